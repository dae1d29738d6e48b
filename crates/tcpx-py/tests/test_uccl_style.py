"""UCCL's p2p tests, as shapes (written for tcpx, host memory): the write and read handshakes
of test_engine_write.py / test_engine_read.py with two children of multiprocessing's *fork*
start method, each making its own endpoint after the fork, metadata through pipes; the
descriptor API end to end (register_memory, get_serialized_descs / deserialize_descs,
transfer "write" and "read", poll_async) between fork children; remove_remote_endpoint
(test_remove_remote_endpoint.py); registration reuse (test_register_memory_cache.py).
Every byte is checked. The CUDA variants are in test_gpu.py and uccl_fork_gpu.py."""

from __future__ import annotations

import gc
import multiprocessing as mp
import threading
import traceback
from typing import Callable, Dict, List

import numpy as np
import pytest
from peers import pattern

import tcpx
from tcpx import p2p

FORK = mp.get_context("fork")
BLOCK = 16 << 10


def run_children(*targets: Callable, timeout: float = 60.0) -> Dict[str, object]:
    """Starts each `target(pipes..., report)` in a fork child; returns what they reported
    as {step: value}. A child that raises reports the traceback and fails the test; one
    that hangs is killed and fails it too."""
    results = FORK.Queue()
    procs = []
    for target, args in targets:
        def body(target=target, args=args):
            try:
                target(*args, lambda step, value: results.put((step, value)))
            except BaseException:
                results.put(("error in " + target.__name__, traceback.format_exc()))
                raise

        procs.append(FORK.Process(target=body, daemon=True))
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join(5)
    got: Dict[str, object] = {}
    while True:
        try:
            step, value = results.get(timeout=0.5)
        except Exception:
            break
        got[step] = value
    errors = {k: v for k, v in got.items() if k.startswith("error in")}
    assert not errors, "\n".join(f"{k}:\n{v}" for k, v in errors.items())
    assert not hung, f"{len(hung)} child process(es) hung; reported so far: {got}"
    assert [p.exitcode for p in procs] == [0] * len(procs), got
    return got


# -- test_engine_write / test_engine_read ------------------------------------------------


def _one_sided_initiator(ep_meta_q, fifo_meta_q, read: bool, report) -> None:
    """UCCL's "server": connects to the peer, then writes its bytes into (or reads the
    peer's bytes from) the advertised buffer."""
    ep_meta = ep_meta_q.recv()
    ip, port, r_gpu = p2p.Endpoint.parse_metadata(ep_meta)
    ep = p2p.Endpoint(local_gpu_idx=0)
    ok, conn_id = ep.connect(ip, r_gpu, remote_port=port)
    assert ok, p2p.last_error()
    n = 1 << 20
    buf = np.zeros(n, np.uint8) if read else pattern(n, 21)
    ok, mr_id = ep.reg(buf.ctypes.data, n)
    assert ok, p2p.last_error()
    fifo_meta = fifo_meta_q.recv()
    assert isinstance(fifo_meta, (bytes, bytearray)) and len(fifo_meta) == 64
    if read:
        ok = ep.read(conn_id, mr_id, buf.ctypes.data, n, fifo_meta)
        report("read", ok and np.array_equal(buf, pattern(n, 22)))
    else:
        ok = ep.write(conn_id, mr_id, buf.ctypes.data, n, fifo_meta)
        report("write", ok)
    fifo_meta_q.send("done")
    ep.close()


def _one_sided_target(ep_meta_q, fifo_meta_q, read: bool, report) -> None:
    """UCCL's "client": accepts, registers and advertises a buffer, then waits."""
    ep = p2p.Endpoint(local_gpu_idx=0)
    ep_meta_q.send(bytes(ep.get_metadata()))
    ok, r_ip, r_gpu, conn_id = ep.accept()
    assert ok and r_ip == "127.0.0.1" and r_gpu == 0, (ok, r_ip, r_gpu, p2p.last_error())
    n = 1 << 20
    buf = pattern(n, 22) if read else np.zeros(n, np.uint8)
    ok, mr_id = ep.reg(buf.ctypes.data, n)
    assert ok
    ok, fifo_blob = ep.advertise(mr_id, buf.ctypes.data, n)
    assert ok and len(fifo_blob) == 64
    fifo_meta_q.send(bytes(fifo_blob))
    assert fifo_meta_q.poll(30), "the initiator never finished"
    assert fifo_meta_q.recv() == "done"
    if not read:
        report("written bytes", np.array_equal(buf, pattern(n, 21)))
    ep.close()


@pytest.mark.parametrize("read", [False, True], ids=["write", "read"])
def test_engine_write_and_read_between_fork_children(read):
    # An endpoint of the parent exists at fork(): the children's own endpoints still work.
    parent = p2p.Endpoint()
    meta_a, meta_b = FORK.Pipe()
    fifo_a, fifo_b = FORK.Pipe()
    got = run_children(
        (_one_sided_initiator, (meta_a, fifo_a, read)),
        (_one_sided_target, (meta_b, fifo_b, read)),
    )
    if read:
        assert got == {"read": True}
    else:
        assert got == {"write": True, "written bytes": True}
    buf = np.zeros(64, np.uint8)
    assert parent.reg(buf.ctypes.data, 64)[0], "the parent's endpoint is untouched"
    parent.close()


# -- the descriptor API between fork children ---------------------------------------------


def _descs_target(pipe, report) -> None:
    """Passive side (UCCL's Ray flow): registers blocks, hands out their descriptors, makes
    no call while the peer writes and reads."""
    ep = p2p.Endpoint(0)
    assert ep.start_passive_accept()
    pool = np.zeros(64 * BLOCK, np.uint8)
    pool_desc = ep.register_memory([pool])  # then the blocks share its registration
    blocks = [pool[i * BLOCK : (i + 1) * BLOCK] for i in range(1, 64, 4)]  # 16 scattered
    descs = ep.register_memory(blocks)
    report("blocks share the pool's keys", all(d.rkeys == pool_desc[0].rkeys for d in descs))
    src = pattern(3 * BLOCK, 32)
    src_descs = ep.register_memory([src[i * BLOCK : (i + 1) * BLOCK] for i in range(3)])
    pipe.send((ep.get_metadata(), ep.get_serialized_descs(descs), ep.get_serialized_descs(src_descs)))
    assert pipe.poll(30) and pipe.recv() == "written"
    want = pattern(16 * BLOCK, 31)
    report("written", all(np.array_equal(b, want[i * BLOCK : (i + 1) * BLOCK]) for i, b in enumerate(blocks)))
    report("nothing else written", int(np.count_nonzero(pool)) == int(np.count_nonzero(want)))
    pipe.send("checked")
    assert pipe.poll(30) and pipe.recv() == "read"
    ep.deregister_memory(descs + pool_desc + src_descs)
    ep.close()


def _descs_initiator(pipe, report) -> None:
    ep = p2p.Endpoint(0)
    meta, blob, src_blob = pipe.recv()
    ok, conn_id = ep.add_remote_endpoint(meta)
    assert ok, p2p.last_error()
    assert ep.add_remote_endpoint(meta) == (True, conn_id), "connects once per peer"
    remote = ep.deserialize_descs(blob)
    assert len(remote) == 16 and all(d.mr_id == 2**64 - 1 and d.size == BLOCK for d in remote)
    data = pattern(16 * BLOCK, 31)
    local = ep.register_memory([data[i * BLOCK : (i + 1) * BLOCK] for i in range(16)])
    ok, tid = ep.transfer(conn_id, "write", local, remote)
    assert ok, p2p.last_error()
    done = False
    while not done:
        ok, done = ep.poll_async(tid)
        assert ok, p2p.last_error()
    pipe.send("written")
    assert pipe.poll(30) and pipe.recv() == "checked"
    # Read back what was written, and the peer's own source blocks.
    back = np.zeros(16 * BLOCK, np.uint8)
    into = ep.register_memory([back[i * BLOCK : (i + 1) * BLOCK] for i in range(16)])
    ok, tid = ep.transfer(conn_id, "read", into, remote)
    while ok and not (r := ep.poll_async(tid))[1]:
        ok = r[0]
    report("read back", ok and np.array_equal(back, data))
    src_remote = ep.deserialize_descs(src_blob)
    small = np.zeros(3 * BLOCK, np.uint8)
    small_descs = ep.register_memory([small[i * BLOCK : (i + 1) * BLOCK] for i in range(3)])
    ok, tid = ep.transfer(conn_id, "read", small_descs, src_remote)
    while ok and not (r := ep.poll_async(tid))[1]:
        ok = r[0]
    report("read the peer's blocks", ok and np.array_equal(small, pattern(3 * BLOCK, 32)))
    pipe.send("read")
    ep.deregister_memory(local + into + small_descs)
    ep.close()


def test_descriptor_api_between_fork_children():
    a, b = FORK.Pipe()
    got = run_children((_descs_target, (a,)), (_descs_initiator, (b,)))
    assert got == {
        "blocks share the pool's keys": True,
        "written": True,
        "nothing else written": True,
        "read back": True,
        "read the peer's blocks": True,
    }


# -- fork safety --------------------------------------------------------------------------


def _inherited_child(inherited, parent_core, pending, parent_meta, parent_blob, report) -> None:
    # What the child inherited refuses every call and names fork().
    parent_ep = inherited["endpoint"]
    report("inherited reg", parent_ep.reg(1 << 20, 16) == (False, 0))
    kind, message = p2p.last_error()
    report("reason", kind == "Closed" and "fork()" in message)
    try:
        parent_core.register(np.zeros(16, np.uint8))
        report("pythonic inherited", False)
    except tcpx.Closed:
        report("pythonic inherited", True)
    try:
        pending.done()
        report("inherited transfer", False)
    except tcpx.Closed:
        report("inherited transfer", True)
    # Dropping an inherited endpoint here (its last reference: the dict's) frees nothing of
    # the parent's and does not hang.
    del parent_ep
    inherited.clear()
    gc.collect()
    report("dropped", True)
    # An endpoint made here works: it writes into the parent's memory (the parent accepts
    # passively) and runs a pair of its own.
    ep = p2p.Endpoint()
    ok, conn_id = ep.add_remote_endpoint(parent_meta)
    src = pattern(BLOCK, 41)
    local = ep.register_memory([src])
    ok, tid = ep.transfer(conn_id, "write", local, ep.deserialize_descs(parent_blob))
    while ok and not (r := ep.poll_async(tid))[1]:
        ok = r[0]
    report("child wrote into the parent", ok)
    ep.close()


def test_only_endpoints_that_existed_at_fork_are_refused_in_the_child():
    # Held only by this dict, so that the child can drop its copy's last reference.
    inherited = {"endpoint": p2p.Endpoint()}
    inherited["endpoint"].start_passive_accept()
    target = np.zeros(BLOCK, np.uint8)
    blob = inherited["endpoint"].get_serialized_descs(inherited["endpoint"].register_memory([target]))
    meta = inherited["endpoint"].get_metadata()
    # A Pythonic pair with a receive pending across the fork.
    with tcpx.Endpoint() as a, tcpx.Endpoint() as b:
        got: dict = {}
        th = threading.Thread(target=lambda: got.update(c=a.accept(timeout=20)))
        th.start()
        conn = b.connect(a.metadata)
        th.join(20)
        pending = got["c"].recv_async(np.zeros(64, np.uint8))
        result = run_children(
            (_inherited_child, (inherited, b, pending, meta, blob)),
        )
        assert result == {
            "inherited reg": True,
            "reason": True,
            "pythonic inherited": True,
            "inherited transfer": True,
            "dropped": True,
            "child wrote into the parent": True,
        }
        assert np.array_equal(target, pattern(BLOCK, 41))
        # The parent's own endpoints kept working across the child's life and exit.
        conn.send(np.ones(64, np.uint8), timeout=20)
        assert pending.wait(20) == 64
    inherited["endpoint"].close()


# -- remove_remote_endpoint ----------------------------------------------------------------


@pytest.fixture
def passive_pair():
    a, b = p2p.Endpoint(0), p2p.Endpoint(0)
    assert a.start_passive_accept() and b.start_passive_accept()
    yield a, b
    a.close()
    b.close()


def test_remove_invalid_conn_id(passive_pair):
    a, _ = passive_pair
    assert a.remove_remote_endpoint(999999) is False
    assert p2p.last_error()[0] == "BadArgument"


def test_remove_after_add_then_double_remove(passive_pair):
    a, b = passive_pair
    ok, conn_id = a.add_remote_endpoint(b.get_metadata())
    assert ok
    assert a.remove_remote_endpoint(conn_id) is True
    assert a.remove_remote_endpoint(conn_id) is False


def test_remove_and_readd_gives_a_new_conn_id(passive_pair):
    a, b = passive_pair
    meta = b.get_metadata()
    ok, first = a.add_remote_endpoint(meta)
    assert ok and a.add_remote_endpoint(meta) == (True, first)
    assert a.remove_remote_endpoint(first)
    ok, second = a.add_remote_endpoint(meta)
    assert ok and second != first
    # The new connection moves bytes.
    dst = np.zeros(4096, np.uint8)
    remote = a.deserialize_descs(b.get_serialized_descs(b.register_memory([dst])))
    src = pattern(4096, 51)
    ok, tid = a.transfer(second, "write", a.register_memory([src]), remote)
    while ok and not (r := a.poll_async(tid))[1]:
        ok = r[0]
    assert ok and np.array_equal(dst, src)


def test_remove_then_transfer_fails(passive_pair):
    a, b = passive_pair
    ok, conn_id = a.add_remote_endpoint(b.get_metadata())
    buf = np.ones(256, np.float32)
    local = a.register_memory([buf])
    remote = a.deserialize_descs(b.get_serialized_descs(b.register_memory([np.zeros(256, np.float32)])))
    assert a.remove_remote_endpoint(conn_id)
    with pytest.raises(RuntimeError, match="Invalid conn_id"):
        a.transfer(conn_id, "write", local, remote)
    a.deregister_memory(local)


# -- registration reuse (test_register_memory_cache) -----------------------------------------


def _keys(d) -> tuple:
    return (tuple(d.lkeys), tuple(d.rkeys))


def test_register_same_buffer_twice_shares_keys_not_ids():
    ep = p2p.Endpoint(0)
    t = np.arange(4096, dtype=np.float32)
    d1 = ep.register_memory([t])[0]
    d2 = ep.register_memory([t])[0]
    for d in (d1, d2):
        assert (d.addr, d.size) == (t.ctypes.data, t.nbytes)
        assert len(d.lkeys) == len(d.rkeys) == 9
    assert d1.mr_id != d2.mr_id
    assert _keys(d1) == _keys(d2)
    ep.deregister_memory([d1])
    d3 = ep.register_memory([t])[0]
    assert _keys(d3) == _keys(d2), "the registration lives while a descriptor holds it"
    ep.deregister_memory([d2, d3])
    ep.close()


def test_subregion_shares_partial_overlap_and_disjoint_do_not():
    ep = p2p.Endpoint(0)
    t = np.arange(4096, dtype=np.float32)
    base = ep.register_memory([t])[0]
    sub = ep.register_memory([t[256:1280]])[0]
    assert (sub.addr, sub.size) == (t[256:].ctypes.data, 1024 * 4)
    assert sub.mr_id != base.mr_id and _keys(sub) == _keys(base)
    ep.deregister_memory([base])
    again = ep.register_memory([t[256:1280]])[0]
    assert _keys(again) == _keys(sub)
    ep.deregister_memory([sub, again])

    first = ep.register_memory([t[:1024]])[0]
    overlap = ep.register_memory([t[768:1792]])[0]
    assert first.addr != overlap.addr and _keys(first) != _keys(overlap)
    other = np.arange(4096, dtype=np.float32)
    a, b = ep.register_memory([t]), ep.register_memory([other])
    assert _keys(a[0]) != _keys(b[0])
    ep.close()


def test_reg_twice_then_dereg_one_keeps_the_peer_able_to_write(passive_pair):
    a, b = passive_pair
    ok, conn_id = a.add_remote_endpoint(b.get_metadata())
    dst = np.zeros(8192, np.uint8)
    ok1, mr1 = b.reg(dst.ctypes.data, dst.nbytes)
    ok2, mr2 = b.reg(dst.ctypes.data, dst.nbytes)
    assert ok1 and ok2 and mr1 != mr2
    ok, blob = b.advertise(mr1, dst.ctypes.data, dst.nbytes)
    assert b.dereg(mr1)
    src = pattern(8192, 61)
    ok, smr = a.reg(src.ctypes.data, src.nbytes)
    assert a.write(conn_id, smr, src.ctypes.data, 8192, blob), p2p.last_error()
    assert np.array_equal(dst, src)
    assert b.dereg(mr2)  # the last one: the advertisement is revoked
    assert not a.write(conn_id, smr, src.ctypes.data, 8192, blob)
    assert p2p.last_error()[0] == "AccessRefused"


# -- the descriptor API in detail ----------------------------------------------------------


def test_descriptors_round_trip_and_garbage_is_refused():
    ep = p2p.Endpoint()
    arrays = [np.zeros(100, np.uint8), np.ones(3, np.float64), bytearray(b"abc")]
    descs = ep.register_memory(arrays)
    blob = ep.get_serialized_descs(descs)
    assert isinstance(blob, bytes)
    back = ep.deserialize_descs(blob)
    assert [(d.addr, d.size, d.lkeys, d.rkeys) for d in back] == [(d.addr, d.size, d.lkeys, d.rkeys) for d in descs]
    assert all(d.mr_id == 2**64 - 1 for d in back)
    assert ep.deserialize_descs(ep.get_serialized_descs([])) == []
    assert ep.deserialize_descs(b"") == []
    for bad, words in [(b"\0" * 40, "magic"), (blob[:-1], "checksum"), (blob[:30], "checksum")]:
        with pytest.raises(tcpx.BadArgument, match=words) as e:
            ep.deserialize_descs(bad)
        assert isinstance(e.value, RuntimeError) and isinstance(e.value, ValueError)
    with pytest.raises(tcpx.BadArgument, match="item 1"):
        ep.register_memory([np.zeros(8, np.uint8), object()])
    with pytest.raises(tcpx.BadArgument, match="contiguous"):
        ep.register_memory([np.zeros((4, 4), np.uint8)[:, 1]])
    ep.deregister_memory(descs)
    ep.close()


def test_transfer_refuses_bad_lists_and_reports_bad_keys(passive_pair):
    a, b = passive_pair
    ok, cid = a.add_remote_endpoint(b.get_metadata())
    dst = np.zeros(4096, np.uint8)
    remote = a.deserialize_descs(b.get_serialized_descs(b.register_memory([dst])))
    src = pattern(8192, 71)
    local = a.register_memory([src[:4096]])
    with pytest.raises(RuntimeError, match="same size"):
        a.transfer(cid, "write", local + local, remote)
    with pytest.raises(RuntimeError, match="Invalid op_name"):
        a.transfer(cid, "copy", local, remote)
    with pytest.raises(RuntimeError, match="no mr_id"):
        a.transfer(cid, "write", [p2p.XferDesc(addr=src.ctypes.data, size=16)], remote)
    with pytest.raises(RuntimeError, match="no rkeys"):
        a.transfer(cid, "write", local, [p2p.XferDesc(addr=1, size=16)])

    # Keys that decode but name memory outside the peer's registration: refused here.
    far = p2p.XferDesc(addr=remote[0].addr + 4000, size=4096, rkeys=remote[0].rkeys)
    assert a.transfer(cid, "write", local, [far]) == (False, 0)
    assert "outside" in p2p.last_error()[1]
    # More local bytes than the remote descriptor holds.
    big = a.register_memory([src])
    assert a.transfer(cid, "write", big, remote) == (False, 0)
    # A forged access key: the peer refuses, nothing is written.
    forged = list(remote[0].rkeys)
    forged[5] ^= 0xFFFF
    bad = p2p.XferDesc(addr=remote[0].addr, size=4096, rkeys=forged)
    ok, tid = a.transfer(cid, "write", local, [bad])
    assert ok
    while not (r := a.poll_async(tid))[1]:
        pass
    assert r == (False, True) and p2p.last_error()[0] == "AccessRefused"
    assert not dst.any()
    # Garbage words.
    assert a.transfer(cid, "write", local, [p2p.XferDesc(addr=1, size=1, rkeys=[7] * 9)]) == (False, 0)
    # And a good one still goes through on the same connection.
    ok, tid = a.transfer(cid, "write", local, remote)
    while ok and not (r := a.poll_async(tid))[1]:
        ok = r[0]
    assert ok and np.array_equal(dst, src[:4096])


def test_value_types_and_oob_ip():
    assert [m.name for m in (p2p.kUndefined, p2p.kFloat16, p2p.kBFloat16, p2p.kFloat32, p2p.kFloat8E4M3FN, p2p.kFloat8E5M2)] == [
        "kUndefined", "kFloat16", "kBFloat16", "kFloat32", "kFloat8E4M3FN", "kFloat8E5M2"
    ]
    assert [int(m) for m in (p2p.FloatType.kUndefined, p2p.FloatType.kFloat8E5M2)] == [0, 5]
    assert p2p.FloatType.kBFloat16.value == 2 and p2p.FloatType.kFloat16 == p2p.kFloat16
    d = p2p.XferDesc()
    assert (d.addr, d.size, d.mr_id, d.lkeys, d.rkeys) == (0, 0, 2**64 - 1, [], [])
    d.addr, d.lkeys = 5, [1, 2]
    assert repr(d) == f"<XferDesc addr=5 size=0 mr_id={2**64 - 1}>" and d.lkeys == [1, 2]
    h = p2p.XferHandle(3, "write", 9)
    assert (h.conn_id, h.op_name, h.transfer_id) == (3, "write", 9)
    with pytest.raises(AttributeError):
        h.conn_id = 4
    assert p2p.get_oob_ip() == "127.0.0.1"  # conftest pins TCPX_CONTROL_ADDR

    ep = p2p.Endpoint()
    buf = np.zeros(64, np.uint8)
    for ft in (p2p.FloatType.kUndefined, p2p.FloatType.kBFloat16, p2p.kFloat8E4M3FN):
        ok, mr = ep.reg(buf.ctypes.data, 64, floatType=ft)
        assert ok and ep.dereg(mr)
    with pytest.raises(TypeError):
        ep.reg(buf.ctypes.data, 64, floatType=3)
    assert ep.conn_id_of_rank(0) == 2**64 - 1
    ep.close()
    assert ep.start_passive_accept() is False and p2p.last_error()[0] == "Closed"


# -- same-host CUDA IPC family, without a GPU -----------------------------------------------
# The rendezvous, the connection ids and every refusal work before any CUDA call, so CI
# checks them with an invented GPU bus id (TCPX_GPU_PCI). The copies are in
# uccl_ipc_gpu.py (device machine).


def test_ipc_family_connects_and_refuses_without_a_gpu(monkeypatch):
    import random
    import struct

    bus = f"0000:{random.randint(0x10, 0xfe):02x}:1f.{random.randint(0, 7)}"
    monkeypatch.setenv("TCPX_GPU_PCI", bus)
    monkeypatch.setenv("TCPX_TIMEOUT_MS", "3000")
    a, b = p2p.Endpoint(), p2p.Endpoint()
    ip, port, got_bus = p2p.Endpoint.parse_metadata(a.get_metadata())
    assert (ip, got_bus) == ("127.0.0.1", bus)

    got = {}
    t = threading.Thread(target=lambda: got.update(r=a.accept_local()))
    t.start()
    ok, cid_b = b.connect_local(remote_gpu_bdf=got_bus)
    t.join(30)
    assert ok, p2p.last_error()
    ok, peer_bus, cid_a = got["r"]
    assert ok and peer_bus == bus

    buf = np.zeros(4096, np.uint8)
    # Host memory has no CUDA IPC handle.
    ok, info = a.advertise_ipc(cid_a, buf.ctypes.data, 4096)
    assert not ok and info == bytes(128) and "CUDA" in p2p.last_error()[1]
    ok, infos = a.advertisev_ipc(cid_a, [buf.ctypes.data] * 2, [64, 64])
    assert not ok and infos == [bytes(128)] * 2 and "range 0" in p2p.last_error()[1]
    # Not an info blob.
    assert b.write_ipc(cid_b, buf.ctypes.data, 64, b"x") is False
    assert p2p.last_error()[0] == "BadArgument" and "advertise_ipc blob" in p2p.last_error()[1]
    # Lists of different lengths.
    assert b.writev_ipc(cid_b, [buf.ctypes.data], [64, 64], [b"x"]) is False
    assert "same length" in p2p.last_error()[1]
    # A well-formed descriptor that the peer never issued: refused by the owner.
    forged = (b"TXIP" + bytes([1, 0, 0, 0]) + bytes(64) + struct.pack("<QI", 7, 1) + bytes(4)
              + struct.pack("<QQQQQ", 0, 1 << 20, 0, 4096, 12345))
    assert len(forged) == 128
    for call in (b.write_ipc, b.read_ipc):
        assert call(cid_b, buf.ctypes.data, 64, forged) is False
        assert p2p.last_error()[0] == "AccessRefused", p2p.last_error()
    ok, xid = b.write_ipc_async(cid_b, buf.ctypes.data, 64, forged)
    if ok:  # refused when polled instead
        while True:
            ok, done = b.poll_async(xid)
            if not ok or done:
                break
        assert not ok
    # A network conn id is not a same-host one, and the other way round.
    assert b.write_ipc(cid_b + 100, buf.ctypes.data, 64, forged) is False
    assert "not a same-host connection" in p2p.last_error()[1]
    assert b.send(cid_b, 0, buf.ctypes.data, 64) is False
    # The descriptor API on a local connection wants IPC info (CUDA registrations carry it).
    (desc,) = b.register_memory([buf])
    with pytest.raises(tcpx.BadArgument, match="IPC info"):
        b.transfer(cid_b, "write", [desc], [desc])
    b.deregister_memory([desc])
    # Removing it ends it on both sides.
    assert b.remove_remote_endpoint(cid_b)
    assert b.write_ipc(cid_b, buf.ctypes.data, 64, forged) is False
    a.close()
    b.close()


def test_connect_local_to_nobody_fails_within_the_timeout(monkeypatch):
    import time

    monkeypatch.setenv("TCPX_TIMEOUT_MS", "1000")
    ep = p2p.Endpoint()
    start = time.monotonic()
    ok, _ = ep.connect_local("0000:fe:1f.7")
    assert not ok and time.monotonic() - start < 20
    assert p2p.last_error()[0] in ("PeerLost", "TransferTimeout"), p2p.last_error()
    ok, _ = ep.connect_local("not-a-bus")
    assert not ok and p2p.last_error()[0] == "BadArgument"
    ep.close()


def test_metadata_today_and_older_layouts_and_garbage():
    """UCCL's metadata today carries the GPU's PCI bus id; older peers sent the index."""
    import random
    import socket
    import struct

    v4 = socket.inet_aton("127.0.0.1")
    for bus in ("", "0000:8a:00.0"):
        meta = v4 + struct.pack("!H", 4321) + bytes([len(bus)]) + bus.encode()
        assert p2p.Endpoint.parse_metadata(meta) == ("127.0.0.1", 4321, bus)
    v6 = socket.inet_pton(socket.AF_INET6, "::1")
    meta = v6 + struct.pack("!H", 9) + bytes([12]) + b"0000:8a:00.0"
    assert p2p.Endpoint.parse_metadata(meta) == ("::1", 9, "0000:8a:00.0")
    # Older layout: the index (host order), also when its low byte fits the length rule.
    for gpu in (3, -1, 0):
        meta = v4 + struct.pack("!H", 4321) + struct.pack("=i", gpu)
        assert p2p.Endpoint.parse_metadata(meta) == ("127.0.0.1", 4321, str(gpu))
    rng = random.Random(7)
    for _ in range(2000):
        junk = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 40)))
        try:
            ip, port, gpu = p2p.Endpoint.parse_metadata(junk)
            assert isinstance(gpu, str) and 0 <= port < 65536
        except ValueError:
            pass
