//! The staged path's engine logic without a GPU: regions registered with
//! `Endpoint::register_staged_emulation` take the staged route (ring per lane, copies ahead on
//! the send side, consume-after-copy on the receive side, FIFO slot reuse) with CPU copies
//! standing in for the GPU's, each reported done one poll late. Same loopback pairs as the
//! other end-to-end tests; the GPU version is `gpu_staged.rs`.

mod common;

use common::*;
use tcpx_runtime::{Endpoint, Region, Segment};

fn staged(ep: &Endpoint, len: usize, seed: Option<u64>) -> Region {
    let memory = tcpx::SharedMemory::host(len.max(1)).expect("host memory");
    let r = ep
        .register_staged_emulation(memory)
        .expect("register_staged_emulation");
    assert!(r.is_staged());
    if let Some(seed) = seed {
        write_pattern(&r, len, seed);
    }
    r
}

fn host(ep: &Endpoint, len: usize, seed: Option<u64>) -> Region {
    let r = ep.alloc_host(len.max(1)).expect("alloc_host");
    if let Some(seed) = seed {
        write_pattern(&r, len, seed);
    }
    r
}

#[test]
fn staged_to_staged_sizes_on_1_4_8_channels() {
    loopback();
    for channels in [1u16, 4, 8] {
        let (a, b, ab, ba) = pair(channels, 256 << 10);
        for (i, &len) in [1usize, 4097, (1 << 20) + 3, 24 << 20].iter().enumerate() {
            let seed = u64::from(channels) * 10 + i as u64;
            let src = staged(&a, len, Some(seed));
            let dst = staged(&b, len, None);
            send_verified(&ab, &ba, &src, &dst, len, seed);
        }
        assert!(ab.error().is_none() && ba.error().is_none());
    }
}

/// Pre-registering a staged region is accepted (and registers nothing: only the rings meet
/// the plugin), and one-sided use of it is refused with a clear error, not a plugin failure.
#[test]
fn staged_regions_preregister_as_a_no_op_and_advertise_for_one_sided_use() {
    loopback();
    let (a, b, ab, ba) = pair(2, 128 << 10);
    let len = (2 << 20) + 11;
    let src = staged(&a, len, Some(77));
    let dst = staged(&b, len, None);
    let before = (a.live_registrations(), b.live_registrations());
    ab.register(&src).expect("register a staged source");
    ba.register(&dst).expect("register a staged destination");
    assert_eq!((a.live_registrations(), b.live_registrations()), before);
    send_verified(&ab, &ba, &src, &dst, len, 77);
    // One-sided access moves staged regions through the rings too (tests/onesided_staged.rs):
    // advertising succeeds, as CUDA memory (what the region stands in for: peers never pack
    // a batch naming it), and still registers nothing with the plugin.
    let descriptor = b.advertise(&dst).expect("advertising a staged region");
    assert_eq!(descriptor.kind(), tcpx::MemoryKind::Cuda);
    assert_eq!(descriptor.len(), len as u64);
    assert_eq!((a.live_registrations(), b.live_registrations()), before);
}

#[test]
fn host_to_staged_and_staged_to_host() {
    loopback();
    let (a, b, ab, ba) = pair(4, 128 << 10);
    for (i, &len) in [1usize, 4097, (3 << 20) + 5].iter().enumerate() {
        let seed = 100 + i as u64;
        let (src, dst) = (host(&a, len, Some(seed)), staged(&b, len, None));
        send_verified(&ab, &ba, &src, &dst, len, seed);
        let (src, dst) = (staged(&a, len, Some(seed + 7)), host(&b, len, None));
        send_verified(&ab, &ba, &src, &dst, len, seed + 7);
    }
}

/// Staged and direct transfers interleaved on the same lanes, many in flight, both ways:
/// rings and windows share the lanes in posting order.
#[test]
fn staged_and_direct_transfers_interleave_in_order() {
    loopback();
    let (a, b, ab, ba) = pair(4, 64 << 10);
    let len = (1 << 20) + 333;
    let mut posted = Vec::new();
    for k in 0..16u64 {
        let seed = 1000 + k;
        let stage_src = k % 2 == 0;
        let stage_dst = k % 3 == 0;
        let src = if stage_src {
            staged(&a, len, Some(seed))
        } else {
            host(&a, len, Some(seed))
        };
        let dst = if stage_dst {
            staged(&b, len, None)
        } else {
            host(&b, len, None)
        };
        let back_src = staged(&b, len, Some(seed + 50));
        let back_dst = if k % 2 == 1 {
            staged(&a, len, None)
        } else {
            host(&a, len, None)
        };
        let r1 = ba.recv(&dst, 0, len).expect("recv");
        let r2 = ab.recv(&back_dst, 0, len).expect("recv back");
        let s1 = ab.send(&src, 0, len).expect("send");
        let s2 = ba.send(&back_src, 0, len).expect("send back");
        posted.push((seed, [r1, r2, s1, s2], dst, back_dst, src, back_src));
    }
    for (seed, transfers, dst, back_dst, _src, _back_src) in posted {
        for t in transfers {
            assert_eq!(t.wait(DEADLINE).expect("transfer"), len as u64);
        }
        verify_region(&dst, len, seed, "a → b");
        verify_region(&back_dst, len, seed + 50, "b → a");
    }
    assert!(ab.error().is_none() && ba.error().is_none());
}

#[test]
fn vectored_staged_transfers_cut_differently_per_side() {
    loopback();
    let (a, b, ab, ba) = pair(4, 64 << 10);
    let len = (2 << 20) + 7;
    let src = staged(&a, len, Some(77));
    let dst = staged(&b, len, None);
    let cuts = |r: &Region, at: &[usize]| -> Vec<(usize, usize)> {
        let _ = r;
        let mut out = Vec::new();
        let mut prev = 0;
        for &x in at.iter().chain(std::iter::once(&len)) {
            out.push((prev, x - prev));
            prev = x;
        }
        out
    };
    let a_cuts = cuts(&src, &[len / 3]);
    let b_cuts = cuts(&dst, &[1000, len / 2]);
    let a_segs: Vec<_> = a_cuts
        .iter()
        .map(|&(o, n)| Segment::new(&src, o, n))
        .collect();
    let b_segs: Vec<_> = b_cuts
        .iter()
        .map(|&(o, n)| Segment::new(&dst, o, n))
        .collect();
    let rx = ba.recv_vectored(&b_segs).expect("recv");
    let tx = ab.send_vectored(&a_segs).expect("send");
    assert_eq!(tx.wait(DEADLINE).unwrap(), len as u64);
    assert_eq!(rx.wait(DEADLINE).unwrap(), len as u64);
    verify_region(&dst, len, 77, "vectored");
}

#[test]
fn a_transfer_cannot_mix_staged_and_host_segments() {
    loopback();
    let (a, _b, ab, _ba) = pair(2, 64 << 10);
    let s = staged(&a, 8192, None);
    let h = host(&a, 8192, None);
    let err = ab
        .send_vectored(&[Segment::new(&s, 0, 4096), Segment::new(&h, 0, 4096)])
        .unwrap_err();
    assert!(err.to_string().contains("mix"), "{err}");
    assert!(ab.error().is_none());
}

/// Staging rings held by `conn`'s lanes, both halves (two-sided and one-sided channels).
fn rings(conn: &tcpx_runtime::Connection) -> u64 {
    conn.stats()
        .iter()
        .chain(conn.one_sided_stats().iter())
        .map(|s| s.staging_rings)
        .sum()
}

/// Registering a staged region on a connection makes every lane's ring then (issue 25: no
/// first-transfer tax), once: transfers afterwards make none, and closing the connection
/// hands them back.
#[test]
fn registering_a_staged_region_makes_every_lanes_ring_ahead_of_use() {
    loopback();
    const CHANNELS: u16 = 3;
    let (a, b, ab, ba) = pair(CHANNELS, 64 << 10);
    assert_eq!((rings(&ab), rings(&ba)), (0, 0), "no staged memory yet");
    let src = staged(&a, 1 << 20, Some(31));
    let dst = staged(&b, 1 << 20, None);
    ab.register(&src).expect("register on a");
    // A send and a receive ring per channel, for both halves.
    let all = 2 * 2 * u64::from(CHANNELS);
    assert_eq!(rings(&ab), all);
    ab.register(&src).expect("again");
    assert_eq!(rings(&ab), all, "made once");
    ba.register(&dst).expect("register on b");
    assert_eq!(rings(&ba), all);
    for len in [4096usize, 1 << 20] {
        send_verified(&ab, &ba, &src, &dst, len, 31);
    }
    assert_eq!(
        (rings(&ab), rings(&ba)),
        (all, all),
        "transfers made no more"
    );
    assert!(ab.error().is_none() && ba.error().is_none());
}

/// Two-sided transfers spread over the channels (8 channels of 512 KiB chunks, 8 engines a
/// side: 256 KiB pieces) go through the staged rings piece by piece: staged to staged, host
/// to staged and back, vectored with different cuts per side, and a stream of them in flight
/// at once, every byte checked, with the pieces where the rule puts them.
#[test]
fn spread_two_sided_transfers_take_the_staged_route_piece_by_piece() {
    loopback();
    let (a, b, ab, ba) = pair_with(spread_config(), spread_config());
    assert!(ab.peer_info().spread_two_sided && ba.peer_info().spread_two_sided);
    const MIB: usize = 1 << 20;
    let mut before = vec![0u64; 8];
    for (i, (len, pieces)) in [(MIB, 4usize), (2 * MIB + 3, 8), (MIB / 2, 2)]
        .into_iter()
        .enumerate()
    {
        let seed = 300 + i as u64;
        let (src, dst) = (staged(&a, len, Some(seed)), staged(&b, len, None));
        send_verified(&ab, &ba, &src, &dst, len, seed);
        let (got, now) = received_since(&ba.stats(), &before);
        before = now;
        assert_eq!(got.len(), pieces, "{len} bytes staged → staged: {got:?}");
        let (src, dst) = (host(&a, len, Some(seed + 7)), staged(&b, len, None));
        send_verified(&ab, &ba, &src, &dst, len, seed + 7);
        let (src, dst) = (staged(&a, len, Some(seed + 9)), host(&b, len, None));
        send_verified(&ab, &ba, &src, &dst, len, seed + 9);
        let (_, now) = received_since(&ba.stats(), &before);
        before = now;
    }

    // Vectored: two segments sent, three received, 1 MiB + 5 in all.
    let len = MIB + 5;
    let src = staged(&a, len, Some(311));
    let dst = staged(&b, len, None);
    let (x, y, z) = (len / 3, 1000, len / 2);
    let rx = ba
        .recv_vectored(&[
            Segment::new(&dst, 0, y),
            Segment::new(&dst, y, z - y),
            Segment::new(&dst, z, len - z),
        ])
        .expect("recv");
    let tx = ab
        .send_vectored(&[Segment::new(&src, 0, x), Segment::new(&src, x, len - x)])
        .expect("send");
    assert_eq!(tx.wait(DEADLINE).unwrap(), len as u64);
    assert_eq!(rx.wait(DEADLINE).unwrap(), len as u64);
    verify_region(&dst, len, 311, "vectored, spread");

    // A stream: sixteen 1–2 MiB staged messages in flight together.
    let stride = 2 * MIB + 4096;
    let src = staged(&a, 16 * stride, Some(312));
    let dst = staged(&b, 16 * stride, None);
    let sizes: Vec<usize> = (0..16).map(|i| [MIB, 2 * MIB, MIB + 4096][i % 3]).collect();
    exchange_verified(
        (&ab, &ba),
        (&src, &dst),
        &sizes,
        stride,
        "staged stream, spread",
    );
    assert!(ab.error().is_none() && ba.error().is_none());
}
