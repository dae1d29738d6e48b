//! Unpack-kernel bandwidth against the same GPU's device-to-device copy, in one run.
//!
//! ```text
//! cargo build --release -p tcpx --example gpu_unpack_bench
//! target/release/examples/gpu_unpack_bench [--mib 256] [--frag 4096] [--iters 20] [--rounds 5]
//!     [--threads 256] [--frags-per-block 32] [--max-blocks 0] [--sweep] [--mixed]
//! ```
//!
//! Workload: `--mib` MiB of payload cut into `--frag`-byte fragments, grouped into receives of
//! 2048 fragments (a full TCPX slot each); fragment i of a receive lands at `i * frag` of the
//! receive's destination and comes from a bounce-buffer page chosen by a random permutation (the
//! source order is shuffled). All receives go in one `Unpacker::launch` call. The metas live in
//! pinned host memory mapped into the GPU (as TCPX provides them) or in device memory.
//!
//! Baseline: `cuMemcpyAsync` device-to-device of the same number of bytes on the same stream.
//!
//! Bytes counted: payload bytes, i.e. each byte copied counts once (it is read once and written
//! once; the "r+w" column doubles it, as device-copy figures often do). Metadata reads are not
//! counted. Each figure is the median over `--rounds` rounds of `--iters` back-to-back launches
//! timed with CUDA events; rounds alternate between the copy and the unpack.
//!
//! Without a CUDA driver it prints "skipped: no CUDA driver (…)" and exits 0.

use std::time::Instant;

use tcpx::cuda::unpack::{LaunchConfig, LoadMeta, UnpackEntry, Unpacker, MAX_FRAGMENTS_PER_SLOT};
use tcpx::cuda::{self, CudaBuffer, CudaDevice, CudaEvent, PinnedHostBuffer};

struct Args {
    mib: usize,
    frag: usize,
    iters: usize,
    rounds: usize,
    config: LaunchConfig,
    sweep: bool,
    mixed: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        mib: 256,
        frag: 4096,
        iters: 20,
        rounds: 5,
        config: LaunchConfig::default(),
        sweep: false,
        mixed: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut num = |name: &str| -> Result<usize, String> {
            it.next()
                .ok_or(format!("{name} needs a value"))?
                .parse()
                .map_err(|e| format!("{name}: {e}"))
        };
        match flag.as_str() {
            "--mib" => a.mib = num("--mib")?,
            "--frag" => a.frag = num("--frag")?,
            "--iters" => a.iters = num("--iters")?,
            "--rounds" => a.rounds = num("--rounds")?,
            "--threads" => a.config.threads_per_block = num("--threads")? as u32,
            "--frags-per-block" => a.config.frags_per_block = num("--frags-per-block")? as u32,
            "--max-blocks" => a.config.max_blocks = num("--max-blocks")? as u32,
            "--sweep" => a.sweep = true,
            "--mixed" => a.mixed = true,
            "-h" | "--help" => {
                println!("see the doc comment of crates/tcpx/examples/gpu_unpack_bench.rs");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if a.frag == 0 || a.frag > 1 << 20 || a.mib == 0 || a.iters == 0 || a.rounds == 0 {
        return Err("sizes and counts must be positive, --frag at most 1 MiB".into());
    }
    if (a.mib << 20) % a.frag != 0 {
        return Err("--mib must be a multiple of --frag".into());
    }
    if (a.mib << 20) > u32::MAX as usize {
        return Err("--mib must stay below 4 GiB (src_off is 32-bit)".into());
    }
    Ok(a)
}

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
        self.next() % n
    }
}

/// Median milliseconds per iteration of `body` (which queues `iters` operations on `stream`).
fn time_rounds(
    gpu: &CudaDevice,
    unpacker: &Unpacker,
    rounds: usize,
    iters: usize,
    mut body: impl FnMut(),
) -> Result<f64, tcpx::Error> {
    let start = CudaEvent::new(gpu, true)?;
    let end = CudaEvent::new(gpu, true)?;
    let mut samples = Vec::new();
    for _ in 0..rounds {
        start.record(unpacker.stream())?;
        for _ in 0..iters {
            body();
        }
        end.record(unpacker.stream())?;
        end.synchronize()?;
        samples.push(end.elapsed_ms(&start)? as f64 / iters as f64);
    }
    samples.sort_by(f64::total_cmp);
    Ok(samples[samples.len() / 2])
}

struct Workload {
    metas: Vec<LoadMeta>,
    /// Destination offset of each receive (2048 fragments each).
    receives: Vec<(usize, usize)>, // (first meta, count)
    dst_bases: Vec<u64>,
    payload: u64,
}

/// Full 4 KiB-style pages, shuffled sources.
fn uniform(total: usize, frag: usize, rng: &mut Rng) -> Workload {
    let n = total / frag;
    let mut perm: Vec<u32> = (0..n as u32).collect();
    for i in (1..n).rev() {
        perm.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let metas = (0..n)
        .map(|i| LoadMeta {
            src_off: perm[i] * frag as u32,
            len: frag as u32,
            dst_off: ((i % MAX_FRAGMENTS_PER_SLOT) * frag) as u64,
        })
        .collect();
    let receives: Vec<(usize, usize)> = (0..n)
        .step_by(MAX_FRAGMENTS_PER_SLOT)
        .map(|s| (s, MAX_FRAGMENTS_PER_SLOT.min(n - s)))
        .collect();
    let dst_bases = receives.iter().map(|&(s, _)| (s * frag) as u64).collect();
    Workload {
        metas,
        receives,
        dst_bases,
        payload: total as u64,
    }
}

/// Random lengths 1..=frag at random (mostly unaligned) sources, packed destinations.
fn mixed(total: usize, frag: usize, rng: &mut Rng) -> Workload {
    let n = total / frag;
    let mut metas = Vec::with_capacity(n);
    let mut receives = Vec::new();
    let mut dst_bases = Vec::new();
    let mut base = 0u64;
    let mut payload = 0u64;
    for s in (0..n).step_by(MAX_FRAGMENTS_PER_SLOT) {
        let count = MAX_FRAGMENTS_PER_SLOT.min(n - s);
        let mut off = 0u64;
        for _ in 0..count {
            let len = 1 + rng.below(frag as u64) as u32;
            let src_off = rng.below((total - len as usize) as u64 + 1) as u32;
            metas.push(LoadMeta {
                src_off,
                len,
                dst_off: off,
            });
            off += len as u64;
        }
        receives.push((s, count));
        dst_bases.push(base);
        base += off;
        payload += off;
    }
    Workload {
        metas,
        receives,
        dst_bases,
        payload,
    }
}

fn entries(
    w: &Workload,
    meta_addr: u64,
    bounce: &CudaBuffer,
    dst: &CudaBuffer,
) -> Vec<UnpackEntry> {
    w.receives
        .iter()
        .zip(&w.dst_bases)
        .map(|(&(first, count), &base)| UnpackEntry {
            metas: meta_addr + first as u64 * 16,
            count: count as u32,
            bounce: bounce.device_ptr(),
            bounce_len: bounce.len() as u64,
            dst: dst.device_ptr() + base,
            dst_len: dst.len() as u64 - base,
        })
        .collect()
}

/// Queues one unpack of `e`; the launch's event is dropped (the stream orders launches).
///
/// # Safety
/// As [`Unpacker::launch`]: the entries' buffers must outlive the launch.
unsafe fn unpack(unpacker: &Unpacker, e: &[UnpackEntry]) {
    // SAFETY: forwarded from the caller.
    let _ = unsafe { unpacker.launch(e) }.expect("launch");
}

fn gbps(bytes: u64, ms: f64) -> f64 {
    bytes as f64 / (ms * 1e-3) / 1e9
}

fn main() {
    if let Err(e) = run() {
        eprintln!("gpu_unpack_bench: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse_args()?;
    if let Some(why) = cuda::skip_reason() {
        println!("{why}");
        return Ok(());
    }
    let gpu = CudaDevice::new(0)?;
    let mut unpacker = Unpacker::new(&gpu)?;
    unpacker.set_config(args.config)?;
    let (major, minor) = gpu.compute_capability();
    println!(
        "device: {} ({}), cc {major}.{minor}, {} SMs, {}; kernel from {}",
        gpu.name(),
        gpu.pci_bus_id(),
        gpu.multiprocessor_count(),
        cuda::driver_status(),
        unpacker.kernel().source()
    );

    let total = args.mib << 20;
    let t0 = Instant::now();
    let mut rng = Rng(0x7c9);
    let mut host = vec![0u8; total];
    for chunk in host.chunks_mut(8) {
        let v = rng.next().to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
    let bounce = gpu.alloc(total)?;
    bounce.copy_from_host(0, &host)?;
    let dst = gpu.alloc(total)?;
    let d2d_dst = gpu.alloc(total)?;
    let work = uniform(total, args.frag, &mut rng);
    let mut pinned = PinnedHostBuffer::new(&gpu, work.metas.len() * 16)?;
    pinned
        .as_mut_slice()
        .copy_from_slice(cuda::unpack::meta_bytes(&work.metas));
    let dev_metas = gpu.alloc(work.metas.len() * 16)?;
    dev_metas.copy_from_host(0, cuda::unpack::meta_bytes(&work.metas))?;
    let e_pinned = entries(&work, pinned.device_ptr(), &bounce, &dst);
    let e_device = entries(&work, dev_metas.device_ptr(), &bounce, &dst);
    println!(
        "payload: {} MiB in {} fragments of {} B, {} receives of up to {} fragments, source \
         pages shuffled (setup {:.1} s)",
        args.mib,
        work.metas.len(),
        args.frag,
        work.receives.len(),
        MAX_FRAGMENTS_PER_SLOT,
        t0.elapsed().as_secs_f64()
    );

    // Correctness first: one unpack, compared with the CPU reference.
    // SAFETY: every address lies in the live buffers above, which outlive the wait.
    unsafe { unpacker.launch(&e_pinned)? }.wait()?;
    let got = dst.to_vec()?;
    let mut expect = vec![0u8; total];
    for (&(first, count), &base) in work.receives.iter().zip(&work.dst_bases) {
        cuda::unpack::gather_cpu(
            &host,
            &work.metas[first..first + count],
            &mut expect[base as usize..],
        )?;
    }
    if got != expect {
        return Err("unpack result differs from the CPU reference".into());
    }
    println!("check: GPU unpack equals the CPU reference ({total} bytes)");
    drop((got, expect));

    let iters = args.iters;
    let rounds = args.rounds;
    let stream = unpacker.stream();
    let d2d = || {
        // SAFETY: both buffers are live and `total` bytes long; nothing else touches d2d_dst.
        unsafe { stream.copy_raw_async(d2d_dst.device_ptr(), bounce.device_ptr(), total) }
            .expect("cuMemcpyAsync");
    };
    // Warm up both.
    time_rounds(&gpu, &unpacker, 1, 3, d2d)?;
    time_rounds(&gpu, &unpacker, 1, 3, || {
        // SAFETY: the entries point into buffers that live until `run` returns, and every
        // round ends by synchronizing the stream.
        unsafe { unpack(&unpacker, &e_pinned) }
    })?;

    // Alternate rounds so that clocks and thermals affect both alike.
    let mut d2d_ms = Vec::new();
    let mut pinned_ms = Vec::new();
    let mut device_ms = Vec::new();
    for _ in 0..rounds {
        d2d_ms.push(time_rounds(&gpu, &unpacker, 1, iters, d2d)?);
        pinned_ms.push(time_rounds(&gpu, &unpacker, 1, iters, || {
            // SAFETY: the entries point into buffers that live until `run` returns, and every
            // round ends by synchronizing the stream.
            unsafe { unpack(&unpacker, &e_pinned) }
        })?);
        device_ms.push(time_rounds(&gpu, &unpacker, 1, iters, || {
            // SAFETY: the entries point into buffers that live until `run` returns, and every
            // round ends by synchronizing the stream.
            unsafe { unpack(&unpacker, &e_device) }
        })?);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let d2d_t = median(&mut d2d_ms);
    let pinned_t = median(&mut pinned_ms);
    let device_t = median(&mut device_ms);
    let bytes = total as u64;
    let d2d_bw = gbps(bytes, d2d_t);
    let cfg = unpacker.config();
    let cfg_s = format!(
        "{}t/{}f/grid {}",
        cfg.threads_per_block,
        cfg.frags_per_block,
        unpacker.grid_cap()
    );
    println!(
        "bytes counted: payload (each byte read once and written once); r+w = 2 x payload; \
         median of {rounds} rounds x {iters} iterations"
    );
    println!(
        "| variant | config | ms/iter | GB/s payload | GB/s r+w | ratio vs D2D |\n|---|---|---|---|---|---|"
    );
    println!(
        "| D2D cuMemcpyAsync | - | {d2d_t:.4} | {:.1} | {:.1} | 1.000 |",
        d2d_bw,
        2.0 * d2d_bw
    );
    for (name, t) in [
        ("unpack, metas in pinned host", pinned_t),
        ("unpack, metas in device memory", device_t),
    ] {
        let bw = gbps(bytes, t);
        println!(
            "| {name} | {cfg_s} | {t:.4} | {bw:.1} | {:.1} | {:.3} |",
            2.0 * bw,
            bw / d2d_bw
        );
    }
    println!(
        "RESULT gpu=\"{}\" frag={} mib={} d2d_gbps={:.1} unpack_pinned_gbps={:.1} \
         unpack_device_gbps={:.1} ratio_pinned={:.3} ratio_device={:.3}",
        gpu.name(),
        args.frag,
        args.mib,
        d2d_bw,
        gbps(bytes, pinned_t),
        gbps(bytes, device_t),
        gbps(bytes, pinned_t) / d2d_bw,
        gbps(bytes, device_t) / d2d_bw
    );

    if args.mixed {
        let mw = mixed(total, args.frag, &mut rng);
        let mut mp = PinnedHostBuffer::new(&gpu, mw.metas.len() * 16)?;
        mp.as_mut_slice()
            .copy_from_slice(cuda::unpack::meta_bytes(&mw.metas));
        let me = entries(&mw, mp.device_ptr(), &bounce, &dst);
        // SAFETY: the entries point into `mp`, `bounce` and `dst`, which live until this block
        // ends, and the launch is waited for before any of them is read or dropped.
        unsafe { unpacker.launch(&me)? }.wait()?;
        let got = dst.to_vec()?;
        let mut expect = got.clone();
        for (&(first, count), &base) in mw.receives.iter().zip(&mw.dst_bases) {
            cuda::unpack::gather_cpu(
                &host,
                &mw.metas[first..first + count],
                &mut expect[base as usize..],
            )?;
        }
        if got != expect {
            return Err("mixed unpack differs from the CPU reference".into());
        }
        let t = time_rounds(&gpu, &unpacker, rounds, iters, || {
            // SAFETY: the entries point into buffers that live until `run` returns, and every
            // round ends by synchronizing the stream.
            unsafe { unpack(&unpacker, &me) }
        })?;
        let bw = gbps(mw.payload, t);
        println!(
            "| unpack mixed 1..{} B, unaligned, pinned metas ({} MiB payload) | {cfg_s} | {t:.4} | {bw:.1} | {:.1} | {:.3} |",
            args.frag,
            mw.payload >> 20,
            2.0 * bw,
            bw / d2d_bw
        );
    }

    if args.sweep {
        println!("\nsweep (metas in pinned host memory; ratio vs the D2D above):");
        println!("| threads | frags/block | max blocks | grid | ms/iter | GB/s payload | ratio |\n|---|---|---|---|---|---|---|");
        let mut best = (0.0, LaunchConfig::default());
        for threads in [128u32, 256, 512] {
            for fpb in [8u32, 16, 32, 64, 128] {
                for max_blocks in [0u32, gpu.multiprocessor_count() * 2] {
                    let config = LaunchConfig {
                        threads_per_block: threads,
                        frags_per_block: fpb,
                        max_blocks,
                    };
                    if unpacker.set_config(config).is_err() {
                        continue;
                    }
                    let t = time_rounds(&gpu, &unpacker, 3, iters, || {
                        // SAFETY: the entries point into buffers that live until `run` returns, and every
                        // round ends by synchronizing the stream.
                        unsafe { unpack(&unpacker, &e_pinned) }
                    })?;
                    let bw = gbps(bytes, t);
                    println!(
                        "| {threads} | {fpb} | {max_blocks} | {} | {t:.4} | {bw:.1} | {:.3} |",
                        unpacker.grid_cap(),
                        bw / d2d_bw
                    );
                    if bw > best.0 {
                        best = (bw, config);
                    }
                }
            }
        }
        println!(
            "best: {:?} at {:.1} GB/s ({:.3} of D2D)",
            best.1,
            best.0,
            best.0 / d2d_bw
        );
    }
    Ok(())
}
