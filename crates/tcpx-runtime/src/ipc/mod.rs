//! Same-host GPU memory without the network: endpoints of one host find each other through a
//! Unix socket and move GPU memory with CUDA IPC, by copy engines only.
//!
//! ```text
//! owner (process A)                               importer (process B)
//! endpoint.advertise_ipc(&region) ─ descriptor (128 bytes, out of band) ─▶
//! endpoint.accept_local()   ◀── Unix socket: hello both ways ──  endpoint.connect_local(&addr)
//!                           ◀── Validate(key, handle, range) ──  first use of a descriptor
//!                           ── Granted ──────────────────────▶  cuIpcOpenMemHandle (cached)
//!                                                              write_ipc / read_ipc: cuMemcpyAsync
//!                                                              on B's streams, events polled by
//!                                                              the Transfer's wait
//! endpoint.revoke_ipc(&d)   ── Revoke ───────────────────────▶  mapping closed, then RevokeAck
//! ```
//!
//! ```rust,no_run
//! use std::time::Duration;
//! use tcpx_runtime::{Endpoint, IpcDescriptor, LocalInfo, LocalRoute};
//!
//! # fn owner(ep: &Endpoint) -> tcpx_runtime::Result<()> {
//! // Process A, the owner: advertise CUDA memory; hand `desc` and `info` to B out of band.
//! let kv = ep.alloc_cuda(256 << 20)?;
//! let desc = ep.advertise_ipc(&kv)?.to_bytes();
//! let info = ep.local_info().to_bytes().expect("fits");
//! let conn = ep.accept_local()?; // keep it while B works: it answers B's checks
//! # Ok(()) }
//! # fn importer(ep: &Endpoint, desc: &[u8], info: &[u8], src: &tcpx_runtime::Region)
//! #     -> tcpx_runtime::Result<()> {
//! // Process B: the same host? Then connect and write with the copy engines.
//! let peer = LocalInfo::from_bytes(info).expect("local info");
//! if let LocalRoute::Ipc = ep.local_route(&peer) {
//!     let conn = ep.connect_local(&peer.addr())?; // or LocalAddr::Gpu("0000:8a:00.0".into())
//!     let d = IpcDescriptor::from_bytes(desc).expect("a descriptor");
//!     conn.write_ipc(src, 0, &d, 0, 4096)?.wait(Duration::from_secs(30))?;
//! }
//! # Ok(()) }
//! ```
//!
//! # When the runtime uses this route
//!
//! [`crate::Endpoint::local_route`] answers [`LocalRoute::Ipc`] when the peer's
//! [`LocalInfo`] shows the same running kernel (equal `/proc/sys/kernel/random/boot_id`,
//! which containers share with their host) and the same user (the rendezvous admits only
//! the same uid, checked by the kernel with `SO_PEERCRED`), a CUDA driver is usable here,
//! this endpoint has its rendezvous socket, and — when both GPUs are known and visible here
//! and differ — the driver says they can reach each other peer-to-peer. Otherwise it answers
//! [`LocalRoute::Network`] with the reason. The route is for GPU memory on both sides: IPC
//! handles exist only for device allocations (`cuMemAlloc`, PyTorch's default allocator;
//! not `cuMemCreate` or `cuMemAllocAsync` pools). Rendezvous names live in the network
//! namespace (abstract sockets): two containers of one host in different network namespaces
//! pass the route check but fail to connect, and callers fall back to the network (the NIXL
//! plugin does).
//!
//! # Rendezvous
//!
//! Every endpoint listens on `tcpx-ipc/<uid>/ep/<control address>` ([`LocalInfo::addr`],
//! [`crate::Endpoint::local_addr`]); the first endpoint of a user on a GPU also claims
//! `tcpx-ipc/<uid>/gpu/<bus id>` ([`LocalAddr::Gpu`]: UCCL's `connect_local(remote_gpu_bdf)`).
//! Admission checks the peer's uid, protocol version and boot id; strangers are turned away
//! while `accept_local` keeps waiting.
//!
//! # Memory safety across processes
//!
//! The owner keeps advertised memory alive until [`crate::Endpoint::revoke_ipc`], which
//! returns only after every connected peer closed its mapping (CUDA forbids freeing an
//! allocation another process still maps). A peer's mapping also closes when the owner's
//! connection says goodbye (dropped) or disappears (process exit). Every close waits for the
//! copies queued on the mapping first.
//!
//! Modules: [`descriptor`] (the 128-byte descriptor), [`identity`] (host identity, addresses,
//! the route), [`wire`] (the local protocol), and private ones: `socket` (abstract Unix
//! sockets), `rendezvous` (admission), `link` (a connection's shared state and its watcher
//! thread), `cache` (grants and mappings), `op` (an operation), `adverts` (the owner's
//! table), `shared` (the endpoint's same-host state).

/// The 128-byte descriptor (`tcpx-proto`'s).
pub mod descriptor {
    pub use tcpx_proto::ipc::{IpcDescriptor, IpcDescriptorError};
}
pub mod identity;
pub mod wire;

mod adverts;
mod cache;
mod connection;
mod link;
pub(crate) mod links;
mod op;
pub(crate) mod rendezvous;
pub(crate) mod shared;
pub(crate) mod socket;

pub use connection::{IpcPtrSegment, IpcSegment, LocalConnection, LocalPeer};
pub use descriptor::{IpcDescriptor, IpcDescriptorError};
pub use identity::{normalize_bus_id, LocalAddr, LocalInfo, LocalRoute, MAX_LOCAL_INFO};
pub use shared::IPC_STREAMS;
