//! After a closed or failed connection no fd, registration or thread is left; after an
//! endpoint is dropped, none of its threads is. One test in its own binary, so the process
//! counts (/proc/self/fd, /proc/self/task) are this test's alone and compared exactly.

mod common;

use std::time::Duration;

use common::*;
use tcpx_runtime::{Backend, Config, Endpoint};

const MIB: usize = 1 << 20;

fn short_timeout() -> Config {
    Config::builder()
        .backend(Backend::Builtin)
        .control_addr("127.0.0.1:0".parse().unwrap())
        .channels(4)
        .chunk_bytes(256 << 10)
        .timeout(Duration::from_secs(1))
        .build()
        .unwrap()
}

#[test]
fn nothing_is_left_after_closed_failed_and_dropped() {
    loopback();
    // Process-wide state created once (plugin init, logging) exists before we count.
    let (fds_start, threads_start) = {
        let warm = Endpoint::new(short_timeout()).unwrap();
        drop(warm);
        (open_fds(), threads())
    };

    let a = Endpoint::new(short_timeout()).unwrap();
    let b = Endpoint::new(short_timeout()).unwrap();
    let src = a.alloc_host(4 * MIB).unwrap();
    let dst = b.alloc_host(4 * MIB).unwrap();
    let (fds0, threads0) = (open_fds(), threads());
    for round in 0..3 {
        let (ab, ba) = connect(&a, &b);
        let rx = ba.recv(&dst, 0, 4 * MIB).unwrap();
        let tx = ab.send(&src, 0, 4 * MIB).unwrap();
        tx.wait(DEADLINE).unwrap();
        rx.wait(DEADLINE).unwrap();
        assert_eq!(a.live_registrations(), 4);
        assert!(open_fds() > fds0 && threads() > threads0);
        // Then it fails: a receive nobody matches times out.
        let lonely = ba.recv(&dst, 0, MIB).unwrap();
        assert!(
            lonely.wait(DEADLINE).unwrap_err().is_timeout(),
            "round {round}"
        );
        assert!(ba.error().is_some());
        drop(ab);
        drop(ba);
        assert_eq!(a.live_registrations(), 0, "round {round}");
        assert_eq!(b.live_registrations(), 0, "round {round}");
        assert_eq!(open_fds(), fds0, "fds after round {round}");
        assert_eq!(threads(), threads0, "threads after round {round}");
    }
    // A peer that goes away first: the survivor's connection fails, then is dropped.
    let (ab, ba) = connect(&a, &b);
    let rx = ba.recv(&dst, 0, MIB).unwrap();
    drop(ab);
    assert!(rx.wait(DEADLINE).is_err());
    drop(ba);
    assert_eq!(open_fds(), fds0, "fds after a peer left");
    assert_eq!(threads(), threads0, "threads after a peer left");

    drop((src, dst, a, b));
    assert_eq!(open_fds(), fds_start, "fds after dropping the endpoints");
    assert_eq!(
        threads(),
        threads_start,
        "threads after dropping the endpoints"
    );
}
