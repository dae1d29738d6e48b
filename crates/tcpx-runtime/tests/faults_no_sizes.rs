//! The runtime over a plugin whose `test` never writes sizes (tcpx-socket with
//! `TCPX_SOCKET_NO_SIZES=1`, the way nccl-fastsocket behaves): two-sided transfers (the path of
//! `tcpx-bench stack` and `server`/`client`), one-sided write and read (the path of `tcpx-bench
//! onesided`) all move verified bytes; then the `tcpx-bench` binary itself runs `stack`,
//! `onesided` and a `server`/`client` pair with `--verify` in that mode. Its own test binary,
//! because the plugin reads the variable once per process.

mod common;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Once;
use std::time::{Duration, Instant};

use common::*;

const MIB: usize = 1 << 20;

fn no_sizes_on_loopback() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| std::env::set_var(tcpx::builtin::NO_SIZES_ENV, "1"));
    loopback();
}

/// Eager messages copied into frames and detached ones (their bytes after the frame, straight
/// into their receives or through a receive frame) arrive whole when the plugin reports the
/// posted size instead of the received one.
#[test]
fn eager_and_detached_messages_verify_without_plugin_sizes() {
    no_sizes_on_loopback();
    let (a, b, ab, ba) = pair(4, 256 << 10);
    let sizes: Vec<usize> = (0..600)
        .map(|i| match i % 5 {
            0 => 4096,
            1 | 2 => 64 << 10,
            3 => 40_000,
            _ => 100,
        })
        .collect();
    let stride = 64 << 10;
    let src = source(&a, sizes.len() * stride, 77);
    let dst = b.alloc_host(sizes.len() * stride).unwrap();
    exchange_verified((&ab, &ba), (&src, &dst), &sizes, stride, "no sizes");
}

#[test]
fn two_sided_and_one_sided_traffic_verifies_without_plugin_sizes() {
    no_sizes_on_loopback();
    let (a, b, ab, ba) = pair(4, 256 << 10);
    let mut rng = Rng(14);
    let dst = b.alloc_host(16 * MIB + 4096).unwrap();
    for round in 0..16u64 {
        let len = 1 + rng.below(16 * MIB as u64) as usize;
        let src = source(&a, len, round);
        send_verified(&ab, &ba, &src, &dst, len, round);
    }
    // One-sided: write into an advertised region, read it back into a fresh one.
    let target = b.alloc_host(8 * MIB).unwrap();
    let d = b.advertise(&target).unwrap();
    for round in 0..8u64 {
        let len = 1 + rng.below(8 * MIB as u64) as usize;
        write_and_read_back((&a, &ab), (&target, d), len, 100 + round, "one-sided");
    }
    assert!(ab.error().is_none() && ba.error().is_none());
}

/// `target/<profile>/tcpx-bench`, next to this test's `deps` directory, if it was built.
fn bench_binary() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let bin = exe.parent()?.parent()?.join("tcpx-bench");
    bin.exists().then_some(bin)
}

fn bench(bin: &PathBuf) -> Command {
    let mut cmd = Command::new(bin);
    cmd.env(tcpx::builtin::NO_SIZES_ENV, "1")
        .env("TCPX_SOCKET_IFNAME", "lo")
        .env("NCCL_SOCKET_IFNAME", "lo")
        .env_remove("UCCL_TCPX_PLUGIN_PATH")
        .env_remove("TCPX_PLUGIN_PATH");
    cmd
}

/// Runs `cmd` to completion within `limit`, returning its stdout; panics with its output on a
/// failure or overrun.
fn run_bounded(mut cmd: Command, limit: Duration, what: &str) -> String {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{what}: spawn: {e}"));
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what}: still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = std::io::read_to_string(child.stdout.take().unwrap()).unwrap_or_default();
    let err = std::io::read_to_string(child.stderr.take().unwrap()).unwrap_or_default();
    assert!(
        status.success(),
        "{what}: {status}\nstdout:\n{out}\nstderr:\n{err}"
    );
    out
}

#[test]
fn tcpx_bench_stack_onesided_and_server_client_verify_without_plugin_sizes() {
    no_sizes_on_loopback();
    let Some(bin) = bench_binary() else {
        eprintln!(
            "SKIP: tcpx-bench is not built next to this test (cargo build -p tcpx-tools); \
             the in-process test above covers the same paths"
        );
        return;
    };
    let limit = Duration::from_secs(120);
    let mut stack = bench(&bin);
    stack.args([
        "stack",
        "--channels",
        "2",
        "--sizes",
        "1MiB,4MiB",
        "--reps",
        "1",
        "--bytes",
        "16MiB",
        "--verify",
    ]);
    run_bounded(stack, limit, "tcpx-bench stack");
    let mut onesided = bench(&bin);
    onesided.args([
        "onesided",
        "--op",
        "write,read",
        "--block",
        "64KiB,1MiB",
        "--batch",
        "1,8",
        "--channels",
        "2",
    ]);
    run_bounded(onesided, limit, "tcpx-bench onesided");

    // server / client: the server prints its metadata line, the client sends with --verify.
    let common_args = [
        "--channels",
        "2",
        "--sizes",
        "4KiB,1MiB,8MiB",
        "--iters",
        "8",
        "--warmup",
        "1",
        "--verify",
        "--timeout",
        "30",
    ];
    // Port 0: the server finds a free control port with a free neighbour for its baseline.
    let mut server = bench(&bin)
        .args(["server", "--bind", "127.0.0.1:0"])
        .args(common_args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn tcpx-bench server");
    let mut lines = BufReader::new(server.stdout.take().unwrap()).lines();
    let start = Instant::now();
    let meta = loop {
        match lines.next() {
            Some(Ok(line)) => {
                if let Some(hex) = line.split("TCPX-BENCH-METADATA").nth(1) {
                    break hex.trim().to_string();
                }
            }
            _ => {
                let _ = server.kill();
                let _ = server.wait();
                panic!("tcpx-bench server exited before printing its metadata");
            }
        }
        assert!(start.elapsed() < limit, "no metadata line from the server");
    };
    let mut client = bench(&bin);
    client.args(["client", "--peer", &meta]).args(common_args);
    // A failing client must not leave the server running: catch, reap the server, re-raise.
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        run_bounded(client, limit, "tcpx-bench client")
    }));
    let status = loop {
        if let Some(s) = server.try_wait().unwrap() {
            break Some(s);
        }
        if start.elapsed() > limit {
            let _ = server.kill();
            let _ = server.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = result.unwrap_or_else(|e| std::panic::resume_unwind(e));
    let status = status.expect("tcpx-bench server did not exit after the client finished");
    let err = std::io::read_to_string(server.stderr.take().unwrap()).unwrap_or_default();
    assert!(status.success(), "tcpx-bench server: {status}\n{err}");
    assert!(out.contains("MiB"), "client printed no table:\n{out}");
}
