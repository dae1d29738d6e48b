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
//! * receive side: the slot is posted (`irecv`); [`set_drain_target`](StagingRing::set_drain_target) records where
//!   its bytes go; once the receive is done, [`drain`](StagingRing::drain) copies slot →
//!   destination, and when `is_copied` says so the receive may be consumed.
//!
//! [`StagingRing::emulated`] builds the same ring in ordinary host memory with CPU copies
//! standing in for the GPU's, each performed only when a later poll reports it done (so a
//! caller that posts a slot, or reuses it, before its copy is seen done moves stale bytes and
//! tests catch it): it lets the runtime's staged engine logic run, and be tested, on machines
//! without a GPU.

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

/// Who performs the copies.
enum Copier {
    /// The GPU's copy engines, on one stream of `device`.
    Cuda {
        device: CudaDevice,
        stream: CudaStream,
    },
    /// The CPU, at once (emulation for tests without a GPU).
    Cpu,
}

/// Polls an emulated copy stays "in progress" before it is reported done.
const EMULATED_POLLS: u8 = 1;

struct Slot {
    /// Recorded after the slot's copy (`None` in emulation).
    event: Option<CudaEvent>,
    /// Emulation: polls left before the copy is performed and reported done.
    polls_left: u8,
    /// Emulation: the copy (destination, source, length) performed when it is seen done.
    deferred: (u64, u64, usize),
    state: SlotState,
    /// The memory on the other side of the slot's copy (kept alive, counted in flight).
    peer: Option<InFlight>,
    /// For receives: destination address and length of the drain copy.
    dst: u64,
    dst_kind: MemoryKind,
    len: usize,
}

/// Pinned host slots, one stream and one event per slot, for staging CUDA memory through a
/// host-only plugin. Send side: [`fill`](Self::fill) a slot from the source, post the slot once
/// [`is_copied`](Self::is_copied); receive side: post into a slot,
/// [`set_drain_target`](Self::set_drain_target), [`drain`](Self::drain) once the receive is
/// done, and hand the receive back once [`is_copied`](Self::is_copied).
pub struct StagingRing {
    copier: Copier,
    memory: SharedMemory,
    base: u64,
    slot_bytes: usize,
    slots: Vec<Slot>,
}

impl fmt::Debug for StagingRing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StagingRing")
            .field("device", &self.device().map(CudaDevice::ordinal))
            .field("slots", &self.slots.len())
            .field("slot_bytes", &self.slot_bytes)
            .finish()
    }
}

impl StagingRing {
    /// Allocates `slots` × `slot_bytes` of pinned host memory (4 KiB-aligned, each slot
    /// starting on a 4 KiB boundary), a stream and one event per slot on `device`.
    pub fn new(device: &CudaDevice, slots: usize, slot_bytes: usize) -> Result<Self> {
        let (stride, total) = Self::layout("StagingRing::new", slots, slot_bytes)?;
        let buffer = PinnedHostBuffer::new(device, total)?;
        // The host address: what the DtoH/HtoD copies take for their host side (and, under
        // the unified addressing CudaDevice::new requires, what cuMemcpyAsync takes too).
        let base = buffer.as_slice().as_ptr() as u64;
        let stream = CudaStream::new(device)?;
        let slots = (0..slots)
            .map(|_| Ok(Slot::new(Some(CudaEvent::new(device, false)?))))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            copier: Copier::Cuda {
                device: device.clone(),
                stream,
            },
            memory: SharedMemory::new(buffer),
            base,
            slot_bytes: stride,
            slots,
        })
    }

    /// The same ring in ordinary host memory, with CPU copies standing in for the GPU's
    /// (each copy is performed by the poll of [`is_copied`](Self::is_copied) that reports it
    /// done, the second one). For testing the staged logic without a GPU; both sides of every
    /// copy must be host memory.
    pub fn emulated(slots: usize, slot_bytes: usize) -> Result<Self> {
        let (stride, total) = Self::layout("StagingRing::emulated", slots, slot_bytes)?;
        let memory = SharedMemory::host(total)?;
        Ok(Self {
            copier: Copier::Cpu,
            base: memory.as_ptr() as u64,
            memory,
            slot_bytes: stride,
            slots: (0..slots).map(|_| Slot::new(None)).collect(),
        })
    }

    /// Slot stride (4 KiB multiple) and total size, checked.
    fn layout(api: &'static str, slots: usize, slot_bytes: usize) -> Result<(usize, usize)> {
        if slots == 0 || slot_bytes == 0 {
            return Err(Error::invalid(
                api,
                format!("a ring needs slots and bytes ({slots} × {slot_bytes})"),
            ));
        }
        // Slots start on 4 KiB boundaries, like every buffer handed to a plugin.
        let stride = slot_bytes.div_ceil(crate::BUFFER_ALIGN) * crate::BUFFER_ALIGN;
        let total = stride
            .checked_mul(slots)
            .ok_or_else(|| Error::invalid(api, "ring size overflows"))?;
        Ok((stride, total))
    }

    /// The ring's memory (register it on the comm that posts from or into the slots).
    pub fn memory(&self) -> &SharedMemory {
        &self.memory
    }

    /// The device whose stream runs the copies (`None` for an emulated ring).
    pub fn device(&self) -> Option<&CudaDevice> {
        match &self.copier {
            Copier::Cuda { device, .. } => Some(device),
            Copier::Cpu => None,
        }
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
        let token = src.begin_operation(API)?;
        let dst = self.base + self.slot_offset(slot) as u64;
        let from = src.as_ptr() as u64 + offset as u64;
        let s = slot_mut(&mut self.slots, self.slot_bytes, API, slot, len)?;
        if s.state != SlotState::Idle {
            return Err(Self::busy(API, slot, s.state));
        }
        // SAFETY: `from..from+len` lies in `src` (range checked), which `token` keeps alive and
        // in flight until the copy is seen done; `dst..dst+len` lies in this ring's slot `slot`
        // (len ≤ slot_bytes), which no other copy uses (state Idle) and which the caller posts
        // only after `is_copied`.
        unsafe {
            start_copy(
                &self.copier,
                s,
                dst,
                MemoryKind::Host,
                from,
                src.kind(),
                len,
            )?
        };
        s.state = SlotState::Copying;
        s.peer = Some(token);
        Ok(())
    }

    /// Records that slot `slot` will receive `len` bytes destined for `dst[offset..]` (device
    /// or host memory); [`drain`](Self::drain) copies them there. `dst` stays alive and in
    /// flight until the drain copy is seen done (or [`synchronize`](Self::synchronize)).
    pub fn set_drain_target(
        &mut self,
        slot: usize,
        dst: &SharedMemory,
        offset: usize,
        len: usize,
    ) -> Result<()> {
        const API: &str = "StagingRing::set_drain_target";
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
    /// what [`set_drain_target`](Self::set_drain_target) announced) to its recorded destination and records the
    /// slot's event.
    pub fn drain(&mut self, slot: usize, len: usize) -> Result<()> {
        const API: &str = "StagingRing::drain";
        let src = self.base + self.slot_offset(slot) as u64;
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
        let (dst, kind) = (s.dst, s.dst_kind);
        // SAFETY: `dst..dst+len` lies in the destination checked by `set_drain_target` (len ≤ its len),
        // kept alive and in flight by the slot's token until the copy is seen done;
        // `src..src+len` is this ring's slot, which the receive has finished writing (the
        // caller drains only after `test` said done) and which is not reposted before
        // `is_copied`.
        unsafe { start_copy(&self.copier, s, dst, kind, src, MemoryKind::Host, len)? };
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
                let done = match &s.event {
                    Some(event) => event.is_done()?,
                    None if s.polls_left > 0 => {
                        s.polls_left -= 1;
                        false
                    }
                    None => {
                        let (dst, src, len) = std::mem::take(&mut s.deferred);
                        if len > 0 {
                            // SAFETY: recorded by `start_copy`, whose caller guaranteed both
                            // host ranges until the copy is seen done, which is now; the slot
                            // and the memory on its other side are different allocations.
                            unsafe {
                                std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len)
                            };
                        }
                        true
                    }
                };
                if done {
                    s.state = SlotState::Idle;
                    s.peer = None;
                }
                Ok(done)
            }
        }
    }

    /// Waits for every queued copy and returns every slot to idle, releasing the memories
    /// (teardown and error paths only: never on the hot path).
    pub fn synchronize(&mut self) -> Result<()> {
        if let Copier::Cuda { stream, .. } = &self.copier {
            stream.synchronize()?;
        }
        for s in &mut self.slots {
            s.state = SlotState::Idle;
            s.peer = None;
            // Emulation: copies not yet seen done are dropped (only abandoned lanes get here).
            s.deferred = (0, 0, 0);
        }
        Ok(())
    }
}

impl Slot {
    fn new(event: Option<CudaEvent>) -> Self {
        Self {
            event,
            polls_left: 0,
            deferred: (0, 0, 0),
            state: SlotState::Idle,
            peer: None,
            dst: 0,
            dst_kind: MemoryKind::Host,
            len: 0,
        }
    }
}

/// Starts the copy of `len` bytes from `src` to `dst` for `slot` and marks its completion
/// point: on the GPU, an async copy on the ring's stream (DtoH, HtoD, or unified for host to
/// host) and the slot's event recorded after it; in emulation, a CPU copy performed when
/// [`StagingRing::is_copied`] reports it done, after [`EMULATED_POLLS`] polls.
///
/// # Safety
/// `src..src+len` must stay readable and `dst..dst+len` writable, and untouched by anything
/// else, until the copy is seen done; in emulation both must be host memory.
unsafe fn start_copy(
    copier: &Copier,
    slot: &mut Slot,
    dst: u64,
    dst_kind: MemoryKind,
    src: u64,
    src_kind: MemoryKind,
    len: usize,
) -> Result<()> {
    match copier {
        Copier::Cuda { device, stream } => {
            device.bind()?;
            if len > 0 {
                let raw = stream.raw();
                // SAFETY: the caller guarantees both ranges for the copy's lifetime; the
                // stream belongs to `device`'s context, bound above.
                let (api, rc) = unsafe {
                    match (dst_kind, src_kind) {
                        (MemoryKind::Host, MemoryKind::Cuda) => (
                            "cuMemcpyDtoHAsync",
                            sys::cuMemcpyDtoHAsync_v2(dst as _, src, len, raw),
                        ),
                        (MemoryKind::Cuda, MemoryKind::Host) => (
                            "cuMemcpyHtoDAsync",
                            sys::cuMemcpyHtoDAsync_v2(dst, src as _, len, raw),
                        ),
                        _ => ("cuMemcpyAsync", sys::cuMemcpyAsync(dst, src, len, raw)),
                    }
                };
                check(api, rc, || {
                    format!("{len} bytes {src:#x} -> {dst:#x}, {}", device.describe())
                })?;
            }
            match &slot.event {
                Some(event) => event.record(stream),
                None => Err(Error::invalid(
                    "StagingRing",
                    "a GPU ring slot has no event",
                )),
            }
        }
        Copier::Cpu => {
            if dst_kind != MemoryKind::Host || src_kind != MemoryKind::Host {
                return Err(Error::invalid(
                    "StagingRing::emulated",
                    "an emulated ring copies host memory only",
                ));
            }
            // The copy happens when it is seen done, not now: a caller that used the slot (or
            // the destination) before that would see stale bytes, as with a real DMA.
            slot.deferred = (dst, src, len);
            slot.polls_left = EMULATED_POLLS;
            Ok(())
        }
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
        let Copier::Cuda { stream, .. } = &self.copier else {
            return;
        };
        if let Err(e) = stream.synchronize() {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn emulated_ring_copies_only_when_seen_done_and_guards_its_slots() {
        let mut ring = StagingRing::emulated(2, 100).unwrap();
        assert_eq!((ring.slots(), ring.slot_bytes()), (2, 4096));
        assert_eq!(ring.slot_offset(1), 4096);
        assert!(ring.device().is_none());
        let src = SharedMemory::host(8192).unwrap();
        src.with_bytes_mut(|b| b[10..20].copy_from_slice(b"0123456789"))
            .unwrap();

        // Send side: fill, not done on the first poll, done (and copied) on the second.
        ring.fill(0, &src, 10, 10).unwrap();
        assert_eq!(src.in_flight(), 1);
        let err = ring.fill(0, &src, 0, 1).unwrap_err();
        assert!(matches!(err.kind(), ErrorKind::Busy(_)), "{err}");
        let slot = |ring: &StagingRing| ring.memory().with_bytes(|b| b[..10].to_vec()).unwrap();
        assert!(!ring.is_copied(0).unwrap());
        assert_eq!(slot(&ring), [0u8; 10]);
        assert!(ring.is_copied(0).unwrap());
        assert_eq!(slot(&ring), *b"0123456789");
        assert_eq!(src.in_flight(), 0);

        // Receive side: drain target, drain of at most what was announced, copy when seen done.
        let dst = SharedMemory::host(64).unwrap();
        ring.set_drain_target(0, &dst, 4, 10).unwrap();
        assert!(!ring.is_copied(0).unwrap(), "expecting is not copied");
        assert!(ring.drain(0, 11).is_err());
        ring.drain(0, 10).unwrap();
        while !ring.is_copied(0).unwrap() {}
        assert_eq!(
            dst.with_bytes(|b| b[4..14].to_vec()).unwrap(),
            *b"0123456789"
        );
        assert_eq!(dst.in_flight(), 0);

        // Out-of-range slots and oversized copies are errors, not panics.
        assert!(ring.fill(2, &src, 0, 1).is_err());
        assert!(ring.fill(1, &src, 0, 4097).is_err());
        assert!(ring.is_copied(9).is_err());
        assert!(StagingRing::emulated(0, 1).is_err());
        assert!(StagingRing::emulated(1, 0).is_err());
    }
}
