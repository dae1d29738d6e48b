//! Peers configured with different channel counts or chunk sizes connect on the smaller of
//! each: both sides open as many comms and cut every schedule alike, so two-sided messages
//! (chunked, vectored, batched, staged and eager), one-sided writes and reads all land whole,
//! in both directions.

mod common;

use common::*;
use tcpx_runtime::{Connection, Endpoint, Region, Segment};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

#[test]
fn peers_with_different_channel_counts_use_the_smaller() {
    loopback();
    for (mine, theirs) in [(2u16, 4u16), (4, 1), (3, 8)] {
        let (a, b, ab, ba) = pair_with(
            config(mine, 256 * KIB as u32),
            config(theirs, 256 * KIB as u32),
        );
        let agreed = mine.min(theirs);
        for (side, conn) in [("acceptor", &ab), ("connector", &ba)] {
            assert_eq!(conn.channels(), agreed, "{side} of {mine} / {theirs}");
            assert_eq!(
                conn.stats().len(),
                usize::from(agreed),
                "{side}: counters per channel"
            );
        }
        let what = format!("{mine} against {theirs} channels");

        // Two-sided, both ways: messages of many chunks over every channel, and small ones
        // (eager frames) in between.
        let len = 4 * MIB + 12_345;
        let (src, dst) = (source(&a, len, 11), b.alloc_host(len).unwrap());
        send_verified(&ab, &ba, &src, &dst, len, 11);
        let (src, dst) = (source(&b, len, 12), a.alloc_host(len).unwrap());
        send_verified(&ba, &ab, &src, &dst, len, 12);
        let sizes: Vec<usize> = (0..64)
            .map(|i| [1, 4 * KIB, 60 * KIB, 300 * KIB][i % 4])
            .collect();
        let stride = 300 * KIB;
        let (src, dst) = (
            source(&a, 64 * stride, 13),
            a.alloc_host(64 * stride).unwrap(),
        );
        let far = b.alloc_host(64 * stride).unwrap();
        exchange_verified((&ab, &ba), (&src, &far), &sizes, stride, &what);
        exchange_verified((&ba, &ab), (&far, &dst), &sizes, stride, &what);

        // One-sided: a write into the peer's region, then read back into a fresh one.
        let target = b.alloc_host(4 * MIB).unwrap();
        let d = b.advertise(&target).unwrap();
        write_and_read_back((&a, &ab), (&target, d), 3 * MIB + 4 * KIB, 14, &what);
        drop((ab, ba, a, b));
    }
}

/// A staged region (the GPU path's rings and copies, emulated in host memory) holding
/// `fill(seed)` when `seed` is given.
fn staged(ep: &Endpoint, len: usize, seed: Option<u64>) -> Region {
    let memory = tcpx::SharedMemory::host(len).expect("host memory");
    let region = ep
        .register_staged_emulation(memory)
        .expect("register_staged_emulation");
    if let Some(seed) = seed {
        write_pattern(&region, len, seed);
    }
    region
}

/// Sends `lens` as one vectored transfer from `src` (packed from offset 0) into `dst`, whose
/// segments sit `gap` bytes apart, and checks every byte landed where the list says.
fn vectored_verified(
    (from, src): (&Connection, &Region),
    (to, dst): (&Connection, &Region),
    lens: &[usize],
    gap: usize,
    seed: u64,
    what: &str,
) {
    let total: usize = lens.iter().sum();
    write_pattern(src, total, seed);
    let mut at = 0;
    let send: Vec<Segment<'_>> = lens
        .iter()
        .map(|&len| {
            let s = Segment::new(src, at, len);
            at += len;
            s
        })
        .collect();
    let mut at = 0;
    let recv: Vec<Segment<'_>> = lens
        .iter()
        .map(|&len| {
            let s = Segment::new(dst, at, len);
            at += len + gap;
            s
        })
        .collect();
    let rx = to.recv_vectored(&recv).expect("post vectored recv");
    let tx = from.send_vectored(&send).expect("post vectored send");
    assert_eq!(tx.wait(DEADLINE).expect("send"), total as u64, "{what}");
    assert_eq!(rx.wait(DEADLINE).expect("recv"), total as u64, "{what}");
    let sent = snapshot(src);
    let got = snapshot(dst);
    let (mut s, mut d) = (0, 0);
    for &len in lens {
        assert!(
            sent[s..s + len] == got[d..d + len],
            "{what}: a segment of {len} bytes differs"
        );
        s += len;
        d += len + gap;
    }
}

#[test]
fn peers_with_different_chunk_sizes_use_the_smaller() {
    loopback();
    // Chunk sizes both ways round, with channel counts differing too in one case.
    for (mine, theirs, channels) in [
        (256 * KIB, 64 * KIB, (4u16, 4u16)),
        (64 * KIB, 1024 * KIB, (4, 4)),
        (512 * KIB, 192 * KIB + 7, (2, 3)),
    ] {
        let (a, b, ab, ba) = pair_with(
            config(channels.0, mine as u32),
            config(channels.1, theirs as u32),
        );
        let what = format!("{mine} against {theirs} byte chunks");
        for (side, conn) in [("acceptor", &ab), ("connector", &ba)] {
            assert_eq!(
                conn.chunk_bytes() as usize,
                mine.min(theirs),
                "{side}: {what}"
            );
            assert_eq!(
                conn.channels(),
                channels.0.min(channels.1),
                "{side}: {what}"
            );
        }

        // Two-sided, both ways: contiguous messages of many (agreed) chunks, so that a side
        // cutting by its own size would post receives the peer never sends.
        let len = 3 * MIB + 4321;
        let (src, dst) = (source(&a, len, 21), b.alloc_host(len).unwrap());
        send_verified(&ab, &ba, &src, &dst, len, 21);
        let (src, dst) = (source(&b, len, 22), a.alloc_host(len).unwrap());
        send_verified(&ba, &ab, &src, &dst, len, 22);

        // Vectored: segment lists paired on the control connection, cut on both sides.
        let lens = [5 * KIB, 700 * KIB + 3, 1, 2 * MIB, 64 * KIB];
        let total: usize = lens.iter().sum();
        let src = a.alloc_host(total).unwrap();
        let dst = b.alloc_host(total + lens.len() * 4096).unwrap();
        vectored_verified((&ab, &src), (&ba, &dst), &lens, 4096, 23, &what);

        // Single messages of every size (eager frames among them), then a batch: a packed
        // list gathered and scattered chunk by chunk.
        let sizes: Vec<usize> = (0..48).map(|i| [4 * KIB, 100 * KIB, 333][i % 3]).collect();
        let stride = 100 * KIB;
        let (src, far) = (
            source(&a, 48 * stride, 24),
            b.alloc_host(48 * stride).unwrap(),
        );
        exchange_verified((&ab, &ba), (&src, &far), &sizes, stride, &what);
        let far = b.alloc_host(48 * stride).unwrap();
        fn list<'r>(r: &'r Region, sizes: &[usize], stride: usize) -> Vec<Segment<'r>> {
            (0..sizes.len())
                .map(|i| Segment::new(r, i * stride, sizes[i]))
                .collect()
        }
        let (send, recv) = (list(&src, &sizes, stride), list(&far, &sizes, stride));
        let rx = ba.recv_batch(&recv).expect("post batch recv");
        let tx = ab.send_batch(&send).expect("post batch send");
        let total: usize = sizes.iter().sum();
        assert_eq!(tx.wait(DEADLINE).expect("batch send"), total as u64);
        assert_eq!(rx.wait(DEADLINE).expect("batch recv"), total as u64);
        let (sent, got) = (snapshot(&src), snapshot(&far));
        for (i, &len) in sizes.iter().enumerate() {
            let at = i * stride;
            assert!(
                got[at..at + len] == sent[at..at + len],
                "{what}: batch message {i}"
            );
        }

        // Staged memory: each lane's ring slots are cut to the agreed chunk.
        let len = 2 * MIB + 99;
        let (src, dst) = (staged(&b, len, Some(25)), staged(&a, len, None));
        send_verified(&ba, &ab, &src, &dst, len, 25);

        // One-sided, both ways.
        let target = b.alloc_host(4 * MIB).unwrap();
        let d = b.advertise(&target).unwrap();
        write_and_read_back((&a, &ab), (&target, d), 3 * MIB + 17, 26, &what);
        let target = a.alloc_host(4 * MIB).unwrap();
        let d = a.advertise(&target).unwrap();
        write_and_read_back((&b, &ba), (&target, d), 2 * MIB + 5, 27, &what);
        drop((ab, ba, a, b));
    }
}

/// A two-sided transfer smaller than the agreed width's worth of chunks is cut into pieces of
/// at least 256 KiB over the channels when both sides spread two-sided transfers (the
/// default), and keeps whole chunks when either side does not: both sides cut every transfer
/// alike, so the bytes land whole either way — a lone message, a length that is not a
/// multiple of 4 KiB, and a stream of mixed sizes with receives posted before and after their
/// sends.
#[test]
fn two_sided_transfers_spread_only_when_both_sides_say_so() {
    loopback();
    for (mine, theirs) in [(true, true), (true, false), (false, true)] {
        let with = |spread: bool| {
            let mut c = spread_config();
            c.spread_two_sided = spread;
            c
        };
        let (a, b, ab, ba) = pair_with(with(mine), with(theirs));
        let what = format!("spreading {mine} / {theirs}");
        assert_eq!(ba.peer_info().spread_two_sided, mine, "{what}: announced");
        let both = mine && theirs;
        let mut totals = vec![0u64; usize::from(ba.channels())];

        // A lone 1 MiB message: four 256 KiB pieces, or two whole 512 KiB chunks.
        let (src, dst) = (source(&a, MIB, 21), b.alloc_host(MIB).unwrap());
        send_verified(&ab, &ba, &src, &dst, MIB, 21);
        let (pieces, now) = received_since(&ba.stats(), &totals);
        totals = now;
        let expected = if both {
            vec![256 * KIB as u64; 4]
        } else {
            vec![512 * KIB as u64; 2]
        };
        assert_eq!(pieces, expected, "{what}: a lone 1 MiB message");

        // 2 MiB and a bit: every channel in 260 KiB pieces, or five chunks.
        let len = 2 * MIB + 5_000;
        let (src, dst) = (source(&b, len, 22), a.alloc_host(len).unwrap());
        let (_, before) = received_since(&ab.stats(), &vec![0; totals.len()]);
        send_verified(&ba, &ab, &src, &dst, len, 22);
        let (pieces, _) = received_since(&ab.stats(), &before);
        assert_eq!(
            pieces.len(),
            if both { 8 } else { 5 },
            "{what}: channels of a {len}-byte message: {pieces:?}"
        );
        assert_eq!(pieces.iter().sum::<u64>(), len as u64, "{what}");

        // A vectored 1 MiB: three segments sent (300, 500, 224 KiB), two received (512 KiB
        // each). The cut (256 KiB, or whole 512 KiB chunks) runs from the start of each piece
        // between both sides' boundaries (300, 212, 288, 224 KiB): six chunks, or four.
        let (src, dst) = (source(&a, MIB, 24), b.alloc_host(MIB).unwrap());
        let (_, before) = received_since(&ba.stats(), &totals);
        let rx = ba
            .recv_vectored(&[
                Segment::new(&dst, 0, 512 * KIB),
                Segment::new(&dst, 512 * KIB, 512 * KIB),
            ])
            .unwrap();
        let tx = ab
            .send_vectored(&[
                Segment::new(&src, 0, 300 * KIB),
                Segment::new(&src, 300 * KIB, 500 * KIB),
                Segment::new(&src, 800 * KIB, 224 * KIB),
            ])
            .unwrap();
        assert_eq!(
            tx.wait(DEADLINE).unwrap(),
            MIB as u64,
            "{what}: vectored send"
        );
        assert_eq!(
            rx.wait(DEADLINE).unwrap(),
            MIB as u64,
            "{what}: vectored recv"
        );
        assert_pattern(&dst, 0, MIB, 24, &format!("{what}: vectored"));
        let (pieces, now) = received_since(&ba.stats(), &before);
        totals = now;
        assert_eq!(
            pieces.len(),
            if both { 6 } else { 4 },
            "{what}: channels of a vectored 1 MiB: {pieces:?}"
        );

        // A stream of mixed sizes in flight together, both ways.
        let sizes: Vec<usize> = (0..16)
            .map(|i| [MIB, 700 * KIB, 2 * MIB + 5_000, 300 * KIB][i % 4])
            .collect();
        let stride = 2 * MIB + 8 * KIB;
        let (src, far) = (
            source(&a, 16 * stride, 23),
            b.alloc_host(16 * stride).unwrap(),
        );
        let back = a.alloc_host(16 * stride).unwrap();
        exchange_verified((&ab, &ba), (&src, &far), &sizes, stride, &what);
        exchange_verified((&ba, &ab), (&far, &back), &sizes, stride, &what);
        drop((ab, ba, a, b));
    }
}
