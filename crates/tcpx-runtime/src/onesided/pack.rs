//! Packing small scattered blocks: a one-sided batch of many small host-memory blocks travels
//! as one contiguous transfer through pack buffers, instead of one plugin request per block.
//!
//! - The data sender decides ([`worth_packing`], [`crate::Config::pack_below`]) and its
//!   engines gather the blocks into a pack buffer, chunk by chunk, as they send; the flag travels in its marker (`WriteRequest`
//!   for writes; for reads the initiator *offers* in `ReadRequest` and the target decides in
//!   `ReadData`), so both sides derive the same contiguous schedule ([`packed_schedule`]).
//! - Each side copies only if its own list is scattered: a side whose list is one run
//!   already sends from / receives into it in place (the wire only needs both sides to cut
//!   the total alike), so a contiguous staging buffer against scattered KV blocks costs one
//!   copy, not two. Which side copies is local; only the flag travels.
//! - The data receiver receives into a pack buffer, and its engines scatter each chunk into
//!   the blocks once it is in, before the chunk counts as done: the receive job completes
//!   with every byte in place, before the write is acknowledged or its notification
//!   delivered. A refused write's data lands in the pack buffer and is simply
//!   not scattered (the contiguous schedule is the same either way: the lanes stay in step).
//! - Pack buffers ([`PACK_BYTES`] each) come from a per-connection pool, allocated on first
//!   use up to [`crate::Config::pack_buffers`] and registered once per direction on the RMA
//!   link (the registration is cached on the link by region). A sender finding the pool
//!   empty falls back to the unpacked transfer (counted in [`PackStats::fallbacks`]); a
//!   receiver must follow the sender, so it allocates a one-off buffer past the pool
//!   ([`PackStats::overflows`]), bounded by what the peer's own pool lets it send.
//! - A buffer goes back to the pool only once the job using it finished: a sender's lease is
//!   held next to its job ([`PackPool::hold`]) and reclaimed when the job is done; a lease of
//!   a job that may still run (the connection failed) is poisoned and never reused.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use tcpx::SharedMemory;

use crate::link::Link;

use crate::engine::job::{HostParts, Job};
use crate::error::{Error, Result};
use crate::registry::Region;
use crate::schedule::Schedule;

/// Bytes of one pack buffer, and the most a packed transfer may carry (both sides know it:
/// a packed request past it is a protocol violation). 1024 blocks of 4 KiB fit.
pub const PACK_BYTES: u64 = 4 << 20;

/// Whether a data sender packs a batch of `total` bytes cut into `runs` pieces (the larger
/// of both sides' merged run counts, which sets the number of plugin requests unpacked):
/// packing is on, there is more than one run, the batch is at most `cap` bytes, and the
/// average run is smaller than `pack_below`. `cap` is [`PACK_BYTES`] when a side copies
/// through a pack buffer (host memory); a staged side gathers and scatters per chunk through
/// its ring slots and needs none ([`PackSide`]).
pub(crate) fn worth_packing(total: u64, runs: usize, pack_below: u32, cap: u64) -> bool {
    pack_below > 0
        && runs > 1
        && total > 0
        && total <= cap
        && total / (runs as u64) < u64::from(pack_below)
}

/// How one side of a batch takes part in packing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PackSide {
    /// Unstaged host memory: a scattered list is copied through a pack buffer, so the batch
    /// fits one ([`PACK_BYTES`]).
    Host,
    /// Staged memory (CUDA memory on a host-only plugin, or its emulation): each chunk of the
    /// contiguous stream is gathered into its ring slot (send) or scattered out of it
    /// (receive) by the lane, one copy per chunk, with no pack buffer and no size cap.
    Staged,
}

impl PackSide {
    /// The largest batch both sides can pack.
    pub(crate) fn cap(a: PackSide, b: PackSide) -> u64 {
        if a == PackSide::Host || b == PackSide::Host {
            PACK_BYTES
        } else {
            u64::MAX
        }
    }
}

/// The schedule of a packed transfer of `total` bytes: the same on both sides (one contiguous
/// segment each), rotated by the operation id like every one-sided schedule.
pub(crate) fn packed_schedule(
    total: u64,
    link: &Link,
    op_id: u64,
    spread: bool,
) -> std::result::Result<Schedule, crate::schedule::ScheduleError> {
    link.schedule(&[total], &[total], spread)
        .map(|s| s.rotated(op_id))
}

/// Packing counters of one connection (both roles), from [`crate::Connection::pack_stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PackStats {
    /// Packed transfers this side sent (writes it initiated, reads it served).
    pub packed_sent: u64,
    /// Packed transfers this side received and scattered (writes it served, reads it
    /// initiated; refused writes included, though not scattered).
    pub packed_received: u64,
    /// Batches worth packing sent unpacked because every pooled buffer was in use.
    pub fallbacks: u64,
    /// One-off buffers a receiver allocated past its pool to follow a packing sender.
    pub overflows: u64,
    /// Pooled buffers allocated so far (at most [`crate::Config::pack_buffers`] alive).
    pub buffers: u64,
}

#[derive(Default)]
struct Counters {
    packed_sent: AtomicU64,
    packed_received: AtomicU64,
    fallbacks: AtomicU64,
    overflows: AtomicU64,
    buffers: AtomicU64,
}

struct PoolInner {
    free: Mutex<Vec<Region>>,
    /// Returned buffers whose last request the engines had not yet retired when the job's
    /// completion was seen (the engine finishes a job before it drops the request's hold on
    /// the memory): free again once idle. Dropping them instead made the pool allocate, and
    /// fault in, a fresh 4 MiB buffer for about every other batch.
    cooling: Mutex<Vec<Region>>,
    /// Pooled buffers alive (free or leased).
    pooled: AtomicUsize,
}

/// Longest a taker waits for a cooling buffer to go idle before it allocates a one-off one.
const COOLING_WAIT: std::time::Duration = std::time::Duration::from_millis(2);

/// Most pack buffers the process keeps from closed connections for later ones (64 MiB).
const SPARE_BUFFERS: usize = 16;

/// Pack buffer memory of closed connections, its pages already touched: a new connection's
/// first packed batch takes it instead of faulting in 4 MiB of fresh pages (about 1 ms), so
/// re-created connections (agents re-made under the same names, say) do not pay again.
static SPARE: Mutex<Vec<SharedMemory>> = Mutex::new(Vec::new());

impl PoolInner {
    /// Moves cooling buffers that went idle to the free list.
    fn warm_up_cooled(&self) {
        let mut cooling = self.cooling.lock().unwrap_or_else(|p| p.into_inner());
        if cooling.is_empty() {
            return;
        }
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        cooling.retain(|region| {
            let idle = region.memory().in_flight() == 0;
            if idle {
                free.push(region.clone());
            }
            !idle
        });
    }
}

impl Drop for PoolInner {
    fn drop(&mut self) {
        let mut free = std::mem::take(self.free.get_mut().unwrap_or_else(|p| p.into_inner()));
        free.append(self.cooling.get_mut().unwrap_or_else(|p| p.into_inner()));
        let mut spare = SPARE.lock().unwrap_or_else(|p| p.into_inner());
        for region in free {
            // Idle (nothing in flight) and no longer the pool's: the next connection may have
            // it. Its old registrations, if any, are released with their link.
            if spare.len() < SPARE_BUFFERS && region.memory().in_flight() == 0 {
                spare.push(region.memory().clone());
            }
        }
    }
}

/// One connection's pack buffers (see the module docs).
pub(crate) struct PackPool {
    cap: usize,
    inner: Arc<PoolInner>,
    /// Senders' leases waiting for their job to finish.
    held: Mutex<Vec<(Arc<Job>, PackLease)>>,
    counters: Counters,
}

/// A pack buffer in use; back to the pool on drop (unless poisoned or one-off).
pub(crate) struct PackLease {
    region: Region,
    pool: Option<Weak<PoolInner>>,
    poisoned: bool,
}

impl PackLease {
    /// The buffer.
    pub(crate) fn region(&self) -> &Region {
        &self.region
    }

    /// Never reuse this buffer: a job that may still post on it is not known to be done.
    pub(crate) fn poison(mut self) {
        self.poisoned = true;
    }
}

impl Drop for PackLease {
    fn drop(&mut self) {
        let Some(pool) = self.pool.take().and_then(|w| w.upgrade()) else {
            return;
        };
        if self.poisoned {
            pool.pooled.fetch_sub(1, Ordering::AcqRel);
            return;
        }
        // A buffer with a request still in flight is never reused before it is idle.
        if self.region.memory().in_flight() > 0 {
            pool.cooling
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(self.region.clone());
            return;
        }
        pool.free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(self.region.clone());
    }
}

impl PackPool {
    /// An empty pool of at most `cap` buffers.
    pub(crate) fn new(cap: usize) -> Self {
        Self {
            cap,
            inner: Arc::new(PoolInner {
                free: Mutex::new(Vec::new()),
                cooling: Mutex::new(Vec::new()),
                pooled: AtomicUsize::new(0),
            }),
            held: Mutex::new(Vec::new()),
            counters: Counters::default(),
        }
    }

    fn held(&self) -> MutexGuard<'_, Vec<(Arc<Job>, PackLease)>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps `lease` until `job` (which sends from it) finished.
    pub(crate) fn hold(&self, job: Arc<Job>, lease: PackLease) {
        self.held().push((job, lease));
    }

    /// Returns the leases of finished jobs to the pool.
    pub(crate) fn reclaim(&self) {
        let done: Vec<PackLease> = {
            let mut held = self.held();
            let mut done = Vec::new();
            let mut i = 0;
            while i < held.len() {
                if held[i].0.is_finished() {
                    done.push(held.swap_remove(i).1);
                } else {
                    i += 1;
                }
            }
            done
        };
        drop(done);
    }

    /// A pooled buffer: a free one, or a new one while fewer than the cap are alive.
    fn pooled(&self) -> Result<Option<PackLease>> {
        self.reclaim();
        self.inner.warm_up_cooled();
        let reused = self
            .inner
            .free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop();
        if let Some(region) = reused {
            return Ok(Some(self.lease(region, true)));
        }
        let grown = self
            .inner
            .pooled
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.cap).then_some(n + 1)
            })
            .is_ok();
        if !grown {
            return Ok(None);
        }
        match allocate() {
            Ok(region) => {
                self.counters.buffers.fetch_add(1, Ordering::Relaxed);
                Ok(Some(self.lease(region, true)))
            }
            Err(e) => {
                self.inner.pooled.fetch_sub(1, Ordering::AcqRel);
                Err(e)
            }
        }
    }

    fn lease(&self, region: Region, pooled: bool) -> PackLease {
        PackLease {
            region,
            pool: pooled.then(|| Arc::downgrade(&self.inner)),
            poisoned: false,
        }
    }

    /// A buffer for a data sender (or a read initiator offering to receive packed), or
    /// `None` when every pooled buffer is in use: the caller goes unpacked.
    pub(crate) fn for_sender(&self) -> Result<Option<PackLease>> {
        let lease = self.pooled()?;
        if lease.is_none() {
            self.counters.fallbacks.fetch_add(1, Ordering::Relaxed);
        }
        Ok(lease)
    }

    /// A buffer for a receiver that must follow a packing sender: pooled if one is free or
    /// the pool may grow, else a one-off buffer dropped after use.
    pub(crate) fn for_receiver(&self) -> Result<PackLease> {
        // A cooling buffer is idle within microseconds (its job is done; the engine only has
        // to retire the request): waiting that long beats allocating and registering a
        // one-off 4 MiB buffer, which a stream of batches would otherwise do every time.
        let deadline = std::time::Instant::now() + COOLING_WAIT;
        loop {
            if let Some(lease) = self.pooled()? {
                return Ok(lease);
            }
            let cooling = !self
                .inner
                .cooling
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_empty();
            if !cooling || std::time::Instant::now() >= deadline {
                break;
            }
            std::thread::yield_now();
        }
        self.counters.overflows.fetch_add(1, Ordering::Relaxed);
        Ok(self.lease(allocate()?, false))
    }

    /// Grows the pool to `count` buffers (at most its cap) now, handing each new one to
    /// `prepare` (its registrations), so that the first batches pay nothing. Returns the
    /// buffers the pool holds.
    pub(crate) fn reserve(
        &self,
        count: usize,
        mut prepare: impl FnMut(&Region) -> Result<()>,
    ) -> Result<usize> {
        let mut made = Vec::new();
        while self.inner.pooled.load(Ordering::Acquire) < count.min(self.cap) {
            let Some(lease) = self.pooled()? else { break };
            made.push(lease);
        }
        let result = made.iter().try_for_each(|lease| prepare(lease.region()));
        // Back to the free list (the leases' drop), prepared or not.
        drop(made);
        result.map(|()| self.inner.pooled.load(Ordering::Acquire))
    }

    /// Counts a packed transfer sent.
    pub(crate) fn count_sent(&self) {
        self.counters.packed_sent.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a packed transfer received.
    pub(crate) fn count_received(&self) {
        self.counters
            .packed_received
            .fetch_add(1, Ordering::Relaxed);
    }

    /// The counters.
    pub(crate) fn stats(&self) -> PackStats {
        let c = &self.counters;
        PackStats {
            packed_sent: c.packed_sent.load(Ordering::Relaxed),
            packed_received: c.packed_received.load(Ordering::Relaxed),
            fallbacks: c.fallbacks.load(Ordering::Relaxed),
            overflows: c.overflows.load(Ordering::Relaxed),
            buffers: c.buffers.load(Ordering::Relaxed),
        }
    }
}

fn allocate() -> Result<Region> {
    if let Some(memory) = SPARE.lock().unwrap_or_else(|p| p.into_inner()).pop() {
        return Ok(Region::new(memory));
    }
    // PACK_BYTES is 4 MiB: it fits a usize.
    let memory = SharedMemory::host(PACK_BYTES as usize)
        .map_err(|e| Error::Internal(format!("cannot allocate a pack buffer: {e}")))?;
    Ok(Region::new(memory))
}

/// One block of a packed batch on this side: `len` bytes at `offset` in `region`.
pub(crate) struct Part {
    pub(crate) region: Region,
    pub(crate) offset: u64,
    pub(crate) len: u64,
}

/// The engines' copy list of a packed host list (see [`HostParts`]): `parts` were checked
/// against their regions at submission, so a refusal here is a bug.
pub(crate) fn host_parts(parts: &[Part]) -> Result<HostParts> {
    tcpx::PackedRanges::new(
        parts
            .iter()
            .map(|p| (p.region.memory(), p.offset as usize, p.len as usize)),
    )
    .map(HostParts::new)
    .map_err(|e| Error::Internal(format!("packing a list of {} blocks: {e}", parts.len())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rule_packs_small_blocks_only() {
        assert!(worth_packing(4 << 20, 1024, 64 << 10, PACK_BYTES));
        assert!(
            !worth_packing(4 << 20, 1, 64 << 10, PACK_BYTES),
            "one run is contiguous already"
        );
        assert!(
            !worth_packing(4 << 20, 1024, 0, PACK_BYTES),
            "0 turns packing off"
        );
        assert!(
            !worth_packing(8 << 20, 64, 64 << 10, PACK_BYTES),
            "128 KiB blocks stay unpacked"
        );
        assert!(
            !worth_packing(PACK_BYTES + 1, 1 << 20, 64 << 10, PACK_BYTES),
            "past a pack buffer"
        );
    }

    #[test]
    fn staged_sides_pack_past_a_pack_buffer() {
        use PackSide::{Host, Staged};
        let cap = PackSide::cap(Staged, Staged);
        // A KV list of 1024 × 16 KiB GPU blocks: packed, though 4 × a pack buffer.
        assert!(worth_packing(16 << 20, 1024, 64 << 10, cap));
        assert!(
            !worth_packing(16 << 20, 64, 64 << 10, cap),
            "256 KiB blocks"
        );
        for (a, b) in [(Host, Staged), (Staged, Host), (Host, Host)] {
            assert_eq!(PackSide::cap(a, b), PACK_BYTES, "{a:?} / {b:?}");
            assert!(!worth_packing(
                16 << 20,
                1024,
                64 << 10,
                PackSide::cap(a, b)
            ));
        }
    }

    #[test]
    fn a_full_pool_says_so_and_refills_on_drop() {
        let pool = PackPool::new(1);
        let a = pool.for_sender().unwrap().expect("first buffer");
        assert!(pool.for_sender().unwrap().is_none());
        let overflow = pool.for_receiver().unwrap();
        drop(overflow);
        drop(a);
        let again = pool.for_sender().unwrap().expect("returned buffer");
        again.poison();
        let fresh = pool
            .for_sender()
            .unwrap()
            .expect("a poisoned buffer frees its slot");
        drop(fresh);
        let s = pool.stats();
        assert_eq!((s.fallbacks, s.overflows, s.buffers), (1, 1, 2));
    }
}
