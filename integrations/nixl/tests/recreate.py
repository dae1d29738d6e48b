"""NIXL agent re-creation loop, shaped like UCCL's p2p/benchmarks/benchmark_nixl.py.

That script makes a new agent pair ("server", "client": the same names every time) per message
size, each with NIXL's own metadata listener (`nixl_agent_config(True, True, port)`); the client
fetches the server's metadata and sends its own to the server's listener on a fixed port, the
server answers with its serialized descriptors as a notification, the client WRITEs (or READs)
with the notification "TRANSFER", and the server waits for it. This loop does the same, with
every wait bounded, per-step timings, and the first transfers of each pair timed one by one:

    NIXL_PLUGIN_DIR=target/nixl/plugins target/nixl/venv/bin/python \\
        integrations/nixl/tests/recreate.py --backend TCPX --iterations 100

Options: `--backend TCPX|UCX` (UCX runs without NIXL_PLUGIN_DIR, `UCX_TLS=tcp,self
UCX_NET_DEVICES=lo`, plus `cuda_copy` for VRAM), `--memory DRAM|VRAM` (VRAM: CUDA device memory
through the driver API; SKIP without a driver or device), `--size`, `--blocks`, `--transfers`
(transfers per agent pair, each re-fetching metadata as the script does; `--exchange once`:
metadata once per pair, then the transfers back to back), `--op WRITE|READ`.

`--sync pair` (default): a new pair starts once both sides tore the previous one down and the new
server agent listens, i.e. what a correct application does. `--sync none`: both processes loop on
their own, as benchmark_nixl.py does; the client may then dial the server's port while the
previous server agent is still being torn down or the next one is not listening yet (NIXL's P2P
metadata backend connects once, logs "P2P backend could not connect" and never retries, and the
script waits forever for the answer). Use it to show that race with either backend.

Every wait of the agents (metadata, notifications, transfer state) gives up after `--timeout`
seconds and is reported as a STALL naming the side, the pair, the transfer and the step; a NIXL
call that itself never returns is caught by the orchestrator (each child dumps its Python stack
on SIGUSR1 into its log). Exit status: 0 when every pair completed, 1 on a stall or an error,
77 on SKIP (VRAM without CUDA).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Client, Listener

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

KiB, MiB = 1 << 10, 1 << 20
SKIP = 77
UID = b"TRANSFER"


# --------------------------------------------------------------------------------------------
# Agent side (one child process per role)
# --------------------------------------------------------------------------------------------


class Stall(Exception):
    """A bounded wait ran out: the step it was in, for the report."""


class Side:
    """One role ("server" or "client") of the loop, in its own process."""

    def __init__(self, conn, args):
        self.conn = conn
        self.args = args
        self.role = args.role
        self.peer = "client" if self.role == "server" else "server"
        self.np = __import__("numpy")
        self.cuda = None
        if args.memory == "VRAM":
            from harness import _Cuda

            self.cuda = _Cuda()
        from harness import nixl_api

        self.nixl_agent, self.nixl_agent_config = nixl_api()

    def step(self, pair, what):
        """Tells the orchestrator where this side is (shown when a call never returns)."""
        self.conn.send(("step", pair, what))

    def wait(self, pair, what, cond):
        deadline = time.monotonic() + self.args.timeout
        while not cond():
            if time.monotonic() > deadline:
                raise Stall(f"{self.role} pair {pair}: {what}: nothing after {self.args.timeout:.0f} s")
            time.sleep(0.0002)

    # -- memory ---------------------------------------------------------------------------
    def alloc(self):
        a = self.args
        per = a.size // a.blocks
        value = 0 if self.role == "server" else 1
        bufs = []
        for _ in range(a.blocks):
            host = self.np.full(per, value, self.np.uint8)
            if self.cuda:
                addr = self.cuda.alloc(per)
                self.cuda.htod(addr, host)
                bufs.append((None, addr, per))
            else:
                bufs.append((host, host.ctypes.data, per))
        return bufs

    def free(self, bufs):
        for host, addr, _ in bufs:
            if host is None:
                self.cuda.free(addr)

    def check(self, bufs):
        """The server's blocks must hold the client's value (1) after WRITEs."""
        for i, (host, addr, n) in enumerate(bufs):
            if host is None:
                host = self.np.empty(n, self.np.uint8)
                self.cuda.dtoh(host, addr)
            if not (host == 1).all():
                raise AssertionError(f"server block {i} does not hold the client's bytes")

    # -- one agent pair -------------------------------------------------------------------
    def pair(self, i):
        a = self.args
        rec = {"pair": i, "role": self.role, "transfers_ms": [], "steps_ms": {}}
        t = time.perf_counter()

        def lap(name):
            nonlocal t
            now = time.perf_counter()
            rec["steps_ms"][name] = round((now - t) * 1e3, 3)
            t = now

        self.step(i, "create agent")
        port = a.port if self.role == "server" else 0
        cfg = self.nixl_agent_config(True, True, port, backends=[a.backend])
        agent = self.nixl_agent(self.role, cfg)
        lap("create")
        bufs = self.alloc()
        self.step(i, "register memory")
        reg = agent.register_memory([(addr, n, 0, "") for _, addr, n in bufs], a.memory)
        lap("register")
        if self.role == "server":
            self.conn.send(("listening", i))
        handle = None
        local = agent.get_xfer_descs([(addr, n, 0) for _, addr, n in bufs], a.memory)
        try:
            for k in range(a.transfers):
                again = k == 0 or a.exchange == "every"
                if self.role == "server" and not again:
                    self.step(i, f"transfer {k}: wait for the TRANSFER notification")
                    self.wait(i, f"transfer {k}: the TRANSFER notification",
                              lambda: agent.check_remote_xfer_done("client", UID))
                    rec["transfers_ms"].append(round((time.perf_counter() - t) * 1e3, 3))
                    t = time.perf_counter()
                elif self.role == "server":
                    self.step(i, f"transfer {k}: wait for the client's metadata")
                    self.wait(i, f"transfer {k}: the client's metadata",
                              lambda: agent.check_remote_metadata("client"))
                    if k == 0:
                        lap("metadata")
                    self.step(i, f"transfer {k}: send descriptors")
                    agent.send_notif("client", agent.get_serialized_descs(local))
                    self.step(i, f"transfer {k}: wait for the TRANSFER notification")
                    self.wait(i, f"transfer {k}: the TRANSFER notification",
                              lambda: agent.check_remote_xfer_done("client", UID))
                    rec["transfers_ms"].append(round((time.perf_counter() - t) * 1e3, 3))
                    t = time.perf_counter()
                else:
                    if again:
                        self.step(i, f"transfer {k}: fetch and send metadata")
                        agent.fetch_remote_metadata("server", "127.0.0.1", a.port)
                        agent.send_local_metadata("127.0.0.1", a.port)
                        got = {}

                        def descs_arrived():
                            for sender, msgs in agent.get_new_notifs().items():
                                got.setdefault(sender, []).extend(msgs)
                            return bool(got.get("server"))

                        self.step(i, f"transfer {k}: wait for the server's descriptors")
                        self.wait(i, f"transfer {k}: the server's descriptors", descs_arrived)
                        remote = agent.deserialize_descs(got["server"][0])
                        self.step(i, f"transfer {k}: wait for the server's metadata")
                        self.wait(i, f"transfer {k}: the server's metadata",
                                  lambda: agent.check_remote_metadata("server"))
                        if k == 0:
                            lap("metadata")
                        if handle is not None:
                            agent.release_xfer_handle(handle)
                        handle = agent.initialize_xfer(a.op, local, remote, "server", UID)
                    self.step(i, f"transfer {k}: transfer")
                    t0 = time.perf_counter()
                    state = agent.transfer(handle)
                    if state == "ERR":
                        raise RuntimeError(f"client pair {i} transfer {k}: transfer() returned ERR")
                    deadline = time.monotonic() + a.timeout
                    while state != "DONE":
                        state = agent.check_xfer_state(handle)
                        if state == "ERR":
                            raise RuntimeError(f"client pair {i} transfer {k}: ERR")
                        if time.monotonic() > deadline:
                            raise Stall(f"client pair {i} transfer {k}: still {state} after "
                                        f"{a.timeout:.0f} s")
                    rec["transfers_ms"].append(round((time.perf_counter() - t0) * 1e3, 3))
            t = time.perf_counter()
            if self.role == "server" and a.op == "WRITE":
                self.check(bufs)
        finally:
            self.step(i, "tear down")
            t = time.perf_counter()
            if handle is not None:
                agent.release_xfer_handle(handle)
                del handle  # it holds a reference to the agent
            agent.deregister_memory(reg)
            agent.remove_remote_agent(self.peer)
            lap("deregister+remove")
            del agent  # the script drops its agent the same way (end of its function)
            lap("destroy")
            self.free(bufs)
        return rec

    def serve(self):
        while True:
            cmd, arg = self.conn.recv()
            if cmd == "exit":
                return
            try:
                if cmd == "pair":
                    self.conn.send(("done", self.pair(arg)))
                elif cmd == "loop":  # benchmark_nixl.py's way: no barrier between pairs
                    for i in range(arg):
                        self.conn.send(("done", self.pair(i)))
            except Stall as e:
                self.conn.send(("stall", str(e)))
            except Exception as e:  # noqa: BLE001 - reported, the orchestrator decides
                self.conn.send(("error", f"{self.role}: {type(e).__name__}: {e}"))


def child_main(args):
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    host, port = args.child.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["RECREATE_KEY"]))
    Side(conn, args).serve()


# --------------------------------------------------------------------------------------------
# Orchestrator
# --------------------------------------------------------------------------------------------


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_env(backend, memory):
    from harness import ucx_tls

    env = dict(os.environ)
    env.update({"TCPX_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo",
                "TCPX_CONTROL_ADDR": "127.0.0.1:0",
                "UCX_TLS": ucx_tls(memory == "VRAM"),
                "UCX_NET_DEVICES": "lo"})
    env.setdefault("TCPX_TIMEOUT_MS", "10000")
    if backend != "TCPX":
        env.pop("NIXL_PLUGIN_DIR", None)  # the wheel's UCX plugin loads from NIXL's own dir
    return env


class Child:
    def __init__(self, role, args, port, logdir):
        key = secrets.token_bytes(16)
        self.role = role
        self.listener = Listener(("127.0.0.1", 0), authkey=key)
        env = backend_env(args.backend, args.memory)
        env["RECREATE_KEY"] = key.hex()
        h, p = self.listener.address
        argv = [sys.executable, os.path.abspath(__file__), "--role", role, "--child", f"{h}:{p}",
                "--port", str(port)] + args.child_args
        self.log_path = os.path.join(logdir, f"{role}.log")
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.listener._listener._socket.settimeout(60)
        self.conn = self.listener.accept()
        self.step = None

    def send(self, *msg):
        self.conn.send(msg)

    def recv(self, deadline):
        """The next message that is not a step report, or None when the deadline passed."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.conn.poll(left):
                return None
            msg = self.conn.recv()
            if msg[0] == "step":
                self.step = msg[1:]
                continue
            return msg

    def stack(self):
        """The child's Python stacks, from its log (a call that never returned)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(0.5)
        self.log.flush()
        with open(self.log_path, "rb") as f:
            return f.read()[-6000:].decode(errors="replace")

    def close(self):
        if self.proc.poll() is None:
            try:
                self.conn.send(("exit", None))
                self.proc.wait(15)
            except Exception:  # noqa: BLE001
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.listener.close()
        self.log.close()


def summarize(recs, transfers):
    """Median per transfer index over pairs (client side), and the medians of the steps."""
    client = [r for r in recs if r["role"] == "client" and len(r["transfers_ms"]) == transfers]
    per_k = [statistics.median(r["transfers_ms"][k] for r in client) for k in range(transfers)] if client else []
    steps = {}
    for role in ("server", "client"):
        rs = [r for r in recs if r["role"] == role]
        for name in (rs[0]["steps_ms"] if rs else {}):
            vals = [r["steps_ms"][name] for r in rs if name in r["steps_ms"]]
            steps[f"{role} {name}"] = statistics.median(vals)
    return per_k, steps


def run(args):
    if args.memory == "VRAM":
        from harness import cuda_available

        if not cuda_available():
            print("SKIP: --memory VRAM needs a CUDA driver and device")
            return SKIP
    if args.backend == "TCPX":
        pd = os.environ.get("NIXL_PLUGIN_DIR", "")
        if not os.path.exists(os.path.join(pd, "libplugin_TCPX.so")):
            sys.exit("set NIXL_PLUGIN_DIR to the directory holding libplugin_TCPX.so (cargo xtask nixl)")
    own_logdir = not args.logdir  # a temporary one: removed again when nothing failed
    logdir = args.logdir or tempfile.mkdtemp(prefix="nixl-recreate-")
    os.makedirs(logdir, exist_ok=True)
    port = args.port or free_port()
    print(f"{args.backend} {args.memory} {args.op}, {args.blocks} x {args.size // args.blocks} B, "
          f"{args.iterations} agent pairs x {args.transfers} transfers, sync {args.sync}, "
          f"exchange {args.exchange}, "
          f"NIXL listener 127.0.0.1:{port}, logs in {logdir}", flush=True)
    server = Child("server", args, port, logdir)
    client = Child("client", args, port, logdir)
    recs, failure = [], None
    # A child's own waits end after args.timeout; beyond that a NIXL call itself is stuck.
    limit = args.timeout * (2 * args.transfers + 4) + 30
    started = time.monotonic()
    try:
        if args.sync == "none":
            server.send("loop", args.iterations)
            client.send("loop", args.iterations)
        done = {"server": 0, "client": 0}
        for i in range(args.iterations):
            if failure:
                break
            deadline = time.monotonic() + limit
            if args.sync == "pair":
                server.send("pair", i)
                msg = server.recv(deadline)
                if not msg or msg[0] != "listening":
                    failure = ("server", msg, server)
                    break
                client.send("pair", i)
            for side in (server, client):
                while True:
                    msg = side.recv(deadline)
                    if msg and msg[0] == "listening":
                        continue
                    break
                if msg is None:
                    failure = (side.role, ("hang", f"no answer in {limit:.0f} s; last step "
                                           f"{side.step}"), side)
                    break
                if msg[0] != "done":
                    failure = (side.role, msg, side)
                    break
                recs.append(msg[1])
                done[side.role] += 1
            if not failure and (i + 1) % max(1, args.iterations // 10) == 0:
                last = [r for r in recs if r["role"] == "client"][-1]["transfers_ms"]
                print(f"  {i + 1:4} pairs done ({time.monotonic() - started:.0f} s); last pair's "
                      f"transfers (ms): {' '.join(f'{x:.2f}' for x in last[:10])}", flush=True)
    finally:
        server_stack = client_stack = ""
        other_side = None
        if failure:
            # What the other side says (it may be stuck on the same exchange, or done).
            other = client if failure[0] == "server" else server
            msg = other.recv(time.monotonic() + args.timeout + 5)
            other_side = f"{other.role}: {msg if msg else f'no answer; last step {other.step}'}"
            server_stack, client_stack = server.stack(), client.stack()
        server.close()
        client.close()

    per_k, steps = summarize(recs, args.transfers)
    pairs = sum(1 for r in recs if r["role"] == "client")
    result = {"backend": args.backend, "memory": args.memory, "op": args.op, "size": args.size,
              "blocks": args.blocks, "sync": args.sync, "pairs_requested": args.iterations,
              "pairs_done": pairs, "stall": None, "first_transfers_ms": per_k, "steps_ms": steps,
              "seconds": round(time.monotonic() - started, 1), "records": recs}
    if per_k:
        print("median per transfer of a new pair (ms): "
              + " ".join(f"#{k + 1}={v:.3f}" for k, v in enumerate(per_k)))
        if len(per_k) >= 10:
            print(f"2nd / 10th = {per_k[1] / per_k[9]:.2f}, 1st / 10th = {per_k[0] / per_k[9]:.2f}")
        print("median step times (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in steps.items()))
    if failure:
        role, msg, side = failure
        kind = msg[0] if msg else "hang"
        text = msg[1] if msg and len(msg) > 1 else f"no answer; last step {side.step}"
        result["stall"] = {"side": role, "kind": kind, "what": text, "pair": pairs}
        result["stall"]["other_side"] = other_side
        print(f"STALL after {pairs} complete pairs: {role} {kind}: {text}")
        print(f"      the other side: {other_side}")
        print(f"--- server log tail ({server.log_path}) ---\n{server_stack}")
        print(f"--- client log tail ({client.log_path}) ---\n{client_stack}")
    else:
        print(f"ok: {pairs} agent pairs, no stall ({result['seconds']} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if own_logdir and not failure:
        shutil.rmtree(logdir, ignore_errors=True)
    return 1 if failure else 0


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="TCPX", choices=["TCPX", "UCX"])
    ap.add_argument("--memory", default="DRAM", choices=["DRAM", "VRAM"])
    ap.add_argument("--iterations", type=int, default=10, help="agent pairs, one after the other")
    ap.add_argument("--transfers", type=int, default=10, help="transfers per agent pair")
    ap.add_argument("--size", type=int, default=16 * KiB, help="bytes per transfer")
    ap.add_argument("--blocks", type=int, default=1, help="blocks (registrations) per transfer")
    ap.add_argument("--op", default="WRITE", choices=["WRITE", "READ"])
    ap.add_argument("--sync", default="pair", choices=["pair", "none"])
    ap.add_argument("--exchange", default="every", choices=["every", "once"],
                    help="metadata and descriptors before every transfer (the script's way) or "
                         "once per pair (then the transfers run back to back)")
    ap.add_argument("--timeout", type=float, default=20.0, help="seconds any one wait may take")
    ap.add_argument("--port", type=int, default=0, help="the server's NIXL listener port (default: a free one)")
    ap.add_argument("--logdir")
    ap.add_argument("--json", help="write the result (with every pair's record) here")
    ap.add_argument("--role", choices=["server", "client"], help=argparse.SUPPRESS)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.size < args.blocks or args.blocks < 1 or args.transfers < 1 or args.iterations < 1:
        ap.error("need iterations >= 1, transfers >= 1 and 1 <= blocks <= size")
    args.child_args = ["--backend", args.backend, "--memory", args.memory, "--transfers",
                       str(args.transfers), "--size", str(args.size), "--blocks", str(args.blocks),
                       "--op", args.op, "--timeout", str(args.timeout), "--exchange", args.exchange]
    return args


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.child:
        child_main(args)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
