"""NIXL agents over the TCPX backend: two agents in two processes, through NIXL's own Python
agent (PyPI nixl-cu12) and libplugin_TCPX.so.

Run by `cargo xtask nixl --test` (which builds the plugin and the virtualenv), or by hand:

    NIXL_PLUGIN_DIR=target/nixl/plugins target/nixl-venv/bin/python integrations/nixl/tests/test_agents.py

Every byte moved is verified on the receiving side. All traffic stays on 127.0.0.1 (control
listeners and NIXL metadata) and `lo` (the socket plugin). VRAM variants run only where a CUDA
driver and device exist, and say SKIP otherwise. Exit status 0 when everything passed.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Peer, RemoteError, blocks, cuda_available, span  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
TIMEOUT_MS = 5000  # tcpx set-up and transfer timeout of every agent here
PARAMS = {"control_addr": "127.0.0.1:0", "timeout_ms": TIMEOUT_MS}


def env():
    plugin_dir = os.environ.get("NIXL_PLUGIN_DIR")
    if not plugin_dir or not os.path.exists(os.path.join(plugin_dir, "libplugin_TCPX.so")):
        sys.exit("set NIXL_PLUGIN_DIR to the directory holding libplugin_TCPX.so (cargo xtask nixl)")
    return {"NIXL_PLUGIN_DIR": plugin_dir, "TCPX_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def expect_error(fn, what):
    try:
        fn()
    except RemoteError as e:
        return str(e)
    raise AssertionError(f"{what}: succeeded, expected a NIXL error")


# Lists of 1, 64 and 1024 blocks from 4 KiB to 64 MiB (at most 64 MiB per list). Local blocks
# are contiguous (the plugin merges them into one segment); remote blocks are spread out with
# gaps and shuffled, so every block has its own place and order on the other side.
CASES = [(1, 4 * KiB), (1, 64 * MiB), (64, 64 * KiB), (64, 1 * MiB), (1024, 4 * KiB), (1024, 64 * KiB)]


def publish(owner, to):
    """NIXL metadata is a snapshot: after `owner` registered memory, `to` loads it again."""
    to.call("add_remote", owner.call("metadata"))


def write_read_lists(init, target, tag):
    # Target buffers stay registered for the whole suite: NIXL matches descriptors against the
    # remote metadata it loaded, and loading newer metadata of the same agent adds to it, so
    # a freed-then-reused address would still match the old (revoked) registration until the
    # agent is removed and loaded again.
    keys = []
    for n, bs in CASES:
        local = blocks(n, bs)
        remote = blocks(n, bs, stride=bs + 4 * KiB, shuffle_seed=n * 7 + bs)
        lsize, rsize = span(local), span(remote)
        seed_w, seed_r = hash((tag, n, bs, "w")) & 0xFFFF, hash((tag, n, bs, "r")) & 0xFFFF
        key = f"{tag}-{n}x{bs}"
        keys.append(key)
        init.call("alloc", key, lsize, seed_w)
        target.call("alloc", key, rsize)
        publish(target, init)
        rdescs = target.call("descs", key, remote)

        msg = f"{tag} write {n}x{bs}".encode()
        init.call("xfer", "WRITE", key, local, rdescs, target.name, msg)
        check(target.call("wait_notif", init.name, msg, 30), f"no notification {msg!r}")
        bad = target.call("verify", key, remote, seed_w, lsize, local)
        check(bad == 0, f"WRITE {n} x {bs} B: {bad} blocks differ on the target")

        target.call("fill", key, seed_r)
        init.call("fill", key, seed_r + 1)
        msg = f"{tag} read {n}x{bs}".encode()
        init.call("xfer", "READ", key, local, rdescs, target.name, msg)
        bad = init.call("verify", key, local, seed_r, rsize, remote)
        check(bad == 0, f"READ {n} x {bs} B: {bad} blocks differ on the initiator")
        check(target.call("wait_notif", init.name, msg, 30), f"no notification {msg!r}")
        print(f"    {n:5} x {bs >> 10:6} KiB: WRITE and READ verified, notifications delivered")
    for key in keys:
        init.call("free", key)


class Suite:
    def __init__(self):
        self.env = env()
        self.init = Peer("initiator", "TCPX", PARAMS, self.env)
        self.target = Peer("target", "TCPX", PARAMS, self.env)
        self.loaded = False

    def load(self):
        name = self.init.call("add_remote", self.target.call("metadata"))
        check(name == "target", f"add_remote_agent returned {name!r}")
        self.loaded = True

    def test_bad_remote_metadata(self):
        print("    (NIXL and the plugin log the refusals below on purpose)", flush=True)
        md = self.target.call("metadata")
        expect_error(lambda: self.init.call("add_remote", b"not nixl metadata"), "garbage metadata")
        expect_error(lambda: self.init.call("add_remote", md[: len(md) // 2]), "truncated metadata")
        # NIXL's framing intact, our connection info inside corrupted: loadRemoteConnInfo refuses.
        check(md.count(b"TXC1") == 1, "the TCPX connection info is in the agent metadata")
        expect_error(lambda: self.init.call("add_remote", md.replace(b"TXC1", b"TXC9")),
                     "corrupted TCPX connection info")
        # Register something so the metadata carries a TCPX memory blob, then corrupt that.
        self.target.call("alloc", "probe", 64 * KiB)
        md = self.target.call("metadata")
        check(md.count(b"TXM1") == 1, "the TCPX memory blob is in the agent metadata")
        expect_error(lambda: self.init.call("add_remote", md.replace(b"TXM1", b"TXM9")),
                     "corrupted TCPX memory metadata")
        self.target.call("free", "probe")
        # After all that, the real metadata still loads.
        self.load()

    def test_unknown_remote_agent(self):
        self.init.call("alloc", "u", 4 * KiB, 1)
        rd = self.target.call("alloc", "u", 4 * KiB) and self.target.call("descs", "u", blocks(1, 4 * KiB))
        expect_error(lambda: self.init.call("xfer", "WRITE", "u", blocks(1, 4 * KiB), rd, "nobody"),
                     "WRITE to an unknown agent")
        expect_error(lambda: self.init.call("send_notif", "nobody", b"x"), "genNotif to an unknown agent")
        self.init.call("free", "u")

    def test_write_read_lists(self):
        write_read_lists(self.init, self.target, "dram")

    def test_notifications_both_ways(self):
        msgs = [f"note {i}".encode() for i in range(10)]
        for m in msgs:
            self.init.call("send_notif", "target", m)
        got = self.target.call("take_notifs", "initiator", len(msgs), 20)
        check(got == msgs, f"genNotif order/content: {got}")
        # The target learns the initiator and initiates itself: a notification and a WRITE back.
        publish(self.init, self.target)
        self.target.call("send_notif", "initiator", b"back")
        check(self.init.call("take_notifs", "target", 1, 20) == [b"back"], "reverse genNotif")
        self.init.call("alloc", "back", 1 * MiB)
        publish(self.init, self.target)
        self.target.call("alloc", "back", 1 * MiB, 99)
        local, remote = blocks(16, 64 * KiB), blocks(16, 64 * KiB, shuffle_seed=3)
        rd = self.init.call("descs", "back", remote)
        self.target.call("xfer", "WRITE", "back", local, rd, "initiator", b"reverse write")
        check(self.init.call("wait_notif", "target", b"reverse write", 20), "reverse WRITE notification")
        check(self.init.call("verify", "back", remote, 99, 1 * MiB, local) == 0, "reverse WRITE data")
        self.init.call("free", "back")

    def test_same_memory_registered_twice(self):
        """NIXL lets the same range be registered twice; dropping one registration must leave
        the other working (the backend counts references instead of revoking)."""
        self.target.call("alloc", "twice", 1 * MiB)
        self.target.call("register_again", "twice")
        self.target.call("deregister_again", "twice")
        publish(self.target, self.init)
        self.init.call("alloc", "twice", 1 * MiB, 41)
        bl = blocks(4, 256 * KiB)
        rd = self.target.call("descs", "twice", bl)
        self.init.call("xfer", "WRITE", "twice", bl, rd, "target", b"twice")
        check(self.target.call("wait_notif", "initiator", b"twice", 20), "WRITE notification")
        check(self.target.call("verify", "twice", bl, 41, 1 * MiB, bl) == 0, "data")
        self.init.call("free", "twice")

    def test_local_transfer(self):
        self.init.call("alloc", "a", 1 * MiB, 5)
        self.init.call("alloc", "b", 1 * MiB)
        local, remote = blocks(8, 128 * KiB), blocks(8, 128 * KiB, shuffle_seed=9)
        rd = self.init.call("descs", "b", remote)
        self.init.call("xfer", "WRITE", "a", local, rd, "initiator")
        check(self.init.call("verify", "b", remote, 5, 1 * MiB, local) == 0, "local WRITE data")
        self.init.call("free", "a")
        self.init.call("free", "b")

    def test_disconnect_and_reconnect(self):
        self.init.call("alloc", "r", 4 * MiB, 11)
        self.target.call("alloc", "r", 4 * MiB)
        publish(self.target, self.init)
        bl = blocks(64, 64 * KiB)
        rd = self.target.call("descs", "r", bl)
        self.init.call("xfer", "WRITE", "r", bl, rd, "target", b"before")
        check(self.target.call("wait_notif", "initiator", b"before", 20), "write before disconnect")
        self.init.call("remove_remote", "target")
        expect_error(lambda: self.init.call("xfer", "WRITE", "r", bl, rd, "target"),
                     "WRITE after remove_remote_agent")
        self.load()
        self.target.call("fill", "r", 0)
        self.init.call("fill", "r", 12)
        self.init.call("xfer", "WRITE", "r", bl, rd, "target", b"after")
        check(self.target.call("wait_notif", "initiator", b"after", 20), "write after reconnect")
        check(self.target.call("verify", "r", bl, 12, 4 * MiB, bl) == 0, "data after reconnect")
        # The target's side of the old connection was closed under it; it reconnects too.
        self.target.call("send_notif", "initiator", b"target still talks")
        check(self.init.call("take_notifs", "target", 1, 20) == [b"target still talks"],
              "target's notification after the initiator reconnected")
        self.init.call("free", "r")

    def test_simultaneous_connect(self):
        """Two agents that know each other dial each other at the same moment: both keep
        working, every notification arrives once, and WRITEs go both ways."""
        a = Peer("sim-a", "TCPX", PARAMS, self.env)
        b = Peer("sim-b", "TCPX", PARAMS, self.env)
        try:
            a.call("alloc", "m", 1 * MiB, 31)
            b.call("alloc", "m", 1 * MiB, 32)
            a.call("add_remote", b.call("metadata"))
            b.call("add_remote", a.call("metadata"))
            for round_ in range(3):
                a.send("send_notif", "sim-b", f"a{round_}".encode())
                b.send("send_notif", "sim-a", f"b{round_}".encode())
                a.result("send_notif")
                b.result("send_notif")
            check(b.call("take_notifs", "sim-a", 3, 20) == [b"a0", b"a1", b"a2"], "a -> b notifications")
            check(a.call("take_notifs", "sim-b", 3, 20) == [b"b0", b"b1", b"b2"], "b -> a notifications")
            bl = blocks(16, 64 * KiB)
            # Each writes its first half into the other's second half, at the same time.
            half, other = bl[:8], bl[8:]
            into_a, into_b = a.call("descs", "m", other), b.call("descs", "m", other)
            a.send("xfer", "WRITE", "m", half, into_b, "sim-b", b"from a")
            b.send("xfer", "WRITE", "m", half, into_a, "sim-a", b"from b")
            a.result("xfer")
            b.result("xfer")
            check(b.call("wait_notif", "sim-a", b"from a", 20), "WRITE a -> b notification")
            check(a.call("wait_notif", "sim-b", b"from b", 20), "WRITE b -> a notification")
            check(b.call("verify", "m", other, 31, 1 * MiB, half) == 0, "a -> b data")
            check(a.call("verify", "m", other, 32, 1 * MiB, half) == 0, "b -> a data")
        finally:
            a.close()
            b.close()

    def test_peer_killed_mid_transfer(self):
        print("    (the plugin logs the failed writes below on purpose)", flush=True)
        victim = Peer("victim", "TCPX", PARAMS, self.env)
        try:
            victim.call("alloc", "v", 64 * MiB)
            self.init.call("alloc", "k", 64 * MiB, 21)
            self.init.call("add_remote", victim.call("metadata"))
            bl = blocks(1024, 64 * KiB)
            rd = victim.call("descs", "v", bl)
            # Freeze the victim first: its receive buffers fill and the writes stall half-way,
            # so they are certainly in flight when it dies.
            self.init.call("connect", "victim")
            victim.proc.send_signal(signal.SIGSTOP)
            hids = [self.init.call("start", "WRITE", "k", bl, rd, "victim") for _ in range(4)]
            time.sleep(0.3)
            victim.kill()
            killed = time.monotonic()
            states = [self.init.call("wait", h, TIMEOUT_MS / 1000 * 3) for h in hids]
            waited = time.monotonic() - killed
            check(all(s == "ERR" for s, _ in states), f"in-flight writes to a killed peer: {states}")
            check(waited < TIMEOUT_MS / 1000 + 5, f"failures took {waited:.1f} s")
            # A new transfer to the dead peer fails too, within the timeout.
            t = time.monotonic()
            try:
                h = self.init.call("start", "WRITE", "k", bl, rd, "victim")
                state, _ = self.init.call("wait", h, TIMEOUT_MS / 1000 * 3)
                check(state == "ERR", f"transfer to a dead peer ended {state}")
            except RemoteError:
                pass
            check(time.monotonic() - t < TIMEOUT_MS / 1000 * 2 + 5, "new transfer to a dead peer hung")
            print(f"    4 writes in flight failed {waited:.2f} s after the kill")
            self.init.call("remove_remote", "victim")
            self.init.call("free", "k")
        finally:
            victim.close()

    def bounded(self, fn, what):
        """Runs `fn`, which must fail with a NIXL error (not hang): within twice the timeout."""
        t = time.monotonic()
        msg = expect_error(fn, what)
        waited = time.monotonic() - t
        check(waited < TIMEOUT_MS / 1000 * 2 + 5, f"{what}: took {waited:.1f} s")
        return msg, waited

    def test_peer_replaced_under_the_same_name(self):
        """An agent replaced under the same name (new process, new endpoint), which introduces
        itself before the initiator dropped the old one: operations naming the old one fail
        fast, never hang; NIXL refuses the new metadata while the old is loaded; after
        remove_remote_agent + add_remote_agent, data and notifications reach the new one, both
        ways."""
        print("    (NIXL and the plugin log the refusals below on purpose)", flush=True)
        bl = blocks(16, 64 * KiB)
        self.init.call("alloc", "rep", 1 * MiB, 51)
        old = Peer("replica", "TCPX", PARAMS, self.env)
        try:
            old.call("alloc", "m", 1 * MiB)
            self.init.call("add_remote", old.call("metadata"))
            rd_old = old.call("descs", "m", bl)
            self.init.call("xfer", "WRITE", "rep", bl, rd_old, "replica", b"to old")
            check(old.call("wait_notif", "initiator", b"to old", 20), "WRITE to the first replica")
            # The old one knows the initiator too and talks to it over its own dial.
            old.call("add_remote", self.init.call("metadata"))
            old.call("send_notif", "initiator", b"from old")
            check(self.init.call("take_notifs", "replica", 1, 20) == [b"from old"], "old -> init")
        finally:
            old.close()
        new = Peer("replica", "TCPX", PARAMS, self.env)
        try:
            new.call("alloc", "m", 1 * MiB)
            new.call("add_remote", self.init.call("metadata"))
            new.call("send_notif", "initiator", b"from new")
            check(self.init.call("take_notifs", "replica", 1, 20) == [b"from new"],
                  "the new replica's notification reaches the initiator")
            # Still the old replica's metadata and descriptors on the initiator's side.
            _, waited = self.bounded(
                lambda: self.init.call("xfer", "WRITE", "rep", bl, rd_old, "replica"),
                "WRITE with the replaced agent's descriptors")
            md_new = new.call("metadata")
            expect_error(lambda: self.init.call("add_remote", md_new),
                         "new metadata under a loaded name (NIXL wants remove_remote_agent first)")
            self.init.call("remove_remote", "replica")
            self.init.call("add_remote", md_new)
            rd_new = new.call("descs", "m", bl)
            self.init.call("fill", "rep", 52)
            self.init.call("xfer", "WRITE", "rep", bl, rd_new, "replica", b"to new")
            check(new.call("wait_notif", "initiator", b"to new", 20), "WRITE notification")
            check(new.call("verify", "m", bl, 52, 1 * MiB, bl) == 0, "data in the new replica")
            new.call("send_notif", "initiator", b"new again")
            check(self.init.call("take_notifs", "replica", 1, 20) == [b"new again"], "new -> init")
            print(f"    old descriptors refused in {waited:.2f} s; the new replica works both ways")
            self.init.call("remove_remote", "replica")
        finally:
            new.close()
            self.init.call("free", "rep")

    def test_torn_down_agent_fails_fast(self):
        """The target agent is destroyed (its process lives on) with WRITEs in flight and the
        initiator still connected: those end (done or failed), later WRITEs and notifications
        to it fail within the timeout; nothing hangs."""
        print("    (the plugin logs the failures below on purpose)", flush=True)
        gone = Peer("gone", "TCPX", PARAMS, self.env)
        try:
            gone.call("alloc", "g", 16 * MiB)
            self.init.call("alloc", "t", 16 * MiB, 61)
            self.init.call("add_remote", gone.call("metadata"))
            bl = blocks(256, 64 * KiB)
            rd = gone.call("descs", "g", bl)
            self.init.call("xfer", "WRITE", "t", bl, rd, "gone", b"first")
            check(gone.call("wait_notif", "initiator", b"first", 20), "first WRITE")
            hids = [self.init.call("start", "WRITE", "t", bl, rd, "gone") for _ in range(4)]
            gone.call("destroy_agent")
            states = [self.init.call("wait", h, TIMEOUT_MS / 1000 * 3) for h in hids]
            check(all(s in ("DONE", "ERR") for s, _ in states), f"in-flight WRITEs: {states}")
            _, w1 = self.bounded(lambda: self.init.call("xfer", "WRITE", "t", bl, rd, "gone"),
                                 "WRITE to a destroyed agent")
            _, w2 = self.bounded(lambda: self.init.call("send_notif", "gone", b"anyone?"),
                                 "notification to a destroyed agent")
            print(f"    in flight: {[s for s, _ in states]}; then WRITE failed in {w1:.2f} s, "
                  f"notification in {w2:.2f} s")
            self.init.call("remove_remote", "gone")
            self.init.call("free", "t")
        finally:
            gone.close()

    def test_metadata_of_a_departed_agent(self):
        """Metadata loaded after its agent's process exited (a metadata exchange that raced a
        teardown): connecting, WRITEs and notifications fail within the timeout."""
        print("    (NIXL and the plugin log the failures below on purpose)", flush=True)
        ghost = Peer("ghost", "TCPX", PARAMS, self.env)
        ghost.call("alloc", "g", 1 * MiB)
        md = ghost.call("metadata")
        rd = ghost.call("descs", "g", blocks(1, 1 * MiB))
        ghost.close()
        self.init.call("add_remote", md)
        self.init.call("alloc", "x", 1 * MiB, 71)
        _, w0 = self.bounded(lambda: self.init.call("connect", "ghost"), "connect to a departed agent")
        _, w1 = self.bounded(lambda: self.init.call("xfer", "WRITE", "x", blocks(1, 1 * MiB), rd, "ghost"),
                             "WRITE to a departed agent")
        _, w2 = self.bounded(lambda: self.init.call("send_notif", "ghost", b"x"),
                             "notification to a departed agent")
        print(f"    connect failed in {w0:.2f} s, WRITE in {w1:.2f} s, notification in {w2:.2f} s")
        self.init.call("remove_remote", "ghost")
        self.init.call("free", "x")

    def test_vram_write_read_lists(self):
        if not cuda_available():
            return "SKIP: no CUDA driver or device"
        a = Peer("gpu-initiator", "TCPX", PARAMS, self.env, mem="VRAM")
        b = Peer("gpu-target", "TCPX", PARAMS, self.env, mem="VRAM")
        try:
            a.call("add_remote", b.call("metadata"))
            write_read_lists(a, b, "vram")
        finally:
            a.close()
            b.close()

    def close(self):
        self.init.close()
        self.target.close()


ORDER = [
    "test_bad_remote_metadata",
    "test_unknown_remote_agent",
    "test_write_read_lists",
    "test_notifications_both_ways",
    "test_same_memory_registered_twice",
    "test_local_transfer",
    "test_disconnect_and_reconnect",
    "test_simultaneous_connect",
    "test_peer_killed_mid_transfer",
    "test_peer_replaced_under_the_same_name",
    "test_torn_down_agent_fails_fast",
    "test_metadata_of_a_departed_agent",
    "test_vram_write_read_lists",
]


def main():
    only = sys.argv[1:]
    suite = Suite()
    failed = 0
    try:
        for name in ORDER:
            if only and not any(o in name for o in only):
                continue
            t = time.monotonic()
            try:
                if name != "test_bad_remote_metadata" and not suite.loaded:
                    suite.load()
                note = getattr(suite, name)()
                print(f"{'SKIP' if note else 'PASS'} {name} ({time.monotonic() - t:.1f} s)"
                      + (f": {note}" if note else ""), flush=True)
            except Exception:
                failed += 1
                print(f"FAIL {name} ({time.monotonic() - t:.1f} s)", flush=True)
                traceback.print_exc()
    finally:
        suite.close()
    print(f"{'FAILED' if failed else 'ok'}: {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
