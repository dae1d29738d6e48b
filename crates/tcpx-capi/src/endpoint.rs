//! Endpoints: the ABI check, options, create / destroy, metadata, connect and accept.

use std::collections::VecDeque;
use std::ffi::c_char;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tcpx_runtime::control::EndpointMetadata;
use tcpx_runtime::{Backend, Config, Endpoint};

use crate::convert::{bytes, c_str, copy_out, fill_text, millis, non_null, write_out};
use crate::error::{guard, CapiError, CapiResult};
use crate::objects::{
    self, adopt_connection, EndpointObj, CONNECTIONS, ENDPOINTS, LOCALS, REGIONS,
};
use crate::tcpx_status::{self, *};
use crate::{
    tcpx_connection, tcpx_endpoint, tcpx_endpoint_info, tcpx_endpoint_options, tcpx_peer_info,
    TCPX_ABI_VERSION, TCPX_ABI_VERSION_MAJOR, TCPX_ABI_VERSION_MINOR,
};

/// The library's ABI version, `(major << 16) | minor` (compare with the header's
/// `TCPX_ABI_VERSION`). Thread safety: any thread.
#[no_mangle]
pub extern "C" fn tcpx_abi_version() -> u32 {
    TCPX_ABI_VERSION
}

/// Checks that this library can serve a host built against `abi_version` (pass
/// `TCPX_ABI_VERSION`, or use `TCPX_ABI_CHECK()`): the major versions must be equal and the
/// library's minor version at least the host's. Returns `TCPX_ERR_ABI_MISMATCH` with a message
/// naming both versions otherwise; the host must then not call anything else. Calling it is
/// optional but recommended, once, before anything else.
/// Thread safety: any thread, any number of times.
#[no_mangle]
pub extern "C" fn tcpx_init(abi_version: u32) -> tcpx_status {
    guard("tcpx_init", || {
        let (major, minor) = (abi_version >> 16, abi_version & 0xffff);
        if major != TCPX_ABI_VERSION_MAJOR || minor > TCPX_ABI_VERSION_MINOR {
            return Err(CapiError::new(
                TCPX_ERR_ABI_MISMATCH,
                format!(
                    "the host was built against tcpx.h ABI {major}.{minor} and this libtcpx \
                     implements ABI {TCPX_ABI_VERSION_MAJOR}.{TCPX_ABI_VERSION_MINOR}: rebuild the \
                     host against this library's header, or load the library it was built for"
                ),
            ));
        }
        Ok(TCPX_OK)
    })
}

/// Options with every field unset (what `tcpx_endpoint_options_init` writes).
const UNSET_OPTIONS: tcpx_endpoint_options = tcpx_endpoint_options {
    struct_size: std::mem::size_of::<tcpx_endpoint_options>() as u32,
    channels: 0,
    chunk_bytes: 0,
    window: 0,
    timeout_ms: 0,
    backend: std::ptr::null(),
    control_addr: std::ptr::null(),
    gpu_pci: std::ptr::null(),
    gpu_index: -1,
    pin_engines: -1,
    require_secret: -1,
    eager_bytes: -1,
};

/// `sizeof(tcpx_endpoint_options)` in hosts built against ABI minor 5 or older: the struct
/// ended with `require_secret` (padded to 8 bytes), where `eager_bytes` now starts.
const OPTIONS_BYTES_MINOR_5: usize = std::mem::offset_of!(tcpx_endpoint_options, eager_bytes);

/// Fills `options` with "unset" in every field (so the environment or the defaults apply) and
/// its `struct_size`. Call it before setting fields. Thread safety: any thread.
///
/// # Safety
/// `options` is NULL or points to writable memory for a `tcpx_endpoint_options`.
#[no_mangle]
pub unsafe extern "C" fn tcpx_endpoint_options_init(
    options: *mut tcpx_endpoint_options,
) -> tcpx_status {
    guard("tcpx_endpoint_options_init", || {
        non_null(options, "options")?;
        let unset = UNSET_OPTIONS;
        // SAFETY: non-null (checked); writable (the caller's promise).
        unsafe { write_out(options, unset) };
        Ok(TCPX_OK)
    })
}

/// The environment's configuration with `options` applied on top.
///
/// # Safety
/// `options` is NULL or points to a `tcpx_endpoint_options` whose string fields are NULL or
/// NUL-terminated.
unsafe fn config_from(options: *const tcpx_endpoint_options) -> CapiResult<Config> {
    let mut config = Config::from_env()?;
    if options.is_null() {
        return Ok(config);
    }
    // SAFETY: non-null; the first field is read alone so that a wrong size is caught before
    // the whole struct is read.
    let size = unsafe { std::ptr::addr_of!((*options).struct_size).read() } as usize;
    if size != std::mem::size_of::<tcpx_endpoint_options>() && size != OPTIONS_BYTES_MINOR_5 {
        return Err(CapiError::invalid(format!(
            "options->struct_size is {size}, this library's tcpx_endpoint_options has {} bytes \
             (or {OPTIONS_BYTES_MINOR_5} from a host built against ABI minor 5 or older): fill \
             the struct with tcpx_endpoint_options_init() (and build against this library's \
             header)",
            std::mem::size_of::<tcpx_endpoint_options>()
        )));
    }
    // What the host did not pass (an older header's struct ends before the appended fields)
    // reads as unset.
    let mut o = UNSET_OPTIONS;
    // SAFETY: `options` is non-null and the host's struct holds `size` initialized bytes
    // (checked against the two layouts this library knows); `o` is a local of at least that
    // size; the two do not overlap. Every field is plain data whose every bit pattern is
    // valid (integers and raw pointers), so overwriting a prefix leaves `o` valid.
    unsafe {
        std::ptr::copy_nonoverlapping(
            options.cast::<u8>(),
            std::ptr::addr_of_mut!(o).cast::<u8>(),
            size,
        )
    };
    if o.channels != 0 {
        config.channels = u16::try_from(o.channels).map_err(|_| {
            CapiError::new(
                TCPX_ERR_CONFIG,
                format!("options->channels {} is too large", o.channels),
            )
        })?;
    }
    if o.chunk_bytes != 0 {
        config.chunk_bytes = o.chunk_bytes;
    }
    if o.window != 0 {
        config.window = o.window as usize;
    }
    if o.timeout_ms != 0 {
        config.timeout = Duration::from_millis(o.timeout_ms);
    }
    if !o.backend.is_null() {
        // SAFETY: non-null, NUL-terminated (the caller's promise).
        config.backend = match unsafe { c_str(o.backend, "options->backend") }? {
            "auto" => Backend::Auto,
            "builtin" => Backend::Builtin,
            path => Backend::Path(PathBuf::from(path)),
        };
    }
    if !o.control_addr.is_null() {
        // SAFETY: `control_addr` is non-null (checked just above) and NUL-terminated, valid for
        // this call (the caller's promise for every string in the options).
        let text = unsafe { c_str(o.control_addr, "options->control_addr") }?;
        config.control_addr = text.parse().map_err(|_| {
            CapiError::new(
                TCPX_ERR_CONFIG,
                format!("options->control_addr {text:?}: expected ip:port (127.0.0.1:7400)"),
            )
        })?;
    }
    if !o.gpu_pci.is_null() {
        // SAFETY: `gpu_pci` is non-null (checked just above) and NUL-terminated, valid for this
        // call (the caller's promise for every string in the options); it is copied out.
        config.gpu_pci = Some(unsafe { c_str(o.gpu_pci, "options->gpu_pci") }?.to_owned());
    }
    match o.gpu_index {
        -1 => {}
        i if i < -1 => {
            return Err(CapiError::new(
                TCPX_ERR_CONFIG,
                format!("options->gpu_index {i}: expected -1 (unset) or a GPU index"),
            ))
        }
        i => config.gpu_index = Some(i as u32),
    }
    match o.pin_engines {
        -1 => {}
        0 => config.pin_engines = false,
        1 => config.pin_engines = true,
        v => {
            return Err(CapiError::new(
                TCPX_ERR_CONFIG,
                format!("options->pin_engines {v}: expected -1 (unset), 0 or 1"),
            ))
        }
    }
    match o.require_secret {
        -1 => {}
        0 => config.require_secret = false,
        1 => config.require_secret = true,
        v => {
            return Err(CapiError::new(
                TCPX_ERR_CONFIG,
                format!("options->require_secret {v}: expected -1 (unset), 0 or 1"),
            ))
        }
    }
    const EAGER_MAX: i64 = tcpx_runtime::EAGER_MAX_MESSAGE as i64;
    match o.eager_bytes {
        -1 => {}
        // In range, so it fits a u32.
        bytes @ 0..=EAGER_MAX => config.eager_bytes = Some(bytes as u32),
        v => {
            return Err(CapiError::new(
                TCPX_ERR_CONFIG,
                format!(
                    "options->eager_bytes {v}: expected -1 (unset), 0 (off) or a size of at \
                     most {}",
                    tcpx_runtime::EAGER_MAX_MESSAGE
                ),
            ))
        }
    }
    config.validate()?;
    Ok(config)
}

/// The GPU index an endpoint announces, or -1.
fn gpu_index_of(endpoint: &Endpoint) -> i32 {
    endpoint.gpu_index().map_or(-1, |i| i as i32)
}

/// Creates an endpoint: loads the plugin, starts the progress engines and binds the control
/// listener. `options` may be NULL (everything from the environment and the defaults).
/// On success `*endpoint` is the new handle; destroy it with `tcpx_endpoint_destroy`.
/// Thread safety: any thread; endpoints are independent.
///
/// # Safety
/// `options` is NULL or an initialized `tcpx_endpoint_options` (see
/// `tcpx_endpoint_options_init`); `endpoint` points to writable memory for a handle.
#[no_mangle]
pub unsafe extern "C" fn tcpx_endpoint_create(
    options: *const tcpx_endpoint_options,
    endpoint: *mut tcpx_endpoint,
) -> tcpx_status {
    guard("tcpx_endpoint_create", || {
        non_null(endpoint, "endpoint (output)")?;
        // SAFETY: the caller's promise on `options`.
        let config = unsafe { config_from(options) }?;
        let created = Endpoint::new(config)?;
        let id = ENDPOINTS.insert(Arc::new(EndpointObj {
            endpoint: created,
            notifications: Mutex::new(VecDeque::new()),
            published: Mutex::new(Vec::new()),
        }));
        // SAFETY: non-null (checked); writable (the caller's promise).
        unsafe { write_out(endpoint, tcpx_endpoint { id }) };
        Ok(TCPX_OK)
    })
}

/// Destroys an endpoint and everything made from it: its connections (network and
/// same-host) are closed at once
/// (their pending transfers fail with `TCPX_ERR_CLOSED`, and once this returns no plugin or
/// engine touches their memory any more), its regions are released and their descriptors
/// revoked, and their handles become stale. Transfer handles stay valid (they report the
/// failure) until released. Never blocks longer than the connections' timeout (each engine
/// is given that long to let go). An accept blocked in another thread on this endpoint
/// (network or same-host) returns `TCPX_ERR_CLOSED` at once, as after
/// `tcpx_endpoint_stop_accepting`.
/// Thread safety: any thread; calls on the endpoint's objects racing with it fail with
/// `TCPX_ERR_STALE_HANDLE` or `TCPX_ERR_CLOSED`, never touch freed memory.
#[no_mangle]
pub extern "C" fn tcpx_endpoint_destroy(endpoint: tcpx_endpoint) -> tcpx_status {
    guard("tcpx_endpoint_destroy", || {
        let obj = ENDPOINTS.remove(endpoint.id)?;
        // Accepts blocked in other threads hold the endpoint: let them go first.
        obj.endpoint.stop_accepting();
        for conn in CONNECTIONS.remove_where(|c| c.endpoint == endpoint.id) {
            conn.shut_down();
        }
        for conn in LOCALS.remove_where(|c| c.endpoint == endpoint.id) {
            conn.shut_down();
        }
        let regions = REGIONS.remove_where(|r| r.endpoint == endpoint.id);
        for region in &regions {
            region.revoke_on(&obj.endpoint);
        }
        drop(regions);
        drop(obj);
        Ok(TCPX_OK)
    })
}

/// Ends every accept on `endpoint`, network and same-host: accepts blocked in other threads
/// return `TCPX_ERR_CLOSED` at once, and so does every later one. For teardown: a host whose
/// threads accept in a loop with a short timeout joins them without waiting for the running
/// one to time out. Connections already made and connects are not affected. Idempotent.
/// Thread safety: any thread.
#[no_mangle]
pub extern "C" fn tcpx_endpoint_stop_accepting(endpoint: tcpx_endpoint) -> tcpx_status {
    guard("tcpx_endpoint_stop_accepting", || {
        objects::endpoint(endpoint)?.endpoint.stop_accepting();
        Ok(TCPX_OK)
    })
}

/// Fills `*info` with the endpoint's control address, plugin, channels, chunk size, timeout and
/// GPU index. Thread safety: any thread.
///
/// # Safety
/// `info` points to writable memory for a `tcpx_endpoint_info`.
#[no_mangle]
pub unsafe extern "C" fn tcpx_endpoint_get_info(
    endpoint: tcpx_endpoint,
    info: *mut tcpx_endpoint_info,
) -> tcpx_status {
    guard("tcpx_endpoint_get_info", || {
        non_null(info, "info")?;
        let obj = objects::endpoint(endpoint)?;
        let ep = &obj.endpoint;
        let config = ep.config();
        let mut out = tcpx_endpoint_info {
            control_addr: [0; crate::TCPX_ADDRESS_MAX],
            plugin: [0; crate::TCPX_NAME_MAX],
            channels: u32::from(config.channels),
            chunk_bytes: config.chunk_bytes,
            timeout_ms: u64::try_from(config.timeout.as_millis()).unwrap_or(u64::MAX),
            gpu_index: gpu_index_of(ep),
        };
        fill_text(
            &mut out.control_addr,
            &ep.metadata().control_addr.to_string(),
        );
        fill_text(&mut out.plugin, &ep.backend().name);
        // SAFETY: non-null (checked); writable (the caller's promise).
        unsafe { write_out(info, out) };
        Ok(TCPX_OK)
    })
}

/// Copies the endpoint's metadata (what a peer passes to `tcpx_endpoint_connect`; at most
/// `TCPX_METADATA_MAX_BYTES`) into `buf`. `*len` is the buffer's capacity on entry and the
/// metadata's length on return; when the buffer is too small (or `buf` is NULL) nothing is
/// copied and `TCPX_ERR_BUFFER_TOO_SMALL` is returned with `*len` set to the size needed.
/// Thread safety: any thread.
///
/// # Safety
/// `len` points to a readable and writable `size_t`; `buf` is NULL or points to `*len` writable
/// bytes.
#[no_mangle]
pub unsafe extern "C" fn tcpx_endpoint_metadata(
    endpoint: tcpx_endpoint,
    buf: *mut u8,
    len: *mut usize,
) -> tcpx_status {
    guard("tcpx_endpoint_metadata", || {
        non_null(len, "len")?;
        let obj = objects::endpoint(endpoint)?;
        let blob =
            obj.endpoint.metadata().to_bytes().map_err(|e| {
                CapiError::new(TCPX_ERR_INTERNAL, format!("encoding metadata: {e}"))
            })?;
        // SAFETY: `len` checked non-null; the rest is the caller's promise.
        unsafe { copy_out(&blob, buf, len, "metadata")? };
        Ok(TCPX_OK)
    })
}

/// Connects to the endpoint whose metadata (from its `tcpx_endpoint_metadata`) is
/// `metadata[0..len)`, waiting at most the configured timeout. `*connection` is the new handle.
/// Thread safety: any thread; several connects and accepts may run at once on one endpoint.
///
/// # Safety
/// `metadata` points to `len` readable bytes; `connection` to writable memory for a handle.
#[no_mangle]
pub unsafe extern "C" fn tcpx_endpoint_connect(
    endpoint: tcpx_endpoint,
    metadata: *const u8,
    len: usize,
    connection: *mut tcpx_connection,
) -> tcpx_status {
    guard("tcpx_endpoint_connect", || {
        non_null(metadata, "metadata")?;
        non_null(connection, "connection (output)")?;
        let obj = objects::endpoint(endpoint)?;
        // SAFETY: non-null (checked), `len` readable bytes (the caller's promise).
        let blob = unsafe { bytes(metadata, len, "metadata") }?;
        let peer = EndpointMetadata::from_bytes(blob)
            .map_err(|e| CapiError::invalid(format!("peer metadata ({len} bytes): {e}")))?;
        let conn = obj.endpoint.connect(&peer)?;
        let handle = adopt_connection(endpoint.id, conn)?;
        // SAFETY: non-null (checked); writable (the caller's promise).
        unsafe { write_out(connection, handle) };
        Ok(TCPX_OK)
    })
}

/// Connects to the endpoint listening at control address `address` (`"ip:port"`, as in the
/// peer's `tcpx_endpoint_info.control_addr`), waiting at most the configured timeout. Peers
/// created with `require_secret` refuse it (`TCPX_ERR_INCOMPATIBLE`); use
/// `tcpx_endpoint_connect` with their metadata instead.
/// Thread safety: as `tcpx_endpoint_connect`.
///
/// # Safety
/// `address` is a NUL-terminated string; `connection` points to writable memory for a handle.
#[no_mangle]
pub unsafe extern "C" fn tcpx_endpoint_connect_addr(
    endpoint: tcpx_endpoint,
    address: *const c_char,
    connection: *mut tcpx_connection,
) -> tcpx_status {
    guard("tcpx_endpoint_connect_addr", || {
        non_null(connection, "connection (output)")?;
        // SAFETY: NUL-terminated when non-null (the caller's promise; null is checked).
        let text = unsafe { c_str(address, "address") }?;
        let addr: SocketAddr = text.parse().map_err(|_| {
            CapiError::invalid(format!(
                "address {text:?}: expected ip:port (127.0.0.1:7400)"
            ))
        })?;
        let obj = objects::endpoint(endpoint)?;
        let conn = obj.endpoint.connect_addr(addr)?;
        let handle = adopt_connection(endpoint.id, conn)?;
        // SAFETY: non-null (checked); writable (the caller's promise).
        unsafe { write_out(connection, handle) };
        Ok(TCPX_OK)
    })
}

/// Waits at most `timeout_ms` for a peer to connect, then sets the connection up (within the
/// configured timeout). `*connection` is the new handle; `peer`, if not NULL, receives the
/// peer's control address and announced GPU index. `TCPX_ERR_TIMEOUT` when nobody came.
/// Thread safety: any thread; concurrent accepts each take a different peer.
///
/// # Safety
/// `connection` points to writable memory for a handle; `peer` is NULL or points to writable
/// memory for a `tcpx_peer_info`.
#[no_mangle]
pub unsafe extern "C" fn tcpx_endpoint_accept(
    endpoint: tcpx_endpoint,
    timeout_ms: u32,
    connection: *mut tcpx_connection,
    peer: *mut tcpx_peer_info,
) -> tcpx_status {
    guard("tcpx_endpoint_accept", || {
        non_null(connection, "connection (output)")?;
        let obj = objects::endpoint(endpoint)?;
        let conn = obj.endpoint.accept_timeout(millis(timeout_ms))?;
        let info = objects::peer_info(&conn);
        let handle = adopt_connection(endpoint.id, conn)?;
        if !peer.is_null() {
            // SAFETY: non-null (checked); writable (the caller's promise).
            unsafe { write_out(peer, info) };
        }
        // SAFETY: non-null (checked); writable (the caller's promise).
        unsafe { write_out(connection, handle) };
        Ok(TCPX_OK)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_of_older_hosts_are_taken_and_their_missing_fields_read_as_unset() {
        // The layout of ABI minor 5 ended with `require_secret` padded to 8 bytes.
        assert_eq!(OPTIONS_BYTES_MINOR_5, 64);
        assert_eq!(std::mem::size_of::<tcpx_endpoint_options>(), 72);
        let mut older = UNSET_OPTIONS;
        older.struct_size = OPTIONS_BYTES_MINOR_5 as u32;
        older.channels = 3;
        // Beyond the older host's struct: must not be read.
        older.eager_bytes = 1 << 40;
        // SAFETY: a live, initialized options struct without strings.
        let config = unsafe { config_from(&older) }.expect("an older host's options");
        assert_eq!(config.channels, 3);
        assert_eq!(config.eager_bytes, Config::from_env().unwrap().eager_bytes);

        let mut current = UNSET_OPTIONS;
        current.eager_bytes = 0;
        // SAFETY: as above.
        let config = unsafe { config_from(&current) }.expect("eager off");
        assert_eq!((config.eager_bytes, config.eager_limit()), (Some(0), 0));
        current.eager_bytes = 4096;
        // SAFETY: as above.
        let config = unsafe { config_from(&current) }.expect("4 KiB");
        assert_eq!(config.eager_limit(), 4096);
        for bad in [-2, 1 << 20, 1 << 40] {
            current.eager_bytes = bad;
            // SAFETY: as above.
            let e = unsafe { config_from(&current) }.expect_err("out of range");
            assert_eq!(e.status, TCPX_ERR_CONFIG, "{bad}: {}", e.message);
        }
        current.eager_bytes = -1;
        current.struct_size = 68;
        // SAFETY: as above.
        let e = unsafe { config_from(&current) }.expect_err("an unknown size");
        assert!(e.message.contains("struct_size"), "{}", e.message);
    }
}
