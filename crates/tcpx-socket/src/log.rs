//! Logging through the logger NCCL hands to `init`.
//!
//! NCCL's logger is variadic and printf-style. We never pass caller-controlled text as the
//! format: every message is formatted in Rust and handed over as `"%s", message`, so a `%` in an
//! interface name or a peer address cannot be misread as a conversion.

use std::ffi::{c_char, c_int, c_ulong, CString};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use tcpx_sys::{
    ncclDebugLogger_t, NCCL_LOG_FLAG_NET, NCCL_LOG_INFO, NCCL_LOG_TRACE, NCCL_LOG_WARN,
};

/// The variadic logger type NCCL passes (the payload of `ncclDebugLogger_t`).
type LoggerFn = unsafe extern "C" fn(c_int, c_ulong, *const c_char, c_int, *const c_char, ...);

/// The installed logger as an address (0 = none). An atomic rather than a lock: logging happens
/// on error paths of the data path, which must not take a global lock.
static LOGGER: AtomicUsize = AtomicUsize::new(0);

/// Severity of a log line, with NCCL's numeric levels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Level {
    /// `NCCL_LOG_WARN` (2): something failed or a peer misbehaved.
    Warn,
    /// `NCCL_LOG_INFO` (3): configuration and connection events.
    Info,
    /// `NCCL_LOG_TRACE` (5): per-call detail.
    Trace,
}

impl Level {
    fn code(self) -> c_int {
        match self {
            Level::Warn => NCCL_LOG_WARN,
            Level::Info => NCCL_LOG_INFO,
            Level::Trace => NCCL_LOG_TRACE,
        }
    }
}

/// Installs (or replaces) the logger; `None` keeps the previous one, because a second `init`
/// with a NULL logger should not silence a plugin that an earlier caller configured.
pub(crate) fn set_logger(logger: ncclDebugLogger_t) {
    if let Some(f) = logger {
        LOGGER.store(f as usize, Ordering::Release);
    }
}

/// Whether TRACE lines are wanted: `NCCL_DEBUG=TRACE`, NCCL's own switch for them (read
/// once). Checked before a TRACE line is formatted: `regMr` traces every registration, and
/// formatting a line nobody reads cost an allocation per call on the data path.
pub(crate) fn trace_enabled() -> bool {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    *ENABLED.get_or_init(|| {
        std::env::var("NCCL_DEBUG").is_ok_and(|v| v.trim().eq_ignore_ascii_case("TRACE"))
    })
}

/// Emits one line. Without a logger, warnings go to stderr (a plugin used before `init`, or by
/// a caller that passed NULL, should still explain its errors); other levels are dropped.
pub(crate) fn log(level: Level, line: u32, msg: &str) {
    let addr = LOGGER.load(Ordering::Acquire);
    if addr == 0 {
        if level == Level::Warn {
            eprintln!("tcpx-socket WARN: {msg}");
        }
        return;
    }
    // Interior NULs would truncate the message; replace them rather than drop the line.
    let text = CString::new(msg.replace('\0', "\\0")).unwrap_or_default();
    // SAFETY: `addr` was stored from a non-NULL `LoggerFn` by `set_logger`, and function
    // pointers round-trip through usize on every platform Rust supports.
    let f: LoggerFn = unsafe { std::mem::transmute::<usize, LoggerFn>(addr) };
    // SAFETY: the logger contract is printf-style; "%s" consumes exactly one C string, which
    // `text` provides and keeps alive for the call. `file` is a static NUL-terminated string.
    unsafe {
        f(
            level.code(),
            NCCL_LOG_FLAG_NET as c_ulong,
            c"tcpx-socket".as_ptr(),
            c_int::try_from(line).unwrap_or(0),
            c"%s".as_ptr(),
            text.as_ptr(),
        );
    }
}

/// `log_warn!(fmt, args…)`: a WARN line through the installed logger.
macro_rules! log_warn {
    ($($arg:tt)*) => { $crate::log::log($crate::log::Level::Warn, line!(), &format!($($arg)*)) };
}
/// `log_info!(fmt, args…)`: an INFO line through the installed logger.
macro_rules! log_info {
    ($($arg:tt)*) => { $crate::log::log($crate::log::Level::Info, line!(), &format!($($arg)*)) };
}
/// `log_trace!(fmt, args…)`: a TRACE line through the installed logger, formatted only when
/// [`trace_enabled`].
#[allow(unused_macros)]
macro_rules! log_trace {
    ($($arg:tt)*) => {
        if $crate::log::trace_enabled() {
            $crate::log::log($crate::log::Level::Trace, line!(), &format!($($arg)*))
        }
    };
}
pub(crate) use {log_info, log_trace, log_warn};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::object::tests::Counted;
    use std::cell::Cell;

    #[test]
    fn trace_lines_are_formatted_only_when_nccl_debug_asks_for_them() {
        let formatted = Cell::new(0);
        log_trace!("tcpx-socket: {}", Counted(&formatted));
        let expected = u32::from(trace_enabled());
        assert_eq!(formatted.get(), expected);
    }
}
