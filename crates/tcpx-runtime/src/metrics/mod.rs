//! What an endpoint has done, for people and dashboards: a [`Metrics`] snapshot
//! ([`Endpoint::metrics`](crate::Endpoint::metrics)), its Prometheus text form
//! ([`Metrics::to_prometheus`]), and the opt-in HTTP exporter (`exporter`,
//! [`Config::metrics_addr`](crate::Config::metrics_addr)).
//!
//! Nothing here is on the hot path: the engines only bump their channels' single-writer
//! relaxed counters (`stats`) and links count failures once each; a snapshot reads them.

mod exporter;
mod text;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::stats::{ChannelStats, InlineStats};

pub(crate) use exporter::Exporter;

/// Endpoint-wide event counters, bumped once per event (never per chunk).
#[derive(Debug, Default)]
pub(crate) struct EndpointCounters {
    pub(crate) connections_opened: AtomicU64,
    pub(crate) setup_failures: AtomicU64,
    pub(crate) timeouts: AtomicU64,
    pub(crate) peers_lost: AtomicU64,
    pub(crate) failures: AtomicU64,
}

impl EndpointCounters {
    pub(crate) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// One channel's counters, with where it runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChannelMetrics {
    /// The channel's index within its connection.
    pub channel: u16,
    /// The NIC (plugin device name) carrying it.
    pub nic: String,
    /// Two-sided (`send`/`recv`) or one-sided (`write`/`read`/`notify`).
    pub one_sided: bool,
    /// Its counters.
    pub stats: ChannelStats,
}

/// One live connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectionMetrics {
    /// Unique within the process.
    pub id: u64,
    /// The peer's control address.
    pub peer: SocketAddr,
    /// Transfers submitted and not finished.
    pub in_flight: u64,
    /// Whether the connection has failed (or was closed).
    pub failed: bool,
    /// Two-sided channels, then one-sided ones.
    pub channels: Vec<ChannelMetrics>,
    /// One-sided operations carried inline, in control messages, on no channel.
    pub inline: InlineStats,
}

impl ConnectionMetrics {
    /// The sum over every channel (both kinds).
    pub fn total(&self) -> ChannelStats {
        let mut sum = ChannelStats::default();
        for c in &self.channels {
            sum.add(&c.stats);
        }
        sum
    }
}

/// A snapshot of an endpoint's counters.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Metrics {
    /// The plugin in use.
    pub backend: String,
    /// Connections set up since the endpoint started.
    pub connections_opened: u64,
    /// Connection set-ups that failed after a peer's `Hello` (incompatible, plugin errors).
    pub setup_failures: u64,
    /// Strangers turned away at the control listener (garbage, silence, a missing secret).
    pub refused_peers: u64,
    /// One-sided requests from peers refused (unknown region, wrong key, out of bounds).
    pub access_refusals: u64,
    /// Connections failed because a transfer made no progress within the timeout.
    pub timeouts: u64,
    /// Connections failed because the peer went away (closed, reset, said goodbye).
    pub peers_lost: u64,
    /// Connections failed for any other reason (plugin, staging, protocol).
    pub failures: u64,
    /// Plugin registrations of application memory alive on the connections (one per region,
    /// direction and comm; see [`crate::Endpoint::live_registrations`]): a gauge.
    pub registrations: u64,
    /// The live connections.
    pub connections: Vec<ConnectionMetrics>,
}

impl Metrics {
    /// Counters summed per NIC, over every live connection's channels (both kinds).
    pub fn per_nic(&self) -> BTreeMap<String, ChannelStats> {
        let mut nics: BTreeMap<String, ChannelStats> = BTreeMap::new();
        for c in self.connections.iter().flat_map(|c| &c.channels) {
            nics.entry(c.nic.clone()).or_default().add(&c.stats);
        }
        nics
    }
}
