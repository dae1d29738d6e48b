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

use tcpx::{MemoryRegion, SharedMemory};

use crate::link::Link;

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

#[derive(Debug)]
pub(crate) struct RegionInner {
    pub(crate) id: u64,
    pub(crate) memory: SharedMemory,
    /// Connections holding registrations of this region.
    links: Mutex<Vec<Weak<Link>>>,
}

impl Region {
    pub(crate) fn new(memory: SharedMemory) -> Self {
        Self {
            inner: Arc::new(RegionInner {
                id: NEXT_REGION_ID.fetch_add(1, Ordering::Relaxed),
                memory,
                links: Mutex::new(Vec::new()),
            }),
        }
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

    /// Notes that `link` caches registrations of this region.
    pub(crate) fn note_link(&self, link: &Arc<Link>) {
        let mut links = self.inner.links.lock().unwrap_or_else(|p| p.into_inner());
        links.retain(|w| w.strong_count() > 0);
        if !links
            .iter()
            .any(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(link)))
        {
            links.push(Arc::downgrade(link));
        }
    }
}

impl Drop for RegionInner {
    fn drop(&mut self) {
        let links = std::mem::take(self.links.get_mut().unwrap_or_else(|p| p.into_inner()));
        for link in links.iter().filter_map(Weak::upgrade) {
            link.forget_region(self.id);
        }
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
