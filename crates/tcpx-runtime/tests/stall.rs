//! The stall regressions. Our socket plugin progresses only inside `test` (like TCPX), so an
//! engine that tests only when a window is full, or only some heads, hangs here; these tests
//! bound every wait and fail instead of hanging.

mod common;

use std::time::{Duration, Instant};

use common::*;
use tcpx_runtime::{Backend, Backoff, Config};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

fn one_channel(chunk: usize, backoff: Backoff) -> Config {
    Config::builder()
        .backend(Backend::Builtin)
        .control_addr("127.0.0.1:0".parse().unwrap())
        .channels(1)
        .chunk_bytes(chunk as u32)
        .window(16)
        .backoff(backoff)
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

/// 64 MiB in 4 KiB chunks each way at once on one channel: 16384 requests per direction
/// against windows of 16, so both sides' send and receive windows sit full the whole time.
#[test]
fn full_windows_on_both_sides_drain() {
    loopback();
    let (a, b, ab, ba) = pair_with(
        one_channel(4 * KIB, Backoff::Park),
        one_channel(4 * KIB, Backoff::Park),
    );
    let len = 64 * MIB;
    let (a_src, b_src) = (source(&a, len, 11), source(&b, len, 12));
    let (a_dst, b_dst) = (a.alloc_host(len).unwrap(), b.alloc_host(len).unwrap());
    let start = Instant::now();
    let transfers = [
        ab.recv(&a_dst, 0, len).unwrap(),
        ba.recv(&b_dst, 0, len).unwrap(),
        ab.send(&a_src, 0, len).unwrap(),
        ba.send(&b_src, 0, len).unwrap(),
    ];
    for t in &transfers {
        assert_eq!(
            t.wait(DEADLINE).unwrap(),
            len as u64,
            "stalled after {:?}",
            start.elapsed()
        );
    }
    assert_pattern(&b_dst, 0, len, 11, "a to b");
    assert_pattern(&a_dst, 0, len, 12, "b to a");
    let stats = ba.stats()[0];
    assert_eq!(stats.recvs, (len / (4 * KIB)) as u64);
    assert_eq!(stats.sends, (len / (4 * KIB)) as u64);
}

/// Receives posted long before the sender starts fill the receive window with requests
/// that cannot complete; the engine must keep testing and then drain them.
#[test]
fn receive_window_full_before_any_data_drains() {
    loopback();
    let (a, b, ab, ba) = pair(1, 64 * KIB as u32);
    let len = 8 * MIB;
    let src = source(&a, len, 21);
    let dst = b.alloc_host(len).unwrap();
    let rx = ba.recv(&dst, 0, len).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    assert!(rx.poll().is_none());
    let tx = ab.send(&src, 0, len).unwrap();
    tx.wait(DEADLINE).unwrap();
    rx.wait(DEADLINE).unwrap();
    assert_pattern(&dst, 0, len, 21, "late sender");
}

/// A transfer smaller than the window never fills it: an engine that tests only full
/// windows would never complete it.
#[test]
fn a_window_that_never_fills_still_completes() {
    loopback();
    let (a, b, ab, ba) = pair(1, 64 * KIB as u32);
    let len = 3 * 64 * KIB;
    let src = source(&a, len, 31);
    let dst = b.alloc_host(len).unwrap();
    let rx = ba.recv(&dst, 0, len).unwrap();
    let tx = ab.send(&src, 0, len).unwrap();
    tx.wait(DEADLINE).unwrap();
    rx.wait(DEADLINE).unwrap();
    assert_pattern(&dst, 0, len, 31, "three chunks");
}

/// Every idle policy drains full windows (spin never sleeps; yield and park back off).
#[test]
fn every_backoff_policy_drains_full_windows() {
    loopback();
    for policy in [Backoff::Spin, Backoff::Yield, Backoff::Park] {
        let (a, b, ab, ba) = pair_with(one_channel(4 * KIB, policy), one_channel(4 * KIB, policy));
        let len = 4 * MIB;
        let src = source(&a, len, 41);
        let dst = b.alloc_host(len).unwrap();
        let rx = ba.recv(&dst, 0, len).unwrap();
        let tx = ab.send(&src, 0, len).unwrap();
        tx.wait(DEADLINE).unwrap();
        rx.wait(DEADLINE).unwrap();
        assert_pattern(&dst, 0, len, 41, &format!("{policy:?}"));
    }
}
