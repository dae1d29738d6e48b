//! The native half of the `tcpx` Python package (`tcpx._native`).
//!
//! A thin layer: [`core::Core`] maps Python's integers (connection, registration and transfer
//! ids, raw pointers) onto the runtime's objects, and the pyclasses only convert arguments and
//! results around it. No transfer logic lives here: the engines of `tcpx-runtime` move every
//! byte, on their own threads, which never touch a Python object.
//!
//! - `tcpx._native.Core` / `Transfer` ([`native`]): raise `tcpx.Error` subclasses; the
//!   Pythonic layer (`tcpx.Endpoint`, `Connection`, ...) is written in Python on top;
//! - `tcpx.p2p.Endpoint` ([`p2p`]): UCCL's p2p surface with `ok` flags;
//! - [`xfer`]: `FloatType`, `XferDesc`, `XferHandle` (the descriptor API's values) and
//!   [`descs`], their byte form; [`blob`]: the advertisement blob and UCCL metadata;
//! - [`fork`]: endpoints inherited through `fork()` refuse every call in the child;
//! - [`wait`]: blocking waits release the GIL and check for signals every 20 ms;
//! - [`errors`]: failures become exceptions in one place;
//! - [`store`]: a Python store with `torch.distributed.Store`'s interface as the runtime's
//!   rendezvous `Store`; [`rendezvous`]: the rendezvous calls of both layers over it;
//!   [`metrics`]: the runtime's metrics snapshot as Python dicts.

#![deny(unsafe_op_in_unsafe_fn)]

pub mod blob;
pub mod core;
/// The descriptor-list codec and keys (`tcpx-proto`'s).
pub use tcpx_proto::uccl::descs;
pub mod errors;
pub mod fork;
pub mod local;
pub mod metrics;
pub mod native;
pub mod p2p;
pub mod rendezvous;
pub mod store;
pub mod wait;
pub mod xfer;

use pyo3::prelude::*;

/// The runtime allocates a few small objects per transfer on the calling thread and frees
/// them on an engine thread, a pattern glibc's malloc handles badly (it took a fifth of a
/// 4 KiB message stream's CPU); the extension's Rust allocations go through mimalloc
/// (Python's own objects keep Python's allocator).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `tcpx._native`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // Before any endpoint exists: endpoints record the process that made them (see `fork`).
    fork::install();
    m.add_class::<native::PyCore>()?;
    m.add_class::<native::PyTransfer>()?;
    m.add_class::<p2p::P2pEndpoint>()?;
    m.add_class::<xfer::FloatType>()?;
    m.add_class::<xfer::XferDesc>()?;
    m.add_class::<xfer::XferHandle>()?;
    m.add_function(wrap_pyfunction!(p2p::last_error, m)?)?;
    m.add_function(wrap_pyfunction!(p2p::get_oob_ip, m)?)?;
    m.add("SLICE_SECONDS", wait::SLICE.as_secs_f64())?;
    Ok(())
}
