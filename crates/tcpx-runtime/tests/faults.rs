//! Faults on purpose: tcpx-socket's fault mode (`TCPX_SOCKET_FAULT`) makes a request fail after
//! N bytes, a `test` return an error, a connection drop mid-stream, or completions arrive late.
//! Under each, every pending transfer ends — completed with verified bytes or failed with an
//! error naming its peer (and, for the side whose plugin failed, the channel) — within a bound;
//! the endpoints then accept a new connection that moves verified data (the faults hit only the
//! first comm of a side: `comms:1`), and no fd or thread is left behind.
//!
//! The plugin reads its environment once per process, so each scenario runs in a child: this
//! test binary itself, started on the ignored `child` test with `TCPX_FAULT_SCENARIO` and
//! `TCPX_SOCKET_FAULT` set; both endpoints live in the child. Every wait is bounded and the
//! child is killed if it overruns.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use tcpx_runtime::{Backend, Config, Connection, Endpoint, Region, RemoteSegment, Segment};

const MIB: usize = 1 << 20;
const SCENARIO_VAR: &str = "TCPX_FAULT_SCENARIO";
/// Transfers posted each way while the fault strikes.
const PENDING: usize = 6;
const LEN: usize = 2 * MIB;
/// A child scenario must finish within this.
const CHILD_LIMIT: Duration = Duration::from_secs(120);
/// The engine's per-wait timeout in the child: a transfer nobody can complete fails after it.
const ENGINE_TIMEOUT: Duration = Duration::from_secs(5);

/// Runs the child with `scenario` and `fault`; returns its stdout, panicking on failure.
fn run_child(scenario: &str, fault: &str) -> String {
    let exe = std::env::current_exe().expect("test binary path");
    let mut child = Command::new(exe)
        .args([
            "--exact",
            "child",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(SCENARIO_VAR, scenario)
        .env(tcpx::builtin::FAULT_ENV, fault)
        .env("TCPX_SOCKET_IFNAME", "lo")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the child");
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("try_wait") {
            break s;
        }
        if start.elapsed() > CHILD_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            panic!("scenario {scenario} ({fault}) still running after {CHILD_LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = std::io::read_to_string(child.stdout.take().unwrap()).unwrap_or_default();
    let err = std::io::read_to_string(child.stderr.take().unwrap()).unwrap_or_default();
    assert!(
        status.success() && out.contains("CHILD OK"),
        "scenario {scenario} ({fault}): {status}\nstdout:\n{out}\nstderr:\n{err}"
    );
    eprintln!("{scenario} ({fault}) in {:?}:\n{out}", start.elapsed());
    out
}

#[test]
fn a_request_failing_after_n_bytes_fails_the_pending_transfers() {
    run_child("fail", "fail_after_bytes:4194304,side:recv,comms:1");
}

#[test]
fn an_error_from_test_fails_the_pending_transfers() {
    run_child("fail", "test_error:20,comms:1");
}

#[test]
fn a_connection_dropped_mid_stream_fails_the_pending_transfers() {
    run_child("fail", "drop_conn_after_bytes:4194304,side:send,comms:1");
}

#[test]
fn delayed_completions_still_deliver_every_byte() {
    run_child("delay", "delay_us:2000");
}

#[test]
fn a_malformed_fault_spec_is_reported_at_init() {
    run_child("bad-spec", "fail_after_bytes:lots");
}

fn child_config() -> Config {
    Config::builder()
        .backend(Backend::Builtin)
        .control_addr("127.0.0.1:0".parse().unwrap())
        .channels(2)
        .chunk_bytes(256 << 10)
        .timeout(ENGINE_TIMEOUT)
        .build()
        .expect("valid config")
}

/// A posted transfer and how to check it: `Some((region, offset, len, seed))` for one whose
/// destination must hold `fill(seed)` if it completes.
struct Posted<'r> {
    what: String,
    transfer: tcpx_runtime::Transfer,
    check: Option<(&'r Region, usize, usize, u64)>,
    conn_peer: std::net::SocketAddr,
}

/// Posts two-sided transfers both ways and one-sided writes and reads both ways, then waits
/// for every one. Returns (completed, failed, error texts, failures that were timeouts).
fn storm(
    a: &Endpoint,
    b: &Endpoint,
    ab: &Connection,
    ba: &Connection,
    seed0: u64,
) -> (usize, usize, Vec<String>, usize) {
    let srcs_a: Vec<Region> = (0..PENDING)
        .map(|i| source(a, LEN, seed0 + i as u64))
        .collect();
    let srcs_b: Vec<Region> = (0..PENDING)
        .map(|i| source(b, LEN, seed0 + 100 + i as u64))
        .collect();
    // One destination region per receive: a region is not CPU-readable while any operation on
    // it is in flight, and a failed connection keeps its failed operations until it closes.
    let dst_a: Vec<Region> = (0..PENDING).map(|_| a.alloc_host(LEN).unwrap()).collect();
    let dst_b: Vec<Region> = (0..PENDING).map(|_| b.alloc_host(LEN).unwrap()).collect();
    // One-sided: b's target takes a's writes; b's filled region is read by a (and vice versa).
    let target_b = b.alloc_host(LEN).unwrap();
    let readable_b = source(b, LEN, seed0 + 200);
    let target_a = a.alloc_host(LEN).unwrap();
    let readable_a = source(a, LEN, seed0 + 300);
    let (tb, rb) = (
        b.advertise(&target_b).unwrap(),
        b.advertise(&readable_b).unwrap(),
    );
    let (ta, ra) = (
        a.advertise(&target_a).unwrap(),
        a.advertise(&readable_a).unwrap(),
    );
    let back_a = a.alloc_host(LEN).unwrap();
    let back_b = b.alloc_host(LEN).unwrap();
    let mut posted: Vec<Posted<'_>> = Vec::new();
    let mut post = |what: String,
                    t: tcpx_runtime::Result<tcpx_runtime::Transfer>,
                    check,
                    conn: &Connection| match t {
        Ok(transfer) => posted.push(Posted {
            what,
            transfer,
            check,
            conn_peer: conn.peer(),
        }),
        // A connection already failed refuses new work at once: that is a failure too,
        // reported without waiting.
        Err(e) => eprintln!("{what}: refused at post: {e}"),
    };
    for i in 0..PENDING {
        post(
            format!("recv {i} at b"),
            ba.recv(&dst_b[i], 0, LEN),
            Some((&dst_b[i], 0, LEN, seed0 + i as u64)),
            ba,
        );
        post(
            format!("recv {i} at a"),
            ab.recv(&dst_a[i], 0, LEN),
            Some((&dst_a[i], 0, LEN, seed0 + 100 + i as u64)),
            ab,
        );
    }
    for i in 0..PENDING {
        post(
            format!("send {i} a->b"),
            ab.send(&srcs_a[i], 0, LEN),
            None,
            ab,
        );
        post(
            format!("send {i} b->a"),
            ba.send(&srcs_b[i], 0, LEN),
            None,
            ba,
        );
    }
    let remote = |d| [RemoteSegment::new(d, 0, LEN as u64)];
    post(
        "write a->b".into(),
        ab.write(&[Segment::new(&srcs_a[0], 0, LEN)], &remote(tb), None),
        Some((&target_b, 0, LEN, seed0)),
        ab,
    );
    post(
        "read a<-b".into(),
        ab.read(&[Segment::new(&back_a, 0, LEN)], &remote(rb)),
        Some((&back_a, 0, LEN, seed0 + 200)),
        ab,
    );
    post(
        "write b->a".into(),
        ba.write(&[Segment::new(&srcs_b[0], 0, LEN)], &remote(ta), None),
        Some((&target_a, 0, LEN, seed0 + 100)),
        ba,
    );
    post(
        "read b<-a".into(),
        ba.read(&[Segment::new(&back_b, 0, LEN)], &remote(ra)),
        Some((&back_b, 0, LEN, seed0 + 300)),
        ba,
    );
    let start = Instant::now();
    let (mut done, mut failed, mut errors, mut timeouts) = (0, 0, Vec::new(), 0);
    for p in &posted {
        match p.transfer.wait(DEADLINE) {
            Ok(n) => {
                assert_eq!(n, LEN as u64, "{}", p.what);
                done += 1;
            }
            Err(e) => {
                assert!(
                    !e.is_timeout() || start.elapsed() < DEADLINE,
                    "{}: {e}",
                    p.what
                );
                assert!(
                    !matches!(e, tcpx_runtime::Error::WaitTimedOut(_)),
                    "{}: still pending after {DEADLINE:?}",
                    p.what
                );
                assert_eq!(e.peer(), Some(p.conn_peer), "{}: {e}", p.what);
                failed += 1;
                timeouts += usize::from(e.is_timeout());
                errors.push(format!("{}: {e}", p.what));
            }
        }
    }
    // Nothing hangs: every transfer ended within the engine's timeout plus the time the
    // healthy ones need.
    let waited = start.elapsed();
    assert!(
        waited < ENGINE_TIMEOUT * 3,
        "the pending transfers took {waited:?} to end"
    );
    // Every completed transfer delivered exactly its bytes (checked once all have ended: a
    // source region shared by a send and a write is busy until both are).
    for p in &posted {
        if let (Ok(_), Some((r, off, len, seed))) = (p.transfer.wait(DEADLINE), p.check) {
            assert_pattern(r, off, len, seed, &p.what);
        }
    }
    (done, failed, errors, timeouts)
}

/// The child side; does nothing unless started by a parent test.
#[test]
#[ignore = "run by the fault tests as their child"]
fn child() {
    loopback();
    let Ok(scenario) = std::env::var(SCENARIO_VAR) else {
        return;
    };
    if scenario == "bad-spec" {
        let err = Endpoint::new(child_config()).expect_err("a malformed TCPX_SOCKET_FAULT");
        println!("endpoint refused: {err}");
        println!("CHILD OK");
        return;
    }
    let a = Endpoint::new(child_config()).expect("endpoint a");
    let b = Endpoint::new(child_config()).expect("endpoint b");
    let (fds0, threads0) = (open_fds(), threads());

    let (ab, ba) = connect(&a, &b);
    let (done, failed, errors, timeouts) = storm(&a, &b, &ab, &ba, 1);
    for e in &errors {
        println!("  {e}");
    }
    println!("first connection: {done} completed and verified, {failed} failed");
    match scenario.as_str() {
        "fail" => {
            assert!(failed > 0, "the fault made nothing fail");
            assert!(
                errors.iter().any(|e| e.contains("channel ")),
                "no error names a channel"
            );
            assert!(ab.error().is_some() || ba.error().is_some());
            // The side whose plugin did not fail hears why from its peer (a control `Error`)
            // and fails at once, instead of waiting for its transfers' deadline.
            assert_eq!(
                timeouts, 0,
                "transfers waited for their deadline instead of hearing from the peer: {errors:?}"
            );
        }
        "delay" => {
            assert_eq!(failed, 0, "delayed completions failed: {errors:?}");
        }
        other => panic!("unknown scenario {other}"),
    }
    let injected = tcpx::builtin::faults_injected();
    assert!(injected > 0, "no fault was injected");
    println!("faults injected: {injected}");
    drop((ab, ba));

    // A new connection on the same endpoints works (the faults hit the first comms only, or
    // only delay) and moves verified bytes both ways.
    let (ab, ba) = connect(&a, &b);
    let (done2, failed2, errors2, _) = storm(&a, &b, &ab, &ba, 1000);
    assert_eq!(failed2, 0, "second connection: {errors2:?}");
    println!("second connection: {done2} completed and verified");
    drop((ab, ba));

    // No fd or thread of either connection is left (threads exit asynchronously: bounded wait).
    let clean = eventually(Duration::from_secs(10), || {
        open_fds() == fds0 && threads() == threads0
    });
    assert!(
        clean,
        "fds {} (were {fds0}), threads {} (were {threads0})",
        open_fds(),
        threads()
    );
    println!("CHILD OK");
}
