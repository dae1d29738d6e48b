"""Same-host CUDA IPC through `tcpx.p2p`, in the shape of UCCL's
p2p/tests/test_engine_onesided_ipc.py (written for tcpx), then the benchmark of issue 21:

    python crates/tcpx-py/tests/uccl_ipc_gpu.py [--gpus 0,0] [--json]

Two processes (multiprocessing *spawn*: the parent never touches CUDA), each with its own
`p2p.Endpoint(local_gpu_idx=...)`. The server (rank 0) sends its `get_metadata()`, then
`accept_local()`; the client (rank 1) reads the server's GPU bus id with
`parse_metadata` and calls `connect_local(remote_gpu_bdf=...)`. Then, with client buffers
on its GPU and in pinned host memory: write_ipc, write_ipc_async, read_ipc, read_ipc_async,
writev_ipc, readv_ipc (+ async), each verified by the side that did not move the bytes
(distinct values per iov); the descriptor API (`register_memory`, `get_serialized_descs`,
`transfer` "write" / "read") over the same local connection, verified; refusals
(an altered info blob, a range past the advertised one) give ok=False, never a crash.

Benchmark (client GPU memory to server GPU memory): `write_ipc` of 256 MiB (best of
`--iters`) next to a device-to-device copy of the same size in the client process
(`torch` `copy_`, i.e. cudaMemcpyAsync D2D, between the same two GPUs), and the 4 KiB
`write_ipc` p50 / p99 in µs. Exit status 0: all passed; 1: a failure; 77: no torch / GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import sys
import time
import traceback

for _k, _v in {
    "TCPX_SOCKET_IFNAME": "lo",
    "NCCL_SOCKET_IFNAME": "lo",
    "TCPX_CONTROL_ADDR": "127.0.0.1:0",
    "TCPX_TIMEOUT_MS": "30000",
    "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
}.items():
    os.environ.setdefault(_k, _v)

import multiprocessing as mp  # noqa: E402

try:
    import torch  # noqa: E402
except ImportError:
    print("skip: torch is not installed")
    sys.exit(77)

SPAWN = mp.get_context("spawn")
NUM_IOVS = 4
ELEMS = 1024  # float32 per buffer: 4 KiB
BIG = 256 << 20


def wait(ep, tid) -> bool:
    while True:
        ok, done = ep.poll_async(tid)
        if not ok or done:
            return ok


def server(gpu: int, pipe) -> None:
    from tcpx import p2p

    torch.cuda.set_device(gpu)
    dev = f"cuda:{gpu}"
    ep = p2p.Endpoint(local_gpu_idx=gpu)
    pipe.send(bytes(ep.get_metadata()))
    ok, peer_bus, conn = ep.accept_local()
    assert ok, p2p.last_error()
    pipe.send(("accepted", peer_bus))
    while True:
        cmd = pipe.recv()
        name = cmd[0]
        if name == "done":
            break
        if name == "dst":  # zeroed destinations, advertised
            bufs = [torch.zeros(ELEMS, dtype=torch.float32, device=dev) for _ in range(cmd[1])]
            ok, infos = ep.advertisev_ipc(conn, [b.data_ptr() for b in bufs], [ELEMS * 4] * len(bufs))
            assert ok, p2p.last_error()
            pipe.send([bytes(i) for i in infos])
        elif name == "check":  # destination i must hold value i+1
            torch.cuda.synchronize()
            pipe.send(all(bool((b == float(i + 1)).all()) for i, b in enumerate(bufs)))
        elif name == "src":  # sources with values 1..n, advertised
            bufs = [torch.full((ELEMS,), float(i + 1), device=dev) for i in range(cmd[1])]
            torch.cuda.synchronize()
            ok, infos = ep.advertisev_ipc(conn, [b.data_ptr() for b in bufs], [ELEMS * 4] * len(bufs))
            assert ok, p2p.last_error()
            pipe.send([bytes(i) for i in infos])
        elif name == "descs":  # descriptor API: one pattern tensor and one zero tensor
            n = cmd[1]
            g = torch.Generator().manual_seed(5)
            src = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(dev)
            dst = torch.zeros(n, dtype=torch.uint8, device=dev)
            descs = ep.register_memory([src, dst])
            pipe.send(ep.get_serialized_descs(descs))
        elif name == "descs_check":
            torch.cuda.synchronize()
            g = torch.Generator().manual_seed(6)
            want = torch.randint(0, 256, (cmd[1],), dtype=torch.uint8, generator=g).to(dev)
            pipe.send(bool(torch.equal(dst, want)))
        elif name == "big":  # the benchmark's destination
            big = torch.zeros(cmd[1], dtype=torch.uint8, device=dev)
            ok, info = ep.advertise_ipc(conn, big.data_ptr(), cmd[1])
            assert ok, p2p.last_error()
            pipe.send(bytes(info))
        elif name == "big_check":
            torch.cuda.synchronize()
            pipe.send(int(big[-1].item()))
    ep.close()


def client(gpu: int, pipe, args) -> dict:
    from tcpx import p2p

    torch.cuda.set_device(gpu)
    dev = f"cuda:{gpu}"
    ep = p2p.Endpoint(local_gpu_idx=gpu)
    meta = pipe.recv()
    _, _, server_bus = p2p.Endpoint.parse_metadata(meta)
    assert ":" in server_bus, f"server metadata has no GPU bus id: {server_bus!r}"
    ok, conn = ep.connect_local(remote_gpu_bdf=server_bus)
    assert ok, p2p.last_error()
    tag, peer_bus = pipe.recv()
    assert tag == "accepted" and ":" in peer_bus
    report = {"server_bus": server_bus, "client_bus": peer_bus, "checks": []}

    def ask(*cmd):
        pipe.send(cmd)
        return pipe.recv()

    def buf(v: float, cpu: bool):
        if cpu:
            return torch.full((ELEMS,), v, dtype=torch.float32).pin_memory()
        return torch.full((ELEMS,), v, dtype=torch.float32, device=dev)

    for cpu in (False, True):
        mode = "cpu" if cpu else "gpu"
        for op, n, sync in (("write", 1, True), ("write", 1, False), ("write", NUM_IOVS, True),
                            ("write", NUM_IOVS, False)):
            infos = ask("dst", n)
            srcs = [buf(float(i + 1), cpu) for i in range(n)]
            torch.cuda.synchronize()
            if n == 1 and sync:
                ok = ep.write_ipc(conn, srcs[0].data_ptr(), ELEMS * 4, infos[0])
            elif n == 1:
                ok, tid = ep.write_ipc_async(conn, srcs[0].data_ptr(), ELEMS * 4, infos[0])
                ok = ok and wait(ep, tid)
            elif sync:
                ok = ep.writev_ipc(conn, [s.data_ptr() for s in srcs], [ELEMS * 4] * n, infos)
            else:
                ok, tid = ep.writev_ipc_async(conn, [s.data_ptr() for s in srcs], [ELEMS * 4] * n, infos)
                ok = ok and wait(ep, tid)
            assert ok, (mode, n, sync, p2p.last_error())
            assert ask("check"), f"write {mode} n={n} sync={sync}: destination mismatch"
            report["checks"].append(f"write{'v' if n > 1 else ''}_ipc{'' if sync else '_async'} [{mode}]")
        for n, sync in ((1, True), (1, False), (NUM_IOVS, True), (NUM_IOVS, False)):
            infos = ask("src", n)
            dsts = [buf(0.0, cpu) for _ in range(n)]
            torch.cuda.synchronize()
            if n == 1 and sync:
                ok = ep.read_ipc(conn, dsts[0].data_ptr(), ELEMS * 4, infos[0])
            elif n == 1:
                ok, tid = ep.read_ipc_async(conn, dsts[0].data_ptr(), ELEMS * 4, infos[0])
                ok = ok and wait(ep, tid)
            elif sync:
                ok = ep.readv_ipc(conn, [d.data_ptr() for d in dsts], [ELEMS * 4] * n, infos)
            else:
                ok, tid = ep.readv_ipc_async(conn, [d.data_ptr() for d in dsts], [ELEMS * 4] * n, infos)
                ok = ok and wait(ep, tid)
            assert ok, (mode, n, sync, p2p.last_error())
            for i, d in enumerate(dsts):
                assert bool((d == float(i + 1)).all()), f"read {mode} n={n} iov {i}: mismatch"
            report["checks"].append(f"read{'v' if n > 1 else ''}_ipc{'' if sync else '_async'} [{mode}]")

    # Refusals: an altered key, a range past the advertised one.
    infos = ask("dst", 1)
    src = buf(1.0, False)
    bad = bytearray(infos[0])
    bad[120] ^= 0xFF
    assert ep.write_ipc(conn, src.data_ptr(), ELEMS * 4, bytes(bad)) is False
    report["altered_key"] = p2p.last_error()
    big_src = torch.zeros(2 * ELEMS, dtype=torch.float32, device=dev)
    assert ep.write_ipc(conn, big_src.data_ptr(), ELEMS * 8, infos[0]) is False
    report["past_range"] = p2p.last_error()
    assert ep.write_ipc(conn, src.data_ptr(), ELEMS * 4, infos[0])  # still usable
    assert ask("check")
    report["checks"].append("refusals")

    # Descriptor API over the local connection.
    n = 1 << 20
    remote = ep.deserialize_descs(ask("descs", n))
    g = torch.Generator().manual_seed(6)
    mine_src = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(dev)
    mine_dst = torch.zeros(n, dtype=torch.uint8, device=dev)
    local = ep.register_memory([mine_src, mine_dst])
    torch.cuda.synchronize()
    ok, tid = ep.transfer(conn, "write", [local[0]], [remote[1]])
    assert ok and wait(ep, tid), p2p.last_error()
    assert ask("descs_check", n), "transfer write: mismatch"
    ok, tid = ep.transfer(conn, "read", [local[1]], [remote[0]])
    assert ok and wait(ep, tid), p2p.last_error()
    g = torch.Generator().manual_seed(5)
    assert torch.equal(mine_dst, torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(dev))
    report["checks"].append("transfer write/read (descriptor API)")

    # Benchmark: 256 MiB write_ipc vs a D2D copy between the same GPUs.
    info = ask("big", BIG)
    src = torch.full((BIG,), 7, dtype=torch.uint8, device=dev)
    torch.cuda.synchronize()
    assert ep.write_ipc(conn, src.data_ptr(), BIG, info)  # maps, warms
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        assert ep.write_ipc(conn, src.data_ptr(), BIG, info)
        times.append(time.perf_counter() - t0)
    assert ask("big_check") == 7
    server_gpu = args.gpus[0]
    other = torch.empty(BIG, dtype=torch.uint8, device=f"cuda:{server_gpu}")
    mtimes = []
    for i in range(args.iters + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        other.copy_(src)
        torch.cuda.synchronize(server_gpu)
        torch.cuda.synchronize(gpu)
        if i:
            mtimes.append(time.perf_counter() - t0)
    ipc_gbs = BIG / min(times) / 1e9
    memcpy_gbs = BIG / min(mtimes) / 1e9
    small = torch.full((1024,), 3.0, device=dev)
    sinfo = ask("dst", 1)[0]
    lat = []
    for i in range(args.small_iters + 50):
        t0 = time.perf_counter()
        assert ep.write_ipc(conn, small.data_ptr(), 4096, sinfo)
        if i >= 50:
            lat.append((time.perf_counter() - t0) * 1e6)
    lat.sort()
    report["bench"] = {
        "bytes": BIG,
        "write_ipc_GBps": round(ipc_gbs, 2),
        "memcpy_d2d_GBps": round(memcpy_gbs, 2),
        "ratio": round(ipc_gbs / memcpy_gbs, 3),
        "write_ipc_4KiB_p50_us": round(statistics.median(lat), 1),
        "write_ipc_4KiB_p99_us": round(lat[int(len(lat) * 0.99) - 1], 1),
        "gpus": f"{gpu}->{server_gpu}",
    }
    pipe.send(("done",))
    ep.close()
    return report


def run_server(gpu, pipe, q):
    try:
        server(gpu, pipe)
        q.put(("server", "ok"))
    except BaseException:
        q.put(("server", traceback.format_exc()))


def run_client(gpu, pipe, args, q):
    try:
        q.put(("client", client(gpu, pipe, args)))
    except BaseException:
        q.put(("client", traceback.format_exc()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", default="0,0", help="server GPU, client GPU (default 0,0)")
    ap.add_argument("--iters", type=int, default=10, help="timed 256 MiB operations")
    ap.add_argument("--small-iters", type=int, default=2000, help="timed 4 KiB operations")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args()
    args.gpus = [int(g) for g in args.gpus.split(",")]
    if not torch.cuda.is_available():
        print("skip: no CUDA device")
        return 77
    a, b = SPAWN.Pipe()
    q = SPAWN.Queue()
    ps = [SPAWN.Process(target=run_server, args=(args.gpus[0], a, q)),
          SPAWN.Process(target=run_client, args=(args.gpus[1], b, args, q))]
    for p in ps:
        p.start()
    got = {}
    try:
        for _ in ps:
            who, what = q.get(timeout=300)
            got[who] = what
    except Exception:
        print("FAILED: a process hung; got", got)
        for p in ps:
            p.kill()
        return 1
    for p in ps:
        p.join(30)
    report = got.get("client")
    if not isinstance(report, dict) or got.get("server") != "ok":
        print("FAILED:\n", got.get("server"), "\n", report)
        return 1
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for c in report["checks"]:
            print("ok", c)
        print("refused (altered key):", report["altered_key"])
        print("refused (past range):", report["past_range"])
        print(json.dumps(report["bench"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
