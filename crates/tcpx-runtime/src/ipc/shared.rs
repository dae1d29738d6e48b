//! [`IpcShared`]: what an endpoint's same-host side shares with its local connections —
//! identity, advertised ranges, the GPUs and copy pools opened so far, the connections
//! themselves (for revocations) — and the endpoint-wide operations on them.

use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use tcpx::cuda::{CopyPool, CudaDevice};

use super::adverts::IpcAdverts;
use super::identity::{boot_id, hostname};
use super::link::{LocalLink, Reply};
use super::wire::Msg;
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
    links: Mutex<Vec<Weak<LocalLink>>>,
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
            links: Mutex::new(Vec::new()),
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

    /// Remembers a new connection (revocations reach it).
    pub(crate) fn add_link(&self, link: &Arc<LocalLink>) {
        let mut links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        links.retain(|w| w.strong_count() > 0);
        links.push(Arc::downgrade(link));
    }

    fn live_links(&self) -> Vec<Arc<LocalLink>> {
        let links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        links.iter().filter_map(Weak::upgrade).collect()
    }

    /// Revokes `key` and waits until every connected peer dropped it (and closed its mapping
    /// if that was the last descriptor of the allocation), at most the timeout in all.
    /// Whether the key was advertised; an error names a peer that did not confirm in time.
    pub(crate) fn revoke(&self, key: u64) -> Result<bool> {
        let was = self.adverts.revoke(key);
        if !was {
            return Ok(false);
        }
        // All asks first, then all answers: one timeout for the lot, not one per peer.
        let asked: Vec<_> = self
            .live_links()
            .into_iter()
            .filter_map(|link| {
                let waiter = link.ask(|req| Msg::Revoke { req, key }).ok()?;
                Some((link, waiter))
            })
            .collect();
        let deadline = Instant::now() + self.timeout;
        for (link, waiter) in asked {
            match link.answer_by(waiter, deadline) {
                Ok(Reply::Ack) => {}
                Ok(other) => {
                    return Err(link.error(
                        LocalErrorKind::Protocol,
                        format!("answered a revocation with {other:?}"),
                    ))
                }
                // Gone, or closed here meanwhile: its mappings were dropped on the way out.
                Err(e)
                    if matches!(
                        e.local_kind(),
                        Some(LocalErrorKind::PeerClosed | LocalErrorKind::Closed)
                    ) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }
}
