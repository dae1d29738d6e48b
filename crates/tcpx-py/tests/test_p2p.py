"""tcpx.p2p: UCCL's API between two processes over loopback, every byte checked, and bad
input giving ok=False (never a crash or a hang)."""

from __future__ import annotations

import multiprocessing as mp
import struct
import threading
import time

import numpy as np
import pytest
from peers import p2p_server, pattern

from tcpx import p2p


def fnv1a(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def reseal(blob: bytearray) -> bytes:
    """Recomputes a modified blob's checksum: what a forger would do."""
    blob[56:64] = struct.pack("<Q", fnv1a(bytes(blob[:56])))
    return bytes(blob)


def test_two_processes_every_call_family():
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    server = ctx.Process(target=p2p_server, args=(there,), daemon=True)
    server.start()
    try:
        _client(here)
    finally:
        server.join(30)
        if server.is_alive():
            server.kill()
            pytest.fail("server process hung")
    assert server.exitcode == 0


def _check(pipe, step):
    got_step, ok = pipe.recv()
    assert got_step == step
    assert ok, f"server-side check failed: {step}"


def _client(pipe):
    assert pipe.poll(60), "server did not start"
    meta = pipe.recv()
    ip, port, gpu = p2p.Endpoint.parse_metadata(meta)
    # IPv4, port, the GPU bus id's length and the bus id ("" without a GPU 3 here).
    assert ip == "127.0.0.1" and len(meta) == 7 + len(gpu) and (gpu == "" or ":" in gpu)
    ep = p2p.Endpoint(local_gpu_idx=1, num_cpus=4)
    ok, cid = ep.connect(ip, gpu, remote_port=port)
    assert ok, p2p.last_error()
    _check(pipe, "accept")

    n = (1 << 20) + 3
    src = pattern(n, 1)
    ok, mr = ep.reg(src.ctypes.data, n)
    assert ok
    assert ep.send(cid, mr, src.ctypes.data, n)
    _check(pipe, "recv")

    small = pattern(5000, 2)
    ok, smr = ep.reg(small.ctypes.data, small.nbytes)
    ok, tid = ep.send_async(cid, smr, small.ctypes.data, 5000)
    assert ok
    done = False
    while not done:
        ok, done = ep.poll_async(tid)
        assert ok
    _check(pipe, "recv_async")

    total = pattern(7 + 70000 + (1 << 18), 3)
    halves = [total[:100000].copy(), total[100000:].copy()]
    regs = [ep.reg(h.ctypes.data, h.nbytes)[1] for h in halves]
    assert ep.sendv(cid, regs, [h.ctypes.data for h in halves], [h.nbytes for h in halves], 2)
    _check(pipe, "recvv")

    back = [np.zeros(1000, np.uint8), np.zeros(3000, np.uint8)]
    bregs = [ep.reg(b.ctypes.data, b.nbytes)[1] for b in back]
    ok, tid = ep.recvv_async(cid, bregs, [b.ctypes.data for b in back], [1000, 3000], 2)
    done = False
    while ok and not done:
        ok, done = ep.poll_async(tid)
    assert ok
    assert np.array_equal(back[0], pattern(1000, 4)) and np.array_equal(back[1], pattern(3000, 5))
    _check(pipe, "sendv_async")

    _check(pipe, "advertise")
    blob, blobs = pipe.recv()
    data = pattern(65536, 7)
    ok, dmr = ep.reg(data.ctypes.data, data.nbytes)
    assert ep.write(cid, dmr, data.ctypes.data, 65536, blob)
    assert ep.send_notif(cid, b"write done")
    vec = pattern(21000, 8)
    ok, vmr = ep.reg(vec.ctypes.data, vec.nbytes)
    ok, tid = ep.writev_async(cid, [vmr, vmr], [vec.ctypes.data, vec.ctypes.data + 1000], [1000, 20000], blobs, 2)
    assert ok
    done = False
    while ok and not done:
        ok, done = ep.poll_async(tid)
    assert ok
    assert ep.send_notif(cid, "writev done")
    _check(pipe, "notified after data")

    # Reads of what the writes left there.
    into = np.zeros(65536, np.uint8)
    ok, imr = ep.reg(into.ctypes.data, into.nbytes)
    assert ep.read(cid, imr, into.ctypes.data, 65536, blob)
    assert np.array_equal(into, data)
    into2 = np.zeros(21000, np.uint8)
    ok, i2 = ep.reg(into2.ctypes.data, into2.nbytes)
    assert ep.readv(cid, [i2, i2], [into2.ctypes.data, into2.ctypes.data + 1000], [1000, 20000], blobs, 2)
    assert np.array_equal(into2, vec)
    ok, tid = ep.read_async(cid, imr, into.ctypes.data, 100, blob)
    done = False
    while ok and not done:
        ok, done = ep.poll_async(tid)
    assert ok
    pipe.send("done")
    ep.close()


@pytest.fixture
def pair():
    """Two endpoints of this process, connected (client, server, client conn, server conn)."""
    server = p2p.Endpoint(local_gpu_idx=0)
    client = p2p.Endpoint()
    ip, port, gpu = p2p.Endpoint.parse_metadata(server.get_metadata())
    got = {}
    t = threading.Thread(target=lambda: got.update(a=server.accept()))
    t.start()
    ok, cid = client.connect(server.get_metadata())  # the connect(metadata) form
    t.join(20)
    assert ok and got["a"][0]
    assert got["a"][2] == -1  # the client announced no GPU
    yield client, server, cid, got["a"][3]
    client.close()
    server.close()


def test_bad_input_gives_ok_false(pair):
    client, server, cid, scid = pair
    buf = np.zeros(4096, np.uint8)
    ok, mr = client.reg(buf.ctypes.data, buf.nbytes)
    assert ok
    p = buf.ctypes.data
    cases = {
        "unknown conn_id": lambda: client.send(cid + 77, mr, p, 16),
        "unknown mr_id": lambda: client.send(cid, mr + 77, p, 16),
        "unregistered ptr": lambda: client.send(cid, mr, p + 8192, 16),
        "ptr below the registration": lambda: client.send(cid, mr, p - 1, 16),
        "size past the registration": lambda: client.send(cid, mr, p + 100, 4000),
        "zero size": lambda: client.send(cid, mr, p, 0),
        "null reg": lambda: client.reg(0, 10)[0],
        "zero-size reg": lambda: client.reg(p, 0)[0],
        "unknown transfer id": lambda: client.poll_async(12345)[0],
        "num_iovs mismatch": lambda: client.sendv(cid, [mr], [p], [16], 2),
        "empty vector": lambda: client.sendv(cid, [], [], [], 0),
        "wrong-length blob": lambda: client.write(cid, mr, p, 16, b"\0" * 63),
        "garbage blob": lambda: client.write(cid, mr, p, 16, b"\x07" * 64),
        "unknown dereg": lambda: client.dereg(mr + 99),
        "advertise outside": lambda: client.advertise(cid, mr, p + 4000, 200)[0],
        "bad ip": lambda: client.connect("not-an-ip", 0, remote_port=1)[0],
        "no port": lambda: client.connect("127.0.0.1", 0)[0],
        "bad metadata": lambda: client.connect(b"\1\2\3")[0],
        "unknown remove": lambda: client.remove_remote_endpoint(999),
    }
    for name, call in cases.items():
        assert call() is False, name
        assert p2p.last_error() is not None, name
    with pytest.raises(ValueError):
        p2p.Endpoint.parse_metadata(b"123")
    # Where UCCL raises, or hands back zeroed blobs on failure, so do we.
    with pytest.raises(RuntimeError, match="ptrs and sizes must match"):
        client.regv([p, p + 16], [16])
    ok, blobs = client.advertisev([mr, mr], [p, p + 4000], [16, 200], 2)
    assert not ok and blobs == [bytes(64)] * 2, blobs
    assert "not inside" in p2p.last_error()[1], p2p.last_error()
    ok, blobs = client.advertisev([mr], [p], [16], 10**12)
    assert not ok and blobs == [bytes(64)], "a wild num_iovs allocates nothing"


def test_blob_checks_and_forged_key_refused_by_peer(pair):
    client, server, cid, scid = pair
    target = np.zeros(8192, np.uint8)
    ok, tmr = server.reg(target.ctypes.data, target.nbytes)
    ok, blob = server.advertise(tmr, target.ctypes.data, 4096)  # newer form, no conn_id
    assert ok and len(blob) == 64
    src = np.full(4096, 9, np.uint8)
    ok, smr = client.reg(src.ctypes.data, src.nbytes)

    corrupted = bytearray(blob)
    corrupted[30] ^= 1
    assert not client.write(cid, smr, src.ctypes.data, 16, bytes(corrupted))
    assert "checksum" in p2p.last_error()[1]

    forged = bytearray(blob)
    forged[24 + 18] ^= 0xFF  # the access key
    assert not client.write(cid, smr, src.ctypes.data, 16, reseal(forged))
    assert p2p.last_error()[0] == "AccessRefused"

    stretched = bytearray(blob)
    stretched[8:16] = struct.pack("<Q", 1 << 20)  # claims more than the registration
    assert not client.write(cid, smr, src.ctypes.data, 16, reseal(stretched))
    assert (target == 0).all(), "a refused write wrote nothing"

    # The connection survived the refusals.
    assert client.write(cid, smr, src.ctypes.data, 4096, blob)
    assert (target[:4096] == 9).all() and (target[4096:] == 0).all()
    # Deregistering revokes the advertisement.
    assert server.dereg(tmr)
    assert not client.write(cid, smr, src.ctypes.data, 16, blob)
    assert p2p.last_error()[0] == "AccessRefused"


def test_peer_gone_and_closed_endpoint(pair):
    client, server, cid, scid = pair
    buf = np.zeros(1 << 16, np.uint8)
    ok, mr = client.reg(buf.ctypes.data, buf.nbytes)
    ok, tid = client.recv_async(cid, mr, buf.ctypes.data, buf.nbytes)
    assert ok
    server.close()
    deadline = time.monotonic() + 20
    while True:
        ok, done = client.poll_async(tid)
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.005)
    assert (ok, done) == (False, True)
    assert p2p.last_error()[0] in ("PeerLost", "Closed"), p2p.last_error()
    assert not client.send(cid, mr, buf.ctypes.data, 16)
    client.close()
    assert client.reg(buf.ctypes.data, 16) == (False, 0)
    assert p2p.last_error()[0] == "Closed"
    assert client.accept()[0] is False


def test_blocking_recv_releases_the_gil(pair):
    client, server, cid, scid = pair
    buf = np.zeros(1024, np.uint8)
    ok, mr = server.reg(buf.ctypes.data, buf.nbytes)
    src = np.full(1024, 5, np.uint8)
    ok, smr = client.reg(src.ctypes.data, src.nbytes)
    ticks = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks[0] += 1

    def late_send():
        time.sleep(0.5)
        client.send(cid, smr, src.ctypes.data, 1024)

    threads = [threading.Thread(target=spin), threading.Thread(target=late_send)]
    for t in threads:
        t.start()
    start = time.monotonic()
    assert server.recv(scid, mr, buf.ctypes.data, 1024)
    waited = time.monotonic() - start
    stop.set()
    for t in threads:
        t.join()
    assert waited >= 0.4 and (buf == 5).all()
    # A thread that only runs with the GIL counted all along the blocked recv.
    assert ticks[0] > 10000, ticks[0]


def test_registration_is_paid_at_reg_and_connect_not_at_the_first_write(pair):
    """UCCL's `reg` is where registration is paid: a buffer registered while a connection is
    up is registered on its one-sided comms at once, and one registered before a connection
    on that connection as it is set up; the first write then registers nothing. The server's
    advertised target likewise (the runtime registers advertised regions on every
    connection). `metrics()["registrations"]` counts them (one per comm and direction)."""
    client, server, cid, scid = pair
    before = client.metrics()["registrations"]
    src = np.full(1 << 16, 7, np.uint8)
    ok, smr = client.reg(src.ctypes.data, src.nbytes)
    assert ok
    per_conn = client.metrics()["registrations"] - before
    assert per_conn > 0, "reg registered nothing on the live connection"
    target = np.zeros(1 << 16, np.uint8)
    ok, tmr = server.reg(target.ctypes.data, target.nbytes)
    ok, blob = server.advertise(tmr, target.ctypes.data, target.nbytes)
    assert ok
    server_before = server.metrics()["registrations"]
    assert client.write(cid, smr, src.ctypes.data, src.nbytes, blob)
    assert (target == 7).all()
    assert client.metrics()["registrations"] == before + per_conn, "the first write registered"
    assert server.metrics()["registrations"] == server_before, "the target registered at the write"

    # A second connection: what the client registered already is registered on it as it comes.
    got = {}
    t = threading.Thread(target=lambda: got.update(a=server.accept()))
    t.start()
    ok, cid2 = client.connect(server.get_metadata())
    t.join(20)
    assert ok and got["a"][0]
    assert client.metrics()["registrations"] == before + 2 * per_conn
    src[:] = 8
    assert client.write(cid2, smr, src.ctypes.data, src.nbytes, blob)
    assert (target == 8).all()
    assert client.metrics()["registrations"] == before + 2 * per_conn
    # Deregistering releases them all (transfers are done).
    assert client.dereg(smr)
    deadline = time.monotonic() + 10
    while client.metrics()["registrations"] != before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.metrics()["registrations"] == before
