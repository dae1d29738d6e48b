//! Small two-sided messages in eager frames: what a connection shares with the engines that
//! carry them.
//!
//! A send or receive of 1 byte up to the connection's agreed eager size (see
//! [`tcpx_proto::eager`] and [`crate::Config::eager_bytes`]) takes no job and no plugin
//! request of its own. Message `seq` belongs to eager channel
//! [`channel_of`]`(seq, channels)` — runs of [`tcpx_proto::eager::EAGER_RUN`] consecutive
//! messages per channel — on both sides. A send queues its message in that channel's share
//! of the connection's [`Eager`] state, in sequence order; the channel's engine takes as many
//! queued messages as fit a frame, copies them into it and sends the frame as one request. A
//! receive names its sequence number in the same channel's inbox; the engine whose frame
//! brings that message copies it into the receive's memory and finishes it. A message that
//! arrives before its receive is kept (bounded) until the receive comes.
//!
//! The state is split by channel because one shared outbox and inbox, which every engine of
//! the connection polled and locked, ran 4 KiB messages at 1.3 GB/s on 16 cores: the
//! engines and the application queued behind each other on two locks. Split, each lock is
//! met by one engine and the application only.
//!
//! Why frames and not one request per message: each request costs a job, a hand-off to an
//! engine and a completion (about 2 µs of the sending thread's time), and TCPX admits 16
//! requests per comm; 4 KiB messages one by one ran at 0.05–0.14 × raw TCP (issue 25). A
//! frame is formed from whatever queued while the comm's previous frames were in flight, so a
//! lone message still leaves at once (one message, one frame) and a stream of them shares
//! requests as soon as the comm is busy — Nagle's batching without its timer.
//!
//! Both sides know which messages go eager from the length alone (a send and the receive it
//! matches have the same length), so the connection's other comms keep their posting order:
//! eager frames ride comms of their own.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tcpx_proto::eager::{channel_of, fits, EagerEntry, EagerMessage};

use crate::error::{Direction, Error, Result};
use crate::link::Link;
use crate::registry::Region;
use crate::transfer::{Completion, Transfer};

/// Bytes of messages that arrived before their receives, per eager channel, past which the
/// peer is misbehaving. An engine reads a channel only while one of its receives waits, and
/// a channel's messages arrive in sequence order, so a well-behaved peer leaves at most the
/// rest of one frame (256 KiB) ahead of the receives.
pub(crate) const EARLY_BYTES_MAX: usize = 8 << 20;

/// A queued small send.
pub(crate) struct Outgoing {
    /// The send's sequence number (the receive it matches).
    pub(crate) seq: u64,
    /// Where its bytes are; held until the frame carrying them is sent.
    pub(crate) region: Region,
    pub(crate) offset: usize,
    pub(crate) len: u32,
    pub(crate) completion: Arc<Completion>,
    pub(crate) deadline: Instant,
}

impl Outgoing {
    /// The frame entry of this message.
    pub(crate) fn entry(&self) -> EagerEntry {
        EagerEntry {
            seq: self.seq,
            len: self.len,
        }
    }
}

/// A posted small receive.
pub(crate) struct Posted {
    region: Region,
    offset: usize,
    len: u32,
    completion: Arc<Completion>,
    deadline: Instant,
}

/// One channel's receives and arrivals. A channel's messages arrive in sequence order (its
/// frames leave in that order on one comm) and its receives are posted in that order, so
/// both are queues, and at most one of them holds anything: a message either finds the
/// oldest waiting receive or waits itself for the next receive.
#[derive(Default)]
struct Inbox {
    /// Receives waiting for their message, oldest first.
    posted: VecDeque<(u64, Posted)>,
    /// Messages that arrived before their receive, oldest first.
    early: VecDeque<(u64, Vec<u8>)>,
    early_bytes: usize,
    /// Early messages whose receive has come: the channel's engine copies them in (so that
    /// the application's thread, which posts every receive, does not copy every byte).
    matched: Vec<(u64, Posted, Vec<u8>)>,
}

/// One eager channel's share: its outbox and inbox, and counters its engine reads without
/// the locks. Aligned to keep two channels' counters off one cache line.
#[derive(Default)]
#[repr(align(128))]
struct Share {
    outbox: Mutex<VecDeque<Outgoing>>,
    /// Messages in the outbox.
    queued: AtomicUsize,
    inbox: Mutex<Inbox>,
    /// Receives waiting.
    waiting: AtomicUsize,
    /// Entries in `matched`.
    matched: AtomicUsize,
}

impl Share {
    fn outbox(&self) -> MutexGuard<'_, VecDeque<Outgoing>> {
        self.outbox.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn inbox(&self) -> MutexGuard<'_, Inbox> {
        self.inbox.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The eager half of one connection: per eager channel, the outbox of small sends and the
/// inbox of small receives.
pub(crate) struct Eager {
    /// Largest message of the eager path on this connection (agreed in `Hello`).
    pub(crate) max_message: u32,
    /// The connection's two-sided link: its failure, timeout, in-flight count and engines.
    pub(crate) link: Arc<Link>,
    spin: Duration,
    shares: Vec<Share>,
}

impl std::fmt::Debug for Eager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Eager")
            .field("max_message", &self.max_message)
            .field("channels", &self.shares.len())
            .finish()
    }
}

impl Eager {
    /// The eager state of a connection with `channels` eager channels.
    pub(crate) fn new(max_message: u32, link: Arc<Link>, spin: Duration, channels: u16) -> Self {
        Self {
            max_message,
            link,
            spin,
            shares: (0..channels.max(1)).map(|_| Share::default()).collect(),
        }
    }

    /// Whether a contiguous message of `len` bytes travels eager on this connection.
    pub(crate) fn carries(&self, len: usize) -> bool {
        len >= 1 && len <= self.max_message as usize
    }

    /// The eager channel of message `seq`.
    fn channel_of(&self, seq: u64) -> u16 {
        // `shares` has between 1 and u16::MAX entries.
        channel_of(seq, self.shares.len() as u16)
    }

    fn share(&self, channel: u16) -> &Share {
        &self.shares[usize::from(channel) % self.shares.len()]
    }

    /// Sends queued on `channel`, not yet in a frame.
    pub(crate) fn queued(&self, channel: u16) -> usize {
        self.share(channel).queued.load(Ordering::Acquire)
    }

    /// Receives of `channel` waiting for their message, or for its engine to copy it in.
    pub(crate) fn waiting(&self, channel: u16) -> usize {
        let share = self.share(channel);
        share.waiting.load(Ordering::Acquire) + share.matched.load(Ordering::Acquire)
    }

    /// Copies in the early messages of `channel` whose receives have come since the last
    /// call, and finishes those receives; `scratch` is the engine's reusable list. Returns
    /// whether there were any.
    pub(crate) fn land_matched(
        &self,
        channel: u16,
        scratch: &mut Vec<(u64, Posted, Vec<u8>)>,
    ) -> bool {
        let share = self.share(channel);
        if share.matched.load(Ordering::Acquire) == 0 {
            return false;
        }
        {
            let mut inbox = share.inbox();
            std::mem::swap(&mut inbox.matched, scratch);
            share.matched.store(0, Ordering::Release);
        }
        for (seq, posted, bytes) in scratch.drain(..) {
            self.land(channel, seq, &posted, &bytes);
        }
        true
    }

    /// Receives of `channel` posted and waiting for their message to arrive.
    pub(crate) fn posted(&self, channel: u16) -> usize {
        self.share(channel).waiting.load(Ordering::Acquire)
    }

    /// Queues send `seq` of `len` bytes at `offset` in `region` (the caller holds the send
    /// order, so each outbox stays in sequence order and frames carry rising numbers).
    pub(crate) fn send(&self, seq: u64, region: &Region, offset: usize, len: usize) -> Transfer {
        let completion = Arc::new(Completion::default());
        let link = &self.link;
        link.in_flight.fetch_add(1, Ordering::AcqRel);
        let message = Outgoing {
            seq,
            region: region.clone(),
            offset,
            // `carries` checked it: at most 64 KiB.
            len: len as u32,
            completion: completion.clone(),
            deadline: Instant::now() + link.timeout,
        };
        let channel = self.channel_of(seq);
        let share = self.share(channel);
        let was_empty = {
            let mut outbox = share.outbox();
            outbox.push_back(message);
            share.queued.store(outbox.len(), Ordering::Release);
            outbox.len() == 1
        };
        if was_empty {
            // The channel's engine may be asleep; a busy one polls the count anyway.
            link.wake_one(u64::from(channel));
        }
        // A failure between the check and the push: the engines may have swept already.
        if link.is_failed() {
            self.fail_all();
        }
        Transfer::new(completion, Direction::Send, len as u64, self.spin)
    }

    /// Takes the sends queued on `channel` that fit one frame into `out` (in sequence order;
    /// emptied first). Returns the payload bytes taken. Takes nothing while the application
    /// is queuing (never blocks the engine; it comes back on its next pass).
    pub(crate) fn take_frame(&self, channel: u16, out: &mut Vec<Outgoing>) -> usize {
        out.clear();
        let share = self.share(channel);
        let mut payload = 0usize;
        let mut outbox = match share.outbox.try_lock() {
            Ok(outbox) => outbox,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return 0,
        };
        while let Some(next) = outbox.front() {
            if !fits(out.len(), payload, next.len) {
                break;
            }
            payload += next.len as usize;
            // `front` was Some.
            out.extend(outbox.pop_front());
        }
        share.queued.store(outbox.len(), Ordering::Release);
        payload
    }

    /// Posts receive `seq` of `len` bytes into `region` at `offset` (the caller holds the
    /// receive order). A message that already arrived goes to the channel's engine, which
    /// copies it in.
    pub(crate) fn recv(&self, seq: u64, region: &Region, offset: usize, len: usize) -> Transfer {
        let completion = Arc::new(Completion::default());
        let link = &self.link;
        link.in_flight.fetch_add(1, Ordering::AcqRel);
        let transfer = Transfer::new(completion.clone(), Direction::Recv, len as u64, self.spin);
        let posted = Posted {
            region: region.clone(),
            offset,
            len: len as u32,
            completion,
            deadline: Instant::now() + link.timeout,
        };
        let channel = self.channel_of(seq);
        let share = self.share(channel);
        let mut inbox = share.inbox();
        // Whether this is the first piece of work of its kind: the engine may be asleep.
        let first = match inbox.early.front() {
            Some(&(head, _)) if head != seq => {
                // The next message of this channel is not the next receive of it: the peer
                // sent out of order or on the wrong channel.
                drop(inbox);
                self.violation(
                    channel,
                    format!("message #{head} arrived where #{seq} was due"),
                );
                self.finish(&posted.completion, Err(self.link.failure_or_closed()));
                return transfer;
            }
            Some(_) => {
                let (_, bytes) = inbox.early.pop_front().unwrap_or_default();
                inbox.early_bytes -= bytes.len();
                inbox.matched.push((seq, posted, bytes));
                share.matched.store(inbox.matched.len(), Ordering::Release);
                inbox.matched.len() == 1
            }
            None => {
                inbox.posted.push_back((seq, posted));
                share.waiting.store(inbox.posted.len(), Ordering::Release);
                inbox.posted.len() == 1
            }
        };
        drop(inbox);
        if first {
            link.wake_one(u64::from(channel));
        }
        // A failure between the check and the push: the engines may have swept already.
        if link.is_failed() {
            self.fail_all();
        }
        transfer
    }

    /// Hands the messages of a frame received on `channel` to their receives (or keeps them
    /// until their receives come). `frame` is the frame's bytes, `messages` its decoded
    /// entries, `landed` the engine's reusable list. A message of another channel, or one out
    /// of its channel's sequence order, is a protocol violation; a length that differs from
    /// its receive's fails the connection.
    pub(crate) fn deliver(
        &self,
        channel: u16,
        frame: &[u8],
        messages: &[EagerMessage],
        landed: &mut Vec<(u64, Posted, std::ops::Range<usize>)>,
    ) {
        let share = self.share(channel);
        landed.clear();
        let mut violation = None;
        {
            let mut inbox = share.inbox();
            for m in messages {
                let seq = m.entry.seq;
                if self.channel_of(seq) != channel {
                    violation = Some(format!(
                        "message #{seq} belongs to eager channel {}",
                        self.channel_of(seq)
                    ));
                    break;
                }
                let range = m.offset..m.offset + m.entry.len as usize;
                if let Some(&(head, _)) = inbox.posted.front() {
                    if head != seq {
                        violation = Some(format!("message #{seq} arrived where #{head} was due"));
                        break;
                    }
                    if let Some((_, posted)) = inbox.posted.pop_front() {
                        landed.push((seq, posted, range));
                    }
                    continue;
                }
                if inbox.early.back().is_some_and(|&(last, _)| seq <= last) {
                    violation = Some(format!("message #{seq} arrived out of order"));
                    break;
                }
                inbox.early_bytes += range.len();
                if inbox.early_bytes > EARLY_BYTES_MAX {
                    violation = Some(format!(
                        "more than {EARLY_BYTES_MAX} bytes of messages ahead of this side's \
                         receives"
                    ));
                    break;
                }
                inbox.early.push_back((seq, frame[range].to_vec()));
            }
            share.waiting.store(inbox.posted.len(), Ordering::Release);
        }
        if let Some(what) = violation {
            self.violation(channel, what);
            // The receives taken off the queue before the bad entry fail with the connection.
            let error = self.link.failure_or_closed();
            for (_, posted, _) in landed.drain(..) {
                self.finish(&posted.completion, Err(error.clone()));
            }
            return;
        }
        for (seq, posted, range) in landed.drain(..) {
            self.land(channel, seq, &posted, &frame[range]);
        }
    }

    fn mismatch(&self, channel: u16, seq: u64, sent: usize, expected: u32) -> Error {
        Error::Mismatch {
            channel,
            peer: self.link.peer,
            what: format!(
                "send #{seq} of {sent} bytes met a receive of {expected} bytes (both sides \
                 must use the same length)"
            ),
        }
    }

    /// Fails the connection over a frame no well-behaved peer sends.
    pub(crate) fn violation(&self, channel: u16, what: String) {
        self.link.fail(Error::PeerClosed {
            peer: self.link.peer,
            reason: format!("protocol violation on eager channel {channel}: {what}"),
        });
    }

    /// Copies a message into its receive's memory and finishes the receive; a length that
    /// differs from the receive's fails the connection.
    fn land(&self, channel: u16, seq: u64, posted: &Posted, bytes: &[u8]) {
        if posted.len as usize != bytes.len() {
            let e = self.mismatch(channel, seq, bytes.len(), posted.len);
            // The connection fails first, so that whoever sees this receive fail sees why.
            self.link.fail(e.clone());
            self.finish(&posted.completion, Err(e));
            return;
        }
        let memory = posted.region.memory();
        let written = if memory.kind() == tcpx::MemoryKind::Host {
            memory
                .write_at(posted.offset, bytes)
                .map_err(|e| Error::InvalidArgument(format!("eager receive #{seq}: {e}")))
        } else {
            // CUDA memory: a synchronous copy through a host bounce (small messages only).
            posted.region.write(posted.offset, bytes)
        };
        self.finish(&posted.completion, written.map(|()| bytes.len() as u64));
    }

    /// Finishes `completion` once, counting the transfer out of the link's in-flight total.
    pub(crate) fn finish(&self, completion: &Completion, outcome: Result<u64>) {
        if completion.finish(outcome) {
            self.link.in_flight.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// The oldest unfinished eager work of `channel` whose deadline has passed, if any,
    /// described for the timeout error.
    ///
    /// Only the oldest of each kind is looked at: sends are queued and receives posted in
    /// sequence order under the connection's order locks, so the lowest number has the
    /// earliest deadline.
    pub(crate) fn overdue(&self, channel: u16, now: Instant) -> Option<String> {
        let share = self.share(channel);
        if share.queued.load(Ordering::Acquire) > 0 {
            if let Some(m) = share.outbox().front() {
                if now >= m.deadline {
                    return Some(format!("eager send #{} of {} bytes", m.seq, m.len));
                }
            }
        }
        if share.waiting.load(Ordering::Acquire) == 0 {
            return None;
        }
        let inbox = share.inbox();
        inbox
            .posted
            .front()
            .filter(|(_, p)| now >= p.deadline)
            .map(|(seq, p)| format!("eager receive #{seq} of {} bytes", p.len))
    }

    /// Fails every queued send and waiting receive with the link's failure (or `Closed`),
    /// and forgets early messages. Idempotent: every engine of the connection calls it when
    /// the link fails, and the connection when it closes.
    pub(crate) fn fail_all(&self) {
        let error = self.link.failure_or_closed();
        for share in &self.shares {
            let sends: Vec<Outgoing> = {
                let mut outbox = share.outbox();
                share.queued.store(0, Ordering::Release);
                outbox.drain(..).collect()
            };
            for m in sends {
                self.finish(&m.completion, Err(error.clone()));
            }
            let posted: Vec<Posted> = {
                let mut inbox = share.inbox();
                inbox.early.clear();
                inbox.early_bytes = 0;
                share.waiting.store(0, Ordering::Release);
                share.matched.store(0, Ordering::Release);
                let matched = std::mem::take(&mut inbox.matched);
                std::mem::take(&mut inbox.posted)
                    .into_iter()
                    .map(|(_, p)| p)
                    .chain(matched.into_iter().map(|(_, p, _)| p))
                    .collect()
            };
            for p in posted {
                self.finish(&p.completion, Err(error.clone()));
            }
        }
    }
}
