//! One eager channel inside its engine: a send comm that carries frames of queued small
//! messages, and a receive comm that keeps frames posted and hands their messages to the
//! connection's receives (see [`crate::eager`] for why).
//!
//! Each side owns a few frame buffers of [`EAGER_FRAME_BYTES`], registered once on their
//! comm when the channel is made, so that the path neither allocates nor registers per
//! frame. A send frame is filled only when it is free and the comm has fewer than
//! [`SEND_FRAMES`] frames in flight: while they are, messages queue in the channel's outbox
//! and the next frame takes them all — that is where aggregation comes from. Receive frames
//! are tested only while a receive of the channel waits (see [`EagerChannel::pump`]).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use tcpx::{MemoryRegion, RecvComm, RecvRequest, SendComm, SendRequest, SharedMemory};
use tcpx_proto::eager::{
    decode, header_len, write_header, EagerEntry, EagerMessage, EAGER_FRAME_BYTES,
};

use super::channel::LinkFailed;
use crate::eager::{Eager, Outgoing, Posted};
use crate::error::{Direction, Error};
use crate::link::Link;
use crate::transfer::Completion;

/// Send frames per eager comm: how many may be in flight at once. Few, so that a busy
/// connection's messages gather into frames rather than spread one per request.
pub(crate) const SEND_FRAMES: usize = 2;

/// Receive frames kept posted per eager comm.
pub(crate) const RECV_FRAMES: usize = 4;

/// An eager channel handed to an engine.
pub(crate) struct NewEagerChannel {
    pub(crate) eager: Arc<Eager>,
    pub(crate) index: u16,
    pub(crate) send: SendComm,
    pub(crate) recv: RecvComm,
}

struct SendFrame {
    memory: SharedMemory,
    region: MemoryRegion,
    /// The frame's length once filled and not yet posted (the plugin was busy).
    ready: Option<usize>,
    request: Option<SendRequest>,
    /// The completions of the messages it carries, and their lengths.
    carried: Vec<(Arc<Completion>, u32)>,
}

struct RecvFrame {
    memory: SharedMemory,
    region: MemoryRegion,
    request: Option<RecvRequest>,
}

/// The eager comms of one connection's channel `index`.
pub(crate) struct EagerChannel {
    pub(crate) eager: Arc<Eager>,
    pub(crate) index: u16,
    send: SendComm,
    recv: RecvComm,
    send_frames: Vec<SendFrame>,
    /// Send frames posted, oldest first (the plugin completes them in order).
    sending: VecDeque<usize>,
    recv_frames: Vec<RecvFrame>,
    /// Receive frames posted, oldest first.
    receiving: VecDeque<usize>,
    /// Scratch for the messages a frame takes and the entries a frame carries.
    taken: Vec<Outgoing>,
    entries: Vec<EagerEntry>,
    decoded: Vec<EagerMessage>,
    matched: Vec<(u64, Posted, Vec<u8>)>,
    landed: Vec<(u64, Posted, std::ops::Range<usize>)>,
    /// When a frame last completed (peer-gone detection).
    pub(crate) progress_at: Instant,
}

impl EagerChannel {
    /// Makes the channel's frames and registers them on its comms.
    pub(crate) fn new(new: NewEagerChannel) -> tcpx::Result<Self> {
        let NewEagerChannel {
            eager,
            index,
            send,
            recv,
        } = new;
        let send_frames = (0..SEND_FRAMES)
            .map(|_| {
                let memory = SharedMemory::host(EAGER_FRAME_BYTES)?;
                let region = send.register(&memory)?;
                Ok(SendFrame {
                    memory,
                    region,
                    ready: None,
                    request: None,
                    carried: Vec::new(),
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
                })
            })
            .collect::<tcpx::Result<Vec<_>>>()?;
        Ok(Self {
            eager,
            index,
            send,
            recv,
            send_frames,
            sending: VecDeque::with_capacity(SEND_FRAMES),
            recv_frames,
            receiving: VecDeque::with_capacity(RECV_FRAMES),
            taken: Vec::new(),
            entries: Vec::new(),
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
    pub(crate) fn has_work(&self) -> bool {
        self.has_send_work() || self.eager.waiting(self.index) > 0
    }

    /// Frames in flight or filled, or messages queued for this channel.
    fn has_send_work(&self) -> bool {
        !self.sending.is_empty()
            || self.send_frames.iter().any(|f| f.ready.is_some())
            || self.eager.queued(self.index) > 0
    }

    /// One pass: fill and post send frames, test the oldest of each side, keep receive
    /// frames posted while a receive waits, copy in early messages whose receives came.
    /// Returns whether anything moved. An idle channel makes no plugin call.
    pub(crate) fn pump(&mut self) -> Result<bool, LinkFailed> {
        if self.link().is_failed() {
            // Abandoned already (nothing posted): nothing to do until the link is removed.
            if self.sending.is_empty() && self.receiving.is_empty() {
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
        let mut moved = false;
        // Retire finished frames, oldest first.
        while let Some(&i) = self.sending.front() {
            let frame = &mut self.send_frames[i];
            let Some(request) = frame.request.as_mut() else {
                self.sending.pop_front();
                continue;
            };
            match self.send.test(request) {
                Ok(Some(_)) => {
                    frame.request = None;
                    // Counted before the sends finish, so that whoever sees a send complete
                    // sees its bytes in the stats. Channel `index`'s counters: this engine owns
                    // both the channel and its eager channel (one writer).
                    let bytes = frame.carried.iter().map(|&(_, len)| u64::from(len)).sum();
                    if let Some(counters) = self.eager.link.counters.get(usize::from(self.index)) {
                        counters.sent(bytes);
                    }
                    for (completion, len) in frame.carried.drain(..) {
                        self.eager.finish(&completion, Ok(u64::from(len)));
                    }
                    self.sending.pop_front();
                    self.progress_at = Instant::now();
                    moved = true;
                }
                Ok(None) => break,
                Err(e) => return Err(self.plugin_error(Direction::Send, e)),
            }
        }
        // Post frames filled earlier while the plugin was busy, then fill free ones.
        for i in 0..self.send_frames.len() {
            if self.send_frames[i].request.is_some() {
                continue;
            }
            if self.send_frames[i].ready.is_none() {
                if self.eager.queued(self.index) == 0 {
                    continue;
                }
                self.fill(i)?;
                if self.send_frames[i].ready.is_none() {
                    continue;
                }
            }
            let frame = &mut self.send_frames[i];
            let len = frame.ready.unwrap_or(0);
            match self.send.isend(&frame.region, 0, len, 0) {
                Ok(Some(request)) => {
                    frame.request = Some(request);
                    frame.ready = None;
                    self.sending.push_back(i);
                    moved = true;
                }
                Ok(None) => break,
                Err(e) => return Err(self.plugin_error(Direction::Send, e)),
            }
        }
        Ok(moved)
    }

    /// Fills free send frame `i` with queued messages (header, then their bytes).
    fn fill(&mut self, i: usize) -> Result<(), LinkFailed> {
        let payload = self.eager.take_frame(self.index, &mut self.taken);
        if self.taken.is_empty() {
            return Ok(());
        }
        self.entries.clear();
        self.entries.extend(self.taken.iter().map(Outgoing::entry));
        let head = header_len(self.entries.len());
        let frame = &mut self.send_frames[i];
        let taken = &self.taken;
        let entries = &self.entries;
        let gathered = frame.memory.with_bytes_mut(|bytes| {
            write_header(entries, bytes);
            let mut at = head;
            for m in taken {
                let out = &mut bytes[at..at + m.len as usize];
                let memory = m.region.memory();
                let read = if memory.kind() == tcpx::MemoryKind::Host {
                    memory
                        .read_at(m.offset, out)
                        .map_err(|e| Error::InvalidArgument(format!("eager send #{}: {e}", m.seq)))
                } else {
                    // CUDA memory: a synchronous copy through a host bounce.
                    m.region.read(m.offset, out)
                };
                read?;
                at += m.len as usize;
            }
            Ok::<(), Error>(())
        });
        let outcome = gathered
            .map_err(|e| Error::Internal(format!("eager frame busy: {e}")))
            .and_then(|r| r);
        match outcome {
            Ok(()) => {
                frame.carried.clear();
                frame
                    .carried
                    .extend(self.taken.drain(..).map(|m| (m.completion, m.len)));
                frame.ready = Some(head + payload);
                Ok(())
            }
            Err(e) => {
                // The receives these messages match would wait forever: the connection fails.
                for m in self.taken.drain(..) {
                    self.eager.finish(&m.completion, Err(e.clone()));
                }
                self.eager.link.fail(e);
                Err(LinkFailed)
            }
        }
    }

    /// Tests and posts receive frames only while a receive of this channel waits for its
    /// message. Frames of one channel arrive in sequence order and receives are posted in
    /// sequence order, so a message nobody waits for yet can only sit behind one that is
    /// waited for: stopping then loses nothing, keeps what the application has not asked for
    /// in TCP (flow control, as behind a plugin request), and spares every engine pass the
    /// plugin call (a `recv` syscall on the socket plugin) of testing an idle comm.
    fn pump_recv(&mut self) -> Result<bool, LinkFailed> {
        let mut moved = self.eager.land_matched(self.index, &mut self.matched);
        if self.eager.posted(self.index) == 0 {
            return Ok(moved);
        }
        while let Some(&i) = self.receiving.front() {
            if self.eager.posted(self.index) == 0 {
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
            if frame.request.is_some() {
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

    /// Decodes received frame `i` (`size` bytes) and hands its messages over.
    fn take_delivery(&mut self, i: usize, size: usize) -> Result<(), LinkFailed> {
        let eager = &self.eager;
        let decoded = &mut self.decoded;
        let landed = &mut self.landed;
        let index = self.index;
        let read = self.recv_frames[i].memory.with_bytes(|bytes| {
            let frame = &bytes[..size.min(bytes.len())];
            match decode(frame, eager.max_message, decoded) {
                Ok(_) => {
                    if let Some(counters) = eager.link.counters.get(usize::from(index)) {
                        counters.received(decoded.iter().map(|m| u64::from(m.entry.len)).sum());
                    }
                    eager.deliver(index, frame, decoded, landed);
                    true
                }
                Err(e) => {
                    eager.violation(index, e.to_string());
                    false
                }
            }
        });
        match read {
            Ok(true) if !self.link().is_failed() => Ok(()),
            Ok(_) => Err(LinkFailed),
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
        let error = self.link().failure_or_closed();
        for frame in &mut self.send_frames {
            frame.request = None;
            frame.ready = None;
            for (completion, _) in frame.carried.drain(..) {
                self.eager.finish(&completion, Err(error.clone()));
            }
        }
        self.sending.clear();
        // Receive frames are always posted: dropping them is this comm's normal end.
        self.recv.closing();
        for frame in &mut self.recv_frames {
            frame.request = None;
        }
        self.receiving.clear();
        self.eager.fail_all();
    }
}
