//! Host-memory throughput through the whole stack vs raw TCP with the same number of
//! streams, in the same run, over loopback. Run in release:
//!
//! ```text
//! cargo run --release -p tcpx-tools --example throughput \
//!     [spin|yield|park] [reps=N] [gib=N] [mib=1,4,...] [engines=one|all|both] [channels ...]
//! ```
//!
//! Each channel count runs with one engine thread (one per NIC, what a TCPX plugin gets) and
//! with one engine per channel (what the built-in socket plugin gets by default, since it
//! copies on the engine's thread).

use tcpx_runtime::Backoff;
use tcpx_tools::bench::stack::{host_throughput, ThroughputOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Loopback only: the socket plugin must not pick another interface.
    std::env::set_var("TCPX_SOCKET_IFNAME", "lo");
    let mut backoff = Backoff::Park;
    let mut channels: Vec<u16> = Vec::new();
    let mut defaults = ThroughputOptions::default();
    let mut engines_mode = "both".to_string();
    for arg in std::env::args().skip(1) {
        if let Some(v) = arg.strip_prefix("reps=") {
            defaults.reps = v.parse()?;
        } else if let Some(v) = arg.strip_prefix("gib=") {
            defaults.bytes_per_rep = v.parse::<usize>()? << 30;
        } else if let Some(v) = arg.strip_prefix("mib=") {
            defaults.sizes = v
                .split(',')
                .map(|m| m.parse::<usize>().map(|m| m << 20))
                .collect::<Result<_, _>>()?;
        } else if let Some(v) = arg.strip_prefix("engines=") {
            engines_mode = v.to_string();
        } else if let Ok(c) = arg.parse::<u16>() {
            channels.push(c);
        } else {
            backoff = arg.parse()?;
        }
    }
    let channels = if channels.is_empty() {
        vec![1, 4, 8]
    } else {
        channels
    };
    println!(
        "GB/s = 10^9 bytes/s, median of {} repetitions after a warm-up, ~{} GiB per repetition, \
         engine backoff {backoff:?}",
        defaults.reps,
        defaults.bytes_per_rep >> 30
    );
    println!(
        "{:>8} {:>7} {:>10} {:>8} {:>12} {:>10} {:>7} {:>10}",
        "channels", "engines", "size", "messages", "stack GB/s", "tcp GB/s", "ratio", "submit µs"
    );
    for c in channels {
        let mut engine_counts = Vec::new();
        if engines_mode != "all" || c == 1 {
            engine_counts.push(1usize);
        }
        if engines_mode != "one" && c > 1 {
            engine_counts.push(usize::from(c));
        }
        for engines in engine_counts {
            let opts = ThroughputOptions {
                channels: c,
                engines_per_device: Some(engines),
                backoff,
                ..defaults.clone()
            };
            for row in host_throughput(&opts)? {
                println!(
                    "{:>8} {:>7} {:>9}K {:>8} {:>12.2} {:>10.2} {:>7.3} {:>10.2}",
                    c,
                    engines,
                    row.size >> 10,
                    row.messages,
                    row.stack_gbps,
                    row.tcp_gbps,
                    row.ratio(),
                    row.submit_us
                );
            }
        }
    }
    Ok(())
}
