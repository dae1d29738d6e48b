//! GPU tests of the staged path: CUDA memory moved through the built-in socket plugin (host
//! memory only) by the engines' pinned rings, two endpoints in one process over loopback.
//! Each test prints "skipped: no CUDA driver (…)" and passes where there is no driver (CI);
//! on a GPU machine they run for real (scripts/gpu/run_gpu_suite.sh). With one GPU both
//! endpoints use GPU 0; with two or more, endpoint a uses GPU 0 and b GPU 1.

mod common;

use common::*;
use tcpx::cuda::{self, CudaDevice};
use tcpx_runtime::{Endpoint, Error, Region, RemoteSegment, Segment};

/// The GPUs of endpoints a and b, or `None` (after printing why) without a CUDA driver.
fn gpus() -> Option<(CudaDevice, CudaDevice)> {
    if let Some(why) = cuda::skip_reason() {
        println!("{why}");
        return None;
    }
    let a = CudaDevice::new(0).expect("CUDA device 0");
    let b = if CudaDevice::count() >= 2 {
        CudaDevice::new(1).expect("CUDA device 1")
    } else {
        a.clone()
    };
    println!("GPU a: {a:?}, GPU b: {b:?}");
    Some((a, b))
}

/// A region of `len` bytes on `ep`: CUDA on `gpu`, else host; filled with `fill(seed)`
/// when `seed` is given.
fn region(ep: &Endpoint, gpu: Option<&CudaDevice>, len: usize, seed: Option<u64>) -> Region {
    let r = match gpu {
        Some(g) => ep.alloc_cuda_on(g, len.max(1)).expect("alloc_cuda"),
        None => ep.alloc_host(len.max(1)).expect("alloc_host"),
    };
    if let Some(seed) = seed {
        write_pattern(&r, len, seed);
    }
    r
}

const SIZES: [usize; 5] = [1, 4097, (1 << 20) + 3, 64 << 20, 256 << 20];

#[test]
fn without_a_driver_cuda_regions_are_a_clear_error() {
    loopback();
    if cuda::driver_available() {
        println!("skipped: a CUDA driver is present");
        return;
    }
    let (a, _b, _ab, _ba) = pair(1, 512 << 10);
    let err = a.alloc_cuda(4096).unwrap_err();
    assert!(matches!(err, Error::Unsupported(_)), "{err}");
    assert!(err.to_string().contains("no CUDA device"), "{err}");
}

#[test]
fn gpu_to_gpu_all_sizes_on_1_4_8_channels() {
    loopback();
    let Some((ga, gb)) = gpus() else { return };
    for channels in [1u16, 4, 8] {
        let (a, b, ab, ba) = pair(channels, 512 << 10);
        let max = *SIZES.iter().max().unwrap_or(&1);
        let src = region(&a, Some(&ga), max, None);
        let dst = region(&b, Some(&gb), max, None);
        assert!(src.is_staged() && dst.is_staged());
        for (i, &len) in SIZES.iter().enumerate() {
            let seed = u64::from(channels) * 100 + i as u64;
            let mut bytes = vec![0u8; len];
            fill(&mut bytes, seed);
            src.write(0, &bytes).expect("write");
            let started = std::time::Instant::now();
            send_verified(&ab, &ba, &src, &dst, len, seed);
            println!(
                "GPU→GPU {len} bytes on {channels} channels: {:?}",
                started.elapsed()
            );
        }
        assert!(ab.error().is_none() && ba.error().is_none());
    }
}

#[test]
fn host_to_gpu_and_gpu_to_host() {
    loopback();
    let Some((ga, gb)) = gpus() else { return };
    let (a, b, ab, ba) = pair(4, 512 << 10);
    for (i, &len) in [1usize, 4097, (1 << 20) + 3, 64 << 20].iter().enumerate() {
        let seed = 1000 + i as u64;
        // host → GPU: the sender posts from host memory, the receiver stages.
        let src = region(&a, None, len, Some(seed));
        let dst = region(&b, Some(&gb), len, None);
        send_verified(&ab, &ba, &src, &dst, len, seed);
        // GPU → host: the sender stages, the receiver takes host memory.
        let src = region(&a, Some(&ga), len, Some(seed + 50));
        let dst = region(&b, None, len, None);
        send_verified(&ab, &ba, &src, &dst, len, seed + 50);
    }
}

#[test]
fn both_directions_and_many_staged_transfers_in_flight() {
    loopback();
    let Some((ga, gb)) = gpus() else { return };
    let (a, b, ab, ba) = pair(8, 256 << 10);
    let len = (3 << 20) + 11;
    let count = 12;
    let mut posted = Vec::new();
    for k in 0..count {
        let seed = 5000 + k as u64;
        let a_src = region(&a, Some(&ga), len, Some(seed));
        let b_dst = region(&b, Some(&gb), len, None);
        let b_src = region(&b, Some(&gb), len, Some(seed + 500));
        let a_dst = region(&a, Some(&ga), len, None);
        let r1 = ba.recv(&b_dst, 0, len).expect("recv b");
        let r2 = ab.recv(&a_dst, 0, len).expect("recv a");
        let s1 = ab.send(&a_src, 0, len).expect("send a");
        let s2 = ba.send(&b_src, 0, len).expect("send b");
        posted.push((seed, [r1, r2, s1, s2], b_dst, a_dst, a_src, b_src));
    }
    for (seed, transfers, b_dst, a_dst, _a_src, _b_src) in posted {
        for t in transfers {
            assert_eq!(t.wait(DEADLINE).expect("transfer"), len as u64);
        }
        verify_region(&b_dst, len, seed, "a → b");
        verify_region(&a_dst, len, seed + 500, "b → a");
    }
}

/// `region` cut into consecutive segments of the given lengths.
fn segments<'r>(region: &'r Region, cuts: &[usize]) -> Vec<Segment<'r>> {
    let mut at = 0;
    cuts.iter()
        .map(|&n| {
            at += n;
            Segment::new(region, at - n, n)
        })
        .collect()
}

#[test]
fn vectored_staged_transfers_cut_differently_per_side() {
    loopback();
    let Some((ga, gb)) = gpus() else { return };
    let (a, b, ab, ba) = pair(4, 128 << 10);
    let len = (5 << 20) + 7;
    let src = region(&a, Some(&ga), len, Some(77));
    let dst = region(&b, Some(&gb), len, None);
    let cut_a = [len / 3, len - len / 3];
    let cut_b = [1000, len / 2 - 1000, len - len / 2];
    let rx = ba.recv_vectored(&segments(&dst, &cut_b)).expect("recv");
    let tx = ab.send_vectored(&segments(&src, &cut_a)).expect("send");
    assert_eq!(tx.wait(DEADLINE).unwrap(), len as u64);
    assert_eq!(rx.wait(DEADLINE).unwrap(), len as u64);
    verify_region(&dst, len, 77, "vectored");
}

#[test]
fn cuda_memory_the_plugin_cannot_take_is_refused_clearly() {
    loopback();
    let Some((ga, _gb)) = gpus() else { return };
    let (a, _b, ab, _ba) = pair(2, 512 << 10);
    // CUDA memory handed over without the GPU: the socket plugin cannot take it directly.
    let raw = ga.alloc(1 << 20).expect("alloc");
    let err = a.register(tcpx::SharedMemory::new(raw)).unwrap_err();
    assert!(err.to_string().contains("register_cuda"), "{err}");
    // One transfer cannot mix staged CUDA segments with host ones.
    let gpu = a.alloc_cuda(1 << 20).expect("alloc_cuda");
    let host = a.alloc_host(1 << 20).expect("alloc_host");
    let err = ab
        .send_vectored(&[Segment::new(&gpu, 0, 4096), Segment::new(&host, 0, 4096)])
        .unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument(ref m) if m.contains("mix")),
        "{err}"
    );
    // A second GPU on the same endpoint is refused (the engines stage through one GPU).
    if CudaDevice::count() >= 2 {
        let other = CudaDevice::new(1).expect("GPU 1");
        let err = a.alloc_cuda_on(&other, 4096).unwrap_err();
        assert!(err.to_string().contains("one endpoint per GPU"), "{err}");
    }
    // Nothing above broke the connection.
    assert!(ab.error().is_none());
}

/// One-sided WRITE (with a notification) and READ between GPU regions: the target's
/// advertised CUDA memory is staged like the initiator's, on both sides through the engines'
/// rings. Lists cut differently on each side, spread over two target regions, with gaps.
#[test]
fn one_sided_write_and_read_gpu_to_gpu() {
    loopback();
    let Some((ga, gb)) = gpus() else { return };
    for channels in [1u16, 4] {
        let (a, b, ab, _ba) = pair(channels, 512 << 10);
        let len = (9 << 20) + 5;
        let seed = 2000 + u64::from(channels);
        let src = region(&a, Some(&ga), len, Some(seed));
        let t0 = region(&b, Some(&gb), 16 << 20, None);
        let t1 = region(&b, Some(&gb), 16 << 20, None);
        assert!(src.is_staged() && t0.is_staged() && t1.is_staged());
        let (d0, d1) = (b.advertise(&t0).unwrap(), b.advertise(&t1).unwrap());
        assert_eq!(d0.kind(), tcpx::MemoryKind::Cuda);
        // Stream order: [0, 3 MiB) → t0 at 1 MiB, [3 MiB, 3 MiB + 4097) → t1 at 0,
        // the rest → t0 at 8 MiB + 1 (unaligned).
        let first = 3 << 20;
        let second = 4097;
        let rest = len - first - second;
        let remote = [
            RemoteSegment::new(d0, 1 << 20, first as u64),
            RemoteSegment::new(d1, 0, second as u64),
            RemoteSegment::new(d0, (8 << 20) + 1, rest as u64),
        ];
        let local = segments(&src, &[len / 2, 1, len - len / 2 - 1]);
        let started = std::time::Instant::now();
        let tx = ab
            .write(&local, &remote, Some(b"gpu write"))
            .expect("write");
        assert_eq!(tx.wait(DEADLINE).expect("write"), len as u64);
        println!(
            "one-sided GPU→GPU write of {len} bytes on {channels} channels: {:?}",
            started.elapsed()
        );
        // The notification comes only after every byte landed in GPU memory.
        let mut notes = Vec::new();
        assert!(common::eventually(DEADLINE, || {
            notes.extend(b.notifications());
            !notes.is_empty()
        }));
        assert_eq!(notes[0].1, b"gpu write");
        let mut expected = vec![0u8; len];
        fill(&mut expected, seed);
        let mut got = vec![0u8; rest];
        for (r, at, from, n) in [
            (&t0, 1 << 20, 0, first),
            (&t1, 0, first, second),
            (&t0, (8 << 20) + 1, first + second, rest),
        ] {
            r.read(at, &mut got[..n]).expect("read back");
            assert!(
                got[..n] == expected[from..from + n],
                "write: {n} bytes at {at} on {channels} channels"
            );
        }

        // Read the same list back into a fresh GPU region, cut another way.
        let back = region(&a, Some(&ga), len, None);
        let started = std::time::Instant::now();
        let rx = ab
            .read(&segments(&back, &[1000, len - 2000, 1000]), &remote)
            .expect("read");
        assert_eq!(rx.wait(DEADLINE).expect("read"), len as u64);
        println!(
            "one-sided GPU→GPU read of {len} bytes on {channels} channels: {:?}",
            started.elapsed()
        );
        verify_region(
            &back,
            len,
            seed,
            &format!("one-sided read on {channels} channels"),
        );
        assert_eq!(b.access_refusals(), 0);
        assert!(ab.error().is_none());
    }
}

/// Small one-sided operations on GPU memory travel inline (issue 25: a 4 KiB GPU write
/// through the staged comms took 2.7 × the host one): writes of 1 B … 64 KiB in one to three
/// blocks, from GPU (and mixed GPU + host) lists into GPU and host targets, one at a time,
/// read back into GPU memory; every byte checked, every operation served inline, nothing
/// refused.
#[test]
fn small_one_sided_operations_on_gpu_memory_travel_inline() {
    loopback();
    let Some((ga, gb)) = gpus() else { return };
    let (a, b, ab, _ba) = pair(2, 512 << 10);
    const LEN: usize = 256 << 10;
    let src = region(&a, Some(&ga), LEN, Some(41));
    let host_src = region(&a, None, LEN, Some(42));
    let targets = [
        region(&b, Some(&gb), LEN, None),
        region(&b, None, LEN, None),
    ];
    let d = [
        b.advertise(&targets[0]).unwrap(),
        b.advertise(&targets[1]).unwrap(),
    ];
    let back = region(&a, Some(&ga), LEN, None);
    let mut sources = [vec![0u8; LEN], vec![0u8; LEN]];
    fill(&mut sources[0], 41);
    fill(&mut sources[1], 42);
    let mut served = 0;
    for (round, &len) in [1usize, 100, 4096, 4097, 8192, 16384, 65536]
        .iter()
        .enumerate()
    {
        for target in 0..2 {
            // Up to three pieces: GPU, host, GPU (a list may mix memory inline).
            let cuts = [len / 3, len / 3, len - 2 * (len / 3)];
            let mut local = Vec::new();
            let mut remote = Vec::new();
            let mut expected = Vec::new();
            for (i, &n) in cuts.iter().enumerate().filter(|(_, &n)| n > 0) {
                let (from_region, from_bytes) = if i == 1 {
                    (&host_src, &sources[1])
                } else {
                    (&src, &sources[0])
                };
                let from = 1000 * (round + 1) + i * 30000;
                let to = i * (32 << 10) + round;
                local.push(Segment::new(from_region, from, n));
                remote.push(RemoteSegment::new(d[target], to as u64, n as u64));
                expected.push((to, from_bytes[from..from + n].to_vec()));
            }
            let tx = ab.write(&local, &remote, None).expect("write");
            assert_eq!(tx.wait(DEADLINE).expect("write"), len as u64);
            served += 1;
            let landed = bytes_of(&targets[target]);
            for (to, bytes) in &expected {
                assert!(
                    landed[*to..to + bytes.len()] == bytes[..],
                    "{len} bytes into target {target}: differs"
                );
            }
            let rx = ab
                .read(&[Segment::new(&back, round, len)], &remote)
                .expect("read");
            assert_eq!(rx.wait(DEADLINE).expect("read"), len as u64);
            served += 1;
            let read = bytes_of(&back);
            let want: Vec<u8> = expected
                .iter()
                .flat_map(|(_, b)| b.iter().copied())
                .collect();
            assert!(
                read[round..round + len] == want[..],
                "{len} bytes read back from target {target}: differs"
            );
        }
    }
    // A list over eight tensors registered one by one (UCCL's `writev`): one inline
    // operation, whose blocks each side copies with one GPU round trip.
    const TENSOR: usize = 2048;
    let tensors: Vec<Region> = (0..8)
        .map(|i| region(&a, Some(&ga), TENSOR, Some(60 + i)))
        .collect();
    let remote_tensors: Vec<Region> = (0..8)
        .map(|_| region(&b, Some(&gb), TENSOR, None))
        .collect();
    let descriptors: Vec<_> = remote_tensors
        .iter()
        .map(|r| b.advertise(r).unwrap())
        .collect();
    let local: Vec<Segment> = tensors.iter().map(|r| Segment::new(r, 0, TENSOR)).collect();
    let remote: Vec<RemoteSegment> = descriptors
        .iter()
        .map(|&d| RemoteSegment::new(d, 0, TENSOR as u64))
        .collect();
    let tx = ab.write(&local, &remote, None).expect("writev");
    assert_eq!(tx.wait(DEADLINE).expect("writev"), 8 * TENSOR as u64);
    served += 1;
    for (i, r) in remote_tensors.iter().enumerate() {
        verify_region(r, TENSOR, 60 + i as u64, &format!("tensor {i} written"));
    }
    let backs: Vec<Region> = (0..8)
        .map(|_| region(&a, Some(&ga), TENSOR, None))
        .collect();
    let back_segments: Vec<Segment> = backs.iter().map(|r| Segment::new(r, 0, TENSOR)).collect();
    let rx = ab.read(&back_segments, &remote).expect("readv");
    assert_eq!(rx.wait(DEADLINE).expect("readv"), 8 * TENSOR as u64);
    served += 1;
    for (i, r) in backs.iter().enumerate() {
        verify_region(r, TENSOR, 60 + i as u64, &format!("tensor {i} read back"));
    }
    assert_eq!(
        b.inline_served(),
        served,
        "every operation was served inline"
    );
    assert_eq!(b.access_refusals(), 0);
    assert!(ab.error().is_none());
}

/// A region's bytes, copied to the host.
fn bytes_of(region: &Region) -> Vec<u8> {
    let mut out = vec![0u8; region.len()];
    region.read(0, &mut out).expect("read region");
    out
}

/// Channels of the ring tests' connections, and the rings one side of such a connection holds:
/// a send and a receive ring per channel, in both halves.
const RING_CHANNELS: u16 = 2;
const RINGS_PER_SIDE: u64 = 2 * 2 * RING_CHANNELS as u64;

/// Staging rings held by `conn`'s lanes, both halves (two-sided and one-sided channels).
fn rings(conn: &tcpx_runtime::Connection) -> u64 {
    conn.stats()
        .iter()
        .chain(conn.one_sided_stats().iter())
        .map(|s| s.staging_rings)
        .sum()
}

/// Issue 25, no first-transfer tax: with CUDA memory registered before the connection, every
/// lane's ring exists once `connect` / `accept` return (a send and a receive ring per channel,
/// both halves), before any transfer; with CUDA memory registered after, `Connection::register`
/// makes them. The first transfers then make none, and their data is right.
#[test]
fn staging_rings_exist_after_connect_when_cuda_memory_is_registered() {
    loopback();
    let Some((ga, gb)) = gpus() else { return };
    let a = Endpoint::new(config(RING_CHANNELS, 512 << 10)).expect("endpoint a");
    let b = Endpoint::new(config(RING_CHANNELS, 512 << 10)).expect("endpoint b");
    let src = region(&a, Some(&ga), 4 << 20, None);
    let dst = region(&b, Some(&gb), 4 << 20, None);
    let started = std::time::Instant::now();
    let (ab, ba) = connect(&a, &b);
    println!("connect with staged CUDA memory: {:?}", started.elapsed());
    assert_eq!(
        (rings(&ab), rings(&ba)),
        (RINGS_PER_SIDE, RINGS_PER_SIDE),
        "rings made at connect"
    );
    for (i, len) in [4096usize, 64 << 10, 1 << 20, 4 << 20]
        .into_iter()
        .enumerate()
    {
        let seed = 2500 + i as u64;
        let mut bytes = vec![0u8; len];
        fill(&mut bytes, seed);
        src.write(0, &bytes).expect("write");
        let started = std::time::Instant::now();
        send_verified(&ab, &ba, &src, &dst, len, seed);
        println!("transfer {i} ({len} bytes): {:?}", started.elapsed());
    }
    assert_eq!(
        (rings(&ab), rings(&ba)),
        (RINGS_PER_SIDE, RINGS_PER_SIDE),
        "transfers made none"
    );

    // Connected first, CUDA memory registered on the connection afterwards.
    let c = Endpoint::new(config(RING_CHANNELS, 512 << 10)).expect("endpoint c");
    let d = Endpoint::new(config(RING_CHANNELS, 512 << 10)).expect("endpoint d");
    let (cd, dc) = connect(&c, &d);
    assert_eq!((rings(&cd), rings(&dc)), (0, 0), "no CUDA memory yet");
    let late = region(&c, Some(&ga), 1 << 20, Some(7));
    cd.register(&late).expect("register");
    assert_eq!(rings(&cd), RINGS_PER_SIDE, "rings made at registration");
    assert!(ab.error().is_none() && ba.error().is_none() && cd.error().is_none());
}

/// Rings are reserved when CUDA memory is registered, at the endpoint's own chunk size; a
/// connection to a peer with a smaller chunk agrees on the smaller one, and the lanes that
/// find no ring of exactly that size take the larger reserved ones (the 512 KiB endpoint's:
/// all of its lanes with two GPUs, half of the connection's with one, where the 96 KiB
/// endpoint's rings fit the others), filling each slot only up to the agreed chunk. Bytes
/// moved both ways, two-sided and one-sided, land whole and no lane makes a ring later.
#[test]
fn rings_reserved_for_a_larger_chunk_carry_a_connection_that_agreed_a_smaller_one() {
    loopback();
    let Some((ga, gb)) = gpus() else { return };
    let a = Endpoint::new(config(RING_CHANNELS, 512 << 10)).expect("endpoint a");
    let b = Endpoint::new(config(RING_CHANNELS, 96 << 10)).expect("endpoint b");
    let len = (3 << 20) + 4099;
    let on_a = region(&a, Some(&ga), len, None);
    let on_b = region(&b, Some(&gb), len, None);
    let (ab, ba) = connect(&a, &b);
    assert_eq!((ab.chunk_bytes(), ba.chunk_bytes()), (96 << 10, 96 << 10));
    assert_eq!(
        (rings(&ab), rings(&ba)),
        (RINGS_PER_SIDE, RINGS_PER_SIDE),
        "rings made at connect"
    );
    for (i, n) in [4096usize, (96 << 10) + 1, len].into_iter().enumerate() {
        let seed = 2600 + i as u64;
        write_pattern(&on_a, n, seed);
        send_verified(&ab, &ba, &on_a, &on_b, n, seed);
        write_pattern(&on_b, n, seed + 50);
        send_verified(&ba, &ab, &on_b, &on_a, n, seed + 50);
    }
    // One-sided, through the other half's rings; the notification comes once every byte
    // landed.
    let advert = b.advertise(&on_b).expect("advertise");
    write_pattern(&on_a, len, 2700);
    let write = ab
        .write(
            &[Segment::new(&on_a, 0, len)],
            &[RemoteSegment::new(advert, 0, len as u64)],
            Some(b"smaller chunk"),
        )
        .expect("write");
    assert_eq!(write.wait(DEADLINE).expect("write done"), len as u64);
    assert!(common::eventually(DEADLINE, || !b
        .notifications()
        .is_empty()));
    verify_region(&on_b, len, 2700, "one-sided write through larger slots");
    assert_eq!(
        (rings(&ab), rings(&ba)),
        (RINGS_PER_SIDE, RINGS_PER_SIDE),
        "transfers made none"
    );
    assert!(ab.error().is_none() && ba.error().is_none());
}

/// Issue 25: a vLLM-like list of scattered 16 KiB GPU blocks written with a notification and
/// read back, packed through the ring slots (one gather launch per chunk on the sending side,
/// one scatter on the receiving side), every byte checked; printed next to one contiguous
/// transfer of the same bytes for the record (no timed assertion).
#[test]
fn a_kv_list_of_gpu_blocks_is_gathered_and_scattered_by_the_rings() {
    loopback();
    let Some((ga, gb)) = gpus() else { return };
    const BLOCK: usize = 16 << 10;
    const BLOCKS: usize = 1024;
    const LEN: usize = BLOCK * BLOCKS;
    let (a, b, ab, _ba) = pair(4, 512 << 10);
    let src = region(&a, Some(&ga), 2 * LEN, Some(4040));
    let kv = region(&b, Some(&gb), 2 * LEN, None);
    let d = b.advertise(&kv).expect("advertise");
    let local: Vec<Segment<'_>> = (0..BLOCKS)
        .map(|i| Segment::new(&src, 2 * i * BLOCK, BLOCK))
        .collect();
    let remote: Vec<RemoteSegment> = (0..BLOCKS)
        .map(|i| RemoteSegment::new(d, ((2 * i + 1) * BLOCK) as u64, BLOCK as u64))
        .collect();
    for round in 0..3 {
        let started = std::time::Instant::now();
        let tx = ab.write(&local, &remote, Some(b"kv")).expect("write");
        assert_eq!(tx.wait(DEADLINE).expect("write"), LEN as u64);
        println!(
            "write {BLOCKS} × {BLOCK} B, round {round}: {:?}",
            started.elapsed()
        );
    }
    let sent = bytes_of(&src);
    let got = bytes_of(&kv);
    for i in 0..BLOCKS {
        let (at, from) = ((2 * i + 1) * BLOCK, 2 * i * BLOCK);
        assert!(got[at..at + BLOCK] == sent[from..from + BLOCK], "block {i}");
        assert!(
            got[at - BLOCK..at].iter().all(|&x| x == 0),
            "gap before {i}"
        );
    }
    let back = region(&a, Some(&ga), 2 * LEN, None);
    let local_back: Vec<Segment<'_>> = (0..BLOCKS)
        .map(|i| Segment::new(&back, (2 * i + 1) * BLOCK, BLOCK))
        .collect();
    let started = std::time::Instant::now();
    let rx = ab.read(&local_back, &remote).expect("read");
    assert_eq!(rx.wait(DEADLINE).expect("read"), LEN as u64);
    println!("read {BLOCKS} × {BLOCK} B: {:?}", started.elapsed());
    let got = bytes_of(&back);
    for i in 0..BLOCKS {
        let (at, from) = ((2 * i + 1) * BLOCK, 2 * i * BLOCK);
        assert!(
            got[at..at + BLOCK] == sent[from..from + BLOCK],
            "read block {i}"
        );
    }
    let contiguous = [Segment::new(&src, 0, LEN)];
    let whole = [RemoteSegment::new(d, 0, LEN as u64)];
    let started = std::time::Instant::now();
    let tx = ab.write(&contiguous, &whole, None).expect("write");
    assert_eq!(tx.wait(DEADLINE).expect("write"), LEN as u64);
    println!("write one contiguous {LEN} B: {:?}", started.elapsed());
    let stats = ab.pack_stats();
    assert!(
        stats.packed_sent >= 3 && stats.packed_received >= 1,
        "{stats:?}"
    );
    assert!(ab.error().is_none());
}

/// Many small messages of GPU memory in flight at once, one call each, ride eager frames: the
/// engines copy each frame's run of messages out of (and into) device memory as one copy list
/// through the GPU's small copier. Sources take turns between two regions of the case's memory
/// and one of host memory (runs end where the memory kind changes), destinations between a
/// region of the case's memory and one of host memory; the cases are GPU → GPU, GPU → host and
/// host → GPU; receives are posted both before the sends and after the messages arrived (held
/// in their frames until then). Every byte is checked.
#[test]
fn small_gpu_messages_ride_eager_frames_in_copy_lists() {
    loopback();
    let Some((ga, gb)) = gpus() else { return };
    let (a, b, ab, ba) = pair(4, 512 << 10);
    assert!(
        ab.eager_bytes() >= 64 << 10,
        "eager frames are on for this pair"
    );
    let slots = 48usize;
    let count = 3 * slots;
    for len in [1usize, 100, 4096, (16 << 10) + 5, 64 << 10] {
        for (what, src_gpu, dst_gpu) in [
            ("GPU → GPU", Some(&ga), Some(&gb)),
            ("GPU → host", Some(&ga), None),
            ("host → GPU", None, Some(&gb)),
        ] {
            // Message i comes from source i % 3 (the third one host memory), slot (i / 3) %
            // slots, whose pattern is seed(i % 3, slot); it lands in destination `i % 4 == 3`
            // (host memory) or the case's, at slot i.
            let seed = |source: usize, slot: usize| (len * 1000 + source * 100 + slot) as u64;
            let sources: Vec<Region> = (0..3)
                .map(|r| {
                    let src = region(&a, if r < 2 { src_gpu } else { None }, slots * len, None);
                    let mut bytes = vec![0u8; slots * len];
                    for (slot, chunk) in bytes.chunks_exact_mut(len).enumerate() {
                        fill(chunk, seed(r, slot));
                    }
                    src.write(0, &bytes).expect("fill the source");
                    src
                })
                .collect();
            let dsts = [
                region(&b, dst_gpu, count * len, None),
                region(&b, None, count * len, None),
            ];
            let dst_of = |i: usize| &dsts[usize::from(i % 4 == 3)];
            for late in [false, true] {
                let post_receives = || -> Vec<_> {
                    (0..count)
                        .map(|i| ba.recv(dst_of(i), i * len, len).expect("post recv"))
                        .collect()
                };
                let early = (!late).then(post_receives);
                let sends: Vec<_> = (0..count)
                    .map(|i| {
                        ab.send(&sources[i % 3], ((i / 3) % slots) * len, len)
                            .expect("post send")
                    })
                    .collect();
                if late {
                    // Let the messages arrive and wait in their frames first.
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                let receives = early.unwrap_or_else(post_receives);
                for t in sends.into_iter().chain(receives) {
                    assert_eq!(t.wait(DEADLINE).expect("transfer"), len as u64);
                }
                let backs: Vec<Vec<u8>> = dsts
                    .iter()
                    .map(|d| {
                        let mut back = vec![0u8; count * len];
                        d.read(0, &mut back).expect("read back");
                        d.write(0, &vec![0u8; count * len]).expect("clear");
                        back
                    })
                    .collect();
                for i in 0..count {
                    let got = &backs[usize::from(i % 4 == 3)][i * len..(i + 1) * len];
                    if let Err(at) = check(got, seed(i % 3, (i / 3) % slots)) {
                        panic!("{what}, {len} B, late {late}: message {i} differs at byte {at}");
                    }
                }
            }
            println!("{what}: {count} messages of {len} B, receives early and late: every byte");
        }
    }
    assert!(ab.error().is_none() && ba.error().is_none());
}
