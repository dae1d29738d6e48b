//! A runtime [`Metrics`] snapshot as plain Python values (dicts, lists, tuples), for
//! `tcpx.Endpoint.metrics()` and `tcpx.p2p.Endpoint.metrics()`.

use std::collections::HashMap;
use std::net::SocketAddr;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use tcpx_runtime::{ChannelStats, Metrics};

/// The counters of a channel (or a sum of channels) as a dict.
fn stats<'py>(py: Python<'py>, s: &ChannelStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("bytes_sent", s.bytes_sent)?;
    d.set_item("bytes_received", s.bytes_received)?;
    d.set_item("sends", s.sends)?;
    d.set_item("recvs", s.recvs)?;
    d.set_item("busy", s.busy)?;
    d.set_item("idle_loops", s.idle_loops)?;
    d.set_item("staging_rings", s.staging_rings)?;
    Ok(d)
}

fn addr(a: SocketAddr) -> (String, u16) {
    (a.ip().to_string(), a.port())
}

/// The snapshot as a dict:
///
/// - endpoint-wide: `backend`, `connections_opened`, `setup_failures`, `refused_peers`,
///   `access_refusals`, `timeouts`, `peers_lost`, `failures`, `registrations` (plugin
///   registrations of application memory alive on the connections, a gauge);
/// - `connections`: a list of dicts with `id` (the runtime's), `conn_id` (this layer's, or
///   `None` when it cannot be told apart by peer address), `peer` (ip, port), `in_flight`,
///   `failed`, `total` (counters summed over its channels), `channels` (each with
///   `channel`, `nic`, `one_sided` and its counters) and `inline` (`bytes_sent`,
///   `bytes_received` of one-sided operations carried in control messages, on no channel);
/// - `nics`: counters summed per NIC; `total`: summed over every live connection.
///
/// Counters are `bytes_sent`, `bytes_received`, `sends`, `recvs`, `busy`, `idle_loops`,
/// `staging_rings`. `conn_ids` maps peer control addresses to this layer's connection ids.
pub fn to_dict<'py>(
    py: Python<'py>,
    m: &Metrics,
    conn_ids: &HashMap<SocketAddr, Vec<u64>>,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("backend", &m.backend)?;
    d.set_item("connections_opened", m.connections_opened)?;
    d.set_item("setup_failures", m.setup_failures)?;
    d.set_item("refused_peers", m.refused_peers)?;
    d.set_item("access_refusals", m.access_refusals)?;
    d.set_item("timeouts", m.timeouts)?;
    d.set_item("peers_lost", m.peers_lost)?;
    d.set_item("failures", m.failures)?;
    d.set_item("registrations", m.registrations)?;
    let mut conns = Vec::with_capacity(m.connections.len());
    let mut total = ChannelStats::default();
    for c in &m.connections {
        let cd = PyDict::new(py);
        cd.set_item("id", c.id)?;
        let ours = match conn_ids.get(&c.peer).map(Vec::as_slice) {
            Some([one]) => Some(*one),
            _ => None,
        };
        cd.set_item("conn_id", ours)?;
        cd.set_item("peer", addr(c.peer))?;
        cd.set_item("in_flight", c.in_flight)?;
        cd.set_item("failed", c.failed)?;
        let sum = c.total();
        total.add(&sum);
        cd.set_item("total", stats(py, &sum)?)?;
        let mut channels = Vec::with_capacity(c.channels.len());
        for ch in &c.channels {
            let chd = stats(py, &ch.stats)?;
            chd.set_item("channel", ch.channel)?;
            chd.set_item("nic", &ch.nic)?;
            chd.set_item("one_sided", ch.one_sided)?;
            channels.push(chd);
        }
        cd.set_item("channels", channels)?;
        let inline = PyDict::new(py);
        inline.set_item("bytes_sent", c.inline.bytes_sent)?;
        inline.set_item("bytes_received", c.inline.bytes_received)?;
        cd.set_item("inline", inline)?;
        conns.push(cd);
    }
    d.set_item("connections", conns)?;
    let nics = PyDict::new(py);
    for (nic, s) in m.per_nic() {
        nics.set_item(nic, stats(py, &s)?)?;
    }
    d.set_item("nics", nics)?;
    d.set_item("total", stats(py, &total)?)?;
    Ok(d)
}
