//! `tcpx-bench stack`: throughput through the whole stack against raw TCP, same streams, same run: host memory,
//! or GPU memory on both sides ([`ThroughputOptions::gpus`]), which the built-in socket plugin
//! moves through the engines' pinned staging rings (the baseline stays host-to-host TCP).
//!
//! Stack: two endpoints in this process connected over loopback with `channels` channels;
//! per repetition, enough transfers of `size` bytes to move about `bytes_per_rep` are
//! submitted at once (receives first) and timed until the last completes.
//!
//! Baseline: `channels` TCP connections over loopback, one writer and one reader thread per
//! connection, each connection carrying exactly the bytes the stack's schedule puts on the
//! corresponding channel, in the same chunk sizes, from and into buffers of the same total
//! footprint as the stack's message (so both pay the same cache misses). Stack and baseline
//! repetitions alternate so both see the same machine conditions.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use tcpx_runtime::schedule::Schedule;
use tcpx_runtime::{Backend, Backoff, Config, Connection, Endpoint, Region, Transfer};

/// What to measure.
#[derive(Debug, Clone)]
pub struct ThroughputOptions {
    /// Channels of the connection, and TCP streams of the baseline.
    pub channels: u16,
    /// Chunk size of the stack (and write size of the baseline).
    pub chunk_bytes: u32,
    /// Message sizes.
    pub sizes: Vec<usize>,
    /// Bytes moved per repetition and size (rounded up to whole messages).
    pub bytes_per_rep: usize,
    /// Repetitions per size (after one warm-up); the median is reported.
    pub reps: usize,
    /// Engine idle policy.
    pub backoff: Backoff,
    /// Plugin to run on.
    pub backend: Backend,
    /// Engine threads per device; `None`: the endpoint's automatic choice.
    pub engines_per_device: Option<usize>,
    /// CUDA memory on GPU `gpus[0]` (sender) and `gpus[1]` (receiver) instead of host
    /// memory; `None`: host memory.
    pub gpus: Option<[usize; 2]>,
    /// Fill the source with a pattern once and, after each size's timed repetitions, copy
    /// the destination back to the host and check it (fails the run on any difference).
    pub verify: bool,
}

impl Default for ThroughputOptions {
    fn default() -> Self {
        Self {
            channels: 4,
            chunk_bytes: tcpx_runtime::schedule::DEFAULT_CHUNK_BYTES,
            sizes: vec![1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20],
            bytes_per_rep: 1 << 30,
            reps: 3,
            backoff: Backoff::Park,
            backend: Backend::Builtin,
            engines_per_device: None,
            gpus: None,
            verify: false,
        }
    }
}

/// One message size's figures.
#[derive(Debug, Clone, PartialEq)]
pub struct ThroughputRow {
    /// Message size in bytes.
    pub size: usize,
    /// Messages per repetition.
    pub messages: usize,
    /// Whole stack, GB/s (median).
    pub stack_gbps: f64,
    /// Raw TCP, same streams, GB/s (median).
    pub tcp_gbps: f64,
    /// Application time per submitted transfer (send or receive), microseconds (median).
    pub submit_us: f64,
}

impl ThroughputRow {
    /// Stack / raw TCP.
    pub fn ratio(&self) -> f64 {
        if self.tcp_gbps > 0.0 {
            self.stack_gbps / self.tcp_gbps
        } else {
            0.0
        }
    }
}

/// [`throughput`], kept under its historical name (it measures GPU memory too when
/// [`ThroughputOptions::gpus`] is set).
pub fn host_throughput(opts: &ThroughputOptions) -> Result<Vec<ThroughputRow>> {
    throughput(opts)
}

/// Runs the comparison on loopback only: the control plane on 127.0.0.1, the data on the
/// plugin's `lo` device (the caller sets `TCPX_SOCKET_IFNAME=lo` before the first plugin
/// use; any other device is refused before traffic starts).
pub fn throughput(opts: &ThroughputOptions) -> Result<Vec<ThroughputRow>> {
    let config = Config::builder()
        .backend(opts.backend.clone())
        .control_addr("127.0.0.1:0".parse().context("loopback address")?)
        .channels(opts.channels)
        .chunk_bytes(opts.chunk_bytes)
        .backoff(opts.backoff)
        .timeout(Duration::from_secs(120))
        .build()?;
    let config = Config {
        engines_per_device: opts.engines_per_device,
        ..config
    };
    let a = Endpoint::new(config.clone())?;
    let b = Endpoint::new(config)?;
    // A loopback benchmark must not touch another interface: refuse before any traffic.
    for (device, _) in a.engines() {
        let name = a
            .net()
            .device(device)
            .map(|d| d.properties.name)
            .unwrap_or_default();
        if name != "lo" {
            bail!(
                "device {device} is {name:?}, not lo: set TCPX_SOCKET_IFNAME=lo before the \
                 first plugin use to keep this benchmark on loopback"
            );
        }
    }
    let meta = a.metadata().clone();
    let (ab, ba) = std::thread::scope(|s| {
        let accepted = s.spawn(|| a.accept());
        let ba = b.connect(&meta);
        let ab = accepted
            .join()
            .map_err(|_| anyhow!("accept thread panicked"))?;
        Ok::<_, anyhow::Error>((ab?, ba?))
    })?;
    let max = opts.sizes.iter().copied().max().unwrap_or(0).max(1);
    let (src, dst) = match opts.gpus {
        None => (a.alloc_host(max)?, b.alloc_host(max)?),
        Some([ga, gb]) => {
            let open =
                |i: usize| tcpx::cuda::CudaDevice::new(i).with_context(|| format!("GPU {i}"));
            (
                a.alloc_cuda_on(&open(ga)?, max)?,
                b.alloc_cuda_on(&open(gb)?, max)?,
            )
        }
    };
    ab.register(&src)?;
    ba.register(&dst)?;
    let pattern = if opts.verify {
        let bytes: Vec<u8> = (0..max).map(pattern_byte).collect();
        src.write(0, &bytes)?;
        bytes
    } else {
        Vec::new()
    };

    let mut rows = Vec::with_capacity(opts.sizes.len());
    for &size in &opts.sizes {
        let messages = opts.bytes_per_rep.div_ceil(size.max(1)).max(1);
        let total = (messages * size) as u64;
        let per_stream = stream_bytes(size, messages, opts.chunk_bytes, opts.channels)?;
        let mut stack = Vec::with_capacity(opts.reps);
        let mut tcp = Vec::with_capacity(opts.reps);
        let mut submit = Vec::with_capacity(opts.reps);
        for rep in 0..=opts.reps {
            let (t_stack, t_submit) = stack_once(&ab, &ba, &src, &dst, size, messages)?;
            let t_tcp = tcp_once(&per_stream, opts.chunk_bytes as usize, size)?;
            // Repetition 0 is the warm-up.
            if rep > 0 {
                stack.push(gbps(total, t_stack));
                tcp.push(gbps(total, t_tcp));
                submit.push(t_submit.as_secs_f64() * 1e6 / (2 * messages) as f64);
            }
        }
        if opts.verify {
            // After the timed part: copy the destination back and compare.
            let mut back = vec![0u8; size];
            dst.read(0, &mut back)?;
            if let Some(at) = back.iter().zip(&pattern).position(|(x, y)| x != y) {
                bail!("verification failed: {size}-byte messages differ at byte {at}");
            }
        }
        rows.push(ThroughputRow {
            size,
            messages,
            stack_gbps: median(&mut stack),
            tcp_gbps: median(&mut tcp),
            submit_us: median(&mut submit),
        });
    }
    Ok(rows)
}

fn stack_once(
    ab: &Connection,
    ba: &Connection,
    src: &Region,
    dst: &Region,
    size: usize,
    messages: usize,
) -> Result<(Duration, Duration)> {
    let start = Instant::now();
    let mut pending: Vec<Transfer> = Vec::with_capacity(2 * messages);
    for _ in 0..messages {
        pending.push(ba.recv(dst, 0, size)?);
        pending.push(ab.send(src, 0, size)?);
    }
    let submitted = start.elapsed();
    // The last transfers finish (about) last: waiting on them first means one wake-up per
    // repetition instead of one per transfer; the rest are then checked without blocking.
    for t in pending.iter().rev() {
        t.wait(Duration::from_secs(120))?;
    }
    Ok((start.elapsed(), submitted))
}

/// The verification pattern (position-dependent, so misplaced chunks show).
fn pattern_byte(i: usize) -> u8 {
    ((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8 ^ (i >> 12) as u8
}

/// Bytes each stream carries when `messages` messages of `size` go through the stack's
/// schedule (rotated per message, as the runtime does).
fn stream_bytes(size: usize, messages: usize, chunk: u32, channels: u16) -> Result<Vec<u64>> {
    let mut per = vec![0u64; usize::from(channels)];
    for m in 0..messages {
        let schedule = Schedule::contiguous(size as u64, chunk, channels)
            .map_err(|e| anyhow!("{e}"))?
            .rotated(m as u64);
        for (c, bytes) in per.iter_mut().enumerate() {
            // `c` < channels, a u16.
            *bytes += schedule
                .on_channel(c as u16)
                .map(|ch| u64::from(ch.len))
                .sum::<u64>();
        }
    }
    Ok(per)
}

fn tcp_once(per_stream: &[u64], chunk: usize, message: usize) -> Result<Duration> {
    let io = |what: &str, e: std::io::Error| anyhow!("raw TCP baseline: {what}: {e}");
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| io("bind", e))?;
    let addr = listener.local_addr().map_err(|e| io("local_addr", e))?;
    let mut pairs = Vec::with_capacity(per_stream.len());
    for _ in per_stream {
        let tx = TcpStream::connect(addr).map_err(|e| io("connect", e))?;
        let (rx, _) = listener.accept().map_err(|e| io("accept", e))?;
        tx.set_nodelay(true).map_err(|e| io("nodelay", e))?;
        pairs.push((tx, rx));
    }
    // Each stream's share of one message, in whole chunks: the streams' buffers together
    // cover one message, like the stack's source and destination regions.
    let share = message
        .div_ceil(per_stream.len().max(1))
        .next_multiple_of(chunk)
        .max(chunk);
    let barrier = Arc::new(Barrier::new(2 * per_stream.len() + 1));
    let mut readers = Vec::with_capacity(per_stream.len());
    let mut writers = Vec::with_capacity(per_stream.len());
    for ((mut tx, mut rx), &bytes) in pairs.into_iter().zip(per_stream) {
        let (bw, br) = (barrier.clone(), barrier.clone());
        writers.push(std::thread::spawn(move || -> std::io::Result<()> {
            let buf = vec![0x5au8; share];
            bw.wait();
            stream_chunks(bytes, chunk, share, |range| tx.write_all(&buf[range]))
        }));
        readers.push(std::thread::spawn(move || -> std::io::Result<()> {
            let mut buf = vec![0u8; share];
            br.wait();
            stream_chunks(bytes, chunk, share, |range| rx.read_exact(&mut buf[range]))
        }));
    }
    barrier.wait();
    let start = Instant::now();
    for t in readers {
        t.join()
            .map_err(|_| anyhow!("reader panicked"))?
            .map_err(|e| io("read", e))?;
    }
    let elapsed = start.elapsed();
    for t in writers {
        t.join()
            .map_err(|_| anyhow!("writer panicked"))?
            .map_err(|e| io("write", e))?;
    }
    Ok(elapsed)
}

/// Calls `io` on consecutive chunk-sized ranges of a `share`-byte buffer (wrapping around)
/// until `bytes` are covered.
fn stream_chunks(
    bytes: u64,
    chunk: usize,
    share: usize,
    mut io: impl FnMut(std::ops::Range<usize>) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let mut left = bytes;
    let mut at = 0usize;
    while left > 0 {
        let n = left.min(chunk as u64) as usize;
        if at + n > share {
            at = 0;
        }
        io(at..at + n)?;
        at += n;
        left -= n as u64;
    }
    Ok(())
}

/// The median of `samples` (0 when empty; the mean of the middle two for even counts).
pub(crate) fn median(samples: &mut [f64]) -> f64 {
    samples.sort_by(f64::total_cmp);
    match samples.len() {
        0 => 0.0,
        n if n % 2 == 1 => samples[n / 2],
        n => (samples[n / 2 - 1] + samples[n / 2]) / 2.0,
    }
}

/// 10^9 bytes per second.
fn gbps(bytes: u64, elapsed: Duration) -> f64 {
    bytes as f64 / elapsed.as_secs_f64().max(1e-9) / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_carry_what_the_schedule_puts_on_their_channel() {
        // 3 chunks per message over 4 channels, rotated: every channel gets 3 of 4 messages.
        let per = stream_bytes(3 * 1024, 4, 1024, 4).unwrap();
        assert_eq!(per, vec![3 * 1024; 4]);
        let per = stream_bytes(2500, 1, 1024, 2).unwrap();
        assert_eq!(per, vec![1024 + 452, 1024]);
    }
}
