"""Batches of small messages through the Pythonic layer: ``Connection.send_batch`` /
``recv_batch`` (many messages in one submission, one packed stream on the wire) and
``reserve_batches``. Two endpoints in this process over loopback (conftest.py pins ``lo``);
every byte is checked where it must land."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from peers import pattern

import tcpx

# The largest total of one batch (the runtime's pack buffer).
BATCH_MAX = 4 << 20


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


def sizes(count: int) -> list:
    """Uneven message sizes, 64 to 1563 bytes."""
    return [64 + (k * 37) % 1500 for k in range(count)]


def test_messages_of_a_batch_land_in_order_in_their_own_slots(pair):
    client, server, conn, peer = pair
    lens = sizes(300)
    send_stride, recv_stride = 3000, 2048
    src_arr = np.zeros(len(lens) * send_stride, np.uint8)
    for k, n in enumerate(lens):
        src_arr[k * send_stride : k * send_stride + n] = pattern(n, 1000 + k)
    dst_arr = np.full(len(lens) * recv_stride, 0xEE, np.uint8)
    src, dst = client.register(src_arr), server.register(dst_arr)
    send = [src[k * send_stride : k * send_stride + n] for k, n in enumerate(lens)]
    recv = [dst[k * recv_stride : k * recv_stride + n] for k, n in enumerate(lens)]
    total = sum(lens)

    rx = peer.recv_batch_async(recv)
    tx = conn.send_batch_async(send)
    assert rx.nbytes == total and tx.nbytes == total
    assert tx.wait(20) == total
    assert rx.wait(20) == total and rx.done()
    for k, n in enumerate(lens):
        got = dst_arr[k * recv_stride : k * recv_stride + recv_stride]
        assert np.array_equal(got[:n], pattern(n, 1000 + k)), f"message {k}"
        assert (got[n:] == 0xEE).all(), f"message {k} overran its slot"
    # Both lists were scattered: each side went through a pack buffer.
    assert conn.batch_pack_stats()["buffers"] >= 1
    assert peer.batch_pack_stats()["buffers"] >= 1

    # A batch is numbered with the other sends: a plain message after it lands in order.
    back = bytearray(100)
    t = peer.recv_async(back)
    conn.send(pattern(100, 7), timeout=20)
    assert t.wait(20) == 100 and bytes(back) == pattern(100, 7).tobytes()


def test_batches_of_plain_buffers_and_blocking_forms(pair):
    client, server, conn, peer = pair
    # Unregistered arrays, bytearrays and read-only bytes, registered for the call.
    msgs = [pattern(n, 50 + i) for i, n in enumerate(sizes(24))]
    send = [m if i % 3 == 0 else bytearray(m.tobytes()) if i % 3 == 1 else m.tobytes() for i, m in enumerate(msgs)]
    recv = [bytearray(len(m)) if i % 2 else np.zeros(len(m), np.uint8) for i, m in enumerate(msgs)]
    total = sum(len(m) for m in msgs)
    got = {}
    th = threading.Thread(target=lambda: got.update(n=peer.recv_batch(recv, timeout=20)))
    th.start()
    assert conn.send_batch(send, timeout=20) == total
    th.join(20)
    assert got["n"] == total
    for i, (m, r) in enumerate(zip(msgs, recv)):
        assert bytes(r) == m.tobytes(), f"message {i}"

    # Several batches in flight in both directions at once.
    rxs = [conn.recv_batch_async([np.zeros(1000, np.uint8), np.zeros(24, np.uint8)]) for _ in range(4)]
    outs = [pattern(1024, 300 + j) for j in range(4)]
    txs = [peer.send_batch_async([o[:1000], o[1000:]]) for o in outs]
    for t in txs + rxs:
        assert t.wait(20) == 1024


def test_a_batch_is_a_stream_cut_however_each_side_likes(pair):
    client, server, conn, peer = pair
    whole = pattern(300001, 9)
    a, b = np.zeros(150003, np.uint8), np.zeros(300001 - 150003, np.uint8)
    rx = peer.recv_batch_async([a, b])
    # One contiguous run cut in three pieces of one registration: sent in place.
    src = client.register(whole)
    conn.send_batch([src[0:1], src[1:100000], src[100000:300001]], timeout=20)
    assert rx.wait(20) == 300001
    assert np.array_equal(np.concatenate([a, b]), whole)
    # And the other way round: a scattered sender, one receive buffer.
    dst = np.zeros(300001, np.uint8)
    rx = peer.recv_batch_async([dst])
    conn.send_batch([whole[:7], whole[7:200000].copy(), whole[200000:]], timeout=20)
    assert rx.wait(20) == 300001 and np.array_equal(dst, whole)


def test_reserved_pack_buffers_are_used(pair):
    client, server, conn, peer = pair
    assert conn.reserve_batches(3) == 3
    assert peer.reserve_batches(3) == 3
    stats = conn.batch_pack_stats()
    assert set(stats) == {"packed_sent", "packed_received", "fallbacks", "overflows", "buffers"}
    assert stats["buffers"] == 3
    lens = [4096] * 64
    src_arr = pattern(64 * 8192, 5)
    src, dst_arr = client.register(src_arr), np.zeros(64 * 8192, np.uint8)
    dst = server.register(dst_arr)
    send = [src[k * 8192 : k * 8192 + n] for k, n in enumerate(lens)]
    recv = [dst[k * 8192 : k * 8192 + n] for k, n in enumerate(lens)]
    for _ in range(3):
        rxs = [peer.recv_batch_async(recv) for _ in range(3)]
        txs = [conn.send_batch_async(send) for _ in range(3)]
        for t in txs + rxs:
            assert t.wait(20) == 64 * 4096
    for k in range(64):
        assert np.array_equal(dst_arr[k * 8192 : k * 8192 + 4096], src_arr[k * 8192 : k * 8192 + 4096])
    assert conn.batch_pack_stats()["buffers"] == 3
    assert peer.batch_pack_stats()["overflows"] == 0
    assert conn.batch_pack_stats()["packed_sent"] >= 9


def test_bad_batches_raise_and_mismatched_totals_fail_without_hanging(pair):
    client, server, conn, peer = pair
    with pytest.raises(tcpx.BadArgument):
        conn.send_batch_async([])
    with pytest.raises(tcpx.BadArgument):
        peer.recv_batch_async([])
    with pytest.raises(tcpx.BadArgument, match="split it"):
        conn.send_batch_async([np.zeros(BATCH_MAX // 2, np.uint8), np.zeros(BATCH_MAX // 2 + 1, np.uint8)])
    with pytest.raises(tcpx.BadArgument):
        peer.recv_batch_async([b"read-only"])
    with pytest.raises(tcpx.BadArgument):
        conn.reserve_batches(-1)

    # Refused batches took no sequence number: the next ones still pair.
    out = pattern(5000, 3)
    dst = np.zeros(5000, np.uint8)
    rx = peer.recv_batch_async([dst[:2500], dst[2500:]])
    conn.send_batch([out[:1000], out[1000:]], timeout=20)
    assert rx.wait(20) == 5000 and np.array_equal(dst, out)

    # The receiver expects more than the sender's batch holds: the receive fails with an
    # error (not the wait running out), well before its own timeout.
    rx = peer.recv_batch_async([np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)])
    tx = conn.send_batch_async([pattern(3000, 1), pattern(3000, 2)])
    start = time.monotonic()
    with pytest.raises(tcpx.Error) as e:
        rx.wait(10)
    assert not isinstance(e.value, tcpx.TransferTimeout), e.value
    assert time.monotonic() - start < 10
    try:
        tx.wait(10)
    except tcpx.TransferTimeout:
        pytest.fail("the smaller batch's send did not finish")
    except tcpx.Error:
        pass  # either side may see the mismatch


def test_blocking_recv_batch_releases_the_gil(pair):
    client, server, conn, peer = pair
    ticks = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks[0] += 1

    def late():
        time.sleep(0.4)
        conn.send_batch([bytearray(b"x" * 600), bytearray(b"y" * 400)])

    threads = [threading.Thread(target=spin), threading.Thread(target=late)]
    for t in threads:
        t.start()
    a, b = bytearray(500), bytearray(500)
    assert peer.recv_batch([a, b], timeout=20) == 1000
    stop.set()
    for t in threads:
        t.join()
    assert a == b"x" * 500 and b == b"x" * 100 + b"y" * 400 and ticks[0] > 10000
