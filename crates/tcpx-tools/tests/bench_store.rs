//! `tcpx-bench … --store etcd://…` as an operator runs it (issue 23): the server publishes its
//! endpoint in a real etcd under a name, the client finds it there — no hex handed over — and
//! the bytes verify; the name is gone when the server exits, and within the lease's TTL when
//! it is killed. Each test starts its own etcd on 127.0.0.1 (free ports, temporary data dir,
//! killed at the end) and skips with a message where no etcd binary is installed.
#![cfg(feature = "etcd")]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tcpx_runtime::rendezvous::{EtcdStore, LocalEtcd};
use tcpx_runtime::Store;

const BENCH: &str = env!("CARGO_BIN_EXE_tcpx-bench");

fn bench() -> Command {
    let mut c = Command::new(BENCH);
    c.env("TCPX_SOCKET_IFNAME", "lo")
        .env("NCCL_SOCKET_IFNAME", "lo")
        .env("TCPX_LOG", "warn")
        .env_remove("TCPX_PLUGIN_PATH")
        .env_remove("UCCL_TCPX_PLUGIN_PATH")
        .env_remove("TCPX_BACKEND")
        .env_remove("TCPX_GPU_NIC_MAP")
        .env_remove("TCPX_NUM_CHANNELS")
        .env_remove("UCCL_TCPX_NUM_CHANNELS");
    c
}

fn etcd_or_skip(test: &str) -> Option<LocalEtcd> {
    if LocalEtcd::binary().is_none() {
        eprintln!(
            "{test}: skipped: no etcd binary (apt-get install etcd-server, or set TCPX_ETCD_BIN)"
        );
        return None;
    }
    Some(LocalEtcd::start().expect("start a local etcd"))
}

/// A server process, killed if the test fails before it exits.
struct Server(Option<Child>);

impl Server {
    /// Starts `tcpx-bench ROLE --bind 127.0.0.1:0 ARGS` and waits for its metadata line
    /// (it publishes right after printing it).
    fn start(role: &[&str], args: &[&str]) -> Self {
        let mut child = bench()
            .args(role)
            // Port 0: the server picks a free pair itself (see `start_server`).
            .args(["--bind", "127.0.0.1:0"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start tcpx-bench server");
        let line = BufReader::new(child.stdout.take().unwrap())
            .lines()
            .next()
            .expect("the server prints its metadata line")
            .unwrap();
        assert!(line.starts_with("TCPX-BENCH-METADATA "), "{line}");
        Self(Some(child))
    }

    fn child(&mut self) -> &mut Child {
        self.0.as_mut().expect("running")
    }

    fn wait(mut self) -> (Option<i32>, String) {
        let out = self.0.take().unwrap().wait_with_output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into(),
        )
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Waits up to `within` for `key` to be absent from `store`.
fn gone_within(store: &dyn Store, key: &str, within: Duration) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < within {
        match store.get(key, Duration::ZERO) {
            Err(e) if e.is_timeout() => return Some(start.elapsed()),
            Err(e) => panic!("reading {key}: {e}"),
            Ok(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
    None
}

#[test]
fn server_and_client_meet_by_name_through_etcd_and_verify() {
    let Some(etcd) = etcd_or_skip("server_and_client_meet_by_name_through_etcd_and_verify") else {
        return;
    };
    let url = etcd.url("job1");
    let args = [
        "--sizes",
        "64KiB,1MiB",
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
    // The client starts looking before the server exists: it waits for the name.
    let client = bench()
        .args(["client", "--store", &url])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let server = Server::start(
        &["server"],
        &[&["--store", url.as_str()][..], &args].concat(),
    );
    let out = client.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "client: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (code, err) = server.wait();
    assert_eq!(code, Some(0), "server: {err}");
    assert!(err.contains("published as \"tcpx-bench-server\""), "{err}");
    assert!(
        stdout.contains("1 MiB") || stdout.contains("1MiB"),
        "{stdout}"
    );
    // The server removed its name on the way out.
    let store = EtcdStore::connect(&url).unwrap();
    assert!(
        gone_within(&store, "tcpx-bench-server", Duration::from_secs(1)).is_some(),
        "the name outlived its server"
    );
}

#[test]
fn kv_roles_meet_by_name_through_etcd_and_verify() {
    let Some(etcd) = etcd_or_skip("kv_roles_meet_by_name_through_etcd_and_verify") else {
        return;
    };
    let url = etcd.url("kvjob");
    let args = [
        "--shapes",
        "16x4KiB",
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
        "--store",
        &url,
        "--name",
        "kv-a",
    ];
    let server = Server::start(&["kv", "server"], &args);
    let out = bench().args(["kv", "client"]).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (code, err) = server.wait();
    assert_eq!(code, Some(0), "kv server: {err}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("write"));
}

#[test]
fn a_killed_servers_name_expires_with_its_lease_and_a_client_then_gives_up() {
    let Some(etcd) = etcd_or_skip("a_killed_servers_name_expires_with_its_lease") else {
        return;
    };
    const TTL: Duration = Duration::from_secs(2);
    let url = format!("{}?ttl={}", etcd.url("killed"), TTL.as_secs());
    let mut server = Server::start(
        &["server"],
        &["--store", &url, "--sizes", "64KiB", "--timeout", "30"],
    );
    let store = EtcdStore::connect(&url).unwrap();
    // Published (the line comes first, the put right after it).
    store
        .get("tcpx-bench-server", Duration::from_secs(10))
        .expect("the server published its name");
    server.child().kill().unwrap();
    server.child().wait().unwrap();
    // Its keep-alives stopped: the lease ends within the TTL (plus etcd's own slack).
    let gone = gone_within(
        &store,
        "tcpx-bench-server",
        TTL * 3 + Duration::from_secs(2),
    );
    let gone = gone.expect("the killed server's name was still there long after its TTL");
    eprintln!("name of the killed server gone {gone:?} after the kill (TTL {TTL:?})");
    // A client looking for it now fails as "peer unreachable" (3) once --timeout runs out.
    let out = bench()
        .args(["client", "--store", &url, "--timeout", "1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("tcpx-bench-server"), "{err}");
}

#[test]
fn store_flags_are_checked() {
    // No etcd needed: these fail before any connection.
    for (args, says) in [
        (&["client"][..], "--peer"),
        (
            &["client", "--peer", "ab", "--store", "etcd://127.0.0.1:1/j"][..],
            "--store",
        ),
        (&["client", "--store", "redis://h:1/j"][..], "scheme"),
        (&["server", "--name", "x"][..], "--store"),
    ] {
        let out = bench().args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{args:?}: {err}");
    }
}
