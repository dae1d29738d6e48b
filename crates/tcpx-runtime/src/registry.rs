//! Memory the application registered with an endpoint ([`Region`]) and its per-comm plugin
//! registrations ([`Registration`]).
//!
//! A plugin registration belongs to one comm, and a connection has one send and one receive
//! comm per channel, so a region is registered lazily, per connection and direction, on every
//! channel's comm at its first use there, and the result is cached on the connection. The
//! cache entry goes when either side goes: dropping the region removes its entries from every
//! connection it was used on, and closing a connection drops its cache. A transfer in flight
//! holds its registrations, so neither can be deregistered under it.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use rustc_hash::FxHashMap;

use tcpx::{MemoryRegion, SharedMemory};

use crate::error::Direction;

static NEXT_REGION_ID: AtomicU64 = AtomicU64::new(1);

/// Memory registered with an [`crate::Endpoint`], usable on any of its connections.
///
/// Cheap to clone. While a transfer is in flight on it, CPU access through the
/// [`SharedMemory`] fails with `Busy` (the safe layer's rule), so data is read after
/// completion.
#[derive(Debug, Clone)]
pub struct Region {
    pub(crate) inner: Arc<RegionInner>,
}

/// Aligned to 128 bytes so that the reference count in front of it, which the application
/// writes for every small transfer it makes, does not share a cache line with the fields the
/// engines read for every message they copy.
#[derive(Debug)]
#[repr(align(128))]
pub(crate) struct RegionInner {
    pub(crate) id: u64,
    pub(crate) memory: SharedMemory,
    /// The GPU of a CUDA region allocated or registered through the endpoint.
    pub(crate) cuda: Option<tcpx::cuda::CudaDevice>,
    /// True when the plugin takes host memory only: transfers of this region are staged
    /// through the engines' pinned rings instead of handed to the plugin.
    pub(crate) staged: bool,
    /// The GPU's small copier, for CUDA memory that small one-sided operations carry inline
    /// (found on first use: [`Region::small_copier`]).
    small_copier: std::sync::OnceLock<Arc<tcpx::cuda::SmallCopier>>,
    /// The caches (one per connection link) holding registrations of this region.
    caches: Mutex<Vec<Weak<RegistrationCache>>>,
}

impl Region {
    /// Whether both handles name the same region.
    pub(crate) fn same(&self, other: &Region) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    pub(crate) fn new(memory: SharedMemory) -> Self {
        Self::with_cuda(memory, None, false)
    }

    /// A CUDA region on `device`; `staged` when the plugin cannot take CUDA pointers.
    pub(crate) fn with_cuda(
        memory: SharedMemory,
        cuda: Option<tcpx::cuda::CudaDevice>,
        staged: bool,
    ) -> Self {
        Self {
            inner: Arc::new(RegionInner {
                id: NEXT_REGION_ID.fetch_add(1, Ordering::Relaxed),
                memory,
                cuda,
                staged,
                small_copier: std::sync::OnceLock::new(),
                caches: Mutex::new(Vec::new()),
            }),
        }
    }

    /// Where the memory lives (host or CUDA device memory).
    pub fn kind(&self) -> tcpx::MemoryKind {
        self.inner.memory.kind()
    }

    /// The GPU holding a CUDA region made by [`crate::Endpoint::alloc_cuda`] or
    /// [`crate::Endpoint::register_cuda`].
    pub fn cuda_device(&self) -> Option<&tcpx::cuda::CudaDevice> {
        self.inner.cuda.as_ref()
    }

    /// The process's small copier for this CUDA region's GPU (the endpoint's, or the one the
    /// pointer lives on for memory registered as plain [`SharedMemory`]); found once, then
    /// kept with the region so that an inline operation takes no process-wide lock.
    pub(crate) fn small_copier(&self) -> tcpx::Result<&Arc<tcpx::cuda::SmallCopier>> {
        if let Some(copier) = self.inner.small_copier.get() {
            return Ok(copier);
        }
        let ordinal = match &self.inner.cuda {
            Some(device) => device.ordinal(),
            None => tcpx::cuda::pointer_device(self.inner.memory.as_ptr()).ok_or_else(|| {
                tcpx::Error::new(
                    "Region::small_copier",
                    tcpx::ErrorKind::InvalidArgument("not CUDA device memory".into()),
                    "",
                )
            })?,
        };
        let copier = tcpx::cuda::SmallCopier::for_ordinal(ordinal)?;
        Ok(self.inner.small_copier.get_or_init(|| copier))
    }

    /// Whether small copies out of or into this region and `other` are made by one call: host
    /// memory of one region (one operation on it), or CUDA memory of one GPU whatever the
    /// regions (one copy list of its [`tcpx::cuda::SmallCopier`]: a GPU round trip costs 6–8 µs
    /// on an H200 VM whatever the size, and applications that register a buffer per tensor or
    /// per message would otherwise pay one per piece). Used by eager frames and inline
    /// one-sided operations to cut their pieces into runs.
    pub(crate) fn copied_with(&self, other: &Region) -> bool {
        match (self.kind(), other.kind()) {
            (tcpx::MemoryKind::Host, tcpx::MemoryKind::Host) => self.same(other),
            (tcpx::MemoryKind::Cuda, tcpx::MemoryKind::Cuda) => {
                match (self.small_copier(), other.small_copier()) {
                    (Ok(x), Ok(y)) => Arc::ptr_eq(x, y),
                    _ => false,
                }
            }
            _ => false,
        }
    }

    /// True when transfers of this region are staged through pinned host memory (a CUDA
    /// region on a plugin that takes host memory only).
    pub fn is_staged(&self) -> bool {
        self.inner.staged
    }

    /// The memory.
    pub fn memory(&self) -> &SharedMemory {
        &self.inner.memory
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.memory.len()
    }

    /// True for an empty region.
    pub fn is_empty(&self) -> bool {
        self.inner.memory.is_empty()
    }

    /// Copies `bytes` into the region at `offset` (host or CUDA memory) and waits for it.
    /// Fails while a transfer is in flight on host memory; for CUDA memory, do not call it
    /// while a transfer on the same bytes is in flight (the GPU does not order the two).
    pub fn write(&self, offset: usize, bytes: &[u8]) -> crate::Result<()> {
        let err = |e: tcpx::Error| crate::Error::InvalidArgument(format!("Region::write: {e}"));
        let memory = &self.inner.memory;
        memory
            .check_range("Region::write", offset, bytes.len())
            .map_err(err)?;
        match &self.inner.cuda {
            Some(device) if memory.kind() == tcpx::MemoryKind::Cuda => {
                if bytes.is_empty() {
                    return Ok(());
                }
                // Through a host bounce: the device copy API takes shared memories.
                let host = SharedMemory::host(bytes.len()).map_err(err)?;
                host.with_bytes_mut(|b| b.copy_from_slice(bytes))
                    .map_err(err)?;
                device
                    .copy(memory, offset, &host, 0, bytes.len())
                    .map_err(err)
            }
            _ => memory
                .with_bytes_mut(|b| b[offset..offset + bytes.len()].copy_from_slice(bytes))
                .map_err(err),
        }
    }

    /// Copies `out.len()` bytes of the region from `offset` into `out` (host or CUDA
    /// memory), waiting for the copy. Read after the transfer that wrote them completed.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> crate::Result<()> {
        let err = |e: tcpx::Error| crate::Error::InvalidArgument(format!("Region::read: {e}"));
        let memory = &self.inner.memory;
        memory
            .check_range("Region::read", offset, out.len())
            .map_err(err)?;
        match &self.inner.cuda {
            Some(device) if memory.kind() == tcpx::MemoryKind::Cuda => {
                if out.is_empty() {
                    return Ok(());
                }
                let host = SharedMemory::host(out.len()).map_err(err)?;
                device
                    .copy(&host, 0, memory, offset, out.len())
                    .map_err(err)?;
                host.with_bytes(|b| out.copy_from_slice(b)).map_err(err)
            }
            _ => memory
                .with_bytes(|b| out.copy_from_slice(&b[offset..offset + out.len()]))
                .map_err(err),
        }
    }

    /// Notes that `cache` holds registrations of this region, so that dropping the region
    /// drops them there.
    pub(crate) fn note_cache(&self, cache: &Arc<RegistrationCache>) {
        let mut caches = self.inner.caches.lock().unwrap_or_else(|p| p.into_inner());
        caches.retain(|w| w.strong_count() > 0);
        if !caches
            .iter()
            .any(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(cache)))
        {
            caches.push(Arc::downgrade(cache));
        }
    }
}

/// One piece of a vectored transfer: `len` bytes at `offset` in `region`.
#[derive(Debug, Clone, Copy)]
pub struct Segment<'a> {
    /// The registered memory.
    pub region: &'a Region,
    /// Offset in the region.
    pub offset: usize,
    /// Bytes.
    pub len: usize,
}

impl<'a> Segment<'a> {
    /// `len` bytes at `offset` in `region`.
    pub fn new(region: &'a Region, offset: usize, len: usize) -> Self {
        Self {
            region,
            offset,
            len,
        }
    }

    /// `Err` names the segment (`what`, e.g. "segment 3") when it does not lie inside its
    /// region.
    pub(crate) fn check_inside(&self, what: impl std::fmt::Display) -> crate::Result<()> {
        if self
            .offset
            .checked_add(self.len)
            .is_none_or(|end| end > self.region.len())
        {
            return Err(crate::Error::InvalidArgument(format!(
                "{what}: {} bytes at offset {} lie outside a region of {} bytes",
                self.len,
                self.offset,
                self.region.len()
            )));
        }
        Ok(())
    }
}

impl Drop for RegionInner {
    fn drop(&mut self) {
        let caches = std::mem::take(self.caches.get_mut().unwrap_or_else(|p| p.into_inner()));
        for cache in caches.iter().filter_map(Weak::upgrade) {
            cache.forget(self.id);
        }
    }
}

/// The registrations of application regions on one link's comms, by (region id, direction).
///
/// The link owns it; regions point back at it weakly ([`Region::note_cache`]) so that either
/// side going away releases the entries.
///
/// Every transfer looks its regions up here, so the map hashes with FxHash: the keys are
/// sequential region ids from this process, and SipHash's protection against chosen keys
/// cost as much as the rest of the lookup.
#[derive(Debug, Default)]
pub(crate) struct RegistrationCache {
    entries: Mutex<Entries>,
}

/// Registrations by (region id, direction).
type Entries = FxHashMap<(u64, Direction), Arc<Registration>>;

impl RegistrationCache {
    fn entries(&self) -> std::sync::MutexGuard<'_, Entries> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The cached registration of `region` in `direction`, if any.
    pub(crate) fn get(&self, region: &Region, direction: Direction) -> Option<Arc<Registration>> {
        self.entries().get(&(region.inner.id, direction)).cloned()
    }

    /// Caches `registration` unless another thread cached one first; returns the cached one.
    pub(crate) fn insert(
        self: &Arc<Self>,
        region: &Region,
        direction: Direction,
        registration: Registration,
    ) -> Arc<Registration> {
        let cached = self
            .entries()
            .entry((region.inner.id, direction))
            .or_insert_with(|| Arc::new(registration))
            .clone();
        region.note_cache(self);
        cached
    }

    /// Drops the registrations of region `id` (the region was dropped).
    fn forget(&self, id: u64) {
        let removed: Vec<_> = {
            let mut entries = self.entries();
            [Direction::Send, Direction::Recv]
                .into_iter()
                .filter_map(|d| entries.remove(&(id, d)))
                .collect()
        };
        // Deregistration happens here, outside the lock.
        drop(removed);
    }

    /// Drops every registration (the link closed); deregistration happens outside the lock.
    pub(crate) fn clear(&self) {
        let all = std::mem::take(&mut *self.entries());
        drop(all);
    }
}

/// Counts live plugin registrations of one endpoint (tests check nothing leaks).
#[derive(Debug, Clone, Default)]
pub(crate) struct RegistrationCounter(Arc<AtomicUsize>);

impl RegistrationCounter {
    pub(crate) fn get(&self) -> usize {
        self.0.load(Ordering::Acquire)
    }
}

/// One plugin registration, counted while alive; deregistered (by the safe layer) on drop.
pub(crate) struct CountedRegion {
    pub(crate) region: MemoryRegion,
    counter: RegistrationCounter,
}

impl CountedRegion {
    pub(crate) fn new(region: MemoryRegion, counter: &RegistrationCounter) -> Self {
        counter.0.fetch_add(1, Ordering::AcqRel);
        Self {
            region,
            counter: counter.clone(),
        }
    }
}

impl Drop for CountedRegion {
    fn drop(&mut self) {
        self.counter.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl std::fmt::Debug for CountedRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.region.fmt(f)
    }
}

/// A region's registrations on one connection in one direction: one per channel, indexed by
/// channel.
#[derive(Debug)]
pub(crate) struct Registration {
    pub(crate) by_channel: Vec<CountedRegion>,
}
