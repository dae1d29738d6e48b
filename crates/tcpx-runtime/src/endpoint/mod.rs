//! [`Endpoint`]: one process's presence on the network — a loaded plugin, its progress
//! engines, a control listener — and the door to [`Connection`]s.
//!
//! - [`backend`]: which plugin (explicit path, TCPX install paths, built-in socket plugin);
//! - `admission`: who gets past the control listener (strangers are turned away
//!   concurrently, each with its own deadline);
//! - `setup`: the connection handshake over the control plane;
//! - [`connection`]: a connected peer: transfers, registrations, close;
//! - `watch`: the thread that keeps reading a connection's control stream;
//! - `local`: the same-host side ([`crate::ipc`]): rendezvous, identity, route, IPC adverts.

pub mod backend;
pub mod connection;

pub use engine_plan::EnginePlan;

mod accept_stop;
mod admission;
mod batch;
mod descriptors;
mod engine_plan;
mod local;
mod local_side;
mod metrics;
mod setup;
mod shared;
mod snapshot;
mod watch;

use std::net::{IpAddr, SocketAddr, TcpListener};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tcpx::cuda::{CudaBuffer, CudaDevice};
use tcpx::{ForeignMemory, MemoryKind, Net, SharedMemory};

use crate::config::Config;
use crate::control::{ControlConn, ControlError, EndpointInfo, EndpointMetadata, Secret};
use crate::engine::pin::plan_cores;
use crate::engine::stage::RingPool;
use crate::engine::EngineHandle;
use crate::error::{Error, Result};
use crate::metrics::Exporter;
use crate::onesided::Descriptor;
use crate::onesided::OneSidedShared;
use crate::registry::{Region, RegistrationCounter};
use admission::{Admission, Policy, HELLO_LIMIT};
use backend::{BackendInfo, BackendOrigin};
pub use connection::{Connection, Segment};
use setup::Side;
use shared::EndpointShared;

/// A transfer endpoint: create one per GPU (or per process for host memory), hand its
/// [`metadata`](Self::metadata) to peers out of band, then [`accept`](Self::accept) or
/// [`connect`](Self::connect).
///
/// ```
/// use std::time::Duration;
/// use tcpx_runtime::{Backend, Config, Endpoint};
/// # std::env::set_var("TCPX_SOCKET_IFNAME", "lo"); // keep doc-test traffic on loopback
/// let config = Config::builder()
///     .backend(Backend::Builtin)
///     .control_addr("127.0.0.1:0".parse().unwrap())
///     .channels(2)
///     .timeout(Duration::from_secs(20))
///     .build()?;
/// let server = Endpoint::new(config.clone())?;
/// let client = Endpoint::new(config)?;
/// let meta = server.metadata().clone();
/// let accepted = std::thread::spawn(move || server.accept().map(|c| (server, c)));
/// let conn = client.connect(&meta)?;
/// let (server, peer) = accepted.join().unwrap()?;
///
/// let src = client.register(tcpx::SharedMemory::host(1 << 20).unwrap())?;
/// let dst = server.register(tcpx::SharedMemory::host(1 << 20).unwrap())?;
/// src.memory().with_bytes_mut(|b| b.fill(7)).unwrap();
/// let rx = peer.recv(&dst, 0, 1 << 20)?;
/// let tx = conn.send(&src, 0, 1 << 20)?;
/// assert_eq!(tx.wait(Duration::from_secs(20))?, 1 << 20);
/// assert_eq!(rx.wait(Duration::from_secs(20))?, 1 << 20);
/// assert!(dst.memory().with_bytes(|b| b.iter().all(|&x| x == 7)).unwrap());
/// # Ok::<(), tcpx_runtime::Error>(())
/// ```
pub struct Endpoint {
    shared: Arc<EndpointShared>,
    metadata: EndpointMetadata,
    /// Turns strangers away and queues real peers for `accept`; stops (and closes what it
    /// holds) when dropped.
    admission: Admission,
    /// Ends every accept at once ([`Endpoint::stop_accepting`]).
    accept_stop: accept_stop::AcceptStop,
    /// The Prometheus exporter ([`Config::metrics_addr`]); stops when dropped.
    exporter: Option<Exporter>,
    /// Same-host peers: the rendezvous (closed when dropped) and what local connections share.
    local: local_side::LocalSide,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("backend", &self.shared.backend)
            .field("devices", &self.shared.devices)
            .field("engines", &self.shared.engines)
            .field("metadata", &self.metadata)
            .finish()
    }
}

impl Endpoint {
    /// Loads the configured backend, starts one engine per device and binds the control
    /// listener.
    pub fn new(config: Config) -> Result<Self> {
        config.validate()?;
        let (net, backend) = backend::open(&config.backend)?;
        Self::start(config, net, backend)
    }

    /// As [`Endpoint::new`], on a plugin the caller already loaded (tests, benchmarks, or an
    /// application sharing one `Net` between endpoints). `config.backend` is ignored.
    pub fn with_net(config: Config, net: Net) -> Result<Self> {
        config.validate()?;
        let backend = BackendInfo::of(
            &net,
            BackendOrigin::Provided,
            "plugin provided by the caller",
        );
        Self::start(config, net, backend)
    }

    fn start(config: Config, net: Net, backend: BackendInfo) -> Result<Self> {
        // Pack buffers made ready while the endpoint starts and connects (see `spare`).
        crate::onesided::spare::warm_for(&config);
        let backend_err = |what: &str| {
            let what = what.to_owned();
            move |e| Error::Backend {
                what,
                source: Arc::new(e),
            }
        };
        let count = net.device_count().map_err(backend_err("listing devices"))?;
        let devices = match &config.devices {
            Some(d) => d.clone(),
            None => (0..count).collect(),
        };
        if devices.is_empty() {
            return Err(Error::Config(format!(
                "plugin {} reports no devices",
                backend.name
            )));
        }
        let mut names = Vec::with_capacity(devices.len());
        let mut plugin_cuda = true;
        let mut host_ok = true;
        for &d in &devices {
            if d >= count {
                return Err(Error::Config(format!(
                    "device {d} does not exist: plugin {} reports {count}",
                    backend.name
                )));
            }
            let device = net
                .device(d)
                .map_err(backend_err("reading device properties"))?;
            plugin_cuda &= device.properties.ptr_support.cuda();
            host_ok &= device.properties.ptr_support.host();
            if !device.properties.ptr_support.host() {
                tracing::info!(target: "tcpx_runtime", device = d, "device does not take host memory");
            }
            names.push(device.properties.name);
        }

        let listener = TcpListener::bind(config.control_addr).map_err(|e| {
            Error::Config(format!(
                "cannot bind the control listener to {}: {e}",
                config.control_addr
            ))
        })?;
        let local = listener
            .local_addr()
            .map_err(|e| Error::Internal(format!("control listener address: {e}")))?;
        // Before this endpoint's threads exist: see `descriptors` (first connections of a
        // process paid 30–60 ms of descriptor-table growth).
        let table = descriptors::reserve(&listener, descriptors::RESERVED_DESCRIPTORS);
        tracing::debug!(target: "tcpx_runtime", descriptors = ?table, "descriptor table reserved");
        let ip = advertised_ip(config.control_addr.ip(), &names[0])?;
        let secret = crate::control::random_secret();
        // Before the admission thread starts: a failure here leaves nothing to stop.
        let accept_stop = accept_stop::AcceptStop::new()
            .map_err(|e| Error::Internal(format!("the accept stop's socket pair: {e}")))?;
        let admission = Admission::start(
            listener,
            Policy {
                secret,
                require_secret: config.require_secret,
                hello_timeout: config.timeout.min(HELLO_LIMIT),
            },
        )?;

        // Engine k serves device k mod D; a connection driven by n engines (a multiple of D:
        // all D·E, or fewer for a peer on the same cores) puts channel c on engine c mod n,
        // whose device is devices[c mod D], as the handshake assumes.
        let plan = EnginePlan::new(&config, backend.copies_on_caller, devices.len());
        let engine_count = devices.len() * plan.per_device;
        let info = EndpointInfo {
            ip,
            gpu_pci: config.gpu_pci.clone(),
            channels: config.channels,
            plugin_name: backend.name.clone(),
            abi_version: backend.abi_version,
            chunk_bytes: config.chunk_bytes,
            gpu_index: config.gpu_index,
            // A connection drives its channels with at most this many engines.
            spread: u16::try_from(engine_count)
                .unwrap_or(u16::MAX)
                .min(config.spread.unwrap_or(u16::MAX))
                .min(config.channels),
            // Eager frames are host buffers the plugin sends from and receives into.
            eager_bytes: if host_ok { config.eager_limit() } else { 0 },
            spread_two_sided: config.spread_two_sided,
        };
        let metadata = EndpointMetadata {
            info: info.clone(),
            control_addr: SocketAddr::new(ip, local.port()),
            secret,
        };
        let local_side = local_side::LocalSide::start(&config, metadata.control_addr)?;
        let engine_nics: Vec<String> = (0..engine_count)
            .map(|k| names[k % names.len()].clone())
            .collect();
        let leases = if config.pin_engines {
            plan_cores(&engine_nics, config.gpu_pci.as_deref())
        } else {
            engine_nics.iter().map(|_| None).collect()
        };
        let engines = leases
            .into_iter()
            .enumerate()
            .map(|(k, lease)| {
                let device = devices[k % devices.len()];
                EngineHandle::spawn(
                    k,
                    device,
                    config.backoff,
                    config.idle_linger,
                    config.window,
                    lease,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        tracing::info!(
            target: "tcpx_runtime",
            control = %metadata.control_addr,
            devices = ?devices,
            nics = ?names,
            cores = ?engines.iter().map(|e| e.core).collect::<Vec<_>>(),
            "endpoint ready"
        );
        let shared = Arc::new(EndpointShared {
            net,
            config,
            backend,
            devices,
            engines,
            engine_plan: plan,
            _live: engine_plan::LiveEndpoint::new(),
            registrations: RegistrationCounter::default(),
            info,
            one_sided: Arc::new(OneSidedShared::default()),
            gpu: OnceLock::new(),
            plugin_cuda,
            nic_names: names,
            counters: Arc::default(),
            links: Mutex::new(Vec::new()),
        });
        let exporter = match shared.config.metrics_addr {
            Some(addr) => Some(snapshot::start_exporter(
                addr,
                Arc::downgrade(&shared),
                admission.rejections.clone(),
            )?),
            None => None,
        };
        Ok(Self {
            shared,
            metadata,
            admission,
            accept_stop,
            exporter,
            local: local_side,
        })
    }

    /// What a peer needs to connect: pass it out of band (`to_hex()` / `parse()`).
    pub fn metadata(&self) -> &EndpointMetadata {
        &self.metadata
    }

    /// The plugin in use and why it was chosen.
    pub fn backend(&self) -> &BackendInfo {
        &self.shared.backend
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.shared.config
    }

    /// The loaded plugin.
    pub fn net(&self) -> &Net {
        &self.shared.net
    }

    /// Per engine: the plugin device it serves and the core it is pinned to.
    pub fn engines(&self) -> Vec<(usize, Option<usize>)> {
        self.shared
            .engines
            .iter()
            .map(|e| (e.device, e.core))
            .collect()
    }

    /// Plugin registrations of application memory (and of one-sided pack buffers) alive on
    /// this endpoint's connections, for leak checks and for `tcpx-bench`'s count of
    /// registrations made while measuring. The eager channels' own frame buffers, a fixed
    /// few per channel for the connection's life, are not counted.
    pub fn live_registrations(&self) -> usize {
        self.shared.registrations.get()
    }

    /// Waits (up to the configured timeout) for one peer to connect, then sets the
    /// connection up.
    ///
    /// Connections that are not a tcpx peer's — garbage, another protocol, a silent or
    /// slowly dripping socket, an early close, a peer without this endpoint's secret when
    /// [`Config::require_secret`] is on — are turned away (told why, closed, logged with
    /// their address) while this keeps waiting; each gets its own short deadline and none
    /// delays a real peer that arrives after it. Errors after a real
    /// peer's `Hello` (incompatible settings, a failing plugin) end the call.
    pub fn accept(&self) -> Result<Connection> {
        self.accept_timeout(self.shared.config.timeout)
    }

    /// [`Endpoint::accept`], waiting at most `wait` for a peer to arrive (set-up then has
    /// the configured timeout). On timeout the error counts the connections turned away since
    /// the last timed-out accept said so (during this wait, or while none was waiting) and
    /// names the last one. After [`stop_accepting`](Self::stop_accepting) it fails at once
    /// with [`Error::AcceptStopped`].
    pub fn accept_timeout(&self, wait: Duration) -> Result<Connection> {
        let admission = &self.admission;
        let deadline = Instant::now() + wait;
        let stopped = || Error::AcceptStopped {
            local: self.metadata.control_addr,
        };
        loop {
            if self.accept_stop.is_stopped() {
                return Err(stopped());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let ready = crossbeam_channel::select! {
                recv(admission.ready) -> c => c.map_err(|_| crossbeam_channel::RecvTimeoutError::Disconnected),
                // Nothing is ever sent on it: ready means stopped (its sender dropped).
                recv(self.accept_stop.signal()) -> _ => return Err(stopped()),
                default(left) => Err(crossbeam_channel::RecvTimeoutError::Timeout),
            };
            let candidate = match ready {
                Ok(c) => c,
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                    let rejected = admission.rejections.take_unreported();
                    return Err(ControlError::AcceptTimeout {
                        local: self.metadata.control_addr,
                        waited: wait,
                        rejected,
                        last_rejection: (rejected > 0)
                            .then(|| admission.rejections.last())
                            .flatten(),
                    }
                    .into());
                }
                Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
                    return Err(Error::Internal(
                        "the control listener's admission thread stopped".into(),
                    ))
                }
            };
            if candidate.is_gone() {
                tracing::info!(target: "tcpx_runtime", peer = %candidate.peer, "admitted peer left before accept took it");
                continue;
            }
            let ctl = ControlConn::from_stream(candidate.stream, self.shared.config.timeout)?;
            return self.establish(
                ctl,
                Side::Accepted {
                    hello: candidate.hello,
                },
            );
        }
    }

    /// Ends every accept of this endpoint, network and same-host: those waiting in other
    /// threads return [`Error::AcceptStopped`] (`Closed` for same-host ones) at once, and so
    /// does every later call. For teardown: an application whose threads accept in a loop
    /// stops them without waiting for their timeouts. Connections already made, connects,
    /// and peers dialing this endpoint are not affected (peers wait in the admission queue
    /// until the endpoint is dropped). Idempotent.
    pub fn stop_accepting(&self) {
        self.accept_stop.stop();
    }

    /// Connects to the endpoint `peer` describes, presenting its secret (so this works with
    /// peers that [require it](crate::Config::require_secret)).
    pub fn connect(&self, peer: &EndpointMetadata) -> Result<Connection> {
        self.connect_presenting(peer.control_addr, Some(peer.secret))
    }

    /// Connects with the peer's control address alone (the control connection carries the
    /// plugin handles, so nothing else is needed). Presents no secret: peers that
    /// [require it](crate::Config::require_secret) refuse the connection.
    pub fn connect_addr(&self, addr: SocketAddr) -> Result<Connection> {
        self.connect_presenting(addr, None)
    }

    fn connect_presenting(&self, addr: SocketAddr, secret: Option<Secret>) -> Result<Connection> {
        let ctl = ControlConn::connect(addr, self.shared.config.timeout)?;
        self.establish(ctl, Side::Connecting { secret })
    }

    /// Runs the handshake on `ctl` and starts the connection on the comms it set up.
    fn establish(&self, ctl: ControlConn, side: Side) -> Result<Connection> {
        let (ctl, established) = setup::establish(&self.shared, ctl, side)?;
        Connection::start(self.shared.clone(), ctl, established)
    }

    /// The GPU index this endpoint announces to peers ([`Config::gpu_index`]), if any.
    pub fn gpu_index(&self) -> Option<u32> {
        self.shared.config.gpu_index
    }

    /// Registers caller-owned memory: host memory, or a CUDA device pointer (recognised
    /// through the driver, [`tcpx::cuda::pointer_device`]) which, like
    /// [`register_cuda`](Self::register_cuda), goes to the plugin directly when it takes CUDA
    /// pointers and is staged through pinned host memory otherwise. The region does not own
    /// the memory: dropping it frees nothing.
    ///
    /// Errors: a null pointer, zero length, a range that wraps around, a CUDA range that
    /// runs past the end of its allocation, or CUDA memory on another GPU than this
    /// endpoint's other CUDA regions.
    ///
    /// # Safety
    /// As [`ForeignMemory::new`]: `[ptr, ptr + len)` is one allocation (host, or CUDA device
    /// memory) that stays valid, and is neither freed nor reused, until the returned
    /// [`Region`], every clone of it, and every connection and transfer that used it are
    /// dropped (transfers in flight and per-connection registrations hold clones); and no
    /// Rust reference into it is held while transfers may be in flight.
    pub unsafe fn register_ptr(&self, ptr: *mut u8, len: usize) -> Result<Region> {
        let invalid = |e: tcpx::Error| Error::InvalidArgument(e.to_string());
        let Some(ordinal) = tcpx::cuda::pointer_device(ptr) else {
            // SAFETY: forwarded from this function's contract.
            let memory =
                unsafe { ForeignMemory::new(ptr, len, MemoryKind::Host) }.map_err(invalid)?;
            return self.register(SharedMemory::new(memory));
        };
        // SAFETY: forwarded from this function's contract.
        let memory = unsafe { ForeignMemory::new(ptr, len, MemoryKind::Cuda) }.map_err(invalid)?;
        // The range must lie inside one allocation of that GPU (`new` checked it does not
        // wrap). The allocation's bounds come from the driver; should it not give them, the
        // last byte at least must be device memory of the same GPU.
        let start = ptr as u64;
        let end = start + len as u64;
        let fits = match tcpx::cuda::pointer_allocation(ptr) {
            Some((base, size)) => base <= start && end <= base + size as u64,
            None => tcpx::cuda::pointer_device(ptr.wrapping_add(len - 1)) == Some(ordinal),
        };
        if !fits {
            return Err(Error::InvalidArgument(format!(
                "{len} bytes at {ptr:p} start in CUDA memory of GPU {ordinal} and run past \
                 the end of that allocation"
            )));
        }
        let device = CudaDevice::new(ordinal)
            .map_err(|e| Error::Unsupported(format!("CUDA: opening GPU {ordinal}: {e}")))?;
        self.register_on_gpu(SharedMemory::new(memory), device)
    }

    /// Makes `memory` usable for transfers on this endpoint's connections. Plugin
    /// registration happens per connection, at first use (or [`Connection::register`]).
    ///
    /// CUDA memory given this way must go to the plugin directly, which needs a plugin that
    /// takes CUDA pointers; to stage CUDA memory through a host-only plugin, use
    /// [`register_cuda`](Self::register_cuda) or [`alloc_cuda`](Self::alloc_cuda), which know
    /// the GPU.
    pub fn register(&self, memory: SharedMemory) -> Result<Region> {
        if memory.kind() == MemoryKind::Cuda && !self.shared.plugin_cuda {
            return Err(Error::InvalidArgument(format!(
                "plugin {} cannot send from or receive into CUDA memory directly; register \
                 CUDA buffers with Endpoint::register_cuda (or allocate them with \
                 Endpoint::alloc_cuda) to stage them through pinned host memory",
                self.shared.backend.name
            )));
        }
        if memory.is_empty() {
            return Err(Error::InvalidArgument(
                "cannot register empty memory".into(),
            ));
        }
        Ok(Region::new(memory))
    }

    /// Advertises `region` for one-sided access by this endpoint's peers: the returned
    /// [`Descriptor`] (hand it over out of band, [`Descriptor::to_bytes`]) lets a peer
    /// [`Connection::write`] into and [`Connection::read`] from the region, with no call on
    /// this side. The endpoint keeps the region alive until [`Endpoint::revoke`]; advertising
    /// a region again gives it a fresh key and retires the old descriptor. A staged CUDA
    /// region ([`Region::is_staged`]) is advertised as CUDA memory and served through the
    /// engines' pinned rings; one request's list must not mix it with other memory.
    ///
    /// The region is registered on every live connection's one-sided comms here (and on
    /// later connections as they are set up), so that a peer's first operation on it does
    /// not wait for that.
    pub fn advertise(&self, region: &Region) -> Result<Descriptor> {
        let descriptor = self.shared.one_sided.adverts.advertise(region)?;
        self.shared.one_sided.register_everywhere(region);
        Ok(descriptor)
    }

    /// Revokes `descriptor`: every later request naming it is refused (operations already
    /// accepted finish). Returns whether it was advertised and not yet revoked.
    pub fn revoke(&self, descriptor: &Descriptor) -> bool {
        self.shared.one_sided.adverts.revoke(descriptor)
    }

    /// Takes the notifications delivered so far, as (peer control address, bytes), in
    /// delivery order: per connection, the order the peer sent them, each attached one only
    /// after its write's bytes landed here.
    pub fn notifications(&self) -> Vec<(SocketAddr, Vec<u8>)> {
        self.shared.one_sided.inbox.drain()
    }

    /// One-sided requests from peers refused so far (unknown region, wrong key, revoked,
    /// out of bounds).
    pub fn access_refusals(&self) -> u64 {
        self.shared.one_sided.adverts.refusals()
    }

    /// One-sided operations from peers served with their data in control messages: writes
    /// whose data came in their request and landed here, reads answered with their data
    /// (small operations on host memory, see [`crate::Config::inline_bytes`]).
    pub fn inline_served(&self) -> u64 {
        self.shared
            .one_sided
            .inline_served
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Registers an existing CUDA allocation. With a plugin that takes CUDA pointers (TCPX)
    /// its chunks go to the plugin directly; with a host-only plugin (the built-in socket
    /// plugin) they are staged through pinned host rings by the engines
    /// ([`Region::is_staged`]). All CUDA regions of one endpoint must live on one GPU.
    pub fn register_cuda(&self, buffer: CudaBuffer) -> Result<Region> {
        let device = buffer.device().clone();
        self.register_on_gpu(SharedMemory::new(buffer), device)
    }

    /// Registers CUDA memory living on `device` (staged on host-only plugins).
    fn register_on_gpu(&self, memory: SharedMemory, device: CudaDevice) -> Result<Region> {
        let mut first = false;
        let gpu = self.shared.gpu.get_or_init(|| {
            first = true;
            device.clone()
        });
        if first && !self.shared.plugin_cuda {
            // The endpoint's first CUDA memory: pin a connection's worth of staging rings now
            // (connections made from here on take them; those made before take them at their
            // first staged transfer), rather than on the first transfers.
            self.reserve_staging_rings(&device);
        }
        let small_copies =
            self.shared.config.inline_gpu_bytes > 0 || self.shared.config.eager_limit() > 0;
        if first && small_copies {
            // Small one-sided operations on this GPU's memory travel inline, and small
            // two-sided messages in eager frames, through the process's copier for it: its
            // streams and pinned buffers are made now, not by the first such transfer.
            if let Err(e) = tcpx::cuda::SmallCopier::for_ordinal(device.ordinal()) {
                tracing::warn!(target: "tcpx_runtime", gpu = device.ordinal(), error = %e, "small GPU copier not made at registration");
            }
        }
        if gpu.ordinal() != device.ordinal() {
            return Err(Error::InvalidArgument(format!(
                "this endpoint's CUDA regions live on GPU {} and this buffer on GPU {}: use \
                 one endpoint per GPU",
                gpu.ordinal(),
                device.ordinal()
            )));
        }
        let staged = !self.shared.plugin_cuda;
        if staged {
            tracing::debug!(target: "tcpx_runtime", gpu = device.ordinal(), len = memory.len(), "CUDA region staged through pinned host memory");
        }
        Ok(Region::with_cuda(memory, Some(device), staged))
    }

    /// Fills the process's ring pool with the rings one connection of this endpoint uses
    /// (both halves: a send and a receive ring per channel each). A failure only means the
    /// lanes allocate their rings later: logged, not returned.
    fn reserve_staging_rings(&self, device: &CudaDevice) {
        let config = &self.shared.config;
        let rings = 2 * usize::from(config.channels);
        let chunk = config.chunk_bytes as usize;
        let pool = RingPool::global();
        let reserved = pool
            .reserve(device, 2 * config.window, chunk, rings)
            .and_then(|()| pool.reserve(device, config.window, chunk, rings));
        if let Err(e) = reserved {
            tracing::warn!(target: "tcpx_runtime", gpu = device.ordinal(), error = %e, "staging rings not reserved at registration");
        }
    }

    /// Testing aid: registers host memory whose transfers take the staged path anyway, with
    /// CPU copies standing in for the GPU's (an emulated ring in plain host memory; each copy
    /// is reported done one poll late, like a DMA in progress). This runs the engines' staged
    /// logic — rings, copies ahead, consume-after-copy, FIFO slot reuse — on machines without
    /// a GPU. Not for production use: it only adds copies.
    #[doc(hidden)]
    pub fn register_staged_emulation(&self, memory: SharedMemory) -> Result<Region> {
        if memory.kind() != MemoryKind::Host || memory.is_empty() {
            return Err(Error::InvalidArgument(
                "staged emulation takes non-empty host memory".into(),
            ));
        }
        Ok(Region::with_cuda(memory, None, true))
    }

    /// Allocates `len` bytes of zeroed, 4 KiB-aligned device memory on this endpoint's GPU
    /// and registers it ([`register_cuda`](Self::register_cuda)). The GPU is the one of the
    /// endpoint's first CUDA region, else the one whose PCI bus id is
    /// [`Config::gpu_pci`](crate::Config), else GPU 0.
    pub fn alloc_cuda(&self, len: usize) -> Result<Region> {
        let device = self.cuda_device()?;
        self.alloc_cuda_on(&device, len)
    }

    /// As [`alloc_cuda`](Self::alloc_cuda), on `device`.
    pub fn alloc_cuda_on(&self, device: &CudaDevice, len: usize) -> Result<Region> {
        let buffer = device
            .alloc(len)
            .map_err(|e| Error::InvalidArgument(format!("allocating CUDA memory: {e}")))?;
        self.register_cuda(buffer)
    }

    /// The GPU [`alloc_cuda`](Self::alloc_cuda) allocates on (opening it on first use).
    pub fn cuda_device(&self) -> Result<CudaDevice> {
        if let Some(gpu) = self.shared.gpu.get() {
            return Ok(gpu.clone());
        }
        let cuda_err = |e: tcpx::Error| Error::Unsupported(format!("CUDA: {e}"));
        let count = CudaDevice::count();
        if count == 0 {
            return Err(Error::Unsupported(format!(
                "no CUDA device: {}",
                tcpx::cuda::driver_status()
            )));
        }
        let ordinal = match &self.shared.config.gpu_pci {
            Some(pci) => {
                let want = pci.to_ascii_lowercase();
                let mut found = None;
                for i in 0..count {
                    let d = CudaDevice::new(i).map_err(cuda_err)?;
                    if d.pci_bus_id() == want {
                        found = Some(i);
                        break;
                    }
                }
                found
                    .ok_or_else(|| Error::Config(format!("no CUDA device has PCI bus id {pci}")))?
            }
            None => 0,
        };
        CudaDevice::new(ordinal).map_err(cuda_err)
    }

    /// Allocates `len` bytes of 4 KiB-aligned host memory and registers it.
    pub fn alloc_host(&self, len: usize) -> Result<Region> {
        let memory = SharedMemory::host(len).map_err(|e| Error::InvalidArgument(e.to_string()))?;
        self.register(memory)
    }
}

impl Region {
    /// Base address of the region's memory (a device pointer for CUDA regions), for
    /// pointer-to-offset arithmetic in bindings. Same as `region.memory().as_ptr()`.
    pub fn as_ptr(&self) -> *mut u8 {
        self.memory().as_ptr()
    }
}

/// The address of interface `name` (its first IPv4 address, else its first IPv6 address that
/// is not link-local), from the same interface list the built-in plugin uses; an error when
/// the list itself cannot be read.
fn interface_ip(name: &str) -> std::result::Result<Option<IpAddr>, String> {
    Ok(tcpx::interfaces()?
        .into_iter()
        .find(|i| i.name == name)
        .map(|i| i.addr))
}

/// The address peers should use: the bind address, else the first data NIC's.
fn advertised_ip(bind: IpAddr, nic: &str) -> Result<IpAddr> {
    if !bind.is_unspecified() {
        return Ok(bind);
    }
    let found = interface_ip(nic).map_err(|e| {
        Error::Config(format!(
            "the control listener binds to {bind}, and the address of interface {nic} to \
             advertise cannot be looked up ({e}); set control_addr to this host's reachable IP"
        ))
    })?;
    found.ok_or_else(|| {
        Error::Config(format!(
            "the control listener binds to {bind} and interface {nic} has no usable address \
             to advertise; set control_addr to this host's reachable IP"
        ))
    })
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    #[test]
    fn loopback_has_its_address_and_unknown_interfaces_have_none() {
        assert_eq!(
            interface_ip("lo").unwrap(),
            Some(IpAddr::V4(Ipv4Addr::LOCALHOST))
        );
        assert_eq!(interface_ip("no-such-interface0").unwrap(), None);
        assert_eq!(
            advertised_ip(IpAddr::V4(Ipv4Addr::UNSPECIFIED), "lo").unwrap(),
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        );
        let unknown = advertised_ip(IpAddr::V4(Ipv4Addr::UNSPECIFIED), "no-such-interface0");
        assert!(unknown
            .unwrap_err()
            .to_string()
            .contains("no-such-interface0"));
    }
}
