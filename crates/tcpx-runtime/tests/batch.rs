//! Two-sided batches (`Connection::send_batch` / `recv_batch`): many small messages in one
//! submission, one packed stream on the wire. Real loopback pairs over the built-in plugin;
//! every byte is checked where it must land.

mod common;

use common::*;
use tcpx_runtime::{Endpoint, Region, Segment, PACK_BYTES};

/// `count` messages of `len` bytes, each in its own slot `stride` bytes apart in one region.
fn slots<'r>(region: &'r Region, count: usize, len: usize, stride: usize) -> Vec<Segment<'r>> {
    (0..count)
        .map(|i| Segment::new(region, i * stride, len))
        .collect()
}

fn staged(ep: &Endpoint, len: usize) -> Region {
    let memory = tcpx::SharedMemory::host(len.max(1)).expect("host memory");
    ep.register_staged_emulation(memory)
        .expect("register_staged_emulation")
}

/// Each message of a batch lands in its own receive slot, with the sender's and receiver's
/// slots laid out differently; batches interleave with plain sends in posting order.
#[test]
fn messages_of_a_batch_land_in_their_own_slots() {
    loopback();
    for channels in [1u16, 4, 8] {
        let (a, b, ab, ba) = pair(channels, 64 << 10);
        let (count, len) = (200, 4096);
        let src = source(&a, count * 8192, u64::from(channels));
        let dst = b.alloc_host(count * 5000 + 64).unwrap();
        let send = slots(&src, count, len, 8192);
        let recv = slots(&dst, count, len, 5000);
        // Receiver first on one batch; a plain send queued behind it on both sides.
        let rx = ba.recv_batch(&recv).unwrap();
        let small_dst = b.alloc_host(100).unwrap();
        let rx_small = ba.recv(&small_dst, 0, 100).unwrap();
        let tx = ab.send_batch(&send).unwrap();
        let tx_small = ab.send(&src, 1, 100).unwrap();
        assert_eq!(tx.wait(DEADLINE).unwrap(), (count * len) as u64);
        assert_eq!(rx.wait(DEADLINE).unwrap(), (count * len) as u64);
        tx_small.wait(DEADLINE).unwrap();
        rx_small.wait(DEADLINE).unwrap();
        let sent = snapshot(&src);
        let got = snapshot(&dst);
        for i in 0..count {
            assert!(
                got[i * 5000..i * 5000 + len] == sent[i * 8192..i * 8192 + len],
                "{channels} channels: message {i} of the batch"
            );
        }
        assert!(
            snapshot(&small_dst)[..] == sent[1..101],
            "plain send after a batch"
        );
        let stats = ba.batch_pack_stats();
        assert!(
            stats.buffers >= 1,
            "the scattered receive went through a pack buffer"
        );
        assert!(ab.error().is_none(), "{:?}", ab.error());
    }
}

/// The wire is one stream: a scattered list may meet a contiguous one (no copy on that side)
/// and the cut may differ, as long as the totals match.
#[test]
fn a_batch_is_a_stream_cut_however_each_side_likes() {
    loopback();
    let (a, b, ab, ba) = pair(4, 32 << 10);
    let total = 300_001;
    let src = source(&a, total, 9);
    let dst = b.alloc_host(total).unwrap();
    // Sender: one run cut into uneven pieces; receiver: one segment.
    let send = [
        Segment::new(&src, 0, 1),
        Segment::new(&src, 1, 99_999),
        Segment::new(&src, 100_000, 200_001),
    ];
    let rx = ba.recv_batch(&[Segment::new(&dst, 0, total)]).unwrap();
    let tx = ab.send_batch(&send).unwrap();
    tx.wait(DEADLINE).unwrap();
    rx.wait(DEADLINE).unwrap();
    assert_pattern(&dst, 0, total, 9, "contiguous receive of a batch");
    // Reverse: contiguous sender, scattered receiver in two regions.
    let d1 = b.alloc_host(200_000).unwrap();
    let d2 = b.alloc_host(200_000).unwrap();
    let rx = ba
        .recv_batch(&[
            Segment::new(&d1, 10, 150_000),
            Segment::new(&d2, 3, total - 150_000),
        ])
        .unwrap();
    let tx = ab.send_batch(&[Segment::new(&src, 0, total)]).unwrap();
    tx.wait(DEADLINE).unwrap();
    rx.wait(DEADLINE).unwrap();
    let mut got = snapshot(&d1)[10..150_010].to_vec();
    got.extend_from_slice(&snapshot(&d2)[3..3 + total - 150_000]);
    assert!(
        got == snapshot(&src),
        "scattered receive of a contiguous batch"
    );
}

/// Staged memory (the CPU emulation of CUDA staging) batches through the lanes' rings, with
/// no pack buffer, against host memory on the other side and against staged memory.
#[test]
fn staged_batches_go_through_the_rings() {
    loopback();
    let (a, b, ab, ba) = pair(4, 64 << 10);
    let (count, len) = (250, 16 << 10);
    let src = staged(&a, count * 20_000);
    write_pattern(&src, count * 20_000, 21);
    let host_dst = b.alloc_host(count * len).unwrap();
    let staged_dst = staged(&b, count * 17_000);
    let send = slots(&src, count, len, 20_000);
    for (what, dst, stride) in [("host", &host_dst, len), ("staged", &staged_dst, 17_000)] {
        let recv = slots(dst, count, len, stride);
        let rx = ba.recv_batch(&recv).unwrap();
        let tx = ab.send_batch(&send).unwrap();
        tx.wait(DEADLINE).unwrap();
        rx.wait(DEADLINE).unwrap();
        let sent = snapshot(&src);
        let got = snapshot(dst);
        for i in 0..count {
            assert!(
                got[i * stride..i * stride + len] == sent[i * 20_000..i * 20_000 + len],
                "staged → {what}: message {i}"
            );
        }
    }
    assert_eq!(
        ab.batch_pack_stats().buffers,
        0,
        "a staged sender needs no pack buffer"
    );
}

/// Bad batches are refused at once with a reason; a total that differs from the peer's fails
/// the batch with an error naming both, and the connection's later traffic is not silently
/// misdelivered.
#[test]
fn bad_batches_are_refused_with_a_reason() {
    loopback();
    let (a, b, ab, ba) = pair(2, 64 << 10);
    let src = a.alloc_host(8192).unwrap();
    let err = ab.send_batch(&[]).unwrap_err().to_string();
    assert!(err.contains("at least one segment"), "{err}");
    let err = ab
        .send_batch(&[Segment::new(&src, 8000, 1000)])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("segment 0") && err.contains("outside"),
        "{err}"
    );
    let big = a.alloc_host(PACK_BYTES as usize + 1).unwrap();
    let err = ab
        .send_batch(&[Segment::new(&big, 0, PACK_BYTES as usize + 1)])
        .unwrap_err()
        .to_string();
    assert!(err.contains("split it"), "{err}");
    assert_eq!(ab.in_flight(), 0, "refused batches leave nothing in flight");

    // The receiver expects more than the sender's batch holds: the plugin reports the
    // shorter message and the receive fails, naming both totals.
    let dst = b.alloc_host(16384).unwrap();
    let rx = ba
        .recv_batch(&[Segment::new(&dst, 0, 4096), Segment::new(&dst, 8192, 4096)])
        .unwrap();
    let tx = ab
        .send_batch(&[Segment::new(&src, 0, 3000), Segment::new(&src, 4096, 3000)])
        .unwrap();
    let sent = tx.wait(DEADLINE);
    let got = rx.wait(DEADLINE);
    assert!(
        sent.is_err() || got.is_err(),
        "mismatched totals must fail a side: sent {sent:?}, got {got:?}"
    );
    if let Err(e) = got {
        let e = e.to_string();
        assert!(!e.is_empty());
    }
}

/// `reserve_batches` pays the pack buffers of a window of batches up front: the batches that
/// follow register nothing more.
#[test]
fn reserved_pack_buffers_leave_nothing_to_pay_later() {
    loopback();
    let (a, b, ab, ba) = pair(4, 64 << 10);
    assert_eq!(ab.reserve_batches(6).unwrap(), 6);
    assert_eq!(ba.reserve_batches(6).unwrap(), 6);
    let (count, len) = (64, 4096);
    let src = source(&a, count * 8192, 5);
    let dst = b.alloc_host(count * 8192).unwrap();
    let send = slots(&src, count, len, 8192);
    let recv = slots(&dst, count, len, 8192);
    // Register the slots' own memory first (the in-place check may look at it); then only
    // pack buffers could add registrations.
    ab.register(&src).unwrap();
    ba.register(&dst).unwrap();
    let before = (a.live_registrations(), b.live_registrations());
    for _ in 0..4 {
        let rx: Vec<_> = (0..6).map(|_| ba.recv_batch(&recv).unwrap()).collect();
        let tx: Vec<_> = (0..6).map(|_| ab.send_batch(&send).unwrap()).collect();
        for t in tx.iter().chain(&rx) {
            t.wait(DEADLINE).unwrap();
        }
    }
    assert_eq!(
        (a.live_registrations(), b.live_registrations()),
        before,
        "batches after reserve_batches registered more memory"
    );
    assert_eq!(ab.batch_pack_stats().overflows, 0);
    assert_eq!(ba.batch_pack_stats().buffers, 6);
}

/// Against the simplest model — the concatenation of the sender's blocks equals the
/// concatenation of the receiver's — for random cuts on both sides: blocks in regions of
/// their own on the sending side, scattered at random gaps in one region on the receiving
/// side, chunks small enough that most cut blocks in two and most blocks share a chunk. The
/// engines of every channel copy their chunks' blocks (gather before the send, scatter after
/// the receive), so a block split across channels, or a chunk over many blocks, is checked
/// here byte for byte.
#[test]
fn packed_batches_deliver_any_cut_on_either_side() {
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestRunner};

    loopback();
    let cuts = (
        proptest::collection::vec(1usize..20_000, 1..48),
        any::<u64>(),
    )
        .prop_flat_map(|(send, seed)| {
            let total: usize = send.iter().sum();
            // Receive cut: as many pieces as the sender's, give or take, at random points.
            let points = proptest::collection::vec(1..total.max(2), 0..send.len() + 4);
            let gaps = proptest::collection::vec(0usize..5_000, send.len() + 5);
            (Just(send), Just(seed), points, gaps)
        });
    for channels in [3u16, 8] {
        let (a, b, ab, ba) = pair(channels, 16 << 10);
        let mut runner = TestRunner::new(Config {
            cases: 24,
            ..Config::default()
        });
        runner
            .run(&cuts, |(send, seed, mut points, gaps)| {
                let total: usize = send.iter().sum();
                points.push(total);
                points.sort_unstable();
                points.dedup();
                let mut recv_lens = Vec::new();
                let mut at = 0;
                for p in points.into_iter().filter(|&p| p > 0 && p <= total) {
                    recv_lens.push(p - at);
                    at = p;
                }
                // One region per sent block, each with its own pattern.
                let blocks: Vec<Region> = send
                    .iter()
                    .enumerate()
                    .map(|(i, &len)| source(&a, len, seed ^ i as u64))
                    .collect();
                let sent: Vec<u8> = blocks
                    .iter()
                    .zip(&send)
                    .flat_map(|(r, &len)| snapshot(r)[..len].to_vec())
                    .collect();
                let segments: Vec<Segment<'_>> = blocks
                    .iter()
                    .zip(&send)
                    .map(|(r, &len)| Segment::new(r, 0, len))
                    .collect();
                // The receive blocks at random gaps in one region.
                let room: usize = total + gaps.iter().sum::<usize>();
                let dst = b.alloc_host(room).unwrap();
                let mut offsets = Vec::new();
                let mut pos = 0;
                for (len, gap) in recv_lens.iter().zip(&gaps) {
                    pos += gap;
                    offsets.push(pos);
                    pos += len;
                }
                let receive: Vec<Segment<'_>> = offsets
                    .iter()
                    .zip(&recv_lens)
                    .map(|(&o, &len)| Segment::new(&dst, o, len))
                    .collect();
                let rx = ba.recv_batch(&receive).unwrap();
                let tx = ab.send_batch(&segments).unwrap();
                prop_assert_eq!(tx.wait(DEADLINE).unwrap(), total as u64);
                prop_assert_eq!(rx.wait(DEADLINE).unwrap(), total as u64);
                let got_region = snapshot(&dst);
                let got: Vec<u8> = offsets
                    .iter()
                    .zip(&recv_lens)
                    .flat_map(|(&o, &len)| got_region[o..o + len].to_vec())
                    .collect();
                prop_assert!(got == sent, "{channels} channels: the stream differs");
                Ok(())
            })
            .unwrap_or_else(|e| panic!("{channels} channels: {e}"));
        assert!(ab.error().is_none(), "{:?}", ab.error());
        assert!(
            ba.batch_pack_stats().packed_received > 0,
            "the scattered receives went through pack buffers"
        );
    }
}

/// Packed batches whose peer goes away fail, on both sides, well within the timeout — none
/// hangs — and leave the application's blocks free: the engines copy them only while a
/// chunk is being posted or retired, so nothing holds them once the transfers failed.
#[test]
fn packed_batches_fail_when_the_peer_goes_away_and_leave_the_blocks_free() {
    use std::time::{Duration, Instant};
    loopback();
    let timeout = Duration::from_secs(10);
    let quick = || {
        let mut c = config(4, 64 << 10);
        c.timeout = timeout;
        c
    };
    let (count, len) = (1024, 4096);

    // A receive batch pending when the sender's connection is dropped.
    let (_a, b, ab, ba) = pair_with(quick(), quick());
    let dst = b.alloc_host(count * 8192).unwrap();
    let rx = ba.recv_batch(&slots(&dst, count, len, 8192)).unwrap();
    let dropped_at = Instant::now();
    drop(ab);
    let got = rx.wait(DEADLINE);
    assert!(got.is_err(), "a batch from a vanished sender: {got:?}");
    assert!(dropped_at.elapsed() < timeout, "{:?}", dropped_at.elapsed());
    dst.memory()
        .with_bytes_mut(|_| ())
        .expect("the receive blocks are free once the batch failed");

    // Send batches pending (more than the sockets hold) when the receiver goes away.
    let (a, _b, ab, ba) = pair_with(quick(), quick());
    let src = source(&a, count * 8192, 3);
    let sends: Vec<_> = (0..24)
        .map(|_| ab.send_batch(&slots(&src, count, len, 8192)).unwrap())
        .collect();
    let dropped_at = Instant::now();
    drop(ba);
    let outcomes: Vec<_> = sends.iter().map(|t| t.wait(DEADLINE)).collect();
    assert!(dropped_at.elapsed() < timeout, "{:?}", dropped_at.elapsed());
    assert!(
        outcomes.last().is_some_and(|o| o.is_err()),
        "96 MiB of batches cannot all fit the sockets of a receiver that left: {:?}",
        outcomes.last()
    );
    drop(sends);
    // The failed jobs let go of the blocks once the engines abandoned them.
    let free_by = Instant::now() + Duration::from_secs(5);
    while src.memory().with_bytes_mut(|_| ()).is_err() {
        assert!(Instant::now() < free_by, "the send blocks stayed in use");
        std::thread::sleep(Duration::from_millis(10));
    }
}
