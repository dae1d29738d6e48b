//! One channel inside its engine: a send lane and a receive lane, each a comm driven by its
//! [`LaneCore`] (the lane's decisions, without I/O: [`super::lane`]), plus what the lane's
//! actions run against: the staging ring ([`super::stage`]) and the unpack step
//! ([`super::unpack`]), each made when the first transfer that needs it reaches the lane.
//!
//! This file only executes actions: one [`Lane::execute`] for every route (direct, staged,
//! unpack) and both directions, the difference between directions being the [`Comm`] calls.
//! The rules whose violation stalled earlier attempts are the core's: it tests its head after
//! every post and on every pass (the engine calls [`Channel::test`] each pass whatever the
//! window holds), only the window's head is ever tested, and a receive is consumed only once
//! done and its data is in place, in FIFO order.
//!
//! Nothing here allocates, locks or touches a shared atomic per chunk beyond the channel's
//! counters: actions are small values, the chunk is computed from the schedule, and a lane
//! reports each transfer once.

use std::sync::Arc;

use tcpx::{MemoryRegion, RecvComm, RecvRequest, SendComm, SendRequest, SharedMemory};

use crate::engine::job::{HostParts, Job};
use crate::engine::lane::{Action, ConsumeFailed, Event, LaneCore, Place, TestFailed};
use crate::engine::stage::{LaneStage, Staging};
use crate::engine::unpack::LaneUnpack;
use crate::error::{Direction, Error};
use crate::link::Link;
use crate::schedule::Chunk;
use crate::stats::ChannelCounters;
use crate::window::TestOutcome;

/// The link failed on this channel; the lane already failed the link. The engine must
/// abandon the link's channels (this one included), failing the transfers they hold.
#[derive(Debug)]
pub(crate) struct LinkFailed;

/// The plugin calls that differ between a send and a receive comm.
pub(crate) trait Comm {
    /// The comm's request.
    type Request;
    /// The lane's direction.
    const DIRECTION: Direction;
    /// `isend` / `irecv` of `region[offset..offset+len]`; `Ok(None)` when the plugin is busy.
    fn post(
        &mut self,
        region: &MemoryRegion,
        offset: usize,
        len: usize,
    ) -> tcpx::Result<Option<Self::Request>>;
    /// Tests the comm's oldest request.
    fn test(&mut self, request: &mut Self::Request) -> tcpx::Result<Option<usize>>;
    /// Hands a done receive back (`irecvConsumed`); a send has nothing to hand back.
    fn consumed(&mut self, request: Self::Request) -> tcpx::Result<()>;
    /// Registers memory on the comm.
    fn register(&self, memory: &SharedMemory) -> tcpx::Result<MemoryRegion>;
    /// The receive comm, for its UNPACK handle; `None` on a send comm.
    fn as_recv(&self) -> Option<&RecvComm>;
    /// The plugin's unpack slot of a receive; `None` for a send.
    fn unpack_slot(&self, request: &Self::Request) -> Option<usize>;
}

impl Comm for SendComm {
    type Request = SendRequest;
    const DIRECTION: Direction = Direction::Send;

    #[inline]
    fn post(
        &mut self,
        region: &MemoryRegion,
        offset: usize,
        len: usize,
    ) -> tcpx::Result<Option<SendRequest>> {
        self.isend(region, offset, len, 0)
    }

    #[inline]
    fn test(&mut self, request: &mut SendRequest) -> tcpx::Result<Option<usize>> {
        SendComm::test(self, request)
    }

    fn consumed(&mut self, request: SendRequest) -> tcpx::Result<()> {
        drop(request);
        Ok(())
    }

    fn register(&self, memory: &SharedMemory) -> tcpx::Result<MemoryRegion> {
        SendComm::register(self, memory)
    }

    fn as_recv(&self) -> Option<&RecvComm> {
        None
    }

    fn unpack_slot(&self, _request: &SendRequest) -> Option<usize> {
        None
    }
}

impl Comm for RecvComm {
    type Request = RecvRequest;
    const DIRECTION: Direction = Direction::Recv;

    #[inline]
    fn post(
        &mut self,
        region: &MemoryRegion,
        offset: usize,
        len: usize,
    ) -> tcpx::Result<Option<RecvRequest>> {
        self.irecv(region, offset, len, 0)
    }

    #[inline]
    fn test(&mut self, request: &mut RecvRequest) -> tcpx::Result<Option<usize>> {
        RecvComm::test(self, request)
    }

    #[inline]
    fn consumed(&mut self, request: RecvRequest) -> tcpx::Result<()> {
        RecvComm::consumed(self, request)
    }

    fn register(&self, memory: &SharedMemory) -> tcpx::Result<MemoryRegion> {
        RecvComm::register(self, memory)
    }

    fn as_recv(&self) -> Option<&RecvComm> {
        Some(self)
    }

    fn unpack_slot(&self, request: &RecvRequest) -> Option<usize> {
        Some(RecvComm::unpack_slot(self, request))
    }
}

/// A channel as its engine owns it.
pub(crate) struct Channel {
    pub(crate) link: Arc<Link>,
    pub(crate) index: u16,
    counters: Arc<ChannelCounters>,
    send: Lane<SendComm>,
    recv: Lane<RecvComm>,
    /// Completed requests at the last health check, and when that count last changed
    /// (progress detection once the peer has left).
    pub(crate) completed_at_check: u64,
    pub(crate) progress_at: std::time::Instant,
}

/// One lane: its comm, its core, and what its actions run against.
struct Lane<C: Comm> {
    comm: C,
    core: LaneCore<C::Request, Arc<Job>>,
    /// The pinned ring of staged transfers, made when the first one reaches the lane.
    stage: Option<Box<LaneStage>>,
    /// Receive lane: the unpack step, set up when the first direct receive into CUDA memory
    /// reaches the lane (`None` before, and for good on a comm without an UNPACK handle).
    unpack: Option<Box<LaneUnpack>>,
}

/// What the channel's failures name.
struct Cx<'a> {
    link: &'a Link,
    index: u16,
    counters: &'a ChannelCounters,
}

/// What executing one action did, as the pass loops count it.
enum Done {
    /// A request went out; what the core asked to run at once (the test of a request that
    /// found the window empty), if anything.
    Posted(Option<Action>),
    /// The plugin answered busy.
    Busy,
    /// A request was retired (a send done, a receive consumed).
    Retired,
    /// Anything else.
    Other,
}

impl Channel {
    pub(crate) fn new(
        link: Arc<Link>,
        index: u16,
        send: SendComm,
        recv: RecvComm,
        window: usize,
    ) -> Result<Self, Error> {
        let bad_window = |e| Error::Config(format!("window: {e}"));
        let counters = link
            .counters
            .get(usize::from(index))
            .cloned()
            .ok_or_else(|| Error::Internal(format!("channel {index} has no counters")))?;
        let channels = link.channels;
        Ok(Self {
            counters,
            send: Lane {
                comm: send,
                core: LaneCore::new(Direction::Send, index, channels, window)
                    .map_err(bad_window)?,
                stage: None,
                unpack: None,
            },
            recv: Lane {
                comm: recv,
                core: LaneCore::new(Direction::Recv, index, channels, window)
                    .map_err(bad_window)?,
                stage: None,
                unpack: None,
            },
            link,
            index,
            completed_at_check: 0,
            progress_at: std::time::Instant::now(),
        })
    }

    /// Queues a transfer on the lane of its direction.
    pub(crate) fn enqueue(&mut self, job: Arc<Job>) {
        match job.direction {
            Direction::Send => self.send.core.push(job),
            Direction::Recv => self.recv.core.push(job),
        }
    }

    /// Registers `memory` on this channel's comm of `direction`.
    pub(crate) fn register(
        &self,
        direction: Direction,
        memory: &SharedMemory,
    ) -> tcpx::Result<MemoryRegion> {
        match direction {
            Direction::Send => self.send.comm.register(memory),
            Direction::Recv => self.recv.comm.register(memory),
        }
    }

    /// Anything in flight or queued.
    pub(crate) fn has_work(&self) -> bool {
        self.send.core.has_work() || self.recv.core.has_work()
    }

    pub(crate) fn counters(&self) -> &ChannelCounters {
        &self.counters
    }

    /// Posts on the send lane until the window is full or there is nothing to post, testing
    /// the head after every post. Returns whether anything moved.
    pub(crate) fn pump_send(&mut self) -> Result<bool, LinkFailed> {
        let cx = Cx {
            link: &self.link,
            index: self.index,
            counters: &self.counters,
        };
        self.send.pump(&cx)
    }

    /// As [`Self::pump_send`], for the receive lane.
    pub(crate) fn pump_recv(&mut self) -> Result<bool, LinkFailed> {
        let cx = Cx {
            link: &self.link,
            index: self.index,
            counters: &self.counters,
        };
        self.recv.pump(&cx)
    }

    /// Tests both heads, retiring every request that is done. Returns whether any was.
    pub(crate) fn test(&mut self) -> Result<bool, LinkFailed> {
        let cx = Cx {
            link: &self.link,
            index: self.index,
            counters: &self.counters,
        };
        let sent = self.send.test(&cx)?;
        let received = self.recv.test(&cx)?;
        Ok(sent + received > 0)
    }

    /// The oldest transfer each lane still holds, for the timeout check.
    pub(crate) fn oldest_jobs(&self) -> [Option<&Arc<Job>>; 2] {
        [self.send.core.oldest_job(), self.recv.core.oldest_job()]
    }

    /// Makes the staging rings of both lanes for `staging` (slots of `slot_bytes`) where a
    /// lane has none yet, registering them on the lanes' comms: the first staged transfers
    /// of the channel then find them ready. Returns how many rings were made.
    pub(crate) fn prepare(&mut self, staging: &Staging, slot_bytes: usize) -> tcpx::Result<u16> {
        let made =
            self.send.prepare(staging, slot_bytes)? + self.recv.prepare(staging, slot_bytes)?;
        for _ in 0..made {
            self.counters.ring_opened();
        }
        Ok(made)
    }

    /// Drops every request and transfer, failing the transfers with the link's error.
    /// Requests still pending are dropped without being tested: the safe layer keeps their
    /// memory until the comm closes and refuses further use of the comm.
    pub(crate) fn abandon(&mut self) {
        self.send.abandon();
        self.recv.abandon();
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        // The rings go back to the process's pool for later connections (the comms close
        // after this, with the rest of the channel).
        for stage in [self.send.stage.take(), self.recv.stage.take()]
            .into_iter()
            .flatten()
        {
            stage.release();
            self.counters.ring_released();
        }
    }
}

impl<C: Comm> Lane<C> {
    /// Makes the lane's ring ahead of its first staged transfer, unless it has one; returns
    /// how many were made (0 or 1).
    fn prepare(&mut self, staging: &Staging, slot_bytes: usize) -> tcpx::Result<u16> {
        if self.core.has_ring() {
            return Ok(0);
        }
        let comm = &self.comm;
        let stage = LaneStage::new(staging, self.core.ring_slots(), slot_bytes, |m| {
            comm.register(m)
        })?;
        if let Err(what) = self.core.ring_made() {
            stage.release();
            return Err(tcpx::Error::new(
                "staging ring",
                tcpx::ErrorKind::InvalidArgument(what.into()),
                String::new(),
            ));
        }
        self.stage = Some(Box::new(stage));
        Ok(1)
    }

    /// Runs the core's post actions until it has nothing to post, testing after each post
    /// (after the last one, for small sends: see [`LaneCore::defers_test`]).
    fn pump(&mut self, cx: &Cx<'_>) -> Result<bool, LinkFailed> {
        let mut moved = false;
        // Small sends posted and not tested yet: the test pass runs once the posting stops.
        let mut untested = false;
        while let Some(action) = self.core.poll_post() {
            // The hot action is run here, the rest through `execute`.
            let done = match action {
                Action::Post { place } => self.post(place, cx)?,
                action => self.execute(action, cx)?,
            };
            match done {
                Done::Posted(next) => {
                    moved = true;
                    // The post just filled a window slot: test at once. A request alone in
                    // the window is tested here (`LaneCore::posted`); the rest of the pass
                    // runs only if a request is left.
                    if let Some(action) = next {
                        self.run_test(action, cx)?;
                    } else if self.core.defers_test() {
                        untested = true;
                        continue;
                    }
                    untested = false;
                    if self.core.has_requests() {
                        self.test_requests(cx)?;
                    }
                }
                Done::Busy => {
                    cx.counters.busy();
                    break;
                }
                Done::Retired | Done::Other => {}
            }
        }
        if untested && self.core.has_requests() {
            self.test_requests(cx)?;
        }
        Ok(moved)
    }

    /// Runs the core's test actions until the head is in flight; returns how many requests
    /// were retired.
    #[inline]
    fn test(&mut self, cx: &Cx<'_>) -> Result<u32, LinkFailed> {
        // Most passes of an idle lane end here, without entering the (larger) test loop.
        if !self.core.has_requests() {
            return Ok(0);
        }
        self.test_requests(cx)
    }

    #[inline(never)]
    fn test_requests(&mut self, cx: &Cx<'_>) -> Result<u32, LinkFailed> {
        let mut retired = 0;
        while let Some(action) = self.core.poll_test() {
            retired += u32::from(self.run_test(action, cx)?);
        }
        Ok(retired)
    }

    /// Runs one action of a test pass; returns whether it retired a request.
    // Always inline: once per request, in the post loop (a request that found the window
    // empty) and in the test loop.
    #[inline(always)]
    fn run_test(&mut self, mut action: Action, cx: &Cx<'_>) -> Result<bool, LinkFailed> {
        if let Action::Test = action {
            match self.test_head(cx)? {
                Some(next) => action = next,
                None => return Ok(false),
            }
        }
        // The hot actions (a completion) are run here, the rest through `execute`.
        match action {
            Action::Sent { size } => {
                cx.counters.sent(size as u64);
                self.core.sent();
            }
            Action::Consume { size } => self.consume(size, cx)?,
            action => return Ok(matches!(self.execute(action, cx)?, Done::Retired)),
        }
        Ok(true)
    }

    /// Hands the done receive at the head (`size` bytes) back to the plugin and counts its
    /// bytes.
    // Always inline: once per receive, in the test loop.
    #[inline(always)]
    fn consume(&mut self, size: usize, cx: &Cx<'_>) -> Result<(), LinkFailed> {
        if let Some(job) = self.core.oldest_job() {
            if let Some(parts) = job.host_parts.as_deref() {
                Self::scatter_head(job, parts, self.core.head_index(), cx)?;
            }
        }
        let comm = &mut self.comm;
        // Counted before the core reports the chunk, so a finished transfer's bytes are in
        // the counters.
        let counted = |token| {
            comm.consumed(token)?;
            cx.counters.received(size as u64);
            Ok(())
        };
        match self.core.consume(counted) {
            Ok(()) => Ok(()),
            Err(ConsumeFailed::Plugin(e)) => Err(cx.fail_plugin(C::DIRECTION, e)),
            Err(ConsumeFailed::Fault(what)) => Err(cx.fail_internal(C::DIRECTION, what)),
        }
    }

    /// Copies the done receive at the head, a chunk of a packed host batch (the lane's oldest
    /// transfer), out of the pack buffer into the batch's blocks: before the chunk counts as
    /// completed, so a finished batch has every byte in place.
    #[cold]
    fn scatter_head(
        job: &Job,
        parts: &HostParts,
        head_index: Option<u64>,
        cx: &Cx<'_>,
    ) -> Result<(), LinkFailed> {
        let direction = C::DIRECTION;
        let Some(index) = head_index else {
            return Err(cx.fail_internal(direction, "a packed receive has no head"));
        };
        let Some(chunk) = job.schedule().and_then(|s| s.chunk(index)) else {
            return Err(cx.fail_internal(direction, "a packed receive's chunk is not scheduled"));
        };
        let Some((region, offset)) = locate(job, cx.index, &chunk) else {
            return Err(cx.fail_internal(direction, "registration missing for a chunk"));
        };
        parts
            .copy_chunk(&chunk, region.memory(), offset, false)
            .map_err(|what| cx.fail_internal(direction, what))
    }

    /// Tests the head; returns the action that follows at once, if any.
    // Always inline: once per request, in `run_test`.
    #[inline(always)]
    fn test_head(&mut self, cx: &Cx<'_>) -> Result<Option<Action>, LinkFailed> {
        let direction = C::DIRECTION;
        let comm = &mut self.comm;
        // The plugin's error waits here, out of the core's (hot, small) result.
        let mut failure = None;
        let tested = self.core.test_head(|req| match comm.test(req) {
            Ok(Some(size)) => TestOutcome::Done { size },
            Ok(None) => TestOutcome::Pending,
            Err(e) => {
                failure = Some(e);
                TestOutcome::Failed(())
            }
        });
        match tested {
            Ok(next) => Ok(next),
            Err(TestFailed::Plugin(())) => match failure {
                Some(e) => Err(cx.fail_plugin(direction, e)),
                None => Err(cx.fail_internal(direction, "a failed test lost its error")),
            },
            Err(TestFailed::Size {
                index,
                size,
                posted,
            }) => Err(cx.fail_mismatch(mismatch(direction, index, size, posted))),
        }
    }

    /// Executes one action against the plugin and CUDA and reports back to the core.
    fn execute(&mut self, action: Action, cx: &Cx<'_>) -> Result<Done, LinkFailed> {
        let direction = C::DIRECTION;
        match action {
            // Only the test pass asks for tests, and runs them itself (`Self::test`).
            Action::Test => return Err(cx.fail_internal(direction, "a test outside a test pass")),
            Action::Post { place } => return self.post(place, cx),
            Action::Consume { size } => {
                self.consume(size, cx)?;
                return Ok(Done::Retired);
            }
            Action::Sent { size } => {
                cx.counters.sent(size as u64);
                self.core.sent();
                return Ok(Done::Retired);
            }
            Action::Fill { slot } => self.fill(slot, cx)?,
            Action::PollCopy { slot } => {
                let Some(stage) = self.stage.as_deref_mut() else {
                    return Err(cx.fail_internal(direction, "a staged chunk has no ring"));
                };
                match stage.ring.is_copied(usize::from(slot)) {
                    Ok(done) => self.report(Event::Copied(done), cx)?,
                    Err(e) => return Err(cx.fail_staging(direction, e)),
                }
            }
            Action::Drain { slot, size } => {
                let Some(stage) = self.stage.as_deref_mut() else {
                    return Err(cx.fail_internal(direction, "a staged receive has no ring"));
                };
                if let Err(e) = stage.ring.drain(usize::from(slot), size) {
                    return Err(cx.fail_staging(direction, e));
                }
            }
            Action::QueueUnpack { slot, size } => {
                let Some(unpack) = self.unpack.as_deref_mut() else {
                    return Err(cx.fail_internal(direction, "an unpack receive has no unpack step"));
                };
                if let Err(e) = unpack.queue(usize::from(slot), size) {
                    return Err(cx.fail_staging(direction, e));
                }
            }
            Action::LaunchUnpack => {
                if let Some(unpack) = self.unpack.as_deref_mut() {
                    if let Err(e) = unpack.launch() {
                        return Err(cx.fail_staging(direction, e));
                    }
                }
            }
            Action::PollUnpack => {
                let gathered = match self.unpack.as_deref_mut() {
                    Some(unpack) => unpack.poll_head(),
                    None => Ok(true),
                };
                match gathered {
                    Ok(done) => self.report(Event::Gathered(done), cx)?,
                    Err(e) => return Err(cx.fail_staging(direction, e)),
                }
            }
            Action::OpenRing { slots, slot_bytes } => {
                let Some(staging) = self.core.posting_job().and_then(|j| j.staging.clone()) else {
                    return Err(cx.fail_internal(direction, "a staged chunk has no staging"));
                };
                let comm = &self.comm;
                match LaneStage::new(&staging, slots, slot_bytes, |m| comm.register(m)) {
                    Ok(stage) => {
                        self.stage = Some(Box::new(stage));
                        cx.counters.ring_opened();
                    }
                    Err(e) => return Err(cx.fail_staging(direction, e)),
                }
                self.report(Event::Opened, cx)?;
            }
            Action::OpenUnpack => {
                let device = self.core.posting_job().and_then(|j| j.cuda_dst.clone());
                let (Some(device), Some(comm)) = (device, self.comm.as_recv()) else {
                    return Err(cx.fail_internal(direction, "an unpack receive has no GPU"));
                };
                // Once per lane: binds the GPU's context to this engine thread, loads the
                // kernel, follows the device handle. A failure fails the link (never a silent
                // plain receive that would leave the destination unwritten).
                match LaneUnpack::open(&device, comm) {
                    Ok(unpack) => self.unpack = unpack.map(Box::new),
                    Err(e) => return Err(cx.fail_staging(direction, e)),
                }
                self.report(Event::UnpackProbed(self.unpack.is_some()), cx)?;
            }
        }
        Ok(Done::Other)
    }

    /// Posts the core's chunk from or into `place`.
    // Always inline: once per request, in the post loop.
    #[inline(always)]
    fn post(&mut self, place: Place, cx: &Cx<'_>) -> Result<Done, LinkFailed> {
        let direction = C::DIRECTION;
        let chunk = self.core.chunk();
        let len = chunk.len as usize;
        let posted = match place {
            // Host memory (most chunks): straight from the plugin's answer to the core.
            Place::Direct => {
                let Some(job) = self.core.posting_job() else {
                    return Err(cx.fail_internal(direction, "a chunk has no transfer"));
                };
                let Some((region, offset)) = locate(job, cx.index, chunk) else {
                    return Err(cx.fail_internal(direction, "registration missing for a chunk"));
                };
                // A packed host batch: this chunk's blocks go into the pack buffer now, while
                // the `send` below is about to read them.
                if let (Direction::Send, Some(parts)) = (direction, job.host_parts.as_deref()) {
                    if let Err(what) = parts.copy_chunk(chunk, region.memory(), offset, true) {
                        return Err(cx.fail_internal(direction, what));
                    }
                }
                let posted = self.comm.post(region, offset, len);
                return self.posted(posted, cx);
            }
            Place::Unpack(_) => {
                let Some(job) = self.core.posting_job() else {
                    return Err(cx.fail_internal(direction, "a chunk has no transfer"));
                };
                let Some((region, offset)) = locate(job, cx.index, chunk) else {
                    return Err(cx.fail_internal(direction, "registration missing for a chunk"));
                };
                let unpack = match place {
                    Place::Unpack(slot) => {
                        let Some(unpack) = self.unpack.as_deref_mut() else {
                            return Err(cx.fail_internal(direction, "no unpack step"));
                        };
                        let gpu = job.cuda_dst.as_ref().map(|d| d.ordinal());
                        if gpu != Some(unpack.device.ordinal()) {
                            return Err(
                                cx.fail_internal(direction, "direct CUDA receives on two GPUs")
                            );
                        }
                        Some((unpack, usize::from(slot)))
                    }
                    _ => None,
                };
                let posted = self.comm.post(region, offset, len);
                if let (Ok(Some(request)), Some((unpack, slot))) = (&posted, unpack) {
                    debug_assert_eq!(Some(slot), self.comm.unpack_slot(request));
                    let dst = region.memory().as_ptr() as u64 + offset as u64;
                    unpack.dst[slot] = (dst, len as u64);
                }
                posted
            }
            Place::Ring(slot) => {
                let slot = usize::from(slot);
                let Some(stage) = self.stage.as_deref_mut() else {
                    return Err(cx.fail_internal(direction, "a staged chunk has no ring"));
                };
                // A receive lands in the slot and records where its bytes go; a send's slot
                // was filled ahead (its transfer may be behind us already).
                let target = match direction {
                    Direction::Send => None,
                    Direction::Recv => {
                        let Some(job) = self.core.posting_job() else {
                            return Err(cx.fail_internal(direction, "a chunk has no transfer"));
                        };
                        let gpu = job.staging.as_ref().and_then(|s| s.ordinal());
                        if stage.ring.device().map(|d| d.ordinal()) != gpu {
                            return Err(cx.fail_internal(direction, "staged transfers on two GPUs"));
                        }
                        Some(job.staged_spans(chunk))
                    }
                };
                let offset = stage.ring.slot_offset(slot);
                let posted = self.comm.post(&stage.region, offset, len);
                if let (Ok(Some(_)), Some(spans)) = (&posted, target) {
                    // One piece for an unpacked transfer, the pieces the chunk covers for a
                    // packed one: the drain scatters the slot into them in one copy.
                    match stage.ring.set_scatter_targets(slot, spans) {
                        Ok(n) if n == len => {}
                        // The request drops here; the link fails.
                        Ok(_) => {
                            return Err(cx.fail_internal(
                                direction,
                                "a staged chunk lies outside its segment",
                            ))
                        }
                        Err(e) => return Err(cx.fail_staging(direction, e)),
                    }
                }
                posted
            }
        };
        self.posted(posted, cx)
    }

    /// Reports the plugin's answer to a post to the core.
    // Always inline: once per request, where the plugin answered (each place's post matches
    // its own answer: no copy of the answer into a shared one first).
    #[inline(always)]
    fn posted(
        &mut self,
        posted: tcpx::Result<Option<C::Request>>,
        cx: &Cx<'_>,
    ) -> Result<Done, LinkFailed> {
        match posted {
            Ok(Some(request)) => match self.core.posted(request) {
                Ok(next) => Ok(Done::Posted(next)),
                Err(what) => Err(cx.fail_internal(C::DIRECTION, what)),
            },
            Ok(None) => {
                self.report(Event::Busy, cx)?;
                Ok(Done::Busy)
            }
            Err(e) => Err(cx.fail_plugin(C::DIRECTION, e)),
        }
    }

    /// Starts the copy of the core's (staged send) chunk into ring slot `slot`.
    fn fill(&mut self, slot: u16, cx: &Cx<'_>) -> Result<(), LinkFailed> {
        let direction = C::DIRECTION;
        let chunk = self.core.chunk();
        let Some(job) = self.core.posting_job() else {
            return Err(cx.fail_internal(direction, "a chunk has no transfer"));
        };
        let Some(stage) = self.stage.as_deref_mut() else {
            return Err(cx.fail_internal(direction, "a staged chunk has no ring"));
        };
        let gpu = job.staging.as_ref().and_then(|s| s.ordinal());
        if stage.ring.device().map(|d| d.ordinal()) != gpu {
            return Err(cx.fail_internal(direction, "staged transfers on two GPUs"));
        }
        // One copy for an unpacked transfer's chunk; one gather launch for the pieces a packed
        // transfer's chunk covers.
        match stage
            .ring
            .gather(usize::from(slot), job.staged_spans(chunk))
        {
            Ok(n) if n == chunk.len as usize => Ok(()),
            Ok(_) => Err(cx.fail_internal(direction, "a staged chunk lies outside its segment")),
            Err(e) => Err(cx.fail_staging(direction, e)),
        }
    }

    fn report(&mut self, event: Event, cx: &Cx<'_>) -> Result<(), LinkFailed> {
        self.core
            .handle(event)
            .map_err(|what| cx.fail_internal(C::DIRECTION, what))
    }

    /// Waits for the lane's copies and gathers, then fails what the core holds.
    fn abandon(&mut self) {
        // Copies into or out of the ring and gathers finish first: they touch memory that the
        // transfers dropped below may be the last to hold.
        if let Some(stage) = self.stage.as_deref_mut() {
            stage.abandon();
        }
        if let Some(unpack) = self.unpack.as_deref_mut() {
            unpack.abandon();
        }
        self.core.abandon();
    }
}

impl Cx<'_> {
    fn fail_plugin(&self, direction: Direction, source: tcpx::Error) -> LinkFailed {
        self.link.fail(Error::Plugin {
            channel: self.index,
            direction,
            peer: self.link.peer,
            source: Arc::new(source),
        });
        LinkFailed
    }

    /// A copy through the ring or a gather of the unpack step failed (a fragment count over
    /// the limit, an out-of-range fragment, a CUDA error): the error names the channel and
    /// the peer.
    fn fail_staging(&self, direction: Direction, source: tcpx::Error) -> LinkFailed {
        self.link.fail(Error::Staging {
            channel: self.index,
            direction,
            peer: self.link.peer,
            source: Arc::new(source),
        });
        LinkFailed
    }

    fn fail_mismatch(&self, what: String) -> LinkFailed {
        self.link.fail(Error::Mismatch {
            channel: self.index,
            peer: self.link.peer,
            what,
        });
        LinkFailed
    }

    fn fail_internal(&self, direction: Direction, what: &str) -> LinkFailed {
        self.link.fail(Error::Internal(format!(
            "channel {} ({direction}) to peer {}: {what}",
            self.index, self.link.peer
        )));
        LinkFailed
    }
}

/// What a size mismatch reported by `test` says.
#[cold]
fn mismatch(direction: Direction, index: u64, size: usize, posted: u32) -> String {
    match direction {
        Direction::Send => {
            format!("send chunk {index} completed with {size} bytes, {posted} were posted")
        }
        Direction::Recv => format!(
            "received {size} bytes in chunk {index} where {posted} were expected \
             (the sender's transfer has a different length or layout)"
        ),
    }
}

/// The registered region and offset holding `chunk` on `channel`.
fn locate<'j>(job: &'j Job, channel: u16, chunk: &Chunk) -> Option<(&'j MemoryRegion, usize)> {
    let piece = job.pieces.get(chunk.segment)?;
    let region = &piece
        .registration
        .as_ref()?
        .by_channel
        .get(usize::from(channel))?
        .region;
    let offset = piece
        .offset
        .checked_add(usize::try_from(chunk.segment_offset).ok()?)?;
    Some((region, offset))
}
