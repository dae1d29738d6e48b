//! The objects behind the C handles — endpoints, connections, regions — and their handle
//! tables. The entry points (`endpoint`, `connection`, `memory`, `onesided`, `transfer`) all
//! reach each other's objects through here, so none of them imports another: destroying an
//! endpoint releases its connections and regions, a connection resolves regions, and each
//! checks its endpoint is still alive.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use tcpx_runtime::onesided::Descriptor;
use tcpx_runtime::{Connection, Endpoint, IpcDescriptor, LocalConnection, Region, Transfer};

use crate::convert::fill_text;
use crate::convert::{to_usize, write_out};
use crate::error::{CapiError, CapiResult};
use crate::handles::Table;
use crate::tcpx_status::{self, *};
use crate::{tcpx_connection, tcpx_endpoint, tcpx_peer_info, tcpx_region, tcpx_segment};

/// An endpoint and the notifications taken from it but not yet handed to C (the runtime
/// drains all at once; C takes them one by one).
pub(crate) struct EndpointObj {
    pub(crate) endpoint: Endpoint,
    pub(crate) notifications: Mutex<VecDeque<(SocketAddr, Vec<u8>)>>,
    /// Names this endpoint published (`tcpx_endpoint_publish`), each with the store holding
    /// it: the store keeps its lease alive, and dropping it (unpublish, or the endpoint's
    /// destruction) revokes the lease, so the key goes with it.
    pub(crate) published: Mutex<Vec<Publication>>,
}

/// The names an endpoint published in one store: the store URL as given, the names, and the
/// open store (one lease for all of them).
pub(crate) struct Publication {
    pub(crate) url: String,
    pub(crate) names: Vec<String>,
    pub(crate) store: Box<dyn tcpx_runtime::Store>,
}

pub(crate) static ENDPOINTS: Table<EndpointObj> = Table::new(1, "tcpx_endpoint");

/// The endpoint `handle` names.
pub(crate) fn endpoint(handle: tcpx_endpoint) -> CapiResult<Arc<EndpointObj>> {
    ENDPOINTS.get(handle.id)
}

/// A connection, owned so that destroying it drops the runtime connection at once, whoever
/// else holds the object: calls take the read lock for their (short) duration, destroy takes
/// the write lock and empties it, so once destroy returns no engine works for it any more.
pub(crate) struct ConnectionObj {
    /// The id of the endpoint it was made on.
    pub(crate) endpoint: u64,
    conn: RwLock<Option<Connection>>,
}

pub(crate) static CONNECTIONS: Table<ConnectionObj> = Table::new(2, "tcpx_connection");

impl ConnectionObj {
    /// Runs `f` on the live connection.
    pub(crate) fn with<R>(&self, f: impl FnOnce(&Connection) -> CapiResult<R>) -> CapiResult<R> {
        let guard = self.conn.read().unwrap_or_else(|p| p.into_inner());
        match guard.as_ref() {
            Some(conn) => f(conn),
            None => Err(CapiError::new(
                TCPX_ERR_CLOSED,
                "the connection was closed by this side",
            )),
        }
    }

    /// Drops the runtime connection now: pending transfers fail with `TCPX_ERR_CLOSED`, the
    /// peer is told, the engines let go of its comms (each within the timeout).
    pub(crate) fn shut_down(&self) {
        let taken = self.conn.write().unwrap_or_else(|p| p.into_inner()).take();
        drop(taken);
    }
}

/// Hands a new connection of endpoint `endpoint` to C. If the endpoint was destroyed while the
/// connection was being set up, the connection is closed and the call fails.
pub(crate) fn adopt_connection(endpoint: u64, conn: Connection) -> CapiResult<tcpx_connection> {
    let obj = Arc::new(ConnectionObj {
        endpoint,
        conn: RwLock::new(Some(conn)),
    });
    let id = CONNECTIONS.insert(obj.clone());
    // Checked after inserting: a destroy that ran before this saw no connection to close.
    if ENDPOINTS.get(endpoint).is_err() {
        let _ = CONNECTIONS.remove(id);
        obj.shut_down();
        return Err(CapiError::new(
            TCPX_ERR_STALE_HANDLE,
            "the endpoint was destroyed while the connection was being set up; it was closed",
        ));
    }
    Ok(tcpx_connection { id })
}

/// A same-host connection, owned like [`ConnectionObj`]: destroy empties it under the write
/// lock, so once destroy returns the runtime connection is gone (its peer told, its mappings
/// closed).
pub(crate) struct LocalConnObj {
    /// The id of the endpoint it was made on.
    pub(crate) endpoint: u64,
    conn: RwLock<Option<LocalConnection>>,
}

pub(crate) static LOCALS: Table<LocalConnObj> = Table::new(5, "tcpx_local_connection");

impl LocalConnObj {
    /// Runs `f` on the live connection.
    pub(crate) fn with<R>(
        &self,
        f: impl FnOnce(&LocalConnection) -> CapiResult<R>,
    ) -> CapiResult<R> {
        let guard = self.conn.read().unwrap_or_else(|p| p.into_inner());
        match guard.as_ref() {
            Some(conn) => f(conn),
            None => Err(CapiError::new(
                TCPX_ERR_CLOSED,
                "the local connection was closed by this side",
            )),
        }
    }

    /// Drops the runtime connection now.
    pub(crate) fn shut_down(&self) {
        let taken = self.conn.write().unwrap_or_else(|p| p.into_inner()).take();
        drop(taken);
    }
}

/// Hands a new same-host connection of endpoint `endpoint` to C (closed again, and the call
/// failed, if the endpoint was destroyed meanwhile).
pub(crate) fn adopt_local(endpoint: u64, conn: LocalConnection) -> CapiResult<u64> {
    let obj = Arc::new(LocalConnObj {
        endpoint,
        conn: RwLock::new(Some(conn)),
    });
    let id = LOCALS.insert(obj.clone());
    if ENDPOINTS.get(endpoint).is_err() {
        let _ = LOCALS.remove(id);
        obj.shut_down();
        return Err(CapiError::new(
            TCPX_ERR_STALE_HANDLE,
            "the endpoint was destroyed while the local connection was being set up; it was closed",
        ));
    }
    Ok(id)
}

/// What C learns about a connection's peer.
pub(crate) fn peer_info(conn: &Connection) -> tcpx_peer_info {
    let mut info = tcpx_peer_info {
        address: [0; crate::TCPX_ADDRESS_MAX],
        gpu_index: conn.peer_gpu().map_or(-1, |g| g as i32),
        channels: u32::from(conn.channels()),
    };
    fill_text(&mut info.address, &conn.peer().to_string());
    info
}

/// The connection `handle` names.
pub(crate) fn connection(handle: tcpx_connection) -> CapiResult<Arc<ConnectionObj>> {
    CONNECTIONS.get(handle.id)
}

/// Set in [`RegionObj::state`] while a destroy checks the region; the low bits count calls
/// submitting a transfer on it.
pub(crate) const DESTROYING: u64 = 1 << 63;
/// Finished transfers are dropped from a region's list once it holds this many.
const PRUNE_AT: usize = 32;

/// A region and what keeps it from being destroyed under a transfer.
pub(crate) struct RegionObj {
    /// The id of the endpoint it belongs to.
    pub(crate) endpoint: u64,
    pub(crate) region: Region,
    pub(crate) state: AtomicU64,
    /// Transfers submitted on it, unfinished ones at least.
    pub(crate) users: Mutex<Vec<Transfer>>,
    /// Its current descriptor, if advertised (advertising again retires the previous one).
    pub(crate) descriptor: Mutex<Option<Descriptor>>,
    /// Its same-host descriptors not yet revoked (each IPC advertisement is its own).
    pub(crate) ipc: Mutex<Vec<IpcDescriptor>>,
}

pub(crate) static REGIONS: Table<RegionObj> = Table::new(3, "tcpx_region");

impl RegionObj {
    fn new(endpoint: u64, region: Region) -> Self {
        Self {
            endpoint,
            region,
            state: AtomicU64::new(0),
            users: Mutex::new(Vec::new()),
            descriptor: Mutex::new(None),
            ipc: Mutex::new(Vec::new()),
        }
    }

    /// Records `transfer` as using this region (until it finishes).
    pub(crate) fn track(&self, transfer: &Transfer) {
        let mut users = self.users.lock().unwrap_or_else(|p| p.into_inner());
        if users.len() >= PRUNE_AT {
            users.retain(|t| !t.is_finished());
        }
        users.push(transfer.clone());
    }

    /// Revokes the region's descriptors on `endpoint`: the network one, and every same-host
    /// one (waiting, at most the endpoint's timeout each, for local peers to close their
    /// mappings, so that the memory may be freed afterwards).
    pub(crate) fn revoke_on(&self, endpoint: &Endpoint) {
        let taken = self
            .descriptor
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(d) = taken {
            endpoint.revoke(&d);
        }
        let ipc = std::mem::take(&mut *self.ipc.lock().unwrap_or_else(|p| p.into_inner()));
        for d in ipc {
            if let Err(e) = endpoint.revoke_ipc(&d) {
                log_cleanup_failure(&format!("revoking a same-host descriptor: {e}"));
            }
        }
    }
}

/// Reports a failure no caller can receive (a cleanup path) on stderr.
fn log_cleanup_failure(what: &str) {
    eprintln!("libtcpx: {what}");
}

/// A region marked as having a transfer submitted on it, for the guard's lifetime.
pub(crate) struct InUse(Arc<RegionObj>);

impl Deref for InUse {
    type Target = RegionObj;
    fn deref(&self) -> &RegionObj {
        &self.0
    }
}

impl Drop for InUse {
    fn drop(&mut self) {
        self.0.state.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Looks up every segment's region, checks it belongs to endpoint `endpoint` and that the
/// range lies inside it, and marks it in use.
///
/// A KV list names one or a few regions a thousand times over: a run of segments on one
/// region looks it up once (the table's lock, an `Arc` clone) and marks it once more per
/// segment (one atomic add). Looking each segment up cost 47 µs for a 1024-block NIXL list
/// (H200), a quarter of the whole same-host transfer.
pub(crate) fn resolve(endpoint: u64, segments: &[tcpx_segment]) -> CapiResult<Vec<InUse>> {
    if segments.is_empty() {
        return Err(CapiError::invalid("the segment list is empty"));
    }
    let mut out: Vec<InUse> = Vec::with_capacity(segments.len());
    let mut previous_id = None;
    for (i, s) in segments.iter().enumerate() {
        let in_use = match out.last() {
            Some(last) if previous_id == Some(s.region.id) => mark(last.0.clone(), i)?,
            _ => {
                let obj = REGIONS
                    .get(s.region.id)
                    .map_err(|e| CapiError::new(e.status, format!("segment {i}: {}", e.message)))?;
                let in_use = mark(obj, i)?;
                if in_use.endpoint != endpoint {
                    return Err(CapiError::invalid(format!(
                        "segment {i}: the region belongs to another endpoint than the connection"
                    )));
                }
                in_use
            }
        };
        previous_id = Some(s.region.id);
        let (offset, len) = (to_usize(s.offset, "offset")?, to_usize(s.len, "len")?);
        let size = in_use.region.len();
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(CapiError::invalid(format!(
                "segment {i}: range {offset}+{len} lies outside the region of {size} bytes"
            )));
        }
        out.push(in_use);
    }
    Ok(out)
}

/// Marks `obj` in use for segment `i`, unless a destroy is checking it.
fn mark(obj: Arc<RegionObj>, i: usize) -> CapiResult<InUse> {
    if obj.state.fetch_add(1, Ordering::AcqRel) & DESTROYING != 0 {
        obj.state.fetch_sub(1, Ordering::AcqRel);
        return Err(CapiError::new(
            TCPX_ERR_STALE_HANDLE,
            format!("segment {i}: the region is being destroyed by another thread"),
        ));
    }
    Ok(InUse(obj))
}

/// Records `transfer` on every region of `regions` (as [`resolve`] returned them), once per
/// region: a region repeated a thousand times in a list is tracked once, not a thousand
/// times (each a lock and a push, and past [`PRUNE_AT`] a scan of the region's list that
/// polled the unfinished transfer again and again: 76 µs for a 1024-block list).
pub(crate) fn track_all(regions: &[InUse], transfer: &Transfer) {
    /// Distinct regions remembered per list; a list of more distinct regions than this may
    /// track a region twice, which is harmless (the list is pruned as transfers finish).
    const REMEMBERED: usize = 16;
    let mut tracked: Vec<*const RegionObj> = Vec::with_capacity(REMEMBERED.min(regions.len()));
    for r in regions {
        let ptr = Arc::as_ptr(&r.0);
        if tracked.contains(&ptr) {
            continue;
        }
        if tracked.len() < REMEMBERED {
            tracked.push(ptr);
        }
        r.track(transfer);
    }
}

/// Hands a new region of endpoint `endpoint` to C through `out` (checked non-null by the
/// caller); fails, releasing it, if the endpoint was destroyed meanwhile.
pub(crate) fn adopt_region(
    endpoint: tcpx_endpoint,
    region: Region,
    out: *mut tcpx_region,
) -> CapiResult<tcpx_status> {
    let id = REGIONS.insert(Arc::new(RegionObj::new(endpoint.id, region)));
    // A destroy of the endpoint that ran meanwhile saw no region to release.
    if ENDPOINTS.get(endpoint.id).is_err() {
        let _ = REGIONS.remove(id);
        return Err(CapiError::new(
            TCPX_ERR_STALE_HANDLE,
            "the endpoint was destroyed during the call",
        ));
    }
    // SAFETY: the callers checked `out` for null; writable (the C caller's promise).
    unsafe { write_out(out, tcpx_region { id }) };
    Ok(TCPX_OK)
}
