"""Two NIXL agents in two processes, driven from a third: shared by the agent test and the
comparison benchmark.

The orchestrating process imports nothing from NIXL. Each agent runs in its own child process
(`python harness.py --child ADDR`), so that each can get its own environment: NIXL reads
NIXL_PLUGIN_DIR once per process, and the wheel's UCX plugin only loads from NIXL's default
directory. Commands, NIXL metadata and serialized descriptor lists travel between the processes
over a socket on 127.0.0.1 (multiprocessing.connection, authenticated).

Memory: "DRAM" is a numpy buffer; "VRAM" is CUDA device memory allocated through the CUDA
driver API with ctypes (no extra Python package); `cuda_available()` says whether it exists.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import subprocess
import sys
import time
from multiprocessing.connection import Client, Listener

HERE = os.path.dirname(os.path.abspath(__file__))

# --------------------------------------------------------------------------------------------
# Orchestrator side
# --------------------------------------------------------------------------------------------


class RemoteError(RuntimeError):
    """A command failed inside an agent process; the message carries its exception."""


def _die_with_parent():
    """In a child before exec: SIGKILL it when the orchestrator dies, even by SIGKILL (a time
    limit), so no agent process outlives its test (Linux prctl PR_SET_PDEATHSIG). An agent
    orphaned mid-command could otherwise hang in NIXL's teardown, e.g. joining an etcd watcher
    whose etcd is gone."""
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # 1: PR_SET_PDEATHSIG


class Peer:
    """One agent in a child process. `call(cmd, ...)` runs a command there and returns its
    result (raising RemoteError with the child's exception text on failure)."""

    def __init__(self, name, backend, params=None, env=None, mem="DRAM", timeout=60):
        self.name = name
        key = secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=key)
        child_env = dict(os.environ)
        child_env.update(env or {})
        child_env["TCPX_HARNESS_KEY"] = key.hex()
        host, port = self._listener.address
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "harness.py"), "--child", f"{host}:{port}"],
            env=child_env,
            preexec_fn=_die_with_parent,
        )
        self._listener._listener._socket.settimeout(timeout)
        try:
            self.conn = self._listener.accept()
        except Exception as e:
            self.proc.kill()
            raise RuntimeError(f"agent process {name} did not call back: {e}") from e
        self.call("init", name, backend, params or {}, mem)

    def call(self, cmd, *args, timeout=120):
        self.send(cmd, *args)
        return self.result(cmd, timeout)

    def send(self, cmd, *args):
        """Starts a command without waiting (pair with `result`), e.g. to run two agents'
        commands at the same moment."""
        self.conn.send((cmd, args))

    def result(self, cmd, timeout=120):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"agent {self.name}: command {cmd} took more than {timeout} s")
        ok, value = self.conn.recv()
        if not ok:
            raise RemoteError(f"agent {self.name}: {cmd}: {value}")
        return value

    def kill(self):
        self.proc.kill()
        self.proc.wait(10)

    def close(self):
        if self.proc.poll() is None:
            try:
                self.conn.send(("exit", ()))
                self.proc.wait(20)
            except Exception:
                self.proc.kill()
                self.proc.wait(10)
        self._listener.close()


def blocks(count, size, stride=None, shuffle_seed=None):
    """`count` (offset, len) blocks of `size` bytes, `stride` apart (default: contiguous),
    optionally in a shuffled order (so the remote side is not a copy of the local layout)."""
    stride = stride or size
    out = [(i * stride, size) for i in range(count)]
    if shuffle_seed is not None:
        import random

        random.Random(shuffle_seed).shuffle(out)
    return out


def span(block_list):
    return max(off + ln for off, ln in block_list)


# --------------------------------------------------------------------------------------------
# CUDA through the driver API (VRAM variants)
# --------------------------------------------------------------------------------------------


class _Cuda:
    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self._check(self.lib.cuInit(0), "cuInit")
        n = ctypes.c_int(0)
        self._check(self.lib.cuDeviceGetCount(ctypes.byref(n)), "cuDeviceGetCount")
        if n.value < 1:
            raise RuntimeError("no CUDA device")
        dev = ctypes.c_int(0)
        self._check(self.lib.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
        ctx = ctypes.c_void_p()
        self._check(
            self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain"
        )
        self._check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    @staticmethod
    def _check(rc, what):
        if rc != 0:
            raise RuntimeError(f"{what} failed: CUDA error {rc}")

    def alloc(self, n):
        p = ctypes.c_uint64(0)
        self._check(self.lib.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n)), "cuMemAlloc")
        return p.value

    def free(self, p):
        self.lib.cuMemFree_v2(ctypes.c_uint64(p))

    def htod(self, dst, host):
        self._check(
            self.lib.cuMemcpyHtoD_v2(
                ctypes.c_uint64(dst), host.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(host.nbytes)
            ),
            "cuMemcpyHtoD",
        )

    def dtoh(self, host, src):
        self._check(
            self.lib.cuMemcpyDtoH_v2(
                host.ctypes.data_as(ctypes.c_void_p), ctypes.c_uint64(src), ctypes.c_size_t(host.nbytes)
            ),
            "cuMemcpyDtoH",
        )


def nixl_api():
    """NIXL's agent classes from the wheel named by TCPX_NIXL_MODULE: nixl_cu12 (the default)
    or nixl_cu13 (CUDA 13 machines, whose UCX registers VRAM there); both are NIXL 1.5.1."""
    import importlib

    module = importlib.import_module(os.environ.get("TCPX_NIXL_MODULE", "nixl_cu12"))
    return module.nixl_agent, module.nixl_agent_config


def cuda_available():
    """True when a CUDA driver and at least one device are present."""
    try:
        _Cuda()
        return True
    except Exception:
        return False


def ucx_tls(gpu_memory):
    """UCX transports for NIXL's UCX backend on loopback: TCP and self, plus cuda_copy for GPU
    memory or wherever a GPU is present (NIXL 1.5.1's UCX backend refuses to start without a
    CUDA transport on a machine with NVIDIA GPUs, even for host memory)."""
    return "tcp,cuda_copy,self" if gpu_memory or cuda_available() else "tcp,self"


# --------------------------------------------------------------------------------------------
# Agent side (child process)
# --------------------------------------------------------------------------------------------


class Agent:
    """The commands an agent process serves. Buffers are named; each is one registration."""

    def __init__(self):
        self.agent = None
        self.bufs = {}  # name -> (host numpy array or None, address, length)
        self.regs = {}
        self.notifs = {}  # sender -> [bytes], notifications seen but not yet taken
        self.pending = {}  # handle id -> (handle, started)
        self.next_id = 0
        self.cuda = None

    # -- setup --------------------------------------------------------------------------------
    def init(self, name, backend, params, mem):
        nixl_agent, nixl_agent_config = nixl_api()

        self.np = __import__("numpy")
        self.mem = mem
        if mem == "VRAM":
            self.cuda = _Cuda()
        self.agent = nixl_agent(name, nixl_agent_config(backends=[]))
        self.agent.create_backend(backend, {k: str(v) for k, v in params.items()})
        self.backend = backend
        return True

    def metadata(self):
        return self.agent.get_agent_metadata()

    def destroy_agent(self):
        """Deregisters everything and drops the NIXL agent (its backend engine is destroyed
        with it), keeping the process: what an application tearing an agent down does."""
        for key in list(self.regs):
            self.agent.deregister_memory(self.regs.pop(key))
        for h, _ in self.pending.values():
            self.agent.release_xfer_handle(h)
        self.pending.clear()
        self.agent = None  # the last reference: NIXL destroys the agent and its engines now
        return True

    def add_remote(self, md):
        name = self.agent.add_remote_agent(md)
        return name.decode() if isinstance(name, bytes) else name

    def connect(self, name):
        self.agent.make_connection(name)
        return True

    def remove_remote(self, name):
        self.agent.remove_remote_agent(name)
        return True

    # -- NIXL's central metadata store (etcd, when NIXL_ETCD_ENDPOINTS is set) ---------------
    def send_local_md(self):
        """Publishes this agent's metadata (a snapshot: its registrations now) to the store."""
        self.agent.send_local_metadata()
        return True

    def fetch_remote_md(self, name):
        """Asks NIXL to load `name`'s metadata from the store (asynchronous: NIXL's metadata
        thread fetches, or watches until it appears; `wait_remote_md` sees the outcome)."""
        self.agent.fetch_remote_metadata(name)
        return True

    def check_remote_md(self, name):
        return self.agent.check_remote_metadata(name)

    def wait_remote_md(self, name, present, timeout):
        """Polls `check_remote_metadata(name)` until it is `present`; returns the seconds it
        took, or raises TimeoutError saying what it saw."""
        start = time.monotonic()
        while self.agent.check_remote_metadata(name) != present:
            if time.monotonic() - start > timeout:
                raise TimeoutError(
                    f"agent {self.agent.name}: metadata of {name!r} still "
                    f"{'absent' if present else 'present'} after {timeout} s")
            time.sleep(0.01)
        return time.monotonic() - start

    def invalidate_local_md(self):
        """Removes this agent's metadata from the store (peers watching it drop it)."""
        self.agent.invalidate_local_metadata()
        return True

    def pattern(self, seed, n):
        return self.np.random.default_rng(seed).integers(0, 256, size=n, dtype=self.np.uint8)

    def alloc(self, key, nbytes, seed=None):
        """A registered buffer of `nbytes`, filled from `seed` (zeros without one)."""
        np = self.np
        host = self.pattern(seed, nbytes) if seed is not None else np.zeros(nbytes, np.uint8)
        if self.mem == "VRAM":
            addr = self.cuda.alloc(nbytes)
            self.cuda.htod(addr, host)
            self.bufs[key] = (None, addr, nbytes)
        else:
            self.bufs[key] = (host, host.ctypes.data, nbytes)
        dev = 0
        self.regs[key] = self.agent.register_memory([(self.bufs[key][1], nbytes, dev, "")], self.mem)
        return True

    def register_again(self, key):
        """Registers buffer `key` a second time (NIXL accepts it; the backend counts it)."""
        _, addr, n = self.bufs[key]
        self.regs[key + "/again"] = self.agent.register_memory([(addr, n, 0, "")], self.mem)
        return True

    def deregister_again(self, key):
        self.agent.deregister_memory(self.regs.pop(key + "/again"))
        return True

    def free(self, key):
        self.agent.deregister_memory(self.regs.pop(key))
        host, addr, _ = self.bufs.pop(key)
        if host is None:
            self.cuda.free(addr)
        return True

    def fill(self, key, seed):
        host, addr, n = self.bufs[key]
        data = self.pattern(seed, n)
        if host is None:
            self.cuda.htod(addr, data)
        else:
            host[:] = data
        return True

    def contents(self, key):
        host, addr, n = self.bufs[key]
        if host is not None:
            return host
        out = self.np.empty(n, self.np.uint8)
        self.cuda.dtoh(out, addr)
        return out

    def descs(self, key, block_list, serialized=True):
        _, addr, _ = self.bufs[key]
        d = self.agent.get_xfer_descs([(addr + off, ln, 0) for off, ln in block_list], self.mem)
        return self.agent.get_serialized_descs(d) if serialized else d

    # -- checks -------------------------------------------------------------------------------
    def verify(self, key, block_list, src_seed, src_len, src_blocks):
        """Counts blocks whose bytes differ: block i of `block_list` in buffer `key` must equal
        block i of `src_blocks` in the pattern `src_seed` of `src_len` bytes."""
        data = self.contents(key)
        src = self.pattern(src_seed, src_len)
        bad = 0
        for (off, ln), (soff, sln) in zip(block_list, src_blocks):
            assert ln == sln
            if not self.np.array_equal(data[off : off + ln], src[soff : soff + ln]):
                bad += 1
        return bad

    def _poll(self):
        for sender, msgs in self.agent.get_new_notifs().items():
            self.notifs.setdefault(sender, []).extend(msgs)

    def wait_notif(self, sender, msg, timeout):
        """Waits for notification `msg` from `sender`; True once it arrived."""
        deadline = time.monotonic() + timeout
        while True:
            self._poll()
            got = self.notifs.get(sender, [])
            if msg in got:
                got.remove(msg)
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0005)

    def take_notifs(self, sender, count, timeout):
        """The next `count` notifications from `sender`, in arrival order (fewer on timeout)."""
        deadline = time.monotonic() + timeout
        while len(self.notifs.get(sender, [])) < count and time.monotonic() < deadline:
            self._poll()
            time.sleep(0.0005)
        got = self.notifs.get(sender, [])
        out, self.notifs[sender] = got[:count], got[count:]
        return out

    def send_notif(self, remote, msg):
        self.agent.send_notif(remote, msg)
        return True

    # -- transfers ----------------------------------------------------------------------------
    def start(self, op, key, block_list, remote_descs, remote, notif=None):
        local = self.descs(key, block_list, serialized=False)
        rd = self.agent.deserialize_descs(remote_descs)
        h = self.agent.initialize_xfer(op, local, rd, remote, notif or b"")
        try:
            state = self.agent.transfer(h)
        except Exception:  # the binding raises on error statuses
            state = "ERR"
        if state == "ERR":
            self.agent.release_xfer_handle(h)
            raise RuntimeError(f"{op} to {remote}: transfer() returned ERR")
        self.next_id += 1
        hid = self.next_id
        self.pending[hid] = (h, time.monotonic())
        return hid

    def wait(self, hid, timeout):
        """Waits for a started transfer: ("DONE"|"ERR"|"PROC", seconds since it started)."""
        h, started = self.pending[hid]
        deadline = time.monotonic() + timeout
        state = "PROC"
        while state == "PROC":
            try:
                state = self.agent.check_xfer_state(h)
            except Exception:  # the binding raises on error statuses
                state = "ERR"
            if time.monotonic() > deadline:
                break
        elapsed = time.monotonic() - started
        if state != "PROC":
            del self.pending[hid]
            self.agent.release_xfer_handle(h)
        return state, elapsed

    def xfer(self, op, key, block_list, remote_descs, remote, notif=None, timeout=60):
        hid = self.start(op, key, block_list, remote_descs, remote, notif)
        state, _ = self.wait(hid, timeout)
        if state != "DONE":
            raise RuntimeError(f"{op} to {remote} ended {state}")
        return True

    def bench(self, op, key, block_list, remote_descs, remote, iters, warmup=2, notif=b""):
        """`iters` back-to-back transfers of the list, one prepared request reposted (as
        nixlbench and vLLM's connector do), after `warmup` untimed ones; each carries
        notification `notif` when given. Returns {"gbps": GB/s (10^9 bytes/s) of the timed
        ones, "first_ms": the very first transfer (the list's and the regions' first use on
        this connection), "p50_ms": the median timed transfer, "p99_ms" / "max_ms": its
        tail, "posted": transfers made}."""
        local = self.agent.prep_xfer_dlist("", self.descs(key, block_list, serialized=False), self.mem)
        rd = self.agent.deserialize_descs(remote_descs)
        remote_h = self.agent.prep_xfer_dlist(remote, rd, self.mem)
        idx = list(range(len(block_list)))
        h = self.agent.make_prepped_xfer(op, local, idx, remote_h, idx, notif)
        total = sum(ln for _, ln in block_list)

        def once():
            t0 = time.perf_counter()
            state = self.agent.transfer(h)
            while state == "PROC":
                state = self.agent.check_xfer_state(h)
            if state != "DONE":
                raise RuntimeError(f"bench {op}: {state}")
            return time.perf_counter() - t0

        first = once()
        for _ in range(warmup - 1):
            once()
        times = []
        t = time.perf_counter()
        for _ in range(iters):
            times.append(once())
        dt = time.perf_counter() - t
        self.agent.release_xfer_handle(h)
        self.agent.release_dlist_handle(local)
        self.agent.release_dlist_handle(remote_h)
        times.sort()
        return {"gbps": total * iters / dt / 1e9, "first_ms": first * 1e3,
                "p50_ms": times[len(times) // 2] * 1e3,
                "p99_ms": times[min(len(times) - 1, len(times) * 99 // 100)] * 1e3,
                "max_ms": times[-1] * 1e3, "posted": max(warmup, 1) + iters}

    def count_notifs(self, sender, msg, count, timeout):
        """Takes notifications `msg` from `sender` until `count` arrived (or the timeout);
        returns how many did."""
        deadline = time.monotonic() + timeout
        got = 0
        while True:
            self._poll()
            msgs = self.notifs.get(sender, [])
            got += msgs.count(msg)
            self.notifs[sender] = [m for m in msgs if m != msg]
            if got >= count or time.monotonic() > deadline:
                return got
            time.sleep(0.001)


def child_main(addr):
    host, port = addr.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["TCPX_HARNESS_KEY"]))
    agent = Agent()
    while True:
        try:
            cmd, args = conn.recv()
        except EOFError:
            return
        if cmd == "exit":
            conn.close()
            return
        try:
            conn.send((True, getattr(agent, cmd)(*args)))
        except Exception as e:  # report to the orchestrator, keep serving
            conn.send((False, f"{type(e).__name__}: {e}"))


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--child":
    child_main(sys.argv[2])
