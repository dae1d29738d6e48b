//! The staged path of one lane: CUDA memory moved through a host-only plugin by way of a
//! pinned host ring (docs/ARCHITECTURE.md, data path step 5).
//!
//! A lane gets its [`LaneStage`] when the first staged transfer reaches it, once: the ring
//! (pinned memory, a stream, an event per slot) is allocated and registered on the lane's comm
//! then, and reused by every later staged transfer. Slots are handed out and taken back in
//! FIFO order, which is also the order in which requests complete and are consumed on a comm,
//! so slot `k mod slots` is free whenever fewer than `slots` are in use.
//!
//! * Send lane: ring of `2 × window` slots. Each staged chunk gets a slot and a device → slot
//!   copy at once (up to the ring's room: a window's worth of copies runs ahead of the
//!   window's sends), waits until its event is seen done, is then posted from the slot, and
//!   frees the slot when `test` reports the send done.
//! * Receive lane: ring of `window` slots, one per window slot. Each staged chunk is received
//!   into a slot; once `test` says done, slot → device is queued; once that copy's event is
//!   seen done, the receive is consumed (`irecvConsumed`) and the slot freed.
//!
//! Which slot a chunk gets and when it is free again is the lane core's bookkeeping
//! ([`super::lane`], with [`SlotFifo`]); this holds the ring itself. Nothing here allocates,
//! locks or synchronizes per chunk: slots are counters, and copies are only polled
//! (`cuEventQuery`).

use tcpx::cuda::{CudaDevice, StagingRing};
use tcpx::{MemoryRegion, SharedMemory};

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
    /// Allocates a ring of `slots` × `slot_bytes` for `staging` and registers it with
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
                StagingRing::new(device, slots, slot_bytes)?
            }
            Staging::Emulated => StagingRing::emulated(slots, slot_bytes)?,
        };
        let region = register(ring.memory())?;
        Ok(Self { ring, region })
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
    use super::SlotFifo;
    use proptest::prelude::*;

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
