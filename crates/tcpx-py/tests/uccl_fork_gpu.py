"""UCCL's test_engine_write / test_engine_read and the descriptor API with torch CUDA tensors,
between two children of multiprocessing's *fork* start method (run by test_gpu.py in a fresh
interpreter, or directly: ``python tests/uccl_fork_gpu.py``).

CUDA cannot be used in a child forked from a process that initialised it, so this parent
never does: it asks NVML whether there is a GPU (PYTORCH_NVML_BASED_CUDA_CHECK) and leaves
every CUDA call to the children. Exit status 0: every check passed; 77: no torch or no GPU;
anything else: a failure (printed).
"""

from __future__ import annotations

import os
import sys
import traceback

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
for k, v in {
    "TCPX_SOCKET_IFNAME": "lo",
    "NCCL_SOCKET_IFNAME": "lo",
    "TCPX_CONTROL_ADDR": "127.0.0.1:0",
    "TCPX_TIMEOUT_MS": "30000",
}.items():
    os.environ.setdefault(k, v)

import multiprocessing as mp  # noqa: E402

try:
    import torch  # noqa: E402
except ImportError:
    print("skip: torch is not installed")
    sys.exit(77)

from tcpx import p2p  # noqa: E402

FORK = mp.get_context("fork")
N = 8 << 20  # bytes per tensor
BLOCK = 16 << 10


def pattern(n: int, seed: int) -> "torch.Tensor":
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).cuda()


def wait(ep, tid) -> bool:
    while True:
        ok, done = ep.poll_async(tid)
        if not ok or done:
            return ok


def one_sided_initiator(meta_q, fifo_q, read, report):
    ip, port, r_gpu = p2p.Endpoint.parse_metadata(meta_q.recv())
    ep = p2p.Endpoint(local_gpu_idx=0)
    ok, conn_id = ep.connect(ip, r_gpu, remote_port=port)
    assert ok, p2p.last_error()
    tensor = torch.zeros(N, dtype=torch.uint8, device="cuda:0") if read else pattern(N, 1)
    torch.cuda.synchronize()
    ok, mr_id = ep.reg(tensor.data_ptr(), N, floatType=p2p.FloatType.kUndefined)
    assert ok, p2p.last_error()
    fifo = fifo_q.recv()
    call = ep.read if read else ep.write
    ok = call(conn_id, mr_id, tensor.data_ptr(), N, fifo)
    torch.cuda.synchronize()
    if read:
        report("read", ok and torch.equal(tensor, pattern(N, 2)))
    else:
        report("write", ok)
    fifo_q.send("done")
    ep.close()


def one_sided_target(meta_q, fifo_q, read, report):
    ep = p2p.Endpoint(local_gpu_idx=0)
    meta_q.send(bytes(ep.get_metadata()))
    ok, _, _, conn_id = ep.accept()
    assert ok, p2p.last_error()
    tensor = pattern(N, 2) if read else torch.zeros(N, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    ok, mr_id = ep.reg(tensor.data_ptr(), N)
    assert ok, p2p.last_error()
    ok, blob = ep.advertise(mr_id, tensor.data_ptr(), N)
    assert ok and len(blob) == 64
    fifo_q.send(bytes(blob))
    assert fifo_q.poll(60) and fifo_q.recv() == "done"
    if not read:
        torch.cuda.synchronize()
        report("written", torch.equal(tensor, pattern(N, 1)))
    ep.close()


def descs_target(pipe, report):
    ep = p2p.Endpoint(0)
    assert ep.start_passive_accept()
    pool = torch.zeros(64 * BLOCK, dtype=torch.uint8, device="cuda:0")
    base = ep.register_memory([pool])
    blocks = [pool[i * BLOCK : (i + 1) * BLOCK] for i in range(1, 64, 4)]
    descs = ep.register_memory(blocks)
    report("blocks share the pool's keys", all(d.rkeys == base[0].rkeys for d in descs))
    pipe.send((ep.get_metadata(), ep.get_serialized_descs(descs)))
    assert pipe.poll(60) and pipe.recv() == "written"
    torch.cuda.synchronize()
    want = pattern(16 * BLOCK, 3)
    report("descs written", all(torch.equal(b, want[i * BLOCK : (i + 1) * BLOCK]) for i, b in enumerate(blocks)))
    pipe.send("checked")
    assert pipe.poll(60) and pipe.recv() == "read"
    ep.deregister_memory(descs + base)
    ep.close()


def descs_initiator(pipe, report):
    ep = p2p.Endpoint(0)
    meta, blob = pipe.recv()
    ok, conn_id = ep.add_remote_endpoint(meta)
    assert ok, p2p.last_error()
    remote = ep.deserialize_descs(blob)
    data = pattern(16 * BLOCK, 3)
    torch.cuda.synchronize()
    local = ep.register_memory([data[i * BLOCK : (i + 1) * BLOCK] for i in range(16)])
    ok, tid = ep.transfer(conn_id, "write", local, remote)
    report("transfer write", ok and wait(ep, tid))
    pipe.send("written")
    assert pipe.poll(60) and pipe.recv() == "checked"
    back = torch.zeros(16 * BLOCK, dtype=torch.uint8, device="cuda:0")
    into = ep.register_memory([back[i * BLOCK : (i + 1) * BLOCK] for i in range(16)])
    ok, tid = ep.transfer(conn_id, "read", into, remote)
    ok = ok and wait(ep, tid)
    torch.cuda.synchronize()
    report("transfer read", ok and torch.equal(back, data))
    pipe.send("read")
    ep.close()


def run(*targets):
    results = FORK.Queue()
    procs = []
    for target, args in targets:
        def body(target=target, args=args):
            try:
                target(*args, lambda k, v: results.put((k, v)))
            except BaseException:
                results.put(("error in " + target.__name__, traceback.format_exc()))
                raise

        procs.append(FORK.Process(target=body, daemon=True))
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    for p in procs:
        if p.is_alive():
            p.kill()
    got = {}
    while True:
        try:
            k, v = results.get(timeout=0.5)
        except Exception:
            break
        got[k] = v
    return got, [p.exitcode for p in procs]


def main() -> int:
    if not torch.cuda.is_available():  # NVML: does not initialise CUDA here
        print("skip: no CUDA device")
        return 77
    failures = 0
    cases = {
        "write": ((one_sided_initiator, False), (one_sided_target, False)),
        "read": ((one_sided_initiator, True), (one_sided_target, True)),
    }
    for name, ((f1, read), (f2, _)) in cases.items():
        a, b = FORK.Pipe()
        c, d = FORK.Pipe()
        got, codes = run((f1, (a, c, read)), (f2, (b, d, read)))
        good = codes == [0, 0] and got and all(v is True for v in got.values())
        print(f"{name}: {'ok' if good else 'FAILED'} {got} exit codes {codes}")
        failures += not good
    a, b = FORK.Pipe()
    got, codes = run((descs_target, (a,)), (descs_initiator, (b,)))
    good = codes == [0, 0] and len(got) == 4 and all(v is True for v in got.values())
    print(f"descriptor API: {'ok' if good else 'FAILED'} {got} exit codes {codes}")
    failures += not good
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
