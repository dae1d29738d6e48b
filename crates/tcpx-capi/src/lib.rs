//! The C API of tcpx: `libtcpx.so` / `libtcpx.a` and the header `include/tcpx.h`, which
//! cbindgen generates from this crate (`cargo xtask capi`; `--check` fails when the checked-in
//! header drifted).
//!
//! It is a thin conversion layer over [`tcpx_runtime`] with the same semantics, in the style of
//! wasmtime's C API and rustls-ffi:
//!
//! - objects are opaque handles (`tcpx_endpoint`, `tcpx_connection`, `tcpx_region`,
//!   `tcpx_transfer`, `tcpx_local_connection`): generation-checked ids into handle tables
//!   ([`handles`]), so a handle
//!   used after it was destroyed is detected (`TCPX_ERR_STALE_HANDLE`) instead of reaching
//!   freed memory;
//! - every function returns a [`tcpx_status`] and records, per thread, a message naming the
//!   call and what failed ([`tcpx_last_error`]);
//! - no panic crosses the boundary: each entry runs under `catch_unwind` ([`error::guard`]);
//! - every pointer argument is checked for null;
//! - nothing of the NCCL plugin ABI appears in the header.
//!
//! The ABI version ([`TCPX_ABI_VERSION_MAJOR`], [`TCPX_ABI_VERSION_MINOR`]) is in the header and
//! returned by [`tcpx_abi_version`]; [`tcpx_init`] (the header's `TCPX_ABI_CHECK()`) refuses a
//! host built against another major version, or a newer minor one, with a clear message.
//!
//! Rust programs use `tcpx-runtime` directly; nothing in Rust links this crate.

// The C names (`tcpx_status`, `TCPX_OK`) are the ABI; Rust naming rules do not apply to them.
#![allow(non_camel_case_types)]
#![deny(unsafe_op_in_unsafe_fn)]

use std::ffi::c_char;

// In the header's order (cbindgen follows the declarations): versions and errors, endpoints,
// memory, two-sided, one-sided, same-host (CUDA IPC), transfers; then the private helpers.
mod connection;
mod endpoint;
mod error;
mod local;
mod memory;
mod nixl;
mod objects;
mod onesided;
mod rendezvous;
mod transfer;

mod convert;
mod handles;

pub use connection::*;
pub use endpoint::*;
pub use error::{tcpx_last_error, tcpx_status_str};
pub use local::*;
pub use memory::*;
pub use nixl::*;
pub use onesided::*;
pub use rendezvous::*;
pub use transfer::*;

/// Major ABI version: changes when an existing function, struct or constant changes in a way
/// that breaks compiled hosts. A host built against another major version must not run.
pub const TCPX_ABI_VERSION_MAJOR: u32 = 1;
/// Minor ABI version: grows when functions or constants are added. A host built against minor
/// `m` needs a library whose minor version is at least `m`.
/// (1: `tcpx_connection_warmup`; the same-host functions, `tcpx_local_connection` and
/// `tcpx_ipc_segment`. 2: rendezvous by name, `tcpx_endpoint_publish`,
/// `tcpx_endpoint_unpublish`, `tcpx_endpoint_connect_by_name`. 3: the NIXL plugin's byte
/// formats, `tcpx_nixl_*`. 4: batches of small messages, `tcpx_connection_send_batch`,
/// `tcpx_connection_recv_batch`, `tcpx_connection_reserve_batches`, `TCPX_BATCH_MAX_BYTES`.
/// 5: `tcpx_local_connection_prepare_ipc`. 6: `tcpx_endpoint_options.eager_bytes`, appended;
/// the options of minor 0–5 hosts are still taken. 7: `tcpx_endpoint_stop_accepting`.)
pub const TCPX_ABI_VERSION_MINOR: u32 = 7;
/// `(TCPX_ABI_VERSION_MAJOR << 16) | TCPX_ABI_VERSION_MINOR`: what `tcpx_abi_version()`
/// returns and what `tcpx_init()` takes.
pub const TCPX_ABI_VERSION: u32 = (TCPX_ABI_VERSION_MAJOR << 16) | TCPX_ABI_VERSION_MINOR;

/// Bytes in the text buffers of `tcpx_peer_info`, `tcpx_endpoint_info` and
/// `tcpx_notification` (a socket address as text, NUL-terminated).
pub const TCPX_ADDRESS_MAX: usize = 64;
/// Bytes in a one-sided descriptor (`tcpx_region_advertise`).
pub const TCPX_DESCRIPTOR_BYTES: usize = 26;
/// Largest endpoint metadata blob (`tcpx_endpoint_metadata`).
pub const TCPX_METADATA_MAX_BYTES: usize = 4096;
/// Largest notification payload (`tcpx_connection_notify`, the one of a write).
pub const TCPX_NOTIFICATION_MAX_BYTES: usize = 65536;
/// Largest total of one batch (`tcpx_connection_send_batch` / `tcpx_connection_recv_batch`):
/// 4 MiB, the size of a pack buffer.
pub const TCPX_BATCH_MAX_BYTES: u64 = 4194304;
/// Bytes in `tcpx_endpoint_info::plugin` (the plugin's name, NUL-terminated).
pub const TCPX_NAME_MAX: usize = 64;
/// Bytes in a same-host (CUDA IPC) descriptor (`tcpx_region_advertise_ipc`).
pub const TCPX_IPC_DESCRIPTOR_BYTES: usize = 128;
/// Largest same-host endpoint info blob (`tcpx_endpoint_local_info`).
pub const TCPX_LOCAL_INFO_MAX_BYTES: usize = 512;
/// Bytes in `tcpx_local_peer_info::gpu_bus` (a PCI bus id, NUL-terminated).
pub const TCPX_BUS_ID_MAX: usize = 40;

/// What every function returns. `TCPX_OK` and `TCPX_PENDING` are not failures; after any other
/// value, `tcpx_last_error()` on the same thread names the call and what failed.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum tcpx_status {
    /// Success.
    TCPX_OK = 0,
    /// Not finished yet: a transfer still in progress (`tcpx_transfer_test`, or
    /// `tcpx_transfer_wait` running out of time; the transfer goes on), or no notification
    /// arrived in time. Not a failure.
    TCPX_PENDING = 1,
    /// A required pointer argument was NULL, or a handle was the zero (null) handle.
    TCPX_ERR_NULL_POINTER = 2,
    /// A handle was destroyed (or released) already, was never created, or is of another kind.
    TCPX_ERR_STALE_HANDLE = 3,
    /// An argument is unusable: a range outside a region, an empty list, a region of another
    /// endpoint, memory that cannot be registered, text that does not parse.
    TCPX_ERR_INVALID_ARGUMENT = 4,
    /// An output buffer is too small; the length argument now holds the size needed.
    TCPX_ERR_BUFFER_TOO_SMALL = 5,
    /// A configuration value (options or environment) is malformed or out of range.
    TCPX_ERR_CONFIG = 6,
    /// Not available here: no CUDA driver or device, or the plugin cannot take this memory.
    TCPX_ERR_UNSUPPORTED = 7,
    /// No usable plugin could be loaded or initialized.
    TCPX_ERR_BACKEND = 8,
    /// The peer's control address could not be reached.
    TCPX_ERR_CONNECT = 9,
    /// A transfer, a connection set-up or an accept did not finish within its timeout.
    TCPX_ERR_TIMEOUT = 10,
    /// The peer closed the connection or went away; its transfers failed.
    TCPX_ERR_PEER_CLOSED = 11,
    /// This side closed the connection (or destroyed the endpoint) while the transfer was
    /// pending.
    TCPX_ERR_CLOSED = 12,
    /// The peer refused a one-sided operation (unknown or revoked descriptor, wrong key, out of
    /// bounds); nothing was written or read.
    TCPX_ERR_ACCESS = 13,
    /// The two endpoints cannot work together (channels, chunk size, plugin differ), or the
    /// peer requires its metadata's secret and was reached by address alone.
    TCPX_ERR_INCOMPATIBLE = 14,
    /// The peer broke the control protocol or sent data that does not match.
    TCPX_ERR_PROTOCOL = 15,
    /// A plugin or CUDA call failed on the data path (the message names channel and peer).
    TCPX_ERR_PLUGIN = 16,
    /// A region still has transfers in flight (or being submitted) and cannot be destroyed yet.
    TCPX_ERR_BUSY = 17,
    /// The host was built against an incompatible version of this header (`tcpx_init`).
    TCPX_ERR_ABI_MISMATCH = 18,
    /// A bug inside the library was caught at the boundary (a Rust panic); the message has it.
    TCPX_ERR_PANIC = 19,
    /// An internal failure (a runtime thread could not start, a channel broke).
    TCPX_ERR_INTERNAL = 20,
}

/// Where memory lives.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum tcpx_memory_kind {
    /// Host memory.
    TCPX_MEMORY_HOST = 0,
    /// CUDA device memory.
    TCPX_MEMORY_CUDA = 1,
}

/// An endpoint: one plugin, its progress engines and a control listener. The zero value
/// (`{0}`) is the null handle.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct tcpx_endpoint {
    /// Opaque, generation-checked id.
    pub id: u64,
}

/// A connection to one peer endpoint. The zero value is the null handle.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct tcpx_connection {
    /// Opaque, generation-checked id.
    pub id: u64,
}

/// Memory registered with (or allocated by) an endpoint. The zero value is the null handle.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct tcpx_region {
    /// Opaque, generation-checked id.
    pub id: u64,
}

/// One submitted send, receive, write or read. The zero value is the null handle.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct tcpx_transfer {
    /// Opaque, generation-checked id.
    pub id: u64,
}

/// A connection to an endpoint of the same host (CUDA IPC, no network). The zero value is the
/// null handle.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct tcpx_local_connection {
    /// Opaque, generation-checked id.
    pub id: u64,
}

/// Endpoint settings. Fill it with `tcpx_endpoint_options_init()` (every field "unset"), then
/// override what you need; unset fields come from the environment (`TCPX_NUM_CHANNELS`,
/// `TCPX_CHUNK_BYTES`, `TCPX_PLUGIN_PATH`, `TCPX_CONTROL_ADDR`, `TCPX_TIMEOUT_MS`,
/// `TCPX_GPU_INDEX`, ... see the README) or the defaults.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct tcpx_endpoint_options {
    /// `sizeof(tcpx_endpoint_options)` as the host saw it; set by `tcpx_endpoint_options_init`.
    pub struct_size: u32,
    /// Channels (comm pairs) offered per connection; a connection uses the smaller of both
    /// peers' counts. 0: unset.
    pub channels: u32,
    /// Chunk size in bytes (one plugin request carries at most this); a connection uses the
    /// smaller of both peers' sizes.
    /// 0: unset.
    pub chunk_bytes: u32,
    /// Requests in flight per comm (1..=16). 0: unset.
    pub window: u32,
    /// Connection set-up and per-transfer timeout, in milliseconds. 0: unset.
    pub timeout_ms: u64,
    /// Plugin: `"auto"`, `"builtin"` (the kernel-TCP socket plugin) or the path of an ncclNet
    /// plugin `.so`. NULL: unset.
    pub backend: *const c_char,
    /// Control listener address, `"ip:port"` (port 0 picks a free one). NULL: unset.
    pub control_addr: *const c_char,
    /// PCI bus id of this endpoint's GPU (`"0000:04:00.0"`), for core pinning. NULL: unset.
    pub gpu_pci: *const c_char,
    /// GPU index this endpoint announces to peers (`tcpx_peer_info.gpu_index` on their side).
    /// -1: unset.
    pub gpu_index: i32,
    /// Pin engine threads to NIC-local cores: 0 no, 1 yes, -1 unset.
    pub pin_engines: i32,
    /// Refuse peers that connect without this endpoint's metadata secret (so that
    /// `tcpx_endpoint_connect_addr` is refused and only `tcpx_endpoint_connect` works): 0 no
    /// (the default), 1 yes, -1 unset (`TCPX_REQUIRE_SECRET`).
    pub require_secret: i32,
    /// Largest two-sided message carried in eager frames, many per plugin request (at most
    /// 65536 bytes; a connection uses the smaller of both sides' values). 0: off — every
    /// message is a plugin request of its own, and the connection makes no eager comms, nor
    /// their frame buffers (about 2 MiB per channel and side), which suits hosts that only
    /// move data one-sided. -1: unset (`TCPX_EAGER_BYTES`, else the default). Appended in ABI
    /// minor 6: a host built against an older header passes the smaller `struct_size`, and
    /// this field reads as unset.
    pub eager_bytes: i64,
}

/// What an endpoint is (`tcpx_endpoint_get_info`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct tcpx_endpoint_info {
    /// The control address peers connect to (`tcpx_endpoint_connect_addr`), NUL-terminated.
    pub control_addr: [c_char; TCPX_ADDRESS_MAX],
    /// The plugin's name, NUL-terminated.
    pub plugin: [c_char; TCPX_NAME_MAX],
    /// Channels per connection.
    pub channels: u32,
    /// Chunk size in bytes.
    pub chunk_bytes: u32,
    /// Connection set-up and per-transfer timeout, in milliseconds.
    pub timeout_ms: u64,
    /// The GPU index this endpoint announces, or -1.
    pub gpu_index: i32,
}

/// The peer of a connection (`tcpx_endpoint_accept`, `tcpx_connection_peer`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct tcpx_peer_info {
    /// The peer's control address, NUL-terminated: the same text `tcpx_notification.peer`
    /// carries for its notifications.
    pub address: [c_char; TCPX_ADDRESS_MAX],
    /// The GPU index the peer announced, or -1 when it announced none.
    pub gpu_index: i32,
    /// Channels each way.
    pub channels: u32,
}

/// One piece of a vectored transfer or of a one-sided local list: `len` bytes at `offset` in
/// `region`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct tcpx_segment {
    /// Registered memory of the connection's endpoint.
    pub region: tcpx_region,
    /// Offset in the region.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

/// One block of a peer's advertised memory: `len` bytes at `offset` in the region the
/// descriptor names.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct tcpx_remote_segment {
    /// Descriptor bytes from the peer's `tcpx_region_advertise`.
    pub descriptor: [u8; TCPX_DESCRIPTOR_BYTES],
    /// Offset in the peer's region.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

/// The peer of a same-host connection (`tcpx_endpoint_accept_local`,
/// `tcpx_local_connection_peer`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct tcpx_local_peer_info {
    /// Its process id.
    pub pid: u32,
    /// Its GPU ordinal in its own numbering, or -1.
    pub gpu_index: i32,
    /// Its GPU's PCI bus id (`0000:8a:00.0`), NUL-terminated; empty when it has none.
    pub gpu_bus: [c_char; TCPX_BUS_ID_MAX],
}

/// One piece of a same-host write or read: `len` bytes at `offset` in `region` (this side's
/// memory: CUDA, or host memory copied by the endpoint's GPU), and at `remote_offset` in the
/// range `descriptor` names (from the peer's `tcpx_region_advertise_ipc`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct tcpx_ipc_segment {
    /// Registered memory of the connection's endpoint.
    pub region: tcpx_region,
    /// Offset in the region.
    pub offset: u64,
    /// Descriptor bytes from the peer's `tcpx_region_advertise_ipc`.
    pub descriptor: [u8; TCPX_IPC_DESCRIPTOR_BYTES],
    /// Offset in the advertised range.
    pub remote_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// A delivered notification's sender and size (`tcpx_endpoint_notification`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct tcpx_notification {
    /// The sender's control address, NUL-terminated (matches its connection's
    /// `tcpx_peer_info.address`).
    pub peer: [c_char; TCPX_ADDRESS_MAX],
    /// Payload bytes (also set when the buffer was too small).
    pub len: u64,
}

/// Counters of one connection, summed over its channels (`tcpx_connection_get_stats`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct tcpx_connection_stats {
    /// Channels each way.
    pub channels: u32,
    /// Transfers submitted and not finished (two-sided, one-sided initiated, one-sided served).
    pub in_flight: u64,
    /// Bytes of completed two-sided sends.
    pub bytes_sent: u64,
    /// Bytes of completed two-sided receives.
    pub bytes_received: u64,
    /// Two-sided send requests completed.
    pub sends: u64,
    /// Two-sided receive requests completed.
    pub recvs: u64,
    /// Bytes one-sided operations sent (writes initiated, reads served), on the one-sided
    /// channels or inline in control messages.
    pub one_sided_bytes_sent: u64,
    /// Bytes one-sided operations received (writes served, reads initiated), likewise.
    pub one_sided_bytes_received: u64,
    /// Posts the plugin answered "busy", all channels.
    pub busy: u64,
}
