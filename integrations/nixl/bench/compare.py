"""NIXL's UCX backend against the TCPX backend, same agent code, same run (nixlbench-like).

For each backend two agents run in two fresh processes (NIXL reads NIXL_PLUGIN_DIR once per
process, and the wheel's UCX plugin only loads from NIXL's default directory, so UCX runs
without NIXL_PLUGIN_DIR and TCPX with it). The initiator prepares one descriptor-list request
and reposts it back to back (as nixlbench does), WRITE or READ, and reports GB/s (10^9 bytes/s)
of payload. One untimed pass first, then the data of the last WRITE is verified on the target.

    NIXL_PLUGIN_DIR=target/nixl/plugins target/nixl-venv/bin/python \\
        integrations/nixl/bench/compare.py [--ops WRITE,READ] [--iters N] [--json FILE]

All traffic stays on 127.0.0.1 / lo (UCX_TLS=tcp,self UCX_NET_DEVICES=lo for UCX).
Targets from the issue: TCPX >= 3 x UCX at >= 1 MiB blocks, >= 2 x at 16 KiB x 1024 blocks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from harness import Peer, blocks, span  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20

# (label, blocks per request, block size, contiguous?) — contiguous lists model a large
# tensor; the KV-cache shape is many small blocks scattered on the remote side.
WORKLOADS = [
    ("1 x 1 MiB", 1, 1 * MiB),
    ("1 x 16 MiB", 1, 16 * MiB),
    ("1 x 64 MiB", 1, 64 * MiB),
    ("64 x 1 MiB", 64, 1 * MiB),
    ("1024 x 16 KiB", 1024, 16 * KiB),
]


def backend_env(backend, plugin_dir):
    env = {"TCPX_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo",
           "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"}
    if backend == "TCPX":
        env["NIXL_PLUGIN_DIR"] = plugin_dir
    return env


def run_backend(backend, plugin_dir, ops, iters, params):
    env = backend_env(backend, plugin_dir)
    saved = os.environ.pop("NIXL_PLUGIN_DIR", None)  # UCX children must not inherit it
    try:
        init = Peer(f"{backend.lower()}-initiator", backend, params, env)
        target = Peer(f"{backend.lower()}-target", backend, params, env)
    finally:
        if saved is not None:
            os.environ["NIXL_PLUGIN_DIR"] = saved
    rows = []
    try:
        for i, (label, n, bs) in enumerate(WORKLOADS):
            local = blocks(n, bs)
            # Remote blocks scattered (a gap after each) for lists, as KV-cache blocks are.
            remote = blocks(n, bs, stride=bs + (4 * KiB if n > 1 else 0), shuffle_seed=i)
            key = f"w{i}"
            init.call("alloc", key, span(local), 1000 + i)
            target.call("alloc", key, span(remote))
            init.call("add_remote", target.call("metadata"))
            rd = target.call("descs", key, remote)
            it = max(3, min(iters, int(iters * 16 * MiB / (n * bs)) or 3))
            for op in ops:
                gbps = init.call("bench", op, key, local, rd, target.name, it, timeout=600)
                rows.append({"backend": backend, "op": op, "workload": label, "blocks": n,
                             "block_bytes": bs, "iters": it, "gbps": gbps})
                print(f"  {backend:5} {op:5} {label:>14}: {gbps:7.3f} GB/s ({it} iterations)",
                      flush=True)
            # The last WRITE left the initiator's pattern on the target: check it.
            if "WRITE" in ops:
                init.call("fill", key, 1000 + i)
                init.call("xfer", "WRITE", key, local, rd, target.name, b"verify")
                assert target.call("wait_notif", init.name, b"verify", 30)
                bad = target.call("verify", key, remote, 1000 + i, span(local), local)
                if bad:
                    raise SystemExit(f"{backend} {label}: {bad} blocks differ on the target")
    finally:
        init.close()
        target.close()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default="WRITE,READ")
    ap.add_argument("--iters", type=int, default=20, help="iterations at 16 MiB per request (scaled)")
    ap.add_argument("--backends", default="UCX,TCPX")
    ap.add_argument("--channels", default="", help="TCPX channels (default: the library's)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    plugin_dir = os.environ.get("NIXL_PLUGIN_DIR", "")
    if "TCPX" in args.backends and not os.path.exists(os.path.join(plugin_dir, "libplugin_TCPX.so")):
        sys.exit("set NIXL_PLUGIN_DIR to the directory holding libplugin_TCPX.so (cargo xtask nixl)")
    ops = args.ops.split(",")
    rows = []
    t = time.monotonic()
    for backend in args.backends.split(","):
        params = {}
        if backend == "TCPX":
            params = {"control_addr": "127.0.0.1:0"}
            if args.channels:
                params["channels"] = args.channels
        print(f"{backend}:", flush=True)
        rows += run_backend(backend, plugin_dir, ops, args.iters, params)

    print(f"\n{'workload':>14} {'op':5} " + " ".join(f"{b:>9}" for b in args.backends.split(","))
          + "   TCPX/UCX")
    for label, _, _ in WORKLOADS:
        for op in ops:
            vals = {r["backend"]: r["gbps"] for r in rows if r["workload"] == label and r["op"] == op}
            ratio = (vals["TCPX"] / vals["UCX"]) if "TCPX" in vals and vals.get("UCX") else float("nan")
            print(f"{label:>14} {op:5} " + " ".join(f"{vals.get(b, float('nan')):9.3f}"
                                                 for b in args.backends.split(",")) + f"   {ratio:6.2f}x")
    print(f"(GB/s = 10^9 bytes/s of payload; {time.monotonic() - t:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
