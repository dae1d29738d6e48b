"""CUDA tensors through both layers (skipped without torch or a GPU). With the built-in
socket plugin, CUDA memory is staged through pinned host memory by the engines; with TCPX it
goes to the plugin directly."""

import threading

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import tcpx  # noqa: E402
from tcpx import p2p  # noqa: E402


def test_p2p_cuda_tensors_send_recv_write_read():
    a, b = p2p.Endpoint(local_gpu_idx=0), p2p.Endpoint(local_gpu_idx=0)
    ip, port, gpu = p2p.Endpoint.parse_metadata(a.get_metadata())
    got = {}
    t = threading.Thread(target=lambda: got.update(r=a.accept()))
    t.start()
    ok, cid = b.connect(ip, gpu, remote_port=port)
    t.join()
    scid = got["r"][3]
    n = 8 << 20
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros(n, dtype=torch.uint8, device="cuda:0")
    ok, smr = b.reg(src.data_ptr(), n)
    assert ok, p2p.last_error()
    ok, dmr = a.reg(dst.data_ptr(), n)
    assert ok, p2p.last_error()
    ok, tid = a.recv_async(scid, dmr, dst.data_ptr(), n)
    assert ok and b.send(cid, smr, src.data_ptr(), n)
    done = False
    while not done:
        ok, done = a.poll_async(tid)
        assert ok, p2p.last_error()
    torch.cuda.synchronize()
    assert torch.equal(src, dst)
    ok, blob = a.advertise(scid, dmr, dst.data_ptr(), n)
    src.fill_(7)
    assert b.write(cid, smr, src.data_ptr(), n, blob), p2p.last_error()
    torch.cuda.synchronize()
    assert bool((dst == 7).all())
    back = torch.zeros(n, dtype=torch.uint8, device="cuda:0")
    ok, bmr = b.reg(back.data_ptr(), n)
    assert b.read(cid, bmr, back.data_ptr(), n, blob)
    torch.cuda.synchronize()
    assert bool((back == 7).all())
    a.close()
    b.close()


def test_pythonic_cuda_tensors():
    with tcpx.Endpoint(gpu=0) as a, tcpx.Endpoint(gpu=0) as b:
        got = {}
        t = threading.Thread(target=lambda: got.update(c=a.accept(timeout=20)))
        t.start()
        conn = b.connect(a.metadata)
        t.join()
        src = torch.arange(1 << 20, dtype=torch.float32, device="cuda:0")
        dst = torch.zeros_like(src)
        rx = got["c"].recv_async(dst)
        conn.send(src, timeout=30)
        rx.wait(30)
        torch.cuda.synchronize()
        assert torch.equal(src, dst)
        host = torch.zeros(1 << 20, dtype=torch.float32)  # CPU tensor, straight in
        rx = got["c"].recv_async(host)
        conn.send(src.cpu(), timeout=30)
        rx.wait(30)
        assert torch.equal(host, src.cpu())


def _wait(ep, tid) -> bool:
    while True:
        ok, done = ep.poll_async(tid)
        if not ok or done:
            return ok


def test_p2p_descriptor_api_cuda_tensors_both_ways():
    """register_memory / serialized descriptors / transfer write and read with CUDA tensors
    (blocks of one pool tensor on each side, scattered), every byte checked."""
    target, initiator = p2p.Endpoint(0), p2p.Endpoint(0)
    assert target.start_passive_accept()
    ok, cid = initiator.add_remote_endpoint(target.get_metadata())
    assert ok, p2p.last_error()
    block = 16 << 10
    pool = torch.zeros(64 * block, dtype=torch.uint8, device="cuda:0")
    base = target.register_memory([pool])
    idx = [5, 0, 63, 17, 30, 31, 2, 48]
    blocks = [pool[i * block : (i + 1) * block] for i in idx]
    remote = initiator.deserialize_descs(target.get_serialized_descs(target.register_memory(blocks)))
    assert all(d.rkeys == base[0].rkeys for d in remote), "views share the pool's registration"
    src = torch.randint(0, 255, (len(idx) * block,), dtype=torch.uint8, device="cuda:0")
    local = initiator.register_memory([src[i * block : (i + 1) * block] for i in range(len(idx))])
    torch.cuda.synchronize()
    ok, tid = initiator.transfer(cid, "write", local, remote)
    assert ok and _wait(initiator, tid), p2p.last_error()
    torch.cuda.synchronize()
    for k, i in enumerate(idx):
        assert torch.equal(pool[i * block : (i + 1) * block], src[k * block : (k + 1) * block])
    others = [j for j in range(64) if j not in idx]
    assert all(not pool[j * block : (j + 1) * block].any() for j in others)
    back = torch.zeros_like(src)
    into = initiator.register_memory([back[i * block : (i + 1) * block] for i in range(len(idx))])
    ok, tid = initiator.transfer(cid, "read", into, remote)
    assert ok and _wait(initiator, tid), p2p.last_error()
    torch.cuda.synchronize()
    assert torch.equal(back, src)
    # A bf16 tensor with its FloatType: accepted, bytes unchanged (no compression).
    bf = torch.randn(4096, device="cuda:0").to(torch.bfloat16)
    ok, mr = initiator.reg(bf.data_ptr(), bf.numel() * 2, floatType=p2p.FloatType.kBFloat16)
    assert ok and initiator.dereg(mr)
    initiator.close()
    target.close()


def test_uccl_fork_children_cuda_tensors():
    """tests/uccl_fork_gpu.py in a fresh interpreter: this process initialised CUDA, which
    a forked child could not use."""
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "uccl_fork_gpu.py")
    out = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=600)
    print(out.stdout, out.stderr)
    if out.returncode == 77:
        pytest.skip(out.stdout.strip())
    assert out.returncode == 0, out.stdout + out.stderr
