//! GPU memory: CUDA device buffers, pinned host buffers, copies, streams and events, and the
//! receive-side unpack kernel of TCPX (docs/NCCL_NET_ABI.md §6).
//!
//! Everything here talks to the CUDA driver API through `cudarc` with dynamic loading, so the
//! crate builds and runs on machines without CUDA. `cudarc` panics when `libcuda` is missing;
//! this module never lets that happen: [`driver_status`] probes the driver once (dlopen
//! `libcuda.so.1`, `cuInit(0)`, at least one device) and caches the answer, and every entry point
//! that reaches the driver checks it first and returns an [`ErrorKind::Cuda`](crate::ErrorKind)
//! error ([`CudaError::NoDriver`]) instead.
//!
//! * [`CudaDevice`]: one GPU (ordinal, name, PCI bus id, compute capability), its primary
//!   context made current on demand.
//! * [`CudaBuffer`]: a zeroed, 4 KiB-aligned device allocation (devmem-TCP needs 4 KiB).
//!   [`PinnedHostBuffer`]: page-locked host memory mapped into the GPU (`cuMemHostAlloc`). Both
//!   implement [`Memory`](crate::Memory), so [`SharedMemory::new`](crate::SharedMemory::new) wraps
//!   and registers them.
//! * [`CudaStream`], [`CudaEvent`], [`AsyncCopy`]: stream-ordered copies between any two
//!   [`SharedMemory`](crate::SharedMemory) handles; the memory counts as in flight until the copy
//!   completes.
//! * [`StagingRing`]: pinned host slots with a stream and per-slot events, through which the
//!   runtime stages CUDA memory for host-only plugins; lists of pieces ([`Span`]) go in and
//!   out of a slot in one gather launch.
//! * CUDA IPC between processes of one host: [`IpcExport`] (a device allocation's handle,
//!   base and offset), [`IpcMapping`] (a peer's allocation mapped here, closed on drop), and
//!   [`CopyPool`] / [`PooledCopy`] (copies on a fixed set of streams, completion through
//!   pooled events).
//! * [`SmallCopier`]: synchronous copies of a few KiB between device memory and host bytes
//!   through pinned bounce buffers (small one-sided operations carried inline).
//! * [`unpack`]: the CPU reference gather and the GPU [`Unpacker`](unpack::Unpacker).
//!
//! ```
//! use tcpx::cuda::{self, CudaDevice};
//! if !cuda::driver_available() {
//!     println!("skipped: no CUDA driver ({})", cuda::driver_status());
//!     return Ok(());
//! }
//! let gpu = CudaDevice::new(0)?;
//! let buf = gpu.alloc(1 << 20)?;
//! buf.copy_from_host(0, b"hello")?;
//! let mut back = [0u8; 5];
//! buf.copy_to_host(0, &mut back)?;
//! assert_eq!(&back, b"hello");
//! # Ok::<(), tcpx::Error>(())
//! ```

mod buffer;
mod copy;
mod device;
mod driver;
mod ipc;
mod list_choice;
mod small_copy;
mod staging;
pub mod unpack;

pub use buffer::{AsyncCopy, CudaBuffer, DeviceAccessible, PinnedHostBuffer};
pub use copy::{
    CopyPiece, CopyPool, PooledCopy, LIST_KERNEL_ENV, LIST_MAX_FRAGMENTS, LIST_MIN_PIECES,
    MAX_COPY_STREAMS, SPLIT_UNIT,
};
pub use device::{device_pci_bus_id, peer_access_possible, CudaDevice, CudaEvent, CudaStream};
pub use driver::{
    driver_available, driver_status, pointer_allocation, pointer_device, skip_reason, DriverStatus,
};
pub use ipc::{allocation_range, IpcExport, IpcMapping, IpcMemHandle, IPC_HANDLE_BYTES};
pub use small_copy::{
    own_this_thread, ListCopy, ListTimes, SmallCopier, SMALL_COPY_BOUNCE_BYTES,
    SMALL_COPY_LISTS_ENV, SMALL_COPY_TIMEOUT,
};
pub use staging::{Span, StagingRing, FRAGMENTS_PER_SLOT, FRAGMENT_BYTES};

/// Why a CUDA operation failed; defined with the crate's error type, which carries it.
pub use crate::error::CudaError;
