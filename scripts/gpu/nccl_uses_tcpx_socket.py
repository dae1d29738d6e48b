#!/usr/bin/env python3
"""Real NCCL (inside PyTorch) driving our tcpx-socket plugin: GPU send/recv and all_reduce
between two GPUs of one host, forced onto the network with NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1.

Usage (on a 2-GPU machine): python3 scripts/gpu/nccl_uses_tcpx_socket.py /path/to/libtcpx_socket.so
Prints NCCL's own INIT/NET lines (which network it chose) and PASS/FAIL per check; exits non-zero
on any wrong result.
"""
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank: int, world: int, port: int, results) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dev = torch.device("cuda", rank)
    ok = True
    # send/recv of several sizes, contents checked
    for n in [1, 1000, 1 << 20, 64 << 20]:
        if rank == 0:
            t = torch.arange(n, dtype=torch.int32, device=dev) * 7 + 3
            dist.send(t, dst=1)
        else:
            t = torch.empty(n, dtype=torch.int32, device=dev)
            dist.recv(t, src=0)
            want = torch.arange(n, dtype=torch.int32, device=dev) * 7 + 3
            good = bool(torch.equal(t, want))
            ok &= good
            print(f"[rank1] send/recv {n * 4} bytes: {'PASS' if good else 'FAIL'}", flush=True)
    # all_reduce, contents checked
    for n in [1024, 16 << 20]:
        t = torch.full((n,), float(rank + 1), device=dev)
        dist.all_reduce(t)
        good = bool(torch.all(t == 3.0))
        ok &= good
        if rank == 0:
            print(f"[rank0] all_reduce {n * 4} bytes: {'PASS' if good else 'FAIL'}", flush=True)
    # throughput of one large send/recv (informative)
    n = 256 << 20
    buf = torch.ones(n // 4, dtype=torch.float32, device=dev)
    for _ in range(2):
        (dist.send(buf, 1) if rank == 0 else dist.recv(buf, 0))
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    iters = 5
    for _ in range(iters):
        (dist.send(buf, 1) if rank == 0 else dist.recv(buf, 0))
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    if rank == 1:
        print(f"[rank1] NCCL+tcpx-socket send/recv 256 MiB: {iters * n / dt / 1e9:.2f} GB/s", flush=True)
    results[rank] = ok
    dist.destroy_process_group()


def main() -> int:
    plugin = os.path.abspath(sys.argv[1])
    os.environ.update(
        NCCL_NET_PLUGIN=plugin,
        NCCL_P2P_DISABLE="1",
        NCCL_SHM_DISABLE="1",
        NCCL_NVLS_ENABLE="0",
        NCCL_DEBUG="INFO",
        NCCL_DEBUG_SUBSYS="INIT,NET",
        NCCL_SOCKET_IFNAME="lo",
        TCPX_SOCKET_IFNAME="lo",
    )
    mp_ctx = mp.get_context("spawn")
    results = mp_ctx.Manager().dict()
    port = 29511
    mp.spawn(worker, args=(2, port, results), nprocs=2, join=True)
    ok = all(results.get(r, False) for r in range(2))
    print("NCCL over tcpx-socket:", "PASS" if ok else "FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
