//! What the caller asks the planner for: which GPUs, which NICs, how many channels, and the
//! operator's overrides.

use std::path::PathBuf;

use crate::override_map::GPU_NIC_MAP_VAR;
use crate::{PciBusId, TopoError};

/// The plugin's TX core bindings variable.
pub const TX_BINDINGS_VAR: &str = "NCCL_GPUDIRECTTCPX_TX_BINDINGS";
/// The plugin's RX core bindings variable.
pub const RX_BINDINGS_VAR: &str = "NCCL_GPUDIRECTTCPX_RX_BINDINGS";
/// The plugin's data-NIC list (`eth1,eth2,eth3,eth4`).
pub const SOCKET_IFNAME_VAR: &str = "NCCL_GPUDIRECTTCPX_SOCKET_IFNAME";
/// Channels per GPU; `UCCL_TCPX_NUM_CHANNELS` is accepted as an alias.
pub const NUM_CHANNELS_VAR: &str = "TCPX_NUM_CHANNELS";
/// UCCL's name for [`NUM_CHANNELS_VAR`].
pub const UCCL_NUM_CHANNELS_VAR: &str = "UCCL_TCPX_NUM_CHANNELS";

/// One NIC the plugin offers: its interface name and, when the plugin reports one, its
/// `pciPath` (the device's sysfs path), which is matched before the name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NicCandidate {
    /// Interface name (`eth1`).
    pub name: String,
    /// The plugin's `pciPath`, e.g. `/sys/devices/pci0000:00/…/0000:06:00.0`.
    pub pci_path: Option<PathBuf>,
}

impl NicCandidate {
    /// A candidate known by name only.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            pci_path: None,
        }
    }

    /// Adds the plugin's `pciPath`.
    pub fn with_pci_path(mut self, path: impl Into<PathBuf>) -> Self {
        self.pci_path = Some(path.into());
        self
    }
}

/// Input of [`Plan::build`](crate::Plan::build).
///
/// `Default` asks for every GPU hwloc sees, every network interface it sees, automatic
/// channel counts and no overrides.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PlanRequest {
    /// The GPUs to plan, by PCI bus id, in CUDA device order (from the CUDA layer).
    /// `None`: every GPU hwloc sees, in PCI bus order. Plan entry `gpu` and the indices in
    /// `gpu_nic_map` refer to positions in this list.
    pub gpus: Option<Vec<PciBusId>>,
    /// The plugin's devices. `None`: every network interface hwloc sees except loopback.
    pub nics: Option<Vec<NicCandidate>>,
    /// Channels (TCPX connections) per GPU; 0 = automatic: [`CONNECTIONS_PER_NIC`] shared
    /// among the GPUs that use a NIC.
    ///
    /// [`CONNECTIONS_PER_NIC`]: crate::CONNECTIONS_PER_NIC
    pub channels_per_gpu: usize,
    /// `TCPX_GPU_NIC_MAP`, unparsed (see [`GpuNicMap`](crate::GpuNicMap)).
    pub gpu_nic_map: Option<String>,
    /// `NCCL_GPUDIRECTTCPX_TX_BINDINGS`, unparsed: cores the plugin keeps for itself.
    pub tx_bindings: Option<String>,
    /// `NCCL_GPUDIRECTTCPX_RX_BINDINGS`, unparsed: cores the plugin keeps for itself.
    pub rx_bindings: Option<String>,
}

impl PlanRequest {
    /// Reads the overrides from the process environment: `TCPX_GPU_NIC_MAP`,
    /// `NCCL_GPUDIRECTTCPX_TX_BINDINGS`/`RX_BINDINGS`, `TCPX_NUM_CHANNELS` (or
    /// `UCCL_TCPX_NUM_CHANNELS`), and `NCCL_GPUDIRECTTCPX_SOCKET_IFNAME` as the NIC list
    /// (a caller holding the plugin's device list should set `nics` from it instead).
    /// Empty variables count as unset.
    pub fn from_env() -> Result<Self, TopoError> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// [`from_env`](Self::from_env) with a custom variable lookup (for tests and for
    /// callers that merge configuration sources).
    pub fn from_vars(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, TopoError> {
        let get = |name: &str| lookup(name).filter(|v| !v.trim().is_empty());
        let channels_per_gpu = match get(NUM_CHANNELS_VAR)
            .map(|v| (NUM_CHANNELS_VAR, v))
            .or_else(|| get(UCCL_NUM_CHANNELS_VAR).map(|v| (UCCL_NUM_CHANNELS_VAR, v)))
        {
            Some((var, v)) => v.trim().parse().map_err(|_| TopoError::Malformed {
                var: var.to_owned(),
                input: v.clone(),
                detail: "expected a whole number of channels".to_owned(),
            })?,
            None => 0,
        };
        let nics = get(SOCKET_IFNAME_VAR).map(|list| {
            list.split(',')
                .map(str::trim)
                .filter(|n| !n.is_empty())
                .map(NicCandidate::new)
                .collect()
        });
        Ok(Self {
            gpus: None,
            nics,
            channels_per_gpu,
            gpu_nic_map: get(GPU_NIC_MAP_VAR),
            tx_bindings: get(TX_BINDINGS_VAR),
            rx_bindings: get(RX_BINDINGS_VAR),
        })
    }
}
