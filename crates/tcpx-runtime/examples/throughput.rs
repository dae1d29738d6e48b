//! Host-memory throughput through the whole stack vs raw TCP with the same number of
//! streams, in the same run, over loopback. Run in release:
//!
//! ```text
//! TCPX_SOCKET_IFNAME=lo cargo run --release -p tcpx-runtime --example throughput [channels ...]
//! ```

use tcpx_runtime::bench::throughput::{host_throughput, ThroughputOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Loopback only: the socket plugin must not pick another interface.
    std::env::set_var("TCPX_SOCKET_IFNAME", "lo");
    let channels: Vec<u16> = std::env::args()
        .skip(1)
        .map(|a| a.parse())
        .collect::<Result<_, _>>()?;
    let channels = if channels.is_empty() {
        vec![1, 4, 8]
    } else {
        channels
    };
    println!("GB/s = 10^9 bytes/s, median of 3 repetitions after a warm-up, ~1 GiB per repetition");
    println!(
        "{:>8} {:>10} {:>8} {:>12} {:>10} {:>7}",
        "channels", "size", "messages", "stack GB/s", "tcp GB/s", "ratio"
    );
    for c in channels {
        let opts = ThroughputOptions {
            channels: c,
            ..ThroughputOptions::default()
        };
        for row in host_throughput(&opts)? {
            println!(
                "{:>8} {:>9}K {:>8} {:>12.2} {:>10.2} {:>7.3}",
                c,
                row.size >> 10,
                row.messages,
                row.stack_gbps,
                row.tcp_gbps,
                row.ratio()
            );
        }
    }
    Ok(())
}
