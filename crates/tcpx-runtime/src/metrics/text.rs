//! The Prometheus text form of a [`Metrics`] snapshot, through `prometheus-client`: a
//! registry per scrape holding one collector that encodes the snapshot's values.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};

use super::Metrics;
use crate::stats::{ChannelStats, InlineStats};

impl Metrics {
    /// The Prometheus text exposition of this snapshot (OpenMetrics text, which Prometheus
    /// scrapes), encoded by the `prometheus-client` crate. Metric names start with `tcpx_`.
    pub fn to_prometheus(&self) -> String {
        encode(self)
    }
}

fn encode(metrics: &Metrics) -> String {
    let mut registry = Registry::with_prefix("tcpx");
    registry.register_collector(Box::new(Snapshot(metrics.clone())));
    let mut out = String::new();
    // Writing into a String cannot fail; an encoder error would be a bug in a label.
    if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &registry) {
        tracing::error!(target: "tcpx_runtime", error = %e, "encoding metrics failed");
    }
    out
}

#[derive(Debug)]
struct Snapshot(Metrics);

type Labels = Vec<(String, String)>;

/// One family: name, help, unit, and (labels, value) per series.
struct Family<'a> {
    name: &'a str,
    help: &'a str,
    unit: Option<Unit>,
    counter: bool,
    series: Vec<(Labels, u64)>,
}

impl Family<'_> {
    fn encode(&self, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let kind = if self.counter {
            MetricType::Counter
        } else {
            MetricType::Gauge
        };
        let mut family =
            encoder.encode_descriptor(self.name, self.help, self.unit.as_ref(), kind)?;
        for (labels, value) in &self.series {
            let metric = family.encode_family(labels)?;
            if self.counter {
                ConstCounter::new(*value).encode(metric)?;
            } else {
                ConstGauge::new(i64::try_from(*value).unwrap_or(i64::MAX)).encode(metric)?;
            }
        }
        Ok(())
    }
}

fn label(k: &str, v: impl ToString) -> (String, String) {
    (k.to_owned(), v.to_string())
}

impl Collector for Snapshot {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let m = &self.0;
        let scalar = |name, help, counter, value| Family {
            name,
            help,
            unit: None,
            counter,
            series: vec![(vec![label("backend", &m.backend)], value)],
        };
        let live = m.connections.iter().filter(|c| !c.failed).count() as u64;
        for f in [
            scalar("connections_open", "Live connections.", false, live),
            scalar(
                "registrations",
                "Plugin registrations of application memory alive on the connections.",
                false,
                m.registrations,
            ),
            scalar(
                "connections_opened",
                "Connections set up since the endpoint started.",
                true,
                m.connections_opened,
            ),
            scalar(
                "setup_failures",
                "Connection set-ups that failed after the peer's Hello.",
                true,
                m.setup_failures,
            ),
            scalar(
                "refused_peers",
                "Strangers turned away at the control listener.",
                true,
                m.refused_peers,
            ),
            scalar(
                "access_refusals",
                "One-sided requests from peers refused.",
                true,
                m.access_refusals,
            ),
            scalar(
                "timeouts",
                "Connections failed by a transfer that made no progress in time.",
                true,
                m.timeouts,
            ),
            scalar(
                "peers_lost",
                "Connections failed because the peer went away.",
                true,
                m.peers_lost,
            ),
            scalar(
                "failures",
                "Connections failed for another reason (plugin, staging, protocol).",
                true,
                m.failures,
            ),
        ] {
            f.encode(&mut encoder)?;
        }

        // Per channel, labelled with its connection, peer, NIC and kind.
        let per_channel = |name, help, unit, counter, get: fn(&ChannelStats) -> u64| Family {
            name,
            help,
            unit,
            counter,
            series: m
                .connections
                .iter()
                .flat_map(|c| {
                    c.channels.iter().map(move |ch| {
                        (
                            vec![
                                label("conn", c.id),
                                label("peer", c.peer),
                                label("channel", ch.channel),
                                label("nic", &ch.nic),
                                label(
                                    "kind",
                                    if ch.one_sided {
                                        "one_sided"
                                    } else {
                                        "two_sided"
                                    },
                                ),
                            ],
                            get(&ch.stats),
                        )
                    })
                })
                .collect(),
        };
        let nics = m.per_nic();
        let per_nic = |name, help, unit, get: fn(&ChannelStats) -> u64| Family {
            name,
            help,
            unit,
            counter: true,
            series: nics
                .iter()
                .map(|(nic, s)| (vec![label("nic", nic)], get(s)))
                .collect(),
        };
        for f in [
            per_channel(
                "channel_sent",
                "Bytes of completed sends.",
                Some(Unit::Bytes),
                true,
                |s| s.bytes_sent,
            ),
            per_channel(
                "channel_received",
                "Bytes of completed receives.",
                Some(Unit::Bytes),
                true,
                |s| s.bytes_received,
            ),
            per_channel(
                "channel_sends",
                "Send requests completed.",
                None,
                true,
                |s| s.sends,
            ),
            per_channel(
                "channel_recvs",
                "Receive requests completed.",
                None,
                true,
                |s| s.recvs,
            ),
            per_channel(
                "channel_busy",
                "Posts the plugin answered busy (retried later).",
                None,
                true,
                |s| s.busy,
            ),
            per_channel(
                "channel_idle_loops",
                "Engine passes in which the channel had work and nothing moved.",
                None,
                true,
                |s| s.idle_loops,
            ),
            per_nic(
                "nic_sent",
                "Bytes of completed sends per NIC (live connections).",
                Some(Unit::Bytes),
                |s| s.bytes_sent,
            ),
            per_nic(
                "nic_received",
                "Bytes of completed receives per NIC (live connections).",
                Some(Unit::Bytes),
                |s| s.bytes_received,
            ),
            per_nic(
                "nic_transfers",
                "Requests completed per NIC, both directions (live connections).",
                None,
                |s| s.sends + s.recvs,
            ),
        ] {
            f.encode(&mut encoder)?;
        }
        let per_connection = |name, help, get: fn(&InlineStats) -> u64| Family {
            name,
            help,
            unit: Some(Unit::Bytes),
            counter: true,
            series: m
                .connections
                .iter()
                .map(|c| {
                    (
                        vec![label("conn", c.id), label("peer", c.peer)],
                        get(&c.inline),
                    )
                })
                .collect(),
        };
        for f in [
            per_connection(
                "connection_inline_sent",
                "Bytes of one-sided operations sent inline in control messages (writes initiated, reads served).",
                |s| s.bytes_sent,
            ),
            per_connection(
                "connection_inline_received",
                "Bytes of one-sided operations received inline in control messages (writes served, reads initiated).",
                |s| s.bytes_received,
            ),
        ] {
            f.encode(&mut encoder)?;
        }
        Family {
            name: "connection_in_flight",
            help: "Transfers submitted and not finished, per connection.",
            unit: None,
            counter: false,
            series: m
                .connections
                .iter()
                .map(|c| {
                    (
                        vec![label("conn", c.id), label("peer", c.peer)],
                        c.in_flight,
                    )
                })
                .collect(),
        }
        .encode(&mut encoder)
    }
}
