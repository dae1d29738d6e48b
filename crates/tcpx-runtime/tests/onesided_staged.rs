//! One-sided WRITE / READ on staged regions without a GPU: regions registered with
//! `Endpoint::register_staged_emulation` take the staged route (the engines' pinned rings,
//! CPU copies standing in for the GPU's, each reported done one poll late), on the initiator,
//! on the target, or both. Random descriptor lists with their contents checked, notifications
//! never ahead of their data, and a remote list mixing staged and host memory refused with
//! `UnsupportedMemory` leaving every byte as it was. The GPU version is in `gpu_staged.rs`.

mod common;

use std::time::Instant;

use common::*;
use tcpx_runtime::{Descriptor, Endpoint, Error, Region, RemoteSegment, Segment};

/// A region of `len` bytes on `ep`, staged (emulated) or plain host memory, zeroed.
fn region(ep: &Endpoint, staged: bool, len: usize) -> Region {
    let r = if staged {
        let memory = tcpx::SharedMemory::host(len).expect("host memory");
        ep.register_staged_emulation(memory)
            .expect("register_staged_emulation")
    } else {
        ep.alloc_host(len).expect("alloc_host")
    };
    assert_eq!(r.is_staged(), staged);
    r
}

/// As [`region`], filled with `fill(seed)`.
fn filled(ep: &Endpoint, staged: bool, len: usize, seed: u64) -> Region {
    let r = region(ep, staged, len);
    write_pattern(&r, len, seed);
    r
}

fn label(staged: bool) -> &'static str {
    if staged {
        "staged"
    } else {
        "host"
    }
}

/// Random lists written from `local_staged` memory on a into `remote_staged` memory on b
/// (two advertised regions), checked block by block, then read back into a fresh local
/// region cut another way and checked. Some rounds use small blocks (batches the packing
/// rule would pack in host memory): staged memory on either side must never pack.
fn random_lists(local_staged: bool, remote_staged: bool, seed: u64) {
    let (a, b, ab, _ba) = pair(3, 64 << 10);
    let what = format!("{} → {}", label(local_staged), label(remote_staged));
    let mut rng = Rng(seed);
    const REGION: usize = 1 << 20;
    let t = [
        region(&b, remote_staged, REGION),
        region(&b, remote_staged, REGION),
    ];
    let d = [b.advertise(&t[0]).unwrap(), b.advertise(&t[1]).unwrap()];
    for round in 0..8u64 {
        let small = round % 2 == 1;
        let total = if small {
            1 + rng.below(256 << 10) as usize
        } else {
            1 + rng.below(600 << 10) as usize
        };
        let max_block = if small { 4 << 10 } else { 96 << 10 };
        let pattern = seed * 100 + round;
        let src = filled(&a, local_staged, total, pattern);
        let local_layout = random_layout(&mut rng, total, total, max_block);
        let remote_layout = random_layout(&mut rng, total, REGION, max_block);
        // Each block goes to one of the two regions, at its offset: the blocks of one
        // region never overlap.
        let which: Vec<usize> = remote_layout
            .iter()
            .map(|_| rng.below(2) as usize)
            .collect();
        let local: Vec<Segment<'_>> = local_layout
            .iter()
            .map(|&(o, l)| Segment::new(&src, o, l))
            .collect();
        let remote: Vec<RemoteSegment> = remote_layout
            .iter()
            .zip(&which)
            .map(|(&(o, l), &w)| RemoteSegment::new(d[w], o as u64, l as u64))
            .collect();
        let tx = ab.write(&local, &remote, None).unwrap();
        assert_eq!(
            tx.wait(DEADLINE).unwrap(),
            total as u64,
            "{what}: write round {round}"
        );
        let expected = snapshot(&src);
        let got = [snapshot(&t[0]), snapshot(&t[1])];
        let mut pos = 0;
        for (&(o, l), &w) in remote_layout.iter().zip(&which) {
            assert!(
                got[w][o..o + l] == expected[pos..pos + l],
                "{what}: write round {round}: block of {l} bytes at {o} in region {w}"
            );
            pos += l;
        }

        let back = region(&a, local_staged, total);
        let back_layout = random_layout(&mut rng, total, total, max_block);
        let local: Vec<Segment<'_>> = back_layout
            .iter()
            .map(|&(o, l)| Segment::new(&back, o, l))
            .collect();
        let rx = ab.read(&local, &remote).unwrap();
        assert_eq!(
            rx.wait(DEADLINE).unwrap(),
            total as u64,
            "{what}: read round {round}"
        );
        if let Err(at) = check(&snapshot(&back), pattern) {
            panic!("{what}: read round {round}: differs at byte {at} of {total}");
        }
    }
    let stats = ab.pack_stats();
    assert_eq!(
        (stats.packed_sent, stats.packed_received),
        (0, 0),
        "{what}: staged memory never packs"
    );
    assert_eq!(b.access_refusals(), 0);
    assert!(ab.error().is_none());
}

#[test]
fn random_lists_staged_to_staged() {
    loopback();
    random_lists(true, true, 11);
}

#[test]
fn random_lists_staged_initiator_host_target() {
    loopback();
    random_lists(true, false, 12);
}

#[test]
fn random_lists_host_initiator_staged_target() {
    loopback();
    random_lists(false, true, 13);
}

/// A staged target delivers each write's notification only once every byte of it landed:
/// its chunks are retired only after their ring → memory copies completed.
fn notifications_follow_their_data(local_staged: bool) {
    // Small chunks: each write is many staged chunks on every channel.
    let (a, b, ab, _ba) = pair(4, 16 << 10);
    const N: usize = 12;
    const LEN: usize = 1 << 20;
    let targets: Vec<Region> = (0..N).map(|_| region(&b, true, LEN)).collect();
    let descriptors: Vec<Descriptor> = targets.iter().map(|r| b.advertise(r).unwrap()).collect();
    let sources: Vec<Region> = (0..N)
        .map(|i| filled(&a, local_staged, LEN, 500 + i as u64))
        .collect();
    let order = std::thread::scope(|s| {
        let checker = s.spawn(|| {
            // At each delivery, the whole region of that write must already hold its data.
            let mut order = Vec::new();
            let deadline = Instant::now() + DEADLINE;
            while order.len() < N + 1 && Instant::now() < deadline {
                for (_, bytes) in b.notifications() {
                    let text = String::from_utf8(bytes).unwrap();
                    if let Some(i) = text.strip_prefix("done ") {
                        let i: usize = i.parse().unwrap();
                        if let Err(at) = check(&snapshot(&targets[i]), 500 + i as u64) {
                            panic!("write {i} at its notification: byte {at} not landed yet");
                        }
                    }
                    order.push(text);
                }
                std::thread::yield_now();
            }
            order
        });
        let mut transfers = Vec::new();
        for i in 0..N {
            let note = format!("done {i}");
            transfers.push(
                ab.write(
                    &[Segment::new(&sources[i], 0, LEN)],
                    &[RemoteSegment::new(descriptors[i], 0, LEN as u64)],
                    Some(note.as_bytes()),
                )
                .unwrap(),
            );
        }
        ab.notify(b"all sent").unwrap();
        for t in &transfers {
            assert_eq!(t.wait(DEADLINE).unwrap(), LEN as u64);
        }
        checker.join().unwrap()
    });
    let mut expected: Vec<String> = (0..N).map(|i| format!("done {i}")).collect();
    expected.push("all sent".into());
    assert_eq!(order, expected, "notifications in send order");
}

#[test]
fn a_notification_into_staged_memory_follows_its_data() {
    loopback();
    notifications_follow_their_data(true);
    notifications_follow_their_data(false);
}

#[test]
fn a_remote_list_mixing_staged_and_host_memory_is_refused_and_changes_nothing() {
    loopback();
    let (a, b, ab, _ba) = pair(3, 64 << 10);
    const LEN: usize = 1 << 20;
    let staged = filled(&b, true, LEN, 900);
    let host = filled(&b, false, LEN, 901);
    let ds = b.advertise(&staged).unwrap();
    let dh = b.advertise(&host).unwrap();
    let before = (snapshot(&staged), snapshot(&host));
    let src = filled(&a, false, 3 * (256 << 10), 77);
    let refusals = b.access_refusals();

    // Write: staged, staged, host → the third entry is named.
    let remote = [
        RemoteSegment::new(ds, 0, 256 << 10),
        RemoteSegment::new(ds, 512 << 10, 256 << 10),
        RemoteSegment::new(dh, 0, 256 << 10),
    ];
    let tx = ab
        .write(
            &[Segment::new(&src, 0, 3 * (256 << 10))],
            &remote,
            Some(b"must not arrive"),
        )
        .unwrap();
    let (index, why) = access_error(tx.wait(DEADLINE));
    assert_eq!(index, 2, "the error names the first entry of other memory");
    assert!(why.contains("mixes staged"), "{why:?}");
    assert_eq!(b.access_refusals(), refusals + 1);

    // Read: host, staged → refused, nothing read.
    let back = region(&a, false, 512 << 10);
    let rx = ab
        .read(
            &[Segment::new(&back, 0, 512 << 10)],
            &[
                RemoteSegment::new(dh, 0, 256 << 10),
                RemoteSegment::new(ds, 0, 256 << 10),
            ],
        )
        .unwrap();
    let (index, why) = access_error(rx.wait(DEADLINE));
    assert_eq!(index, 1);
    assert!(why.contains("mixes staged"), "{why:?}");
    assert_eq!(b.access_refusals(), refusals + 2);
    assert!(
        snapshot(&back).iter().all(|&x| x == 0),
        "a refused read wrote"
    );

    assert!(
        (snapshot(&staged), snapshot(&host)) == before,
        "a refused request changed target memory"
    );
    assert!(
        b.notifications().is_empty(),
        "a refused write's notification"
    );

    // The lanes are still in step: good writes to each kind land.
    for (d, r) in [(ds, &staged), (dh, &host)] {
        let tx = ab
            .write(
                &[Segment::new(&src, 0, 256 << 10)],
                &[RemoteSegment::new(d, 0, 256 << 10)],
                None,
            )
            .unwrap();
        assert_eq!(tx.wait(DEADLINE).unwrap(), 256 << 10);
        if let Err(at) = check(&snapshot(r)[..256 << 10], 77) {
            panic!("write after the refusal: differs at byte {at}");
        }
    }
    assert!(ab.error().is_none());
}

#[test]
fn a_local_list_mixing_staged_and_host_memory_is_refused_up_front() {
    loopback();
    let (a, b, ab, _ba) = pair(2, 64 << 10);
    let dst = region(&b, false, 1 << 20);
    let d = b.advertise(&dst).unwrap();
    let staged = filled(&a, true, 4096, 1);
    let host = filled(&a, false, 4096, 2);
    let local = [Segment::new(&staged, 0, 4096), Segment::new(&host, 0, 4096)];
    let remote = [RemoteSegment::new(d, 0, 8192)];
    for result in [
        ab.write(&local, &remote, None).map(|_| ()),
        ab.read(&local, &remote).map(|_| ()),
    ] {
        match result {
            Err(Error::InvalidArgument(why)) => assert!(why.contains("mix staged"), "{why}"),
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }
    // Nothing was sent: the connection still works.
    let tx = ab
        .write(
            &[Segment::new(&staged, 0, 4096)],
            &[RemoteSegment::new(d, 0, 4096)],
            None,
        )
        .unwrap();
    assert_eq!(tx.wait(DEADLINE).unwrap(), 4096);
    assert_eq!(b.access_refusals(), 0);
}
