//! `tcpx._native.Core` and `tcpx._native.Transfer`: what the Pythonic layer (`tcpx`) is built
//! on. Every failure raises (a `tcpx.Error` subclass); the Python side turns objects (numpy
//! arrays, tensors, buffers) into pointers and keeps them alive through `keep`.

use std::sync::{Arc, Mutex};

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use tcpx_runtime::control::EndpointMetadata;

use crate::core::{Core, Piece, Way};
use crate::errors::{raise, Failure, Outcome};
use crate::fork::Origin;
use crate::{rendezvous, wait};

/// Transfers whose Python handle was dropped before they finished, with the objects whose
/// memory they use: kept until they finish, so the memory cannot be freed under the engines.
type Orphans = Arc<Mutex<Vec<(tcpx_runtime::Transfer, Py<PyAny>)>>>;

/// The native endpoint behind `tcpx.Endpoint` (see the Python class for the documentation).
#[pyclass(frozen, module = "tcpx._native", name = "Core")]
pub struct PyCore {
    pub(crate) core: Arc<Core>,
    orphans: Orphans,
}

fn pieces(list: Vec<(u64, u64, u64)>) -> Vec<Piece> {
    list.into_iter()
        .map(|(mr_id, ptr, size)| Piece { mr_id, ptr, size })
        .collect()
}

impl PyCore {
    fn transfer(
        &self,
        t: Outcome<tcpx_runtime::Transfer>,
        keep: Py<PyAny>,
        py: Python<'_>,
    ) -> PyResult<PyTransfer> {
        let inner = raise(py, t)?;
        // Reap orphans that finished (under the GIL: their objects may be freed now).
        let mut orphans = self.orphans.lock().unwrap_or_else(|p| p.into_inner());
        if !orphans.is_empty() {
            orphans.retain(|(t, _)| !t.is_finished());
        }
        drop(orphans);
        Ok(PyTransfer {
            inner,
            keep: Some(keep),
            orphans: self.orphans.clone(),
            origin: self.core.origin(),
        })
    }
}

#[pymethods]
impl PyCore {
    #[new]
    #[pyo3(signature = (gpu_index=None))]
    fn new(py: Python<'_>, gpu_index: Option<u32>) -> PyResult<Self> {
        let core = raise(py, py.detach(|| Core::new(gpu_index)))?;
        Ok(Self {
            core: Arc::new(core),
            orphans: Arc::default(),
        })
    }

    /// The runtime's metadata blob (address and secret).
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let meta = raise(py, self.core.metadata())?;
        let bytes = raise(py, meta.to_bytes().map_err(|e| Failure::bad(e.to_string())))?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// UCCL's metadata (address, port, GPU bus id: `tcpx.p2p.Endpoint.get_metadata`'s).
    fn uccl_metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let meta = raise(py, self.core.metadata())?;
        let bus = raise(py, self.core.gpu_bus())?;
        Ok(PyBytes::new(
            py,
            &crate::blob::uccl_metadata(meta.control_addr, &bus),
        ))
    }

    /// (ip, port) of the control listener peers connect to.
    fn address(&self, py: Python<'_>) -> PyResult<(String, u16)> {
        let meta = raise(py, self.core.metadata())?;
        Ok((meta.control_addr.ip().to_string(), meta.control_addr.port()))
    }

    /// The GPU index announced to peers, or None.
    fn gpu_index(&self) -> Option<u32> {
        self.core.gpu_index()
    }

    /// The plugin in use and why.
    fn backend(&self, py: Python<'_>) -> PyResult<String> {
        let ep = raise(py, self.core.endpoint())?;
        let b = ep.backend();
        Ok(format!("{b:?}"))
    }

    #[pyo3(signature = (timeout=None))]
    fn accept(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<(u64, String, u16, i64)> {
        let limit = raise(py, wait::timeout(timeout))?;
        let deadline = limit.map(|l| std::time::Instant::now() + l);
        loop {
            let slice = match deadline {
                Some(d) => wait::SLICE.min(d.saturating_duration_since(std::time::Instant::now())),
                None => wait::SLICE,
            };
            let core = self.core.clone();
            match py.detach(|| core.accept(slice)) {
                Ok((id, peer, gpu)) => {
                    return Ok((
                        id,
                        peer.ip().to_string(),
                        peer.port(),
                        gpu.map_or(-1, i64::from),
                    ))
                }
                Err(f) if f.kind == crate::errors::Kind::Timeout => {}
                Err(f) => return Err(f.into_py(py)),
            }
            py.check_signals()?;
            if deadline.is_some_and(|d| std::time::Instant::now() >= d) {
                return Err(Failure::new(
                    crate::errors::Kind::Timeout,
                    format!("no peer connected within {}s", timeout.unwrap_or_default()),
                )
                .into_py(py));
            }
        }
    }

    /// Connects to `ip:port` (address only).
    fn connect(&self, py: Python<'_>, ip: &str, port: u16) -> PyResult<u64> {
        let ip: std::net::IpAddr = raise(
            py,
            ip.parse()
                .map_err(|_| Failure::bad(format!("not an IP address: {ip:?}"))),
        )?;
        let core = self.core.clone();
        let addr = std::net::SocketAddr::new(ip, port);
        raise(py, wait::blocking(py, move || core.connect_addr(addr))?)
    }

    /// Connects with the peer's full runtime metadata.
    fn connect_metadata(&self, py: Python<'_>, metadata: &[u8]) -> PyResult<u64> {
        let meta = raise(
            py,
            EndpointMetadata::from_bytes(metadata)
                .map_err(|e| Failure::bad(format!("endpoint metadata: {e}"))),
        )?;
        let core = self.core.clone();
        raise(
            py,
            wait::blocking(py, move || core.connect_metadata(&meta))?,
        )
    }

    /// (ip, port, gpu or -1) of a connection's peer.
    fn peer(&self, py: Python<'_>, conn_id: u64) -> PyResult<(String, u16, i64)> {
        let (addr, gpu) = raise(py, self.core.conn_peer(conn_id))?;
        Ok((
            addr.ip().to_string(),
            addr.port(),
            gpu.map_or(-1, i64::from),
        ))
    }

    /// Closes a connection; whether it existed.
    fn close_conn(&self, py: Python<'_>, conn_id: u64) -> PyResult<bool> {
        let core = self.core.clone();
        raise(py, py.detach(|| core.remove_conn(conn_id)))
    }

    /// Registers `size` bytes at `ptr`; the caller keeps the memory alive until `dereg`.
    fn reg(&self, py: Python<'_>, ptr: u64, size: u64) -> PyResult<u64> {
        let core = self.core.clone();
        // SAFETY: the Python layer registers the memory of an object it keeps referenced (the
        // Region holds it) until dereg, and transfers keep their Region referenced.
        raise(py, py.detach(|| unsafe { core.reg(ptr, size) }))
    }

    fn dereg(&self, py: Python<'_>, mr_id: u64) -> PyResult<()> {
        raise(py, self.core.dereg(mr_id))
    }

    #[pyo3(signature = (conn_id, pieces, keep, vectored=false))]
    fn send(
        &self,
        py: Python<'_>,
        conn_id: u64,
        pieces: Vec<(u64, u64, u64)>,
        keep: Py<PyAny>,
        vectored: bool,
    ) -> PyResult<PyTransfer> {
        self.two_sided(py, Way::Send, conn_id, pieces, keep, vectored)
    }

    #[pyo3(signature = (conn_id, pieces, keep, vectored=false))]
    fn recv(
        &self,
        py: Python<'_>,
        conn_id: u64,
        pieces: Vec<(u64, u64, u64)>,
        keep: Py<PyAny>,
        vectored: bool,
    ) -> PyResult<PyTransfer> {
        self.two_sided(py, Way::Recv, conn_id, pieces, keep, vectored)
    }

    /// Starts sending the pieces as one batch of small messages (peer: `recv_batch`).
    fn send_batch(
        &self,
        py: Python<'_>,
        conn_id: u64,
        pieces: Vec<(u64, u64, u64)>,
        keep: Py<PyAny>,
    ) -> PyResult<PyTransfer> {
        self.batch(py, Way::Send, conn_id, pieces, keep)
    }

    /// Starts receiving one batch (peer: `send_batch`, same total) into the pieces, in order.
    fn recv_batch(
        &self,
        py: Python<'_>,
        conn_id: u64,
        pieces: Vec<(u64, u64, u64)>,
        keep: Py<PyAny>,
    ) -> PyResult<PyTransfer> {
        self.batch(py, Way::Recv, conn_id, pieces, keep)
    }

    /// Allocates and registers the pack buffers of `batches` batches in flight; returns the
    /// buffers now pooled.
    fn reserve_batches(&self, py: Python<'_>, conn_id: u64, batches: usize) -> PyResult<usize> {
        let core = self.core.clone();
        raise(py, py.detach(|| core.reserve_batches(conn_id, batches)))
    }

    /// The packing counters of the connection's batches, as a dict.
    fn batch_pack_stats<'py>(&self, py: Python<'py>, conn_id: u64) -> PyResult<Bound<'py, PyDict>> {
        let s = raise(py, self.core.batch_pack_stats(conn_id))?;
        let d = PyDict::new(py);
        d.set_item("packed_sent", s.packed_sent)?;
        d.set_item("packed_received", s.packed_received)?;
        d.set_item("fallbacks", s.fallbacks)?;
        d.set_item("overflows", s.overflows)?;
        d.set_item("buffers", s.buffers)?;
        Ok(d)
    }

    #[pyo3(signature = (conn_id, pieces, blobs, keep, notification=None))]
    fn write(
        &self,
        py: Python<'_>,
        conn_id: u64,
        pieces: Vec<(u64, u64, u64)>,
        blobs: Vec<Vec<u8>>,
        keep: Py<PyAny>,
        notification: Option<Vec<u8>>,
    ) -> PyResult<PyTransfer> {
        let core = self.core.clone();
        let p = self::pieces(pieces);
        let t = py.detach(|| {
            let refs: Vec<&[u8]> = blobs.iter().map(Vec::as_slice).collect();
            core.one_sided_blobs(true, conn_id, &p, &refs, notification.as_deref())
        });
        self.transfer(t, keep, py)
    }

    fn read(
        &self,
        py: Python<'_>,
        conn_id: u64,
        pieces: Vec<(u64, u64, u64)>,
        blobs: Vec<Vec<u8>>,
        keep: Py<PyAny>,
    ) -> PyResult<PyTransfer> {
        let core = self.core.clone();
        let p = self::pieces(pieces);
        let t = py.detach(|| {
            let refs: Vec<&[u8]> = blobs.iter().map(Vec::as_slice).collect();
            core.one_sided_blobs(false, conn_id, &p, &refs, None)
        });
        self.transfer(t, keep, py)
    }

    fn advertise<'py>(
        &self,
        py: Python<'py>,
        mr_id: u64,
        ptr: u64,
        size: u64,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let blob = raise(py, self.core.advertise(Piece { mr_id, ptr, size }))?;
        Ok(PyBytes::new(py, &blob))
    }

    fn notify(&self, py: Python<'_>, conn_id: u64, message: &[u8]) -> PyResult<()> {
        raise(py, self.core.notify(conn_id, message))
    }

    /// [(conn_id or None, ip, port, bytes)] delivered so far.
    #[allow(clippy::type_complexity)]
    fn notifications<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Vec<(Option<u64>, String, u16, Bound<'py, PyBytes>)>> {
        let got = raise(py, self.core.notifications())?;
        Ok(got
            .into_iter()
            .map(|(id, peer, bytes)| {
                (
                    id,
                    peer.ip().to_string(),
                    peer.port(),
                    PyBytes::new(py, &bytes),
                )
            })
            .collect())
    }

    /// The group rendezvous through a Python store: `[(rank, conn_id)]` of every other rank.
    #[pyo3(signature = (store, rank, world, timeout=None, prefix="tcpx", job="group"))]
    #[allow(clippy::too_many_arguments)]
    fn rendezvous(
        &self,
        py: Python<'_>,
        store: &Bound<'_, PyAny>,
        rank: i64,
        world: i64,
        timeout: Option<f64>,
        prefix: &str,
        job: &str,
    ) -> PyResult<Vec<(usize, u64)>> {
        let group = rendezvous::Group {
            prefix: prefix.to_owned(),
            job: job.to_owned(),
            rank,
            world,
            timeout,
        };
        raise(py, rendezvous::group(py, &self.core, store, group)?)
    }

    /// Publishes this endpoint's metadata in a Python store under `name`.
    #[pyo3(signature = (store, name, prefix="tcpx"))]
    fn publish(
        &self,
        py: Python<'_>,
        store: &Bound<'_, PyAny>,
        name: String,
        prefix: &str,
    ) -> PyResult<()> {
        raise(
            py,
            rendezvous::publish(py, &self.core, store, prefix, name)?,
        )
    }

    /// Removes `name` from a Python store; whether it was there.
    #[pyo3(signature = (store, name, prefix="tcpx"))]
    fn unpublish(
        &self,
        py: Python<'_>,
        store: &Bound<'_, PyAny>,
        name: String,
        prefix: &str,
    ) -> PyResult<bool> {
        raise(
            py,
            rendezvous::unpublish(py, &self.core, store, prefix, name)?,
        )
    }

    /// Connects to the endpoint published under `name` in a Python store.
    #[pyo3(signature = (store, name, timeout=None, prefix="tcpx"))]
    fn connect_by_name(
        &self,
        py: Python<'_>,
        store: &Bound<'_, PyAny>,
        name: String,
        timeout: Option<f64>,
        prefix: &str,
    ) -> PyResult<u64> {
        raise(
            py,
            rendezvous::connect_by_name(py, &self.core, store, prefix, name, timeout)?,
        )
    }

    /// A snapshot of the endpoint's counters as a dict (see `tcpx.Endpoint.metrics`).
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (m, ids) = raise(py, self.core.metrics())?;
        crate::metrics::to_dict(py, &m, &ids)
    }

    /// The Prometheus text of the endpoint's counters.
    fn metrics_text(&self, py: Python<'_>) -> PyResult<String> {
        raise(py, self.core.metrics_text())
    }

    /// (ip, port) of the Prometheus exporter (`TCPX_METRICS_ADDR`), or None.
    fn metrics_addr(&self, py: Python<'_>) -> PyResult<Option<(String, u16)>> {
        let a = raise(py, self.core.metrics_addr())?;
        Ok(a.map(|a| (a.ip().to_string(), a.port())))
    }

    /// Closes every connection and stops the engines (idempotent).
    fn close(&self, py: Python<'_>) {
        let core = self.core.clone();
        py.detach(|| core.close());
        // The engines are stopped: nothing touches the orphans' memory any more.
        self.orphans
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }

    #[getter]
    fn closed(&self) -> bool {
        self.core.is_closed()
    }
}

impl PyCore {
    fn two_sided(
        &self,
        py: Python<'_>,
        way: Way,
        conn_id: u64,
        pieces: Vec<(u64, u64, u64)>,
        keep: Py<PyAny>,
        vectored: bool,
    ) -> PyResult<PyTransfer> {
        let core = self.core.clone();
        let p = self::pieces(pieces);
        let t = py.detach(|| {
            if vectored {
                core.two_sided_v(way, conn_id, &p)
            } else {
                match p.as_slice() {
                    [one] => core.two_sided(way, conn_id, *one),
                    _ => Err(Failure::bad(
                        "a contiguous transfer takes exactly one buffer",
                    )),
                }
            }
        });
        self.transfer(t, keep, py)
    }

    /// Submits a batch without the GIL (the sender gathers a scattered list on this thread).
    fn batch(
        &self,
        py: Python<'_>,
        way: Way,
        conn_id: u64,
        pieces: Vec<(u64, u64, u64)>,
        keep: Py<PyAny>,
    ) -> PyResult<PyTransfer> {
        let core = self.core.clone();
        let p = self::pieces(pieces);
        let t = py.detach(|| core.batch(way, conn_id, &p));
        self.transfer(t, keep, py)
    }
}

impl Drop for PyCore {
    fn drop(&mut self) {
        if self.core.origin().inherited() {
            // Inherited through fork(): the orphans' transfers belong to engines that do not
            // exist here. A reference that is never dropped keeps them (and their memory)
            // untouched.
            std::mem::forget(self.orphans.clone());
        }
    }
}

/// A transfer in flight: `done()`, `wait(timeout)`. Holds the objects whose memory it uses
/// until it finishes, even when this handle is dropped first.
#[pyclass(module = "tcpx", name = "Transfer")]
pub struct PyTransfer {
    inner: tcpx_runtime::Transfer,
    keep: Option<Py<PyAny>>,
    orphans: Orphans,
    /// The process whose endpoint started it: elsewhere (a forked child) it is unusable.
    origin: Origin,
}

impl PyTransfer {
    fn live(&self, py: Python<'_>) -> PyResult<()> {
        if self.origin.inherited() {
            return Err(self.origin.failure("transfer").into_py(py));
        }
        Ok(())
    }
}

#[pymethods]
impl PyTransfer {
    /// True once the transfer finished (successfully or not); never blocks. Raises
    /// `tcpx.Closed` in a process that inherited the transfer through fork().
    fn done(&self, py: Python<'_>) -> PyResult<bool> {
        self.live(py)?;
        Ok(self.inner.is_finished())
    }

    /// Blocks until the transfer finishes (at most `timeout` seconds; `None`: until the
    /// runtime's transfer timeout) and returns the bytes moved. Raises the transfer's error,
    /// `tcpx.TransferTimeout` when `timeout` passes first (the transfer keeps running), or
    /// `KeyboardInterrupt` on Ctrl-C (likewise). Releases the GIL while waiting.
    #[pyo3(signature = (timeout=None))]
    fn wait(&mut self, py: Python<'_>, timeout: Option<f64>) -> PyResult<u64> {
        self.live(py)?;
        let limit = raise(py, wait::timeout(timeout))?;
        let n = raise(py, wait::transfer(py, &self.inner, limit)?)?;
        self.keep = None;
        Ok(n)
    }

    /// Bytes in the transfer.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.inner.len()
    }

    fn __repr__(&self) -> String {
        if self.origin.inherited() {
            return "<tcpx.Transfer inherited through fork(): unusable>".to_string();
        }
        let state = match self.inner.poll() {
            None => "in progress".to_string(),
            Some(Ok(_)) => "done".to_string(),
            Some(Err(e)) => format!("failed: {e}"),
        };
        format!(
            "<tcpx.Transfer {:?} of {} bytes, {state}>",
            self.inner.direction(),
            self.inner.len()
        )
    }
}

impl Drop for PyTransfer {
    fn drop(&mut self) {
        if self.origin.inherited() {
            // Inherited through fork(): never release what the parent's engines may hold.
            std::mem::forget(self.inner.clone());
            std::mem::forget(self.keep.take());
            return;
        }
        if let Some(keep) = self.keep.take() {
            if !self.inner.is_finished() {
                self.orphans
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push((self.inner.clone(), keep));
            }
        }
    }
}
