//! `tcpx-info --watch ADDR`: polls a running endpoint's Prometheus exporter
//! (`TCPX_METRICS_ADDR`, `GET /metrics`) and shows bytes and GB/s per NIC and per connection
//! since the previous poll.
//!
//! The scrape is the exporter's OpenMetrics text; only the byte counters are read:
//! `tcpx_nic_{sent,received}_bytes_total{nic}` and
//! `tcpx_channel_{sent,received}_bytes_total{conn,peer,channel,nic,kind}` (summed per
//! connection). The HTTP GET goes through `ureq` (already in the workspace's dependency tree
//! for the runtime's metrics tests), without TLS: the exporter speaks plain HTTP.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use anyhow::{bail, Context, Result};

/// Bytes sent and received by one NIC or one connection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Bytes {
    /// Bytes of completed sends.
    pub sent: u64,
    /// Bytes of completed receives.
    pub received: u64,
}

/// One scrape's byte counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Sample {
    /// Per NIC name.
    pub nics: BTreeMap<String, Bytes>,
    /// Per connection id: its peer address and bytes (summed over its channels).
    pub connections: BTreeMap<u64, (String, Bytes)>,
}

/// The labels and value of one sample line (`name{k="v",…} value`), or `None` for comments,
/// blank lines and lines of other metrics.
fn sample_line<'a>(line: &'a str, metric: &str) -> Option<(Vec<(&'a str, String)>, f64)> {
    let rest = line.strip_prefix(metric)?;
    let (labels, value) = match rest.strip_prefix('{') {
        Some(r) => {
            let end = r.rfind('}')?;
            (&r[..end], r[end + 1..].trim())
        }
        None if rest.starts_with(' ') => ("", rest.trim()),
        None => return None,
    };
    let value: f64 = value.split_whitespace().next()?.parse().ok()?;
    let mut out = Vec::new();
    // Label values here are numbers, addresses and interface names: no escaped quotes.
    for pair in labels.split("\",").filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once("=\"")?;
        out.push((k.trim(), v.trim_end_matches('"').to_owned()));
    }
    Some((out, value))
}

fn label<'a>(labels: &'a [(&str, String)], key: &str) -> Option<&'a str> {
    labels
        .iter()
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v.as_str())
}

impl Sample {
    /// Reads the byte counters out of an exporter's text.
    pub fn parse(text: &str) -> Self {
        let mut sample = Sample::default();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            for (metric, sent) in [
                ("tcpx_nic_sent_bytes_total", true),
                ("tcpx_nic_received_bytes_total", false),
            ] {
                if let Some((labels, v)) = sample_line(line, metric) {
                    if let Some(nic) = label(&labels, "nic") {
                        let b = sample.nics.entry(nic.to_owned()).or_default();
                        *if sent { &mut b.sent } else { &mut b.received } += v as u64;
                    }
                }
            }
            for (metric, sent) in [
                ("tcpx_channel_sent_bytes_total", true),
                ("tcpx_channel_received_bytes_total", false),
            ] {
                if let Some((labels, v)) = sample_line(line, metric) {
                    let Some(conn) = label(&labels, "conn").and_then(|c| c.parse().ok()) else {
                        continue;
                    };
                    let peer = label(&labels, "peer").unwrap_or("?").to_owned();
                    let entry = sample
                        .connections
                        .entry(conn)
                        .or_insert_with(|| (peer, Bytes::default()));
                    let b = &mut entry.1;
                    *if sent { &mut b.sent } else { &mut b.received } += v as u64;
                }
            }
        }
        sample
    }
}

/// `GET http://ADDR/metrics` (ADDR: `host:port`, or a full `http://` URL), within `timeout`.
pub fn scrape(addr: &str, timeout: Duration) -> Result<String> {
    let url = if addr.starts_with("http://") {
        addr.to_owned()
    } else {
        format!("http://{addr}/metrics")
    };
    let mut response = ureq::get(&url)
        .config()
        .timeout_global(Some(timeout))
        .build()
        .call()
        .with_context(|| format!("scraping {url} (is TCPX_METRICS_ADDR set to it?)"))?;
    let text = response
        .body_mut()
        .read_to_string()
        .with_context(|| format!("reading the answer of {url}"))?;
    if !text.contains("tcpx_") {
        bail!("{url} answered, but with no tcpx metrics: is it a tcpx endpoint's exporter?");
    }
    Ok(text)
}

/// GB/s (10^9 B/s) of a counter that moved from `before` to `now` in `secs`; `None` without a
/// previous value (a first poll, or a connection new since the last one).
fn rate(before: Option<u64>, now: u64, secs: f64) -> Option<f64> {
    let before = before?;
    (secs > 0.0).then(|| now.saturating_sub(before) as f64 / secs / 1e9)
}

fn fmt_rate(r: Option<f64>) -> String {
    r.map_or_else(|| "-".to_owned(), |r| format!("{r:.3}"))
}

/// One poll as a table: per NIC, then per connection, bytes so far and GB/s since `previous`
/// (taken `secs` earlier).
pub fn table(poll: u64, now: &Sample, previous: Option<&Sample>, secs: f64) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# poll {poll}{}",
        if previous.is_some() {
            format!(", GB/s over the last {secs:.2} s")
        } else {
            " (GB/s from the next poll on)".to_owned()
        }
    );
    let _ = writeln!(
        out,
        "{:<12} {:>16} {:>16} {:>9} {:>9}",
        "NIC", "sent B", "received B", "tx GB/s", "rx GB/s"
    );
    for (nic, b) in &now.nics {
        let old = previous.and_then(|p| p.nics.get(nic));
        let _ = writeln!(
            out,
            "{:<12} {:>16} {:>16} {:>9} {:>9}",
            nic,
            b.sent,
            b.received,
            fmt_rate(rate(old.map(|o| o.sent), b.sent, secs)),
            fmt_rate(rate(old.map(|o| o.received), b.received, secs)),
        );
    }
    let _ = writeln!(
        out,
        "{:<6} {:<22} {:>16} {:>16} {:>9} {:>9}",
        "CONN", "PEER", "sent B", "received B", "tx GB/s", "rx GB/s"
    );
    if now.connections.is_empty() {
        let _ = writeln!(out, "(no connections)");
    }
    for (id, (peer, b)) in &now.connections {
        let old = previous.and_then(|p| p.connections.get(id)).map(|o| o.1);
        let _ = writeln!(
            out,
            "{:<6} {:<22} {:>16} {:>16} {:>9} {:>9}",
            id,
            peer,
            b.sent,
            b.received,
            fmt_rate(rate(old.map(|o| o.sent), b.sent, secs)),
            fmt_rate(rate(old.map(|o| o.received), b.received, secs)),
        );
    }
    out
}

/// One poll as a JSON object: `{"poll":N,"interval_s":S,"nics":[{"nic","sent_bytes",
/// "received_bytes","sent_gbps","received_gbps"}],"connections":[{"conn","peer",…}]}`, rates
/// `null` where there is no previous value.
pub fn json(poll: u64, now: &Sample, previous: Option<&Sample>, secs: f64) -> serde_json::Value {
    let nics: Vec<_> = now
        .nics
        .iter()
        .map(|(nic, b)| {
            let old = previous.and_then(|p| p.nics.get(nic));
            serde_json::json!({
                "nic": nic,
                "sent_bytes": b.sent,
                "received_bytes": b.received,
                "sent_gbps": rate(old.map(|o| o.sent), b.sent, secs),
                "received_gbps": rate(old.map(|o| o.received), b.received, secs),
            })
        })
        .collect();
    let connections: Vec<_> = now
        .connections
        .iter()
        .map(|(id, (peer, b))| {
            let old = previous.and_then(|p| p.connections.get(id)).map(|o| o.1);
            serde_json::json!({
                "conn": id,
                "peer": peer,
                "sent_bytes": b.sent,
                "received_bytes": b.received,
                "sent_gbps": rate(old.map(|o| o.sent), b.sent, secs),
                "received_gbps": rate(old.map(|o| o.received), b.received, secs),
            })
        })
        .collect();
    serde_json::json!({
        "poll": poll,
        "interval_s": previous.map(|_| secs),
        "nics": nics,
        "connections": connections,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "\
# HELP tcpx_nic_sent_bytes Bytes sent.
# TYPE tcpx_nic_sent_bytes counter
tcpx_nic_sent_bytes_total{nic=\"lo\"} 3000000000
tcpx_nic_received_bytes_total{nic=\"lo\"} 5
tcpx_channel_sent_bytes_total{conn=\"7\",peer=\"127.0.0.1:4000\",channel=\"0\",nic=\"lo\",kind=\"two_sided\"} 100
tcpx_channel_sent_bytes_total{conn=\"7\",peer=\"127.0.0.1:4000\",channel=\"1\",nic=\"lo\",kind=\"two_sided\"} 50
tcpx_channel_sent_bytes_created 12.5
# EOF
";

    #[test]
    fn counters_are_read_per_nic_and_summed_per_connection() {
        let s = Sample::parse(TEXT);
        assert_eq!(
            s.nics["lo"],
            Bytes {
                sent: 3_000_000_000,
                received: 5
            }
        );
        assert_eq!(s.connections[&7].0, "127.0.0.1:4000");
        assert_eq!(s.connections[&7].1.sent, 150);
    }

    #[test]
    fn rates_are_the_difference_over_the_interval() {
        let mut before = Sample::parse(TEXT);
        before.nics.get_mut("lo").unwrap().sent = 1_000_000_000;
        let now = Sample::parse(TEXT);
        let t = table(2, &now, Some(&before), 2.0);
        assert!(t.contains("1.000"), "{t}");
        let j = json(2, &now, Some(&before), 2.0);
        assert_eq!(j["nics"][0]["sent_gbps"], 1.0);
        assert!(json(1, &now, None, 0.0)["nics"][0]["sent_gbps"].is_null());
    }
}
