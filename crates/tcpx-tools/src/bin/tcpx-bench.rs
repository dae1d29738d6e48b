//! `tcpx-bench`: throughput and latency of the tcpx stack against an in-run raw-TCP baseline.
//!
//! Roles: `server` and `client` (two processes; `cargo xtask bench` starts both, locally, in
//! network namespaces or on two nodes over ssh); `comm` (one comm pair through the safe layer
//! against one TCP stream, in this process); `stack` (two endpoints in this process, N channels
//! against N streams); `onesided` (one-sided write / read sweep over block and batch sizes
//! against two-sided send / recv of the same bytes, two endpoints in this process);
//! `overhead` (engine cost per request with a plugin that completes instantly).

use std::io::{IsTerminal, Write};
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use tcpx_runtime::control::metadata::EndpointMetadata;
use tcpx_runtime::{Backend, Config, Endpoint};
use tcpx_tools::bench::pair::{self, exit, Failure, Sweep, METADATA_PREFIX};
use tcpx_tools::bench::{baseline, report, safe_layer, sizes, stats};

/// Measure tcpx transfers against plain TCP in the same run.
///
/// Every figure is GB/s = 10^9 bytes/s per GPU (or comm) pair, never summed silently, with the
/// raw-TCP baseline measured in the same run and the ratio between the two.
///
/// Two processes:   tcpx-bench server --bind 127.0.0.1:7700
///                  tcpx-bench client --peer <hex printed by the server>
/// (`cargo xtask bench` does this for you, locally, in namespaces or across nodes.)
///
/// Exit codes: 0 ok, 1 error, 2 usage, 3 peer unreachable or lost, 4 data verification failed.
#[derive(Parser, Debug)]
#[command(version, about, long_about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Receive the sweep: print the metadata line, serve one client, exit.
    Server(ServerArgs),
    /// Send the sweep to a server and print the table.
    Client(ClientArgs),
    /// One comm pair through the safe layer vs one TCP stream, both in this process (loopback).
    Comm(CommArgs),
    /// Two endpoints in this process over loopback: N channels vs N TCP streams.
    Stack(StackArgs),
    /// One-sided write / read vs two-sided send / recv of the same bytes: a block × batch
    /// sweep between two endpoints in this process (loopback).
    Onesided(OnesidedArgs),
    /// Engine overhead: requests retired per second with a plugin that completes instantly.
    Overhead(OverheadArgs),
}

/// Settings both roles must share.
#[derive(Args, Debug, Clone)]
struct Common {
    /// Channels (comm pairs each way); the baseline uses as many TCP streams.
    #[arg(long, default_value_t = 4, env = "UCCL_TCPX_NUM_CHANNELS")]
    channels: u16,
    /// Chunk size: the most one plugin request carries.
    #[arg(long, default_value = "512KiB", env = "UCCL_TCPX_CHUNK_BYTES")]
    chunk: String,
    /// Plugin requests in flight per comm (TCPX allows 16).
    #[arg(long, default_value_t = 16)]
    window: usize,
    /// Messages in flight at once (enough to keep every channel's window busy at mid sizes).
    #[arg(long, default_value_t = 8)]
    depth: usize,
    /// Message sizes: a doubling range `A..B` or a comma list (KiB, MiB, GiB).
    #[arg(long, default_value = "4KiB..256MiB")]
    sizes: String,
    /// Measured messages per size (capped so a size moves at most about 1 GiB).
    #[arg(long, default_value_t = 100)]
    iters: usize,
    /// Unmeasured messages per size.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Memory to move: host, or cuda (device memory on `--gpu`, default GPU 0; staged
    /// through pinned host memory when the plugin takes host memory only).
    #[arg(long, default_value = "host", value_parser = ["host", "cuda"])]
    memory: String,
    /// GPU(s) this process serves: `3`, or `0-7` / `0,1` for one process driving several
    /// (`--single-process`); reported with every row.
    #[arg(long, value_parser = parse_gpus)]
    gpu: Option<GpuList>,
    /// Net plugin (default: a TCPX install if present, else the built-in socket plugin).
    #[arg(long, env = "UCCL_TCPX_PLUGIN_PATH")]
    plugin: Option<PathBuf>,
    /// In-run baseline: raw-tcp (same number of plain TCP streams) or none.
    #[arg(long, default_value = "raw-tcp", value_parser = ["raw-tcp", "none"])]
    baseline: String,
    /// Fill messages with a pattern and check every byte at the server (slower).
    #[arg(long)]
    verify: bool,
    /// Seconds any single wait may take before the run fails.
    #[arg(long, default_value_t = 60)]
    timeout: u64,
}

#[derive(Args, Debug)]
struct ServerArgs {
    /// Control address (the baseline listens on its port + 1).
    #[arg(long, default_value = "127.0.0.1:7700")]
    bind: SocketAddr,
    #[command(flatten)]
    common: Common,
}

#[derive(Args, Debug)]
struct ClientArgs {
    /// The server's metadata (the hex after TCPX-BENCH-METADATA).
    #[arg(long)]
    peer: String,
    /// Also write one JSON object per size to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    #[command(flatten)]
    common: Common,
}

#[derive(Args, Debug)]
struct CommArgs {
    /// Message sizes.
    #[arg(long, default_value = "4KiB..64MiB")]
    sizes: String,
    /// Measured messages per size.
    #[arg(long, default_value_t = 200)]
    iters: usize,
    /// Unmeasured messages per size.
    #[arg(long, default_value_t = 10)]
    warmup: usize,
    /// Requests in flight per comm.
    #[arg(long, default_value_t = 16)]
    window: usize,
    /// Repetitions per size; the median is reported.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Net plugin instead of the built-in one.
    #[arg(long)]
    plugin: Option<PathBuf>,
    /// Also write JSON lines here.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Args, Debug)]
struct StackArgs {
    /// Channels, and TCP streams of the baseline.
    #[arg(long, default_value_t = 4)]
    channels: u16,
    /// Message sizes.
    #[arg(long, default_value = "1MiB..256MiB")]
    sizes: String,
    /// Repetitions per size; the median is reported.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Bytes moved per repetition.
    #[arg(long, default_value = "1GiB")]
    bytes: String,
    /// Chunk size: the most one plugin request carries.
    #[arg(long, default_value = "512KiB")]
    chunk: String,
    /// Memory to move: host, or cuda (GPU to GPU, staged through pinned host memory by the
    /// built-in socket plugin; the raw-TCP baseline stays host to host).
    #[arg(long, default_value = "host", value_parser = ["host", "cuda"])]
    memory: String,
    /// With --memory cuda: the sender's and receiver's GPUs, `0,1` (one index: both ends on
    /// that GPU). Default: 0,1 when there are two GPUs, else 0.
    #[arg(long, value_parser = parse_gpus)]
    gpu: Option<GpuList>,
    /// Check the received bytes after each size's timed part (copied back from the GPU).
    #[arg(long)]
    verify: bool,
}

#[derive(Args, Debug)]
struct OnesidedArgs {
    /// Operations to measure: send, write, read (a comma list).
    #[arg(long, default_value = "write")]
    op: String,
    /// Block sizes: a doubling range `A..B` or a comma list.
    #[arg(long, default_value = "4KiB..64MiB")]
    block: String,
    /// Blocks per operation (a comma list; 1 to 1024 is the nixlbench range).
    #[arg(long, default_value = "1,32,1024")]
    batch: String,
    /// Remote placement: contiguous (blocks coalesce) or strided (one run per block).
    #[arg(long, default_value = "contiguous", value_parser = ["contiguous", "strided"])]
    layout: String,
    /// Channels (and as many one-sided channels).
    #[arg(long, default_value_t = 4)]
    channels: u16,
    /// Chunk size.
    #[arg(long, default_value = "512KiB")]
    chunk: String,
    /// Operations in flight while measuring throughput.
    #[arg(long, default_value_t = 4)]
    depth: usize,
    /// Bytes moved per throughput measurement.
    #[arg(long, default_value = "256MiB")]
    bytes: String,
    /// Skip points whose operation (block × batch) is larger than this.
    #[arg(long, default_value = "256MiB")]
    max_op: String,
    /// Operations timed one at a time for the latency columns (per repetition).
    #[arg(long, default_value_t = 100)]
    latency_iters: usize,
    /// Repetitions per point, interleaving the operations; medians are reported.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Seconds any single wait may take.
    #[arg(long, default_value_t = 60)]
    timeout: u64,
    /// Also write one JSON object per row here.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Args, Debug)]
struct OverheadArgs {
    /// Channels of the connection.
    #[arg(long, default_value_t = 1)]
    channels: u16,
    /// Transfers per side per repetition.
    #[arg(long, default_value_t = 2000)]
    transfers: usize,
}

/// GPUs named on the command line, as typed and as indices.
#[derive(Clone, Debug)]
struct GpuList {
    text: String,
    indices: Vec<usize>,
}

impl GpuList {
    /// A single GPU as a number (what per-GPU rows carry), several as their list.
    fn json(&self) -> serde_json::Value {
        match self.indices.as_slice() {
            [one] => serde_json::json!(one),
            many => serde_json::json!(many),
        }
    }
}

fn parse_gpus(text: &str) -> Result<GpuList, String> {
    let mut indices = Vec::new();
    for part in text.split(',') {
        let bad = || format!("`{part}` is not a GPU index or range (e.g. 3, 0-7, 0,2)");
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (
                    a.trim().parse().map_err(|_| bad())?,
                    b.trim().parse().map_err(|_| bad())?,
                );
                if a > b || b - a > 1024 {
                    return Err(bad());
                }
                indices.extend(a..=b);
            }
            None => indices.push(part.trim().parse().map_err(|_| bad())?),
        }
    }
    Ok(GpuList {
        text: text.to_string(),
        indices,
    })
}

fn main() {
    tcpx_tools::logging::init("warn");
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Server(a) => server(a),
        Command::Client(a) => client(a),
        Command::Comm(a) => comm(a).map_err(Failure::from),
        Command::Stack(a) => stack(a).map_err(Failure::from),
        Command::Onesided(a) => onesided(a).map_err(Failure::from),
        Command::Overhead(a) => overhead(a).map_err(Failure::from),
    };
    if let Err(f) = result {
        eprintln!("tcpx-bench: error: {:#}", f.error);
        std::process::exit(f.code);
    }
}

fn usage(e: impl Into<anyhow::Error>) -> Failure {
    Failure {
        code: exit::USAGE,
        error: e.into(),
    }
}

fn sweep(c: &Common) -> Result<Sweep, Failure> {
    let gpu = c
        .gpu
        .as_ref()
        .and_then(|g| g.indices.first().copied())
        .unwrap_or(0);
    if c.memory == "cuda" && !tcpx::cuda::driver_available() {
        return Err(usage(anyhow::anyhow!(
            "--memory cuda: no CUDA driver ({})",
            tcpx::cuda::driver_status()
        )));
    }
    Ok(Sweep {
        sizes: sizes::parse_sizes(&c.sizes).map_err(usage)?,
        iters: c.iters.max(1),
        warmup: c.warmup,
        depth: c.depth.max(1),
        channels: usize::from(c.channels),
        baseline: c.baseline == "raw-tcp",
        verify: c.verify,
        timeout: Duration::from_secs(c.timeout.max(1)),
        memory: if c.memory == "cuda" { "cuda" } else { "host" },
        gpu,
    })
}

fn endpoint(c: &Common, bind: SocketAddr) -> Result<Endpoint, Failure> {
    let chunk = sizes::parse_size(&c.chunk).map_err(usage)?;
    let mut config = Config::from_env().map_err(usage)?;
    config.backend = match &c.plugin {
        Some(p) => Backend::Path(p.clone()),
        None => config.backend,
    };
    config.channels = c.channels;
    config.chunk_bytes =
        u32::try_from(chunk).map_err(|_| usage(anyhow::anyhow!("--chunk {chunk} is too large")))?;
    config.window = c.window;
    config.timeout = Duration::from_secs(c.timeout.max(1));
    config.control_addr = bind;
    config.validate().map_err(usage)?;
    Ok(Endpoint::new(config)?)
}

fn server(a: ServerArgs) -> Result<(), Failure> {
    let sweep = sweep(&a.common)?;
    let baseline_addr = SocketAddr::new(a.bind.ip(), a.bind.port().wrapping_add(1));
    let baseline = TcpListener::bind(baseline_addr)
        .with_context(|| format!("bind the baseline listener {baseline_addr}"))?;
    let endpoint = endpoint(&a.common, a.bind)?;
    let hex = endpoint
        .metadata()
        .to_hex()
        .map_err(|e| anyhow::anyhow!("encode metadata: {e}"))?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{METADATA_PREFIX} {hex}")?;
    out.flush()?;
    drop(out);
    pair::serve(&endpoint, &baseline, &sweep)
}

fn client(a: ClientArgs) -> Result<(), Failure> {
    let sweep = sweep(&a.common)?;
    let peer = a.peer.trim().trim_start_matches(METADATA_PREFIX).trim();
    let peer: EndpointMetadata = peer
        .parse()
        .map_err(|e| usage(anyhow::anyhow!("--peer is not server metadata: {e}")))?;
    let bind = SocketAddr::new(
        if peer.control_addr.ip().is_loopback() {
            "127.0.0.1".parse().expect("literal")
        } else {
            "0.0.0.0".parse().expect("literal")
        },
        0,
    );
    let endpoint = endpoint(&a.common, bind)?;
    let mut json = match &a.json {
        Some(p) => {
            Some(std::fs::File::create(p).with_context(|| format!("create {}", p.display()))?)
        }
        None => None,
    };
    let bar = progress_bar(sweep.sizes.len());
    report::print_header(
        &format!(
            "{} via tcpx-runtime, {} channels, gpu {}",
            endpoint.backend().name,
            sweep.channels,
            a.common
                .gpu
                .as_ref()
                .map_or("-".to_string(), |g| g.text.clone())
        ),
        &format!("raw TCP, {} streams", sweep.channels),
    );
    let gpu = a.common.gpu.as_ref().map(GpuList::json);
    let mut write_err = None;
    pair::drive(&endpoint, &peer, &sweep, |row| {
        bar.suspend(|| report::print_row(row));
        bar.inc(1);
        if let Some(f) = json.as_mut() {
            let mut v = serde_json::to_value(row).expect("rows serialize");
            v["gpu"] = serde_json::json!(gpu);
            if let Err(e) = writeln!(f, "{v}") {
                write_err.get_or_insert(e);
            }
        }
    })?;
    bar.finish_and_clear();
    if let Some(e) = write_err {
        return Err(anyhow::Error::from(e).context("writing --json").into());
    }
    Ok(())
}

fn progress_bar(len: usize) -> indicatif::ProgressBar {
    if !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} sizes {pos}/{len} [{elapsed_precise}] {wide_bar}",
        )
        .expect("static template"),
    );
    bar
}

fn pin_loopback() {
    if std::env::var_os("TCPX_SOCKET_IFNAME").is_none() {
        // In-process benchmarks never leave loopback.
        std::env::set_var("TCPX_SOCKET_IFNAME", "lo");
    }
}

fn comm(args: CommArgs) -> Result<()> {
    pin_loopback();
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
        let (mut ours, mut base, mut latencies) = (Vec::new(), Vec::new(), Vec::new());
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
        let row = report::Row::new(size, gbps, baseline_gbps, &mut latencies, 1, "host");
        report::print_row(&row);
        if let Some(f) = json.as_mut() {
            writeln!(f, "{}", serde_json::to_string(&row)?)?;
        }
    }
    Ok(())
}

fn stack(args: StackArgs) -> Result<()> {
    pin_loopback();
    let gpus = match args.memory.as_str() {
        "cuda" => {
            if !tcpx::cuda::driver_available() {
                anyhow::bail!(
                    "--memory cuda: no CUDA driver ({})",
                    tcpx::cuda::driver_status()
                );
            }
            Some(match args.gpu.as_ref().map(|g| g.indices.as_slice()) {
                Some([one]) => [*one, *one],
                Some([a, b, ..]) => [*a, *b],
                _ if tcpx::cuda::CudaDevice::count() >= 2 => [0, 1],
                _ => [0, 0],
            })
        }
        _ => None,
    };
    let chunk = sizes::parse_size(&args.chunk)?;
    let opts = tcpx_tools::bench::stack::ThroughputOptions {
        channels: args.channels,
        chunk_bytes: u32::try_from(chunk).context("--chunk is too large")?,
        sizes: sizes::parse_sizes(&args.sizes)?,
        bytes_per_rep: sizes::parse_size(&args.bytes)?,
        reps: args.reps.max(1),
        gpus,
        verify: args.verify,
        ..Default::default()
    };
    let memory = match gpus {
        Some([a, b]) => format!("GPU {a} → GPU {b} (staged through pinned host memory)"),
        None => "host memory".to_string(),
    };
    println!("# whole stack (2 endpoints, {} channels, {memory}) vs raw TCP ({} streams, host), loopback; GB/s = 10^9 B/s{}", args.channels, args.channels, if args.verify { "; verified" } else { "" });
    println!(
        "{:>10} {:>10} {:>12} {:>7}",
        "size", "GB/s", "raw TCP", "ratio"
    );
    for row in tcpx_tools::bench::stack::throughput(&opts)? {
        println!(
            "{:>10} {:>10.2} {:>12.2} {:>7.3}",
            sizes::format_size(row.size),
            row.stack_gbps,
            row.tcp_gbps,
            row.ratio()
        );
    }
    Ok(())
}

fn onesided(args: OnesidedArgs) -> Result<()> {
    use tcpx_tools::bench::onesided::{self as os, Layout, Op};
    pin_loopback();
    let ops = args
        .op
        .split(',')
        .map(str::parse)
        .collect::<Result<Vec<Op>>>()?;
    let batches = args
        .batch
        .split(',')
        .map(|b| {
            b.trim()
                .parse::<usize>()
                .ok()
                .filter(|&n| n > 0)
                .with_context(|| format!("--batch: `{b}` is not a positive count"))
        })
        .collect::<Result<Vec<_>>>()?;
    let chunk = sizes::parse_size(&args.chunk)?;
    let opts = os::Options {
        channels: args.channels,
        chunk_bytes: u32::try_from(chunk).context("--chunk is too large")?,
        ops,
        blocks: sizes::parse_sizes(&args.block)?,
        batches,
        bytes_per_point: sizes::parse_size(&args.bytes)?,
        max_op_bytes: sizes::parse_size(&args.max_op)?,
        depth: args.depth.max(1),
        latency_iters: args.latency_iters.max(3),
        reps: args.reps.max(1),
        layout: if args.layout == "strided" {
            Layout::Strided
        } else {
            Layout::Contiguous
        },
        timeout: Duration::from_secs(args.timeout.max(1)),
    };
    let mut json = match &args.json {
        Some(path) => Some(
            std::fs::File::create(path).with_context(|| format!("create {}", path.display()))?,
        ),
        None => None,
    };
    println!(
        "# one-sided vs two-sided send/recv of the same bytes per op; 2 endpoints in this \
         process, {} channels (+{} one-sided), loopback, {} layout, {} ops in flight; \
         GB/s = 10^9 B/s; latency one op at a time (write: until acknowledged)",
        opts.channels, opts.channels, args.layout, opts.depth
    );
    println!(
        "{:>5} {:>8} {:>6} {:>9} {:>9} {:>6} {:>9} {:>9} {:>10}",
        "op", "block", "batch", "GB/s", "send GB/s", "ratio", "p50 µs", "p99 µs", "send p50"
    );
    let mut write_err = None;
    os::run(&opts, |row| {
        println!(
            "{:>5} {:>8} {:>6} {:>9.2} {:>9.2} {:>6.3} {:>9.1} {:>9.1} {:>10.1}",
            format!("{:?}", row.op).to_lowercase(),
            sizes::format_size(row.block),
            row.batch,
            row.gbps,
            row.send_gbps,
            row.ratio,
            row.p50_us,
            row.p99_us,
            row.send_p50_us
        );
        if let Some(f) = json.as_mut() {
            if let Err(e) = writeln!(f, "{}", serde_json::to_string(row).expect("rows serialize")) {
                write_err.get_or_insert(e);
            }
        }
    })?;
    if let Some(e) = write_err {
        return Err(anyhow::Error::from(e).context("writing --json"));
    }
    Ok(())
}

fn overhead(args: OverheadArgs) -> Result<()> {
    let opts = tcpx_tools::bench::overhead::OverheadOptions {
        channels: args.channels,
        transfers: args.transfers,
        ..Default::default()
    };
    let r = tcpx_tools::bench::overhead::engine_overhead(&opts)?;
    println!("{r:#?}");
    Ok(())
}
