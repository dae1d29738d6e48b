"""The Pythonic layer: tcpx.Endpoint / Connection / Region / Transfer with numpy arrays and
buffers, exceptions instead of ok flags, context managers."""

from __future__ import annotations

import multiprocessing as mp
import struct
import threading
import time

import numpy as np
import pytest
from peers import pattern, pythonic_server

import tcpx


def test_two_processes_numpy_and_buffers():
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    server = ctx.Process(target=pythonic_server, args=(there,), daemon=True)
    server.start()
    try:
        assert here.poll(60), "server did not start"
        meta = here.recv()
        with tcpx.Endpoint() as ep, ep.connect(meta) as conn:
            assert conn.peer_gpu == 2
            conn.send(pattern(300000, 11), timeout=20)
            assert here.recv() == ("recv", True)
            whole = pattern(100000, 12)
            t = conn.sendv_async([whole[:60000], bytes(whole[60000:])])  # bytes: read-only
            assert t.wait(20) == 100000 and t.done()
            assert here.recv() == ("recvv", True)
            back = bytearray(4096)
            assert conn.recv(back, timeout=20) == 4096
            assert bytes(back) == pattern(4096, 13).tobytes()
            blob, window = here.recv()
            assert len(blob) == 64 and len(window) == 64
            conn.write(pattern(65536, 14), blob, notification=b"kv ready", timeout=20)
            assert here.recv() == ("notified", True)
            out = np.zeros(65536, np.uint8)
            conn.read(out, blob, timeout=20)
            assert np.array_equal(out, pattern(65536, 14))
            conn.write(np.full(65536, 3, np.uint8), window, timeout=20)
            conn.read(out, window, timeout=20)
            assert (out == 3).all()
            with pytest.raises(tcpx.BadArgument):
                conn.write(np.zeros(65537, np.uint8), window)  # more than advertised
            here.send("done")
    finally:
        server.join(30)
        if server.is_alive():
            server.kill()
            pytest.fail("server process hung")
    assert server.exitcode == 0


@pytest.fixture
def pair():
    server, client = tcpx.Endpoint(), tcpx.Endpoint()
    got = {}
    t = threading.Thread(target=lambda: got.update(c=server.accept(timeout=20)))
    t.start()
    conn = client.connect(server.address)
    t.join(20)
    yield client, server, conn, got["c"]
    client.close()
    server.close()


def test_bad_input_raises(pair):
    client, server, conn, peer = pair
    region = client.register(np.zeros(4096, np.uint8))
    with pytest.raises(tcpx.BadArgument):
        client.register(np.zeros((8, 8))[:, 0])  # not contiguous
    with pytest.raises(tcpx.BadArgument):
        client.register(object())
    with pytest.raises(tcpx.BadArgument):
        conn.recv(b"read-only bytes")
    with pytest.raises(tcpx.BadArgument):
        region[10:5]
    with pytest.raises(tcpx.BadArgument):
        conn.write(region, b"\0" * 63)
    with pytest.raises(tcpx.BadArgument):
        conn.write(region, b"\1" * 64)
    target = server.register(np.zeros(4096, np.uint8))
    blob = bytearray(server.advertise(target))
    blob[24 + 18] ^= 1  # forge the key, then fix the checksum as a forger would
    h = 0xCBF29CE484222325
    for b in bytes(blob[:56]):
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    blob[56:] = struct.pack("<Q", h)
    with pytest.raises(tcpx.AccessRefused):
        conn.write(region, bytes(blob), timeout=20)
    with pytest.raises(tcpx.BadArgument):
        tcpx.Endpoint().connect("nonsense")
    with pytest.raises(tcpx.PeerLost):
        client.connect(("127.0.0.1", 1))  # nobody listens there
    with pytest.raises(tcpx.TransferTimeout):
        peer.recv_async(np.zeros(16, np.uint8)).wait(0.05)
    region.close()
    with pytest.raises(tcpx.Closed):
        conn.send(region)


def test_peer_gone_and_closed_endpoint(pair):
    client, server, conn, peer = pair
    t = conn.recv_async(np.zeros(1 << 16, np.uint8))
    server.close()
    with pytest.raises((tcpx.PeerLost, tcpx.Closed)) as e:
        t.wait(20)
    assert isinstance(e.value, tcpx.Error)
    client.close()
    with pytest.raises(tcpx.Closed):
        client.register(np.zeros(16, np.uint8))
    with pytest.raises(tcpx.Closed):
        client.accept(timeout=0.1)


def test_dropped_transfer_keeps_its_memory_alive(pair):
    client, server, conn, peer = pair
    import gc
    import weakref

    dst = np.zeros(1 << 16, np.uint8)
    ref = weakref.ref(dst)
    peer.recv_async(dst)  # handle dropped at once
    del dst
    gc.collect()
    assert ref() is not None, "the array was freed while a receive into it was in flight"
    conn.send(np.full(1 << 16, 4, np.uint8), timeout=20)
    arr = ref()
    deadline = time.monotonic() + 20
    while arr is not None and not (arr == 4).all() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert arr is not None and (arr == 4).all()


def test_blocking_recv_releases_the_gil(pair):
    client, server, conn, peer = pair
    ticks = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks[0] += 1

    def late():
        time.sleep(0.4)
        conn.send(bytearray(b"x" * 1000))

    threads = [threading.Thread(target=spin), threading.Thread(target=late)]
    for t in threads:
        t.start()
    buf = bytearray(1000)
    assert peer.recv(buf, timeout=20) == 1000
    stop.set()
    for t in threads:
        t.join()
    assert buf == b"x" * 1000 and ticks[0] > 10000


def test_region_views_and_uccl_metadata(pair):
    client, server, conn, peer = pair
    src = client.register(np.arange(256, dtype=np.uint8))
    dst = server.register(np.zeros(256, np.uint8))
    t = peer.recv_async(dst[16:32])
    conn.send(src[100:116])
    t.wait(20)
    assert list(dst._keep[16:32]) == list(range(100, 116))
    assert server.uccl_metadata[:4] == bytes([127, 0, 0, 1])
    with tcpx.Endpoint() as other:
        got = {}
        th = threading.Thread(target=lambda: got.update(c=server.accept(timeout=20)))
        th.start()
        c2 = other.connect(server.uccl_metadata)  # address-only metadata works too
        th.join(20)
        assert c2.peer == server.address and got["c"].peer[0] == "127.0.0.1"


def test_endpoint_inherited_through_fork_is_closed_in_the_child(pair):
    import os

    client, server, conn, peer = pair
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: every call on the inherited endpoint raises Closed
        code = 1
        try:
            client.register(np.zeros(16, np.uint8))
        except tcpx.Closed:
            code = 0
        except BaseException:
            code = 2
        os.write(w, bytes([code]))
        os._exit(0)  # no teardown of what the parent owns
    os.close(w)
    assert os.read(r, 1) == b"\0"
    os.waitpid(pid, 0)
    # The parent's endpoint is untouched.
    t = peer.recv_async(np.zeros(8, np.uint8))
    conn.send(np.ones(8, np.uint8), timeout=20)
    assert t.wait(20) == 8
