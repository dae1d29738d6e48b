//! Times the ways of copying a few KiB between device memory and host bytes, one at a time
//! (what a small one-sided operation carried inline pays on each side): the small copier,
//! synchronous driver copies from pinned and pageable memory, and an async copy waited for
//! by polling the stream; then lists of pieces in separate allocations (a `writev` over
//! tensors) gathered and scattered each way a [`ListCopy`] names (a `cuMemcpyAsync` per
//! piece, one `cuMemcpyBatchAsync`, one kernel launch). Prints p50 and p99 in µs per way and direction. Needs a GPU.
//!
//! `cargo run --release -p tcpx --example small_copy_bench -- [bytes] [iterations] [gap-µs]`
//!
//! With a gap, each timed copy follows that many µs of an untimed spin, as the copies of
//! one-at-a-time operations do (a 4 KiB inline write spends about 25 µs between its two).

use std::time::Instant;

use cudarc::driver::sys;
use tcpx::cuda::{self, CudaDevice, ListCopy, SmallCopier};
use tcpx::SharedMemory;

fn percentiles(mut t: Vec<f64>) -> (f64, f64) {
    t.sort_by(f64::total_cmp);
    (t[t.len() / 2], t[t.len() * 99 / 100])
}

/// Untimed spin before each timed call (the third argument, µs).
static GAP_US: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn time(iters: usize, mut f: impl FnMut()) -> (f64, f64) {
    for _ in 0..iters / 10 {
        f();
    }
    let gap = std::time::Duration::from_micros(GAP_US.load(std::sync::atomic::Ordering::Relaxed));
    let samples = (0..iters)
        .map(|_| {
            let idle = Instant::now();
            while idle.elapsed() < gap {
                std::hint::spin_loop();
            }
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    percentiles(samples)
}

fn ok(rc: sys::CUresult) {
    assert_eq!(rc, sys::CUresult::CUDA_SUCCESS);
}

fn main() -> tcpx::Result<()> {
    if let Some(why) = cuda::skip_reason() {
        println!("{why}");
        return Ok(());
    }
    let mut args = std::env::args().skip(1);
    let bytes: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(4096);
    let iters: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(2000);
    let gap_us: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(0);
    GAP_US.store(gap_us, std::sync::atomic::Ordering::Relaxed);
    let gpu = CudaDevice::new(0)?;
    let device = SharedMemory::new(gpu.alloc(1 << 20)?);
    // What an endpoint's first CUDA registration pays for the process's copier, as the
    // environment asks (`TCPX_SMALL_COPY_LISTS`: the kernel is loaded unless it says
    // `batch` or `each`).
    let made = Instant::now();
    let first = SmallCopier::new(&gpu)?;
    println!(
        "a copier ({:?}) made in {:.2} ms",
        first.list_copy(),
        made.elapsed().as_secs_f64() * 1e3
    );
    drop(first);
    // A copier of its own, with the gather kernel loaded, so that every list way can be timed.
    let copier = SmallCopier::with_kernel(&gpu)?;
    let mut pinned = gpu.alloc_pinned(1 << 20)?;
    let mut pageable = vec![7u8; bytes];
    let stream = gpu.stream()?;
    let dev = device.as_ptr() as u64;
    println!("{bytes} bytes, {iters} copies each, {gap_us} µs apart: p50 / p99 µs");
    let report = |what: &str, (p50, p99): (f64, f64)| println!("{what:<44} {p50:7.1} {p99:7.1}");

    let mut out = Vec::with_capacity(bytes);
    report(
        "D2H SmallCopier::read_ranges",
        time(iters, || {
            out.clear();
            copier.read_ranges(&device, [(0, bytes)], &mut out).unwrap();
        }),
    );
    report(
        "H2D SmallCopier::write_ranges",
        time(iters, || {
            copier.write_ranges(&device, [(0, &pageable[..])]).unwrap();
        }),
    );
    // The same from a thread with no context current (as the runtime's control loops): each
    // copy pushes and pops the GPU's context.
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut out = Vec::with_capacity(bytes);
            report(
                "D2H SmallCopier, no context current",
                time(iters, || {
                    out.clear();
                    copier.read_ranges(&device, [(0, bytes)], &mut out).unwrap();
                }),
            );
            report(
                "H2D SmallCopier, no context current",
                time(iters, || {
                    copier.write_ranges(&device, [(0, &pageable[..])]).unwrap();
                }),
            );
        });
    });
    // Lists: n allocations, one piece each, at most 64 KiB in all.
    for n in [2usize, 4, 16, 64] {
        let piece = bytes.min(tcpx::cuda::SMALL_COPY_BOUNCE_BYTES / n);
        let tensors = (0..n)
            .map(|_| Ok(SharedMemory::new(gpu.alloc(piece)?)))
            .collect::<tcpx::Result<Vec<_>>>()?;
        let data = vec![3u8; piece];
        for how in [
            ListCopy::Each,
            ListCopy::Batch,
            ListCopy::Kernel,
            ListCopy::Auto,
        ] {
            if !copier.set_list_copy(how) {
                println!("{how:?}: not available here");
                continue;
            }
            let mut out = Vec::with_capacity(n * piece);
            report(
                &format!("D2H {n} x {piece} B, {how:?}"),
                time(iters, || {
                    out.clear();
                    copier
                        .gather(tensors.iter().map(|t| (t, 0, piece)), &mut out)
                        .unwrap();
                }),
            );
            report(
                &format!("H2D {n} x {piece} B, {how:?}"),
                time(iters, || {
                    copier
                        .scatter(tensors.iter().map(|t| (t, 0, &data[..])))
                        .unwrap();
                }),
            );
        }
        for t in copier.auto_list_times() {
            println!(
                "  Auto learned ({}, {:?} copies): copy engines {:?}, kernel {:?}",
                if t.to_device { "H2D" } else { "D2H" },
                t.copies,
                t.engines,
                t.kernel
            );
        }
        copier.set_list_copy(ListCopy::Batch);
    }
    gpu.bind()?;
    let host = pinned.as_mut_slice().as_mut_ptr() as usize;
    let page = pageable.as_mut_ptr() as usize;
    let s = stream.raw() as usize;
    // Each case is one raw driver call sequence on the buffers above: `copy(case)` runs
    // `case` with their addresses, every copy complete when it returns.
    let copy = |case: u8| {
        let (host, page, s) = (host as *mut u8, page as *mut u8, s as sys::CUstream);
        // SAFETY: every range lies inside a live allocation made above (`bytes` ≤ 1 MiB of
        // device and pinned memory, `pageable` holds `bytes`), no Rust reference to them is
        // alive meanwhile, and each copy is synchronized before the call returns.
        unsafe {
            match case {
                0 => ok(sys::cuMemcpyDtoH_v2(host.cast(), dev, bytes)),
                1 => ok(sys::cuMemcpyHtoD_v2(dev, host.cast(), bytes)),
                2 => ok(sys::cuMemcpyDtoH_v2(page.cast(), dev, bytes)),
                3 => {
                    ok(sys::cuMemcpyHtoD_v2(dev, page.cast(), bytes));
                    ok(sys::cuStreamSynchronize(std::ptr::null_mut()));
                }
                4 => {
                    ok(sys::cuMemcpyDtoHAsync_v2(host.cast(), dev, bytes, s));
                    ok(sys::cuStreamSynchronize(s));
                }
                5 => {
                    ok(sys::cuMemcpyHtoDAsync_v2(dev, host.cast(), bytes, s));
                    ok(sys::cuStreamSynchronize(s));
                }
                6 => {
                    ok(sys::cuMemcpyDtoHAsync_v2(host.cast(), dev, bytes, s));
                    while sys::cuStreamQuery(s) != sys::CUresult::CUDA_SUCCESS {}
                }
                7 => {
                    ok(sys::cuMemcpyHtoDAsync_v2(dev, host.cast(), bytes, s));
                    while sys::cuStreamQuery(s) != sys::CUresult::CUDA_SUCCESS {}
                }
                8 => {
                    ok(sys::cuMemcpyHtoDAsync_v2(dev, page.cast(), bytes, s));
                    ok(sys::cuStreamSynchronize(s));
                }
                9 => ok(sys::cuStreamSynchronize(s)),
                _ => {
                    ok(sys::cuMemsetD8Async(dev, 1, 1, s));
                    ok(sys::cuStreamSynchronize(s));
                }
            }
        }
    };
    for (case, what) in [
        "D2H cuMemcpyDtoH, pinned",
        "H2D cuMemcpyHtoD, pinned",
        "D2H cuMemcpyDtoH, pageable",
        "H2D cuMemcpyHtoD, pageable (+ ctx sync)",
        "D2H async pinned + cuStreamSynchronize",
        "H2D async pinned + cuStreamSynchronize",
        "D2H async pinned + cuStreamQuery spin",
        "H2D async pinned + cuStreamQuery spin",
        "H2D async pageable + cuStreamSynchronize",
        "cuStreamSynchronize of an idle stream",
        "cuMemsetD8Async 1 byte + cuStreamSynchronize",
    ]
    .into_iter()
    .enumerate()
    {
        report(what, time(iters, || copy(case as u8)));
    }
    pageable[0] = 1;
    Ok(())
}
