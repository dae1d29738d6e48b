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
//! The baseline streams prove they belong to this run with a token the server sends over the
//! tcpx connection first ([`super::rawtcp`]); the control messages are small transfers on the
//! same connection ([`super::control`]).

use std::collections::VecDeque;
use std::net::TcpListener;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};

use tcpx_runtime::control::metadata::EndpointMetadata;
use tcpx_runtime::{Connection, Direction, Endpoint, Region, Segment, Transfer};

use super::control::Control;
use super::rawtcp::{self, Strangers, StreamPlan};
use super::report::Row;
use super::stats;

pub use super::failure::{exit, peer_failure, Failure};

/// Batches of `bytes` one pack buffer holds at once (the runtime's slicing).
fn batches_per_buffer(bytes: usize) -> usize {
    tcpx_runtime::batches_per_pack_buffer(bytes as u64)
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
    /// Messages per submission: 1 sends each message on its own (`Connection::send` /
    /// `recv`); more posts them in batches (`Connection::send_batch` / `recv_batch`), at
    /// most a pack buffer's worth per batch ([`Sweep::batch_for`]).
    pub batch: usize,
    /// The connection's pooled pack buffers: batches in flight when `depth` is not given are
    /// as many as they hold at once (a batch past them takes a one-off buffer).
    pub pack_buffers: usize,
    /// This side's `Config::eager_bytes`: messages up to it travel in eager frames, where
    /// no plugin window limits how many are in flight.
    pub eager_bytes: u32,
    /// All message slots in one region at consecutive offsets ([`Slots`]), not one region
    /// each.
    pub one_region: bool,
    /// Times each size is measured, the stack then the baseline each time (at least 1): its
    /// row gives the medians of the GB/s and of the rounds' ratios, and their range.
    pub rounds: usize,
}

impl Sweep {
    /// Messages per size actually measured: `iters`, raised to move at least `min_bytes`,
    /// capped to about 1 GiB, never fewer than 8.
    pub fn iters_for(&self, size: usize) -> usize {
        messages_for(size, self.iters, self.min_bytes, 8)
    }

    /// Unmeasured messages before the clock at `size`, one call per message: `warmup`, and
    /// for sizes that may travel eager enough to put a message in every slot and on every
    /// eager channel, so that their registrations (host messages from
    /// `Config::eager_detach` on are sent from and received into the slots' own memory,
    /// registered once per region and channel) are made before the clock. Both roles derive
    /// it from values they share ([`Sweep::fingerprint`] covers them), not from their own
    /// eager settings.
    pub fn warmup_for(&self, size: usize) -> usize {
        if size > tcpx_runtime::EAGER_MAX_MESSAGE as usize {
            return self.warmup;
        }
        let every_channel = self.channels.max(1) * tcpx_runtime::EAGER_RUN as usize;
        let every_slot = self.depth.unwrap_or(0).max(MAX_AUTO_DEPTH);
        self.warmup.max(every_slot).max(every_channel)
    }

    /// The raw-TCP baseline of one size: the messages the stack's clock covers, over
    /// `channels` streams.
    fn streams(&self, size: usize) -> StreamPlan {
        let units = Units::new(self, size);
        StreamPlan {
            size,
            messages: units.timed_messages(),
            chunk: self.chunk,
            channels: self.channels,
            timeout: self.timeout,
            // The stack cycles its messages through `places` places of `size` bytes.
            footprint: units.messages.min(units.places) * size,
        }
    }

    /// Places of `size` bytes that messages of that size cycle through, on each side: one
    /// per message in flight (submissions in flight × messages per submission), as many as
    /// the slots hold at most ([`Slots::places`]; batches of many small messages can have
    /// more in flight than that). So no two messages in flight share bytes, as in an
    /// application, and a size is measured over the same memory whatever other sizes the
    /// sweep has. (Messages once cycled through one place per slot, and a sweep's slot count
    /// follows its largest size: 1 MiB messages in the issue's sweep up to 256 MiB went 16 at
    /// a time into each of four 1 MiB places, a 4 MiB footprint that raw TCP moved from the
    /// CPU's caches, where `--sizes 1MiB` alone cycled through 64 MiB.)
    pub fn places(&self, size: usize) -> usize {
        let size = size.max(1);
        let max = self.sizes.iter().copied().max().unwrap_or(1).max(size);
        let capacity = self.slots().saturating_mul((max / size).max(1));
        let in_flight = self
            .in_flight_for(size)
            .saturating_mul(self.batch_for(size));
        in_flight.clamp(1, capacity.max(1))
    }

    /// Message slots each side allocates: one per message in flight at the deepest size,
    /// at most 1 GiB of them at the largest size.
    pub fn slots(&self) -> usize {
        let max = self.sizes.iter().copied().max().unwrap_or(1).max(1);
        ((1usize << 30) / max).clamp(1, self.max_depth().max(1))
    }

    /// Messages in flight at once for `size`: `--depth` if given, else enough to fill every
    /// channel's window (channels × window requests of at most one chunk each), and at least
    /// [`MIN_AUTO_DEPTH`]. The raw-TCP baseline streams its bytes with no limit in flight, so
    /// a fixed small depth measured the stack's latency at small sizes, not its throughput
    /// (H100, 8 channels, 4 KiB: depth 8 puts one message per channel in flight).
    ///
    /// Messages of eager size (`Config::eager_bytes`, sent one per call) are not plugin
    /// requests of their own, so no window limits them: their automatic depth is
    /// [`MAX_AUTO_DEPTH`], as an application streaming small messages would keep.
    pub fn depth_for(&self, size: usize) -> usize {
        self.depth.unwrap_or_else(|| {
            if self.batch <= 1 && size >= 1 && size <= self.eager_bytes as usize {
                return MAX_AUTO_DEPTH;
            }
            self.window_fill(size).clamp(MIN_AUTO_DEPTH, MAX_AUTO_DEPTH)
        })
    }

    /// Messages per submission at `size`: 1 without `--batch` or past
    /// [`BATCH_LARGEST_MESSAGE`], else as many as `--batch` says that fit one pack buffer
    /// ([`tcpx_runtime::PACK_BYTES`]); 1 when not even two do.
    pub fn batch_for(&self, size: usize) -> usize {
        if self.batch <= 1 || size > BATCH_LARGEST_MESSAGE {
            return 1;
        }
        let fit = (tcpx_runtime::PACK_BYTES as usize) / size.max(1);
        match self.batch.min(fit) {
            0 | 1 => 1,
            k => k,
        }
    }

    /// Submissions in flight at `size`: messages ([`Sweep::depth_for`]) one per call, else
    /// batches — `--depth` if given, else enough to fill the channels' windows, at most as
    /// many as the pooled pack buffers hold at once
    /// ([`tcpx_runtime::batches_per_pack_buffer`]).
    pub fn in_flight_for(&self, size: usize) -> usize {
        let k = self.batch_for(size);
        if k == 1 {
            return self.depth_for(size);
        }
        self.depth.unwrap_or_else(|| {
            let room = self.pack_buffers.max(1) * batches_per_buffer(size * k);
            self.window_fill(size * k).clamp(1, room)
        })
    }

    /// Pack buffers a window of `batches` batches of `bytes` needs (what to reserve).
    pub fn buffers_for(batches: usize, bytes: usize) -> usize {
        batches.div_ceil(batches_per_buffer(bytes))
    }

    /// Submissions of `bytes` each that fill every channel's window (channels × window
    /// requests of at most one chunk each).
    fn window_fill(&self, bytes: usize) -> usize {
        let chunks = bytes.max(1).div_ceil(self.chunk.max(1));
        (self.channels.max(1) * self.window.max(1)).div_ceil(chunks)
    }

    /// Times each size is measured ([`Sweep::rounds`], at least one).
    fn rounds(&self) -> usize {
        self.rounds.max(1)
    }

    /// A digest of the settings both processes must share ([`super::control::fingerprint`]):
    /// the sizes and how many messages each moves (a given `--depth` sets the warm-up at eager
    /// sizes, see [`Sweep::warmup_for`]), batches, rounds, and the baseline's shape. The
    /// slots' layout is each side's own.
    pub fn fingerprint(&self) -> u64 {
        super::control::fingerprint(&format!(
            "{:?}|{}|{}|{}|{:?}|{}|{}|{}|{}|{}|{}",
            self.sizes,
            self.iters,
            self.min_bytes,
            self.warmup,
            self.depth,
            self.batch,
            self.rounds,
            self.channels,
            self.chunk,
            self.baseline,
            self.verify
        ))
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

/// Messages of `size` bytes to measure: `iters`, raised to move at least `min_bytes`, capped
/// to about 1 GiB, never fewer than `at_least`.
pub fn messages_for(size: usize, iters: usize, min_bytes: usize, at_least: usize) -> usize {
    let size = size.max(1);
    let floor = min_bytes.div_ceil(size);
    iters
        .max(floor)
        .min(((1usize << 30) / size).max(at_least))
        .max(at_least)
}

/// Largest message `--batch` batches: past it a message fills chunks on its own, and the
/// pack buffer's copies would cost more than the submissions they save (2-core box, 8
/// channels: 1 MiB messages in batches of 4 ran at 0.2 × one per call).
pub const BATCH_LARGEST_MESSAGE: usize = 64 << 10;

/// Fewest messages in flight an automatic depth chooses (the depth of earlier releases).
pub const MIN_AUTO_DEPTH: usize = 8;
/// Most messages in flight an automatic depth chooses.
pub const MAX_AUTO_DEPTH: usize = 1024;

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

/// The receiving side: accepts one connection, receives the sweep, acknowledges each size.
pub fn serve(endpoint: &Endpoint, baseline: &TcpListener, sweep: &Sweep) -> Result<(), Failure> {
    let conn = endpoint
        .accept_timeout(sweep.timeout * 4)
        .map_err(peer_failure)?;
    let slots = alloc_slots(endpoint, &conn, sweep, None)?;
    let ctl = Control::new(endpoint, &conn, sweep.timeout)?;
    let token = rawtcp::new_token()?;
    ctl.send([token, sweep.fingerprint(), 0])?;
    // Warm-up: one full-size message into every slot, before any clock.
    let warm: Vec<Transfer> = (0..slots.len())
        .map(|i| {
            let (region, at) = slots.slot(i);
            conn.recv(region, at, slots.max)
        })
        .collect::<tcpx_runtime::Result<_>>()?;
    for t in warm {
        t.wait(sweep.timeout).map_err(peer_failure)?;
    }
    let mut strangers = Strangers::default();
    for size in sweep
        .sizes
        .iter()
        .flat_map(|&s| std::iter::repeat_n(s, sweep.rounds()))
    {
        let plan = Units::new(sweep, size);
        let places = slots.places(size, plan.places);
        if sweep.verify {
            // A message that never lands must not pass for one that did.
            let poison = vec![0u8; size];
            for p in 0..places.len() {
                let (region, at) = places.get(p);
                region.write(at, &poison)?;
            }
        }
        ctl.send([0, 0, 0])?;
        // The costs counted are those of the timed part, as on the client: from the last
        // warm-up unit received on.
        let mut probe = (plan.warmup_units == 0).then(|| Probe::start(endpoint));
        let mut inflight: VecDeque<(Transfer, usize)> = VecDeque::with_capacity(plan.depth);
        let mut posted = 0;
        let mut received = 0;
        while posted < plan.units || !inflight.is_empty() {
            while posted < plan.units && inflight.len() < plan.depth {
                let messages = plan.messages_in(posted);
                inflight.push_back((
                    plan.post(&conn, &places, posted, Direction::Recv)?,
                    messages * size,
                ));
                posted += 1;
            }
            let (t, want) = inflight.pop_front().expect("non-empty");
            let got = t.wait(sweep.timeout).map_err(peer_failure)?;
            if got as usize != want {
                return Err(anyhow!("received {got} bytes where {want} were due").into());
            }
            received += 1;
            if received == plan.warmup_units {
                probe = Some(Probe::start(endpoint));
            }
        }
        let total = plan.messages;
        let work = probe
            .unwrap_or_else(|| Probe::start(endpoint))
            .finish(endpoint);
        ctl.send([1, work.page_faults, work.registrations])?;
        if sweep.verify {
            // After DONE: the client's clock has stopped. Every place used holds the last
            // message that landed in it.
            for p in 0..total.min(places.len()) {
                let (region, at) = places.get(p);
                verify_slot(region, at, size)?;
            }
        }
        if sweep.baseline {
            rawtcp::receive(baseline, &sweep.streams(size), token, &mut strangers).map_err(
                |e| peer_failure(e.context(format!("raw-TCP baseline, {size}-byte messages"))),
            )?;
        }
    }
    drop(ctl);
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
    let slots = alloc_slots(endpoint, &conn, sweep, Some(&pattern))?;
    drop(pattern);
    let ctl = Control::new(endpoint, &conn, sweep.timeout)?;
    let [token, fingerprint, _] = ctl.recv("the server's baseline token")?;
    if fingerprint != sweep.fingerprint() {
        return Err(Failure {
            code: exit::USAGE,
            error: anyhow!(
                "the server runs other settings (--sizes, --iters, --min-bytes, --warmup, \
                 --depth, --batch, --rounds, --channels, --chunk, --baseline, --verify): give \
                 both processes the same options"
            ),
        });
    }
    let warm: Vec<Transfer> = (0..slots.len())
        .map(|i| {
            let (region, at) = slots.slot(i);
            conn.send(region, at, slots.max)
        })
        .collect::<tcpx_runtime::Result<_>>()?;
    for t in warm {
        t.wait(sweep.timeout).map_err(peer_failure)?;
    }
    let baseline_addr = rawtcp::baseline_addr(peer.control_addr);
    let mut rows = Vec::with_capacity(sweep.sizes.len());
    for &size in &sweep.sizes {
        if sweep.verify {
            // Every place starts its message with the pattern's first byte (the slots hold
            // the pattern from each slot's start, so places past it hold later bytes).
            let places = slots.places(size, Units::new(sweep, size).places);
            let mut message = vec![0u8; size];
            fill_pattern(&mut message);
            for p in 0..places.len() {
                let (region, at) = places.get(p);
                region.write(at, &message)?;
            }
        }
        let mut rounds = Vec::with_capacity(sweep.rounds());
        for _ in 0..sweep.rounds() {
            ctl.recv::<3>("the server's READY")?;
            let (elapsed, latencies, work, timed) =
                send_size(endpoint, &conn, &slots, &ctl, size, sweep)?;
            let baseline_gbps = if sweep.baseline {
                let t = rawtcp::send(baseline_addr, &sweep.streams(size), token).map_err(|e| {
                    peer_failure(e.context(format!(
                        "raw-TCP baseline to {baseline_addr}, {size}-byte messages"
                    )))
                })?;
                Some(stats::gbps(size * timed, t))
            } else {
                None
            };
            rounds.push(Round {
                gbps: stats::gbps(size * timed, elapsed),
                baseline_gbps,
                latencies,
                work,
                timed,
            });
        }
        let row = row_of_rounds(size, rounds, sweep);
        on_row(&row);
        rows.push(row);
    }
    drop(ctl);
    conn.close().map_err(peer_failure)?;
    Ok(rows)
}

/// One timed measurement of a size: the stack's GB/s, the baseline's right after it, the
/// sampled latencies, what both sides paid inside the window, the messages timed.
struct Round {
    gbps: f64,
    baseline_gbps: Option<f64>,
    latencies: Vec<Duration>,
    work: TimedWork,
    timed: usize,
}

/// The row of a size measured in `rounds` (at least one): the median GB/s of the stack and
/// of the baseline, the median of the rounds' ratios (each round's stack against the
/// baseline run right after it: the pair a drifting machine treats alike) and their range,
/// the latencies of every round together, and the messages and one-time costs of every
/// timed window summed.
fn row_of_rounds(size: usize, rounds: Vec<Round>, sweep: &Sweep) -> Row {
    let mut gbps: Vec<f64> = rounds.iter().map(|r| r.gbps).collect();
    let mut baselines: Vec<f64> = rounds.iter().filter_map(|r| r.baseline_gbps).collect();
    let mut ratios: Vec<f64> = rounds
        .iter()
        .filter_map(|r| r.baseline_gbps.filter(|&b| b > 0.0).map(|b| r.gbps / b))
        .collect();
    let baseline = (!baselines.is_empty()).then(|| stats::median(&mut baselines));
    let mut latencies: Vec<Duration> = rounds
        .iter()
        .flat_map(|r| r.latencies.iter().copied())
        .collect();
    let mut row = Row::new(
        size,
        stats::median(&mut gbps),
        baseline,
        &mut latencies,
        sweep.channels,
        sweep.memory,
    );
    if !ratios.is_empty() {
        row.ratio = Some(stats::median(&mut ratios));
        // `median` sorted them.
        row.ratio_range = (rounds.len() > 1).then(|| (ratios[0], ratios[ratios.len() - 1]));
    }
    row.rounds = rounds.len();
    row.messages = rounds.iter().map(|r| r.timed).sum();
    row.timed_page_faults = Some(rounds.iter().map(|r| r.work.page_faults).sum());
    row.timed_registrations = Some(rounds.iter().map(|r| r.work.registrations).sum());
    row.verified = sweep.verify;
    row
}

/// Message sizes below which latencies are sampled rather than taken for every message.
const LATENCY_SAMPLE_BELOW: usize = 256 << 10;

/// One message in this many is timed below [`LATENCY_SAMPLE_BELOW`].
const LATENCY_SAMPLE_EVERY: usize = 16;

/// One size, timed: returns the elapsed time (first measured message to DONE), the
/// per-submission latencies (per message, or per batch with `--batch`; one in
/// [`LATENCY_SAMPLE_EVERY`] below [`LATENCY_SAMPLE_BELOW`]), what both sides paid
/// inside the window, and the messages the clock covered.
fn send_size(
    endpoint: &Endpoint,
    conn: &Connection,
    slots: &Slots,
    ctl: &Control<'_>,
    size: usize,
    sweep: &Sweep,
) -> Result<(Duration, Vec<Duration>, TimedWork, usize), Failure> {
    let plan = Units::new(sweep, size);
    let places = slots.places(size, plan.places);
    // Small messages are timed one in `LATENCY_SAMPLE_EVERY`: two clock reads per message
    // were a sixth of the submitting thread's time at 4 KiB, which the stack would be charged.
    let sample_every = if size < LATENCY_SAMPLE_BELOW {
        LATENCY_SAMPLE_EVERY
    } else {
        1
    };
    let mut inflight: VecDeque<(Transfer, Option<Instant>)> = VecDeque::with_capacity(plan.depth);
    let mut latencies = Vec::with_capacity(plan.units / sample_every + 1);
    let mut posted = 0;
    let mut done = 0;
    // The warm-up units (with batches: at least a window of them, see `Units::new`) are
    // posted and finished before the clock starts and before any timed unit is posted: a
    // send may finish once its bytes are copied (eager frames), long before they land, so a
    // clock started while timed units were already posted would miss their time.
    let warm_units = plan.warmup_units;
    while done < warm_units.min(plan.units) {
        while posted < warm_units && inflight.len() < plan.depth {
            inflight.push_back((plan.post(conn, &places, posted, Direction::Send)?, None));
            posted += 1;
        }
        let (t, _) = inflight.pop_front().expect("non-empty");
        t.wait(sweep.timeout).map_err(peer_failure)?;
        done += 1;
    }
    let probe = Probe::start(endpoint);
    let t0 = Instant::now();
    while done < plan.units {
        while posted < plan.units && inflight.len() < plan.depth {
            let started = (posted % sample_every == 0).then(Instant::now);
            inflight.push_back((plan.post(conn, &places, posted, Direction::Send)?, started));
            posted += 1;
        }
        let (t, started) = inflight.pop_front().expect("non-empty");
        t.wait(sweep.timeout).map_err(peer_failure)?;
        done += 1;
        if let Some(started) = started {
            latencies.push(started.elapsed());
        }
    }
    // The clock stops when the server confirms it has everything.
    let [_, server_faults, server_regs] = ctl.recv("the server's DONE")?;
    let elapsed = t0.elapsed();
    let mine = probe.finish(endpoint);
    Ok((
        elapsed,
        latencies,
        TimedWork {
            page_faults: mine.page_faults + server_faults,
            registrations: mine.registrations + server_regs,
        },
        plan.timed_messages(),
    ))
}

/// How one size is posted: `units` submissions of one message each, or of up to `k` (the
/// last one short), `depth` of them in flight. Both roles derive the same units.
struct Units {
    size: usize,
    /// Places this size's messages cycle through ([`Sweep::places`]).
    places: usize,
    k: usize,
    messages: usize,
    units: usize,
    warmup_units: usize,
    depth: usize,
}

impl Units {
    fn new(sweep: &Sweep, size: usize) -> Self {
        let k = sweep.batch_for(size);
        let depth = sweep.in_flight_for(size);
        let iters = sweep.iters_for(size);
        let places = sweep.places(size);
        if k == 1 {
            let warmup = sweep.warmup_for(size);
            let messages = warmup + iters;
            return Self {
                size,
                places,
                k,
                messages,
                units: messages,
                warmup_units: warmup,
                depth,
            };
        }
        // Batches: the warm-up covers a full window of them, so that both pack pools have
        // grown (and registered) every buffer the window needs before the clock starts; the
        // timed part is at least four windows. Every batch is full.
        let warmup_units = sweep.warmup.div_ceil(k).max(depth);
        let timed_units = iters.div_ceil(k).max(4 * depth);
        let units = warmup_units + timed_units;
        Self {
            size,
            places,
            k,
            messages: units * k,
            units,
            warmup_units,
            depth,
        }
    }

    /// Messages the clock covers.
    fn timed_messages(&self) -> usize {
        self.messages - (self.warmup_units * self.k).min(self.messages)
    }

    /// Messages unit `u` carries.
    fn messages_in(&self, u: usize) -> usize {
        (self.messages - u * self.k).min(self.k)
    }

    /// Posts unit `u`: message `m` uses place `m % places`, as one call per message does.
    fn post(
        &self,
        conn: &Connection,
        places: &Places<'_>,
        u: usize,
        direction: Direction,
    ) -> tcpx_runtime::Result<Transfer> {
        let first = u * self.k;
        if self.k == 1 {
            let (region, at) = places.get(first);
            return match direction {
                Direction::Send => conn.send(region, at, self.size),
                Direction::Recv => conn.recv(region, at, self.size),
            };
        }
        let segments: Vec<Segment<'_>> = (first..first + self.messages_in(u))
            .map(|m| {
                let (region, at) = places.get(m);
                Segment::new(region, at, self.size)
            })
            .collect();
        match direction {
            Direction::Send => conn.send_batch(&segments),
            Direction::Recv => conn.recv_batch(&segments),
        }
    }
}

/// Where a side's messages live: one slot per message in flight, `max` bytes each — one
/// region per slot, or one region holding every slot at consecutive offsets
/// ([`Sweep::one_region`]).
pub struct Slots {
    regions: Vec<Region>,
    count: usize,
    /// Bytes per slot (the largest message size).
    pub max: usize,
}

impl Slots {
    /// Slots in all.
    pub fn len(&self) -> usize {
        self.count
    }

    /// Whether there are none (never: a sweep has at least one).
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The region and offset of slot `i % len` (`max` bytes).
    pub fn slot(&self, i: usize) -> (&Region, usize) {
        let i = i % self.count.max(1);
        match self.regions.as_slice() {
            [one] => (one, i * self.max),
            many => (&many[i], 0),
        }
    }

    /// The first `count` places for messages of `size` bytes ([`Sweep::places`]), laid out
    /// one after another: a slot's bytes from its start, then the next slot's. A count above
    /// the slots' capacity at that size (`len × (max / size)`) wraps onto places already
    /// listed.
    ///
    /// Consecutive, as the raw-TCP baseline streams through its footprint, and as an
    /// application's ring of message buffers lies. Places once went round the slots first,
    /// one per slot: in the issue's small sweep (slots of 256 KiB) 1024 messages of 4 KiB lay
    /// 256 KiB apart, every one of them in the same few sets of the L2 cache, while the
    /// baseline moved the same 4 MiB contiguously. Laid out in a row, 4 KiB moved 22 % and
    /// 64 KiB 25 % faster in the same call (docs/RESULTS.md, thirty-ninth session).
    pub fn places(&self, size: usize, count: usize) -> Places<'_> {
        let spots = (0..count.max(1))
            .map(|p| {
                let (slot, offset) = place_in_slots(p, size, self.count, self.max);
                match self.regions.len() {
                    1 => (0, slot * self.max + offset),
                    _ => (slot, offset),
                }
            })
            .collect();
        Places {
            regions: &self.regions,
            spots,
        }
    }
}

/// Where the places of one size lie ([`Slots::places`]): each message looks its place up
/// instead of working it out, so that the loop that posts small messages — whose time is
/// the stack's — pays one division per message, as before places.
pub struct Places<'s> {
    regions: &'s [Region],
    /// (index into `regions`, offset) of each place.
    spots: Vec<(usize, usize)>,
}

impl<'s> Places<'s> {
    /// Places listed (at least one).
    pub fn len(&self) -> usize {
        self.spots.len()
    }

    /// Whether none are (never).
    pub fn is_empty(&self) -> bool {
        self.spots.is_empty()
    }

    /// The region and offset of message `m`'s place (`m % len`).
    pub fn get(&self, m: usize) -> (&'s Region, usize) {
        let (region, at) = self.spots[m % self.spots.len()];
        (&self.regions[region], at)
    }
}

/// Where place `p` lies, as numbers ([`Slots::places`]): the slot of place `p` for
/// `size`-byte messages among `count` slots of `max` bytes, and the offset in it.
fn place_in_slots(p: usize, size: usize, count: usize, max: usize) -> (usize, usize) {
    let count = count.max(1);
    let per_slot = (max / size.max(1)).max(1);
    let p = p % (count * per_slot);
    (p / per_slot, (p % per_slot) * size)
}

/// One buffer per message in flight (`depth`, capped at 1 GiB in all), each its own region
/// (or all in one, [`Sweep::one_region`]), registered and with every page touched (written
/// with `fill`, else zeros) before anything is timed.
fn alloc_slots(
    endpoint: &Endpoint,
    conn: &Connection,
    sweep: &Sweep,
    fill: Option<&[u8]>,
) -> Result<Slots, Failure> {
    let max = sweep.sizes.iter().copied().max().unwrap_or(1).max(1);
    let count = sweep.slots();
    if sweep.batch > 1 && sweep.memory == "host" {
        // The pack buffers of a window of batches, allocated and registered now (they would
        // otherwise grow inside the timed window as the window first fills).
        let most = sweep
            .sizes
            .iter()
            .filter(|&&s| sweep.batch_for(s) > 1)
            .map(|&s| Sweep::buffers_for(sweep.in_flight_for(s), s * sweep.batch_for(s)))
            .max()
            .unwrap_or(0);
        conn.reserve_batches(most)?;
    }
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
    let (regions, per_region) = if sweep.one_region && count > 1 {
        (1, count)
    } else {
        (count, 1)
    };
    let mut slots = Slots {
        regions: Vec::with_capacity(regions),
        count,
        max,
    };
    for _ in 0..regions {
        let len = max * per_region;
        let region = match &gpu {
            Some(gpu) => endpoint.alloc_cuda_on(gpu, len)?,
            None => endpoint.alloc_host(len)?,
        };
        for k in 0..per_region {
            region.write(k * max, &fill[..max])?;
        }
        conn.register(&region)?;
        slots.regions.push(region);
    }
    Ok(slots)
}

/// Byte `i` of the benchmark pattern (what senders write and `--verify` checks).
pub fn pattern_byte(i: usize) -> u8 {
    (i as u32).wrapping_mul(2_654_435_761).rotate_right(13) as u8
}

fn fill_pattern(buf: &mut [u8]) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = pattern_byte(i);
    }
}

fn verify_slot(region: &Region, at: usize, len: usize) -> Result<(), Failure> {
    let first_bad = |got: &[u8]| {
        got.iter()
            .enumerate()
            .position(|(i, &x)| x != pattern_byte(i))
    };
    let bad = if region.kind() == tcpx::MemoryKind::Cuda {
        // GPU memory: copy it back to the host first.
        let mut back = vec![0u8; len];
        region.read(at, &mut back)?;
        first_bad(&back)
    } else {
        region
            .memory()
            .with_bytes(|b| first_bad(&b[at..at + len]))?
    };
    match bad {
        None => Ok(()),
        Some(i) => Err(Failure {
            code: exit::VERIFY,
            error: anyhow!("verification failed: a {len}-byte message differs at byte {i}"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sweep() -> Sweep {
        Sweep {
            sizes: vec![4 << 10],
            iters: 100,
            min_bytes: 64 << 20,
            warmup: 5,
            depth: None,
            window: 16,
            channels: 8,
            chunk: 512 << 10,
            baseline: true,
            verify: false,
            timeout: Duration::from_secs(1),
            memory: "host",
            gpu: 0,
            batch: 1,
            pack_buffers: 8,
            eager_bytes: 64 << 10,
            one_region: false,
            rounds: 3,
        }
    }

    fn round(gbps: f64, baseline: Option<f64>, micros: u64) -> Round {
        Round {
            gbps,
            baseline_gbps: baseline,
            latencies: vec![Duration::from_micros(micros); 10],
            work: TimedWork {
                page_faults: 2,
                registrations: 1,
            },
            timed: 100,
        }
    }

    #[test]
    fn batches_in_flight_fill_the_windows_within_the_pack_space() {
        let mut s = sweep();
        s.batch = 1024;
        // 4 MiB batches take a whole buffer each: as many in flight as buffers.
        assert_eq!(s.batch_for(4 << 10), 1024);
        assert_eq!(batches_per_buffer(4 << 20), 1);
        assert_eq!(s.in_flight_for(4 << 10), 8);
        assert_eq!(Sweep::buffers_for(8, 4 << 20), 8);
        // 128 KiB batches share buffers (two slices each): the windows' 8 × 16 requests.
        s.batch = 32;
        assert_eq!(batches_per_buffer(128 << 10), 32);
        assert_eq!(s.in_flight_for(4 << 10), 128);
        assert_eq!(Sweep::buffers_for(128, 128 << 10), 4);
        // One pack buffer caps 128 KiB batches at 32 in flight.
        s.pack_buffers = 1;
        assert_eq!(s.in_flight_for(4 << 10), 32);
        // A batch a slice and a byte long takes two slices.
        assert_eq!(batches_per_buffer((64 << 10) + 1), 32);
        assert_eq!(batches_per_buffer(1), 64);
    }

    #[test]
    fn rounds_give_medians_the_paired_ratios_range_and_sums() {
        // The ratio's median pairs each round's stack with its own baseline: 0.5, 0.25, 1.0.
        let rows = vec![
            round(10.0, Some(20.0), 5),
            round(4.0, Some(16.0), 7),
            round(8.0, Some(8.0), 9),
        ];
        let row = row_of_rounds(4096, rows, &sweep());
        assert_eq!(row.gbps, 8.0);
        assert_eq!(row.baseline_gbps, Some(16.0));
        assert_eq!(row.ratio, Some(0.5));
        assert_eq!(row.ratio_range, Some((0.25, 1.0)));
        assert_eq!(row.rounds, 3);
        assert_eq!(row.messages, 300);
        assert_eq!(row.timed_page_faults, Some(6));
        assert_eq!(row.timed_registrations, Some(3));
        // Latencies of every round together.
        assert_eq!(row.p50_us, 7.0);
        assert_eq!(row.p99_us, 9.0);
    }

    #[test]
    fn the_fingerprint_covers_what_sets_the_message_counts() {
        let base = sweep();
        let same = sweep();
        assert_eq!(base.fingerprint(), same.fingerprint());
        // A depth past the automatic one raises the warm-up at eager sizes, so the two
        // processes would count different messages.
        let deeper = Sweep {
            depth: Some(4096),
            ..sweep()
        };
        assert!(deeper.warmup_for(4 << 10) > base.warmup_for(4 << 10));
        assert_ne!(deeper.fingerprint(), base.fingerprint());
        let more_rounds = Sweep {
            rounds: 5,
            ..sweep()
        };
        assert_ne!(more_rounds.fingerprint(), base.fingerprint());
        // Each side's own slot layout is not part of it.
        let one_region = Sweep {
            one_region: true,
            ..sweep()
        };
        assert_eq!(one_region.fingerprint(), base.fingerprint());
    }

    /// The issue's large-size sweep: four slots of 256 MiB.
    fn large() -> Sweep {
        Sweep {
            sizes: vec![1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20],
            min_bytes: 2 << 30,
            ..sweep()
        }
    }

    #[test]
    fn a_size_cycles_through_as_many_places_as_a_sweep_of_it_alone() {
        let issue = large();
        assert_eq!(issue.slots(), 4);
        for size in [1usize << 20, 4 << 20, 16 << 20] {
            let alone = Sweep {
                sizes: vec![size],
                ..large()
            };
            assert_eq!(issue.places(size), alone.places(size), "{size}");
            assert_eq!(issue.places(size), issue.depth_for(size), "{size}");
        }
        // 1 MiB: a window per channel, 64 messages, no longer 16 to each of four places.
        assert_eq!(issue.places(1 << 20), 64);
        // Where 1 GiB binds, the slots' capacity: four 256 MiB messages.
        assert_eq!(issue.places(256 << 20), 4);
        // Batches count their messages, up to what the slots hold (one per submission in
        // flight: 128 here, against 8 × 1024 messages).
        let batched = Sweep {
            sizes: vec![16 << 10, 64 << 10],
            batch: 1024,
            ..sweep()
        };
        assert_eq!(batched.slots(), batched.depth_for(16 << 10));
        assert_eq!(batched.places(16 << 10), batched.slots() * 4);
        assert!(
            batched.in_flight_for(16 << 10) * batched.batch_for(16 << 10) > 4 * batched.slots()
        );
    }

    #[test]
    fn small_places_lie_one_after_another_as_the_baseline_streams() {
        // The issue's small sweep: 1024 slots of 256 KiB.
        let (count, max) = (1024, 256 << 10);
        let at = |p| {
            let (slot, offset) = place_in_slots(p, 4096, count, max);
            slot * max + offset
        };
        for p in 0..1023 {
            assert_eq!(at(p + 1), at(p) + 4096, "place {p}");
        }
        // Past the slots' capacity at that size, places wrap to the first.
        assert_eq!(at(count * (max / 4096)), 0);
        // A message as large as a slot takes one slot per place, as before.
        assert_eq!(place_in_slots(5, max, count, max), (5, 0));
    }

    proptest::proptest! {
        /// Places stay inside their slots, no two share a byte, and there are never more
        /// than the slots hold nor more than the messages in flight need.
        #[test]
        fn places_are_disjoint_and_inside_the_slots(
            sizes in proptest::collection::vec(1usize..(64 << 20), 1..5),
            depth in proptest::option::of(1usize..2048),
            batch in proptest::sample::select(vec![1usize, 4, 64]),
        ) {
            let sweep = Sweep { sizes: sizes.clone(), depth, batch, ..sweep() };
            let count = sweep.slots();
            let max = sizes.iter().copied().max().unwrap_or(1);
            for &size in &sizes {
                let places = sweep.places(size);
                proptest::prop_assert!(places >= 1);
                proptest::prop_assert!(places <= count * (max / size).max(1));
                proptest::prop_assert!(
                    places <= (sweep.in_flight_for(size) * sweep.batch_for(size)).max(1)
                );
                let mut spans: Vec<(usize, usize)> = (0..places)
                    .map(|p| {
                        let (slot, offset) = place_in_slots(p, size, count, max);
                        assert!(slot < count && offset + size <= max);
                        (slot * max + offset, slot * max + offset + size)
                    })
                    .collect();
                spans.sort_unstable();
                for pair in spans.windows(2) {
                    proptest::prop_assert!(pair[0].1 <= pair[1].0, "{:?} overlap", pair);
                }
            }
        }
    }

    #[test]
    fn one_round_or_no_baseline_has_no_range() {
        let row = row_of_rounds(4096, vec![round(3.0, Some(4.0), 1)], &sweep());
        assert_eq!(row.ratio, Some(0.75));
        assert_eq!(row.ratio_range, None);
        let row = row_of_rounds(
            4096,
            vec![round(3.0, None, 1), round(5.0, None, 1)],
            &sweep(),
        );
        assert_eq!(
            (row.baseline_gbps, row.ratio, row.ratio_range),
            (None, None, None)
        );
        assert_eq!(row.gbps, 5.0, "upper median of two");
    }
}
