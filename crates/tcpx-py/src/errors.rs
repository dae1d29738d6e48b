//! The one place where failures become Python exceptions.
//!
//! Every failure of the bindings is a [`Failure`]: a runtime error passed through, or a check
//! of the bindings' own (unknown id, pointer outside its registration, malformed blob). Its
//! [`Kind`] picks the exception class; the classes live in `tcpx/_errors.py` so that each can
//! also derive from the matching builtin (`PeerLost` is a `ConnectionError`, `BadArgument` a
//! `ValueError`…), and are looked up once.

use std::cell::RefCell;

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

/// What kind of failure: decides the exception class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A transfer or a wait ran out of time.
    Timeout,
    /// The peer closed the connection or went away.
    PeerLost,
    /// The peer refused a one-sided operation (bad key, revoked, out of bounds).
    AccessRefused,
    /// The caller passed something unusable.
    BadArgument,
    /// The memory (or operation) is not supported by this plugin / machine.
    Unsupported,
    /// The endpoint or connection was closed by this side.
    Closed,
    /// Anything else (plugin failure, configuration, internal).
    Other,
}

/// A failure of a bindings call, with the message shown to the user.
#[derive(Debug, Clone)]
pub struct Failure {
    /// Which exception class.
    pub kind: Kind,
    /// What failed and where.
    pub message: String,
}

impl Failure {
    /// A failure of `kind` with `message`.
    pub fn new(kind: Kind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    /// A bad argument.
    pub fn bad(message: impl Into<String>) -> Self {
        Self::new(Kind::BadArgument, message)
    }
}

impl From<tcpx_runtime::Error> for Failure {
    fn from(e: tcpx_runtime::Error) -> Self {
        use tcpx_runtime::{Error as E, LocalErrorKind};
        let kind = match &e {
            _ if e.is_timeout() => Kind::Timeout,
            E::PeerClosed { .. }
            | E::Violation { .. }
            | E::Control(_)
            | E::Setup { .. }
            | E::Mismatch { .. } => Kind::PeerLost,
            // The plugin's word for "the other side went away" (connection reset, closed).
            E::Plugin { .. } if e.plugin_code() == Some(tcpx::ResultCode::REMOTE_ERROR) => {
                Kind::PeerLost
            }
            E::Access { .. } => Kind::AccessRefused,
            E::Local { kind, .. } => match kind {
                LocalErrorKind::Access => Kind::AccessRefused,
                LocalErrorKind::PeerClosed | LocalErrorKind::Protocol => Kind::PeerLost,
                LocalErrorKind::Closed => Kind::Closed,
                LocalErrorKind::Timeout => Kind::Timeout,
                // No peer at the rendezvous name (never started, or gone).
                LocalErrorKind::Rendezvous => Kind::PeerLost,
                LocalErrorKind::Cuda => Kind::Other,
            },
            E::InvalidArgument(_) | E::Config(_) => Kind::BadArgument,
            E::Unsupported(_) => Kind::Unsupported,
            E::Closed { .. } | E::AcceptStopped { .. } => Kind::Closed,
            _ => Kind::Other,
        };
        Self::new(kind, e.to_string())
    }
}

/// Result of a bindings call.
pub type Outcome<T> = Result<T, Failure>;

static CLASSES: [PyOnceLock<Py<PyType>>; 7] = [
    PyOnceLock::new(),
    PyOnceLock::new(),
    PyOnceLock::new(),
    PyOnceLock::new(),
    PyOnceLock::new(),
    PyOnceLock::new(),
    PyOnceLock::new(),
];

fn class_name(kind: Kind) -> (usize, &'static str) {
    match kind {
        Kind::Timeout => (0, "TransferTimeout"),
        Kind::PeerLost => (1, "PeerLost"),
        Kind::AccessRefused => (2, "AccessRefused"),
        Kind::BadArgument => (3, "BadArgument"),
        Kind::Unsupported => (4, "UnsupportedMemory"),
        Kind::Closed => (5, "Closed"),
        Kind::Other => (6, "Error"),
    }
}

impl Failure {
    /// The Python exception for this failure.
    pub fn into_py(self, py: Python<'_>) -> PyErr {
        let (slot, name) = class_name(self.kind);
        match CLASSES[slot].import(py, "tcpx._errors", name) {
            Ok(class) => PyErr::from_type(class.clone(), self.message),
            Err(e) => e,
        }
    }
}

/// Converts an outcome into a Python result (the exception path of the Pythonic layer).
pub fn raise<T>(py: Python<'_>, outcome: Outcome<T>) -> PyResult<T> {
    outcome.map_err(|f| f.into_py(py))
}

thread_local! {
    /// The last failure on this thread of a call that reports through an `ok` flag
    /// (`tcpx.p2p`), for `tcpx.p2p.last_error()`.
    static LAST: RefCell<Option<Failure>> = const { RefCell::new(None) };
}

/// Records `failure` as this thread's last error (the `ok = False` path of `tcpx.p2p`).
pub fn remember(failure: Failure) {
    LAST.with(|l| *l.borrow_mut() = Some(failure));
}

/// This thread's last error from an `ok`-flag call, as (class name, message).
pub fn last() -> Option<(&'static str, String)> {
    LAST.with(|l| {
        l.borrow()
            .as_ref()
            .map(|f| (class_name(f.kind).1, f.message.clone()))
    })
}
