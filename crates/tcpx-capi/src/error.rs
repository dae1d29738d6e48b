//! Status codes, the thread-local last error, and [`guard`]: the wrapper every exported
//! function runs its body in (panics caught, failures recorded).

use std::cell::RefCell;
use std::ffi::{c_char, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use tcpx_runtime::control::{ControlError, ErrorCode};
use tcpx_runtime::{Error, LocalErrorKind};

use crate::tcpx_status::{self, *};

/// A failure on its way to C: the status and what to say about it.
#[derive(Debug)]
pub(crate) struct CapiError {
    pub(crate) status: tcpx_status,
    pub(crate) message: String,
}

impl CapiError {
    pub(crate) fn new(status: tcpx_status, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    pub(crate) fn null(what: &str) -> Self {
        Self::new(TCPX_ERR_NULL_POINTER, format!("{what} is NULL"))
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Self::new(TCPX_ERR_INVALID_ARGUMENT, message)
    }
}

impl From<Error> for CapiError {
    fn from(e: Error) -> Self {
        Self::new(status_of(&e), e.to_string())
    }
}

/// The status a runtime error maps to (one place, so every call reports alike).
pub(crate) fn status_of(e: &Error) -> tcpx_status {
    match e {
        Error::Config(_) => TCPX_ERR_CONFIG,
        Error::InvalidArgument(_) => TCPX_ERR_INVALID_ARGUMENT,
        Error::Backend { .. } => TCPX_ERR_BACKEND,
        Error::Plugin { .. } | Error::Staging { .. } | Error::Setup { .. } => TCPX_ERR_PLUGIN,
        Error::Unsupported(_) => TCPX_ERR_UNSUPPORTED,
        Error::Control(c) => match &**c {
            ControlError::Connect { .. } | ControlError::Accept { .. } => TCPX_ERR_CONNECT,
            ControlError::AcceptTimeout { .. } | ControlError::Timeout { .. } => TCPX_ERR_TIMEOUT,
            ControlError::Io { .. }
            | ControlError::Closed { .. }
            | ControlError::ClosedByPeer { .. }
            | ControlError::Broken { .. } => TCPX_ERR_PEER_CLOSED,
            ControlError::Protocol { .. }
            | ControlError::Malformed { .. }
            | ControlError::Encode { .. }
            | ControlError::Unexpected { .. } => TCPX_ERR_PROTOCOL,
            // The peer refused the set-up: it names why (a missing secret, a setting that
            // differs) in the message.
            ControlError::Remote { code, .. } if *code == ErrorCode::INCOMPATIBLE => {
                TCPX_ERR_INCOMPATIBLE
            }
            ControlError::Remote { .. } => TCPX_ERR_PROTOCOL,
        },
        Error::Incompatible { .. } => TCPX_ERR_INCOMPATIBLE,
        Error::Timeout { .. } => TCPX_ERR_TIMEOUT,
        Error::WaitTimedOut(_) => TCPX_PENDING,
        Error::PeerClosed { .. } => TCPX_ERR_PEER_CLOSED,
        Error::Mismatch { .. } | Error::Violation { .. } => TCPX_ERR_PROTOCOL,
        Error::Closed { .. } | Error::AcceptStopped { .. } => TCPX_ERR_CLOSED,
        Error::Access { .. } => TCPX_ERR_ACCESS,
        Error::Rendezvous {
            timed_out: true, ..
        } => TCPX_ERR_TIMEOUT,
        Error::Rendezvous { .. } => TCPX_ERR_CONNECT,
        Error::Internal(_) => TCPX_ERR_INTERNAL,
        Error::Local { kind, .. } => match kind {
            LocalErrorKind::Rendezvous => TCPX_ERR_CONNECT,
            LocalErrorKind::PeerClosed => TCPX_ERR_PEER_CLOSED,
            LocalErrorKind::Access => TCPX_ERR_ACCESS,
            LocalErrorKind::Cuda => TCPX_ERR_PLUGIN,
            LocalErrorKind::Timeout => TCPX_ERR_TIMEOUT,
            LocalErrorKind::Closed => TCPX_ERR_CLOSED,
            LocalErrorKind::Protocol => TCPX_ERR_PROTOCOL,
        },
    }
}

pub(crate) type CapiResult<T> = Result<T, CapiError>;

thread_local! {
    /// The message of this thread's last failed call (NUL-terminated for C).
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(api: &str, message: &str) {
    // Interior NULs cannot be in a C string; plugin or peer text could carry one.
    let text = format!("{api}: {message}").replace('\0', "\\0");
    let text = CString::new(text).unwrap_or_default();
    // `try_with`: during thread teardown the slot may be gone; the status still tells.
    let _ = LAST_ERROR.try_with(|slot| *slot.borrow_mut() = text);
}

/// Runs an exported function's body: a panic becomes `TCPX_ERR_PANIC`, an error its status;
/// both leave a message naming `api` in [`tcpx_last_error`]. `TCPX_PENDING` results are not
/// failures and leave the message alone.
pub(crate) fn guard(
    api: &'static str,
    body: impl FnOnce() -> CapiResult<tcpx_status>,
) -> tcpx_status {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(status)) => status,
        Ok(Err(e)) => {
            set_last_error(api, &e.message);
            e.status
        }
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic with no message".into());
            set_last_error(api, &format!("internal error (please report): {what}"));
            TCPX_ERR_PANIC
        }
    }
}

/// The message of the last call on this thread that failed (returned neither `TCPX_OK` nor
/// `TCPX_PENDING`): the function's name, then what failed and where (peer, channel, value).
/// An empty string when none failed yet.
///
/// Never NULL. The text belongs to the library and stays valid until the next failing call
/// on this thread (copy it to keep it). Thread safety: each thread has its own message.
#[no_mangle]
pub extern "C" fn tcpx_last_error() -> *const c_char {
    let ptr = catch_unwind(|| {
        LAST_ERROR
            .try_with(|slot| slot.borrow().as_ptr())
            .unwrap_or(EMPTY.as_ptr())
    });
    ptr.unwrap_or(EMPTY.as_ptr())
}

const EMPTY: &CStr = c"";

/// A short static name for `status` (`"TCPX_ERR_TIMEOUT"`); `"TCPX_UNKNOWN_STATUS"` for values
/// this library does not define. Never NULL, never freed. Thread safety: any thread.
#[no_mangle]
pub extern "C" fn tcpx_status_str(status: i32) -> *const c_char {
    let name: &CStr = match status {
        0 => c"TCPX_OK",
        1 => c"TCPX_PENDING",
        2 => c"TCPX_ERR_NULL_POINTER",
        3 => c"TCPX_ERR_STALE_HANDLE",
        4 => c"TCPX_ERR_INVALID_ARGUMENT",
        5 => c"TCPX_ERR_BUFFER_TOO_SMALL",
        6 => c"TCPX_ERR_CONFIG",
        7 => c"TCPX_ERR_UNSUPPORTED",
        8 => c"TCPX_ERR_BACKEND",
        9 => c"TCPX_ERR_CONNECT",
        10 => c"TCPX_ERR_TIMEOUT",
        11 => c"TCPX_ERR_PEER_CLOSED",
        12 => c"TCPX_ERR_CLOSED",
        13 => c"TCPX_ERR_ACCESS",
        14 => c"TCPX_ERR_INCOMPATIBLE",
        15 => c"TCPX_ERR_PROTOCOL",
        16 => c"TCPX_ERR_PLUGIN",
        17 => c"TCPX_ERR_BUSY",
        18 => c"TCPX_ERR_ABI_MISMATCH",
        19 => c"TCPX_ERR_PANIC",
        20 => c"TCPX_ERR_INTERNAL",
        _ => c"TCPX_UNKNOWN_STATUS",
    };
    name.as_ptr()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_status_has_its_own_name() {
        for code in 0..=20 {
            // SAFETY: tcpx_status_str returns a static NUL-terminated string.
            let name = unsafe { CStr::from_ptr(tcpx_status_str(code)) };
            assert!(name.to_str().unwrap().starts_with("TCPX_"));
            assert_ne!(name, c"TCPX_UNKNOWN_STATUS", "code {code}");
        }
    }
}
