//! Same-host endpoints (CUDA IPC, no network): local info and the route decision, the
//! local rendezvous (accept / connect), IPC advertisement and revocation, and one-sided
//! write / read of a local peer's GPU memory. Transfers are ordinary `tcpx_transfer`s.

use std::ffi::c_char;

use tcpx_runtime::ipc::{IpcDescriptor, IpcSegment, LocalAddr, LocalInfo, LocalPeer};
use tcpx_runtime::LocalRoute;

use crate::convert::{
    array, bytes, c_str, copy_out, fill_text, millis, non_null, to_usize, write_out,
};
use crate::error::{guard, CapiError, CapiResult};
use crate::objects::{self, adopt_local, resolve, LOCALS, REGIONS};
use crate::tcpx_status::{self, *};
use crate::transfer::issue;
use crate::{
    tcpx_endpoint, tcpx_ipc_segment, tcpx_local_connection, tcpx_local_peer_info, tcpx_region,
    tcpx_segment, tcpx_transfer, TCPX_IPC_DESCRIPTOR_BYTES, TCPX_LOCAL_INFO_MAX_BYTES,
};

// The header's sizes are the runtime's.
const _: () = assert!(TCPX_IPC_DESCRIPTOR_BYTES == IpcDescriptor::BYTES);
const _: () = assert!(tcpx_runtime::ipc::MAX_LOCAL_INFO <= TCPX_LOCAL_INFO_MAX_BYTES);

fn peer_info(p: &LocalPeer) -> tcpx_local_peer_info {
    let mut out = tcpx_local_peer_info {
        pid: p.pid,
        gpu_index: p.gpu_ordinal.map_or(-1, |g| g as i32),
        gpu_bus: [0; crate::TCPX_BUS_ID_MAX],
    };
    fill_text(&mut out.gpu_bus, p.gpu_bus.as_deref().unwrap_or(""));
    out
}

fn parse_info(raw: &[u8]) -> CapiResult<LocalInfo> {
    LocalInfo::from_bytes(raw).map_err(|e| CapiError::invalid(format!("local info: {e}")))
}

/// Writes this endpoint's same-host info (at most `TCPX_LOCAL_INFO_MAX_BYTES`) to
/// `buf[0..*len)` and sets `*len` to its size: hand it to peers out of band, next to the
/// metadata, for `tcpx_endpoint_local_route` and `tcpx_endpoint_connect_local`. On
/// `TCPX_ERR_BUFFER_TOO_SMALL` (or a NULL `buf`) `*len` holds the size needed.
/// Thread safety: any thread.
///
/// # Safety
/// `len` points to a readable and writable `size_t`; `buf` is NULL or points to `*len`
/// writable bytes.
#[no_mangle]
pub unsafe extern "C" fn tcpx_endpoint_local_info(
    endpoint: tcpx_endpoint,
    buf: *mut u8,
    len: *mut usize,
) -> tcpx_status {
    guard("tcpx_endpoint_local_info", || {
        non_null(len, "len")?;
        let obj = objects::endpoint(endpoint)?;
        let blob =
            obj.endpoint.local_info().to_bytes().map_err(|e| {
                CapiError::new(TCPX_ERR_INTERNAL, format!("encoding local info: {e}"))
            })?;
        // SAFETY: `len` checked non-null; the rest is the caller's promise.
        unsafe { copy_out(&blob, buf, len, "local info")? };
        Ok(TCPX_OK)
    })
}

/// Decides how GPU memory should move between this endpoint and the one whose local info is
/// `info[0..len)`: `*use_ipc` is true when it is on this host, of this user, and CUDA IPC can
/// reach its GPU (then use `tcpx_endpoint_connect_local` and the `*_ipc` calls for GPU memory
/// on both sides), false for the network path. `reason`, unless NULL, receives why not
/// (NUL-terminated, cut to `reason_len`). Thread safety: any thread.
///
/// # Safety
/// `info` points to `len` readable bytes; `use_ipc` to a writable `bool`; `reason` is NULL or
/// points to `reason_len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn tcpx_endpoint_local_route(
    endpoint: tcpx_endpoint,
    info: *const u8,
    len: usize,
    use_ipc: *mut bool,
    reason: *mut c_char,
    reason_len: usize,
) -> tcpx_status {
    guard("tcpx_endpoint_local_route", || {
        non_null(info, "info")?;
        non_null(use_ipc, "use_ipc (output)")?;
        // SAFETY: non-null (checked), `len` readable bytes (the caller's promise).
        let peer = parse_info(unsafe { bytes(info, len, "info") }?)?;
        let obj = objects::endpoint(endpoint)?;
        let (ipc, why) = match obj.endpoint.local_route(&peer) {
            LocalRoute::Ipc => (true, String::new()),
            LocalRoute::Network(why) => (false, why),
        };
        // SAFETY: non-null (checked); writable (the caller's promise).
        unsafe { write_out(use_ipc, ipc) };
        if !reason.is_null() && reason_len > 0 {
            // SAFETY: `reason_len` writable bytes (the caller's promise), NUL-terminated below.
            let out = unsafe { std::slice::from_raw_parts_mut(reason, reason_len) };
            let mut end = why.len().min(reason_len - 1);
            while !why.is_char_boundary(end) {
                end -= 1;
            }
            for (d, &s) in out.iter_mut().zip(&why.as_bytes()[..end]) {
                *d = s as c_char;
            }
            out[end] = 0;
        }
        Ok(TCPX_OK)
    })
}

fn finish_connect(
    endpoint: tcpx_endpoint,
    conn: tcpx_runtime::LocalConnection,
    out: *mut tcpx_local_connection,
    peer: *mut tcpx_local_peer_info,
) -> CapiResult<tcpx_status> {
    let info = peer_info(&conn.peer());
    let id = adopt_local(endpoint.id, conn)?;
    if !peer.is_null() {
        // SAFETY: non-null (checked); writable (the C caller's promise).
        unsafe { write_out(peer, info) };
    }
    // SAFETY: the callers checked `out` for null; writable (the C caller's promise).
    unsafe { write_out(out, tcpx_local_connection { id }) };
    Ok(TCPX_OK)
}

/// Waits up to `timeout_ms` for an endpoint of this host (same user) to connect locally;
/// `*connection` is the new handle and `*peer`, unless NULL, says who it is. Sockets of other
/// users and ones that do not speak the local protocol are turned away while this waits.
/// `TCPX_ERR_TIMEOUT` when none came. Thread safety: any thread.
///
/// # Safety
/// `connection` points to writable memory for a handle; `peer` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tcpx_endpoint_accept_local(
    endpoint: tcpx_endpoint,
    timeout_ms: u32,
    connection: *mut tcpx_local_connection,
    peer: *mut tcpx_local_peer_info,
) -> tcpx_status {
    guard("tcpx_endpoint_accept_local", || {
        non_null(connection, "connection (output)")?;
        let obj = objects::endpoint(endpoint)?;
        let conn = obj.endpoint.accept_local_timeout(millis(timeout_ms))?;
        finish_connect(endpoint, conn, connection, peer)
    })
}

/// Connects to the endpoint of this host whose local info (its `tcpx_endpoint_local_info`) is
/// `info[0..len)`, waiting at most the configured timeout for it to accept.
/// `TCPX_ERR_CONNECT` when nobody of this user listens there (another host, another network
/// namespace: use the network path). Thread safety: any thread.
///
/// # Safety
/// `info` points to `len` readable bytes; `connection` to writable memory for a handle.
#[no_mangle]
pub unsafe extern "C" fn tcpx_endpoint_connect_local(
    endpoint: tcpx_endpoint,
    info: *const u8,
    len: usize,
    connection: *mut tcpx_local_connection,
) -> tcpx_status {
    guard("tcpx_endpoint_connect_local", || {
        non_null(info, "info")?;
        non_null(connection, "connection (output)")?;
        // SAFETY: non-null (checked), `len` readable bytes (the caller's promise).
        let peer = parse_info(unsafe { bytes(info, len, "info") }?)?;
        let obj = objects::endpoint(endpoint)?;
        let conn = obj.endpoint.connect_local(&peer.addr())?;
        finish_connect(endpoint, conn, connection, std::ptr::null_mut())
    })
}

/// Connects to the first endpoint of this user on the GPU with PCI bus id `bus_id`
/// (`"0000:8a:00.0"`, the driver's `"00000000:8A:00.0"` too), like UCCL's
/// `connect_local(remote_gpu_bdf)`. Thread safety: any thread.
///
/// # Safety
/// `bus_id` is a NUL-terminated string; `connection` points to writable memory for a handle.
#[no_mangle]
pub unsafe extern "C" fn tcpx_endpoint_connect_local_gpu(
    endpoint: tcpx_endpoint,
    bus_id: *const c_char,
    connection: *mut tcpx_local_connection,
) -> tcpx_status {
    guard("tcpx_endpoint_connect_local_gpu", || {
        non_null(connection, "connection (output)")?;
        // SAFETY: NUL-terminated (the caller's promise); checked for null inside.
        let bus = unsafe { c_str(bus_id, "bus_id") }?;
        let obj = objects::endpoint(endpoint)?;
        let conn = obj
            .endpoint
            .connect_local(&LocalAddr::Gpu(bus.to_owned()))?;
        finish_connect(endpoint, conn, connection, std::ptr::null_mut())
    })
}

/// Fills `*peer` with who is at the other end of a same-host connection.
/// Thread safety: any thread.
///
/// # Safety
/// `peer` points to writable memory for a `tcpx_local_peer_info`.
#[no_mangle]
pub unsafe extern "C" fn tcpx_local_connection_peer(
    connection: tcpx_local_connection,
    peer: *mut tcpx_local_peer_info,
) -> tcpx_status {
    guard("tcpx_local_connection_peer", || {
        non_null(peer, "peer (output)")?;
        let info = LOCALS
            .get(connection.id)?
            .with(|c| Ok(peer_info(&c.peer())))?;
        // SAFETY: non-null (checked); writable (the caller's promise).
        unsafe { write_out(peer, info) };
        Ok(TCPX_OK)
    })
}

/// `TCPX_OK` while the same-host connection is usable; otherwise the status of what ended it
/// (`TCPX_ERR_PEER_CLOSED` when the peer left or closed it), its message in
/// `tcpx_last_error()`. Thread safety: any thread.
#[no_mangle]
pub extern "C" fn tcpx_local_connection_status(connection: tcpx_local_connection) -> tcpx_status {
    guard("tcpx_local_connection_status", || {
        LOCALS.get(connection.id)?.with(|c| match c.error() {
            None => Ok(TCPX_OK),
            Some(e) => Err(CapiError::from(e)),
        })
    })
}

/// Closes a same-host connection and releases its handle: the peer is told (it closes its
/// mappings of this side's memory before this returns, within the timeout), this side's
/// mappings close after their copies, and transfers not yet seen complete fail with
/// `TCPX_ERR_CLOSED`. Thread safety: any thread.
#[no_mangle]
pub extern "C" fn tcpx_local_connection_destroy(connection: tcpx_local_connection) -> tcpx_status {
    guard("tcpx_local_connection_destroy", || {
        LOCALS.remove(connection.id)?.shut_down();
        Ok(TCPX_OK)
    })
}

/// Advertises `len` bytes at `offset` in CUDA `region` for same-host peers and writes the
/// descriptor (`TCPX_IPC_DESCRIPTOR_BYTES`) to `descriptor`: hand it to the peer out of band,
/// which names it in `tcpx_ipc_segment`. Each call makes a new descriptor; all of a region's
/// are revoked by `tcpx_region_destroy`. `TCPX_ERR_INVALID_ARGUMENT` for host memory or a
/// range outside the region; `TCPX_ERR_PLUGIN` when the driver cannot export the memory.
/// Thread safety: any thread.
///
/// # Safety
/// `descriptor` points to `capacity` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn tcpx_region_advertise_ipc(
    region: tcpx_region,
    offset: u64,
    len: u64,
    descriptor: *mut u8,
    capacity: usize,
) -> tcpx_status {
    guard("tcpx_region_advertise_ipc", || {
        non_null(descriptor, "descriptor")?;
        if capacity < TCPX_IPC_DESCRIPTOR_BYTES {
            return Err(CapiError::new(
                TCPX_ERR_BUFFER_TOO_SMALL,
                format!(
                    "an IPC descriptor is {TCPX_IPC_DESCRIPTOR_BYTES} bytes, the buffer holds \
                     {capacity}"
                ),
            ));
        }
        let obj = REGIONS.get(region.id)?;
        let ep = objects::endpoint(tcpx_endpoint { id: obj.endpoint })?;
        let d = ep.endpoint.advertise_ipc_range(
            &obj.region,
            to_usize(offset, "offset")?,
            to_usize(len, "len")?,
        )?;
        obj.ipc.lock().unwrap_or_else(|p| p.into_inner()).push(d);
        let raw = d.to_bytes();
        // SAFETY: room for `capacity` >= TCPX_IPC_DESCRIPTOR_BYTES bytes (the caller's
        // promise, size checked); `raw` is ours.
        unsafe { std::ptr::copy_nonoverlapping(raw.as_ptr(), descriptor, raw.len()) };
        Ok(TCPX_OK)
    })
}

/// Revokes a same-host descriptor this endpoint issued and waits (at most the timeout) until
/// every connected local peer closed its mapping: afterwards the memory may be freed.
/// `*was_advertised`, unless NULL, says whether it was advertised and not yet revoked.
/// `TCPX_ERR_TIMEOUT` names a peer that did not confirm in time. Thread safety: any thread.
///
/// # Safety
/// `descriptor` points to `len` readable bytes; `was_advertised` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tcpx_endpoint_revoke_ipc(
    endpoint: tcpx_endpoint,
    descriptor: *const u8,
    len: usize,
    was_advertised: *mut bool,
) -> tcpx_status {
    guard("tcpx_endpoint_revoke_ipc", || {
        non_null(descriptor, "descriptor")?;
        // SAFETY: non-null (checked), `len` readable bytes (the caller's promise).
        let raw = unsafe { bytes(descriptor, len, "descriptor") }?;
        let d = IpcDescriptor::from_bytes(raw)
            .map_err(|e| CapiError::invalid(format!("descriptor: {e}")))?;
        let obj = objects::endpoint(endpoint)?;
        let revoked = obj.endpoint.revoke_ipc(&d)?;
        if !was_advertised.is_null() {
            // SAFETY: non-null (checked); writable (the caller's promise).
            unsafe { write_out(was_advertised, revoked) };
        }
        Ok(TCPX_OK)
    })
}

/// Pays ahead what the first `tcpx_local_connection_write_ipc` / `_read_ipc` naming the
/// descriptor would: the owner's confirmation, the copying GPU's streams and list kernel, the
/// mapping of the allocation (a NIXL agent's first VRAM transfer took 20 × its tenth without
/// it). `gpu` is the CUDA ordinal of the local memory that will be copied (negative: the
/// endpoint's GPU, else GPU 0). Errors as a transfer naming the descriptor: `TCPX_ERR_ACCESS`
/// for an unknown, revoked or foreign one. Optional. Thread safety: any thread.
///
/// # Safety
/// `descriptor` points to `len` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn tcpx_local_connection_prepare_ipc(
    connection: tcpx_local_connection,
    descriptor: *const u8,
    len: usize,
    gpu: i32,
) -> tcpx_status {
    guard("tcpx_local_connection_prepare_ipc", || {
        non_null(descriptor, "descriptor")?;
        // SAFETY: non-null (checked), `len` readable bytes (the caller's promise).
        let raw = unsafe { bytes(descriptor, len, "descriptor") }?;
        let d = IpcDescriptor::from_bytes(raw)
            .map_err(|e| CapiError::invalid(format!("descriptor: {e}")))?;
        let gpu = usize::try_from(gpu).ok();
        let conn = LOCALS.get(connection.id)?;
        conn.with(|c| Ok(c.prepare_ipc(&d, gpu)?))?;
        Ok(TCPX_OK)
    })
}

/// Shared body of write and read.
///
/// # Safety
/// `segments` points to `n` initialized entries; `transfer` is writable.
unsafe fn ipc_op(
    connection: tcpx_local_connection,
    segments: *const tcpx_ipc_segment,
    n: usize,
    transfer: *mut tcpx_transfer,
    write: bool,
) -> CapiResult<tcpx_status> {
    non_null(segments, "segments")?;
    non_null(transfer, "transfer (output)")?;
    // SAFETY: non-null (checked), `n` initialized entries (the caller's promise).
    let segs = unsafe { array(segments, n, "segments") }?;
    let conn = LOCALS.get(connection.id)?;
    // A KV list names one or a few of the peer's descriptors block after block: each run is
    // decoded once (22 µs of a 1024-block list when every segment was).
    let (descriptors, which) =
        IpcDescriptor::decode_runs(segs.iter().map(|s| &s.descriptor[..]))
            .map_err(|(i, e)| CapiError::invalid(format!("segment {i}: descriptor: {e}")))?;
    let local: Vec<tcpx_segment> = segs
        .iter()
        .map(|s| tcpx_segment {
            region: s.region,
            offset: s.offset,
            len: s.len,
        })
        .collect();
    let regions = resolve(conn.endpoint, &local)?;
    let mut pieces = Vec::with_capacity(segs.len());
    for ((r, s), &d) in regions.iter().zip(segs).zip(&which) {
        pieces.push(IpcSegment::new(
            &r.region,
            to_usize(s.offset, "offset")?,
            &descriptors[d],
            s.remote_offset,
            to_usize(s.len, "len")?,
        ));
    }
    let started = conn.with(|c| {
        Ok(if write {
            c.writev_ipc(&pieces)?
        } else {
            c.readv_ipc(&pieces)?
        })
    })?;
    objects::track_all(&regions, &started);
    // SAFETY: non-null (checked); writable (the caller's promise).
    unsafe { write_out(transfer, issue(started)) };
    Ok(TCPX_OK)
}

/// Writes every segment's local bytes into the local peer's advertised GPU memory, with this
/// process's copy engines (no call on the peer). One transfer for the list; it completes
/// (`tcpx_transfer_test` / `_wait`) once every copy did. The first use of a descriptor on a
/// connection asks the peer to confirm it (`TCPX_ERR_ACCESS` for an unknown, revoked or
/// altered one, or one of another endpoint; nothing is copied then); a range outside the
/// descriptor is `TCPX_ERR_INVALID_ARGUMENT`. Thread safety: any thread.
///
/// # Safety
/// `segments` points to `n` initialized entries; `transfer` to writable memory for a handle.
#[no_mangle]
pub unsafe extern "C" fn tcpx_local_connection_write_ipc(
    connection: tcpx_local_connection,
    segments: *const tcpx_ipc_segment,
    n: usize,
    transfer: *mut tcpx_transfer,
) -> tcpx_status {
    guard("tcpx_local_connection_write_ipc", || {
        // SAFETY: forwarded caller promises.
        unsafe { ipc_op(connection, segments, n, transfer, true) }
    })
}

/// Reads the local peer's advertised GPU memory into every segment's local bytes (rules as
/// `tcpx_local_connection_write_ipc`). Thread safety: any thread.
///
/// # Safety
/// As `tcpx_local_connection_write_ipc`.
#[no_mangle]
pub unsafe extern "C" fn tcpx_local_connection_read_ipc(
    connection: tcpx_local_connection,
    segments: *const tcpx_ipc_segment,
    n: usize,
    transfer: *mut tcpx_transfer,
) -> tcpx_status {
    guard("tcpx_local_connection_read_ipc", || {
        // SAFETY: forwarded caller promises.
        unsafe { ipc_op(connection, segments, n, transfer, false) }
    })
}
