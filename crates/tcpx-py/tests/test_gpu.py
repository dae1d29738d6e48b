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
