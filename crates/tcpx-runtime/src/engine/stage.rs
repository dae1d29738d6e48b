//! The staged path of one lane: CUDA memory moved through a host-only plugin by way of a
//! pinned host ring (docs/ARCHITECTURE.md, data path step 5).
//!
//! A lane gets its [`LaneStage`] once: when the connection is set up or CUDA memory is
//! registered on it (the endpoint has a GPU: [`crate::carrier::Carrier::prepare_staging`]), or
//! else when the first staged transfer reaches it. The ring (pinned memory, a stream, an event
//! per slot, the gather kernel) is taken from the process's [`RingPool`] or allocated, and
//! registered on the lane's comm; every later staged transfer reuses it. Slots are handed out
//! and taken back in FIFO order, which is also the order in which requests complete and are
//! consumed on a comm, so slot `k mod slots` is free whenever fewer than `slots` are in use.
//!
//! * Send lane: ring of `2 × window` slots. Each staged chunk gets a slot and a device → slot
//!   copy at once (up to the ring's room: a window's worth of copies runs ahead of the
//!   window's sends), waits until its event is seen done, is then posted from the slot, and
//!   frees the slot when `test` reports the send done. A chunk of a packed transfer covers
//!   many small blocks: they are gathered into the slot in one kernel launch.
//! * Receive lane: ring of `window` slots, one per window slot. Each staged chunk is received
//!   into a slot; once `test` says done, slot → device is queued (a scatter launch for a
//!   packed chunk); once that copy's event is seen done, the receive is consumed
//!   (`irecvConsumed`) and the slot freed.
//!
//! Which slot a chunk gets and when it is free again is the lane core's bookkeeping
//! ([`super::lane`], with [`SlotFifo`]); this holds the ring itself. Nothing here allocates,
//! locks or synchronizes per chunk: slots are counters, and copies are only polled
//! (`cuEventQuery`).
//!
//! # Why rings are made ahead and pooled
//! A ring is megabytes of pinned memory (`cuMemHostAlloc` pins and maps every page: tens of
//! milliseconds for the rings of one connection) plus a stream, events and the kernel.
//! Made on a lane's first staged transfer, that cost landed on the first transfers of every
//! channel of every new connection (the first 3–4 transfers of a new NIXL agent pair took
//! 10–18 ms each). So rings are made when the connection starts (or its endpoint's first CUDA
//! memory is registered), and a closed connection's rings go back to a process-wide pool
//! ([`RingPool`], at most [`POOL_IDLE_BYTES`] idle) from which the next connection's lanes
//! take them: re-creating agents or endpoints pays the pinning once per process.

use std::sync::Mutex;

use tcpx::cuda::{CudaDevice, StagingRing};
use tcpx::{MemoryRegion, SharedMemory};

/// Most bytes of pinned rings the process keeps idle for later lanes (beyond, a returned
/// ring is freed). A connection's rings at the defaults (4 channels, 512 KiB chunks, windows
/// of 16, both halves) are 192 MiB per side.
pub(crate) const POOL_IDLE_BYTES: usize = 1 << 30;

/// Pinned rings of closed lanes, kept for new lanes with as many slots and a chunk their slots
/// hold (see the module docs and [`pick`]).
pub(crate) struct RingPool {
    idle: Mutex<Vec<StagingRing>>,
}

/// The process's pool.
static POOL: RingPool = RingPool {
    idle: Mutex::new(Vec::new()),
};

impl RingPool {
    /// The process's pool.
    pub(crate) fn global() -> &'static RingPool {
        &POOL
    }

    fn idle(&self) -> std::sync::MutexGuard<'_, Vec<StagingRing>> {
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// An idle ring on `device` for a lane that wants `slots` × `slot_bytes`, if any (see
    /// [`pick`]).
    fn take(&self, device: &CudaDevice, slots: usize, slot_bytes: usize) -> Option<StagingRing> {
        let mut idle = self.idle();
        let at = pick(
            idle.iter().map(|r| RingShape::of(r, device)),
            slots,
            slot_bytes,
        )?;
        Some(idle.swap_remove(at))
    }

    /// A ring of `slots` × `slot_bytes` on `device`: an idle one, else a new one.
    pub(crate) fn ring(
        &self,
        device: &CudaDevice,
        slots: usize,
        slot_bytes: usize,
    ) -> tcpx::Result<StagingRing> {
        match self.take(device, slots, slot_bytes) {
            Some(ring) => Ok(ring),
            None => StagingRing::new(device, slots, slot_bytes),
        }
    }

    /// Takes `ring` back for later lanes, once it is idle and healthy, while the pool holds
    /// less than [`POOL_IDLE_BYTES`]; frees it otherwise. Emulated rings (plain host memory,
    /// cheap) are simply dropped.
    pub(crate) fn give(&self, mut ring: StagingRing) {
        // A request abandoned on a failed link keeps its slot in flight until its comm closes
        // (the plugin may still write it): such a ring is never handed to another lane (it is
        // freed once the comm lets go of it).
        if ring.device().is_none() || ring.memory().in_flight() > 0 {
            return;
        }
        if let Err(e) = ring.recycle() {
            tracing::warn!(target: "tcpx_runtime", error = %e, "staging ring not reused");
            return;
        }
        let mut idle = self.idle();
        let held: usize = idle.iter().map(ring_bytes).sum();
        if held + ring_bytes(&ring) <= POOL_IDLE_BYTES {
            idle.push(ring);
        }
    }

    /// Makes sure `count` idle rings of `slots` × `slot_bytes` on `device` are in the pool
    /// (within [`POOL_IDLE_BYTES`]), allocating what is missing: pays the pinning now (when
    /// CUDA memory is registered) rather than on a lane's first transfer.
    pub(crate) fn reserve(
        &self,
        device: &CudaDevice,
        slots: usize,
        slot_bytes: usize,
        count: usize,
    ) -> tcpx::Result<()> {
        let have = self
            .idle()
            .iter()
            .filter(|r| fits(r, device, slots, slot_bytes))
            .count();
        for _ in have..count {
            // Allocated outside the lock: pinning takes milliseconds.
            let ring = StagingRing::new(device, slots, slot_bytes)?;
            let mut idle = self.idle();
            let held: usize = idle.iter().map(ring_bytes).sum();
            if held + ring_bytes(&ring) > POOL_IDLE_BYTES {
                break;
            }
            idle.push(ring);
        }
        Ok(())
    }
}

/// Whether `ring` has exactly the shape [`RingPool::reserve`] makes.
fn fits(ring: &StagingRing, device: &CudaDevice, slots: usize, slot_bytes: usize) -> bool {
    let shape = RingShape::of(ring, device);
    shape.same_device && shape.slots == slots && shape.slot_bytes == aligned(slot_bytes)
}

/// `slot_bytes` rounded up as [`StagingRing`] rounds its slots.
fn aligned(slot_bytes: usize) -> usize {
    slot_bytes.div_ceil(tcpx::BUFFER_ALIGN) * tcpx::BUFFER_ALIGN
}

/// What [`pick`] needs to know of an idle ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RingShape {
    same_device: bool,
    slots: usize,
    slot_bytes: usize,
}

impl RingShape {
    fn of(ring: &StagingRing, device: &CudaDevice) -> Self {
        Self {
            same_device: ring.device().map(CudaDevice::ordinal) == Some(device.ordinal()),
            slots: ring.slots(),
            slot_bytes: ring.slot_bytes(),
        }
    }
}

/// Which of the idle rings `shapes` a lane wanting `slots` × `slot_bytes` takes: one of
/// exactly that shape, else the one of that many slots whose slots are the smallest that
/// hold `slot_bytes`. A lane fills a slot only up to its chunk, so larger slots serve; and
/// rings are reserved when CUDA memory is registered, at the endpoint's own chunk size, while
/// a connection to a peer with a smaller chunk agrees on the smaller one (see
/// `Link::chunk_bytes`): without this, its lanes pinned rings of their own and left the
/// reserved ones idle.
fn pick(shapes: impl Iterator<Item = RingShape>, slots: usize, slot_bytes: usize) -> Option<usize> {
    let want = aligned(slot_bytes);
    shapes
        .enumerate()
        .filter(|(_, s)| s.same_device && s.slots == slots && s.slot_bytes >= want)
        .min_by_key(|(_, s)| s.slot_bytes)
        .map(|(at, _)| at)
}

fn ring_bytes(ring: &StagingRing) -> usize {
    ring.slots() * ring.slot_bytes()
}

/// Where a staged transfer's copies run.
#[derive(Debug, Clone)]
pub(crate) enum Staging {
    /// CUDA memory on this GPU: copies on the GPU's copy engines.
    Cuda(CudaDevice),
    /// Host memory sent through the staged path with CPU copies standing in for the GPU's
    /// ([`crate::Endpoint::register_staged_emulation`]: tests of the staged logic without a
    /// GPU).
    Emulated,
}

impl Staging {
    /// The GPU's ordinal, `None` in emulation (a lane's ring serves one kind only).
    pub(crate) fn ordinal(&self) -> Option<usize> {
        match self {
            Staging::Cuda(device) => Some(device.ordinal()),
            Staging::Emulated => None,
        }
    }
}

/// A lane's pinned ring and its registration on the lane's comm.
pub(crate) struct LaneStage {
    pub(crate) ring: StagingRing,
    /// The ring registered on the lane's comm (posts name it).
    pub(crate) region: MemoryRegion,
}

/// FIFO slot accounting of a ring of `count` slots (sans-IO): slots are handed out as
/// `0, 1, …, count-1, 0, …` and released oldest first.
#[derive(Debug, Clone)]
pub(crate) struct SlotFifo {
    count: usize,
    /// Slots handed out so far (the next one is `next mod count`).
    next: u64,
    /// Slots in use.
    used: usize,
}

impl SlotFifo {
    pub(crate) fn new(count: usize) -> Self {
        Self {
            count: count.max(1),
            next: 0,
            used: 0,
        }
    }

    /// A slot is free.
    #[inline]
    pub(crate) fn has_room(&self) -> bool {
        self.used < self.count
    }

    /// The slot [`Self::take`] would hand out.
    #[inline]
    pub(crate) fn peek(&self) -> usize {
        (self.next % self.count as u64) as usize
    }

    /// Hands out the next slot; `None` when all are in use.
    #[inline]
    pub(crate) fn take(&mut self) -> Option<usize> {
        if !self.has_room() {
            return None;
        }
        let slot = self.peek();
        self.next += 1;
        self.used += 1;
        Some(slot)
    }

    /// The oldest slot in use is free again.
    #[inline]
    pub(crate) fn release(&mut self) {
        self.used = self.used.saturating_sub(1);
    }

    /// Slots in use.
    #[cfg(test)]
    pub(crate) fn used(&self) -> usize {
        self.used
    }

    /// Forgets every slot in use.
    pub(crate) fn clear(&mut self) {
        self.used = 0;
    }
}

impl LaneStage {
    /// A ring of `slots` × `slot_bytes` for `staging` (from the pool, or new) registered with
    /// `register` (the lane's comm). Binds the GPU's context to this (engine) thread first.
    pub(crate) fn new(
        staging: &Staging,
        slots: usize,
        slot_bytes: usize,
        register: impl FnOnce(&SharedMemory) -> tcpx::Result<MemoryRegion>,
    ) -> tcpx::Result<Self> {
        let ring = match staging {
            Staging::Cuda(device) => {
                device.bind()?;
                RingPool::global().ring(device, slots, slot_bytes)?
            }
            Staging::Emulated => StagingRing::emulated(slots, slot_bytes)?,
        };
        match register(ring.memory()) {
            Ok(region) => Ok(Self { ring, region }),
            Err(e) => {
                RingPool::global().give(ring);
                Err(e)
            }
        }
    }

    /// Deregisters the ring and hands it back to the pool (the lane is going away).
    pub(crate) fn release(self) {
        let Self { ring, region } = self;
        drop(region);
        RingPool::global().give(ring);
    }

    /// Waits for every queued copy (the lane was abandoned; its window is failed and never
    /// posts again).
    pub(crate) fn abandon(&mut self) {
        if let Err(e) = self.ring.synchronize() {
            tracing::error!(target: "tcpx_runtime", error = %e, "staging ring: waiting for copies failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{aligned, pick, RingShape, SlotFifo};
    use proptest::prelude::*;

    fn shape(same_device: bool, slots: usize, slot_bytes: usize) -> RingShape {
        RingShape {
            same_device,
            slots,
            slot_bytes,
        }
    }

    #[test]
    fn a_lane_takes_the_exact_ring_else_the_smallest_larger_one_of_its_device() {
        let idle = [
            shape(true, 32, 1 << 20),
            shape(false, 32, 256 << 10),
            shape(true, 16, 256 << 10),
            shape(true, 32, 512 << 10),
        ];
        // Exact shape.
        assert_eq!(pick(idle.into_iter(), 32, 512 << 10), Some(3));
        // A smaller agreed chunk: the smallest slots that hold it, on this device, with as
        // many slots (the other device's and the 16-slot ring are not taken).
        assert_eq!(pick(idle.into_iter(), 32, 256 << 10), Some(3));
        assert_eq!(pick(idle.into_iter(), 32, 100_000), Some(3));
        assert_eq!(pick(idle.into_iter(), 16, 64 << 10), Some(2));
        // Nothing large enough, or no ring of that many slots.
        assert_eq!(pick(idle.into_iter(), 32, (1 << 20) + 1), None);
        assert_eq!(pick(idle.into_iter(), 8, 4096), None);
        assert_eq!(pick(std::iter::empty(), 32, 4096), None);
    }

    proptest! {
        /// Against a model: the pick is on this device, has the slots asked for, holds the
        /// slot size asked for, and no other such ring has smaller slots; none is picked only
        /// when no ring qualifies.
        #[test]
        fn the_pick_is_the_tightest_ring_that_serves(
            idle in proptest::collection::vec((any::<bool>(), 1usize..4, 1usize..6), 0..12),
            slots in 1usize..4,
            want in 1usize..(6 << 12),
        ) {
            let shapes: Vec<RingShape> = idle
                .iter()
                .map(|&(d, n, pages)| shape(d, n, pages << 12))
                .collect();
            let serves = |s: &RingShape| s.same_device && s.slots == slots && s.slot_bytes >= aligned(want);
            match pick(shapes.iter().copied(), slots, want) {
                Some(at) => {
                    prop_assert!(serves(&shapes[at]));
                    prop_assert!(shapes.iter().filter(|s| serves(s)).all(|s| s.slot_bytes >= shapes[at].slot_bytes));
                }
                None => prop_assert!(!shapes.iter().any(serves)),
            }
        }
    }

    proptest! {
        /// Against a model (a queue of live slots): a slot is never handed out while in use,
        /// `take` refuses exactly when all are in use, and releases free the oldest.
        #[test]
        fn fifo_slots_never_overlap(count in 1usize..20, ops in proptest::collection::vec(any::<bool>(), 0..400)) {
            let mut fifo = SlotFifo::new(count);
            let mut live = std::collections::VecDeque::new();
            for take in ops {
                if take {
                    match fifo.take() {
                        Some(s) => {
                            prop_assert!(s < count);
                            prop_assert!(!live.contains(&s), "slot {} handed out twice", s);
                            live.push_back(s);
                        }
                        None => prop_assert_eq!(live.len(), count),
                    }
                } else if live.pop_front().is_some() {
                    fifo.release();
                }
                prop_assert_eq!(fifo.used(), live.len());
            }
        }
    }
}
