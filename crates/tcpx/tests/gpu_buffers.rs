//! GPU tests of `tcpx::cuda` buffers, copies, streams and events. Each test prints
//! "skipped: no CUDA driver (…)" and passes where there is no driver (CI); on a GPU machine
//! they run for real (scripts/gpu/run_gpu_suite.sh).

use std::time::{Duration, Instant};

use tcpx::cuda::{self, CudaBuffer, CudaDevice, ListCopy, PinnedHostBuffer};
use tcpx::{ErrorKind, Memory, MemoryKind, SharedMemory, BUFFER_ALIGN};

/// Device 0, or `None` (after printing why) when there is no CUDA driver.
fn gpu() -> Option<CudaDevice> {
    if let Some(why) = cuda::skip_reason() {
        println!("{why}");
        return None;
    }
    Some(CudaDevice::new(0).expect("CUDA device 0"))
}

fn pattern(len: usize, salt: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).rotate_left(7) as u8 ^ salt)
        .collect()
}

#[test]
fn without_a_driver_everything_is_an_error_not_a_panic() {
    if cuda::driver_available() {
        println!(
            "skipped: a CUDA driver is present ({})",
            cuda::driver_status()
        );
        return;
    }
    println!("no CUDA driver: {}", cuda::driver_status());
    assert_eq!(CudaDevice::count(), 0);
    let err = CudaDevice::new(0).unwrap_err();
    assert!(
        matches!(err.kind(), ErrorKind::Cuda(cuda::CudaError::NoDriver(_))),
        "{err}"
    );
    assert!(err.to_string().contains("no usable CUDA driver"), "{err}");
}

#[test]
fn device_identity() {
    let Some(gpu) = gpu() else { return };
    println!(
        "{}: {} {:?} cc {:?}, {} SMs, {} GiB, driver bus id {}",
        cuda::driver_status(),
        gpu.name(),
        gpu.pci_bus_id(),
        gpu.compute_capability(),
        gpu.multiprocessor_count(),
        gpu.total_memory() >> 30,
        gpu.driver_pci_bus_id().unwrap()
    );
    assert!(CudaDevice::count() >= 1);
    assert_eq!(gpu.ordinal(), 0);
    assert!(!gpu.name().is_empty());
    // "dddd:bb:dd.0", lowercase hex.
    let id = gpu.pci_bus_id();
    let parts: Vec<&str> = id.split([':', '.']).collect();
    assert_eq!(parts.len(), 4, "{id}");
    assert_eq!(
        parts.iter().map(|p| p.len()).collect::<Vec<_>>(),
        [4, 2, 2, 1],
        "{id}"
    );
    assert!(id
        .chars()
        .all(|c| c.is_ascii_digit() || matches!(c, 'a'..='f' | ':' | '.')));
    // The driver prints an 8-digit domain and uppercase hex: same numbers.
    let driver = gpu.driver_pci_bus_id().unwrap().to_ascii_lowercase();
    let (d_dom, d_rest) = driver.split_once(':').unwrap();
    let (o_dom, o_rest) = id.split_once(':').unwrap();
    assert_eq!(
        u32::from_str_radix(d_dom, 16).unwrap(),
        u32::from_str_radix(o_dom, 16).unwrap()
    );
    assert_eq!(d_rest, o_rest);
    let (major, _) = gpu.compute_capability();
    assert!(major >= 7);
    assert!(CudaDevice::new(CudaDevice::count()).is_err());
}

#[test]
fn allocations_are_aligned_and_zeroed() {
    let Some(gpu) = gpu() else { return };
    for len in [1, 100, 4095, 4096, 4097, (1 << 20) + 1, 3 << 20] {
        let buf = gpu.alloc(len).unwrap();
        assert_eq!(buf.len(), len);
        assert_eq!(buf.device_ptr() % BUFFER_ALIGN as u64, 0, "len {len}");
        assert_eq!(Memory::as_ptr(&buf) as u64, buf.device_ptr());
        assert_eq!(buf.kind(), MemoryKind::Cuda);
        assert!(buf.to_vec().unwrap().iter().all(|&b| b == 0), "len {len}");

        let pinned = gpu.alloc_pinned(len).unwrap();
        assert_eq!(pinned.len(), len);
        assert_eq!(pinned.as_slice().as_ptr() as usize % BUFFER_ALIGN, 0);
        assert_eq!(pinned.device_ptr() % BUFFER_ALIGN as u64, 0);
        assert_eq!(pinned.kind(), MemoryKind::Host);
        assert!(pinned.as_slice().iter().all(|&b| b == 0));
    }
    assert!(gpu.alloc(0).is_err());
    assert!(gpu.alloc_pinned(0).is_err());
    assert!(gpu.alloc(usize::MAX).is_err());
    // More than the GPU has: a CUDA error, not a crash.
    let err = gpu.alloc(gpu.total_memory() * 2).unwrap_err();
    assert!(matches!(err.kind(), ErrorKind::Cuda(_)), "{err}");
}

#[test]
fn sync_round_trips() {
    let Some(gpu) = gpu() else { return };
    let len = (8 << 20) + 123;
    let data = pattern(len, 0x5a);
    let a = gpu.alloc(len + 4096).unwrap();
    a.copy_from_host(17, &data).unwrap();
    let mut back = vec![0u8; len];
    a.copy_to_host(17, &mut back).unwrap();
    assert_eq!(back, data);

    // Device to device, at odd offsets.
    let b = gpu.alloc(len).unwrap();
    b.copy_from_device(3, &a, 17 + 5, len - 10).unwrap();
    let all = b.to_vec().unwrap();
    assert_eq!(&all[3..3 + len - 10], &data[5..len - 5]);
    assert_eq!(&all[..3], &[0, 0, 0]);

    // Out of range: errors, nothing copied.
    assert!(a.copy_from_host(a.len() - 1, &[1, 2]).is_err());
    assert!(a.copy_to_host(usize::MAX, &mut [0u8; 1]).is_err());
    assert!(b.copy_from_device(0, &a, a.len(), 1).is_err());
    a.copy_from_host(a.len(), &[]).unwrap();
}

#[test]
fn shared_memory_copies_sync_and_async() {
    let Some(gpu) = gpu() else { return };
    let len = 4 << 20;
    let data = pattern(len, 3);
    let mut pinned = gpu.alloc_pinned(len).unwrap();
    pinned.as_mut_slice().copy_from_slice(&data);
    let host = SharedMemory::new(pinned);
    let dev = SharedMemory::new(gpu.alloc(len).unwrap());
    assert_eq!(dev.kind(), MemoryKind::Cuda);
    assert_eq!(host.kind(), MemoryKind::Host);
    // CUDA memory is not CPU-accessible through SharedMemory.
    assert!(dev.with_bytes(|_| ()).is_err());

    // Pinned -> device (async), device -> pageable host (sync), compare.
    let stream = gpu.stream().unwrap();
    let mut copy = stream.copy_async(&dev, 0, &host, 0, len).unwrap();
    assert!(dev.in_flight() >= 1);
    copy.is_done().unwrap();
    copy.wait().unwrap();
    assert_eq!(dev.in_flight(), 0);
    let pageable = SharedMemory::host(len).unwrap();
    gpu.copy(&pageable, 0, &dev, 0, len).unwrap();
    assert!(pageable.with_bytes(|b| b == &data[..]).unwrap());

    // While a copy into pinned memory is in flight, the CPU may not look at it.
    let back = SharedMemory::new(gpu.alloc_pinned(len).unwrap());
    let copy = stream.copy_async(&back, 0, &dev, 0, len).unwrap();
    let busy = back.with_bytes(|_| ());
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut copy = copy;
    while !copy.is_done().unwrap() {
        assert!(Instant::now() < deadline, "async copy never completed");
    }
    let e = busy.unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Busy(_)), "{e}");
    drop(copy);
    assert!(back.with_bytes(|b| b == &data[..]).unwrap());

    // Dropping an unfinished copy waits for it.
    let dev2 = SharedMemory::new(gpu.alloc(len).unwrap());
    drop(stream.copy_async(&dev2, 0, &host, 0, len).unwrap());
    assert_eq!(dev2.in_flight(), 0);
    gpu.copy(&pageable, 0, &dev2, 0, len).unwrap();
    assert!(pageable.with_bytes(|b| b == &data[..]).unwrap());

    // Ranges are checked, and CPU access blocks copies.
    assert!(gpu.copy(&dev, 1, &host, 0, len).is_err());
    assert!(stream.copy_async(&dev, 0, &host, len, 1).is_err());
    host.with_bytes(|_| {
        let e = gpu.copy(&dev, 0, &host, 0, 1).unwrap_err();
        assert!(matches!(e.kind(), ErrorKind::Busy(_)), "{e}");
    })
    .unwrap();
    stream.synchronize().unwrap();
}

#[test]
fn buffers_move_between_threads() {
    let Some(gpu) = gpu() else { return };
    let buf: CudaBuffer = gpu.alloc(1 << 16).unwrap();
    let pinned: PinnedHostBuffer = gpu.alloc_pinned(1 << 16).unwrap();
    let handle = std::thread::spawn(move || {
        // A fresh thread has no current context: every call binds the primary context.
        buf.copy_from_host(0, &[9u8; 100]).unwrap();
        let mut out = [0u8; 100];
        buf.copy_to_host(0, &mut out).unwrap();
        assert_eq!(out, [9u8; 100]);
        (buf, pinned)
    });
    let (buf, pinned) = handle.join().unwrap();
    drop(pinned);
    let shared = SharedMemory::new(buf);
    let t = std::thread::spawn(move || shared.len());
    assert_eq!(t.join().unwrap(), 1 << 16);
}

#[test]
fn events_time_work() {
    let Some(gpu) = gpu() else { return };
    let stream = gpu.stream().unwrap();
    let a = SharedMemory::new(gpu.alloc(64 << 20).unwrap());
    let b = SharedMemory::new(gpu.alloc(64 << 20).unwrap());
    let start = cuda::CudaEvent::new(&gpu, true).unwrap();
    let end = cuda::CudaEvent::new(&gpu, true).unwrap();
    start.record(&stream).unwrap();
    let copy = stream.copy_async(&b, 0, &a, 0, 64 << 20).unwrap();
    end.record(&stream).unwrap();
    end.synchronize().unwrap();
    assert!(end.is_done().unwrap());
    let ms = end.elapsed_ms(&start).unwrap();
    println!(
        "64 MiB device copy: {ms:.3} ms ({:.0} GB/s)",
        (64 << 20) as f64 / ms as f64 / 1e6
    );
    assert!(ms > 0.0);
    copy.wait().unwrap();
    gpu.synchronize().unwrap();
}

/// The small copier (small one-sided operations carried inline, runs of small messages in
/// eager frames): gathers ranges of device memory into host bytes (a vector, or a slice) and
/// scatters host bytes into it, exactly, in one round or in several when the ranges pass its
/// bounce; a range outside the memory, or more bytes than a slice takes, stops the call with
/// an error after the ranges before it, and the copier goes on serving.
#[test]
fn small_copier_gathers_and_scatters_exactly() {
    let Some(gpu) = gpu() else { return };
    let copier = cuda::SmallCopier::for_ordinal(gpu.ordinal()).expect("small copier");
    assert!(std::sync::Arc::ptr_eq(
        &copier,
        &cuda::SmallCopier::for_ordinal(gpu.ordinal()).unwrap()
    ));
    const LEN: usize = 2 << 20;
    let memory = SharedMemory::new(gpu.alloc(LEN).expect("alloc"));
    let source = pattern(LEN, 5);
    // Pieces of 1 B … 300 KiB (together past one bounce, the last alone too), scattered and
    // then gathered back.
    let pieces: Vec<(usize, usize)> = [1usize, 7, 4096, 4097, 65536, 65537, 100 << 10, 300 << 10]
        .iter()
        .enumerate()
        .map(|(i, &len)| (i * (128 << 10) + i, len))
        .collect();
    copier
        .write_ranges(
            &memory,
            pieces.iter().map(|&(at, len)| (at, &source[at..at + len])),
        )
        .expect("write_ranges");
    let mut back = Vec::new();
    copier
        .read_ranges(&memory, pieces.iter().copied(), &mut back)
        .expect("read_ranges");
    let expected: Vec<u8> = pieces
        .iter()
        .flat_map(|&(at, len)| source[at..at + len].iter().copied())
        .collect();
    assert!(back == expected, "gathered bytes differ");
    assert!(
        expected.len() > cuda::SMALL_COPY_BOUNCE_BYTES,
        "several rounds"
    );
    // Into a slice: exactly its bytes; one byte short, an error (nothing past the slice).
    let mut slice = vec![0u8; expected.len()];
    let n = copier
        .gather_to(
            pieces.iter().map(|&(at, len)| (&memory, at, len)),
            &mut slice,
        )
        .expect("gather_to");
    assert_eq!(n, expected.len());
    assert!(slice == expected, "gathered bytes differ (slice)");
    let mut short = vec![0u8; expected.len() - 1];
    let err = copier
        .gather_to(
            pieces.iter().map(|&(at, len)| (&memory, at, len)),
            &mut short,
        )
        .unwrap_err();
    assert!(err.to_string().contains("destination"), "{err}");
    // A range past the end: an error naming it, after the range before it.
    let mut partial = Vec::new();
    let err = copier
        .read_ranges(&memory, [(0, 10), (LEN - 5, 10)], &mut partial)
        .unwrap_err();
    assert!(err.to_string().contains("read_ranges"), "{err}");
    let mut first = Vec::new();
    copier
        .read_ranges(&memory, [(0, 10)], &mut first)
        .expect("read_ranges");
    assert_eq!(first[0], source[0]);
    assert_eq!(partial, first, "the range before the bad one was read");
    let err = copier
        .write_ranges(&memory, [(LEN, &source[..1])])
        .unwrap_err();
    assert!(err.to_string().contains("write_ranges"), "{err}");
    // One call over several memories (tensors registered one by one).
    let others: Vec<SharedMemory> = (0..4)
        .map(|_| SharedMemory::new(gpu.alloc(8192).expect("alloc")))
        .collect();
    copier
        .scatter(
            others
                .iter()
                .enumerate()
                .map(|(i, m)| (m, i * 100, &source[i * 1000..i * 1000 + 5000])),
        )
        .expect("scatter");
    let mut gathered = Vec::new();
    copier
        .gather(
            others.iter().enumerate().map(|(i, m)| (m, i * 100, 5000)),
            &mut gathered,
        )
        .expect("gather");
    let want: Vec<u8> = (0..4)
        .flat_map(|i| source[i * 1000..i * 1000 + 5000].iter().copied())
        .collect();
    assert!(gathered == want, "gathered over several memories differ");
    // Host memory is not the copier's.
    let host = SharedMemory::host(4096).unwrap();
    assert!(copier
        .read_ranges(&host, [(0, 1)], &mut Vec::new())
        .is_err());
    // Still serving, from several threads at once.
    std::thread::scope(|s| {
        for t in 0..8usize {
            let (copier, memory, source) = (&copier, &memory, &source);
            s.spawn(move || {
                for round in 0..50 {
                    let at = t * (64 << 10) + round * 17;
                    let bytes = &source[(round * 31)..(round * 31) + 4096];
                    copier.write_ranges(memory, [(at, bytes)]).unwrap();
                    let mut got = Vec::new();
                    copier.read_ranges(memory, [(at, 4096)], &mut got).unwrap();
                    assert!(got == bytes, "thread {t} round {round}");
                }
            });
        }
    });
}

/// Lists of pieces moved by one `cuMemcpyBatchAsync` or one launch of the gather kernel land
/// exactly where a `cuMemcpyAsync` per piece puts them: odd sizes and offsets, pieces that cross the kernel's 4 KiB fragments and the
/// bounce, adjacent pieces (merged), more memories than one launch takes, more pieces than
/// a lane plans at once, and pieces more than 4 GiB apart in one memory.
#[test]
fn small_copier_lists_by_batch_or_kernel_match_copies_piece_by_piece() {
    let Some(gpu) = gpu() else { return };
    let copier = cuda::SmallCopier::with_kernel(&gpu).expect("small copier");
    let ways = [
        ListCopy::Each,
        ListCopy::Batch,
        ListCopy::Kernel,
        ListCopy::Auto,
    ];
    assert!(
        copier.set_list_copy(ListCopy::Kernel),
        "the gather kernel loads on this GPU"
    );
    if !copier.set_list_copy(ListCopy::Batch) {
        println!("no cuMemcpyBatchAsync in this driver: batches fall back to one copy each");
    }
    if std::env::var_os(cuda::SMALL_COPY_LISTS_ENV).is_none() {
        // Unasked, a copier loads the kernel and chooses per list.
        let plain = cuda::SmallCopier::new(&gpu).expect("small copier");
        assert_eq!(plain.list_copy(), ListCopy::Auto);
    }
    let memories: Vec<SharedMemory> = (0..80)
        .map(|_| SharedMemory::new(gpu.alloc(1 << 17).expect("alloc")))
        .collect();
    // (memory, offset, len) lists, each read back both ways.
    let mut lists: Vec<Vec<(usize, usize, usize)>> = vec![
        // Sixteen tensors of 1 KiB, as `writev` sends them.
        (0..16).map(|i| (i, 0, 1024)).collect(),
        // Odd sizes and offsets, some past a fragment, some adjacent in one memory.
        vec![
            (0, 3, 1),
            (0, 4, 4099),
            (1, 17, 8191),
            (1, 8208, 5),
            (2, 0, 12_345),
            (0, 70_000, 3),
        ],
        // More memories than one launch's 64 entries.
        (0..80).map(|i| (i, i * 13, 700)).collect(),
        // More pieces than a lane plans at once (1024), none adjacent.
        (0..1500).map(|i| (i % 80, (i / 80) * 64 + 1, 17)).collect(),
        // More bytes than the bounce: several rounds.
        (0..5).map(|i| (i, 100, 30_000)).collect(),
    ];
    // A gather reaches 4 GiB from an entry's first piece: a piece past it starts another.
    let large = gpu
        .alloc((4usize << 30) + (1 << 20))
        .ok()
        .map(SharedMemory::new);
    let mut all: Vec<&SharedMemory> = memories.iter().collect();
    if let Some(large) = &large {
        all.push(large);
        let l = all.len() - 1;
        lists.push(vec![
            (l, 10, 5000),
            (l, (4usize << 30) + 100, 5000),
            (l, 20_000, 9),
        ]);
    } else {
        println!("no 4 GiB allocation: the far-apart case is not run");
    }
    for (n, list) in lists.iter().enumerate() {
        let total: usize = list.iter().map(|p| p.2).sum();
        let source = pattern(total, n as u8);
        let mut got = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
        for (way, how) in ways.into_iter().enumerate() {
            copier.set_list_copy(how);
            // Scatter the source, poison nothing else, gather it back.
            let mut at = 0;
            let pieces: Vec<(&SharedMemory, usize, &[u8])> = list
                .iter()
                .map(|&(m, off, len)| {
                    at += len;
                    (all[m], off, &source[at - len..at])
                })
                .collect();
            copier.scatter(pieces).expect("scatter");
            copier
                .gather(
                    list.iter().map(|&(m, off, len)| (all[m], off, len)),
                    &mut got[way],
                )
                .expect("gather");
        }
        for (way, how) in ways.into_iter().enumerate() {
            assert!(got[way] == source, "list {n}: the copies of {how:?} differ");
        }
    }
    // A kernel-written list, read back piece by piece, agrees too.
    let list: Vec<(usize, usize, usize)> = (0..16).map(|i| (i, 5, 3000)).collect();
    let source = pattern(16 * 3000, 99);
    // The 16-piece list of 3000 bytes each, scattered from `source` and gathered back.
    let scatter_list =
        |source: &[u8], what: &str| {
            copier
                .scatter(list.iter().enumerate().map(|(i, &(m, off, len))| {
                    (&memories[m], off, &source[i * 3000..i * 3000 + len])
                }))
                .unwrap_or_else(|e| panic!("scatter, {what}: {e}"));
        };
    let gather_list = |what: &str| {
        let mut back = Vec::new();
        copier
            .gather(
                list.iter().map(|&(m, off, len)| (&memories[m], off, len)),
                &mut back,
            )
            .unwrap_or_else(|e| panic!("gather, {what}: {e}"));
        back
    };
    copier.set_list_copy(ListCopy::Kernel);
    scatter_list(&source, "by kernel");
    copier.set_list_copy(ListCopy::Each);
    assert!(
        gather_list("by copies") == source,
        "kernel scatter, copy gather"
    );

    // `Auto` tries both ways on a list class before it picks, then probes: forty lists of
    // sixteen pieces each way, every one checked, and both ways measured for them.
    copier.set_list_copy(ListCopy::Auto);
    for round in 0..40u8 {
        let source = pattern(16 * 3000, round);
        scatter_list(&source, "auto");
        assert!(gather_list("auto") == source, "auto, round {round}");
    }
    let times = copier.auto_list_times();
    println!("auto: {times:?}");
    for to_device in [true, false] {
        assert!(
            times
                .iter()
                .any(|t| t.to_device == to_device && t.copies == (16, Some(31))),
            "both ways measured for 16-piece lists, to device {to_device}"
        );
    }
}
