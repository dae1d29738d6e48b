//! Small two-sided messages in eager frames (`Config::eager_bytes`): many messages per plugin
//! request on comms of their own, handed to their receives by sequence number. Real loopback
//! pairs over the built-in plugin; every byte is checked where it must land.

mod common;

use std::time::{Duration, Instant};

use common::*;
use tcpx_runtime::{Config, Connection, Endpoint, Error, Region};

fn eager_config(channels: u16, eager: u32) -> Config {
    let mut c = config(channels, 64 << 10);
    c.eager_bytes = Some(eager);
    c
}

/// A stream of small messages interleaved with large ones, posted receive-first for some and
/// send-first for others, with many in flight: every message lands whole in its own slot, in
/// its own order, on every channel count.
#[test]
fn small_and_large_messages_interleave_and_land_in_order() {
    loopback();
    for channels in [1u16, 3, 8] {
        let (a, b, ab, ba) = pair_with(
            eager_config(channels, 16 << 10),
            eager_config(channels, 16 << 10),
        );
        assert_eq!(ab.eager_bytes(), 16 << 10);
        // Sizes cycle through the eager bound and past it (1 byte .. 200 KiB).
        let sizes: Vec<usize> = (0..300)
            .map(|i| match i % 7 {
                0 => 1,
                1 => 4096,
                2 => 16 << 10,
                3 => (16 << 10) + 1,
                4 => 200 << 10,
                5 => 333,
                _ => 8000,
            })
            .collect();
        let stride = 256 << 10;
        let src = source(&a, sizes.len() * stride, u64::from(channels) + 40);
        let dst = b.alloc_host(sizes.len() * stride).unwrap();
        // The first half's receives come first; the second half's messages arrive before
        // their receives (early arrivals), which are posted while the sends are in flight:
        // waiting for those sends first would ask TCP to buffer megabytes of large messages
        // nobody receives, which passes or not with the kernel's buffer autotuning.
        let what = format!("{channels} channels");
        exchange_verified((&ab, &ba), (&src, &dst), &sizes, stride, &what);
        assert_eq!(ab.in_flight(), 0);
        assert_eq!(ba.in_flight(), 0);
    }
}

/// Messages sent detached (host memory from `eager_detach` on: their bytes follow their
/// frame from the application's memory) interleaved with copied ones and large ones, receive
/// first and send first, on one to eight channels: every message lands whole in its slot, and
/// sends finish in order (a copied send behind a detached one finishes with it).
#[test]
fn detached_messages_interleave_with_copied_ones_and_land_in_order() {
    loopback();
    for (channels, detach) in [(1u16, 16 << 10), (3, 16 << 10), (8, 32 << 10), (2, 1)] {
        let mut ca = eager_config(channels, 64 << 10);
        ca.eager_detach = detach;
        let (a, b, ab, ba) = pair_with(ca.clone(), ca);
        // Runs of detached messages longer than a frame takes, alone and between copied ones.
        let sizes: Vec<usize> = (0..400)
            .map(|i| match i % 11 {
                0 => 1,
                1..=3 => 64 << 10,
                4 => 16 << 10,
                5 => 40_000,
                6 => (64 << 10) + 1,
                7 => 4096,
                8 => (16 << 10) - 1,
                9 => 64 << 10,
                _ => 333,
            })
            .collect();
        let stride = 96 << 10;
        let src = source(&a, sizes.len() * stride, u64::from(channels) + 70);
        let dst = b.alloc_host(sizes.len() * stride).unwrap();
        let what = format!("{channels} channels, detached from {detach}");
        exchange_verified((&ab, &ba), (&src, &dst), &sizes, stride, &what);
        assert_eq!(ab.in_flight() + ba.in_flight(), 0);
    }
}

/// A receiver that starts late behind thousands of detached 64 KiB messages: their bytes
/// wait in receive frames (then in TCP) and each lands in its own receive, in order.
#[test]
fn detached_messages_to_a_late_receiver_all_arrive_in_order() {
    loopback();
    let (a, b, ab, ba) = pair_with(eager_config(4, 64 << 10), eager_config(4, 64 << 10));
    let (count, len, slots) = (3000usize, 64usize << 10, 64usize);
    let shape = Stream {
        count,
        len,
        slots,
        depth: slots,
        receiver_late_by: Duration::from_millis(300),
    };
    assert_eq!(stream_through_slots((&a, &b), (&ab, &ba), shape), count);
    assert_eq!(ab.in_flight() + ba.in_flight(), 0);
}

/// A detached message whose receive has another length fails that receive with both
/// lengths, whether the receive came first (straight into its memory) or after the message.
#[test]
fn a_detached_length_mismatch_fails_the_receive_and_says_both_lengths() {
    loopback();
    for receive_first in [true, false] {
        let (a, b, ab, ba) = pair_with(eager_config(2, 64 << 10), eager_config(2, 64 << 10));
        let src = source(&a, 64 << 10, 5);
        let dst = b.alloc_host(64 << 10).unwrap();
        let (sent, expected) = (40_000usize, 48_000usize);
        let r = if receive_first {
            let r = ba.recv(&dst, 0, expected).unwrap();
            let _ = ab.send(&src, 0, sent).unwrap();
            r
        } else {
            let _ = ab.send(&src, 0, sent).unwrap();
            std::thread::sleep(Duration::from_millis(100));
            ba.recv(&dst, 0, expected).unwrap()
        };
        let err = r.wait(DEADLINE).unwrap_err();
        assert!(matches!(err, Error::Mismatch { .. }), "{err:?}");
        let text = err.to_string();
        assert!(text.contains("40000") && text.contains("48000"), "{text}");
        assert!(ba.error().is_some(), "the connection failed");
    }
}

/// Thousands of 4 KiB messages with a deep window of sends in flight share frames, and the
/// receive side hands each to its own receive (checked by content).
#[test]
fn a_deep_stream_of_small_messages_arrives_whole() {
    loopback();
    let (a, b, ab, ba) = pair_with(eager_config(4, 16 << 10), eager_config(4, 16 << 10));
    let (count, len, depth) = (5000usize, 4096usize, 256usize);
    let shape = Stream {
        count,
        len,
        slots: 512,
        depth,
        receiver_late_by: Duration::ZERO,
    };
    let seen = stream_through_slots((&a, &b), (&ab, &ba), shape);
    assert_eq!(seen, count);
}

/// Eager frames are agreed: a side that turns them off (0) makes the connection carry every
/// message as a plugin request of its own, and small messages still arrive.
#[test]
fn either_side_turning_eager_off_keeps_every_message_on_the_channels() {
    loopback();
    let (a, b, ab, ba) = pair_with(eager_config(2, 16 << 10), eager_config(2, 0));
    assert_eq!(ab.eager_bytes(), 0);
    assert_eq!(ba.eager_bytes(), 0);
    let src = source(&a, 4096, 7);
    let dst = b.alloc_host(4096).unwrap();
    let r = ba.recv(&dst, 0, 4096).unwrap();
    ab.send(&src, 0, 4096).unwrap().wait(DEADLINE).unwrap();
    r.wait(DEADLINE).unwrap();
    assert_pattern(&dst, 0, 4096, 7, "a small message without eager frames");
    // The smaller offer wins.
    let (_c, _d, cd, dc) = pair_with(eager_config(2, 16 << 10), eager_config(2, 1024));
    assert_eq!((cd.eager_bytes(), dc.eager_bytes()), (1024, 1024));
}

/// A small receive of another length than its send fails with a mismatch naming both
/// lengths, and the connection with it; nothing hangs.
#[test]
fn a_length_mismatch_fails_the_receive_and_says_both_lengths() {
    loopback();
    let (a, b, ab, ba) = pair_with(eager_config(2, 16 << 10), eager_config(2, 16 << 10));
    let src = source(&a, 4096, 3);
    let dst = b.alloc_host(4096).unwrap();
    let r = ba.recv(&dst, 0, 2048).unwrap();
    let _ = ab.send(&src, 0, 4096).unwrap().wait(DEADLINE);
    let err = r.wait(DEADLINE).unwrap_err();
    assert!(matches!(err, Error::Mismatch { .. }), "{err:?}");
    let text = err.to_string();
    assert!(text.contains("4096") && text.contains("2048"), "{text}");
    assert!(ba.error().is_some(), "the connection failed");
}

/// Small receives whose sends never come time out with an error that names them; a peer
/// that closes fails them well before that.
#[test]
fn waiting_small_receives_end_in_an_error_not_a_hang() {
    loopback();
    let mut short = eager_config(2, 16 << 10);
    short.timeout = Duration::from_millis(700);
    let (_a, _b, _ab, ba) = pair_with(eager_config(2, 16 << 10), short);
    let b_region = _b.alloc_host(4096).unwrap();
    let started = Instant::now();
    let r = ba.recv(&b_region, 0, 4096).unwrap();
    let err = r.wait(DEADLINE).unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(20));
    assert!(
        matches!(&err, Error::Timeout { what, .. } if what.contains("eager receive #0")),
        "{err:?}"
    );

    let (a, b, ab, ba) = pair_with(eager_config(2, 16 << 10), eager_config(2, 16 << 10));
    let dst = b.alloc_host(4096).unwrap();
    let r = ba.recv(&dst, 0, 4096).unwrap();
    let started = Instant::now();
    drop(ab);
    drop(a);
    let err = r.wait(DEADLINE).unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
    // The peer's goodbye, its control stream ending, or its comm closing under a receive.
    assert!(
        matches!(
            err,
            Error::PeerClosed { .. } | Error::Control(_) | Error::Plugin { .. }
        ),
        "{err:?}"
    );
}

/// Dropping a connection with small sends queued and receives waiting fails them with
/// `Closed` and leaves nothing counted in flight.
#[test]
fn closing_fails_what_is_queued_and_waiting() {
    loopback();
    let (a, b, ab, ba) = pair_with(eager_config(2, 16 << 10), eager_config(2, 16 << 10));
    let dst = b.alloc_host(4096 * 4).unwrap();
    let waiting: Vec<_> = (0..4)
        .map(|i| ba.recv(&dst, i * 4096, 4096).unwrap())
        .collect();
    drop(ba);
    for r in waiting {
        assert!(r.wait(DEADLINE).is_err());
    }
    let src = source(&a, 4096, 1);
    // The peer left: a send after its goodbye is refused or fails, never hangs.
    let deadline = Instant::now() + DEADLINE;
    while Instant::now() < deadline {
        match ab.send(&src, 0, 4096) {
            Err(_) => break,
            Ok(t) => {
                if t.wait(DEADLINE).is_err() {
                    break;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        Instant::now() < deadline,
        "sends kept succeeding after the peer left"
    );
}

/// A sender far ahead of its receiver (47 MiB, far more than the receive frames hold, sent
/// before the first receive: the frames fill and the rest waits in TCP): the receiver still
/// gets every message, in order.
#[test]
fn a_receiver_far_behind_its_sender_still_gets_every_message() {
    loopback();
    let (a, b, ab, ba) = pair_with(eager_config(4, 16 << 10), eager_config(4, 16 << 10));
    let (count, len) = (12_000usize, 4096usize);
    let src = a.alloc_host(len).unwrap();
    let dst = b.alloc_host(count.min(1024) * len).unwrap();
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut in_flight = std::collections::VecDeque::new();
            for i in 0..count {
                if in_flight.len() >= 1024 {
                    let t: tcpx_runtime::Transfer = in_flight.pop_front().unwrap();
                    t.wait(DEADLINE).unwrap();
                }
                // Each message says its number in its first 8 bytes.
                src.memory().write_at(0, &(i as u64).to_le_bytes()).unwrap();
                in_flight.push_back(ab.send(&src, 0, len).unwrap());
                // The next write must not race the copy into a frame: wait for it.
                in_flight.pop_back().unwrap().wait(DEADLINE).unwrap();
            }
        });
        std::thread::sleep(Duration::from_millis(300));
        for round in 0..count.div_ceil(1024) {
            let n = 1024.min(count - round * 1024);
            let batch: Vec<_> = (0..n)
                .map(|k| ba.recv(&dst, k * len, len).unwrap())
                .collect();
            for t in &batch {
                t.wait(DEADLINE).unwrap();
            }
            let got = snapshot(&dst);
            for k in 0..n {
                let number = u64::from_le_bytes(got[k * len..k * len + 8].try_into().unwrap());
                assert_eq!(
                    number,
                    (round * 1024 + k) as u64,
                    "message {k} of round {round}"
                );
            }
        }
    });
}

/// A small send finishes once its bytes are copied into a frame, before any receive is
/// posted: the sender may overwrite its buffer at once, and the receiver gets the bytes as
/// they were when the send was made.
#[test]
fn a_small_send_finishes_when_copied_and_its_buffer_is_free_again() {
    loopback();
    let (a, b, ab, ba) = pair_with(eager_config(2, 16 << 10), eager_config(2, 16 << 10));
    let (count, len) = (200usize, 1000usize);
    let src = a.alloc_host(len).unwrap();
    for i in 0..count {
        src.memory().write_at(0, &vec![i as u8; len]).unwrap();
        let send = ab.send(&src, 0, len).unwrap();
        // No receive is posted yet: the send still finishes (its bytes are in a frame).
        assert_eq!(send.wait(DEADLINE).unwrap(), len as u64, "send {i}");
    }
    let dst = b.alloc_host(count * len).unwrap();
    let recvs: Vec<_> = (0..count)
        .map(|i| ba.recv(&dst, i * len, len).unwrap())
        .collect();
    for (i, r) in recvs.iter().enumerate() {
        assert_eq!(r.wait(DEADLINE).unwrap(), len as u64, "receive {i}");
    }
    let got = snapshot(&dst);
    for (i, message) in got.chunks_exact(len).enumerate() {
        assert!(
            message.iter().all(|&x| x == i as u8),
            "message {i} does not hold the bytes it was sent with"
        );
    }
    assert_eq!(ab.in_flight() + ba.in_flight(), 0);
}

/// A receiver that never receives: the sender's frames stop being taken, its later small
/// sends wait for a frame, and the connection ends in a timeout that says what was stuck —
/// never a hang, and never sends reported done forever.
#[test]
fn small_sends_to_a_receiver_that_never_receives_end_in_a_timeout() {
    loopback();
    let mut short = eager_config(2, 64 << 10);
    short.timeout = Duration::from_millis(1500);
    let (a, _b, ab, _ba) = pair_with(short, eager_config(2, 64 << 10));
    let len = 64 << 10;
    let src = source(&a, len, 3);
    let started = Instant::now();
    let mut error = None;
    // Far more than socket buffers and frames hold (a few MiB per comm).
    for i in 0..8192 {
        match ab.send(&src, 0, len) {
            Ok(t) => {
                if i % 64 == 63 {
                    if let Err(e) = t.wait(DEADLINE) {
                        error = Some(e);
                        break;
                    }
                }
            }
            Err(e) => {
                error = Some(e);
                break;
            }
        }
    }
    let error = error.expect("every send finished although nothing was received");
    assert!(started.elapsed() < Duration::from_secs(30), "{error:?}");
    assert!(
        matches!(&error, Error::Timeout { what, .. } if what.contains("eager"))
            || matches!(&error, Error::PeerClosed { .. }),
        "{error:?}"
    );
}

/// Small transfers keep no reference to their regions once finished: the engines hand them
/// back to the application in bulk and release the rest when they go idle. A region pair
/// registered with the plugin by one large transfer, then used by many small ones, is
/// deregistered once the application drops its handles.
#[test]
fn regions_of_finished_small_transfers_are_released() {
    loopback();
    let (a, b, ab, ba) = pair_with(eager_config(4, 16 << 10), eager_config(4, 16 << 10));
    let big = 1 << 20;
    let src = source(&a, big, 7);
    let dst = b.alloc_host(big).unwrap();
    let (base_a, base_b) = (a.live_registrations(), b.live_registrations());
    let recv = ba.recv(&dst, 0, big).unwrap();
    ab.send(&src, 0, big).unwrap().wait(DEADLINE).unwrap();
    recv.wait(DEADLINE).unwrap();
    assert!(a.live_registrations() > base_a && b.live_registrations() > base_b);
    for round in 0..20 {
        let (sends, recvs): (Vec<_>, Vec<_>) = (0..100)
            .map(|k| {
                let at = ((round * 100 + k) % 1000) * 1000;
                (
                    ab.send(&src, at, 1000).unwrap(),
                    ba.recv(&dst, at, 1000).unwrap(),
                )
            })
            .unzip();
        for t in sends.iter().chain(&recvs) {
            assert_eq!(t.wait(DEADLINE).unwrap(), 1000);
        }
    }
    assert_eq!(snapshot(&dst), snapshot(&src), "every small message landed");
    drop((src, dst));
    assert_registrations_back((&a, &b), (base_a, base_b));
}

/// The eager channels' registrations of application regions (detached messages are sent
/// from, and received straight into, the application's memory) count in
/// `live_registrations` once per region, not per message, and go once the regions are
/// dropped and the engines idle.
#[test]
fn registrations_of_detached_messages_are_counted_once_per_region_and_released() {
    loopback();
    let (a, b, ab, ba) = pair_with(eager_config(2, 64 << 10), eager_config(2, 64 << 10));
    let (base_a, base_b) = (a.live_registrations(), b.live_registrations());
    let (regions, len, rounds) = (6usize, 64usize << 10, 30usize);
    let srcs: Vec<_> = (0..regions).map(|i| source(&a, len, i as u64)).collect();
    let dsts: Vec<_> = (0..regions).map(|_| b.alloc_host(len).unwrap()).collect();
    // Registrations stay while their regions live: the count after each round is the most
    // it reached.
    let (mut most_a, mut most_b) = (0, 0);
    for round in 0..rounds {
        let recvs: Vec<_> = dsts.iter().map(|d| ba.recv(d, 0, len).unwrap()).collect();
        let sends: Vec<_> = srcs.iter().map(|s| ab.send(s, 0, len).unwrap()).collect();
        for t in sends.iter().chain(&recvs) {
            assert_eq!(t.wait(DEADLINE).unwrap(), len as u64, "round {round}");
        }
        for (s, d) in srcs.iter().zip(&dsts) {
            assert!(
                snapshot(s) == snapshot(d),
                "round {round}: a message landed wrong"
            );
        }
        most_a = most_a.max(a.live_registrations().saturating_sub(base_a));
        most_b = most_b.max(b.live_registrations().saturating_sub(base_b));
    }
    // Each region is registered at most once per side and channel, whatever the rounds.
    assert!(
        most_a > 0,
        "the sender's detached registrations are not counted"
    );
    assert!(
        most_a <= 2 * regions,
        "the sender registered per message: {most_a}"
    );
    assert!(
        most_b <= 2 * regions,
        "the receiver registered per message: {most_b}"
    );
    drop((srcs, dsts));
    assert_registrations_back((&a, &b), (base_a, base_b));
}

/// Streams of detached messages whose count ends a channel's run part-way, each followed by
/// a small message, with receives posted well ahead (the shape of `tcpx-bench` phases): every
/// receive finishes with its own bytes.
#[test]
fn detached_streams_that_end_mid_run_finish_every_receive() {
    loopback();
    let (a, b, ab, ba) = pair_with(eager_config(8, 64 << 10), eager_config(8, 64 << 10));
    let slots = 64usize;
    for (round, (count, len)) in [
        (1638usize, 40usize << 10),
        (100, 48 << 10),
        (1000, 64 << 10),
    ]
    .into_iter()
    .enumerate()
    {
        let src = slotted_source(&a, slots, len);
        let dst = b.alloc_host(slots * len).unwrap();
        let note = b.alloc_host(64).unwrap();
        let note_src = a.alloc_host(64).unwrap();
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut in_flight = std::collections::VecDeque::new();
                for i in 0..count {
                    if in_flight.len() >= 256 {
                        let t: tcpx_runtime::Transfer = in_flight.pop_front().unwrap();
                        t.wait(DEADLINE).unwrap();
                    }
                    in_flight.push_back(ab.send(&src, (i % slots) * len, len).unwrap());
                }
                in_flight.push_back(ab.send(&note_src, 0, 24).unwrap());
                for t in in_flight {
                    t.wait(DEADLINE).unwrap();
                }
            });
            let mut in_flight = std::collections::VecDeque::new();
            for i in 0..count {
                if in_flight.len() >= 1024 {
                    let t: tcpx_runtime::Transfer = in_flight.pop_front().unwrap();
                    assert_eq!(t.wait(DEADLINE).unwrap(), len as u64, "round {round}");
                }
                in_flight.push_back(ba.recv(&dst, (i % slots) * len, len).unwrap());
            }
            in_flight.push_back(ba.recv(&note, 0, 24).unwrap());
            for t in in_flight {
                t.wait(DEADLINE).unwrap();
            }
        });
        let got = snapshot(&dst);
        for k in 0..slots {
            assert!(
                check(&got[k * len..(k + 1) * len], k as u64).is_ok(),
                "round {round}, slot {k}"
            );
        }
    }
}

/// Waits (up to 10 s) until both endpoints hold as many live registrations as `base` again:
/// what a test's transfers registered was released.
fn assert_registrations_back((a, b): (&Endpoint, &Endpoint), (base_a, base_b): (usize, usize)) {
    let back = || (a.live_registrations(), b.live_registrations()) == (base_a, base_b);
    assert!(
        eventually(Duration::from_secs(10), back),
        "registrations still alive: {} and {} (were {base_a} and {base_b})",
        a.live_registrations(),
        b.live_registrations()
    );
}

/// A stream of same-size messages through `slots` message slots (see
/// [`stream_through_slots`]).
#[derive(Clone, Copy)]
struct Stream {
    count: usize,
    len: usize,
    slots: usize,
    /// Sends in flight at most.
    depth: usize,
    /// How long the receiver waits before its first receive.
    receiver_late_by: Duration,
}

/// Sends `count` messages from a sender thread, message `i` from slot `i % slots` (each slot
/// holds its own pattern), while the receiver receives them in rounds of one per slot and
/// checks each slot by content before it is reused. Returns the messages checked.
fn stream_through_slots(
    (a, b): (&Endpoint, &Endpoint),
    (ab, ba): (&Connection, &Connection),
    shape: Stream,
) -> usize {
    let Stream {
        count,
        len,
        slots,
        depth,
        receiver_late_by,
    } = shape;
    let src = slotted_source(a, slots, len);
    let dst = b.alloc_host(slots * len).unwrap();
    let mut checked = 0;
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut in_flight = std::collections::VecDeque::new();
            for i in 0..count {
                if in_flight.len() >= depth {
                    let t: tcpx_runtime::Transfer = in_flight.pop_front().unwrap();
                    t.wait(DEADLINE).unwrap();
                }
                in_flight.push_back(ab.send(&src, (i % slots) * len, len).unwrap());
            }
            for t in in_flight {
                t.wait(DEADLINE).unwrap();
            }
        });
        std::thread::sleep(receiver_late_by);
        for round in 0..count.div_ceil(slots) {
            let n = slots.min(count - round * slots);
            let batch: Vec<_> = (0..n)
                .map(|k| ba.recv(&dst, k * len, len).unwrap())
                .collect();
            for t in &batch {
                assert_eq!(t.wait(DEADLINE).unwrap(), len as u64);
            }
            dst.memory()
                .with_bytes(|bytes| {
                    for k in 0..n {
                        let slot = &bytes[k * len..(k + 1) * len];
                        assert!(check(slot, k as u64).is_ok(), "round {round}, slot {k}");
                        checked += 1;
                    }
                })
                .unwrap();
        }
    });
    checked
}

/// `slots` slots of `len` bytes in one region of `ep`, slot `i` filled with pattern `i`.
fn slotted_source(ep: &Endpoint, slots: usize, len: usize) -> Region {
    let src = ep.alloc_host(slots * len).unwrap();
    src.memory()
        .with_bytes_mut(|bytes| {
            for (i, slot) in bytes.chunks_exact_mut(len).enumerate() {
                fill(slot, i as u64);
            }
        })
        .unwrap();
    src
}
