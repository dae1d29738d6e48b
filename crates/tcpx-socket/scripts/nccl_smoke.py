"""Real NCCL (PyTorch's) driving tcpx-socket: all_reduce correctness and bandwidth over loopback.

Needs two GPUs on one host. NCCL is forced onto the network (no P2P, no SHM) and, by default,
onto our plugin by name, so a silent fallback to NCCL's own Socket transport fails loudly:

  NCCL_NET_PLUGIN=$PWD/target/release/libtcpx_socket.so NCCL_NET=tcpx-socket \
  NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 TCPX_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo \
  torchrun --nproc_per_node=2 crates/tcpx-socket/scripts/nccl_smoke.py

Run it again with NCCL_NET=Socket (and no plugin) for NCCL's built-in transport as a baseline.
"""
import os
import time

import torch
import torch.distributed as dist


def main():
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    expect = world * (world + 1) / 2
    for n in [1, 1000, 1 << 20, (64 << 20) + 3]:
        x = torch.full((n,), float(rank + 1), device="cuda")
        dist.all_reduce(x)
        torch.cuda.synchronize()
        assert torch.all(x == expect), f"all_reduce of {n} floats gave wrong values"
    nbytes = 256 << 20
    x = torch.ones(nbytes // 4, device="cuda")
    for _ in range(3):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    iters = 10
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / iters
    algbw = nbytes / dt / 1e9
    busbw = algbw * 2 * (world - 1) / world
    if rank == 0:
        print(
            f"NET={os.environ.get('NCCL_NET', '?')} all_reduce 256 MiB: {dt * 1e3:.1f} ms, "
            f"algbw {algbw:.2f} GB/s, busbw {busbw:.2f} GB/s; correctness checks passed",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
