//! One channel inside its engine: a send lane and a receive lane, each a comm, its request
//! window and the queue of transfers with chunks still to post on it.
//!
//! The three rules whose violation stalled earlier attempts are structural here:
//! - a lane tests its head after every post and on every pass, never only when its window is
//!   full (the engine calls [`Channel::test`] each pass whatever the window holds);
//! - the only request a lane can test is the window's head ([`SendWindow::test_head`]);
//! - a receive is consumed only through [`RecvWindow::consume_head`], which refuses before
//!   `test` said done, and it is consumed right after (host memory needs no unpack), so no
//!   done receive keeps its slot.
//!
//! Staged transfers (CUDA memory on a host-only plugin, [`super::stage`]) take a second
//! route through the same lanes, chosen per transfer (the job's `staging`): the lane copies
//! into or out of its pinned ring around the plugin calls, and a staged receive is consumed
//! only after its copy to the GPU completed. Host transfers pay one branch per post for each route.
//!
//! Direct receives into CUDA memory on a plugin whose comm hands out an UNPACK device handle
//! (TCPX; tcpx-socket in devmem mode) take a third route ([`super::unpack`]): the plugin
//! leaves the payload in its bounce buffer, so a done receive stays in the window until the
//! lane's gather kernel has copied it into the destination, and is consumed then, FIFO. The
//! route is chosen per transfer (the job's `cuda_dst`), then per segment (CUDA or host).
//!
//! Nothing here allocates, locks or touches a shared atomic per chunk: windows and queues are
//! preallocated, the chunk is computed from the schedule, and a lane counts its own chunks of
//! each transfer, reporting them to the transfer once, when its last one on this lane
//! completes (completions are FIFO per comm, so the oldest transfer is always the one a
//! completion belongs to).

use std::collections::VecDeque;
use std::sync::Arc;

use tcpx::{MemoryRegion, RecvComm, RecvRequest, SendComm, SendRequest};

use crate::engine::job::Job;
use crate::engine::stage::{Ahead, LaneStage};
use crate::engine::stats::ChannelCounters;
use crate::engine::unpack::{LaneUnpack, UNPACK_FLAG};
use crate::error::{Direction, Error};
use crate::link::Link;
use crate::schedule::Chunk;
use crate::window::{RecvWindow, Release, SendWindow, TestOutcome};

/// Transfers queued per lane before the queue grows (it grows only if the application
/// submits more than this many transfers ahead of the network).
const QUEUE_CAPACITY: usize = 256;

/// What a window slot remembers about its request (its transfer is the lane's oldest).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tag {
    /// Bytes posted.
    len: u32,
    /// Chunk index in the transfer's schedule (for error messages).
    index: u64,
    /// The ring slot of a staged chunk, `UNPACK_FLAG | slot` for a receive gathered from the
    /// plugin's bounce buffer (its unpack slot), [`NO_SLOT`] for a direct one.
    slot: u16,
}

/// [`Tag::slot`] of a chunk posted from or into the application's own memory.
const NO_SLOT: u16 = u16::MAX;

/// What one post attempt did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Post {
    /// A request went out.
    Posted,
    /// Nothing to post: no transfer, or the front one waits for the peer's segment list.
    Idle,
    /// The window is full.
    Full,
    /// The plugin answered busy.
    Busy,
}

/// The link failed on this channel; the lane already failed the link and the transfers it
/// held. The engine must abandon the link's other channels.
#[derive(Debug)]
pub(crate) struct LinkFailed;

/// A channel as its engine owns it.
pub(crate) struct Channel {
    pub(crate) link: Arc<Link>,
    pub(crate) index: u16,
    counters: Arc<ChannelCounters>,
    send: Lane<SendComm, SendWindow<SendRequest, Tag>>,
    recv: Lane<RecvComm, RecvWindow<RecvRequest, Tag>>,
    /// Completed requests at the last health check, and when that count last changed
    /// (progress detection once the peer has left).
    pub(crate) completed_at_check: u64,
    pub(crate) progress_at: std::time::Instant,
}

struct Lane<C, W> {
    comm: C,
    window: W,
    track: Track,
    /// The pinned ring of staged transfers, made when the first one reaches the lane.
    stage: Option<Box<LaneStage>>,
    /// Receive lane: the unpack step, set up when the first direct receive into CUDA memory
    /// reaches the lane (`None` before, and for good on a comm without an UNPACK handle).
    unpack: Option<Box<LaneUnpack>>,
    /// Receive lane: whether the comm's device handle was looked at (once).
    unpack_probed: bool,
    /// Receive lane: irecvs posted on the comm so far, on every route: the plugin's unpack
    /// slot of the k-th is `k mod 16`.
    irecvs: u64,
}

/// The transfers a lane carries, oldest first: first those with chunks in flight (or with
/// no chunk here, waiting for older ones to finish), then the one being posted, then those
/// queued behind it.
struct Track {
    jobs: VecDeque<LaneJob>,
    /// Index in `jobs` of the transfer being posted.
    posting: usize,
    /// Next chunk index of that transfer; `None` before its first (its schedule may not be
    /// known yet).
    next: Option<u64>,
}

struct LaneJob {
    job: Arc<Job>,
    /// Chunks of the transfer on this lane (known once posting starts).
    here: u64,
    /// Of those, not yet completed.
    left: u64,
}

impl Track {
    fn new() -> Self {
        Self {
            jobs: VecDeque::with_capacity(QUEUE_CAPACITY),
            posting: 0,
            next: None,
        }
    }

    fn push(&mut self, job: Arc<Job>) {
        self.jobs.push_back(LaneJob {
            job,
            here: 0,
            left: u64::MAX,
        });
    }

    fn is_empty(&self) -> bool {
        self.jobs.is_empty()
    }

    fn oldest(&self) -> Option<&Arc<Job>> {
        self.jobs.front().map(|j| &j.job)
    }

    /// The next chunk to post on `channel`, or `None` when nothing is ready: no transfer, or
    /// the one being posted waits for its schedule (later ones wait too: posting order must
    /// follow submission order).
    fn next_chunk(&mut self, channel: u16) -> Option<(&Job, Chunk)> {
        loop {
            let lane_job = self.jobs.get_mut(self.posting)?;
            let schedule = lane_job.job.schedule()?;
            let index = match self.next {
                Some(index) => index,
                None => {
                    lane_job.here = schedule.chunk_count_on(channel);
                    lane_job.left = lane_job.here;
                    *self.next.insert(schedule.first_index_on(channel))
                }
            };
            if let Some(chunk) = schedule.chunk(index) {
                return Some((&self.jobs[self.posting].job, chunk));
            }
            // Every chunk of this transfer on this lane is posted: on to the next one.
            self.posting += 1;
            self.next = None;
            self.retire();
        }
    }

    /// The chunk just returned by `next_chunk` was posted.
    #[inline]
    fn posted(&mut self, chunk: &Chunk, channels: u16) {
        self.next = Some(chunk.index + u64::from(channels));
    }

    /// The oldest request completed: it belongs to the oldest transfer.
    #[inline]
    fn completed(&mut self) {
        if let Some(front) = self.jobs.front_mut() {
            front.left = front.left.saturating_sub(1);
            if front.left == 0 {
                self.retire();
            }
        }
    }

    /// Reports and drops fully posted transfers with nothing left in flight, oldest first.
    fn retire(&mut self) {
        while self.posting > 0 {
            match self.jobs.front() {
                Some(front) if front.left == 0 => {}
                _ => return,
            }
            if let Some(done) = self.jobs.pop_front() {
                self.posting -= 1;
                done.job.chunks_done(done.here);
            }
        }
    }

    /// Fails every transfer it holds with the link's error and starts over.
    fn abandon(&mut self) {
        for lane_job in self.jobs.drain(..) {
            lane_job.job.fail_with_link();
        }
        self.posting = 0;
        self.next = None;
    }
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
        Ok(Self {
            counters,
            send: Lane {
                comm: send,
                window: SendWindow::new(window).map_err(bad_window)?,
                track: Track::new(),
                stage: None,
                unpack: None,
                unpack_probed: false,
                irecvs: 0,
            },
            recv: Lane {
                comm: recv,
                window: RecvWindow::new(window).map_err(bad_window)?,
                track: Track::new(),
                stage: None,
                unpack: None,
                unpack_probed: false,
                irecvs: 0,
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
            Direction::Send => self.send.track.push(job),
            Direction::Recv => self.recv.track.push(job),
        }
    }

    /// Registers `memory` on this channel's comm of `direction`.
    pub(crate) fn register(
        &self,
        direction: Direction,
        memory: &tcpx::SharedMemory,
    ) -> tcpx::Result<MemoryRegion> {
        match direction {
            Direction::Send => self.send.comm.register(memory),
            Direction::Recv => self.recv.comm.register(memory),
        }
    }

    /// Requests in flight on either lane.
    pub(crate) fn in_flight(&self) -> bool {
        !self.send.window.is_empty() || !self.recv.window.is_empty()
    }

    /// Anything in flight or queued.
    pub(crate) fn has_work(&self) -> bool {
        self.in_flight() || !self.send.track.is_empty() || !self.recv.track.is_empty()
    }

    pub(crate) fn counters(&self) -> &ChannelCounters {
        &self.counters
    }

    /// Posts on the send lane until the window is full or there is nothing to post, testing
    /// the head after every post. Returns whether anything moved.
    pub(crate) fn pump_send(&mut self) -> Result<bool, LinkFailed> {
        let mut moved = false;
        loop {
            match self.post_send()? {
                Post::Posted => {
                    moved = true;
                    self.test_send()?;
                }
                Post::Idle | Post::Full => return Ok(moved),
                Post::Busy => {
                    self.counters.busy();
                    return Ok(moved);
                }
            }
        }
    }

    /// As [`Self::pump_send`], for the receive lane.
    pub(crate) fn pump_recv(&mut self) -> Result<bool, LinkFailed> {
        let mut moved = false;
        loop {
            match self.post_recv()? {
                Post::Posted => {
                    moved = true;
                    self.test_recv()?;
                }
                Post::Idle | Post::Full => return Ok(moved),
                Post::Busy => {
                    self.counters.busy();
                    return Ok(moved);
                }
            }
        }
    }

    /// Tests both heads, retiring every request that is done. Returns whether any was.
    pub(crate) fn test(&mut self) -> Result<bool, LinkFailed> {
        let sent = self.test_send()?;
        let received = self.test_recv()?;
        Ok(sent + received > 0)
    }

    fn post_send(&mut self) -> Result<Post, LinkFailed> {
        // Staged chunks already copied ahead go out before anything behind them.
        if self
            .send
            .stage
            .as_ref()
            .is_some_and(|s| !s.ahead.is_empty())
        {
            return self.post_send_staged();
        }
        let channels = self.link.channels;
        let index = self.index;
        let lane = &mut self.send;
        if lane.window.is_full() {
            return Ok(Post::Full);
        }
        let Some((job, chunk)) = lane.track.next_chunk(index) else {
            return Ok(Post::Idle);
        };
        if job.staging.is_some() {
            return self.post_send_staged();
        }
        let Some((region, offset)) = locate(job, index, &chunk) else {
            return Err(self.fail_internal("send", "registration missing for a chunk"));
        };
        match lane.comm.isend(region, offset, chunk.len as usize, 0) {
            Ok(Some(request)) => {
                lane.track.posted(&chunk, channels);
                let tag = Tag {
                    len: chunk.len,
                    index: chunk.index,
                    slot: NO_SLOT,
                };
                if lane.window.try_post(request, tag).is_err() {
                    return Err(self.fail_internal("send", "window refused a post"));
                }
                Ok(Post::Posted)
            }
            Ok(None) => Ok(Post::Busy),
            Err(e) => Err(self.fail_plugin(Direction::Send, e)),
        }
    }

    /// Staged send: queues device → ring copies for the next staged chunks while the ring has
    /// room, then posts the oldest copied chunk from its slot once its copy is seen done.
    // Out of line: keeps the host path's post loop as small as it was.
    #[inline(never)]
    fn post_send_staged(&mut self) -> Result<Post, LinkFailed> {
        self.fill_send_ring()?;
        let lane = &mut self.send;
        let Some(stage) = lane.stage.as_deref_mut() else {
            return Ok(Post::Idle);
        };
        let Some(front) = stage.ahead.front().copied() else {
            return Ok(Post::Idle);
        };
        if lane.window.is_full() {
            return Ok(Post::Full);
        }
        match stage.ring.is_copied(usize::from(front.slot)) {
            Ok(true) => {}
            // The copy is still running: nothing to post yet (polled again next pass).
            Ok(false) => return Ok(Post::Idle),
            Err(e) => return Err(self.fail_staging(Direction::Send, e)),
        }
        let offset = stage.ring.slot_offset(usize::from(front.slot));
        match lane
            .comm
            .isend(&stage.region, offset, front.len as usize, 0)
        {
            Ok(Some(request)) => {
                stage.ahead.pop_front();
                let tag = Tag {
                    len: front.len,
                    index: front.index,
                    slot: front.slot,
                };
                if lane.window.try_post(request, tag).is_err() {
                    return Err(self.fail_internal("send", "window refused a post"));
                }
                Ok(Post::Posted)
            }
            Ok(None) => Ok(Post::Busy),
            Err(e) => Err(self.fail_plugin(Direction::Send, e)),
        }
    }

    /// Queues a device → slot copy for each next chunk of a staged transfer while the send
    /// ring has a free slot (making the ring on first use). Stops at a direct transfer: it
    /// posts once the staged chunks before it are out.
    // Out of line: keeps the host path's post loop as small as it was.
    #[inline(never)]
    fn fill_send_ring(&mut self) -> Result<(), LinkFailed> {
        let channels = self.link.channels;
        let index = self.index;
        let window = self.send.window.capacity();
        loop {
            let lane = &mut self.send;
            if lane.stage.as_ref().is_some_and(|s| !s.slots.has_room()) {
                return Ok(());
            }
            let Some((job, chunk)) = lane.track.next_chunk(index) else {
                return Ok(());
            };
            let Some(device) = job.staging.as_ref() else {
                return Ok(());
            };
            let Some(piece) = job.pieces.get(chunk.segment) else {
                return Err(self.fail_internal("send", "a staged chunk has no segment"));
            };
            let Some(offset) = usize::try_from(chunk.segment_offset)
                .ok()
                .and_then(|o| piece.offset.checked_add(o))
            else {
                return Err(self.fail_internal("send", "a staged chunk lies outside its segment"));
            };
            if lane.stage.is_none() {
                let slot_bytes = job.schedule().map_or(chunk.len, |s| s.chunk_bytes()) as usize;
                let comm = &lane.comm;
                // Twice the window: a window's worth of sends in flight and as many copies
                // running ahead of them.
                match LaneStage::new(device, 2 * window, slot_bytes, |m| comm.register(m)) {
                    Ok(stage) => lane.stage = Some(Box::new(stage)),
                    Err(e) => return Err(self.fail_staging(Direction::Send, e)),
                }
            }
            let Some(stage) = lane.stage.as_deref_mut() else {
                return Ok(());
            };
            if stage.ring.device().map(|d| d.ordinal()) != device.ordinal() {
                return Err(self.fail_internal("send", "staged transfers on two GPUs"));
            }
            let Some(slot) = stage.slots.take() else {
                return Ok(());
            };
            if let Err(e) = stage
                .ring
                .fill(slot, &piece.memory, offset, chunk.len as usize)
            {
                return Err(self.fail_staging(Direction::Send, e));
            }
            stage.ahead.push_back(Ahead {
                // Slots < 2 × window ≤ 32.
                slot: slot as u16,
                len: chunk.len,
                index: chunk.index,
            });
            lane.track.posted(&chunk, channels);
        }
    }

    fn post_recv(&mut self) -> Result<Post, LinkFailed> {
        let channels = self.link.channels;
        let index = self.index;
        let lane = &mut self.recv;
        if lane.window.is_full() {
            return Ok(Post::Full);
        }
        let Some((job, chunk)) = lane.track.next_chunk(index) else {
            return Ok(Post::Idle);
        };
        if job.staging.is_some() {
            return self.post_recv_staged();
        }
        if job.cuda_dst.is_some() {
            return self.post_recv_unpack();
        }
        let Some((region, offset)) = locate(job, index, &chunk) else {
            return Err(self.fail_internal("recv", "registration missing for a chunk"));
        };
        match lane.comm.irecv(region, offset, chunk.len as usize, 0) {
            Ok(Some(request)) => {
                lane.irecvs += 1;
                lane.track.posted(&chunk, channels);
                let tag = Tag {
                    len: chunk.len,
                    index: chunk.index,
                    slot: NO_SLOT,
                };
                if lane.window.try_post(request, tag).is_err() {
                    return Err(self.fail_internal("recv", "window refused a post"));
                }
                Ok(Post::Posted)
            }
            Ok(None) => Ok(Post::Busy),
            Err(e) => Err(self.fail_plugin(Direction::Recv, e)),
        }
    }

    /// Staged receive: posts the next chunk into the next ring slot (one slot per window
    /// slot, making the ring on first use) and records where its bytes go.
    // Out of line: keeps the host path's post loop as small as it was.
    #[inline(never)]
    fn post_recv_staged(&mut self) -> Result<Post, LinkFailed> {
        let channels = self.link.channels;
        let index = self.index;
        let window = self.recv.window.capacity();
        let lane = &mut self.recv;
        let Some((job, chunk)) = lane.track.next_chunk(index) else {
            return Ok(Post::Idle);
        };
        let Some(device) = job.staging.as_ref() else {
            return Ok(Post::Idle);
        };
        let Some(piece) = job.pieces.get(chunk.segment) else {
            return Err(self.fail_internal("recv", "a staged chunk has no segment"));
        };
        let Some(offset) = usize::try_from(chunk.segment_offset)
            .ok()
            .and_then(|o| piece.offset.checked_add(o))
        else {
            return Err(self.fail_internal("recv", "a staged chunk lies outside its segment"));
        };
        if lane.stage.is_none() {
            let slot_bytes = job.schedule().map_or(chunk.len, |s| s.chunk_bytes()) as usize;
            let comm = &lane.comm;
            match LaneStage::new(device, window, slot_bytes, |m| comm.register(m)) {
                Ok(stage) => lane.stage = Some(Box::new(stage)),
                Err(e) => return Err(self.fail_staging(Direction::Recv, e)),
            }
        }
        let Some(stage) = lane.stage.as_deref_mut() else {
            return Ok(Post::Idle);
        };
        if stage.ring.device().map(|d| d.ordinal()) != device.ordinal() {
            return Err(self.fail_internal("recv", "staged transfers on two GPUs"));
        }
        // Slots in use never exceed the window's requests, so a window with room has a free
        // slot; refusing here would only mean a bookkeeping bug, kept harmless.
        if !stage.slots.has_room() {
            return Ok(Post::Full);
        }
        let slot = stage.slots.peek();
        let ring_offset = stage.ring.slot_offset(slot);
        match lane
            .comm
            .irecv(&stage.region, ring_offset, chunk.len as usize, 0)
        {
            Ok(Some(request)) => {
                lane.irecvs += 1;
                stage.slots.take();
                if let Err(e) = stage
                    .ring
                    .expect(slot, &piece.memory, offset, chunk.len as usize)
                {
                    drop(request);
                    return Err(self.fail_staging(Direction::Recv, e));
                }
                lane.track.posted(&chunk, channels);
                let tag = Tag {
                    len: chunk.len,
                    index: chunk.index,
                    // Slots < window ≤ 16.
                    slot: slot as u16,
                };
                if lane.window.try_post(request, tag).is_err() {
                    return Err(self.fail_internal("recv", "window refused a post"));
                }
                Ok(Post::Posted)
            }
            Ok(None) => Ok(Post::Busy),
            Err(e) => Err(self.fail_plugin(Direction::Recv, e)),
        }
    }

    /// Direct receive of a transfer with CUDA segments: sets up the lane's unpack step at the
    /// first one, then posts the chunk into its destination. A chunk into CUDA memory on a comm
    /// with an UNPACK handle records its unpack slot and destination (gathered once done);
    /// anything else (a host segment, or a comm whose plugin writes CUDA memory itself) is a
    /// plain direct receive.
    // Out of line: keeps the host path's post loop as small as it was.
    #[inline(never)]
    fn post_recv_unpack(&mut self) -> Result<Post, LinkFailed> {
        let channels = self.link.channels;
        let index = self.index;
        let lane = &mut self.recv;
        let Some((job, chunk)) = lane.track.next_chunk(index) else {
            return Ok(Post::Idle);
        };
        let Some(device) = job.cuda_dst.as_ref() else {
            return Ok(Post::Idle);
        };
        let Some((region, offset)) = locate(job, index, &chunk) else {
            return Err(self.fail_internal("recv", "registration missing for a chunk"));
        };
        let cuda = region.memory().kind() == tcpx::MemoryKind::Cuda;
        if cuda && !lane.unpack_probed {
            // Once per lane: binds the GPU's context to this engine thread, loads the kernel,
            // follows the device handle. A failure fails the link (never a silent plain
            // receive that would leave the destination unwritten).
            match LaneUnpack::open(device, &lane.comm) {
                Ok(unpack) => {
                    lane.unpack = unpack.map(Box::new);
                    lane.unpack_probed = true;
                }
                Err(e) => return Err(self.fail_staging(Direction::Recv, e)),
            }
        }
        let unpack = match lane.unpack.as_deref_mut() {
            Some(unpack) if cuda => Some(unpack),
            _ => None,
        };
        if let Some(unpack) = unpack.as_ref() {
            if unpack.device.ordinal() != device.ordinal() {
                return Err(self.fail_internal("recv", "direct CUDA receives on two GPUs"));
            }
        }
        match lane.comm.irecv(region, offset, chunk.len as usize, 0) {
            Ok(Some(request)) => {
                // TCPX's rule: the k-th irecv of a comm (counting from 0) uses slot k mod 16.
                let unpack_slot = (lane.irecvs % tcpx::cuda::unpack::SLOTS as u64) as usize;
                debug_assert_eq!(unpack_slot, lane.comm.unpack_slot(&request));
                lane.irecvs += 1;
                let slot = match unpack {
                    Some(unpack) => {
                        let dst = region.memory().as_ptr() as u64 + offset as u64;
                        unpack.dst[unpack_slot] = (dst, u64::from(chunk.len));
                        // Slots < 16: the flag keeps them apart from ring slots and NO_SLOT.
                        UNPACK_FLAG | unpack_slot as u16
                    }
                    None => NO_SLOT,
                };
                lane.track.posted(&chunk, channels);
                let tag = Tag {
                    len: chunk.len,
                    index: chunk.index,
                    slot,
                };
                if lane.window.try_post(request, tag).is_err() {
                    return Err(self.fail_internal("recv", "window refused a post"));
                }
                Ok(Post::Posted)
            }
            Ok(None) => Ok(Post::Busy),
            Err(e) => Err(self.fail_plugin(Direction::Recv, e)),
        }
    }

    /// Retires done sends from the head; returns how many.
    fn test_send(&mut self) -> Result<u32, LinkFailed> {
        let mut retired = 0;
        loop {
            let comm = &mut self.send.comm;
            match self.send.window.test_head(|req| outcome(comm.test(req))) {
                None | Some(Release::NotReady) => return Ok(retired),
                Some(Release::Released(done)) => {
                    if done.size != done.data.len as usize {
                        let what = format!(
                            "send chunk {} completed with {} bytes, {} were posted",
                            done.data.index, done.size, done.data.len
                        );
                        return Err(self.fail_mismatch(what));
                    }
                    if done.data.slot != NO_SLOT {
                        if let Some(stage) = self.send.stage.as_deref_mut() {
                            stage.slots.release();
                        }
                    }
                    self.counters.sent(done.size as u64);
                    self.send.track.completed();
                    retired += 1;
                }
                // The requests it took down drop here; the engine then abandons the link,
                // failing every transfer its lanes hold.
                Some(Release::Error(failure)) => {
                    return Err(self.fail_plugin(Direction::Send, failure.error));
                }
            }
        }
    }

    /// Retires done receives from the head, consuming each as soon as its data is in place
    /// (host memory: at once; staged: once its copy to the GPU completed); returns how many.
    fn test_recv(&mut self) -> Result<u32, LinkFailed> {
        let mut retired = 0;
        // Staged receives whose copies were queued on an earlier pass may be ready now (host
        // lanes never have a stage and skip this).
        if self.recv.stage.is_some() || self.recv.unpack.is_some() {
            retired += self.consume_recv()?;
        }
        loop {
            let comm = &mut self.recv.comm;
            let (size, expected, index, slot) =
                match self.recv.window.test_head(|req| outcome(comm.test(req))) {
                    None | Some(Release::NotReady) => {
                        // The done receives this pass found go out in one launch.
                        if self
                            .recv
                            .unpack
                            .as_ref()
                            .is_some_and(|u| !u.batch.is_empty())
                        {
                            self.launch_unpack()?;
                        }
                        return Ok(retired);
                    }
                    Some(Release::Released(received)) => (
                        received.size,
                        received.data.len,
                        received.data.index,
                        received.data.slot,
                    ),
                    Some(Release::Error(failure)) => {
                        return Err(self.fail_plugin(Direction::Recv, failure.error));
                    }
                };
            if size != expected as usize {
                let what = format!(
                    "received {size} bytes in chunk {index} where {expected} were expected \
                     (the sender's transfer has a different length or layout)"
                );
                return Err(self.fail_mismatch(what));
            }
            if slot != NO_SLOT {
                if slot & UNPACK_FLAG != 0 {
                    self.queue_unpack(slot & !UNPACK_FLAG, size)?;
                } else {
                    self.drain_staged(slot, size)?;
                }
            }
            if slot == NO_SLOT && self.recv.window.awaiting_consume() == 1 {
                // Host memory, nothing ahead of it (done receives are the window's prefix):
                // the data is in place once done, so hand the slot back at once.
                let Ok(done) = self.recv.window.consume_head() else {
                    return Err(self.fail_internal("recv", "a done receive was not consumable"));
                };
                if let Err(e) = self.recv.comm.consumed(done.token) {
                    return Err(self.fail_plugin(Direction::Recv, e));
                }
                self.counters.received(size as u64);
                self.recv.track.completed();
                retired += 1;
            } else {
                // Behind staged receives still copying, or staged itself: in order, as their
                // copies complete.
                retired += self.consume_recv()?;
            }
        }
    }

    /// Staged receive done: the bytes are in ring slot `slot`; queue their copy to the GPU.
    /// The receive keeps its window slot (and ring slot) until the copy is seen done.
    #[inline(never)]
    fn drain_staged(&mut self, slot: u16, size: usize) -> Result<(), LinkFailed> {
        let drained = match self.recv.stage.as_deref_mut() {
            Some(stage) => stage.ring.drain(usize::from(slot), size),
            None => return Err(self.fail_internal("recv", "a staged receive has no ring")),
        };
        drained.map_err(|e| self.fail_staging(Direction::Recv, e))
    }

    /// Unpack receive done: reads its fragment count and adds its gather to the lane's batch
    /// (launched when the test pass ends). The receive keeps its window slot (and its
    /// fragments and bounce pages) until the gather is seen done.
    #[inline(never)]
    fn queue_unpack(&mut self, slot: u16, size: usize) -> Result<(), LinkFailed> {
        let Some(unpack) = self.recv.unpack.as_deref_mut() else {
            return Err(self.fail_internal("recv", "an unpack receive has no unpack step"));
        };
        let slot = usize::from(slot);
        // SAFETY: the queue was read from this lane's comm, which is open (the lane owns it).
        let count = match unsafe { unpack.queue.slot_count(slot) } {
            Ok(count) => count,
            Err(e) => return Err(self.fail_unpack(e)),
        };
        let (dst, posted) = unpack.dst[slot];
        // The plugin reported `size` ≤ posted bytes; the kernel checks every fragment against
        // the posted length and skips (and reports) any that would write past it.
        debug_assert!(size as u64 <= posted);
        let entry = unpack.queue.entry(slot, count, dst, posted);
        unpack.batch.push(entry);
        Ok(())
    }

    /// Launches the batch of done unpack receives (one launch, one event).
    #[inline(never)]
    fn launch_unpack(&mut self) -> Result<(), LinkFailed> {
        let launched = match self.recv.unpack.as_deref_mut() {
            Some(unpack) => unpack.launch(),
            None => return Ok(()),
        };
        launched.map_err(|e| self.fail_unpack(e))
    }

    /// Consumes done receives from the head, in order, while their data is in place.
    #[inline(never)]
    fn consume_recv(&mut self) -> Result<u32, LinkFailed> {
        let mut consumed = 0;
        loop {
            let (size, slot) = match self.recv.window.consumable() {
                Some(received) => (received.size, received.data.slot),
                None => return Ok(consumed),
            };
            if slot != NO_SLOT && slot & UNPACK_FLAG != 0 {
                let gathered = match self.recv.unpack.as_deref_mut() {
                    Some(unpack) => unpack.head_ready(),
                    None => Ok(true),
                };
                match gathered {
                    Ok(true) => {}
                    Ok(false) => return Ok(consumed),
                    Err(e) => return Err(self.fail_unpack(e)),
                }
            } else if slot != NO_SLOT {
                let copied = match self.recv.stage.as_deref_mut() {
                    Some(stage) => stage.ring.is_copied(usize::from(slot)),
                    None => Ok(true),
                };
                match copied {
                    Ok(true) => {}
                    Ok(false) => return Ok(consumed),
                    Err(e) => return Err(self.fail_staging(Direction::Recv, e)),
                }
            }
            let Ok(done) = self.recv.window.consume_head() else {
                return Err(self.fail_internal("recv", "a done receive was not consumable"));
            };
            if let Err(e) = self.recv.comm.consumed(done.token) {
                return Err(self.fail_plugin(Direction::Recv, e));
            }
            if slot != NO_SLOT && slot & UNPACK_FLAG != 0 {
                if let Some(unpack) = self.recv.unpack.as_deref_mut() {
                    unpack.ready = unpack.ready.saturating_sub(1);
                }
            } else if slot != NO_SLOT {
                if let Some(stage) = self.recv.stage.as_deref_mut() {
                    stage.slots.release();
                }
            }
            self.counters.received(size as u64);
            self.recv.track.completed();
            consumed += 1;
        }
    }

    /// The oldest transfer each lane still holds, for the timeout check.
    pub(crate) fn oldest_jobs(&self) -> [Option<&Arc<Job>>; 2] {
        [self.send.track.oldest(), self.recv.track.oldest()]
    }

    /// Drops every request and transfer, failing the transfers with the link's error.
    /// Requests still pending are dropped without being tested: the safe layer keeps their
    /// memory until the comm closes and refuses further use of the comm.
    pub(crate) fn abandon(&mut self) {
        // Copies into or out of the rings finish first: they touch memory that the
        // transfers dropped below may be the last to hold.
        for stage in [
            self.send.stage.as_deref_mut(),
            self.recv.stage.as_deref_mut(),
        ]
        .into_iter()
        .flatten()
        {
            stage.abandon();
        }
        if let Some(unpack) = self.recv.unpack.as_deref_mut() {
            unpack.abandon();
        }
        drop(self.send.window.abandon());
        drop(self.recv.window.abandon());
        self.send.track.abandon();
        self.recv.track.abandon();
    }

    fn fail_plugin(&mut self, direction: Direction, source: tcpx::Error) -> LinkFailed {
        self.link.fail(Error::Plugin {
            channel: self.index,
            direction,
            peer: self.link.peer,
            source: Arc::new(source),
        });
        LinkFailed
    }

    fn fail_staging(&mut self, direction: Direction, source: tcpx::Error) -> LinkFailed {
        self.link.fail(Error::Staging {
            channel: self.index,
            direction,
            peer: self.link.peer,
            source: Arc::new(source),
        });
        LinkFailed
    }

    /// The unpack step failed (a fragment count over the limit, an out-of-range fragment, a
    /// CUDA error of the gather): the error names the channel and the peer.
    fn fail_unpack(&mut self, source: tcpx::Error) -> LinkFailed {
        self.fail_staging(Direction::Recv, source)
    }

    fn fail_mismatch(&mut self, what: String) -> LinkFailed {
        self.link.fail(Error::Mismatch {
            channel: self.index,
            peer: self.link.peer,
            what,
        });
        LinkFailed
    }

    fn fail_internal(&mut self, lane: &str, what: &str) -> LinkFailed {
        self.link.fail(Error::Internal(format!(
            "channel {} ({lane}) to peer {}: {what}",
            self.index, self.link.peer
        )));
        LinkFailed
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

fn outcome(result: tcpx::Result<Option<usize>>) -> TestOutcome<tcpx::Error> {
    match result {
        Ok(Some(size)) => TestOutcome::Done { size },
        Ok(None) => TestOutcome::Pending,
        Err(e) => TestOutcome::Failed(e),
    }
}
