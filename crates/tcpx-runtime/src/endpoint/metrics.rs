//! [`Endpoint::metrics`]: a snapshot of the endpoint's counters (taken in
//! [`super::snapshot`], which the exporter reads too).

use std::net::SocketAddr;

use super::snapshot::snapshot;
use super::Endpoint;
use crate::metrics::{Exporter, Metrics};

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
