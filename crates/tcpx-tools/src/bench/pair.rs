//! The server and client roles of `tcpx-bench`: two processes (on one machine, two namespaces
//! or two nodes) with one Endpoint each. The client sends, the server receives; after every
//! size the server answers with a small acknowledgement transfer, so the client's clock stops
//! only when the last byte has *arrived*. The raw-TCP baseline moves the same bytes over as
//! many plain TCP streams as there are channels, to the server's port + 1, in the same run.
//!
//! What is paid once is paid before any clock starts: both sides allocate, register and touch
//! every page of their message slots, then one full-size message goes through every slot (the
//! plugin's sockets, the engines and the kernel's buffers reach their working size). Per size,
//! the server says READY (its slots poisoned when verifying), the client times the size, the
//! server says DONE, and only then checks each slot byte for byte (`--verify`): the checker's
//! time is never inside a figure. Each DONE carries the page faults and registrations the
//! server saw inside its timed window, and the client adds its own (they should be zero).
//!
//! The baseline streams prove they belong to this run: the server sends a random token over
//! the (authenticated) tcpx connection first, and every baseline stream must open with it.
//! Anything else connecting to port + 1 is dropped after a short deadline of its own, logged
//! with its address, without holding up the real streams.

use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
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
    /// Measured messages per size (at least `min_bytes` worth, at most about 1 GiB).
    pub iters: usize,
    /// Each size moves at least this many bytes (measured and baseline alike), so that small
    /// sizes run long enough to mean something.
    pub min_bytes: usize,
    /// Unmeasured messages per size.
    pub warmup: usize,
    /// Messages in flight at once; `None` chooses per size ([`Sweep::depth_for`]).
    pub depth: Option<usize>,
    /// Plugin requests in flight per comm (what an automatic depth fills).
    pub window: usize,
    /// Channels (for the baseline's stream count and the report).
    pub channels: usize,
    /// Chunk size: how the baseline cuts a message over its streams, as the stack does.
    pub chunk: usize,
    /// Run the raw-TCP baseline.
    pub baseline: bool,
    /// Check every byte of every size after its timed part (the server poisons its slots
    /// before each size and checks each slot's last message after DONE).
    pub verify: bool,
    /// Every wait gives up after this long.
    pub timeout: Duration,
    /// "host" or "cuda": what the messages live in (reported with every row).
    pub memory: &'static str,
    /// With `memory == "cuda"`: the GPU this process allocates its messages on.
    pub gpu: usize,
}

impl Sweep {
    /// Messages per size actually measured: `iters`, raised to move at least `min_bytes`,
    /// capped to about 1 GiB, never fewer than 8.
    pub fn iters_for(&self, size: usize) -> usize {
        let size = size.max(1);
        let floor = self.min_bytes.div_ceil(size);
        self.iters
            .max(floor)
            .min(((1usize << 30) / size).max(8))
            .max(8)
    }

    /// Messages in flight at once for `size`: `--depth` if given, else enough to fill every
    /// channel's window (channels × window requests of at most one chunk each), and at least
    /// [`MIN_AUTO_DEPTH`]. The raw-TCP baseline streams its bytes with no limit in flight, so
    /// a fixed small depth measured the stack's latency at small sizes, not its throughput
    /// (H100, 8 channels, 4 KiB: depth 8 puts one message per channel in flight).
    pub fn depth_for(&self, size: usize) -> usize {
        self.depth.unwrap_or_else(|| {
            let chunks = size.max(1).div_ceil(self.chunk.max(1));
            (self.channels.max(1) * self.window.max(1))
                .div_ceil(chunks)
                .clamp(MIN_AUTO_DEPTH, MAX_AUTO_DEPTH)
        })
    }

    /// The largest depth of any size (how many message buffers to allocate).
    pub fn max_depth(&self) -> usize {
        self.sizes
            .iter()
            .map(|&s| self.depth_for(s))
            .max()
            .unwrap_or(MIN_AUTO_DEPTH)
    }
}

/// Fewest messages in flight an automatic depth chooses (the depth of earlier releases).
pub const MIN_AUTO_DEPTH: usize = 8;
/// Most messages in flight an automatic depth chooses.
pub const MAX_AUTO_DEPTH: usize = 1024;

/// The small control messages (token, READY, DONE + the server's timed-window counters).
const ACK_BYTES: usize = 24;

/// How long a stranger on the baseline port may take to present the run's token.
const STRANGER_DEADLINE: Duration = Duration::from_secs(2);

/// Unproven baseline connections held at once; beyond this the oldest is dropped.
const MAX_PENDING: usize = 256;

/// Line the server prints once it accepts connections; launchers wait for it.
pub const METADATA_PREFIX: &str = "TCPX-BENCH-METADATA";

/// What happened inside a timed window that should have been paid before it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TimedWork {
    /// Minor + major page faults of the process (first touches of memory).
    pub page_faults: u64,
    /// Plugin registrations added (`Endpoint::live_registrations`).
    pub registrations: u64,
}

/// A snapshot taken when a timed window opens.
struct Probe {
    faults: u64,
    registrations: usize,
}

impl Probe {
    fn start(endpoint: &Endpoint) -> Self {
        Self {
            faults: page_faults(),
            registrations: endpoint.live_registrations(),
        }
    }

    fn finish(&self, endpoint: &Endpoint) -> TimedWork {
        TimedWork {
            page_faults: page_faults().saturating_sub(self.faults),
            registrations: endpoint
                .live_registrations()
                .saturating_sub(self.registrations) as u64,
        }
    }
}

/// Page faults of this process so far (0 where `getrusage` fails).
fn page_faults() -> u64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: `usage` is a valid, writable rusage; getrusage only writes it.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) };
    if rc != 0 {
        return 0;
    }
    // SAFETY: getrusage succeeded, so the struct is initialised (it was zeroed anyway).
    let usage = unsafe { usage.assume_init() };
    (usage.ru_minflt.max(0) + usage.ru_majflt.max(0)) as u64
}

/// A fresh random token for this run's baseline streams.
fn new_token() -> Result<u64> {
    let mut bytes = [0u8; 8];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .context("read a baseline token from /dev/urandom")?;
    Ok(u64::from_le_bytes(bytes))
}

/// Sends `words` in the small control region and waits for it.
fn send_words(
    conn: &Connection,
    ack: &Region,
    words: [u64; 3],
    sweep: &Sweep,
) -> Result<(), Failure> {
    let mut bytes = [0u8; ACK_BYTES];
    for (chunk, w) in bytes.chunks_exact_mut(8).zip(words) {
        chunk.copy_from_slice(&w.to_le_bytes());
    }
    ack.write(0, &bytes)?;
    conn.send(ack, 0, ACK_BYTES)?
        .wait(sweep.timeout)
        .map_err(peer_failure)?;
    Ok(())
}

/// Receives one small control message (`what` names it in errors).
fn recv_words(
    conn: &Connection,
    ack: &Region,
    what: &str,
    sweep: &Sweep,
) -> Result<[u64; 3], Failure> {
    let got = conn
        .recv(ack, 0, ACK_BYTES)?
        .wait(sweep.timeout)
        .map_err(|e| {
            peer_failure(anyhow::Error::from(e).context(format!("waiting for the server's {what}")))
        })?;
    if got as usize != ACK_BYTES {
        return Err(anyhow!("the server's {what} was {got} bytes, expected {ACK_BYTES}").into());
    }
    let mut bytes = [0u8; ACK_BYTES];
    ack.read(0, &mut bytes)?;
    let mut words = [0u64; 3];
    for (w, chunk) in words.iter_mut().zip(bytes.chunks_exact(8)) {
        *w = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
    }
    Ok(words)
}

/// The receiving side: accepts one connection, receives the sweep, acknowledges each size.
pub fn serve(endpoint: &Endpoint, baseline: &TcpListener, sweep: &Sweep) -> Result<(), Failure> {
    let conn = endpoint
        .accept_timeout(sweep.timeout * 4)
        .map_err(peer_failure)?;
    let regions = alloc_slots(endpoint, &conn, sweep, None)?;
    let ack = endpoint.alloc_host(ACK_BYTES)?;
    conn.register(&ack)?;
    let token = new_token()?;
    send_words(&conn, &ack, [token, 0, 0], sweep)?;
    // Warm-up: one full-size message into every slot, before any clock.
    let max = regions.first().map_or(0, Region::len);
    let warm: Vec<Transfer> = regions
        .iter()
        .map(|r| conn.recv(r, 0, max))
        .collect::<tcpx_runtime::Result<_>>()?;
    for t in warm {
        t.wait(sweep.timeout).map_err(peer_failure)?;
    }
    let mut strangers = Strangers::default();
    for &size in &sweep.sizes {
        if sweep.verify {
            // A message that never lands must not pass for one that did.
            let poison = vec![0u8; size];
            for region in &regions {
                region.write(0, &poison)?;
            }
        }
        send_words(&conn, &ack, [0, 0, 0], sweep)?;
        let probe = Probe::start(endpoint);
        let total = sweep.warmup + sweep.iters_for(size);
        let depth = sweep.depth_for(size);
        let mut inflight: VecDeque<Transfer> = VecDeque::with_capacity(depth);
        let mut posted = 0;
        while posted < total || !inflight.is_empty() {
            while posted < total && inflight.len() < depth {
                let slot = posted % regions.len();
                inflight.push_back(conn.recv(&regions[slot], 0, size)?);
                posted += 1;
            }
            let t = inflight.pop_front().expect("non-empty");
            let got = t.wait(sweep.timeout).map_err(peer_failure)?;
            if got as usize != size {
                return Err(anyhow!("received {got} bytes for a {size}-byte message").into());
            }
        }
        let work = probe.finish(endpoint);
        send_words(
            &conn,
            &ack,
            [1, work.page_faults, work.registrations],
            sweep,
        )?;
        if sweep.verify {
            // After DONE: the client's clock has stopped. Every slot holds the last message
            // that landed in it (all of them did: total >= 8 >= slots or every slot was used).
            for region in regions.iter().take(total.min(regions.len())) {
                verify_slot(region, size)?;
            }
        }
        if sweep.baseline {
            baseline_receive(baseline, size, token, sweep, &mut strangers).map_err(|e| {
                peer_failure(e.context(format!("raw-TCP baseline, {size}-byte messages")))
            })?;
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
    // The pattern is written whether or not the server checks it: it touches every page.
    let mut pattern = vec![0u8; sweep.sizes.iter().copied().max().unwrap_or(1).max(1)];
    fill_pattern(&mut pattern);
    let regions = alloc_slots(endpoint, &conn, sweep, Some(&pattern))?;
    drop(pattern);
    let ack = endpoint.alloc_host(ACK_BYTES)?;
    conn.register(&ack)?;
    let [token, _, _] = recv_words(&conn, &ack, "baseline token", sweep)?;
    let max = regions.first().map_or(0, Region::len);
    let warm: Vec<Transfer> = regions
        .iter()
        .map(|r| conn.send(r, 0, max))
        .collect::<tcpx_runtime::Result<_>>()?;
    for t in warm {
        t.wait(sweep.timeout).map_err(peer_failure)?;
    }
    let baseline_addr = SocketAddr::new(
        peer.control_addr.ip(),
        peer.control_addr.port().wrapping_add(1),
    );
    let mut rows = Vec::with_capacity(sweep.sizes.len());
    for &size in &sweep.sizes {
        recv_words(&conn, &ack, "READY", sweep)?;
        let iters = sweep.iters_for(size);
        let (elapsed, mut latencies, work) =
            send_size(endpoint, &conn, &regions, &ack, size, iters, sweep)?;
        let gbps = stats::gbps(size * iters, elapsed);
        let baseline_gbps = if sweep.baseline {
            let t = baseline_send(baseline_addr, size, token, sweep).map_err(|e| {
                peer_failure(e.context(format!(
                    "raw-TCP baseline to {baseline_addr}, {size}-byte messages"
                )))
            })?;
            Some(stats::gbps(size * iters, t))
        } else {
            None
        };
        let mut row = Row::new(
            size,
            gbps,
            baseline_gbps,
            &mut latencies,
            sweep.channels,
            sweep.memory,
        );
        row.messages = iters;
        row.timed_page_faults = Some(work.page_faults);
        row.timed_registrations = Some(work.registrations);
        row.verified = sweep.verify;
        on_row(&row);
        rows.push(row);
    }
    conn.close().map_err(peer_failure)?;
    Ok(rows)
}

/// One size, timed: returns the elapsed time (first measured message to DONE), the
/// per-message latencies and what both sides paid inside the window.
fn send_size(
    endpoint: &Endpoint,
    conn: &Connection,
    regions: &[Region],
    ack: &Region,
    size: usize,
    iters: usize,
    sweep: &Sweep,
) -> Result<(Duration, Vec<Duration>, TimedWork), Failure> {
    let total = sweep.warmup + iters;
    let depth = sweep.depth_for(size);
    let mut inflight: VecDeque<(Transfer, Instant)> = VecDeque::with_capacity(depth);
    let mut latencies = Vec::with_capacity(iters);
    let mut posted = 0;
    let mut done = 0;
    let mut probe = Probe::start(endpoint);
    let mut t0 = Instant::now();
    while done < total {
        while posted < total && inflight.len() < depth {
            let region = &regions[posted % regions.len()];
            inflight.push_back((conn.send(region, 0, size)?, Instant::now()));
            posted += 1;
        }
        let (t, started) = inflight.pop_front().expect("non-empty");
        t.wait(sweep.timeout).map_err(peer_failure)?;
        done += 1;
        if done == sweep.warmup {
            probe = Probe::start(endpoint);
            t0 = Instant::now();
        } else if done > sweep.warmup {
            latencies.push(started.elapsed());
        }
    }
    // The clock stops when the server confirms it has everything.
    let [_, server_faults, server_regs] = recv_words(conn, ack, "DONE", sweep)?;
    let elapsed = t0.elapsed();
    let mine = probe.finish(endpoint);
    Ok((
        elapsed,
        latencies,
        TimedWork {
            page_faults: mine.page_faults + server_faults,
            registrations: mine.registrations + server_regs,
        },
    ))
}

/// One buffer per message in flight (`depth`, capped at 1 GiB in all), each its own region,
/// registered and with every page touched (written with `fill`, else zeros) before anything
/// is timed.
fn alloc_slots(
    endpoint: &Endpoint,
    conn: &Connection,
    sweep: &Sweep,
    fill: Option<&[u8]>,
) -> Result<Vec<Region>, Failure> {
    let max = sweep.sizes.iter().copied().max().unwrap_or(1).max(1);
    let slots = ((1usize << 30) / max).clamp(1, sweep.max_depth().max(1));
    let mut regions = Vec::with_capacity(slots);
    let gpu = match sweep.memory {
        "cuda" => Some(
            tcpx::cuda::CudaDevice::new(sweep.gpu)
                .with_context(|| format!("open GPU {} for --memory cuda", sweep.gpu))?,
        ),
        _ => None,
    };
    let zeros;
    let fill = match fill {
        Some(f) => f,
        None => {
            zeros = vec![0u8; max];
            &zeros
        }
    };
    for _ in 0..slots {
        let region = match &gpu {
            Some(gpu) => endpoint.alloc_cuda_on(gpu, max)?,
            None => endpoint.alloc_host(max)?,
        };
        region.write(0, &fill[..max])?;
        conn.register(&region)?;
        regions.push(region);
    }
    Ok(regions)
}

fn pattern_byte(i: usize) -> u8 {
    (i as u32).wrapping_mul(2_654_435_761).rotate_right(13) as u8
}

fn fill_pattern(buf: &mut [u8]) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = pattern_byte(i);
    }
}

fn verify_slot(region: &Region, len: usize) -> Result<(), Failure> {
    let first_bad = |got: &[u8]| {
        got.iter()
            .enumerate()
            .position(|(i, &x)| x != pattern_byte(i))
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

/// Bytes each baseline stream carries for `messages` messages of `size`: the stack's own
/// schedule (chunks of `chunk`, rotated per message over `channels`), so that small messages
/// go whole on one stream each, as they do through the stack, instead of in slivers.
pub fn baseline_plan(size: usize, messages: usize, chunk: usize, channels: usize) -> Vec<u64> {
    let channels = channels.max(1);
    let chunk = chunk.max(1) as u64;
    let mut per = vec![0u64; channels];
    let size = size as u64;
    let chunks = size.div_ceil(chunk).max(1);
    let whole_rounds = messages as u64 / channels as u64;
    // Every `channels` consecutive messages put the same bytes on every channel in total.
    let per_round: u64 = size;
    for bytes in per.iter_mut() {
        *bytes = whole_rounds * per_round;
    }
    for m in 0..(messages % channels) as u64 {
        for c in 0..chunks {
            let len = (size - c * chunk).min(chunk);
            per[((c + m) % channels as u64) as usize] += len;
        }
    }
    per
}

/// Turns an I/O error of the baseline into one that says what timed out.
fn io_context(e: std::io::Error, what: &str, timeout: Duration) -> anyhow::Error {
    match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => {
            anyhow!(
                "{what}: timed out after {} s (--timeout)",
                timeout.as_secs_f64()
            )
        }
        _ => anyhow::Error::from(e).context(what.to_string()),
    }
}

/// How long one blocking socket call may sleep before the caller looks at its clock again.
const POLL: Duration = Duration::from_millis(100);

/// `write_all` that fails once no byte has moved for `timeout` (each call sleeps at most
/// [`POLL`], set on the socket beforehand), however the kernel splits the writes.
fn write_all_by(s: &mut TcpStream, mut buf: &[u8], timeout: Duration, what: &str) -> Result<()> {
    let mut progress = Instant::now();
    while !buf.is_empty() {
        match s.write(buf) {
            Ok(0) => bail!("{what}: the peer closed the connection"),
            Ok(n) => {
                buf = &buf[n..];
                progress = Instant::now();
            }
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) =>
            {
                if progress.elapsed() >= timeout {
                    bail!(
                        "{what}: timed out after {} s (--timeout)",
                        timeout.as_secs_f64()
                    );
                }
            }
            Err(e) => return Err(anyhow::Error::from(e).context(what.to_string())),
        }
    }
    Ok(())
}

/// `read_exact` that fails once no byte has arrived for `timeout` (see [`write_all_by`]).
fn read_exact_by(
    s: &mut TcpStream,
    mut buf: &mut [u8],
    timeout: Duration,
    what: &str,
) -> Result<()> {
    let mut progress = Instant::now();
    while !buf.is_empty() {
        match s.read(buf) {
            Ok(0) => bail!("{what}: the peer closed the connection"),
            Ok(n) => {
                buf = &mut buf[n..];
                progress = Instant::now();
            }
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) =>
            {
                if progress.elapsed() >= timeout {
                    bail!(
                        "{what}: timed out after {} s (--timeout)",
                        timeout.as_secs_f64()
                    );
                }
            }
            Err(e) => return Err(anyhow::Error::from(e).context(what.to_string())),
        }
    }
    Ok(())
}

/// Short socket timeouts so that every blocking call comes back to [`write_all_by`] /
/// [`read_exact_by`] in time to honour `--timeout`.
fn poll_timeouts(s: &TcpStream) -> Result<()> {
    s.set_read_timeout(Some(POLL))?;
    s.set_write_timeout(Some(POLL))?;
    Ok(())
}

fn remaining(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

fn baseline_send(addr: SocketAddr, size: usize, token: u64, sweep: &Sweep) -> Result<Duration> {
    let iters = sweep.iters_for(size);
    let plan = baseline_plan(size, iters, sweep.chunk, sweep.channels);
    let deadline = Instant::now() + sweep.timeout;
    let timeout = sweep.timeout;
    let mut conns = Vec::with_capacity(plan.len());
    for i in 0..plan.len() {
        let mut s = TcpStream::connect_timeout(&addr, remaining(deadline))
            .map_err(|e| io_context(e, &format!("connect stream {i}"), timeout))?;
        s.set_nodelay(true)?;
        poll_timeouts(&s)?;
        write_all_by(
            &mut s,
            &token.to_le_bytes(),
            remaining(deadline),
            &format!("stream {i}: send the run's token"),
        )?;
        conns.push(s);
    }
    // The server says GO on every stream once all of them are in: the clock starts then.
    for (i, s) in conns.iter_mut().enumerate() {
        let mut go = [0u8; 1];
        read_exact_by(
            s,
            &mut go,
            remaining(deadline),
            &format!("stream {i}: wait for the server's GO"),
        )?;
    }
    let chunk = sweep.chunk.max(1);
    let t0 = Instant::now();
    std::thread::scope(|scope| -> Result<()> {
        let workers: Vec<_> = conns
            .iter_mut()
            .zip(&plan)
            .enumerate()
            .map(|(i, (c, &bytes))| {
                scope.spawn(move || -> Result<()> {
                    let buf = vec![0x5au8; chunk];
                    let what = format!("stream {i}: write");
                    let mut left = bytes;
                    while left > 0 {
                        let n = left.min(chunk as u64) as usize;
                        write_all_by(c, &buf[..n], timeout, &what)?;
                        left -= n as u64;
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
    read_exact_by(
        &mut conns[0],
        &mut ack,
        timeout,
        "wait for the server's acknowledgement",
    )?;
    Ok(t0.elapsed())
}

/// Connections on the baseline port that have not proven they belong to the run yet.
#[derive(Default)]
struct Strangers {
    pending: VecDeque<Pending>,
}

struct Pending {
    stream: TcpStream,
    peer: SocketAddr,
    since: Instant,
    got: [u8; 8],
    len: usize,
}

/// What one poll of an unproven connection found.
enum Proof {
    Member,
    Waiting,
    Stranger(String),
}

impl Pending {
    fn poll(&mut self, token: u64) -> Proof {
        loop {
            match self.stream.read(&mut self.got[self.len..]) {
                Ok(0) => return Proof::Stranger("closed before sending the run's token".into()),
                Ok(n) => {
                    self.len += n;
                    if self.len == 8 {
                        return if u64::from_le_bytes(self.got) == token {
                            Proof::Member
                        } else {
                            Proof::Stranger("sent a wrong token".into())
                        };
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    return if self.since.elapsed() > STRANGER_DEADLINE {
                        Proof::Stranger(format!(
                            "no token within {} s",
                            STRANGER_DEADLINE.as_secs()
                        ))
                    } else {
                        Proof::Waiting
                    };
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Proof::Stranger(format!("read failed: {e}")),
            }
        }
    }
}

fn baseline_receive(
    listener: &TcpListener,
    size: usize,
    token: u64,
    sweep: &Sweep,
    strangers: &mut Strangers,
) -> Result<()> {
    let iters = sweep.iters_for(size);
    let plan = baseline_plan(size, iters, sweep.chunk, sweep.channels);
    let streams = plan.len();
    let mut conns: Vec<TcpStream> = Vec::with_capacity(streams);
    listener.set_nonblocking(true)?;
    let deadline = Instant::now() + sweep.timeout;
    while conns.len() < streams {
        let mut progressed = false;
        match listener.accept() {
            Ok((s, peer)) => {
                s.set_nonblocking(true)?;
                if strangers.pending.len() >= MAX_PENDING {
                    if let Some(old) = strangers.pending.pop_front() {
                        tracing::warn!(peer = %old.peer, "baseline: dropped an unproven connection (too many pending)");
                    }
                }
                strangers.pending.push_back(Pending {
                    stream: s,
                    peer,
                    since: Instant::now(),
                    got: [0; 8],
                    len: 0,
                });
                progressed = true;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            // Transient per-connection failures (aborted before accept, out of fds) must not
            // end the run: note them and keep waiting for the real streams.
            Err(e) => tracing::warn!("baseline: accept failed: {e}"),
        }
        let mut i = 0;
        while i < strangers.pending.len() && conns.len() < streams {
            match strangers.pending[i].poll(token) {
                Proof::Waiting => i += 1,
                Proof::Member => {
                    let p = strangers.pending.remove(i).expect("index in range");
                    p.stream.set_nonblocking(false)?;
                    conns.push(p.stream);
                    progressed = true;
                }
                Proof::Stranger(why) => {
                    let p = strangers.pending.remove(i).expect("index in range");
                    tracing::warn!(peer = %p.peer, "baseline: dropped a stranger: {why}");
                    progressed = true;
                }
            }
        }
        if conns.len() < streams && !progressed {
            if Instant::now() > deadline {
                bail!(
                    "{} of {streams} streams presented the run's token within {} s (--timeout)",
                    conns.len(),
                    sweep.timeout.as_secs_f64()
                );
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    let timeout = sweep.timeout;
    for (i, c) in conns.iter_mut().enumerate() {
        poll_timeouts(c)?;
        write_all_by(c, &[1], timeout, &format!("stream {i}: send GO"))?;
    }
    let chunk = sweep.chunk.max(1);
    std::thread::scope(|scope| -> Result<()> {
        let workers: Vec<_> = conns
            .iter_mut()
            .zip(&plan)
            .enumerate()
            .map(|(i, (c, &bytes))| {
                scope.spawn(move || -> Result<()> {
                    let mut buf = vec![0u8; chunk];
                    let what = format!("stream {i}: read");
                    let mut left = bytes;
                    while left > 0 {
                        let n = left.min(chunk as u64) as usize;
                        read_exact_by(c, &mut buf[..n], timeout, &what)?;
                        left -= n as u64;
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
    write_all_by(&mut conns[0], &[1], timeout, "send the acknowledgement")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn baseline_plan_matches_the_stack_schedule() {
        // Small messages go whole, one stream each, rotating.
        assert_eq!(
            baseline_plan(4096, 10, 512 << 10, 4),
            vec![3 * 4096, 3 * 4096, 2 * 4096, 2 * 4096]
        );
        // 3 chunks per message over 4 channels, rotated: every channel gets 3 of 4 messages.
        assert_eq!(baseline_plan(3 * 1024, 4, 1024, 4), vec![3 * 1024; 4]);
        assert_eq!(baseline_plan(2500, 1, 1024, 2), vec![1024 + 452, 1024]);
        let plan = baseline_plan(5 << 20, 7, 512 << 10, 8);
        assert_eq!(plan.iter().sum::<u64>(), 7 * (5 << 20));
    }
}
