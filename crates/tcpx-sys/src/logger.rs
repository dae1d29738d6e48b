//! The logger a plugin's `init` receives. NCCL's logger is variadic; stable Rust can call such a
//! function but not define one, so a small C shim (`src/logger_shim.c`) formats the message and
//! forwards it to a sink function installed from Rust (the `tcpx` crate routes it to `tracing`).

use std::ffi::{c_char, c_int, c_ulong};

use crate::bindings::ncclDebugLogger_t;

/// The sink that receives formatted plugin log lines.
pub type LogSink = unsafe extern "C" fn(
    level: c_int,
    flags: c_ulong,
    file: *const c_char,
    line: c_int,
    msg: *const c_char,
);

unsafe extern "C" {
    fn tcpx_sys_set_log_sink(sink: Option<LogSink>);
    fn tcpx_sys_log_shim(
        level: c_int,
        flags: c_ulong,
        file: *const c_char,
        line: c_int,
        fmt: *const c_char,
        ...
    );
}

/// The variadic logger to pass to a plugin's `init`.
pub fn shim_logger() -> ncclDebugLogger_t {
    Some(tcpx_sys_log_shim)
}

/// Installs the process-wide sink that formatted messages go to (`None` drops them).
///
/// The sink may be called from any thread the plugin logs from, with `file` possibly NULL.
pub fn set_sink(sink: Option<LogSink>) {
    // SAFETY: the shim stores the pointer atomically; any Rust `LogSink` is a valid C callback.
    unsafe { tcpx_sys_set_log_sink(sink) }
}
