//! The live line of a long `tcpx-bench` run: GB/s per NIC since the last tick, read from the
//! endpoint's metrics (`Endpoint::metrics`, the same counters the Prometheus exporter serves)
//! and shown as the progress bar's message on a terminal.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tcpx_runtime::{ChannelStats, Endpoint};

/// How often the line is refreshed.
const TICK: Duration = Duration::from_millis(500);

/// Bytes each NIC moved (sent plus received) in one snapshot.
pub fn nic_bytes(per_nic: &BTreeMap<String, ChannelStats>) -> BTreeMap<String, u64> {
    per_nic
        .iter()
        .map(|(nic, s)| (nic.clone(), s.bytes_sent + s.bytes_received))
        .collect()
}

/// "lo 12.3 GB/s" per NIC (10^9 B/s) from two snapshots `secs` apart; NICs new in `now`
/// count from zero, counters that went backwards (a connection closed) as zero.
pub fn line(before: &BTreeMap<String, u64>, now: &BTreeMap<String, u64>, secs: f64) -> String {
    if secs <= 0.0 {
        return String::new();
    }
    now.iter()
        .map(|(nic, &b)| {
            let moved = b.saturating_sub(before.get(nic).copied().unwrap_or(0));
            format!("{nic} {:.1} GB/s", moved as f64 / secs / 1e9)
        })
        .collect::<Vec<_>>()
        .join(" · ")
}

/// Refreshes `bar`'s message every half second (`TICK`) until `stop` is set.
pub fn run(endpoint: &Endpoint, bar: &indicatif::ProgressBar, stop: &AtomicBool) {
    let mut before = nic_bytes(&endpoint.metrics().per_nic());
    let mut at = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        let next = at + TICK;
        while Instant::now() < next {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let now = nic_bytes(&endpoint.metrics().per_nic());
        let t = Instant::now();
        bar.set_message(line(&before, &now, (t - at).as_secs_f64()));
        before = now;
        at = t;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_per_nic_from_two_snapshots() {
        let before = BTreeMap::from([("eth1".to_string(), 1_000_000_000u64)]);
        let now = BTreeMap::from([
            ("eth1".to_string(), 3_000_000_000u64),
            ("eth2".to_string(), 500_000_000u64),
        ]);
        assert_eq!(line(&before, &now, 0.5), "eth1 4.0 GB/s · eth2 1.0 GB/s");
        // A counter that went backwards (its connection closed) reads as idle.
        assert_eq!(line(&now, &before, 1.0), "eth1 0.0 GB/s");
        assert_eq!(line(&before, &now, 0.0), "");
    }
}
