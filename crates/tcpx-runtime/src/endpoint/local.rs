//! The endpoint's same-host side ([`crate::ipc`]): its rendezvous, its identity, the route
//! decision, and advertising GPU memory for peers of the same host.

use std::time::Duration;

use tcpx::cuda::{CudaDevice, IpcExport};

use super::local_side::NAME_GRACE;
use super::Endpoint;
use crate::error::{Error, LocalErrorKind, Result};
use crate::ipc::identity::endpoint_socket_name;
use crate::ipc::rendezvous;
use crate::ipc::socket;
use crate::ipc::wire::{Hello, LOCAL_PROTOCOL_VERSION};
use crate::ipc::{
    normalize_bus_id, IpcDescriptor, LocalAddr, LocalConnection, LocalInfo, LocalRoute,
};
use crate::onesided::descriptor::random_key;
use crate::registry::Region;

impl Endpoint {
    /// This endpoint's GPU for same-host work: the one of its CUDA regions, else the one
    /// configured by PCI bus id, else by index ([`Config::gpu_index`], read as the CUDA
    /// ordinal; this asks the driver, without creating a context).
    fn local_gpu(&self) -> Option<(Option<u32>, String)> {
        if let Some(d) = self.shared.gpu.get() {
            return Some((Some(d.ordinal() as u32), d.pci_bus_id()));
        }
        let config = &self.shared.config;
        if let Some(bus) = config.gpu_pci.as_deref().and_then(normalize_bus_id) {
            return Some((config.gpu_index, bus));
        }
        // By index: the bus id from the device's attributes, no context created.
        let index = config.gpu_index?;
        let bus = tcpx::cuda::device_pci_bus_id(index as usize).ok()?;
        Some((Some(index), bus))
    }

    /// The hello this endpoint says, and the GPU it copies on for host memory (when known).
    fn local_hello(&self) -> (Hello, Option<usize>) {
        let shared = &self.local.shared;
        let gpu = self.local_gpu();
        if let Some((_, bus)) = &gpu {
            self.local.listeners.claim_gpu(shared.uid, bus);
        }
        let ordinal = gpu.as_ref().and_then(|(o, _)| *o);
        // Without a configured GPU, host memory is copied by GPU 0 (decided at the first
        // operation, so that connecting never probes the driver).
        let default_gpu = ordinal.map(|o| o as usize);
        let hello = Hello {
            version: LOCAL_PROTOCOL_VERSION,
            pid: shared.pid,
            instance: shared.instance,
            boot_id: shared.boot_id,
            gpu_ordinal: ordinal,
            gpu_bus: gpu.map(|(_, bus)| bus),
            hostname: shared.hostname.clone(),
        };
        (hello, default_gpu)
    }

    /// Who and where this endpoint is on its host: hand [`LocalInfo::to_bytes`] to peers
    /// (next to [`metadata`](Self::metadata)) so they can decide the route
    /// ([`local_route`](Self::local_route)) and reach this endpoint
    /// ([`connect_local`](Self::connect_local) with [`LocalInfo::addr`]).
    pub fn local_info(&self) -> LocalInfo {
        let shared = &self.local.shared;
        LocalInfo {
            boot_id: shared.boot_id,
            uid: shared.uid,
            pid: shared.pid,
            instance: shared.instance,
            name: shared.name.clone(),
            gpu: self
                .local
                .listeners
                .claimed_gpu()
                .or_else(|| self.local_gpu().map(|(_, bus)| bus)),
            hostname: shared.hostname.clone(),
        }
    }

    /// Where peers of this host reach this endpoint (its own rendezvous name). Also derived
    /// from its metadata alone: [`local_addr_of`](Self::local_addr_of).
    pub fn local_addr(&self) -> LocalAddr {
        LocalAddr::Name(self.local.shared.name.clone())
    }

    /// The rendezvous of the endpoint that published `metadata`, when it runs on this host
    /// as this user.
    pub fn local_addr_of(metadata: &crate::control::EndpointMetadata) -> LocalAddr {
        LocalAddr::Name(endpoint_socket_name(socket::uid(), metadata.control_addr))
    }

    /// Whether GPU memory between this endpoint and the one `peer` describes should move
    /// through CUDA IPC or the network (the rule is in [`crate::ipc`]'s docs).
    pub fn local_route(&self, peer: &LocalInfo) -> LocalRoute {
        let shared = &self.local.shared;
        let network = |why: String| LocalRoute::Network(why);
        if peer.instance == shared.instance {
            return network("the peer is this endpoint".into());
        }
        let me = self.local_info();
        if me.boot_id == [0; 16] {
            return network("this host's boot id is unknown".into());
        }
        if peer.boot_id != me.boot_id {
            return network(format!(
                "another host ({} here, {} there; boot ids differ)",
                me.hostname, peer.hostname
            ));
        }
        if peer.uid != me.uid {
            return network(format!(
                "another user (uid {} here, {} there): the rendezvous admits only the same user",
                me.uid, peer.uid
            ));
        }
        if let Some(why) = self.local.listeners.unavailable() {
            return network(why.to_owned());
        }
        if !tcpx::cuda::driver_available() {
            return network(format!(
                "no CUDA driver here ({})",
                tcpx::cuda::driver_status()
            ));
        }
        if let (Some(mine), Some(theirs)) = (me.gpu.as_deref(), peer.gpu.as_deref()) {
            if mine != theirs {
                if let Ok(Some(false)) = tcpx::cuda::peer_access_possible(mine, theirs) {
                    return network(format!("GPU {mine} cannot reach GPU {theirs} peer-to-peer"));
                }
            }
        }
        LocalRoute::Ipc
    }

    /// Waits (up to the configured timeout) for a peer of this host to connect locally.
    pub fn accept_local(&self) -> Result<LocalConnection> {
        self.accept_local_timeout(self.shared.config.timeout)
    }

    /// [`accept_local`](Self::accept_local), waiting at most `wait` for a peer to arrive.
    /// Connections of other users, and sockets that do not say a valid hello in time, are
    /// turned away (logged) while this keeps waiting. After
    /// [`stop_accepting`](Self::stop_accepting) it fails at once (`Closed`).
    pub fn accept_local_timeout(&self, wait: Duration) -> Result<LocalConnection> {
        let (hello, default_gpu) = self.local_hello();
        self.local.listeners.accept(
            &self.local.shared,
            &self.local.links,
            (&hello, default_gpu),
            self.accept_stop.fd(),
            wait,
        )
    }

    /// Connects to the endpoint of this host at `addr`, waiting up to the configured timeout
    /// for it to accept. An endpoint's own name exists from its creation on, so nobody
    /// listening there fails within half a second; a GPU's name is claimed when its endpoint
    /// first accepts (or at creation with [`Config::gpu_pci`](crate::Config::gpu_pci)), so that one is retried for
    /// the whole timeout.
    pub fn connect_local(&self, addr: &LocalAddr) -> Result<LocalConnection> {
        let shared = &self.local.shared;
        let name = crate::ipc::identity::socket_name(addr, shared.uid)?;
        let (hello, default_gpu) = self.local_hello();
        let timeout = self.shared.config.timeout;
        let listen_wait = match addr {
            LocalAddr::Name(_) => timeout.min(NAME_GRACE),
            LocalAddr::Gpu(_) => timeout,
        };
        rendezvous::connect(
            shared,
            &self.local.links,
            &name,
            &hello,
            default_gpu,
            listen_wait,
            timeout,
        )
    }

    /// Advertises all of CUDA `region` for peers of this host ([`crate::ipc`]); see
    /// [`advertise_ipc_range`](Self::advertise_ipc_range).
    pub fn advertise_ipc(&self, region: &Region) -> Result<IpcDescriptor> {
        self.advertise_ipc_range(region, 0, region.len())
    }

    /// Advertises `len` bytes at `offset` in CUDA `region` for same-host access: the returned
    /// descriptor (hand [`IpcDescriptor::to_bytes`] over out of band) lets a peer's
    /// [`LocalConnection`] write and read the range. The endpoint keeps the region alive until
    /// [`revoke_ipc`](Self::revoke_ipc) (or until it and all its local connections are
    /// dropped). Each call makes a new descriptor with its own key.
    ///
    /// Errors: host memory (no CUDA IPC handle exists for it), a range outside the region,
    /// memory the driver cannot export (`cuMemCreate`, `cuMemAllocAsync` pools).
    pub fn advertise_ipc_range(
        &self,
        region: &Region,
        offset: usize,
        len: usize,
    ) -> Result<IpcDescriptor> {
        if region.kind() != tcpx::MemoryKind::Cuda {
            return Err(Error::InvalidArgument(
                "only CUDA memory can be advertised for same-host (IPC) access".into(),
            ));
        }
        if len == 0 {
            return Err(Error::InvalidArgument(
                "cannot advertise an empty range".into(),
            ));
        }
        region
            .memory()
            .check_range("advertise_ipc", offset, len)
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        let ptr = region.as_ptr() as u64 + offset as u64;
        let device = match region.cuda_device() {
            Some(d) => d.clone(),
            None => {
                let ordinal = tcpx::cuda::pointer_device(ptr as *const u8).ok_or_else(|| {
                    Error::InvalidArgument(format!("{ptr:#x} is not CUDA device memory"))
                })?;
                CudaDevice::new(ordinal)
                    .map_err(|e| Error::Unsupported(format!("CUDA: opening GPU {ordinal}: {e}")))?
            }
        };
        let export = IpcExport::of(&device, ptr).map_err(|e| Error::Local {
            peer: "-".into(),
            kind: LocalErrorKind::Cuda,
            what: format!("advertise_ipc: {e}"),
        })?;
        let shared = &self.local.shared;
        let key = random_key()?;
        let d = IpcDescriptor {
            handle: export.handle,
            owner: shared.instance,
            owner_pid: shared.pid,
            base: export.base,
            alloc_len: export.alloc_len as u64,
            offset: export.offset as u64,
            len: len as u64,
            key,
        };
        shared
            .adverts
            .insert(key, region.clone(), d.handle, d.offset, d.len);
        Ok(d)
    }

    /// Advertises caller-owned CUDA memory (bindings: UCCL's `advertise_ipc(conn_id, ptr,
    /// size)`): [`register_ptr`](Self::register_ptr), then
    /// [`advertise_ipc`](Self::advertise_ipc).
    ///
    /// # Safety
    /// As [`register_ptr`](Self::register_ptr): the memory stays valid until the descriptor
    /// is revoked ([`revoke_ipc`](Self::revoke_ipc)) or the endpoint and all its local
    /// connections are dropped.
    pub unsafe fn advertise_ipc_ptr(&self, ptr: *mut u8, len: usize) -> Result<IpcDescriptor> {
        // SAFETY: forwarded from this function's contract.
        let region = unsafe { self.register_ptr(ptr, len) }?;
        self.advertise_ipc(&region)
    }

    /// Revokes a descriptor this endpoint issued and waits (at most the configured timeout)
    /// until every connected peer closed its mapping of it: afterwards the memory may be
    /// freed. Whether it was advertised and not yet revoked; an error names a peer that did
    /// not confirm in time.
    pub fn revoke_ipc(&self, descriptor: &IpcDescriptor) -> Result<bool> {
        if descriptor.owner != self.local.shared.instance {
            return Ok(false);
        }
        self.local.links.revoke(&self.local.shared, descriptor.key)
    }

    /// Descriptors this endpoint advertised and has not revoked.
    pub fn ipc_advertised(&self) -> usize {
        self.local.shared.adverts.live()
    }
}
