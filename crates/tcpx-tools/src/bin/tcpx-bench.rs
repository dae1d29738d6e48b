//! `tcpx-bench`: throughput and latency of the tcpx stack against an in-run raw-TCP baseline.
//!
//! Roles: `server` and `client` (two processes; `cargo xtask bench` starts both, locally, in
//! network namespaces or on two nodes over ssh); `comm` (one comm pair through the safe layer
//! against one TCP stream, in this process); `stack` (two endpoints in this process, N channels
//! against N streams); `onesided` (one-sided write / read sweep over block and batch sizes
//! against two-sided send / recv of the same bytes, two endpoints in this process);
//! `overhead` (engine cost per request with a plugin that completes instantly); `latency`
//! (one-way latency from ping-pong round trips, tcpx and raw TCP with TCP_NODELAY).
//!
//! Every subcommand checks its options the same way before doing anything: a bad value is
//! one line on stderr and exit code 2.

/// The runtime allocates a few small objects per transfer on the submitting thread and frees
/// them on an engine thread; glibc's malloc handles that producer/consumer pattern badly
/// (a third of the CPU of a 4 KiB message stream went to `_int_malloc` and bin walks), so the
/// tools use mimalloc, as `libtcpx` and the Python extension do.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::io::{IsTerminal, Write};
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use tcpx_runtime::control::metadata::EndpointMetadata;
use tcpx_runtime::{Backend, Backoff, Config, Endpoint};
use tcpx_tools::backend_choice;
use tcpx_tools::bench::pair::{self, exit, Failure, Sweep, METADATA_PREFIX};
use tcpx_tools::bench::{baseline, report, safe_layer, sizes, stats};

/// Measure tcpx transfers against plain TCP in the same run.
///
/// Every figure is GB/s = 10^9 bytes/s per GPU (or comm) pair, never summed silently, with the
/// raw-TCP baseline measured in the same run and the ratio between the two.
///
/// Two processes:   tcpx-bench server --bind 127.0.0.1:7700
///                  tcpx-bench client --peer HEX   (the metadata line the server prints)
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
    /// One-way latency (ping-pong round trip / 2, p50 and p99) through the whole stack and
    /// through one raw TCP connection with TCP_NODELAY, two endpoints in this process.
    Latency(LatencyArgs),
}

/// Settings both roles must share.
#[derive(Args, Debug, Clone)]
struct Common {
    /// Channels (comm pairs each way); the baseline uses as many TCP streams. Default:
    /// TCPX_NUM_CHANNELS, else UCCL_TCPX_NUM_CHANNELS, else 4.
    #[arg(long)]
    channels: Option<u16>,
    /// Chunk size: the most one plugin request carries. Default: TCPX_CHUNK_BYTES, else
    /// UCCL_TCPX_CHUNK_BYTES, else 512KiB.
    #[arg(long)]
    chunk: Option<String>,
    /// Plugin requests in flight per comm, 1 to 16 (TCPX allows 16).
    #[arg(long, default_value_t = 16)]
    window: usize,
    /// Messages in flight at once. Default: per size, enough to fill every channel's window
    /// (channels × window requests; at least 8, at most 1024), as the raw-TCP baseline has
    /// no limit in flight; give a number to measure at a fixed depth.
    #[arg(long)]
    depth: Option<usize>,
    /// Message sizes: a doubling range `A..B` or a comma list (KiB, MiB, GiB).
    #[arg(long, default_value = "4KiB..256MiB")]
    sizes: String,
    /// Measured messages per size (raised to move at least --min-bytes, capped so a size
    /// moves at most about 1 GiB).
    #[arg(long, default_value_t = 100)]
    iters: usize,
    /// Every size moves at least this many bytes, measured side and baseline alike (small
    /// sizes otherwise run too briefly to mean anything); 0 turns the floor off.
    #[arg(long, default_value = "64MiB")]
    min_bytes: String,
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
    /// Net plugin. Default: TCPX_PLUGIN_PATH, else UCCL_TCPX_PLUGIN_PATH, else a TCPX install
    /// if present, else the built-in socket plugin.
    #[arg(long)]
    plugin: Option<PathBuf>,
    /// In-run baseline: raw-tcp (same number of plain TCP streams) or none.
    #[arg(long, default_value = "raw-tcp", value_parser = ["raw-tcp", "none"])]
    baseline: String,
    /// Check every byte of every size at the server, after each size's timed part (the
    /// figures do not include the checking).
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
    /// Requests in flight per comm, 1 to 16.
    #[arg(long, default_value_t = 16)]
    window: usize,
    /// Repetitions per size; the median is reported.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Net plugin. Default: TCPX_PLUGIN_PATH, else UCCL_TCPX_PLUGIN_PATH, else the built-in one.
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
    /// Net plugin. Default: TCPX_PLUGIN_PATH, else UCCL_TCPX_PLUGIN_PATH, else the built-in one.
    #[arg(long)]
    plugin: Option<PathBuf>,
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
    /// Net plugin. Default: TCPX_PLUGIN_PATH, else UCCL_TCPX_PLUGIN_PATH, else the built-in one.
    #[arg(long)]
    plugin: Option<PathBuf>,
}

#[derive(Args, Debug)]
struct OverheadArgs {
    /// Channels of the connection.
    #[arg(long, default_value_t = 1)]
    channels: u16,
    /// Transfers per side per repetition.
    #[arg(long, default_value_t = 2000)]
    transfers: usize,
    /// Bytes per transfer, cut into 4 KiB requests. The default measures the engine (many
    /// requests per transfer); `4KiB` measures the whole per-message path (submission,
    /// engine, completion, wait: one request per transfer).
    #[arg(long, default_value = "64MiB")]
    transfer_bytes: String,
    /// Engine idle policy: spin, yield or park (park for instruction counts under callgrind,
    /// which runs one thread at a time: a spinning idle engine's passes would be counted).
    #[arg(long, default_value = "spin")]
    backoff: String,
}

#[derive(Args, Debug)]
struct LatencyArgs {
    /// Message sizes.
    #[arg(long, default_value = "4KiB,64KiB,1MiB")]
    sizes: String,
    /// Measured round trips per size.
    #[arg(long, default_value_t = 2000)]
    iters: usize,
    /// Unmeasured round trips per size.
    #[arg(long, default_value_t = 200)]
    warmup: usize,
    /// Channels of the connection.
    #[arg(long, default_value_t = 1)]
    channels: u16,
    /// Engine idle policy: spin (lowest latency, a core per engine), yield or park.
    #[arg(long, default_value = "spin")]
    backoff: String,
    /// Microseconds a wait polls for its transfer before sleeping (the library's
    /// TCPX_WAIT_SPIN_US); 0 sleeps at once. Default: the library's (50, or 0 below 4 cores).
    #[arg(long)]
    wait_spin_us: Option<u64>,
    /// Seconds any single wait may take.
    #[arg(long, default_value_t = 60)]
    timeout: u64,
    /// Net plugin. Default: TCPX_PLUGIN_PATH, else UCCL_TCPX_PLUGIN_PATH, else the built-in one.
    #[arg(long)]
    plugin: Option<PathBuf>,
    /// Also write one JSON object per row here.
    #[arg(long)]
    json: Option<PathBuf>,
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
        Command::Comm(a) => comm(a),
        Command::Stack(a) => stack(a),
        Command::Onesided(a) => onesided(a),
        Command::Overhead(a) => overhead(a),
        Command::Latency(a) => latency(a),
    };
    if let Err(f) = result {
        eprintln!("tcpx-bench: error: {}", tcpx_tools::error_text(&f.error));
        std::process::exit(f.code);
    }
}

fn usage(e: impl Into<anyhow::Error>) -> Failure {
    Failure {
        code: exit::USAGE,
        error: e.into(),
    }
}

/// A usage error from a plain message.
fn bad(msg: String) -> Failure {
    usage(anyhow::anyhow!(msg))
}

/// `--flag` sizes: parsed, every one at least a byte.
fn check_sizes(flag: &str, text: &str) -> Result<Vec<usize>, Failure> {
    let list = sizes::parse_sizes(text).map_err(|e| bad(format!("{flag}: {e}")))?;
    if list.is_empty() || list.contains(&0) {
        return Err(bad(format!(
            "{flag} {text}: every size must be at least 1 byte"
        )));
    }
    Ok(list)
}

/// One size (`--chunk`, `--bytes`, …), at least `min`.
fn check_size(flag: &str, text: &str, min: usize) -> Result<usize, Failure> {
    let n = sizes::parse_size(text).map_err(|e| bad(format!("{flag}: {e}")))?;
    if n < min {
        return Err(bad(format!("{flag} {text}: must be at least {min} bytes")));
    }
    Ok(n)
}

/// A count that must be at least 1.
fn check_count(flag: &str, n: usize) -> Result<usize, Failure> {
    if n == 0 {
        return Err(bad(format!("{flag} 0: must be at least 1")));
    }
    Ok(n)
}

/// Requests in flight per comm: TCPX's limit is 16.
fn check_window(n: usize) -> Result<usize, Failure> {
    if !(1..=16).contains(&n) {
        return Err(bad(format!(
            "--window {n}: must be between 1 and 16 (the TCPX per-comm limit)"
        )));
    }
    Ok(n)
}

fn check_timeout(secs: u64) -> Result<Duration, Failure> {
    if secs == 0 {
        return Err(bad("--timeout 0: must be at least 1 second".into()));
    }
    Ok(Duration::from_secs(secs))
}

fn check_chunk(text: &str) -> Result<u32, Failure> {
    let n = check_size("--chunk", text, 1)?;
    u32::try_from(n).map_err(|_| bad(format!("--chunk {text}: must be below 4GiB")))
}

/// Everything the server and client agree on, checked once: the endpoint's configuration and
/// the sweep.
fn settings(c: &Common, bind: SocketAddr) -> Result<(Config, Sweep), Failure> {
    // The plan overrides are read (and refused when malformed) by every tool alike.
    let request = tcpx_topo::PlanRequest::from_env().map_err(|e| bad(e.to_string()))?;
    if let Some(map) = &request.gpu_nic_map {
        tcpx_topo::GpuNicMap::parse(tcpx_topo::GPU_NIC_MAP_VAR, map)
            .map_err(|e| bad(e.to_string()))?;
    }
    let mut config = Config::from_env().map_err(|e| bad(e.to_string()))?;
    if let Some(p) = &c.plugin {
        config.backend = Backend::Path(p.clone());
    }
    if let Some(n) = c.channels {
        config.channels = n;
    }
    if config.channels == 0 {
        return Err(bad("--channels 0: must be at least 1".into()));
    }
    if let Some(text) = &c.chunk {
        config.chunk_bytes = check_chunk(text)?;
    }
    config.window = check_window(c.window)?;
    config.timeout = check_timeout(c.timeout)?;
    config.control_addr = bind;
    config.validate().map_err(|e| bad(e.to_string()))?;
    let gpu = c
        .gpu
        .as_ref()
        .and_then(|g| g.indices.first().copied())
        .unwrap_or(0);
    if c.memory == "cuda" && !tcpx::cuda::driver_available() {
        return Err(bad(format!(
            "--memory cuda: no CUDA driver ({})",
            tcpx::cuda::driver_status()
        )));
    }
    let sweep = Sweep {
        sizes: check_sizes("--sizes", &c.sizes)?,
        iters: check_count("--iters", c.iters)?,
        min_bytes: check_size("--min-bytes", &c.min_bytes, 0)?,
        warmup: c.warmup,
        depth: c.depth.map(|d| check_count("--depth", d)).transpose()?,
        window: config.window,
        channels: usize::from(config.channels),
        chunk: config.chunk_bytes as usize,
        baseline: c.baseline == "raw-tcp",
        verify: c.verify,
        timeout: config.timeout,
        memory: if c.memory == "cuda" { "cuda" } else { "host" },
        gpu,
    };
    Ok((config, sweep))
}

fn server(a: ServerArgs) -> Result<(), Failure> {
    let (config, sweep) = settings(&a.common, a.bind)?;
    let baseline_addr = SocketAddr::new(a.bind.ip(), a.bind.port().wrapping_add(1));
    let baseline = TcpListener::bind(baseline_addr)
        .with_context(|| format!("bind the baseline listener {baseline_addr}"))?;
    // Only a client holding the metadata this server prints may connect (issue 14 item 2):
    // a stranger who merely finds the port is refused without disturbing the wait.
    let endpoint = Endpoint::new(Config {
        require_secret: true,
        ..config
    })?;
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
    // Options first, so that a bad option is reported as such whatever --peer holds.
    settings(&a.common, SocketAddr::from(([127, 0, 0, 1], 0)))?;
    let peer = a.peer.trim().trim_start_matches(METADATA_PREFIX).trim();
    let peer: EndpointMetadata = peer
        .parse()
        .map_err(|e| bad(format!("--peer is not server metadata: {e}")))?;
    let bind = SocketAddr::new(
        if peer.control_addr.ip().is_loopback() {
            "127.0.0.1".parse().expect("literal")
        } else {
            "0.0.0.0".parse().expect("literal")
        },
        0,
    );
    let (config, sweep) = settings(&a.common, bind)?;
    let endpoint = Endpoint::new(config)?;
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
        &if sweep.baseline {
            format!("raw TCP, {} streams", sweep.channels)
        } else {
            "none".to_string()
        },
    );
    println!(
        "# every size moves at least {} ({} measured messages, raised to --min-bytes); \
         one-time costs paid before timing; {}",
        sizes::format_size(sweep.min_bytes),
        sweep.iters,
        if sweep.verify {
            "every byte checked after each size's timed part (not in the figures)"
        } else {
            "not verified"
        }
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

/// The JSON file of `--json`, created up front so a bad path fails before any measuring.
fn json_file(path: Option<&PathBuf>) -> Result<Option<std::fs::File>, Failure> {
    match path {
        Some(p) => Ok(Some(std::fs::File::create(p).map_err(|e| {
            bad(format!("--json {}: cannot create it: {e}", p.display()))
        })?)),
        None => Ok(None),
    }
}

fn comm(args: CommArgs) -> Result<(), Failure> {
    pin_loopback();
    let sizes = check_sizes("--sizes", &args.sizes)?;
    let iters = check_count("--iters", args.iters)?;
    let window = check_window(args.window)?;
    let reps = check_count("--reps", args.reps)?;
    let mut json = json_file(args.json.as_ref())?;
    let choice = backend_choice(args.plugin.as_deref(), Backend::Builtin).map_err(usage)?;
    let net = match &choice {
        Backend::Path(path) => {
            tcpx::Net::load(path).with_context(|| format!("load the plugin {}", path.display()))?
        }
        Backend::Builtin => tcpx::Net::builtin()?,
        Backend::Auto => tcpx_runtime::endpoint::backend::open(&Backend::Auto)?.0,
    };
    let mut pair =
        safe_layer::SafeLayerPair::connect(&net).context("connect the benchmark comm pair")?;
    report::print_header(
        &format!("{} (ncclNet {}), 1 comm", net.name(), net.abi_version()),
        "raw TCP, 1 stream",
    );
    for size in sizes {
        let iters = iters.min(((1usize << 30) / size).max(8));
        let (mut ours, mut base, mut latencies) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..reps {
            let m = pair
                .measure(size, args.warmup, iters, window)
                .with_context(|| format!("{size}-byte messages through the plugin"))?;
            ours.push(stats::gbps(size * iters, m.elapsed));
            latencies.extend(m.latencies);
            base.push(stats::gbps(
                size * iters,
                baseline::raw_tcp(size, iters, 1)
                    .with_context(|| format!("raw-TCP baseline, {size}-byte messages"))?,
            ));
        }
        let gbps = stats::median(&mut ours);
        let baseline_gbps = stats::median(&mut base);
        let row = report::Row::new(size, gbps, Some(baseline_gbps), &mut latencies, 1, "host");
        report::print_row(&row);
        if let Some(f) = json.as_mut() {
            writeln!(f, "{}", serde_json::to_string(&row).context("row to JSON")?)
                .context("writing --json")?;
        }
    }
    Ok(())
}

fn stack(args: StackArgs) -> Result<(), Failure> {
    pin_loopback();
    if args.channels == 0 {
        return Err(bad("--channels 0: must be at least 1".into()));
    }
    let chunk = check_chunk(&args.chunk)?;
    let sizes = check_sizes("--sizes", &args.sizes)?;
    let bytes_per_rep = check_size("--bytes", &args.bytes, 1)?;
    let reps = check_count("--reps", args.reps)?;
    let backend = backend_choice(args.plugin.as_deref(), Backend::Builtin).map_err(usage)?;
    let gpus = match args.memory.as_str() {
        "cuda" => {
            if !tcpx::cuda::driver_available() {
                return Err(bad(format!(
                    "--memory cuda: no CUDA driver ({})",
                    tcpx::cuda::driver_status()
                )));
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
    let opts = tcpx_tools::bench::stack::ThroughputOptions {
        channels: args.channels,
        chunk_bytes: chunk,
        sizes,
        bytes_per_rep,
        reps,
        gpus,
        verify: args.verify,
        backend,
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

fn onesided(args: OnesidedArgs) -> Result<(), Failure> {
    use tcpx_tools::bench::onesided::{self as os, Layout, Op};
    pin_loopback();
    let ops = args
        .op
        .split(',')
        .map(str::parse)
        .collect::<Result<Vec<Op>>>()
        .map_err(|e| bad(format!("--op: {e}")))?;
    let batches = args
        .batch
        .split(',')
        .map(|b| {
            b.trim()
                .parse::<usize>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| bad(format!("--batch: `{b}` is not a positive count")))
        })
        .collect::<Result<Vec<_>, Failure>>()?;
    if args.channels == 0 {
        return Err(bad("--channels 0: must be at least 1".into()));
    }
    let chunk = check_chunk(&args.chunk)?;
    let blocks = check_sizes("--block", &args.block)?;
    let max_op_bytes = check_size("--max-op", &args.max_op, 1)?;
    let smallest =
        blocks.iter().min().copied().unwrap_or(0) * batches.iter().min().copied().unwrap_or(0);
    if smallest > max_op_bytes {
        return Err(bad(format!(
            "--block {} × --batch {}: every operation is larger than --max-op {} \
             (nothing to measure)",
            args.block, args.batch, args.max_op
        )));
    }
    let backend = backend_choice(args.plugin.as_deref(), Backend::Builtin).map_err(usage)?;
    let opts = os::Options {
        channels: args.channels,
        chunk_bytes: chunk,
        ops,
        blocks,
        batches,
        bytes_per_point: check_size("--bytes", &args.bytes, 1)?,
        max_op_bytes,
        depth: check_count("--depth", args.depth)?,
        latency_iters: check_count("--latency-iters", args.latency_iters)?.max(3),
        reps: check_count("--reps", args.reps)?,
        layout: if args.layout == "strided" {
            Layout::Strided
        } else {
            Layout::Contiguous
        },
        timeout: check_timeout(args.timeout)?,
        backend,
    };
    let mut json = json_file(args.json.as_ref())?;
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
        return Err(anyhow::Error::from(e).context("writing --json").into());
    }
    Ok(())
}

fn overhead(args: OverheadArgs) -> Result<(), Failure> {
    if args.channels == 0 {
        return Err(bad("--channels 0: must be at least 1".into()));
    }
    let opts = tcpx_tools::bench::overhead::OverheadOptions {
        channels: args.channels,
        backoff: args
            .backoff
            .parse()
            .map_err(|e| bad(format!("--backoff {}: {e}", args.backoff)))?,
        transfers: check_count("--transfers", args.transfers)?,
        transfer_bytes: match tcpx_tools::bench::sizes::parse_size(&args.transfer_bytes) {
            Ok(0) | Err(_) => {
                return Err(bad(format!(
                    "--transfer-bytes {}: expected a positive size such as 4KiB or 64MiB",
                    args.transfer_bytes
                )))
            }
            Ok(n) => n,
        },
        ..Default::default()
    };
    let r = tcpx_tools::bench::overhead::engine_overhead(&opts)?;
    println!("{r:#?}");
    Ok(())
}

fn latency(args: LatencyArgs) -> Result<(), Failure> {
    use tcpx_tools::bench::latency as lat;
    pin_loopback();
    if args.channels == 0 {
        return Err(bad("--channels 0: must be at least 1".into()));
    }
    let backoff: Backoff = args
        .backoff
        .parse()
        .map_err(|e| bad(format!("--backoff {}: {e}", args.backoff)))?;
    let opts = lat::Options {
        sizes: check_sizes("--sizes", &args.sizes)?,
        iters: check_count("--iters", args.iters)?,
        warmup: args.warmup,
        channels: args.channels,
        chunk_bytes: tcpx_runtime::schedule::DEFAULT_CHUNK_BYTES,
        backoff,
        wait_spin: args.wait_spin_us.map_or_else(
            tcpx_runtime::config::default_wait_spin,
            Duration::from_micros,
        ),
        backend: backend_choice(args.plugin.as_deref(), Backend::Builtin).map_err(usage)?,
        timeout: check_timeout(args.timeout)?,
    };
    let mut json = json_file(args.json.as_ref())?;
    println!(
        "# one-way latency = ping-pong round trip / 2, {} round trips after {} unmeasured; \
         tcpx: 2 endpoints in this process, {} channel(s), engine backoff {:?}, wait spin {:?}; \
         raw TCP: one loopback connection, TCP_NODELAY, blocking reads",
        opts.iters, opts.warmup, opts.channels, opts.backoff, opts.wait_spin
    );
    println!(
        "{:>10} {:>10} {:>10} {:>12} {:>12} {:>9}",
        "size", "p50 µs", "p99 µs", "tcp p50 µs", "tcp p99 µs", "p50 ratio"
    );
    let mut write_err = None;
    lat::run(&opts, |row| {
        println!(
            "{:>10} {:>10.1} {:>10.1} {:>12.1} {:>12.1} {:>9.2}",
            sizes::format_size(row.bytes),
            row.p50_us,
            row.p99_us,
            row.tcp_p50_us,
            row.tcp_p99_us,
            row.ratio
        );
        if let Some(f) = json.as_mut() {
            if let Err(e) = writeln!(f, "{}", serde_json::to_string(row).expect("rows serialize")) {
                write_err.get_or_insert(e);
            }
        }
    })?;
    if let Some(e) = write_err {
        return Err(anyhow::Error::from(e).context("writing --json").into());
    }
    Ok(())
}
