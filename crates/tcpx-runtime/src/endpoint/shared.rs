//! What an endpoint's connections share, below both the handshake (`setup`) and the
//! [`Connection`](super::Connection) that use it.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use tcpx::cuda::CudaDevice;
use tcpx::Net;

use super::backend::BackendInfo;
use crate::config::Config;
use crate::control::EndpointInfo;
use crate::engine::stage::Staging;
use crate::engine::EngineHandle;
use crate::link::Link;
use crate::metrics::EndpointCounters;
use crate::onesided::OneSidedShared;
use crate::registry::RegistrationCounter;

/// What an endpoint's connections share: the plugin, the engines and the configuration.
pub(crate) struct EndpointShared {
    pub(crate) net: Net,
    pub(crate) config: Config,
    pub(crate) backend: BackendInfo,
    /// Plugin devices in use; channel `c` lives on `devices[c % devices.len()]`.
    pub(crate) devices: Vec<usize>,
    /// `engines_per_device` engines per device: engine `k` serves `devices[k % devices.len()]`;
    /// on a connection driven by the first `n` of them ([`Self::engines_for`]), it owns the
    /// channels `c` with `c % n == k`.
    pub(crate) engines: Vec<EngineHandle>,
    /// How many engines per device it started, and how many drive a connection to a peer
    /// that competes for this process's cores (the first ones, as many per device).
    pub(crate) engine_plan: super::engine_plan::EnginePlan,
    /// Counts this endpoint among the process's live ones while it exists (see
    /// `engine_plan::shares_cores`).
    pub(crate) _live: super::engine_plan::LiveEndpoint,
    pub(crate) registrations: RegistrationCounter,
    /// What this endpoint tells peers in `Hello`.
    pub(crate) info: EndpointInfo,
    /// Advertised regions and delivered notifications, shared with every connection's
    /// one-sided half.
    pub(crate) one_sided: Arc<OneSidedShared>,
    /// The GPU of this endpoint's CUDA regions, fixed by the first one (one GPU per
    /// endpoint: the engines' staging rings and streams live on it).
    pub(crate) gpu: OnceLock<CudaDevice>,
    /// Every plugin device in use takes CUDA pointers (`NCCL_PTR_CUDA`): CUDA regions go to
    /// the plugin directly; otherwise they are staged through pinned host memory.
    pub(crate) plugin_cuda: bool,
    /// Plugin device names, parallel to `devices` (what metrics call a NIC).
    pub(crate) nic_names: Vec<String>,
    /// Event counters (connections, failures by cause) for [`super::Endpoint::metrics`].
    pub(crate) counters: Arc<EndpointCounters>,
    /// Every connection's two links (two-sided, one-sided), for metrics; pruned of dead
    /// ones whenever a connection is added or a snapshot taken. Locked only then, never on
    /// the data path.
    pub(crate) links: Mutex<Vec<(Weak<Link>, Weak<Link>)>>,
}

impl EndpointShared {
    /// How many of the first engines drive a connection whose control connection runs from
    /// `local` to `peer`: all of them, or half the cores' worth when the peer competes for
    /// this process's cores (see `engine_plan`). Channel `c` is driven by engine
    /// `c % count`, which serves the channel's device (the count is a multiple of the devices).
    pub(crate) fn engines_for(&self, local: SocketAddr, peer: SocketAddr) -> usize {
        if self.engine_plan.shares_cores_with(local, peer) {
            (self.devices.len() * self.engine_plan.per_device_for_local_peers)
                .clamp(1, self.engines.len())
        } else {
            self.engines.len()
        }
    }

    /// Remembers a new connection's links for metrics.
    pub(crate) fn track(&self, link: &Arc<Link>, rma: &Arc<Link>) {
        let mut links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        links.retain(|(l, _)| l.strong_count() > 0);
        links.push((Arc::downgrade(link), Arc::downgrade(rma)));
    }

    /// The NIC (plugin device name) carrying channel `channel`.
    pub(crate) fn nic_of(&self, channel: u16) -> &str {
        &self.nic_names[usize::from(channel) % self.nic_names.len()]
    }

    /// The plugin device carrying channel `channel`.
    pub(crate) fn device_of(&self, channel: u16) -> usize {
        self.devices[usize::from(channel) % self.devices.len()]
    }

    /// Where this endpoint's CUDA memory is staged: its GPU, once CUDA memory is registered
    /// and when the plugin takes host memory only; `None` otherwise.
    pub(crate) fn staging(&self) -> Option<Staging> {
        if self.plugin_cuda {
            return None;
        }
        self.gpu.get().map(|gpu| Staging::Cuda(gpu.clone()))
    }
}
