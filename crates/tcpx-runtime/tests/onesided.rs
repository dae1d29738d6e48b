//! One-sided WRITE / READ with notifications, end to end over loopback: random descriptor
//! lists with their contents checked, notifications never ahead of their data, every kind of
//! refusal leaving target memory untouched (and the connection usable), detached transfers,
//! mixing with two-sided traffic, and a peer lost mid-operation.

mod common;

use std::time::{Duration, Instant};

use common::*;
use tcpx_runtime::{Connection, Descriptor, Endpoint, Error, Region, RemoteSegment, Segment};

const MIB: usize = 1 << 20;

/// `d` with its access key changed (byte 18 of its encoding): a forged descriptor.
fn with_wrong_key(d: Descriptor) -> Descriptor {
    let mut bytes = d.to_bytes();
    bytes[18] ^= 1;
    Descriptor::from_bytes(&bytes).unwrap()
}

/// `d` claiming `len` bytes (bytes 9..17 of its encoding), more than its region holds: the
/// out-of-bounds refusals need a descriptor the target did not issue.
fn with_len(d: Descriptor, len: u64) -> Descriptor {
    let mut bytes = d.to_bytes();
    bytes[9..17].copy_from_slice(&len.to_le_bytes());
    Descriptor::from_bytes(&bytes).unwrap()
}

#[test]
fn random_descriptor_lists_are_written_and_read_back_exactly() {
    loopback();
    let (a, b, ab, _ba) = pair(3, 64 << 10);
    let mut rng = Rng(7);
    // Two target regions, advertised; the initiator cuts its side differently.
    let t0 = b.alloc_host(1 << 20).unwrap();
    let t1 = b.alloc_host(1 << 20).unwrap();
    let targets = [
        (&t0, b.advertise(&t0).unwrap()),
        (&t1, b.advertise(&t1).unwrap()),
    ];
    for round in 0..12u64 {
        let total = 1 + rng.below(600 << 10) as usize;
        let seed = 1000 + round;
        let src = source(&a, total, seed);
        let what = format!("round {round}");
        let back = random_lists_round(
            &mut rng,
            &ab,
            targets,
            &src,
            [96 << 10, 48 << 10, 80 << 10],
            || a.alloc_host(total).unwrap(),
            &what,
        );
        assert_pattern(&back, 0, total, seed, &format!("{what}: read back"));
    }
    assert_eq!(b.access_refusals(), 0);
}

#[test]
fn many_small_blocks_go_as_one_batch_and_land_in_place() {
    loopback();
    let (a, b, ab, _ba) = pair(2, 512 << 10);
    const BLOCK: usize = 16 << 10;
    const N: usize = 512;
    let src = source(&a, BLOCK * N, 5);
    let (dst, d) = advertised_host(&b, 2 * BLOCK * N);
    // Contiguous locally; remotely every block goes to slot (i * 2 + i % 2) - half of them
    // adjacent pairs, so some coalesce and some do not.
    let local: Vec<_> = (0..N).map(|i| (i * BLOCK, BLOCK)).collect();
    let remote: Vec<_> = (0..N)
        .map(|i| (((i / 2) * 4 + i % 2) * BLOCK, BLOCK))
        .collect();
    let tx = ab
        .write(
            &local_segments(&src, &local),
            &remote_segments(d, &remote),
            Some(b"batch"),
        )
        .unwrap();
    assert_eq!(tx.wait(DEADLINE).unwrap(), (BLOCK * N) as u64);
    assert_eq!(wait_notifications(&b, 1), [b"batch".to_vec()]);
    assert_blocks(&dst, &remote, &snapshot(&src), "one batch");
}

#[test]
fn a_notification_is_never_delivered_before_its_data() {
    loopback();
    // Small chunks: each write is many requests on every channel.
    let (a, b, ab, _ba) = pair(4, 16 << 10);
    const N: usize = 24;
    const LEN: usize = 3 << 20;
    let targets: Vec<Region> = (0..N).map(|_| b.alloc_host(LEN).unwrap()).collect();
    let sources: Vec<Region> = (0..N).map(|i| source(&a, LEN, 300 + i as u64)).collect();
    notifications_after_their_data(
        (&b, &ab),
        (&sources, &targets),
        |d| vec![RemoteSegment::new(d, 0, LEN as u64)],
        true,
        |i| {
            let seed = 300 + i as u64;
            let what = format!("write {i} at its notification");
            assert_pattern(&targets[i], 0, LEN, seed, &what);
        },
    );
}

/// Writes `bad` (one bad entry among good ones) and checks the refusal and that no byte of
/// the target changed; then a good write on the same connection still lands.
fn refused_write_changes_nothing(
    a: &Endpoint,
    b: &Endpoint,
    ab: &Connection,
    dst: &Region,
    good: Descriptor,
    bad: RemoteSegment,
    reason: &str,
) {
    let before = snapshot(dst);
    let refusals = b.access_refusals();
    let src = source(a, 3 << 20, 77);
    let remote = [
        RemoteSegment::new(good, 0, 1 << 20),
        RemoteSegment::new(good, 1 << 20, 1 << 20),
        bad,
    ];
    let local = [Segment::new(&src, 0, (2 << 20) + bad.len as usize)];
    let tx = ab.write(&local, &remote, Some(b"must not arrive")).unwrap();
    assert_refused(&tx, 2, reason, "write");
    assert_eq!(b.access_refusals(), refusals + 1);
    assert!(
        snapshot(dst) == before,
        "a refused write changed target memory"
    );
    // A read naming the same bad entry is refused too, and reads nothing.
    let back = a.alloc_host(3 << 20).unwrap();
    let rx = ab
        .read(
            &[Segment::new(&back, 0, (1 << 20) + bad.len as usize)],
            &[remote[0], bad],
        )
        .unwrap();
    assert_refused(&rx, 1, reason, "read");
    assert_eq!(b.access_refusals(), refusals + 2);
    // The lanes are still in step: a good write lands exactly.
    let tx = write_one(ab, &src, good, 1 << 20, None);
    assert_eq!(tx.wait(DEADLINE).unwrap(), 1 << 20);
    assert_pattern(dst, 0, 1 << 20, 77, "write after a refusal");
    dst.memory()
        .with_bytes_mut(|m| m.copy_from_slice(&before))
        .unwrap();
    assert!(
        b.notifications().is_empty(),
        "a refused write's notification was delivered"
    );
}

#[test]
fn bad_descriptors_are_refused_and_nothing_is_written() {
    loopback();
    let (a, b, ab, _ba) = pair(2, 256 << 10);
    let dst = b.alloc_host(4 << 20).unwrap();
    dst.memory().with_bytes_mut(|m| fill(m, 9)).unwrap();
    let good = b.advertise(&dst).unwrap();
    let refused = |bad, reason| refused_write_changes_nothing(&a, &b, &ab, &dst, good, bad, reason);

    // Wrong key.
    let forged = with_wrong_key(good);
    refused(RemoteSegment::new(forged, 2 << 20, 4096), "key");

    // Out of bounds (the descriptor claims more than the region holds).
    let long = with_len(good, 64 << 20);
    refused(RemoteSegment::new(long, (4 << 20) - 4096, 8192), "outside");

    // Unknown region.
    let mut unknown = good.to_bytes();
    unknown[1..9].copy_from_slice(&u64::MAX.to_le_bytes());
    let unknown = Descriptor::from_bytes(&unknown).unwrap();
    refused(RemoteSegment::new(unknown, 0, 4096), "unknown");

    // Revoked: a second region, advertised then revoked.
    let (_other, revoked) = advertised_host(&b, 1 << 20);
    assert!(b.revoke(&revoked));
    assert!(!b.revoke(&revoked));
    refused(RemoteSegment::new(revoked, 0, 4096), "revoked");

    assert_eq!(b.access_refusals(), 8);
    assert!(ab.error().is_none());
}

#[test]
fn dropped_transfers_keep_both_sides_in_step_and_mix_with_two_sided_traffic() {
    loopback();
    let (a, b, ab, ba) = pair(2, 64 << 10);
    let (dst, d) = advertised_host(&b, 8 << 20);
    let src = source(&a, 8 << 20, 11);
    // Detached writes and reads, with two-sided transfers in between in both directions.
    let scratch = a.alloc_host(1 << 20).unwrap();
    let two_src = source(&b, 1 << 20, 12);
    let two_dst = a.alloc_host(1 << 20).unwrap();
    for i in 0..16usize {
        let off = (i % 8) << 20;
        drop(
            ab.write(
                &[Segment::new(&src, off, 1 << 20)],
                &[RemoteSegment::new(d, off as u64, 1 << 20)],
                None,
            )
            .unwrap(),
        );
        if i % 4 == 0 {
            drop(read_one(&ab, &scratch, d, 1 << 20));
            let rx = ab.recv(&two_dst, 0, 1 << 20).unwrap();
            let tx = ba.send(&two_src, 0, 1 << 20).unwrap();
            tx.wait(DEADLINE).unwrap();
            rx.wait(DEADLINE).unwrap();
        }
    }
    assert_pattern(&two_dst, 0, 1 << 20, 12, "two-sided between one-sided ops");
    // A last write is acknowledged only after the earlier ones on its lanes landed.
    let tx = write_one(&ab, &src, d, 8 << 20, Some(b"last"));
    assert_eq!(tx.wait(DEADLINE).unwrap(), 8 << 20);
    assert_eq!(wait_notifications(&b, 1), [b"last".to_vec()]);
    // The detached reads' sends from `dst` may still be finishing on the target (the CPU may
    // not touch memory with requests in flight): wait for them before looking.
    assert!(eventually(DEADLINE, || ab.in_flight() == 0 && ba.in_flight() == 0));
    assert_pattern(&dst, 0, 8 << 20, 11, "after detached writes");
}

/// Adjacent remote segments of one region travel as one entry of the request (the target
/// checks them as one run), and a refusal of such an entry still says where: it names the
/// first segment of the run and which segments the run covered. Writes and reads, through
/// the comms (64 KiB) and inline (4 KiB).
#[test]
fn a_refused_run_of_adjacent_segments_names_its_segments() {
    loopback();
    let (a, b, ab, _ba) = pair(2, 256 << 10);
    let dst = b.alloc_host(4 << 20).unwrap();
    let good = b.advertise(&dst).unwrap();
    // Claims 64 MiB of a 4 MiB region: segments past 4 MiB are out of bounds.
    let long = with_len(good, 64 << 20);
    let src = source(&a, 1 << 20, 5);
    let back = a.alloc_host(1 << 20).unwrap();
    for piece in [64u64 << 10, 4 << 10] {
        let end = 4u64 << 20;
        // Segment 0 alone (not adjacent to the run), then 1..=3 adjacent, the last one past
        // the region's end.
        let remote = [
            RemoteSegment::new(good, 0, piece),
            RemoteSegment::new(long, end - 2 * piece, piece),
            RemoteSegment::new(long, end - piece, piece),
            RemoteSegment::new(long, end, piece),
        ];
        let len = (4 * piece) as usize;
        let tx = ab
            .write(&[Segment::new(&src, 0, len)], &remote, None)
            .unwrap();
        assert_refused(&tx, 1, "segments 1..=3", "a write of a run");
        let rx = ab.read(&[Segment::new(&back, 0, len)], &remote).unwrap();
        assert_refused(&rx, 1, "segments 1..=3", "a read of a run");
        // The same run inside the region lands whole.
        let inside = [
            RemoteSegment::new(good, end - 3 * piece, piece),
            RemoteSegment::new(good, end - 2 * piece, piece),
            RemoteSegment::new(good, end - piece, piece),
        ];
        let len = (3 * piece) as usize;
        let tx = ab
            .write(&[Segment::new(&src, 0, len)], &inside, None)
            .unwrap();
        assert_eq!(tx.wait(DEADLINE).unwrap(), len as u64);
        let mut landed = vec![0u8; len];
        dst.read((end - 3 * piece) as usize, &mut landed).unwrap();
        let mut sent = vec![0u8; len];
        src.read(0, &mut sent).unwrap();
        assert!(
            landed == sent,
            "a run of adjacent segments landed wrong ({piece} B pieces)"
        );
    }
    assert_eq!(b.access_refusals(), 4);
    assert!(ab.error().is_none());
}

#[test]
fn invalid_local_arguments_are_refused_before_anything_moves() {
    loopback();
    let (a, b, ab, _ba) = pair(1, 64 << 10);
    let (_dst, d) = advertised_host(&b, 1 << 20);
    let src = a.alloc_host(1 << 20).unwrap();
    let r = |o, l| RemoteSegment::new(d, o, l);
    let bad = |res: tcpx_runtime::Result<_>| matches!(res, Err(Error::InvalidArgument(_)));
    assert!(
        bad(ab.write(&[Segment::new(&src, 0, 10)], &[r(0, 11)], None)),
        "unequal totals"
    );
    assert!(bad(ab.write(&[], &[r(0, 1)], None)), "empty list");
    assert!(
        bad(ab.write(
            &[Segment::new(&src, 0, 10)],
            &[r(0, 10)],
            Some(&vec![0; 65 << 10])
        )),
        "notification too long"
    );
    assert!(matches!(
        ab.notify(&vec![0; 65 << 10]),
        Err(Error::InvalidArgument(_))
    ));
    assert!(
        bad(ab.read(&[Segment::new(&src, 1 << 20, 1)], &[r(0, 1)])),
        "local out of range"
    );
    // A batch too large for one control message is refused with a clear error (segments
    // apart from one another: adjacent ones travel as one entry, below).
    let many: Vec<_> = (0..40_000u64).map(|i| r(i * 24, 16)).collect();
    let local = [Segment::new(&src, 0, 40_000 * 16)];
    match ab.write(&local, &many, None) {
        Err(Error::InvalidArgument(what)) => assert!(what.contains("split the batch"), "{what}"),
        other => panic!("expected a batch-size error, got {other:?}"),
    }
    // The same count of segments, each where the one before ends, is one run of the region:
    // its request carries one entry, and the write lands.
    let adjacent: Vec<_> = (0..40_000u64).map(|i| r(i * 16, 16)).collect();
    let tx = ab.write(&local, &adjacent, None).unwrap();
    assert_eq!(tx.wait(DEADLINE).unwrap(), 40_000 * 16);
    // Nothing was sent: a good write goes through.
    let tx = ab
        .write(&[Segment::new(&src, 0, 4096)], &[r(0, 4096)], None)
        .unwrap();
    assert_eq!(tx.wait(DEADLINE).unwrap(), 4096);
    assert_eq!(b.access_refusals(), 0);
}

/// The lost-peer scenarios' start: a pair whose operations give up after 3 s (a lost peer
/// must fail them well inside the tests' waits), `b`'s 64 MiB region advertised and an
/// initiator region of the same size: (a, b, ab, ba, target, its descriptor, source).
fn lost_peer_setup() -> (
    Endpoint,
    Endpoint,
    Connection,
    Connection,
    Region,
    Descriptor,
    Region,
) {
    let mut cfg = config(2, 64 << 10);
    cfg.timeout = Duration::from_secs(3);
    let (a, b, ab, ba) = pair_with(cfg.clone(), cfg);
    let (dst, d) = advertised_host(&b, 64 << 20);
    let src = a.alloc_host(64 << 20).unwrap();
    (a, b, ab, ba, dst, d, src)
}

#[test]
fn a_lost_peer_fails_every_pending_operation_on_both_sides() {
    loopback();
    let (a, b, ab, ba, _dst, d, src) = lost_peer_setup();
    let back = a.alloc_host(64 << 20).unwrap();
    let mut pending = Vec::new();
    for _ in 0..4 {
        pending.push(write_one(&ab, &src, d, 64 << 20, None));
        pending.push(read_one(&ab, &back, d, 64 << 20));
    }
    // The target goes away mid-operation.
    drop(ba);
    drop(b);
    let started = Instant::now();
    let failed = pending
        .iter()
        .filter(|t| t.wait(Duration::from_secs(10)).is_err())
        .count();
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
    assert!(
        failed >= pending.len() - 1,
        "only {failed} of {} pending operations failed",
        pending.len()
    );
    assert!(eventually(Duration::from_secs(10), || ab.error().is_some()));
    assert!(ab
        .write(
            &[Segment::new(&src, 0, 4096)],
            &[RemoteSegment::new(d, 0, 4096)],
            None
        )
        .is_err());
    drop(a);
}

#[test]
fn a_lost_initiator_fails_the_targets_pending_work() {
    loopback();
    let (a, b, ab, ba, _dst, d, src) = lost_peer_setup();
    for _ in 0..4 {
        drop(write_one(&ab, &src, d, 64 << 20, None));
    }
    drop(ab);
    drop(a);
    let started = Instant::now();
    assert!(eventually(Duration::from_secs(10), || ba.error().is_some()
        && ba.in_flight() == 0));
    assert!(started.elapsed() < Duration::from_secs(10));
    // Whatever landed, no notification and no refusal came out of it.
    assert_eq!(b.access_refusals(), 0);
}

#[test]
fn closing_releases_one_sided_registrations() {
    loopback();
    let a = Endpoint::new(config(2, 64 << 10)).unwrap();
    let b = Endpoint::new(config(2, 64 << 10)).unwrap();
    let (_dst, d) = advertised_host(&b, 1 << 20);
    let src = source(&a, 1 << 20, 3);
    for _ in 0..3 {
        let (ab, ba) = connect(&a, &b);
        write_one(&ab, &src, d, 1 << 20, None)
            .wait(DEADLINE)
            .unwrap();
        // A refusal registers the discard region too.
        let bad = Descriptor::from_bytes(&{
            let mut x = d.to_bytes();
            x[18] ^= 0x80;
            x
        })
        .unwrap();
        let w = write_one(&ab, &src, bad, 4096, None);
        assert!(w.wait(DEADLINE).is_err());
        assert!(a.live_registrations() > 0 && b.live_registrations() > 0);
        close_releases_everything((&a, &b), ab, ba);
    }
}

/// Closes `ab` from `a`'s side and asserts that both endpoints released every one-sided
/// registration: `a` at once, `b` once its side of the connection noticed.
fn close_releases_everything((a, b): (&Endpoint, &Endpoint), ab: Connection, ba: Connection) {
    ab.close().unwrap();
    drop(ba);
    assert_eq!(a.live_registrations(), 0);
    assert!(eventually(DEADLINE, || b.live_registrations() == 0));
}

#[test]
fn a_read_sees_every_earlier_write_of_the_same_connection() {
    loopback();
    let (a, b, ab, _ba) = pair(4, 64 << 10);
    const LEN: usize = 4 << 20;
    let (_dst, d) = advertised_host(&b, LEN);
    for round in 0..6u64 {
        let src = source(&a, LEN, 500 + round);
        let back = a.alloc_host(LEN).unwrap();
        // Issued back to back: the read is served only after the write landed.
        let w = write_one(&ab, &src, d, LEN, None);
        let r = read_one(&ab, &back, d, LEN);
        assert_eq!(r.wait(DEADLINE).unwrap(), LEN as u64);
        assert_eq!(w.wait(DEADLINE).unwrap(), LEN as u64);
        assert_pattern(
            &back,
            0,
            LEN,
            500 + round,
            &format!("read after write, round {round}"),
        );
    }
}

// ---- Packing: batches of small scattered host blocks travel through pack buffers. ----

/// `n` non-overlapping blocks of 1..=`max_block` bytes at random offsets of a region of
/// `region_len` bytes, in random (not address) order; returns (offset, len) per block.
fn scattered(rng: &mut Rng, n: usize, max_block: usize, region_len: usize) -> Vec<(usize, usize)> {
    // Slots of max_block bytes, each block at a random place inside its own slot.
    let slots = region_len / max_block;
    assert!(n <= slots);
    let mut order: Vec<usize> = (0..slots).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    order[..n]
        .iter()
        .map(|&slot| {
            let len = 1 + rng.below(max_block as u64) as usize;
            let at = rng.below((max_block - len) as u64 + 1) as usize;
            (slot * max_block + at, len)
        })
        .collect()
}

#[test]
fn scattered_small_blocks_are_written_and_read_packed_exactly() {
    loopback();
    // Every batch packs, however short (alone on the connection, a short one would not),
    // and blocks of up to 64 KiB (averaging 32 KiB, where host lists go unpacked by default).
    let mut c = config(3, 128 << 10);
    c.pack_lone_runs = Some(0);
    c.pack_below = 64 << 10;
    let (a, b, ab, ba) = pair_with(c.clone(), c);
    let mut rng = Rng(11);
    const REGION: usize = 16 << 20;
    let t0 = b.alloc_host(REGION).unwrap();
    let t1 = b.alloc_host(REGION).unwrap();
    let d = [b.advertise(&t0).unwrap(), b.advertise(&t1).unwrap()];
    for round in 0..10u64 {
        // Random blocks of 1 B..64 KiB across two regions (each region's blocks disjoint).
        let n = 2 + rng.below(100) as usize;
        let blocks = scattered(&mut rng, n, 64 << 10, REGION);
        let which: Vec<usize> = blocks.iter().map(|_| rng.below(2) as usize).collect();
        let total: usize = blocks.iter().map(|b| b.1).sum();
        let seed = 2000 + round;
        let src = source(&a, total, seed);
        // The local side is scattered too: the same lengths at random places of a bigger
        // region, in another order than the address order.
        let staging = a.alloc_host(n * (64 << 10)).unwrap();
        let local_blocks: Vec<(usize, usize)> = {
            let slots = scattered(&mut rng, n, 64 << 10, n * (64 << 10));
            slots
                .iter()
                .zip(&blocks)
                .map(|(&(o, _), &(_, l))| ((o / (64 << 10)) * (64 << 10), l))
                .collect()
        };
        let stream = snapshot(&src);
        staging
            .memory()
            .with_bytes_mut(|m| {
                let mut pos = 0;
                for &(o, l) in &local_blocks {
                    m[o..o + l].copy_from_slice(&stream[pos..pos + l]);
                    pos += l;
                }
            })
            .unwrap();
        let local = local_segments(&staging, &local_blocks);
        let remote = spread_remote_segments(&d, &blocks, &which);
        let (sent, received) = (ab.pack_stats().packed_sent, ba.pack_stats().packed_received);
        let tx = ab.write(&local, &remote, None).unwrap();
        assert_eq!(tx.wait(DEADLINE).unwrap(), total as u64, "write {round}");
        assert_eq!(
            ab.pack_stats().packed_sent,
            sent + 1,
            "write {round} packed"
        );
        assert_eq!(ba.pack_stats().packed_received, received + 1);
        let what = format!("write {round}");
        assert_spread_blocks(&[&t0, &t1], &blocks, &which, &stream, &what);

        // Read it back into another scattered local list, packed as well.
        let back = a.alloc_host(n * (64 << 10)).unwrap();
        let local = local_segments(&back, &local_blocks);
        let (sent, received) = (ba.pack_stats().packed_sent, ab.pack_stats().packed_received);
        let rx = ab.read(&local, &remote).unwrap();
        assert_eq!(rx.wait(DEADLINE).unwrap(), total as u64, "read {round}");
        assert_eq!(ba.pack_stats().packed_sent, sent + 1, "read {round} packed");
        assert_eq!(ab.pack_stats().packed_received, received + 1);
        assert_blocks(&back, &local_blocks, &stream, &format!("read {round}"));
    }
    assert_eq!(b.access_refusals(), 0);
    assert_eq!(ab.pack_stats().fallbacks, 0);
}

#[test]
fn a_short_list_alone_on_its_connection_goes_unpacked_and_a_long_one_packs() {
    loopback();
    // 2 channels × a window of 16: up to 32 runs ride the channels unpacked when alone.
    // Lone operations of up to 32 KiB go inline by default (`inline_lone_bytes`): off here,
    // so that the two-block round (32 KiB) takes the comms this rule is about.
    let mut initiator = config(2, 128 << 10);
    initiator.inline_lone_bytes = 0;
    let (a, b, ab, _ba) = pair_with(initiator, config(2, 128 << 10));
    const BLOCK: usize = 16 << 10;
    let (dst, d) = advertised_host(&b, 2 * BLOCK * 64);
    for (round, n) in [(0u64, 2usize), (1, 32), (2, 33), (3, 64)] {
        let src = source(&a, BLOCK * n, 700 + round);
        let blocks = every_other_block(n, BLOCK, 0);
        let before = ab.pack_stats().packed_sent;
        let tx = ab
            .write(
                &[Segment::new(&src, 0, BLOCK * n)],
                &remote_segments(d, &blocks),
                None,
            )
            .expect("write");
        assert_eq!(tx.wait(DEADLINE).unwrap(), (BLOCK * n) as u64);
        let packed = ab.pack_stats().packed_sent - before;
        assert_eq!(
            packed,
            u64::from(n > 32),
            "{n} runs of 16 KiB alone: packed {packed}"
        );
        assert_blocks(&dst, &blocks, &snapshot(&src), &format!("{n} blocks"));
    }
}

#[test]
fn a_refused_packed_write_changes_no_byte_and_keeps_the_lanes_in_step() {
    loopback();
    let (a, b, ab, ba) = pair(2, 64 << 10);
    let dst = b.alloc_host(8 << 20).unwrap();
    dst.memory().with_bytes_mut(|m| fill(m, 5)).unwrap();
    let before = snapshot(&dst);
    let d = b.advertise(&dst).unwrap();
    const BLOCK: usize = 4096;
    const N: usize = 512;
    let src = source(&a, BLOCK * N, 6);
    let local = [Segment::new(&src, 0, BLOCK * N)];
    // Every other 4 KiB slot; the last entry carries a wrong key.
    let blocks = every_other_block(N, BLOCK, 0);
    let mut remote = remote_segments(d, &blocks);
    remote[N - 1] = RemoteSegment::new(with_wrong_key(d), remote[N - 1].offset, BLOCK as u64);
    let received = ba.pack_stats().packed_received;
    let tx = ab.write(&local, &remote, Some(b"must not arrive")).unwrap();
    assert_refused(&tx, N - 1, "key", "packed write");
    assert_eq!(
        ba.pack_stats().packed_received,
        received + 1,
        "the refused write travelled packed"
    );
    assert!(
        snapshot(&dst) == before,
        "a refused packed write changed target memory"
    );
    // The lanes are still in step: the good list lands exactly, with its notification.
    remote[N - 1] = RemoteSegment::new(d, ((N - 1) * 2 * BLOCK) as u64, BLOCK as u64);
    let tx = ab.write(&local, &remote, Some(b"landed")).unwrap();
    assert_eq!(tx.wait(DEADLINE).unwrap(), (BLOCK * N) as u64);
    assert_eq!(wait_notifications(&b, 1), [b"landed".to_vec()]);
    assert_blocks(
        &dst,
        &blocks,
        &snapshot(&src),
        "write after a packed refusal",
    );
    assert_eq!(ab.pack_stats().packed_sent, 2);
}

#[test]
fn a_packed_writes_notification_is_never_delivered_before_its_data() {
    loopback();
    let (a, b, ab, ba) = pair(4, 64 << 10);
    const N: usize = 16;
    const BLOCK: usize = 4096;
    const BLOCKS: usize = 1024;
    let targets: Vec<Region> = (0..N)
        .map(|_| b.alloc_host(2 * BLOCK * BLOCKS).unwrap())
        .collect();
    let sources: Vec<Region> = (0..N)
        .map(|i| source(&a, BLOCK * BLOCKS, 400 + i as u64))
        .collect();
    let streams: Vec<Vec<u8>> = sources.iter().map(snapshot).collect();
    // Every other slot, in reverse order: nothing coalesces.
    let mut blocks = every_other_block(BLOCKS, BLOCK, 0);
    blocks.reverse();
    notifications_after_their_data(
        (&b, &ab),
        (&sources, &targets),
        |d| remote_segments(d, &blocks),
        false,
        |i| {
            let what = format!("packed write {i} at its notification");
            assert_blocks(&targets[i], &blocks, &streams[i], &what);
        },
    );
    assert_eq!(ba.pack_stats().packed_received, N as u64);
    // The initiator's side is contiguous: sent packed from in place, no buffer needed.
    let s = ab.pack_stats();
    assert_eq!((s.packed_sent, s.buffers), (N as u64, 0), "{s:?}");
}

#[test]
fn an_exhausted_pack_pool_falls_back_and_every_write_still_lands() {
    loopback();
    // No pack buffer on the sender: every packable write finds the pool empty and falls back
    // (deterministic). One buffer: back-to-back writes may find it in use (how often depends
    // on timing), and the target may have to allocate past its pool; either way every write
    // lands and each is counted once.
    for sender_buffers in [0usize, 1] {
        exhausted_pool_round(sender_buffers);
    }
}

/// `n` lists of `blocks` 4 KiB blocks written from `a` into `dst` (advertised as `d`, at
/// least `n × 2 × blocks` slots of 4 KiB): every source holds its blocks in every other slot
/// (scattered, so the sender needs pack space), and list i fills every other slot of its own
/// stretch of the target, in reverse order when `reverse` (nothing coalesces). All are
/// posted before any is waited for; each must report its length and land exactly. Returns
/// the target lists, the bytes each carried, and the sources' block layout.
fn write_scattered_lists(
    (a, ab): (&Endpoint, &Connection),
    (dst, d): (&Region, Descriptor),
    (n, blocks): (usize, usize),
    seed: u64,
    reverse: bool,
) -> ScatteredLists {
    const BLOCK: usize = 4096;
    let sources: Vec<Region> = (0..n)
        .map(|i| source(a, 2 * BLOCK * blocks, seed + i as u64))
        .collect();
    let local_blocks = every_other_block(blocks, BLOCK, 0);
    let streams: Vec<Vec<u8>> = sources
        .iter()
        .map(|src| gather(&snapshot(src), &local_blocks))
        .collect();
    let lists: Vec<Vec<(usize, usize)>> = (0..n)
        .map(|i| {
            let mut list: Vec<(usize, usize)> = (0..blocks)
                .map(|k| ((i * blocks + k) * 2 * BLOCK, BLOCK))
                .collect();
            if reverse {
                list.reverse();
            }
            list
        })
        .collect();
    let transfers: Vec<_> = (0..n)
        .map(|i| {
            let local = local_segments(&sources[i], &local_blocks);
            ab.write(&local, &remote_segments(d, &lists[i]), None)
                .unwrap()
        })
        .collect();
    for (i, t) in transfers.iter().enumerate() {
        assert_eq!(
            t.wait(DEADLINE).unwrap(),
            (BLOCK * blocks) as u64,
            "write {i}"
        );
    }
    for i in 0..n {
        assert_blocks(dst, &lists[i], &streams[i], &format!("write {i}"));
    }
    ScatteredLists {
        lists,
        streams,
        local_blocks,
    }
}

/// What [`write_scattered_lists`] wrote: each list's target blocks and bytes, and where the
/// blocks lay in each source.
struct ScatteredLists {
    lists: Vec<Vec<(usize, usize)>>,
    streams: Vec<Vec<u8>>,
    local_blocks: Vec<(usize, usize)>,
}

fn exhausted_pool_round(sender_buffers: usize) {
    let with = |c: tcpx_runtime::Config, buffers: usize| tcpx_runtime::Config {
        pack_buffers: buffers,
        ..c
    };
    let (a, b, ab, ba) = pair_with(
        with(config(2, 128 << 10), sender_buffers),
        with(config(2, 128 << 10), 1),
    );
    const N: usize = 8;
    const BLOCKS: usize = 1024;
    let (dst, d) = advertised_host(&b, N * 2 * 4096 * BLOCKS);
    let _ = write_scattered_lists((&a, &ab), (&dst, d), (N, BLOCKS), 500, false);
    let s = ab.pack_stats();
    if sender_buffers == 0 {
        assert_eq!((s.packed_sent, s.fallbacks), (0, N as u64), "{s:?}");
    } else {
        assert!(s.packed_sent >= 1, "{s:?}");
    }
    assert_eq!(s.packed_sent + s.fallbacks, N as u64, "{s:?}");
    assert!(s.buffers <= sender_buffers as u64, "{s:?}");
    assert_eq!(ba.pack_stats().packed_received, s.packed_sent);
}

/// Many small scattered lists in flight at once share one pack buffer on each side: 32
/// writes and then 32 reads of 32 × 4 KiB (128 KiB each, a vLLM-like block list) with a
/// pool of one buffer on both sides all travel packed — no fallback to one request per
/// block, no one-off buffer on the target — and every byte lands where it belongs. (Whole
/// buffers per batch let one list at a time pack here, and at depth 32 in two processes the
/// rest ran at 0.04 × the same bytes contiguous.)
#[test]
fn small_packed_lists_in_flight_share_one_pack_buffer() {
    loopback();
    // Every list packs, even one that finds the connection idle (alone, a list of 32 runs
    // would ride the channels unpacked: `pack_lone_runs`).
    let one_buffer = |c: tcpx_runtime::Config| tcpx_runtime::Config {
        pack_buffers: 1,
        pack_lone_runs: Some(0),
        ..c
    };
    let (a, b, ab, ba) = pair_with(
        one_buffer(config(2, 128 << 10)),
        one_buffer(config(2, 128 << 10)),
    );
    const N: usize = 32;
    const BLOCK: usize = 4096;
    const BLOCKS: usize = 32;
    let (dst, d) = advertised_host(&b, N * 2 * BLOCK * BLOCKS);
    let ScatteredLists {
        lists,
        streams,
        local_blocks,
    } = write_scattered_lists((&a, &ab), (&dst, d), (N, BLOCKS), 900, true);
    // Read every list back, all in flight, into scattered blocks of fresh regions.
    let backs: Vec<Region> = (0..N)
        .map(|_| a.alloc_host(2 * BLOCK * BLOCKS).unwrap())
        .collect();
    let reads: Vec<_> = (0..N)
        .map(|i| {
            let local = local_segments(&backs[i], &local_blocks);
            ab.read(&local, &remote_segments(d, &lists[i])).unwrap()
        })
        .collect();
    for (i, t) in reads.iter().enumerate() {
        assert_eq!(
            t.wait(DEADLINE).unwrap(),
            (BLOCK * BLOCKS) as u64,
            "read {i}"
        );
        assert_blocks(&backs[i], &local_blocks, &streams[i], &format!("read {i}"));
    }
    let (s, t) = (ab.pack_stats(), ba.pack_stats());
    assert_eq!(
        (s.packed_sent, s.packed_received, s.fallbacks, s.buffers),
        (N as u64, N as u64, 0, 1),
        "initiator {s:?}"
    );
    assert_eq!(
        (t.packed_received, t.packed_sent, t.overflows, t.buffers),
        (N as u64, N as u64, 0, 1),
        "target {t:?}"
    );
}

/// A region is registered on the one-sided comms (both directions) ahead of the first
/// operation: advertised ones by the endpoint itself (at connect, or at advertise for
/// connections already up), others by `Connection::warm_up`. The first operations then add
/// no registration, and closing the connection still releases everything.
#[test]
fn warming_up_registers_ahead_and_the_first_operations_reuse_it() {
    loopback();
    let channels = 3;
    let a = Endpoint::new(config(channels, 64 << 10)).unwrap();
    let b = Endpoint::new(config(channels, 64 << 10)).unwrap();
    let (dst, d) = advertised_host(&b, 1 << 20);
    let src = source(&a, 1 << 20, 5);
    let (ab, ba) = connect(&a, &b);
    // One registration per one-sided comm: a send and a receive comm per channel. The
    // advertised region is registered at connect; nothing of `a` is advertised. With host
    // memory advertised, `b` also readies and registers its first pack buffer then, when
    // the process keeps one ready (`pooled`).
    let per_side = 2 * usize::from(channels);
    assert_eq!(
        (a.live_registrations(), b.live_registrations()),
        (0, per_side + pooled(&ba, per_side))
    );
    ab.warm_up(&src).unwrap();
    ba.warm_up(&dst).unwrap();
    assert_eq!(a.live_registrations(), per_side);
    assert_eq!(b.live_registrations(), per_side + pooled(&ba, per_side));
    // Twice is the same as once (the registrations are cached on the connection).
    ab.warm_up(&src).unwrap();
    assert_eq!(a.live_registrations(), per_side);
    let w = write_one(&ab, &src, d, 1 << 20, Some(b"warm"));
    assert_eq!(w.wait(DEADLINE).unwrap(), 1 << 20);
    assert_eq!(wait_notifications(&b, 1), vec![b"warm".to_vec()]);
    assert_eq!(snapshot(&dst), snapshot(&src));
    let back = a.alloc_host(1 << 20).unwrap();
    ab.warm_up(&back).unwrap();
    let r = read_one(&ab, &back, d, 1 << 20);
    assert_eq!(r.wait(DEADLINE).unwrap(), 1 << 20);
    assert_eq!(snapshot(&back), snapshot(&src));
    // The operations added nothing: both regions were registered ahead (one run each: no
    // pack buffer is needed).
    assert_eq!(a.live_registrations(), 2 * per_side);
    assert_eq!(b.live_registrations(), per_side + pooled(&ba, per_side));
    // A region advertised on a live connection is registered on it at once, and released
    // with the region once it is revoked and dropped.
    let (more, dm) = advertised_host(&b, 64 << 10);
    assert_eq!(b.live_registrations(), 2 * per_side + pooled(&ba, per_side));
    assert!(b.revoke(&dm));
    drop(more);
    let left = per_side + pooled(&ba, per_side);
    assert!(eventually(DEADLINE, || b.live_registrations() == left));
    close_releases_everything((&a, &b), ab, ba);
}

/// `Connection::warm_up_all` registers many regions in one go, skipping what is cached, and
/// the writes from them then register nothing.
#[test]
fn warming_up_many_regions_at_once() {
    loopback();
    let channels = 2;
    let (a, b, ab, _ba) = pair(channels, 64 << 10);
    let per_region = 2 * usize::from(channels);
    let sources: Vec<_> = (0..16).map(|i| source(&a, 64 << 10, 50 + i)).collect();
    ab.warm_up(&sources[0]).unwrap();
    assert_eq!(a.live_registrations(), per_region);
    ab.warm_up_all(&sources).unwrap();
    assert_eq!(a.live_registrations(), sources.len() * per_region);
    let (dst, d) = advertised_host(&b, 64 << 10);
    for (i, src) in sources.iter().enumerate() {
        let w = write_one(&ab, src, d, 64 << 10, None);
        assert_eq!(w.wait(DEADLINE).unwrap(), 64 << 10);
        assert_pattern(&dst, 0, 64 << 10, 50 + i as u64, &format!("write {i}"));
    }
    assert_eq!(a.live_registrations(), sources.len() * per_region);
    drop(sources);
    assert!(eventually(DEADLINE, || a.live_registrations() == 0));
}

/// A connection to an endpoint that advertises host memory readies its first pack buffer at
/// connect and registers it with the advertised regions, so that the first packed write
/// into that memory registers nothing on the target (issue 25: no first-transfer tax). The
/// buffer is one the process keeps ready (or one a closed connection left): other tests
/// take them too, so a connection that found none goes without, its first packed write
/// registers a buffer as before, and the next connection is tried.
#[test]
fn the_first_pack_buffer_is_registered_at_connect_where_host_memory_is_advertised() {
    loopback();
    const BLOCK: usize = 16 << 10;
    // Alone on 2 channels, more than 32 runs pack.
    const N: usize = 64;
    let channels = 2;
    let per_side = 2 * usize::from(channels);
    let blocks = every_other_block(N, BLOCK, 0);
    let deadline = Instant::now() + DEADLINE;
    for attempt in 0.. {
        let a = Endpoint::new(config(channels, 128 << 10)).unwrap();
        let b = Endpoint::new(config(channels, 128 << 10)).unwrap();
        let (dst, d) = advertised_host(&b, 2 * BLOCK * N);
        let src = source(&a, BLOCK * N, 40 + attempt);
        let (ab, ba) = connect(&a, &b);
        let readied = ba.pack_stats().buffers as usize;
        assert!(readied <= 1, "one buffer at most is readied: {readied}");
        // The advertised region, and the readied buffer if any, both ways on every channel;
        // nothing on the side that advertised nothing.
        assert_eq!(b.live_registrations(), per_side * (1 + readied));
        assert_eq!((a.live_registrations(), ab.pack_stats().buffers), (0, 0));
        let tx = ab
            .write(
                &[Segment::new(&src, 0, BLOCK * N)],
                &remote_segments(d, &blocks),
                None,
            )
            .expect("write");
        assert_eq!(tx.wait(DEADLINE).unwrap(), (BLOCK * N) as u64);
        assert_eq!(ab.pack_stats().packed_sent, 1, "the list went packed");
        assert_blocks(
            &dst,
            &blocks,
            &snapshot(&src),
            &format!("attempt {attempt}"),
        );
        // Either way the target holds one pooled buffer, registered once.
        assert_eq!(ba.pack_stats().buffers, 1);
        assert_eq!(b.live_registrations(), 2 * per_side);
        close_releases_everything((&a, &b), ab, ba);
        if readied == 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no connection found a pack buffer kept ready in {attempt} attempts"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A write whose own blocks are gathered into a pack buffer registers nothing of its list
/// with the plugin (the engines copy the blocks; only the buffer goes on the wire), so its
/// connection's first such write waits for no registration of it. The same blocks written
/// one run at a time (unpacked) register their region, as before.
#[test]
fn a_packed_write_registers_only_the_pack_buffer_of_the_initiator() {
    loopback();
    const BLOCK: usize = 16 << 10;
    // Alone on 2 channels, more than 32 runs pack.
    const N: usize = 64;
    let channels = 2;
    // A region registered by a write: on the send comm of every channel.
    let per_region = usize::from(channels);
    let (a, b, ab, ba) = pair(channels, 128 << 10);
    let (dst, d) = advertised_host(&b, 2 * BLOCK * N);
    let src = source(&a, 2 * BLOCK * N, 91);
    let blocks = every_other_block(N, BLOCK, 1);
    let local: Vec<Segment<'_>> = blocks
        .iter()
        .map(|&(offset, len)| Segment::new(&src, offset, len))
        .collect();
    let tx = ab
        .write(&local, &remote_segments(d, &blocks), None)
        .expect("write");
    assert_eq!(tx.wait(DEADLINE).unwrap(), (BLOCK * N) as u64);
    assert_eq!(ab.pack_stats().packed_sent, 1, "the list went packed");
    assert_blocks(&dst, &blocks, &gather(&snapshot(&src), &blocks), "packed");
    assert_eq!(ab.pack_stats().buffers, 1);
    assert_eq!(
        a.live_registrations(),
        per_region,
        "the pack buffer's registrations only, none of the list's region"
    );
    // Four blocks (64 KiB, past what goes inline): too few runs to pack alone, so they go
    // one request each, from `src`.
    let four = &blocks[..4];
    let tx = ab
        .write(&local[..4], &remote_segments(d, four), None)
        .expect("write");
    assert_eq!(tx.wait(DEADLINE).unwrap(), (4 * BLOCK) as u64);
    assert_eq!(ab.pack_stats().packed_sent, 1, "four blocks went unpacked");
    assert_blocks(&dst, four, &gather(&snapshot(&src), four), "unpacked");
    assert_eq!(
        a.live_registrations(),
        2 * per_region,
        "now `src` is registered"
    );
    close_releases_everything((&a, &b), ab, ba);
}

/// Registrations of `conn`'s pooled pack buffers: `per_buffer` (a comm's each) for every
/// buffer its pool made.
fn pooled(conn: &Connection, per_buffer: usize) -> usize {
    conn.pack_stats().buffers as usize * per_buffer
}

/// A target that closes as soon as it sees a write's notification (a NIXL agent torn down
/// once its peer said "done") must not take the initiator's acknowledgement with it: the
/// write landed, so the initiator's transfer completes instead of failing with `PeerClosed`.
#[test]
fn a_target_closing_at_the_notification_still_acknowledges_the_write() {
    loopback();
    let a = Endpoint::new(config(2, 64 << 10)).unwrap();
    let src = source(&a, 64 << 10, 9);
    for round in 0..20 {
        let b = Endpoint::new(config(2, 64 << 10)).unwrap();
        let (_dst, d) = advertised_host(&b, 64 << 10);
        let (ab, ba) = connect(&a, &b);
        let w = write_one(&ab, &src, d, 64 << 10, Some(b"done"));
        let deadline = Instant::now() + DEADLINE;
        while b.notifications().is_empty() {
            assert!(Instant::now() < deadline, "round {round}: no notification");
            std::hint::spin_loop();
        }
        drop(ba);
        drop(b);
        assert_eq!(
            w.wait(DEADLINE)
                .unwrap_or_else(|e| panic!("round {round}: {e}")),
            64 << 10,
            "round {round}"
        );
    }
}

/// Many small operations in flight in both directions, each side's control loop either
/// sleeping between frames (no wait spin: every frame is a wake-up, and a thread queueing a
/// frame while its loop sleeps writes it itself) or spinning (frames and answers of many
/// operations written together): every byte lands, every read sees the writes before it,
/// and notifications arrive once each, in order.
#[test]
fn many_small_operations_in_flight_land_whether_the_control_loops_spin_or_sleep() {
    loopback();
    for spin in [Duration::ZERO, Duration::from_micros(200)] {
        let conf = || {
            let mut c = config(4, 64 << 10);
            c.wait_spin = spin;
            c
        };
        let (a, b, ab, ba) = pair_with(conf(), conf());
        const OPS: usize = 400;
        const BLOCK: usize = 4 << 10;
        const IN_FLIGHT: usize = 32;
        // a writes into b's region and reads it back; b writes into a's region the other way.
        let b_dst = b.alloc_host(OPS * BLOCK).unwrap();
        let a_dst = a.alloc_host(OPS * BLOCK).unwrap();
        let (db, da) = (b.advertise(&b_dst).unwrap(), a.advertise(&a_dst).unwrap());
        let a_src = source(&a, OPS * BLOCK, 900);
        let b_src = source(&b, OPS * BLOCK, 901);
        let back = a.alloc_host(OPS * BLOCK).unwrap();
        let run = |conn: &Connection, src: &Region, d: Descriptor, read_back: bool| {
            let mut in_flight = std::collections::VecDeque::new();
            for i in 0..OPS {
                let at = i * BLOCK;
                let note = format!("{i}");
                in_flight.push_back(
                    conn.write(
                        &[Segment::new(src, at, BLOCK)],
                        &[RemoteSegment::new(d, at as u64, BLOCK as u64)],
                        Some(note.as_bytes()),
                    )
                    .unwrap(),
                );
                if read_back {
                    in_flight.push_back(
                        conn.read(
                            &[Segment::new(&back, at, BLOCK)],
                            &[RemoteSegment::new(d, at as u64, BLOCK as u64)],
                        )
                        .unwrap(),
                    );
                }
                while in_flight.len() > IN_FLIGHT {
                    let t = in_flight.pop_front().unwrap();
                    assert_eq!(t.wait(DEADLINE).unwrap(), BLOCK as u64, "spin {spin:?}");
                }
            }
            for t in in_flight {
                assert_eq!(t.wait(DEADLINE).unwrap(), BLOCK as u64, "spin {spin:?}");
            }
        };
        std::thread::scope(|s| {
            s.spawn(|| run(&ab, &a_src, db, true));
            s.spawn(|| run(&ba, &b_src, da, false));
        });
        let expected: Vec<Vec<u8>> = (0..OPS).map(|i| format!("{i}").into_bytes()).collect();
        assert_eq!(
            wait_notifications(&b, OPS),
            expected,
            "b's notifications, spin {spin:?}"
        );
        assert_eq!(
            wait_notifications(&a, OPS),
            expected,
            "a's notifications, spin {spin:?}"
        );
        assert_pattern(
            &b_dst,
            0,
            OPS * BLOCK,
            900,
            &format!("a → b, spin {spin:?}"),
        );
        assert_pattern(
            &back,
            0,
            OPS * BLOCK,
            900,
            &format!("read back, spin {spin:?}"),
        );
        assert_pattern(
            &a_dst,
            0,
            OPS * BLOCK,
            901,
            &format!("b → a, spin {spin:?}"),
        );
    }
}

/// Both peers submit writes with long segment lists at once, never waiting in between: each
/// request is about 256 KiB of control frame, so both control streams hold several MiB at a
/// time, more than the sockets buffer. Each side's control loop must go on reading while its
/// own stream is full (it never waits for its socket), or both would wait for the other until
/// the write timeout. Every byte lands.
#[test]
fn both_control_streams_full_at_once_do_not_wait_for_each_other() {
    loopback();
    let conf = || {
        let mut c = config(2, 64 << 10);
        c.timeout = Duration::from_secs(20);
        // Loops that stay awake write every frame themselves (a frame queued while a loop
        // sleeps is written by the thread that queued it, which would hide the problem).
        c.wait_spin = Duration::from_secs(2);
        c
    };
    let (a, b, ab, ba) = pair_with(conf(), conf());
    const WRITES: usize = 40;
    const SEGMENTS: usize = 8192;
    const SEG: usize = 16;
    const LEN: usize = SEGMENTS * SEG;
    let a_dst = a.alloc_host(LEN).unwrap();
    let b_dst = b.alloc_host(LEN).unwrap();
    let (da, db) = (a.advertise(&a_dst).unwrap(), b.advertise(&b_dst).unwrap());
    let a_src = source(&a, LEN, 41);
    let b_src = source(&b, LEN, 42);
    let run = |conn: &Connection, src: &Region, d: Descriptor| {
        // Every other segment of the destination in reverse order: nothing coalesces, so
        // every segment is an entry of the request.
        let remote: Vec<RemoteSegment> = (0..SEGMENTS)
            .map(|i| RemoteSegment::new(d, ((SEGMENTS - 1 - i) * SEG) as u64, SEG as u64))
            .collect();
        let local = [Segment::new(src, 0, LEN)];
        let transfers: Vec<_> = (0..WRITES)
            .map(|_| conn.write(&local, &remote, None).unwrap())
            .collect();
        for t in transfers {
            assert_eq!(t.wait(Duration::from_secs(60)).unwrap(), LEN as u64);
        }
    };
    std::thread::scope(|s| {
        s.spawn(|| run(&ab, &a_src, db));
        s.spawn(|| run(&ba, &b_src, da));
    });
    // Segment i of the source landed at the mirrored place.
    let check = |dst: &Region, src: &Region, what: &str| {
        let (d, s) = (snapshot(dst), snapshot(src));
        for i in 0..SEGMENTS {
            let at = (SEGMENTS - 1 - i) * SEG;
            assert_eq!(
                &d[at..at + SEG],
                &s[i * SEG..(i + 1) * SEG],
                "{what}: segment {i}"
            );
        }
    };
    check(&b_dst, &a_src, "a → b");
    check(&a_dst, &b_src, "b → a");
}

#[test]
fn spread_writes_and_reads_land_exactly() {
    loopback();
    let (a, b, ab, ba) = pair_with(spread_config(), spread_config());
    assert_eq!(ab.peer_info().spread, 8);
    // A lone 1 MiB write rides all 8 RMA channels in 128 KiB pieces.
    {
        let src = source(&a, MIB, 3);
        let (target, d) = advertised_host(&b, MIB);
        let (_, mut totals) = received_since(&ba.one_sided_stats(), &[0; 8]);
        let got = lone_write_pieces((&ab, &ba), &src, (&target, d), &mut totals, "lone");
        assert_eq!(got, vec![(MIB / 8) as u64; 8]);
    }
    let (target, d) = advertised_host(&b, 4 << 20);
    let (second, d2) = advertised_host(&b, 1 << 20);
    let mut rng = Rng(11);
    for round in 0..8u64 {
        let total = (128 << 10) + rng.below(3 << 20) as usize;
        // Every other round two writes go at once: the second is not alone and keeps whole
        // chunks, the first spreads; both land.
        let companion = (round % 2 == 1).then(|| {
            let extra = source(&a, 600 << 10, 700 + round);
            let t = ab
                .write(
                    &[Segment::new(&extra, 0, 600 << 10)],
                    &[RemoteSegment::new(d2, 0, 600 << 10)],
                    None,
                )
                .unwrap();
            (extra, t)
        });
        let src = source(&a, total, 500 + round);
        let local_layout = random_layout(&mut rng, total, total, 700 << 10);
        let remote_layout = random_layout(&mut rng, total, 4 << 20, 600 << 10);
        let remote = remote_segments(d, &remote_layout);
        let tx = ab
            .write(&local_segments(&src, &local_layout), &remote, None)
            .unwrap();
        assert_eq!(tx.wait(DEADLINE).unwrap(), total as u64, "write {round}");
        if let Some((extra, t)) = companion {
            assert_eq!(t.wait(DEADLINE).unwrap(), 600 << 10);
            assert!(
                snapshot(&second)[..600 << 10] == snapshot(&extra)[..],
                "write {round}: companion"
            );
        }
        let expected = snapshot(&src);
        assert_blocks(
            &target,
            &remote_layout,
            &expected,
            &format!("write {round}"),
        );
        let back = a.alloc_host(total).unwrap();
        let rx = ab.read(&[Segment::new(&back, 0, total)], &remote).unwrap();
        assert_eq!(rx.wait(DEADLINE).unwrap(), total as u64, "read {round}");
        assert!(snapshot(&back) == expected[..total], "read {round}");
    }
}

/// Spread transfers are cut alike on both sides even when only one side halves its engines
/// for a peer on the same cores (an automatic engine count on one side, an explicit one on
/// the other): the width comes from what both announced, not from the engines each drives.
#[test]
fn spread_is_agreed_when_only_one_side_halves_its_engines() {
    loopback();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    // Twice as many channels as cores: the automatic side starts one engine per core and
    // drives a loopback connection with half of them.
    let channels = u16::try_from((2 * cores).clamp(2, 32)).unwrap();
    let engines = usize::from(channels) / 2;
    let auto = config(channels, 512 << 10);
    let mut explicit = config(channels, 512 << 10);
    explicit.engines_per_device = Some(engines);
    let (a, b, ab, ba) = pair_with(auto, explicit);
    assert_eq!(a.engines().len(), engines);
    assert_eq!(
        ba.engine_count(),
        engines,
        "an explicit count drives every engine"
    );
    assert!(ab.engine_count() <= engines);
    for (from, to, conn, seed) in [(&a, &b, &ab, 1u64), (&b, &a, &ba, 2)] {
        for len in [MIB, 300 << 10, 3 * MIB + 7] {
            let src = source(from, len, seed * 10 + len as u64);
            let (target, d) = advertised_host(to, len);
            let tx = write_one(conn, &src, d, len, None);
            assert_eq!(tx.wait(DEADLINE).unwrap(), len as u64, "write of {len}");
            assert!(snapshot(&target) == snapshot(&src), "write of {len}");
            let back = from.alloc_host(len).unwrap();
            let rx = read_one(conn, &back, d, len);
            assert_eq!(rx.wait(DEADLINE).unwrap(), len as u64, "read of {len}");
            assert!(snapshot(&back) == snapshot(&src), "read of {len}");
        }
    }
}

// ---- Small writes of host memory carry their data in their request (`inline_bytes`). ----

/// Two connected endpoints whose initiator (`a`) carries small one-sided operations inline,
/// or (`inline` false) sends them through the comms.
fn inline_pair(inline: bool) -> (Endpoint, Endpoint, Connection, Connection) {
    let mut initiator = config(4, 64 << 10);
    if !inline {
        initiator.inline_bytes = 0;
        initiator.inline_lone_bytes = 0;
    }
    pair_with(initiator, config(4, 64 << 10))
}

/// `n` small operations for the inline tests: each 1 B to 8 KiB in all, cut into 1–3 blocks
/// that alternate between two remote regions; every block at its own offset, the same on
/// both sides, one after the other. Per operation, its blocks as (region 0 or 1, offset, len).
fn small_operations(seed: u64, n: usize) -> Vec<Vec<(usize, usize, usize)>> {
    let mut rng = Rng(seed);
    let mut at = 0usize;
    (0..n)
        .map(|i| {
            let total = 1 + rng.below(8192) as usize;
            let blocks = (1 + rng.below(3) as usize).min(total);
            let mut left = total;
            (0..blocks)
                .map(|k| {
                    let len = if k + 1 == blocks {
                        left
                    } else {
                        1 + rng.below((left - (blocks - k - 1)) as u64) as usize
                    };
                    left -= len;
                    let block = ((i + k) % 2, at, len);
                    at += len;
                    block
                })
                .collect()
        })
        .collect()
}

/// One of [`small_operations`] as lists: its blocks of `local`, and of the remote regions `d`
/// (0 or 1 per block); with its length in all.
fn small_lists<'r>(
    local: &'r Region,
    d: [Descriptor; 2],
    blocks: &[(usize, usize, usize)],
) -> (usize, Vec<Segment<'r>>, Vec<RemoteSegment>) {
    let total = blocks.iter().map(|b| b.2).sum();
    let local = blocks
        .iter()
        .map(|&(_, at, len)| Segment::new(local, at, len))
        .collect();
    let remote = blocks
        .iter()
        .map(|&(w, at, len)| RemoteSegment::new(d[w], at as u64, len as u64))
        .collect();
    (total, local, remote)
}

/// Asserts every block of `operations` holds the same bytes in `local` as in `remote[w]`, its
/// remote region's snapshot (blocks sit at the same offset on both sides): the check the
/// small write and read scenarios share, whichever way the bytes went.
fn assert_small_blocks(
    operations: &[Vec<(usize, usize, usize)>],
    local: &[u8],
    remote: [&[u8]; 2],
    what: &str,
) {
    for &(w, offset, len) in operations.iter().flatten() {
        assert!(
            remote[w][offset..offset + len] == local[offset..offset + len],
            "{what}: block of {len} bytes at {offset} in remote region {w}"
        );
    }
}

/// Small writes (1 B up to the inline threshold, one block or several in two regions, some
/// with a notification), many in flight from one source region, land exactly, travel
/// inline (the target counts them), and their notifications come in order, each after its
/// data; the same writes with inline writes off land the same bytes through the comms.
#[test]
fn small_writes_travel_inline_and_land_exactly_with_their_notifications_in_order() {
    loopback();
    for inline in [true, false] {
        let (a, b, ab, ba) = inline_pair(inline);
        // 300 writes of at most 8 KiB, each at its own place.
        const LEN: usize = 3 << 20;
        let t0 = b.alloc_host(LEN).unwrap();
        let t1 = b.alloc_host(LEN).unwrap();
        let (d0, d1) = (b.advertise(&t0).unwrap(), b.advertise(&t1).unwrap());
        let src = source(&a, LEN, 41);
        let operations = small_operations(0x1711e, 300);
        let mut transfers = Vec::new();
        let mut notes = Vec::new();
        for (i, blocks) in operations.iter().enumerate() {
            let (total, local, remote) = small_lists(&src, [d0, d1], blocks);
            let note = (i % 3 == 0).then(|| format!("inline {i}"));
            if let Some(n) = &note {
                notes.push(n.clone());
            }
            transfers.push((
                total,
                ab.write(&local, &remote, note.as_deref().map(str::as_bytes))
                    .unwrap(),
            ));
        }
        for (total, t) in &transfers {
            assert_eq!(t.wait(DEADLINE).unwrap(), *total as u64);
        }
        let got: Vec<String> = wait_notifications(&b, notes.len())
            .into_iter()
            .map(|n| String::from_utf8(n).unwrap())
            .collect();
        assert_eq!(got, notes, "notifications in write order");
        let (s0, s1) = (snapshot(&t0), snapshot(&t1));
        let what = format!("inline={inline}: write");
        assert_small_blocks(&operations, &snapshot(&src), [&s0, &s1], &what);
        let landed = b.inline_served();
        let moved: u64 = transfers.iter().map(|(total, _)| *total as u64).sum();
        if inline {
            assert_eq!(landed, 300, "every write travelled inline");
            assert_eq!(ab.inline_stats().bytes_sent, moved);
            assert_eq!(ba.inline_stats().bytes_received, moved);
        } else {
            assert_eq!(landed, 0, "inline writes off: the comms carried them");
            assert_eq!(ab.inline_stats(), tcpx_runtime::InlineStats::default());
        }
    }
}

/// An inline write lands after every earlier write of the connection (a large one through
/// the comms to the same bytes lands first, so the small one's bytes stay), and a read issued
/// right after it sees it.
#[test]
fn an_inline_write_lands_after_earlier_writes_and_before_later_reads() {
    loopback();
    let (a, b, ab, _ba) = pair(4, 64 << 10);
    const LEN: usize = 4 << 20;
    let (dst, d) = advertised_host(&b, LEN);
    for round in 0..8u64 {
        let big = source(&a, LEN, 900 + round);
        let small = source(&a, 4096, 950 + round);
        let back = a.alloc_host(4096).unwrap();
        let w_big = write_one(&ab, &big, d, LEN, None);
        let w_small = ab
            .write(
                &[Segment::new(&small, 0, 4096)],
                &[RemoteSegment::new(d, 8192, 4096)],
                None,
            )
            .unwrap();
        let r = ab
            .read(
                &[Segment::new(&back, 0, 4096)],
                &[RemoteSegment::new(d, 8192, 4096)],
            )
            .unwrap();
        assert_eq!(r.wait(DEADLINE).unwrap(), 4096);
        assert_eq!(w_small.wait(DEADLINE).unwrap(), 4096);
        assert_eq!(w_big.wait(DEADLINE).unwrap(), LEN as u64);
        assert_pattern(
            &back,
            0,
            4096,
            950 + round,
            "read right after the inline write",
        );
        assert_pattern(
            &dst,
            8192,
            4096,
            950 + round,
            "the later, inline write's bytes",
        );
        assert_pattern(
            &dst,
            0,
            8192,
            900 + round,
            "the earlier write's bytes around it",
        );
    }
    // Each round: the inline write and the inline read.
    assert_eq!(b.inline_served(), 16);
}

/// A refused inline write (wrong key, out of bounds, revoked) changes no byte, names the bad
/// entry, is counted, delivers no notification, and the connection goes on.
#[test]
fn a_refused_inline_write_changes_nothing_and_the_connection_goes_on() {
    loopback();
    let (a, b, ab, _ba) = pair(2, 64 << 10);
    let dst = b.alloc_host(64 << 10).unwrap();
    dst.memory().with_bytes_mut(|m| fill(m, 5)).unwrap();
    let good = b.advertise(&dst).unwrap();
    let forged = with_wrong_key(good);
    let (_other, revoked) = advertised_host(&b, 4096);
    assert!(b.revoke(&revoked));
    let src = source(&a, 8192, 6);
    let before = snapshot(&dst);
    // The descriptor claims more than the region holds.
    let long = with_len(good, 1 << 20);
    let bad = [
        (RemoteSegment::new(forged, 0, 100), "key"),
        (RemoteSegment::new(long, (64 << 10) - 50, 100), "outside"),
        (RemoteSegment::new(revoked, 0, 100), "revoked"),
    ];
    for (i, (entry, reason)) in bad.into_iter().enumerate() {
        let refusals = b.access_refusals();
        let tx = ab
            .write(
                &[Segment::new(&src, 0, 200)],
                &[RemoteSegment::new(good, 0, 100), entry],
                Some(b"must not arrive"),
            )
            .unwrap();
        assert_refused(&tx, 1, reason, reason);
        assert_eq!(b.access_refusals(), refusals + 1, "{reason}: counted");
        assert!(
            snapshot(&dst) == before,
            "{reason}: target memory changed ({i})"
        );
    }
    assert_eq!(b.inline_served(), 0);
    let tx = write_one(&ab, &src, good, 8192, Some(b"landed"));
    assert_eq!(tx.wait(DEADLINE).unwrap(), 8192);
    assert_pattern(&dst, 0, 8192, 6, "a good inline write after the refusals");
    assert_eq!(wait_notifications(&b, 1), vec![b"landed".to_vec()]);
    assert_eq!(b.inline_served(), 1);
}

/// Lone host operations past `inline_bytes` (8 KiB) and up to `inline_lone_bytes` (64 KiB)
/// travel inline, writes and reads, one block or two, and land exactly; one byte more takes
/// the comms; with `inline_lone_bytes` off the same lone operations take the comms too.
#[test]
fn lone_host_operations_up_to_the_lone_limit_travel_inline() {
    loopback();
    for lone_limit in [64 << 10, 0] {
        let mut initiator = config(4, 64 << 10);
        initiator.inline_lone_bytes = lone_limit;
        let (a, b, ab, _ba) = pair_with(initiator, config(4, 64 << 10));
        const LEN: usize = 1 << 20;
        let (dst, d) = advertised_host(&b, LEN);
        let back = a.alloc_host(LEN).unwrap();
        let mut at = 0usize;
        for (i, &len) in [(8 << 10) + 1, 16 << 10, 40_000, 64 << 10, (64 << 10) + 1]
            .iter()
            .enumerate()
        {
            let src = source(&a, len, 900 + i as u64);
            // Every other operation in two blocks at two places of the target.
            let half = len / 2;
            let remote = if i % 2 == 0 {
                vec![RemoteSegment::new(d, at as u64, len as u64)]
            } else {
                vec![
                    RemoteSegment::new(d, at as u64, half as u64),
                    RemoteSegment::new(d, (at + half + 4096) as u64, (len - half) as u64),
                ]
            };
            let served = b.inline_served();
            let tx = ab
                .write(&[Segment::new(&src, 0, len)], &remote, None)
                .unwrap();
            assert_eq!(tx.wait(DEADLINE).unwrap(), len as u64, "write of {len}");
            let rx = ab.read(&[Segment::new(&back, at, len)], &remote).unwrap();
            assert_eq!(rx.wait(DEADLINE).unwrap(), len as u64, "read of {len}");
            let inline = lone_limit > 0 && len <= lone_limit as usize;
            assert_eq!(
                b.inline_served() - served,
                if inline { 2 } else { 0 },
                "lone limit {lone_limit}: a write and a read of {len} bytes"
            );
            let expected = snapshot(&src);
            // The target's engine may retire its send of the read out of `dst` a moment after
            // the read completed here.
            let (landed, read) = (settled_snapshot(&dst), snapshot(&back));
            let mut got = Vec::with_capacity(len);
            for r in &remote {
                got.extend_from_slice(&landed[r.offset as usize..(r.offset + r.len) as usize]);
            }
            assert!(
                got == expected,
                "lone limit {lone_limit}: write of {len} bytes"
            );
            assert!(
                read[at..at + len] == expected[..],
                "lone limit {lone_limit}: read of {len} bytes"
            );
            at += len + 8192;
        }
    }
}

/// Small reads into host memory (1 B up to the inline threshold, one block or several from
/// two regions) come back with their data in `ReadInline`, many in flight, exactly; with
/// inline operations off the same reads come through the comms.
#[test]
fn small_reads_come_back_inline_exactly() {
    loopback();
    for inline in [true, false] {
        let (a, b, ab, ba) = inline_pair(inline);
        const LEN: usize = 3 << 20;
        let s0 = source(&b, LEN, 71);
        let s1 = source(&b, LEN, 72);
        let (d0, d1) = (b.advertise(&s0).unwrap(), b.advertise(&s1).unwrap());
        let back = a.alloc_host(LEN).unwrap();
        let operations = small_operations(0x5ead, 300);
        let mut transfers = Vec::new();
        for blocks in &operations {
            let (total, local, remote) = small_lists(&back, [d0, d1], blocks);
            transfers.push((total, ab.read(&local, &remote).unwrap()));
        }
        for (total, t) in &transfers {
            assert_eq!(t.wait(DEADLINE).unwrap(), *total as u64);
        }
        // The target's sends of the reads over the comms may still hold its sources.
        let (b0, b1, got) = (
            settled_snapshot(&s0),
            settled_snapshot(&s1),
            snapshot(&back),
        );
        assert_small_blocks(
            &operations,
            &got,
            [&b0, &b1],
            &format!("inline={inline}: read"),
        );
        assert_eq!(b.inline_served(), if inline { 300 } else { 0 });
        let moved: u64 = transfers.iter().map(|(total, _)| *total as u64).sum();
        let expected = if inline { moved } else { 0 };
        assert_eq!(ab.inline_stats().bytes_received, expected);
        assert_eq!(ba.inline_stats().bytes_sent, expected);
    }
}

/// A refused inline read reads nothing, names the bad entry and is counted; the connection
/// goes on.
#[test]
fn a_refused_inline_read_reads_nothing_and_the_connection_goes_on() {
    loopback();
    let (a, b, ab, _ba) = pair(2, 64 << 10);
    let src = source(&b, 64 << 10, 8);
    let good = b.advertise(&src).unwrap();
    let forged = with_wrong_key(good);
    let back = a.alloc_host(8192).unwrap();
    back.memory().with_bytes_mut(|m| m.fill(0xcc)).unwrap();
    let refusals = b.access_refusals();
    let rx = ab
        .read(
            &[Segment::new(&back, 0, 200)],
            &[
                RemoteSegment::new(good, 0, 100),
                RemoteSegment::new(forged, 0, 100),
            ],
        )
        .unwrap();
    assert_refused(&rx, 1, "key", "inline read");
    assert_eq!(b.access_refusals(), refusals + 1);
    assert!(
        snapshot(&back).iter().all(|&x| x == 0xcc),
        "a refused read wrote"
    );
    let rx = read_one(&ab, &back, good, 8192);
    assert_eq!(rx.wait(DEADLINE).unwrap(), 8192);
    assert_pattern(&back, 0, 8192, 8, "a good inline read after the refusal");
    assert_eq!(b.inline_served(), 1);
}
