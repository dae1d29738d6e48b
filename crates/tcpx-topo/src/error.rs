//! The one error type of this crate.

use std::path::PathBuf;

/// Everything that can go wrong while discovering the topology or building a plan.
///
/// Every variant names what was at fault (the file, the GPU, the NIC, the environment
/// variable) so that the message alone tells the operator what to fix.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TopoError {
    /// The topology XML file could not be read (missing, unreadable, not UTF-8).
    #[error("cannot read topology XML file {path}: {source}")]
    ReadXml {
        /// The file that was asked for.
        path: PathBuf,
        /// What the operating system said.
        source: std::io::Error,
    },

    /// The topology XML is empty (or only whitespace).
    #[error("topology XML {origin} is empty")]
    EmptyXml {
        /// The file path, or `<string>` for XML passed in memory.
        origin: String,
    },

    /// hwloc (or our pre-check) rejected the topology XML.
    #[error("topology XML {origin} is not a valid hwloc topology: {detail}")]
    InvalidXml {
        /// The file path, or `<string>` for XML passed in memory.
        origin: String,
        /// Why it was rejected.
        detail: String,
    },

    /// hwloc failed while discovering the live machine.
    #[error("hwloc discovery failed during {step}: {detail}")]
    Hwloc {
        /// Which step failed (for example `hwloc_topology_load`).
        step: String,
        /// What hwloc said.
        detail: String,
    },

    /// A PCI bus id string could not be parsed.
    #[error("invalid PCI bus id {input:?}: {detail} (expected e.g. 0000:04:00.0)")]
    InvalidPciBusId {
        /// The text that was given.
        input: String,
        /// What is wrong with it.
        detail: String,
    },

    /// A GPU the caller asked for (by PCI bus id) is not in the hwloc topology.
    #[error(
        "GPU {pci} (CUDA device {index}) is not in the hwloc topology; GPUs hwloc sees: {seen}"
    )]
    GpuNotFound {
        /// The GPU's position in the caller's list (CUDA order).
        index: usize,
        /// Its PCI bus id.
        pci: String,
        /// The GPUs hwloc does see, comma-separated (or `none`).
        seen: String,
    },

    /// The same GPU appears twice in the caller's GPU list.
    #[error("GPU {pci} is listed twice in the plan request (positions {first} and {second})")]
    DuplicateGpu {
        /// Its PCI bus id.
        pci: String,
        /// First position.
        first: usize,
        /// Second position.
        second: usize,
    },

    /// `TCPX_GPU_NIC_MAP` names a GPU index that does not exist.
    #[error("{var} names GPU {index}, but only {count} GPU(s) are planned (indices 0..{count})")]
    UnknownGpu {
        /// The variable (or option) the mapping came from.
        var: String,
        /// The GPU index it named.
        index: usize,
        /// How many GPUs there are.
        count: usize,
    },

    /// `TCPX_GPU_NIC_MAP` names a NIC that is not a candidate.
    #[error("{var} names NIC {name:?}, which is not among the candidate NICs [{candidates}]")]
    UnknownNic {
        /// The variable (or option) the mapping came from.
        var: String,
        /// The NIC name it used.
        name: String,
        /// The NIC names that are available, comma-separated.
        candidates: String,
    },

    /// An environment-style setting (`TCPX_GPU_NIC_MAP`, `*_BINDINGS`) is malformed.
    #[error("malformed {var}={input:?}: {detail}")]
    Malformed {
        /// The variable the text came from.
        var: String,
        /// The text.
        input: String,
        /// What is wrong with it and where.
        detail: String,
    },

    /// There are GPUs to plan but no NIC to put them on.
    #[error(
        "no NIC to plan {gpus} GPU(s) onto: hwloc sees no network device and the caller passed no NIC list"
    )]
    NoNics {
        /// How many GPUs were waiting for a NIC.
        gpus: usize,
    },

    /// The plan request itself is inconsistent.
    #[error("invalid plan request: {detail}")]
    InvalidRequest {
        /// What is wrong.
        detail: String,
    },
}
