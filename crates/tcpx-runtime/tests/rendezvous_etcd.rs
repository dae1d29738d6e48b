//! Rendezvous through a real etcd (Debian's `etcd-server`), started by each test on
//! 127.0.0.1 with free ports and a temporary data directory, and killed when the test ends
//! (panics included). Without an etcd binary the tests say so and pass without running.
//!
//! Run: `cargo test -p tcpx-runtime --features etcd --test rendezvous_etcd`.
#![cfg(feature = "etcd")]

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use tcpx_runtime::rendezvous::{EtcdStore, LocalEtcd};
use tcpx_runtime::{Endpoint, Store};

const MIB: usize = 1 << 20;
const ROLE_VAR: &str = "TCPX_RDV_CHILD";
/// What the child prints once its key is in the store.
const PUBLISHED: &str = "TCPX-RDV-CHILD-PUBLISHED";

/// A local etcd, or `None` (and a message) where no etcd binary is installed.
fn etcd_or_skip(test: &str) -> Option<LocalEtcd> {
    if LocalEtcd::binary().is_none() {
        eprintln!(
            "{test}: skipped: no etcd binary (apt-get install etcd-server, or set TCPX_ETCD_BIN)"
        );
        return None;
    }
    Some(LocalEtcd::start().expect("start a local etcd"))
}

fn store(etcd: &LocalEtcd, job: &str) -> EtcdStore {
    EtcdStore::connect(&etcd.url(job)).expect("connect to the local etcd")
}

/// Whether `key` is absent now.
fn absent(store: &dyn Store, key: &str) -> bool {
    match store.get(key, Duration::ZERO) {
        Ok(_) => false,
        Err(e) if e.is_timeout() => true,
        Err(e) => panic!("reading {key}: {e}"),
    }
}

#[test]
fn publish_and_connect_by_name_through_etcd() {
    loopback();
    let Some(etcd) = etcd_or_skip("publish_and_connect_by_name_through_etcd") else {
        return;
    };
    let server_store = store(&etcd, "pair");
    let client_store = store(&etcd, "pair");
    let server = Endpoint::new(config(2, 256 << 10)).unwrap();
    let client = Endpoint::new(config(2, 256 << 10)).unwrap();
    std::thread::scope(|s| {
        // The client waits for a name published after it started looking (a watch).
        let looking = s.spawn(|| client.connect_by_name(&client_store, "server", DEADLINE));
        std::thread::sleep(Duration::from_millis(200));
        server.publish(&server_store, "server").unwrap();
        let sc = server.accept_timeout(DEADLINE).unwrap();
        let cc = looking.join().unwrap().unwrap();
        let len = 5 * MIB + 11;
        let src = source(&client, len, 3);
        let dst = server.alloc_host(len).unwrap();
        let rx = sc.recv(&dst, 0, len).unwrap();
        cc.send(&src, 0, len).unwrap().wait(DEADLINE).unwrap();
        rx.wait(DEADLINE).unwrap();
        assert_pattern(&dst, 0, len, 3, "through etcd");
    });
    // Keys live under the job's prefix: another job does not see them.
    let other_job = store(&etcd, "other");
    assert!(absent(&other_job, "server"));
    assert!(!absent(&client_store, "server"));
    // Dropping the publisher's store revokes its lease: the key is gone at once.
    drop(server_store);
    assert!(absent(&client_store, "server"));
}

#[test]
fn the_secret_is_honoured_through_etcd() {
    loopback();
    let Some(etcd) = etcd_or_skip("the_secret_is_honoured_through_etcd") else {
        return;
    };
    let store = store(&etcd, "secret");
    let mut guarded = config(2, 256 << 10);
    guarded.require_secret = true;
    let server = Endpoint::new(guarded).unwrap();
    let client = Endpoint::new(config(2, 256 << 10)).unwrap();
    server.publish(&store, "guarded").unwrap();
    let e = client
        .connect_addr(server.metadata().control_addr)
        .unwrap_err();
    assert!(e.to_string().contains("secret"), "{e}");
    std::thread::scope(|s| {
        let accepted = s.spawn(|| server.accept_timeout(DEADLINE));
        client.connect_by_name(&store, "guarded", DEADLINE).unwrap();
        accepted.join().unwrap().unwrap();
    });
}

#[test]
fn eight_ranks_meet_through_etcd_and_each_writes_to_every_other() {
    loopback();
    let Some(etcd) = etcd_or_skip("eight_ranks_meet_through_etcd_and_each_writes_to_every_other")
    else {
        return;
    };
    const WORLD: usize = 8;
    let etcd = &etcd;
    std::thread::scope(|s| {
        let ranks: Vec<_> = (0..WORLD)
            .map(|rank| {
                s.spawn(move || {
                    // Each rank is its own etcd client with its own lease, as processes are.
                    let store = store(etcd, "job8");
                    let ep = Endpoint::new(config(1, 256 << 10)).unwrap();
                    let group = ep.rendezvous(&store, "all", rank, WORLD, DEADLINE).unwrap();
                    all_to_all(&ep, &group, 512 << 10);
                    (store, group)
                })
            })
            .collect();
        let done: Vec<_> = ranks.into_iter().map(|r| r.join().unwrap()).collect();
        for rank in 0..WORLD {
            assert!(absent(&done[0].0, &format!("all/rank/{rank}")));
        }
    });
}

/// The child half of `a_killed_publishers_key_expires_with_its_lease`: publishes and waits to
/// be killed.
#[test]
#[ignore = "run by a_killed_publishers_key_expires_with_its_lease as a child process"]
fn child() {
    let Ok(url) = std::env::var(ROLE_VAR) else {
        return;
    };
    loopback();
    let store = EtcdStore::connect(&url).expect("child: connect to etcd");
    let ep = Endpoint::new(config(1, 256 << 10)).unwrap();
    ep.publish(&store, "victim").unwrap();
    // On a line of its own: libtest may have written "test child ... " without a newline.
    println!("\n{PUBLISHED}");
    // Bounded: the parent kills us long before this.
    std::thread::sleep(Duration::from_secs(120));
}

/// Kills the child unless it was reaped.
struct Killer(Child);

impl Drop for Killer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_killed_publishers_key_expires_with_its_lease() {
    loopback();
    let Some(etcd) = etcd_or_skip("a_killed_publishers_key_expires_with_its_lease") else {
        return;
    };
    const TTL: Duration = Duration::from_secs(2);
    let url = format!("{}?ttl={}", etcd.url("lease"), TTL.as_secs());
    let mut child = Killer(
        Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "child",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ROLE_VAR, &url)
            .env("TCPX_SOCKET_IFNAME", "lo")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    );
    let out = child.0.stdout.take().unwrap();
    let mut lines = BufReader::new(out).lines();
    assert!(
        lines.any(|l| l.is_ok_and(|l| l.trim() == PUBLISHED)),
        "the child did not publish"
    );
    let watcher = EtcdStore::connect(&url).unwrap();
    assert!(!absent(&watcher, "victim"));
    // The key outlives several TTLs while its publisher lives: the keep-alive renews it.
    std::thread::sleep(TTL * 2);
    assert!(
        !absent(&watcher, "victim"),
        "the live publisher's key expired"
    );

    // SIGKILL: no destructor runs, so no revoke; only the lease's expiry removes the key.
    child.0.kill().unwrap();
    let killed = Instant::now();
    child.0.wait().unwrap();
    // etcd checks leases for expiry about every 500 ms: allow the TTL and a few seconds.
    assert!(
        eventually(TTL + Duration::from_secs(10), || absent(&watcher, "victim")),
        "the dead publisher's key was still there {:?} after the kill",
        killed.elapsed()
    );
    eprintln!(
        "key of the killed publisher gone {:?} after the kill (lease TTL {TTL:?})",
        killed.elapsed()
    );
}

#[test]
fn a_restarted_publisher_is_found_again_under_its_old_name() {
    loopback();
    let Some(etcd) = etcd_or_skip("a_restarted_publisher_is_found_again_under_its_old_name") else {
        return;
    };
    let publisher_store = store(&etcd, "restart");
    let client_store = store(&etcd, "restart");
    let client = Endpoint::new(config(2, 256 << 10)).unwrap();
    // The first incarnation publishes and dies, leaving its key behind (its store, and so
    // the lease, stays alive): the name now points at a closed port.
    let first = Endpoint::new(config(2, 256 << 10)).unwrap();
    first.publish(&publisher_store, "svc").unwrap();
    drop(first);
    std::thread::scope(|s| {
        let found = s.spawn(|| client.connect_by_name(&client_store, "svc", DEADLINE));
        std::thread::sleep(Duration::from_millis(500));
        let second = Endpoint::new(config(2, 256 << 10)).unwrap();
        second.publish(&publisher_store, "svc").unwrap();
        let accepted = second.accept_timeout(DEADLINE).unwrap();
        let conn = found.join().unwrap().unwrap();
        assert_eq!(accepted.peer(), conn.local_control_addr().unwrap());
    });
}

#[test]
fn an_unreachable_etcd_is_an_error_that_names_it() {
    // A port with nothing behind it (bound, then released).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let e = EtcdStore::connect(&format!("etcd://127.0.0.1:{port}/x")).unwrap_err();
    assert!(e.to_string().contains(&port.to_string()), "{e}");
}
