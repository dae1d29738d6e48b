//! Small two-sided messages in eager frames: what a connection shares with the engines that
//! carry them.
//!
//! A send or receive of 1 byte up to the connection's agreed eager size (see
//! [`tcpx_proto::eager`] and [`crate::Config::eager_bytes`]) takes no job and no plugin
//! request of its own. A send queues its message in the connection's [`Eager`] outbox, in
//! sequence order; whichever engine of the connection has room on its eager comm takes as
//! many queued messages as fit a frame, copies them into it and sends the frame as one
//! request. A receive names its sequence number in the inbox; the engine whose frame brings
//! that message copies it into the receive's memory and finishes it. A message that arrives
//! before its receive is kept (bounded) until the receive comes.
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

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tcpx_proto::eager::{fits, EagerEntry, EagerMessage};

use crate::error::{Direction, Error, Result};
use crate::link::{Link, Signal};
use crate::registry::Region;
use crate::transfer::{Completion, Transfer};

/// Bytes of messages that arrived before their receives, per connection, past which the
/// engines stop posting eager frames while no receive waits (the peer's sends then wait in
/// TCP, as a plugin request would) until receives take some.
pub(crate) const EARLY_BYTES_MAX: usize = 32 << 20;

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
struct Posted {
    region: Region,
    offset: usize,
    len: u32,
    completion: Arc<Completion>,
    deadline: Instant,
}

#[derive(Default)]
struct Inbox {
    /// Receives waiting for their message, by sequence number.
    posted: BTreeMap<u64, Posted>,
    /// Messages that arrived before their receive, by sequence number.
    early: BTreeMap<u64, Vec<u8>>,
    early_bytes: usize,
}

/// The eager half of one connection: the outbox of small sends, the inbox of small receives.
pub(crate) struct Eager {
    /// Largest message of the eager path on this connection (agreed in `Hello`).
    pub(crate) max_message: u32,
    /// The connection's two-sided link: its failure, timeout, in-flight count and engines.
    pub(crate) link: Arc<Link>,
    spin: Duration,
    outbox: Mutex<VecDeque<Outgoing>>,
    /// Messages in the outbox, read by engines without the lock.
    queued: AtomicUsize,
    inbox: Mutex<Inbox>,
    /// Receives waiting, read by engines without the lock.
    waiting: AtomicUsize,
    /// Bytes held in `early`, read by engines without the lock.
    early_bytes: AtomicUsize,
}

impl std::fmt::Debug for Eager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Eager")
            .field("max_message", &self.max_message)
            .field("queued", &self.queued())
            .field("waiting", &self.waiting())
            .finish()
    }
}

impl Eager {
    pub(crate) fn new(max_message: u32, link: Arc<Link>, spin: Duration) -> Self {
        Self {
            max_message,
            link,
            spin,
            outbox: Mutex::new(VecDeque::new()),
            queued: AtomicUsize::new(0),
            inbox: Mutex::new(Inbox::default()),
            waiting: AtomicUsize::new(0),
            early_bytes: AtomicUsize::new(0),
        }
    }

    /// Whether a contiguous message of `len` bytes travels eager on this connection.
    pub(crate) fn carries(&self, len: usize) -> bool {
        len >= 1 && len <= self.max_message as usize
    }

    /// Sends queued, not yet in a frame.
    pub(crate) fn queued(&self) -> usize {
        self.queued.load(Ordering::Acquire)
    }

    /// Receives waiting for their message.
    pub(crate) fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }

    /// Whether the engines may post more frames: the early messages are under their bound,
    /// or a receive is waiting. A waiting receive's message may sit behind others in any
    /// eager comm's stream (frames of different comms arrive in any order), so while one
    /// waits every comm keeps reading, whatever the early messages hold: stopping then
    /// would wait forever on a message that can only come by reading past the bound.
    pub(crate) fn accepts_frames(&self) -> bool {
        self.waiting() > 0 || self.early_bytes.load(Ordering::Acquire) < EARLY_BYTES_MAX
    }

    fn outbox(&self) -> MutexGuard<'_, VecDeque<Outgoing>> {
        self.outbox.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn inbox(&self) -> MutexGuard<'_, Inbox> {
        self.inbox.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues send `seq` of `len` bytes at `offset` in `region` (the caller holds the send
    /// order, so the outbox stays in sequence order and frames carry rising numbers).
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
        let was_empty = {
            let mut outbox = self.outbox();
            outbox.push_back(message);
            self.queued.store(outbox.len(), Ordering::Release);
            outbox.len() == 1
        };
        if was_empty {
            // One engine is enough: whichever engine of the connection has room takes the
            // queue, and busy engines poll it anyway. Waking all of them for every message
            // cost a command per engine per message.
            link.wake_one(seq);
        }
        // A failure between the check and the push: the engines may have swept already.
        if link.is_failed() {
            self.fail_all();
        }
        Transfer::new(completion, Direction::Send, len as u64, self.spin)
    }

    /// Takes the queued sends that fit one frame into `out` (in sequence order; emptied
    /// first). Returns the payload bytes taken.
    ///
    /// Takes nothing when another engine is taking (never blocks an engine behind another,
    /// nor the application's next send behind a queue of engines).
    pub(crate) fn take_frame(&self, out: &mut Vec<Outgoing>) -> usize {
        out.clear();
        let mut payload = 0usize;
        let mut outbox = match self.outbox.try_lock() {
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
        self.queued.store(outbox.len(), Ordering::Release);
        payload
    }

    /// Posts receive `seq` of `len` bytes into `region` at `offset` (the caller holds the
    /// receive order). A message that already arrived is copied now.
    pub(crate) fn recv(
        &self,
        seq: u64,
        region: &Region,
        offset: usize,
        len: usize,
    ) -> Result<Transfer> {
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
        let mut inbox = self.inbox();
        if let Some(bytes) = inbox.early.remove(&seq) {
            inbox.early_bytes -= bytes.len();
            self.early_bytes.store(inbox.early_bytes, Ordering::Release);
            drop(inbox);
            // Which eager channel brought it is no longer known.
            self.land(0, seq, &posted, &bytes);
            return Ok(transfer);
        }
        inbox.posted.insert(seq, posted);
        let first = inbox.posted.len() == 1;
        self.waiting.store(inbox.posted.len(), Ordering::Release);
        drop(inbox);
        if first {
            // Engines with nothing else to do may be asleep: they test eager comms again.
            link.wake_engines(Signal::Wake);
        }
        if link.is_failed() {
            self.fail_all();
        }
        Ok(transfer)
    }

    /// Hands the messages of a received frame to their receives (or keeps them until their
    /// receives come). `frame` is the frame's bytes, `messages` its decoded entries.
    /// A message whose length differs from its receive's fails the connection.
    pub(crate) fn deliver(&self, channel: u16, frame: &[u8], messages: &[EagerMessage]) {
        let mut landed: Vec<(u64, Posted, std::ops::Range<usize>)> = Vec::new();
        {
            let mut inbox = self.inbox();
            for m in messages {
                let range = m.offset..m.offset + m.entry.len as usize;
                match inbox.posted.remove(&m.entry.seq) {
                    Some(posted) => landed.push((m.entry.seq, posted, range)),
                    None => {
                        if inbox.early.contains_key(&m.entry.seq) {
                            drop(inbox);
                            self.violation(channel, format!("message #{} arrived twice", m.entry.seq));
                            return;
                        }
                        inbox.early_bytes += range.len();
                        inbox.early.insert(m.entry.seq, frame[range].to_vec());
                    }
                }
            }
            self.waiting.store(inbox.posted.len(), Ordering::Release);
            self.early_bytes.store(inbox.early_bytes, Ordering::Release);
        }
        for (seq, posted, range) in landed {
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

    /// The oldest unfinished eager work whose deadline has passed, if any, described for
    /// the timeout error.
    ///
    /// Only the oldest of each kind is looked at: sends are queued and receives posted in
    /// sequence order under the connection's order locks, so the lowest number has the
    /// earliest deadline.
    pub(crate) fn overdue(&self, now: Instant) -> Option<String> {
        if self.queued() > 0 {
            if let Some(m) = self.outbox().front() {
                if now >= m.deadline {
                    return Some(format!("eager send #{} of {} bytes", m.seq, m.len));
                }
            }
        }
        if self.waiting() == 0 {
            return None;
        }
        let inbox = self.inbox();
        inbox
            .posted
            .first_key_value()
            .filter(|(_, p)| now >= p.deadline)
            .map(|(seq, p)| format!("eager receive #{seq} of {} bytes", p.len))
    }

    /// Fails every queued send and waiting receive with the link's failure (or `Closed`),
    /// and forgets early messages. Idempotent: every engine of the connection calls it when
    /// the link fails, and the connection when it closes.
    pub(crate) fn fail_all(&self) {
        let error = self.link.failure_or_closed();
        let sends: Vec<Outgoing> = {
            let mut outbox = self.outbox();
            self.queued.store(0, Ordering::Release);
            outbox.drain(..).collect()
        };
        for m in sends {
            self.finish(&m.completion, Err(error.clone()));
        }
        let posted: Vec<Posted> = {
            let mut inbox = self.inbox();
            inbox.early.clear();
            inbox.early_bytes = 0;
            self.waiting.store(0, Ordering::Release);
            self.early_bytes.store(0, Ordering::Release);
            std::mem::take(&mut inbox.posted).into_values().collect()
        };
        for p in posted {
            self.finish(&p.completion, Err(error.clone()));
        }
    }
}
