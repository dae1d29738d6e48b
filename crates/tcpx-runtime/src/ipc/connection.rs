//! [`LocalConnection`]: a peer endpoint of the same host, reached through a Unix socket, and
//! the one-sided `*_ipc` operations on its advertised GPU memory.

use std::thread::JoinHandle;
use std::time::Instant;

use std::sync::Arc;

use super::descriptor::IpcDescriptor;
use super::link::LocalLink;
use super::op::{submit, Piece};
use super::wire::Msg;
use crate::error::{Direction, Error, LocalErrorKind, Result};
use crate::registry::Region;
use crate::transfer::Transfer;

/// What a local peer said about itself, and what the kernel says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalPeer {
    /// Its process id (the kernel's, `SO_PEERCRED`).
    pub pid: u32,
    /// Its endpoint's instance id (the owner its descriptors name).
    pub instance: u64,
    /// Its GPU ordinal, in its own numbering.
    pub gpu_ordinal: Option<u32>,
    /// Its GPU's PCI bus id.
    pub gpu_bus: Option<String>,
    /// Its hostname.
    pub hostname: String,
}

/// One piece of a vectored same-host operation on registered memory: `len` bytes at
/// `local_offset` in `local`, and at `remote_offset` in the range `remote` names.
#[derive(Debug, Clone, Copy)]
pub struct IpcSegment<'a> {
    /// This side's memory (CUDA, or host memory: then the endpoint's GPU copies).
    pub local: &'a Region,
    /// Offset in `local`.
    pub local_offset: usize,
    /// The peer's advertised range.
    pub remote: &'a IpcDescriptor,
    /// Offset in the advertised range.
    pub remote_offset: u64,
    /// Bytes.
    pub len: usize,
}

impl<'a> IpcSegment<'a> {
    /// A segment (see the fields).
    pub fn new(
        local: &'a Region,
        local_offset: usize,
        remote: &'a IpcDescriptor,
        remote_offset: u64,
        len: usize,
    ) -> Self {
        Self {
            local,
            local_offset,
            remote,
            remote_offset,
            len,
        }
    }
}

/// One piece of a vectored same-host operation on caller-owned memory (bindings:
/// UCCL's `writev_ipc(conn_id, ptr_v, size_v, info_v)`).
#[derive(Debug, Clone, Copy)]
pub struct IpcPtrSegment<'a> {
    /// This side's address: CUDA device memory, or host memory (pinned for speed).
    pub ptr: *mut u8,
    /// The peer's advertised range.
    pub remote: &'a IpcDescriptor,
    /// Offset in the advertised range.
    pub remote_offset: u64,
    /// Bytes.
    pub len: usize,
}

/// A connection to an endpoint of the same host ([`crate::Endpoint::accept_local`],
/// [`crate::Endpoint::connect_local`]): one-sided writes and reads of the peer's advertised
/// GPU memory through CUDA IPC, performed by this process's copy engines with no call on
/// the peer.
///
/// Each operation returns a [`Transfer`] at once; polling or waiting on it is what observes
/// the copies' completion (it fails with the configured timeout when they run past it). The
/// first operation on a descriptor asks the owner to confirm it and maps its allocation;
/// later ones on the same allocation reuse both. Errors: a range outside the descriptor
/// ([`Error::InvalidArgument`]); a descriptor of another endpoint, an unknown, revoked or
/// altered one ([`LocalErrorKind::Access`]); a handle the driver will not open or a failed
/// copy ([`LocalErrorKind::Cuda`]); a peer that left before an operation finished
/// ([`LocalErrorKind::PeerClosed`]).
///
/// Dropping it tells the peer (which closes its mappings of this side's memory and fails its
/// later operations), closes this side's mappings after waiting for their copies, and fails
/// operations not yet seen complete with [`LocalErrorKind::Closed`].
pub struct LocalConnection {
    link: Arc<LocalLink>,
    watcher: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for LocalConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalConnection")
            .field("link", &self.link)
            .finish()
    }
}

impl LocalConnection {
    pub(crate) fn new(link: Arc<LocalLink>, watcher: JoinHandle<()>) -> Self {
        Self {
            link,
            watcher: Some(watcher),
        }
    }

    /// The peer.
    pub fn peer(&self) -> LocalPeer {
        let h = &self.link.peer;
        LocalPeer {
            pid: self.link.peer_pid,
            instance: h.instance,
            gpu_ordinal: h.gpu_ordinal,
            gpu_bus: h.gpu_bus.clone(),
            hostname: h.hostname.clone(),
        }
    }

    /// Why the connection is over (the peer left, said goodbye, broke the protocol); `None`
    /// while it is open.
    pub fn error(&self) -> Option<Error> {
        self.link.gone_error()
    }

    /// Peer allocations mapped by this connection (each opened once, reused by every later
    /// operation on it).
    pub fn mapped_allocations(&self) -> usize {
        self.link
            .cache
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .mappings()
    }

    /// Descriptors the peer confirmed on this connection (each asked once, at its first use).
    pub fn confirmed_descriptors(&self) -> usize {
        self.link
            .cache
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .grants()
    }

    /// Writes `len` bytes from `src[src_offset..]` to `remote_offset` in the range `remote`
    /// names.
    pub fn write_ipc(
        &self,
        src: &Region,
        src_offset: usize,
        remote: &IpcDescriptor,
        remote_offset: u64,
        len: usize,
    ) -> Result<Transfer> {
        self.writev_ipc(&[IpcSegment::new(src, src_offset, remote, remote_offset, len)])
    }

    /// Reads `len` bytes from `remote_offset` in the range `remote` names into
    /// `dst[dst_offset..]`.
    pub fn read_ipc(
        &self,
        dst: &Region,
        dst_offset: usize,
        remote: &IpcDescriptor,
        remote_offset: u64,
        len: usize,
    ) -> Result<Transfer> {
        self.readv_ipc(&[IpcSegment::new(dst, dst_offset, remote, remote_offset, len)])
    }

    /// Pays ahead what the first [`write_ipc`](Self::write_ipc) / [`read_ipc`](Self::read_ipc)
    /// naming `remote` would: the owner's confirmation of the descriptor, the copying GPU's
    /// streams and list kernel, the mapping of the allocation. `gpu` is the GPU of the local
    /// memory that will be copied (`None`: the endpoint's GPU, else GPU 0). The same errors as
    /// a transfer naming `remote` (an unknown, revoked or foreign descriptor is
    /// [`Error::Local`] with [`LocalErrorKind::Access`]). Optional: transfers do all of this
    /// themselves the first time.
    pub fn prepare_ipc(&self, remote: &IpcDescriptor, gpu: Option<usize>) -> Result<()> {
        super::op::prepare(&self.link, remote, gpu)
    }

    /// Writes every segment; one transfer for all of them.
    pub fn writev_ipc(&self, segments: &[IpcSegment<'_>]) -> Result<Transfer> {
        self.on_regions(Direction::Send, segments)
    }

    /// Reads every segment; one transfer for all of them.
    pub fn readv_ipc(&self, segments: &[IpcSegment<'_>]) -> Result<Transfer> {
        self.on_regions(Direction::Recv, segments)
    }

    fn on_regions(&self, direction: Direction, segments: &[IpcSegment<'_>]) -> Result<Transfer> {
        let mut pieces = Vec::with_capacity(segments.len());
        let mut regions = Vec::with_capacity(segments.len());
        // The GPU of the last region seen: a KV list names one region a thousand times, and
        // asking the driver where foreign CUDA memory lives costs a call per ask.
        let mut last_gpu: Option<(u64, Option<usize>)> = None;
        for (i, s) in segments.iter().enumerate() {
            s.local
                .memory()
                .check_range("ipc", s.local_offset, s.len)
                .map_err(|e| Error::InvalidArgument(format!("segment {i}: local memory: {e}")))?;
            let base = s.local.as_ptr() as u64;
            let local_gpu = match last_gpu {
                Some((id, gpu)) if id == s.local.inner.id => gpu,
                _ => {
                    let gpu = match s.local.cuda_device() {
                        Some(d) => Some(d.ordinal()),
                        None if s.local.kind() == tcpx::MemoryKind::Cuda => {
                            tcpx::cuda::pointer_device(s.local.as_ptr())
                        }
                        None => None,
                    };
                    last_gpu = Some((s.local.inner.id, gpu));
                    gpu
                }
            };
            pieces.push(Piece {
                local: base + s.local_offset as u64,
                local_gpu,
                remote: s.remote,
                remote_offset: s.remote_offset,
                len: s.len,
            });
            if !regions
                .iter()
                .any(|r: &Region| r.inner.id == s.local.inner.id)
            {
                regions.push(s.local.clone());
            }
        }
        // SAFETY: every local range lies inside a region (checked above) that the
        // operation keeps alive until its copies are done.
        unsafe { submit(&self.link, direction, &pieces, regions) }
    }

    /// Writes `len` bytes at `src` (CUDA device memory, or host memory) to `remote_offset`
    /// in the range `remote` names.
    ///
    /// # Safety
    /// `[src, src + len)` is memory of this process that stays valid and readable until the
    /// returned transfer finished or was dropped.
    pub unsafe fn write_ipc_ptr(
        &self,
        src: *const u8,
        len: usize,
        remote: &IpcDescriptor,
        remote_offset: u64,
    ) -> Result<Transfer> {
        let seg = IpcPtrSegment {
            ptr: src.cast_mut(),
            remote,
            remote_offset,
            len,
        };
        // SAFETY: forwarded from this function's contract.
        unsafe { self.writev_ipc_ptr(&[seg]) }
    }

    /// Reads `len` bytes from `remote_offset` in the range `remote` names into `dst`.
    ///
    /// # Safety
    /// `[dst, dst + len)` is memory of this process that stays valid and writable, with no
    /// Rust reference into it, until the returned transfer finished or was dropped.
    pub unsafe fn read_ipc_ptr(
        &self,
        dst: *mut u8,
        len: usize,
        remote: &IpcDescriptor,
        remote_offset: u64,
    ) -> Result<Transfer> {
        let seg = IpcPtrSegment {
            ptr: dst,
            remote,
            remote_offset,
            len,
        };
        // SAFETY: forwarded from this function's contract.
        unsafe { self.readv_ipc_ptr(&[seg]) }
    }

    /// Writes every segment; one transfer for all of them.
    ///
    /// # Safety
    /// As [`write_ipc_ptr`](Self::write_ipc_ptr), for every segment.
    pub unsafe fn writev_ipc_ptr(&self, segments: &[IpcPtrSegment<'_>]) -> Result<Transfer> {
        // SAFETY: forwarded from this function's contract.
        unsafe { self.on_pointers(Direction::Send, segments) }
    }

    /// Reads every segment; one transfer for all of them.
    ///
    /// # Safety
    /// As [`read_ipc_ptr`](Self::read_ipc_ptr), for every segment.
    pub unsafe fn readv_ipc_ptr(&self, segments: &[IpcPtrSegment<'_>]) -> Result<Transfer> {
        // SAFETY: forwarded from this function's contract.
        unsafe { self.on_pointers(Direction::Recv, segments) }
    }

    /// # Safety
    /// As [`writev_ipc_ptr`](Self::writev_ipc_ptr) / [`readv_ipc_ptr`](Self::readv_ipc_ptr).
    unsafe fn on_pointers(
        &self,
        direction: Direction,
        segments: &[IpcPtrSegment<'_>],
    ) -> Result<Transfer> {
        let mut pieces = Vec::with_capacity(segments.len());
        // The last CUDA allocation seen (start, size, GPU): a KV list's blocks lie in one or
        // a few allocations, and asking the driver (two calls per pointer) cost more than the
        // copies of a list of small blocks.
        let mut last: Option<(u64, usize, usize)> = None;
        for (i, s) in segments.iter().enumerate() {
            if s.ptr.is_null() && s.len > 0 {
                return Err(Error::InvalidArgument(format!(
                    "segment {i}: the local pointer is null"
                )));
            }
            let at = s.ptr as u64;
            let known = last.filter(|&(start, size, _)| at >= start && at - start < size as u64);
            let (local_gpu, allocation) = match known {
                Some((start, size, gpu)) => (Some(gpu), Some((start, size))),
                None => {
                    let gpu = tcpx::cuda::pointer_device(s.ptr);
                    let allocation = gpu.and_then(|_| tcpx::cuda::pointer_allocation(s.ptr));
                    if let (Some(gpu), Some((start, size))) = (gpu, allocation) {
                        last = Some((start, size, gpu));
                    }
                    (gpu, allocation)
                }
            };
            // Device memory: the driver knows the allocation, so a range running past it is
            // caught here rather than by a faulting copy.
            if let (Some(_), Some((start, size))) = (local_gpu, allocation) {
                let end = (s.ptr as u64).checked_add(s.len as u64);
                if end.is_none_or(|end| end > start + size as u64) {
                    return Err(Error::InvalidArgument(format!(
                        "segment {i}: {} bytes at {:p} run past the end of their CUDA \
                         allocation ({start:#x}+{size})",
                        s.len, s.ptr
                    )));
                }
            }
            pieces.push(Piece {
                local: s.ptr as u64,
                local_gpu,
                remote: s.remote,
                remote_offset: s.remote_offset,
                len: s.len,
            });
        }
        // SAFETY: forwarded from this function's contract.
        unsafe { submit(&self.link, direction, &pieces, Vec::new()) }
    }
}

impl Drop for LocalConnection {
    fn drop(&mut self) {
        let link = &self.link;
        // Tell the peer first, while the link is open: it closes its mappings of this side's
        // memory before it acknowledges.
        if link.gone_error().is_none() {
            let asked = link.ask(|req| Msg::Goodbye {
                req,
                reason: "closed by its owner".into(),
            });
            if let Ok(waiter) = asked {
                if let Err(e) = link.answer_by(waiter, Instant::now() + link.shared.timeout) {
                    tracing::warn!(target: "tcpx_runtime::ipc", peer = %link.label(), "goodbye not acknowledged: {e}");
                }
            }
        }
        link.mark_gone(
            LocalErrorKind::Closed,
            "the connection was closed by this side",
        );
        link.retire_all();
        link.shutdown();
        if let Some(w) = self.watcher.take() {
            let _ = w.join();
        }
    }
}
