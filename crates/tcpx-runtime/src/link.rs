//! [`Link`]: the state one connection shares between the application's [`crate::Connection`],
//! the engines that own its channels and the thread that watches its control connection.
//!
//! A link fails once: the first error (plugin error, timeout, peer gone, local close) is kept
//! and handed to every transfer still pending on it, and every later submission fails fast
//! with it. Failing wakes the engines so they abandon the link's requests at once.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use crate::engine::job::Job;
use crate::engine::stats::ChannelCounters;
use crate::engine::{Command, Signal};
use crate::error::{Direction, Error};
use crate::registry::Registration;

/// The shared state of one connection.
pub(crate) struct Link {
    /// Unique within the process; engines find a link's channels by it.
    pub(crate) id: u64,
    /// The peer's control address: how errors name the peer.
    pub(crate) peer: SocketAddr,
    pub(crate) channels: u16,
    pub(crate) timeout: Duration,
    failed: AtomicBool,
    failure: OnceLock<Error>,
    /// When and why the peer said goodbye (control `Close`, EOF, reset). Transfers that still
    /// make no progress a short while later are failed (see `engine`).
    peer_gone: OnceLock<(Instant, String)>,
    /// The engines owning this link's channels (each once).
    engines: Vec<Sender<Command>>,
    /// Per-channel counters, indexed by channel.
    pub(crate) counters: Vec<Arc<ChannelCounters>>,
    /// Registrations of application regions on this link's comms, by (region id, direction).
    pub(crate) registrations: Mutex<HashMap<(u64, Direction), Arc<Registration>>>,
    /// Vectored transfers waiting for the peer's segment list, or lists waiting for theirs.
    pub(crate) segments: Mutex<SegmentsBook>,
    /// Transfers submitted and not finished.
    pub(crate) in_flight: AtomicUsize,
    /// The other link of the same connection (two-sided ↔ one-sided): failing either fails
    /// both, and a departed peer is departed on both.
    partner: OnceLock<Weak<Link>>,
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

static NEXT_LINK_ID: AtomicU64 = AtomicU64::new(1);

impl Link {
    pub(crate) fn new(
        peer: SocketAddr,
        channels: u16,
        timeout: Duration,
        engines: Vec<Sender<Command>>,
    ) -> Self {
        Self {
            id: NEXT_LINK_ID.fetch_add(1, Ordering::Relaxed),
            peer,
            channels,
            timeout,
            failed: AtomicBool::new(false),
            failure: OnceLock::new(),
            peer_gone: OnceLock::new(),
            engines,
            counters: (0..channels)
                .map(|_| Arc::new(ChannelCounters::default()))
                .collect(),
            registrations: Mutex::new(HashMap::new()),
            segments: Mutex::new(SegmentsBook::default()),
            in_flight: AtomicUsize::new(0),
            partner: OnceLock::new(),
        }
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

    /// When and why the peer left, if it did.
    pub(crate) fn peer_gone(&self) -> Option<&(Instant, String)> {
        self.peer_gone.get()
    }

    /// Sends `signal` to every engine of the link, without blocking: engines call this too,
    /// and must never wait on their own full queue. A signal lost to a full queue is covered
    /// by the engine's health check (it notices failed links on its own).
    pub(crate) fn wake_engines(&self, signal: Signal) {
        for engine in &self.engines {
            let _ = engine.try_send(Command::Signal(signal));
        }
    }

    /// The engines owning this link's channels.
    pub(crate) fn engines(&self) -> &[Sender<Command>] {
        &self.engines
    }

    /// Drops this link's registrations of region `id` (the region was dropped).
    pub(crate) fn forget_region(&self, id: u64) {
        let removed: Vec<_> = {
            let mut regs = self.registrations.lock().unwrap_or_else(|p| p.into_inner());
            [Direction::Send, Direction::Recv]
                .into_iter()
                .filter_map(|d| regs.remove(&(id, d)))
                .collect()
        };
        // Deregistration happens here, outside the lock.
        drop(removed);
    }
}

/// Pairs vectored transfers with the peer's segment lists (`Segments` messages), which may
/// arrive before or after the local submission.
#[derive(Default)]
pub(crate) struct SegmentsBook {
    /// Local vectored transfers still waiting for the peer's list, by (direction, sequence).
    pub(crate) waiting: HashMap<(Direction, u64), Arc<Job>>,
    /// Peer lists that arrived before the local submission.
    pub(crate) arrived: HashMap<(Direction, u64), Vec<u64>>,
}

/// `Segments.transfer_id` on the wire: the sequence number of the transfer in its direction,
/// shifted left once, with the low bit saying which side sent the list (0: the data sender,
/// 1: the data receiver). Both directions share one control connection, so the bit keeps
/// send #k and receive #k of the *other* direction apart.
pub(crate) fn segments_id(direction: Direction, seq: u64) -> u64 {
    (seq << 1)
        | match direction {
            Direction::Send => 0,
            Direction::Recv => 1,
        }
}

/// The local (direction, sequence) a peer's `Segments.transfer_id` refers to: the peer's
/// send #k pairs with our receive #k and vice versa.
pub(crate) fn local_key_of_peer_segments(transfer_id: u64) -> (Direction, u64) {
    let local = if transfer_id & 1 == 0 {
        Direction::Recv
    } else {
        Direction::Send
    };
    (local, transfer_id >> 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_segments_map_to_the_opposite_direction() {
        for seq in [0, 1, 7, u64::MAX >> 1] {
            assert_eq!(
                local_key_of_peer_segments(segments_id(Direction::Send, seq)),
                (Direction::Recv, seq)
            );
            assert_eq!(
                local_key_of_peer_segments(segments_id(Direction::Recv, seq)),
                (Direction::Send, seq)
            );
        }
    }
}
