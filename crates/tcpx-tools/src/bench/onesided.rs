//! The one-sided sweep (nixlbench-like): WRITE / READ of `batch` blocks of `block` bytes per
//! operation between two endpoints in this process over loopback, against two-sided
//! send / recv of the same bytes (one contiguous message per operation) measured in the same
//! run. Throughput keeps `depth` operations in flight; latency is measured separately, one
//! operation at a time (write: until the target's acknowledgement arrives; read: until the
//! data arrived; two-sided: from the send until the pre-posted receive completed).
//!
//! With [`Options::gpus`] every region is CUDA memory (the initiator's on the first GPU, the
//! target's on the second): on the built-in socket plugin it is staged through the engines'
//! pinned rings, and batches of small blocks travel packed through the ring slots.
//! [`Layout::Scattered`] scatters the blocks on both sides (a KV cache's paged blocks);
//! [`Layout::Tensors`] gives every block a region of its own on both sides (a list of tensors).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;
use tcpx_runtime::{
    Backend, Config, Connection, Descriptor, Endpoint, Region, RemoteSegment, Segment, Transfer,
};

use super::stats;

/// The operation a row measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    /// Two-sided send / recv (the baseline alone).
    Send,
    /// One-sided write.
    Write,
    /// One-sided read.
    Read,
}

impl std::str::FromStr for Op {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s.trim() {
            "send" => Self::Send,
            "write" => Self::Write,
            "read" => Self::Read,
            other => bail!("--op {other}: expected send, write or read"),
        })
    }
}

/// Where a batch's blocks sit in the remote region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Layout {
    /// Block i at i · block on both sides: the batch coalesces into one run.
    Contiguous,
    /// Remote block i at 2 · i · block: nothing coalesces (one run per block).
    Strided,
    /// Local block i at 2 · i · block and remote block i at (2 · i + 1) · block: nothing
    /// coalesces on either side (paged KV blocks on both ends).
    Scattered,
    /// Every block its own region on both sides, registered (and, on the target, advertised)
    /// one by one: UCCL's `writev` / `readv` over a list of tensors.
    Tensors,
}

/// What to sweep.
#[derive(Debug, Clone)]
pub struct Options {
    /// Channels per connection (and RMA channels).
    pub channels: u16,
    /// Chunk size.
    pub chunk_bytes: u32,
    /// Operations to measure.
    pub ops: Vec<Op>,
    /// Block sizes.
    pub blocks: Vec<usize>,
    /// Blocks per operation.
    pub batches: Vec<usize>,
    /// Bytes moved per throughput measurement (at least `depth` operations).
    pub bytes_per_point: usize,
    /// Points whose operation (block · batch) exceeds this are skipped.
    pub max_op_bytes: usize,
    /// Operations in flight during the throughput phase.
    pub depth: usize,
    /// Operations timed one by one in the latency phase (per repetition).
    pub latency_iters: usize,
    /// Repetitions per point (interleaved); the median GB/s is reported.
    pub reps: usize,
    /// Remote block placement.
    pub layout: Layout,
    /// Transfer timeout.
    pub timeout: Duration,
    /// Plugin to run on.
    pub backend: Backend,
    /// CUDA memory instead of host memory: the initiator's regions on GPU `gpus[0]`, the
    /// target's on GPU `gpus[1]`.
    pub gpus: Option<[usize; 2]>,
}

/// One (op, block, batch) point.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// The measured operation.
    pub op: Op,
    /// Block bytes.
    pub block: usize,
    /// Blocks per operation.
    pub batch: usize,
    /// Remote layout.
    pub layout: Layout,
    /// GB/s of the operation.
    pub gbps: f64,
    /// GB/s of two-sided send / recv of the same bytes per operation.
    pub send_gbps: f64,
    /// `gbps / send_gbps`.
    pub ratio: f64,
    /// Median latency of one operation, µs.
    pub p50_us: f64,
    /// 99th percentile latency, µs.
    pub p99_us: f64,
    /// Median latency of the two-sided baseline, µs.
    pub send_p50_us: f64,
}

/// Two connected endpoints and the target's advertised regions.
struct Bench {
    initiator: Endpoint,
    target: Endpoint,
    ab: Connection,
    ba: Connection,
    timeout: Duration,
}

fn config(o: &Options) -> Result<Config> {
    // Packing, inline and idle knobs come from the environment (TCPX_PACK_BELOW=0 and
    // TCPX_PACK_STAGED_BELOW=0 measure the unpacked paths, TCPX_INLINE_BYTES=0 /
    // TCPX_INLINE_LONE_BYTES=0 / TCPX_INLINE_GPU_BYTES=0 small operations through the comms,
    // TCPX_BACKOFF / TCPX_ENGINE_LINGER_US / TCPX_WAIT_SPIN_US how threads wait, in the same
    // build); everything else from the flags.
    let env = Config::from_env()?;
    let config = Config::builder()
        .backend(o.backend.clone())
        .control_addr("127.0.0.1:0".parse().expect("literal"))
        .channels(o.channels)
        .chunk_bytes(o.chunk_bytes)
        .timeout(o.timeout)
        .backoff(env.backoff)
        .idle_linger(env.idle_linger)
        .wait_spin(env.wait_spin)
        .pack_below(env.pack_below)
        .pack_staged_below(env.pack_staged_below)
        .pack_buffers(env.pack_buffers)
        .inline_bytes(env.inline_bytes)
        .inline_lone_bytes(env.inline_lone_bytes)
        .inline_gpu_bytes(env.inline_gpu_bytes)
        .build()?;
    Ok(config)
}

/// Runs the sweep, handing each row to `on_row` as it is measured.
pub fn run(o: &Options, mut on_row: impl FnMut(&Row)) -> Result<()> {
    if std::env::var_os("TCPX_SOCKET_IFNAME").is_none() {
        // In-process benchmarks never leave loopback.
        std::env::set_var("TCPX_SOCKET_IFNAME", "lo");
    }
    let target = Endpoint::new(config(o)?)?;
    let initiator = Endpoint::new(config(o)?)?;
    let meta = target.metadata().clone();
    let (ab, ba) = std::thread::scope(|s| {
        let accepted = s.spawn(|| target.accept());
        let ab = initiator.connect(&meta);
        let ba = accepted
            .join()
            .map_err(|_| anyhow::anyhow!("accept thread panicked"));
        Ok::<_, anyhow::Error>((ab?, ba??))
    })
    .context("connect the two endpoints")?;
    let bench = Bench {
        initiator,
        target,
        ab,
        ba,
        timeout: o.timeout,
    };
    for &block in &o.blocks {
        for &batch in &o.batches {
            let op_bytes = block.saturating_mul(batch);
            if op_bytes > o.max_op_bytes {
                continue;
            }
            let point = bench.point(o, block, batch)?;
            // Repetitions interleave the operations so that load from elsewhere on the box
            // hits them alike; medians are reported.
            let mut gbps: Vec<Vec<f64>> = vec![Vec::new(); o.ops.len()];
            let mut lats: Vec<Vec<Duration>> = vec![Vec::new(); o.ops.len()];
            let (mut send_gbps, mut send_lat) = (Vec::new(), Vec::new());
            for _ in 0..o.reps.max(1) {
                send_gbps.push(point.throughput(o, Op::Send)?);
                send_lat.extend(point.latencies(o, Op::Send)?);
                for (i, &op) in o.ops.iter().enumerate() {
                    if op != Op::Send {
                        gbps[i].push(point.throughput(o, op)?);
                        lats[i].extend(point.latencies(o, op)?);
                    }
                }
            }
            let send_gbps = stats::median(&mut send_gbps);
            let send_p50 = micros(stats::percentile(&mut send_lat, 50.0));
            for (i, &op) in o.ops.iter().enumerate() {
                let (gbps, lat) = match op {
                    Op::Send => (send_gbps, &mut send_lat),
                    _ => (stats::median(&mut gbps[i]), &mut lats[i]),
                };
                let row = Row {
                    op,
                    block,
                    batch,
                    layout: o.layout,
                    gbps,
                    send_gbps,
                    ratio: if send_gbps > 0.0 {
                        gbps / send_gbps
                    } else {
                        0.0
                    },
                    p50_us: micros(stats::percentile(lat, 50.0)),
                    p99_us: micros(stats::percentile(lat, 99.0)),
                    send_p50_us: send_p50,
                };
                on_row(&row);
            }
            drop(point);
        }
    }
    // Which path the batches took (packed, fallbacks, pool growth), for the record.
    eprintln!(
        "# packing: initiator {:?}; target {:?}",
        bench.ab.pack_stats(),
        bench.ba.pack_stats()
    );
    eprintln!(
        "# inline: the target served {} operations with their data in control messages \
         (TCPX_INLINE_BYTES: up to {} bytes of host memory; TCPX_INLINE_LONE_BYTES: up to {} \
         of host memory while nothing else is in flight; TCPX_INLINE_GPU_BYTES: up to {} with \
         GPU memory while at most one other operation is pending)",
        bench.target.inline_served(),
        bench.initiator.config().inline_bytes,
        bench.initiator.config().inline_lone_bytes,
        bench.initiator.config().inline_gpu_bytes
    );
    Ok(())
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// The regions of one (block, batch) point.
struct Point<'b> {
    bench: &'b Bench,
    block: usize,
    batch: usize,
    /// Initiator: source of writes and two-sided sends.
    src: Region,
    /// Initiator: destination of reads.
    back: Region,
    /// Target: advertised, written to and read from; also the two-sided destination.
    dst: Region,
    descriptor: Descriptor,
    /// [`Layout::Tensors`]: one region per block on each side (source, destination of reads,
    /// target) and the target's advertisement of each; empty otherwise.
    tensors: Vec<[Region; 3]>,
    tensor_descriptors: Vec<Descriptor>,
}

impl Bench {
    fn point(&self, o: &Options, block: usize, batch: usize) -> Result<Point<'_>> {
        let op_bytes = block * batch;
        let (local_bytes, remote_bytes) = match o.layout {
            Layout::Strided => (op_bytes, 2 * op_bytes),
            // The send baseline's contiguous message; the blocks have regions of their own.
            Layout::Contiguous | Layout::Tensors => (op_bytes, op_bytes),
            Layout::Scattered => (2 * op_bytes, 2 * op_bytes),
        };
        let [src, back, dst] = self.regions(o, [local_bytes, local_bytes, remote_bytes])?;
        let descriptor = self.target.advertise(&dst)?;
        let (mut tensors, mut tensor_descriptors) = (Vec::new(), Vec::new());
        if o.layout == Layout::Tensors {
            for _ in 0..batch {
                let regions = self.regions(o, [block; 3])?;
                tensor_descriptors.push(self.target.advertise(&regions[2])?);
                tensors.push(regions);
            }
        }
        Ok(Point {
            bench: self,
            block,
            batch,
            src,
            back,
            dst,
            descriptor,
            tensors,
            tensor_descriptors,
        })
    }

    /// An initiator's source and read destination and a target's region of these sizes,
    /// the source filled with a pattern and all three registered up front (host: the
    /// plugin registrations; staged CUDA memory: every lane's pinned ring), so that no
    /// point's first operation pays for it.
    fn regions(&self, o: &Options, [local, back, remote]: [usize; 3]) -> Result<[Region; 3]> {
        let [src, back, dst] = match o.gpus {
            None => [
                self.initiator.alloc_host(local)?,
                self.initiator.alloc_host(back)?,
                self.target.alloc_host(remote)?,
            ],
            Some([gi, gt]) => {
                let open =
                    |i: usize| tcpx::cuda::CudaDevice::new(i).with_context(|| format!("GPU {i}"));
                let (gi, gt) = (open(gi)?, open(gt)?);
                [
                    self.initiator.alloc_cuda_on(&gi, local)?,
                    self.initiator.alloc_cuda_on(&gi, back)?,
                    self.target.alloc_cuda_on(&gt, remote)?,
                ]
            }
        };
        let pattern: Vec<u8> = (0..local).map(|i| (i % 251) as u8).collect();
        src.write(0, &pattern)?;
        for region in [&src, &back] {
            self.ab.register(region)?;
        }
        self.ba.register(&dst)?;
        Ok([src, back, dst])
    }
}

impl Drop for Point<'_> {
    fn drop(&mut self) {
        self.bench.target.revoke(&self.descriptor);
        for d in &self.tensor_descriptors {
            self.bench.target.revoke(d);
        }
    }
}

impl Point<'_> {
    fn op_bytes(&self) -> usize {
        self.block * self.batch
    }

    fn remote(&self, layout: Layout) -> Vec<RemoteSegment> {
        if layout == Layout::Tensors {
            return self
                .tensor_descriptors
                .iter()
                .map(|&d| RemoteSegment::new(d, 0, self.block as u64))
                .collect();
        }
        let (stride, first) = match layout {
            Layout::Contiguous | Layout::Tensors => (self.block, 0),
            Layout::Strided => (2 * self.block, 0),
            Layout::Scattered => (2 * self.block, self.block),
        };
        (0..self.batch)
            .map(|i| {
                RemoteSegment::new(
                    self.descriptor,
                    (first + i * stride) as u64,
                    self.block as u64,
                )
            })
            .collect()
    }

    /// The operation's local blocks: in `region`, or with [`Layout::Tensors`] in the
    /// blocks' own regions (`which`: 0 the sources, 1 the read destinations).
    fn local<'r>(&'r self, region: &'r Region, which: usize, layout: Layout) -> Vec<Segment<'r>> {
        if layout == Layout::Tensors {
            return self
                .tensors
                .iter()
                .map(|t| Segment::new(&t[which], 0, self.block))
                .collect();
        }
        let stride = match layout {
            Layout::Contiguous | Layout::Strided | Layout::Tensors => self.block,
            Layout::Scattered => 2 * self.block,
        };
        (0..self.batch)
            .map(|i| Segment::new(region, i * stride, self.block))
            .collect()
    }

    /// Starts one operation; for `Send`, the pre-posted receive and the send.
    fn start(&self, op: Op, layout: Layout) -> Result<Vec<Transfer>> {
        let b = self.bench;
        Ok(match op {
            Op::Write => {
                vec![b.ab.write(
                    &self.local(&self.src, 0, layout),
                    &self.remote(layout),
                    None,
                )?]
            }
            Op::Read => vec![b
                .ab
                .read(&self.local(&self.back, 1, layout), &self.remote(layout))?],
            Op::Send => {
                let rx = b.ba.recv(&self.dst, 0, self.op_bytes())?;
                let tx = b.ab.send(&self.src, 0, self.op_bytes())?;
                vec![rx, tx]
            }
        })
    }

    fn finish(&self, transfers: Vec<Transfer>) -> Result<()> {
        for t in transfers {
            t.wait(self.bench.timeout)?;
        }
        Ok(())
    }

    /// GB/s with `depth` operations in flight (after a short warm-up).
    fn throughput(&self, o: &Options, op: Op) -> Result<f64> {
        let layout = if op == Op::Send {
            Layout::Contiguous
        } else {
            o.layout
        };
        let ops = (o.bytes_per_point / self.op_bytes()).clamp(o.depth.max(2), 20_000);
        for _ in 0..o.depth.min(4) {
            let t = self.start(op, layout)?;
            self.finish(t)?;
        }
        let started = Instant::now();
        let mut in_flight = VecDeque::with_capacity(o.depth);
        for _ in 0..ops {
            if in_flight.len() >= o.depth.max(1) {
                if let Some(t) = in_flight.pop_front() {
                    self.finish(t)?;
                }
            }
            in_flight.push_back(self.start(op, layout)?);
        }
        for t in in_flight {
            self.finish(t)?;
        }
        Ok(stats::gbps(ops * self.op_bytes(), started.elapsed()))
    }

    /// Latency of single operations, one at a time.
    fn latencies(&self, o: &Options, op: Op) -> Result<Vec<Duration>> {
        let layout = if op == Op::Send {
            Layout::Contiguous
        } else {
            o.layout
        };
        let iters = (o.bytes_per_point / self.op_bytes()).clamp(3, o.latency_iters.max(3));
        let mut out = Vec::with_capacity(iters);
        for _ in 0..iters {
            let started = Instant::now();
            let t = self.start(op, layout)?;
            // For two-sided, the receive (first) completing is the delivery.
            if let Some(first) = t.first() {
                first.wait(self.bench.timeout)?;
            }
            out.push(started.elapsed());
            self.finish(t)?;
        }
        Ok(out)
    }
}
