"""Packs what the VRAM agent test and benchmarks need on a GPU machine without network access
into one small tarball: NIXL's Python agent and the shared libraries it really loads (the ELF
NEEDED closure of its extension modules, not the wheel's storage plugins or nixl_ep), plus
numpy, for a given Python version; with --with-ucx also NIXL's UCX plugin, its closure and
UCX's CUDA transport modules (for the UCX side of compare.py / recreate.py).

    target/nixl/venv/bin/python integrations/nixl/tests/gpu_bundle.py \\
        [--python-version 3.12] [--wheel nixl-cu13] [--with-ucx]

writes target/nixl/gpu/site.tar.gz and copies target/nixl/plugins and target/release/tcpx-bench
(if built) next to it, without debug info. On the GPU
machine (CUDA 13: --wheel nixl-cu13, whose UCX registers VRAM there; nixl-cu12's UCX sees VRAM
as host memory):

    mkdir -p /tmp/nixl-site && tar xzf target/nixl/gpu/site.tar.gz -C /tmp/nixl-site
    PYTHONPATH=/tmp/nixl-site TCPX_NIXL_MODULE=nixl_cu13 NIXL_PLUGIN_DIR=$PWD/target/nixl/gpu/plugins \\
        TCPX_SOCKET_IFNAME=lo python3.12 integrations/nixl/tests/test_agents.py vram
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def needed(path):
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    return [line.split("[", 1)[1].split("]", 1)[0] for line in out.splitlines() if "(NEEDED)" in line]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--python-version", default="3.12")
    ap.add_argument("--out", default=os.path.join(ROOT, "target/nixl/gpu"))
    ap.add_argument("--wheel", default="nixl-cu12", help="nixl-cu12 or nixl-cu13 (1.5.1)")
    ap.add_argument("--with-ucx", action="store_true", help="also NIXL's UCX plugin and UCX")
    args = ap.parse_args()
    mod = args.wheel.replace("-", "_")
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        wheels = os.path.join(tmp, "wheels")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             "--python-version", args.python_version, "--platform", "manylinux_2_28_x86_64",
             f"{args.wheel}==1.5.1", "numpy", "-d", wheels],
            check=True,
        )
        site = os.path.join(tmp, "site")
        for w in os.listdir(wheels):
            with zipfile.ZipFile(os.path.join(wheels, w)) as z:
                z.extractall(site)
        # Keep NIXL's extension modules and what they load, transitively.
        libdirs = [f".{mod}.mesonpy.libs", f"{mod}.libs"]
        index = {}
        for d in libdirs:
            for f in os.listdir(os.path.join(site, d)):
                p = os.path.join(d, f)
                if os.path.isfile(os.path.join(site, p)):
                    index[f] = p
        keep = set()
        todo = [os.path.join(mod, f) for f in os.listdir(os.path.join(site, mod))
                if f.endswith(".so")]
        if args.with_ucx:
            # The UCX plugin NIXL dlopens, and UCX's own modules it dlopens (cuda_copy lives in
            # ucx/libuct_cuda; tcp and self are in libuct itself).
            todo.append(os.path.join(libdirs[0], "plugins", "libplugin_UCX.so"))
            ucx = os.path.join(libdirs[1], "ucx")
            todo += [os.path.join(ucx, f) for f in os.listdir(os.path.join(site, ucx))
                     if ".so" in f and any(k in f for k in ("cuda", "cma"))]
        while todo:
            rel = todo.pop()
            if rel in keep:
                continue
            keep.add(rel)
            todo += [index[n] for n in needed(os.path.join(site, rel)) if n in index]
        out = os.path.join(args.out, "site.tar.gz")
        with tarfile.open(out, "w:gz") as tar:
            for top in os.listdir(site):
                full = os.path.join(site, top)
                if top in libdirs:
                    for rel in sorted(k for k in keep if k.startswith(top + os.sep)):
                        tar.add(os.path.join(site, rel), rel)
                elif top.startswith(mod) and top.endswith(".dist-info"):
                    tar.add(full, top)
                elif top == mod or top.startswith("numpy"):
                    tar.add(full, top)
    plugins = os.path.join(ROOT, "target/nixl/plugins")
    if os.path.isdir(plugins):
        shutil.copytree(plugins, os.path.join(args.out, "plugins"), dirs_exist_ok=True)
    # tcpx-bench (compare.py's tcpx-without-NIXL figures) rides along; debug info stripped from
    # what is carried, so that everything fits the device machine's transfer limit.
    bench = os.path.join(ROOT, "target/release/tcpx-bench")
    if os.path.exists(bench):
        shutil.copy2(bench, os.path.join(args.out, "tcpx-bench"))
    for f in ["tcpx-bench", "plugins/libtcpx.so", "plugins/libplugin_TCPX.so"]:
        path = os.path.join(args.out, f)
        if os.path.exists(path):
            subprocess.run(["strip", "--strip-debug", path], check=False)
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(args.out) for f in fs)
    print(f"{out}: {os.path.getsize(out) / 2**20:.1f} MiB; {args.out} in all: {total / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
