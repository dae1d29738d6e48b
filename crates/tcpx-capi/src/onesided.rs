//! One-sided access: advertise / revoke, write / read of block lists with an optional
//! notification, standalone notifications and draining them.

use std::time::{Duration, Instant};

use tcpx_runtime::onesided::{Descriptor, RemoteSegment};
use tcpx_runtime::Segment;

use crate::convert::{array, bytes, fill_text, millis, non_null, to_usize, write_out};
use crate::error::{guard, CapiError, CapiResult};
use crate::objects::{self, resolve, ENDPOINTS, REGIONS};
use crate::tcpx_status::{self, *};
use crate::transfer::issue;
use crate::{
    tcpx_connection, tcpx_endpoint, tcpx_notification, tcpx_region, tcpx_remote_segment,
    tcpx_segment, tcpx_transfer, TCPX_DESCRIPTOR_BYTES,
};

// The header's sizes are the runtime's.
const _: () = assert!(TCPX_DESCRIPTOR_BYTES == Descriptor::BYTES);
const _: () =
    assert!(crate::TCPX_METADATA_MAX_BYTES == tcpx_runtime::control::metadata::MAX_METADATA_BYTES);
const _: () =
    assert!(crate::TCPX_NOTIFICATION_MAX_BYTES == tcpx_runtime::onesided::MAX_NOTIFICATION);

/// Advertises `region` for one-sided access by the endpoint's peers and writes its descriptor
/// (`TCPX_DESCRIPTOR_BYTES`) to `descriptor`; hand those bytes to the peer out of band, which
/// names them in `tcpx_remote_segment`. Advertising again retires the previous descriptor.
/// `capacity` must be at least `TCPX_DESCRIPTOR_BYTES` (`TCPX_ERR_BUFFER_TOO_SMALL`).
/// Thread safety: any thread.
///
/// # Safety
/// `descriptor` points to `capacity` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn tcpx_region_advertise(
    region: tcpx_region,
    descriptor: *mut u8,
    capacity: usize,
) -> tcpx_status {
    guard("tcpx_region_advertise", || {
        non_null(descriptor, "descriptor")?;
        if capacity < TCPX_DESCRIPTOR_BYTES {
            return Err(CapiError::new(
                TCPX_ERR_BUFFER_TOO_SMALL,
                format!(
                    "a descriptor is {TCPX_DESCRIPTOR_BYTES} bytes, the buffer holds {capacity}"
                ),
            ));
        }
        let obj = REGIONS.get(region.id)?;
        let ep = ENDPOINTS.get(obj.endpoint)?;
        let mut current = obj.descriptor.lock().unwrap_or_else(|p| p.into_inner());
        let d = ep.endpoint.advertise(&obj.region)?;
        *current = Some(d);
        let raw = d.to_bytes();
        // SAFETY: `descriptor` has room for `capacity` >= TCPX_DESCRIPTOR_BYTES bytes (the
        // caller's promise, size checked); `raw` is ours, so they do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(raw.as_ptr(), descriptor, raw.len()) };
        Ok(TCPX_OK)
    })
}

/// Revokes a descriptor this endpoint issued: every later request naming it is refused
/// (operations already accepted finish). `*was_advertised`, if not NULL, says whether it was
/// advertised and not yet revoked. Thread safety: any thread.
///
/// # Safety
/// `descriptor` points to `len` readable bytes; `was_advertised` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn tcpx_endpoint_revoke(
    endpoint: tcpx_endpoint,
    descriptor: *const u8,
    len: usize,
    was_advertised: *mut bool,
) -> tcpx_status {
    guard("tcpx_endpoint_revoke", || {
        non_null(descriptor, "descriptor")?;
        // SAFETY: non-null (checked), `len` readable bytes (the caller's promise).
        let raw = unsafe { bytes(descriptor, len, "descriptor") }?;
        let d = parse_descriptor(raw, "descriptor")?;
        let obj = objects::endpoint(endpoint)?;
        let revoked = obj.endpoint.revoke(&d);
        if !was_advertised.is_null() {
            // SAFETY: non-null (checked); writable (the caller's promise).
            unsafe { write_out(was_advertised, revoked) };
        }
        Ok(TCPX_OK)
    })
}

fn parse_descriptor(raw: &[u8], what: &str) -> CapiResult<Descriptor> {
    Descriptor::from_bytes(raw).map_err(|e| CapiError::invalid(format!("{what}: {e}")))
}

fn remote_list(remote: &[tcpx_remote_segment]) -> CapiResult<Vec<RemoteSegment>> {
    remote
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let d = parse_descriptor(&r.descriptor, &format!("remote segment {i}"))?;
            Ok(RemoteSegment::new(d, r.offset, r.len))
        })
        .collect()
}

/// Shared body of write and read.
///
/// # Safety
/// `local` / `remote` point to `nlocal` / `nremote` initialized entries; `transfer` is
/// writable.
unsafe fn one_sided(
    connection: tcpx_connection,
    local: *const tcpx_segment,
    nlocal: usize,
    remote: *const tcpx_remote_segment,
    nremote: usize,
    transfer: *mut tcpx_transfer,
    post: impl FnOnce(
        &tcpx_runtime::Connection,
        &[Segment<'_>],
        &[RemoteSegment],
    ) -> tcpx_runtime::Result<tcpx_runtime::Transfer>,
) -> CapiResult<tcpx_status> {
    non_null(local, "local")?;
    non_null(remote, "remote")?;
    non_null(transfer, "transfer (output)")?;
    // SAFETY: non-null (checked), counts as promised by the caller.
    let local = unsafe { array(local, nlocal, "local") }?;
    // SAFETY: `remote` is non-null (checked above) and, by the caller's promise, points at
    // `nremote` readable entries that stay valid for this call.
    let remote = unsafe { array(remote, nremote, "remote") }?;
    if remote.is_empty() {
        return Err(CapiError::invalid("the remote list is empty"));
    }
    let remote = remote_list(remote)?;
    let conn = objects::connection(connection)?;
    let regions = resolve(conn.endpoint, local)?;
    let mut pieces = Vec::with_capacity(local.len());
    for (r, s) in regions.iter().zip(local) {
        pieces.push(Segment::new(
            &r.region,
            to_usize(s.offset, "offset")?,
            to_usize(s.len, "len")?,
        ));
    }
    let started = conn.with(|c| Ok(post(c, &pieces, &remote)?))?;
    objects::track_all(&regions, &started);
    // SAFETY: non-null (checked); writable (the caller's promise).
    unsafe { write_out(transfer, issue(started)) };
    Ok(TCPX_OK)
}

/// Writes the bytes of `local[0..nlocal)` into the peer's advertised memory
/// `remote[0..nremote)` (the peer application makes no call); both lists describe the same
/// total. Completes (test / wait) once the peer acknowledged that every byte landed, or fails
/// with `TCPX_ERR_ACCESS` naming the first bad remote entry (nothing written).
/// `notification[0..notification_len)`, unless `notification` is NULL, reaches the peer's
/// `tcpx_endpoint_notification` only after the data landed (never for a refused write; at most
/// `TCPX_NOTIFICATION_MAX_BYTES`). Operations of one connection are served in issue order.
/// Releasing the transfer does not cancel the write. Thread safety: any thread; several threads
/// may issue on one connection.
///
/// # Safety
/// `local` and `remote` point to `nlocal` and `nremote` initialized entries; `notification`
/// is NULL or points to `notification_len` readable bytes; `transfer` to writable memory for a
/// handle.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn tcpx_connection_write(
    connection: tcpx_connection,
    local: *const tcpx_segment,
    nlocal: usize,
    remote: *const tcpx_remote_segment,
    nremote: usize,
    notification: *const u8,
    notification_len: usize,
    transfer: *mut tcpx_transfer,
) -> tcpx_status {
    guard("tcpx_connection_write", || {
        let note = if notification.is_null() {
            None
        } else {
            // SAFETY: non-null, `notification_len` readable bytes (the caller's promise).
            Some(unsafe { bytes(notification, notification_len, "notification") }?)
        };
        // SAFETY: forwarded caller promises on the lists and `transfer`.
        unsafe {
            one_sided(
                connection,
                local,
                nlocal,
                remote,
                nremote,
                transfer,
                |c, l, r| c.write(l, r, note),
            )
        }
    })
}

/// Reads the peer's advertised memory `remote[0..nremote)` into `local[0..nlocal)` (one-sided;
/// same list rules as `tcpx_connection_write`). Completes once every byte arrived, or fails
/// with `TCPX_ERR_ACCESS` (nothing read). Thread safety: as `tcpx_connection_write`.
///
/// # Safety
/// As `tcpx_connection_write`, without the notification.
#[no_mangle]
pub unsafe extern "C" fn tcpx_connection_read(
    connection: tcpx_connection,
    local: *const tcpx_segment,
    nlocal: usize,
    remote: *const tcpx_remote_segment,
    nremote: usize,
    transfer: *mut tcpx_transfer,
) -> tcpx_status {
    guard("tcpx_connection_read", || {
        // SAFETY: forwarded caller promises on the lists and `transfer`.
        unsafe {
            one_sided(
                connection,
                local,
                nlocal,
                remote,
                nremote,
                transfer,
                |c, l, r| c.read(l, r),
            )
        }
    })
}

/// Pays now what the first one-sided operations naming `regions[0..count)` on this connection
/// would pay at their start (registration on the connection's one-sided comms, both
/// directions: writes and reads issued here, and the peer's served here), so that the first
/// `tcpx_connection_write` / `_read` runs as fast as the later ones. Call it once the
/// connection exists, for the regions it will carry; again for regions registered later.
/// Optional: without it the first operation on each region registers it. Each region must
/// belong to the connection's endpoint. Thread safety: any thread.
///
/// # Safety
/// `regions` points to `count` initialized handles (may be NULL when `count` is 0).
#[no_mangle]
pub unsafe extern "C" fn tcpx_connection_warmup(
    connection: tcpx_connection,
    regions: *const tcpx_region,
    count: usize,
) -> tcpx_status {
    guard("tcpx_connection_warmup", || {
        // SAFETY: `count` initialized handles when non-null (the caller's promise).
        let regions = unsafe { array(regions, count, "regions") }?;
        let conn = objects::connection(connection)?;
        for (i, &region) in regions.iter().enumerate() {
            let seg = [tcpx_segment {
                region,
                offset: 0,
                len: 0,
            }];
            let in_use = resolve(conn.endpoint, &seg)
                .map_err(|e| CapiError::new(e.status, format!("region {i}: {}", e.message)))?;
            conn.with(|c| Ok(c.warm_up(&in_use[0].region)?))
                .map_err(|e| CapiError::new(e.status, format!("region {i}: {}", e.message)))?;
        }
        Ok(TCPX_OK)
    })
}

/// Sends a standalone notification (`bytes[0..len)`, at most `TCPX_NOTIFICATION_MAX_BYTES`) to
/// the peer's `tcpx_endpoint_notification`, delivered after every notification and write this
/// side issued before it. Thread safety: any thread.
///
/// # Safety
/// `bytes` points to `len` readable bytes (may be NULL when `len` is 0).
#[no_mangle]
pub unsafe extern "C" fn tcpx_connection_notify(
    connection: tcpx_connection,
    bytes: *const u8,
    len: usize,
) -> tcpx_status {
    guard("tcpx_connection_notify", || {
        // SAFETY: `len` readable bytes when non-null (the caller's promise).
        let payload = unsafe { self::bytes(bytes, len, "bytes") }?;
        objects::connection(connection)?.with(|c| Ok(c.notify(payload)?))?;
        Ok(TCPX_OK)
    })
}

/// Takes the oldest notification delivered to this endpoint (from any peer, in delivery
/// order per connection), waiting at most `timeout_ms` for one: `TCPX_OK` with its sender and
/// length in `*info` and its bytes in `buf`; `TCPX_PENDING` when none arrived in time; or
/// `TCPX_ERR_BUFFER_TOO_SMALL` when `capacity` is less than its length (then `info->len` says
/// how much is needed and the notification stays first in line). `buf` may be NULL when
/// `capacity` is 0. Thread safety: any thread; concurrent callers each get different
/// notifications.
///
/// # Safety
/// `info` points to a writable `tcpx_notification`; `buf` to `capacity` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn tcpx_endpoint_notification(
    endpoint: tcpx_endpoint,
    timeout_ms: u32,
    info: *mut tcpx_notification,
    buf: *mut u8,
    capacity: usize,
) -> tcpx_status {
    guard("tcpx_endpoint_notification", || {
        non_null(info, "info")?;
        if capacity > 0 {
            non_null(buf, "buf")?;
        }
        let obj = objects::endpoint(endpoint)?;
        let deadline = Instant::now() + millis(timeout_ms);
        loop {
            {
                let mut queue = obj.notifications.lock().unwrap_or_else(|p| p.into_inner());
                if queue.is_empty() {
                    queue.extend(obj.endpoint.notifications());
                }
                if let Some((peer, payload)) = queue.front() {
                    let mut out = tcpx_notification {
                        peer: [0; crate::TCPX_ADDRESS_MAX],
                        len: payload.len() as u64,
                    };
                    fill_text(&mut out.peer, &peer.to_string());
                    // SAFETY: non-null (checked); writable (the caller's promise).
                    unsafe { write_out(info, out) };
                    if payload.len() > capacity {
                        return Err(CapiError::new(
                            TCPX_ERR_BUFFER_TOO_SMALL,
                            format!(
                                "the notification from {peer} is {} bytes, the buffer holds \
                                 {capacity}",
                                payload.len()
                            ),
                        ));
                    }
                    if !payload.is_empty() {
                        // SAFETY: `buf` has room for `capacity` >= len bytes (checked non-null
                        // since capacity > 0); the payload is ours, no overlap.
                        unsafe {
                            std::ptr::copy_nonoverlapping(payload.as_ptr(), buf, payload.len())
                        };
                    }
                    queue.pop_front();
                    return Ok(TCPX_OK);
                }
            }
            if Instant::now() >= deadline {
                return Ok(TCPX_PENDING);
            }
            // Notifications arrive through the control stream; a short sleep keeps a waiting
            // host from spinning a core the engines need.
            std::thread::sleep(Duration::from_micros(200));
        }
    })
}

/// Writes to `*refusals` how many one-sided requests from peers this endpoint refused so far
/// (unknown or revoked descriptor, wrong key, out of bounds). Thread safety: any thread.
///
/// # Safety
/// `refusals` points to a writable `uint64_t`.
#[no_mangle]
pub unsafe extern "C" fn tcpx_endpoint_access_refusals(
    endpoint: tcpx_endpoint,
    refusals: *mut u64,
) -> tcpx_status {
    guard("tcpx_endpoint_access_refusals", || {
        non_null(refusals, "refusals")?;
        let n = objects::endpoint(endpoint)?.endpoint.access_refusals();
        // SAFETY: non-null (checked); writable (the caller's promise).
        unsafe { write_out(refusals, n) };
        Ok(TCPX_OK)
    })
}
