//! Per-channel counters: written by the one engine owning the channel, read by anyone.
//!
//! A single writer means a relaxed load and store suffice (no locked read-modify-write on
//! the hot path); readers see a recent, not necessarily instantaneous, value.

use std::sync::atomic::{AtomicU64, Ordering};

/// The live counters of one channel.
#[derive(Debug, Default)]
pub(crate) struct ChannelCounters {
    bytes_sent: AtomicU64,
    bytes_received: AtomicU64,
    sends: AtomicU64,
    recvs: AtomicU64,
    busy: AtomicU64,
    idle_loops: AtomicU64,
    staging_rings: AtomicU64,
}

#[inline]
fn bump(counter: &AtomicU64, n: u64) {
    // Single writer (the owning engine): no RMW needed.
    counter.store(
        counter.load(Ordering::Relaxed).wrapping_add(n),
        Ordering::Relaxed,
    );
}

impl ChannelCounters {
    #[inline]
    pub(crate) fn sent(&self, bytes: u64) {
        bump(&self.sends, 1);
        bump(&self.bytes_sent, bytes);
    }

    #[inline]
    pub(crate) fn received(&self, bytes: u64) {
        bump(&self.recvs, 1);
        bump(&self.bytes_received, bytes);
    }

    #[inline]
    pub(crate) fn busy(&self) {
        bump(&self.busy, 1);
    }

    #[inline]
    pub(crate) fn idle(&self) {
        bump(&self.idle_loops, 1);
    }

    /// A lane of the channel made its staging ring.
    pub(crate) fn ring_opened(&self) {
        bump(&self.staging_rings, 1);
    }

    /// A lane of the channel gave its staging ring back.
    pub(crate) fn ring_released(&self) {
        bump(&self.staging_rings, u64::MAX);
    }

    /// Requests completed so far in both directions (progress detection).
    pub(crate) fn completed(&self) -> u64 {
        self.sends.load(Ordering::Relaxed) + self.recvs.load(Ordering::Relaxed)
    }

    pub(crate) fn snapshot(&self) -> ChannelStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        ChannelStats {
            bytes_sent: get(&self.bytes_sent),
            bytes_received: get(&self.bytes_received),
            sends: get(&self.sends),
            recvs: get(&self.recvs),
            busy: get(&self.busy),
            idle_loops: get(&self.idle_loops),
            staging_rings: get(&self.staging_rings),
        }
    }
}

/// Bytes of one-sided operations a connection carried inline, in control messages (see
/// [`crate::Config::inline_bytes`]), in both roles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct InlineStats {
    /// Bytes sent: writes this side initiated, reads it served.
    pub bytes_sent: u64,
    /// Bytes received: writes this side served, reads it initiated.
    pub bytes_received: u64,
}

/// The live counters behind [`InlineStats`]. Several threads write them (the application's
/// for the writes it initiates, the control loop for the rest), once per operation.
#[derive(Debug, Default)]
pub(crate) struct InlineCounters {
    bytes_sent: AtomicU64,
    bytes_received: AtomicU64,
}

impl InlineCounters {
    pub(crate) fn sent(&self, bytes: u64) {
        self.bytes_sent.fetch_add(bytes, Ordering::Relaxed);
    }

    pub(crate) fn received(&self, bytes: u64) {
        self.bytes_received.fetch_add(bytes, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> InlineStats {
        InlineStats {
            bytes_sent: self.bytes_sent.load(Ordering::Relaxed),
            bytes_received: self.bytes_received.load(Ordering::Relaxed),
        }
    }
}

/// What one channel has done so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ChannelStats {
    /// Bytes of completed sends.
    pub bytes_sent: u64,
    /// Bytes of completed (and consumed) receives.
    pub bytes_received: u64,
    /// Send requests completed.
    pub sends: u64,
    /// Receive requests completed.
    pub recvs: u64,
    /// Posts the plugin answered "busy" (NULL request).
    pub busy: u64,
    /// Engine passes in which this channel had work but nothing moved.
    pub idle_loops: u64,
    /// Lanes of this channel holding a pinned staging ring (0 to 2): made when the
    /// connection starts on an endpoint with staged CUDA memory, or at the first staged
    /// transfer.
    pub staging_rings: u64,
}

impl ChannelStats {
    /// Adds `other` to `self`, field by field (sums over channels, connections or NICs).
    pub fn add(&mut self, other: &ChannelStats) {
        self.bytes_sent += other.bytes_sent;
        self.bytes_received += other.bytes_received;
        self.sends += other.sends;
        self.recvs += other.recvs;
        self.busy += other.busy;
        self.idle_loops += other.idle_loops;
    }
}
