//! One eager channel inside its engine: a send comm that carries frames of small messages,
//! and a receive comm that keeps frames posted and hands their messages to the connection's
//! receives (see [`crate::eager`] for why).
//!
//! Each side owns a few frame buffers, registered once on their comm when the channel is
//! made, so that the path neither allocates nor registers per frame. The engine takes the
//! channel's queued sends, copies them into its open frame and finishes each send as it is
//! copied (its memory may be reused then, as after a socket `send`); the open frame goes out
//! as soon as fewer than [`SEND_FRAMES`] are in flight. While they are, messages gather in
//! the open frame and the ones closed behind it: that is where aggregation comes from. Receive
//! frames are tested only while a receive of the channel waits (see [`EagerChannel::pump`]).
//!
//! A send frame's header is written when it closes, ending where the payload begins
//! ([`FRAME_HEAD`]): the frame is sent from there, in the wire format, with no second copy.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use tcpx::{MemoryRegion, RecvComm, RecvRequest, SendComm, SendRequest, SharedMemory};
use tcpx_proto::eager::{
    decode, fits, header_len, write_header, EagerEntry, EagerMessage, EAGER_ENTRY_BYTES,
    EAGER_FRAME_BYTES, EAGER_HEADER_BYTES, EAGER_MAX_MESSAGES,
};

use super::channel::LinkFailed;
use crate::eager::{Delivered, Eager, Early, Outgoing, Posted};
use crate::error::{Direction, Error};
use crate::link::Link;
use crate::registry::Region;

/// Send frames per eager comm in flight at once. Few, so that a busy connection's messages
/// gather into frames rather than spread one per request.
pub(crate) const SEND_FRAMES: usize = 2;

/// Send frame buffers per eager comm: those in flight, the open one, and one closed behind
/// it, so that copying (and finishing sends) goes on while frames are on the wire.
const SEND_BUFFERS: usize = SEND_FRAMES + 2;

/// Where a send buffer's payload starts: room for the largest header before it.
const FRAME_HEAD: usize = EAGER_HEADER_BYTES + EAGER_ENTRY_BYTES * EAGER_MAX_MESSAGES;

/// Receive frames kept posted per eager comm.
pub(crate) const RECV_FRAMES: usize = 4;

/// Transfers finished per publication of a lane's count while a run of them finishes (the
/// run's end is always published): the application polls that count, and a store per
/// message would move its cache line between the two cores per message.
const PUBLISH_EVERY: u64 = 16;

/// Bytes finished after which a lane's count is published even within
/// [`PUBLISH_EVERY`] transfers: 16 messages of 64 KiB are a millisecond of copying, which
/// the application would otherwise wait before it sees the first of them finished.
const PUBLISH_BYTES: usize = 64 << 10;

/// One lane's finished transfers as its engine counts them, published in steps.
#[derive(Debug, Default)]
struct Tally {
    count: u64,
    unpublished: u64,
    unpublished_bytes: usize,
}

impl Tally {
    /// Counts a finished transfer of `len` bytes; returns whether the count is due to be
    /// published ([`Tally::publish`]).
    fn add(&mut self, len: usize) -> bool {
        self.count += 1;
        self.unpublished += 1;
        self.unpublished_bytes += len;
        self.unpublished >= PUBLISH_EVERY || self.unpublished_bytes >= PUBLISH_BYTES
    }

    /// The count to publish now, if any finished since the last time.
    fn publish(&mut self) -> Option<u64> {
        if self.unpublished == 0 {
            return None;
        }
        self.unpublished = 0;
        self.unpublished_bytes = 0;
        Some(self.count)
    }
}

/// An eager channel handed to an engine.
pub(crate) struct NewEagerChannel {
    pub(crate) eager: Arc<Eager>,
    pub(crate) index: u16,
    pub(crate) send: SendComm,
    pub(crate) recv: RecvComm,
}

struct SendBuffer {
    memory: SharedMemory,
    region: MemoryRegion,
    /// Entries of the messages copied in, and their bytes.
    entries: Vec<EagerEntry>,
    payload: usize,
}

/// A closed send frame: posted (with its request) or waiting for room.
struct Closed {
    buffer: usize,
    /// Where the frame starts in its buffer, and its length.
    start: usize,
    len: usize,
    request: Option<SendRequest>,
    /// When it was posted: a frame the peer does not take within the link's timeout fails
    /// the connection, as the sends it carries would have.
    posted_at: Instant,
}

struct RecvFrame {
    memory: SharedMemory,
    region: MemoryRegion,
    request: Option<RecvRequest>,
    /// Messages of the last frame received here that wait for their receives (see
    /// [`Early`]): the buffer is posted again only once they are copied out.
    kept: usize,
}

/// The eager comms of one connection's channel `index`.
pub(crate) struct EagerChannel {
    pub(crate) eager: Arc<Eager>,
    pub(crate) index: u16,
    send: SendComm,
    recv: RecvComm,
    send_buffers: Vec<SendBuffer>,
    /// Buffers neither open nor closed.
    free: Vec<usize>,
    /// The buffer messages are copied into.
    open: Option<usize>,
    /// Closed frames, oldest first: posted ones (the plugin completes them in order), then
    /// those waiting for room.
    closed: VecDeque<Closed>,
    /// Sends taken from the connection's queue and not yet copied, oldest first.
    taken: VecDeque<Outgoing>,
    recv_frames: Vec<RecvFrame>,
    /// Receive frames posted, oldest first.
    receiving: VecDeque<usize>,
    /// Receives of this channel this engine took off the inbox's queue, and the last total
    /// it read of those queued ([`Eager::posted_total`]): while the latter is ahead, a
    /// receive waits, and the application's counter need not be read again.
    recvs_taken: u64,
    recvs_seen: u64,
    /// This channel's sends copied and receives landed, ever (published to the connection's
    /// lanes, see [`crate::transfer::in_order`]).
    sends_copied: Tally,
    recvs_landed: Tally,
    /// Regions of transfers this engine is done with, to hand back to the application with
    /// the next lock it takes anyway, and whether it handed any back since the channel was
    /// last idle (see [`crate::eager`]'s `HANDED_BACK`).
    spent_sends: Vec<Region>,
    spent_recvs: Vec<Region>,
    handed_sends: bool,
    handed_recvs: bool,
    /// Scratch: decoded messages and the receives they land in.
    decoded: Vec<EagerMessage>,
    matched: Vec<(u64, Posted, Early)>,
    landed: Vec<(u64, Posted)>,
    /// When a frame last completed (peer-gone detection).
    pub(crate) progress_at: Instant,
}

impl EagerChannel {
    /// Makes the channel's frame buffers and registers them on its comms.
    pub(crate) fn new(new: NewEagerChannel) -> tcpx::Result<Self> {
        let NewEagerChannel {
            eager,
            index,
            send,
            recv,
        } = new;
        let send_buffers = (0..SEND_BUFFERS)
            .map(|_| {
                let memory = SharedMemory::host(FRAME_HEAD + EAGER_FRAME_BYTES)?;
                let region = send.register(&memory)?;
                Ok(SendBuffer {
                    memory,
                    region,
                    entries: Vec::with_capacity(EAGER_MAX_MESSAGES),
                    payload: 0,
                })
            })
            .collect::<tcpx::Result<Vec<_>>>()?;
        let recv_frames = (0..RECV_FRAMES)
            .map(|_| {
                let memory = SharedMemory::host(EAGER_FRAME_BYTES)?;
                let region = recv.register(&memory)?;
                Ok(RecvFrame {
                    memory,
                    region,
                    request: None,
                    kept: 0,
                })
            })
            .collect::<tcpx::Result<Vec<_>>>()?;
        Ok(Self {
            eager,
            index,
            send,
            recv,
            send_buffers,
            free: (0..SEND_BUFFERS).rev().collect(),
            open: None,
            closed: VecDeque::with_capacity(SEND_BUFFERS),
            taken: VecDeque::new(),
            recv_frames,
            receiving: VecDeque::with_capacity(RECV_FRAMES),
            recvs_taken: 0,
            recvs_seen: 0,
            sends_copied: Tally::default(),
            recvs_landed: Tally::default(),
            spent_sends: Vec::new(),
            spent_recvs: Vec::new(),
            handed_sends: false,
            handed_recvs: false,
            decoded: Vec::new(),
            matched: Vec::new(),
            landed: Vec::new(),
            progress_at: Instant::now(),
        })
    }

    /// The connection's two-sided link.
    pub(crate) fn link(&self) -> &Arc<Link> {
        &self.eager.link
    }

    /// Whether anything is queued, in flight or waited for: the engine keeps polling (and
    /// checks deadlines) while it is. Frames posted with no receive waiting are not work:
    /// an idle connection lets its engines sleep, and a receive wakes them.
    pub(crate) fn has_work(&mut self) -> bool {
        self.has_send_work() || self.receive_waits() || self.eager.has_matched(self.index)
    }

    /// Frames closed or in flight, messages copied or to copy.
    fn has_send_work(&self) -> bool {
        !self.closed.is_empty()
            || !self.taken.is_empty()
            || self.open.is_some()
            || self.eager.queued(self.index)
    }

    /// Whether a receive of this channel waits for its message (reads the application's
    /// counter only when the receives known of are all taken).
    fn receive_waits(&mut self) -> bool {
        // A frame may take receives queued after the last read: `taken` can pass `seen`.
        if self.recvs_seen <= self.recvs_taken {
            self.recvs_seen = self.eager.posted_total(self.index);
        }
        self.recvs_seen > self.recvs_taken
    }

    /// The oldest frame in flight, if it has been longer than the link's timeout.
    pub(crate) fn overdue_frame(&self, now: Instant) -> Option<String> {
        let oldest = self.closed.front().filter(|c| c.request.is_some())?;
        (now >= oldest.posted_at + self.link().timeout).then(|| {
            let messages = self.send_buffers[oldest.buffer].entries.len();
            format!("eager frame of {messages} messages, not taken by the peer")
        })
    }

    /// One pass: retire sent frames and post new ones, test the oldest receive frame while a
    /// receive waits, copy in early messages whose receives came. Returns whether anything
    /// moved. An idle channel makes no plugin call.
    pub(crate) fn pump(&mut self) -> Result<bool, LinkFailed> {
        if self.link().is_failed() {
            // Abandoned already (nothing posted): nothing to do until the link is removed.
            if self.closed.is_empty() && self.receiving.is_empty() {
                return Ok(false);
            }
            return Err(LinkFailed);
        }
        let mut moved = false;
        if self.has_send_work() {
            moved |= self.pump_send()?;
        }
        moved |= self.pump_recv()?;
        Ok(moved)
    }

    /// Releases the regions of finished transfers the application has not taken back: the
    /// engine is about to sleep, so nothing streams on this channel.
    pub(crate) fn release_spent(&mut self) {
        if self.handed_sends || !self.spent_sends.is_empty() {
            self.spent_sends.clear();
            self.eager.release_spent(self.index, Direction::Send);
            self.handed_sends = false;
        }
        if self.handed_recvs || !self.spent_recvs.is_empty() {
            self.spent_recvs.clear();
            self.eager.release_spent(self.index, Direction::Recv);
            self.handed_recvs = false;
        }
    }

    fn plugin_error(&self, direction: Direction, source: tcpx::Error) -> LinkFailed {
        let link = self.link();
        link.fail(Error::Plugin {
            channel: self.index,
            direction,
            peer: link.peer,
            source: Arc::new(source),
        });
        LinkFailed
    }

    fn pump_send(&mut self) -> Result<bool, LinkFailed> {
        let mut moved = self.retire_sent()?;
        if self.taken.is_empty() && self.eager.queued(self.index) {
            self.eager.take_queued(self.index, &mut self.taken);
        }
        moved |= self.copy_taken()?;
        moved |= self.post_closed()?;
        Ok(moved)
    }

    /// Retires sent frames, oldest first: their buffers become free.
    fn retire_sent(&mut self) -> Result<bool, LinkFailed> {
        let mut messages = 0;
        let mut bytes = 0u64;
        while let Some(oldest) = self.closed.front_mut() {
            let Some(request) = oldest.request.as_mut() else {
                break;
            };
            match self.send.test(request) {
                Ok(Some(_)) => {
                    let b = oldest.buffer;
                    self.closed.pop_front();
                    let buffer = &mut self.send_buffers[b];
                    messages += buffer.entries.len();
                    bytes += buffer.payload as u64;
                    buffer.entries.clear();
                    buffer.payload = 0;
                    self.free.push(b);
                    self.progress_at = Instant::now();
                }
                Ok(None) => break,
                Err(e) => return Err(self.plugin_error(Direction::Send, e)),
            }
        }
        if messages == 0 {
            return Ok(false);
        }
        // Channel `index`'s counters: this engine owns both the channel and its eager channel
        // (one writer).
        if let Some(counters) = self.eager.link.counters.get(usize::from(self.index)) {
            counters.sent(bytes);
        }
        self.eager.sent(self.index, messages, &mut self.spent_sends);
        self.handed_sends = true;
        Ok(true)
    }

    /// Copies taken sends into the open frame (opening and closing frames as they fill) and
    /// finishes them, until they are all copied or every buffer is closed.
    fn copy_taken(&mut self) -> Result<bool, LinkFailed> {
        let mut moved = false;
        while let Some(first) = self.taken.front() {
            let b = match self.open {
                Some(b) => b,
                None => match self.free.pop() {
                    Some(b) => {
                        self.open = Some(b);
                        b
                    }
                    None => break,
                },
            };
            let buffer = &mut self.send_buffers[b];
            if !fits(buffer.entries.len(), buffer.payload, first.len) {
                self.close_open()?;
                continue;
            }
            // The run: the next messages from the same region that fit this frame, copied as
            // one operation on the region (its state atomic is written once per run, not
            // twice per message from every engine that copies out of it).
            let (mut entries, mut payload) = (buffer.entries.len(), buffer.payload);
            let run = self
                .taken
                .iter()
                .take_while(|m| {
                    let take = m.region.same(&first.region) && fits(entries, payload, m.len);
                    if take {
                        entries += 1;
                        payload += m.len as usize;
                    }
                    take
                })
                .count();
            let ranges = self.taken.iter().take(run).scan(buffer.payload, |at, m| {
                let range = (m.offset, FRAME_HEAD + *at, m.len as usize);
                *at += m.len as usize;
                Some(range)
            });
            if let Err(e) = copy_in(&first.region, ranges, &buffer.memory) {
                // The receives these messages match would wait forever: the connection fails
                // (and with it these sends and the ones after them).
                let seq = first.seq;
                self.publish_sends();
                self.link().fail(Error::InvalidArgument(format!(
                    "eager sends from #{seq} ({run} messages): {e}"
                )));
                return Err(LinkFailed);
            }
            for _ in 0..run {
                let Some(m) = self.taken.pop_front() else {
                    break;
                };
                buffer.entries.push(EagerEntry {
                    seq: m.seq,
                    len: m.len,
                });
                buffer.payload += m.len as usize;
                if self.sends_copied.add(m.len as usize) {
                    if let Some(count) = self.sends_copied.publish() {
                        self.eager.sends_finished(self.index, count);
                    }
                }
                self.spent_sends.push(m.region);
            }
            moved = true;
        }
        self.publish_sends();
        Ok(moved)
    }

    /// Finishes the sends copied so far.
    fn publish_sends(&mut self) {
        if let Some(count) = self.sends_copied.publish() {
            self.eager.sends_finished(self.index, count);
        }
    }

    /// Finishes the receives landed so far.
    fn publish_recvs(&mut self) {
        if let Some(count) = self.recvs_landed.publish() {
            self.eager.recvs_finished(self.index, count);
        }
    }

    /// Closes the open frame: writes its header in front of its payload.
    fn close_open(&mut self) -> Result<(), LinkFailed> {
        let Some(b) = self.open.take() else {
            return Ok(());
        };
        let buffer = &self.send_buffers[b];
        if buffer.entries.is_empty() {
            self.free.push(b);
            return Ok(());
        }
        let head = header_len(buffer.entries.len());
        let start = FRAME_HEAD - head;
        let written = buffer.memory.with_bytes_mut(|bytes| {
            write_header(&buffer.entries, &mut bytes[start..FRAME_HEAD]);
        });
        if let Err(e) = written {
            self.link()
                .fail(Error::Internal(format!("eager frame busy: {e}")));
            return Err(LinkFailed);
        }
        self.closed.push_back(Closed {
            buffer: b,
            start,
            len: head + buffer.payload,
            request: None,
            posted_at: Instant::now(),
        });
        Ok(())
    }

    /// Posts closed frames, and the open one when nothing else waits, while fewer than
    /// [`SEND_FRAMES`] are in flight: a lone message leaves at once.
    fn post_closed(&mut self) -> Result<bool, LinkFailed> {
        let mut moved = false;
        loop {
            let posted = self
                .closed
                .iter()
                .take_while(|c| c.request.is_some())
                .count();
            if posted >= SEND_FRAMES {
                break;
            }
            if posted == self.closed.len() {
                if self.open.is_none() {
                    break;
                }
                self.close_open()?;
                if posted == self.closed.len() {
                    break;
                }
            }
            let next = &mut self.closed[posted];
            let region = &self.send_buffers[next.buffer].region;
            match self.send.isend(region, next.start, next.len, 0) {
                Ok(Some(request)) => {
                    next.request = Some(request);
                    next.posted_at = Instant::now();
                    moved = true;
                }
                Ok(None) => break,
                Err(e) => return Err(self.plugin_error(Direction::Send, e)),
            }
        }
        Ok(moved)
    }

    /// Tests and posts receive frames only while a receive of this channel waits for its
    /// message. Frames of one channel arrive in sequence order and receives are posted in
    /// sequence order, so a message nobody waits for yet can only sit behind one that is
    /// waited for: stopping then loses nothing, keeps what the application has not asked for
    /// in TCP (flow control, as behind a plugin request), and spares every engine pass the
    /// plugin call (a `recv` syscall on the socket plugin) of testing an idle comm.
    fn pump_recv(&mut self) -> Result<bool, LinkFailed> {
        let mut moved = self.land_matched()?;
        if !self.receive_waits() {
            return Ok(moved);
        }
        while let Some(&i) = self.receiving.front() {
            if !self.receive_waits() {
                break;
            }
            let frame = &mut self.recv_frames[i];
            let Some(request) = frame.request.as_mut() else {
                self.receiving.pop_front();
                continue;
            };
            let size = match self.recv.test(request) {
                Ok(Some(size)) => size,
                Ok(None) => break,
                Err(e) => return Err(self.plugin_error(Direction::Recv, e)),
            };
            let request = frame.request.take();
            self.receiving.pop_front();
            if let Some(request) = request {
                // The bytes are in our own host buffer: hand the slot back before reading.
                if let Err(e) = self.recv.consumed(request) {
                    return Err(self.plugin_error(Direction::Recv, e));
                }
            }
            self.progress_at = Instant::now();
            moved = true;
            self.take_delivery(i, size)?;
        }
        for i in 0..self.recv_frames.len() {
            let frame = &mut self.recv_frames[i];
            if frame.request.is_some() || frame.kept > 0 {
                continue;
            }
            match self.recv.irecv(&frame.region, 0, EAGER_FRAME_BYTES, 0) {
                Ok(Some(request)) => {
                    frame.request = Some(request);
                    self.receiving.push_back(i);
                    moved = true;
                }
                Ok(None) => break,
                Err(e) => return Err(self.plugin_error(Direction::Recv, e)),
            }
        }
        Ok(moved)
    }

    /// Copies in the early messages whose receives have come since the last call, finishes
    /// those receives and releases the frames they held. Returns whether there were any.
    fn land_matched(&mut self) -> Result<bool, LinkFailed> {
        if !self.eager.take_matched(self.index, &mut self.matched) {
            return Ok(false);
        }
        land_early(
            &self.eager,
            self.index,
            &self.recv_frames,
            &self.matched,
            &mut self.recvs_landed,
        );
        self.release_matched();
        self.publish_recvs();
        if self.link().is_failed() {
            return Err(LinkFailed);
        }
        Ok(true)
    }

    /// Forgets the early messages of `matched` (landed, or failed with the link) and posts
    /// their frames again once they hold nothing more.
    fn release_matched(&mut self) {
        for (_, posted, early) in self.matched.drain(..) {
            if let Some(frame) = self.recv_frames.get_mut(early.frame) {
                frame.kept = frame.kept.saturating_sub(1);
            }
            self.spent_recvs.push(posted.into_region());
        }
    }

    /// Decodes received frame `i` (`size` bytes) and hands its messages over: the early
    /// messages whose receives came since the last pass land first (their receives were
    /// posted first), then the frame's own.
    fn take_delivery(&mut self, i: usize, size: usize) -> Result<(), LinkFailed> {
        let (eager, index) = (&self.eager, self.index);
        let frames = &self.recv_frames;
        let (decoded, landed, matched) = (&mut self.decoded, &mut self.landed, &mut self.matched);
        let tally = &mut self.recvs_landed;
        let spent = &mut self.spent_recvs;
        self.handed_recvs |= !spent.is_empty();
        let read = frames[i].memory.with_bytes(|bytes| {
            let frame = &bytes[..size.min(bytes.len())];
            if let Err(e) = decode(frame, eager.max_message, decoded) {
                eager.violation(index, e.to_string());
                return None;
            }
            if let Some(counters) = eager.link.counters.get(usize::from(index)) {
                counters.received(decoded.iter().map(|m| u64::from(m.entry.len)).sum());
            }
            let delivered = eager.deliver(index, i, decoded, landed, matched, spent);
            if land_early(eager, index, frames, matched, tally) {
                let good = delivered.good.min(landed.len());
                let n = eager.land_run(index, &landed[..good], decoded, frame);
                for m in &decoded[..n] {
                    if tally.add(m.entry.len as usize) {
                        if let Some(count) = tally.publish() {
                            eager.recvs_finished(index, count);
                        }
                    }
                }
            }
            Some(delivered)
        });
        self.release_matched();
        self.spent_recvs.extend(
            self.landed
                .drain(..)
                .map(|(_, posted)| posted.into_region()),
        );
        self.publish_recvs();
        match read {
            Ok(Some(Delivered { taken, kept, .. })) => {
                self.recvs_taken += taken;
                self.recv_frames[i].kept = kept;
                if self.link().is_failed() {
                    Err(LinkFailed)
                } else {
                    Ok(())
                }
            }
            Ok(None) => Err(LinkFailed),
            Err(e) => {
                self.link()
                    .fail(Error::Internal(format!("eager frame busy: {e}")));
                Err(LinkFailed)
            }
        }
    }

    /// Fails what this channel carries and what the connection's eager half holds (the
    /// link failed or closed). The frames' requests are dropped with the channel's comms.
    pub(crate) fn abandon(&mut self) {
        // Sends copied into frames finished then (their count is published); those taken
        // and not copied fail when `fail_all` seals the lanes.
        self.closed.clear();
        self.open = None;
        self.taken.clear();
        self.spent_sends.clear();
        self.spent_recvs.clear();
        // Receive frames are always posted: dropping them is this comm's normal end.
        self.recv.closing();
        for frame in &mut self.recv_frames {
            frame.request = None;
        }
        self.receiving.clear();
        self.eager.fail_all();
    }
}

/// Copies early messages into their receives' memory from the frames that hold them, in
/// order, counting each in `tally` (and publishing it when due); returns whether all landed
/// (else one failed the connection, and the rest fail with it).
fn land_early(
    eager: &Eager,
    index: u16,
    frames: &[RecvFrame],
    matched: &[(u64, Posted, Early)],
    tally: &mut Tally,
) -> bool {
    for (seq, posted, early) in matched {
        let range = early.offset..early.offset + early.len as usize;
        let read = frames.get(early.frame).map(|frame| {
            frame
                .memory
                .with_bytes(|bytes| bytes.get(range).map(|b| eager.land(index, *seq, posted, b)))
        });
        match read {
            Some(Ok(Some(true))) => {
                if tally.add(early.len as usize) {
                    if let Some(count) = tally.publish() {
                        eager.recvs_finished(index, count);
                    }
                }
            }
            Some(Ok(Some(false))) => return false,
            other => {
                // Decoding checked every message against its frame, and a frame that holds
                // messages is not posted: short of a bug, neither fails.
                eager.link.fail(Error::Internal(format!(
                    "eager receive #{seq}: its message is no longer in frame {} ({other:?})",
                    early.frame
                )));
                return false;
            }
        }
    }
    true
}

/// Copies `(offset in region, offset in buffer, len)` ranges of `region` into `buffer` (host
/// memory: one operation on each for all of them; CUDA memory: a synchronous copy through
/// the driver per range, small messages only).
fn copy_in(
    region: &Region,
    mut ranges: impl Iterator<Item = (usize, usize, usize)>,
    buffer: &SharedMemory,
) -> std::result::Result<(), String> {
    let memory = region.memory();
    if memory.kind() == tcpx::MemoryKind::Host {
        return SharedMemory::copy_ranges(memory, buffer, ranges).map_err(|e| e.to_string());
    }
    buffer
        .with_bytes_mut(|bytes| {
            ranges.try_for_each(|(offset, at, len)| region.read(offset, &mut bytes[at..at + len]))
        })
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tally_is_due_every_few_small_transfers_or_every_large_one_and_keeps_the_rest() {
        let mut tally = Tally::default();
        let mut published = Vec::new();
        for _ in 0..40 {
            if tally.add(4096) {
                published.extend(tally.publish());
            }
        }
        // 16 messages of 4 KiB reach both thresholds at once.
        assert_eq!(published, [16, 32]);
        assert_eq!(tally.publish(), Some(40), "the tail of a run");
        assert_eq!(tally.publish(), None, "nothing finished since");
        assert!(tally.add(64 << 10), "one large message is due at once");
        assert_eq!(tally.publish(), Some(41));
        assert!(!tally.add(100));
        assert_eq!(tally.publish(), Some(42));
    }
}
