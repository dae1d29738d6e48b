//! [`Rma`]: one connection's one-sided state — its RMA link, the operations this side
//! initiated and still waits on, the discard region — and the initiator's calls.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::coalesce::{coalesce, Run};
use super::descriptor::RemoteSegment;
use super::pack::{
    host_parts, lease_pieces, packed_schedule, spans_buffers, worth_packing, PackCredit,
    PackCredits, PackLease, PackPool, PackSide, Part, PACKED_HOST_MAX_BYTES, PACK_BYTES,
};
use super::remote_runs::{remote_entries, SegmentMap};
use super::{packs_through_buffers, OneSidedShared};
use crate::carrier::{Carrier, JobSpec};
use crate::config::Config;
use crate::control::codec::MAX_PAYLOAD;
use crate::control::rma::{ReadRequest, Refusal, RemoteEntry, WriteRequest, MAX_NOTIFICATION};
use crate::control::{ControlTx, Message};
use crate::engine::job::{staging_of, Job, Pieces};
use crate::engine::stage::Staging;
use crate::error::{Direction, Error, Result};
use crate::link::Link;
use crate::registry::{Region, Registration, Segment};
use crate::schedule::Schedule;
use crate::transfer::{Completion, Transfer};

/// How often the watcher checks pending operations against their deadlines.
const SWEEP_EVERY: Duration = Duration::from_millis(50);

/// What an initiated operation still waits for.
// A read keeps its pieces and schedule inline (no allocation of their own, see
// `engine::job::Pieces`); boxing them to shrink the other variants would add one back.
#[allow(clippy::large_enum_variant)]
pub(crate) enum PendingKind {
    /// A write whose data is queued (`job`), waiting for the target's `WriteAck`.
    Write { job: Arc<Job> },
    /// A write whose data travelled in its request (see [`crate::Config::inline_bytes`]),
    /// waiting for the target's `WriteAck`: no job on this side.
    InlineWrite,
    /// A read that asked for its data inline, waiting for `ReadInline` (or `ReadRefused`):
    /// where each piece of the data goes, in order.
    InlineRead { local: Vec<(Region, usize, usize)> },
    /// A read waiting for `ReadData` (then its receive job is queued) or `ReadRefused`.
    Read {
        pieces: Pieces,
        schedule: Schedule,
        /// Set when the local list is staged: the receive job copies through the rings.
        staging: Option<Staging>,
        /// This side offered to receive the data packed.
        offered: bool,
        /// The pack buffer it offered to receive into (none when its list is one run), and
        /// where its bytes go.
        pack: Option<ReadPack>,
        /// The request asked to spread (a packed answer is cut the same way).
        spread: bool,
    },
}

/// How an operation's data is cut on the wire: both sides rotate its schedule by the
/// operation id, and spread it when its request says so.
#[derive(Debug, Clone, Copy)]
pub(crate) struct OpCut {
    pub(crate) op_id: u64,
    pub(crate) spread: bool,
}

/// A read initiator's side of a packed read it offered.
pub(crate) struct ReadPack {
    pub(crate) lease: PackLease,
    /// The local list, in order: the pack buffer is scattered into it.
    pub(crate) parts: Vec<Part>,
}

/// One operation this side initiated and the target has not answered yet.
pub(crate) struct PendingOp {
    pub(crate) kind: PendingKind,
    /// The application's [`Transfer`] completes through this.
    pub(crate) completion: Arc<Completion>,
    pub(crate) len: u64,
    pub(crate) deadline: Instant,
    /// From the request's entries back to the application's remote segments (a refusal
    /// names an entry).
    pub(crate) segments: SegmentMap,
    /// A packed write from staged memory into host memory: its bytes' share of the
    /// connection's [`PackCredits`], held only to be given back when the operation goes
    /// (its drop does it).
    pub(crate) _credit: Option<PackCredit>,
}

/// Operations touching GPU memory go inline only while fewer than this many one-sided
/// operations of the connection are pending. Inline, each costs one synchronous GPU copy on
/// each side (6.5–8 µs on an H200 VM whatever the size: the GPU's round trip), done one
/// after another on the initiator's calling thread and on the target's control loop; the
/// comms pipeline theirs. Measured on an H200 (docs/RESULTS.md, twenty-third session),
/// inline carries more at depth 1 and 2 (4 KiB 0.13 / 0.20 against 0.05 / 0.17 GB/s, 64 KiB
/// 0.84 / 1.50 against 0.55 / 1.22) and less from depth 4 (4 KiB reads 0.20 against 0.30,
/// 64 KiB writes 1.64 against 2.43; depth 128 4 KiB 0.37 against 0.93).
pub(crate) const GPU_INLINE_MAX_PENDING: usize = 2;

/// Host operations past [`Config::inline_bytes`], up to [`Config::inline_lone_bytes`], go
/// inline only while fewer than this many one-sided operations of the connection wait for
/// their answer and no read through the comms is still receiving: only when nothing else is
/// in flight. Their bytes then cross one control stream and a copy on each side's control
/// loop, where the comms spread and pipeline them over the channels. Measured on an H200
/// (docs/RESULTS.md, thirtieth session, one process holding both endpoints): inline at
/// depth 1 moved 16 KiB at 0.74–0.75 GB/s against 0.24–0.27 through the comms, but with one
/// other operation pending (depth 2) 64 KiB at 2.1–2.5 against 3.2–3.4, and reads at depth
/// 2 lost as much to a rule that did not see a read still receiving. Host memory up to
/// [`Config::inline_bytes`] always goes inline.
pub(crate) const HOST_LONE_MAX_PENDING: usize = 1;

/// What a connection has in flight when an operation is posted ([`Rma::in_flight`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct InFlight {
    /// One-sided operations waiting for their answer.
    answers: usize,
    /// The latest read through the comms was answered and is still receiving its bytes.
    reading: bool,
}

/// Whether an operation of `total` bytes goes inline by its size under `config`, for GPU
/// memory on either side or not, with `in_flight` what the connection has in flight (see
/// [`GPU_INLINE_MAX_PENDING`] and [`HOST_LONE_MAX_PENDING`]). `in_flight` is asked only
/// when the answer depends on it, since it takes the pending table's lock, which the control
/// loop also takes: never for a host operation within [`Config::inline_bytes`] or one too
/// large for any limit.
fn inline_by_size(
    config: &Config,
    gpu: bool,
    total: u64,
    in_flight: impl FnOnce() -> InFlight,
) -> bool {
    if gpu {
        return total <= u64::from(config.inline_gpu_bytes)
            && in_flight().answers < GPU_INLINE_MAX_PENDING;
    }
    if total <= u64::from(config.inline_bytes) {
        return true;
    }
    total <= u64::from(config.inline_lone_bytes) && {
        let now = in_flight();
        now.answers < HOST_LONE_MAX_PENDING && !now.reading
    }
}

#[derive(Default)]
struct Pending {
    ops: HashMap<u64, PendingOp>,
    /// Set once no answer can arrive any more (the control stream ended or the connection
    /// closed): new operations fail at once with it.
    closed: Option<Error>,
    last_sweep: Option<Instant>,
    /// The completion of the latest read posted through the comms. Its entry leaves `ops`
    /// at `ReadData`, while its bytes still travel: whether this has finished tells a lone
    /// operation from one behind a read ([`Rma::in_flight`]).
    last_read: Option<Arc<Completion>>,
}

/// A local list and a remote list checked and coalesced. The local runs become pieces (and
/// are registered) only where the operation hands them to the lanes ([`Rma::local_pieces`]).
struct Plan {
    /// The coalesced local runs: which caller segment starts each, its offset and length.
    runs: Vec<Run>,
    /// Every run is unstaged host memory (a candidate for pack buffers).
    host: bool,
    /// Set when the local list is staged (all of it: a mixed list is refused).
    staging: Option<Staging>,
    local_lens: Vec<u64>,
    entries: Vec<RemoteEntry>,
    /// From `entries` back to the caller's remote segments.
    segments: SegmentMap,
    remote_lens: Vec<u64>,
    len: u64,
}

/// The one-sided half of a connection (see the module docs of [`crate::onesided`]).
pub(crate) struct Rma {
    /// The link over the RMA channels (N..2N of the handshake).
    pub(crate) link: Arc<Link>,
    /// How this half's jobs reach the engines of `link`.
    pub(crate) carrier: Arc<Carrier>,
    /// The two-sided link of the same connection.
    pub(crate) main: Arc<Link>,
    /// The endpoint's advertised regions and notification inbox.
    pub(crate) shared: Arc<OneSidedShared>,
    /// The endpoint's configuration (chunk size, packing thresholds).
    pub(crate) config: Config,
    /// The control connection's sending half, shared with the two-sided code. Queueing a send
    /// job and its marker in one of its critical sections is what keeps the RMA lanes in step.
    pub(crate) writer: Arc<ControlTx>,
    next_op: AtomicU64,
    pending: Mutex<Pending>,
    /// The discard region (registered for receives on first refusal) and its registration.
    scratch: Mutex<Option<(Region, Arc<Registration>)>>,
    /// Pack buffers for batches of small blocks (see `pack`).
    pub(crate) pack: PackPool,
    /// Bytes of packed writes from staged memory into host memory in flight.
    staged_to_host: PackCredits,
    /// This endpoint stages CUDA memory (its plugin takes host memory only). Both ends of a
    /// connection run the same plugin, so the peer then stages its CUDA regions too and can
    /// take a packed stream into them through its rings.
    pub(crate) stages_cuda: bool,
}

impl Rma {
    /// The pool's first pack buffer, readied now ([`PackPool::ready_first`]) where this
    /// connection packs host memory at all (pack buffers allowed, a threshold above 0): for
    /// the caller to register with the regions it registers at connect time.
    pub(crate) fn ready_pack_buffer(&self) -> Option<Region> {
        (self.config.pack_below > 0).then(|| self.pack.ready_first())?
    }

    pub(crate) fn new(
        carrier: Arc<Carrier>,
        main: Arc<Link>,
        shared: Arc<OneSidedShared>,
        config: Config,
        writer: Arc<ControlTx>,
        stages_cuda: bool,
    ) -> Self {
        let pack = PackPool::new(config.pack_buffers);
        // Its first packed batches should find buffers whose pages are faulted in already.
        super::spare::warm_for(&config);
        Self {
            pack,
            staged_to_host: PackCredits::default(),
            stages_cuda,
            link: carrier.link.clone(),
            carrier,
            main,
            shared,
            config,
            writer,
            next_op: AtomicU64::new(0),
            pending: Mutex::new(Pending::default()),
            scratch: Mutex::new(None),
        }
    }

    fn pending(&self) -> MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Operations initiated here and not answered yet.
    pub(crate) fn pending_count(&self) -> usize {
        self.pending().ops.len()
    }

    /// What the connection has in flight: operations waiting for an answer, and whether the
    /// latest read through the comms is still receiving (answered, so no longer among them).
    fn in_flight(&self) -> InFlight {
        let pending = self.pending();
        InFlight {
            answers: pending.ops.len(),
            reading: matches!(&pending.last_read, Some(c) if !c.is_finished()),
        }
    }

    fn usable(&self) -> Result<()> {
        if let Some(e) = self.main.refusal().or_else(|| self.link.refusal()) {
            return Err(e);
        }
        if let Some(e) = &self.pending().closed {
            return Err(e.clone());
        }
        Ok(())
    }

    /// Checks both lists and coalesces them.
    fn plan(
        &self,
        local: &[Segment<'_>],
        remote: &[RemoteSegment],
        direction: Direction,
    ) -> Result<Plan> {
        let len = checked_len(local, remote)?;
        // All staged or none, checked before anything is registered. Only a list naming a
        // staged region goes through `staging_of`: other lists keep their direct route
        // unchanged (a plugin taking CUDA pointers registers CUDA regions itself).
        let staging = if local.iter().any(|s| s.region.is_staged()) {
            staging_of(local.iter().map(|s| s.region), direction)?
        } else {
            None
        };
        let local_runs = coalesce(
            local
                .iter()
                .map(|s| (s.region.inner.id, s.offset as u64, s.len as u64)),
        );
        let (entries, segments) = remote_entries(remote);
        let remote_lens = remote_lens(&entries);
        Ok(Plan {
            local_lens: local_runs.iter().map(|r| r.len).collect(),
            runs: local_runs,
            host: staging.is_none() && local.iter().all(|s| packs_through_buffers(s.region)),
            staging,
            entries,
            segments,
            remote_lens,
            len,
        })
    }

    /// The plan's local runs as pieces of a job in `direction`, registered on the link
    /// (staged regions are not: the plugin only ever sees the lanes' rings). A write asks
    /// only once it knows that its own list goes on the wire: one whose blocks are gathered
    /// into a pack buffer never reaches the plugin, and registering it was an engine round
    /// trip for nothing on its connection's first write (47–420 µs with the engines asleep;
    /// docs/RESULTS.md, thirty-eighth session).
    fn local_pieces(
        &self,
        plan: &Plan,
        local: &[Segment<'_>],
        direction: Direction,
    ) -> Result<Pieces> {
        self.carrier.region_pieces(
            plan.runs.iter().map(|&Run { first, offset, len }| {
                // Within the region, so the offset fits a usize.
                (local[first].region, offset as usize, len)
            }),
            direction,
            plan.staging.is_some(),
        )
    }

    fn schedule(
        &self,
        local_lens: &[u64],
        remote_lens: &[u64],
        op_id: u64,
        spread: bool,
    ) -> Result<Schedule> {
        self.link
            .schedule(local_lens, remote_lens, spread)
            .map(|s| s.rotated(op_id))
            .map_err(|e| Error::InvalidArgument(e.to_string()))
    }

    /// How this side takes part if the batch travels packed, or `None` when it does not
    /// (see [`crate::onesided`], "Packing small scattered blocks"). Packed when the batch is
    /// worth it ([`worth_packing`]) and each side can copy: a local list of unstaged host
    /// memory (through a pack buffer) or of staged memory (through the lanes' ring slots);
    /// a remote list of host memory, or of CUDA memory when this endpoint stages CUDA memory
    /// (the peer runs the same plugin, so it stages its CUDA regions too; a target that does
    /// not still takes the stream through rings, see `target`). Batches are capped at a
    /// pack buffer when either side is host memory. CUDA memory a plugin takes directly
    /// never packs on this side (no GPU pack buffer). A batch with staged memory on either
    /// side packs below [`crate::Config::pack_staged_below`], one of host memory on both
    /// below [`crate::Config::pack_below`] ([`PackSide::threshold`]).
    fn pack_side(
        &self,
        remote: &[RemoteSegment],
        plan: &Plan,
        spread: bool,
    ) -> Option<(PackSide, PackSide)> {
        let local = if plan.staging.is_some() {
            PackSide::Staged
        } else if plan.host {
            PackSide::Host
        } else {
            return None;
        };
        let kinds = |kind| remote.iter().all(|r| r.descriptor.kind() == kind);
        let far = if kinds(tcpx::MemoryKind::Host) {
            PackSide::Host
        } else if self.stages_cuda && kinds(tcpx::MemoryKind::Cuda) {
            PackSide::Staged
        } else {
            return None;
        };
        let runs = plan.runs.len().max(plan.remote_lens.len());
        let cap = PackSide::cap(local, far, self.host_pack_cap(plan.len, spread));
        let below = PackSide::threshold(local, far, &self.config);
        (worth_packing(plan.len, runs, below, cap)
            && (runs > self.lone_unpacked_runs(local, far) || !self.alone()))
        .then_some((local, far))
    }

    /// The largest packed transfer of `len` bytes a host side takes (see
    /// [`super::pack::PACKED_HOST_MAX_BYTES`]): as many pack buffers as the pool may hold
    /// when the stream's chunks fit them whole ([`spans_buffers`]: a chunk size that does not
    /// divide a buffer would cut the stream differently over several buffers than the peer
    /// cuts it over one), else one.
    pub(crate) fn host_pack_cap(&self, len: u64, spread: bool) -> u64 {
        let spans = len <= PACK_BYTES
            || packed_schedule(len, &self.link, 0, spread)
                .is_ok_and(|s| spans_buffers(len, s.cut_bytes()));
        if spans {
            // One buffer's worth at least: a pool too small for it counts the batch as a
            // fallback (`PackStats::fallbacks`), as it always has.
            PACKED_HOST_MAX_BYTES
                .min(PACK_BYTES.saturating_mul(self.config.pack_buffers as u64))
                .max(PACK_BYTES)
        } else {
            PACK_BYTES
        }
    }

    /// Whether the connection has no other one-sided operation in flight: none waits for its
    /// answer, and the latest read is not still receiving its bytes. A read leaves the
    /// pending table at its answer (`ReadData`), long before its data is in; judged by the
    /// table alone, a stream of reads looked idle whenever the target had answered the one
    /// before, and 32 × 4 KiB reads at depth 32 went unpacked, one request per block (two of
    /// 32 packed in `small_packed_lists_in_flight_share_one_pack_buffer`).
    fn alone(&self) -> bool {
        let now = self.in_flight();
        now.answers == 0 && !now.reading
    }

    /// Runs a batch between `local` and `far` alone on the connection may have and still go
    /// unpacked: its pieces then ride the channels in parallel with no copy (see
    /// [`crate::Config::pack_lone_runs`]); fewer where a side is staged, since there every
    /// unpacked piece is a ring copy of its own.
    fn lone_unpacked_runs(&self, local: PackSide, far: PackSide) -> usize {
        let channels = usize::from(self.link.channels);
        self.config
            .pack_lone_runs
            .unwrap_or(if PackSide::either_staged(local, far) {
                channels * crate::config::STAGED_LONE_RUNS_PER_CHANNEL
            } else {
                channels * self.config.window
            })
    }

    /// The packed form of a batch: the contiguous schedule, and this side's pieces — the
    /// pack buffer's whole `len`, or `own` when this side's list is one run already (a
    /// contiguous side needs no copy: the wire only needs both sides to cut `len` alike).
    pub(crate) fn packed_job_parts(
        &self,
        lease: Option<&PackLease>,
        own: Pieces,
        len: u64,
        direction: Direction,
        staged: bool,
        cut: OpCut,
    ) -> Result<(Pieces, Schedule)> {
        let OpCut { op_id, spread } = cut;
        let schedule = packed_schedule(len, &self.link, op_id, spread)
            .map_err(|e| Error::Internal(format!("packed operation #{op_id}: {e}")))?;
        let pieces = match lease {
            // Staged: the lanes gather each chunk's pieces into their ring slots (or scatter
            // them out), so the list stays as it is, however scattered.
            None if staged => own,
            Some(lease) => {
                let pieces = lease_pieces(&self.carrier, lease, direction)?;
                if pieces.len() > 1 {
                    // Several buffers: this side's schedule runs over them, and cuts the
                    // stream as the peer's contiguous one does (the buffers hold whole
                    // chunks: `spans_buffers`).
                    let spans = self
                        .link
                        .schedule(&lease.span_lens(), &[len], spread)
                        .map(|s| s.rotated(op_id))
                        .map_err(|e| Error::Internal(format!("packed operation #{op_id}: {e}")))?;
                    if spans.chunk_count() != schedule.chunk_count()
                        || !spans_buffers(len, schedule.cut_bytes())
                    {
                        return Err(Error::Internal(format!(
                            "packed operation #{op_id} of {len} bytes: {} pack buffers do not \
                             hold whole chunks of {} bytes",
                            pieces.len(),
                            schedule.cut_bytes()
                        )));
                    }
                    return Ok((pieces, spans));
                }
                pieces
            }
            None if own.len() == 1 => own,
            None => {
                return Err(Error::Internal(format!(
                    "packed operation #{op_id} without a pack buffer for {} pieces",
                    own.len()
                )))
            }
        };
        Ok((pieces, schedule))
    }

    /// Creates the job of a packed operation whose one piece is a pack buffer of host memory
    /// (from [`Self::packed_job_parts`]): the engines copy each chunk's share of `parts`
    /// into the buffer before they send it, or out of it once it is received (see
    /// [`crate::engine::job::HostParts`]), so the job finishes with every byte in place.
    pub(crate) fn packed_host_job(&self, spec: JobSpec, parts: &[Part]) -> Result<Arc<Job>> {
        Ok(self.carrier.new_packed_host_job(spec, host_parts(parts)?))
    }

    /// Whether an operation is cut finer over the connection's spread width (the initiator
    /// decides; the request tells the target). Only a lone operation: a transfer waited for on
    /// its own rides every channel at once, while operations already in flight keep the
    /// channels busy anyway and spreading would only multiply requests (measured: 4 one-sided
    /// 1 MiB writes in flight lost a quarter of their rate).
    ///
    /// Staged (GPU) memory spreads too. Whole, a lone staged chunk went through one ring slot
    /// with its copy out, its send, its receive and its copy in one after the other; in
    /// pieces they overlap on every lane. Two processes on one H200, one write at a time
    /// (`kv --memory cuda --depth 1`): 256 KiB p50 127–136 µs against 336, 1 MiB 179–198
    /// against 384–414; 16 MiB level. (Every staged transfer was once spread, streams too,
    /// and a stream of 1 MiB GPU messages in pieces ran at half its rate: streams are not
    /// alone, and keep whole chunks. A window of four whose answers come in bursts still
    /// finds the connection idle now and then: 1 MiB writes at depth 4 ran 6.60 against 7.09
    /// GB/s, at depth 8 level.)
    fn spreads(&self) -> bool {
        self.link.spread_width() > 1 && self.alone()
    }

    /// Registers `op` unless the connection can no longer answer it.
    fn add_pending(&self, op_id: u64, op: PendingOp) -> Result<()> {
        let mut pending = self.pending();
        if let Some(e) = &pending.closed {
            return Err(e.clone());
        }
        if matches!(op.kind, PendingKind::Read { .. }) {
            pending.last_read = Some(op.completion.clone());
        }
        pending.ops.insert(op_id, op);
        Ok(())
    }

    /// See [`crate::Connection::write`].
    pub(crate) fn write(
        &self,
        local: &[Segment<'_>],
        remote: &[RemoteSegment],
        notification: Option<&[u8]>,
    ) -> Result<Transfer> {
        self.usable()?;
        if let Some(n) = notification {
            check_notification(n)?;
        }
        if let Some(transfer) = self.write_inline(local, remote, notification)? {
            return Ok(transfer);
        }
        let plan = self.plan(local, remote, Direction::Send)?;
        let spread = self.spreads();
        // Packing: a scattered host list is gathered into pooled buffers by the engines,
        // chunk by chunk, just before each chunk's send (no pooled buffer free: the batch
        // goes unpacked); a local list that is one run already is sent from in place. A
        // staged list is gathered by the lanes, chunk by chunk, into their ring slots.
        let (side, credit) = match self.pack_side(remote, &plan, spread) {
            // Staged memory into host memory: packed only while the target's pool holds it.
            Some((PackSide::Staged, PackSide::Host)) => {
                let cap = self.host_pack_cap(plan.len, spread);
                let credit = self.staged_to_host.take(plan.len, cap);
                (credit.is_some().then_some(PackSide::Staged), credit)
            }
            sides => (sides.map(|(local, _)| local), None),
        };
        let mut packed = side.is_some();
        let staged = side == Some(PackSide::Staged);
        let pack = if side == Some(PackSide::Host) && plan.runs.len() > 1 {
            let lease = self.pack.for_sender(plan.len)?;
            packed = lease.is_some();
            lease
        } else {
            None
        };
        // Gathered into a pack buffer, the list itself never reaches the plugin; otherwise
        // (unpacked, one run sent in place, or staged) its pieces are what the lanes send.
        let own = match pack {
            Some(_) => Pieces::new(),
            None => self.local_pieces(&plan, local, Direction::Send)?,
        };
        let op_id = self.next_op.fetch_add(1, Ordering::Relaxed);
        let request = WriteRequest {
            op_id,
            entries: plan.entries,
            local_lens: plan.local_lens,
            notification: notification.map(<[u8]>::to_vec),
            packed,
            spread,
            inline: None,
        };
        check_batch(request.payload_len(), request.entries.len())?;
        let (pieces, schedule) = if packed {
            self.packed_job_parts(
                pack.as_ref(),
                own,
                plan.len,
                Direction::Send,
                staged,
                OpCut { op_id, spread },
            )?
        } else {
            (
                own,
                self.schedule(&request.local_lens, &plan.remote_lens, op_id, spread)?,
            )
        };
        let spec = JobSpec {
            direction: Direction::Send,
            seq: op_id,
            pieces,
            staging: plan.staging,
            schedule: Some(schedule),
            completion: None,
            packed,
        };
        let job = match &pack {
            Some(_) => self.packed_host_job(spec, &local_parts(local))?,
            None => self.carrier.new_job(spec),
        };
        if packed {
            self.pack.count_sent();
        }
        if let Some(lease) = pack {
            // Back to the pool once the sends are done (whatever the target answers).
            self.pack.hold(job.clone(), lease);
        }
        let completion = Arc::new(Completion::default());
        let op = PendingOp {
            kind: PendingKind::Write { job: job.clone() },
            completion: completion.clone(),
            len: plan.len,
            deadline: Instant::now() + self.link.timeout,
            segments: plan.segments,
            _credit: credit,
        };
        if let Err(e) = self.add_pending(op_id, op) {
            job.fail(e.clone());
            return Err(e);
        }
        // The order rule: the data sender queues its job and its marker in one critical
        // section, so the target queues its receives in the same order. The connection's
        // control loop writes the marker when it is awake: this thread then pays no syscall.
        let ((), queued) = self.writer.queue_with(
            || self.carrier.submit_job(&job),
            &Message::WriteRequest(request),
        );
        let sent = queued.and_then(|()| self.writer.signal());
        if let Err(e) = sent {
            let e = Error::from(e);
            self.link.fail(e.clone());
            self.fail_pending(&e);
            return Err(e);
        }
        Ok(Transfer::new(
            completion,
            Direction::Send,
            plan.len,
            self.config.wait_spin,
        ))
    }

    /// A small write ([`Rma::goes_inline`]), of host or CUDA memory:
    /// its data is gathered now and travels in its `WriteRequest`, which the target copies
    /// in and answers (see [`crate::onesided`], "Small writes travel inline"). `None` when the
    /// write is not one (the caller takes the one-sided comms).
    fn write_inline(
        &self,
        local: &[Segment<'_>],
        remote: &[RemoteSegment],
        notification: Option<&[u8]>,
    ) -> Result<Option<Transfer>> {
        if !self.goes_inline(local, remote) {
            return Ok(None);
        }
        let len = checked_len(local, remote)?;
        let mut data = Vec::with_capacity(len as usize);
        super::inline::gather(local, &mut data)
            .map_err(|e| Error::InvalidArgument(format!("one-sided write: {e}")))?;
        let op_id = self.next_op.fetch_add(1, Ordering::Relaxed);
        let (entries, segments) = remote_entries(remote);
        let request = WriteRequest {
            op_id,
            entries,
            // The data is one run, whatever the local list was.
            local_lens: vec![len],
            notification: notification.map(<[u8]>::to_vec),
            packed: false,
            spread: false,
            inline: Some(data),
        };
        if request.payload_len() > MAX_PAYLOAD as usize {
            // So many entries that the request does not fit one frame: the comms take it
            // (and say so if it fits no request at all).
            return Ok(None);
        }
        let completion = Arc::new(Completion::default());
        let op = PendingOp {
            kind: PendingKind::InlineWrite,
            completion: completion.clone(),
            len,
            deadline: Instant::now() + self.link.timeout,
            segments,
            _credit: None,
        };
        self.add_pending(op_id, op)?;
        // No job: the data is in the request, so the order rule of the comms does not apply,
        // and the target serves the request in control-stream order with every other one.
        if let Err(e) = self.writer.post(&Message::WriteRequest(request)) {
            let e = Error::from(e);
            self.link.fail(e.clone());
            self.fail_pending(&e);
            return Err(e);
        }
        self.link.inline.sent(len);
        Ok(Some(Transfer::new(
            completion,
            Direction::Send,
            len,
            self.config.wait_spin,
        )))
    }

    /// See [`crate::Connection::read`].
    pub(crate) fn read(&self, local: &[Segment<'_>], remote: &[RemoteSegment]) -> Result<Transfer> {
        self.usable()?;
        if let Some(transfer) = self.read_inline(local, remote)? {
            return Ok(transfer);
        }
        let plan = self.plan(local, remote, Direction::Recv)?;
        // Registered now: the target decides whether the data comes packed.
        let pieces = self.local_pieces(&plan, local, Direction::Recv)?;
        let spread = self.spreads();
        // Offer to receive packed (host memory: into place when the local list is one run,
        // else into pooled buffers reserved for it, none free, no offer; staged memory:
        // scattered by the lanes out of their ring slots); the target decides.
        // A host target sends, bounded by its own pool: no credit is needed here.
        let side = self
            .pack_side(remote, &plan, spread)
            .map(|(local, _)| local);
        let mut offered = side.is_some();
        let pack = if side == Some(PackSide::Host) && plan.runs.len() > 1 {
            let pack = self.pack.for_sender(plan.len)?.map(|lease| ReadPack {
                lease,
                parts: local_parts(local),
            });
            offered = pack.is_some();
            pack
        } else {
            None
        };
        let op_id = self.next_op.fetch_add(1, Ordering::Relaxed);
        let request = ReadRequest {
            op_id,
            entries: plan.entries,
            local_lens: plan.local_lens,
            pack: offered,
            spread,
            inline: false,
        };
        check_batch(request.payload_len(), request.entries.len())?;
        let schedule = self.schedule(&request.local_lens, &plan.remote_lens, op_id, spread)?;
        let completion = Arc::new(Completion::default());
        let op = PendingOp {
            kind: PendingKind::Read {
                pieces,
                schedule,
                staging: plan.staging,
                offered,
                pack,
                spread,
            },
            completion: completion.clone(),
            len: plan.len,
            deadline: Instant::now() + self.link.timeout,
            segments: plan.segments,
            _credit: None,
        };
        self.add_pending(op_id, op)?;
        let sent = self.writer.post(&Message::ReadRequest(request));
        if let Err(e) = sent {
            let e = Error::from(e);
            self.link.fail(e.clone());
            self.fail_pending(&e);
            return Err(e);
        }
        Ok(Transfer::new(
            completion,
            Direction::Recv,
            plan.len,
            self.config.wait_spin,
        ))
    }

    /// A small read ([`Rma::goes_inline`]), into host or CUDA memory:
    /// it asks the target for its data inline (`ReadInline`, copied into `local` by the
    /// control loop), as [`Rma::write_inline`] sends a small write's. `None` when the read is
    /// not one (the caller takes the one-sided comms).
    fn read_inline(
        &self,
        local: &[Segment<'_>],
        remote: &[RemoteSegment],
    ) -> Result<Option<Transfer>> {
        if !self.goes_inline(local, remote) {
            return Ok(None);
        }
        let len = checked_len(local, remote)?;
        let op_id = self.next_op.fetch_add(1, Ordering::Relaxed);
        let (entries, segments) = remote_entries(remote);
        let request = ReadRequest {
            op_id,
            entries,
            local_lens: vec![len],
            pack: false,
            spread: false,
            inline: true,
        };
        if request.payload_len() > MAX_PAYLOAD as usize {
            return Ok(None);
        }
        let completion = Arc::new(Completion::default());
        let op = PendingOp {
            kind: PendingKind::InlineRead {
                local: local
                    .iter()
                    .map(|s| (s.region.clone(), s.offset, s.len))
                    .collect(),
            },
            completion: completion.clone(),
            len,
            deadline: Instant::now() + self.link.timeout,
            segments,
            _credit: None,
        };
        self.add_pending(op_id, op)?;
        if let Err(e) = self.writer.post(&Message::ReadRequest(request)) {
            let e = Error::from(e);
            self.link.fail(e.clone());
            self.fail_pending(&e);
            return Err(e);
        }
        Ok(Some(Transfer::new(
            completion,
            Direction::Recv,
            len,
            self.config.wait_spin,
        )))
    }

    /// Whether an operation on these lists carries its data in control messages: of memory
    /// this side can copy (host, or CUDA through its GPU's small copier; the target's control
    /// loop copies host and CUDA memory alike), and small enough ([`inline_by_size`]):
    /// [`Config::inline_bytes`] of host memory, or [`Config::inline_lone_bytes`] while the
    /// connection has nothing else in flight; when either side is GPU memory (staged
    /// included), [`Config::inline_gpu_bytes`] while fewer than [`GPU_INLINE_MAX_PENDING`]
    /// operations wait for their answer.
    fn goes_inline(&self, local: &[Segment<'_>], remote: &[RemoteSegment]) -> bool {
        let c = &self.config;
        let most = c
            .inline_bytes
            .max(c.inline_lone_bytes)
            .max(c.inline_gpu_bytes);
        // Stops at the first segment past the largest limit: a long list of large blocks
        // costs nothing more on its way to the comms.
        let Some(total) = local.iter().try_fold(0u64, |total, s| {
            total
                .checked_add(s.len as u64)
                .filter(|&t| t <= u64::from(most))
        }) else {
            return false;
        };
        let cuda = tcpx::MemoryKind::Cuda;
        let gpu = local
            .iter()
            .any(|s| s.region.kind() == cuda || s.region.is_staged())
            || remote.iter().any(|r| r.descriptor.kind() == cuda);
        local.iter().all(|s| super::inline::copyable(s.region))
            && inline_by_size(c, gpu, total, || self.in_flight())
    }

    /// See [`crate::Connection::notify`].
    pub(crate) fn notify(&self, bytes: &[u8]) -> Result<()> {
        self.usable()?;
        check_notification(bytes)?;
        let sent = self.writer.post(&Message::Notify {
            bytes: bytes.to_vec(),
        });
        sent.map_err(|e| {
            let e = Error::from(e);
            self.link.fail(e.clone());
            e
        })
    }

    /// Takes the pending operation `op_id` (the target answered it).
    pub(crate) fn take_pending(&self, op_id: u64) -> Option<PendingOp> {
        self.pending().ops.remove(&op_id)
    }

    /// Fails every pending operation with `error`.
    pub(crate) fn fail_pending(&self, error: &Error) {
        let ops: Vec<PendingOp> = self.pending().ops.drain().map(|(_, op)| op).collect();
        for op in ops {
            op.completion.finish(Err(error.clone()));
        }
    }

    /// No answer can arrive any more: fails what is pending and every later operation.
    pub(crate) fn close(&self, error: Error) {
        {
            let mut pending = self.pending();
            if pending.closed.is_none() {
                pending.closed = Some(error.clone());
            }
        }
        self.fail_pending(&error);
    }

    /// Called by the watcher on every pass: fails pending operations once either link failed,
    /// and fails the connection when one waited past the configured timeout.
    pub(crate) fn sweep(&self, now: Instant) {
        let late = {
            let mut pending = self.pending();
            if pending.ops.is_empty()
                || pending
                    .last_sweep
                    .is_some_and(|at| now.duration_since(at) < SWEEP_EVERY)
            {
                return;
            }
            pending.last_sweep = Some(now);
            pending
                .ops
                .iter()
                .find(|(_, op)| now >= op.deadline)
                .map(|(id, op)| {
                    let write = matches!(
                        op.kind,
                        PendingKind::Write { .. } | PendingKind::InlineWrite
                    );
                    (*id, write)
                })
        };
        if let Some((op_id, write)) = late {
            self.link.fail(Error::Timeout {
                channel: 0,
                peer: self.link.peer,
                waited: self.link.timeout,
                what: format!(
                    "one-sided {} #{op_id} (waiting for the target's answer)",
                    if write { "write" } else { "read" }
                ),
            });
        }
        if let Some(e) = self.main.failure().or_else(|| self.link.failure()) {
            self.fail_pending(&e.clone());
        }
    }

    /// The discard region's memory and registration (chunk-sized, receives only), made on
    /// first use: the data of a refused write lands there, every chunk at offset 0.
    pub(crate) fn scratch(&self) -> Result<(tcpx::SharedMemory, Arc<Registration>)> {
        let mut scratch = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((region, registration)) = scratch.as_ref() {
            return Ok((region.memory().clone(), registration.clone()));
        }
        let memory = tcpx::SharedMemory::host(self.link.chunk_bytes as usize)
            .map_err(|e| Error::Internal(format!("cannot allocate the discard region: {e}")))?;
        let region = Region::new(memory.clone());
        let registration = self.carrier.register_region(&region, Direction::Recv)?;
        *scratch = Some((region, registration.clone()));
        Ok((memory, registration))
    }
}

/// The local list as pack parts, in order (validated by `plan`).
fn local_parts(local: &[Segment<'_>]) -> Vec<Part> {
    local
        .iter()
        .map(|s| Part {
            region: s.region.clone(),
            offset: s.offset as u64,
            len: s.len as u64,
        })
        .collect()
}

/// The lengths of the remote list as the target will cut it (coalesced, like the target).
pub(crate) fn remote_lens(entries: &[RemoteEntry]) -> Vec<u64> {
    coalesce(entries.iter().map(|e| (e.region_id, e.offset, e.len)))
        .into_iter()
        .map(|r| r.len)
        .collect()
}

/// The access error an initiator reports for a refusal of the request `segments` maps back
/// to the application's remote list.
pub(crate) fn access_error(link: &Link, refusal: Refusal, segments: &SegmentMap) -> Error {
    let (descriptor, reason) = segments.name(&refusal);
    Error::Access {
        peer: link.peer,
        descriptor,
        reason,
    }
}

fn check_notification(bytes: &[u8]) -> Result<()> {
    if bytes.len() > MAX_NOTIFICATION {
        return Err(Error::InvalidArgument(format!(
            "a notification of {} bytes exceeds the cap of {MAX_NOTIFICATION} bytes",
            bytes.len()
        )));
    }
    Ok(())
}

/// The bytes a one-sided operation moves, once both lists are checked: neither empty, every
/// segment non-empty and inside its region, and both lists of the same total.
fn checked_len(local: &[Segment<'_>], remote: &[RemoteSegment]) -> Result<u64> {
    if local.is_empty() || remote.is_empty() {
        return Err(Error::InvalidArgument(
            "a one-sided operation needs at least one local and one remote segment".into(),
        ));
    }
    let mut len = 0u64;
    for (i, s) in local.iter().enumerate() {
        check_segment(
            "local",
            i,
            s.offset as u64,
            s.len as u64,
            s.region.len() as u64,
        )?;
        len += s.len as u64;
    }
    let mut remote_len = 0u64;
    for (i, r) in remote.iter().enumerate() {
        check_segment("remote", i, r.offset, r.len, r.descriptor.len())?;
        remote_len = remote_len.checked_add(r.len).ok_or_else(|| {
            Error::InvalidArgument("the remote list's total overflows u64".into())
        })?;
    }
    if len != remote_len {
        return Err(Error::InvalidArgument(format!(
            "the local list holds {len} bytes and the remote list {remote_len}: they must be equal"
        )));
    }
    Ok(len)
}

/// Segment `i` of the `side` list: `len` bytes at `offset` in a region of `region_len`,
/// non-empty and inside it.
fn check_segment(side: &str, i: usize, offset: u64, len: u64, region_len: u64) -> Result<()> {
    if len == 0 || offset.checked_add(len).is_none_or(|end| end > region_len) {
        return Err(Error::InvalidArgument(format!(
            "{side} segment {i}: {len} bytes at offset {offset} in a region of {region_len} \
             bytes (empty or outside it)"
        )));
    }
    Ok(())
}

/// Refuses a request too large for one control frame, saying how large it is and what fits.
fn check_batch(payload: usize, entries: usize) -> Result<()> {
    if payload > MAX_PAYLOAD as usize {
        return Err(Error::InvalidArgument(format!(
            "a batch of {entries} remote entries (its segments, adjacent ones merged) needs a \
             {payload}-byte request; one request carries at most {MAX_PAYLOAD} bytes (about {} \
             entries): split the batch",
            (MAX_PAYLOAD as usize - 64) / (crate::control::rma::ENTRY_BYTES + 8)
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(inline: u32, lone: u32, gpu: u32) -> Config {
        Config::builder()
            .inline_bytes(inline)
            .inline_lone_bytes(lone)
            .inline_gpu_bytes(gpu)
            .build()
            .expect("valid limits")
    }

    /// The rule against its statement: host memory up to `inline_bytes` always, up to
    /// `inline_lone_bytes` while nothing else is in flight; GPU memory up to
    /// `inline_gpu_bytes` while at most one other operation waits for its answer; and the
    /// pending table is looked at only when the answer depends on it.
    #[test]
    fn lone_operations_go_inline_up_to_their_own_limits() {
        let c = limits(8 << 10, 32 << 10, 64 << 10);
        let sizes = [
            1u64,
            8 << 10,
            (8 << 10) + 1,
            32 << 10,
            (32 << 10) + 1,
            64 << 10,
            1 << 20,
        ];
        for answers in 0..4usize {
            for reading in [false, true] {
                let now = InFlight { answers, reading };
                let alone = answers == 0 && !reading;
                for total in sizes {
                    let host = total <= 8 << 10 || (total <= 32 << 10 && alone);
                    assert_eq!(
                        inline_by_size(&c, false, total, || now),
                        host,
                        "host, {total} bytes, {now:?}"
                    );
                    let gpu = total <= 64 << 10 && answers <= 1;
                    assert_eq!(
                        inline_by_size(&c, true, total, || now),
                        gpu,
                        "GPU, {total} bytes, {now:?}"
                    );
                }
            }
        }
        // No lock where the size alone decides: a host operation within `inline_bytes`, one
        // past every limit, or any past the lone limit when that is at or under
        // `inline_bytes`.
        let untouched = |c: &Config, gpu: bool, total: u64| {
            let looked = std::cell::Cell::new(false);
            inline_by_size(c, gpu, total, || {
                looked.set(true);
                InFlight::default()
            });
            !looked.get()
        };
        assert!(untouched(&c, false, 4096));
        assert!(untouched(&c, false, 1 << 20));
        assert!(untouched(&c, true, 1 << 20));
        for lone in [0, 4 << 10, 8 << 10] {
            let c = limits(8 << 10, lone, 64 << 10);
            assert!(!inline_by_size(&c, false, (8 << 10) + 1, InFlight::default));
            assert!(untouched(&c, false, (8 << 10) + 1), "lone limit {lone}");
        }
        // Everything off: nothing past 0 bytes goes inline.
        let off = limits(0, 0, 0);
        assert!(!inline_by_size(&off, false, 1, InFlight::default));
        assert!(!inline_by_size(&off, true, 1, InFlight::default));
    }
}
