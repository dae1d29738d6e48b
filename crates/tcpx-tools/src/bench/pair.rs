//! The server and client roles of `tcpx-bench`: two processes (on one machine, two namespaces
//! or two nodes) with one Endpoint each. The client sends, the server receives; after every
//! size the server answers with a small acknowledgement transfer, so the client's clock stops
//! only when the last byte has *arrived*. The raw-TCP baseline moves the same bytes over as
//! many plain TCP streams as there are channels, to the server's port + 1, in the same run.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

use tcpx_runtime::control::metadata::EndpointMetadata;
use tcpx_runtime::{Connection, Endpoint, Region, Transfer};

use super::report::Row;
use super::stats;

/// Exit codes scripts can rely on.
pub mod exit {
    /// Success.
    pub const OK: i32 = 0;
    /// Any other failure.
    pub const ERROR: i32 = 1;
    /// Bad command line.
    pub const USAGE: i32 = 2;
    /// The peer could not be reached or went away.
    pub const PEER: i32 = 3;
    /// Received bytes differed from what was sent (`--verify`).
    pub const VERIFY: i32 = 4;
}

/// A failure with the exit code it maps to.
#[derive(Debug)]
pub struct Failure {
    /// Process exit code.
    pub code: i32,
    /// What went wrong.
    pub error: anyhow::Error,
}

impl<E: Into<anyhow::Error>> From<E> for Failure {
    fn from(e: E) -> Self {
        Self {
            code: exit::ERROR,
            error: e.into(),
        }
    }
}

fn peer_failure(e: impl Into<anyhow::Error>) -> Failure {
    Failure {
        code: exit::PEER,
        error: e.into(),
    }
}

/// The sweep both roles run; both must be given the same values.
#[derive(Clone, Debug)]
pub struct Sweep {
    /// Message sizes in bytes.
    pub sizes: Vec<usize>,
    /// Measured messages per size (the client caps large sizes to about 1 GiB moved).
    pub iters: usize,
    /// Unmeasured messages per size.
    pub warmup: usize,
    /// Messages in flight at once.
    pub depth: usize,
    /// Channels (for the baseline's stream count and the report).
    pub channels: usize,
    /// Run the raw-TCP baseline.
    pub baseline: bool,
    /// Fill with a pattern and check every received message (costs CPU time on both sides).
    pub verify: bool,
    /// Every wait gives up after this long.
    pub timeout: Duration,
    /// "host" or "cuda": what the messages live in (reported with every row).
    pub memory: &'static str,
    /// With `memory == "cuda"`: the GPU this process allocates its messages on.
    pub gpu: usize,
}

impl Sweep {
    /// Messages per size actually measured: at most about 1 GiB per size, at least 8.
    pub fn iters_for(&self, size: usize) -> usize {
        self.iters.min(((1usize << 30) / size.max(1)).max(8))
    }
}

const ACK_BYTES: usize = 8;

/// Line the server prints once it accepts connections; launchers wait for it.
pub const METADATA_PREFIX: &str = "TCPX-BENCH-METADATA";

/// The receiving side: accepts one connection, receives the sweep, acknowledges each size.
pub fn serve(endpoint: &Endpoint, baseline: &TcpListener, sweep: &Sweep) -> Result<(), Failure> {
    let conn = endpoint
        .accept_timeout(sweep.timeout * 4)
        .map_err(peer_failure)?;
    let regions = alloc_slots(endpoint, &conn, sweep)?;
    let ack = endpoint.alloc_host(ACK_BYTES)?;
    conn.register(&ack)?;
    for &size in &sweep.sizes {
        let total = sweep.warmup + sweep.iters_for(size);
        let mut inflight: VecDeque<(Transfer, usize)> = VecDeque::with_capacity(sweep.depth);
        let mut posted = 0;
        while posted < total || !inflight.is_empty() {
            while posted < total && inflight.len() < sweep.depth {
                let slot = posted % regions.len();
                inflight.push_back((conn.recv(&regions[slot], 0, size)?, slot));
                posted += 1;
            }
            let (t, slot) = inflight.pop_front().expect("non-empty");
            let got = t.wait(sweep.timeout).map_err(peer_failure)?;
            if got as usize != size {
                return Err(anyhow!("received {got} bytes for a {size}-byte message").into());
            }
            if sweep.verify {
                verify_slot(&regions[slot], size)?;
            }
        }
        conn.send(&ack, 0, ACK_BYTES)?
            .wait(sweep.timeout)
            .map_err(peer_failure)?;
        if sweep.baseline {
            baseline_receive(baseline, size, sweep).map_err(peer_failure)?;
        }
    }
    conn.close().map_err(peer_failure)?;
    Ok(())
}

/// The sending side: connects, runs the sweep, returns one row per size.
pub fn drive(
    endpoint: &Endpoint,
    peer: &EndpointMetadata,
    sweep: &Sweep,
    mut on_row: impl FnMut(&Row),
) -> Result<Vec<Row>, Failure> {
    let conn = endpoint.connect(peer).map_err(peer_failure)?;
    let regions = alloc_slots(endpoint, &conn, sweep)?;
    if sweep.verify {
        let mut pattern = vec![0u8; regions.first().map_or(0, Region::len)];
        fill_pattern(&mut pattern);
        for region in &regions {
            // Host or GPU memory alike (a copy to the GPU for CUDA regions).
            region.write(0, &pattern)?;
        }
    }
    let ack = endpoint.alloc_host(ACK_BYTES)?;
    conn.register(&ack)?;
    let baseline_addr = SocketAddr::new(
        peer.control_addr.ip(),
        peer.control_addr.port().wrapping_add(1),
    );
    let mut rows = Vec::with_capacity(sweep.sizes.len());
    for &size in &sweep.sizes {
        let iters = sweep.iters_for(size);
        let (elapsed, mut latencies) = send_size(&conn, &regions, &ack, size, iters, sweep)?;
        let gbps = stats::gbps(size * iters, elapsed);
        let baseline_gbps = if sweep.baseline {
            let t = baseline_send(baseline_addr, size, sweep).map_err(peer_failure)?;
            stats::gbps(size * iters, t)
        } else {
            0.0
        };
        let row = Row::new(
            size,
            gbps,
            baseline_gbps,
            &mut latencies,
            sweep.channels,
            sweep.memory,
        );
        on_row(&row);
        rows.push(row);
    }
    conn.close().map_err(peer_failure)?;
    Ok(rows)
}

fn send_size(
    conn: &Connection,
    regions: &[Region],
    ack: &Region,
    size: usize,
    iters: usize,
    sweep: &Sweep,
) -> Result<(Duration, Vec<Duration>), Failure> {
    let total = sweep.warmup + iters;
    let mut inflight: VecDeque<(Transfer, Instant)> = VecDeque::with_capacity(sweep.depth);
    let mut latencies = Vec::with_capacity(iters);
    let mut posted = 0;
    let mut done = 0;
    let mut t0 = Instant::now();
    while done < total {
        while posted < total && inflight.len() < sweep.depth {
            let region = &regions[posted % regions.len()];
            inflight.push_back((conn.send(region, 0, size)?, Instant::now()));
            posted += 1;
        }
        let (t, started) = inflight.pop_front().expect("non-empty");
        t.wait(sweep.timeout).map_err(peer_failure)?;
        done += 1;
        if done == sweep.warmup {
            t0 = Instant::now();
        } else if done > sweep.warmup {
            latencies.push(started.elapsed());
        }
    }
    // The clock stops when the server confirms it has everything.
    let got = conn
        .recv(ack, 0, ACK_BYTES)?
        .wait(sweep.timeout)
        .map_err(peer_failure)?;
    if got as usize != ACK_BYTES {
        return Err(anyhow!("acknowledgement of {got} bytes, expected {ACK_BYTES}").into());
    }
    Ok((t0.elapsed(), latencies))
}

/// One buffer per message in flight (`depth`, capped at 1 GiB in all), each its own region:
/// the CPU may check one (`--verify`) while the network fills the others.
fn alloc_slots(
    endpoint: &Endpoint,
    conn: &Connection,
    sweep: &Sweep,
) -> Result<Vec<Region>, Failure> {
    let max = sweep.sizes.iter().copied().max().unwrap_or(1).max(1);
    let slots = ((1usize << 30) / max).clamp(1, sweep.depth.max(1));
    let mut regions = Vec::with_capacity(slots);
    let gpu = match sweep.memory {
        "cuda" => Some(
            tcpx::cuda::CudaDevice::new(sweep.gpu)
                .with_context(|| format!("open GPU {} for --memory cuda", sweep.gpu))?,
        ),
        _ => None,
    };
    for _ in 0..slots {
        let region = match &gpu {
            Some(gpu) => endpoint.alloc_cuda_on(gpu, max)?,
            None => endpoint.alloc_host(max)?,
        };
        conn.register(&region)?;
        regions.push(region);
    }
    Ok(regions)
}

fn fill_pattern(buf: &mut [u8]) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (i as u32).wrapping_mul(2_654_435_761).rotate_right(13) as u8;
    }
}

fn verify_slot(region: &Region, len: usize) -> Result<(), Failure> {
    let first_bad = |got: &[u8]| {
        got.iter()
            .enumerate()
            .position(|(i, &x)| x != (i as u32).wrapping_mul(2_654_435_761).rotate_right(13) as u8)
    };
    let bad = if region.kind() == tcpx::MemoryKind::Cuda {
        // GPU memory: copy it back to the host first.
        let mut back = vec![0u8; len];
        region.read(0, &mut back)?;
        first_bad(&back)
    } else {
        region.memory().with_bytes(|b| first_bad(&b[..len]))?
    };
    match bad {
        None => Ok(()),
        Some(i) => Err(Failure {
            code: exit::VERIFY,
            error: anyhow!("verification failed: a {len}-byte message differs at byte {i}"),
        }),
    }
}

fn baseline_streams(size: usize, sweep: &Sweep) -> (usize, usize) {
    let streams = sweep.channels.max(1);
    (streams, size.div_ceil(streams))
}

fn baseline_send(addr: SocketAddr, size: usize, sweep: &Sweep) -> Result<Duration> {
    let iters = sweep.iters_for(size);
    let (streams, share) = baseline_streams(size, sweep);
    let mut conns = Vec::with_capacity(streams);
    for _ in 0..streams {
        let s = TcpStream::connect_timeout(&addr, sweep.timeout)
            .with_context(|| format!("baseline connect to {addr}"))?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(sweep.timeout))?;
        s.set_write_timeout(Some(sweep.timeout))?;
        conns.push(s);
    }
    let t0 = Instant::now();
    std::thread::scope(|s| -> Result<()> {
        let workers: Vec<_> = conns
            .iter_mut()
            .map(|c| {
                s.spawn(move || -> std::io::Result<()> {
                    let buf = vec![0x5au8; share];
                    for _ in 0..iters {
                        c.write_all(&buf)?;
                    }
                    Ok(())
                })
            })
            .collect();
        for w in workers {
            w.join()
                .map_err(|_| anyhow!("baseline writer panicked"))??;
        }
        Ok(())
    })?;
    let mut ack = [0u8; 1];
    conns[0]
        .read_exact(&mut ack)
        .context("baseline acknowledgement")?;
    Ok(t0.elapsed())
}

fn baseline_receive(listener: &TcpListener, size: usize, sweep: &Sweep) -> Result<()> {
    let iters = sweep.iters_for(size);
    let (streams, share) = baseline_streams(size, sweep);
    let mut conns = Vec::with_capacity(streams);
    listener.set_nonblocking(true)?;
    let deadline = Instant::now() + sweep.timeout;
    while conns.len() < streams {
        match listener.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false)?;
                s.set_read_timeout(Some(sweep.timeout))?;
                conns.push(s);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() > deadline {
                    bail!(
                        "baseline: {} of {streams} streams connected within {:?}",
                        conns.len(),
                        sweep.timeout
                    );
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => return Err(e).context("baseline accept"),
        }
    }
    std::thread::scope(|s| -> Result<()> {
        let workers: Vec<_> = conns
            .iter_mut()
            .map(|c| {
                s.spawn(move || -> std::io::Result<()> {
                    let mut buf = vec![0u8; share];
                    for _ in 0..iters {
                        c.read_exact(&mut buf)?;
                    }
                    Ok(())
                })
            })
            .collect();
        for w in workers {
            w.join()
                .map_err(|_| anyhow!("baseline reader panicked"))??;
        }
        Ok(())
    })?;
    conns[0]
        .write_all(&[1])
        .context("baseline acknowledgement")?;
    Ok(())
}
