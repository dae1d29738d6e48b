//! [`Core`]: the state both Python layers share — an endpoint of the runtime and the tables
//! that turn UCCL-style integers (connection ids, memory-region ids, transfer ids, raw
//! pointers) into runtime objects. It knows nothing of Python: the pyclasses in `native.rs`
//! and `p2p.rs` only convert arguments and results around it.

use std::collections::{BTreeMap, HashMap};
use std::mem::ManuallyDrop;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use tcpx_runtime::control::EndpointMetadata;
use tcpx_runtime::{
    Config, Connection, Descriptor, Endpoint, IpcDescriptor, LocalConnection, Metrics, PackStats,
    Region, RemoteSegment, Segment, Store, Transfer,
};

use crate::blob::Advert;
use crate::descs::{RemoteKey, RemoteRange};
use crate::errors::{Failure, Kind, Outcome};
use crate::fork::Origin;

/// How long the passive-accept thread waits for a peer before looking at its stop flag (a
/// closing endpoint does not wait for it: it stops the accept, see [`Core::close`]).
const ACCEPT_SLICE: Duration = Duration::from_millis(20);

/// One registration of the runtime: a region and its address range. Several `mr_id`s may
/// share it (the same buffer registered twice, or a range inside a registered buffer), as
/// UCCL's MR cache shares an MR.
pub struct Mr {
    region: Region,
    base: u64,
    len: u64,
    /// Tells registrations with the same base apart in [`Registrations::live`].
    serial: u64,
    /// The registration's descriptor once advertised (advertised once, then every
    /// `advertise` of a range inside it, and every descriptor of it, reuses it).
    advert: Mutex<Option<Descriptor>>,
}

/// What an `mr_id` names: the range the caller registered, inside a shared registration.
struct Handle {
    mr: Arc<Mr>,
    base: u64,
    len: u64,
}

/// The registration tables (under one lock: finding a registration to reuse and counting
/// its handles must not interleave with the last handle going away).
#[derive(Default)]
struct Registrations {
    handles: HashMap<u64, Handle>,
    /// Live registrations by (base, serial), with the number of handles on each.
    live: BTreeMap<(u64, u64), (Arc<Mr>, usize)>,
    next_mr: u64,
    next_serial: u64,
}

impl Registrations {
    /// A live registration containing `[ptr, end)`.
    fn containing(&mut self, ptr: u64, end: u64) -> Option<&mut (Arc<Mr>, usize)> {
        self.live
            .range_mut(..=(ptr, u64::MAX))
            .rev()
            .map(|(_, entry)| entry)
            .find(|(mr, _)| mr.base + mr.len >= end)
    }

    fn add_handle(&mut self, mr: Arc<Mr>, base: u64, len: u64) -> u64 {
        let id = self.next_mr;
        self.next_mr += 1;
        self.handles.insert(id, Handle { mr, base, len });
        id
    }
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

/// One advertised range, remembered so that advertising the same buffer again (UCCL's
/// scripts do it per iteration) hands out the same descriptor instead of growing the
/// endpoint's advert table.
pub(crate) struct Advertised {
    pub(crate) descriptor: IpcDescriptor,
    /// The CUDA allocation `(start, size)` the range was in when advertised: a different one
    /// at the same address (freed and allocated again) gets a new descriptor.
    pub(crate) allocation: Option<(u64, usize)>,
}

/// The same-host half of an endpoint's state (used by [`crate::local`]).
#[derive(Default)]
pub struct LocalState {
    pub(crate) conns: RwLock<HashMap<u64, Arc<LocalConnection>>>,
    pub(crate) adverts: Mutex<HashMap<(u64, u64), Advertised>>,
}

/// The background thread of `start_passive_accept`.
struct Passive {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

/// Everything an endpoint owns. Never touched in a process that inherited it through
/// `fork()` (see [`crate::fork`]).
pub(crate) struct State {
    endpoint: RwLock<Option<Arc<Endpoint>>>,
    /// Same-host (CUDA IPC) connections and adverts ([`crate::local`]).
    pub(crate) local: LocalState,
    conns: RwLock<HashMap<u64, Arc<Connection>>>,
    /// `add_remote_endpoint`'s memo: the peer's metadata bytes → its connection.
    peers: Mutex<HashMap<Vec<u8>, u64>>,
    regs: RwLock<Registrations>,
    /// Asynchronous transfers of `tcpx.p2p`, by transfer id, until polled done.
    xfers: Mutex<HashMap<u64, Transfer>>,
    next_conn: AtomicU64,
    next_xfer: AtomicU64,
    passive: Mutex<Option<Passive>>,
    /// Connection ids of the ranks met through [`Core::rendezvous`] (`conn_id_of_rank`).
    ranks: Mutex<HashMap<usize, u64>>,
}

/// The shared state of one Python endpoint.
pub struct Core {
    /// The process that created it: in any other (a forked child) every call fails and
    /// dropping it frees nothing.
    origin: Origin,
    gpu_index: Option<u32>,
    /// Dropped only in the creating process (see `Drop`).
    state: ManuallyDrop<State>,
}

fn closed() -> Failure {
    Failure::new(Kind::Closed, "the endpoint is closed")
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
            origin: Origin::here(),
            gpu_index,
            state: ManuallyDrop::new(State {
                endpoint: RwLock::new(Some(Arc::new(endpoint))),
                local: LocalState::default(),
                conns: RwLock::default(),
                peers: Mutex::default(),
                regs: RwLock::default(),
                xfers: Mutex::default(),
                next_conn: AtomicU64::new(0),
                next_xfer: AtomicU64::new(0),
                passive: Mutex::new(None),
                ranks: Mutex::default(),
            }),
        })
    }

    /// The state, unless this process inherited the endpoint through `fork()`. Every method
    /// goes through here before touching a lock: one held by a parent's thread at fork()
    /// would never be released in the child.
    fn st(&self) -> Outcome<&State> {
        if self.origin.inherited() {
            return Err(self.origin.failure("endpoint"));
        }
        Ok(&self.state)
    }

    /// [`Core::st`] for the other modules of the bindings (same fork rule).
    pub(crate) fn state(&self) -> Outcome<&State> {
        self.st()
    }

    /// A new connection id (network and same-host connections share the numbering).
    pub(crate) fn new_conn_id(&self) -> Outcome<u64> {
        Ok(self.st()?.next_conn.fetch_add(1, Ordering::Relaxed))
    }

    /// The process that created this endpoint (transfer handles carry it too).
    pub fn origin(&self) -> Origin {
        self.origin
    }

    /// The runtime endpoint, unless closed.
    pub fn endpoint(&self) -> Outcome<Arc<Endpoint>> {
        self.st()?
            .endpoint
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(closed)
    }

    /// The GPU index announced to peers.
    pub fn gpu_index(&self) -> Option<u32> {
        self.gpu_index
    }

    /// The PCI bus id of the endpoint's GPU ("" without one): what UCCL's metadata carries
    /// and `connect_local` dials. Asks the driver (no context) the first time.
    pub fn gpu_bus(&self) -> Outcome<String> {
        Ok(self.endpoint()?.local_info().gpu.unwrap_or_default())
    }

    /// The runtime's metadata (address, plugin handles' source, secret).
    pub fn metadata(&self) -> Outcome<EndpointMetadata> {
        Ok(self.endpoint()?.metadata().clone())
    }

    fn add_conn(&self, conn: Connection) -> Outcome<u64> {
        let st = self.st()?;
        // What `reg` registered so far is registered on the new connection's one-sided comms
        // now, not by its first `write` / `read` (`reg` does the same for connections that
        // come before it).
        let regions: Vec<Region> = {
            let regs = st.regs.read().unwrap_or_else(|p| p.into_inner());
            regs.live
                .values()
                .map(|(mr, _)| mr.region.clone())
                .collect()
        };
        // Dropped on purpose on failure: the first transfer registers again and raises its
        // own error, naming the transfer.
        let _ = conn.warm_up_all(&regions);
        let id = st.next_conn.fetch_add(1, Ordering::Relaxed);
        st.conns
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, Arc::new(conn));
        Ok(id)
    }

    /// Waits up to `wait` for a peer; returns its connection id, control address and GPU.
    pub fn accept(&self, wait: Duration) -> Outcome<(u64, SocketAddr, Option<u32>)> {
        let conn = self.endpoint()?.accept_timeout(wait)?;
        let (peer, gpu) = (conn.peer(), conn.peer_gpu());
        Ok((self.add_conn(conn)?, peer, gpu))
    }

    /// Connects with the peer's control address alone.
    pub fn connect_addr(&self, addr: SocketAddr) -> Outcome<u64> {
        let conn = self.endpoint()?.connect_addr(addr)?;
        self.add_conn(conn)
    }

    /// Connects with the peer's full metadata (presents its secret).
    pub fn connect_metadata(&self, meta: &EndpointMetadata) -> Outcome<u64> {
        let conn = self.endpoint()?.connect(meta)?;
        self.add_conn(conn)
    }

    /// Publishes this endpoint's metadata (secret included) in `store` under `name`.
    pub fn publish(&self, store: &dyn Store, name: &str) -> Outcome<()> {
        Ok(self.endpoint()?.publish(store, name)?)
    }

    /// Removes `name` from `store`; whether it was there.
    pub fn unpublish(&self, store: &dyn Store, name: &str) -> Outcome<bool> {
        Ok(self.endpoint()?.unpublish(store, name)?)
    }

    /// Waits up to `wait` for `name` in `store` and connects to the endpoint published there.
    pub fn connect_by_name(&self, store: &dyn Store, name: &str, wait: Duration) -> Outcome<u64> {
        let conn = self.endpoint()?.connect_by_name(store, name, wait)?;
        self.add_conn(conn)
    }

    /// The runtime's group rendezvous of `world` ranks under `job` in `store` (waiting at
    /// most `wait`): a connection to every other rank, as `(rank, conn_id)` in rank order.
    /// The ranks are remembered for [`Core::conn_of_rank`].
    pub fn rendezvous(
        &self,
        store: &dyn Store,
        job: &str,
        rank: usize,
        world: usize,
        wait: Duration,
    ) -> Outcome<Vec<(usize, u64)>> {
        let group = self.endpoint()?.rendezvous(store, job, rank, world, wait)?;
        let mut out = Vec::with_capacity(world.saturating_sub(1));
        for (peer, conn) in group.into_connections().into_iter().enumerate() {
            if let Some(conn) = conn {
                out.push((peer, self.add_conn(conn)?));
            }
        }
        self.st()?
            .ranks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(out.iter().copied());
        Ok(out)
    }

    /// The connection id of `rank` from the last [`Core::rendezvous`] that met it, while that
    /// connection is open.
    pub fn conn_of_rank(&self, rank: usize) -> Option<u64> {
        let st = self.st().ok()?;
        let id = *st
            .ranks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&rank)?;
        st.conns
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(&id)
            .then_some(id)
    }

    /// A snapshot of the endpoint's counters, with the connection ids of this layer by
    /// peer control address (to label the snapshot's connections).
    pub fn metrics(&self) -> Outcome<(Metrics, HashMap<SocketAddr, Vec<u64>>)> {
        let metrics = self.endpoint()?.metrics();
        let mut ids: HashMap<SocketAddr, Vec<u64>> = HashMap::new();
        for (id, conn) in self
            .st()?
            .conns
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            ids.entry(conn.peer()).or_default().push(*id);
        }
        Ok((metrics, ids))
    }

    /// The Prometheus text of the endpoint's counters.
    pub fn metrics_text(&self) -> Outcome<String> {
        Ok(self.endpoint()?.metrics().to_prometheus())
    }

    /// Where the Prometheus exporter listens (`TCPX_METRICS_ADDR`), if it is on.
    pub fn metrics_addr(&self) -> Outcome<Option<SocketAddr>> {
        Ok(self.endpoint()?.metrics_addr())
    }

    /// The connection an earlier `add_remote_endpoint(metadata)` made, if still open.
    pub fn known_peer(&self, metadata: &[u8]) -> Outcome<Option<u64>> {
        let st = self.st()?;
        let id = st
            .peers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(metadata)
            .copied();
        let open = |id: &u64| {
            st.conns
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .contains_key(id)
        };
        Ok(id.filter(open))
    }

    /// Remembers that `metadata` connected as `conn_id` (for [`Core::known_peer`]).
    pub fn remember_peer(&self, metadata: Vec<u8>, conn_id: u64) -> Outcome<()> {
        self.st()?
            .peers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(metadata, conn_id);
        Ok(())
    }

    /// Accepts every peer that connects, on a background thread, until the endpoint closes
    /// (UCCL's `start_passive_accept`: the peers then `write` / `read` this side's
    /// registered memory without a call here). Idempotent.
    pub fn start_passive_accept(self: &Arc<Self>) -> Outcome<()> {
        let st = self.st()?;
        self.endpoint()?;
        let mut passive = st.passive.lock().unwrap_or_else(|p| p.into_inner());
        if passive.is_some() {
            return Ok(());
        }
        let stop = Arc::new(AtomicBool::new(false));
        let weak: Weak<Core> = Arc::downgrade(self);
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("tcpx-py-accept".into())
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    // A strong reference only for one slice: dropping the Python endpoint
                    // still ends the core (and, through `Drop`, this loop).
                    let Some(core) = weak.upgrade() else { break };
                    match core.accept(ACCEPT_SLICE) {
                        Ok(_) => {}
                        Err(f) if f.kind == Kind::Timeout => {}
                        Err(f) if f.kind == Kind::Closed => break,
                        // A peer whose set-up failed: keep serving the others.
                        Err(_) => std::thread::sleep(ACCEPT_SLICE),
                    }
                }
            })
            .map_err(|e| Failure::new(Kind::Other, format!("starting the accept thread: {e}")))?;
        *passive = Some(Passive { stop, thread });
        Ok(())
    }

    /// The connection `conn_id`.
    pub fn conn(&self, conn_id: u64) -> Outcome<Arc<Connection>> {
        if let Some(c) = self
            .st()?
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
    pub fn remove_conn(&self, conn_id: u64) -> Outcome<bool> {
        let st = self.st()?;
        let conn = st
            .conns
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&conn_id);
        st.peers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|_, id| *id != conn_id);
        Ok(conn.is_some() || self.remove_local(conn_id)?)
    }

    /// Registers `[ptr, ptr + size)` (host or CUDA memory, found through the driver) and
    /// returns a new `mr_id`. A range inside a live registration of this endpoint shares it
    /// (same region, same descriptor and keys) instead of registering again.
    ///
    /// # Safety
    /// As `tcpx_runtime::Endpoint::register_ptr`: the range lies in one allocation that
    /// stays valid until this `mr_id` is deregistered and every transfer using it has
    /// finished. (A shared registration may outlive the `mr_id` that made it; that is sound
    /// because the shared range lies in the same allocation, alive while this range is.)
    pub unsafe fn reg(&self, ptr: u64, size: u64) -> Outcome<u64> {
        if ptr == 0 {
            return Err(Failure::bad("reg: ptr is 0 (null)"));
        }
        if size == 0 {
            return Err(Failure::bad("reg: size is 0"));
        }
        let Some(end) = ptr.checked_add(size) else {
            return Err(Failure::bad(
                "reg: the range wraps around the address space",
            ));
        };
        let len = usize::try_from(size).map_err(|_| Failure::bad("reg: size too large"))?;
        let st = self.st()?;
        let endpoint = self.endpoint()?;
        {
            let mut regs = st.regs.write().unwrap_or_else(|p| p.into_inner());
            if let Some((mr, handles)) = regs.containing(ptr, end) {
                *handles += 1;
                let mr = mr.clone();
                return Ok(regs.add_handle(mr, ptr, size));
            }
        }
        // Registering asks the CUDA driver about the pointer: not under the tables' lock.
        // SAFETY: the caller's contract is the one `register_ptr` requires.
        let region = unsafe { endpoint.register_ptr(ptr as usize as *mut u8, len) }?;
        let mut regs = st.regs.write().unwrap_or_else(|p| p.into_inner());
        let serial = regs.next_serial;
        regs.next_serial += 1;
        let mr = Arc::new(Mr {
            base: region.as_ptr() as usize as u64,
            region,
            len: size,
            serial,
            advert: Mutex::new(None),
        });
        regs.live.insert((mr.base, serial), (mr.clone(), 1));
        let id = regs.add_handle(mr.clone(), ptr, size);
        drop(regs);
        // UCCL's `reg` is where registration is paid: register on every connection's
        // one-sided comms now rather than at each connection's first transfer naming it.
        let conns: Vec<Arc<Connection>> = st
            .conns
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect();
        for conn in &conns {
            // Dropped on purpose on failure: the first transfer registers again and raises
            // its own error, naming the transfer.
            let _ = conn.warm_up_all(std::slice::from_ref(&mr.region));
        }
        Ok(id)
    }

    /// Drops `mr_id`. When it was the last one on its registration, the registration goes
    /// (and its advertisement is revoked); transfers in flight keep the memory registered
    /// until they finish.
    pub fn dereg(&self, mr_id: u64) -> Outcome<()> {
        let st = self.st()?;
        let gone = {
            let mut regs = st.regs.write().unwrap_or_else(|p| p.into_inner());
            let Some(handle) = regs.handles.remove(&mr_id) else {
                drop(regs);
                self.endpoint()?;
                return Err(Failure::bad(format!("unknown mr_id {mr_id}")));
            };
            let key = (handle.mr.base, handle.mr.serial);
            let last = match regs.live.get_mut(&key) {
                Some((_, n)) => {
                    *n -= 1;
                    *n == 0
                }
                None => false,
            };
            if last {
                regs.live.remove(&key);
                Some(handle.mr)
            } else {
                None
            }
        };
        if let Some(mr) = gone {
            let advert = *mr.advert.lock().unwrap_or_else(|p| p.into_inner());
            if let (Some(d), Ok(endpoint)) = (advert, self.endpoint()) {
                endpoint.revoke(&d);
            }
        }
        Ok(())
    }

    /// The registration and the offset of `piece` in it, after checking the range lies
    /// inside what `mr_id` registered.
    fn resolve(&self, piece: Piece) -> Outcome<(Arc<Mr>, usize, usize)> {
        let found = self
            .st()?
            .regs
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .handles
            .get(&piece.mr_id)
            .map(|h| (h.mr.clone(), h.base, h.len));
        let Some((mr, base, len)) = found else {
            self.endpoint()?;
            return Err(Failure::bad(format!("unknown mr_id {}", piece.mr_id)));
        };
        let inside = piece.ptr >= base
            && piece
                .ptr
                .checked_add(piece.size)
                .is_some_and(|end| end <= base + len);
        if !inside {
            return Err(Failure::bad(format!(
                "{} bytes at {:#x} are not inside mr_id {} ({} bytes at {:#x})",
                piece.size, piece.ptr, piece.mr_id, len, base
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
        self.with_segments(conn_id, pieces, |conn, segments| match way {
            Way::Send => conn.send_vectored(segments),
            Way::Recv => conn.recv_vectored(segments),
        })
    }

    /// Starts a batch of small messages (`Connection::send_batch` / `recv_batch`): one
    /// submission, one packed stream; the peer uses the batch form of the same total.
    pub fn batch(&self, way: Way, conn_id: u64, pieces: &[Piece]) -> Outcome<Transfer> {
        self.with_segments(conn_id, pieces, |conn, segments| match way {
            Way::Send => conn.send_batch(segments),
            Way::Recv => conn.recv_batch(segments),
        })
    }

    /// Resolves `pieces` into segments of registered regions and starts `start` on the
    /// connection with them.
    fn with_segments(
        &self,
        conn_id: u64,
        pieces: &[Piece],
        start: impl FnOnce(&Connection, &[Segment<'_>]) -> tcpx_runtime::Result<Transfer>,
    ) -> Outcome<Transfer> {
        let conn = self.conn(conn_id)?;
        let resolved = self.resolve_all(pieces)?;
        let segments: Vec<Segment<'_>> = resolved
            .iter()
            .map(|(mr, offset, len)| Segment::new(&mr.region, *offset, *len))
            .collect();
        Ok(start(&conn, &segments)?)
    }

    /// Allocates and registers the pack buffers of `batches` batches in flight on
    /// `conn_id` up front; returns the buffers now pooled.
    pub fn reserve_batches(&self, conn_id: u64, batches: usize) -> Outcome<usize> {
        Ok(self.conn(conn_id)?.reserve_batches(batches)?)
    }

    /// The packing counters of `conn_id`'s batches.
    pub fn batch_pack_stats(&self, conn_id: u64) -> Outcome<PackStats> {
        Ok(self.conn(conn_id)?.batch_pack_stats())
    }

    /// The registration's descriptor, advertising it on first use.
    fn descriptor_of(&self, mr: &Mr) -> Outcome<Descriptor> {
        let mut advert = mr.advert.lock().unwrap_or_else(|p| p.into_inner());
        match *advert {
            Some(d) => Ok(d),
            None => {
                let d = self.endpoint()?.advertise(&mr.region)?;
                *advert = Some(d);
                Ok(d)
            }
        }
    }

    /// Advertises `piece` for one-sided access; returns the 64-byte blob for the peer.
    pub fn advertise(&self, piece: Piece) -> Outcome<[u8; crate::blob::ADVERT_BYTES]> {
        let (mr, offset, len) = self.resolve(piece)?;
        Ok(Advert {
            addr: piece.ptr,
            len: len as u64,
            offset: offset as u64,
            descriptor: self.descriptor_of(&mr)?,
        }
        .encode())
    }

    /// The keys of `mr_id`'s registration for a transfer descriptor (advertising it on
    /// first use): every `mr_id` of one registration gets the same keys.
    pub fn keys(&self, mr_id: u64) -> Outcome<RemoteKey> {
        let mr = self
            .st()?
            .regs
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .handles
            .get(&mr_id)
            .map(|h| h.mr.clone())
            .ok_or_else(|| Failure::bad(format!("unknown mr_id {mr_id}")))?;
        Ok(RemoteKey {
            descriptor: self.descriptor_of(&mr)?,
            base: mr.base,
        })
    }

    /// Starts ONE one-sided write (`write = true`) or read of the whole list: `pieces[i]`
    /// goes to / comes from `remote[i]` (at most its length).
    pub fn one_sided(
        &self,
        write: bool,
        conn_id: u64,
        pieces: &[Piece],
        remote: &[RemoteRange],
        notification: Option<&[u8]>,
    ) -> Outcome<Transfer> {
        if pieces.len() != remote.len() {
            return Err(Failure::bad(format!(
                "{} local buffers but {} remote ones",
                pieces.len(),
                remote.len()
            )));
        }
        let conn = self.conn(conn_id)?;
        let resolved = self.resolve_all(pieces)?;
        let mut targets = Vec::with_capacity(remote.len());
        for (i, (r, (_, _, len))) in remote.iter().zip(&resolved).enumerate() {
            if *len as u64 > r.len {
                return Err(Failure::bad(format!(
                    "buffer {i}: {len} bytes but the peer's buffer holds {}",
                    r.len
                )));
            }
            targets.push(RemoteSegment::new(r.descriptor, r.offset, *len as u64));
        }
        let segments: Vec<Segment<'_>> = resolved
            .iter()
            .map(|(mr, offset, len)| Segment::new(&mr.region, *offset, *len))
            .collect();
        Ok(if write {
            conn.write(&segments, &targets, notification)?
        } else {
            conn.read(&segments, &targets)?
        })
    }

    /// [`Core::one_sided`] into / from the peer's advertised `blobs` (one per piece).
    pub fn one_sided_blobs(
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
        let remote = blobs
            .iter()
            .enumerate()
            .map(|(i, blob)| {
                crate::blob::decode_advert(blob)
                    .map(|a| a.range())
                    .map_err(|f| Failure::new(f.kind, format!("blob {i}: {}", f.message)))
            })
            .collect::<Outcome<Vec<_>>>()?;
        self.one_sided(write, conn_id, pieces, &remote, notification)
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
        let conns = self.st()?.conns.read().unwrap_or_else(|p| p.into_inner());
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
    pub fn track(&self, transfer: Transfer) -> Outcome<u64> {
        let st = self.st()?;
        let id = st.next_xfer.fetch_add(1, Ordering::Relaxed);
        st.xfers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, transfer);
        Ok(id)
    }

    /// `Ok(false)` while transfer `id` runs; `Ok(true)` once it finished well (the id is then
    /// forgotten); its error if it failed (forgotten too).
    pub fn poll(&self, id: u64) -> Outcome<bool> {
        let mut xfers = self.st()?.xfers.lock().unwrap_or_else(|p| p.into_inner());
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
        self.st()?
            .xfers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id)
            .cloned()
            .ok_or_else(|| Failure::bad(format!("unknown transfer_id {id}")))
    }

    /// Closes every connection (pending transfers fail), drops registrations and stops the
    /// engines. Idempotent; does nothing on an endpoint inherited through `fork()`. Blocks
    /// until the engines released the connections' comms, so call it without the GIL.
    pub fn close(&self) {
        let Ok(st) = self.st() else { return };
        let passive = st.passive.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(p) = passive {
            p.stop.store(true, Ordering::Relaxed);
            // Ends the accept it waits in at once (else it would notice at the slice's end;
            // scripts that make and close endpoints in a loop paid that each time).
            if let Ok(endpoint) = self.endpoint() {
                endpoint.stop_accepting();
            }
            // A panic in it has nothing left to report.
            let _ = p.thread.join();
        }
        self.close_locals();
        let conns = std::mem::take(&mut *st.conns.write().unwrap_or_else(|p| p.into_inner()));
        drop(conns);
        st.peers.lock().unwrap_or_else(|p| p.into_inner()).clear();
        st.ranks.lock().unwrap_or_else(|p| p.into_inner()).clear();
        st.xfers.lock().unwrap_or_else(|p| p.into_inner()).clear();
        let regs = std::mem::take(&mut *st.regs.write().unwrap_or_else(|p| p.into_inner()));
        drop(regs);
        let endpoint = st
            .endpoint
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        drop(endpoint);
    }

    /// Whether [`Core::close`] ran (always true for an endpoint inherited through `fork()`:
    /// it is unusable).
    pub fn is_closed(&self) -> bool {
        match self.st() {
            Ok(st) => st
                .endpoint
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .is_none(),
            Err(_) => true,
        }
    }
}

/// The address this host's endpoints announce to peers (UCCL's `get_oob_ip`):
/// `TCPX_CONTROL_ADDR`'s when it names one, else the first data NIC's, which only an endpoint
/// knows (its plugin lists the NICs): one is made, asked and closed.
pub fn oob_ip() -> Outcome<IpAddr> {
    let ip = Config::from_env()?.control_addr.ip();
    if !ip.is_unspecified() {
        return Ok(ip);
    }
    let core = Core::new(None)?;
    let ip = core.metadata()?.control_addr.ip();
    core.close();
    Ok(ip)
}

impl Drop for Core {
    fn drop(&mut self) {
        if self.origin.inherited() {
            // Inherited from the parent: its threads do not exist here, and a lock they held
            // at fork() stays locked forever. Leak everything rather than touch it.
            return;
        }
        if let Some(p) = self
            .state
            .passive
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            // Not joined: this drop may run on that very thread (its slice held the last
            // reference); it sees the flag, or a dead `Weak`, and ends by itself.
            p.stop.store(true, Ordering::Relaxed);
        }
        // SAFETY: `state` is dropped exactly once, here, and never used afterwards (this is
        // the owner's drop).
        unsafe { ManuallyDrop::drop(&mut self.state) };
    }
}
