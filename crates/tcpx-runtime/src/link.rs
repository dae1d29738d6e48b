//! [`Link`]: the state one connection shares between the application's [`crate::Connection`],
//! the engines that own its channels and the thread that watches its control connection.
//!
//! A link fails once: the first error (plugin error, timeout, peer gone, local close) is kept
//! and handed to every transfer still pending on it, and every later submission fails fast
//! with it. Failing wakes the engines so they abandon the link's requests at once.
//!
//! The link sits below the engines: it knows them only as [`Wake`] targets, so that engines
//! can hold links without the link module knowing what an engine is. What travels to the
//! engines (jobs, registrations) goes through [`crate::carrier`], one layer up.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use crate::control::ControlError;
use crate::error::Error;
use crate::metrics::EndpointCounters;
use crate::registry::RegistrationCache;
use crate::schedule::{Schedule, ScheduleError, SPREAD_FLOOR_BYTES, TWO_SIDED_SPREAD_FLOOR_BYTES};
use crate::stats::ChannelCounters;

/// A signal that wakes an engine (cheap to copy; sent best-effort).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Signal {
    /// The link with this id failed: abandon its requests.
    Fail(u64),
    /// Something changed (a schedule was published, a peer left): run a pass.
    Wake,
}

/// Something a link can wake: an engine owning some of its channels. Waking never blocks
/// (engines wake links' other engines from their own thread and must not wait on a full
/// queue); a lost signal is covered by the engine's periodic health check.
pub(crate) trait Wake: Send + Sync {
    /// Delivers `signal` if there is room for it.
    fn wake(&self, signal: Signal);

    /// Wakes the engine only if it is asleep or going to sleep: for work it finds by itself
    /// while awake (eager queues), where a signal per message would cost every message a
    /// queue operation on both threads.
    fn nudge(&self) {
        self.wake(Signal::Wake);
    }
}

/// Transfers a link carries outside its in-flight counter (eager frames count theirs under
/// their own locks, so that no counter shared by every engine is written per message).
pub(crate) trait Pending: Send + Sync {
    /// Transfers accepted and not finished.
    fn pending(&self) -> usize;
}

/// The shared state of one connection.
pub(crate) struct Link {
    /// Unique within the process; engines find a link's channels by it.
    pub(crate) id: u64,
    /// The peer's control address: how errors name the peer.
    pub(crate) peer: SocketAddr,
    pub(crate) channels: u16,
    /// The largest chunk of this link's schedules (plugin requests carry at most this):
    /// the smaller of both sides' chunk sizes, as both compute from the two `Hello`s.
    pub(crate) chunk_bytes: u32,
    /// How transfers smaller than the channels' worth of chunks are cut (agreed with the
    /// peer; see [`Schedule::spread_over`]).
    spread: Spread,
    pub(crate) timeout: Duration,
    failed: AtomicBool,
    failure: OnceLock<Error>,
    /// When and why the peer said goodbye (control `Close`, EOF, reset). Transfers that still
    /// make no progress a short while later are failed (see `engine`).
    peer_gone: OnceLock<(Instant, String)>,
    /// The engines owning this link's channels (each once).
    engines: Vec<Box<dyn Wake>>,
    /// Per-channel counters, indexed by channel.
    pub(crate) counters: Vec<Arc<ChannelCounters>>,
    /// Bytes of one-sided operations carried inline in control messages: counted on a
    /// connection's one-sided link only (see [`crate::Config::inline_bytes`]).
    pub(crate) inline: crate::stats::InlineCounters,
    /// Registrations of application regions on this link's comms.
    pub(crate) registrations: Arc<RegistrationCache>,
    /// Transfers submitted and not finished (see also `pending`).
    pub(crate) in_flight: AtomicUsize,
    /// Transfers counted elsewhere: the connection's eager frames, if any.
    pending: OnceLock<Weak<dyn Pending>>,
    /// The other link of the same connection (two-sided ↔ one-sided): failing either fails
    /// both, and a departed peer is departed on both.
    partner: OnceLock<Weak<Link>>,
    /// The endpoint's event counters, where this link's failure is counted (once per
    /// connection: only the two-sided link of a pair holds them).
    events: Option<Arc<EndpointCounters>>,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("id", &self.id)
            .field("peer", &self.peer)
            .field("channels", &self.channels)
            .field("failed", &self.is_failed())
            .finish()
    }
}

/// How a link cuts transfers smaller than its channels' worth of chunks, as agreed with the
/// peer in the handshake (both sides must cut alike).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Spread {
    /// Most channels a spread transfer rides (1: whole chunks).
    pub(crate) width: u16,
    /// Whether two-sided transfers spread too ([`crate::Config::spread_two_sided`] on both
    /// sides), not only the lone one-sided operations that ask for it.
    pub(crate) two_sided: bool,
}

static NEXT_LINK_ID: AtomicU64 = AtomicU64::new(1);

impl Link {
    pub(crate) fn new(
        peer: SocketAddr,
        channels: u16,
        chunk_bytes: u32,
        spread: Spread,
        timeout: Duration,
        engines: Vec<Box<dyn Wake>>,
        events: Option<Arc<EndpointCounters>>,
    ) -> Self {
        Self {
            id: NEXT_LINK_ID.fetch_add(1, Ordering::Relaxed),
            peer,
            channels,
            chunk_bytes,
            spread,
            timeout,
            failed: AtomicBool::new(false),
            failure: OnceLock::new(),
            peer_gone: OnceLock::new(),
            engines,
            counters: (0..channels)
                .map(|_| Arc::new(ChannelCounters::default()))
                .collect(),
            inline: Default::default(),
            registrations: Arc::new(RegistrationCache::default()),
            in_flight: AtomicUsize::new(0),
            pending: OnceLock::new(),
            partner: OnceLock::new(),
            events,
        }
    }

    /// The schedule of a transfer on this link: `local_lens` against the peer's
    /// `remote_lens`, cut into the link's chunks over its channels and, with
    /// `spread`, cut finer over the width agreed with the peer. Every schedule of the link is
    /// built here, so that both sides cut alike (both must pass the same `spread`: a one-sided
    /// request carries it); callers rotate it by the number both sides know.
    pub(crate) fn schedule(
        &self,
        local_lens: &[u64],
        remote_lens: &[u64],
        spread: bool,
    ) -> Result<Schedule, ScheduleError> {
        self.cut(local_lens, remote_lens, spread, SPREAD_FLOOR_BYTES)
    }

    /// The schedule of a two-sided transfer (before rotation), `local_lens` against the
    /// peer's `remote_lens` (one length each for a contiguous transfer): spread over the
    /// agreed width in pieces of at least [`TWO_SIDED_SPREAD_FLOOR_BYTES`] when both sides
    /// announced it, whole chunks otherwise. Both sides cut alike: each passes its own list
    /// first, and the cut depends only on the total.
    pub(crate) fn two_sided_schedule(
        &self,
        local_lens: &[u64],
        remote_lens: &[u64],
    ) -> Result<Schedule, ScheduleError> {
        let spread = self.spread.two_sided;
        self.cut(
            local_lens,
            remote_lens,
            spread,
            TWO_SIDED_SPREAD_FLOOR_BYTES,
        )
    }

    /// `local_lens` against `remote_lens` in the link's chunks, cut over the agreed width in
    /// pieces of at least `floor` with `spread`.
    fn cut(
        &self,
        local_lens: &[u64],
        remote_lens: &[u64],
        spread: bool,
        floor: u32,
    ) -> Result<Schedule, ScheduleError> {
        let width = if spread { self.spread.width } else { 1 };
        Schedule::vectored(local_lens, remote_lens, self.chunk_bytes, self.channels)
            .map(|s| s.spread_over_floor(width, floor))
    }

    /// The width a spread transfer of this link is cut over (1: spreading changes nothing).
    pub(crate) fn spread_width(&self) -> u16 {
        self.spread.width
    }

    /// Ties `a` and `b` together: from now on failing either fails both (see `partner`).
    pub(crate) fn pair(a: &Arc<Link>, b: &Arc<Link>) {
        let _ = a.partner.set(Arc::downgrade(b));
        let _ = b.partner.set(Arc::downgrade(a));
    }

    fn partner(&self) -> Option<Arc<Link>> {
        self.partner.get().and_then(Weak::upgrade)
    }

    /// Fails the link with `error` unless it already failed; wakes its engines. Returns
    /// whether this call was the first.
    pub(crate) fn fail(&self, error: Error) -> bool {
        if self.failure.set(error).is_err() {
            return false;
        }
        self.failed.store(true, Ordering::Release);
        if let (Some(events), Some(e)) = (&self.events, self.failure.get()) {
            match e {
                Error::Closed { .. } => {}
                Error::Timeout { .. } => EndpointCounters::bump(&events.timeouts),
                Error::PeerClosed { .. } => EndpointCounters::bump(&events.peers_lost),
                Error::Control(c)
                    if matches!(
                        **c,
                        ControlError::Closed { .. }
                            | ControlError::ClosedByPeer { .. }
                            | ControlError::Io { .. }
                    ) =>
                {
                    EndpointCounters::bump(&events.peers_lost)
                }
                _ => EndpointCounters::bump(&events.failures),
            }
        }
        match self.failure.get() {
            // Our own close is the normal end of a connection, not a failure worth a warning.
            Some(e @ Error::Closed { .. }) => {
                tracing::debug!(target: "tcpx_runtime", link = self.id, peer = %self.peer, error = %e, "connection closed")
            }
            Some(e) => {
                tracing::warn!(target: "tcpx_runtime", link = self.id, peer = %self.peer, error = %e, "connection failed")
            }
            None => {}
        }
        self.wake_engines(Signal::Fail(self.id));
        if let Some(partner) = self.partner() {
            // Returns at once if the partner already failed (the recursion ends there).
            if let Some(e) = self.failure.get() {
                partner.fail(e.clone());
            }
        }
        true
    }

    /// One relaxed-cost check for the hot path.
    pub(crate) fn is_failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// The error the link failed with.
    pub(crate) fn failure(&self) -> Option<&Error> {
        if self.is_failed() {
            self.failure.get()
        } else {
            None
        }
    }

    /// The error to complete a pending transfer with once the link failed.
    pub(crate) fn failure_or_closed(&self) -> Error {
        self.failure()
            .cloned()
            .unwrap_or(Error::Closed { peer: self.peer })
    }

    /// Records that the peer closed its end (first report wins) and wakes the engines.
    pub(crate) fn set_peer_gone(&self, reason: String) {
        if self.peer_gone.set((Instant::now(), reason.clone())).is_ok() {
            self.wake_engines(Signal::Wake);
            if let Some(partner) = self.partner() {
                partner.set_peer_gone(reason);
            }
        }
    }

    /// Why new work that needs the peer is refused, if it is: the failure, or else the peer's
    /// departure — nothing on the other side will ever match a send, serve a one-sided
    /// operation or read a notification submitted after its goodbye (a notification written
    /// into its closed stream would vanish). Receives are not refused for a goodbye alone:
    /// what the peer sent before it may still arrive. Work in flight is not affected.
    pub(crate) fn refusal(&self) -> Option<Error> {
        if let Some(e) = self.failure() {
            return Some(e.clone());
        }
        self.peer_gone().map(|(_, reason)| Error::PeerClosed {
            peer: self.peer,
            reason: reason.clone(),
        })
    }

    /// Counts `pending`'s transfers in [`Link::in_flight_total`] (once).
    pub(crate) fn count_pending(&self, pending: Weak<dyn Pending>) {
        let _ = self.pending.set(pending);
    }

    /// Transfers submitted and not finished, those counted elsewhere included.
    pub(crate) fn in_flight_total(&self) -> usize {
        let elsewhere = self
            .pending
            .get()
            .and_then(Weak::upgrade)
            .map_or(0, |p| p.pending());
        self.in_flight.load(Ordering::Acquire) + elsewhere
    }

    /// When and why the peer left, if it did.
    pub(crate) fn peer_gone(&self) -> Option<&(Instant, String)> {
        self.peer_gone.get()
    }

    /// Wakes one engine of the link (`k` modulo their count) if it sleeps, without blocking
    /// (see [`Wake::nudge`]): the caller has published work that engine finds by itself.
    pub(crate) fn wake_one(&self, k: u64) {
        if !self.engines.is_empty() {
            let i = (k % self.engines.len() as u64) as usize;
            self.engines[i].nudge();
        }
    }

    /// Sends `signal` to every engine of the link, without blocking (see [`Wake`]).
    pub(crate) fn wake_engines(&self, signal: Signal) {
        for engine in &self.engines {
            engine.wake(signal);
        }
    }
}
