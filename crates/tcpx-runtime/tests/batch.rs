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
