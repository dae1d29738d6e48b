//! [`MemoryKind`]: host or CUDA memory, as every format here (and the plugin ABI) codes it.

/// Where memory lives, as the plugin's `regMr` type and as descriptors code it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum MemoryKind {
    /// Host memory (`NCCL_PTR_HOST`, code 1).
    Host,
    /// CUDA device memory (`NCCL_PTR_CUDA`, code 2).
    Cuda,
}

impl MemoryKind {
    /// The `type` argument of the plugin's `regMr` (`NCCL_PTR_HOST` 1, `NCCL_PTR_CUDA` 2: the
    /// ncclNet ABI's codes, which descriptors use too).
    pub fn ptr_type(self) -> i32 {
        match self {
            MemoryKind::Host => 1,
            MemoryKind::Cuda => 2,
        }
    }
}
