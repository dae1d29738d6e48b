//! Engine overhead: requests retired per second per engine thread with a plugin that
//! completes instantly. Run in release:
//!
//! ```text
//! cargo run --release -p tcpx-tools --example engine_overhead [channels] [chunk_bytes] [transfers]
//! ```

use tcpx_tools::bench::overhead::{engine_overhead, OverheadOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mut opts = OverheadOptions::default();
    if let Some(c) = args.next() {
        opts.channels = c.parse()?;
    }
    if let Some(c) = args.next() {
        opts.chunk_bytes = c.parse()?;
    }
    if let Some(t) = args.next() {
        opts.transfers = t.parse()?;
    }
    let r = engine_overhead(&opts)?;
    println!(
        "engine overhead (instant plugin, {} channels, {} B chunks, {} requests per side, median of {}):",
        opts.channels, opts.chunk_bytes, r.requests, opts.reps
    );
    println!(
        "  sending engine:   {:.2} M requests/s",
        r.send_per_sec / 1e6
    );
    println!(
        "  receiving engine: {:.2} M requests/s (tested done + consumed)",
        r.recv_per_sec / 1e6
    );
    Ok(())
}
