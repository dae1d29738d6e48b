//! Connections: peer info, two-sided send / receive (contiguous, vectored and batches of
//! small messages), statistics, close and destroy.

use std::time::{Duration, Instant};

use tcpx_runtime::{Connection, Segment, Transfer};

use crate::convert::{array, non_null, write_out};
use crate::error::{guard, CapiError, CapiResult};
use crate::objects::{self, resolve, InUse, CONNECTIONS, ENDPOINTS};
use crate::tcpx_status::{self, *};
use crate::transfer::issue;
use crate::{
    tcpx_connection, tcpx_connection_stats, tcpx_peer_info, tcpx_region, tcpx_segment,
    tcpx_transfer, TCPX_BATCH_MAX_BYTES,
};

// The header's cap on a batch is the runtime's: both sides derive the batch's packed stream
// from its total, which must fit one pack buffer.
const _: () = assert!(TCPX_BATCH_MAX_BYTES == tcpx_runtime::PACK_BYTES);

/// Fills `*peer` with the peer's control address, announced GPU index and channel count.
/// Thread safety: any thread.
///
/// # Safety
/// `peer` points to writable memory for a `tcpx_peer_info`.
#[no_mangle]
pub unsafe extern "C" fn tcpx_connection_peer(
    connection: tcpx_connection,
    peer: *mut tcpx_peer_info,
) -> tcpx_status {
    guard("tcpx_connection_peer", || {
        non_null(peer, "peer")?;
        let info = objects::connection(connection)?.with(|c| Ok(objects::peer_info(c)))?;
        // SAFETY: non-null (checked); writable (the caller's promise).
        unsafe { write_out(peer, info) };
        Ok(TCPX_OK)
    })
}

/// Submits `segments` (resolved and marked in use) in `direction` and hands out the transfer.
fn submit(
    connection: tcpx_connection,
    segments: &[tcpx_segment],
    transfer: *mut tcpx_transfer,
    post: impl FnOnce(&Connection, &[Segment<'_>]) -> tcpx_runtime::Result<Transfer>,
) -> CapiResult<tcpx_status> {
    non_null(transfer, "transfer (output)")?;
    let conn = objects::connection(connection)?;
    let regions: Vec<InUse> = resolve(conn.endpoint, segments)?;
    let pieces: Vec<Segment<'_>> = regions
        .iter()
        .zip(segments)
        .map(|(r, s)| Segment::new(&r.region, s.offset as usize, s.len as usize))
        .collect();
    let started = conn.with(|c| Ok(post(c, &pieces)?))?;
    objects::track_all(&regions, &started);
    let handle = issue(started);
    // SAFETY: non-null (checked); writable (the caller's promise).
    unsafe { write_out(transfer, handle) };
    Ok(TCPX_OK)
}

/// [`submit`] of the C list `segments[0..count)`, refused when `segments` is NULL.
///
/// # Safety
/// `segments` is NULL or points to `count` initialized segments; `transfer` as for
/// [`submit`].
unsafe fn submit_list(
    connection: tcpx_connection,
    segments: *const tcpx_segment,
    count: usize,
    transfer: *mut tcpx_transfer,
    post: impl FnOnce(&Connection, &[Segment<'_>]) -> tcpx_runtime::Result<Transfer>,
) -> CapiResult<tcpx_status> {
    non_null(segments, "segments")?;
    // SAFETY: non-null (checked), `count` segments (the caller's promise).
    let segs = unsafe { array(segments, count, "segments") }?;
    submit(connection, segs, transfer, post)
}

/// Sends `len` bytes at `offset` in `region` (registered or allocated on this connection's
/// endpoint); the peer posts a receive of the same length. `*transfer` tracks it (test / wait,
/// then release). The memory must stay untouched until the transfer finished.
/// Thread safety: any thread; several threads may post on one connection at once (each
/// direction's transfers are matched with the peer's in the order they were posted).
///
/// # Safety
/// `transfer` points to writable memory for a handle.
#[no_mangle]
pub unsafe extern "C" fn tcpx_connection_send(
    connection: tcpx_connection,
    region: tcpx_region,
    offset: u64,
    len: u64,
    transfer: *mut tcpx_transfer,
) -> tcpx_status {
    let seg = [tcpx_segment {
        region,
        offset,
        len,
    }];
    guard("tcpx_connection_send", || {
        submit(connection, &seg, transfer, |c, s| {
            c.send(s[0].region, s[0].offset, s[0].len)
        })
    })
}

/// Receives `len` bytes into `region` at `offset`; the peer sends the same length.
/// Thread safety: as `tcpx_connection_send`.
///
/// # Safety
/// `transfer` points to writable memory for a handle.
#[no_mangle]
pub unsafe extern "C" fn tcpx_connection_recv(
    connection: tcpx_connection,
    region: tcpx_region,
    offset: u64,
    len: u64,
    transfer: *mut tcpx_transfer,
) -> tcpx_status {
    let seg = [tcpx_segment {
        region,
        offset,
        len,
    }];
    guard("tcpx_connection_recv", || {
        submit(connection, &seg, transfer, |c, s| {
            c.recv(s[0].region, s[0].offset, s[0].len)
        })
    })
}

/// Sends the concatenation of `segments[0..count)` as one transfer; the peer receives it with
/// `tcpx_connection_recv_vectored`, cut however it likes (the totals must match).
/// Thread safety: as `tcpx_connection_send`.
///
/// # Safety
/// `segments` points to `count` initialized segments; `transfer` to writable memory for a
/// handle.
#[no_mangle]
pub unsafe extern "C" fn tcpx_connection_send_vectored(
    connection: tcpx_connection,
    segments: *const tcpx_segment,
    count: usize,
    transfer: *mut tcpx_transfer,
) -> tcpx_status {
    guard("tcpx_connection_send_vectored", || {
        // SAFETY: `segments` and `transfer` as this function's contract says.
        unsafe {
            submit_list(connection, segments, count, transfer, |c, s| {
                c.send_vectored(s)
            })
        }
    })
}

/// Receives one transfer into `segments[0..count)`, in order; the peer sends it with
/// `tcpx_connection_send_vectored`. Thread safety: as `tcpx_connection_send`.
///
/// # Safety
/// As `tcpx_connection_send_vectored`.
#[no_mangle]
pub unsafe extern "C" fn tcpx_connection_recv_vectored(
    connection: tcpx_connection,
    segments: *const tcpx_segment,
    count: usize,
    transfer: *mut tcpx_transfer,
) -> tcpx_status {
    guard("tcpx_connection_recv_vectored", || {
        // SAFETY: `segments` and `transfer` as this function's contract says.
        unsafe {
            submit_list(connection, segments, count, transfer, |c, s| {
                c.recv_vectored(s)
            })
        }
    })
}

/// Sends many small messages in one submission: `segments[0..count)` travel, in order, as one
/// batch into the peer's `tcpx_connection_recv_batch` of the same total (1 byte to
/// `TCPX_BATCH_MAX_BYTES`; a larger total is refused with `TCPX_ERR_INVALID_ARGUMENT`, split
/// it into several batches). With the same segment sizes on both sides each message lands in
/// its own receive segment; the batch completes as one transfer.
///
/// For many small messages this is the fast path: each message sent alone costs one request
/// and one completion, a batch pays that once and is one contiguous stream on the wire. A
/// scattered host-memory list is copied into a pooled pack buffer during this call
/// (`tcpx_connection_reserve_batches` allocates those buffers up front); a list that is one
/// contiguous run is sent in place; scattered CUDA memory is refused unless it is staged. As
/// for every send, the memory must stay untouched until the transfer finished.
/// Batches are numbered with the connection's other sends: the k-th send of any kind pairs
/// with the peer's k-th receive, which must be a `tcpx_connection_recv_batch`.
/// Thread safety: as `tcpx_connection_send`.
///
/// # Safety
/// `segments` points to `count` initialized segments; `transfer` to writable memory for a
/// handle.
#[no_mangle]
pub unsafe extern "C" fn tcpx_connection_send_batch(
    connection: tcpx_connection,
    segments: *const tcpx_segment,
    count: usize,
    transfer: *mut tcpx_transfer,
) -> tcpx_status {
    guard("tcpx_connection_send_batch", || {
        // SAFETY: `segments` and `transfer` as this function's contract says.
        unsafe {
            submit_list(connection, segments, count, transfer, |c, s| {
                c.send_batch(s)
            })
        }
    })
}

/// Receives a batch sent with `tcpx_connection_send_batch` into `segments[0..count)`, in
/// order; the totals must match (a receive larger than the peer's batch fails instead of
/// waiting for bytes that never come). A scattered host-memory list is received into a
/// pooled pack buffer and copied out when the transfer is tested or waited on: read the segments only after `tcpx_transfer_test` / `tcpx_transfer_wait`
/// returned `TCPX_OK`. Thread safety: as `tcpx_connection_send`.
///
/// # Safety
/// As `tcpx_connection_send_batch`.
#[no_mangle]
pub unsafe extern "C" fn tcpx_connection_recv_batch(
    connection: tcpx_connection,
    segments: *const tcpx_segment,
    count: usize,
    transfer: *mut tcpx_transfer,
) -> tcpx_status {
    guard("tcpx_connection_recv_batch", || {
        // SAFETY: `segments` and `transfer` as this function's contract says.
        unsafe {
            submit_list(connection, segments, count, transfer, |c, s| {
                c.recv_batch(s)
            })
        }
    })
}

/// Allocates and registers the pack buffers that `batches` batches of scattered host memory
/// in flight need (at most the connection's pool, `TCPX_PACK_BUFFERS`, 8 by default), so that
/// the first batches do not pay for them; without it the pool grows on demand. `*reserved`,
/// if `reserved` is not NULL, gets the number of buffers now pooled. Thread safety: any thread.
///
/// # Safety
/// `reserved` is NULL or points to a writable `size_t`.
#[no_mangle]
pub unsafe extern "C" fn tcpx_connection_reserve_batches(
    connection: tcpx_connection,
    batches: usize,
    reserved: *mut usize,
) -> tcpx_status {
    guard("tcpx_connection_reserve_batches", || {
        let pooled = objects::connection(connection)?.with(|c| Ok(c.reserve_batches(batches)?))?;
        if !reserved.is_null() {
            // SAFETY: non-null (checked); writable (the caller's promise).
            unsafe { write_out(reserved, pooled) };
        }
        Ok(TCPX_OK)
    })
}

/// Registers `region` with this connection's comms now rather than at its first transfer
/// (takes the registration cost off the first transfer). Thread safety: any thread.
#[no_mangle]
pub extern "C" fn tcpx_connection_register(
    connection: tcpx_connection,
    region: tcpx_region,
) -> tcpx_status {
    guard("tcpx_connection_register", || {
        let conn = objects::connection(connection)?;
        let seg = [tcpx_segment {
            region,
            offset: 0,
            len: 0,
        }];
        let regions = resolve(conn.endpoint, &seg)?;
        conn.with(|c| Ok(c.register(&regions[0].region)?))?;
        Ok(TCPX_OK)
    })
}

/// Fills `*stats` with the connection's counters summed over its channels. Thread safety: any
/// thread (the counters are read without stopping the engines, so they are a recent, not an
/// atomic, picture).
///
/// # Safety
/// `stats` points to writable memory for a `tcpx_connection_stats`.
#[no_mangle]
pub unsafe extern "C" fn tcpx_connection_get_stats(
    connection: tcpx_connection,
    stats: *mut tcpx_connection_stats,
) -> tcpx_status {
    guard("tcpx_connection_get_stats", || {
        non_null(stats, "stats")?;
        let out = objects::connection(connection)?.with(|c| {
            let mut out = tcpx_connection_stats {
                channels: u32::from(c.channels()),
                in_flight: c.in_flight() as u64,
                ..Default::default()
            };
            for s in c.stats() {
                out.bytes_sent += s.bytes_sent;
                out.bytes_received += s.bytes_received;
                out.sends += s.sends;
                out.recvs += s.recvs;
                out.busy += s.busy;
            }
            for s in c.one_sided_stats() {
                out.one_sided_bytes_sent += s.bytes_sent;
                out.one_sided_bytes_received += s.bytes_received;
                out.busy += s.busy;
            }
            let inline = c.inline_stats();
            out.one_sided_bytes_sent += inline.bytes_sent;
            out.one_sided_bytes_received += inline.bytes_received;
            Ok(out)
        })?;
        // SAFETY: non-null (checked); writable (the caller's promise).
        unsafe { write_out(stats, out) };
        Ok(TCPX_OK)
    })
}

/// `TCPX_OK` while the connection works; once it failed (peer gone, timeout, plugin error),
/// the status of that failure, with `tcpx_last_error()` naming it. Thread safety: any thread.
#[no_mangle]
pub extern "C" fn tcpx_connection_status(connection: tcpx_connection) -> tcpx_status {
    guard("tcpx_connection_status", || {
        objects::connection(connection)?.with(|c| match c.error() {
            None => Ok(TCPX_OK),
            Some(e) => Err(e.into()),
        })
    })
}

/// Closes gracefully: waits (at most the configured timeout) for the connection's pending
/// transfers to finish, then closes it as `tcpx_connection_destroy` does. Returns
/// `TCPX_ERR_TIMEOUT` if some were still pending (they then failed with `TCPX_ERR_CLOSED`); the
/// handle is stale afterwards either way. Thread safety: any thread; posting on the connection
/// from other threads meanwhile makes the wait longer, not unsafe.
#[no_mangle]
pub extern "C" fn tcpx_connection_close(connection: tcpx_connection) -> tcpx_status {
    guard("tcpx_connection_close", || {
        let conn = objects::connection(connection)?;
        let healthy = conn.with(|c| Ok(c.error().is_none()))?;
        let mut outcome = Ok(TCPX_OK);
        if healthy {
            let limit = ENDPOINTS
                .get(conn.endpoint)
                .map(|e| e.endpoint.config().timeout)
                .unwrap_or(Duration::from_secs(30));
            let deadline = Instant::now() + limit;
            // The read lock is taken per check, never across the sleep, so a concurrent
            // destroy is not held up.
            while conn.with(|c| Ok(c.in_flight()))? > 0 {
                if Instant::now() >= deadline {
                    outcome = Err(CapiError::new(
                        TCPX_ERR_TIMEOUT,
                        format!("transfers were still pending after {limit:?}; they were failed"),
                    ));
                    break;
                }
                std::thread::sleep(Duration::from_micros(500));
            }
        }
        let _ = CONNECTIONS.remove(connection.id);
        conn.shut_down();
        outcome
    })
}

/// Closes the connection now: pending transfers fail with `TCPX_ERR_CLOSED`, the peer is
/// told, and once this returns no engine touches the connection's memory any more (each engine
/// is given the configured timeout to let go, so this never blocks longer). The handle is
/// stale afterwards; transfer handles stay valid until released.
/// Thread safety: any thread; calls racing with it on the same connection fail with
/// `TCPX_ERR_STALE_HANDLE` or `TCPX_ERR_CLOSED` (destroy waits for calls already inside to
/// return, which never block).
#[no_mangle]
pub extern "C" fn tcpx_connection_destroy(connection: tcpx_connection) -> tcpx_status {
    guard("tcpx_connection_destroy", || {
        let conn = CONNECTIONS.remove(connection.id)?;
        conn.shut_down();
        Ok(TCPX_OK)
    })
}
