//! [`Core`]: the state both Python layers share — an endpoint of the runtime and the tables
//! that turn UCCL-style integers (connection ids, memory-region ids, transfer ids, raw
//! pointers) into runtime objects. It knows nothing of Python: the pyclasses in `native.rs`
//! and `p2p.rs` only convert arguments and results around it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use tcpx_runtime::control::EndpointMetadata;
use tcpx_runtime::{
    Config, Connection, Descriptor, Endpoint, Region, RemoteSegment, Segment, Transfer,
};

use crate::blob::Advert;
use crate::errors::{Failure, Kind, Outcome};

/// Set in a child process after `fork()`: endpoints inherited from the parent have no engine
/// threads there, so every call on them fails, and dropping them frees nothing (joining
/// threads that do not exist would hang).
pub static FORKED: AtomicBool = AtomicBool::new(false);

/// A memory registration made through `reg`: a runtime region plus its address range.
pub struct Mr {
    region: Region,
    base: u64,
    len: u64,
    /// The registration's descriptor once advertised (advertised once, then every
    /// `advertise` of a range inside it reuses the descriptor).
    advert: Mutex<Option<Descriptor>>,
}

/// One piece of a local list: `size` bytes at `ptr` inside registration `mr_id`.
#[derive(Debug, Clone, Copy)]
pub struct Piece {
    /// Registration id from `reg`.
    pub mr_id: u64,
    /// Address inside it.
    pub ptr: u64,
    /// Bytes.
    pub size: u64,
}

/// A delivered notification: the connection id (if still open), the peer, the bytes.
pub type Delivered = (Option<u64>, SocketAddr, Vec<u8>);

/// Which two-sided direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Way {
    /// This side sends.
    Send,
    /// This side receives.
    Recv,
}

/// The shared state of one Python endpoint.
pub struct Core {
    endpoint: RwLock<Option<Arc<Endpoint>>>,
    /// Process that created it (see [`FORKED`]).
    gpu_index: Option<u32>,
    conns: RwLock<HashMap<u64, Arc<Connection>>>,
    mrs: RwLock<HashMap<u64, Arc<Mr>>>,
    /// Asynchronous transfers of `tcpx.p2p`, by transfer id, until polled done.
    xfers: Mutex<HashMap<u64, Transfer>>,
    next_conn: AtomicU64,
    next_mr: AtomicU64,
    next_xfer: AtomicU64,
}

fn closed() -> Failure {
    Failure::new(Kind::Closed, "the endpoint is closed")
}

fn forked() -> Failure {
    Failure::new(
        Kind::Closed,
        "this endpoint was created in the parent process before fork(): its engine threads \
         do not exist in the child; create a new endpoint in the child",
    )
}

impl Core {
    /// An endpoint configured exactly as `Config::from_env` decides (TCPX if installed,
    /// else the built-in socket plugin), announcing `gpu_index` to peers when given.
    pub fn new(gpu_index: Option<u32>) -> Outcome<Self> {
        let mut config = Config::from_env()?;
        if gpu_index.is_some() {
            config.gpu_index = gpu_index;
        }
        let endpoint = Endpoint::new(config)?;
        let gpu_index = endpoint.gpu_index();
        Ok(Self {
            endpoint: RwLock::new(Some(Arc::new(endpoint))),
            gpu_index,
            conns: RwLock::default(),
            mrs: RwLock::default(),
            xfers: Mutex::default(),
            next_conn: AtomicU64::new(0),
            next_mr: AtomicU64::new(0),
            next_xfer: AtomicU64::new(0),
        })
    }

    /// The runtime endpoint, unless closed.
    pub fn endpoint(&self) -> Outcome<Arc<Endpoint>> {
        if FORKED.load(Ordering::Relaxed) {
            return Err(forked());
        }
        self.endpoint
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(closed)
    }

    /// The GPU index announced to peers.
    pub fn gpu_index(&self) -> Option<u32> {
        self.gpu_index
    }

    /// The runtime's metadata (address, plugin handles' source, secret).
    pub fn metadata(&self) -> Outcome<EndpointMetadata> {
        Ok(self.endpoint()?.metadata().clone())
    }

    fn add_conn(&self, conn: Connection) -> u64 {
        let id = self.next_conn.fetch_add(1, Ordering::Relaxed);
        self.conns
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, Arc::new(conn));
        id
    }

    /// Waits up to `wait` for a peer; returns its connection id, control address and GPU.
    pub fn accept(&self, wait: Duration) -> Outcome<(u64, SocketAddr, Option<u32>)> {
        let conn = self.endpoint()?.accept_timeout(wait)?;
        let (peer, gpu) = (conn.peer(), conn.peer_gpu());
        Ok((self.add_conn(conn), peer, gpu))
    }

    /// Connects with the peer's control address alone.
    pub fn connect_addr(&self, addr: SocketAddr) -> Outcome<u64> {
        let conn = self.endpoint()?.connect_addr(addr)?;
        Ok(self.add_conn(conn))
    }

    /// Connects with the peer's full metadata (presents its secret).
    pub fn connect_metadata(&self, meta: &EndpointMetadata) -> Outcome<u64> {
        let conn = self.endpoint()?.connect(meta)?;
        Ok(self.add_conn(conn))
    }

    /// The connection `conn_id`.
    pub fn conn(&self, conn_id: u64) -> Outcome<Arc<Connection>> {
        if let Some(c) = self
            .conns
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&conn_id)
        {
            return Ok(c.clone());
        }
        self.endpoint()?;
        Err(Failure::bad(format!("unknown conn_id {conn_id}")))
    }

    /// Peer address and GPU of `conn_id`.
    pub fn conn_peer(&self, conn_id: u64) -> Outcome<(SocketAddr, Option<u32>)> {
        let c = self.conn(conn_id)?;
        Ok((c.peer(), c.peer_gpu()))
    }

    /// Closes `conn_id` (pending transfers on it fail). Returns whether it existed.
    pub fn remove_conn(&self, conn_id: u64) -> bool {
        let conn = self
            .conns
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&conn_id);
        conn.is_some()
    }

    /// Registers `[ptr, ptr + size)` (host or CUDA memory, found through the driver).
    ///
    /// # Safety
    /// As `tcpx_runtime::Endpoint::register_ptr`: the range is one allocation that stays
    /// valid until it is deregistered and every transfer using it has finished.
    pub unsafe fn reg(&self, ptr: u64, size: u64) -> Outcome<u64> {
        if ptr == 0 {
            return Err(Failure::bad("reg: ptr is 0 (null)"));
        }
        if size == 0 {
            return Err(Failure::bad("reg: size is 0"));
        }
        let len = usize::try_from(size).map_err(|_| Failure::bad("reg: size too large"))?;
        let endpoint = self.endpoint()?;
        // SAFETY: the caller's contract is the one `register_ptr` requires.
        let region = unsafe { endpoint.register_ptr(ptr as usize as *mut u8, len) }?;
        let id = self.next_mr.fetch_add(1, Ordering::Relaxed);
        let mr = Mr {
            base: region.as_ptr() as usize as u64,
            region,
            len: size,
            advert: Mutex::new(None),
        };
        self.mrs
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, Arc::new(mr));
        Ok(id)
    }

    /// Drops registration `mr_id` (and revokes its advertisement). Transfers in flight keep
    /// it registered until they finish.
    pub fn dereg(&self, mr_id: u64) -> Outcome<()> {
        let mr = self
            .mrs
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&mr_id);
        let Some(mr) = mr else {
            self.endpoint()?;
            return Err(Failure::bad(format!("unknown mr_id {mr_id}")));
        };
        let advert = *mr.advert.lock().unwrap_or_else(|p| p.into_inner());
        if let (Some(d), Ok(endpoint)) = (advert, self.endpoint()) {
            endpoint.revoke(&d);
        }
        Ok(())
    }

    /// The registration and the offset of `piece` in it, after checking the range lies
    /// inside the registration.
    fn resolve(&self, piece: Piece) -> Outcome<(Arc<Mr>, usize, usize)> {
        let mr = self
            .mrs
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&piece.mr_id)
            .cloned();
        let Some(mr) = mr else {
            self.endpoint()?;
            return Err(Failure::bad(format!("unknown mr_id {}", piece.mr_id)));
        };
        let inside = piece.ptr >= mr.base
            && piece
                .ptr
                .checked_add(piece.size)
                .is_some_and(|end| end <= mr.base + mr.len);
        if !inside {
            return Err(Failure::bad(format!(
                "{} bytes at {:#x} are not inside mr_id {} ({} bytes at {:#x})",
                piece.size, piece.ptr, piece.mr_id, mr.len, mr.base
            )));
        }
        if piece.size == 0 {
            return Err(Failure::bad("size is 0"));
        }
        // Both fit in usize: they lie inside a registration of usize length.
        let offset = (piece.ptr - mr.base) as usize;
        Ok((mr, offset, piece.size as usize))
    }

    fn resolve_all(&self, pieces: &[Piece]) -> Outcome<Vec<(Arc<Mr>, usize, usize)>> {
        if pieces.is_empty() {
            return Err(Failure::bad("the list of buffers is empty"));
        }
        pieces.iter().map(|&p| self.resolve(p)).collect()
    }

    /// Starts a two-sided transfer of one buffer.
    pub fn two_sided(&self, way: Way, conn_id: u64, piece: Piece) -> Outcome<Transfer> {
        let conn = self.conn(conn_id)?;
        let (mr, offset, len) = self.resolve(piece)?;
        Ok(match way {
            Way::Send => conn.send(&mr.region, offset, len)?,
            Way::Recv => conn.recv(&mr.region, offset, len)?,
        })
    }

    /// Starts a vectored two-sided transfer (the peer uses the vectored form too).
    pub fn two_sided_v(&self, way: Way, conn_id: u64, pieces: &[Piece]) -> Outcome<Transfer> {
        let conn = self.conn(conn_id)?;
        let resolved = self.resolve_all(pieces)?;
        let segments: Vec<Segment<'_>> = resolved
            .iter()
            .map(|(mr, offset, len)| Segment::new(&mr.region, *offset, *len))
            .collect();
        Ok(match way {
            Way::Send => conn.send_vectored(&segments)?,
            Way::Recv => conn.recv_vectored(&segments)?,
        })
    }

    /// Advertises `piece` for one-sided access; returns the 64-byte blob for the peer.
    pub fn advertise(&self, piece: Piece) -> Outcome<[u8; crate::blob::ADVERT_BYTES]> {
        let (mr, offset, len) = self.resolve(piece)?;
        let descriptor = {
            let mut advert = mr.advert.lock().unwrap_or_else(|p| p.into_inner());
            match *advert {
                Some(d) => d,
                None => {
                    let d = self.endpoint()?.advertise(&mr.region)?;
                    *advert = Some(d);
                    d
                }
            }
        };
        Ok(Advert {
            addr: piece.ptr,
            len: len as u64,
            offset: offset as u64,
            descriptor,
        }
        .encode())
    }

    /// Starts a one-sided write (`write = true`) or read of `pieces` into / from the peer's
    /// advertised `blobs` (one blob per piece; each piece at most its blob's size).
    pub fn one_sided(
        &self,
        write: bool,
        conn_id: u64,
        pieces: &[Piece],
        blobs: &[&[u8]],
        notification: Option<&[u8]>,
    ) -> Outcome<Transfer> {
        if pieces.len() != blobs.len() {
            return Err(Failure::bad(format!(
                "{} local buffers but {} advertisement blobs",
                pieces.len(),
                blobs.len()
            )));
        }
        let conn = self.conn(conn_id)?;
        let resolved = self.resolve_all(pieces)?;
        let mut remote = Vec::with_capacity(blobs.len());
        for (i, (blob, (_, _, len))) in blobs.iter().zip(&resolved).enumerate() {
            let advert = Advert::decode(blob)
                .map_err(|f| Failure::new(f.kind, format!("blob {i}: {}", f.message)))?;
            if *len as u64 > advert.len {
                return Err(Failure::bad(format!(
                    "buffer {i}: {len} bytes but the peer advertised {}",
                    advert.len
                )));
            }
            remote.push(RemoteSegment::new(
                advert.descriptor,
                advert.offset,
                *len as u64,
            ));
        }
        let segments: Vec<Segment<'_>> = resolved
            .iter()
            .map(|(mr, offset, len)| Segment::new(&mr.region, *offset, *len))
            .collect();
        Ok(if write {
            conn.write(&segments, &remote, notification)?
        } else {
            conn.read(&segments, &remote)?
        })
    }

    /// Sends a notification on `conn_id` (delivered after this side's earlier writes).
    pub fn notify(&self, conn_id: u64, bytes: &[u8]) -> Outcome<()> {
        Ok(self.conn(conn_id)?.notify(bytes)?)
    }

    /// Notifications delivered so far, with the sending connection's id when it is known.
    pub fn notifications(&self) -> Outcome<Vec<Delivered>> {
        let got = self.endpoint()?.notifications();
        if got.is_empty() {
            return Ok(Vec::new());
        }
        let conns = self.conns.read().unwrap_or_else(|p| p.into_inner());
        Ok(got
            .into_iter()
            .map(|(peer, bytes)| {
                let id = conns
                    .iter()
                    .find(|(_, c)| c.peer() == peer)
                    .map(|(id, _)| *id);
                (id, peer, bytes)
            })
            .collect())
    }

    /// Keeps `transfer` under a new transfer id (for `poll_async`).
    pub fn track(&self, transfer: Transfer) -> u64 {
        let id = self.next_xfer.fetch_add(1, Ordering::Relaxed);
        self.xfers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, transfer);
        id
    }

    /// `Ok(false)` while transfer `id` runs; `Ok(true)` once it finished well (the id is then
    /// forgotten); its error if it failed (forgotten too).
    pub fn poll(&self, id: u64) -> Outcome<bool> {
        let mut xfers = self.xfers.lock().unwrap_or_else(|p| p.into_inner());
        let Some(t) = xfers.get(&id) else {
            drop(xfers);
            self.endpoint()?;
            return Err(Failure::bad(format!("unknown transfer_id {id}")));
        };
        match t.poll() {
            None => Ok(false),
            Some(outcome) => {
                xfers.remove(&id);
                outcome.map(|_| true).map_err(Failure::from)
            }
        }
    }

    /// The transfer under `id`, still tracked.
    pub fn tracked(&self, id: u64) -> Outcome<Transfer> {
        self.xfers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id)
            .cloned()
            .ok_or_else(|| Failure::bad(format!("unknown transfer_id {id}")))
    }

    /// Closes every connection (pending transfers fail), drops registrations and stops the
    /// engines. Idempotent. Blocks until the engines released the connections' comms, so
    /// call it without the GIL.
    pub fn close(&self) {
        if FORKED.load(Ordering::Relaxed) {
            return;
        }
        let conns = std::mem::take(&mut *self.conns.write().unwrap_or_else(|p| p.into_inner()));
        drop(conns);
        self.xfers.lock().unwrap_or_else(|p| p.into_inner()).clear();
        let mrs = std::mem::take(&mut *self.mrs.write().unwrap_or_else(|p| p.into_inner()));
        drop(mrs);
        let endpoint = self
            .endpoint
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        drop(endpoint);
    }

    /// Whether [`Core::close`] ran.
    pub fn is_closed(&self) -> bool {
        self.endpoint
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .is_none()
    }
}

impl Drop for Core {
    fn drop(&mut self) {
        if FORKED.load(Ordering::Relaxed) {
            // Inherited from the parent: its threads do not exist here, and a lock they held
            // at fork() stays locked forever. Leak everything rather than touch it.
            let endpoint = self
                .endpoint
                .get_mut()
                .unwrap_or_else(|p| p.into_inner())
                .take();
            std::mem::forget(endpoint);
            std::mem::forget(std::mem::take(
                self.conns.get_mut().unwrap_or_else(|p| p.into_inner()),
            ));
            std::mem::forget(std::mem::take(
                self.mrs.get_mut().unwrap_or_else(|p| p.into_inner()),
            ));
            std::mem::forget(std::mem::take(
                self.xfers.get_mut().unwrap_or_else(|p| p.into_inner()),
            ));
        }
    }
}
