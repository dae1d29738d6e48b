//! Two endpoints in two processes over loopback: verified data both ways (contiguous and
//! vectored), and a peer killed mid-transfer. The child is this test binary itself, run with
//! `TCPX_RT_CHILD=<role>` on the ignored `child` test; the parent's metadata reaches it on
//! stdin. Every wait is bounded and the child is killed if the parent fails.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use tcpx_runtime::control::EndpointMetadata;
use tcpx_runtime::{Endpoint, Segment};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const ROLE_VAR: &str = "TCPX_RT_CHILD";
const SIZES: [usize; 5] = [1, 4097, MIB + 3, 16 * MIB, 64 * MIB];
const CHANNELS: u16 = 4;
const CHUNK: u32 = 256 * KIB as u32;

/// Kills the child unless it was reaped.
struct ChildGuard(Option<Child>);

impl ChildGuard {
    fn spawn(role: &str) -> Self {
        let exe = std::env::current_exe().expect("test binary path");
        let child = Command::new(exe)
            .args([
                "--exact",
                "child",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ROLE_VAR, role)
            .env("TCPX_SOCKET_IFNAME", "lo")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the child process");
        Self(Some(child))
    }

    fn child(&mut self) -> &mut Child {
        self.0.as_mut().expect("child")
    }

    /// Waits for the child to exit within `timeout`; kills it otherwise.
    fn wait(mut self, timeout: Duration) -> (std::process::ExitStatus, String) {
        let mut child = self.0.take().expect("child");
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(status) = child.try_wait().expect("try_wait") {
                break status;
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("child did not exit within {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let mut out = String::new();
        if let Some(stdout) = child.stdout.take() {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                out.push_str(&line);
                out.push('\n');
            }
        }
        (status, out)
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Starts an endpoint, spawns the child with `role`, hands it our metadata and accepts it.
fn parent(role: &str) -> (Endpoint, tcpx_runtime::Connection, ChildGuard) {
    let ep = Endpoint::new(config(CHANNELS, CHUNK)).expect("endpoint");
    let mut child = ChildGuard::spawn(role);
    let hex = ep.metadata().to_hex().expect("metadata");
    {
        let stdin = child.child().stdin.as_mut().expect("child stdin");
        writeln!(stdin, "{hex}").expect("write metadata");
    }
    let conn = ep.accept_timeout(DEADLINE).expect("accept the child");
    (ep, conn, child)
}

#[test]
fn verified_data_between_two_processes() {
    loopback();
    let (ep, conn, child) = parent("peer");
    let max = SIZES.iter().copied().max().unwrap_or(0);
    for (i, &len) in SIZES.iter().enumerate() {
        let src = source(&ep, len, i as u64);
        conn.send(&src, 0, len).unwrap().wait(DEADLINE).unwrap();
    }
    let dst = ep.alloc_host(max).unwrap();
    for (i, &len) in SIZES.iter().enumerate() {
        let rx = conn.recv(&dst, 0, len).unwrap();
        assert_eq!(rx.wait(DEADLINE).unwrap(), len as u64);
        assert_pattern(
            &dst,
            0,
            len,
            100 + i as u64,
            &format!("from the child, {len} bytes"),
        );
    }
    // Vectored: two segments here, three in the child.
    let total = 3 * MIB + 1000;
    let src = source(&ep, total, 500);
    let segs = [
        Segment::new(&src, 0, 1000),
        Segment::new(&src, 1000, 3 * MIB),
    ];
    conn.send_vectored(&segs).unwrap().wait(DEADLINE).unwrap();
    let (status, out) = child.wait(DEADLINE);
    assert!(status.success(), "child failed: {status}\n{out}");
    assert!(out.contains("CHILD OK"), "child output:\n{out}");
}

#[test]
fn killed_peer_fails_every_pending_transfer() {
    loopback();
    let (ep, conn, mut child) = parent("streamer");
    let len = 64 * MIB;
    let dst = ep.alloc_host(len).unwrap();
    let pending: Vec<_> = (0..4).map(|_| conn.recv(&dst, 0, len).unwrap()).collect();
    let src = ep.alloc_host(len).unwrap();
    let unmatched_send = conn.send(&src, 0, len).unwrap();
    // The child sends one whole transfer, posts a second (which may be mid-flight, or may
    // land, when the kill comes) and then sends nothing more: receives 3 and 4 and our send
    // have no counterpart, so at least three of the four pending transfers must fail, however
    // fast the machine streams.
    assert_eq!(
        pending[0].wait(DEADLINE).expect("the first transfer"),
        len as u64
    );
    child.child().kill().expect("kill the child");
    let killed_at = Instant::now();
    let timeout = ep.config().timeout;
    let mut failed = 0;
    for t in pending[1..].iter().chain(std::iter::once(&unmatched_send)) {
        match t.wait(DEADLINE) {
            Ok(_) => {}
            Err(e) => {
                failed += 1;
                assert_eq!(e.peer(), Some(conn.peer()), "{e}");
            }
        }
    }
    let elapsed = killed_at.elapsed();
    eprintln!("{failed} of 4 pending transfers failed within {elapsed:?} of the kill");
    assert!(
        elapsed < timeout,
        "pending transfers took {elapsed:?} to fail"
    );
    assert!(failed >= 3, "only {failed} of 4 pending transfers failed");
    assert!(conn.error().is_some());
    drop(child);
}

/// The child side; does nothing unless started by a parent test.
#[test]
#[ignore = "run by the two-process tests as their child"]
fn child() {
    loopback();
    let Ok(role) = std::env::var(ROLE_VAR) else {
        return;
    };
    let mut line = String::new();
    std::io::stdin()
        .read_line(&mut line)
        .expect("metadata on stdin");
    let meta: EndpointMetadata = line.trim().parse().expect("metadata");
    let ep = Endpoint::new(config(CHANNELS, CHUNK)).expect("child endpoint");
    let conn = ep.connect(&meta).expect("child connect");
    match role.as_str() {
        "peer" => {
            let max = SIZES.iter().copied().max().unwrap_or(0);
            let dst = ep.alloc_host(max).unwrap();
            for (i, &len) in SIZES.iter().enumerate() {
                conn.recv(&dst, 0, len).unwrap().wait(DEADLINE).unwrap();
                assert_pattern(
                    &dst,
                    0,
                    len,
                    i as u64,
                    &format!("from the parent, {len} bytes"),
                );
            }
            for (i, &len) in SIZES.iter().enumerate() {
                let src = source(&ep, len, 100 + i as u64);
                conn.send(&src, 0, len).unwrap().wait(DEADLINE).unwrap();
            }
            let total = 3 * MIB + 1000;
            let r = ep.alloc_host(total + 64).unwrap();
            let segs = [
                Segment::new(&r, 0, 10),
                Segment::new(&r, 10, 2 * MIB),
                Segment::new(&r, 10 + 2 * MIB, total - 10 - 2 * MIB),
            ];
            conn.recv_vectored(&segs).unwrap().wait(DEADLINE).unwrap();
            assert_pattern(&r, 0, total, 500, "vectored from the parent");
            println!("CHILD OK");
            conn.close().expect("graceful close");
        }
        "streamer" => {
            let len = 64 * MIB;
            let src = ep.alloc_host(len).unwrap();
            conn.send(&src, 0, len).unwrap().wait(DEADLINE).unwrap();
            // A second send is posted (it may be mid-flight when the parent kills us) and we
            // then wait to be killed; DEADLINE bounds an orphan.
            let second = conn.send(&src, 0, len).unwrap();
            std::thread::sleep(DEADLINE);
            drop(second);
        }
        other => panic!("unknown child role {other}"),
    }
}
