//! What a comm and everything made from it (regions, requests) share: the plugin comm, its
//! side and device, and what keeps a comm safe after a request was dropped in flight.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use crate::error::{Error, ErrorKind, Result};
use crate::memory::InFlight;
use crate::net::Net;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Side {
    Send,
    Recv,
}

/// State shared by a comm and everything made from it (regions, requests).
pub(crate) struct CommInner {
    pub(crate) net: Net,
    pub(crate) raw: *mut c_void,
    pub(crate) side: Side,
    pub(crate) device: usize,
    pub(crate) id: u64,
    /// Set when a request was dropped before `test` reported it done: the plugin still owns it
    /// and FIFO testing can no longer proceed, so every later data call fails clearly.
    pub(crate) poisoned: AtomicBool,
    /// Memory of requests dropped while in flight: kept alive until the comm is closed, because
    /// the plugin may still read or write it until then.
    pub(crate) abandoned: Mutex<Vec<InFlight>>,
    /// Set by [`RecvComm::closing`](super::RecvComm::closing): requests dropped from then on
    /// are the owner's expected teardown and are not warned about.
    pub(crate) closing: AtomicBool,
}

// SAFETY: `raw` is a plugin comm. Data-path calls need `&mut SendComm`/`&mut RecvComm` (one
// thread at a time, the ncclNet rule); the only calls made through a shared `CommInner` from
// other threads are regMr/deregMr (allowed concurrently by the ABI) and close, which runs once,
// in Drop, after every region and comm handle is gone.
unsafe impl Send for CommInner {}
// SAFETY: the only calls made through a shared `&CommInner` are regMr/deregMr, which the ncclNet
// ABI allows concurrently; data-path calls need `&mut SendComm`/`&mut RecvComm`, and the other
// fields are atomics, a mutex, or immutable after construction.
unsafe impl Sync for CommInner {}

impl CommInner {
    pub(crate) fn label(&self) -> String {
        let side = match self.side {
            Side::Send => "send",
            Side::Recv => "recv",
        };
        format!("{side} comm #{} on device {}", self.id, self.device)
    }

    pub(super) fn check_usable(&self, api: &'static str) -> Result<()> {
        if self.poisoned.load(Ordering::Relaxed) {
            return Err(Error::new(
                api,
                ErrorKind::InvalidArgument(
                    "a request was dropped before completion; close this comm".into(),
                ),
                self.label(),
            ));
        }
        Ok(())
    }
}

impl Drop for CommInner {
    fn drop(&mut self) {
        let plugin = &self.net.inner.plugin;
        let result = match self.side {
            // SAFETY: last owner of a live comm; every region (which holds an Arc) is gone.
            Side::Send => unsafe { plugin.close_send(self.raw) },
            // SAFETY: last owner of a live receive comm; every region (which holds an Arc) and
            // request is gone.
            Side::Recv => unsafe { plugin.close_recv(self.raw) },
        };
        match result {
            Ok(code) if code.is_success() => {}
            Ok(code) => tracing::warn!(target: "tcpx", comm = %self.label(), %code, "close failed"),
            Err(e) => {
                tracing::warn!(target: "tcpx", comm = %self.label(), error = %e, "close failed")
            }
        }
        // `abandoned` drops after close: only now may that memory be freed.
    }
}
