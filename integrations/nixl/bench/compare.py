"""NIXL's UCX backend against the TCPX backend, same agent code, same run, plus the same bytes
through `tcpx-bench server/client` (tcpx without NIXL) with the same channels.

For each backend two agents run in two fresh processes (NIXL reads NIXL_PLUGIN_DIR once per
process, and the wheel's UCX plugin only loads from NIXL's default directory, so UCX runs
without NIXL_PLUGIN_DIR and TCPX with it). The initiator prepares one descriptor-list request
and reposts it back to back (as nixlbench and vLLM's connector do), WRITE or READ; GB/s are
10^9 bytes/s of payload. Two tables:

- large blocks: one block of 1 MiB, 16 MiB or 64 MiB per transfer, against `tcpx-bench
  server/client` moving the same message sizes over the same channels, one message in flight
  (`--depth 1`, like the agents' loop), and that tool's in-run raw-TCP baseline;
- KV lists (vLLM's NixlConnector shape): 1024 x 16 KiB, 512 x 64 KiB, 64 x 1 MiB blocks
  scattered on both sides (a gap after each block, shuffled), a notification with every
  transfer (the target counts them all), the first transfer of each list on its own.

The data of the last WRITE of every workload is verified on the target.

    NIXL_PLUGIN_DIR=target/nixl/plugins target/nixl/venv/bin/python \\
        integrations/nixl/bench/compare.py --tcpx-bench target/release/tcpx-bench \\
        [--memory host|cuda] [--channels 4] [--ops WRITE,READ] [--iters N] [--json FILE]

All traffic stays on 127.0.0.1 / lo: UCX with UCX_TLS=tcp,self (tcp,cuda_copy,self for
--memory cuda) and UCX_NET_DEVICES=lo; TCPX with TCPX_SOCKET_IFNAME=lo and control listeners on
127.0.0.1. `--nixl-module` picks the NIXL wheel (nixl_cu12 by default; nixl_cu13 on CUDA 13,
whose UCX is the one that registers VRAM there).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from harness import Peer, blocks, cuda_available, span, ucx_tls  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20

LARGE = [("1 x 1 MiB", 1, 1 * MiB), ("1 x 16 MiB", 1, 16 * MiB), ("1 x 64 MiB", 1, 64 * MiB)]
KV = [("1024 x 16 KiB", 1024, 16 * KiB), ("512 x 64 KiB", 512, 64 * KiB), ("64 x 1 MiB", 64, 1 * MiB)]
GAP = 4 * KiB  # after every scattered block


def backend_env(backend, plugin_dir, memory, module):
    env = {"TCPX_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo",
           "UCX_TLS": ucx_tls(memory == "cuda"),
           "UCX_NET_DEVICES": "lo", "TCPX_NIXL_MODULE": module}
    if backend == "TCPX":
        env["NIXL_PLUGIN_DIR"] = plugin_dir
    return env


def iterations(iters, total):
    """`iters` at 16 MiB per transfer, scaled to the transfer's size: as many bytes at every
    size (320 transfers of 1 MiB for the default 20), at least 3. (It used to be capped at
    `iters`, so 1 MiB ran 20 transfers, 2 ms in all, where one scheduler hiccup moved the
    figure by a third.)"""
    return max(3, int(iters * 16 * MiB / total))


def run_backend(backend, args, plugin_dir, params):
    env = backend_env(backend, plugin_dir, args.memory, args.nixl_module)
    mem = "VRAM" if args.memory == "cuda" else "DRAM"
    saved = os.environ.pop("NIXL_PLUGIN_DIR", None)  # UCX children must not inherit it
    try:
        init = Peer(f"{backend.lower()}-initiator", backend, params, env, mem=mem)
        target = Peer(f"{backend.lower()}-target", backend, params, env, mem=mem)
    finally:
        if saved is not None:
            os.environ["NIXL_PLUGIN_DIR"] = saved
    rows = []
    try:
        work = [("large", w) for w in LARGE if "large" in args.workloads] + \
            [("kv", w) for w in KV if "kv" in args.workloads]
        for i, (kind, (label, n, bs)) in enumerate(work):
            if kind == "large":
                local, remote = blocks(n, bs), blocks(n, bs)
            else:
                local = blocks(n, bs, stride=bs + GAP, shuffle_seed=2 * i)
                remote = blocks(n, bs, stride=bs + GAP, shuffle_seed=2 * i + 1)
            key = f"w{i}"
            init.call("alloc", key, span(local), 1000 + i)
            target.call("alloc", key, span(remote))
            init.call("add_remote", target.call("metadata"))
            rd = target.call("descs", key, remote)
            it = iterations(args.iters, n * bs)
            for op in args.ops:
                notif = f"{label} {op}".encode() if kind == "kv" else b""
                r = init.call("bench", op, key, local, rd, target.name, it, 2, notif, timeout=900)
                if notif:
                    got = target.call("count_notifs", init.name, notif, r["posted"], 60)
                    if got != r["posted"]:
                        raise SystemExit(f"{backend} {label} {op}: {got} of {r['posted']} "
                                         "notifications arrived")
                rows.append({"backend": backend, "kind": kind, "op": op, "workload": label,
                             "blocks": n, "block_bytes": bs, "iters": it, **r})
                print(f"  {backend:5} {op:5} {label:>14}: {r['gbps']:7.3f} GB/s, first "
                      f"{r['first_ms']:8.2f} ms, p50 {r['p50_ms']:8.3f} ms, p99 {r['p99_ms']:8.3f} ms, "
                      f"max {r['max_ms']:8.3f} ms ({it} transfers"
                      f"{', each notified' if notif else ''})", flush=True)
            # The last WRITE left the initiator's pattern on the target: check it.
            if "WRITE" in args.ops:
                init.call("fill", key, 1000 + i)
                init.call("xfer", "WRITE", key, local, rd, target.name, b"verify")
                if not target.call("wait_notif", init.name, b"verify", 30):
                    raise SystemExit(f"{backend} {label}: no notification for the checked WRITE")
                bad = target.call("verify", key, remote, 1000 + i, span(local), local)
                if bad:
                    raise SystemExit(f"{backend} {label}: {bad} blocks differ on the target")
            init.call("free", key)
    finally:
        init.close()
        target.close()
    return rows


def free_port_pair():
    """A port p on 127.0.0.1 with p + 1 free too (tcpx-bench's baseline listens there)."""
    for _ in range(100):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            p = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", p + 1))
                except OSError:
                    continue
            return p
    raise RuntimeError("no two neighbouring free ports on 127.0.0.1")


def run_tcpx_bench(args):
    """tcpx-bench server + client over 127.0.0.1, the LARGE sizes, one message in flight:
    {bytes: row} (gbps, baseline_gbps = raw TCP with as many streams as channels)."""
    sizes = ",".join(f"{bs // MiB}MiB" for _, _, bs in LARGE)
    common = ["--sizes", sizes, "--depth", "1", "--iters", str(args.iters), "--memory", args.memory,
              "--timeout", "120"]
    if args.channels:
        common += ["--channels", args.channels]
    env = dict(os.environ, TCPX_SOCKET_IFNAME="lo", NCCL_SOCKET_IFNAME="lo")
    port = free_port_pair()
    server = subprocess.Popen([args.tcpx_bench, "server", "--bind", f"127.0.0.1:{port}"] + common,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        hexmd, seen = None, []
        deadline = time.monotonic() + 60
        while hexmd is None and time.monotonic() < deadline:
            line = server.stdout.readline()
            if not line:
                break
            seen.append(line)
            if line.startswith("TCPX-BENCH-METADATA"):
                hexmd = line.split()[-1]
        if hexmd is None:
            raise RuntimeError("tcpx-bench server printed no metadata:\n" + "".join(seen))
        with tempfile.NamedTemporaryFile(suffix=".jsonl") as out:
            client = subprocess.run([args.tcpx_bench, "client", "--peer", hexmd, "--json", out.name]
                                    + common, capture_output=True, text=True, env=env, timeout=900)
            if client.returncode != 0:
                raise RuntimeError(f"tcpx-bench client failed ({client.returncode}):\n"
                                   f"{client.stdout}{client.stderr}")
            rows = [json.loads(line) for line in open(out.name) if line.strip()]
        server.wait(60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
    return {r["bytes"]: r for r in rows}


def fmt(v, spec="9.3f"):
    return format(v, spec) if isinstance(v, (int, float)) else f"{'-':>9}"


def report(rows, bench, args, backends):
    get = lambda b, label, op: next((r for r in rows if r["backend"] == b and r["workload"] == label
                                     and r["op"] == op), None)
    print(f"\nLarge blocks, {args.memory} memory, one block per transfer, GB/s "
          "(tcpx-bench: two-sided, same channels, one message in flight; raw TCP: its baseline)")
    print(f"{'workload':>14} {'op':5} " + " ".join(f"{b:>9}" for b in backends)
          + f" {'tcpx-bench':>10} {'raw TCP':>9} {'TCPX/UCX':>9} {'TCPX/bench':>10}")
    for label, _, bs in LARGE:
        for op in args.ops:
            vals = {b: (get(b, label, op) or {}).get("gbps") for b in backends}
            tb = bench.get(bs, {})
            t, u, x = vals.get("TCPX"), vals.get("UCX"), tb.get("gbps")
            print(f"{label:>14} {op:5} " + " ".join(fmt(vals[b]) for b in backends)
                  + f" {fmt(x, '10.3f')} {fmt(tb.get('baseline_gbps'))}"
                  + f" {fmt(t / u if t and u else None, '8.2f')}x"
                  + f" {fmt(t / x if t and x else None, '9.2f')}x")
    if "kv" not in args.workloads:
        return
    print(f"\nKV lists, {args.memory} memory, blocks scattered on both sides, a notification with "
          "every transfer: GB/s, first transfer ms, median transfer ms")
    print(f"{'workload':>14} {'op':5} " + " ".join(f"{b + ' GB/s':>10} {'first':>8} {'p50':>7}"
                                                  for b in backends) + f" {'TCPX/UCX':>9}")
    for label, _, _ in KV:
        for op in args.ops:
            line = f"{label:>14} {op:5} "
            vals = {}
            for b in backends:
                r = get(b, label, op) or {}
                vals[b] = r.get("gbps")
                line += f"{fmt(r.get('gbps'), '10.3f')} {fmt(r.get('first_ms'), '8.2f')} " \
                        f"{fmt(r.get('p50_ms'), '7.3f')} "
            t, u = vals.get("TCPX"), vals.get("UCX")
            print(line + f"{fmt(t / u if t and u else None, '8.2f')}x")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default="WRITE,READ")
    ap.add_argument("--iters", type=int, default=20, help="transfers at 16 MiB per transfer (scaled)")
    ap.add_argument("--backends", default="UCX,TCPX")
    ap.add_argument("--workloads", default="large,kv",
                    help="which rows: large (one block per transfer), kv (block lists), or both")
    ap.add_argument("--channels", default="4", help="TCPX channels, also tcpx-bench's")
    ap.add_argument("--memory", default="host", choices=["host", "cuda"])
    ap.add_argument("--tcpx-bench", help="tcpx-bench binary: adds its server/client figures")
    ap.add_argument("--nixl-module", default=os.environ.get("TCPX_NIXL_MODULE", "nixl_cu12"),
                    help="the NIXL Python module (nixl_cu12, nixl_cu13)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    args.ops = args.ops.split(",")
    args.workloads = args.workloads.split(",")
    if not args.workloads or any(w not in ("large", "kv") for w in args.workloads):
        sys.exit("--workloads takes large, kv or large,kv")
    backends = args.backends.split(",")
    plugin_dir = os.environ.get("NIXL_PLUGIN_DIR", "")
    if "TCPX" in backends and not os.path.exists(os.path.join(plugin_dir, "libplugin_TCPX.so")):
        sys.exit("set NIXL_PLUGIN_DIR to the directory holding libplugin_TCPX.so (cargo xtask nixl)")
    if args.memory == "cuda" and not cuda_available():
        print("SKIP: --memory cuda needs a CUDA driver and device")
        return
    ucx = "UCX_TLS=" + ucx_tls(args.memory == "cuda")
    print(f"{args.memory} memory; TCPX: {args.channels} channels, built-in plugin unless "
          f"TCPX_PLUGIN_PATH says otherwise; UCX: NIXL's UCX plugin from {args.nixl_module}, "
          f"{ucx} UCX_NET_DEVICES=lo", flush=True)
    t = time.monotonic()
    rows = []
    for backend in backends:
        params = {}
        if backend == "TCPX":
            params = {"control_addr": "127.0.0.1:0", "channels": args.channels}
        print(f"{backend}:", flush=True)
        rows += run_backend(backend, args, plugin_dir, params)
    bench = {}
    if args.tcpx_bench:
        print("tcpx-bench server/client:", flush=True)
        bench = run_tcpx_bench(args)
        for b, r in sorted(bench.items()):
            print(f"  {b // MiB:4} MiB: {r['gbps']:7.3f} GB/s, raw TCP {r.get('baseline_gbps') or 0:7.3f}",
                  flush=True)
    report(rows, bench, args, backends)
    print(f"(GB/s = 10^9 bytes/s of payload; {time.monotonic() - t:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"nixl": rows, "tcpx_bench": list(bench.values())}, f, indent=1)


if __name__ == "__main__":
    main()
