//! The endpoint's counters as a [`Metrics`] snapshot, for [`super::Endpoint::metrics`] and
//! for the Prometheus exporter (which holds the endpoint's shared state weakly and so cannot
//! go through the `Endpoint` itself).

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use super::admission::Rejections;
use super::shared::EndpointShared;
use crate::error::Result;
use crate::link::Link;
use crate::metrics::{ChannelMetrics, ConnectionMetrics, Exporter, Metrics};

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

/// The counters of the endpoint `shared` describes, now.
pub(super) fn snapshot(shared: &EndpointShared, rejections: &Rejections) -> Metrics {
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
                in_flight: link.in_flight_total() as u64,
                failed: link.is_failed(),
                channels: all,
                inline: rma
                    .as_ref()
                    .map(|rma| rma.inline.snapshot())
                    .unwrap_or_default(),
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
        registrations: shared.registrations.get() as u64,
        connections,
    }
}
