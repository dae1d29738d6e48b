//! `tcpx.p2p.Endpoint`: UCCL's `uccl.p2p.Endpoint` surface (names, argument order, keyword
//! names, defaults, return tuples), so that a UCCL p2p script runs with `from tcpx import p2p`.
//!
//! Like UCCL, calls report failure through an `ok` flag instead of raising; the reason is in
//! `tcpx.p2p.last_error()` (per thread). Where UCCL raises (the descriptor API's bad
//! arguments), this raises too. Blocking calls release the GIL and wait in short slices, so
//! Ctrl-C raises `KeyboardInterrupt`.
//!
//! The methods come in families: metadata and connections; registration; two-sided calls;
//! one-sided calls on 64-byte blobs ([`crate::blob`]); the descriptor API (`register_memory`
//! ... `transfer`, descriptors in [`crate::xfer`] / [`crate::descs`]); same-host CUDA IPC
//! (over the runtime's `LocalConnection`, [`crate::local`]); notifications. All of them
//! convert arguments and results around [`crate::core::Core`], which holds the state.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};
use tcpx_runtime::control::EndpointMetadata;

use crate::blob;
use crate::core::{Core, Piece, Way};
use crate::descs::{self, RemoteKey, RemoteRange};
use crate::errors::{self, Failure, Kind, Outcome};
use crate::local::IpcPiece;
use crate::xfer::{FloatType, XferDesc, NO_MR};
use crate::{rendezvous, wait};

/// UCCL's `p2p.Endpoint` over the tcpx runtime (TCPX when installed, else kernel TCP).
///
/// `Endpoint(local_gpu_idx=None, num_cpus=None)`: `local_gpu_idx` is announced to peers
/// (`accept` returns it on their side; `get_metadata` carries it). `num_cpus` is accepted for
/// compatibility and unused: the runtime sizes its progress engines itself (one pinned thread
/// per NIC with TCPX; per channel, fitted to the cores, with the socket plugin). The
/// configuration otherwise comes from the environment exactly as in Rust
/// (`Config::from_env`: `TCPX_PLUGIN_PATH`, `TCPX_NUM_CHANNELS`, `TCPX_CONTROL_ADDR`,
/// `TCPX_TIMEOUT_MS`, ...).
#[pyclass(frozen, module = "tcpx.p2p", name = "Endpoint")]
pub struct P2pEndpoint {
    core: Arc<Core>,
}

fn flag(r: Outcome<()>) -> bool {
    match r {
        Ok(()) => true,
        Err(f) => {
            errors::remember(f);
            false
        }
    }
}

fn with_id(r: Outcome<u64>) -> (bool, u64) {
    match r {
        Ok(id) => (true, id),
        Err(f) => {
            errors::remember(f);
            (false, 0)
        }
    }
}

fn zip_pieces(
    mr_id_v: &[u64],
    ptr_v: &[u64],
    size_v: &[u64],
    num_iovs: usize,
) -> Outcome<Vec<Piece>> {
    if mr_id_v.len() != num_iovs || ptr_v.len() != num_iovs || size_v.len() != num_iovs {
        return Err(Failure::bad(format!(
            "num_iovs is {num_iovs} but the lists have {}, {} and {} entries",
            mr_id_v.len(),
            ptr_v.len(),
            size_v.len()
        )));
    }
    Ok((0..num_iovs)
        .map(|i| Piece {
            mr_id: mr_id_v[i],
            ptr: ptr_v[i],
            size: size_v[i],
        })
        .collect())
}

impl P2pEndpoint {
    /// Submits without the GIL (a first use may register memory with the plugin).
    fn submit(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&Core) -> Outcome<tcpx_runtime::Transfer> + Send,
    ) -> Outcome<tcpx_runtime::Transfer> {
        let core = &*self.core;
        py.detach(|| f(core))
    }

    /// Submits, then waits for completion (interruptible).
    fn blocking(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&Core) -> Outcome<tcpx_runtime::Transfer> + Send,
    ) -> PyResult<bool> {
        let t = match self.submit(py, f) {
            Ok(t) => t,
            Err(e) => return Ok(flag(Err(e))),
        };
        Ok(flag(wait::transfer(py, &t, None)?.map(|_| ())))
    }

    fn asynchronous(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&Core) -> Outcome<tcpx_runtime::Transfer> + Send,
    ) -> (bool, u64) {
        with_id(self.submit(py, f).and_then(|t| self.core.track(t)))
    }

    fn connect_to(&self, py: Python<'_>, target: Target) -> PyResult<(bool, u64)> {
        let core = self.core.clone();
        let r = wait::blocking(py, move || match target {
            Target::Addr(a) => core.connect_addr(a),
            Target::Full(m) => core.connect_metadata(&m),
        })?;
        Ok(with_id(r))
    }
}

enum Target {
    Addr(SocketAddr),
    Full(Box<EndpointMetadata>),
}

/// The runtime's full metadata, or UCCL's (today's or the older layout).
fn target_of(bytes: &[u8]) -> Outcome<Target> {
    match EndpointMetadata::from_bytes(bytes) {
        Ok(m) => Ok(Target::Full(Box::new(m))),
        Err(full) => match blob::parse_uccl_metadata(bytes) {
            Ok((addr, _)) => Ok(Target::Addr(addr)),
            Err(_) => Err(Failure::bad(format!(
                "endpoint metadata ({} bytes) is neither UCCL's nor tcpx's: {full}",
                bytes.len()
            ))),
        },
    }
}

#[pymethods]
impl P2pEndpoint {
    #[new]
    #[pyo3(signature = (local_gpu_idx=None, num_cpus=None))]
    fn new(py: Python<'_>, local_gpu_idx: Option<u32>, num_cpus: Option<u32>) -> PyResult<Self> {
        let _ = num_cpus;
        let core = errors::raise(py, py.detach(|| Core::new(local_gpu_idx)))?;
        Ok(Self {
            core: Arc::new(core),
        })
    }

    /// UCCL's metadata: IPv4 (4 bytes) or IPv6 (16), port (2, network order), the length of
    /// the GPU's PCI bus id (1) and the bus id ("" without a GPU). `connect(metadata)` and
    /// `add_remote_endpoint` take it; `parse_metadata` reads it.
    fn get_metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let meta = errors::raise(py, self.core.metadata())?;
        let bus = errors::raise(py, self.core.gpu_bus())?;
        Ok(PyBytes::new(
            py,
            &blob::uccl_metadata(meta.control_addr, &bus),
        ))
    }

    /// Older UCCL name of [`get_metadata`](Self::get_metadata).
    fn get_endpoint_metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        self.get_metadata(py)
    }

    /// `(ip, port, gpu_bdf)` from UCCL metadata: the GPU's PCI bus id (what `connect_local`
    /// takes; "" without a GPU), or the GPU index as a string in the older 10/22-byte
    /// layout. Raises `ValueError` (`tcpx.BadArgument`) on bytes that are neither.
    #[staticmethod]
    fn parse_metadata(py: Python<'_>, metadata: &[u8]) -> PyResult<(String, u16, String)> {
        let (addr, gpu) = errors::raise(py, blob::parse_uccl_metadata(metadata))?;
        Ok((addr.ip().to_string(), addr.port(), gpu))
    }

    /// `connect(remote_ip_addr, remote_gpu_bdf, remote_port=-1) -> (ok, conn_id)`, or
    /// `connect(metadata)` with the peer's `get_metadata()` bytes. The control connection
    /// carries the plugin handles, so the address suffices; the port names the endpoint
    /// (`remote_port=-1` cannot be resolved and fails: pass the peer's port).
    /// `remote_gpu_bdf` (UCCL today: the peer GPU's PCI bus id; older UCCL: its index, also
    /// accepted as keyword `remote_gpu_idx`) is informational: the peer's own announcement
    /// wins.
    #[pyo3(signature = (remote_ip_addr, remote_gpu_bdf=None, remote_port=-1, *, remote_gpu_idx=None))]
    fn connect(
        &self,
        py: Python<'_>,
        remote_ip_addr: &Bound<'_, PyAny>,
        remote_gpu_bdf: Option<&Bound<'_, PyAny>>,
        remote_port: i64,
        remote_gpu_idx: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<(bool, u64)> {
        let _ = (remote_gpu_bdf, remote_gpu_idx);
        if let Ok(bytes) = remote_ip_addr.cast::<PyBytes>() {
            return match target_of(bytes.as_bytes()) {
                Ok(t) => self.connect_to(py, t),
                Err(f) => Ok(with_id(Err(f))),
            };
        }
        let ip: String = remote_ip_addr.extract()?;
        let addr = match (ip.parse::<IpAddr>(), u16::try_from(remote_port)) {
            (Ok(ip), Ok(port)) if port != 0 => SocketAddr::new(ip, port),
            (Err(_), _) => {
                return Ok(with_id(Err(Failure::bad(format!(
                    "not an IP address: {ip:?}"
                )))))
            }
            _ => {
                return Ok(with_id(Err(Failure::bad(format!(
                    "remote_port {remote_port}: pass the peer's port (parse_metadata gives it)"
                )))))
            }
        };
        self.connect_to(py, Target::Addr(addr))
    }

    /// Newer UCCL name: connect with the peer's metadata bytes -> `(ok, conn_id)`. Connects
    /// once per peer: the same metadata again gives the same `conn_id` until
    /// `remove_remote_endpoint`.
    fn add_remote_endpoint(&self, py: Python<'_>, metadata_bytes: &[u8]) -> PyResult<(bool, u64)> {
        match self.core.known_peer(metadata_bytes) {
            Ok(Some(id)) => return Ok((true, id)),
            Ok(None) => {}
            Err(f) => return Ok(with_id(Err(f))),
        }
        let target = match target_of(metadata_bytes) {
            Ok(t) => t,
            Err(f) => return Ok(with_id(Err(f))),
        };
        let (ok, id) = self.connect_to(py, target)?;
        if ok {
            if let Err(f) = self.core.remember_peer(metadata_bytes.to_vec(), id) {
                return Ok(with_id(Err(f)));
            }
        }
        Ok((ok, id))
    }

    /// Closes a connection -> ok (`False` for an unknown or already removed `conn_id`). A
    /// later `add_remote_endpoint` of the same peer connects anew, with a new `conn_id`.
    fn remove_remote_endpoint(&self, py: Python<'_>, conn_id: u64) -> bool {
        let core = self.core.clone();
        flag(py.detach(|| core.remove_conn(conn_id)).and_then(|found| {
            if found {
                Ok(())
            } else {
                Err(Failure::bad(format!("unknown conn_id {conn_id}")))
            }
        }))
    }

    /// UCCL's `start_passive_accept() -> True`: accepts every peer that connects, on a
    /// background thread, until the endpoint closes, so peers can `add_remote_endpoint`
    /// and then `transfer` / `write` / `read` into this side's registered memory with no
    /// call here. Idempotent; `False` on a closed endpoint.
    fn start_passive_accept(&self) -> bool {
        flag(self.core.start_passive_accept())
    }

    /// UCCL's `conn_id_of_rank(rank)`: the connection of a peer rank, or 2**64-1 when there
    /// is none. Ranks are known after [`rendezvous`](Self::rendezvous) (while their
    /// connection is open); `connect` / `add_remote_endpoint` know no ranks (UCCL's table,
    /// at the commit in tests/uccl_api.txt, is never filled either).
    fn conn_id_of_rank(&self, rank: i64) -> u64 {
        usize::try_from(rank)
            .ok()
            .and_then(|r| self.core.conn_of_rank(r))
            .unwrap_or(NO_MR)
    }

    /// tcpx's addition: meets the other ranks of a job through a store with
    /// `torch.distributed.Store`'s interface (`set`, `get`, `check` or `wait`, `delete_key`)
    /// -> `(ok, {rank: conn_id})`, one connection to every other rank; afterwards
    /// `conn_id_of_rank(rank)` gives them. Every rank calls it with the same `world` (and
    /// `prefix`, `job`). `timeout` (seconds) bounds the whole meeting (default: the store's
    /// `timeout`, else 300 s). Keys go under `<prefix>/<job>/`; the endpoint's metadata there
    /// carries its secret. Interruptible with Ctrl-C; failures give `ok = False`.
    #[pyo3(signature = (store, rank, world, timeout=None, prefix="tcpx", job="group"))]
    #[allow(clippy::too_many_arguments)]
    fn rendezvous<'py>(
        &self,
        py: Python<'py>,
        store: &Bound<'py, PyAny>,
        rank: i64,
        world: i64,
        timeout: Option<f64>,
        prefix: &str,
        job: &str,
    ) -> PyResult<(bool, Bound<'py, PyDict>)> {
        let group = rendezvous::Group {
            prefix: prefix.to_owned(),
            job: job.to_owned(),
            rank,
            world,
            timeout,
        };
        let out = PyDict::new(py);
        match rendezvous::group(py, &self.core, store, group)? {
            Ok(peers) => {
                for (r, id) in peers {
                    out.set_item(r, id)?;
                }
                Ok((true, out))
            }
            Err(f) => {
                errors::remember(f);
                Ok((false, out))
            }
        }
    }

    /// tcpx's addition: a snapshot of the endpoint's counters as a dict (the same as
    /// `tcpx.Endpoint.metrics()`: endpoint-wide counters, `connections` with their
    /// `conn_id` and per-channel counters, `nics`, `total`). Raises `tcpx.Closed` on a
    /// closed endpoint.
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (m, ids) = errors::raise(py, self.core.metrics())?;
        crate::metrics::to_dict(py, &m, &ids)
    }

    /// tcpx's addition: the Prometheus text of the endpoint's counters.
    fn metrics_text(&self, py: Python<'_>) -> PyResult<String> {
        errors::raise(py, self.core.metrics_text())
    }

    /// Waits for a peer -> `(ok, ip, remote_gpu_idx, conn_id)` (`remote_gpu_idx` -1 when the
    /// peer announced none). Interruptible with Ctrl-C.
    fn accept(&self, py: Python<'_>) -> PyResult<(bool, String, i64, u64)> {
        loop {
            let core = self.core.clone();
            match py.detach(|| core.accept(wait::SLICE)) {
                Ok((id, peer, gpu)) => {
                    return Ok((true, peer.ip().to_string(), gpu.map_or(-1, i64::from), id))
                }
                Err(f) if f.kind == Kind::Timeout => py.check_signals()?,
                Err(f) => {
                    errors::remember(f);
                    return Ok((false, String::new(), -1, 0));
                }
            }
        }
    }

    /// Registers `size` bytes at `ptr` (host or CUDA memory; the driver says which) ->
    /// `(ok, mr_id)`. TCPX equivalent of an RDMA MR: nothing is pinned here; the plugin
    /// registers the range per connection, on its one-sided comms — on every connection up
    /// now, and on each later one as it is set up — so that the first `write` / `read` on a
    /// connection registers nothing. A range inside memory this endpoint
    /// registered already shares that registration (a new `mr_id`, the same keys), like
    /// UCCL's MR cache. `floatType` (a `FloatType`; UCCL compresses floats with it) is
    /// accepted and ignored: bytes travel as they are. The memory must stay allocated until
    /// `dereg` and every transfer on it finished.
    #[pyo3(signature = (ptr, size, floatType=FloatType::Undefined))]
    #[allow(non_snake_case)]
    fn reg(
        &self,
        py: Python<'_>,
        ptr: u64,
        size: u64,
        floatType: Option<FloatType>,
    ) -> (bool, u64) {
        let _ = floatType;
        let core = self.core.clone();
        // SAFETY: UCCL's contract, stated in the docstring: the caller keeps the memory
        // allocated until dereg and until transfers on it finished.
        with_id(py.detach(|| unsafe { core.reg(ptr, size) }))
    }

    /// Registers several buffers -> `(ok, [mr_id, ...])` (all or none).
    fn regv(&self, py: Python<'_>, ptrs: Vec<u64>, sizes: Vec<u64>) -> PyResult<(bool, Vec<u64>)> {
        if ptrs.len() != sizes.len() {
            // UCCL raises here (a caller's bug), rather than reporting `ok = False`.
            return Err(Failure::bad(format!(
                "regv: ptrs and sizes must match ({} pointers, {} sizes)",
                ptrs.len(),
                sizes.len()
            ))
            .into_py(py));
        }
        let core = self.core.clone();
        let r = py.detach(|| {
            let mut ids = Vec::with_capacity(ptrs.len());
            for (&p, &s) in ptrs.iter().zip(&sizes) {
                // SAFETY: UCCL's contract for `regv`, as for `reg`: the caller keeps each of these
                // ranges allocated until dereg and until transfers on it finished.
                match unsafe { core.reg(p, s) } {
                    Ok(id) => ids.push(id),
                    Err(f) => {
                        for id in ids {
                            let _ = core.dereg(id);
                        }
                        return Err(f);
                    }
                }
            }
            Ok(ids)
        });
        Ok(match r {
            Ok(ids) => (true, ids),
            Err(f) => {
                errors::remember(f);
                (false, Vec::new())
            }
        })
    }

    /// Deregisters -> ok (revokes its advertisement; transfers in flight finish).
    fn dereg(&self, mr_id: u64) -> bool {
        flag(self.core.dereg(mr_id))
    }

    /// Sends `size` bytes at `ptr` (inside `mr_id`) and waits -> ok. Pairs with the peer's
    /// `recv` of the same size, in order.
    fn send(
        &self,
        py: Python<'_>,
        conn_id: u64,
        mr_id: u64,
        ptr: u64,
        size: u64,
    ) -> PyResult<bool> {
        self.blocking(py, |c| {
            c.two_sided(Way::Send, conn_id, Piece { mr_id, ptr, size })
        })
    }

    /// Receives `size` bytes into `ptr` (inside `mr_id`) and waits -> ok.
    fn recv(
        &self,
        py: Python<'_>,
        conn_id: u64,
        mr_id: u64,
        ptr: u64,
        size: u64,
    ) -> PyResult<bool> {
        self.blocking(py, |c| {
            c.two_sided(Way::Recv, conn_id, Piece { mr_id, ptr, size })
        })
    }

    /// `send` without waiting -> `(ok, transfer_id)`; finish with `poll_async`.
    fn send_async(
        &self,
        py: Python<'_>,
        conn_id: u64,
        mr_id: u64,
        ptr: u64,
        size: u64,
    ) -> (bool, u64) {
        self.asynchronous(py, |c| {
            c.two_sided(Way::Send, conn_id, Piece { mr_id, ptr, size })
        })
    }

    /// `recv` without waiting -> `(ok, transfer_id)`.
    fn recv_async(
        &self,
        py: Python<'_>,
        conn_id: u64,
        mr_id: u64,
        ptr: u64,
        size: u64,
    ) -> (bool, u64) {
        self.asynchronous(py, |c| {
            c.two_sided(Way::Recv, conn_id, Piece { mr_id, ptr, size })
        })
    }

    /// Sends `num_iovs` buffers as one message and waits -> ok. Pairs with the peer's
    /// `recvv` (which may cut the bytes differently; the totals must match).
    fn sendv(
        &self,
        py: Python<'_>,
        conn_id: u64,
        mr_id_v: Vec<u64>,
        data_ptr_v: Vec<u64>,
        size_v: Vec<u64>,
        num_iovs: usize,
    ) -> PyResult<bool> {
        self.blocking(py, |c| {
            c.two_sided_v(
                Way::Send,
                conn_id,
                &zip_pieces(&mr_id_v, &data_ptr_v, &size_v, num_iovs)?,
            )
        })
    }

    /// Receives one `sendv` message into `num_iovs` buffers and waits -> ok.
    fn recvv(
        &self,
        py: Python<'_>,
        conn_id: u64,
        mr_id_v: Vec<u64>,
        data_ptr_v: Vec<u64>,
        size_v: Vec<u64>,
        num_iovs: usize,
    ) -> PyResult<bool> {
        self.blocking(py, |c| {
            c.two_sided_v(
                Way::Recv,
                conn_id,
                &zip_pieces(&mr_id_v, &data_ptr_v, &size_v, num_iovs)?,
            )
        })
    }

    /// `sendv` without waiting -> `(ok, transfer_id)`.
    fn sendv_async(
        &self,
        py: Python<'_>,
        conn_id: u64,
        mr_id_v: Vec<u64>,
        data_ptr_v: Vec<u64>,
        size_v: Vec<u64>,
        num_iovs: usize,
    ) -> (bool, u64) {
        self.asynchronous(py, |c| {
            c.two_sided_v(
                Way::Send,
                conn_id,
                &zip_pieces(&mr_id_v, &data_ptr_v, &size_v, num_iovs)?,
            )
        })
    }

    /// `recvv` without waiting -> `(ok, transfer_id)`.
    fn recvv_async(
        &self,
        py: Python<'_>,
        conn_id: u64,
        mr_id_v: Vec<u64>,
        data_ptr_v: Vec<u64>,
        size_v: Vec<u64>,
        num_iovs: usize,
    ) -> (bool, u64) {
        self.asynchronous(py, |c| {
            c.two_sided_v(
                Way::Recv,
                conn_id,
                &zip_pieces(&mr_id_v, &data_ptr_v, &size_v, num_iovs)?,
            )
        })
    }

    /// `(ok, is_done)` of an asynchronous transfer. Once `is_done`, the id is forgotten. A
    /// failed transfer gives `(False, True)`; an unknown id `(False, False)`. Never blocks.
    fn poll_async(&self, transfer_id: u64) -> (bool, bool) {
        match self.core.poll(transfer_id) {
            Ok(done) => (true, done),
            Err(f) => {
                let unknown = f.kind == Kind::BadArgument;
                errors::remember(f);
                (false, !unknown)
            }
        }
    }

    /// Exposes `size` bytes at `ptr` (inside `mr_id`) for the peer's one-sided `write` /
    /// `read` -> `(ok, blob)`: a 64-byte blob, like UCCL's serialized FifoItem, to hand to the
    /// peer. Both UCCL forms: `advertise(conn_id, mr_id, ptr, size)` and newer
    /// `advertise(mr_id, ptr, size)`; `conn_id`, if given, must name a connection, but any
    /// connection of this endpoint may use the blob. TCPX equivalent of an rkey: the blob
    /// carries the registration's random access key; the peer's requests are checked against
    /// the registration on this side (no call needed here).
    #[pyo3(signature = (*args, conn_id=None, mr_id=None, ptr=None, size=None))]
    fn advertise<'py>(
        &self,
        py: Python<'py>,
        args: &Bound<'py, PyTuple>,
        conn_id: Option<u64>,
        mr_id: Option<u64>,
        ptr: Option<u64>,
        size: Option<u64>,
    ) -> PyResult<(bool, Bound<'py, PyBytes>)> {
        let vals = overload(args, [conn_id, mr_id, ptr, size])?;
        let r = (|| {
            let [conn, mr_id, ptr, size] = vals?;
            if let Some(c) = conn {
                self.core.conn(c)?;
            }
            let need = |v: Option<u64>, n: &str| {
                v.ok_or_else(|| Failure::bad(format!("advertise: {n} missing")))
            };
            self.core.advertise(Piece {
                mr_id: need(mr_id, "mr_id")?,
                ptr: need(ptr, "ptr")?,
                size: need(size, "size")?,
            })
        })();
        Ok(match r {
            Ok(b) => (true, PyBytes::new(py, &b)),
            Err(f) => {
                errors::remember(f);
                (false, PyBytes::new(py, b""))
            }
        })
    }

    /// `advertise` for `num_iovs` buffers -> `(ok, [blob, ...])`; both UCCL forms
    /// (`advertisev(conn_id, mr_id_v, ptr_v, size_v, num_iovs)` and without `conn_id`).
    #[pyo3(signature = (*args, conn_id=None, mr_id_v=None, ptr_v=None, size_v=None, num_iovs=None))]
    #[allow(clippy::too_many_arguments)]
    fn advertisev<'py>(
        &self,
        py: Python<'py>,
        args: &Bound<'py, PyTuple>,
        conn_id: Option<u64>,
        mr_id_v: Option<Vec<u64>>,
        ptr_v: Option<Vec<u64>>,
        size_v: Option<Vec<u64>>,
        num_iovs: Option<usize>,
    ) -> PyResult<(bool, Vec<Bound<'py, PyBytes>>)> {
        let n = args.len();
        let with_conn = n == 5 || (conn_id.is_some() && n == 0);
        let mut it = args.iter();
        let mut next_u64 = |kw: Option<u64>| -> PyResult<Option<u64>> {
            match it.next() {
                Some(v) => Ok(Some(v.extract()?)),
                None => Ok(kw),
            }
        };
        let conn = if with_conn {
            next_u64(conn_id)?
        } else {
            conn_id
        };
        let mut rest: Vec<Bound<'py, PyAny>> = it.collect();
        rest.reverse();
        let mut pop_vec = |kw: Option<Vec<u64>>| -> PyResult<Option<Vec<u64>>> {
            match rest.pop() {
                Some(v) => Ok(Some(v.extract()?)),
                None => Ok(kw),
            }
        };
        let mr_id_v = pop_vec(mr_id_v)?;
        let ptr_v = pop_vec(ptr_v)?;
        let size_v = pop_vec(size_v)?;
        let num_iovs: Option<usize> = match rest.pop() {
            Some(v) => Some(v.extract()?),
            None => num_iovs,
        };
        // UCCL answers a failed `advertisev` with `num_iovs` zeroed blobs, so that a script
        // indexing the list fails on the peer's side (refused), not with an IndexError here.
        // Never more than the lists hold: a wild `num_iovs` must not allocate.
        let expected = match (&mr_id_v, num_iovs) {
            (Some(m), Some(n)) => n.min(m.len()),
            (Some(m), None) => m.len(),
            (None, _) => 0,
        };
        let r = (|| {
            if let Some(c) = conn {
                self.core.conn(c)?;
            }
            let (Some(m), Some(p), Some(s)) = (mr_id_v, ptr_v, size_v) else {
                return Err(Failure::bad(
                    "advertisev: mr_id_v, ptr_v and size_v are required",
                ));
            };
            let n = num_iovs.unwrap_or(m.len());
            zip_pieces(&m, &p, &s, n)?
                .into_iter()
                .map(|piece| self.core.advertise(piece))
                .collect::<Outcome<Vec<_>>>()
        })();
        Ok(match r {
            Ok(blobs) => (true, blobs.iter().map(|b| PyBytes::new(py, b)).collect()),
            Err(f) => {
                errors::remember(f);
                let zeroed = PyBytes::new(py, &[0u8; blob::ADVERT_BYTES]);
                (false, vec![zeroed; expected])
            }
        })
    }

    /// One-sided write of `size` bytes at `ptr` into the peer's advertised buffer (`meta`:
    /// its 64-byte blob) and wait -> ok. TCPX equivalent of RDMA-WRITE: the peer's engines
    /// place the bytes; no call is needed on the peer.
    fn write(
        &self,
        py: Python<'_>,
        conn_id: u64,
        mr_id: u64,
        ptr: u64,
        size: u64,
        meta: &[u8],
    ) -> PyResult<bool> {
        self.blocking(py, |c| {
            c.one_sided_blobs(true, conn_id, &[Piece { mr_id, ptr, size }], &[meta], None)
        })
    }

    /// `write` without waiting -> `(ok, transfer_id)`.
    fn write_async(
        &self,
        py: Python<'_>,
        conn_id: u64,
        mr_id: u64,
        ptr: u64,
        size: u64,
        meta: &[u8],
    ) -> (bool, u64) {
        self.asynchronous(py, |c| {
            c.one_sided_blobs(true, conn_id, &[Piece { mr_id, ptr, size }], &[meta], None)
        })
    }

    /// One-sided read of the peer's advertised buffer into `size` bytes at `ptr` and wait ->
    /// ok (TCPX equivalent of RDMA-READ).
    fn read(
        &self,
        py: Python<'_>,
        conn_id: u64,
        mr_id: u64,
        ptr: u64,
        size: u64,
        meta: &[u8],
    ) -> PyResult<bool> {
        self.blocking(py, |c| {
            c.one_sided_blobs(false, conn_id, &[Piece { mr_id, ptr, size }], &[meta], None)
        })
    }

    /// `read` without waiting -> `(ok, transfer_id)`.
    fn read_async(
        &self,
        py: Python<'_>,
        conn_id: u64,
        mr_id: u64,
        ptr: u64,
        size: u64,
        meta: &[u8],
    ) -> (bool, u64) {
        self.asynchronous(py, |c| {
            c.one_sided_blobs(false, conn_id, &[Piece { mr_id, ptr, size }], &[meta], None)
        })
    }

    /// Vectored `write`: `num_iovs` local buffers into as many advertised blobs, one batch.
    #[allow(clippy::too_many_arguments)]
    fn writev(
        &self,
        py: Python<'_>,
        conn_id: u64,
        mr_id_v: Vec<u64>,
        ptr_v: Vec<u64>,
        size_v: Vec<u64>,
        meta_blob_v: Vec<Vec<u8>>,
        num_iovs: usize,
    ) -> PyResult<bool> {
        self.blocking(py, |c| {
            one_sided_v(
                c,
                true,
                conn_id,
                &mr_id_v,
                &ptr_v,
                &size_v,
                &meta_blob_v,
                num_iovs,
            )
        })
    }

    /// `writev` without waiting -> `(ok, transfer_id)`.
    #[allow(clippy::too_many_arguments)]
    fn writev_async(
        &self,
        py: Python<'_>,
        conn_id: u64,
        mr_id_v: Vec<u64>,
        ptr_v: Vec<u64>,
        size_v: Vec<u64>,
        meta_blob_v: Vec<Vec<u8>>,
        num_iovs: usize,
    ) -> (bool, u64) {
        self.asynchronous(py, |c| {
            one_sided_v(
                c,
                true,
                conn_id,
                &mr_id_v,
                &ptr_v,
                &size_v,
                &meta_blob_v,
                num_iovs,
            )
        })
    }

    /// Vectored `read`.
    #[allow(clippy::too_many_arguments)]
    fn readv(
        &self,
        py: Python<'_>,
        conn_id: u64,
        mr_id_v: Vec<u64>,
        ptr_v: Vec<u64>,
        size_v: Vec<u64>,
        meta_blob_v: Vec<Vec<u8>>,
        num_iovs: usize,
    ) -> PyResult<bool> {
        self.blocking(py, |c| {
            one_sided_v(
                c,
                false,
                conn_id,
                &mr_id_v,
                &ptr_v,
                &size_v,
                &meta_blob_v,
                num_iovs,
            )
        })
    }

    /// `readv` without waiting -> `(ok, transfer_id)`.
    #[allow(clippy::too_many_arguments)]
    fn readv_async(
        &self,
        py: Python<'_>,
        conn_id: u64,
        mr_id_v: Vec<u64>,
        ptr_v: Vec<u64>,
        size_v: Vec<u64>,
        meta_blob_v: Vec<Vec<u8>>,
        num_iovs: usize,
    ) -> (bool, u64) {
        self.asynchronous(py, |c| {
            one_sided_v(
                c,
                false,
                conn_id,
                &mr_id_v,
                &ptr_v,
                &size_v,
                &meta_blob_v,
                num_iovs,
            )
        })
    }

    // Descriptor API (UCCL's Ray-style calls) -----------------------------------------

    /// UCCL's `register_memory(tensor_list) -> [XferDesc]`: registers each tensor (anything
    /// with `data_ptr()`, `numel()` and `element_size()`, host or CUDA) or array / buffer
    /// (numpy, `__cuda_array_interface__`, the buffer protocol) and returns its descriptor,
    /// whose keys a peer can `transfer` into / from. Keep the objects alive until
    /// `deregister_memory`. All or none: a failure deregisters the ones done and raises
    /// (`tcpx.BadArgument` for an object that is not contiguous memory).
    fn register_memory(
        &self,
        py: Python<'_>,
        tensor_list: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<XferDesc>> {
        let items: Vec<Bound<'_, PyAny>> = tensor_list.extract()?;
        let mut ranges = Vec::with_capacity(items.len());
        for (i, obj) in items.iter().enumerate() {
            ranges.push(memory_of(py, obj).map_err(|e| {
                let msg = format!("register_memory: item {i}: {}", e.value(py));
                Failure::bad(msg).into_py(py)
            })?);
        }
        let core = self.core.clone();
        let descs = py.detach(move || {
            let mut out: Vec<XferDesc> = Vec::with_capacity(ranges.len());
            for (i, &(ptr, size)) in ranges.iter().enumerate() {
                // SAFETY: UCCL's contract, stated in the docstring: the caller keeps the
                // objects alive (their memory allocated) until deregister_memory.
                let r = unsafe { core.reg(ptr, size) }.and_then(|mr_id| {
                    let keys = core.keys(mr_id).inspect_err(|_| {
                        let _ = core.dereg(mr_id);
                    })?;
                    let mut d = desc_of(ptr, size, mr_id, &keys);
                    d.ipc_info = ipc_info_of(&core, ptr, size);
                    Ok(d)
                });
                match r {
                    Ok(d) => out.push(d),
                    Err(f) => {
                        for d in &out {
                            let _ = core.dereg(d.mr_id);
                        }
                        return Err(Failure::new(
                            f.kind,
                            format!("register_memory: item {i}: {}", f.message),
                        ));
                    }
                }
            }
            Ok(out)
        });
        errors::raise(py, descs)
    }

    /// UCCL's `deregister_memory(desc_list)`: deregisters each descriptor's `mr_id`
    /// (descriptors without one, from a peer, are skipped). Returns None; an unknown `mr_id`
    /// is skipped too and left in `last_error()`.
    fn deregister_memory(&self, py: Python<'_>, desc_list: Vec<PyRef<'_, XferDesc>>) {
        let ids: Vec<u64> = desc_list
            .iter()
            .map(|d| d.mr_id)
            .filter(|&id| id != NO_MR)
            .collect();
        drop(desc_list);
        let core = self.core.clone();
        let failed = py.detach(move || {
            let mut failed = None;
            for id in ids {
                if let Err(f) = core.dereg(id) {
                    failed = Some(f);
                }
            }
            failed
        });
        if let Some(f) = failed {
            errors::remember(f);
        }
    }

    /// UCCL's `get_serialized_descs(desc_list) -> bytes`: the descriptors' bytes for the
    /// peer's `deserialize_descs` (format: `descs.rs`; `mr_id` stays here).
    fn get_serialized_descs<'py>(
        &self,
        py: Python<'py>,
        desc_list: Vec<PyRef<'py, XferDesc>>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let list: Vec<descs::Desc> = desc_list.iter().map(|d| d.to_desc()).collect();
        let bytes = descs::encode(&list)
            .map_err(|e| Failure::bad(format!("get_serialized_descs: {e}")).into_py(py))?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// UCCL's `deserialize_descs(serialized_bytes) -> [XferDesc]`: the peer's descriptors
    /// (`mr_id` 2**64-1). Raises `tcpx.BadArgument` (also a `RuntimeError`, as UCCL raises)
    /// for bytes that are not a descriptor list, naming what is wrong.
    fn deserialize_descs(
        &self,
        py: Python<'_>,
        serialized_bytes: &[u8],
    ) -> PyResult<Vec<XferDesc>> {
        let list = descs::decode(serialized_bytes)
            .map_err(|e| Failure::bad(format!("deserialize_descs: {e}")).into_py(py))?;
        Ok(list.into_iter().map(XferDesc::from_desc).collect())
    }

    /// UCCL's `transfer(conn_id, op_name, local_desc_list, remote_desc_list) -> (ok,
    /// transfer_id)`: starts ONE one-sided `"write"` (local descriptors into the peer's) or
    /// `"read"` (the peer's into the local ones) of the whole list — one runtime operation,
    /// one control message, not one per descriptor — and returns at once; finish it with
    /// `poll_async(transfer_id)`. Entry `i` moves `local[i].size` bytes (at most
    /// `remote[i].size`). No call is needed on the peer (it accepted the connection, e.g.
    /// with `start_passive_accept`).
    ///
    /// Raises `tcpx.BadArgument` (also a `RuntimeError`, as UCCL raises) for lists of
    /// different lengths, an `op_name` other than "read" / "write", an invalid `conn_id`
    /// (never made or removed: the message says "Invalid conn_id"), a local descriptor
    /// without `mr_id` or a remote one without `rkeys`. Other failures give `ok = False`
    /// with `last_error()`; a refused access (forged or revoked keys, out of range) fails
    /// the transfer and writes nothing.
    fn transfer(
        &self,
        py: Python<'_>,
        conn_id: u64,
        op_name: &str,
        local_desc_list: Vec<PyRef<'_, XferDesc>>,
        remote_desc_list: Vec<PyRef<'_, XferDesc>>,
    ) -> PyResult<(bool, u64)> {
        let usage = |msg: String| Failure::bad(format!("transfer: {msg}")).into_py(py);
        if local_desc_list.len() != remote_desc_list.len() {
            return Err(usage(format!(
                "Local and remote descriptors must have the same size ({} local, {} remote)",
                local_desc_list.len(),
                remote_desc_list.len()
            )));
        }
        let write = match op_name {
            "write" => true,
            "read" => false,
            other => {
                return Err(usage(format!(
                    "Invalid op_name: {other:?} (\"read\" or \"write\")"
                )))
            }
        };
        let local = match self.core.conn(conn_id) {
            Ok(_) => false,
            Err(f) if f.kind == Kind::BadArgument => {
                if self.core.local_conn(conn_id).is_err() {
                    return Err(usage(format!(
                        "Invalid conn_id {conn_id}: no such connection (never made, or removed)"
                    )));
                }
                true
            }
            Err(f) => return Ok(with_id(Err(f))),
        };
        if local {
            // A same-host connection: the peer's CUDA registrations came with their IPC
            // info (register_memory advertises them), so the copy engines move the list.
            let mut items = Vec::with_capacity(local_desc_list.len());
            for (i, (l, r)) in local_desc_list.iter().zip(&remote_desc_list).enumerate() {
                if r.ipc_info.is_empty() {
                    return Err(usage(format!(
                        "remote descriptor {i} has no IPC info for a same-host transfer (only \
                         CUDA memory registered with register_memory carries it)"
                    )));
                }
                items.push((l.addr, l.size, r.ipc_info.clone(), r.addr));
            }
            drop((local_desc_list, remote_desc_list));
            return Ok(self.asynchronous(py, move |c| {
                let pieces: Vec<IpcPiece<'_>> = items
                    .iter()
                    .map(|(ptr, size, info, raddr)| IpcPiece {
                        ptr: *ptr,
                        size: *size,
                        info,
                        remote_addr: Some(*raddr),
                    })
                    .collect();
                // SAFETY: UCCL's contract: registered memory stays valid until the transfer
                // completes (the descriptors come from register_memory).
                unsafe { c.ipc(write, conn_id, &pieces) }
            }));
        }
        let mut pieces = Vec::with_capacity(local_desc_list.len());
        for (i, d) in local_desc_list.iter().enumerate() {
            if d.mr_id == NO_MR {
                return Err(usage(format!(
                    "local descriptor {i} has no mr_id: pass descriptors from register_memory"
                )));
            }
            pieces.push(Piece {
                mr_id: d.mr_id,
                ptr: d.addr,
                size: d.size,
            });
        }
        let mut keys = Vec::with_capacity(remote_desc_list.len());
        for (i, d) in remote_desc_list.iter().enumerate() {
            if d.rkeys.is_empty() {
                return Err(usage(format!(
                    "remote descriptor {i} has no rkeys: pass the peer's descriptors \
                     (get_serialized_descs there, deserialize_descs here)"
                )));
            }
            keys.push((d.rkeys.clone(), d.addr, d.size));
        }
        // Not borrowed while the GIL is released: another thread may set their fields.
        drop((local_desc_list, remote_desc_list));
        Ok(self.asynchronous(py, move |c| {
            let remote = remote_ranges(&keys)?;
            c.one_sided(write, conn_id, &pieces, &remote, None)
        }))
    }

    // Same-host CUDA IPC (UCCL's intra-node family) ------------------------------------
    // GPU memory between processes of one host through CUDA IPC handles and the copy
    // engines, no network ([`crate::local`], the runtime's `LocalConnection`). Failures give
    // `ok = False` with `last_error()`, as the network calls do.

    /// `connect_local(remote_gpu_bdf) -> (ok, conn_id)`: connects to the endpoint of this
    /// host on GPU `remote_gpu_bdf` (the PCI bus id `parse_metadata` returns, e.g.
    /// `0000:8a:00.0`; a GPU index of this host is accepted too). That endpoint must call
    /// `accept_local()`; this waits for it up to the endpoint timeout (`TCPX_TIMEOUT_MS`).
    fn connect_local(
        &self,
        py: Python<'_>,
        remote_gpu_bdf: &Bound<'_, PyAny>,
    ) -> PyResult<(bool, u64)> {
        let bdf = match remote_gpu_bdf.extract::<String>() {
            Ok(s) => s,
            Err(_) => remote_gpu_bdf.extract::<i64>()?.to_string(),
        };
        let core = self.core.clone();
        Ok(with_id(wait::blocking(py, move || {
            core.connect_local(&bdf)
        })?))
    }

    /// `accept_local() -> (ok, remote_gpu_bdf, conn_id)`: waits (interruptibly, without a
    /// limit, as UCCL) for a peer of this host to `connect_local`; `remote_gpu_bdf` is the
    /// peer's GPU PCI bus id ("" when it has none). The first endpoint of a GPU to accept
    /// answers to that GPU's bus id.
    fn accept_local(&self, py: Python<'_>) -> PyResult<(bool, String, u64)> {
        loop {
            let core = self.core.clone();
            match py.detach(|| core.accept_local(wait::SLICE)) {
                Ok((id, bus)) => return Ok((true, bus, id)),
                Err(f) if f.kind == Kind::Timeout => py.check_signals()?,
                Err(f) => {
                    errors::remember(f);
                    return Ok((false, String::new(), 0));
                }
            }
        }
    }

    /// `advertise_ipc(conn_id, ptr, size) -> (ok, info)`: makes `size` bytes of CUDA memory
    /// at `ptr` writable and readable by the peer of same-host connection `conn_id` (any
    /// local peer of this endpoint may use `info`); hand it `info` (128 bytes). The memory
    /// must stay allocated while the peer may use it. Advertising the same range again
    /// returns the same `info`.
    fn advertise_ipc<'py>(
        &self,
        py: Python<'py>,
        conn_id: u64,
        ptr: u64,
        size: u64,
    ) -> (bool, Bound<'py, PyBytes>) {
        let core = self.core.clone();
        // SAFETY: UCCL's contract, stated in the docstring: the memory stays allocated.
        match py.detach(move || unsafe { core.advertise_ipc(conn_id, ptr, size) }) {
            Ok(b) => (true, PyBytes::new(py, &b)),
            Err(f) => {
                errors::remember(f);
                // Zeroed, as UCCL's: no owner issues an all-zero descriptor.
                (
                    false,
                    PyBytes::new(py, &[0u8; tcpx_runtime::IpcDescriptor::BYTES]),
                )
            }
        }
    }

    /// `advertisev_ipc(conn_id, ptr_v, size_v) -> (ok, [info])`: `advertise_ipc` of each
    /// range, all or none.
    fn advertisev_ipc<'py>(
        &self,
        py: Python<'py>,
        conn_id: u64,
        ptr_v: Vec<u64>,
        size_v: Vec<u64>,
    ) -> (bool, Vec<Bound<'py, PyBytes>>) {
        if ptr_v.len() != size_v.len() {
            errors::remember(Failure::bad(format!(
                "advertisev_ipc: {} pointers but {} sizes",
                ptr_v.len(),
                size_v.len()
            )));
            return (false, Vec::new());
        }
        let ranges = ptr_v.len();
        let core = self.core.clone();
        let r = py.detach(move || {
            ptr_v
                .iter()
                .zip(&size_v)
                .enumerate()
                .map(|(i, (&p, &n))| {
                    // SAFETY: as advertise_ipc (UCCL's contract).
                    unsafe { core.advertise_ipc(conn_id, p, n) }
                        .map_err(|f| Failure::new(f.kind, format!("range {i}: {}", f.message)))
                })
                .collect::<Outcome<Vec<_>>>()
        });
        match r {
            Ok(v) => (true, v.iter().map(|b| PyBytes::new(py, b)).collect()),
            Err(f) => {
                errors::remember(f);
                // One zeroed descriptor per range, as UCCL.
                let zeroed = PyBytes::new(py, &[0u8; tcpx_runtime::IpcDescriptor::BYTES]);
                (false, vec![zeroed; ranges])
            }
        }
    }

    /// `write_ipc(conn_id, ptr, size, info) -> ok`: copies `size` bytes at `ptr` (CUDA
    /// memory, or host memory: pinned is faster) into the start of the peer's advertised
    /// range `info`, and waits. Refused: a range longer than the advertised one, a forged
    /// or revoked `info`, a peer gone.
    fn write_ipc(
        &self,
        py: Python<'_>,
        conn_id: u64,
        ptr: u64,
        size: u64,
        info: Vec<u8>,
    ) -> PyResult<bool> {
        self.blocking(py, move |c| {
            ipc_v(c, true, conn_id, &[ptr], &[size], &[info])
        })
    }

    /// `read_ipc(conn_id, ptr, size, info) -> ok`: copies `size` bytes from the start of
    /// the peer's advertised range `info` to `ptr`, and waits.
    fn read_ipc(
        &self,
        py: Python<'_>,
        conn_id: u64,
        ptr: u64,
        size: u64,
        info: Vec<u8>,
    ) -> PyResult<bool> {
        self.blocking(py, move |c| {
            ipc_v(c, false, conn_id, &[ptr], &[size], &[info])
        })
    }

    /// `write_ipc_async(conn_id, ptr, size, info) -> (ok, transfer_id)` (`poll_async`).
    fn write_ipc_async(
        &self,
        py: Python<'_>,
        conn_id: u64,
        ptr: u64,
        size: u64,
        info: Vec<u8>,
    ) -> (bool, u64) {
        self.asynchronous(py, move |c| {
            ipc_v(c, true, conn_id, &[ptr], &[size], &[info])
        })
    }

    /// `read_ipc_async(conn_id, ptr, size, info) -> (ok, transfer_id)` (`poll_async`).
    fn read_ipc_async(
        &self,
        py: Python<'_>,
        conn_id: u64,
        ptr: u64,
        size: u64,
        info: Vec<u8>,
    ) -> (bool, u64) {
        self.asynchronous(py, move |c| {
            ipc_v(c, false, conn_id, &[ptr], &[size], &[info])
        })
    }

    /// `writev_ipc(conn_id, ptr_v, size_v, info_v) -> ok`: `write_ipc` of every piece, as
    /// one transfer.
    fn writev_ipc(
        &self,
        py: Python<'_>,
        conn_id: u64,
        ptr_v: Vec<u64>,
        size_v: Vec<u64>,
        info_v: Vec<Vec<u8>>,
    ) -> PyResult<bool> {
        self.blocking(py, move |c| {
            ipc_v(c, true, conn_id, &ptr_v, &size_v, &info_v)
        })
    }

    /// `readv_ipc(conn_id, ptr_v, size_v, info_v) -> ok`: `read_ipc` of every piece, as one
    /// transfer.
    fn readv_ipc(
        &self,
        py: Python<'_>,
        conn_id: u64,
        ptr_v: Vec<u64>,
        size_v: Vec<u64>,
        info_v: Vec<Vec<u8>>,
    ) -> PyResult<bool> {
        self.blocking(py, move |c| {
            ipc_v(c, false, conn_id, &ptr_v, &size_v, &info_v)
        })
    }

    /// `writev_ipc_async(conn_id, ptr_v, size_v, info_v) -> (ok, transfer_id)`.
    fn writev_ipc_async(
        &self,
        py: Python<'_>,
        conn_id: u64,
        ptr_v: Vec<u64>,
        size_v: Vec<u64>,
        info_v: Vec<Vec<u8>>,
    ) -> (bool, u64) {
        self.asynchronous(py, move |c| {
            ipc_v(c, true, conn_id, &ptr_v, &size_v, &info_v)
        })
    }

    /// `readv_ipc_async(conn_id, ptr_v, size_v, info_v) -> (ok, transfer_id)`.
    fn readv_ipc_async(
        &self,
        py: Python<'_>,
        conn_id: u64,
        ptr_v: Vec<u64>,
        size_v: Vec<u64>,
        info_v: Vec<Vec<u8>>,
    ) -> (bool, u64) {
        self.asynchronous(py, move |c| {
            ipc_v(c, false, conn_id, &ptr_v, &size_v, &info_v)
        })
    }

    /// UCCL's `uccl_engine_send_notif`: sends `msg` (bytes or str, at most 64 KiB) to the
    /// peer of `conn_id` -> ok. It reaches the peer's `get_notifs()` after the data of every
    /// `write` this side issued on the connection before it.
    fn send_notif(&self, conn_id: u64, msg: &Bound<'_, PyAny>) -> PyResult<bool> {
        let bytes: Vec<u8> = match msg.cast::<PyBytes>() {
            Ok(b) => b.as_bytes().to_vec(),
            Err(_) => msg.extract::<String>()?.into_bytes(),
        };
        Ok(flag(self.core.notify(conn_id, &bytes)))
    }

    /// UCCL's `uccl_engine_get_notifs`: takes the notifications delivered so far ->
    /// `[(conn_id, msg_bytes), ...]` in delivery order (`conn_id` -1 if its connection is
    /// gone).
    fn get_notifs<'py>(&self, py: Python<'py>) -> Vec<(i64, Bound<'py, PyBytes>)> {
        match self.core.notifications() {
            Ok(v) => v
                .into_iter()
                .map(|(id, _, b)| (id.map_or(-1, |i| i as i64), PyBytes::new(py, &b)))
                .collect(),
            Err(f) => {
                errors::remember(f);
                Vec::new()
            }
        }
    }

    /// Closes every connection and stops the engines (also done on garbage collection and
    /// at interpreter exit). Later calls fail with ok=False.
    fn close(&self, py: Python<'_>) {
        let core = self.core.clone();
        py.detach(|| core.close());
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) {
        self.close(py);
    }

    fn __repr__(&self) -> String {
        match self.core.metadata() {
            Ok(m) => format!(
                "<tcpx.p2p Endpoint {} gpu={:?}>",
                m.control_addr,
                self.core.gpu_index()
            ),
            Err(_) => "<tcpx.p2p Endpoint (closed)>".to_string(),
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn one_sided_v(
    c: &Core,
    write: bool,
    conn_id: u64,
    mr_id_v: &[u64],
    ptr_v: &[u64],
    size_v: &[u64],
    metas: &[Vec<u8>],
    num_iovs: usize,
) -> Outcome<tcpx_runtime::Transfer> {
    let pieces = zip_pieces(mr_id_v, ptr_v, size_v, num_iovs)?;
    let refs: Vec<&[u8]> = metas.iter().map(Vec::as_slice).collect();
    c.one_sided_blobs(write, conn_id, &pieces, &refs, None)
}

/// Resolves `advertise`'s two forms into [conn_id, mr_id, ptr, size].
fn overload(
    args: &Bound<'_, PyTuple>,
    kw: [Option<u64>; 4],
) -> PyResult<Outcome<[Option<u64>; 4]>> {
    let pos: Vec<u64> = args.extract()?;
    let named = kw.iter().filter(|v| v.is_some()).count();
    let with_conn = pos.len() == 4 || kw[0].is_some() || pos.len() + named == 4;
    let mut out = kw;
    let start = if with_conn { 0 } else { 1 };
    if start + pos.len() > 4 {
        return Ok(Err(Failure::bad(format!(
            "advertise takes 3 or 4 arguments, got {}",
            pos.len()
        ))));
    }
    for (i, v) in pos.into_iter().enumerate() {
        out[start + i] = Some(v);
    }
    Ok(Ok(out))
}

/// One `*_ipc` call of UCCL's: every list the same length, then the runtime's same-host
/// route.
fn ipc_v(
    c: &Core,
    write: bool,
    conn_id: u64,
    ptr_v: &[u64],
    size_v: &[u64],
    info_v: &[Vec<u8>],
) -> Outcome<tcpx_runtime::Transfer> {
    if ptr_v.len() != size_v.len() || ptr_v.len() != info_v.len() {
        return Err(Failure::bad(format!(
            "{} pointers, {} sizes and {} infos: the lists must have the same length",
            ptr_v.len(),
            size_v.len(),
            info_v.len()
        )));
    }
    let pieces: Vec<IpcPiece<'_>> = (0..ptr_v.len())
        .map(|i| IpcPiece {
            ptr: ptr_v[i],
            size: size_v[i],
            info: &info_v[i],
            remote_addr: None,
        })
        .collect();
    // SAFETY: UCCL's contract for these calls: the caller's memory stays valid until the
    // call (or, async, its transfer) completes.
    unsafe { c.ipc(write, conn_id, &pieces) }
}

/// `(ptr, bytes)` of one `register_memory` item: UCCL's rule for tensors (`data_ptr()`,
/// `numel() * element_size()`, and contiguous), else the Pythonic layer's for arrays and
/// buffers (`tcpx._buffers.describe`).
fn memory_of(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<(u64, u64)> {
    if obj.hasattr("data_ptr")? {
        if let Ok(contiguous) = obj.call_method0("is_contiguous") {
            if !contiguous.is_truthy()? {
                return Err(
                    Failure::bad("tensor is not contiguous: call .contiguous() first").into_py(py),
                );
            }
        }
        let ptr: u64 = obj.call_method0("data_ptr")?.extract()?;
        let numel: u64 = obj.call_method0("numel")?.extract()?;
        let item: u64 = obj.call_method0("element_size")?.extract()?;
        let size = numel
            .checked_mul(item)
            .ok_or_else(|| Failure::bad("tensor size overflows").into_py(py))?;
        return Ok((ptr, size));
    }
    let info = py
        .import("tcpx._buffers")?
        .getattr("describe")?
        .call1((obj, false))?;
    Ok((
        info.getattr("ptr")?.extract()?,
        info.getattr("nbytes")?.extract()?,
    ))
}

/// The descriptor of `size` bytes at `ptr`, registered as `mr_id` with `keys`.
fn desc_of(ptr: u64, size: u64, mr_id: u64, keys: &RemoteKey) -> XferDesc {
    XferDesc {
        addr: ptr,
        size,
        mr_id,
        lkeys: keys.lkeys(),
        rkeys: keys.rkeys(),
        ipc_info: Vec::new(),
    }
}

/// The same-host (CUDA IPC) info of a registration: CUDA memory is advertised so that a
/// local peer's `transfer` can reach it; host memory, or memory the driver will not export
/// (`cuMemCreate` pools), has none and is reached over the network only.
fn ipc_info_of(core: &Core, ptr: u64, size: u64) -> Vec<u8> {
    if tcpx::cuda::pointer_device(ptr as *const u8).is_none() {
        return Vec::new();
    }
    // SAFETY: register_memory's contract: the memory stays allocated until
    // deregister_memory (and the endpoint keeps the advert until it closes).
    // A failure leaves the registration network-only; a local peer's `transfer` then says
    // the descriptor has no IPC info.
    unsafe { core.advertise_range(ptr, size) }
        .map(|b| b.to_vec())
        .unwrap_or_default()
}

/// The peer's descriptors (`rkeys`, `addr`, `size`) as ranges of its registrations.
fn remote_ranges(keys: &[(Vec<u32>, u64, u64)]) -> Outcome<Vec<RemoteRange>> {
    keys.iter()
        .enumerate()
        .map(|(i, (rkeys, addr, size))| {
            RemoteKey::from_rkeys(rkeys)
                .and_then(|k| k.range(*addr, *size))
                .map_err(|e| Failure::bad(format!("remote descriptor {i}: {e}")))
        })
        .collect()
}

/// UCCL's module function `get_oob_ip()`: the address this host's endpoints announce to
/// peers (`TCPX_CONTROL_ADDR`'s, else the first data NIC's).
#[pyfunction]
pub fn get_oob_ip(py: Python<'_>) -> PyResult<String> {
    errors::raise(py, py.detach(crate::core::oob_ip)).map(|ip| ip.to_string())
}

/// The reason of this thread's last `ok = False` as `(exception class name, message)`, or
/// None.
#[pyfunction]
pub fn last_error() -> Option<(&'static str, String)> {
    errors::last()
}
