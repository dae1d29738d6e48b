//! `tcpx-proto`: every wire format a tcpx peer or a user hands us, in one sans-IO crate.
//!
//! No sockets, no threads, no `unsafe`, no CUDA, no clock: decoders take byte slices (or are fed bytes
//! as they arrive, like the control [`control::codec::Decoder`]) and answer a value or an
//! error naming what is wrong; they never panic and never allocate more than the limit they
//! state, whatever the input. The runtime (`tcpx-runtime`) does the IO around them.
//!
//! - [`wire`]: the little-endian [`Reader`](wire::Reader) / [`Writer`](wire::Writer) every
//!   format is written with, and their errors;
//! - [`control`]: control frames, messages and one-sided (RMA) payloads;
//! - [`eager`]: frames of small two-sided messages on the eager comms;
//! - [`metadata`]: endpoint metadata, the one blob that finds a peer (out of band, through a
//!   store, in UCCL's or NIXL's exchanges);
//! - [`onesided`]: the descriptor of an advertised region, and [`MemoryKind`];
//! - [`ipc`]: same-host formats (CUDA IPC handle and descriptor, the local protocol);
//! - [`uccl`]: what `tcpx.p2p` shares with UCCL scripts (metadata, the 64-byte advert, the
//!   descriptor lists);
//! - [`nixl`]: the NIXL backend plugin's connection info, public memory data and
//!   notification payloads;
//! - the sans-IO cores that decide on them: [`window`] (a comm's request window and its
//!   rules: 16 in flight, FIFO test, consume), [`schedule`] (how a transfer is cut into chunks
//!   over channels, both sides alike) and [`coalesce`] (one-sided list entries merged the same
//!   way on both sides);
//! - [`bus_id`], [`checksum`]: the PCI bus id spellings, FNV-1a.
//!
//! Every decoder here is fuzzed (`cargo xtask fuzz`, targets in `crates/tcpx-proto/fuzz`).

#![forbid(unsafe_code)]

pub mod bus_id;
pub mod checksum;
pub mod coalesce;
pub mod control;
pub mod eager;
pub mod ipc;
pub mod metadata;
pub mod nixl;
pub mod onesided;
pub mod schedule;
pub mod uccl;
pub mod window;
pub mod wire;

mod memory_kind;

pub use memory_kind::MemoryKind;
