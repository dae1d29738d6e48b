#!/usr/bin/env python3
"""NCCL's own Socket transport, GPU to GPU over loopback: the P2 baseline of tcpx-bench
(docs: /work/shared/design/PERFORMANCE.md, target P2 >= 3 x NCCL Socket tuned).

Two ranks (GPU 0 and GPU 1 of this host) exchange 256 MiB with send/recv through NCCL forced
onto its Socket transport over `lo` (NCCL_NET=Socket, NCCL_P2P_DISABLE=1, NCCL_SHM_DISABLE=1,
NCCL_SOCKET_IFNAME=lo), once with NCCL's defaults and once tuned (NCCL_SOCKET_NTHREADS=4
NCCL_NSOCKS_PERTHREAD=4). Prints GB/s (10^9 bytes/s, median of the repetitions) and one
machine-readable line per configuration:
    RESULT nccl_socket_<default|tuned>_gbps=<GB/s> bytes=<n>

Usage: python3 scripts/gpu/nccl_socket_baseline.py [--mib 256] [--iters 5] [--reps 3]
       [--only default|tuned]
With fewer than two GPUs (or no PyTorch / CUDA) it says it needs two and exits 0.
"""
import argparse
import os
import statistics
import sys
import time


def worker(rank: int, world: int, port: int, nbytes: int, iters: int, reps: int, results) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dev = torch.device("cuda", rank)
    n = nbytes // 4
    if rank == 0:
        buf = torch.arange(n, dtype=torch.int32, device=dev)
    else:
        buf = torch.zeros(n, dtype=torch.int32, device=dev)

    def once() -> None:
        if rank == 0:
            dist.send(buf, dst=1)
        else:
            dist.recv(buf, src=0)

    for _ in range(2):  # warm-up: connection set-up, buffers
        once()
    torch.cuda.synchronize()
    ok = True
    if rank == 1:
        ok = bool(torch.equal(buf, torch.arange(n, dtype=torch.int32, device=dev)))
    rates = []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            once()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        rates.append(iters * nbytes / dt / 1e9)
    results[rank] = (ok, statistics.median(rates))
    dist.destroy_process_group()


def run(name: str, extra_env: dict, args, port: int) -> int:
    import torch.multiprocessing as mp

    env = dict(
        NCCL_NET="Socket",
        NCCL_P2P_DISABLE="1",
        NCCL_SHM_DISABLE="1",
        NCCL_NVLS_ENABLE="0",
        NCCL_SOCKET_IFNAME="lo",
        NCCL_DEBUG="WARN",
    )
    env.update(extra_env)
    for key in ("NCCL_NET_PLUGIN", "NCCL_SOCKET_NTHREADS", "NCCL_NSOCKS_PERTHREAD"):
        os.environ.pop(key, None)
    os.environ.update(env)
    nbytes = args.mib << 20
    ctx = mp.get_context("spawn")
    results = ctx.Manager().dict()
    mp.spawn(worker, args=(2, port, nbytes, args.iters, args.reps, results), nprocs=2, join=True)
    ok, gbps = results.get(1, (False, 0.0))
    knobs = " ".join(f"{k}={v}" for k, v in extra_env.items()) or "NCCL defaults"
    print(f"NCCL Socket GPU0->GPU1 {args.mib} MiB ({knobs}): {gbps:.2f} GB/s, data {'ok' if ok else 'WRONG'}", flush=True)
    print(f"RESULT nccl_socket_{name}_gbps={gbps:.3f} bytes={nbytes}", flush=True)
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--only", choices=["default", "tuned"])
    args = parser.parse_args()
    try:
        import torch
    except ImportError as e:
        print(f"skipped: the NCCL baseline needs PyTorch with CUDA ({e}); it needs two GPUs")
        return 0
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        print(f"skipped: the NCCL Socket baseline needs two GPUs, this machine has {count}")
        return 0
    configs = [("default", {}), ("tuned", {"NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "4"})]
    rc = 0
    for i, (name, extra) in enumerate(configs):
        if args.only and name != args.only:
            continue
        rc |= run(name, extra, args, 29611 + i)
    return rc


if __name__ == "__main__":
    sys.exit(main())
