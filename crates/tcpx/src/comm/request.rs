//! Send and receive requests: tokens for operations in flight. They are tested and consumed
//! through their comm (`SendComm::test`, `RecvComm::test`, `RecvComm::consumed`), which keeps
//! every data-path call on the comm's one thread.
//!
//! Dropping a request never frees memory the plugin may still touch: an unfinished request
//! parks its memory in the comm until the comm closes (and poisons the comm, because FIFO
//! testing cannot skip it); a completed but unconsumed receive is consumed on its turn.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use super::inner::CommInner;
use crate::memory::InFlight;

/// Receives dropped after completion but before being consumed, by sequence number. The flag
/// lets the hot path (every `irecv` and `consumed`) skip the lock when nothing was dropped.
#[derive(Default)]
pub(crate) struct DroppedDone {
    any: AtomicBool,
    map: Mutex<BTreeMap<u64, usize>>,
}

impl DroppedDone {
    fn insert(&self, seq: u64, raw: usize) {
        self.map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(seq, raw);
        self.any.store(true, Ordering::Release);
    }

    /// Removes and returns the request numbered `seq`, if it was dropped.
    pub(crate) fn take(&self, seq: u64) -> Option<usize> {
        if !self.any.load(Ordering::Acquire) {
            return None;
        }
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        let raw = match map.first_key_value() {
            Some((&first, _)) if first == seq => map.pop_first().map(|(_, raw)| raw),
            _ => None,
        };
        if map.is_empty() {
            self.any.store(false, Ordering::Release);
        }
        raw
    }
}

/// The shared part of send and receive requests.
pub(crate) struct RequestCore {
    pub(crate) raw: *mut c_void,
    pub(crate) comm: Arc<CommInner>,
    pub(crate) op: Option<InFlight>,
    pub(crate) len: usize,
    pub(crate) state: RequestState,
}

/// Where a request stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RequestState {
    Pending,
    Done(usize),
    Consumed,
    Failed,
}

impl RequestCore {
    fn abandon_if_pending(&mut self) {
        if self.state == RequestState::Pending {
            self.comm.poisoned.store(true, Ordering::Relaxed);
            if !self.comm.closing.load(Ordering::Relaxed) {
                tracing::warn!(target: "tcpx", comm = %self.comm.label(), "request dropped before completion; comm poisoned");
            }
        }
        if let Some(op) = self.op.take() {
            self.comm
                .abandoned
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(op);
        }
    }
}

/// A send in flight.
pub struct SendRequest {
    pub(crate) state: RequestCore,
}

// SAFETY: the raw request is a token only used through `&mut SendComm` (the comm's thread).
unsafe impl Send for SendRequest {}

impl SendRequest {
    pub(crate) fn new(raw: *mut c_void, comm: Arc<CommInner>, op: InFlight, len: usize) -> Self {
        Self {
            state: RequestCore {
                raw,
                comm,
                op: Some(op),
                len,
                state: RequestState::Pending,
            },
        }
    }

    /// Bytes posted.
    pub fn len(&self) -> usize {
        self.state.len
    }

    /// True for a zero-byte send.
    pub fn is_empty(&self) -> bool {
        self.state.len == 0
    }

    /// True once a test reported completion.
    pub fn is_done(&self) -> bool {
        matches!(self.state.state, RequestState::Done(_))
    }
}

impl Drop for SendRequest {
    fn drop(&mut self) {
        self.state.abandon_if_pending();
    }
}

impl std::fmt::Debug for SendRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendRequest")
            .field("len", &self.state.len)
            .field("state", &self.state.state)
            .finish()
    }
}

/// A receive in flight (or completed and not yet consumed).
pub struct RecvRequest {
    pub(crate) state: RequestCore,
    pub(crate) seq: u64,
    dropped_done: Arc<DroppedDone>,
}

// SAFETY: the raw request is a token only used through `&mut RecvComm` (the comm's thread).
unsafe impl Send for RecvRequest {}

impl RecvRequest {
    pub(crate) fn new(
        raw: *mut c_void,
        comm: Arc<CommInner>,
        op: InFlight,
        len: usize,
        seq: u64,
        dropped_done: Arc<DroppedDone>,
    ) -> Self {
        Self {
            state: RequestCore {
                raw,
                comm,
                op: Some(op),
                len,
                state: RequestState::Pending,
            },
            seq,
            dropped_done,
        }
    }

    /// Capacity posted.
    pub fn len(&self) -> usize {
        self.state.len
    }

    /// True for a zero-byte receive.
    pub fn is_empty(&self) -> bool {
        self.state.len == 0
    }

    /// Bytes received, once a test reported completion.
    pub fn received(&self) -> Option<usize> {
        match self.state.state {
            RequestState::Done(n) => Some(n),
            _ => None,
        }
    }

    /// Position in the comm's posting order (0-based).
    pub fn sequence(&self) -> u64 {
        self.seq
    }
}

impl Drop for RecvRequest {
    fn drop(&mut self) {
        if let RequestState::Done(_) = self.state.state {
            // Completed but never consumed: consume it when its turn comes.
            self.dropped_done.insert(self.seq, self.state.raw as usize);
        }
        self.state.abandon_if_pending();
    }
}

impl std::fmt::Debug for RecvRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecvRequest")
            .field("seq", &self.seq)
            .field("len", &self.state.len)
            .field("state", &self.state.state)
            .finish()
    }
}
