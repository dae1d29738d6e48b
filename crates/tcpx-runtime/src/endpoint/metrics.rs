//! [`Endpoint::metrics`]: a snapshot of the endpoint's counters, and the exporter's view of
//! the same.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use super::admission::Rejections;
use super::{Endpoint, EndpointShared};
use crate::error::Result;
use crate::link::Link;
use crate::metrics::{ChannelMetrics, ConnectionMetrics, Exporter, Metrics};

impl Endpoint {
    /// A snapshot of this endpoint's counters: per live connection and channel (bytes and
    /// requests each way, plugin busy answers, idle passes), per NIC, and endpoint-wide
    /// events (connections, refusals, timeouts, peers lost). Reads relaxed atomics; takes one
    /// uncontended lock to list the connections.
    pub fn metrics(&self) -> Metrics {
        snapshot(&self.shared, &self.admission.rejections)
    }

    /// Where the Prometheus exporter listens, when [`Config::metrics_addr`](crate::Config)
    /// turned it on.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.exporter.as_ref().map(Exporter::addr)
    }
}

/// Starts the exporter; it holds the endpoint weakly, so it never keeps it alive.
pub(super) fn start_exporter(
    addr: SocketAddr,
    shared: Weak<EndpointShared>,
    rejections: Arc<Rejections>,
) -> Result<Exporter> {
    Exporter::start(
        addr,
        Box::new(move || {
            let shared = shared.upgrade()?;
            Some(snapshot(&shared, &rejections).to_prometheus())
        }),
    )
}

fn snapshot(shared: &EndpointShared, rejections: &Rejections) -> Metrics {
    let live: Vec<(Arc<Link>, Option<Arc<Link>>)> = {
        let mut links = shared.links.lock().unwrap_or_else(|p| p.into_inner());
        links.retain(|(l, _)| l.strong_count() > 0);
        links
            .iter()
            .filter_map(|(l, r)| Some((l.upgrade()?, r.upgrade())))
            .collect()
    };
    let channels = |link: &Link, one_sided: bool| {
        link.counters
            .iter()
            .enumerate()
            .map(|(c, counters)| ChannelMetrics {
                channel: c as u16,
                nic: shared.nic_of(c as u16).to_owned(),
                one_sided,
                stats: counters.snapshot(),
            })
            .collect::<Vec<_>>()
    };
    let connections = live
        .iter()
        .map(|(link, rma)| {
            let mut all = channels(link, false);
            if let Some(rma) = rma {
                all.extend(channels(rma, true));
            }
            ConnectionMetrics {
                id: link.id,
                peer: link.peer,
                in_flight: link.in_flight.load(Ordering::Relaxed) as u64,
                failed: link.is_failed(),
                channels: all,
            }
        })
        .collect();
    let c = &shared.counters;
    let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    Metrics {
        backend: shared.backend.name.clone(),
        connections_opened: get(&c.connections_opened),
        setup_failures: get(&c.setup_failures),
        refused_peers: rejections.count(),
        access_refusals: shared.one_sided.adverts.refusals(),
        timeouts: get(&c.timeouts),
        peers_lost: get(&c.peers_lost),
        failures: get(&c.failures),
        connections,
    }
}
