//! `tcpx-bench` as a user (or an attacker) runs it: the built binary, real processes, real
//! sockets on 127.0.0.1 only. Each test names the issue item it guards.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use tcpx_runtime::control::EndpointMetadata;

const BENCH: &str = env!("CARGO_BIN_EXE_tcpx-bench");

fn bench() -> Command {
    let mut c = Command::new(BENCH);
    c.env("TCPX_SOCKET_IFNAME", "lo")
        .env("TCPX_LOG", "warn")
        .env_remove("TCPX_PLUGIN_PATH")
        .env_remove("UCCL_TCPX_PLUGIN_PATH")
        .env_remove("TCPX_BACKEND")
        .env_remove("TCPX_GPU_NIC_MAP")
        .env_remove("TCPX_NUM_CHANNELS")
        .env_remove("UCCL_TCPX_NUM_CHANNELS");
    c
}

fn run(args: &[&str]) -> Output {
    bench().args(args).output().expect("run tcpx-bench")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A running server and the metadata it printed.
struct Server {
    child: Child,
    peer: String,
    /// The control port the server got (its raw-TCP baseline listens on the next one).
    port: u16,
}

impl Server {
    fn start(args: &[&str]) -> Self {
        Self::start_role(&["server"], args)
    }

    /// `role` is `["server"]` or `["kv", "server"]`. The server binds port 0 and the test
    /// learns the port from its metadata: picking two free ports first and handing them over
    /// raced with every other test's connections on a busy CI host.
    fn start_role(role: &[&str], args: &[&str]) -> Self {
        let bind = "127.0.0.1:0";
        let mut child = bench()
            .args(role)
            .args(["--bind", bind])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start server");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let Some(line) = lines.next() else {
            // Say why: the server's own error is the whole diagnosis.
            let status = child.wait().unwrap();
            let mut err = String::new();
            let _ = child.stderr.take().unwrap().read_to_string(&mut err);
            panic!("server on {bind} exited ({status}) before its metadata: {err}");
        };
        let line = line.expect("utf-8");
        let peer = line
            .strip_prefix("TCPX-BENCH-METADATA ")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
            .to_string();
        let port = EndpointMetadata::from_hex(&peer)
            .expect("the server's metadata decodes")
            .control_addr
            .port();
        Self { child, peer, port }
    }

    fn wait(mut self) -> (Option<i32>, String) {
        let status = self.child.wait().unwrap();
        let mut err = String::new();
        self.child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .unwrap();
        (status.code(), err)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn json_rows(path: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn tmp(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("tcpx-bench-test-{}-{name}", std::process::id()))
}

/// Runs `tcpx-bench server` and `client` with `args` on both sides; both must succeed.
/// Returns the client's JSON rows and its standard output.
fn server_client_rows(args: &[&str], json_name: &str) -> (Vec<serde_json::Value>, String) {
    client_rows(Server::start(args), &["client"], args, json_name)
}

/// Runs the client `role` (`["client"]` or `["kv", "client"]`) with `args` against `server`;
/// both must succeed. Returns the client's JSON rows and its standard output.
fn client_rows(
    server: Server,
    role: &[&str],
    args: &[&str],
    json_name: &str,
) -> (Vec<serde_json::Value>, String) {
    let json = tmp(json_name);
    let out = bench()
        .args(role)
        .args(["--peer", &server.peer, "--json"])
        .arg(&json)
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "{role:?}: {}", text(&out.stderr));
    let (code, err) = server.wait();
    assert_eq!(code, Some(0), "{role:?}'s server: {err}");
    let rows = json_rows(&json);
    let _ = std::fs::remove_file(json);
    (rows, text(&out.stdout))
}

/// Issue 16: registration, allocation and first touches are paid before any clock starts,
/// and `--verify` checks after the timed part: inside every timed window, neither process
/// adds a registration or takes more than a handful of page faults. 64 KiB messages travel
/// detached (registered per slot region and eager channel): the warm-up registers them.
#[test]
fn one_time_costs_are_paid_before_the_timer_starts() {
    let args = [
        "--sizes",
        "64KiB,1MiB,4MiB",
        "--iters",
        "8",
        "--min-bytes",
        "16MiB",
        "--verify",
        "--timeout",
        "30",
    ];
    let (rows, _) = server_client_rows(&args, "costs.json");
    assert_eq!(rows.len(), 3);
    for row in &rows {
        assert_eq!(row["timed_registrations"], 0, "{row}");
        let faults = row["timed_page_faults"].as_u64().expect("counted");
        // A 1 MiB message into untouched memory alone is 256 first touches per slot.
        assert!(
            faults < 64,
            "{faults} page faults inside the timed window: {row}"
        );
        assert_eq!(row["verified"], true, "{row}");
    }
}

/// A server bound to port 0 (the kernel picks a free one, as a launcher of several servers
/// wants) listens for the raw-TCP baseline next to the port it got, where clients look: its
/// baseline had gone to port 1, and every client failed at the baseline. Both roles, with
/// the baseline's figures in the rows.
#[test]
fn a_server_on_port_zero_serves_its_baseline_next_to_the_port_it_got() {
    for role in [&["server"][..], &["kv", "server"][..]] {
        let (args, client): (&[&str], Vec<&str>) = if role.len() == 1 {
            (
                &["--sizes", "64KiB", "--iters", "8", "--min-bytes", "1MiB"],
                vec!["client"],
            )
        } else {
            (
                &["--shapes", "4x16KiB", "--min-bytes", "1MiB"],
                vec!["kv", "client"],
            )
        };
        let server = Server::start_role(role, args);
        let name = format!("port-zero-{}.json", role.len());
        let (rows, _) = client_rows(server, &client, args, &name);
        assert!(!rows.is_empty(), "{role:?}: no rows");
        for row in &rows {
            let baseline = row["baseline_gbps"].as_f64().unwrap_or(0.0);
            assert!(baseline > 0.0, "{role:?}: no baseline figure in {row}");
        }
    }
}

/// Issue 25: `--batch` posts small messages in batches (`send_batch` / `recv_batch`) between
/// two processes; every slot is verified, and the pack buffers are grown and registered in
/// the warm-up, not inside the timed window.
#[test]
fn batched_small_messages_are_verified_and_pay_their_buffers_before_the_clock() {
    let args = [
        "--sizes",
        "4KiB,16KiB,1MiB",
        "--batch",
        "256",
        "--channels",
        "4",
        "--min-bytes",
        "8MiB",
        "--verify",
        "--timeout",
        "30",
    ];
    let (rows, stdout) = server_client_rows(&args, "batch.json");
    assert!(stdout.contains("batches of up to 256 messages"), "{stdout}");
    assert_eq!(rows.len(), 3);
    for row in &rows {
        assert_eq!(row["verified"], true, "{row}");
        assert_eq!(row["timed_registrations"], 0, "{row}");
        assert!(row["gbps"].as_f64().unwrap() > 0.0, "{row}");
    }
    // 4 KiB in batches of 256 (1 MiB): at least four windows of batches are timed.
    assert!(
        rows[0]["messages"].as_u64().unwrap() >= 4 * 256,
        "{}",
        rows[0]
    );
}

/// `--one-region`: every slot in one region at consecutive offsets, eager sizes and larger,
/// one call and batches; every slot verified, nothing registered inside a timed window.
#[test]
fn one_region_slots_are_verified_for_eager_and_large_messages() {
    for batch in ["1", "64"] {
        let args = [
            "--sizes",
            "4000,64KiB,1MiB",
            "--one-region",
            "--batch",
            batch,
            "--channels",
            "4",
            "--min-bytes",
            "8MiB",
            "--verify",
            "--timeout",
            "30",
        ];
        let (rows, stdout) = server_client_rows(&args, &format!("one_region_{batch}.json"));
        assert!(
            stdout.contains("every message slot in one region"),
            "{stdout}"
        );
        assert_eq!(rows.len(), 3);
        for row in &rows {
            assert_eq!(row["verified"], true, "{row}");
            assert_eq!(row["timed_registrations"], 0, "{row}");
        }
    }
}

/// Issue 14 item 3: one validation for every subcommand: exit 2, one line, the flag named,
/// never a panic.
#[test]
fn bad_options_exit_2_with_one_line_naming_the_flag() {
    let cases: &[(&[&str], &str)] = &[
        (&["comm", "--sizes", "0"], "--sizes"),
        (&["comm", "--window", "0"], "--window"),
        (&["comm", "--window", "17"], "--window"),
        (&["server", "--window", "17", "--timeout", "1"], "--window"),
        (&["server", "--window", "0", "--timeout", "1"], "--window"),
        (&["server", "--sizes", "0", "--timeout", "1"], "--sizes"),
        (&["server", "--depth", "0", "--timeout", "1"], "--depth"),
        (&["server", "--rounds", "0", "--timeout", "1"], "--rounds"),
        (&["client", "--peer", "00", "--sizes", "0"], "--sizes"),
        (&["stack", "--sizes", "abc"], "--sizes"),
        (&["stack", "--chunk", "0"], "--chunk"),
        (&["onesided", "--block", "64GiB"], "--max-op"),
        (&["onesided", "--max-op", "0"], "--max-op"),
        (&["onesided", "--depth", "0"], "--depth"),
        (&["onesided", "--op", "fly"], "--op"),
        (&["latency", "--sizes", "0"], "--sizes"),
        (&["latency", "--gap-us", "99999999999"], "--gap-us"),
    ];
    for (args, flag) in cases {
        let out = run(args);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(flag), "{args:?} should name {flag}: {err}");
    }
}

/// Issue 14 item 8: messages say a thing once, in words.
#[test]
fn messages_are_plain_and_say_things_once() {
    let out = run(&["stack", "--sizes", "abc"]);
    let err = text(&out.stderr);
    assert!(!err.contains("cannot parse integer"), "{err}");
    assert!(err.contains("`abc` is not a size"), "{err}");
    for args in [
        &["client", "--peer", "zz"][..],
        &["comm", "--window", "17"][..],
        &["stack", "--sizes", "8KiB..4KiB"][..],
    ] {
        let err = text(&run(args).stderr);
        let parts: Vec<&str> = err.trim().split(": ").collect();
        for w in parts.windows(2) {
            assert_ne!(w[0], w[1], "{args:?} repeats itself: {err}");
        }
        assert!(!err.contains("Some("), "{args:?}: {err}");
    }
}

/// Issue 14 items 6 and 8: small sizes move at least --min-bytes; `--baseline none` prints
/// `-`, not made-up zeros.
#[test]
fn small_sizes_move_min_bytes_and_no_baseline_prints_dashes() {
    let args = [
        "--sizes",
        "4KiB",
        "--iters",
        "10",
        "--min-bytes",
        "4MiB",
        "--baseline",
        "none",
        "--timeout",
        "30",
    ];
    let server = Server::start(&args);
    let json = tmp("small.json");
    let out = bench()
        .args(["client", "--peer", &server.peer, "--json"])
        .arg(&json)
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let row = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("4KiB"))
        .unwrap_or_else(|| panic!("no 4KiB row: {stdout}"));
    let cols: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(cols[cols.len() - 2..], ["-", "-"], "{row}");
    let rows = json_rows(&json);
    assert_eq!(rows[0]["messages"], 1024, "{}", rows[0]);
    assert!(rows[0]["baseline_gbps"].is_null(), "{}", rows[0]);
    drop(server);
    let _ = std::fs::remove_file(json);
}

/// Issue 25: `--rounds N` measures every size N times, each time the stack and then the
/// baseline, and reports medians with the range of the rounds' ratios — on a shared host one
/// round can be off by a factor of two. Both processes run every round (the server's
/// `--verify` checks each), and the row counts the messages of all of them.
#[test]
fn rounds_report_medians_and_the_range_of_the_ratios() {
    let args = [
        "--sizes",
        "4KiB,256KiB",
        "--iters",
        "10",
        "--min-bytes",
        "2MiB",
        "--rounds",
        "3",
        "--verify",
        "--timeout",
        "30",
    ];
    let (rows, stdout) = server_client_rows(&args, "rounds.json");
    assert_eq!(rows.len(), 2, "one row per size: {stdout}");
    assert!(stdout.contains("3 rounds per size"), "{stdout}");
    for row in &rows {
        assert_eq!(row["rounds"], 3, "{row}");
        assert_eq!(row["verified"], true, "{row}");
        let (lo, hi) = (
            row["ratio_range"][0].as_f64().unwrap(),
            row["ratio_range"][1].as_f64().unwrap(),
        );
        let ratio = row["ratio"].as_f64().unwrap();
        assert!(lo <= ratio && ratio <= hi && lo > 0.0, "{row}");
        // Three rounds of at least 2 MiB each.
        let bytes = row["bytes"].as_u64().unwrap();
        assert!(
            row["messages"].as_u64().unwrap() * bytes >= 3 * (2 << 20),
            "{row}"
        );
        assert_eq!(row["timed_registrations"], 0, "{row}");
    }
    let line = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("256KiB"))
        .unwrap_or_else(|| panic!("no 256KiB row: {stdout}"));
    assert!(
        line.split_whitespace().last().unwrap().contains('–'),
        "{line}"
    );

    // A client that runs another plan than the server is refused at once, naming the options,
    // not failed later on a size it did not expect.
    let server = Server::start(&["--sizes", "4KiB", "--rounds", "2", "--timeout", "10"]);
    let out = bench()
        .args(["client", "--peer", &server.peer])
        .args(["--sizes", "4KiB", "--timeout", "10"])
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--rounds") && err.contains("same options"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

/// Issue 14 item 6: the latency mode measures tcpx and raw TCP one-way latency.
#[test]
fn latency_mode_reports_tcpx_and_raw_tcp() {
    let json = tmp("latency.json");
    let out = bench()
        .args([
            "latency",
            "--sizes",
            "4KiB",
            "--iters",
            "200",
            "--warmup",
            "20",
            "--backoff",
            "park",
            // Round trips after idle take the same path; the header says so.
            "--gap-us",
            "50",
            "--json",
        ])
        .arg(&json)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("each after 50µs idle"),
        "{}",
        text(&out.stdout)
    );
    let rows = json_rows(&json);
    assert_eq!(rows.len(), 1);
    for key in ["p50_us", "p99_us", "tcp_p50_us", "tcp_p99_us", "ratio"] {
        let v = rows[0][key].as_f64().unwrap();
        assert!(v > 0.0 && v.is_finite(), "{key}: {}", rows[0]);
    }
    assert!(rows[0]["p99_us"].as_f64() >= rows[0]["p50_us"].as_f64());
    let _ = std::fs::remove_file(json);
}

/// Issue 14 item 5: TCPX_PLUGIN_PATH, `--plugin` and TCPX_GPU_NIC_MAP mean the same to every
/// tool.
#[test]
fn plugin_choice_and_overrides_are_honoured_by_every_tool() {
    let missing = "/nonexistent/libnccl-net-missing.so";
    let info = Command::new(env!("CARGO_BIN_EXE_tcpx-info"))
        .env("TCPX_SOCKET_IFNAME", "lo")
        .env("TCPX_PLUGIN_PATH", missing)
        .output()
        .unwrap();
    assert!(!info.status.success(), "tcpx-info ignored TCPX_PLUGIN_PATH");
    assert!(
        text(&info.stderr).contains(missing),
        "{}",
        text(&info.stderr)
    );
    for args in [
        &["stack", "--sizes", "4KiB", "--bytes", "4KiB", "--reps", "1"][..],
        &["onesided", "--block", "4KiB", "--batch", "1", "--reps", "1"][..],
        &["comm", "--sizes", "4KiB", "--iters", "8", "--reps", "1"][..],
        &["latency", "--sizes", "4KiB", "--iters", "8"][..],
    ] {
        let out = bench()
            .args(args)
            .env("TCPX_PLUGIN_PATH", missing)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} ignored TCPX_PLUGIN_PATH");
        assert!(
            text(&out.stderr).contains(missing),
            "{args:?}: {}",
            text(&out.stderr)
        );
        let out = bench()
            .args(args)
            .args(["--plugin", missing])
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} --plugin");
        assert!(
            text(&out.stderr).contains(missing),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }
    let out = bench()
        .args(["server", "--bind", "127.0.0.1:0", "--timeout", "1"])
        .env("TCPX_GPU_NIC_MAP", "garbage")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("TCPX_GPU_NIC_MAP"),
        "{}",
        text(&out.stderr)
    );
}

/// Whether a TCP connection with local port `port` is established (from /proc/net/tcp).
fn established_on(port: u16) -> bool {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    table.lines().skip(1).any(|l| {
        let cols: Vec<&str> = l.split_whitespace().collect();
        cols.len() > 3
            && cols[3] == "01"
            && (cols[1].ends_with(&format!(":{port:04X}"))
                || cols[2].ends_with(&format!(":{port:04X}")))
    })
}

/// Issue 14 item 8: an error whose source repeats its text is printed once (a stranger's
/// `bad magic` used to appear twice in one line). A server is started and given garbage on its
/// control port, then the real client's failure or the server's message is read.
#[test]
fn a_library_error_is_not_printed_twice() {
    let server = Server::start(&["--timeout", "5"]);
    let addr = format!("127.0.0.1:{}", server.port);
    if let Ok(mut s) = TcpStream::connect(&addr) {
        let _ = s.write_all(&[0xff; 64]);
        std::thread::sleep(Duration::from_millis(500));
    }
    let out = bench()
        .args([
            "client",
            "--peer",
            &server.peer,
            "--sizes",
            "4KiB",
            "--timeout",
            "5",
        ])
        .output()
        .unwrap();
    let (_, err) = server.wait();
    let all = format!("{}\n{err}", text(&out.stderr));
    for line in all.lines().filter(|l| l.starts_with("tcpx-bench: error:")) {
        let parts: Vec<&str> = line.split(": ").collect();
        for (i, p) in parts.iter().enumerate() {
            assert!(
                p.len() < 12 || !parts[i + 1..].contains(p),
                "`{p}` twice in: {line}"
            );
        }
    }
}

/// Issue 14 item 4: a server frozen during the baseline makes the client fail within about
/// `--timeout`, saying it timed out and in which phase.
#[test]
fn a_frozen_server_during_the_baseline_fails_the_client_within_the_timeout() {
    let args = [
        "--sizes",
        "16MiB",
        "--iters",
        "64",
        "--min-bytes",
        "1GiB",
        "--timeout",
        "3",
    ];
    let server = Server::start(&args);
    let mut client = bench()
        .args(["client", "--peer", &server.peer])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while !established_on(server.port + 1) {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no baseline phase seen"
        );
        if let Some(status) = client.try_wait().unwrap() {
            panic!("client ended before the baseline: {status}");
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    let pid = server.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-STOP", &pid])
        .status()
        .unwrap()
        .success());
    let frozen = Instant::now();
    let status = client.wait().unwrap();
    let waited = frozen.elapsed();
    let _ = Command::new("kill").args(["-CONT", &pid]).status();
    let mut err = String::new();
    client
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(
        !status.success(),
        "the client finished against a frozen server"
    );
    assert!(
        waited < Duration::from_secs(6),
        "waited {waited:?} with --timeout 3: {err}"
    );
    assert!(err.contains("timed out"), "{err}");
    assert!(err.contains("baseline"), "{err}");
}

/// Issue 14 item 2: strangers on the baseline port (port + 1) are dropped; the run's own
/// streams (which carry the token learnt over the tcpx connection) complete, verified.
#[test]
fn strangers_on_the_baseline_port_are_dropped_and_the_run_completes() {
    let args = [
        "--sizes",
        "1MiB",
        "--iters",
        "8",
        "--min-bytes",
        "8MiB",
        "--verify",
        "--timeout",
        "20",
    ];
    let server = Server::start(&args);
    let addr: SocketAddr = format!("127.0.0.1:{}", server.port + 1).parse().unwrap();
    let mut held = Vec::new();
    for kind in 0..30 {
        let Ok(mut s) = TcpStream::connect(addr) else {
            continue;
        };
        let _ = match kind % 5 {
            0 => s.write_all(&[0xff; 64]),
            1 => s.write_all(b"TXCP\x01\x02\x03\x04junkjunkjunk"),
            2 => s.write_all(&(kind as u64).to_le_bytes()),
            // Instant close: dropped below without a byte.
            3 => Ok(()),
            // A drip that never finishes.
            _ => s.write_all(&[7]),
        };
        if kind % 5 != 3 {
            held.push(s);
        }
    }
    let out = bench()
        .args(["client", "--peer", &server.peer])
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let (code, err) = server.wait();
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("dropped a stranger"), "{err}");
    assert!(
        err.contains("127.0.0.1:"),
        "strangers are logged with their address: {err}"
    );
    drop(held);
}

/// Issue 22 item 5: an option that multiplies sockets or memory past what the process may
/// open or allocate is refused up front — one line naming the option and the limit, exit 2 —
/// instead of running into `EMFILE` ("Too many open files") half-way through the set-up.
#[test]
fn options_past_the_open_file_or_memory_limit_are_refused_up_front() {
    use std::os::unix::process::CommandExt;
    // The child's own limit, low and known, so the refusal does not depend on this machine's.
    let low_limit = |c: &mut Command| {
        // SAFETY: runs in the forked child before exec; setrlimit is async-signal-safe and
        // the closure touches no memory shared with the parent.
        unsafe {
            c.pre_exec(|| {
                let mut old = libc::rlimit {
                    rlim_cur: 0,
                    rlim_max: 0,
                };
                if libc::getrlimit(libc::RLIMIT_NOFILE, &mut old) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let limit = libc::rlimit {
                    rlim_cur: 256.min(old.rlim_max),
                    rlim_max: old.rlim_max,
                };
                if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    };
    let cases: &[(&[&str], &str, &str)] = &[
        (
            &["stack", "--channels", "100"],
            "--channels 100",
            "limit of 256",
        ),
        (
            &["onesided", "--channels", "100"],
            "--channels 100",
            "limit of 256",
        ),
        (
            &["latency", "--channels", "100"],
            "--channels 100",
            "limit of 256",
        ),
        (
            &["server", "--channels", "100", "--timeout", "1"],
            "--channels 100",
            "limit of 256",
        ),
        (
            &["client", "--peer", "00", "--channels", "100"],
            "--channels 100",
            "limit of 256",
        ),
        (
            &["stack", "--sizes", "100000GiB"],
            "--sizes 100000GiB",
            "MemAvailable",
        ),
        (
            &["server", "--sizes", "100000GiB", "--timeout", "1"],
            "--sizes 100000GiB",
            "MemAvailable",
        ),
    ];
    for (args, option, limit) in cases {
        let mut cmd = bench();
        cmd.args(*args);
        low_limit(&mut cmd);
        let out = cmd.output().expect("run tcpx-bench");
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(option), "{args:?} should name {option}: {err}");
        assert!(err.contains(limit), "{args:?} should name {limit}: {err}");
        assert!(!err.contains("Too many open files"), "{args:?}: {err}");
        // Refused before any endpoint exists: nothing was listening, so no port is named.
        assert!(!err.contains("127.0.0.1"), "{args:?}: {err}");
    }
    // What fits passes the check: 4 channels need 2 × 4 × 2 × 2 × 2 + 2 × 4 + 64 = 200 files,
    // so the run goes on to load the plugin (which is missing here, to end it at once).
    let mut cmd = bench();
    cmd.args([
        "stack",
        "--channels",
        "4",
        "--plugin",
        "/nonexistent/libnone.so",
    ]);
    low_limit(&mut cmd);
    let out = cmd.output().expect("run tcpx-bench");
    let err = text(&out.stderr);
    assert!(!err.contains("RLIMIT_NOFILE"), "{err}");
    assert!(err.contains("/nonexistent/libnone.so"), "{err}");
}

/// Issue 25 item 4: `tcpx-bench kv` in two processes — scattered blocks by one-sided write
/// and read, against the same bytes contiguous, two-sided and over raw TCP, every byte checked
/// — prints a steady row per shape and phase and the first transfer of each phase on a row
/// of its own.
#[test]
fn kv_mode_moves_scattered_blocks_between_two_processes_verified() {
    let args = [
        "--shapes",
        "16x4KiB,4x64KiB",
        "--iters",
        "4",
        "--min-bytes",
        "0",
        "--warmup",
        "1",
        "--channels",
        "2",
        "--verify",
        "--timeout",
        "30",
    ];
    let server = Server::start_role(&["kv", "server"], &args);
    let json = tmp("kv.json");
    // The client pauses before each measured transfer (the server is not told: only the
    // initiator acts on it).
    let out = bench()
        .args(["kv", "client", "--peer", &server.peer, "--json"])
        .arg(&json)
        .args(args)
        .args(["--gap-us", "300"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let (code, err) = server.wait();
    assert_eq!(code, Some(0), "server: {err}");
    let stdout = text(&out.stdout);
    assert!(stdout.contains("300 µs after the previous one"), "{stdout}");
    for label in [
        "write contiguous",
        "read",
        "send/recv",
        "raw TCP",
        "first write",
    ] {
        assert!(stdout.contains(label), "no `{label}` row: {stdout}");
    }
    let rows = json_rows(&json);
    // Per shape: write, read (each scattered and contiguous), send, raw TCP; then a first
    // row for each of the five phases that have one.
    assert_eq!(rows.len(), 2 * (6 + 5), "{rows:#?}");
    for row in &rows {
        assert_eq!(row["bench"], "kv", "{row}");
        let gbps = row["gbps"].as_f64().unwrap();
        assert!(gbps > 0.0 && gbps.is_finite(), "{row}");
        let first = row["first"].as_bool().unwrap();
        let raw = row["op"] == "raw-tcp";
        assert_eq!(row["verified"], !raw, "{row}");
        if first {
            assert_eq!(row["transfers"], 1, "{row}");
            assert!(row["first_us"].as_f64().unwrap() > 0.0, "{row}");
            assert!(
                row["p50_us"].is_null(),
                "a first transfer is not a steady figure"
            );
        } else {
            assert!(row["ratio"].as_f64().unwrap() > 0.0, "vs raw TCP: {row}");
            if !raw {
                assert_eq!(row["transfers"], 4, "{row}");
                let (p50, p99) = (row["p50_us"].as_f64(), row["p99_us"].as_f64());
                assert!(p50.unwrap() > 0.0 && p99 >= p50, "{row}");
            }
        }
        if row["layout"] == "scattered" && !first {
            assert!(row["vs_contiguous"].as_f64().unwrap() > 0.0, "{row}");
        }
    }
    let shapes: Vec<&str> = rows.iter().map(|r| r["shape"].as_str().unwrap()).collect();
    assert_eq!(shapes[0], "16x4KiB");
    assert_eq!(shapes[rows.len() - 1], "4x64KiB");
    let _ = std::fs::remove_file(json);
}

/// Issue 25 item 4: kv checks its options like every mode (exit 2, one line, the flag
/// named), and a client whose options differ from the server's is told so, while the server
/// gives up within its timeout.
#[test]
fn kv_bad_options_and_mismatched_processes_are_refused() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["kv", "server", "--shapes", "16KiB", "--timeout", "1"],
            "--shapes",
        ),
        (
            &["kv", "server", "--shapes", "0x4KiB", "--timeout", "1"],
            "--shapes",
        ),
        (
            &["kv", "server", "--shapes", "99999x4KiB", "--timeout", "1"],
            "--shapes",
        ),
        (
            &["kv", "server", "--blocks", "4", "--timeout", "1"],
            "--blocks",
        ),
        (
            &[
                "kv",
                "server",
                "--blocks",
                "x",
                "--block",
                "4KiB",
                "--timeout",
                "1",
            ],
            "--blocks",
        ),
        (&["kv", "server", "--op", "fly", "--timeout", "1"], "--op"),
        (
            &["kv", "server", "--depth", "0", "--timeout", "1"],
            "--depth",
        ),
        (
            &["kv", "server", "--window", "17", "--timeout", "1"],
            "--window",
        ),
        (&["kv", "server", "--gpu", "0,1", "--timeout", "1"], "--gpu"),
        (&["kv", "client", "--peer", "00", "--iters", "0"], "--iters"),
        (&["kv", "client", "--peer", "zz"], "--peer"),
        (
            &[
                "kv", "client", "--peer", "00", "--gap-us", "100", "--depth", "2",
            ],
            "--gap-us",
        ),
    ];
    for (args, flag) in cases {
        let out = run(args);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(flag), "{args:?} should name {flag}: {err}");
    }

    let missing = "/nonexistent/libnccl-net-missing.so";
    let out = bench()
        .args(["kv", "server", "--bind", "127.0.0.1:0"])
        .args(["--timeout", "1", "--plugin", missing])
        .output()
        .unwrap();
    assert!(!out.status.success(), "kv server ignored --plugin");
    assert!(text(&out.stderr).contains(missing), "{}", text(&out.stderr));

    let server = Server::start_role(
        &["kv", "server"],
        &["--shapes", "8x4KiB", "--iters", "4", "--timeout", "5"],
    );
    let out = bench()
        .args(["kv", "client", "--peer", &server.peer])
        .args(["--shapes", "8x8KiB", "--iters", "4", "--timeout", "5"])
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("same options"), "{err}");
    // Bounded, so a server that never gives up fails the test instead of hanging it.
    let mut server = server;
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "the kv server never gave up");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        !status.success(),
        "the server went on with a mismatched client"
    );
}
