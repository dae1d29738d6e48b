//! How close a GPU sits to a NIC.

use std::fmt;

/// The PCIe/NUMA relation between a GPU and a NIC, closest first.
///
/// Derived from their *deepest common ancestor* in the hwloc tree (not from their parents:
/// on A3-high a GPU and its NIC hang off different downstream ports of one switch):
///
/// | variant | deepest common ancestor |
/// |---|---|
/// | `SameSwitch` | a PCI-to-PCI bridge (a PCIe switch, or one root port) |
/// | `SameHostBridge` | a host bridge (same root complex) |
/// | `SameNuma` | a CPU-side object; both devices are local to the same NUMA node |
/// | `SameSocket` | a CPU-side object; same package, different NUMA nodes (sub-NUMA clustering) |
/// | `OtherSocket` | a CPU-side object; different packages or NUMA nodes |
/// | `Unknown` | no locality known for one side (NIC not in hwloc, no PCI data) |
///
/// The order (`SameSwitch < … < Unknown`) is the order of preference.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Relation {
    /// Behind one PCIe switch: peer-to-peer traffic never reaches the CPU.
    SameSwitch,
    /// Under one host bridge, in different switches.
    SameHostBridge,
    /// Under different host bridges of one NUMA node.
    SameNuma,
    /// Different NUMA nodes of one socket.
    SameSocket,
    /// Across the inter-socket link: the case that loses bandwidth.
    OtherSocket,
    /// Locality of one side is not known.
    Unknown,
}

impl Relation {
    /// The plain-words reason a plan gives for choosing a NIC with this relation.
    pub fn reason(self) -> &'static str {
        match self {
            Self::SameSwitch => "same PCIe switch",
            Self::SameHostBridge => "same PCIe host bridge",
            Self::SameNuma => "same NUMA node",
            Self::SameSocket => "same socket, other NUMA node",
            Self::OtherSocket => "other socket: no closer NIC",
            Self::Unknown => "locality unknown: NIC not in the hwloc topology",
        }
    }
}

impl fmt::Display for Relation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.reason())
    }
}
