//! `tcpx-bench`: throughput and latency of the tcpx stack against an in-run raw-TCP baseline.
//!
//! Roles: `server` and `client` (two processes; `cargo xtask bench` starts both, locally, in
//! network namespaces or on two nodes over ssh); `comm` (one comm pair through the safe layer
//! against one TCP stream, in this process); `stack` (two endpoints in this process, N channels
//! against N streams); `onesided` (one-sided write / read sweep over block and batch sizes
//! against two-sided send / recv of the same bytes, two endpoints in this process);
//! `overhead` (engine cost per request with a plugin that completes instantly); `latency`
//! (one-way latency from ping-pong round trips, tcpx and raw TCP with TCP_NODELAY); `kv`
//! (`kv server` / `kv client`, two processes: scattered KV blocks by one-sided WRITE and
//! READ against the same bytes contiguous, two-sided and over raw TCP, first transfers on
//! their own rows).
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
use tcpx_tools::bench::limits::{staging_bytes, Demand};
use tcpx_tools::bench::pair::{self, exit, Failure, Sweep, METADATA_PREFIX};
use tcpx_tools::bench::rendezvous::{Published, Rendezvous, DEFAULT_KV_NAME, DEFAULT_SERVER_NAME};
use tcpx_tools::bench::{baseline, kv, live, report, safe_layer, sizes, stats};

/// Measure tcpx transfers against plain TCP in the same run.
///
/// Every figure is GB/s = 10^9 bytes/s per GPU (or comm) pair, never summed silently, with the
/// raw-TCP baseline measured in the same run and the ratio between the two.
///
/// Two processes:   tcpx-bench server --bind 127.0.0.1:7700
///                  tcpx-bench client --peer HEX   (the metadata line the server prints)
/// Or by name:      tcpx-bench server --store etcd://127.0.0.1:2379/job1
///                  tcpx-bench client --store etcd://127.0.0.1:2379/job1
/// KV blocks:       tcpx-bench kv server / tcpx-bench kv client --peer HEX  (see `kv --help`)
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
    /// KV-cache hand-off between two processes: N scattered blocks by one-sided WRITE / READ,
    /// against the same bytes contiguous, two-sided and over raw TCP (`kv server`, `kv client`).
    ///
    /// A transfer is N blocks of B bytes (`--shapes 1024x16KiB,64x1MiB`, or `--blocks 1024
    /// --block 16KiB`) at shuffled, non-adjacent offsets in a region twice their size, on both
    /// sides, as in a paged KV cache: nothing coalesces. Per shape, on a fresh connection, the
    /// client (the initiator) times, one after the other:
    ///
    ///   write              one-sided WRITE of the block list, a notification with each
    ///   write contiguous   the same bytes as one block: what the list could reach
    ///   read               one-sided READ of the block list
    ///   read contiguous    the same bytes as one block
    ///   send/recv          the same bytes two-sided, each transfer acknowledged by the server
    ///   raw TCP            the same bytes over as many plain TCP streams as channels
    ///
    /// and prints, per shape and transfer: GB/s (10^9 B/s), p50 / p99 per transfer, the ratio
    /// to the contiguous transfer and to raw TCP, and each phase's FIRST transfer on a row of
    /// its own (the first use of the connection and of the list shape; kept out of the steady
    /// figures, its time under `p50 µs` and as a multiple of the steady p50). The server (the
    /// target) advertises its region and makes no call during one-sided phases; after each,
    /// it checks that every notification arrived, in order, and with --verify every byte
    /// (the initiator checks what it read).
    ///
    ///   tcpx-bench kv server --bind 127.0.0.1:7700 --verify
    ///   tcpx-bench kv client --peer HEX --verify      (HEX: the server's metadata line)
    /// or, through etcd instead of the hex line (see `kv server --help`, --store):
    ///   tcpx-bench kv server --store etcd://127.0.0.1:2379/job1 --verify
    ///   tcpx-bench kv client --store etcd://127.0.0.1:2379/job1 --verify
    ///   add --memory cuda --gpu N to both for GPU memory (staged through pinned host memory
    ///   on the built-in plugin)
    ///
    /// Both processes need the same options (the client checks). Exit codes as for
    /// server/client: 0 ok, 1 error, 2 usage, 3 peer unreachable or lost, 4 data differed.
    #[command(verbatim_doc_comment)]
    Kv(KvArgs),
}

/// Connection and run settings every two-process mode shares (server/client and kv).
#[derive(Args, Debug, Clone)]
struct Link {
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
    /// Check every byte after each timed part (the figures do not include the checking).
    #[arg(long)]
    verify: bool,
    /// Seconds any single wait may take before the run fails.
    #[arg(long, default_value_t = 60)]
    timeout: u64,
}

/// The size sweep's settings; both roles must be given the same.
#[derive(Args, Debug, Clone)]
struct Common {
    /// Messages in flight at once. Default: per size, enough to fill every channel's window
    /// (channels × window requests; at least 8, at most 1024), as the raw-TCP baseline has
    /// no limit in flight; 1024 for sizes up to TCPX_EAGER_BYTES (eager frames: no window
    /// limits them); give a number to measure at a fixed depth.
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
    /// Messages per submission: 1 posts each message with its own send / recv call; more
    /// posts them in batches (`Connection::send_batch` / `recv_batch`: one job, one packed
    /// stream on the wire), at most 4 MiB per batch, for messages of up to 64 KiB (larger
    /// ones still go one per call). The way to move many small messages at wire speed
    /// (batches of 1–4 MiB do best: 1024 for 4 KiB messages); `--depth` then counts
    /// batches in flight (default: enough to fill every channel's window, as many as two
    /// pack buffers per channel hold — batches share a buffer in 64 KiB slices — unless
    /// TCPX_PACK_BUFFERS says otherwise), and p50/p99 are per batch.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Put every message slot in one region, at consecutive offsets, instead of one region
    /// per slot: the shape of applications that register one buffer and send from offsets
    /// in it (UCCL's and NIXL's users). Each side chooses its own layout.
    #[arg(long)]
    one_region: bool,
    /// Measure every size this many times, each time the stack and then the baseline: rows
    /// report the medians (GB/s of each, and of the rounds' ratios) and the range of the
    /// ratios. On shared or noisy machines (cloud VMs, both ends on one host) one round can
    /// be off by a factor of two; 3 or 5 give a figure to compare.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    #[command(flatten)]
    link: Link,
}

/// Rendezvous by name through a store instead of copying the metadata line by hand.
#[derive(Args, Debug, Clone)]
struct StoreArgs {
    /// Rendezvous store: etcd://HOST:PORT[,HOST:PORT...]/JOB[?ttl=SECONDS]. The server
    /// publishes its endpoint there under --name (and removes it when it exits; a server
    /// that dies leaves it for at most the lease's TTL, 10 s unless ?ttl= says otherwise);
    /// the client waits up to --timeout for the name and connects to what it finds. Both
    /// must name the same store and job. The metadata line is still printed.
    #[arg(long, value_name = "URL")]
    store: Option<String>,
    /// Name under --store's job (default: tcpx-bench-server, tcpx-bench-kv-server for kv).
    #[arg(long, value_name = "NAME", requires = "store")]
    name: Option<String>,
}

impl StoreArgs {
    /// The store opened for this role's name, if `--store` was given.
    fn open(&self, default_name: &str) -> Result<Option<Rendezvous>, Failure> {
        self.store
            .as_deref()
            .map(|url| Rendezvous::open(url, self.name.as_deref().unwrap_or(default_name)))
            .transpose()
    }
}

#[derive(Args, Debug)]
struct ServerArgs {
    /// Control address (the raw-TCP baseline listens on its port + 1). Port 0 picks a free
    /// pair of ports; the metadata line carries the one picked.
    #[arg(long, default_value = "127.0.0.1:7700")]
    bind: SocketAddr,
    #[command(flatten)]
    store: StoreArgs,
    #[command(flatten)]
    common: Common,
}

#[derive(Args, Debug)]
struct ClientArgs {
    /// The server's metadata (the hex after TCPX-BENCH-METADATA); or give --store.
    #[arg(long, required_unless_present = "store", conflicts_with = "store")]
    peer: Option<String>,
    #[command(flatten)]
    store: StoreArgs,
    /// Also write one JSON object per size to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    #[command(flatten)]
    common: Common,
}

#[derive(Args, Debug)]
struct KvArgs {
    #[command(subcommand)]
    role: KvRole,
}

#[derive(Subcommand, Debug)]
enum KvRole {
    /// The target: print the metadata line, serve one client's shapes, exit.
    Server(KvServerArgs),
    /// The initiator: run every shape against a server and print the table.
    Client(KvClientArgs),
}

#[derive(Args, Debug)]
struct KvServerArgs {
    /// Control address (the raw-TCP baseline listens on its port + 1). Port 0 picks a free
    /// pair of ports; the metadata line carries the one picked.
    #[arg(long, default_value = "127.0.0.1:7700")]
    bind: SocketAddr,
    #[command(flatten)]
    store: StoreArgs,
    #[command(flatten)]
    kv: KvCommon,
}

#[derive(Args, Debug)]
struct KvClientArgs {
    /// The server's metadata (the hex after TCPX-BENCH-METADATA); or give --store.
    #[arg(long, required_unless_present = "store", conflicts_with = "store")]
    peer: Option<String>,
    #[command(flatten)]
    store: StoreArgs,
    /// Also write one JSON object per row to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    #[command(flatten)]
    kv: KvCommon,
}

/// The kv run's settings; both processes must be given the same.
#[derive(Args, Debug, Clone)]
struct KvCommon {
    /// Transfer shapes, BLOCKSxSIZE, comma-separated (one fresh connection each).
    #[arg(long, default_value = "1024x16KiB,512x64KiB,64x1MiB")]
    shapes: String,
    /// Blocks per transfer of a single shape (with --block; replaces --shapes).
    #[arg(long)]
    blocks: Option<String>,
    /// Bytes per block of a single shape (with --blocks; replaces --shapes).
    #[arg(long)]
    block: Option<String>,
    /// One-sided operations, a comma list of write and read (each also runs on one
    /// contiguous block).
    #[arg(long, default_value = "write,read")]
    op: String,
    /// Measured transfers per phase (raised to move at least --min-bytes, capped so a phase
    /// moves about 1 GiB at most, never fewer than 4).
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Every phase moves at least this many bytes; 0 turns the floor off.
    #[arg(long, default_value = "256MiB")]
    min_bytes: String,
    /// Unmeasured transfers per phase, after its first one.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Transfers in flight (1: one hand-off at a time, as a serving stack moves one
    /// request's blocks).
    #[arg(long, default_value_t = 1)]
    depth: usize,
    /// Pause before each measured transfer, in microseconds (with --depth 1): the engines and
    /// control loops go idle in between, as between a serving stack's requests, and the
    /// figures show what a transfer after idle costs (GB/s then count the transfers' own
    /// time, not the pauses). Only the client's value matters. 0: back to back.
    #[arg(long, default_value_t = 0)]
    gap_us: u64,
    #[command(flatten)]
    link: Link,
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
    /// Block placement: contiguous (blocks coalesce), strided (remote: one run per block),
    /// scattered (both sides: one run per block, like paged KV blocks) or tensors (every
    /// block its own region on both sides, registered one by one, like UCCL's writev over a
    /// list of tensors).
    #[arg(long, default_value = "contiguous", value_parser = ["contiguous", "strided", "scattered", "tensors"])]
    layout: String,
    /// Memory to move: host, or cuda (initiator on the first --gpu, target on the second;
    /// staged through pinned host memory by the built-in socket plugin).
    #[arg(long, default_value = "host", value_parser = ["host", "cuda"])]
    memory: String,
    /// With --memory cuda: the initiator's and target's GPUs, `0,1` (one index: both on that
    /// GPU). Default: 0,1 when there are two GPUs, else 0.
    #[arg(long, value_parser = parse_gpus)]
    gpu: Option<GpuList>,
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
    /// Microseconds the pinger idles before each round trip, on both paths (not timed): the
    /// latency of a message after the stack went quiet, as sporadic requests see it (with
    /// `--backoff park`, the library's default, engines block after TCPX_ENGINE_LINGER_US).
    /// 0: back to back.
    #[arg(long, default_value_t = 0)]
    gap_us: u64,
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
        Command::Kv(a) => match a.role {
            KvRole::Server(s) => kv_server(s),
            KvRole::Client(c) => kv_client(c),
        },
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

/// Longest pause `--gap-us` takes: past it no engine or loop is still awake to measure, and a
/// typo (a pause of hours per transfer) would look like a hang.
const MAX_GAP_US: u64 = 10_000_000;

fn check_gap(us: u64) -> Result<Duration, Failure> {
    if us > MAX_GAP_US {
        return Err(bad(format!(
            "--gap-us {us}: at most {MAX_GAP_US} (10 s) of idle before each transfer"
        )));
    }
    Ok(Duration::from_micros(us))
}

fn check_chunk(text: &str) -> Result<u32, Failure> {
    let n = check_size("--chunk", text, 1)?;
    u32::try_from(n).map_err(|_| bad(format!("--chunk {text}: must be below 4GiB")))
}

/// Refuses options that ask for more sockets or memory than this process may open or
/// allocate, before anything is opened (see `tcpx_tools::bench::limits`).
fn check_demand(demand: Demand) -> Result<(), Failure> {
    demand.check().map_err(bad)
}

/// Host memory for `slots` messages of the largest of `sizes` (`--sizes`, named by `option`),
/// or, with GPU memory, the engines' pinned staging for `channels` × `window` × `chunk`.
fn memory_demand(
    d: Demand,
    cuda: bool,
    sizes: (&str, &[usize], usize),
    ring: (u64, u64, u64),
) -> Demand {
    let (text, list, slots) = sizes;
    let (channels, window, chunk) = ring;
    if cuda {
        let bytes = staging_bytes(d.sides, channels, window, chunk);
        let option = format!("--channels {channels} × --window {window} × --chunk {chunk}");
        d.memory(option, bytes)
    } else {
        let max = list.iter().copied().max().unwrap_or(0) as u64;
        let bytes = max.saturating_mul(slots as u64).saturating_mul(d.sides);
        d.memory(format!("--sizes {text}"), bytes)
    }
}

/// What the shared link settings decided, besides the endpoint's configuration.
struct LinkChoice {
    channels: usize,
    chunk: usize,
    baseline: bool,
    verify: bool,
    timeout: Duration,
    memory: &'static str,
    gpu: usize,
}

/// The endpoint's configuration from the environment and the shared flags, checked once
/// (server/client and kv alike).
fn link_settings(l: &Link, bind: SocketAddr) -> Result<(Config, LinkChoice), Failure> {
    // The plan overrides are read (and refused when malformed) by every tool alike.
    let request = tcpx_topo::PlanRequest::from_env().map_err(|e| bad(e.to_string()))?;
    if let Some(map) = &request.gpu_nic_map {
        tcpx_topo::GpuNicMap::parse(tcpx_topo::GPU_NIC_MAP_VAR, map)
            .map_err(|e| bad(e.to_string()))?;
    }
    let mut config = Config::from_env().map_err(|e| bad(e.to_string()))?;
    if let Some(p) = &l.plugin {
        config.backend = Backend::Path(p.clone());
    }
    if let Some(n) = l.channels {
        config.channels = n;
    }
    if config.channels == 0 {
        return Err(bad("--channels 0: must be at least 1".into()));
    }
    if let Some(text) = &l.chunk {
        config.chunk_bytes = check_chunk(text)?;
    }
    config.window = check_window(l.window)?;
    config.timeout = check_timeout(l.timeout)?;
    config.control_addr = bind;
    config.validate().map_err(|e| bad(e.to_string()))?;
    let gpu = l
        .gpu
        .as_ref()
        .and_then(|g| g.indices.first().copied())
        .unwrap_or(0);
    if l.memory == "cuda" && !tcpx::cuda::driver_available() {
        return Err(bad(format!(
            "--memory cuda: no CUDA driver ({})",
            tcpx::cuda::driver_status()
        )));
    }
    if l.memory == "cuda" && config.gpu_index.is_none() {
        // Announce the GPU, as an application serving one would (`TCPX_GPU_INDEX`): the
        // endpoint then chooses its defaults for CUDA traffic.
        config.gpu_index = u32::try_from(gpu).ok();
    }
    let choice = LinkChoice {
        channels: usize::from(config.channels),
        chunk: config.chunk_bytes as usize,
        baseline: l.baseline == "raw-tcp",
        verify: l.verify,
        timeout: config.timeout,
        memory: if l.memory == "cuda" { "cuda" } else { "host" },
        gpu,
    };
    Ok((config, choice))
}

/// Everything the server and client agree on, checked once: the endpoint's configuration and
/// the sweep.
fn settings(c: &Common, bind: SocketAddr) -> Result<(Config, Sweep), Failure> {
    let (mut config, link) = link_settings(&c.link, bind)?;
    if c.batch > 1 && std::env::var_os("TCPX_PACK_BUFFERS").is_none() {
        // Batches in flight are bounded by the pooled pack buffers: two per channel keep
        // every channel's socket fed while the submitting threads copy (H200, 8 channels,
        // 16 KiB in batches of 256: 13.5–16 GB/s with 8 buffers, 21–37 with 32).
        config.pack_buffers = config
            .pack_buffers
            .max(2 * usize::from(config.channels))
            .min(tcpx_runtime::config::MAX_PACK_BUFFERS);
    }
    let sweep = Sweep {
        sizes: check_sizes("--sizes", &c.sizes)?,
        iters: check_count("--iters", c.iters)?,
        min_bytes: check_size("--min-bytes", &c.min_bytes, 0)?,
        warmup: c.warmup,
        depth: c.depth.map(|d| check_count("--depth", d)).transpose()?,
        window: config.window,
        channels: link.channels,
        chunk: link.chunk,
        baseline: link.baseline,
        verify: link.verify,
        timeout: link.timeout,
        memory: link.memory,
        gpu: link.gpu,
        batch: check_count("--batch", c.batch)?,
        pack_buffers: config.pack_buffers,
        eager_bytes: config.eager_limit(),
        one_region: c.one_region,
        rounds: check_count("--rounds", c.rounds)?,
    };
    // The sender and receiver each keep up to `depth` messages (at most 1 GiB of them).
    let slots = sweep.slots();
    let ring = (
        u64::from(config.channels),
        config.window as u64,
        u64::from(config.chunk_bytes),
    );
    let base = if sweep.baseline {
        sweep.channels as u64
    } else {
        0
    };
    let demand =
        Demand::channels(format!("--channels {}", config.channels), 1, ring.0).baseline(base);
    check_demand(memory_demand(
        demand,
        c.link.memory == "cuda",
        (&c.sizes, &sweep.sizes, slots),
        ring,
    ))?;
    Ok((config, sweep))
}

/// Starts a server's endpoint on `config` (peers must present the secret of the metadata it
/// prints), binds the raw-TCP baseline listener on the control port + 1 and prints the
/// metadata line launchers wait for.
///
/// The baseline follows the port the endpoint actually bound, which its metadata carries, not
/// the one asked for: with `--bind 127.0.0.1:0` (the kernel picks a free port, as a launcher
/// running several servers wants) the baseline had gone to port 1 while clients dialled the
/// picked port + 1, and every run failed at its baseline.
///
/// With port 0 the port after the kernel's pick may be taken; see
/// [`tcpx_tools::bench::rawtcp::open_beside_baseline`].
fn start_server(config: Config, bind: SocketAddr) -> Result<(Endpoint, TcpListener), Failure> {
    let (endpoint, baseline) = tcpx_tools::bench::rawtcp::open_beside_baseline(bind, || {
        // Only a client holding the metadata this server prints may connect (issue 14 item
        // 2): a stranger who merely finds the port is refused without disturbing the wait.
        let endpoint = Endpoint::new(Config {
            require_secret: true,
            ..config.clone()
        })?;
        let port = endpoint.metadata().control_addr.port();
        Ok((endpoint, port))
    })?;
    let metadata = endpoint.metadata();
    let hex = metadata
        .to_hex()
        .map_err(|e| anyhow::anyhow!("encode metadata: {e}"))?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{METADATA_PREFIX} {hex}")?;
    out.flush()?;
    drop(out);
    Ok((endpoint, baseline))
}

fn server(a: ServerArgs) -> Result<(), Failure> {
    let (config, sweep) = settings(&a.common, a.bind)?;
    let store = a.store.open(DEFAULT_SERVER_NAME)?;
    let (endpoint, baseline) = start_server(config, a.bind)?;
    let _published = publish(store.as_ref(), &endpoint)?;
    pair::serve(&endpoint, &baseline, &sweep)?;
    if sweep.memory == "cuda" {
        report::print_copy_lists(sweep.gpu);
    }
    Ok(())
}

/// Publishes the server's endpoint under `--name` when `--store` was given; the guard removes
/// the name when the server returns (success or failure).
fn publish<'a>(
    store: Option<&'a Rendezvous>,
    endpoint: &'a Endpoint,
) -> Result<Option<Published<'a>>, Failure> {
    let Some(store) = store else {
        return Ok(None);
    };
    let published = store.publish(endpoint)?;
    eprintln!(
        "tcpx-bench: published as {:?} in {}",
        store.name(),
        store.describe()
    );
    Ok(Some(published))
}

/// The server's metadata, from `--peer` (with or without the METADATA prefix) or found under
/// `--name` in `--store` (waiting up to `--timeout`), and the address the client binds:
/// loopback for a loopback server, else any.
fn peer_and_bind(
    peer: Option<&str>,
    store: &StoreArgs,
    default_name: &str,
    timeout: u64,
) -> Result<(EndpointMetadata, SocketAddr), Failure> {
    let peer: EndpointMetadata = match (peer, store.open(default_name)?) {
        (_, Some(store)) => store.find(check_timeout(timeout)?)?,
        (Some(text), None) => text
            .trim()
            .trim_start_matches(METADATA_PREFIX)
            .trim()
            .parse()
            .map_err(|e| bad(format!("--peer is not server metadata: {e}")))?,
        (None, None) => return Err(bad("give --peer HEX or --store URL".into())),
    };
    let bind = SocketAddr::new(
        if peer.control_addr.ip().is_loopback() {
            "127.0.0.1".parse().expect("literal")
        } else {
            "0.0.0.0".parse().expect("literal")
        },
        0,
    );
    Ok((peer, bind))
}

fn client(a: ClientArgs) -> Result<(), Failure> {
    // Options first, so that a bad option is reported as such whatever --peer holds.
    settings(&a.common, SocketAddr::from(([127, 0, 0, 1], 0)))?;
    let (peer, bind) = peer_and_bind(
        a.peer.as_deref(),
        &a.store,
        DEFAULT_SERVER_NAME,
        a.common.link.timeout,
    )?;
    let (config, sweep) = settings(&a.common, bind)?;
    let endpoint = Endpoint::new(config)?;
    let mut json = match &a.json {
        Some(p) => {
            Some(std::fs::File::create(p).with_context(|| format!("create {}", p.display()))?)
        }
        None => None,
    };
    let bar = progress_bar(sweep.sizes.len(), "sizes");
    report::print_header(
        &format!(
            "{} via tcpx-runtime, {} channels, gpu {}",
            endpoint.backend().name,
            sweep.channels,
            a.common
                .link
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
         one-time costs paid before timing; {}{}{}",
        sizes::format_size(sweep.min_bytes),
        sweep.iters,
        if sweep.one_region {
            "every message slot in one region (--one-region); "
        } else {
            ""
        },
        if sweep.batch > 1 {
            format!(
                "posted in batches of up to {} messages (send_batch; p50/p99 per batch); ",
                sweep.batch
            )
        } else {
            String::new()
        },
        if sweep.verify {
            "every byte checked after each size's timed part (not in the figures)"
        } else {
            "not verified"
        }
    );
    if sweep.rounds > 1 {
        println!(
            "# {} rounds per size, each the stack then the baseline: medians of GB/s and of \
             the rounds' ratios; the last column is the ratios' range",
            sweep.rounds
        );
    }
    let gpu = a.common.link.gpu.as_ref().map(GpuList::json);
    let mut write_err = None;
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        // On a terminal, a live line of GB/s per NIC under the bar (the endpoint's metrics).
        if !bar.is_hidden() {
            s.spawn(|| live::run(&endpoint, &bar, &stop));
        }
        let result = pair::drive(&endpoint, &peer, &sweep, |row| {
            bar.suspend(|| report::print_row(row));
            bar.inc(1);
            if let Some(f) = json.as_mut() {
                let mut v = serde_json::to_value(row).expect("rows serialize");
                v["gpu"] = serde_json::json!(gpu);
                if let Err(e) = writeln!(f, "{v}") {
                    write_err.get_or_insert(e);
                }
            }
        });
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        result
    })?;
    bar.finish_and_clear();
    if sweep.memory == "cuda" {
        report::print_copy_lists(sweep.gpu);
    }
    if let Some(e) = write_err {
        return Err(anyhow::Error::from(e).context("writing --json").into());
    }
    Ok(())
}

/// A progress bar on a terminal's stderr (hidden otherwise) counting `len` `things`.
fn progress_bar(len: usize, things: &str) -> indicatif::ProgressBar {
    if !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(&format!(
            "{{spinner}} {things} {{pos}}/{{len}} [{{elapsed_precise}}] {{wide_bar}} {{msg}}"
        ))
        .expect("static template"),
    );
    bar
}

/// The kv plan and the endpoint's configuration, every option checked.
fn kv_plan(k: &KvCommon, bind: SocketAddr) -> Result<(Config, kv::Plan), Failure> {
    let (config, link) = link_settings(&k.link, bind)?;
    if k.link.gpu.as_ref().is_some_and(|g| g.indices.len() > 1) {
        return Err(bad(
            "--gpu: kv runs one GPU per process (give one index)".into()
        ));
    }
    let shapes = match (&k.blocks, &k.block) {
        (None, None) => kv::parse_shapes(&k.shapes).map_err(|e| bad(format!("--shapes: {e}")))?,
        (Some(n), Some(b)) => {
            let blocks: usize = n
                .trim()
                .parse()
                .map_err(|_| bad(format!("--blocks {n}: not a block count")))?;
            let block = check_size("--block", b, 1)?;
            vec![kv::Shape::new(blocks, block)
                .map_err(|e| bad(format!("--blocks {n} --block {b}: {e}")))?]
        }
        _ => {
            return Err(bad(
                "--blocks and --block go together (one shape: --blocks 1024 --block 16KiB)".into(),
            ))
        }
    };
    let mut ops = Vec::new();
    for word in k.op.split(',') {
        let op: kv::Op = word.parse().map_err(|e| bad(format!("--op: {e}")))?;
        if !ops.contains(&op) {
            ops.push(op);
        }
    }
    let plan = kv::Plan {
        shapes,
        ops,
        iters: check_count("--iters", k.iters)?,
        min_bytes: check_size("--min-bytes", &k.min_bytes, 0)?,
        warmup: k.warmup,
        depth: check_count("--depth", k.depth)?,
        gap: if k.gap_us > 0 && k.depth != 1 {
            return Err(bad(format!(
                "--gap-us {}: pauses between transfers need --depth 1",
                k.gap_us
            )));
        } else {
            check_gap(k.gap_us)?
        },
        channels: link.channels,
        chunk: link.chunk,
        baseline: link.baseline,
        verify: link.verify,
        timeout: link.timeout,
        memory: link.memory,
        gpu: link.gpu,
    };
    Ok((config, plan))
}

fn kv_server(a: KvServerArgs) -> Result<(), Failure> {
    let (config, plan) = kv_plan(&a.kv, a.bind)?;
    let store = a.store.open(DEFAULT_KV_NAME)?;
    let (endpoint, baseline) = start_server(config, a.bind)?;
    let _published = publish(store.as_ref(), &endpoint)?;
    kv::serve(&endpoint, &baseline, &plan)
}

fn kv_client(a: KvClientArgs) -> Result<(), Failure> {
    // Options first, so that a bad option is reported as such whatever --peer holds.
    kv_plan(&a.kv, SocketAddr::from(([127, 0, 0, 1], 0)))?;
    let mut json = json_file(a.json.as_ref())?;
    let (peer, bind) = peer_and_bind(
        a.peer.as_deref(),
        &a.store,
        DEFAULT_KV_NAME,
        a.kv.link.timeout,
    )?;
    let (config, plan) = kv_plan(&a.kv, bind)?;
    let endpoint = Endpoint::new(config)?;
    let gpu = match plan.memory {
        "cuda" => format!(" on GPU {}", plan.gpu),
        _ => String::new(),
    };
    println!(
        "{}",
        kv::report::preamble(
            &plan,
            &format!(
                "{} via tcpx-runtime, {} channels (+{} one-sided), {} memory{gpu}",
                endpoint.backend().name,
                plan.channels,
                plan.channels,
                plan.memory
            )
        )
    );
    println!("{}", kv::report::header());
    let bar = progress_bar(plan.shapes.len() * plan.phases().len(), "phases");
    let gpu = a.kv.link.gpu.as_ref().map(GpuList::json);
    let mut write_err = None;
    kv::drive(
        &endpoint,
        &peer,
        &plan,
        || bar.inc(1),
        |rows| {
            bar.suspend(|| {
                for row in rows {
                    println!("{}", kv::report::line(row));
                }
            });
            if let Some(f) = json.as_mut() {
                for row in rows {
                    let mut v = serde_json::to_value(row).expect("rows serialize");
                    v["gpu"] = serde_json::json!(gpu);
                    if let Err(e) = writeln!(f, "{v}") {
                        write_err.get_or_insert(e);
                    }
                }
            }
        },
    )?;
    bar.finish_and_clear();
    if let Some(e) = write_err {
        return Err(anyhow::Error::from(e).context("writing --json").into());
    }
    Ok(())
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

/// The (first, second) GPUs of `--memory cuda` (`None` for host memory): `--gpu a,b`, one
/// index for both, else 0,1 with two GPUs and 0 otherwise. No CUDA driver is an error (exit 2
/// as a usage error would be: the option cannot be served here).
fn cuda_pair(memory: &str, gpu: Option<&GpuList>) -> Result<Option<[usize; 2]>, Failure> {
    if memory != "cuda" {
        return Ok(None);
    }
    if !tcpx::cuda::driver_available() {
        return Err(bad(format!(
            "--memory cuda: no CUDA driver ({})",
            tcpx::cuda::driver_status()
        )));
    }
    Ok(Some(match gpu.map(|g| g.indices.as_slice()) {
        Some([one]) => [*one, *one],
        Some([a, b, ..]) => [*a, *b],
        _ if tcpx::cuda::CudaDevice::count() >= 2 => [0, 1],
        _ => [0, 0],
    }))
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
    // Both endpoints and both ends of every baseline stream live in this process.
    let ring = (
        u64::from(args.channels),
        Config::default().window as u64,
        u64::from(chunk),
    );
    let demand =
        Demand::channels(format!("--channels {}", args.channels), 2, ring.0).baseline(ring.0);
    check_demand(memory_demand(
        demand,
        args.memory == "cuda",
        (&args.sizes, &sizes, 1),
        ring,
    ))?;
    let backend = backend_choice(args.plugin.as_deref(), Backend::Builtin).map_err(usage)?;
    let gpus = cuda_pair(&args.memory, args.gpu.as_ref())?;
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
    // Both endpoints hold the largest operation's blocks (at most --max-op) on each side.
    let largest =
        blocks.iter().max().copied().unwrap_or(0) * batches.iter().max().copied().unwrap_or(0);
    let held = (largest.min(max_op_bytes) as u64).saturating_mul(2);
    check_demand(
        Demand::channels(
            format!("--channels {}", args.channels),
            2,
            u64::from(args.channels),
        )
        .memory(format!("--max-op {}", args.max_op), held),
    )?;
    let backend = backend_choice(args.plugin.as_deref(), Backend::Builtin).map_err(usage)?;
    let gpus = cuda_pair(&args.memory, args.gpu.as_ref())?;
    let opts = os::Options {
        gpus,
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
        layout: match args.layout.as_str() {
            "strided" => Layout::Strided,
            "scattered" => Layout::Scattered,
            "tensors" => Layout::Tensors,
            _ => Layout::Contiguous,
        },
        timeout: check_timeout(args.timeout)?,
        backend,
    };
    let mut json = json_file(args.json.as_ref())?;
    let memory = match gpus {
        Some([a, b]) => format!("GPU {a} → GPU {b} (staged through pinned host memory)"),
        None => "host memory".to_string(),
    };
    println!(
        "# one-sided vs two-sided send/recv of the same bytes per op; 2 endpoints in this \
         process, {} channels (+{} one-sided), loopback, {} layout, {memory}, {} ops in \
         flight; GB/s = 10^9 B/s; latency one op at a time (write: until acknowledged)",
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
    let sizes = check_sizes("--sizes", &args.sizes)?;
    // Two endpoints with one buffer of the largest size each, and one raw-TCP connection.
    let ring = (u64::from(args.channels), 0, 0);
    let demand = Demand::channels(format!("--channels {}", args.channels), 2, ring.0).baseline(1);
    check_demand(memory_demand(demand, false, (&args.sizes, &sizes, 1), ring))?;
    let opts = lat::Options {
        sizes,
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
        gap: check_gap(args.gap_us)?,
    };
    let mut json = json_file(args.json.as_ref())?;
    println!(
        "# one-way latency = ping-pong round trip / 2, {} round trips after {} unmeasured{}; \
         tcpx: 2 endpoints in this process, {} channel(s), engine backoff {:?}, wait spin {:?}; \
         raw TCP: one loopback connection, TCP_NODELAY, blocking reads",
        opts.iters,
        opts.warmup,
        if opts.gap.is_zero() {
            String::new()
        } else {
            format!(", each after {:?} idle", opts.gap)
        },
        opts.channels,
        opts.backoff,
        opts.wait_spin
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
