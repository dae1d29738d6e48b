//! Same-host connections of a Python endpoint: UCCL's intra-node family (`connect_local`,
//! `accept_local`, `advertise_ipc`, `write_ipc`, ...) over the runtime's CUDA IPC route
//! (`tcpx_runtime::LocalConnection`). The runtime decides everything (rendezvous, handle
//! export and mapping, copies, errors); this only turns UCCL's integers and info blobs into
//! its objects.
//!
//! Local connections share the connection-id space of network ones, so a `conn_id` names
//! exactly one of them and a call on the wrong kind says so.

use std::sync::Arc;
use std::time::Duration;

use tcpx_runtime::ipc::IpcPtrSegment;
use tcpx_runtime::{IpcDescriptor, LocalAddr, LocalConnection, Transfer};

use crate::core::{Advertised, Core, LocalState};
use crate::errors::{Failure, Outcome};

/// One piece of a `*_ipc` call: `size` bytes at this process's `ptr`, and the peer's info
/// blob (`advertise_ipc`'s bytes) naming the remote range (from its start).
pub struct IpcPiece<'a> {
    /// This side's address (CUDA device memory, or host memory: pinned is faster).
    pub ptr: u64,
    /// Bytes.
    pub size: u64,
    /// The peer's `advertise_ipc` info.
    pub info: &'a [u8],
    /// Where in the advertised range: the peer's address of the first byte (UCCL
    /// descriptors carry owner addresses), or `None` for the range's start.
    pub remote_addr: Option<u64>,
}

fn not_local(conn_id: u64) -> Failure {
    Failure::bad(format!(
        "conn_id {conn_id} is not a same-host connection (make one with connect_local / \
         accept_local; connect / accept make network connections)"
    ))
}

/// The bus id `connect_local` dials: a PCI bus id as `parse_metadata` returns it, or a CUDA
/// ordinal of this host (metadata of older peers carries only the index).
fn gpu_addr(remote_gpu_bdf: &str) -> Outcome<LocalAddr> {
    let text = remote_gpu_bdf.trim();
    if let Ok(ordinal) = text.parse::<usize>() {
        let bus = tcpx::cuda::device_pci_bus_id(ordinal).map_err(|e| {
            Failure::bad(format!(
                "remote_gpu_bdf {text:?}: GPU {ordinal} of this host has no bus id ({e})"
            ))
        })?;
        return Ok(LocalAddr::Gpu(bus));
    }
    if tcpx_runtime::ipc::normalize_bus_id(text).is_none() {
        return Err(Failure::bad(format!(
            "remote_gpu_bdf {text:?} is not a PCI bus id (like 0000:8a:00.0) or a GPU index"
        )));
    }
    Ok(LocalAddr::Gpu(text.to_owned()))
}

impl Core {
    fn locals(&self) -> Outcome<&LocalState> {
        Ok(&self.state()?.local)
    }

    fn add_local(&self, conn: LocalConnection) -> Outcome<u64> {
        let id = self.new_conn_id()?;
        self.locals()?
            .conns
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, Arc::new(conn));
        Ok(id)
    }

    /// Connects to the endpoint of this host that holds GPU `remote_gpu_bdf` (the first
    /// endpoint on that GPU claims its name when it accepts locally).
    pub fn connect_local(&self, remote_gpu_bdf: &str) -> Outcome<u64> {
        let addr = gpu_addr(remote_gpu_bdf)?;
        let conn = self.endpoint()?.connect_local(&addr)?;
        self.add_local(conn)
    }

    /// Waits up to `wait` for a peer of this host; its connection id and GPU bus id (empty
    /// when it has no GPU).
    pub fn accept_local(&self, wait: Duration) -> Outcome<(u64, String)> {
        let conn = self.endpoint()?.accept_local_timeout(wait)?;
        let bus = conn.peer().gpu_bus.unwrap_or_default();
        Ok((self.add_local(conn)?, bus))
    }

    /// The same-host connection `conn_id`.
    pub fn local_conn(&self, conn_id: u64) -> Outcome<Arc<LocalConnection>> {
        if let Some(c) = self
            .locals()?
            .conns
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&conn_id)
        {
            return Ok(c.clone());
        }
        self.endpoint()?;
        Err(not_local(conn_id))
    }

    /// Closes same-host connection `conn_id`; whether it existed.
    pub fn remove_local(&self, conn_id: u64) -> Outcome<bool> {
        let conn = self
            .locals()?
            .conns
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&conn_id);
        Ok(conn.is_some())
    }

    /// Advertises `size` bytes of CUDA memory at `ptr` for the peer of same-host connection
    /// `conn_id` (any local peer of this endpoint may use the descriptor) and returns the
    /// info blob to hand it. The same range advertised again returns the same blob while
    /// it lies in the same allocation.
    ///
    /// # Safety
    /// The memory stays allocated while peers may use the descriptor (until the endpoint
    /// closes), as in UCCL.
    pub unsafe fn advertise_ipc(
        &self,
        conn_id: u64,
        ptr: u64,
        size: u64,
    ) -> Outcome<[u8; IpcDescriptor::BYTES]> {
        self.local_conn(conn_id)?;
        // SAFETY: forwarded from this function's contract.
        unsafe { self.advertise_range(ptr, size) }
    }

    /// [`advertise_ipc`](Self::advertise_ipc) without a connection (the descriptor API
    /// advertises CUDA registrations up front, for whichever local peer comes).
    ///
    /// # Safety
    /// As [`advertise_ipc`](Self::advertise_ipc).
    pub unsafe fn advertise_range(
        &self,
        ptr: u64,
        size: u64,
    ) -> Outcome<[u8; IpcDescriptor::BYTES]> {
        let len = usize::try_from(size)
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| Failure::bad(format!("advertise_ipc: size {size} is not usable")))?;
        if ptr == 0 {
            return Err(Failure::bad("advertise_ipc: the pointer is null"));
        }
        let allocation = tcpx::cuda::pointer_allocation(ptr as *const u8);
        let endpoint = self.endpoint()?;
        let mut adverts = self
            .locals()?
            .adverts
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(a) = adverts.get(&(ptr, size)) {
            if a.allocation == allocation {
                return Ok(a.descriptor.to_bytes());
            }
            // Freed and allocated again at the same address: the old handle is stale.
            let stale = a.descriptor;
            adverts.remove(&(ptr, size));
            endpoint.revoke_ipc(&stale)?;
        }
        // SAFETY: forwarded from this function's contract.
        let descriptor = unsafe { endpoint.advertise_ipc_ptr(ptr as *mut u8, len) }?;
        let bytes = descriptor.to_bytes();
        adverts.insert(
            (ptr, size),
            Advertised {
                descriptor,
                allocation,
            },
        );
        Ok(bytes)
    }

    /// Writes (`write`) or reads every piece through same-host connection `conn_id`: one
    /// transfer for all of them.
    ///
    /// # Safety
    /// Every `[ptr, ptr + size)` is memory of this process that stays valid (and, for a
    /// read, unaliased) until the returned transfer finished or was dropped.
    pub unsafe fn ipc(
        &self,
        write: bool,
        conn_id: u64,
        pieces: &[IpcPiece<'_>],
    ) -> Outcome<Transfer> {
        let conn = self.local_conn(conn_id)?;
        // Blocks of one advertised range repeat its blob: each run is decoded once.
        let (descriptors, which) = IpcDescriptor::decode_runs(pieces.iter().map(|p| p.info))
            .map_err(|(i, e)| {
                Failure::bad(format!(
                    "info {i} ({} bytes) is not an advertise_ipc blob: {e}",
                    pieces[i].info.len()
                ))
            })?;
        let mut segments = Vec::with_capacity(pieces.len());
        for (i, (p, &at)) in pieces.iter().zip(&which).enumerate() {
            let d = &descriptors[at];
            let len = usize::try_from(p.size)
                .map_err(|_| Failure::bad(format!("piece {i}: size {} too large", p.size)))?;
            let remote_offset = match p.remote_addr {
                None => 0,
                Some(addr) => addr.checked_sub(d.address()).ok_or_else(|| {
                    Failure::bad(format!(
                        "piece {i}: remote address {addr:#x} lies before its advertised range \
                         ({:#x}+{})",
                        d.address(),
                        d.len()
                    ))
                })?,
            };
            segments.push(IpcPtrSegment {
                ptr: p.ptr as *mut u8,
                remote: d,
                remote_offset,
                len,
            });
        }
        // SAFETY: forwarded from this function's contract; the runtime checks each range
        // against its descriptor and, for device memory, against its CUDA allocation.
        let t = unsafe {
            if write {
                conn.writev_ipc_ptr(&segments)
            } else {
                conn.readv_ipc_ptr(&segments)
            }
        }?;
        Ok(t)
    }

    /// Drops every same-host connection and forgets the adverts (the endpoint revokes them
    /// when it goes).
    pub(crate) fn close_locals(&self) {
        let Ok(local) = self.locals() else { return };
        let conns = std::mem::take(&mut *local.conns.write().unwrap_or_else(|p| p.into_inner()));
        drop(conns);
        local
            .adverts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }
}
