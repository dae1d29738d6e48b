//! The soak behind `cargo xtask soak --seconds N` (ignored here; xtask runs it): one endpoint in
//! this process against a succession of peer processes (this test binary, role `soak_peer`),
//! each killed at a random point or started with a random plugin fault (`TCPX_SOCKET_FAULT`),
//! or left to finish its ops and close. Operations of random size (1 B to 8 MiB), two-sided both
//! ways and one-sided write and read, run in lockstep (each acknowledged by a notification), and
//! every byte is checked where it lands.
//!
//! Accounting, printed at the end:
//! * **done**: operations whose bytes arrived and verified (by the side that received them);
//! * **failed**: operations that ended with an error (a killed or faulted peer), and peers that
//!   exited on an error of their own;
//! * **lost**: operations that neither completed with verified bytes nor failed with an error
//!   within their timeout, plus any verified mismatch (a peer exiting with code 4, or bytes that
//!   completed here but differ). Must be 0, or the soak fails;
//! * **faults injected**: peers killed plus peers started with a plugin fault.
//!
//! The endpoint's fd and thread counts must be back where they started once the last peer is
//! gone.

mod common;

use std::io::{BufRead, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use tcpx_runtime::{
    Backend, Config, Connection, Descriptor, Endpoint, Region, RemoteSegment, Segment,
};

const ROLE_VAR: &str = "TCPX_SOAK_PEER";
const SECONDS_VAR: &str = "TCPX_SOAK_SECONDS";
const REGION: usize = 8 << 20;
/// The engine gives up on a stalled transfer after this.
const ENGINE_TIMEOUT: Duration = Duration::from_secs(4);
/// An operation with no outcome after this is lost (well above the engine's timeout, so a
/// failing operation reports its error first).
const OP_TIMEOUT: Duration = Duration::from_secs(15);

fn soak_config() -> Config {
    Config::builder()
        .backend(Backend::Builtin)
        .control_addr("127.0.0.1:0".parse().unwrap())
        .channels(2)
        .chunk_bytes(256 << 10)
        .timeout(ENGINE_TIMEOUT)
        .build()
        .expect("valid config")
}

/// One operation, the same on both sides (derived from the peer's seed).
#[derive(Clone, Copy, Debug)]
enum Op {
    /// The parent sends, the peer receives and checks.
    Push { len: usize },
    /// The peer sends, the parent receives and checks.
    Pull { len: usize },
    /// The peer writes into the parent's target region (notification after the data).
    Write { len: usize },
    /// The peer reads from the parent's fixed region at `off` and checks.
    Read { off: usize, len: usize },
}

impl Op {
    fn len(self) -> usize {
        match self {
            Op::Push { len } | Op::Pull { len } | Op::Write { len } | Op::Read { len, .. } => len,
        }
    }
}

fn ops(seed: u64, n: usize) -> Vec<Op> {
    let mut rng = Rng(seed);
    (0..n)
        .map(|_| {
            let bits = 1 + rng.below(23);
            let len = 1 + rng.below(1 << bits) as usize;
            match rng.below(4) {
                0 => Op::Push { len },
                1 => Op::Pull { len },
                2 => Op::Write { len },
                _ => Op::Read {
                    off: rng.below((REGION - len + 1) as u64) as usize,
                    len,
                },
            }
        })
        .collect()
}

fn data_seed(gen: u64, i: usize) -> u64 {
    gen * 1_000_003 + i as u64
}

/// The fixed contents of the parent's readable region.
const READ_SEED: u64 = 0xfeed;

#[derive(Default, Debug)]
struct Tally {
    peers: u64,
    killed: u64,
    faulted: u64,
    done: u64,
    bytes: u64,
    failed: u64,
    lost: u64,
}

/// What ended an operation on the parent's side.
enum Outcome {
    Done,
    Failed(String),
    Lost(String),
}

/// Waits for `t`, killing the peer when its time comes.
fn wait_transfer(t: &tcpx_runtime::Transfer, peer: &mut Peer) -> Outcome {
    let start = Instant::now();
    loop {
        match t.wait(Duration::from_millis(10)) {
            Ok(_) => return Outcome::Done,
            Err(tcpx_runtime::Error::WaitTimedOut(_)) => {}
            Err(e) => return Outcome::Failed(e.to_string()),
        }
        peer.maybe_kill();
        if start.elapsed() > OP_TIMEOUT {
            return Outcome::Lost(format!("transfer still pending after {OP_TIMEOUT:?}"));
        }
    }
}

/// Waits for the notification `want` from the peer (stale ones of earlier peers are dropped).
fn wait_note(ep: &Endpoint, conn: &Connection, want: &[u8], peer: &mut Peer) -> Outcome {
    let start = Instant::now();
    loop {
        if ep.notifications().iter().any(|(_, b)| b == want) {
            return Outcome::Done;
        }
        if let Some(e) = conn.error() {
            return Outcome::Failed(e.to_string());
        }
        if peer.exited() {
            // Notifications arrive in order behind the data: give the inbox a moment.
            std::thread::sleep(Duration::from_millis(50));
            if ep.notifications().iter().any(|(_, b)| b == want) {
                return Outcome::Done;
            }
            return Outcome::Failed("peer process exited".into());
        }
        peer.maybe_kill();
        if start.elapsed() > OP_TIMEOUT {
            return Outcome::Lost(format!(
                "no notification {:?} and no error after {OP_TIMEOUT:?}",
                String::from_utf8_lossy(want)
            ));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

struct Peer {
    child: Child,
    kill_at: Option<Instant>,
    killed: bool,
    status: Option<std::process::ExitStatus>,
}

impl Peer {
    fn maybe_kill(&mut self) {
        if !self.killed && self.kill_at.is_some_and(|t| Instant::now() >= t) {
            let _ = self.child.kill();
            self.killed = true;
        }
    }

    fn exited(&mut self) -> bool {
        if self.status.is_none() {
            self.status = self.child.try_wait().ok().flatten();
        }
        self.status.is_some()
    }

    /// Reaps the child (killing it after `limit`).
    fn reap(&mut self, limit: Duration) -> std::process::ExitStatus {
        let start = Instant::now();
        while !self.exited() {
            if start.elapsed() > limit {
                let _ = self.child.kill();
                self.killed = true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.status.expect("exited")
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        if !self.exited() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

#[test]
#[ignore = "the soak: run by `cargo xtask soak --seconds N`"]
fn soak() {
    loopback();
    let seconds: u64 = std::env::var(SECONDS_VAR)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let ep = Endpoint::new(soak_config()).expect("endpoint");
    let target = ep.alloc_host(REGION).unwrap();
    let readable = source(&ep, REGION, READ_SEED);
    let (dt, dr) = (
        ep.advertise(&target).unwrap(),
        ep.advertise(&readable).unwrap(),
    );
    let (fds0, threads0) = (open_fds(), threads());
    let mut rng = Rng(std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1));
    let master_seed = rng.0;
    let mut tally = Tally::default();
    let end = Instant::now() + Duration::from_secs(seconds);
    let exe = std::env::current_exe().expect("test binary path");
    let mut gen = 0u64;
    while Instant::now() < end {
        gen += 1;
        let seed = rng.next();
        let nops = 20 + rng.below(300) as usize;
        let fault = match rng.below(6) {
            0 => Some(format!("fail_after_bytes:{}", 1 + rng.below(32 << 20))),
            1 => Some(format!("test_error:{}", 1 + rng.below(3000))),
            2 => Some(format!("drop_conn_after_bytes:{}", 1 + rng.below(32 << 20))),
            3 => Some(format!("delay_us:{}", 50 + rng.below(2000))),
            _ => None,
        };
        // Half the peers are killed at a random point of their run.
        let kill_after = (rng.below(2) == 0).then(|| Duration::from_millis(rng.below(1500)));
        let mut cmd = Command::new(&exe);
        cmd.args([
            "--exact",
            "soak_peer",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE_VAR, format!("{gen}:{seed}:{nops}"))
        .env("TCPX_SOCKET_IFNAME", "lo")
        .env_remove(tcpx::builtin::FAULT_ENV)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        if let Some(f) = &fault {
            cmd.env(tcpx::builtin::FAULT_ENV, f);
            tally.faulted += 1;
        }
        let mut peer = Peer {
            child: cmd.spawn().expect("spawn a peer"),
            kill_at: kill_after.map(|d| Instant::now() + d),
            killed: false,
            status: None,
        };
        tally.peers += 1;
        {
            let stdin = peer.child.stdin.as_mut().expect("peer stdin");
            let hex = |d: Descriptor| -> String {
                d.to_bytes().iter().map(|b| format!("{b:02x}")).collect()
            };
            writeln!(
                stdin,
                "{}\n{}\n{}",
                ep.metadata().to_hex().expect("metadata"),
                hex(dt),
                hex(dr)
            )
            .expect("write to the peer");
        }
        let conn = match ep.accept_timeout(OP_TIMEOUT) {
            Ok(c) => c,
            Err(e) => {
                // A peer killed before it connected: not an operation, not lost.
                peer.maybe_kill();
                assert!(
                    peer.killed || peer.exited(),
                    "peer {gen} neither connected nor died: {e}"
                );
                peer.reap(OP_TIMEOUT);
                tally.killed += u64::from(peer.killed);
                continue;
            }
        };
        run_peer(&ep, &conn, &target, gen, seed, nops, &mut peer, &mut tally);
        drop(conn);
        let status = peer.reap(OP_TIMEOUT);
        tally.killed += u64::from(peer.killed);
        if !peer.killed {
            match status.code() {
                Some(0) => {}
                Some(4) => {
                    eprintln!("peer {gen}: verified a mismatch (exit 4)");
                    tally.lost += 1;
                }
                _ if fault.is_some() => tally.failed += 1,
                other => {
                    eprintln!("peer {gen} ({seed}): unexpected exit {other:?} without a fault");
                    tally.lost += 1;
                }
            }
        }
    }
    let clean = eventually(Duration::from_secs(10), || {
        open_fds() == fds0 && threads() == threads0
    });
    println!(
        "soak: {seconds} s, seed {master_seed}, {} peers ({} killed, {} with a plugin fault); \
         transfers done {}, bytes verified {}, faults injected {}, failures seen {}, lost {}; \
         fds {} (start {fds0}), threads {} (start {threads0})",
        tally.peers,
        tally.killed,
        tally.faulted,
        tally.done,
        tally.bytes,
        tally.killed + tally.faulted,
        tally.failed,
        tally.lost,
        open_fds(),
        threads()
    );
    assert_eq!(tally.lost, 0, "operations lost");
    assert!(tally.done > 0, "no operation completed");
    assert!(clean, "fds or threads leaked");
}

#[allow(clippy::too_many_arguments)]
fn run_peer(
    ep: &Endpoint,
    conn: &Connection,
    target: &Region,
    gen: u64,
    seed: u64,
    nops: usize,
    peer: &mut Peer,
    tally: &mut Tally,
) {
    for (i, op) in ops(seed, nops).into_iter().enumerate() {
        let dseed = data_seed(gen, i);
        let ack = format!("{gen}:{i}").into_bytes();
        let outcome = match op {
            Op::Push { len } => {
                let src = source(ep, len, dseed);
                match conn.send(&src, 0, len) {
                    Ok(t) => match wait_transfer(&t, peer) {
                        Outcome::Done => wait_note(ep, conn, &ack, peer),
                        other => other,
                    },
                    Err(e) => Outcome::Failed(e.to_string()),
                }
            }
            Op::Pull { len } => {
                let dst = ep.alloc_host(len).unwrap();
                match conn.recv(&dst, 0, len) {
                    Ok(t) => {
                        let o = wait_transfer(&t, peer);
                        if matches!(o, Outcome::Done) {
                            let ok = dst
                                .memory()
                                .with_bytes(|b| check(&b[..len], dseed).is_ok())
                                .expect("cpu access");
                            if !ok {
                                eprintln!("peer {gen} op {i}: pulled bytes differ");
                                tally.lost += 1;
                            }
                        }
                        o
                    }
                    Err(e) => Outcome::Failed(e.to_string()),
                }
            }
            Op::Write { len } => {
                let o = wait_note(ep, conn, &ack, peer);
                if matches!(o, Outcome::Done) {
                    let ok = target
                        .memory()
                        .with_bytes(|b| check(&b[..len], dseed).is_ok())
                        .expect("cpu access");
                    if !ok {
                        eprintln!("peer {gen} op {i}: written bytes differ");
                        tally.lost += 1;
                    }
                }
                o
            }
            Op::Read { .. } => wait_note(ep, conn, &ack, peer),
        };
        match outcome {
            Outcome::Done => {
                tally.done += 1;
                tally.bytes += op.len() as u64;
            }
            Outcome::Failed(e) => {
                if tally.failed < 5 {
                    eprintln!(
                        "peer {gen} op {i} ({op:?}): failed, as a killed or faulted peer may: {e}"
                    );
                }
                tally.failed += 1;
                return;
            }
            Outcome::Lost(what) => {
                eprintln!("peer {gen} op {i} ({op:?}): LOST: {what}");
                tally.lost += 1;
                return;
            }
        }
        // The go-ahead: the peer starts op i + 1 only once this side has checked op i.
        if conn.notify(&ack).is_err() {
            tally.failed += 1;
            return;
        }
    }
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex"))
        .collect()
}

/// The peer side; does nothing unless started by the soak. Exit codes: 0 all ops done, 3 an
/// operation failed (expected under a plugin fault), 4 bytes differed.
#[test]
#[ignore = "run by the soak as its peer"]
fn soak_peer() {
    loopback();
    let Ok(role) = std::env::var(ROLE_VAR) else {
        return;
    };
    let mut it = role.split(':').map(|v| v.parse::<u64>().expect("role"));
    let (gen, seed, nops) = (
        it.next().unwrap(),
        it.next().unwrap(),
        it.next().unwrap() as usize,
    );
    let mut lines = std::io::stdin().lock().lines();
    let mut line = || lines.next().expect("a line").expect("stdin");
    let meta: tcpx_runtime::control::EndpointMetadata = line().trim().parse().expect("metadata");
    let dt = Descriptor::from_bytes(&unhex(line().trim())).expect("target descriptor");
    let dr = Descriptor::from_bytes(&unhex(line().trim())).expect("readable descriptor");
    let ep = Endpoint::new(soak_config()).expect("peer endpoint");
    let conn = ep.connect(&meta).expect("connect");
    let mut expected_read = vec![0u8; REGION];
    fill(&mut expected_read, READ_SEED);
    let fail = |what: &str, e: &dyn std::fmt::Display| -> ! {
        eprintln!("soak peer {gen}: {what}: {e}");
        std::process::exit(3)
    };
    let corrupt = |what: String| -> ! {
        eprintln!("soak peer {gen}: {what}");
        std::process::exit(4)
    };
    for (i, op) in ops(seed, nops).into_iter().enumerate() {
        let dseed = data_seed(gen, i);
        let ack = format!("{gen}:{i}").into_bytes();
        match op {
            Op::Push { len } => {
                let dst = ep.alloc_host(len).unwrap();
                let t = conn.recv(&dst, 0, len).unwrap_or_else(|e| fail("recv", &e));
                t.wait(OP_TIMEOUT).unwrap_or_else(|e| fail("recv", &e));
                let ok = dst
                    .memory()
                    .with_bytes(|b| check(&b[..len], dseed).is_ok())
                    .expect("cpu access");
                if !ok {
                    corrupt(format!("op {i}: pushed bytes differ"));
                }
                conn.notify(&ack).unwrap_or_else(|e| fail("notify", &e));
            }
            Op::Pull { len } => {
                let src = source(&ep, len, dseed);
                let t = conn.send(&src, 0, len).unwrap_or_else(|e| fail("send", &e));
                t.wait(OP_TIMEOUT).unwrap_or_else(|e| fail("send", &e));
            }
            Op::Write { len } => {
                let src = source(&ep, len, dseed);
                let t = conn
                    .write(
                        &[Segment::new(&src, 0, len)],
                        &[RemoteSegment::new(dt, 0, len as u64)],
                        Some(&ack),
                    )
                    .unwrap_or_else(|e| fail("write", &e));
                t.wait(OP_TIMEOUT).unwrap_or_else(|e| fail("write", &e));
            }
            Op::Read { off, len } => {
                let dst = ep.alloc_host(len).unwrap();
                let t = conn
                    .read(
                        &[Segment::new(&dst, 0, len)],
                        &[RemoteSegment::new(dr, off as u64, len as u64)],
                    )
                    .unwrap_or_else(|e| fail("read", &e));
                t.wait(OP_TIMEOUT).unwrap_or_else(|e| fail("read", &e));
                let ok = dst
                    .memory()
                    .with_bytes(|b| b[..len] == expected_read[off..off + len])
                    .expect("cpu access");
                if !ok {
                    corrupt(format!("op {i}: read bytes differ"));
                }
                conn.notify(&ack).unwrap_or_else(|e| fail("notify", &e));
            }
        }
        // Wait for the parent's go-ahead for this op.
        let start = Instant::now();
        loop {
            if ep.notifications().iter().any(|(_, b)| b == &ack) {
                break;
            }
            if let Some(e) = conn.error() {
                fail("waiting for the go-ahead", &e);
            }
            if start.elapsed() > OP_TIMEOUT {
                fail("waiting for the go-ahead", &"timed out");
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    let _ = conn.close();
    std::process::exit(0);
}
