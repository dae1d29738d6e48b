//! One same-host write or read: checking every piece, confirming descriptors with the owner
//! (once per key and connection), mapping allocations (once per device, handle and
//! connection), queuing the copies on the device's pool, and the [`Drive`] that finishes
//! the operation's [`Transfer`] when its events say so.
//!
//! Order matters for the error rules: everything a peer could get wrong (descriptor of
//! another endpoint, range outside it, unknown or revoked key) is found before any CUDA call,
//! and nothing is queued unless every piece passed.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use tcpx::cuda::{CopyPiece, IpcMapping, PooledCopy};

use super::cache::{Grant, Mapped, Target};
use super::descriptor::IpcDescriptor;
use super::link::{LocalLink, Reply};
use super::wire::Msg;
use crate::error::{Direction, Error, LocalErrorKind, Result};
use crate::registry::Region;
use crate::transfer::{Completion, Drive, Transfer};

/// One piece of an operation, resolved to addresses.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Piece<'a> {
    /// This side's address (device, or host memory).
    pub(crate) local: u64,
    /// The GPU holding `local`; `None` for host memory.
    pub(crate) local_gpu: Option<usize>,
    pub(crate) remote: &'a IpcDescriptor,
    pub(crate) remote_offset: u64,
    pub(crate) len: usize,
}

/// The copies of an operation and what must outlive them. Field order is drop order: the
/// copy (whose drop waits) before the mappings and memory it uses.
#[derive(Debug)]
struct Flight {
    copy: PooledCopy,
    _mappings: Vec<Arc<Mapped>>,
    _regions: Vec<Region>,
}

/// The driver of one operation's transfer.
#[derive(Debug)]
struct IpcOp {
    completion: Arc<Completion>,
    flight: Mutex<Option<Flight>>,
    link: Arc<LocalLink>,
    len: u64,
    deadline: Instant,
    what: &'static str,
}

impl Drive for IpcOp {
    fn drive(&self) {
        // Another thread is driving: it will see what this one would.
        let Ok(mut flight) = self.flight.try_lock() else {
            return;
        };
        let Some(f) = flight.as_mut() else {
            return;
        };
        match f.copy.is_done() {
            Ok(true) => {
                *flight = None;
                // A peer that left before the copy was seen done: its memory is gone, so the
                // operation did not do its job, whether or not the bytes moved.
                let outcome = match self.link.gone_error() {
                    Some(e) => Err(e),
                    None => Ok(self.len),
                };
                self.completion.finish(outcome);
            }
            Ok(false) => {
                if !self.completion.is_finished() && Instant::now() >= self.deadline {
                    self.completion.finish(Err(self.link.error(
                        LocalErrorKind::Timeout,
                        format!(
                            "{} of {} bytes did not complete within {:?}",
                            self.what, self.len, self.link.shared.timeout
                        ),
                    )));
                }
            }
            // The copies' state is unknown: keep them (and what they use) until the handle
            // goes, whose drop waits for them.
            Err(e) => {
                self.completion.finish(Err(self
                    .link
                    .error(LocalErrorKind::Cuda, format!("{}: {e}", self.what))));
            }
        }
    }
}

/// Checks the pieces, confirms and maps what they name, queues the copies and returns the
/// operation's transfer. `regions` are kept alive until the copies are done.
///
/// # Safety
/// Every piece's `local..local+len` is memory of this process (device memory of
/// `local_gpu`, or host memory) that stays valid — readable for a write, writable and not
/// referenced from Rust for a read — until the returned transfer finished or was dropped.
pub(crate) unsafe fn submit(
    link: &Arc<LocalLink>,
    direction: Direction,
    pieces: &[Piece<'_>],
    regions: Vec<Region>,
) -> Result<Transfer> {
    let what = match direction {
        Direction::Send => "write_ipc",
        Direction::Recv => "read_ipc",
    };
    link.check_open()?;
    if pieces.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "{what}: the segment list is empty"
        )));
    }
    let mut total = 0u64;
    for (i, p) in pieces.iter().enumerate() {
        check_piece(link, what, i, p)?;
        total += p.len as u64;
    }
    // What the owner must confirm, once per key on this connection. A KV list names the same
    // descriptor block after block: each run of equal descriptors is looked up once.
    for (i, p) in pieces.iter().enumerate() {
        if i > 0 && same_descriptor(pieces[i - 1].remote, p.remote) {
            continue;
        }
        confirm(link, what, i, p.remote)?;
    }
    let ordinal = copy_gpu(link, what, pieces)?;

    // CUDA from here on.
    let gpu = link.shared.gpu(ordinal).map_err(|e| relabel(link, e))?;
    let mut mappings: Vec<Arc<Mapped>> = Vec::with_capacity(1);
    let mut which = Vec::with_capacity(pieces.len());
    for (i, p) in pieces.iter().enumerate() {
        if i > 0 && same_descriptor(pieces[i - 1].remote, p.remote) {
            which.push(which[i - 1]);
            continue;
        }
        let mapped = map(link, &gpu, ordinal, what, i, p.remote)?;
        let at = match mappings.iter().position(|m| Arc::ptr_eq(m, &mapped)) {
            Some(at) => at,
            None => {
                mappings.push(mapped);
                mappings.len() - 1
            }
        };
        which.push(at);
    }

    // Queue under the mappings' read locks: a retirement cannot close one in between.
    let guards: Vec<_> = mappings.iter().map(|m| m.read()).collect();
    let mut copies = Vec::with_capacity(pieces.len());
    for (i, (p, &at)) in pieces.iter().zip(&which).enumerate() {
        if p.len == 0 {
            continue;
        }
        let base = match guards[at].as_ref() {
            Some(Target::Ipc(m)) => m.base(),
            Some(Target::Direct(base)) => *base,
            None => {
                return Err(link.gone_error().unwrap_or_else(|| {
                    link.error(
                        LocalErrorKind::Access,
                        format!("{what}: segment {i}: the descriptor was revoked meanwhile"),
                    )
                }))
            }
        };
        let remote = base + p.remote.offset + p.remote_offset;
        copies.push(match direction {
            Direction::Send => CopyPiece {
                dst: remote,
                src: p.local,
                len: p.len,
            },
            Direction::Recv => CopyPiece {
                dst: p.local,
                src: remote,
                len: p.len,
            },
        });
    }
    // A list goes through the gather kernel (one launch, not one copy per block) when the
    // kernel reaches every byte: local memory on the copying GPU, and peer memory either
    // mapped through IPC (which needs peer-to-peer access to the owner's GPU) or, for a
    // peer in this process, on the copying GPU too.
    let kernel_reaches = pieces.iter().all(|p| p.local_gpu == Some(ordinal))
        && guards.iter().all(|g| match g.as_ref() {
            Some(Target::Ipc(_)) => true,
            Some(Target::Direct(base)) => {
                tcpx::cuda::pointer_device(*base as *const u8) == Some(ordinal)
            }
            None => false,
        });
    // SAFETY: the remote ranges lie inside mappings held open (read-locked now, kept by the
    // flight until the copies are seen done, retired only after a wait for every queued
    // copy); the local ranges are the caller's promise. `submit_list` only when every
    // address is device memory the copying GPU reaches (checked just above).
    let copy = unsafe {
        if kernel_reaches {
            gpu.pool.submit_list(&copies)
        } else {
            gpu.pool.submit(&copies)
        }
    }
    .map_err(|e| {
        link.error(
            LocalErrorKind::Cuda,
            format!("{what}: queuing the copies: {e}"),
        )
    })?;
    drop(guards);

    let completion = Arc::new(Completion::default());
    let op = Arc::new(IpcOp {
        completion: completion.clone(),
        flight: Mutex::new(Some(Flight {
            copy,
            _mappings: mappings,
            _regions: regions,
        })),
        link: link.clone(),
        len: total,
        deadline: Instant::now() + link.shared.timeout,
        what,
    });
    Ok(Transfer::driven(
        completion,
        op,
        direction,
        total,
        link.shared.spin,
    ))
}

/// Does now what the first operation naming `remote` would otherwise pay for (a new agent's
/// first VRAM transfer took 20 × its tenth): confirms the descriptor with its owner, opens
/// the copying GPU (its streams, events and list kernel) and maps the allocation there.
/// `gpu` is the GPU whose memory will be copied to or from `remote` (`None`: the endpoint's,
/// else GPU 0); operations from memory on another GPU map it again there.
pub(crate) fn prepare(
    link: &Arc<LocalLink>,
    remote: &IpcDescriptor,
    gpu: Option<usize>,
) -> Result<()> {
    const WHAT: &str = "prepare_ipc";
    link.check_open()?;
    let piece = Piece {
        local: 0,
        local_gpu: gpu,
        remote,
        remote_offset: 0,
        len: 0,
    };
    check_piece(link, WHAT, 0, &piece)?;
    confirm(link, WHAT, 0, remote)?;
    let ordinal = copy_gpu(link, WHAT, &[piece])?;
    let gpu = link.shared.gpu(ordinal).map_err(|e| relabel(link, e))?;
    map(link, &gpu, ordinal, WHAT, 0, remote)?;
    gpu.pool.prepare_lists();
    Ok(())
}

/// The GPU that copies: the one of the local memory (one for all pieces), else for host
/// memory the endpoint's, else GPU 0.
fn copy_gpu(link: &LocalLink, what: &str, pieces: &[Piece<'_>]) -> Result<usize> {
    let mut gpu = None;
    let fallback = || {
        link.default_gpu
            .or_else(|| (tcpx::cuda::CudaDevice::count() > 0).then_some(0))
    };
    for (i, p) in pieces.iter().enumerate() {
        let Some(on) = p.local_gpu.or_else(fallback) else {
            return Err(Error::Unsupported(format!(
                "{what}: segment {i}: local memory is host memory and this endpoint has no GPU \
                 to copy with ({})",
                tcpx::cuda::driver_status()
            )));
        };
        match gpu {
            Some(g) if g != on => {
                return Err(Error::InvalidArgument(format!(
                    "{what}: segment {i}: local memory on GPU {on}, an earlier one on GPU {g}: \
                     one operation's local memory lives on one GPU"
                )))
            }
            _ => gpu = Some(on),
        }
    }
    Ok(gpu.expect("the list is not empty"))
}

/// Errors from the shared GPU table name no peer; this operation's do.
fn relabel(link: &LocalLink, e: Error) -> Error {
    match e {
        Error::Local { kind, what, .. } => link.error(kind, what),
        other => other,
    }
}

/// Whether two pieces name the same descriptor: the same reference (the C API and the
/// NIXL plugin pass one decoding for a run of blocks) or equal values.
fn same_descriptor(a: &IpcDescriptor, b: &IpcDescriptor) -> bool {
    std::ptr::eq(a, b) || a == b
}

/// The checks that need nothing but the piece and the connection.
fn check_piece(link: &LocalLink, what: &str, i: usize, p: &Piece<'_>) -> Result<()> {
    let d = p.remote;
    if d.owner != link.peer.instance {
        return Err(link.error(
            LocalErrorKind::Access,
            format!(
                "{what}: segment {i}: the descriptor belongs to endpoint {:#x} (pid {}), this \
                 connection's peer is endpoint {:#x}",
                d.owner, d.owner_pid, link.peer.instance
            ),
        ));
    }
    if p.remote_offset
        .checked_add(p.len as u64)
        .is_none_or(|end| end > d.len)
    {
        return Err(Error::InvalidArgument(format!(
            "{what}: segment {i}: range {}+{} lies outside the {} advertised bytes",
            p.remote_offset, p.len, d.len
        )));
    }
    if p.len > 0 && p.local.checked_add(p.len as u64).is_none() {
        return Err(Error::InvalidArgument(format!(
            "{what}: segment {i}: {} bytes at {:#x} wrap around the address space",
            p.len, p.local
        )));
    }
    Ok(())
}

/// Makes sure the owner confirmed `d` on this connection: asks it the first time, after that
/// compares with what it confirmed.
fn confirm(link: &LocalLink, what: &str, i: usize, d: &IpcDescriptor) -> Result<()> {
    let wanted = Grant {
        handle: d.handle,
        offset: d.offset,
        len: d.len,
    };
    let known = link
        .cache
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .grant(d.key);
    match known {
        Some(g) if g == wanted => return Ok(()),
        Some(_) => {
            return Err(link.error(
                LocalErrorKind::Access,
                format!(
                    "{what}: segment {i}: the descriptor differs from the one the owner \
                     confirmed for its key"
                ),
            ))
        }
        None => {}
    }
    let reply = link.request(|req| Msg::Validate {
        req,
        key: d.key,
        handle: d.handle,
        offset: d.offset,
        len: d.len,
    })?;
    match reply {
        Reply::Granted => {
            link.cache
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .confirm(d.key, wanted);
            Ok(())
        }
        Reply::Refused(reason) => Err(link.error(
            LocalErrorKind::Access,
            format!("{what}: segment {i}: {reason}"),
        )),
        Reply::Ack => Err(link.error(
            LocalErrorKind::Protocol,
            "answered a descriptor check with an acknowledgement",
        )),
    }
}

/// The mapping `d` lies in on device `ordinal`, opened on first use.
fn map(
    link: &LocalLink,
    gpu: &super::shared::Gpu,
    ordinal: usize,
    what: &str,
    i: usize,
    d: &IpcDescriptor,
) -> Result<Arc<Mapped>> {
    let cached = link
        .cache
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .mapping(ordinal, &d.handle);
    let mapped = match cached {
        Some(m) => m,
        None => {
            let shared = &link.shared;
            // No process can open its own handle, and none needs to: a peer endpoint in this
            // very process is reached at the owner's own address.
            let target = if d.owner_pid == shared.pid && link.peer_pid == shared.pid {
                Target::Direct(d.base)
            } else {
                Target::Ipc(IpcMapping::open(&gpu.device, &d.handle).map_err(|e| {
                    link.error(
                        LocalErrorKind::Cuda,
                        format!("{what}: segment {i}: opening the peer's allocation: {e}"),
                    )
                })?)
            };
            let fresh = Arc::new(Mapped::new(target, gpu.pool.clone()));
            let kept = link
                .cache
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .add_mapping(ordinal, d.handle, fresh.clone());
            // When another thread mapped it first, or it was revoked meanwhile, `fresh` is
            // dropped here and closes its handle: nothing was queued on it.
            match kept {
                Some(m) => m,
                None => {
                    return Err(link.gone_error().unwrap_or_else(|| {
                        link.error(
                            LocalErrorKind::Access,
                            format!("{what}: segment {i}: the descriptor was revoked meanwhile"),
                        )
                    }));
                }
            }
        }
    };
    // The driver's size of the mapping bounds what a descriptor may claim.
    if let Some(size) = mapped.len() {
        if d.offset + d.len > size as u64 {
            return Err(link.error(
                LocalErrorKind::Access,
                format!(
                    "{what}: segment {i}: the descriptor claims {}+{} in an allocation of {size} \
                     bytes",
                    d.offset, d.len
                ),
            ));
        }
    }
    Ok(mapped)
}
