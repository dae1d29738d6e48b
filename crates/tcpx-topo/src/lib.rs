//! Which NIC and which CPU cores belong to each GPU, and the plan the runtime follows.
//!
//! On an A3-high node each pair of GPUs shares a PCIe switch with one gVNIC, and each socket
//! holds four GPUs and two NICs; a GPU that sends through a NIC across the socket, or a
//! progress thread on the wrong socket, loses a large part of the bandwidth. This crate finds
//! the layout out on any machine with hwloc (live, or from an XML file for tests) and turns
//! it into a [`Plan`]: per GPU its NIC(s), closest first and balanced; the cores for its
//! progress threads (local to the NIC, leaving the TCPX plugin's own binding cores alone);
//! its channel count; and the reason for every choice.
//!
//! - GPUs are PCI devices of vendor 0x10de, class 0x0302 or 0x0300, named by PCI bus id
//!   (Debian's hwloc has no CUDA plugin). The CUDA layer passes its bus ids in CUDA order in
//!   [`PlanRequest::gpus`].
//! - NICs are hwloc network OS devices, matched to the plugin's devices
//!   ([`PlanRequest::nics`]) by the PCI bus id in the plugin's `pciPath`, else by name.
//! - Closeness is a [`Relation`] from the deepest common ancestor in the hwloc tree.
//! - `TCPX_GPU_NIC_MAP` overrides the choice; a machine whose hwloc shows no PCI data gets a
//!   static layout, marked `fallback: no PCI data`.
//!
//! ```
//! use tcpx_topo::{Plan, PlanRequest, Topology};
//!
//! let path = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/two-gpu-one-nic.xml");
//! let topo = Topology::from_xml_file(path)?;
//! let plan = Plan::build(&topo, &PlanRequest::default())?;
//! assert_eq!(plan.entries.len(), 2);
//! assert_eq!(plan.entries[0].nics, ["eth1"]);
//! assert_eq!(plan.entries[0].reason, "same PCIe switch");
//! println!("{}", plan.to_json());
//! # Ok::<(), tcpx_topo::TopoError>(())
//! ```

mod assign;
mod bindings;
mod cores;
mod discover;
mod error;
mod override_map;
mod pci;
mod plan;
mod relation;
mod request;
mod resolve;
mod topology;

pub use bindings::Bindings;
pub use error::TopoError;
pub use override_map::{GpuNicMap, GPU_NIC_MAP_VAR};
pub use pci::PciBusId;
pub use plan::{GpuPlan, Plan, CONNECTIONS_PER_NIC};
pub use relation::Relation;
pub use request::{
    NicCandidate, PlanRequest, NUM_CHANNELS_VAR, RX_BINDINGS_VAR, SOCKET_IFNAME_VAR,
    TX_BINDINGS_VAR, UCCL_NUM_CHANNELS_VAR,
};
pub use topology::{Gpu, Nic, NumaNode, Topology};
