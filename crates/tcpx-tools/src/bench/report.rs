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
    /// Baseline bandwidth in the same run (GB/s); `None` without a baseline.
    pub baseline_gbps: Option<f64>,
    /// gbps / baseline_gbps; `None` without a baseline.
    pub ratio: Option<f64>,
    /// Channels (comm pairs) used.
    pub channels: usize,
    /// "host" or "cuda".
    pub memory: &'static str,
    /// Measured messages (0 where not counted).
    pub messages: usize,
    /// Page faults inside the timed window, both processes (server/client only).
    pub timed_page_faults: Option<u64>,
    /// Plugin registrations added inside the timed window, both processes (server/client
    /// only): one-time work that should have been paid before the clock started.
    pub timed_registrations: Option<u64>,
    /// The received bytes were checked (after the timed window, never inside it).
    pub verified: bool,
    /// Times the size was measured (server/client `--rounds`); the figures are medians.
    pub rounds: usize,
    /// Lowest and highest ratio of the rounds, when there were several.
    pub ratio_range: Option<(f64, f64)>,
}

impl Row {
    /// A row from the measured bandwidths and the per-message latencies (sorted in place).
    pub fn new(
        bytes: usize,
        gbps: f64,
        baseline_gbps: Option<f64>,
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
            ratio: baseline_gbps.filter(|&b| b > 0.0).map(|b| gbps / b),
            channels,
            memory,
            messages: latencies.len(),
            timed_page_faults: None,
            timed_registrations: None,
            verified: false,
            rounds: 1,
            ratio_range: None,
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

/// `-` for a figure that was not measured.
pub fn or_dash(value: Option<f64>, decimals: usize) -> String {
    value.map_or_else(|| "-".to_string(), |v| format!("{v:.decimals$}"))
}

/// Prints one table row (with the ratios' range last when the size ran several rounds).
pub fn print_row(row: &Row) {
    let range = row.ratio_range.map_or_else(String::new, |(lo, hi)| {
        format!(" {:>13}", format!("{lo:.2}–{hi:.2}"))
    });
    println!(
        "{:>10} {:>10.2} {:>10.1} {:>10.1} {:>12} {:>7}{range}",
        format_size(row.bytes),
        row.gbps,
        row.p50_us,
        row.p99_us,
        or_dash(row.baseline_gbps, 2),
        or_dash(row.ratio, 3)
    );
}

/// Prints, as a `#` line, what GPU `ordinal`'s small copier measured for its lists of copies
/// when it chooses their way (`TCPX_SMALL_COPY_LISTS=auto`, the default): per direction and
/// list length, the average time of a list through the copy engines and through the gather
/// kernel. Small GPU messages in eager frames and inline one-sided operations take this path;
/// the line says which way they went. Nothing when the process made no copier, or no list was
/// long enough to choose.
pub fn print_copy_lists(ordinal: usize) {
    let Some(copier) = tcpx::cuda::SmallCopier::existing(ordinal) else {
        return;
    };
    if copier.list_copy() != tcpx::cuda::ListCopy::Auto {
        return;
    }
    let classes: Vec<String> = copier
        .auto_list_times()
        .iter()
        .map(|t| {
            let pieces = match t.copies {
                (first, Some(last)) => format!("{first}–{last}"),
                (first, None) => format!("{first}+"),
            };
            let chosen = match t.chosen() {
                tcpx::cuda::ListCopy::Kernel => "kernel",
                _ => "copy engines",
            };
            format!(
                "{} {pieces} pieces: copy engines {:.1} µs, kernel {:.1} µs ({chosen})",
                if t.to_device {
                    "host→GPU"
                } else {
                    "GPU→host"
                },
                t.engines.as_secs_f64() * 1e6,
                t.kernel.as_secs_f64() * 1e6
            )
        })
        .collect();
    if !classes.is_empty() {
        println!(
            "# small GPU copy lists (TCPX_SMALL_COPY_LISTS=auto), GPU {ordinal}: {}",
            classes.join("; ")
        );
    }
}
