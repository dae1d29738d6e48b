//! GPU tests of the unpack kernel against the CPU reference (`tcpx::cuda::unpack::gather_cpu`).
//! Each test prints "skipped: no CUDA driver (…)" and passes where there is no driver (CI).

use tcpx::cuda::unpack::{
    self, gather_cpu, meta_bytes, nvrtc_available, slot_offset, BufferEntry, KernelSource,
    LaunchConfig, LoadMeta, UnpackEntry, UnpackKernel, Unpacker, MAX_ENTRIES_PER_LAUNCH,
    MAX_FRAGMENTS_PER_SLOT, SLOTS,
};
use tcpx::cuda::{self, CudaBuffer, CudaDevice, DeviceAccessible};

fn gpu() -> Option<CudaDevice> {
    if let Some(why) = cuda::skip_reason() {
        println!("{why}");
        return None;
    }
    Some(CudaDevice::new(0).expect("CUDA device 0"))
}

/// SplitMix64: small, seedable, good enough for test data.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i as u64 + 1) as usize);
        }
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(n + 8);
        while v.len() < n {
            v.extend_from_slice(&self.next().to_le_bytes());
        }
        v.truncate(n);
        v
    }
}

/// One receive to gather: its fragments and where its destination starts in the big buffer.
struct Entry {
    metas: Vec<LoadMeta>,
    dst_offset: usize,
}

struct Case {
    bounce: Vec<u8>,
    entries: Vec<Entry>,
    dst_len: usize,
}

impl Case {
    fn fragments(&self) -> usize {
        self.entries.iter().map(|e| e.metas.len()).sum()
    }
}

/// Random receives: fragment lengths 1 B..4 KiB (half exactly 4 KiB), sources anywhere in the
/// bounce buffer (some page-aligned, most not), destinations disjoint within a receive with
/// random gaps and a random misalignment of each receive's base, fragment order shuffled.
fn random_case(rng: &mut Rng, max_entries: u64, frag_budget: usize) -> Case {
    let bounce_len = (4 << 20) + rng.below(4096) as usize;
    let bounce = rng.bytes(bounce_len);
    let n_entries = 1 + rng.below(max_entries);
    let mut budget = frag_budget;
    let mut cursor = 0usize;
    let mut entries = Vec::new();
    for _ in 0..n_entries {
        let count = match rng.below(10) {
            0 => 0,
            1 => MAX_FRAGMENTS_PER_SLOT,
            2..=4 => rng.below(MAX_FRAGMENTS_PER_SLOT as u64 + 1) as usize,
            _ => rng.below(64) as usize,
        }
        .min(budget);
        budget -= count;
        let dst_offset = cursor + rng.below(64) as usize;
        let mut off = 0u64;
        let mut metas = Vec::with_capacity(count);
        for _ in 0..count {
            let len = if rng.chance(50) {
                4096
            } else {
                1 + rng.below(4096) as u32
            };
            if rng.chance(30) {
                off += rng.below(32);
            }
            let span = (bounce_len - len as usize + 1) as u64;
            let mut src_off = rng.below(span) as u32;
            if rng.chance(30) {
                src_off &= !4095;
            }
            metas.push(LoadMeta {
                src_off,
                len,
                dst_off: off,
            });
            off += len as u64;
        }
        rng.shuffle(&mut metas);
        cursor = dst_offset + off as usize + rng.below(100) as usize;
        entries.push(Entry { metas, dst_offset });
    }
    Case {
        bounce,
        entries,
        dst_len: cursor + 4096,
    }
}

/// Where the kernel reads the metas from.
#[derive(Clone, Copy, Debug)]
enum MetaHome {
    /// Pinned host memory mapped into the GPU (what TCPX gives).
    Pinned,
    /// Device memory.
    Device,
}

const FILL: u8 = 0xEE;

/// Runs `case` on the GPU and compares with the CPU reference.
fn check_case(gpu: &CudaDevice, unpacker: &Unpacker, case: &Case, home: MetaHome, label: &str) {
    let bounce = gpu.alloc(case.bounce.len()).unwrap();
    bounce.copy_from_host(0, &case.bounce).unwrap();
    let dst = gpu.alloc(case.dst_len).unwrap();
    dst.copy_from_host(0, &vec![FILL; case.dst_len]).unwrap();

    let all: Vec<LoadMeta> = case
        .entries
        .iter()
        .flat_map(|e| e.metas.iter().copied())
        .collect();
    let meta_len = (all.len() * 16).max(16);
    let pinned;
    let device;
    let metas: &dyn DeviceAccessible = match home {
        MetaHome::Pinned => {
            let mut p = gpu.alloc_pinned(meta_len).unwrap();
            p.as_mut_slice()[..all.len() * 16].copy_from_slice(meta_bytes(&all));
            pinned = p;
            &pinned
        }
        MetaHome::Device => {
            let d = gpu.alloc(meta_len).unwrap();
            d.copy_from_host(0, meta_bytes(&all)).unwrap();
            device = d;
            &device
        }
    };
    let mut entries = Vec::new();
    let mut metas_offset = 0;
    for e in &case.entries {
        entries.push(BufferEntry {
            metas,
            metas_offset,
            count: e.metas.len() as u32,
            bounce: &bounce,
            dst: &dst,
            dst_offset: e.dst_offset,
        });
        metas_offset += e.metas.len() * 16;
    }
    unpacker.unpack(&entries).unwrap();

    let mut expect = vec![FILL; case.dst_len];
    for e in &case.entries {
        gather_cpu(&case.bounce, &e.metas, &mut expect[e.dst_offset..]).unwrap();
    }
    let got = dst.to_vec().unwrap();
    if got != expect {
        let first = got.iter().zip(&expect).position(|(a, b)| a != b).unwrap();
        let culprit = case.entries.iter().enumerate().find_map(|(i, e)| {
            e.metas
                .iter()
                .position(|m| {
                    let start = e.dst_offset + m.dst_off as usize;
                    (start..start + m.len as usize).contains(&first)
                })
                .map(|j| (i, j, e.metas[j]))
        });
        panic!(
            "{label} ({home:?}): GPU result differs from the CPU reference at byte {first} \
             (got {:#x}, want {:#x}); fragment (entry, index, meta) = {culprit:?}",
            got[first], expect[first]
        );
    }
    println!(
        "{label} ({home:?}): {} entries, {} fragments, {} bytes: equal to the CPU reference",
        case.entries.len(),
        case.fragments(),
        case.dst_len
    );
}

#[test]
fn kernel_matches_cpu_reference_on_random_fragments() {
    let Some(gpu) = gpu() else { return };
    let unpacker = Unpacker::new(&gpu).unwrap();
    println!("kernel from {}", unpacker.kernel().source());
    for seed in 0..12u64 {
        let mut rng = Rng(seed);
        // Up to 100 receives (so up to two launches), up to 16 Ki fragments in all.
        let case = random_case(&mut rng, 100, 16 << 10);
        let home = if seed % 2 == 0 {
            MetaHome::Pinned
        } else {
            MetaHome::Device
        };
        check_case(&gpu, &unpacker, &case, home, &format!("seed {seed}"));
    }
}

#[test]
fn many_small_receives_split_into_several_launches() {
    let Some(gpu) = gpu() else { return };
    let unpacker = Unpacker::new(&gpu).unwrap();
    let mut rng = Rng(1000);
    let mut case = random_case(&mut rng, 1, 0);
    // 300 receives of 0..8 fragments: 5 launches.
    let mut cursor = 0;
    case.entries.clear();
    for _ in 0..300 {
        let n = rng.below(8) as usize;
        let mut metas = Vec::new();
        let mut off = 0u64;
        for _ in 0..n {
            let len = 1 + rng.below(4096) as u32;
            metas.push(LoadMeta {
                src_off: rng.below((case.bounce.len() - len as usize) as u64) as u32,
                len,
                dst_off: off,
            });
            off += len as u64;
        }
        case.entries.push(Entry {
            metas,
            dst_offset: cursor,
        });
        cursor += off as usize + 1;
    }
    case.dst_len = cursor + 1;
    check_case(&gpu, &unpacker, &case, MetaHome::Pinned, "300 receives");
}

#[test]
fn every_alignment_and_length_edge() {
    let Some(gpu) = gpu() else { return };
    let unpacker = Unpacker::new(&gpu).unwrap();
    let mut rng = Rng(7);
    let bounce = rng.bytes(1 << 20);
    let lens: Vec<u32> = (1..=40)
        .chain([63, 64, 65, 511, 512, 513, 4095, 4096, 4097, 8191, 16384])
        .collect();
    let mut metas = Vec::new();
    let mut off = 0u64;
    for s in 0..16u32 {
        for d in 0..16u64 {
            for &len in &lens {
                let dst_off = off.div_ceil(16) * 16 + d;
                metas.push(LoadMeta {
                    src_off: 4096 * (rng.below(200) as u32) + s,
                    len,
                    dst_off,
                });
                off = dst_off + len as u64;
            }
        }
    }
    rng.shuffle(&mut metas);
    // Split into slots of at most 2048 fragments, as TCPX would.
    let mut entries = Vec::new();
    let mut rest = metas.as_slice();
    while !rest.is_empty() {
        let n = rest.len().min(MAX_FRAGMENTS_PER_SLOT);
        entries.push(Entry {
            metas: rest[..n].to_vec(),
            dst_offset: 0,
        });
        rest = &rest[n..];
    }
    let case = Case {
        bounce,
        entries,
        dst_len: off as usize + 64,
    };
    check_case(&gpu, &unpacker, &case, MetaHome::Device, "alignment matrix");
}

#[test]
fn launch_shapes_agree() {
    let Some(gpu) = gpu() else { return };
    let mut unpacker = Unpacker::new(&gpu).unwrap();
    let mut rng = Rng(99);
    let case = random_case(&mut rng, 40, 8 << 10);
    for (threads, frags, max_blocks) in [
        (32, 1, 0),
        (64, 7, 3),
        (128, 16, 0),
        (256, 32, 1),
        (512, 128, 0),
        (1024, 3072, 0),
    ] {
        let config = LaunchConfig {
            threads_per_block: threads,
            frags_per_block: frags,
            max_blocks,
        };
        unpacker.set_config(config).unwrap();
        check_case(
            &gpu,
            &unpacker,
            &case,
            MetaHome::Pinned,
            &format!("{config:?}"),
        );
    }
}

#[test]
fn every_loader_gives_the_same_result() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng(5);
    let case = random_case(&mut rng, 20, 4096);
    let mut sources = vec![KernelSource::Ptx, KernelSource::PtxCompat];
    if nvrtc_available() {
        sources.push(KernelSource::Nvrtc);
    } else {
        println!("nvrtc: skipped (libnvrtc not found)");
    }
    for source in sources {
        let kernel = UnpackKernel::load_from(&gpu, source.clone())
            .unwrap_or_else(|e| panic!("loading the kernel from {source}: {e}"));
        let unpacker = Unpacker::with_kernel(kernel.into(), gpu.stream().unwrap()).unwrap();
        check_case(
            &gpu,
            &unpacker,
            &case,
            MetaHome::Pinned,
            &format!("{source}"),
        );
    }
}

#[test]
fn out_of_range_fragments_are_skipped_and_reported() {
    let Some(gpu) = gpu() else { return };
    let unpacker = Unpacker::new(&gpu).unwrap();
    let bounce = gpu.alloc(64 << 10).unwrap();
    bounce.copy_from_host(0, &[0x11; 64 << 10]).unwrap();
    let dst = gpu.alloc(8192).unwrap();
    let metas_ok = [LoadMeta {
        src_off: 0,
        len: 100,
        dst_off: 0,
    }];
    let metas_bad = [
        LoadMeta {
            src_off: 0,
            len: 100,
            dst_off: 200,
        },
        // dst_offset 4096 leaves 4096 writable bytes: this one would write 4000..4200.
        LoadMeta {
            src_off: 0,
            len: 200,
            dst_off: 4000,
        },
        // Past the bounce buffer.
        LoadMeta {
            src_off: (64 << 10) - 10,
            len: 11,
            dst_off: 300,
        },
    ];
    let meta_buf = gpu.alloc(4096).unwrap();
    meta_buf.copy_from_host(0, meta_bytes(&metas_ok)).unwrap();
    meta_buf.copy_from_host(16, meta_bytes(&metas_bad)).unwrap();
    let entry = |offset, count, dst_offset| BufferEntry {
        metas: &meta_buf,
        metas_offset: offset,
        count,
        bounce: &bounce,
        dst: &dst,
        dst_offset,
    };
    let err = unpacker
        .unpack(&[entry(0, 1, 0), entry(16, 3, 4096)])
        .unwrap_err();
    let msg = err.to_string();
    println!("reported: {msg}");
    assert!(msg.contains("entry 1 fragment"), "{msg}");
    assert!(
        msg.contains("(src_off 0, len 200, dst_off 4000)")
            || msg.contains(&format!(
                "(src_off {}, len 11, dst_off 300)",
                (64 << 10) - 10
            )),
        "{msg}"
    );
    // The good fragments landed; the bad ones wrote nothing.
    let got = dst.to_vec().unwrap();
    assert!(got[..100].iter().all(|&b| b == 0x11));
    assert!(got[100..4096].iter().all(|&b| b == 0));
    assert!(got[4096 + 200..4096 + 300].iter().all(|&b| b == 0x11));
    assert!(got[4096 + 300..].iter().all(|&b| b == 0));
    // Sticky until cleared.
    assert!(unpacker.check().is_err());
    unpacker.clear_error();
    unpacker.check().unwrap();
    unpacker.unpack(&[entry(0, 1, 0)]).unwrap();

    // Host-side checks: metas past their buffer, destination offset past the buffer.
    assert!(unpacker.unpack(&[entry(4096 - 16, 2, 0)]).is_err());
    assert!(unpacker.unpack(&[entry(0, 1, 8193)]).is_err());
}

#[test]
fn raw_launches_are_asynchronous_and_counted() {
    let Some(gpu) = gpu() else { return };
    let unpacker = Unpacker::new(&gpu).unwrap();
    // Empty and zero-count batches launch nothing.
    // SAFETY: no entry has fragments, so no address is used.
    let none = unsafe { unpacker.launch(&[]) }.unwrap();
    none.wait().unwrap();
    assert_eq!(none.launches(), 0);
    let zero = UnpackEntry {
        metas: 0,
        count: 0,
        bounce: 0,
        bounce_len: 0,
        dst: 0,
        dst_len: 0,
    };
    // SAFETY: every entry has `count: 0`, so no address (all 0 here) is used.
    let l = unsafe { unpacker.launch(&[zero; 10]) }.unwrap();
    l.wait().unwrap();
    assert_eq!(l.launches(), 0);

    // A NULL address with fragments is refused before launching.
    let bad = UnpackEntry { count: 1, ..zero };
    // SAFETY: refused on the host, nothing is launched.
    assert!(unsafe { unpacker.launch(&[bad]) }.is_err());

    // 130 receives of one 4 KiB fragment each: 3 launches, one event.
    let bounce = gpu.alloc(130 * 4096).unwrap();
    let data: Vec<u8> = (0..130 * 4096).map(|i| (i / 4096) as u8).collect();
    bounce.copy_from_host(0, &data).unwrap();
    let dst = gpu.alloc(130 * 4096).unwrap();
    let metas: Vec<LoadMeta> = (0..130)
        .map(|i| LoadMeta {
            src_off: (129 - i) * 4096,
            len: 4096,
            dst_off: 0,
        })
        .collect();
    let meta_buf = gpu.alloc_pinned(130 * 16).unwrap();
    let mut meta_buf = meta_buf;
    meta_buf.as_mut_slice().copy_from_slice(meta_bytes(&metas));
    let entries: Vec<UnpackEntry> = (0..130u64)
        .map(|i| UnpackEntry {
            metas: meta_buf.device_ptr() + i * 16,
            count: 1,
            bounce: bounce.device_ptr(),
            bounce_len: bounce.len() as u64,
            dst: dst.device_ptr() + i * 4096,
            dst_len: 4096,
        })
        .collect();
    // SAFETY: all addresses are inside the live buffers above, which outlive `wait`.
    let launch = unsafe { unpacker.launch(&entries) }.unwrap();
    assert_eq!(
        launch.launches() as usize,
        130usize.div_ceil(MAX_ENTRIES_PER_LAUNCH)
    );
    while !launch.is_done().unwrap() {
        std::hint::spin_loop();
    }
    launch.wait().unwrap();
    let got = dst.to_vec().unwrap();
    for i in 0..130 {
        assert!(got[i * 4096..(i + 1) * 4096]
            .iter()
            .all(|&b| b == (129 - i) as u8));
    }
}

#[test]
fn tcpx_meta_page_in_pinned_memory() {
    let Some(gpu) = gpu() else { return };
    let unpacker = Unpacker::new(&gpu).unwrap();
    let mut rng = Rng(42);
    let bounce_host = rng.bytes(4 << 20);
    let bounce = gpu.alloc(bounce_host.len()).unwrap();
    bounce.copy_from_host(0, &bounce_host).unwrap();
    // A whole tcpxUnpackMeta page: 16 slots, counts in cnt[].
    let mut page = gpu.alloc_pinned(tcpx_sys::UNPACK_META_SIZE).unwrap();
    let mut per_slot = Vec::new();
    for slot in 0..SLOTS {
        let n = rng.below(MAX_FRAGMENTS_PER_SLOT as u64 + 1) as usize;
        let mut off = 0;
        let mut metas: Vec<LoadMeta> = (0..n)
            .map(|_| {
                let len = 1 + rng.below(4096) as u32;
                let m = LoadMeta {
                    src_off: rng.below((bounce_host.len() - len as usize) as u64) as u32,
                    len,
                    dst_off: off,
                };
                off += len as u64;
                m
            })
            .collect();
        rng.shuffle(&mut metas);
        let bytes = page.as_mut_slice();
        bytes[slot_offset(slot)..slot_offset(slot) + n * 16].copy_from_slice(meta_bytes(&metas));
        let cnt = tcpx_sys::UNPACK_CNT_OFFSET + slot * 8;
        bytes[cnt..cnt + 8].copy_from_slice(&(n as u64).to_le_bytes());
        per_slot.push((metas, off as usize));
    }
    let dsts: Vec<CudaBuffer> = per_slot
        .iter()
        .map(|(_, len)| gpu.alloc((*len).max(1)).unwrap())
        .collect();
    let entries: Vec<BufferEntry> = (0..SLOTS)
        .map(|slot| {
            // SAFETY: the page is a live, aligned tcpxUnpackMeta-sized pinned buffer.
            let count =
                unsafe { unpack::read_slot_count(page.as_slice().as_ptr().cast(), slot).unwrap() };
            BufferEntry {
                metas: &page,
                metas_offset: slot_offset(slot),
                count,
                bounce: &bounce,
                dst: &dsts[slot],
                dst_offset: 0,
            }
        })
        .collect();
    unpacker.unpack(&entries).unwrap();
    for (slot, (metas, len)) in per_slot.iter().enumerate() {
        let mut expect = vec![0u8; (*len).max(1)];
        gather_cpu(&bounce_host, metas, &mut expect).unwrap();
        assert_eq!(dsts[slot].to_vec().unwrap(), expect, "slot {slot}");
    }
    println!(
        "16 slots, {} fragments from one meta page: equal to the CPU reference",
        per_slot.iter().map(|(m, _)| m.len()).sum::<usize>()
    );
}
