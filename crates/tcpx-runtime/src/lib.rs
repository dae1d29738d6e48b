//! The transfer runtime of tcpx: what turns a loaded ncclNet plugin into GPU-to-GPU transfers.
//!
//! This crate holds the pieces above the safe plugin layer (`tcpx`):
//!
//! - [`window`]: per-comm sliding windows that enforce the plugin's request rules (at most 16
//!   in flight, `test` only on the oldest, receives consumed in FIFO order after done);
//! - [`schedule`]: how a transfer (contiguous or vectored) is cut into chunks and spread over
//!   channels, derived identically by both peers;
//! - [`control`]: the control plane — a versioned, framed protocol over one TCP connection per
//!   peer pair that exchanges endpoint info and connect handles, plus the out-of-band endpoint
//!   metadata blob;
//! - progress engines (private): one pinned thread per NIC owning its channels' comms,
//!   posting chunks into the windows and testing every head on every pass;
//! - [`Endpoint`], [`Connection`], [`Region`], [`Transfer`]: the API — connect, register,
//!   send / receive (contiguous and vectored), poll / wait, close on drop — configured by
//!   [`Config`] (builder, environment, CLI flags in the tools);
//! - [`onesided`]: one-sided write / read into a peer's advertised memory ([`Descriptor`],
//!   [`Connection::write`], [`Connection::read`]) with notifications
//!   ([`Connection::notify`], [`Endpoint::notifications`]), on comms of their own so that
//!   engines can order them without disturbing two-sided traffic;
//! - [`rendezvous`]: endpoints meet by name through a key-value [`Store`] (etcd with feature
//!   `etcd`, in-memory): [`Endpoint::publish`], [`Endpoint::connect_by_name`] and the group
//!   form [`Endpoint::rendezvous`].
//!
//! [`Endpoint::metrics`] reads every connection's, channel's and NIC's counters in process;
//! [`Config::metrics_addr`] (`TCPX_METRICS_ADDR`) serves them to Prometheus.
//! - [`ipc`]: same-host GPU memory through CUDA IPC ([`Endpoint::accept_local`],
//!   [`Endpoint::connect_local`], [`Endpoint::advertise_ipc`], [`LocalConnection::write_ipc`]
//!   and its kin), found through a Unix socket, moved by copy engines only.
//!
//! The benchmarks that drive this API (whole stack vs raw TCP, engine overhead) live in
//! `tcpx-tools`, above it.
//!
//! The window, schedule and codec are sans-IO state machines (no sockets, no clock of their
//! own), so they are tested exhaustively without a network; [`control::ControlConn`] and
//! the engines are the thin I/O shells around them.
//!
//! ```
//! use tcpx_runtime::schedule::Schedule;
//!
//! // 1.5 MiB in 512 KiB chunks over 2 channels: chunk i goes to channel i mod 2.
//! let schedule = Schedule::contiguous(3 << 19, 512 << 10, 2).unwrap();
//! let channels: Vec<u16> = schedule.iter().map(|c| c.channel).collect();
//! assert_eq!(channels, [0, 1, 0]);
//! ```

// Listed in the one-way order of docs/ARCHITECTURE.md: each module imports only modules
// listed before it (`cargo xtask layers` checks it, file by file).

// Control plane: codec, messages, metadata, one-sided payloads, the blocking socket shell.
pub mod control;
mod wakeup;
// Sans-IO cores: deterministic state machines, no sockets, no clock of their own (they live
// in tcpx-proto with the formats they decide on; re-exported under their old paths).
/// The largest eager message of any connection, and how many consecutive messages an eager
/// channel takes before the next one does (a benchmark warms every channel with them).
pub use tcpx_proto::eager::{EAGER_MAX_MESSAGE, EAGER_RUN};
pub use tcpx_proto::{schedule, window};

// Per-channel counters.
mod stats;
// Members held weakly (an endpoint's live connections).
mod weak_list;
// A lock released with a plain store, for the per-message sections of small transfers.
mod spin_lock;
// Errors (they carry control-plane errors).
pub mod error;
// Configuration: builder, environment.
pub mod config;
// Regions, segments, plugin registrations and their per-link cache.
mod registry;
// `Transfer` and its completion.
mod transfer;

// Snapshots of the counters, their Prometheus form and the opt-in HTTP exporter.
pub mod metrics;
// What a connection shares with its engines: failure, peer-gone, counters.
mod link;

mod eager;
// The pinned progress engines: lane core, action executor, staging, unpack.
mod engine;
// The submission path of one link: regions, pieces, jobs handed to the engines.
mod carrier;

// One-sided write / read with notifications, on a carrier of its own.
pub mod onesided;

// Same-host GPU memory through CUDA IPC, found through a Unix socket (no network).
pub mod ipc;
// The Endpoint API: Endpoint, Connection, admission, the control watcher.
pub mod endpoint;
// Endpoints meet by name through a key-value store (etcd, in-memory), above the Endpoint API.
pub mod rendezvous;

pub use config::{Backend, Backoff, Config, ConfigBuilder};
pub use endpoint::backend::{BackendInfo, BackendOrigin};
pub use endpoint::{Connection, Endpoint, EnginePlan, Segment};
pub use error::{Direction, Error, LocalErrorKind, Result};
pub use ipc::{IpcDescriptor, LocalAddr, LocalConnection, LocalInfo, LocalRoute};
pub use metrics::{ChannelMetrics, ConnectionMetrics, Metrics};
pub use onesided::{
    batches_per_pack_buffer, Descriptor, PackStats, RemoteSegment, PACKED_HOST_MAX_BYTES,
    PACK_BYTES, PACK_SLICE,
};
pub use registry::Region;
pub use rendezvous::{Group, MemoryStore, Store, StoreError};
pub use stats::{ChannelStats, InlineStats};
pub use transfer::Transfer;
