//! Rendezvous through the in-process store: publish / connect by name, the secret, and a
//! group of ranks (threads) that each write to every other. The etcd twin of these tests is
//! `rendezvous_etcd.rs`.

mod common;

use std::time::Duration;

use common::*;
use tcpx_runtime::control::EndpointMetadata;
use tcpx_runtime::{Config, Endpoint, Error, MemoryStore, Store};

const MIB: usize = 1 << 20;

fn secret_config(require: bool) -> Config {
    let mut c = config(2, 256 << 10);
    c.require_secret = require;
    c
}

#[test]
fn connect_by_name_moves_verified_bytes() {
    loopback();
    let store = MemoryStore::new();
    let server = Endpoint::new(config(2, 256 << 10)).unwrap();
    let client = Endpoint::new(config(2, 256 << 10)).unwrap();
    server.publish(&store, "server").unwrap();
    let (sc, cc) = std::thread::scope(|s| {
        let accepted = s.spawn(|| server.accept_timeout(DEADLINE).unwrap());
        let cc = client.connect_by_name(&store, "server", DEADLINE).unwrap();
        (accepted.join().unwrap(), cc)
    });
    let src = source(&client, 3 * MIB + 5, 7);
    let dst = server.alloc_host(3 * MIB + 5).unwrap();
    let rx = sc.recv(&dst, 0, 3 * MIB + 5).unwrap();
    cc.send(&src, 0, 3 * MIB + 5)
        .unwrap()
        .wait(DEADLINE)
        .unwrap();
    rx.wait(DEADLINE).unwrap();
    assert_pattern(&dst, 0, 3 * MIB + 5, 7, "by name");
    assert!(server.unpublish(&store, "server").unwrap());
    assert!(store.keys().is_empty());
}

#[test]
fn a_name_that_never_appears_times_out_naming_it() {
    loopback();
    let store = MemoryStore::new();
    let client = Endpoint::new(config(2, 256 << 10)).unwrap();
    let e = client
        .connect_by_name(&store, "nobody", Duration::from_millis(100))
        .unwrap_err();
    assert!(e.is_timeout() && e.to_string().contains("nobody"), "{e}");
    store.put("garbage", b"not metadata").unwrap();
    let e = client
        .connect_by_name(&store, "garbage", DEADLINE)
        .unwrap_err();
    assert!(
        e.to_string().contains("garbage") && e.to_string().contains("magic"),
        "{e}"
    );
}

#[test]
fn the_published_secret_is_honoured() {
    loopback();
    let store = MemoryStore::new();
    let server = Endpoint::new(secret_config(true)).unwrap();
    let client = Endpoint::new(secret_config(false)).unwrap();
    server.publish(&store, "guarded").unwrap();

    // Without the secret (address only) the server refuses; it keeps accepting.
    let e = client
        .connect_addr(server.metadata().control_addr)
        .unwrap_err();
    assert!(e.to_string().contains("secret"), "{e}");

    // A value whose secret was altered is refused too (the stored checksum is recomputed,
    // so only the secret differs).
    let mut forged = server.metadata().clone();
    forged.secret = tcpx_runtime::control::random_secret();
    store.put("forged", &forged.to_bytes().unwrap()).unwrap();
    let e = client
        .connect_by_name(&store, "forged", DEADLINE)
        .unwrap_err();
    assert!(e.to_string().contains("secret"), "{e}");

    // By name, the published secret is presented and the server lets the client in.
    std::thread::scope(|s| {
        let accepted = s.spawn(|| server.accept_timeout(DEADLINE));
        let conn = client.connect_by_name(&store, "guarded", DEADLINE).unwrap();
        let peer = accepted.join().unwrap().unwrap();
        assert_eq!(peer.peer(), conn.local_control_addr().unwrap());
    });
    let stored = store.get("guarded", Duration::ZERO).unwrap();
    assert_eq!(
        &EndpointMetadata::from_bytes(&stored).unwrap(),
        server.metadata()
    );
}

#[test]
fn six_ranks_meet_and_each_writes_to_every_other() {
    loopback();
    const WORLD: usize = 6;
    let store = MemoryStore::new();
    std::thread::scope(|s| {
        let ranks: Vec<_> = (0..WORLD)
            .map(|rank| {
                let store = &store;
                s.spawn(move || {
                    let ep = Endpoint::new(config(2, 256 << 10)).unwrap();
                    let group = ep.rendezvous(store, "job", rank, WORLD, DEADLINE).unwrap();
                    assert_eq!((group.rank(), group.world()), (rank, WORLD));
                    assert!(group.connection(rank).is_none());
                    all_to_all(&ep, &group, MIB + 4097);
                    // Keep every connection until all ranks are done.
                    group
                })
            })
            .collect();
        let groups: Vec<_> = ranks.into_iter().map(|r| r.join().unwrap()).collect();
        drop(groups);
    });
    // The rendezvous cleans up after itself: no rank or link key is left.
    assert_eq!(store.keys(), Vec::<String>::new());
}

#[test]
fn a_missing_rank_ends_the_rendezvous_with_a_timeout_that_names_it() {
    loopback();
    let store = MemoryStore::new();
    let ep = Endpoint::new(config(2, 256 << 10)).unwrap();
    let e = ep
        .rendezvous(&store, "lonely", 0, 2, Duration::from_millis(300))
        .unwrap_err();
    assert!(
        e.is_timeout() && e.to_string().contains("lonely/rank/1"),
        "{e}"
    );
    let e = ep
        .rendezvous(&store, "lonely", 1, 2, Duration::from_millis(300))
        .unwrap_err();
    assert!(e.is_timeout() && e.to_string().contains("[0]"), "{e}");
    assert!(matches!(
        ep.rendezvous(&store, "bad", 2, 2, DEADLINE),
        Err(Error::InvalidArgument(_))
    ));
    assert!(store.keys().is_empty(), "{:?}", store.keys());
}

#[test]
fn a_group_of_one_has_no_connections() {
    loopback();
    let store = MemoryStore::new();
    let ep = Endpoint::new(config(2, 256 << 10)).unwrap();
    let group = ep.rendezvous(&store, "solo", 0, 1, DEADLINE).unwrap();
    assert_eq!(group.world(), 1);
    assert!(group.into_connections().iter().all(Option::is_none));
}
