"""The other process of the two-process tests (started with multiprocessing's spawn)."""

from __future__ import annotations

import time

import numpy as np


def pattern(n: int, seed: int) -> np.ndarray:
    """Deterministic bytes both processes can rebuild to check every byte."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def wait_notifs(ep, count: int, timeout: float = 20.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        got += ep.get_notifs()
        time.sleep(0.001)
    return got


def p2p_server(pipe) -> None:
    """Serves the client's script in test_p2p.py step by step, reporting checks through
    `pipe` as (step, ok) so that the test process asserts them."""
    from tcpx import p2p

    ep = p2p.Endpoint(local_gpu_idx=3, num_cpus=4)
    pipe.send(ep.get_metadata())
    ok, ip, gpu, cid = ep.accept()
    pipe.send(("accept", ok and ip == "127.0.0.1" and gpu == 1))

    # Two-sided, blocking: 1 MiB + 3 bytes.
    n = (1 << 20) + 3
    buf = np.zeros(n, np.uint8)
    ok, mr = ep.reg(buf.ctypes.data, n)
    ok = ok and ep.recv(cid, mr, buf.ctypes.data, n)
    pipe.send(("recv", ok and np.array_equal(buf, pattern(n, 1))))

    # Async + poll, at an offset inside the registration.
    ok, tid = ep.recv_async(cid, mr, buf.ctypes.data + 100, 5000)
    done = False
    while ok and not done:
        ok, done = ep.poll_async(tid)
    pipe.send(("recv_async", ok and np.array_equal(buf[100:5100], pattern(5000, 2))))

    # Vectored: the client sends two pieces, this side receives into three.
    parts = [np.zeros(s, np.uint8) for s in (7, 70000, 1 << 18)]
    regs = [ep.reg(p.ctypes.data, p.nbytes)[1] for p in parts]
    ok = ep.recvv(cid, regs, [p.ctypes.data for p in parts], [p.nbytes for p in parts], 3)
    got = np.concatenate(parts)
    pipe.send(("recvv", ok and np.array_equal(got, pattern(got.size, 3))))

    # This side sends vectored, asynchronously.
    out = [pattern(1000, 4), pattern(3000, 5)]
    oregs = [ep.reg(o.ctypes.data, o.nbytes)[1] for o in out]
    ok, tid = ep.sendv_async(cid, oregs, [o.ctypes.data for o in out], [1000, 3000], 2)
    done = False
    while ok and not done:
        ok, done = ep.poll_async(tid)
    pipe.send(("sendv_async", ok))

    # One-sided target: advertise, then no call until the notifications arrive.
    target = pattern(1 << 20, 6)
    ok, tmr = ep.reg(target.ctypes.data, target.nbytes)
    ok, blob = ep.advertise(cid, tmr, target.ctypes.data + 4096, 65536)
    okv, blobs = ep.advertisev(
        cid, [tmr, tmr], [target.ctypes.data + 200000, target.ctypes.data + 400000], [1000, 20000], 2
    )
    pipe.send(("advertise", ok and okv and len(blob) == 64 and all(len(b) == 64 for b in blobs)))
    pipe.send((blob, blobs))
    notifs = wait_notifs(ep, 2)
    want = [(0, b"write done"), (0, b"writev done")]
    # A notification is delivered only after the data of the writes issued before it.
    data_ok = np.array_equal(target[4096 : 4096 + 65536], pattern(65536, 7)) and np.array_equal(
        np.concatenate([target[200000:201000], target[400000:420000]]), pattern(21000, 8)
    )
    pipe.send(("notified after data", notifs == want and data_ok))
    pipe.recv()  # the client finished its reads
    ep.close()


def pythonic_server(pipe) -> None:
    """The other process of test_pythonic.py's two-process test."""
    import tcpx

    with tcpx.Endpoint(gpu=2) as ep:
        pipe.send(ep.metadata)
        with ep.accept(timeout=30) as conn:
            ok = conn.peer_gpu is None and conn.peer[0] == "127.0.0.1"
            dst = np.zeros(300000, np.uint8)
            conn.recv(dst, timeout=20)
            pipe.send(("recv", ok and np.array_equal(dst, pattern(300000, 11))))
            parts = [bytearray(5), np.zeros(99995, np.uint8)]
            conn.recvv(parts, timeout=20)
            got = np.concatenate([np.frombuffer(bytes(parts[0]), np.uint8), parts[1]])
            pipe.send(("recvv", np.array_equal(got, pattern(100000, 12))))
            conn.send(pattern(4096, 13), timeout=20)
            kv = ep.register(np.zeros(1 << 20, np.uint8))
            pipe.send((ep.advertise(kv), ep.advertise(kv[65536:131072])))
            notes: list = []
            deadline = time.monotonic() + 20
            while not notes and time.monotonic() < deadline:
                notes = ep.notifications()
                time.sleep(0.001)
            arr = kv._keep
            landed = np.array_equal(arr[:65536], pattern(65536, 14))
            pipe.send(("notified", landed and [n for _, n in notes] == [b"kv ready"]))
            pipe.recv()
