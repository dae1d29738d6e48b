"""NIXL's own etcd metadata exchange with the TCPX backend: two NIXL agents in two processes
find each other through a real etcd (NIXL_ETCD_ENDPOINTS), move verified bytes, and find an
agent again after it restarted under the same name.

Run by `cargo xtask nixl --test` after test_agents.py, or by hand:

    NIXL_PLUGIN_DIR=target/nixl/plugins target/nixl/venv/bin/python integrations/nixl/tests/test_etcd.py

It starts a throw-away etcd (`$TCPX_ETCD_BIN`, else `etcd` on PATH: Debian's etcd-server) on
127.0.0.1 with free client and peer ports and a temporary data directory, and kills and removes
it whatever happens. Without an etcd binary it says SKIP and exits 0 (unless
TCPX_REQUIRE_ETCD=1, then it fails).

Per memory kind (DRAM; VRAM too where a CUDA device exists), in a fresh etcd namespace:

1. agents "a" and "b" (backend TCPX, separate processes) register memory, each
   `send_local_metadata()`, each `fetch_remote_metadata(other)` and waits for
   `check_remote_metadata(other)`: nothing but etcd carries NIXL metadata (the orchestrator
   hands over serialized descriptor lists, i.e. addresses, as an application would);
2. a WRITEs into b and READs from b, b WRITEs into a, each with a notification; every byte is
   checked on the receiving side;
3. b calls `invalidate_local_metadata()`: a's NIXL sees the etcd delete and drops b
   (`check_remote_metadata("b")` turns false); b's process exits;
4. a new process creates agent "b" again, registers new memory, publishes; a fetches "b"
   again through etcd, and the new b fetches a (never re-published); then the transfers of
   step 2 run against the new b with new data;
5. the new b is killed (SIGKILL, no invalidation: its stale metadata stays in etcd), a third
   "b" starts and publishes over it; a removes the dead "b", fetches again and moves verified
   bytes to the third one.

The agents' listening sockets are checked to be on 127.0.0.1 only (TCPX's control listener;
NIXL's own listener thread stays off, its etcd client only dials out). Every wait is bounded.
Exit status 0 when everything passed.
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Peer, blocks, cuda_available, span  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
TIMEOUT_MS = 5000  # tcpx set-up and transfer timeout of every agent here
PARAMS = {"control_addr": "127.0.0.1:0", "timeout_ms": TIMEOUT_MS}
ETCD_READY_S = 30  # a fresh single-member etcd elects itself in about a second
MD_WAIT_S = 30  # metadata to appear in (or vanish from) an agent through etcd
NOTIF_WAIT_S = 30


def check(cond, what):
    if not cond:
        raise AssertionError(what)


# --------------------------------------------------------------------------------------------
# A throw-away etcd on 127.0.0.1
# --------------------------------------------------------------------------------------------


def etcd_binary():
    """`$TCPX_ETCD_BIN`, else `etcd` on PATH (the same rule as xtask's LocalEtcd)."""
    path = os.environ.get("TCPX_ETCD_BIN")
    if path:
        return path if os.path.isfile(path) else None
    return shutil.which("etcd")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent():
    """In the etcd child before exec: SIGKILL it when this test process dies, even by SIGKILL
    (xtask's time limit), so no etcd outlives the test (Linux prctl PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # 1: PR_SET_PDEATHSIG


class LocalEtcd:
    """A single-member etcd on free 127.0.0.1 ports with a temporary data directory; `stop()`
    kills it and removes the directory (also when start-up failed)."""

    def __init__(self, binary):
        self.dir = tempfile.mkdtemp(prefix="tcpx-nixl-etcd-")
        self.proc = None
        last = None
        for _ in range(3):  # a free port may be taken between probing and etcd's bind
            try:
                self._start(binary)
                return
            except RuntimeError as e:
                last = e
                self._kill()
        self.stop()
        raise last

    def _start(self, binary):
        client, peer = free_port(), free_port()
        self.url = f"http://127.0.0.1:{client}"
        peer_url = f"http://127.0.0.1:{peer}"
        data = tempfile.mkdtemp(dir=self.dir)
        self.log = data + ".log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [binary, "--name", "tcpx-nixl", "--data-dir", data,
                 "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                 "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                 "--initial-cluster", f"tcpx-nixl={peer_url}", "--initial-cluster-state", "new",
                 "--logger", "zap", "--log-outputs", "stderr"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                start_new_session=True,  # a Ctrl-C of the test does not race our own kill
                preexec_fn=die_with_parent,
            )
        deadline = time.monotonic() + ETCD_READY_S
        while True:
            text = open(self.log, errors="replace").read()
            if "ready to serve client" in text or "serving client" in text:
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                state = (f"exited with {self.proc.returncode}" if self.proc.poll() is not None
                         else f"did not serve clients within {ETCD_READY_S} s")
                tail = "\n".join(text.splitlines()[-15:])
                raise RuntimeError(f"etcd on {self.url} {state}; its last log lines:\n{tail}")
            time.sleep(0.05)

    def range(self, key, prefix=False):
        """The keys at `key` (or under it, with `prefix`) as {key: mod_revision}, read through
        etcd's v3 JSON gateway: what NIXL really stored, independent of NIXL's caches."""
        body = {"key": base64.b64encode(key.encode()).decode()}
        if prefix:
            end = key.encode()[:-1] + bytes([key.encode()[-1] + 1])
            body["range_end"] = base64.b64encode(end).decode()
        req = urllib.request.Request(f"{self.url}/v3/kv/range", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            kvs = json.load(r).get("kvs", [])
        return {base64.b64decode(kv["key"]).decode(): int(kv["mod_revision"]) for kv in kvs}

    def wait_key(self, key, newer_than, timeout=MD_WAIT_S):
        """Waits until `key` exists with a mod_revision above `newer_than`; returns that."""
        deadline = time.monotonic() + timeout
        while True:
            rev = self.range(key).get(key, 0)
            if rev > newer_than:
                return rev
            if time.monotonic() > deadline:
                raise TimeoutError(f"etcd key {key} not written after revision {newer_than} "
                                   f"within {timeout} s (now: {rev or 'absent'})")
            time.sleep(0.01)

    def _kill(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self):
        self._kill()
        shutil.rmtree(self.dir, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Loopback check: what the agent processes listen on
# --------------------------------------------------------------------------------------------


def listening(pid):
    """The (address, port) of every listening TCP socket of process `pid` (Linux /proc)."""
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table, v6 in ((f"/proc/{pid}/net/tcp", False), (f"/proc/{pid}/net/tcp6", True)):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A: LISTEN
                continue
            hexaddr, hexport = f[1].split(":")
            raw = bytes.fromhex(hexaddr)
            if v6:
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                addr = socket.inet_ntop(socket.AF_INET6, raw)
            else:
                addr = socket.inet_ntop(socket.AF_INET, raw[::-1])
            out.append((addr, int(hexport, 16)))
    return out


def check_loopback_only(peer):
    socks = listening(peer.proc.pid)
    wild = [s for s in socks if s[0] not in ("127.0.0.1", "::1")]
    check(not wild, f"agent {peer.name} (pid {peer.proc.pid}) listens beyond loopback: {wild}")
    return socks


# --------------------------------------------------------------------------------------------
# The scenario
# --------------------------------------------------------------------------------------------


def agent_env(etcd_url, namespace):
    plugin_dir = os.environ.get("NIXL_PLUGIN_DIR")
    if not plugin_dir or not os.path.exists(os.path.join(plugin_dir, "libplugin_TCPX.so")):
        sys.exit("set NIXL_PLUGIN_DIR to the directory holding libplugin_TCPX.so (cargo xtask nixl)")
    return {
        "NIXL_PLUGIN_DIR": plugin_dir,
        "NIXL_ETCD_ENDPOINTS": etcd_url,
        "NIXL_ETCD_NAMESPACE": namespace,
        "TCPX_SOCKET_IFNAME": "lo",
        "TCPX_CONTROL_ADDR": "127.0.0.1:0",
        "NCCL_SOCKET_IFNAME": "lo",
    }


# Each agent has one buffer "in" (written into / read back) and one "out" (the source of READs
# from it), both registered before it publishes. Local blocks are contiguous; remote blocks are
# spread out and shuffled.
SIZE = 5 * MiB
LOCAL = blocks(64, 64 * KiB)
REMOTE = blocks(64, 64 * KiB, stride=64 * KiB + 4 * KiB, shuffle_seed=23)
assert span(REMOTE) <= SIZE


def start_agent(name, env, mem, out_seed, etcd):
    """A new agent process `name` with its buffers registered and its metadata published.
    NIXL publishes from its metadata thread; this returns once etcd holds the new metadata
    (so a fetch cannot find an older agent's left-overs under the same name)."""
    key = md_key(env, name)
    before = etcd.range(key).get(key, 0)
    p = Peer(name, "TCPX", PARAMS, env, mem=mem)
    try:
        p.call("alloc", "in", SIZE)
        p.call("alloc", "out", SIZE, out_seed)
        p.call("send_local_md")
        etcd.wait_key(key, before)
    except Exception:
        p.kill()
        raise
    return p


def md_key(env, name):
    """Where NIXL 1.5.1 stores agent `name`'s metadata: NAMESPACE/NAME/metadata."""
    return f"{env['NIXL_ETCD_NAMESPACE']}/{name}/metadata"


def agent_keys(etcd, env, name):
    return etcd.range(f"{env['NIXL_ETCD_NAMESPACE']}/{name}/", prefix=True)


def wait_gone(etcd, env, name, timeout=MD_WAIT_S):
    """Waits until etcd holds no key of agent `name` (its invalidation landed)."""
    deadline = time.monotonic() + timeout
    while keys := agent_keys(etcd, env, name):
        if time.monotonic() > deadline:
            raise TimeoutError(f"agent {name}'s keys still in etcd after {timeout} s: {keys}")
        time.sleep(0.01)


def find(who, other, timeout=MD_WAIT_S):
    """`who` fetches `other`'s metadata through etcd and waits until NIXL loaded it."""
    who.call("fetch_remote_md", other.name)
    took = who.call("wait_remote_md", other.name, True, timeout, timeout=timeout + 10)
    return took


def write_read(a, b, tag, seed):
    """a WRITEs into b's "in", READs b's "out" into its own "in"; b WRITEs into a's "in" too.
    Each carries a notification; every byte is verified where it landed."""
    # a -> b, WRITE
    a.call("fill", "out", seed)
    b.call("fill", "in", 0)
    rd = b.call("descs", "in", REMOTE)
    msg = f"{tag}: a wrote".encode()
    a.call("xfer", "WRITE", "out", LOCAL, rd, b.name, msg)
    check(b.call("wait_notif", a.name, msg, NOTIF_WAIT_S), f"{tag}: b got no notification {msg!r}")
    bad = b.call("verify", "in", REMOTE, seed, SIZE, LOCAL)
    check(bad == 0, f"{tag}: WRITE a -> b: {bad} of {len(LOCAL)} blocks differ on b")
    # a <- b, READ
    b.call("fill", "out", seed + 1)
    a.call("fill", "in", 0)
    rd = b.call("descs", "out", REMOTE)
    msg = f"{tag}: a read".encode()
    a.call("xfer", "READ", "in", LOCAL, rd, b.name, msg)
    bad = a.call("verify", "in", LOCAL, seed + 1, SIZE, REMOTE)
    check(bad == 0, f"{tag}: READ a <- b: {bad} of {len(LOCAL)} blocks differ on a")
    check(b.call("wait_notif", a.name, msg, NOTIF_WAIT_S), f"{tag}: b got no notification {msg!r}")
    # b -> a, WRITE (b found a through etcd too)
    b.call("fill", "out", seed + 2)
    a.call("fill", "in", 0)
    rd = a.call("descs", "in", REMOTE)
    msg = f"{tag}: b wrote".encode()
    b.call("xfer", "WRITE", "out", LOCAL, rd, a.name, msg)
    check(a.call("wait_notif", b.name, msg, NOTIF_WAIT_S), f"{tag}: a got no notification {msg!r}")
    bad = a.call("verify", "in", REMOTE, seed + 2, SIZE, LOCAL)
    check(bad == 0, f"{tag}: WRITE b -> a: {bad} of {len(LOCAL)} blocks differ on a")
    n = len(LOCAL) * LOCAL[0][1]
    print(f"    {tag}: WRITE a->b, READ a<-b, WRITE b->a, {n >> 20} MiB each in "
          f"{len(LOCAL)} blocks: verified, notifications delivered", flush=True)


def scenario(etcd, mem):
    env = agent_env(etcd.url, f"/tcpx-nixl-test/{mem}/{secrets.token_hex(4)}")
    peers = []
    try:
        a = start_agent("a", env, mem, 101, etcd)
        peers.append(a)
        b = start_agent("b", env, mem, 202, etcd)
        peers.append(b)
        # 1. Only etcd carries metadata.
        check(not a.call("check_remote_md", "b"), "a knows b before fetching it")
        ta, tb = find(a, b), find(b, a)
        print(f"    {mem}: a found b in {ta * 1e3:.0f} ms, b found a in {tb * 1e3:.0f} ms "
              f"through etcd {etcd.url} (keys {sorted(etcd.range(env['NIXL_ETCD_NAMESPACE'] + '/', prefix=True))})",
              flush=True)
        for p in (a, b):
            socks = check_loopback_only(p)
            print(f"    agent {p.name} listens on {sorted(socks)} only", flush=True)
        # 2. Bytes both ways.
        write_read(a, b, f"{mem} first b", 1000)

        # 3. b invalidates its metadata (etcd deletes its keys) and goes away; a's NIXL
        # watches b's keys and drops b on the delete.
        b.call("invalidate_local_md")
        wait_gone(etcd, env, "b")
        took = a.call("wait_remote_md", "b", False, MD_WAIT_S, timeout=MD_WAIT_S + 10)
        print(f"    {mem}: b invalidated its metadata: gone from etcd, a dropped b after "
              f"{took * 1e3:.0f} ms", flush=True)
        b.call("destroy_agent")
        b.close()
        peers.remove(b)

        # 4. A new process creates "b" again; a finds it through etcd and moves bytes to it;
        # the new b finds a (published once, at the start).
        b = start_agent("b", env, mem, 303, etcd)
        peers.append(b)
        ta, tb = find(a, b), find(b, a)
        print(f"    {mem}: re-created b published; a found it again in {ta * 1e3:.0f} ms, "
              f"it found a in {tb * 1e3:.0f} ms", flush=True)
        write_read(a, b, f"{mem} second b", 2000)

        # 5. A crash: b dies without invalidating, so its metadata stays in etcd (NIXL does not
        # invalidate on teardown); a third "b" publishes over it; a drops the dead one and
        # fetches the new one.
        b.kill()
        peers.remove(b)
        stale = agent_keys(etcd, env, "b")
        check(md_key(env, "b") in stale, f"a killed b's metadata left etcd: {stale}")
        print("    (NIXL's etcd watcher logs the overwrite below as an unexpected event: it only "
              "acts on deletes)", flush=True)
        b = start_agent("b", env, mem, 404, etcd)
        peers.append(b)
        a.call("remove_remote", "b")
        check(not a.call("check_remote_md", "b"), "a still has b after remove_remote_agent")
        ta, tb = find(a, b), find(b, a)
        print(f"    {mem}: b killed (SIGKILL, stale metadata left in etcd) and started again; "
              f"a found the third b in {ta * 1e3:.0f} ms", flush=True)
        write_read(a, b, f"{mem} third b", 3000)

        # Both leave cleanly: each one's invalidation reaches the other, etcd is empty.
        b.call("invalidate_local_md")
        a.call("wait_remote_md", "b", False, MD_WAIT_S, timeout=MD_WAIT_S + 10)
        a.call("invalidate_local_md")
        b.call("wait_remote_md", "a", False, MD_WAIT_S, timeout=MD_WAIT_S + 10)
        wait_gone(etcd, env, "a")
        wait_gone(etcd, env, "b")
        left = etcd.range(env["NIXL_ETCD_NAMESPACE"] + "/", prefix=True)
        check(not left, f"keys left in etcd after both agents invalidated: {left}")
    finally:
        for p in peers:
            try:
                p.close()
            except Exception as e:
                print(f"    closing agent {p.name}: {e}", flush=True)
                p.kill()


def main():
    binary = etcd_binary()
    if binary is None:
        msg = ("no etcd binary (set TCPX_ETCD_BIN or install Debian's etcd-server: "
               "apt-get install etcd-server)")
        if os.environ.get("TCPX_REQUIRE_ETCD") == "1":
            print(f"FAIL test_etcd: {msg}, and TCPX_REQUIRE_ETCD=1", flush=True)
            return 1
        print(f"SKIP test_etcd: {msg}", flush=True)
        return 0
    etcd = LocalEtcd(binary)
    print(f"etcd {binary} on {etcd.url} (data in {etcd.dir})", flush=True)
    failed = 0
    # Ctrl-C or a kill from xtask's time limit: stop etcd and the agents on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        for mem in ("DRAM", "VRAM"):
            name = f"test_etcd_{mem.lower()}"
            if mem == "VRAM" and not cuda_available():
                print(f"SKIP {name}: no CUDA driver or device", flush=True)
                continue
            t = time.monotonic()
            try:
                scenario(etcd, mem)
                print(f"PASS {name} ({time.monotonic() - t:.1f} s)", flush=True)
            except Exception:
                failed += 1
                print(f"FAIL {name} ({time.monotonic() - t:.1f} s)", flush=True)
                traceback.print_exc()
                if etcd.proc.poll() is not None:
                    print(f"etcd exited with {etcd.proc.returncode}", flush=True)
    finally:
        etcd.stop()
    print(f"{'FAILED' if failed else 'ok'}: {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
