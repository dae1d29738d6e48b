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
//! - [`wait`]: blocking waits release the GIL and check for signals every 20 ms;
//! - [`errors`]: failures become exceptions in one place.

#![deny(unsafe_op_in_unsafe_fn)]

pub mod blob;
pub mod core;
pub mod errors;
pub mod native;
pub mod p2p;
pub mod wait;

use pyo3::prelude::*;

/// Marks endpoints inherited through `fork()` unusable in the child (called by
/// `os.register_at_fork(after_in_child=...)` in `tcpx/__init__.py`).
#[pyfunction]
fn _after_fork_in_child() {
    core::FORKED.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// `tcpx._native`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<native::PyCore>()?;
    m.add_class::<native::PyTransfer>()?;
    m.add_class::<p2p::P2pEndpoint>()?;
    m.add_function(wrap_pyfunction!(p2p::last_error, m)?)?;
    m.add_function(wrap_pyfunction!(_after_fork_in_child, m)?)?;
    m.add("SLICE_SECONDS", wait::SLICE.as_secs_f64())?;
    Ok(())
}
