//! [`IpcShared`]: what an endpoint's same-host side shares with its local connections —
//! identity, advertised ranges, the GPUs and copy pools opened so far. (The connections
//! themselves, for revocations, are in [`super::links`]: they hold this, not the other way.)

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tcpx::cuda::{CopyPool, CudaDevice};

use super::adverts::IpcAdverts;
use super::identity::{boot_id, hostname};
use crate::error::{Error, LocalErrorKind, Result};

/// Streams per GPU for same-host copies: a large operation is spread over them (each stream
/// keeps a copy engine busy), small ones take turns.
pub const IPC_STREAMS: usize = 4;

/// A GPU opened for same-host copies and its copy pool.
pub(crate) struct Gpu {
    pub(crate) device: CudaDevice,
    pub(crate) pool: Arc<CopyPool>,
}

/// A GPU slot: opened on first use, or why it could not be.
type GpuSlot = OnceLock<std::result::Result<Arc<Gpu>, String>>;

/// One endpoint's same-host state, shared with its local connections (which keep it, and so
/// the advertised memory, alive while they live).
pub(crate) struct IpcShared {
    pub(crate) timeout: Duration,
    pub(crate) spin: Duration,
    pub(crate) uid: u32,
    pub(crate) pid: u32,
    pub(crate) instance: u64,
    pub(crate) boot_id: [u8; 16],
    pub(crate) hostname: String,
    /// This endpoint's rendezvous name.
    pub(crate) name: String,
    pub(crate) adverts: IpcAdverts,
    /// Per CUDA ordinal, opened on first use (the outer list on the first GPU operation, so
    /// that endpoints that never copy never probe the driver).
    gpus: OnceLock<Vec<GpuSlot>>,
}

impl IpcShared {
    pub(crate) fn new(
        timeout: Duration,
        spin: Duration,
        uid: u32,
        instance: u64,
        name: String,
    ) -> Self {
        Self {
            timeout,
            spin,
            uid,
            pid: std::process::id(),
            instance,
            boot_id: boot_id(),
            hostname: hostname(),
            name,
            adverts: IpcAdverts::default(),
            gpus: OnceLock::new(),
        }
    }

    /// GPU `ordinal` and its copy pool, opened on first use. Without a usable driver, or for
    /// an ordinal that does not exist, an error that says so.
    pub(crate) fn gpu(&self, ordinal: usize) -> Result<Arc<Gpu>> {
        let gpus = self
            .gpus
            .get_or_init(|| (0..CudaDevice::count()).map(|_| OnceLock::new()).collect());
        let Some(slot) = gpus.get(ordinal) else {
            return Err(Error::Unsupported(format!(
                "same-host copies need CUDA GPU {ordinal}: {}",
                if gpus.is_empty() {
                    format!("no CUDA device ({})", tcpx::cuda::driver_status())
                } else {
                    format!("{} device(s) present", gpus.len())
                }
            )));
        };
        slot.get_or_init(|| {
            let device = CudaDevice::new(ordinal).map_err(|e| e.to_string())?;
            let pool = CopyPool::new(&device, IPC_STREAMS).map_err(|e| e.to_string())?;
            Ok(Arc::new(Gpu { device, pool }))
        })
        .clone()
        .map_err(|e| Error::Local {
            peer: "-".into(),
            kind: LocalErrorKind::Cuda,
            what: format!("opening GPU {ordinal} for same-host copies: {e}"),
        })
    }
}
