//! GPU tests of the unpack path: receives into CUDA memory through a plugin that takes CUDA
//! pointers and hands out an UNPACK device handle — the built-in socket plugin in devmem
//! emulation mode (`TCPX_SOCKET_DEVMEM=1`, docs/DEVMEM.md) — so the payload lands in the
//! plugin's GPU bounce buffer and the engines' receive lanes gather it into the destination
//! with the unpack kernel before `irecvConsumed` (engine/unpack.rs). Two endpoints in one
//! process over loopback, both on GPU 0 (the emulation registers CUDA memory of one GPU).
//!
//! The whole binary runs in devmem mode: the variable is set once, before any plugin
//! initializes (every test goes through [`gpu`]); no other test binary sees it. Each test
//! prints "skipped: no CUDA driver (…)" and passes where there is no driver (CI); on a GPU
//! machine they run for real (scripts/gpu/run_gpu_suite.sh).

mod common;

use std::sync::Once;

use common::*;
use tcpx::cuda::{self, CudaDevice};
use tcpx_runtime::{Endpoint, Region, RemoteSegment, Segment};

/// Chunk size: devmem mode refuses receives into CUDA memory over 4 MiB.
const CHUNK: u32 = 512 << 10;

/// GPU 0 with devmem mode on, or `None` (after printing why) without a CUDA driver.
fn gpu() -> Option<CudaDevice> {
    if let Some(why) = cuda::skip_reason() {
        println!("{why}");
        return None;
    }
    loopback();
    static DEVMEM: Once = Once::new();
    DEVMEM.call_once(|| std::env::set_var(tcpx::builtin::DEVMEM_ENV, "1"));
    let g = CudaDevice::new(0).expect("CUDA device 0");
    println!("GPU: {g:?}");
    Some(g)
}

/// A region of `len` bytes on `ep`: CUDA on `gpu`, else host; filled with `fill(seed)` when
/// `seed` is given. CUDA regions must go direct (the plugin takes CUDA pointers).
fn region(ep: &Endpoint, gpu: Option<&CudaDevice>, len: usize, seed: Option<u64>) -> Region {
    let r = match gpu {
        Some(g) => ep.alloc_cuda_on(g, len.max(1)).expect("alloc_cuda"),
        None => ep.alloc_host(len.max(1)).expect("alloc_host"),
    };
    assert!(
        !r.is_staged(),
        "devmem mode takes CUDA pointers: no staging"
    );
    if let Some(seed) = seed {
        write_pattern(&r, len, seed);
    }
    r
}

const SIZES: [usize; 5] = [1, 4097, (1 << 20) + 3, 4 << 20, 64 << 20];

#[test]
fn gpu_to_gpu_all_sizes_on_1_4_8_channels() {
    let Some(g) = gpu() else { return };
    for channels in [1u16, 4, 8] {
        let (a, b, ab, ba) = pair(channels, CHUNK);
        let max = *SIZES.iter().max().unwrap_or(&1);
        let src = region(&a, Some(&g), max, None);
        let dst = region(&b, Some(&g), max, None);
        for (i, &len) in SIZES.iter().enumerate() {
            let seed = u64::from(channels) * 100 + i as u64;
            let mut bytes = vec![0u8; len];
            fill(&mut bytes, seed);
            src.write(0, &bytes).expect("write");
            let started = std::time::Instant::now();
            send_verified(&ab, &ba, &src, &dst, len, seed);
            println!(
                "unpack path GPU→GPU {len} bytes on {channels} channels: {:?}",
                started.elapsed()
            );
        }
        assert!(ab.error().is_none() && ba.error().is_none());
    }
}

#[test]
fn host_to_gpu_and_host_destinations_still_work() {
    let Some(g) = gpu() else { return };
    let (a, b, ab, ba) = pair(4, CHUNK);
    for (i, &len) in SIZES.iter().enumerate() {
        let seed = 1000 + i as u64;
        // host → GPU: the receive lane unpacks.
        let src = region(&a, None, len, Some(seed));
        let dst = region(&b, Some(&g), len, None);
        send_verified(&ab, &ba, &src, &dst, len, seed);
        // GPU → host: the plugin writes host destinations itself (cnt = 0).
        let src = region(&a, Some(&g), len, Some(seed + 50));
        let dst = region(&b, None, len, None);
        send_verified(&ab, &ba, &src, &dst, len, seed + 50);
        // host → host on the same lanes, after their unpack step exists.
        let src = region(&a, None, len, Some(seed + 70));
        let dst = region(&b, None, len, None);
        send_verified(&ab, &ba, &src, &dst, len, seed + 70);
    }
    assert!(ab.error().is_none() && ba.error().is_none());
}

/// Windows fill: many transfers in flight per comm in both directions, CUDA and host
/// destinations interleaved on the same lanes (one window holds unpack and plain receives).
#[test]
fn many_in_flight_both_directions_mixed_destinations() {
    let Some(g) = gpu() else { return };
    for channels in [1u16, 4, 8] {
        let (a, b, ab, ba) = pair(channels, CHUNK);
        let len = (3 << 20) + 11;
        // 16 transfers per comm on one channel; more across channels.
        let count = 16 * usize::from(channels).min(2);
        let mut posted = Vec::new();
        for k in 0..count {
            let seed = 5000 + u64::from(channels) * 100 + k as u64;
            let host_dst = k % 4 == 3;
            let a_src = region(&a, Some(&g), len, Some(seed));
            let b_dst = region(&b, (!host_dst).then_some(&g), len, None);
            let b_src = region(&b, (k % 2 == 0).then_some(&g), len, Some(seed + 500));
            let a_dst = region(&a, Some(&g), len, None);
            let r1 = ba.recv(&b_dst, 0, len).expect("recv b");
            let r2 = ab.recv(&a_dst, 0, len).expect("recv a");
            let s1 = ab.send(&a_src, 0, len).expect("send a");
            let s2 = ba.send(&b_src, 0, len).expect("send b");
            posted.push((seed, b_dst, a_dst, [r1, r2, s1, s2], a_src, b_src));
        }
        for (seed, b_dst, a_dst, handles, _a_src, _b_src) in posted {
            for h in handles {
                assert_eq!(h.wait(DEADLINE).expect("transfer"), len as u64);
            }
            verify_region(&b_dst, len, seed, "a → b");
            verify_region(&a_dst, len, seed + 500, "b → a");
        }
        assert!(ab.error().is_none() && ba.error().is_none());
        println!("{count} transfers each way in flight on {channels} channels: ok");
    }
}

/// A 64 MiB receive into CUDA memory on one channel: 128 chunks through a 16-deep window, so
/// slots wrap many times and several done receives share launches.
#[test]
fn one_large_receive_wraps_the_slots() {
    let Some(g) = gpu() else { return };
    let (a, b, ab, ba) = pair(1, CHUNK);
    let len = 64 << 20;
    let src = region(&a, Some(&g), len, Some(77));
    let dst = region(&b, Some(&g), len, None);
    send_verified(&ab, &ba, &src, &dst, len, 77);
}

/// One-sided WRITE into an advertised GPU region (the target's lane unpacks, in place) with a
/// notification, then READ back into a fresh GPU region (the initiator's lane unpacks).
#[test]
fn one_sided_write_and_read_into_gpu_memory() {
    let Some(g) = gpu() else { return };
    for channels in [1u16, 4] {
        let (a, b, ab, _ba) = pair(channels, CHUNK);
        let len = (9 << 20) + 5;
        let seed = 2000 + u64::from(channels);
        let src = region(&a, Some(&g), len, Some(seed));
        let target = region(&b, Some(&g), 16 << 20, None);
        let d = b.advertise(&target).expect("advertise");
        assert_eq!(d.kind(), tcpx::MemoryKind::Cuda);
        let at = (1 << 20) + 1;
        let remote = [RemoteSegment::new(d, at as u64, len as u64)];
        let tx = ab
            .write(
                &[Segment::new(&src, 0, len)],
                &remote,
                Some(b"unpacked write"),
            )
            .expect("write");
        assert_eq!(tx.wait(DEADLINE).expect("write"), len as u64);
        // The notification comes only after every byte landed in GPU memory.
        let mut notes = Vec::new();
        assert!(common::eventually(DEADLINE, || {
            notes.extend(b.notifications());
            !notes.is_empty()
        }));
        assert_eq!(notes[0].1, b"unpacked write");
        let mut got = vec![0u8; len];
        target.read(at, &mut got).expect("read the target");
        if let Err(off) = check(&got, seed) {
            panic!("one-sided write on {channels} channels differs at byte {off}");
        }
        let back = region(&a, Some(&g), len, None);
        let rx = ab
            .read(&[Segment::new(&back, 0, len)], &remote)
            .expect("read");
        assert_eq!(rx.wait(DEADLINE).expect("read"), len as u64);
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
