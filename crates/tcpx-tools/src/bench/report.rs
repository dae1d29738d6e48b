//! Results: one row per message size, printed as a table for people and as JSON lines.

use serde::Serialize;

use super::sizes::format_size;

/// One measured size. Bandwidth is per GPU pair / comm pair, in GB/s (10^9 bytes per second).
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// Message size in bytes.
    pub bytes: usize,
    /// Measured bandwidth (GB/s, 10^9).
    pub gbps: f64,
    /// Median post-to-completion latency of one message, µs.
    pub p50_us: f64,
    /// 99th percentile latency, µs.
    pub p99_us: f64,
    /// Baseline bandwidth in the same run (GB/s).
    pub baseline_gbps: f64,
    /// gbps / baseline_gbps.
    pub ratio: f64,
    /// Channels (comm pairs) used.
    pub channels: usize,
    /// "host" or "cuda".
    pub memory: &'static str,
}

impl Row {
    /// A row from the measured bandwidths and the per-message latencies (sorted in place).
    pub fn new(
        bytes: usize,
        gbps: f64,
        baseline_gbps: f64,
        latencies: &mut [std::time::Duration],
        channels: usize,
        memory: &'static str,
    ) -> Self {
        let mut us = |p| super::stats::percentile(latencies, p).as_secs_f64() * 1e6;
        let (p50_us, p99_us) = (us(50.0), us(99.0));
        Self {
            bytes,
            gbps,
            p50_us,
            p99_us,
            baseline_gbps,
            ratio: if baseline_gbps > 0.0 {
                gbps / baseline_gbps
            } else {
                0.0
            },
            channels,
            memory,
        }
    }
}

/// Prints the table header.
pub fn print_header(path: &str, baseline: &str) {
    println!("# path: {path}; baseline: {baseline}; GB/s = 10^9 bytes/s, per comm pair");
    println!(
        "{:>10} {:>10} {:>10} {:>10} {:>12} {:>7}",
        "size", "GB/s", "p50 µs", "p99 µs", "baseline", "ratio"
    );
}

/// Prints one table row.
pub fn print_row(row: &Row) {
    println!(
        "{:>10} {:>10.2} {:>10.1} {:>10.1} {:>12.2} {:>7.3}",
        format_size(row.bytes),
        row.gbps,
        row.p50_us,
        row.p99_us,
        row.baseline_gbps,
        row.ratio
    );
}
