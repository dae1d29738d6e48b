//! The discovered machine as plain data: GPUs, NICs, NUMA nodes, cores, and how close each
//! GPU is to each NIC. Built once from hwloc (see `discover`), then queried without hwloc.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::{PciBusId, Relation};

/// A GPU as hwloc sees it: a PCI device of vendor 0x10de, class 0x0302 (3D) or 0x0300 (VGA).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Gpu {
    /// Position in PCI bus order (what CUDA calls device `index` under
    /// `CUDA_DEVICE_ORDER=PCI_BUS_ID`).
    pub index: usize,
    /// PCI bus id.
    pub pci: PciBusId,
    /// NUMA node (OS index) the GPU is attached to, when hwloc knows a single one.
    pub numa: Option<u32>,
    /// Package (socket, OS index) the GPU is attached to, when known.
    pub package: Option<u32>,
    /// OS indices of the PUs local to the GPU.
    pub local_cpus: Vec<usize>,
}

/// A network interface: an hwloc network OS device (`eth1`, `ens8`…).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Nic {
    /// Interface name.
    pub name: String,
    /// PCI bus id of the device behind the interface, when it has one.
    pub pci: Option<PciBusId>,
    /// NUMA node (OS index) the NIC is attached to, when hwloc knows a single one.
    pub numa: Option<u32>,
    /// Package (socket, OS index) the NIC is attached to, when known.
    pub package: Option<u32>,
    /// OS indices of the PUs local to the NIC: where its progress thread belongs.
    pub local_cpus: Vec<usize>,
}

/// A NUMA node and the PUs it holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NumaNode {
    /// OS index of the node.
    pub os_index: u32,
    /// Package (socket, OS index) it belongs to, when known.
    pub package: Option<u32>,
    /// OS indices of its PUs.
    pub cpus: Vec<usize>,
}

/// Everything the planner needs to know about one machine.
///
/// Load it with [`Topology::from_live`], [`Topology::from_xml_file`] or
/// [`Topology::from_xml_str`]; it holds no hwloc handle afterwards (it is plain, `Send`
/// and `Sync` data).
#[derive(Debug, Clone, Serialize)]
pub struct Topology {
    pub(crate) origin: String,
    pub(crate) gpus: Vec<Gpu>,
    pub(crate) nics: Vec<Nic>,
    /// `relations[gpu][nic]`, same indices as `gpus` and `nics`.
    pub(crate) relations: Vec<Vec<Relation>>,
    pub(crate) numa_nodes: Vec<NumaNode>,
    pub(crate) pus: Vec<usize>,
    /// PU OS index → physical core id, so that core sets can be split by whole cores.
    #[serde(skip)]
    pub(crate) core_of_pu: BTreeMap<usize, usize>,
    pub(crate) has_pci: bool,
}

impl Topology {
    /// Where this topology came from: `live`, a file path, or `<string>`.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The GPUs, in PCI bus order (`gpus()[i].index == i`).
    pub fn gpus(&self) -> &[Gpu] {
        &self.gpus
    }

    /// The network interfaces hwloc sees, in PCI bus order (interfaces without a PCI
    /// device last, by name).
    pub fn nics(&self) -> &[Nic] {
        &self.nics
    }

    /// The NUMA nodes, by OS index.
    pub fn numa_nodes(&self) -> &[NumaNode] {
        &self.numa_nodes
    }

    /// OS indices of every PU (hardware thread) this process may use.
    pub fn pus(&self) -> &[usize] {
        &self.pus
    }

    /// Whether hwloc saw any PCI device. Some VMs hide PCI locality entirely; plans for
    /// such machines fall back to a static layout and say so.
    pub fn has_pci_info(&self) -> bool {
        self.has_pci
    }

    /// How close GPU `gpu` (index into [`gpus`](Self::gpus)) is to NIC `nic` (index into
    /// [`nics`](Self::nics)). An index out of range yields [`Relation::Unknown`].
    pub fn relation(&self, gpu: usize, nic: usize) -> Relation {
        self.relations
            .get(gpu)
            .and_then(|row| row.get(nic))
            .copied()
            .unwrap_or(Relation::Unknown)
    }

    /// The GPU with this PCI bus id.
    pub fn gpu_by_pci(&self, pci: &PciBusId) -> Option<&Gpu> {
        self.gpus.iter().find(|g| g.pci == *pci)
    }

    /// The NIC with this interface name.
    pub fn nic(&self, name: &str) -> Option<&Nic> {
        self.nics.iter().find(|n| n.name == name)
    }

    /// The PUs local to the NIC named `name` (OS indices), where one progress thread per NIC
    /// should be pinned; `None` when hwloc does not know that NIC. This is the full local
    /// set: [`Plan`](crate::Plan) entries additionally leave out the plugin's binding cores.
    pub fn nic_local_cores(&self, name: &str) -> Option<&[usize]> {
        self.nic(name).map(|n| n.local_cpus.as_slice())
    }

    /// Physical core id of a PU, so that hyperthread siblings stay together.
    pub(crate) fn core_of(&self, pu: usize) -> usize {
        // A PU hwloc did not put under a core (unusual) counts as its own core; offset so it
        // cannot collide with a real core id.
        self.core_of_pu
            .get(&pu)
            .copied()
            .unwrap_or((usize::MAX / 2).saturating_add(pu))
    }
}
