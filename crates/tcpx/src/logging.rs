//! Routes the plugin's logger into `tracing` (target `tcpx::plugin`).

use std::ffi::{c_char, c_int, c_ulong, CStr};

use tcpx_sys::{NCCL_LOG_ABORT, NCCL_LOG_INFO, NCCL_LOG_TRACE, NCCL_LOG_VERSION, NCCL_LOG_WARN};

/// Installs the sink once per process; idempotent.
pub(crate) fn install() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| tcpx_sys::logger::set_sink(Some(sink)));
}

unsafe extern "C" fn sink(
    level: c_int,
    flags: c_ulong,
    file: *const c_char,
    line: c_int,
    msg: *const c_char,
) {
    // A panic must never unwind into the plugin's C frames.
    let _ = std::panic::catch_unwind(|| {
        // SAFETY: the shim passes a NUL-terminated buffer that lives for this call.
        let msg = unsafe { cstr(msg) };
        // SAFETY: NULL or a NUL-terminated string from the plugin (`__FILE__`).
        let file = unsafe { cstr(file) };
        match level {
            NCCL_LOG_WARN | NCCL_LOG_ABORT => {
                tracing::warn!(target: "tcpx::plugin", flags, %file, line, "{msg}")
            }
            NCCL_LOG_INFO | NCCL_LOG_VERSION => {
                tracing::info!(target: "tcpx::plugin", flags, %file, line, "{msg}")
            }
            NCCL_LOG_TRACE => tracing::trace!(target: "tcpx::plugin", flags, %file, line, "{msg}"),
            _ => tracing::debug!(target: "tcpx::plugin", level, flags, %file, line, "{msg}"),
        }
    });
}

/// # Safety
/// `p` is NULL or points at a NUL-terminated string valid for the call.
unsafe fn cstr<'a>(p: *const c_char) -> std::borrow::Cow<'a, str> {
    if p.is_null() {
        return "".into();
    }
    // SAFETY: guaranteed by the caller.
    unsafe { CStr::from_ptr(p) }.to_string_lossy()
}
