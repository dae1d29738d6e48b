//! Two endpoints in one process over loopback move verified data: 1 B to 256 MiB, 1/2/4/8
//! channels, both directions at once, vectored layouts that differ per side, many transfers
//! in flight.

mod common;

use common::*;
use tcpx_runtime::{Connection, Endpoint, Region, Segment};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// Sends `len` bytes a→b and checks them.
fn roundtrip(a: &Endpoint, b: &Endpoint, ab: &Connection, ba: &Connection, len: usize, seed: u64) {
    let src = source(a, len, seed);
    let dst = b.alloc_host(len.max(1)).unwrap();
    let rx = ba.recv(&dst, 0, len).unwrap();
    let tx = ab.send(&src, 0, len).unwrap();
    assert_eq!(tx.wait(DEADLINE).unwrap(), len as u64, "send of {len}");
    assert_eq!(rx.wait(DEADLINE).unwrap(), len as u64, "recv of {len}");
    assert_pattern(&dst, 0, len, seed, &format!("{len} bytes"));
}

#[test]
fn sizes_from_one_byte_to_sixteen_mib_on_1_2_4_8_channels() {
    loopback();
    let sizes = [
        1,
        7,
        4 * KIB,
        4 * KIB + 1,
        64 * KIB - 1,
        64 * KIB,
        64 * KIB + 3,
        MIB + 5,
        16 * MIB,
    ];
    for channels in [1u16, 2, 4, 8] {
        // Small chunks so every size spans several channels.
        // One engine per channel, explicitly: the automatic choice caps engines at half the
        // cores, and these transfers must cross several engines on any machine.
        let cfg = || {
            let mut c = config(channels, 64 * KIB as u32);
            c.engines_per_device = Some(usize::from(channels));
            c
        };
        let (a, b, ab, ba) = pair_with(cfg(), cfg());
        assert_eq!(a.engines().len(), usize::from(channels));
        for (i, &len) in sizes.iter().enumerate() {
            roundtrip(&a, &b, &ab, &ba, len, u64::from(channels) * 100 + i as u64);
        }
        // The receiving side saw every byte on the channels the schedule names.
        let received: u64 = ba.stats().iter().map(|s| s.bytes_received).sum();
        assert_eq!(received, sizes.iter().map(|&s| s as u64).sum::<u64>());
    }
}

#[test]
fn two_hundred_fifty_six_mib_on_8_channels() {
    loopback();
    let (a, b, ab, ba) = pair(8, 512 * KIB as u32);
    roundtrip(&a, &b, &ab, &ba, 256 * MIB, 256);
    let stats = ba.stats();
    assert!(
        stats.iter().all(|s| s.bytes_received == 32 * MIB as u64),
        "{stats:?}"
    );
}

#[test]
fn two_hundred_fifty_six_mib_on_1_channel() {
    loopback();
    let (a, b, ab, ba) = pair(1, 512 * KIB as u32);
    roundtrip(&a, &b, &ab, &ba, 256 * MIB, 257);
}

#[test]
fn both_directions_at_once() {
    loopback();
    let (a, b, ab, ba) = pair(4, 128 * KIB as u32);
    let len = 24 * MIB + 11;
    let a_src = source(&a, len, 1);
    let b_src = source(&b, len, 2);
    let a_dst = a.alloc_host(len).unwrap();
    let b_dst = b.alloc_host(len).unwrap();
    let t = [
        ab.send(&a_src, 0, len).unwrap(),
        ba.send(&b_src, 0, len).unwrap(),
        ab.recv(&a_dst, 0, len).unwrap(),
        ba.recv(&b_dst, 0, len).unwrap(),
    ];
    for t in &t {
        assert_eq!(t.wait(DEADLINE).unwrap(), len as u64);
    }
    assert_pattern(&b_dst, 0, len, 1, "a to b");
    assert_pattern(&a_dst, 0, len, 2, "b to a");
}

#[test]
fn many_transfers_in_flight_complete_in_submission_order() {
    loopback();
    let (a, b, ab, ba) = pair(2, 32 * KIB as u32);
    let n = 64;
    let len = 100 * KIB + 13;
    let src = source(&a, n * len, 0);
    // Re-fill each slot with its own seed so a transfer landing in the wrong slot shows.
    src.memory()
        .with_bytes_mut(|bytes| {
            for i in 0..n {
                fill(&mut bytes[i * len..(i + 1) * len], 1000 + i as u64);
            }
        })
        .unwrap();
    let dst = b.alloc_host(n * len).unwrap();
    let rx: Vec<_> = (0..n)
        .map(|i| ba.recv(&dst, i * len, len).unwrap())
        .collect();
    let tx: Vec<_> = (0..n)
        .map(|i| ab.send(&src, i * len, len).unwrap())
        .collect();
    for t in tx.iter().chain(&rx) {
        assert_eq!(t.wait(DEADLINE).unwrap(), len as u64);
    }
    for i in 0..n {
        assert_pattern(
            &dst,
            i * len,
            len,
            1000 + i as u64,
            &format!("transfer {i}"),
        );
    }
}

#[test]
fn vectored_transfers_with_different_layouts_per_side() {
    loopback();
    let (a, b, ab, ba) = pair(3, 64 * KIB as u32);
    // Sender: pieces of two regions; receiver: three pieces cut elsewhere.
    let total = 4 * MIB + 1234;
    let whole = source(&a, total, 77);
    // Copy the stream into two sender regions at odd offsets.
    let s1 = a.alloc_host(2 * MIB).unwrap();
    let s2 = a.alloc_host(4 * MIB).unwrap();
    let cut = 1_500_001;
    let stream: Vec<u8> = whole.memory().with_bytes(|b| b[..total].to_vec()).unwrap();
    s1.memory()
        .with_bytes_mut(|b| b[100..100 + cut].copy_from_slice(&stream[..cut]))
        .unwrap();
    s2.memory()
        .with_bytes_mut(|b| b[5..5 + total - cut].copy_from_slice(&stream[cut..]))
        .unwrap();
    let send_segments = [
        Segment::new(&s1, 100, cut),
        Segment::new(&s2, 5, total - cut),
    ];

    let r1 = b.alloc_host(2 * MIB).unwrap();
    let r2 = b.alloc_host(4 * MIB).unwrap();
    let lens = [3, MIB - 3, total - MIB];
    let recv_segments = [
        Segment::new(&r1, 0, lens[0]),
        Segment::new(&r1, 7, lens[1]),
        Segment::new(&r2, 0, lens[2]),
    ];
    // Receiver first on one transfer, sender first on the next: the segment lists cross.
    let rx1 = ba.recv_vectored(&recv_segments).unwrap();
    let tx1 = ab.send_vectored(&send_segments).unwrap();
    assert_eq!(tx1.wait(DEADLINE).unwrap(), total as u64);
    assert_eq!(rx1.wait(DEADLINE).unwrap(), total as u64);
    let check_stream = |what: &str| {
        let mut got = Vec::with_capacity(total);
        r1.memory()
            .with_bytes(|b| got.extend_from_slice(&b[..3]))
            .unwrap();
        r1.memory()
            .with_bytes(|b| got.extend_from_slice(&b[7..7 + lens[1]]))
            .unwrap();
        r2.memory()
            .with_bytes(|b| got.extend_from_slice(&b[..lens[2]]))
            .unwrap();
        assert!(got == stream, "{what}: vectored stream differs");
    };
    check_stream("receiver posted first");
    r1.memory().with_bytes_mut(|b| b.fill(0)).unwrap();
    r2.memory().with_bytes_mut(|b| b.fill(0)).unwrap();

    // Sender first, then a contiguous transfer queued behind the vectored one on both sides.
    let small = source(&a, 1000, 5);
    let small_dst = b.alloc_host(1000).unwrap();
    let tx2 = ab.send_vectored(&send_segments).unwrap();
    let tx3 = ab.send(&small, 0, 1000).unwrap();
    // The control stream is ordered and the receiver handles it in order: once this
    // notification is delivered, the sender's segment list is held on the receiver, which
    // has not posted yet (sender first, by construction rather than by a sleep).
    ab.notify(b"segments sent").unwrap();
    assert!(
        eventually(DEADLINE, || !b.notifications().is_empty()),
        "the notification after the segment list never arrived"
    );
    let rx2 = ba.recv_vectored(&recv_segments).unwrap();
    let rx3 = ba.recv(&small_dst, 0, 1000).unwrap();
    for t in [&tx2, &tx3, &rx2, &rx3] {
        t.wait(DEADLINE).unwrap();
    }
    check_stream("sender posted first");
    assert_pattern(&small_dst, 0, 1000, 5, "contiguous after vectored");
}

#[test]
fn zero_length_transfers_complete_and_keep_the_pairing() {
    loopback();
    let (a, b, ab, ba) = pair(2, 64 * KIB as u32);
    let src = source(&a, 5000, 9);
    let dst = b.alloc_host(5000).unwrap();
    let empty_tx = ab.send(&src, 0, 0).unwrap();
    let empty_rx = ba.recv(&dst, 0, 0).unwrap();
    assert_eq!(empty_tx.wait(DEADLINE).unwrap(), 0);
    assert_eq!(empty_rx.wait(DEADLINE).unwrap(), 0);
    let rx = ba.recv(&dst, 0, 5000).unwrap();
    let tx = ab.send(&src, 0, 5000).unwrap();
    tx.wait(DEADLINE).unwrap();
    rx.wait(DEADLINE).unwrap();
    assert_pattern(&dst, 0, 5000, 9, "after empty transfers");
}

#[test]
fn registrations_are_made_once_per_comm_and_released_with_the_region() {
    loopback();
    let (a, b, ab, ba) = pair(4, 64 * KIB as u32);
    let src = source(&a, MIB, 3);
    let dst: Region = b.alloc_host(MIB).unwrap();
    assert_eq!(a.live_registrations(), 0);
    for round in 0..3 {
        let rx = ba.recv(&dst, 0, MIB).unwrap();
        let tx = ab.send(&src, 0, MIB).unwrap();
        tx.wait(DEADLINE).unwrap();
        rx.wait(DEADLINE).unwrap();
        // One registration per channel's send comm on a, per recv comm on b, reused.
        assert_eq!(a.live_registrations(), 4, "round {round}");
        assert_eq!(b.live_registrations(), 4, "round {round}");
    }
    ab.register(&src).unwrap();
    assert_eq!(a.live_registrations(), 8);
    drop(src);
    assert_eq!(a.live_registrations(), 0);
    drop(ba);
    assert_eq!(
        b.live_registrations(),
        0,
        "closing the connection releases its registrations"
    );
    drop(dst);
}

#[test]
fn bad_ranges_are_refused_before_anything_is_posted() {
    loopback();
    let (a, _b, ab, _ba) = pair(1, 64 * KIB as u32);
    let src = a.alloc_host(4096).unwrap();
    assert!(ab.send(&src, 4000, 100).is_err());
    assert!(ab.send(&src, usize::MAX, 2).is_err());
    assert!(ab.send_vectored(&[]).is_err());
    assert_eq!(ab.in_flight(), 0);
}

/// The largest divisor of `channels` that is at most `limit` (at least 1).
fn divisor_within(channels: usize, limit: usize) -> usize {
    (1..=channels)
        .rev()
        .find(|&n| channels % n == 0 && n <= limit.max(1))
        .unwrap_or(1)
}

/// The automatic engine count of the built-in plugin: one per channel (it copies on the
/// engine's thread), at most the cores, a divisor of the channels; a loopback connection (a
/// peer on the same cores) is driven by half the cores' worth of them — and its transfers
/// still cross every channel.
#[test]
fn automatic_engines_follow_channels_and_a_local_peer_gets_half_the_cores() {
    loopback();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    for channels in [1u16, 4, 6, 8] {
        let cfg = || config(channels, 64 * KIB as u32);
        let (a, b, ab, ba) = pair_with(cfg(), cfg());
        let started = divisor_within(usize::from(channels), cores);
        assert_eq!(
            a.engines().len(),
            started,
            "{channels} channels, {cores} cores"
        );
        // Both endpoints live in this process: they share its cores, confined or not.
        let driving = divisor_within(started, cores / 2);
        for conn in [&ab, &ba] {
            assert_eq!(
                conn.engine_count(),
                driving,
                "{channels} channels, {cores} cores"
            );
        }
        roundtrip(&a, &b, &ab, &ba, 3 * MIB + 5, u64::from(channels));
        let received: u64 = ba.stats().iter().map(|s| s.bytes_received).sum();
        assert_eq!(received, 3 * MIB as u64 + 5);
        assert!(
            ba.stats().iter().all(|s| s.bytes_received > 0),
            "every channel carried its share with {driving} engines"
        );
    }
}

#[test]
fn several_engines_per_device_share_the_channels() {
    loopback();
    let cfg = || {
        tcpx_runtime::Config::builder()
            .backend(tcpx_runtime::Backend::Builtin)
            .control_addr("127.0.0.1:0".parse().unwrap())
            .channels(6)
            .chunk_bytes(64 * KIB as u32)
            .engines_per_device(4)
            .build()
            .unwrap()
    };
    let (a, b, ab, ba) = pair_with(cfg(), cfg());
    assert_eq!(a.engines().len(), 4);
    // Contiguous transfers of every size class, then a vectored one (sent to every engine).
    for (i, len) in [1, 64 * KIB, 3 * 64 * KIB + 1, 8 * MIB + 77]
        .into_iter()
        .enumerate()
    {
        roundtrip(&a, &b, &ab, &ba, len, 600 + i as u64);
    }
    let src = source(&a, 2 * MIB, 9);
    let dst = b.alloc_host(2 * MIB).unwrap();
    let rx = ba
        .recv_vectored(&[Segment::new(&dst, 0, MIB), Segment::new(&dst, MIB, MIB)])
        .unwrap();
    ab.send_vectored(&[Segment::new(&src, 0, 2 * MIB)])
        .unwrap()
        .wait(DEADLINE)
        .unwrap();
    rx.wait(DEADLINE).unwrap();
    assert_pattern(&dst, 0, 2 * MIB, 9, "vectored over 4 engines");
    // One registration per channel, made by the engine owning each channel.
    assert_eq!(b.live_registrations(), 6);
}

#[test]
fn two_sided_transfers_spread_over_the_agreed_width_in_pieces_of_its_floor() {
    loopback();
    // 8 channels of 512 KiB chunks: the connection agrees a spread width of the smaller
    // engine count. A two-sided transfer is cut over that width in pieces of at least 256 KiB
    // (`TWO_SIDED_SPREAD_FLOOR_BYTES`, coarser than a lone one-sided operation's 128 KiB: its
    // receiver posts without knowing whether the sender's message is alone, so streams are
    // cut the same way).
    let cfg = |engines: usize| {
        let mut c = config(8, 512 * KIB as u32);
        c.engines_per_device = Some(engines);
        c
    };
    let k = |n: usize| (n * KIB) as u64;
    for (engines_a, engines_b, one_mib, two_mib) in [
        (8, 8, vec![k(256); 4], vec![k(256); 8]),
        (8, 4, vec![k(256); 4], vec![k(512); 4]),
        (1, 8, vec![k(512); 2], vec![k(512); 4]),
    ] {
        let (a, b, ab, ba) = pair_with(cfg(engines_a), cfg(engines_b));
        assert_eq!(ba.peer_info().spread, engines_a as u16);
        assert_eq!(ab.peer_info().spread, engines_b as u16);
        for (len, expected) in [(MIB, one_mib), (2 * MIB, two_mib)] {
            let (_, before) = received_since(&ba.stats(), &[0; 8]);
            roundtrip(&a, &b, &ab, &ba, len, 900 + engines_b as u64);
            let (got, _) = received_since(&ba.stats(), &before);
            assert_eq!(
                got, expected,
                "{len} bytes, engines {engines_a} and {engines_b}"
            );
        }
    }
}

/// Each engine thread has a name of its own, `tcpx-eng-<device>.<index>`, so that profiles
/// and `top -H` tell the engines of one NIC apart.
#[test]
fn every_engine_thread_is_named_after_its_device_and_index() {
    loopback();
    let ep = Endpoint::new(config(4, 64 * KIB as u32)).unwrap();
    let wanted: Vec<String> = ep
        .engines()
        .into_iter()
        .enumerate()
        .map(|(index, (device, _core))| format!("tcpx-eng-{device}.{index}"))
        .collect();
    assert!(!wanted.is_empty());
    for name in &wanted {
        assert!(name.len() <= 15, "{name}: past Linux's 15 bytes");
    }
    // A new thread names itself as it starts: wait for all of them to have started.
    let named = eventually(DEADLINE, || {
        let names = thread_names();
        wanted.iter().all(|w| names.contains(w))
    });
    assert!(named, "{wanted:?} not all among {:?}", thread_names());
}
