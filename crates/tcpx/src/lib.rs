//! Safe types over an ncclNet plugin (GPUDirect-TCPX, or our kernel-TCP `tcpx-socket`).
//!
//! * [`Net`]: a loaded plugin, initialized once per process, its logger routed into `tracing`
//!   (target `tcpx::plugin`).
//! * [`Device`] and [`Properties`]: what the plugin reports per NIC.
//! * [`ListenComm`], [`SendComm`], [`RecvComm`]: connections; set-up is non-blocking underneath
//!   ([`PendingConnect`], [`PendingAccept`]) and driven to completion with a timeout.
//! * [`HostBuffer`], [`SharedMemory`], [`MemoryRegion`]: memory and its registrations
//!   (deregistered on drop; a region keeps its comm alive, a comm keeps its `Net` alive).
//! * [`SendRequest`], [`RecvRequest`]: operations in flight, tested in FIFO order and consumed.
//! * [`Error`]: one error type naming the API, the plugin's code and the context.
//!
//! ```
//! use std::time::Duration;
//! use tcpx::{Net, SharedMemory};
//! # std::env::set_var("TCPX_SOCKET_IFNAME", "lo"); // keep doc-test traffic on loopback
//! let net = Net::builtin()?; // the linked-in socket plugin
//! let mut listener = net.listen(0)?;
//! let handle = *listener.handle();
//! let sender = std::thread::spawn(move || -> tcpx::Result<()> {
//!     let mut send = net.connect(0, &handle, Duration::from_secs(10))?;
//!     let memory = SharedMemory::host(4096)?;
//!     memory.with_bytes_mut(|b| b[..5].copy_from_slice(b"hello"))?;
//!     let region = send.register(&memory)?;
//!     let mut req = loop {
//!         if let Some(r) = send.isend(&region, 0, 5, 0)? { break r }
//!     };
//!     while send.test(&mut req)?.is_none() {}
//!     Ok(())
//! });
//! let mut recv = listener.accept(Duration::from_secs(10))?;
//! let memory = SharedMemory::host(4096)?;
//! let region = recv.register(&memory)?;
//! let mut req = loop {
//!     if let Some(r) = recv.irecv(&region, 0, 4096, 0)? { break r }
//! };
//! let n = loop {
//!     if let Some(n) = recv.test(&mut req)? { break n }
//! };
//! recv.consumed(req)?;
//! assert_eq!(memory.with_bytes(|b| b[..n].to_vec())?, b"hello");
//! sender.join().unwrap()?;
//! # Ok::<(), tcpx::Error>(())
//! ```
#![deny(unsafe_op_in_unsafe_fn)]

mod call;
mod comm;
pub mod cuda;
mod device;
mod error;
mod handle;
mod logging;
mod memory;
mod net;
mod packed;

pub use comm::{ListenComm, MemoryRegion, PendingAccept, PendingConnect, RecvComm, SendComm};
pub use comm::{RecvRequest, SendRequest};
pub use device::{Device, DeviceType, Properties, PtrSupport};
pub use error::{Error, ErrorKind, Result};
pub use handle::ConnectHandle;
pub use memory::{
    ForeignMemory, HostBuffer, Memory, MemoryKind, SharedMemory, BUFFER_ALIGN, HUGE_PAGE,
};
pub use net::{Net, TCPX_INSTALL_PATHS};
pub use packed::PackedRanges;
/// The network interfaces that are up, one usable address each — the built-in plugin's own
/// list, so that tools and the runtime name and address interfaces exactly as it does.
pub use tcpx_socket::{interfaces, Interface};

/// The built-in kernel-TCP plugin's switches and counters, for tools and tests that drive it
/// (size reporting off, fault injection, devmem emulation) or fit its reads (the padding of
/// eager frames) without depending on `tcpx-socket` themselves.
pub mod builtin {
    pub use tcpx_socket::{
        faults_injected, DEVMEM_ENV, DIRECT_READ_MIN, FAULT_ENV, NO_SIZES_ENV, PLUGIN_NAME,
    };
}
pub use tcpx_sys::{AbiVersion, ResultCode};
