"""`transfer` of scattered blocks (default 64 x 16 KiB, UCCL's descriptor API) next to the
same bytes through `writev` / `readv` (64-byte blobs), both verified, on GPU memory.

    python crates/tcpx-py/tests/gpu_descs_bench.py                 # CUDA tensors (torch)
    python crates/tcpx-py/tests/gpu_descs_bench.py --device cpu    # host memory (numpy)

Two endpoints of this process over loopback (TCPX_SOCKET_IFNAME=lo, control on 127.0.0.1):
the target accepts passively and registers a pool of blocks; the initiator moves `--blocks`
blocks picked at random from its pool into (or from) as many blocks picked at random from the
target's pool, so no two neighbours merge. One operation = the whole list: `transfer(conn,
op, local_descs, remote_descs)` + `poll_async`, or `writev_async` / `readv_async` +
`poll_async`. Each method runs `--warmup` operations, then `--iters` timed ones in
`--rounds` rounds interleaved with the other method's; GB/s is 10^9 bytes per second of
wall time over the timed operations; p50 is one operation's submit-to-done time. Before
each round the destination is zeroed, and after it every selected block is compared (and,
for writes, every other block must still be zero).
`--load` keeps the GPU busy from a thread of this process while the figures are taken:
back-to-back fp16 GEMMs (8192 x 8192, one in flight) on a stream of their own, as a serving
process's model runs beside its KV transfers.
Exit status 0: all verified; 1: a mismatch or a failed call; 77: no torch / no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time

for _k, _v in {
    "TCPX_SOCKET_IFNAME": "lo",
    "NCCL_SOCKET_IFNAME": "lo",
    "TCPX_CONTROL_ADDR": "127.0.0.1:0",
}.items():
    os.environ.setdefault(_k, _v)

from tcpx import p2p  # noqa: E402


class Memory:
    """Pools of blocks on the chosen device, behind one small interface."""

    def __init__(self, device: str) -> None:
        self.device = device
        if device == "cuda":
            try:
                import torch
            except ImportError:
                print("skip: torch is not installed (or use --device cpu)")
                sys.exit(77)
            if not torch.cuda.is_available():
                print("skip: no CUDA device (or use --device cpu)")
                sys.exit(77)
            self.torch = torch
        else:
            import numpy as np

            self.np = np

    def zeros(self, n: int):
        if self.device == "cuda":
            return self.torch.zeros(n, dtype=self.torch.uint8, device="cuda:0")
        return self.np.zeros(n, self.np.uint8)

    def random(self, n: int, seed: int):
        if self.device == "cuda":
            g = self.torch.Generator().manual_seed(seed)
            return self.torch.randint(0, 256, (n,), dtype=self.torch.uint8, generator=g).cuda()
        return self.np.random.default_rng(seed).integers(0, 256, n, dtype=self.np.uint8)

    def ptr(self, a) -> int:
        return a.data_ptr() if self.device == "cuda" else a.ctypes.data

    def copy(self, dst, src) -> None:
        if self.device == "cuda":
            dst.copy_(src)
        else:
            dst[:] = src

    def fill(self, a, value: int) -> None:
        if self.device == "cuda":
            a.fill_(value)
        else:
            a[:] = value

    def equal(self, a, b) -> bool:
        if self.device == "cuda":
            return bool(self.torch.equal(a, b))
        return bool(self.np.array_equal(a, b))

    def any(self, a) -> bool:
        return bool(a.any())

    def sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()


class GemmLoad:
    """Back-to-back fp16 GEMMs on a stream of their own, from a thread of this process, one
    in flight at a time (so that a device-wide synchronize waits for one GEMM at most)."""

    def __init__(self, torch) -> None:
        self.torch = torch
        self.stop = threading.Event()
        self.gemms = 0
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        torch = self.torch
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            a = torch.randn(8192, 8192, device="cuda:0", dtype=torch.float16)
            b = torch.randn_like(a)
            while not self.stop.is_set():
                a @ b
                stream.synchronize()
                self.gemms += 1

    def start(self) -> None:
        self.thread.start()
        time.sleep(1.0)  # past cuBLAS's set-up: the GPU is busy when the clock starts

    def finish(self) -> None:
        self.stop.set()
        self.thread.join()


def wait(ep, tid) -> None:
    while True:
        ok, done = ep.poll_async(tid)
        if not ok:
            raise RuntimeError(f"transfer failed: {p2p.last_error()}")
        if done:
            return


def check(ok, what: str) -> None:
    if not ok:
        raise RuntimeError(f"{what}: {p2p.last_error()}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--block-bytes", type=int, default=16 << 10)
    ap.add_argument("--pool-blocks", type=int, default=256)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per method")
    ap.add_argument("--ops", default="write,read")
    ap.add_argument("--json", action="store_true", help="one JSON object per result, no table")
    ap.add_argument("--load", action="store_true", help="GEMMs on the GPU from a thread meanwhile")
    args = ap.parse_args()
    if args.load and args.device != "cuda":
        ap.error("--load needs --device cuda")
    if args.blocks > args.pool_blocks:
        ap.error("--blocks must not exceed --pool-blocks")
    mem = Memory(args.device)
    B, n = args.block_bytes, args.blocks
    rng = random.Random(7)
    t_idx = rng.sample(range(args.pool_blocks), n)
    i_idx = rng.sample(range(args.pool_blocks), n)

    target = p2p.Endpoint(0 if args.device == "cuda" else None)
    init = p2p.Endpoint(0 if args.device == "cuda" else None)
    check(target.start_passive_accept(), "start_passive_accept")
    ok, conn = init.add_remote_endpoint(target.get_metadata())
    check(ok, "add_remote_endpoint")

    t_pool, i_pool = mem.zeros(args.pool_blocks * B), mem.zeros(args.pool_blocks * B)
    t_blocks = [t_pool[j * B : (j + 1) * B] for j in t_idx]
    i_blocks = [i_pool[j * B : (j + 1) * B] for j in i_idx]
    source_data = mem.random(n * B, 11)

    # Descriptor API: the pools first, then the blocks (views: they share the pools'
    # registrations, as UCCL's MR cache would).
    t_base = target.register_memory([t_pool])
    i_base = init.register_memory([i_pool])
    remote = init.deserialize_descs(target.get_serialized_descs(target.register_memory(t_blocks)))
    local = init.register_memory(i_blocks)
    # Blob API: one registration per pool, one blob per block.
    ok, t_mr = target.reg(mem.ptr(t_pool), args.pool_blocks * B)
    check(ok, "reg")
    ok, blobs = target.advertisev([t_mr] * n, [mem.ptr(b) for b in t_blocks], [B] * n, n)
    check(ok, "advertisev")
    ok, i_mr = init.reg(mem.ptr(i_pool), args.pool_blocks * B)
    check(ok, "reg")
    i_ptrs = [mem.ptr(b) for b in i_blocks]

    def prepare(op: str) -> None:
        mem.fill(t_pool, 0)
        mem.fill(i_pool, 0)
        src = i_blocks if op == "write" else t_blocks
        for k, b in enumerate(src):
            mem.copy(b, source_data[k * B : (k + 1) * B])
        mem.sync()

    def verify(op: str) -> bool:
        mem.sync()
        src, dst = (i_blocks, t_blocks) if op == "write" else (t_blocks, i_blocks)
        good = all(mem.equal(d, s) for d, s in zip(dst, src))
        pool, idx = (t_pool, t_idx) if op == "write" else (i_pool, i_idx)
        chosen = set(idx)
        untouched = all(
            not mem.any(pool[j * B : (j + 1) * B]) for j in range(args.pool_blocks) if j not in chosen
        )
        return good and untouched

    def via_transfer(op: str) -> None:
        ok, tid = init.transfer(conn, op, local, remote)
        check(ok, "transfer")
        wait(init, tid)

    def via_vectored(op: str) -> None:
        call = init.writev_async if op == "write" else init.readv_async
        ok, tid = call(conn, [i_mr] * n, i_ptrs, [B] * n, blobs, n)
        check(ok, call.__name__)
        wait(init, tid)

    load = GemmLoad(mem.torch) if args.load else None
    if load:
        load.start()
    results = []
    for op in [o.strip() for o in args.ops.split(",") if o.strip()]:
        if op not in ("write", "read"):
            ap.error(f"--ops: {op!r} is not write or read")
        methods = (("transfer", via_transfer), ("writev" if op == "write" else "readv", via_vectored))
        elapsed = {m: 0.0 for m, _ in methods}
        lat = {m: [] for m, _ in methods}
        verified = {m: True for m, _ in methods}
        for m, run in methods:
            prepare(op)
            for _ in range(args.warmup):
                run(op)
        # Interleaved rounds: a load change on the machine hits both methods alike.
        per_round = max(1, args.iters // args.rounds)
        for _ in range(args.rounds):
            for m, run in methods:
                prepare(op)
                start = time.perf_counter()
                for _ in range(per_round):
                    t0 = time.perf_counter()
                    run(op)
                    lat[m].append(time.perf_counter() - t0)
                elapsed[m] += time.perf_counter() - start
                verified[m] = verified[m] and verify(op)
        for m, _ in methods:
            results.append(
                {
                    "device": args.device,
                    "op": op,
                    "method": m,
                    "blocks": n,
                    "block_bytes": B,
                    "ops": len(lat[m]),
                    "gbps": n * B * len(lat[m]) / elapsed[m] / 1e9,
                    "p50_us": statistics.median(lat[m]) * 1e6,
                    "verified": verified[m],
                }
            )
    if load:
        load.finish()
        for r in results:
            r["load_gemms"] = load.gemms
    for r in results:
        if args.json:
            print(json.dumps(r))
    if not args.json:
        print(
            f"{n} x {B} B blocks, {args.device} memory, {results[0]['ops'] if results else 0} "
            f"operations per method in {args.rounds} interleaved rounds (+{args.warmup} warm-up)"
            + (f"; {load.gemms} GEMMs of 8192^3 meanwhile" if load else "")
        )
        print(f"{'op':6} {'method':9} {'GB/s':>8} {'p50 us':>9}  verified")
        for r in results:
            print(f"{r['op']:6} {r['method']:9} {r['gbps']:8.3f} {r['p50_us']:9.1f}  {r['verified']}")
        by = {(r["op"], r["method"]): r["gbps"] for r in results}
        for op, vec in (("write", "writev"), ("read", "readv")):
            if (op, "transfer") in by and (op, vec) in by:
                print(f"{op}: transfer / {vec} = {by[(op, 'transfer')] / by[(op, vec)]:.2f}")
    init.deregister_memory(local + i_base)
    target.close()
    init.close()
    return 0 if all(r["verified"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
