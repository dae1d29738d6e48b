//! Failing cleanly: a peer that goes away mid-transfer, a transfer nobody matches, an
//! incompatible peer, mismatched lengths — every pending transfer completes with an error
//! naming channel and peer within the configured timeout, and nothing (fd, thread,
//! registration) is left once the connection is gone.

mod common;

use std::time::{Duration, Instant};

use common::*;
use tcpx_runtime::control::{ControlConn, EndpointInfo, Message};
use tcpx_runtime::{Backend, Config, Endpoint, Error};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

fn with_timeout(channels: u16, timeout: Duration) -> Config {
    Config::builder()
        .backend(Backend::Builtin)
        .control_addr("127.0.0.1:0".parse().unwrap())
        .channels(channels)
        .chunk_bytes(256 * KIB as u32)
        .timeout(timeout)
        .build()
        .unwrap()
}

#[test]
fn peer_closing_mid_transfer_fails_pending_transfers_on_both_sides() {
    loopback();
    let timeout = Duration::from_secs(10);
    let (a, b, ab, ba) = pair_with(with_timeout(2, timeout), with_timeout(2, timeout));
    let len = 256 * MIB;
    let src = a.alloc_host(len).unwrap();
    let dst = b.alloc_host(len).unwrap();
    let back = a.alloc_host(MIB).unwrap();
    // Mid-transfer by construction, not by timing: the sender sends half of what the
    // receiver posted (whole chunks, so the halves pair chunk by chunk), and nothing more.
    let rx = ba.recv(&dst, 0, len).unwrap();
    let rx_later = ba.recv(&dst, 0, MIB).unwrap();
    // Pending on the side that goes away: b never sends.
    let on_dropped = ab.recv(&back, 0, MIB).unwrap();
    let half = ab.send(&src, 0, len / 2).unwrap();
    assert_eq!(half.wait(DEADLINE).unwrap(), (len / 2) as u64);
    assert!(ba.stats().iter().any(|s| s.bytes_received > 0));
    let dropped_at = Instant::now();
    drop(ab);
    let dropped_result = on_dropped.wait(DEADLINE);
    let rx_result = rx.wait(DEADLINE);
    let later_result = rx_later.wait(DEADLINE);
    let elapsed = dropped_at.elapsed();
    assert!(elapsed < timeout, "failures took {elapsed:?}");
    assert!(
        matches!(dropped_result, Err(Error::Closed { .. })),
        "{dropped_result:?}"
    );
    let err = rx_result.unwrap_err();
    assert_eq!(err.peer(), Some(ba.peer()), "{err}");
    assert!(later_result.is_err(), "{later_result:?}");
    // The connection stays failed: new transfers fail fast.
    assert!(ba.recv(&dst, 0, 1).is_err());
    drop((a, b));
}

/// A peer that closed its end (idle, nothing pending) is sent nothing more: sends, one-sided
/// operations and notifications on the survivor are refused at once with `PeerClosed` — a
/// notification written into the closed stream would otherwise vanish — while a receive is
/// still taken (what the peer sent before its goodbye may be in flight) and fails only when
/// nothing arrives.
#[test]
fn work_for_a_peer_that_closed_is_refused_not_lost() {
    loopback();
    let timeout = Duration::from_secs(10);
    let (a, b, ab, ba) = pair_with(with_timeout(2, timeout), with_timeout(2, timeout));
    let buf = b.alloc_host(MIB).unwrap();
    let target = a.alloc_host(MIB).unwrap();
    let remote = a.advertise(&target).unwrap();
    drop(ab);
    // The goodbye travels on the control stream; bounded wait for the survivor to read it.
    // (Notifications sent before it is read go out and are dropped by the closed peer.)
    assert!(
        eventually(DEADLINE, || ba.notify(b"anyone there?").is_err()),
        "the survivor never noticed the peer's close"
    );
    let peer_closed = |r: Result<(), Error>, what: &str| match r {
        Err(e @ Error::PeerClosed { .. }) => assert_eq!(e.peer(), Some(ba.peer()), "{what}: {e}"),
        Err(e) => panic!("{what}: expected PeerClosed, got {e}"),
        Ok(()) => panic!("{what}: accepted on a connection whose peer has gone"),
    };
    peer_closed(ba.send(&buf, 0, MIB).map(|_| ()), "send");
    peer_closed(ba.notify(b"anyone there?"), "notify");
    let segment = [tcpx_runtime::Segment::new(&buf, 0, 4 * KIB)];
    let remote = [tcpx_runtime::RemoteSegment::new(remote, 0, 4 * KIB as u64)];
    peer_closed(ba.write(&segment, &remote, None).map(|_| ()), "write");
    peer_closed(ba.read(&segment, &remote).map(|_| ()), "read");
    // A receive is taken, and fails (nothing was sent) once the engines give up on the
    // departed peer, well within the transfer timeout.
    let started = Instant::now();
    let late = ba
        .recv(&buf, 0, MIB)
        .expect("a receive after the goodbye is taken");
    let err = late.wait(DEADLINE).unwrap_err();
    assert_eq!(err.peer(), Some(ba.peer()), "{err}");
    assert!(
        started.elapsed() < timeout,
        "{:?}: {err}",
        started.elapsed()
    );
    drop((ba, a, b));
}

#[test]
fn unmatched_transfers_time_out_naming_channel_and_peer() {
    loopback();
    let timeout = Duration::from_millis(800);
    let (a, b, ab, ba) = pair_with(with_timeout(3, timeout), with_timeout(3, timeout));
    // A receive nobody sends to.
    let dst = b.alloc_host(MIB).unwrap();
    let start = Instant::now();
    let rx = ba.recv(&dst, 0, MIB).unwrap();
    let err = rx.wait(DEADLINE).unwrap_err();
    let elapsed = start.elapsed();
    assert!(err.is_timeout(), "{err}");
    assert!(elapsed >= timeout && elapsed < timeout * 4, "{elapsed:?}");
    assert!(err.channel().is_some(), "{err}");
    assert_eq!(err.peer(), Some(ba.peer()));
    let text = err.to_string();
    assert!(
        text.contains("channel") && text.contains(&ba.peer().to_string()),
        "{text}"
    );
    // The connection is failed: the next transfer fails at once with the same cause.
    let again = ba.recv(&dst, 0, 10).unwrap_err();
    assert!(again.is_timeout(), "{again}");

    // A send larger than the socket buffers that nobody receives times out too (small sends
    // complete once the kernel has buffered them, as with TCPX).
    let (_ab2, _ba2) = (ab, ba);
    let (c, d, cd, _dc) = pair_with(with_timeout(1, timeout), with_timeout(1, timeout));
    let src = c.alloc_host(256 * MIB).unwrap();
    let tx = cd.send(&src, 0, 256 * MIB).unwrap();
    let err = tx.wait(DEADLINE).unwrap_err();
    assert!(err.is_timeout() && err.channel() == Some(0), "{err}");
    drop((a, b, d));
}

#[test]
fn incompatible_peers_are_refused_naming_both_values() {
    loopback();
    // Channel counts and chunk sizes may differ (the connection takes the smaller of each:
    // `agreement.rs`); a foreign plugin or a chunk size of 0 may not, and the refusal names
    // what differs on both sides: in the acceptor's error and in the `Error` the peer gets.
    let a = Endpoint::new(config(2, 512 * KIB as u32)).unwrap();
    let meta = a.metadata().clone();
    let own_plugin = a.backend().name.clone();
    let hello = |plugin_name: &str, chunk_bytes: u32| EndpointInfo {
        ip: meta.control_addr.ip(),
        gpu_pci: None,
        channels: 2,
        plugin_name: plugin_name.into(),
        abi_version: 8,
        chunk_bytes,
        gpu_index: None,
        spread: 1,
        eager_bytes: 0,
        spread_two_sided: true,
    };
    for (info, wanted) in [
        (
            hello("GPUDirectTCPX_v7", 512 * KIB as u32),
            ["plugin", "GPUDirectTCPX_v7"],
        ),
        (hello(&own_plugin, 0), ["chunk size", "this side 524288"]),
    ] {
        let (accepted, answer) = std::thread::scope(|s| {
            let accepted = s.spawn(|| a.accept_timeout(DEADLINE));
            let mut peer = ControlConn::connect(meta.control_addr, DEADLINE).unwrap();
            peer.send(&Message::hello_presenting(info, Some(meta.secret)))
                .unwrap();
            // The acceptor answers with its own `Hello`, then with why it stops.
            let own = peer.recv(DEADLINE);
            assert!(matches!(own, Ok(Message::Hello { .. })), "{own:?}");
            (accepted.join().unwrap(), peer.recv(DEADLINE))
        });
        let local = accepted.map(|_| ()).unwrap_err().to_string();
        let Ok(Message::Error { message, .. }) = answer else {
            panic!("the peer was answered {answer:?}, not an error");
        };
        for text in [&local, &message] {
            for w in wanted {
                assert!(text.contains(w), "{w:?} missing from: {text}");
            }
        }
    }
}

#[test]
fn mismatched_lengths_fail_instead_of_corrupting() {
    loopback();
    let (a, b, ab, ba) = pair_with(
        with_timeout(1, Duration::from_secs(5)),
        with_timeout(1, Duration::from_secs(5)),
    );
    let src = a.alloc_host(4096).unwrap();
    let dst = b.alloc_host(4096).unwrap();
    let rx = ba.recv(&dst, 0, 2000).unwrap();
    let tx = ab.send(&src, 0, 1000).unwrap();
    let err = rx.wait(DEADLINE).unwrap_err();
    assert!(matches!(err, Error::Mismatch { channel: 0, .. }), "{err}");
    assert!(
        err.to_string().contains("1000") && err.to_string().contains("2000"),
        "{err}"
    );
    // The sender either finished (bytes left) or fails when the receiver closes.
    drop(ba);
    let _ = tx.wait(DEADLINE);
    drop((a, b, ab));
}
