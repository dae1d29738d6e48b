"""``python -m tcpx.bench``: UCCL-benchmark-like figures through ``tcpx.p2p``.

By default two processes over loopback: this one (client, the data sender for
``--mode send|write``, the reader for ``--mode read``) starts a server process and the two
exchange metadata and advertisement blobs through the server's stdin/stdout (a pipe). Per
size: GB/s (10^9 bytes/s) and mean latency per operation, like UCCL's benchmark_uccl.py.

    python -m tcpx.bench                                   # send/recv, host memory
    python -m tcpx.bench --mode write --async --num-iovs 4
    python -m tcpx.bench --device gpu --sizes 1048576,104857600 --json
    python -m tcpx.bench --overhead                         # per-call cost of the binding

Loopback only by default (``TCPX_SOCKET_IFNAME=lo``, control on 127.0.0.1) unless the
environment already says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, List

DEFAULT_SIZES = [256, 1024, 4096, 16384, 65536, 262144, 1048576, 10485760, 16777216, 104857600]


def _pretty(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _buffers(args, size: int, gpu: int) -> List[Any]:
    per = max(1, size // args.num_iovs)
    sizes = [per] * (args.num_iovs - 1) + [size - per * (args.num_iovs - 1)]
    if args.device == "gpu":
        import torch  # type: ignore[import-not-found]

        return [torch.ones(s, dtype=torch.uint8, device=f"cuda:{gpu}") for s in sizes]
    import numpy as np  # type: ignore[import-not-found]

    return [np.ones(s, dtype=np.uint8) for s in sizes]


def _ptr(buf) -> int:
    return buf.data_ptr() if hasattr(buf, "data_ptr") else buf.ctypes.data


def _nbytes(buf) -> int:
    return buf.numel() * buf.element_size() if hasattr(buf, "numel") else buf.nbytes


def _check(ok, what: str) -> None:
    if not ok:
        from . import p2p

        raise SystemExit(f"tcpx.bench: {what} failed: {p2p.last_error()}")


def _wait(ep, tid) -> None:
    done = False
    while not done:
        ok, done = ep.poll_async(tid)
        _check(ok, "poll_async")


def _op(ep, args, kind: str, cid: int, mrs, bufs, blobs=None) -> None:
    ptrs, sizes, n = [_ptr(b) for b in bufs], [_nbytes(b) for b in bufs], len(bufs)
    vec = n > 1
    suffix = "_async" if args.async_api else ""
    if kind in ("send", "recv"):
        name = kind + ("v" if vec else "") + suffix
        call = getattr(ep, name)
        res = call(cid, mrs, ptrs, sizes, n) if vec else call(cid, mrs[0], ptrs[0], sizes[0])
    else:
        name = kind + ("v" if vec else "") + suffix
        call = getattr(ep, name)
        res = call(cid, mrs, ptrs, sizes, blobs, n) if vec else call(cid, mrs[0], ptrs[0], sizes[0], blobs[0])
    if args.async_api:
        ok, tid = res
        _check(ok, name)
        _wait(ep, tid)
    else:
        _check(res, name)


def _server(args) -> None:
    from . import p2p

    gpu = args.gpus[1]
    ep = p2p.Endpoint(local_gpu_idx=gpu)
    print(ep.get_metadata().hex(), flush=True)
    ok, _, _, cid = ep.accept()
    _check(ok, "accept")
    for size in args.sizes:
        bufs = _buffers(args, size, gpu)
        mrs = [ep.reg(_ptr(b), _nbytes(b))[1] for b in bufs]
        if args.mode == "send":
            for _ in range(args.iters + args.warmup):
                _op(ep, args, "recv", cid, mrs, bufs)
        else:
            ok, blobs = ep.advertisev(cid, mrs, [_ptr(b) for b in bufs], [_nbytes(b) for b in bufs], len(bufs))
            _check(ok, "advertisev")
            print(json.dumps([b.hex() for b in blobs]), flush=True)
        # The client's notification ends the size (one-sided: after its last operation).
        while not ep.get_notifs():
            time.sleep(0.0005)
        for m in mrs:
            ep.dereg(m)
    ep.close()


def _client(args, server) -> List[dict]:
    from . import p2p

    gpu = args.gpus[0]
    ep = p2p.Endpoint(local_gpu_idx=gpu)
    meta = bytes.fromhex(server.stdout.readline().strip())
    ip, port, rgpu = p2p.Endpoint.parse_metadata(meta)
    ok, cid = ep.connect(ip, rgpu, remote_port=port)
    _check(ok, "connect")
    rows = []
    for size in args.sizes:
        bufs = _buffers(args, size, gpu)
        mrs = [ep.reg(_ptr(b), _nbytes(b))[1] for b in bufs]
        blobs = None
        kind = "send"
        if args.mode != "send":
            blobs = [bytes.fromhex(h) for h in json.loads(server.stdout.readline())]
            kind = args.mode
        # Warm-up, untimed: registration, and the first use of every channel (a message of
        # one chunk lands on one channel, the next on the next one), whose staging ring or
        # plugin registration would otherwise be paid inside the timed loop.
        for _ in range(args.warmup):
            _op(ep, args, kind, cid, mrs, bufs, blobs)
        start = time.perf_counter()
        for _ in range(args.iters):
            _op(ep, args, kind, cid, mrs, bufs, blobs)
        elapsed = time.perf_counter() - start
        _check(ep.send_notif(cid, b"next"), "send_notif")
        for m in mrs:
            ep.dereg(m)
        total = size * args.iters
        row = {
            "size": size,
            "iters": args.iters,
            "mode": args.mode,
            "device": args.device,
            "async": args.async_api,
            "num_iovs": args.num_iovs,
            "gbps": total / elapsed / 1e9,
            "lat_us": elapsed / args.iters * 1e6,
        }
        rows.append(row)
        if not args.json:
            print(f"[Client] {_pretty(size):>8} : {row['gbps']:7.3f} GB/s | {row['gbps'] * 8:7.2f} Gbps | {row['lat_us']:10.1f} us", flush=True)
    ep.close()
    return rows


def _overhead(args) -> dict:
    """Per-call cost of send_async + poll_async at 256 B through tcpx.p2p, and of a call
    that does no transfer work (the binding's floor)."""
    import threading

    import numpy as np

    from . import p2p

    a, b = p2p.Endpoint(), p2p.Endpoint()
    ip, port, _ = p2p.Endpoint.parse_metadata(a.get_metadata())
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(r=a.accept()))
    t.start()
    ok, cid = b.connect(ip, 0, remote_port=port)
    t.join()
    n = args.iters
    rcid = got["r"][3]
    src, dst = np.ones(256, np.uint8), np.zeros(256, np.uint8)
    _, smr = b.reg(src.ctypes.data, 256)
    _, dmr = a.reg(dst.ctypes.data, 256)
    submit = poll = 0.0
    polls = 0
    for _ in range(n):
        ok, rid = a.recv_async(rcid, dmr, dst.ctypes.data, 256)
        t0 = time.perf_counter()
        ok, tid = b.send_async(cid, smr, src.ctypes.data, 256)
        t1 = time.perf_counter()
        done = False
        while not done:
            ok, done = b.poll_async(tid)
            polls += 1
        submit += t1 - t0
        poll += time.perf_counter() - t1
        _wait(a, rid)
    t0 = time.perf_counter()
    for _ in range(n):
        b.poll_async(1 << 60)  # unknown id: argument parsing, one map lookup, tuple back
    floor = time.perf_counter() - t0
    a.close()
    b.close()
    return {
        "send_async_call_us": submit / n * 1e6,
        "poll_async_call_us": poll / polls * 1e6,
        "polls_per_send": polls / n,
        "binding_call_floor_us": floor / n * 1e6,
        "iters": n,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tcpx.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["send", "write", "read"], default="send")
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--async", dest="async_api", action="store_true", help="use the _async calls and poll_async")
    p.add_argument("--num-iovs", type=int, default=1, help="buffers per operation (vectored calls when > 1)")
    p.add_argument("--sizes", type=lambda v: [int(s) for s in v.split(",") if s], default=DEFAULT_SIZES)
    p.add_argument("--iters", type=int, default=50, help="timed operations per size (after the warm-up)")
    p.add_argument("--warmup", type=int, default=16,
                   help="untimed operations per size first (default 16: one per channel of up to 16)")
    p.add_argument("--gpus", type=lambda v: [int(s) for s in v.split(",")], default=None,
                   help="client,server GPU indices (default 0,1 with two GPUs, else 0,0)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    p.add_argument("--overhead", action="store_true", help="measure the per-call cost of send_async + poll_async (256 B)")
    p.add_argument("--role", choices=["client", "server"], default="client", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    os.environ.setdefault("TCPX_SOCKET_IFNAME", "lo")
    os.environ.setdefault("TCPX_CONTROL_ADDR", "127.0.0.1:0")
    if args.num_iovs < 1:
        p.error("--num-iovs must be at least 1")
    if args.warmup < 1:
        p.error("--warmup must be at least 1")
    if args.gpus is None:
        count = 0
        if args.device == "gpu":
            import torch  # type: ignore[import-not-found]

            count = torch.cuda.device_count()
        args.gpus = [0, 1] if count >= 2 else [0, 0]
    if args.overhead:
        if args.iters < 1000:
            args.iters = 20000
        result = _overhead(args)
        print(json.dumps(result) if args.json else "\n".join(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}" for k, v in result.items()))
        return 0
    if args.role == "server":
        _server(args)
        return 0
    cmd = [sys.executable, "-m", "tcpx.bench", "--role", "server"] + (argv if argv is not None else sys.argv[1:])
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        if not args.json:
            api = "Async" if args.async_api else "Sync"
            print(f"tcpx p2p benchmark — mode: {args.mode} | API: {api} | device: {args.device} | iovs: {args.num_iovs} | iters: {args.iters}")
        rows = _client(args, server)
        if server.wait(60) != 0:
            raise SystemExit("tcpx.bench: the server process failed")
    finally:
        if server.poll() is None:
            server.kill()
    if args.json:
        print(json.dumps({"benchmark": "tcpx.bench", "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
