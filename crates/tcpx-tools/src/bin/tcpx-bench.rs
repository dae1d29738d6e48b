//! `tcpx-bench`: throughput and latency of the tcpx stack against an in-run raw-TCP baseline.
//!
//! `tcpx-bench local` runs both ends in this process over loopback with the built-in socket
//! plugin: one comm pair through the safe layer against one plain TCP stream, size by size.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use tcpx_tools::bench::{baseline, report, safe_layer, sizes, stats};

/// Measure tcpx transfers against plain TCP in the same run.
///
/// Bandwidth is reported in GB/s (10^9 bytes per second) per comm pair, never summed silently.
#[derive(Parser, Debug)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Both ends in this process over loopback (socket plugin pinned to `lo`).
    Local(LocalArgs),
}

#[derive(clap::Args, Debug)]
struct LocalArgs {
    /// Message sizes: a doubling range `A..B` or a comma list (units KiB, MiB, GiB).
    #[arg(long, default_value = "4KiB..64MiB")]
    sizes: String,
    /// Measured messages per size (scaled down for large sizes to at most 1 GiB moved).
    #[arg(long, default_value_t = 200)]
    iters: usize,
    /// Unmeasured messages before each size.
    #[arg(long, default_value_t = 10)]
    warmup: usize,
    /// Requests in flight per comm (the plugin allows at most 16).
    #[arg(long, default_value_t = 16)]
    window: usize,
    /// Repetitions per size; the median is reported.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Net plugin to load instead of the built-in socket plugin.
    #[arg(long, env = "UCCL_TCPX_PLUGIN_PATH")]
    plugin: Option<PathBuf>,
    /// Also write one JSON object per size to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

fn main() {
    tcpx_tools::logging::init("warn");
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Local(args) => local(args),
    };
    if let Err(err) = result {
        eprintln!("tcpx-bench: error: {err:#}");
        std::process::exit(1);
    }
}

fn local(args: LocalArgs) -> Result<()> {
    if std::env::var_os("TCPX_SOCKET_IFNAME").is_none() {
        // The local benchmark never leaves loopback.
        std::env::set_var("TCPX_SOCKET_IFNAME", "lo");
    }
    let sizes = sizes::parse_sizes(&args.sizes)?;
    let net = match &args.plugin {
        Some(path) => tcpx::Net::load(path)?,
        None => tcpx::Net::builtin()?,
    };
    let mut pair =
        safe_layer::SafeLayerPair::connect(&net).context("connect the benchmark comm pair")?;
    let mut json = match &args.json {
        Some(path) => Some(
            std::fs::File::create(path).with_context(|| format!("create {}", path.display()))?,
        ),
        None => None,
    };
    report::print_header(
        &format!("{} (ncclNet {}), 1 comm", net.name(), net.abi_version()),
        "raw TCP, 1 stream",
    );
    for size in sizes {
        let iters = args.iters.min(((1usize << 30) / size).max(8));
        let mut ours = Vec::new();
        let mut base = Vec::new();
        let mut latencies = Vec::new();
        for _ in 0..args.reps.max(1) {
            let m = pair.measure(size, args.warmup, iters, args.window)?;
            ours.push(stats::gbps(size * iters, m.elapsed));
            latencies.extend(m.latencies);
            base.push(stats::gbps(
                size * iters,
                baseline::raw_tcp(size, iters, 1)?,
            ));
        }
        let gbps = stats::median(&mut ours);
        let baseline_gbps = stats::median(&mut base);
        let row = report::Row {
            bytes: size,
            gbps,
            p50_us: stats::percentile(&mut latencies, 50.0).as_secs_f64() * 1e6,
            p99_us: stats::percentile(&mut latencies, 99.0).as_secs_f64() * 1e6,
            baseline_gbps,
            ratio: if baseline_gbps > 0.0 {
                gbps / baseline_gbps
            } else {
                0.0
            },
            channels: 1,
            memory: "host",
        };
        report::print_row(&row);
        if let Some(f) = json.as_mut() {
            writeln!(f, "{}", serde_json::to_string(&row)?)?;
        }
    }
    Ok(())
}
