//! [`Config`]: every knob of an [`Endpoint`](crate::Endpoint), from a builder, from the
//! environment ([`Config::from_env`]) or from the tools' command-line flags (which map onto the
//! builder).
//!
//! Environment variables (empty counts as unset; UCCL's names are accepted as aliases):
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `TCPX_PLUGIN_PATH` / `UCCL_TCPX_PLUGIN_PATH` | plugin `.so` to load | search, then built-in |
//! | `TCPX_BACKEND` | `auto`, `builtin`, or a path | `auto` |
//! | `TCPX_NUM_CHANNELS` / `UCCL_TCPX_NUM_CHANNELS` | channels per connection (a connection uses the smaller of both peers' counts) | 4 |
//! | `TCPX_CHUNK_BYTES` / `UCCL_TCPX_CHUNK_BYTES` | chunk size (`524288`, `512K`, `1M`; a connection uses the smaller of both peers' sizes) | 512 KiB |
//! | `TCPX_WINDOW` | requests in flight per comm (1..=16) | 16 |
//! | `TCPX_TIMEOUT_MS` | set-up and per-transfer timeout | 30000 |
//! | `TCPX_CONTROL_ADDR` | control listener (`ip:port`) | `0.0.0.0:0` |
//! | `TCPX_DEVICES` | plugin devices to use (`0,1`) | all |
//! | `TCPX_GPU_PCI` | PCI bus id of this endpoint's GPU | none |
//! | `TCPX_GPU_INDEX` | GPU index announced to peers ([`Config::gpu_index`]) | none |
//! | `TCPX_REQUIRE_SECRET` | accept only peers presenting this endpoint's metadata secret (`0`/`1`) | `0` |
//! | `TCPX_METRICS_ADDR` | serve Prometheus metrics over HTTP at this address ([`Config::metrics_addr`]) | off |
//! | `TCPX_BACKOFF` | engine idle policy: `spin`, `yield`, `park` | `park` |
//! | `TCPX_WAIT_SPIN_US` | how long [`Transfer::wait`](crate::Transfer::wait) polls before it sleeps, µs ([`Config::wait_spin`]) | `50` (`0` below 4 cores) |
//! | `TCPX_ENGINE_LINGER_US` | how long an engine with nothing in flight keeps polling for new work before it blocks, µs ([`Config::idle_linger`]) | `200` (`0` below 4 cores) |
//! | `TCPX_PIN` | pin engine threads (`0`/`1`) | `1` |
//! | `TCPX_ENGINES_PER_NIC` | engine threads per device | auto (see [`Config::engines_per_device`]) |
//! | `TCPX_SPREAD` | most channels a lone one-sided operation is cut over (`1`: whole chunks; [`Config::spread`]) | the engine count |
//! | `TCPX_SPREAD_TWO_SIDED` | cut two-sided transfers smaller than `TCPX_SPREAD` chunks into pieces of at least 256 KiB over the channels, when both sides do (`0`/`1`; [`Config::spread_two_sided`]) | `1` |
//! | `TCPX_PACK_BELOW` | pack one-sided batches of host memory on both sides whose average block is smaller (`0`: never) ([`Config::pack_below`]) | 32 KiB |
//! | `TCPX_PACK_STAGED_BELOW` | pack one-sided batches with staged GPU memory on either side whose average block is smaller (`0`: never) ([`Config::pack_staged_below`]) | 512 KiB |
//! | `TCPX_PACK_LONE_RUNS` | a one-sided batch alone on its connection packs only past this many runs (`0`: always) ([`Config::pack_lone_runs`]) | channels × window; with staged GPU memory 4 × channels |
//! | `TCPX_EAGER_BYTES` | two-sided messages up to this size travel in eager frames, many per plugin request (`0`: off; at most 64 KiB) ([`Config::eager_bytes`]) | 64 KiB |
//! | `TCPX_EAGER_DETACH` | eager messages of host memory from this size leave from the application's memory as plugin messages of their own, not copied into frames (`0`: never) ([`Config::eager_detach`]) | 32 KiB |
//! | `TCPX_PACK_BUFFERS` | pooled 4 MiB pack buffers per connection (batches share them in 64 KiB slices; a batch past one takes several) | 8 |
//! | `TCPX_INLINE_BYTES` | one-sided writes and reads of host memory up to this many bytes in all carry their data in control messages (`0`: never; at most 64 KiB) ([`Config::inline_bytes`]) | 8 KiB |
//! | `TCPX_INLINE_LONE_BYTES` | one-sided writes and reads of host memory up to this many bytes in all carry their data in control messages while the connection has no other one-sided operation in flight (`0`: only `TCPX_INLINE_BYTES` applies; at most 64 KiB) ([`Config::inline_lone_bytes`]) | 32 KiB |
//! | `TCPX_INLINE_GPU_BYTES` | the same for one-sided operations touching GPU memory, while the connection has at most one other operation pending ([`Config::inline_gpu_bytes`]) | 64 KiB |
//!
//! The plugin's own variables (`NCCL_GPUDIRECTTCPX_*`, `NCCL_*`, `TCPX_SOCKET_*`) are not read
//! here: they pass through to the plugin untouched.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::schedule::{DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES};
use crate::window::DEFAULT_CAPACITY;

/// Where the TCPX plugin is installed on Google's images, searched in this order (one list,
/// owned by the safe layer, which `tcpx-info` reports from too).
pub use tcpx::TCPX_INSTALL_PATHS;

/// Which plugin an endpoint loads.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Backend {
    /// The TCPX install paths ([`TCPX_INSTALL_PATHS`]) if one exists, else the built-in socket
    /// plugin.
    #[default]
    Auto,
    /// The built-in kernel-TCP plugin (`tcpx-socket`), linked in.
    Builtin,
    /// This plugin library, and nothing else (a load failure is an error).
    Path(PathBuf),
}

/// What an engine thread does when a pass over its channels moved nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backoff {
    /// Spin forever: lowest latency, one core per engine.
    Spin,
    /// Spin briefly, then `sched_yield` between passes.
    Yield,
    /// Spin, then yield, then sleep for short, growing periods; block while nothing is in
    /// flight. The polite default.
    #[default]
    Park,
}

impl std::str::FromStr for Backoff {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "spin" => Ok(Self::Spin),
            "yield" => Ok(Self::Yield),
            "park" => Ok(Self::Park),
            other => Err(Error::Config(format!(
                "backoff policy {other:?}: expected spin, yield or park"
            ))),
        }
    }
}

/// Default [`Config::pack_below`]. First measured on loopback (docs/RESULTS-onesided.md):
/// packed scattered blocks beat unpacked ones at 4–32 KiB, broke even around 64 KiB and lost
/// from 128 KiB (the extra memcpy costs more than the plugin requests it saves). With the
/// engines of issue 25 unpacked lists got cheaper: on an H200 host (docs/RESULTS.md,
/// thirty-sixth session, alternated) 16 KiB blocks still move 2–10 % faster packed, 32 KiB
/// blocks 2–11 % faster unpacked; so host lists pack below 32 KiB.
pub const DEFAULT_PACK_BELOW: u32 = 32 << 10;

/// Default [`Config::pack_staged_below`]. GPU memory staged through a host-memory plugin
/// pays a ring copy per block unpacked; packed, each chunk is one copy list. Measured on an
/// H200 host (docs/RESULTS.md, thirty-sixth session, alternated, GPU 0 → GPU 1): packed
/// lists of 64 KiB blocks moved 6–23 % more, of 128 KiB 11–13 %, of 256 KiB 11–14 %; 32 KiB
/// blocks unpacked lost 40 %. Blocks of 256 KiB are the largest measured.
pub const DEFAULT_PACK_STAGED_BELOW: u32 = 512 << 10;

/// Runs per channel past which a one-sided list touching staged GPU memory packs even when it
/// is alone on its connection, unless [`Config::pack_lone_runs`] says otherwise (measured:
/// see there).
pub const STAGED_LONE_RUNS_PER_CHANNEL: usize = 4;

/// Default [`Config::inline_bytes`]: one-sided writes and reads of up to 8 KiB of host memory
/// travel inline (docs/RESULTS.md, twenty-second session).
pub const DEFAULT_INLINE_BYTES: u32 = 8 << 10;

/// Default [`Config::inline_lone_bytes`]: one-sided operations of up to 32 KiB of host memory
/// travel inline while the connection has nothing else in flight. Measured on an H200
/// (docs/RESULTS.md, thirtieth session) with UCCL's own `benchmark_uccl.py` over `tcpx.p2p`,
/// two processes, one operation at a time: 12–24 KiB writes 21.6–28.4 µs against 27.9–32.8
/// through the comms, reads 19.1–25.9 against 29.3–42.6; 32 KiB level to a sixth faster;
/// from 48 KiB the comms, whose pieces ride several channels at once, are as fast or faster
/// (64 KiB writes 42.9–52.6 inline against 42.1–42.3).
pub const DEFAULT_INLINE_LONE_BYTES: u32 = 32 << 10;

/// Default [`Config::inline_gpu_bytes`]: one-sided operations touching GPU memory of up to
/// 64 KiB travel inline while the connection has at most one other operation pending
/// (docs/RESULTS.md, twenty-third session: on an H200, 16–64 KiB p50 42–77 µs against
/// 81–106 through the staged comms).
pub const DEFAULT_INLINE_GPU_BYTES: u32 = 64 << 10;

/// Default [`Config::eager_bytes`]: two-sided messages up to 64 KiB travel in eager frames.
pub const DEFAULT_EAGER_BYTES: u32 = 64 << 10;
/// Default [`Config::eager_detach`]: eager messages of 32 KiB and more leave uncopied.
pub const DEFAULT_EAGER_DETACH: u32 = 32 << 10;
/// Default [`Config::pack_buffers`] (8 × 4 MiB at most, allocated on first use).
pub const DEFAULT_PACK_BUFFERS: usize = 8;

/// Default [`Config::wait_spin`] on a machine with cores to spare: about two loopback round
/// trips of a 4 KiB message. Measured on an H100 host (16 cores, docs/RESULTS.md): 4 KiB
/// one-way p50 11.7 µs against 25.4 µs sleeping at once; 20 µs is too short to help.
pub const DEFAULT_WAIT_SPIN: Duration = Duration::from_micros(50);

/// Default [`Config::idle_linger`] on a machine with cores to spare. A stream of small
/// transfers spread over several engines leaves each engine idle between two of its
/// messages; an engine that blocked at once made every submission pay a futex wake and the
/// engine's reschedule (H100 host, 8 channels, 4 KiB messages: about 4 µs of the
/// submitting thread per message, which capped the stream at 1 GB/s). 200 µs covers the gap
/// between messages of such a stream at any rate worth polling for.
pub const DEFAULT_IDLE_LINGER: Duration = Duration::from_micros(200);

/// Cores below which a wait does not spin by default: with so few, the spinning waiter takes
/// the core an engine needs to finish the very transfer it waits for.
const MIN_CORES_TO_SPIN: usize = 4;

/// [`DEFAULT_WAIT_SPIN`] where this process may run on at least 4 cores
/// (affinity and cgroup quota included), else zero.
pub fn default_wait_spin() -> Duration {
    match std::thread::available_parallelism() {
        Ok(n) if n.get() >= MIN_CORES_TO_SPIN => DEFAULT_WAIT_SPIN,
        _ => Duration::ZERO,
    }
}
/// [`DEFAULT_IDLE_LINGER`] where this process may run on at least 4 cores, else zero (a
/// lingering engine would take the core the application needs to submit the next message).
pub fn default_idle_linger() -> Duration {
    match std::thread::available_parallelism() {
        Ok(n) if n.get() >= MIN_CORES_TO_SPIN => DEFAULT_IDLE_LINGER,
        _ => Duration::ZERO,
    }
}
/// Largest [`Config::pack_buffers`].
pub const MAX_PACK_BUFFERS: usize = 64;

/// The configuration of an endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Which plugin to load.
    pub backend: Backend,
    /// Channels (comm pairs) this endpoint offers per connection; a connection uses the
    /// smaller of both peers' counts.
    pub channels: u16,
    /// Chunk size: one plugin request carries at most this many bytes; a connection uses the
    /// smaller of both peers' sizes.
    pub chunk_bytes: u32,
    /// Requests in flight per comm (TCPX allows 16).
    pub window: usize,
    /// Limit for connection set-up and for each transfer, from submission to completion.
    pub timeout: Duration,
    /// Where the control listener binds. Port 0 picks a free port. An unspecified IP listens
    /// everywhere and advertises the IP of the first data device's interface.
    pub control_addr: SocketAddr,
    /// Plugin devices (NICs) to spread channels over; `None`: every device the plugin reports.
    pub devices: Option<Vec<usize>>,
    /// PCI bus id of the GPU this endpoint serves, if any (advertised, and used for pinning).
    pub gpu_pci: Option<String>,
    /// Engine idle policy.
    pub backoff: Backoff,
    /// How long [`Transfer::wait`](crate::Transfer::wait) polls the outcome before it
    /// sleeps. A small message finishes within microseconds of being waited on, sooner than
    /// a sleeping thread can be woken (a futex wait and wake, then a reschedule), so a short
    /// poll halves its latency; a long transfer pays this once, then sleeps. `0` sleeps at
    /// once. Default: [`DEFAULT_WAIT_SPIN`] on machines with 4 cores or more, else `0`
    /// ([`default_wait_spin`]).
    pub wait_spin: Duration,
    /// How long an engine whose channels hold nothing keeps polling for new work (spinning,
    /// then yielding) before it blocks on its queue, under the `park` policy. Submitting to a
    /// blocked engine costs the submitter a futex wake and the transfer the engine's
    /// reschedule; a lingering engine takes the next job with neither. `0` blocks at once.
    /// Default: [`default_idle_linger`].
    pub idle_linger: Duration,
    /// Pin each engine thread to a core local to its NIC (when the topology says which).
    pub pin_engines: bool,
    /// Engine threads per device; `None` chooses: one per device (one per NIC) for plugins
    /// that move the bytes on their own threads (TCPX), and one per channel for the built-in
    /// socket plugin, which copies inside `test` on the engine's own thread, so that one
    /// engine would cap a device at one core's copy bandwidth — at most the cores this
    /// process may use, and a divisor of the channels per device (an engine with two
    /// channels where the others have one sets the pace of every transfer). A connection to a
    /// peer on the same cores (loopback or this host's address, with this process not
    /// confined to some of the machine's cores or holding more than one endpoint) is driven
    /// by half the cores' worth of them,
    /// so that two local endpoints do not oversubscribe the machine
    /// ([`Connection::engine_count`](crate::Connection::engine_count)).
    pub engines_per_device: Option<usize>,
    /// Most channels a lone one-sided operation smaller than `channels` chunks is cut over, so
    /// that a 1 MiB write waited for on its own rides eight channels in 128 KiB pieces rather
    /// than two in 512 KiB chunks
    /// ([`Schedule::spread_over`](crate::schedule::Schedule::spread_over)); a connection uses
    /// the smaller of both sides' values. The initiator spreads an operation only when none
    /// other of the connection is in flight; two-sided transfers spread by
    /// [`Config::spread_two_sided`]. `None`: this endpoint's engine count (pieces beyond the
    /// threads that move them only add requests). `Some(1)` keeps whole chunks.
    pub spread: Option<u16>,
    /// Whether two-sided transfers smaller than [`Config::spread`] chunks are cut into pieces
    /// of at least 256 KiB over the channels
    /// ([`TWO_SIDED_SPREAD_FLOOR_BYTES`](crate::schedule::TWO_SIDED_SPREAD_FLOOR_BYTES)): a
    /// 1 MiB send rides four channels instead of two. A connection spreads them only when
    /// both sides say so (both must cut alike, and a two-sided transfer cannot say whether
    /// it is alone: every one is cut, streams included). Vectored transfers too; batches
    /// ([`Connection::send_batch`](crate::Connection::send_batch)) keep whole chunks.
    ///
    /// Measured on an H200 host, 16 cores per peer (issue 25, thirty-third session): a lone
    /// host 1 MiB send 64–73 µs against 112–140, 2 MiB 65–73 against 118–145, streams of host
    /// messages level; GPU memory staged through a host-memory plugin: lone 1 MiB 126–138 µs
    /// against 179–192, but streams of 1–2 MiB GPU messages 7–9 % slower with a GPU per peer
    /// (a copy per piece, and half the bytes in a window of 16 requests).
    /// `false` keeps whole chunks.
    pub spread_two_sided: bool,
    /// One-sided batches of host memory (on both sides) whose blocks average fewer bytes
    /// than this (after merging contiguous ones) travel packed: gathered into one contiguous
    /// pack buffer, sent as one transfer, scattered on arrival (see [`crate::onesided`]).
    /// `0` never packs them. Only the data sender's value matters (it decides; the receiver
    /// follows), except that the target of a read from host memory cannot tell whether the
    /// reader's memory is staged: it takes the reader's offer below the larger of this and
    /// [`Config::pack_staged_below`] (the reader offers only by its own rule).
    pub pack_below: u32,
    /// The same for batches with GPU memory staged through a host-memory plugin on either
    /// side: unpacked, each block costs a ring copy of its own, so larger blocks pack
    /// ([`DEFAULT_PACK_STAGED_BELOW`]). `0` never packs them.
    pub pack_staged_below: u32,
    /// A batch worth packing ([`Config::pack_below`]) that is alone on its connection (no
    /// other one-sided operation in flight) packs only when it has more runs than this.
    /// `None`: for host memory on both sides channels × window, the pieces the connection can
    /// have in flight at once; with staged GPU memory on either side
    /// [`STAGED_LONE_RUNS_PER_CHANNEL`] per channel, since each unpacked piece pays a ring
    /// copy of its own (GPU 0 → 1 between two processes, one list at a time, docs/RESULTS.md
    /// thirty-sixth session, medians of four writes' p50: 64 × 64 KiB 490 µs packed against
    /// 692 unpacked, 128 × 64 KiB 766 against 1150, 64 × 256 KiB 1158 against 1420; but
    /// 8 × 64 KiB 221 against 122 and 16 × 16 KiB 339 against 117).
    ///
    /// Alone, a short list of small blocks is faster unpacked: its pieces ride every channel
    /// in parallel with no copy, where packed they are gathered, carried in one chunk on one
    /// channel and scattered (measured between two processes, one at a time, 2 × 16 KiB
    /// blocks: host 26 µs unpacked against 35 packed, GPU on two H100s 47 against 90;
    /// 16 × 16 KiB: 56 against 121 and 120 against 156; docs/RESULTS.md). Past a window per
    /// channel, or with other operations in flight, the pieces queue behind the plugin's
    /// request windows and packing wins (256 × 16 KiB: 1.06 against 0.55 × two-sided).
    /// `Some(0)` packs whatever the connection does (the behaviour before this rule).
    pub pack_lone_runs: Option<usize>,
    /// Two-sided messages ([`Connection::send`](crate::Connection::send) /
    /// [`recv`](crate::Connection::recv)) of 1 byte up to this size travel in eager frames:
    /// the engines copy queued small messages into frames of up to 256 KiB (a send finishes
    /// once copied, as a socket `send` does once the kernel has the bytes; one of host memory
    /// from [`Config::eager_detach`] on is sent uncopied behind its frame) and send each
    /// frame as one plugin request on comms of their own, and the receiver hands every
    /// message to its receive (see [`tcpx_proto::eager`]). A connection uses the smaller of
    /// both sides' values; 0 on either side turns it off, as does a plugin that cannot take
    /// host memory (the frames are host buffers). At most 64 KiB.
    ///
    /// `None` (the default) is [`DEFAULT_EAGER_BYTES`] ([`Config::eager_limit`]), for host
    /// and GPU memory alike. Host messages gained 2–5 × in frames (4 KiB one call per
    /// message, 8 channels: 0.05–0.12 × raw TCP before, 0.33–0.35 then; 64 KiB 0.62–0.75 →
    /// 0.69–0.99). GPU messages did once the engines copied a frame's run of them as one copy
    /// list through the GPU's small copier (one GPU round trip per run, whatever the
    /// regions): two processes on one H200, one call per message, 8 channels, 4 / 16 / 64 KiB
    /// at 3.8–4.0 / 7.4–7.8 / 9.3 GB/s against 0.9–1.2 / 3.9–4.0 / 8.2–8.4 staged (a
    /// synchronous copy per message had run them at 0.25 GB/s, so endpoints that named their
    /// GPU kept them off until then).
    pub eager_bytes: Option<u32>,
    /// Eager messages of host memory of at least this many bytes are not copied into their
    /// frame: the frame carries their entry, and their bytes follow it on the same comm as
    /// plugin messages of their own, sent from the application's memory (registered once per
    /// region and channel; see [`tcpx_proto::eager`]). A send of one finishes when the plugin
    /// has sent it. This side's choice: the receiver follows the frames. `0` copies every
    /// eager message. Default [`DEFAULT_EAGER_DETACH`].
    pub eager_detach: u32,
    /// One-sided writes and reads whose local and remote memory is host memory and whose
    /// total is at most this many bytes carry their data in control messages (a write's in
    /// its `WriteRequest`, a read's in the target's `ReadInline` answer), copied in by the
    /// receiving side's control loop: no plugin request, engine hand-off or job on either
    /// side, which is most of what a small one-sided operation costs (a 4 KiB write through
    /// the comms ran at 0.2–0.5 × a two-sided send). Larger operations take the one-sided
    /// comms; operations touching GPU memory follow [`Config::inline_gpu_bytes`]. `0`:
    /// never. At most [`tcpx_proto::control::rma::MAX_INLINE`]. Only the initiator's value
    /// matters. Default [`DEFAULT_INLINE_BYTES`].
    pub inline_bytes: u32,
    /// One-sided operations of host memory whose total is at most this many bytes also
    /// travel inline, as those under [`Config::inline_bytes`] do, but only while the
    /// connection has no other one-sided operation in flight (none waiting for its answer,
    /// no read still receiving): a lone write or read then costs a copy on each side and one
    /// control message each way instead of a job, plugin requests and an engine hand-off on
    /// each side (12–24 KiB a quarter to a third faster than the comms, one at a time, in
    /// two processes). Past about 32 KiB the comms, which spread a lone operation's bytes
    /// over several channels, are as fast; and with more in flight they pipeline the bytes
    /// and carry more: 64 KiB operations all inline at depth 32 moved 3.7 against 12.7
    /// GB/s. `0`: only [`Config::inline_bytes`] applies. At most
    /// [`tcpx_proto::control::rma::MAX_INLINE`]. Only the initiator's value matters. Default
    /// [`DEFAULT_INLINE_LONE_BYTES`].
    pub inline_lone_bytes: u32,
    /// The same for one-sided operations with GPU memory on either side (a staged region
    /// counts as GPU memory): at most this many bytes in all travel inline, copied by one
    /// synchronous GPU copy on each side, but only while the connection has fewer than two
    /// operations pending. Such a copy costs a GPU round trip (6.5–8 µs on an H200 VM) and
    /// runs one at a time on the target's control loop, so inline wins on latency and lone
    /// operations (4 KiB p50 31–33 µs against 39–41, 64 KiB 77 against 106) while the comms,
    /// which pipeline their copies, carry more once several are in flight. `0`: never. At
    /// most [`tcpx_proto::control::rma::MAX_INLINE`]. Only the initiator's value matters.
    /// Default [`DEFAULT_INLINE_GPU_BYTES`].
    pub inline_gpu_bytes: u32,
    /// Pack buffers (4 MiB each, registered once) a connection keeps for packed transfers.
    /// A batch takes only the 64 KiB slices it needs, so small ones share a buffer; one past
    /// a buffer takes whole ones, so the pool also bounds the largest packed batch of host
    /// memory (and what a staged sender has in flight packed into host memory); when no
    /// buffer has room, a data sender falls back to the unpacked transfer. The pool grows as
    /// batches need buffers, except for its first one on a connection to an endpoint that
    /// advertises host memory: that one is taken (from the buffers the process keeps ready)
    /// and registered as the connection is set up, so the first packed transfer does not wait
    /// for it. Buffers are mapped in huge pages where the kernel gives them.
    pub pack_buffers: usize,
    /// The GPU index this endpoint announces to peers in `Hello`
    /// ([`Connection::peer_gpu`](crate::Connection::peer_gpu) on their side), if any. A label
    /// for the application (e.g. the local rank's GPU); the runtime does not check it against
    /// CUDA.
    pub gpu_index: Option<u32>,
    /// Accept only peers that present this endpoint's secret, i.e. that connected with its
    /// [`EndpointMetadata`](crate::control::EndpointMetadata)
    /// ([`Endpoint::connect`](crate::Endpoint::connect)); address-only connects
    /// ([`Endpoint::connect_addr`](crate::Endpoint::connect_addr)) are then refused. Off by
    /// default so that address-only (UCCL-style) connects work.
    pub require_secret: bool,
    /// Serve this endpoint's metrics in Prometheus text format over HTTP at this address
    /// (`GET /metrics`), from a thread of its own that stops with the endpoint
    /// (`TCPX_METRICS_ADDR=127.0.0.1:9464`). Off (`None`) by default. Port 0 picks a free
    /// port ([`Endpoint::metrics_addr`](crate::Endpoint::metrics_addr) tells which).
    pub metrics_addr: Option<SocketAddr>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            backend: Backend::Auto,
            channels: 4,
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            window: DEFAULT_CAPACITY,
            timeout: Duration::from_secs(30),
            control_addr: SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0),
            devices: None,
            gpu_pci: None,
            backoff: Backoff::Park,
            wait_spin: default_wait_spin(),
            idle_linger: default_idle_linger(),
            pin_engines: true,
            engines_per_device: None,
            spread: None,
            spread_two_sided: true,
            pack_below: DEFAULT_PACK_BELOW,
            pack_staged_below: DEFAULT_PACK_STAGED_BELOW,
            pack_lone_runs: None,
            eager_bytes: None,
            eager_detach: DEFAULT_EAGER_DETACH,
            inline_bytes: DEFAULT_INLINE_BYTES,
            inline_lone_bytes: DEFAULT_INLINE_LONE_BYTES,
            inline_gpu_bytes: DEFAULT_INLINE_GPU_BYTES,
            pack_buffers: DEFAULT_PACK_BUFFERS,
            gpu_index: None,
            require_secret: false,
            metrics_addr: None,
        }
    }
}

impl Config {
    /// A builder starting from the defaults.
    pub fn builder() -> ConfigBuilder {
        ConfigBuilder {
            config: Self::default(),
        }
    }

    /// The defaults overridden by the process environment (see the module docs).
    pub fn from_env() -> Result<Self> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// [`Config::from_env`] with a custom lookup (tests, or callers merging sources).
    pub fn from_vars(lookup: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let get = |names: &[&'static str]| {
            names.iter().find_map(|&name| {
                lookup(name)
                    .filter(|v| !v.trim().is_empty())
                    .map(|v| (name, v.trim().to_owned()))
            })
        };
        let mut b = Self::builder();
        if let Some((_, v)) = get(&["TCPX_BACKEND"]) {
            b = b.backend(match v.as_str() {
                "auto" => Backend::Auto,
                "builtin" => Backend::Builtin,
                path => Backend::Path(PathBuf::from(path)),
            });
        }
        if let Some((_, v)) = get(&["TCPX_PLUGIN_PATH", "UCCL_TCPX_PLUGIN_PATH"]) {
            b = b.backend(Backend::Path(PathBuf::from(v)));
        }
        if let Some((name, v)) = get(&["TCPX_NUM_CHANNELS", "UCCL_TCPX_NUM_CHANNELS"]) {
            b = b.channels(parse_num(name, &v)?);
        }
        if let Some((name, v)) = get(&["TCPX_CHUNK_BYTES", "UCCL_TCPX_CHUNK_BYTES"]) {
            b = b.chunk_bytes(parse_size(name, &v)?);
        }
        if let Some((name, v)) = get(&["TCPX_WINDOW"]) {
            b = b.window(parse_num(name, &v)?);
        }
        if let Some((name, v)) = get(&["TCPX_TIMEOUT_MS"]) {
            b = b.timeout(Duration::from_millis(parse_num(name, &v)?));
        }
        if let Some((name, v)) = get(&["TCPX_CONTROL_ADDR"]) {
            let addr = v.parse().map_err(|_| {
                Error::Config(format!(
                    "{name}={v:?}: expected ip:port (e.g. 10.0.0.2:7400)"
                ))
            })?;
            b = b.control_addr(addr);
        }
        if let Some((name, v)) = get(&["TCPX_DEVICES"]) {
            let devices = v
                .split(',')
                .map(str::trim)
                .filter(|d| !d.is_empty())
                .map(|d| parse_num(name, d))
                .collect::<Result<Vec<usize>>>()?;
            b = b.devices(devices);
        }
        if let Some((_, v)) = get(&["TCPX_GPU_PCI"]) {
            b = b.gpu_pci(v);
        }
        if let Some((name, v)) = get(&["TCPX_BACKOFF"]) {
            b = b.backoff(
                v.parse()
                    .map_err(|e: Error| Error::Config(format!("{name}: {e}")))?,
            );
        }
        if let Some((name, v)) = get(&["TCPX_WAIT_SPIN_US"]) {
            b = b.wait_spin(Duration::from_micros(parse_num(name, &v)?));
        }
        if let Some((name, v)) = get(&["TCPX_ENGINE_LINGER_US"]) {
            b = b.idle_linger(Duration::from_micros(parse_num(name, &v)?));
        }
        if let Some((name, v)) = get(&["TCPX_PIN"]) {
            b = b.pin_engines(parse_bool(name, &v)?);
        }
        if let Some((name, v)) = get(&["TCPX_GPU_INDEX"]) {
            b = b.gpu_index(parse_num(name, &v)?);
        }
        if let Some((name, v)) = get(&["TCPX_REQUIRE_SECRET"]) {
            b = b.require_secret(parse_bool(name, &v)?);
        }
        if let Some((name, v)) = get(&["TCPX_METRICS_ADDR"]) {
            let addr = v.trim().parse::<SocketAddr>().map_err(|e| {
                Error::Config(format!(
                    "{name}={v:?} is not an address like 127.0.0.1:9464: {e}"
                ))
            })?;
            b = b.metrics_addr(Some(addr));
        }
        if let Some((name, v)) = get(&["TCPX_ENGINES_PER_NIC"]) {
            b = b.engines_per_device(parse_num(name, &v)?);
        }
        if let Some((name, v)) = get(&["TCPX_SPREAD"]) {
            b = b.spread(parse_num(name, &v)?);
        }
        if let Some((name, v)) = get(&["TCPX_SPREAD_TWO_SIDED"]) {
            b = b.spread_two_sided(parse_bool(name, &v)?);
        }
        if let Some((name, v)) = get(&["TCPX_PACK_BELOW"]) {
            b = b.pack_below(parse_size(name, &v)?);
        }
        if let Some((name, v)) = get(&["TCPX_PACK_STAGED_BELOW"]) {
            b = b.pack_staged_below(parse_size(name, &v)?);
        }
        if let Some((name, v)) = get(&["TCPX_PACK_LONE_RUNS"]) {
            b = b.pack_lone_runs(parse_num(name, &v)?);
        }
        if let Some((name, v)) = get(&["TCPX_EAGER_BYTES"]) {
            b = b.eager_bytes(parse_size(name, &v)?);
        }
        if let Some((name, v)) = get(&["TCPX_EAGER_DETACH"]) {
            b = b.eager_detach(parse_size(name, &v)?);
        }
        if let Some((name, v)) = get(&["TCPX_INLINE_BYTES"]) {
            b = b.inline_bytes(parse_size(name, &v)?);
        }
        if let Some((name, v)) = get(&["TCPX_INLINE_LONE_BYTES"]) {
            b = b.inline_lone_bytes(parse_size(name, &v)?);
        }
        if let Some((name, v)) = get(&["TCPX_INLINE_GPU_BYTES"]) {
            b = b.inline_gpu_bytes(parse_size(name, &v)?);
        }
        if let Some((name, v)) = get(&["TCPX_PACK_BUFFERS"]) {
            b = b.pack_buffers(parse_num(name, &v)?);
        }
        b.build()
    }

    /// The eager size this endpoint offers its peers: [`Config::eager_bytes`] when given, else
    /// [`DEFAULT_EAGER_BYTES`] (whether or not the endpoint names its GPU).
    pub fn eager_limit(&self) -> u32 {
        self.eager_bytes.unwrap_or(DEFAULT_EAGER_BYTES)
    }

    /// Checks every value is in range; [`ConfigBuilder::build`] and
    /// [`crate::Endpoint::new`] call it.
    pub fn validate(&self) -> Result<()> {
        if self.channels == 0 {
            return Err(Error::Config("channels must be at least 1".into()));
        }
        if self.chunk_bytes == 0 || self.chunk_bytes > MAX_CHUNK_BYTES {
            return Err(Error::Config(format!(
                "chunk_bytes {} must be between 1 and {MAX_CHUNK_BYTES}",
                self.chunk_bytes
            )));
        }
        if self.window == 0 || self.window > DEFAULT_CAPACITY {
            return Err(Error::Config(format!(
                "window {} must be between 1 and {DEFAULT_CAPACITY} (the TCPX per-comm limit)",
                self.window
            )));
        }
        if self.timeout.is_zero() {
            return Err(Error::Config("timeout must be longer than zero".into()));
        }
        if let Some(n) = self.engines_per_device {
            if n == 0 || n > 256 {
                return Err(Error::Config(format!(
                    "engines_per_device {n} must be between 1 and 256"
                )));
            }
        }
        if self.spread == Some(0) {
            return Err(Error::Config(
                "spread must be at least 1 (1 keeps whole chunks)".into(),
            ));
        }
        if let Some(bytes) = self.eager_bytes {
            if bytes > tcpx_proto::eager::EAGER_MAX_MESSAGE {
                return Err(Error::Config(format!(
                    "eager_bytes {bytes} must be at most {} (0 turns eager frames off)",
                    tcpx_proto::eager::EAGER_MAX_MESSAGE
                )));
            }
        }
        for (name, value) in [
            ("inline_bytes", self.inline_bytes),
            ("inline_lone_bytes", self.inline_lone_bytes),
            ("inline_gpu_bytes", self.inline_gpu_bytes),
        ] {
            if value as usize > tcpx_proto::control::rma::MAX_INLINE {
                return Err(Error::Config(format!(
                    "{name} {value} must be at most {} (0 turns inline operations off)",
                    tcpx_proto::control::rma::MAX_INLINE
                )));
            }
        }
        if self.pack_buffers > MAX_PACK_BUFFERS {
            return Err(Error::Config(format!(
                "pack_buffers {} must be at most {MAX_PACK_BUFFERS}",
                self.pack_buffers
            )));
        }
        if matches!(&self.devices, Some(d) if d.is_empty()) {
            return Err(Error::Config("the device list is empty".into()));
        }
        Ok(())
    }
}

/// Builds a [`Config`]; every setter overrides one default.
#[derive(Debug, Clone)]
#[must_use = "call build() to get the Config"]
pub struct ConfigBuilder {
    config: Config,
}

impl ConfigBuilder {
    /// Which plugin to load.
    pub fn backend(mut self, backend: Backend) -> Self {
        self.config.backend = backend;
        self
    }

    /// Channels per connection.
    pub fn channels(mut self, channels: u16) -> Self {
        self.config.channels = channels;
        self
    }

    /// Chunk size in bytes.
    pub fn chunk_bytes(mut self, chunk_bytes: u32) -> Self {
        self.config.chunk_bytes = chunk_bytes;
        self
    }

    /// Requests in flight per comm (1..=16).
    pub fn window(mut self, window: usize) -> Self {
        self.config.window = window;
        self
    }

    /// Set-up and per-transfer timeout.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.config.timeout = timeout;
        self
    }

    /// Control listener address.
    pub fn control_addr(mut self, addr: SocketAddr) -> Self {
        self.config.control_addr = addr;
        self
    }

    /// Plugin devices to use.
    pub fn devices(mut self, devices: Vec<usize>) -> Self {
        self.config.devices = Some(devices);
        self
    }

    /// PCI bus id of this endpoint's GPU.
    pub fn gpu_pci(mut self, pci: impl Into<String>) -> Self {
        self.config.gpu_pci = Some(pci.into());
        self
    }

    /// Engine idle policy.
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.config.backoff = backoff;
        self
    }

    /// Pin engine threads.
    pub fn pin_engines(mut self, pin: bool) -> Self {
        self.config.pin_engines = pin;
        self
    }

    /// Engine threads per device (instead of the automatic choice).
    pub fn engines_per_device(mut self, engines: usize) -> Self {
        self.config.engines_per_device = Some(engines);
        self
    }

    /// [`Config::spread`].
    pub fn spread(mut self, channels: u16) -> Self {
        self.config.spread = Some(channels);
        self
    }

    /// [`Config::spread_two_sided`].
    pub fn spread_two_sided(mut self, spread: bool) -> Self {
        self.config.spread_two_sided = spread;
        self
    }

    /// Packing threshold for one-sided batches (see [`Config::pack_below`]).
    pub fn pack_below(mut self, bytes: u32) -> Self {
        self.config.pack_below = bytes;
        self
    }

    /// Packing threshold for one-sided batches with staged GPU memory (see
    /// [`Config::pack_staged_below`]).
    pub fn pack_staged_below(mut self, bytes: u32) -> Self {
        self.config.pack_staged_below = bytes;
        self
    }

    /// Runs past which a batch alone on its connection packs (see [`Config::pack_lone_runs`]).
    pub fn pack_lone_runs(mut self, runs: usize) -> Self {
        self.config.pack_lone_runs = Some(runs);
        self
    }

    /// Largest two-sided message sent in eager frames; 0: none (see [`Config::eager_bytes`]).
    pub fn eager_bytes(mut self, bytes: u32) -> Self {
        self.config.eager_bytes = Some(bytes);
        self
    }

    /// Smallest eager message sent uncopied; 0: none (see [`Config::eager_detach`]).
    pub fn eager_detach(mut self, bytes: u32) -> Self {
        self.config.eager_detach = bytes;
        self
    }

    /// Largest one-sided write carried inline; 0: none (see [`Config::inline_bytes`]).
    pub fn inline_bytes(mut self, bytes: u32) -> Self {
        self.config.inline_bytes = bytes;
        self
    }

    /// Largest one-sided operation of host memory carried inline while the connection has
    /// nothing else in flight; 0: only [`Config::inline_bytes`] (see
    /// [`Config::inline_lone_bytes`]).
    pub fn inline_lone_bytes(mut self, bytes: u32) -> Self {
        self.config.inline_lone_bytes = bytes;
        self
    }

    /// Largest one-sided operation touching GPU memory carried inline; 0: none (see
    /// [`Config::inline_gpu_bytes`]).
    pub fn inline_gpu_bytes(mut self, bytes: u32) -> Self {
        self.config.inline_gpu_bytes = bytes;
        self
    }

    /// Pack buffers per connection (see [`Config::pack_buffers`]).
    pub fn pack_buffers(mut self, buffers: usize) -> Self {
        self.config.pack_buffers = buffers;
        self
    }

    /// GPU index announced to peers (see [`Config::gpu_index`]).
    pub fn gpu_index(mut self, index: u32) -> Self {
        self.config.gpu_index = Some(index);
        self
    }

    /// How long an idle engine polls before it blocks (see [`Config::idle_linger`]).
    pub fn idle_linger(mut self, linger: Duration) -> Self {
        self.config.idle_linger = linger;
        self
    }

    /// How long a wait polls before it sleeps (see [`Config::wait_spin`]).
    pub fn wait_spin(mut self, spin: Duration) -> Self {
        self.config.wait_spin = spin;
        self
    }

    /// Accept only peers presenting this endpoint's secret (see [`Config::require_secret`]).
    pub fn require_secret(mut self, require: bool) -> Self {
        self.config.require_secret = require;
        self
    }

    /// Serve Prometheus metrics at `addr` (see [`Config::metrics_addr`]).
    pub fn metrics_addr(mut self, addr: Option<SocketAddr>) -> Self {
        self.config.metrics_addr = addr;
        self
    }

    /// The configuration, validated.
    pub fn build(self) -> Result<Config> {
        self.config.validate()?;
        Ok(self.config)
    }
}

fn parse_bool(name: &str, v: &str) -> Result<bool> {
    match v {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(Error::Config(format!("{name}={v:?}: expected 0 or 1"))),
    }
}

fn parse_num<T: std::str::FromStr>(name: &str, v: &str) -> Result<T> {
    v.trim()
        .parse()
        .map_err(|_| Error::Config(format!("{name}={v:?}: expected a whole number")))
}

/// Parses `524288`, `512K`, `512KiB`, `1M`, `1MiB` (binary multiples).
fn parse_size(name: &str, v: &str) -> Result<u32> {
    let t = v.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, suffix) = t.split_at(split);
    let shift = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        _ => {
            return Err(Error::Config(format!(
                "{name}={v:?}: expected bytes, optionally with K, M or G"
            )))
        }
    };
    let n: u64 = parse_num(name, digits)?;
    n.checked_shl(shift)
        .filter(|&b| b >> shift == n)
        .and_then(|b| u32::try_from(b).ok())
        .ok_or_else(|| Error::Config(format!("{name}={v:?}: too large")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn from(vars: &[(&str, &str)]) -> Result<Config> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_vars(|k| map.get(k).cloned())
    }

    #[test]
    fn packing_knobs_come_from_the_environment() {
        let c = from(&[
            ("TCPX_PACK_BELOW", "16K"),
            ("TCPX_PACK_STAGED_BELOW", "1M"),
            ("TCPX_PACK_BUFFERS", "3"),
        ])
        .unwrap();
        assert_eq!(
            (c.pack_below, c.pack_staged_below, c.pack_buffers),
            (16 << 10, 1 << 20, 3)
        );
        let off = from(&[("TCPX_PACK_BELOW", "0"), ("TCPX_PACK_STAGED_BELOW", "0")]).unwrap();
        assert_eq!((off.pack_below, off.pack_staged_below), (0, 0));
        assert!(from(&[("TCPX_PACK_STAGED_BELOW", "big")]).is_err());
        let always = from(&[("TCPX_PACK_LONE_RUNS", "0")]).unwrap();
        assert_eq!(always.pack_lone_runs, Some(0));
        assert!(from(&[("TCPX_PACK_LONE_RUNS", "many")]).is_err());
        assert!(from(&[("TCPX_PACK_BUFFERS", "65")]).is_err());
        assert!(from(&[("TCPX_PACK_BELOW", "lots")]).is_err());
        let d = Config::default();
        assert_eq!(
            (d.pack_below, d.pack_staged_below, d.pack_buffers),
            (32 << 10, 512 << 10, 8)
        );
        assert_eq!(d.pack_lone_runs, None);
    }

    #[test]
    fn inline_limits_come_from_the_environment_and_are_capped() {
        type Field = fn(&Config) -> u32;
        let limits: [(&str, Field, u32); 3] = [
            (
                "TCPX_INLINE_BYTES",
                |c| c.inline_bytes,
                DEFAULT_INLINE_BYTES,
            ),
            (
                "TCPX_INLINE_LONE_BYTES",
                |c| c.inline_lone_bytes,
                DEFAULT_INLINE_LONE_BYTES,
            ),
            (
                "TCPX_INLINE_GPU_BYTES",
                |c| c.inline_gpu_bytes,
                DEFAULT_INLINE_GPU_BYTES,
            ),
        ];
        for (name, field, default) in limits {
            assert_eq!(field(&Config::default()), default, "{name}");
            assert_eq!(field(&from(&[(name, "4K")]).unwrap()), 4096, "{name}");
            assert_eq!(field(&from(&[(name, "0")]).unwrap()), 0, "{name}");
            assert_eq!(field(&from(&[(name, "64K")]).unwrap()), 65536, "{name}");
            assert!(from(&[(name, "65537")]).is_err(), "{name} over 64 KiB");
            assert!(from(&[(name, "some")]).is_err(), "{name} not a size");
        }
    }

    #[test]
    fn eager_frames_default_to_64_kib_on_every_endpoint() {
        assert_eq!(Config::default().eager_bytes, None);
        assert_eq!(Config::default().eager_limit(), 64 << 10);
        let gpu = from(&[("TCPX_GPU_INDEX", "2")]).unwrap();
        assert_eq!(gpu.eager_limit(), 64 << 10);
        let pci = from(&[("TCPX_GPU_PCI", "0000:04:00.0")]).unwrap();
        assert_eq!(pci.eager_limit(), 64 << 10);
        let asked = from(&[("TCPX_GPU_INDEX", "2"), ("TCPX_EAGER_BYTES", "4K")]).unwrap();
        assert_eq!(asked.eager_limit(), 4 << 10);
        assert_eq!(from(&[("TCPX_EAGER_BYTES", "0")]).unwrap().eager_limit(), 0);
        assert_eq!(Config::default().eager_detach, DEFAULT_EAGER_DETACH);
        assert_eq!(
            from(&[("TCPX_EAGER_DETACH", "16K")]).unwrap().eager_detach,
            16 << 10
        );
        assert_eq!(from(&[("TCPX_EAGER_DETACH", "0")]).unwrap().eager_detach, 0);
        assert!(from(&[("TCPX_EAGER_DETACH", "lots")]).is_err());
        let err = from(&[("TCPX_EAGER_BYTES", "128K")])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("eager_bytes") && err.contains("at most"),
            "{err}"
        );
    }

    #[test]
    fn empty_environment_gives_the_defaults() {
        assert_eq!(from(&[]).unwrap(), Config::default());
    }

    #[test]
    fn uccl_aliases_are_accepted_and_ours_win() {
        let c = from(&[
            ("UCCL_TCPX_NUM_CHANNELS", "8"),
            ("UCCL_TCPX_CHUNK_BYTES", "1M"),
            ("UCCL_TCPX_PLUGIN_PATH", "/opt/x.so"),
        ])
        .unwrap();
        assert_eq!(c.channels, 8);
        assert_eq!(c.chunk_bytes, 1 << 20);
        assert_eq!(c.backend, Backend::Path("/opt/x.so".into()));
        let c = from(&[("UCCL_TCPX_NUM_CHANNELS", "8"), ("TCPX_NUM_CHANNELS", "2")]).unwrap();
        assert_eq!(c.channels, 2);
    }

    #[test]
    fn every_variable_is_read() {
        let c = from(&[
            ("TCPX_BACKEND", "builtin"),
            ("TCPX_CHUNK_BYTES", "262144"),
            ("TCPX_WINDOW", "8"),
            ("TCPX_TIMEOUT_MS", "1500"),
            ("TCPX_CONTROL_ADDR", "127.0.0.1:7400"),
            ("TCPX_DEVICES", "0, 2"),
            ("TCPX_GPU_PCI", "0000:04:00.0"),
            ("TCPX_BACKOFF", "spin"),
            ("TCPX_WAIT_SPIN_US", "0"),
            ("TCPX_ENGINE_LINGER_US", "7"),
            ("TCPX_PIN", "0"),
            ("TCPX_ENGINES_PER_NIC", "4"),
            ("TCPX_GPU_INDEX", "3"),
            ("TCPX_REQUIRE_SECRET", "1"),
        ])
        .unwrap();
        assert_eq!(c.wait_spin, Duration::ZERO);
        assert_eq!(c.idle_linger, Duration::from_micros(7));
        assert_eq!(c.gpu_index, Some(3));
        assert!(c.require_secret);
        assert_eq!(c.backend, Backend::Builtin);
        assert_eq!(c.chunk_bytes, 256 << 10);
        assert_eq!(c.window, 8);
        assert_eq!(c.timeout, Duration::from_millis(1500));
        assert_eq!(c.control_addr, "127.0.0.1:7400".parse().unwrap());
        assert_eq!(c.devices, Some(vec![0, 2]));
        assert_eq!(c.gpu_pci.as_deref(), Some("0000:04:00.0"));
        assert_eq!(c.backoff, Backoff::Spin);
        assert!(!c.pin_engines);
        assert_eq!(c.engines_per_device, Some(4));
    }

    #[test]
    fn bad_values_name_the_variable() {
        for (var, value) in [
            ("TCPX_NUM_CHANNELS", "many"),
            ("TCPX_NUM_CHANNELS", "0"),
            ("TCPX_CHUNK_BYTES", "4T"),
            ("TCPX_CHUNK_BYTES", "8G"),
            ("TCPX_WINDOW", "17"),
            ("TCPX_BACKOFF", "nap"),
            ("TCPX_CONTROL_ADDR", "localhost"),
            ("TCPX_ENGINES_PER_NIC", "0"),
            ("TCPX_GPU_INDEX", "-1"),
            ("TCPX_REQUIRE_SECRET", "maybe"),
        ] {
            let err = from(&[(var, value)]).unwrap_err().to_string();
            assert!(
                err.contains(var) || err.contains("must be"),
                "{var}={value}: {err}"
            );
        }
    }

    #[test]
    fn sizes_accept_binary_suffixes() {
        assert_eq!(parse_size("X", "512K").unwrap(), 512 << 10);
        assert_eq!(parse_size("X", "512 KiB").unwrap(), 512 << 10);
        assert_eq!(parse_size("X", "1g").unwrap(), 1 << 30);
        assert!(parse_size("X", "").is_err());
    }
}
