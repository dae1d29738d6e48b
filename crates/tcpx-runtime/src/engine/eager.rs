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
//!
//! Messages of host memory from [`crate::Config::eager_detach`] on are not copied: their
//! entries close the frame, and their bytes follow it on the comm as requests of their own,
//! sent from the application's memory (registered on the eager comm once per region, kept
//! until the region is dropped: see [`registration`]). Their sends finish when those
//! requests complete, and the sends copied after one wait for it ([`Behind`]): a lane's
//! sends finish in order. The receiver lands a detached message straight into its receive's
//! memory when it knows, before posting the request that brings it, which message that is
//! and its receive has come ([`Incoming`]): after a frame, its detached messages come next,
//! then a frame. Otherwise (the request was posted before the frame announcing the message
//! was read, or the receive has not come) the bytes arrive in a receive frame and are copied
//! out as a frame's messages are.

use std::collections::VecDeque;

use std::sync::Arc;
use std::time::Instant;

use tcpx::{MemoryRegion, RecvComm, RecvRequest, SendComm, SendRequest, SharedMemory};
use tcpx_proto::eager::{
    decode, fits, header_len, write_header, EagerEntry, EagerMessage, EAGER_ENTRY_BYTES,
    EAGER_FRAME_BYTES, EAGER_HEADER_BYTES, EAGER_MAX_DETACHED, EAGER_MAX_MESSAGES,
};

use super::channel::LinkFailed;
use crate::eager::{Delivered, Eager, Early, Outgoing, Posted};
use crate::error::{Direction, Error};
use crate::link::Link;
use crate::registry::{
    CountedRegion, Region, Registration, RegistrationCache, RegistrationCounter,
};

/// Send frames per eager comm in flight at once. Few, so that a busy connection's messages
/// gather into frames rather than spread one per request.
pub(crate) const SEND_FRAMES: usize = 2;

/// Send frame buffers per eager comm: those in flight, the open one, and one closed behind
/// it, so that copying (and finishing sends) goes on while frames are on the wire.
const SEND_BUFFERS: usize = SEND_FRAMES + 2;

/// Where a send buffer's payload starts: room for the largest header before it.
const FRAME_HEAD: usize = EAGER_HEADER_BYTES + EAGER_ENTRY_BYTES * EAGER_MAX_MESSAGES;

/// Requests a comm takes in flight at once (TCPX's window, the ABI's `MAX_REQUESTS`).
const COMM_REQUESTS: usize = 16;

/// Receive frames kept posted per eager comm.
pub(crate) const RECV_FRAMES: usize = 4;

/// Least length of a frame that announces detached messages: the built-in plugin reads
/// ahead 128 KiB past a message shorter than its [`tcpx::builtin::DIRECT_READ_MIN`] (many
/// small messages per `recv`), and after a frame of a few entries that read took the detached
/// bytes behind it into the plugin's own buffer, to be copied out again: a fifth of a
/// receiving engine's time at 64 KiB. After a message this long it reads only the next
/// header, and the detached bytes go straight into their receive. The receiver ignores what
/// follows a frame's last message. Only over the built-in plugin
/// ([`crate::eager::Eager::pad_announcing`]): over another plugin the padding would be bytes
/// on the wire for nothing. The pad is the plugin's threshold itself, so that it costs no
/// more than it must: in a stream of 64 KiB messages (about seven per frame) 32 KiB pads
/// added 6.6 % to the payload's bytes on the wire, 8 KiB pads add 1.7 %.
const ANNOUNCING_BYTES: usize = tcpx::builtin::DIRECT_READ_MIN;

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
        self.add_many(1, len)
    }

    /// Counts `n` finished transfers of `bytes` in all; returns whether the count is due.
    fn add_many(&mut self, n: u64, bytes: usize) -> bool {
        self.count += n;
        self.unpublished += n;
        self.unpublished_bytes += bytes;
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
    /// The endpoint's count of live registrations of application memory, which the
    /// channel's registrations of detached messages' regions join.
    pub(crate) counter: RegistrationCounter,
}

struct SendBuffer {
    memory: SharedMemory,
    region: MemoryRegion,
    /// Entries of the messages copied in (then of the detached ones), and the copied bytes.
    entries: Vec<EagerEntry>,
    payload: usize,
    /// The detached messages of the frame, in entry order: sent after it.
    detached: Vec<Detached>,
    /// Requests of the detached messages posted so far, right after the frame's own, in
    /// order (kept with the buffer so a frame allocates nothing).
    payloads: Vec<SendRequest>,
}

/// A message sent from the application's memory right after its frame.
struct Detached {
    /// The send's region, counted until the request completes (see `Kept`), and its
    /// registration here.
    _region: Region,
    registered: Arc<Registration>,
    offset: usize,
    len: u32,
}

/// The registration of `region` on one of an eager channel's comms (`direction`: its send or
/// its receive comm; `register` makes one there) for a detached message, made on first use,
/// cached in `cache` and counted in `counter`, and kept until the region is dropped: the
/// region points back at the cache weakly, as it does at its links' caches, so the
/// application's memory is never held by it. An earlier version held the region and let
/// every registration go whenever the engine slept, so a burst after a pause registered its
/// regions again (seven registrations inside each timed window of `tcpx-bench` at 64 KiB,
/// once they were counted).
fn registration(
    cache: &Arc<RegistrationCache>,
    counter: &RegistrationCounter,
    region: &Region,
    direction: Direction,
    register: impl FnOnce(&SharedMemory) -> tcpx::Result<MemoryRegion>,
) -> tcpx::Result<Arc<Registration>> {
    if let Some(registered) = cache.get(region, direction) {
        return Ok(registered);
    }
    let registration = Registration {
        by_channel: vec![CountedRegion::new(register(region.memory())?, counter)],
    };
    Ok(cache.insert(region, direction, registration))
}

/// A detached send in flight and the copied sends after it (up to the next detached one),
/// which finish with it.
#[derive(Clone, Copy, Default)]
struct Blocked {
    len: u32,
    copied: u64,
    copied_bytes: usize,
}

/// A closed send frame: posted (with its request) or waiting for room.
struct Closed {
    buffer: usize,
    /// Where the frame starts in its buffer, and its length.
    start: usize,
    len: usize,
    request: Option<SendRequest>,
    /// Of the frame's request and its buffer's payloads', how many completed (in that
    /// order).
    sent: usize,
    /// When it was posted: a frame the peer does not take within the link's timeout fails
    /// the connection, as the sends it carries would have.
    posted_at: Instant,
}

/// What a posted request of the eager receive comm brings, in posting order.
enum Incoming {
    /// Receive frame `frame`: a frame, or the bytes of detached message `payload`.
    Buffer {
        frame: usize,
        payload: Option<EagerEntry>,
    },
    /// A detached message, straight into its receive's memory (held inline: the queue's
    /// room is allocated once, and a message of its own must not allocate).
    Direct(Direct),
}

/// A detached message received into its receive's memory.
struct Direct {
    seq: u64,
    posted: Posted,
    request: RecvRequest,
    /// The receive's memory, counted while the plugin writes into it (see `Kept`), and
    /// registered on the comm (kept while the request is posted).
    _memory: Region,
    _registered: Arc<Registration>,
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
    /// Receive requests posted, oldest first.
    receiving: VecDeque<Incoming>,
    /// Of those, how many are [`Incoming::Direct`] (they are tested while no receive waits).
    directs: usize,
    /// Detached messages announced by a frame read, whose requests are not posted yet: the
    /// next requests posted bring them, in order.
    expected: VecDeque<EagerEntry>,
    /// Whether the last frame read announced detached messages (see `post_receives`).
    announced: bool,
    /// Receives of this channel this engine took off the inbox's queue, and the last total
    /// it read of those queued ([`Eager::posted_total`]): while the latter is ahead, a
    /// receive waits, and the application's counter need not be read again.
    recvs_taken: u64,
    recvs_seen: u64,
    /// This channel's sends copied and receives landed, ever (published to the connection's
    /// lanes, see [`crate::transfer::in_order`]).
    sends_copied: Tally,
    recvs_landed: Tally,
    /// Sends that cannot finish yet: each detached send still on the wire, with the copied
    /// sends behind it, oldest first.
    behind: VecDeque<Blocked>,
    /// Registrations of application regions on this channel's comms, for detached
    /// messages: `Send` on the send comm, `Recv` on the receive comm (see [`registration`]).
    registrations: Arc<RegistrationCache>,
    /// The endpoint's count of live registrations, which these join.
    counter: RegistrationCounter,
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
            counter,
        } = new;
        // Resident from the start (about 2 MiB per channel and side), on purpose: mapped lazily
        // (zero pages faulted in on first touch) a connection's set-up took 2-3 ms instead of
        // 4-7 and 33 MiB less memory per pair, but its first small messages paid the faults
        // (a first 16 KiB send/recv 77-118 us against 28-36); populated with
        // MADV_POPULATE_WRITE at set-up it took 12-43 ms, where the allocator reuses freed heap
        // (H100, twentieth session of issue 25, `examples/first_connection`).
        let send_buffers = (0..SEND_BUFFERS)
            .map(|_| {
                let memory = SharedMemory::host(FRAME_HEAD + EAGER_FRAME_BYTES)?;
                let region = send.register(&memory)?;
                Ok(SendBuffer {
                    memory,
                    region,
                    entries: Vec::with_capacity(EAGER_MAX_MESSAGES),
                    payload: 0,
                    detached: Vec::with_capacity(EAGER_MAX_DETACHED),
                    payloads: Vec::with_capacity(EAGER_MAX_DETACHED),
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
            receiving: VecDeque::with_capacity(COMM_REQUESTS),
            directs: 0,
            expected: VecDeque::with_capacity(EAGER_MAX_DETACHED),
            announced: false,
            recvs_taken: 0,
            recvs_seen: 0,
            sends_copied: Tally::default(),
            recvs_landed: Tally::default(),
            behind: VecDeque::new(),
            registrations: Arc::new(RegistrationCache::default()),
            counter,
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
        self.has_send_work()
            || self.directs > 0
            || self.receive_waits()
            || self.eager.has_matched(self.index)
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
        let direct = self.receiving.iter().find_map(|item| match item {
            Incoming::Direct(d) => Some(d),
            Incoming::Buffer { .. } => None,
        });
        if let Some(d) = direct.filter(|d| now >= d.posted_at + self.link().timeout) {
            return Some(format!(
                "eager receive #{} of {} bytes (detached)",
                d.seq,
                d.posted.target().2
            ));
        }
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

    /// Releases the counts of regions whose transfers all finished: the engine is about to
    /// sleep, so nothing streams on this channel (see [`crate::eager`]'s `Kept`).
    pub(crate) fn release_finished(&mut self) {
        self.eager.release_finished(self.index);
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

    /// Retires sent frames (with their detached messages), oldest first: their buffers
    /// become free, and their detached sends finish.
    fn retire_sent(&mut self) -> Result<bool, LinkFailed> {
        let mut messages = 0;
        let mut bytes = 0u64;
        'frames: while let Some(oldest) = self.closed.front_mut() {
            let buffer = &mut self.send_buffers[oldest.buffer];
            // The frame's request, then its payloads': the plugin completes them in order.
            while oldest.sent <= buffer.detached.len() {
                let request = match oldest.sent {
                    0 => oldest.request.as_mut(),
                    k => buffer.payloads.get_mut(k - 1),
                };
                let Some(request) = request else {
                    break 'frames;
                };
                match self.send.test(request) {
                    Ok(Some(_)) => oldest.sent += 1,
                    Ok(None) => break 'frames,
                    Err(e) => {
                        let failed = self.plugin_error(Direction::Send, e);
                        return Err(failed);
                    }
                }
            }
            let b = oldest.buffer;
            self.closed.pop_front();
            let buffer = &mut self.send_buffers[b];
            messages += buffer.entries.len();
            bytes += buffer.payload as u64;
            for detached in buffer.detached.drain(..) {
                bytes += u64::from(detached.len);
                // Each detached send is the oldest one blocked (frames retire in order).
                if let Some(blocked) = self.behind.pop_front() {
                    let due = self.sends_copied.add(blocked.len as usize);
                    if due
                        | self
                            .sends_copied
                            .add_many(blocked.copied, blocked.copied_bytes)
                    {
                        if let Some(count) = self.sends_copied.publish() {
                            self.eager.sends_finished(self.index, count);
                        }
                    }
                }
            }
            buffer.entries.clear();
            buffer.payloads.clear();
            buffer.payload = 0;
            self.free.push(b);
            self.progress_at = Instant::now();
        }
        if messages == 0 {
            return Ok(false);
        }
        self.publish_sends();
        // Channel `index`'s counters: this engine owns both the channel and its eager channel
        // (one writer).
        if let Some(counters) = self.eager.link.counters.get(usize::from(self.index)) {
            counters.sent(bytes);
        }
        self.eager.sent(self.index, messages);
        Ok(true)
    }

    /// Copies taken sends into the open frame (opening and closing frames as they fill) and
    /// finishes them, until they are all copied or every buffer is closed.
    fn copy_taken(&mut self) -> Result<bool, LinkFailed> {
        let mut moved = false;
        let detach_from = self.eager.detach_from;
        while let Some(first) = self.taken.front() {
            let detach = detaches(detach_from, first);
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
            if detach {
                // Its entry only; its bytes follow the frame from its own memory.
                if buffer.detached.len() >= EAGER_MAX_DETACHED
                    || !fits(buffer.entries.len(), buffer.payload, 0)
                {
                    self.close_open()?;
                    continue;
                }
                let registered = match registration(
                    &self.registrations,
                    &self.counter,
                    &first.region,
                    Direction::Send,
                    |m| self.send.register(m),
                ) {
                    Ok(registered) => registered,
                    Err(e) => {
                        let what = format!(
                            "eager send #{}: registering its memory on eager channel {}: {e}",
                            first.seq, self.index
                        );
                        return Err(self.fail_sends(what));
                    }
                };
                let Some(m) = self.taken.pop_front() else {
                    break;
                };
                buffer.entries.push(EagerEntry {
                    seq: m.seq,
                    len: m.len,
                    detached: true,
                });
                self.behind.push_back(Blocked {
                    len: m.len,
                    ..Blocked::default()
                });
                buffer.detached.push(Detached {
                    // Counted while the plugin sends from its memory, whatever becomes of
                    // the connection's count (see `Kept`).
                    _region: Region::clone(&m.region),
                    registered,
                    offset: m.offset,
                    len: m.len,
                });
                moved = true;
                continue;
            }
            // A frame's inline messages come before its detached ones.
            if !buffer.detached.is_empty() || !fits(buffer.entries.len(), buffer.payload, first.len)
            {
                self.close_open()?;
                continue;
            }
            // The run: the next messages that fit this frame and are copied together — from
            // the same host region, one operation on it (its state atomic is written once per
            // run, not twice per message from every engine that copies out of it), or from
            // CUDA memory of one GPU, whatever the regions, one copy list.
            let (mut entries, mut payload) = (buffer.entries.len(), buffer.payload);
            let run = self
                .taken
                .iter()
                .take_while(|m| {
                    let take = m.region.copied_with(&first.region)
                        && !detaches(detach_from, m)
                        && fits(entries, payload, m.len);
                    if take {
                        entries += 1;
                        payload += m.len as usize;
                    }
                    take
                })
                .count();
            let ranges = self.taken.iter().take(run).scan(buffer.payload, |at, m| {
                let range = (&*m.region, m.offset, FRAME_HEAD + *at, m.len as usize);
                *at += m.len as usize;
                Some(range)
            });
            if let Err(e) = copy_in(&first.region, ranges, &buffer.memory) {
                // The receives these messages match would wait forever: the connection fails
                // (and with it these sends and the ones after them).
                let what = format!("eager sends from #{} ({run} messages): {e}", first.seq);
                return Err(self.fail_sends(what));
            }
            for _ in 0..run {
                let Some(m) = self.taken.pop_front() else {
                    break;
                };
                buffer.entries.push(EagerEntry {
                    seq: m.seq,
                    len: m.len,
                    detached: false,
                });
                buffer.payload += m.len as usize;
                if let Some(blocked) = self.behind.back_mut() {
                    // Finishes with the detached send before it.
                    blocked.copied += 1;
                    blocked.copied_bytes += m.len as usize;
                } else if self.sends_copied.add(m.len as usize) {
                    if let Some(count) = self.sends_copied.publish() {
                        self.eager.sends_finished(self.index, count);
                    }
                }
            }
            moved = true;
        }
        self.publish_sends();
        Ok(moved)
    }

    /// Finishes the sends copied so far and fails the connection with `what` (memory the
    /// channel could not take a send from): the sends after them fail with it.
    fn fail_sends(&mut self, what: String) -> LinkFailed {
        self.publish_sends();
        self.link().fail(Error::InvalidArgument(what));
        LinkFailed
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
        // A frame followed by detached messages goes out at least `ANNOUNCING_BYTES` long
        // over the built-in plugin (the receiver reads no further than the frame's own end;
        // see the constant).
        let mut len = head + buffer.payload;
        if !buffer.detached.is_empty() && self.eager.pad_announcing {
            len = len.max(ANNOUNCING_BYTES);
        }
        self.closed.push_back(Closed {
            buffer: b,
            start,
            len,
            request: None,
            sent: 0,
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
            if posted > 0 && !self.post_payloads(posted - 1, &mut moved)? {
                break;
            }
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

    /// Posts the detached messages of posted frame `k` that are not posted yet, right behind
    /// it (nothing else is posted on the comm before they all are); returns whether they all
    /// are now.
    fn post_payloads(&mut self, k: usize, moved: &mut bool) -> Result<bool, LinkFailed> {
        let buffer = &mut self.send_buffers[self.closed[k].buffer];
        while let Some(d) = buffer.detached.get(buffer.payloads.len()) {
            match self.send.isend(
                &d.registered.by_channel[0].region,
                d.offset,
                d.len as usize,
                0,
            ) {
                Ok(Some(request)) => {
                    buffer.payloads.push(request);
                    *moved = true;
                }
                Ok(None) => return Ok(false),
                Err(e) => {
                    let failed = self.plugin_error(Direction::Send, e);
                    return Err(failed);
                }
            }
        }
        Ok(true)
    }

    /// Tests and posts receive frames only while a receive of this channel waits for its
    /// message. Frames of one channel arrive in sequence order and receives are posted in
    /// sequence order, so a message nobody waits for yet can only sit behind one that is
    /// waited for: stopping then loses nothing, keeps what the application has not asked for
    /// in TCP (flow control, as behind a plugin request), and spares every engine pass the
    /// plugin call (a `recv` syscall on the socket plugin) of testing an idle comm.
    fn pump_recv(&mut self) -> Result<bool, LinkFailed> {
        let mut moved = self.land_matched()?;
        if self.directs == 0 && self.expected.is_empty() && !self.receive_waits() {
            return Ok(moved);
        }
        // Whether a receive of the inbox still waits (frames are read ahead only then).
        let mut waits = true;
        loop {
            // Direct receives were taken already: they are tested whether or not a receive
            // of the inbox waits.
            if self.directs == 0 && !self.receive_waits() {
                waits = false;
                break;
            }
            let Some(front) = self.receiving.front_mut() else {
                break;
            };
            match front {
                Incoming::Buffer { frame: i, payload } => {
                    let (i, payload) = (*i, *payload);
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
                        // The bytes are in our own host buffer: hand the slot back before
                        // reading.
                        if let Err(e) = self.recv.consumed(request) {
                            return Err(self.plugin_error(Direction::Recv, e));
                        }
                    }
                    self.progress_at = Instant::now();
                    moved = true;
                    self.take_delivery(i, size, payload)?;
                }
                Incoming::Direct(direct) => {
                    let size = match self.recv.test(&mut direct.request) {
                        Ok(Some(size)) => size,
                        Ok(None) => break,
                        Err(e) => return Err(self.plugin_error(Direction::Recv, e)),
                    };
                    let Some(Incoming::Direct(direct)) = self.receiving.pop_front() else {
                        break;
                    };
                    self.directs -= 1;
                    let Direct {
                        seq,
                        posted,
                        request,
                        ..
                    } = direct;
                    if let Err(e) = self.recv.consumed(request) {
                        return Err(self.plugin_error(Direction::Recv, e));
                    }
                    self.progress_at = Instant::now();
                    moved = true;
                    self.land_direct(seq, &posted, size)?;
                }
            }
        }
        // A run of direct receives ends here: publish what it finished.
        self.publish_recvs();
        self.post_receives(waits, &mut moved)?;
        Ok(moved)
    }

    /// Finishes a receive whose detached message the plugin wrote into its memory.
    fn land_direct(&mut self, seq: u64, posted: &Posted, size: usize) -> Result<(), LinkFailed> {
        let len = posted.target().2;
        if size != len as usize {
            self.eager.fail_mismatch(self.index, seq, size, len);
            return Err(LinkFailed);
        }
        if let Some(counters) = self.eager.link.counters.get(usize::from(self.index)) {
            counters.received(u64::from(len));
        }
        if self.recvs_landed.add(len as usize) {
            self.publish_recvs();
        }
        Ok(())
    }

    /// Posts receive requests: first for the detached messages announced and not yet asked
    /// for (each straight into its receive's memory when that receive has come, else into a
    /// receive frame), then, when a receive `waits`, receive frames for what comes next. After
    /// a frame that announced detached messages, only the one frame known to follow them is
    /// posted, so that the next frame's detached messages find their requests unposted and
    /// go straight into their receives too.
    fn post_receives(&mut self, waits: bool, moved: &mut bool) -> Result<(), LinkFailed> {
        while let Some(&entry) = self.expected.front() {
            if self.receiving.len() >= COMM_REQUESTS {
                return Ok(());
            }
            if self.post_direct(entry)? {
                self.expected.pop_front();
                *moved = true;
                continue;
            }
            let Some(i) = self.free_frame() else {
                return Ok(());
            };
            if !self.post_frame(i, Some(entry))? {
                return Ok(());
            }
            self.expected.pop_front();
            *moved = true;
        }
        if !waits {
            return Ok(());
        }
        let unknown = |r: &VecDeque<Incoming>| {
            r.iter()
                .filter(|item| matches!(item, Incoming::Buffer { payload: None, .. }))
                .count()
        };
        while !self.announced || unknown(&self.receiving) == 0 {
            let Some(i) = self.free_frame() else {
                break;
            };
            if !self.post_frame(i, None)? {
                break;
            }
            *moved = true;
        }
        Ok(())
    }

    /// A receive frame neither posted nor holding early messages.
    fn free_frame(&self) -> Option<usize> {
        self.recv_frames
            .iter()
            .position(|f| f.request.is_none() && f.kept == 0)
    }

    /// Posts receive frame `i` for a frame or for detached message `payload`; returns
    /// whether the plugin took it.
    fn post_frame(&mut self, i: usize, payload: Option<EagerEntry>) -> Result<bool, LinkFailed> {
        let frame = &mut self.recv_frames[i];
        match self.recv.irecv(&frame.region, 0, EAGER_FRAME_BYTES, 0) {
            Ok(Some(request)) => {
                frame.request = Some(request);
                self.receiving
                    .push_back(Incoming::Buffer { frame: i, payload });
                Ok(true)
            }
            Ok(None) => Ok(false),
            Err(e) => Err(self.plugin_error(Direction::Recv, e)),
        }
    }

    /// Posts the request of detached message `entry` straight into its receive's memory, if
    /// that receive has come and is host memory; returns whether it did.
    fn post_direct(&mut self, entry: EagerEntry) -> Result<bool, LinkFailed> {
        let Some(posted) = self.eager.take_posted(self.index, entry.seq) else {
            return Ok(false);
        };
        let (region, offset, len) = posted.target();
        if region.memory().kind() != tcpx::MemoryKind::Host || region.is_staged() {
            self.eager.untake_posted(self.index, entry.seq, posted);
            return Ok(false);
        }
        if len != entry.len {
            self.eager
                .fail_mismatch(self.index, entry.seq, entry.len as usize, len);
            return Err(LinkFailed);
        }
        let registered = match registration(
            &self.registrations,
            &self.counter,
            region,
            Direction::Recv,
            |m| self.recv.register(m),
        ) {
            Ok(registered) => registered,
            Err(e) => {
                self.link().fail(Error::InvalidArgument(format!(
                    "eager receive #{}: registering its memory on eager channel {}: {e}",
                    entry.seq, self.index
                )));
                return Err(LinkFailed);
            }
        };
        match self
            .recv
            .irecv(&registered.by_channel[0].region, offset, len as usize, 0)
        {
            Ok(Some(request)) => {
                self.receiving.push_back(Incoming::Direct(Direct {
                    seq: entry.seq,
                    _memory: Region::clone(region),
                    posted,
                    request,
                    _registered: registered,
                    posted_at: Instant::now(),
                }));
                self.directs += 1;
                self.recvs_taken += 1;
                Ok(true)
            }
            Ok(None) => {
                self.eager.untake_posted(self.index, entry.seq, posted);
                Ok(false)
            }
            Err(e) => {
                self.eager.untake_posted(self.index, entry.seq, posted);
                Err(self.plugin_error(Direction::Recv, e))
            }
        }
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
        for (_, _, early) in self.matched.drain(..) {
            if let Some(frame) = self.recv_frames.get_mut(early.frame) {
                frame.kept = frame.kept.saturating_sub(1);
            }
        }
    }

    /// Decodes received frame `i` (`size` bytes; the bytes of detached message `payload`
    /// when given) and hands its messages over: the early messages whose receives came since
    /// the last pass land first (their receives were posted first), then the frame's own.
    /// The detached messages a frame announces are assigned to the requests posted after it,
    /// in order, and the rest are expected (see `post_receives`).
    fn take_delivery(
        &mut self,
        i: usize,
        size: usize,
        payload: Option<EagerEntry>,
    ) -> Result<(), LinkFailed> {
        let (eager, index) = (&self.eager, self.index);
        let frames = &self.recv_frames;
        let (decoded, landed, matched) = (&mut self.decoded, &mut self.landed, &mut self.matched);
        let tally = &mut self.recvs_landed;
        let (receiving, expected) = (&mut self.receiving, &mut self.expected);
        let announced = &mut self.announced;
        let read = frames[i].memory.with_bytes(|bytes| {
            let frame = &bytes[..size.min(bytes.len())];
            if let Some(entry) = payload {
                // The bytes of a detached message, alone: the whole plugin message, or the
                // whole posted buffer from a plugin that reports no sizes.
                let len = entry.len as usize;
                if frame.len() != len && frame.len() != EAGER_FRAME_BYTES {
                    eager.violation(
                        index,
                        format!(
                            "detached message #{} of {len} bytes came as {} bytes",
                            entry.seq,
                            frame.len()
                        ),
                    );
                    return None;
                }
                decoded.clear();
                decoded.push(EagerMessage { entry, offset: 0 });
            } else {
                if let Err(e) = decode(frame, eager.max_message, decoded) {
                    eager.violation(index, e.to_string());
                    return None;
                }
                // Detached messages (after the inline ones) come in the next requests: those
                // posted already (receive frames posted before this frame was read: nothing
                // was known of what they would bring), then ones not posted yet.
                let inline = decoded
                    .iter()
                    .position(|m| m.entry.detached)
                    .unwrap_or(decoded.len());
                *announced = inline < decoded.len();
                let mut detached = decoded[inline..].iter().map(|m| m.entry);
                for item in receiving.iter_mut().take(decoded.len() - inline) {
                    let Incoming::Buffer {
                        payload: slot @ None,
                        ..
                    } = item
                    else {
                        eager.link.fail(Error::Internal(format!(
                            "eager channel {index}: a request posted after an unread frame \
                             already has a message"
                        )));
                        return None;
                    };
                    *slot = detached.next();
                }
                expected.extend(detached);
                decoded.truncate(inline);
                if decoded.is_empty() {
                    return Some(Delivered::default());
                }
            }
            if let Some(counters) = eager.link.counters.get(usize::from(index)) {
                counters.received(decoded.iter().map(|m| u64::from(m.entry.len)).sum());
            }
            let delivered = eager.deliver(index, i, decoded, landed, matched);
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
        self.landed.clear();
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
        self.behind.clear();
        self.registrations.clear();
        self.expected.clear();
        self.directs = 0;
        for buffer in &mut self.send_buffers {
            buffer.detached.clear();
            buffer.payloads.clear();
        }
        // Receive frames are always posted: dropping them is this comm's normal end.
        self.recv.closing();
        for frame in &mut self.recv_frames {
            frame.request = None;
        }
        // Direct receives fail with the lanes (`fail_all`); their requests go with the comm.
        self.receiving.clear();
        self.eager.fail_all();
    }
}

/// Copies early messages into their receives' memory from the frames that hold them, in
/// order, counting each in `tally` (and publishing it when due); returns whether all landed
/// (else one failed the connection, and the rest fail with it). Consecutive messages of one
/// frame whose receives are copied together ([`Region::copied_with`]: one host region, or
/// CUDA memory of one GPU) land as one copy: a receiver that fell behind a stream of small
/// GPU messages pays a GPU round trip per run, not per message.
fn land_early(
    eager: &Eager,
    index: u16,
    frames: &[RecvFrame],
    matched: &[(u64, Posted, Early)],
    tally: &mut Tally,
) -> bool {
    let mut rest = matched;
    while let Some((seq, _, early)) = rest.first() {
        let (now, after) = rest.split_at(Eager::early_run(rest));
        rest = after;
        let read = frames.get(early.frame).map(|frame| {
            frame.memory.with_bytes(|bytes| {
                // Decoding checked every message against its frame.
                let inside = now
                    .iter()
                    .all(|(_, _, e)| bytes.get(e.offset..e.offset + e.len as usize).is_some());
                inside.then(|| match now {
                    [(seq, posted, early)] => {
                        let range = early.offset..early.offset + early.len as usize;
                        eager.land(index, *seq, posted, &bytes[range])
                    }
                    _ => eager.land_early_run(now, bytes),
                })
            })
        });
        match read {
            Some(Ok(Some(true))) => {
                for (_, _, e) in now {
                    if tally.add(e.len as usize) {
                        if let Some(count) = tally.publish() {
                            eager.recvs_finished(index, count);
                        }
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

/// Whether `m` leaves detached: host memory of at least `detach_from` bytes (0: never). CUDA
/// memory is copied through a host bounce (the plugin may not take it from there).
fn detaches(detach_from: u32, m: &Outgoing) -> bool {
    detach_from > 0
        && m.len >= detach_from
        && m.region.memory().kind() == tcpx::MemoryKind::Host
        && !m.region.is_staged()
}

/// Copies `(region, offset in it, offset in buffer, len)` ranges into `buffer`, back to back
/// in it (a frame's run: regions copied with `first`, see [`Region::copied_with`]). Host
/// memory (then one region): one operation on each for all of them. CUDA memory: one copy list through the GPU's small copier (a batched copy or
/// one kernel launch, one wait, see [`tcpx::cuda::SmallCopier`]) for the whole run — a GPU
/// round trip costs 6–8 µs on an H200 VM whatever the size, so a frame of sixteen 4 KiB
/// messages pays it once, not sixteen times (a synchronous copy per message ran 4 KiB GPU
/// messages at 0.25 GB/s).
fn copy_in<'r>(
    first: &Region,
    ranges: impl Iterator<Item = (&'r Region, usize, usize, usize)>,
    buffer: &SharedMemory,
) -> std::result::Result<(), String> {
    let memory = first.memory();
    if memory.kind() == tcpx::MemoryKind::Host {
        // One region (see `Region::copied_with`).
        let ranges = ranges.map(|(_, offset, at, len)| (offset, at, len));
        return SharedMemory::copy_ranges(memory, buffer, ranges).map_err(|e| e.to_string());
    }
    let copier = first.small_copier().map_err(|e| e.to_string())?;
    let mut ranges = ranges.peekable();
    let Some(&(_, _, start, _)) = ranges.peek() else {
        return Ok(());
    };
    // The run's ranges follow each other in the frame (see the caller): one destination.
    let (mut next, mut apart) = (start, false);
    let pieces = ranges.map_while(|(region, offset, at, len)| {
        apart |= at != next;
        next += len;
        (!apart).then_some((region.memory(), offset, len))
    });
    let total = buffer
        .with_bytes_mut(|bytes| {
            let out = bytes.get_mut(start..).unwrap_or_default();
            copier.gather_to(pieces, out)
        })
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
    if apart || start + total != next {
        return Err(format!(
            "a run of GPU messages was not copied back to back into its frame ({total} bytes \
             from offset {start})"
        ));
    }
    Ok(())
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
