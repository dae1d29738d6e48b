"""Packs what the VRAM agent test needs on a GPU machine without network access into one
small tarball: NIXL's Python agent and the shared libraries it really loads (the ELF NEEDED
closure of its extension modules, not the wheel's storage plugins, UCX transports or nixl_ep),
plus numpy, for a given Python version.

    target/nixl/venv/bin/python integrations/nixl/tests/gpu_bundle.py [--python-version 3.12]

writes target/nixl/gpu/site.tar.gz (and copies target/nixl/plugins next to it). On the GPU
machine:

    mkdir -p /tmp/nixl-site && tar xzf target/nixl/gpu/site.tar.gz -C /tmp/nixl-site
    PYTHONPATH=/tmp/nixl-site NIXL_PLUGIN_DIR=$PWD/target/nixl/gpu/plugins TCPX_SOCKET_IFNAME=lo \\
        python3.12 integrations/nixl/tests/test_agents.py vram
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
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        wheels = os.path.join(tmp, "wheels")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             "--python-version", args.python_version, "--platform", "manylinux_2_28_x86_64",
             "nixl-cu12==1.5.1", "numpy", "-d", wheels],
            check=True,
        )
        site = os.path.join(tmp, "site")
        for w in os.listdir(wheels):
            with zipfile.ZipFile(os.path.join(wheels, w)) as z:
                z.extractall(site)
        # Keep NIXL's extension modules and what they load, transitively.
        libdirs = [".nixl_cu12.mesonpy.libs", "nixl_cu12.libs"]
        index = {}
        for d in libdirs:
            for f in os.listdir(os.path.join(site, d)):
                p = os.path.join(d, f)
                if os.path.isfile(os.path.join(site, p)):
                    index[f] = p
        keep = set()
        todo = [os.path.join("nixl_cu12", f) for f in os.listdir(os.path.join(site, "nixl_cu12"))
                if f.endswith(".so")]
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
                elif top.startswith("nixl_cu12") and top.endswith(".dist-info"):
                    tar.add(full, top)
                elif top == "nixl_cu12" or top.startswith("numpy"):
                    tar.add(full, top)
    plugins = os.path.join(ROOT, "target/nixl/plugins")
    if os.path.isdir(plugins):
        shutil.copytree(plugins, os.path.join(args.out, "plugins"), dirs_exist_ok=True)
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(args.out) for f in fs)
    print(f"{out}: {os.path.getsize(out) / 2**20:.1f} MiB; {args.out} in all: {total / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
