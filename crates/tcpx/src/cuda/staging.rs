//! [`StagingRing`]: pinned host slots that CUDA memory is staged through when a plugin takes
//! host memory only (the runtime's staged path, docs/ARCHITECTURE.md "data path" step 5).
//!
//! A ring is `slots` slots of `slot_bytes` each in one [`PinnedHostBuffer`], one stream, and one
//! event per slot. The caller (an engine lane) decides which slot each chunk uses; the ring
//! only queues the copies, answers "is this slot's copy done" without blocking, and keeps the
//! memory on the other side of each copy alive and counted in flight (one [`InFlight`] token
//! per slot, stored in a preallocated slot: no allocation per copy) until that copy is seen
//! done. A slot whose copy has not been seen done refuses a new copy, so an accounting mistake
//! upstream is an error, not corrupted data.
//!
//! * send side: [`fill`](StagingRing::fill) copies device → slot; once
//!   [`is_copied`](StagingRing::is_copied) says so, the slot's bytes can be posted (`isend`);
//! * receive side: the slot is posted (`irecv`); [`expect`](StagingRing::expect) records where
//!   its bytes go; once the receive is done, [`drain`](StagingRing::drain) copies slot →
//!   destination, and when `is_copied` says so the receive may be consumed.

use std::fmt;

use cudarc::driver::sys;

use super::buffer::PinnedHostBuffer;
use super::device::{CudaDevice, CudaEvent, CudaStream};
use super::driver::check;
use crate::error::{Error, ErrorKind, Result};
use crate::memory::{InFlight, MemoryKind, SharedMemory};

/// What one slot is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    /// No copy queued, nothing expected.
    Idle,
    /// A receive will land here; its destination is recorded.
    Expecting,
    /// A copy is queued; its event has not been seen done.
    Copying,
}

struct Slot {
    event: CudaEvent,
    state: SlotState,
    /// The memory on the other side of the slot's copy (kept alive, counted in flight).
    peer: Option<InFlight>,
    /// For receives: destination address and length of the drain copy.
    dst: u64,
    dst_kind: MemoryKind,
    len: usize,
}

/// Pinned host slots, one stream and one event per slot, for staging CUDA memory through a
/// host-only plugin. See the [module docs](self).
pub struct StagingRing {
    device: CudaDevice,
    stream: CudaStream,
    memory: SharedMemory,
    base: u64,
    slot_bytes: usize,
    slots: Vec<Slot>,
}

impl fmt::Debug for StagingRing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StagingRing")
            .field("device", &self.device.ordinal())
            .field("slots", &self.slots.len())
            .field("slot_bytes", &self.slot_bytes)
            .finish()
    }
}

impl StagingRing {
    /// Allocates `slots` × `slot_bytes` of pinned host memory (4 KiB-aligned, each slot
    /// starting on a 4 KiB boundary), a stream and one event per slot on `device`.
    pub fn new(device: &CudaDevice, slots: usize, slot_bytes: usize) -> Result<Self> {
        const API: &str = "StagingRing::new";
        if slots == 0 || slot_bytes == 0 {
            return Err(Error::invalid(
                API,
                format!("a ring needs slots and bytes ({slots} × {slot_bytes})"),
            ));
        }
        // Slots start on 4 KiB boundaries, like every buffer handed to a plugin.
        let stride = slot_bytes.div_ceil(crate::BUFFER_ALIGN) * crate::BUFFER_ALIGN;
        let total = stride
            .checked_mul(slots)
            .ok_or_else(|| Error::invalid(API, "ring size overflows"))?;
        let buffer = PinnedHostBuffer::new(device, total)?;
        // The host address: what the DtoH/HtoD copies take for their host side (and, under
        // the unified addressing CudaDevice::new requires, what cuMemcpyAsync takes too).
        let base = buffer.as_slice().as_ptr() as u64;
        let stream = CudaStream::new(device)?;
        let slots = (0..slots)
            .map(|_| {
                Ok(Slot {
                    event: CudaEvent::new(device, false)?,
                    state: SlotState::Idle,
                    peer: None,
                    dst: 0,
                    dst_kind: MemoryKind::Cuda,
                    len: 0,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            device: device.clone(),
            stream,
            memory: SharedMemory::new(buffer),
            base,
            slot_bytes: stride,
            slots,
        })
    }

    /// The ring's memory (register it on the comm that posts from or into the slots).
    pub fn memory(&self) -> &SharedMemory {
        &self.memory
    }

    /// The device whose stream runs the copies.
    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    /// Number of slots.
    pub fn slots(&self) -> usize {
        self.slots.len()
    }

    /// Bytes per slot (the requested size rounded up to 4 KiB).
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Offset of slot `slot` in [`memory`](Self::memory).
    pub fn slot_offset(&self, slot: usize) -> usize {
        slot * self.slot_bytes
    }

    fn busy(api: &'static str, slot: usize, state: SlotState) -> Error {
        Error::new(
            api,
            ErrorKind::Busy(format!("staging slot {slot} is {state:?}")),
            "",
        )
    }

    /// Queues a copy of `src[offset..offset+len]` (device memory, or host memory) into slot
    /// `slot` and records the slot's event. `src` stays alive and in flight until
    /// [`is_copied`](Self::is_copied) has seen the copy done.
    pub fn fill(
        &mut self,
        slot: usize,
        src: &SharedMemory,
        offset: usize,
        len: usize,
    ) -> Result<()> {
        const API: &str = "StagingRing::fill";
        src.check_range(API, offset, len)?;
        let dst = self.base + self.slot_offset(slot) as u64;
        let token = src.begin_operation(API)?;
        let stream = self.stream.raw();
        let describe = self.device.describe();
        self.device.bind()?;
        let s = slot_mut(&mut self.slots, self.slot_bytes, API, slot, len)?;
        if s.state != SlotState::Idle {
            return Err(Self::busy(API, slot, s.state));
        }
        let from = src.as_ptr() as u64 + offset as u64;
        if len > 0 {
            // SAFETY: `from..from+len` lies in `src` (range checked), which `token` keeps alive
            // until the event recorded below is seen done; `dst..dst+len` lies in this ring's
            // slot `slot` (len ≤ slot_bytes), which no other copy uses (state Idle) and which
            // the caller posts only after `is_copied`. The stream belongs to the bound context.
            let rc = unsafe {
                match src.kind() {
                    MemoryKind::Cuda => sys::cuMemcpyDtoHAsync_v2(dst as _, from, len, stream),
                    MemoryKind::Host => sys::cuMemcpyAsync(dst, from, len, stream),
                }
            };
            check("cuMemcpyDtoHAsync", rc, || {
                format!("{len} bytes {from:#x} -> staging slot {slot}, {describe}")
            })?;
        }
        s.event.record(&self.stream)?;
        s.state = SlotState::Copying;
        s.peer = Some(token);
        Ok(())
    }

    /// Records that slot `slot` will receive `len` bytes destined for `dst[offset..]` (device
    /// or host memory); [`drain`](Self::drain) copies them there. `dst` stays alive and in
    /// flight until the drain copy is seen done (or [`synchronize`](Self::synchronize)).
    pub fn expect(
        &mut self,
        slot: usize,
        dst: &SharedMemory,
        offset: usize,
        len: usize,
    ) -> Result<()> {
        const API: &str = "StagingRing::expect";
        dst.check_range(API, offset, len)?;
        let token = dst.begin_operation(API)?;
        let s = slot_mut(&mut self.slots, self.slot_bytes, API, slot, len)?;
        if s.state != SlotState::Idle {
            return Err(Self::busy(API, slot, s.state));
        }
        s.state = SlotState::Expecting;
        s.dst = dst.as_ptr() as u64 + offset as u64;
        s.dst_kind = dst.kind();
        s.len = len;
        s.peer = Some(token);
        Ok(())
    }

    /// Queues the copy of slot `slot`'s first `len` bytes (what the receive delivered, at most
    /// what [`expect`](Self::expect) announced) to its recorded destination and records the
    /// slot's event.
    pub fn drain(&mut self, slot: usize, len: usize) -> Result<()> {
        const API: &str = "StagingRing::drain";
        let src = self.base + self.slot_offset(slot) as u64;
        let stream = self.stream.raw();
        let describe = self.device.describe();
        self.device.bind()?;
        let s = slot_mut(&mut self.slots, self.slot_bytes, API, slot, len)?;
        if s.state != SlotState::Expecting {
            return Err(Self::busy(API, slot, s.state));
        }
        if len > s.len {
            return Err(Error::invalid(
                API,
                format!("{len} bytes received where {} were expected", s.len),
            ));
        }
        let dst = s.dst;
        if len > 0 {
            // SAFETY: `dst..dst+len` lies in the destination checked by `expect` (len ≤ its
            // len), kept alive and in flight by the slot's token until the event below is seen
            // done; `src..src+len` is this ring's slot, which the receive has finished writing
            // (the caller drains only after `test` said done) and which is not reposted before
            // `is_copied`. The stream belongs to the bound context.
            let rc = unsafe {
                match s.dst_kind {
                    MemoryKind::Cuda => sys::cuMemcpyHtoDAsync_v2(dst, src as _, len, stream),
                    MemoryKind::Host => sys::cuMemcpyAsync(dst, src, len, stream),
                }
            };
            check("cuMemcpyHtoDAsync", rc, || {
                format!("{len} bytes staging slot {slot} -> {dst:#x}, {describe}")
            })?;
        }
        s.event.record(&self.stream)?;
        s.state = SlotState::Copying;
        Ok(())
    }

    /// True once slot `slot`'s copy has completed (non-blocking: `cuEventQuery`); the slot is
    /// then idle again and the memory on the other side released. True for an idle slot.
    #[inline]
    pub fn is_copied(&mut self, slot: usize) -> Result<bool> {
        let Some(s) = self.slots.get_mut(slot) else {
            return Err(Error::invalid(
                "StagingRing::is_copied",
                format!("slot {slot} out of range"),
            ));
        };
        match s.state {
            SlotState::Idle => Ok(true),
            SlotState::Expecting => Ok(false),
            SlotState::Copying => {
                if s.event.is_done()? {
                    s.state = SlotState::Idle;
                    s.peer = None;
                    Ok(true)
                } else {
                    Ok(false)
                }
            }
        }
    }

    /// Waits for every queued copy and returns every slot to idle, releasing the memories
    /// (teardown and error paths only: never on the hot path).
    pub fn synchronize(&mut self) -> Result<()> {
        self.stream.synchronize()?;
        for s in &mut self.slots {
            s.state = SlotState::Idle;
            s.peer = None;
        }
        Ok(())
    }
}

/// Slot `slot`, checked to exist and to hold `len` bytes.
fn slot_mut<'s>(
    slots: &'s mut [Slot],
    slot_bytes: usize,
    api: &'static str,
    slot: usize,
    len: usize,
) -> Result<&'s mut Slot> {
    if len > slot_bytes {
        return Err(Error::invalid(
            api,
            format!("{len} bytes do not fit a slot of {slot_bytes}"),
        ));
    }
    let count = slots.len();
    slots
        .get_mut(slot)
        .ok_or_else(|| Error::invalid(api, format!("slot {slot} of {count}")))
}

impl Drop for StagingRing {
    fn drop(&mut self) {
        if let Err(e) = self.stream.synchronize() {
            // A copy may still be running: keep the memories it touches alive and marked in
            // flight for good rather than free them under a DMA engine.
            tracing::error!(target: "tcpx::cuda", "staging ring dropped, wait failed: {e}");
            for s in &mut self.slots {
                std::mem::forget(s.peer.take());
            }
            std::mem::forget(self.memory.clone());
        }
    }
}
