//! `tcpx-socket`: an NCCL net plugin (the ncclNet v8 and v7 tables) over kernel TCP sockets,
//! for host memory.
//!
//! It is the embedded default backend of the tcpx stack, the test peer of every layer above the
//! ABI, and a plugin real NCCL can load (`NCCL_NET_PLUGIN=/path/to/libtcpx_socket.so`). Its
//! semantics follow GPUDirect-TCPX so the layers above meet real behaviour:
//!
//! * `listen`/`connect`/`accept` never block: they return Success with a NULL comm until the
//!   connection is ready, and `connect` keeps its progress in the caller's handle buffer.
//! * Sends and receives match in posting order; at most 16 requests per comm (the 17th post
//!   answers Success with a NULL request: busy); `irecv` takes exactly one buffer.
//! * Progress happens only inside `test`, and `test` is legal only on the oldest outstanding
//!   request of a comm (anything else is ncclInvalidUsage).
//! * `irecvConsumed` releases receive slots in FIFO order when the accept caller asked for a
//!   device handle (TCPX-style callers); otherwise `test` releases them (real NCCL).
//! * Truncated, malformed or hostile peer traffic yields an error code and a log line, never a
//!   crash; a peer that goes away fails the comm with ncclRemoteError.
//!
//! Environment (read once, at the first `init`):
//! * `TCPX_SOCKET_IFNAME`, else `NCCL_SOCKET_IFNAME`: interfaces to expose, NCCL syntax
//!   (`eth,ib` prefixes, `^lo` excludes, `=eth1` exact). Default: every non-loopback interface
//!   that is up, else `lo`.
//! * `TCPX_SOCKET_NSOCKS`, else `NCCL_NSOCKS_PERTHREAD × NCCL_SOCKET_NTHREADS`: data sockets per
//!   comm, 1..=8, default 1. The listener's value wins (it travels in the handle).
//! * `TCPX_SOCKET_DEVMEM=1` (also `true`/`yes`/`on`; default off): **devmem emulation**. The
//!   plugin loads the CUDA driver itself (`libcuda.so.1`; a missing driver makes `init` fail with
//!   ncclSystemError and a log line), reports `ptrSupport` HOST|CUDA and `netDeviceType` UNPACK
//!   version 7, accepts CUDA registrations, and receives into CUDA memory the way GPUDirect-TCPX
//!   does: payload lands in a GPU bounce buffer in scattered 4 KiB pages, `test` publishes
//!   `loadMeta`s and `cnt[slot]` in the metadata the accept's device handle points at, and the
//!   consumer gathers the fragments with its unpack kernel, then calls `irecvConsumed` (FIFO).
//!   Receives into CUDA memory are limited to 4 MiB (2048 fragments); sends from CUDA memory are
//!   staged through host memory. `TCPX_SOCKET_DEVMEM_GPU` picks the GPU (ordinal, default 0);
//!   `TCPX_CUDA_DISABLE=1` makes the plugin behave as if no driver were installed;
//!   `TCPX_SOCKET_CUDA_LIB=/path/libcuda.so.1` loads that driver library instead. Off: host
//!   memory only, netDeviceType HOST, exactly as before.
//!
//! * `TCPX_SOCKET_READ_BATCH=BYTES` (default 262144 with 4 cores or more, else 0; `0` off): in
//!   payload parts of at least that size with another receive posted behind them (a stream),
//!   a receive socket found empty is read again only once that many bytes, or the rest of the
//!   part, are queued (`SO_RCVLOWAT`), so streams of large messages arrive in a few large
//!   reads; a lone transfer is read as it lands. Details: [`READ_BATCH_ENV`].
//! * `TCPX_SOCKET_NO_SIZES=1` (default off): `test` never writes `*sizes`, like some deployed
//!   v6 plugins (nccl-fastsocket), so the layers above are tested against NCCL's size contract.
//! * `TCPX_SOCKET_FAULT=key:value[,...]` (default off): fault injection for tests — fail a comm
//!   after N bytes (`fail_after_bytes:N`), fail its K-th `test` (`test_error:K`), shut its
//!   sockets down after N bytes (`drop_conn_after_bytes:N`), hold completions back
//!   (`delay_us:D`), limited to one side (`side:send|recv`) or to the first N comms of a side
//!   (`comms:N`). A bad value makes `init` fail with a log line. Details: [`FAULT_ENV`].
//!
//! Wire formats are documented in the `handle` and `wire` modules' sources.
//!
//! ```
//! use tcpx_sys::{AbiVersion, NetPlugin};
//! // SAFETY: the table is this crate's own, complete and valid for the whole process.
//! let plugin = unsafe { NetPlugin::from_static_v8(tcpx_socket::table_v8()) }?;
//! assert_eq!(plugin.name(), tcpx_socket::PLUGIN_NAME);
//! assert_eq!(plugin.version(), AbiVersion::V8);
//! # Ok::<(), tcpx_sys::LoadError>(())
//! ```
#![deny(unsafe_op_in_unsafe_fn)]

mod log;

mod connect;
mod cuda;
mod device;
mod devmem;
mod fault;
mod handle;
#[cfg(feature = "instant")]
pub mod instant;
mod listen;
mod mr;
mod object;
mod recv;
mod send;
mod sock;
#[cfg(test)]
mod stream_model;
mod switch;
mod table;
pub mod wire;

pub use cuda::CUDA_LIB_ENV;
pub use device::{
    interfaces, Interface, DEFAULT_READ_BATCH, DEFAULT_SPEED_MBPS, DEVMEM_ENV, DEVMEM_GPU_ENV,
    MAX_NSOCKS, READ_BATCH_ENV,
};
pub use fault::{faults_injected, FAULT_ENV, NO_SIZES_ENV};
/// Least part the plugin reads straight into its receive, reading only the next header
/// after it (see `recv`): a layer that wants the bytes behind a short message to land
/// straight in their receives pads that message to this length.
pub use recv::DIRECT_MIN as DIRECT_READ_MIN;
pub use table::{ncclNetPlugin_v7, ncclNetPlugin_v8, pending_connects, PluginTable};

/// The plugin's name, as reported in its tables.
pub const PLUGIN_NAME: &str = "tcpx-socket";

const PLUGIN_NAME_C: &std::ffi::CStr = c"tcpx-socket";

/// The ncclNet v8 table, for use without `dlopen` (`tcpx_sys::NetPlugin::from_static_v8`).
pub fn table_v8() -> &'static tcpx_sys::ncclNet_v8_t {
    &ncclNetPlugin_v8.0
}

/// The ncclNet v7 table (TCPX's version), for use without `dlopen`.
pub fn table_v7() -> &'static tcpx_sys::ncclNet_v7_t {
    &ncclNetPlugin_v7.0
}
