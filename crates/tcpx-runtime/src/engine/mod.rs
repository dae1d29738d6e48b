//! Progress engines: one thread per NIC (by default), pinned near it, owning that NIC's
//! channels and driving every plugin call on them.
//!
//! The loop, each pass:
//! 1. take commands without blocking (new channels, transfers — one message per transfer per
//!    engine —, registrations, removals, failure signals);
//! 2. for each channel, post while its windows have room, testing that lane's head after
//!    every post; when a channel posted, test every other channel's heads too;
//! 3. test every channel's heads, retiring completions (receives consumed right away);
//! 4. when nothing moved, back off by policy ([`backoff`]); check deadlines and departed peers.
//!
//! Progress happens only inside plugin calls, so testing is never conditional on a full
//! window: that is what stalled a receive window of 16 forever in an earlier design.
//! Failures are contained per connection: the first error fails the connection's link, and
//! every engine abandons that link's requests, failing its transfers with that error.

pub(crate) mod backoff;
pub(crate) mod channel;
pub(crate) mod eager;
pub(crate) mod job;
pub(crate) mod lane;
pub(crate) mod pin;
pub(crate) mod stage;
pub(crate) mod unpack;

use std::sync::atomic::{fence, AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use crossbeam_utils::CachePadded;
use tcpx::{RecvComm, SendComm, SharedMemory};

use crate::config::Backoff;
use crate::error::{Direction, Error, Result};
use crate::link::{Link, Signal, Wake};
use crate::registry::{CountedRegion, RegistrationCounter};
use backoff::{Idle, Pause};
use channel::Channel;
use eager::{EagerChannel, NewEagerChannel};
use job::Job;
use pin::CoreLease;
use stage::Staging;

/// Commands queued per engine before a submitter waits (the queue is preallocated).
const COMMAND_QUEUE: usize = 4096;

/// After the peer said goodbye, a channel that still has work but completes nothing for this
/// long (capped by the link's timeout) fails: what was sent before the goodbye has arrived.
const PEER_GONE_LINGER: Duration = Duration::from_millis(250);

/// Passes between health checks while busy (deadlines, departed peers).
const CHECK_EVERY_PASSES: u64 = 256;

/// Longest interval between two deadline checks of an engine's eager channels.
const EAGER_CHECK_EVERY: Duration = Duration::from_millis(1);

/// A channel handed to an engine.
pub(crate) struct NewChannel {
    pub(crate) link: Arc<Link>,
    pub(crate) index: u16,
    pub(crate) send: SendComm,
    pub(crate) recv: RecvComm,
}

/// Registrations of one region on one engine's channels of a link, by channel.
pub(crate) type RegisterReply = Vec<(u16, tcpx::Result<CountedRegion>)>;

/// Staging rings made on one engine's channels of a link, by channel.
pub(crate) type PrepareReply = Vec<(u16, tcpx::Result<u16>)>;

/// What an engine can be asked to do.
pub(crate) enum Command {
    /// Take ownership of a channel.
    AddChannel(Box<NewChannel>, Sender<Result<()>>),
    /// Take ownership of a connection's eager channel (see [`crate::eager`]).
    AddEager(Box<NewEagerChannel>, Sender<Result<()>>),
    /// Carry a transfer's chunks on this engine's channels of its link.
    Submit(Arc<Job>),
    /// Register memory on this engine's channels of a link (comms are driven by their engine,
    /// so registration happens here too).
    Register {
        link: u64,
        direction: Direction,
        memory: SharedMemory,
        counter: RegistrationCounter,
        reply: Sender<RegisterReply>,
    },
    /// Make the staging rings of a link's channels on this engine for `staging` (slots of
    /// `slot_bytes`) where a lane has none, ahead of the first staged transfer; reply with the
    /// rings made per channel.
    Prepare {
        link: u64,
        staging: Staging,
        slot_bytes: usize,
        reply: Sender<PrepareReply>,
    },
    /// Abandon and close a link's channels; reply once the comms are closed.
    Remove { link: u64, reply: Sender<()> },
    /// A wake-up.
    Signal(Signal),
    /// Stop the thread.
    Shutdown,
}

/// How links wake an engine: through its command queue, without blocking (a signal lost to a
/// full queue is covered by the engine's health check); a nudge only while it is parked.
#[derive(Clone)]
pub(crate) struct Waker {
    tx: Sender<Command>,
    parked: Arc<CachePadded<AtomicBool>>,
}

impl Wake for Waker {
    fn wake(&self, signal: Signal) {
        let _ = self.tx.try_send(Command::Signal(signal));
    }

    fn nudge(&self) {
        // Pairs with the fence in `Engine::park`: either the engine's last look for work
        // sees what the caller published before this, or this sees the engine parked.
        fence(Ordering::SeqCst);
        if self.parked.load(Ordering::SeqCst) {
            self.wake(Signal::Wake);
        }
    }
}

/// The application side of an engine thread.
pub(crate) struct EngineHandle {
    tx: Sender<Command>,
    /// Set while the engine sleeps waiting for a command (see [`Waker::nudge`]).
    parked: Arc<CachePadded<AtomicBool>>,
    thread: Option<JoinHandle<()>>,
    /// The plugin device this engine serves.
    pub(crate) device: usize,
    /// The core it is pinned to, if any.
    pub(crate) core: Option<usize>,
}

impl std::fmt::Debug for EngineHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("device", &self.device)
            .field("core", &self.core)
            .finish()
    }
}

impl EngineHandle {
    /// Starts engine `index` of its endpoint, for `device`, pinned to `lease`'s core if given.
    /// Its thread is named `tcpx-eng-<device>.<index>` (at most 15 bytes, Linux's limit for
    /// up to 10 devices and 1000 engines), so that profiles and `top -H` tell the engines of
    /// one NIC apart: under one name per NIC, a profile summed them.
    pub(crate) fn spawn(
        index: usize,
        device: usize,
        backoff: Backoff,
        linger: Duration,
        window: usize,
        lease: Option<CoreLease>,
    ) -> Result<Self> {
        let (tx, rx) = crossbeam_channel::bounded(COMMAND_QUEUE);
        let parked = Arc::new(CachePadded::new(AtomicBool::new(false)));
        let engine_parked = parked.clone();
        let core = lease.as_ref().map(|l| l.core);
        let thread = std::thread::Builder::new()
            .name(format!("tcpx-eng-{device}.{index}"))
            .spawn(move || {
                if let Some(lease) = &lease {
                    if !core_affinity::set_for_current(core_affinity::CoreId { id: lease.core }) {
                        tracing::warn!(target: "tcpx_runtime", device, core = lease.core, "could not pin the engine thread");
                    }
                }
                // Eager frames of GPU memory copy on this thread (see `eager::copy_in`): it
                // may keep their GPU's context current between copies.
                tcpx::cuda::own_this_thread();
                Engine {
                    rx,
                    parked: engine_parked,
                    channels: Vec::new(),
                    eager: Vec::new(),
                    eager_checked: Instant::now(),
                    clock: Instant::now(),
                    idle: Idle::new(backoff, linger),
                    window,
                    passes: 0,
                }
                .run();
                drop(lease);
            })
            .map_err(|e| Error::Internal(format!("cannot start the engine thread: {e}")))?;
        Ok(Self {
            tx,
            parked,
            thread: Some(thread),
            device,
            core,
        })
    }

    /// Where to send commands.
    pub(crate) fn sender(&self) -> &Sender<Command> {
        &self.tx
    }

    /// What a link wakes this engine with.
    pub(crate) fn waker(&self) -> Waker {
        Waker {
            tx: self.tx.clone(),
            parked: self.parked.clone(),
        }
    }
}

impl Drop for EngineHandle {
    fn drop(&mut self) {
        let _ = self.tx.send(Command::Shutdown);
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                tracing::error!(target: "tcpx_runtime", device = self.device, "engine thread panicked");
            }
        }
    }
}

/// The engine thread's state.
struct Engine {
    rx: Receiver<Command>,
    /// Set while the engine sleeps waiting for a command (see [`Waker::nudge`]).
    parked: Arc<CachePadded<AtomicBool>>,
    channels: Vec<Channel>,
    eager: Vec<EagerChannel>,
    /// When the eager channels' deadlines were last checked.
    eager_checked: Instant,
    /// The last clock reading of an empty pass (see [`Idle::wants_clock`]).
    clock: Instant,
    idle: Idle,
    window: usize,
    passes: u64,
}

/// Whether the loop goes on.
enum Flow {
    Continue,
    Stop,
}

impl Engine {
    fn run(mut self) {
        loop {
            // `is_empty` is two loads; `try_recv` on an empty queue also pays a full fence,
            // on every pass of a busy engine. Queues whose senders are all gone are seen by
            // the periodic `try_recv` (and by every blocking wait).
            if !self.rx.is_empty() || self.passes % CHECK_EVERY_PASSES == 0 {
                loop {
                    match self.rx.try_recv() {
                        Ok(command) => {
                            if let Flow::Stop = self.handle(command) {
                                return self.stop();
                            }
                        }
                        Err(TryRecvError::Empty) => break,
                        Err(TryRecvError::Disconnected) => return self.stop(),
                    }
                }
            }
            let moved = self.pass();
            self.passes = self.passes.wrapping_add(1);
            if moved {
                self.idle.moved();
                if self.passes % CHECK_EVERY_PASSES == 0 {
                    self.health_check(Instant::now());
                }
                continue;
            }
            let mut busy = false;
            for channel in &self.channels {
                if channel.has_work() {
                    busy = true;
                    channel.counters().idle();
                }
            }
            busy |= self.eager.iter_mut().any(EagerChannel::has_work);
            let fresh = self.idle.wants_clock();
            if fresh {
                self.clock = Instant::now();
            }
            let now = self.clock;
            if busy && fresh {
                // Only work in progress can time out or wait on a departed peer.
                self.health_check(now);
            }
            let flow = match self.idle.empty_pass(busy, now) {
                Pause::Spin => {
                    std::hint::spin_loop();
                    Flow::Continue
                }
                Pause::Yield => {
                    std::thread::yield_now();
                    Flow::Continue
                }
                Pause::Sleep(d) => {
                    if !self.park() {
                        continue;
                    }
                    let received = self.rx.recv_timeout(d);
                    self.parked.store(false, Ordering::SeqCst);
                    match received {
                        Ok(command) => self.handle(command),
                        Err(RecvTimeoutError::Timeout) => Flow::Continue,
                        Err(RecvTimeoutError::Disconnected) => Flow::Stop,
                    }
                }
                Pause::Block => {
                    if !self.park() {
                        continue;
                    }
                    let received = self.rx.recv();
                    self.parked.store(false, Ordering::SeqCst);
                    match received {
                        Ok(command) => self.handle(command),
                        Err(_) => Flow::Stop,
                    }
                }
            };
            if let Flow::Stop = flow {
                return self.stop();
            }
        }
    }

    /// Marks the engine parked, then looks once more for eager work, which arrives without
    /// a command (see [`Waker::nudge`]). Returns whether it may sleep; if not, it is awake
    /// again.
    fn park(&mut self) -> bool {
        self.parked.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if self.eager.iter_mut().any(EagerChannel::has_work) {
            self.parked.store(false, Ordering::SeqCst);
            return false;
        }
        // Going to sleep: nothing streams, so what the applications did not take back of
        // their regions is released here.
        self.eager
            .iter_mut()
            .for_each(EagerChannel::release_finished);
        true
    }

    /// One pass over the channels; returns whether anything moved.
    fn pass(&mut self) -> bool {
        let mut moved = false;
        let n = self.channels.len();
        for i in 0..n {
            let posted = {
                let channel = &mut self.channels[i];
                channel
                    .pump_send()
                    .and_then(|sent| Ok(channel.pump_recv()? | sent))
            };
            match posted {
                Ok(false) => {}
                Ok(true) => {
                    moved = true;
                    // Opportunistically test every other channel's heads.
                    for j in (0..n).filter(|&j| j != i) {
                        moved |= self.test_channel(j);
                    }
                }
                Err(channel::LinkFailed) => {
                    moved = true;
                    self.abandon_link(self.channels[i].link.id);
                }
            }
        }
        for i in 0..n {
            moved |= self.test_channel(i);
        }
        for i in 0..self.eager.len() {
            match self.eager[i].pump() {
                Ok(m) => moved |= m,
                Err(channel::LinkFailed) => {
                    moved = true;
                    self.abandon_link(self.eager[i].link().id);
                }
            }
        }
        moved
    }

    fn test_channel(&mut self, i: usize) -> bool {
        match self.channels[i].test() {
            Ok(retired) => retired,
            Err(channel::LinkFailed) => {
                self.abandon_link(self.channels[i].link.id);
                true
            }
        }
    }

    fn abandon_link(&mut self, link: u64) {
        for channel in self.channels.iter_mut().filter(|c| c.link.id == link) {
            channel.abandon();
        }
        for channel in self.eager.iter_mut().filter(|c| c.link().id == link) {
            channel.abandon();
        }
    }

    fn handle(&mut self, command: Command) -> Flow {
        match command {
            Command::AddChannel(new, reply) => {
                let NewChannel {
                    link,
                    index,
                    send,
                    recv,
                } = *new;
                let result = Channel::new(link, index, send, recv, self.window).map(|c| {
                    self.channels.push(c);
                });
                let _ = reply.send(result);
            }
            Command::AddEager(new, reply) => {
                let peer = new.eager.link.peer;
                let result =
                    EagerChannel::new(*new)
                        .map(|c| self.eager.push(c))
                        .map_err(|source| Error::Setup {
                            peer,
                            source: Arc::new(source),
                        });
                let _ = reply.send(result);
            }
            Command::Submit(job) => {
                if job.link.is_failed() {
                    job.fail_with_link();
                } else {
                    for channel in self
                        .channels
                        .iter_mut()
                        .filter(|c| c.link.id == job.link.id)
                    {
                        channel.enqueue(job.clone());
                    }
                }
            }
            Command::Register {
                link,
                direction,
                memory,
                counter,
                reply,
            } => {
                let regs = self
                    .channels
                    .iter()
                    .filter(|c| c.link.id == link)
                    .map(|c| {
                        let region = c
                            .register(direction, &memory)
                            .map(|r| CountedRegion::new(r, &counter));
                        (c.index, region)
                    })
                    .collect();
                let _ = reply.send(regs);
            }
            Command::Prepare {
                link,
                staging,
                slot_bytes,
                reply,
            } => {
                let made = self
                    .channels
                    .iter_mut()
                    .filter(|c| c.link.id == link && !c.link.is_failed())
                    .map(|c| (c.index, c.prepare(&staging, slot_bytes)))
                    .collect();
                let _ = reply.send(made);
            }
            Command::Remove { link, reply } => {
                self.abandon_link(link);
                // Dropping the channels closes their comms (once registrations are gone too).
                self.channels.retain(|c| c.link.id != link);
                self.eager.retain(|c| c.link().id != link);
                let _ = reply.send(());
            }
            Command::Signal(Signal::Fail(link)) => self.abandon_link(link),
            Command::Signal(Signal::Wake) => {}
            Command::Shutdown => return Flow::Stop,
        }
        Flow::Continue
    }

    /// Fails links whose oldest transfer is past its deadline, or whose peer left and whose
    /// channels stopped progressing; abandons links that failed elsewhere.
    fn health_check(&mut self, now: Instant) {
        let mut failed: Option<u64> = None;
        for channel in &mut self.channels {
            let link = &channel.link;
            if !channel.has_work() {
                continue;
            }
            if link.is_failed() {
                failed = Some(link.id);
                break;
            }
            let late = channel
                .oldest_jobs()
                .into_iter()
                .flatten()
                .find(|job| now >= job.deadline && !job.is_finished());
            if let Some(job) = late {
                link.fail(Error::Timeout {
                    channel: channel.index,
                    peer: link.peer,
                    waited: link.timeout,
                    what: job.describe(),
                });
                failed = Some(link.id);
                break;
            }
            if let Some((gone_at, reason)) = link.peer_gone() {
                let completed = channel.counters().completed();
                if completed != channel.completed_at_check {
                    channel.completed_at_check = completed;
                    channel.progress_at = now;
                }
                let quiet_since = channel.progress_at.max(*gone_at);
                if now.duration_since(quiet_since) >= PEER_GONE_LINGER.min(link.timeout) {
                    link.fail(Error::PeerClosed {
                        peer: link.peer,
                        reason: reason.clone(),
                    });
                    failed = Some(link.id);
                    break;
                }
            }
        }
        // Eager deadlines are coarse (the link's timeout) and their check takes the
        // connection's locks, which the application and the delivering engine want: at most
        // once per millisecond per engine.
        if failed.is_none() && now >= self.eager_checked + EAGER_CHECK_EVERY {
            self.eager_checked = now;
            failed = self.check_eager(now);
        }
        if let Some(link) = failed {
            self.abandon_link(link);
        }
    }

    /// [`Engine::health_check`] for eager channels: deadlines of queued sends and waiting
    /// receives, and a departed peer whose frames stopped coming.
    fn check_eager(&mut self, now: Instant) -> Option<u64> {
        for channel in &mut self.eager {
            if !channel.has_work() {
                continue;
            }
            let link = channel.link().clone();
            if link.is_failed() {
                return Some(link.id);
            }
            let overdue = channel
                .eager
                .overdue(channel.index, now)
                .or_else(|| channel.overdue_frame(now));
            if let Some(what) = overdue {
                link.fail(Error::Timeout {
                    channel: channel.index,
                    peer: link.peer,
                    waited: link.timeout,
                    what,
                });
                return Some(link.id);
            }
            if let Some((gone_at, reason)) = link.peer_gone() {
                let quiet_since = channel.progress_at.max(*gone_at);
                if now.duration_since(quiet_since) >= PEER_GONE_LINGER.min(link.timeout) {
                    link.fail(Error::PeerClosed {
                        peer: link.peer,
                        reason: reason.clone(),
                    });
                    return Some(link.id);
                }
            }
        }
        None
    }

    fn stop(mut self) {
        for channel in &mut self.channels {
            channel.link.fail(Error::Closed {
                peer: channel.link.peer,
            });
            channel.abandon();
        }
        self.channels.clear();
        for channel in &mut self.eager {
            channel.link().fail(Error::Closed {
                peer: channel.link().peer,
            });
            channel.abandon();
        }
        self.eager.clear();
    }
}
