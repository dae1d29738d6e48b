//! The lane core: one lane's decisions, without I/O (sans-IO, in the manner of quinn-proto's
//! `Connection`).
//!
//! A [`LaneCore`] owns what one lane (one comm, one direction) knows: its request window, the
//! transfers it carries ([`Track`]), and, where present, the slot accounting of its staging
//! ring and of its unpack step. It performs no plugin call, no CUDA call and no clock read.
//! The engine thread drives it:
//!
//! - [`LaneCore::poll_post`] returns the next thing to do to get a chunk out (make the ring,
//!   look for an UNPACK handle, start a device → slot copy, ask whether a copy finished, post a
//!   chunk), or `None` when the window is full or nothing is ready;
//! - [`LaneCore::poll_test`] returns the next thing to do to retire requests (test the head,
//!   start a slot → device copy, queue or launch gathers, ask whether a copy or gather
//!   finished, consume the head), or `None` when the head is still in flight;
//! - the engine executes each action against the plugin and CUDA and feeds what happened back
//!   in ([`LaneCore::posted`], [`LaneCore::handle`], [`LaneCore::test_head`]); an error fails the link,
//!   and [`LaneCore::abandon`] then fails every transfer the lane holds;
//! - a report may answer with the next action at once: a post that found the window empty
//!   asks for the test of its request ([`Action::Test`], the action a test pass would start
//!   with), a test that found the head done asks for what follows it, so the common request
//!   (posted, done at its first test, retired) passes through the action machinery once.
//!
//! The three routes go through this one path and differ only in a chunk's [`Place`]:
//! - direct: the plugin reads or writes the application's registered memory;
//! - staged (CUDA memory on a host-only plugin, [`super::stage`]): a send chunk is copied into
//!   a ring slot ahead of its post ([`Action::Fill`]) and posted once that copy is seen done; a
//!   receive chunk lands in a slot, is copied out once done ([`Action::Drain`]) and consumed
//!   only once that copy is seen done;
//! - unpack (a receive into CUDA memory on a comm with an UNPACK handle, [`super::unpack`]):
//!   a done receive's gather is queued ([`Action::QueueUnpack`]), the gathers a test pass
//!   found go out in one launch ([`Action::LaunchUnpack`]), and the receive is consumed only
//!   once its launch is seen done.
//!
//! The plugin's rules hold by construction: only the window's head is ever tested, receives
//! are consumed in FIFO order and only once done and their data is in place, ring slots are
//! handed out FIFO and never while in use, and each transfer is reported to its [`LaneWork`]
//! exactly once (all of its chunks on this lane done, or failed).
//!
//! Nothing here allocates, locks or touches a shared atomic per chunk: the window, the queues
//! and the slot accounting are preallocated, an action is a small value, and a lane counts
//! its own chunks of each transfer, reporting them once, when its last one completes
//! (completions are FIFO per comm, so the oldest transfer is the one a completion belongs to).

use std::collections::VecDeque;

use tcpx::cuda::unpack::SLOTS as UNPACK_SLOTS;

use crate::engine::stage::SlotFifo;
use crate::error::Direction;
use crate::schedule::{Chunk, Schedule};
use crate::window::{HeadTest, RecvWindow, TestOutcome, ZeroCapacity};

/// Transfers queued per lane before the queue grows (it grows only if the application
/// submits more than this many transfers ahead of the network).
const QUEUE_CAPACITY: usize = 256;

/// A send chunk shorter than this is not tested right after its post while more chunks are
/// ready to post: the posts that follow it join it, and the test after them hands the plugin
/// all of them at once (the built-in plugin writes a socket's queued requests in one
/// `sendmsg`). Tested one by one, a list of 16 KiB blocks cost a system call per block on
/// each side: the receiver then read every block on its own too. The bound takes in 64 KiB
/// KV blocks (their lists measured 10–30 % faster batched); chunks of 256 KiB and more keep
/// their immediate test (batching them measured slower at 256 KiB messages).
pub(crate) const BATCH_SENDS_BELOW: u32 = 128 << 10;

/// What the lane needs of a transfer. Cloned once per transfer, when the lane starts posting
/// its chunks (the engine's is an `Arc`), so that finding the posting transfer costs no
/// queue lookup per chunk.
pub(crate) trait LaneWork: Clone {
    /// The transfer's schedule, once known (nothing is posted from it, or from any transfer
    /// behind it on the lane, before).
    fn schedule(&self) -> Option<&Schedule>;
    /// How `chunk` travels.
    fn route(&self, chunk: &Chunk) -> Route;
    /// `n` chunks of this transfer completed on this lane: all of them (called once).
    fn chunks_done(&self, n: u64);
    /// The transfer fails (its link failed).
    fn fail(&self);
}

/// How a transfer's chunk travels, as the transfer sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// From or into the application's registered memory.
    Direct,
    /// Through the lane's pinned ring.
    Staged,
    /// A receive into CUDA memory: through the unpack step where the comm has an UNPACK
    /// handle, direct otherwise.
    CudaDst,
}

/// Where a posted chunk's bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Place {
    /// The application's registered memory.
    Direct,
    /// This slot of the lane's staging ring.
    Ring(u16),
    /// The plugin's bounce buffer, gathered through this unpack slot (receives only).
    Unpack(u16),
}

/// What a window slot remembers about its request (its transfer is the lane's oldest).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tag {
    /// Bytes posted.
    pub(crate) len: u32,
    /// Chunk index in the transfer's schedule (for error messages).
    pub(crate) index: u64,
    /// Where its bytes are.
    pub(crate) place: Place,
}

/// What the engine should do next on a lane. Actions are moved through every poll, so they
/// stay small: neither the chunk nor the plugin's request travels in one (the engine reads the
/// chunk from [`LaneCore::chunk`] and hands the head back through [`LaneCore::consume`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Action {
    /// Make the lane's staging ring (`slots` × `slot_bytes`) for the posting transfer's
    /// staging, register it on the comm, then report [`Event::Opened`].
    OpenRing { slots: usize, slot_bytes: usize },
    /// Look for the comm's UNPACK handle for the posting transfer's GPU, then report
    /// [`Event::UnpackProbed`].
    OpenUnpack,
    /// Start copying [`LaneCore::chunk`] (of the posting transfer) into ring slot `slot`
    /// (send; no report).
    Fill { slot: u16 },
    /// Ask whether the copy of ring slot `slot` finished, then report [`Event::Copied`].
    PollCopy { slot: u16 },
    /// Post [`LaneCore::chunk`] (of the posting transfer, unless `place` is a send's ring
    /// slot) from or into `place`, then report [`LaneCore::posted`] or [`Event::Busy`]. A
    /// receive into a ring slot also records where the slot's bytes go; one into an unpack
    /// slot records its destination. (The chunk stays in the core, read by reference: an
    /// action is moved through every poll, so it carries only what is small.)
    Post { place: Place },
    /// Test the head: call [`LaneCore::test_head`] with the plugin's `test`, then execute
    /// the action it returns, if any.
    Test,
    /// Start copying ring slot `slot`'s first `size` bytes to their destination (receive; no
    /// report).
    Drain { slot: u16, size: usize },
    /// Add the gather of the done receive in unpack slot `slot` to the batch (no report).
    QueueUnpack { slot: u16, size: usize },
    /// Launch the batch of gathers in one go (no report).
    LaunchUnpack,
    /// Ask whether the oldest launch finished (and found no bad fragment), then report
    /// [`Event::Gathered`].
    PollUnpack,
    /// Hand the done receive at the head back to the plugin through [`LaneCore::consume`]
    /// (`irecvConsumed`); `size` bytes arrived.
    Consume { size: usize },
    /// A send of `size` bytes completed: count it, then report [`LaneCore::sent`] (counted
    /// before its transfer can finish, so a finished transfer's bytes are in the counters).
    Sent { size: usize },
}

/// What happened to an action that asked for a report.
#[derive(Debug)]
pub(crate) enum Event {
    /// [`Action::OpenRing`] made the ring.
    Opened,
    /// [`Action::OpenUnpack`] looked: whether the comm has an UNPACK handle.
    UnpackProbed(bool),
    /// [`Action::Post`]: the plugin is busy; try again on a later pass.
    Busy,
    /// [`Action::PollCopy`]: whether the copy finished.
    Copied(bool),
    /// [`Action::PollUnpack`]: whether the oldest launch finished.
    Gathered(bool),
}

/// Why testing the head failed the lane.
#[derive(Debug)]
pub(crate) enum TestFailed<E> {
    /// The plugin's `test` failed.
    Plugin(E),
    /// The request completed with `size` bytes where `posted` were posted.
    Size {
        index: u64,
        size: usize,
        posted: u32,
    },
}

/// Why handing the head back ([`LaneCore::consume`]) failed the lane.
#[derive(Debug)]
pub(crate) enum ConsumeFailed<E> {
    /// The plugin's `irecvConsumed` failed.
    Plugin(E),
    /// The lane's bookkeeping broke (a bug).
    Fault(&'static str),
}

/// Whether a completion's size is acceptable for the `posted` bytes of its request.
#[inline]
fn size_ok(_direction: Direction, size: usize, posted: u32) -> bool {
    size == posted as usize
}

/// The reports the core waits for, with what it needs to apply them.
#[derive(Debug, Clone, Copy)]
enum Expect {
    Nothing,
    Open {
        slots: usize,
    },
    Probe,
    /// A post of [`LaneCore::chunk`] from or into `place`.
    Post {
        place: Place,
    },
    /// Copy of the send ring's oldest ahead chunk.
    CopyAhead,
    /// Copy of the receive window's head out of its slot.
    CopyHead,
    Gather,
    Test,
    /// The engine hands the head back ([`LaneCore::consume`]).
    Consume,
}

/// Where the test pass stands.
#[derive(Debug, Clone, Copy)]
enum Step {
    Start,
    /// Consume done receives from the head while their data is in place.
    Consume,
    /// Test the head.
    Test,
    /// Launch the gathers queued in this pass, then end.
    Launch,
    End,
}

/// A staged send chunk whose copy into its slot started and which is not posted yet.
#[derive(Debug, Clone, Copy)]
struct Ahead {
    slot: u16,
    chunk: Chunk,
}

/// The slot accounting of a lane's staging ring.
#[derive(Debug)]
struct Ring {
    slots: SlotFifo,
    /// Send lane: chunks copied (or being copied) into their slots, not yet posted, oldest
    /// first. Always empty on a receive lane.
    ahead: VecDeque<Ahead>,
    /// The copy of `ahead`'s front was seen done.
    front_copied: bool,
    /// Receive lane: the copy out of the window head's slot was seen done.
    head_copied: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Probe {
    Unprobed,
    Absent,
    Present,
}

/// The accounting of a receive lane's unpack step.
#[derive(Debug)]
struct Unpack {
    probe: Probe,
    /// Gathers queued in this test pass, not launched yet.
    batch: u32,
    /// Launches not yet seen done, oldest first: the receives each gathers.
    launches: VecDeque<u32>,
    /// Receives at the window's head whose launch was seen done, not yet consumed.
    ready: u32,
}

/// One lane's state: see the module docs.
pub(crate) struct LaneCore<R, J> {
    direction: Direction,
    channel: u16,
    channels: u16,
    /// Both directions use the receive window: a send is consumed as soon as it is done.
    window: RecvWindow<R, Tag>,
    track: Track<J>,
    ring: Option<Ring>,
    unpack: Unpack,
    /// Receive lane: irecvs posted on the comm so far, on every route: the plugin's unpack
    /// slot of the k-th is `k mod 16`.
    irecvs: u64,
    expect: Expect,
    /// Receive lane with a ring or an unpack step: a test pass first consumes the receives
    /// whose copies or gathers an earlier pass started (set once, when either appears).
    consume_first: bool,
    /// The chunk the last [`Action::Post`] or [`Action::Fill`] names.
    chunk: Chunk,
    step: Step,
    /// The post pass stops at the next [`Self::poll_post`] (the ring's front copy still runs).
    halt: bool,
}

impl<R, J: LaneWork> LaneCore<R, J> {
    /// A lane of `direction` on channel `channel` of `channels`, with a window of `window`.
    pub(crate) fn new(
        direction: Direction,
        channel: u16,
        channels: u16,
        window: usize,
    ) -> Result<Self, ZeroCapacity> {
        Ok(Self {
            direction,
            channel,
            channels,
            window: RecvWindow::new(window)?,
            track: Track::new(),
            ring: None,
            unpack: Unpack {
                probe: Probe::Unprobed,
                batch: 0,
                launches: VecDeque::with_capacity(UNPACK_SLOTS),
                ready: 0,
            },
            irecvs: 0,
            expect: Expect::Nothing,
            consume_first: false,
            chunk: Chunk {
                index: 0,
                channel,
                offset: 0,
                len: 0,
                segment: 0,
                segment_offset: 0,
            },
            step: Step::Start,
            halt: false,
        })
    }

    /// Queues a transfer behind those the lane carries.
    pub(crate) fn push(&mut self, job: J) {
        self.track.push(job);
    }

    /// The transfer chunks are being posted from (the one [`Action::OpenRing`],
    /// [`Action::OpenUnpack`], [`Action::Fill`] and [`Action::Post`] name).
    #[inline]
    pub(crate) fn posting_job(&self) -> Option<&J> {
        self.track.current.as_ref()
    }

    /// The chunk the last [`Action::Post`] or [`Action::Fill`] names.
    #[inline]
    pub(crate) fn chunk(&self) -> &Chunk {
        &self.chunk
    }

    /// Schedule index of the chunk of the receive at the window's head, once done (the
    /// lane's oldest transfer's).
    pub(crate) fn head_index(&self) -> Option<u64> {
        self.window.consumable().map(|head| head.data.index)
    }

    /// The oldest transfer the lane holds (the timeout check; the transfer of the window's
    /// head).
    pub(crate) fn oldest_job(&self) -> Option<&J> {
        self.track.jobs.front().map(|j| &j.job)
    }

    /// Anything in flight or queued.
    pub(crate) fn has_work(&self) -> bool {
        !self.window.is_empty() || !self.track.jobs.is_empty()
    }

    /// The window's capacity.
    #[cfg(test)]
    fn capacity(&self) -> usize {
        self.window.capacity()
    }

    /// The next step towards posting a chunk; `None` when the window is full, nothing is
    /// ready, or a staged send's copy still runs.
    #[inline]
    pub(crate) fn poll_post(&mut self) -> Option<Action> {
        debug_assert!(matches!(self.expect, Expect::Nothing), "{:?}", self.expect);
        if self.halt {
            self.halt = false;
            return None;
        }
        if self.direction == Direction::Send {
            // Staged chunks already copied ahead go out before anything behind them.
            if self.ring.as_ref().is_some_and(|r| !r.ahead.is_empty()) {
                return self.post_ahead();
            }
        }
        if self.window.is_full() {
            return None;
        }
        let (job, chunk) = self.track.next_chunk(self.channel)?;
        let place = match (self.direction, job.route(&chunk)) {
            (_, Route::Direct) | (Direction::Send, Route::CudaDst) => Place::Direct,
            (Direction::Send, Route::Staged) => return self.post_ahead(),
            (Direction::Recv, Route::Staged) => {
                let Some(ring) = self.ring.as_ref() else {
                    let slot_bytes = job.schedule().map_or(chunk.len, |s| s.chunk_bytes());
                    return Some(self.open_ring(self.ring_slots(), slot_bytes as usize));
                };
                // Slots in use never exceed the window's requests, so a window with room has
                // a free slot; refusing here would only mean a bookkeeping bug, kept harmless.
                if !ring.slots.has_room() {
                    return None;
                }
                // Slots < window ≤ 16.
                Place::Ring(ring.slots.peek() as u16)
            }
            (Direction::Recv, Route::CudaDst) => match self.unpack.probe {
                Probe::Unprobed => {
                    self.expect = Expect::Probe;
                    return Some(Action::OpenUnpack);
                }
                // TCPX's rule: the k-th irecv of a comm (counting from 0) uses slot k mod 16.
                Probe::Present => Place::Unpack((self.irecvs % UNPACK_SLOTS as u64) as u16),
                Probe::Absent => Place::Direct,
            },
        };
        self.chunk = chunk;
        self.expect = Expect::Post { place };
        Some(Action::Post { place })
    }

    fn open_ring(&mut self, slots: usize, slot_bytes: usize) -> Action {
        self.expect = Expect::Open { slots };
        Action::OpenRing { slots, slot_bytes }
    }

    /// Staged send: starts copies of the next staged chunks into free slots, then posts the
    /// oldest copied one once its copy is seen done.
    #[inline(never)]
    fn post_ahead(&mut self) -> Option<Action> {
        if let Some(fill) = self.fill() {
            return Some(fill);
        }
        let ring = self.ring.as_mut()?;
        let front = *ring.ahead.front()?;
        if self.window.is_full() {
            return None;
        }
        if !ring.front_copied {
            self.expect = Expect::CopyAhead;
            return Some(Action::PollCopy { slot: front.slot });
        }
        let place = Place::Ring(front.slot);
        self.chunk = front.chunk;
        self.expect = Expect::Post { place };
        Some(Action::Post { place })
    }

    /// The copy of the next staged send chunk into a free slot (making the ring first);
    /// `None` when the ring is full or the next chunk is not staged (it posts once the staged
    /// chunks before it are out).
    fn fill(&mut self) -> Option<Action> {
        if self.ring.as_ref().is_some_and(|r| !r.slots.has_room()) {
            return None;
        }
        let (job, chunk) = self.track.next_chunk(self.channel)?;
        if job.route(&chunk) != Route::Staged {
            return None;
        }
        let slot_bytes = job.schedule().map_or(chunk.len, |s| s.chunk_bytes()) as usize;
        let Some(ring) = self.ring.as_mut() else {
            // Twice the window: a window's worth of sends in flight and as many copies running
            // ahead of them.
            return Some(self.open_ring(self.ring_slots(), slot_bytes));
        };
        // Slots < 2 × window ≤ 32.
        let slot = ring.slots.take()? as u16;
        ring.ahead.push_back(Ahead { slot, chunk });
        self.track.posted(chunk.index, self.channels);
        self.chunk = chunk;
        Some(Action::Fill { slot })
    }

    /// The next step towards retiring requests; `None` once the head is still in flight (or
    /// its data not yet in place) and the pass's gathers are launched.
    #[inline]
    pub(crate) fn poll_test(&mut self) -> Option<Action> {
        debug_assert!(matches!(self.expect, Expect::Nothing), "{:?}", self.expect);
        if self.window.is_empty() {
            // Nothing to test or consume (queued gathers hold their receives' slots).
            self.step = Step::Start;
            return None;
        }
        loop {
            match self.step {
                Step::Start => {
                    // Receives whose copies or gathers were started on an earlier pass may be
                    // ready now (lanes without a ring or an unpack step skip this).
                    self.step = if self.consume_first {
                        Step::Consume
                    } else {
                        Step::Test
                    };
                }
                Step::Consume => match self.next_consume() {
                    Some(action) => return Some(action),
                    None => self.step = Step::Test,
                },
                Step::Test => {
                    if self.window.next_to_test().is_none() {
                        if self.unpack.batch == 0 {
                            self.step = Step::Start;
                            return None;
                        }
                        self.step = Step::Launch;
                        continue;
                    }
                    self.expect = Expect::Test;
                    return Some(Action::Test);
                }
                Step::Launch => {
                    self.step = Step::End;
                    let batch = std::mem::take(&mut self.unpack.batch);
                    self.unpack.launches.push_back(batch);
                    return Some(Action::LaunchUnpack);
                }
                Step::End => {
                    self.step = Step::Start;
                    return None;
                }
            }
        }
    }

    /// The send that [`Action::Sent`] reported was counted: its chunk counts as completed.
    #[inline(always)]
    pub(crate) fn sent(&mut self) {
        self.track.completed();
    }

    /// Hands the head that [`Action::Consume`] named to `consume` (the plugin's
    /// `irecvConsumed`) and frees what it held (its ring slot, its place among gathered
    /// receives); once `consume` succeeded, its chunk counts as completed. (A failed consume
    /// fails the link instead, and the transfer with it.)
    // Always inline: once per receive, in the engine's test loop.
    #[inline(always)]
    pub(crate) fn consume<E>(
        &mut self,
        consume: impl FnOnce(R) -> Result<(), E>,
    ) -> Result<(), ConsumeFailed<E>> {
        if !matches!(
            std::mem::replace(&mut self.expect, Expect::Nothing),
            Expect::Consume
        ) {
            return Err(ConsumeFailed::Fault("a consume the lane did not ask for"));
        }
        let (ring, unpack) = (&mut self.ring, &mut self.unpack);
        let consumed = self.window.consume_head_into(|token, tag: Tag| {
            match tag.place {
                Place::Direct => {}
                Place::Ring(_) => {
                    if let Some(ring) = ring.as_mut() {
                        ring.slots.release();
                        ring.head_copied = false;
                    }
                }
                Place::Unpack(_) => unpack.ready = unpack.ready.saturating_sub(1),
            }
            consume(token)
        });
        match consumed {
            None => Err(ConsumeFailed::Fault("a done receive was not consumable")),
            Some(Err(e)) => Err(ConsumeFailed::Plugin(e)),
            Some(Ok(())) => {
                self.track.completed();
                Ok(())
            }
        }
    }

    /// Whether any request holds a window slot (nothing to test or consume otherwise).
    #[inline]
    pub(crate) fn has_requests(&self) -> bool {
        !self.window.is_empty()
    }

    /// Consumes the head if its data is in place, or asks whether it is.
    fn next_consume(&mut self) -> Option<Action> {
        let head = self.window.consumable()?;
        let (place, size) = (head.data.place, head.size);
        match place {
            Place::Direct => {}
            Place::Ring(slot) => {
                if !self.ring.as_ref().is_some_and(|r| r.head_copied) {
                    self.expect = Expect::CopyHead;
                    return Some(Action::PollCopy { slot });
                }
            }
            Place::Unpack(_) => {
                if self.unpack.ready == 0 {
                    if self.unpack.launches.is_empty() {
                        return None;
                    }
                    self.expect = Expect::Gather;
                    return Some(Action::PollUnpack);
                }
            }
        }
        Some(self.take_head(size))
    }

    /// Asks the engine to hand the done head (`size` bytes) back ([`Self::consume`]).
    #[inline]
    fn take_head(&mut self, size: usize) -> Action {
        self.expect = Expect::Consume;
        Action::Consume { size }
    }

    /// Applies the plugin's `test` of the head ([`Action::Test`]) and returns what follows
    /// at once, if anything (report a send, consume a receive, start a copy out of a slot,
    /// queue a gather): the engine executes it before polling again. An error fails the
    /// lane: the engine fails the link and abandons the lane.
    // Always inline: once per request, in the engine's test (its result is matched there).
    #[inline(always)]
    pub(crate) fn test_head<E>(
        &mut self,
        test: impl FnOnce(&mut R) -> TestOutcome<E>,
    ) -> Result<Option<Action>, TestFailed<E>> {
        debug_assert!(matches!(self.expect, Expect::Test), "{:?}", self.expect);
        self.expect = Expect::Nothing;
        let (size, tag) = match self.window.test_head_copied(test) {
            HeadTest::Nothing | HeadTest::Pending => {
                self.step = if self.unpack.batch > 0 {
                    Step::Launch
                } else {
                    Step::End
                };
                return Ok(None);
            }
            HeadTest::Done { size, data } => (size, data),
            // The requests it took down dropped in the window; the engine then abandons the
            // link.
            HeadTest::Failed(error) => {
                self.step = Step::End;
                return Err(TestFailed::Plugin(error));
            }
        };
        if !size_ok(self.direction, size, tag.len) {
            self.step = Step::End;
            return Err(TestFailed::Size {
                index: tag.index,
                size,
                posted: tag.len,
            });
        }
        Ok(Some(match (self.direction, tag.place) {
            (Direction::Send, place) => {
                // A send is finished once done: it leaves the window at once.
                self.window.drop_done_head();
                if let (Place::Ring(_), Some(ring)) = (place, self.ring.as_mut()) {
                    ring.slots.release();
                }
                Action::Sent { size }
            }
            // Host memory, nothing ahead of it (done receives are the window's prefix): the
            // data is in place once done, so hand the slot back at once.
            (Direction::Recv, Place::Direct) if self.window.awaiting_consume() == 1 => {
                self.take_head(size)
            }
            // Behind receives whose data is not in place yet: in order, as it gets there.
            (Direction::Recv, Place::Direct) => {
                self.step = Step::Consume;
                return Ok(None);
            }
            (Direction::Recv, Place::Ring(slot)) => {
                self.step = Step::Consume;
                Action::Drain { slot, size }
            }
            (Direction::Recv, Place::Unpack(slot)) => {
                self.step = Step::Consume;
                self.unpack.batch += 1;
                Action::QueueUnpack { slot, size }
            }
        }))
    }

    /// [`Action::Post`] went out as `request` (the hot report, apart from [`Self::handle`]'s).
    /// Returns [`Action::Test`] when the request is alone in the window: it is the head the
    /// test pass would test first (nothing ahead of it to consume, no gathers queued), so the
    /// engine tests it at once, as it would for the pass's first action, and then runs the
    /// rest of the pass ([`Self::poll_test`]) only if a request is left. `None`: run the test
    /// pass — or, when [`Self::defers_test`] says so, post on and run it after the last post.
    /// `Err` names a bookkeeping bug (fail the link with it).
    // Always inline: once per request, in the engine's post (its result is matched there).
    #[inline(always)]
    pub(crate) fn posted(&mut self, request: R) -> Result<Option<Action>, &'static str> {
        let Expect::Post { place } = std::mem::replace(&mut self.expect, Expect::Nothing) else {
            return Err("a post was reported that the lane did not ask for");
        };
        let (index, len) = (self.chunk.index, self.chunk.len);
        match (self.direction, place) {
            (Direction::Send, Place::Direct) => self.track.posted(index, self.channels),
            (Direction::Send, _) => {
                // Counted as posted when its copy started.
                if let Some(ring) = self.ring.as_mut() {
                    ring.ahead.pop_front();
                    ring.front_copied = false;
                }
            }
            (Direction::Recv, place) => {
                if let (Place::Ring(_), Some(ring)) = (place, self.ring.as_mut()) {
                    ring.slots.take();
                }
                self.irecvs += 1;
                self.track.posted(index, self.channels);
            }
        }
        let tag = Tag { len, index, place };
        if self.window.try_post(request, tag).is_err() {
            return Err("window refused a post");
        }
        // The pass's state (`step`) matters only while the window holds requests: a request
        // that finds the window empty starts the pass here, where `poll_test` would have
        // got to (past the consumes: nothing ahead of it is done).
        if self.window.len() == 1 {
            self.step = Step::Test;
            if self.defers_test() {
                return Ok(None);
            }
            self.expect = Expect::Test;
            return Ok(Some(Action::Test));
        }
        Ok(None)
    }

    /// Whether the request just posted waits for the posts behind it before it is tested: a
    /// send shorter than [`BATCH_SENDS_BELOW`]. The engine then keeps posting while chunks
    /// are ready and the window has room, and runs the test pass once after the last post.
    #[inline(always)]
    pub(crate) fn defers_test(&self) -> bool {
        self.direction == Direction::Send && self.chunk.len < BATCH_SENDS_BELOW
    }

    /// Applies the report of the last action that asked for one. `Err` names a bookkeeping
    /// bug (fail the link with it).
    pub(crate) fn handle(&mut self, event: Event) -> Result<(), &'static str> {
        let expect = std::mem::replace(&mut self.expect, Expect::Nothing);
        match (expect, event) {
            (Expect::Open { slots }, Event::Opened) => self.set_ring(slots),
            (Expect::Probe, Event::UnpackProbed(present)) => {
                self.unpack.probe = if present {
                    self.consume_first = true;
                    Probe::Present
                } else {
                    Probe::Absent
                };
            }
            (Expect::Post { .. }, Event::Busy) => {}
            (Expect::CopyAhead, Event::Copied(done)) => match self.ring.as_mut() {
                Some(ring) if done => ring.front_copied = true,
                _ => self.halt = true,
            },
            (Expect::CopyHead, Event::Copied(done)) => match self.ring.as_mut() {
                Some(ring) if done => ring.head_copied = true,
                _ => self.step = Step::Test,
            },
            (Expect::Gather, Event::Gathered(done)) => {
                if done {
                    self.unpack.ready = self.unpack.launches.pop_front().unwrap_or(0);
                } else {
                    self.step = Step::Test;
                }
            }
            _ => return Err("a lane event answered an action it did not follow"),
        }
        Ok(())
    }

    /// The slots of the ring this lane asks for ([`Action::OpenRing`]): twice the window on a
    /// send lane (a window's worth of copies runs ahead of the sends), the window on a
    /// receive lane.
    pub(crate) fn ring_slots(&self) -> usize {
        match self.direction {
            Direction::Send => 2 * self.window.capacity(),
            Direction::Recv => self.window.capacity(),
        }
    }

    /// Whether the lane has its staging ring.
    pub(crate) fn has_ring(&self) -> bool {
        self.ring.is_some()
    }

    /// The engine made the lane's ring ([`Self::ring_slots`] slots) ahead of its first staged
    /// transfer (when the connection started, or CUDA memory was registered): staged chunks
    /// then go straight to their slots, with no [`Action::OpenRing`]. Only between passes
    /// (no action waiting for its report) and only once; `Err` names the bookkeeping bug.
    pub(crate) fn ring_made(&mut self) -> Result<(), &'static str> {
        if !matches!(self.expect, Expect::Nothing) {
            return Err("a ring was made while an action waited for its report");
        }
        if self.ring.is_some() {
            return Err("a second ring was made");
        }
        self.set_ring(self.ring_slots());
        Ok(())
    }

    fn set_ring(&mut self, slots: usize) {
        self.ring = Some(Ring {
            slots: SlotFifo::new(slots),
            ahead: VecDeque::with_capacity(slots),
            front_copied: false,
            head_copied: false,
        });
        self.consume_first = self.direction == Direction::Recv;
    }

    /// Fails every transfer the lane holds and forgets every request (dropped here, without
    /// being tested), copy and gather. The engine first waits for the copies and gathers
    /// still running: they touch memory the transfers failed here may be the last to hold.
    /// The window stays failed: the lane never posts again.
    pub(crate) fn abandon(&mut self) {
        drop(self.window.abandon());
        self.track.abandon();
        if let Some(ring) = self.ring.as_mut() {
            ring.ahead.clear();
            ring.slots.clear();
            ring.front_copied = false;
            ring.head_copied = false;
        }
        self.unpack.batch = 0;
        self.unpack.launches.clear();
        self.unpack.ready = 0;
        self.expect = Expect::Nothing;
        self.step = Step::Start;
        self.halt = false;
    }
}

/// The transfers a lane carries, oldest first: first those with chunks in flight (or with
/// no chunk here, waiting for older ones to finish), then the one being posted, then those
/// queued behind it.
struct Track<J> {
    jobs: VecDeque<LaneJob<J>>,
    /// Index in `jobs` of the transfer being posted.
    posting: usize,
    /// Next chunk index of that transfer; `None` before its first (its schedule may not be
    /// known yet).
    next: Option<u64>,
    /// That transfer, once its first chunk is found (`next` is `Some`); `None` otherwise.
    current: Option<J>,
}

struct LaneJob<J> {
    job: J,
    /// Chunks of the transfer on this lane (known once posting starts).
    here: u64,
    /// Of those, not yet completed.
    left: u64,
}

impl<J: LaneWork> Track<J> {
    fn new() -> Self {
        Self {
            jobs: VecDeque::with_capacity(QUEUE_CAPACITY),
            posting: 0,
            next: None,
            current: None,
        }
    }

    fn push(&mut self, job: J) {
        self.jobs.push_back(LaneJob {
            job,
            here: 0,
            left: u64::MAX,
        });
    }

    /// The next chunk to post on `channel`, or `None` when nothing is ready: no transfer, or
    /// the one being posted waits for its schedule (later ones wait too: posting order must
    /// follow submission order).
    // Inline: the common cases (the next chunk of the transfer being posted, nothing to post)
    // cost no call; moving on to the next transfer goes out of line.
    #[inline]
    fn next_chunk(&mut self, channel: u16) -> Option<(&J, Chunk)> {
        match (self.next, &self.current) {
            (Some(index), Some(job)) => {
                if let Some(chunk) = job.schedule().and_then(|s| s.chunk(index)) {
                    // Re-borrowed: the slow path below needs `self` mutably.
                    return Some((self.current.as_ref()?, chunk));
                }
            }
            (None, _) if self.posting >= self.jobs.len() => return None,
            _ => {}
        }
        self.next_chunk_slow(channel)
    }

    /// [`Self::next_chunk`] past the end of a transfer, or at the start of one.
    #[inline(never)]
    fn next_chunk_slow(&mut self, channel: u16) -> Option<(&J, Chunk)> {
        loop {
            let lane_job = self.jobs.get_mut(self.posting)?;
            let schedule = lane_job.job.schedule()?;
            let index = match self.next {
                Some(index) => index,
                None => {
                    lane_job.here = schedule.chunk_count_on(channel);
                    lane_job.left = lane_job.here;
                    self.current = Some(lane_job.job.clone());
                    *self.next.insert(schedule.first_index_on(channel))
                }
            };
            if let Some(chunk) = schedule.chunk(index) {
                return Some((self.current.as_ref()?, chunk));
            }
            // Every chunk of this transfer on this lane is posted: on to the next one.
            self.posting += 1;
            self.next = None;
            self.current = None;
            self.retire();
        }
    }

    /// The chunk just returned by `next_chunk` was posted (or its copy started).
    // Always inline (here and in `completed`): once per request, and small; left to the
    // compiler, a growing engine loop can push them out of line.
    #[inline(always)]
    fn posted(&mut self, index: u64, channels: u16) {
        self.next = Some(index + u64::from(channels));
    }

    /// The oldest request completed: it belongs to the oldest transfer.
    #[inline(always)]
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

    /// Fails every transfer it holds and starts over.
    fn abandon(&mut self) {
        for lane_job in self.jobs.drain(..) {
            lane_job.job.fail();
        }
        self.posting = 0;
        self.next = None;
        self.current = None;
    }
}

#[cfg(test)]
mod tests;
