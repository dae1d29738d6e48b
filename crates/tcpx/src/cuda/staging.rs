//! [`StagingRing`]: pinned host slots that CUDA memory is staged through when a plugin takes
//! host memory only (the runtime's staged path, docs/ARCHITECTURE.md "data path" step 5).
//!
//! A ring is `slots` slots of `slot_bytes` each in one [`PinnedHostBuffer`], one stream, and one
//! event per slot. The caller (an engine lane) decides which slot each chunk uses; the ring
//! only queues the copies, answers "is this slot's copy done" without blocking, and keeps the
//! memory on the other side of each copy alive and counted in flight (one [`InFlight`] token
//! per distinct memory, in a preallocated per-slot list: no allocation per copy) until that
//! copy is seen done. A slot whose copy has not been seen done refuses a new copy, so an
//! accounting mistake upstream is an error, not corrupted data.
//!
//! * send side: [`fill`](StagingRing::fill) copies device → slot, or
//!   [`gather`](StagingRing::gather) copies a list of pieces ([`Span`]s) into the slot
//!   back to back; once [`is_copied`](StagingRing::is_copied) says so, the slot's bytes can be
//!   posted (`isend`);
//! * receive side: the slot is posted (`irecv`);
//!   [`set_drain_target`](StagingRing::set_drain_target) records where its bytes go (or
//!   [`set_scatter_targets`](StagingRing::set_scatter_targets) a list of pieces they are cut
//!   into); once the receive is done, [`drain`](StagingRing::drain) copies slot →
//!   destination(s), and when `is_copied` says so the receive may be consumed.
//!
//! # Lists of pieces: one launch per slot, not one copy per piece
//! A KV cache moves as many small scattered blocks (16–256 KiB). Copying each with its own
//! `cuMemcpyAsync` costs a driver call (a few µs) per block on the engine thread and keeps the
//! copy engines busy with tiny transfers, so a list of 1024 × 16 KiB blocks would move at a
//! fraction of one 16 MiB transfer. A ring made with the gather kernel (the unpack kernel of
//! [`super::unpack`], which copies fragment lists; loaded once per GPU and process) instead
//! writes the list's fragments (at most [`FRAGMENT_BYTES`] each, so that every warp of the
//! launch gets one) into the slot's preallocated metadata in pinned memory and launches the
//! kernel once for the slot: on the send side it reads the device blocks and writes the
//! pinned slot over PCIe, on the receive side it reads the slot and writes the blocks. A list
//! of more fragments than a slot's metadata holds, memory the GPU cannot reach, or a ring
//! without the kernel falls back to one copy per piece (correct, slower). A list of one piece
//! is always one plain copy.
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
use super::unpack::{put_meta, LaunchConfig, UnpackEntry, UnpackKernel, Unpacker, META_BYTES};
use crate::error::{Error, ErrorKind, Result};
use crate::memory::{InFlight, MemoryKind, SharedMemory};

/// Largest fragment the gather kernel is handed: one warp copies one fragment, so a 512 KiB
/// slot of 16 KiB blocks keeps 32 warps busy rather than one per block of any size.
pub const FRAGMENT_BYTES: usize = 16 << 10;

/// Fragments a slot's metadata holds (16 bytes each): the gather of a list cut into more goes
/// through one copy per piece instead.
pub const FRAGMENTS_PER_SLOT: usize = 2048;

/// Launch shape of gathers: 8 warps per block, one fragment each, so a slot's fragments
/// spread over as many multiprocessors as they need.
const GATHER_LAUNCH: LaunchConfig = LaunchConfig {
    threads_per_block: 256,
    frags_per_block: 8,
    max_blocks: 0,
};

/// One piece of the memory on the other side of a slot's copy: `len` bytes at `offset` in
/// `memory` (device memory, or host memory).
#[derive(Debug, Clone, Copy)]
pub struct Span<'m> {
    /// The memory.
    pub memory: &'m SharedMemory,
    /// Offset in it.
    pub offset: usize,
    /// Bytes.
    pub len: usize,
}

impl<'m> Span<'m> {
    /// `len` bytes at `offset` in `memory`.
    pub fn new(memory: &'m SharedMemory, offset: usize, len: usize) -> Self {
        Self {
            memory,
            offset,
            len,
        }
    }
}

/// What one slot is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    /// No copy queued, nothing expected.
    Idle,
    /// A receive will land here; its destinations are recorded.
    Expecting,
    /// A copy is queued; its event has not been seen done.
    Copying,
}

/// Which way a slot's copy goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    /// Pieces → slot (send side).
    Gather,
    /// Slot → pieces (receive side).
    Scatter,
}

/// One piece of a slot's copy, by address: `len` bytes between the slot at `at` (an offset in
/// the slot) and `addr` (unified address in memory of kind `kind`).
#[derive(Debug, Clone, Copy)]
struct Frag {
    at: usize,
    addr: u64,
    len: usize,
    kind: MemoryKind,
}

/// The GPU side of a ring: its stream, and the gather kernel when it could be loaded.
enum Gpu {
    /// Copies and gathers on the unpacker's stream.
    Kernel(Unpacker),
    /// Copies only (the kernel could not be loaded): lists go one copy per piece.
    Copies(CudaStream),
}

impl Gpu {
    fn stream(&self) -> &CudaStream {
        match self {
            Gpu::Kernel(unpacker) => unpacker.stream(),
            Gpu::Copies(stream) => stream,
        }
    }
}

/// Who performs the copies.
enum Copier {
    /// The GPU: copy engines for single pieces, the gather kernel for lists.
    Cuda {
        device: CudaDevice,
        gpu: Gpu,
        /// Per slot, [`FRAGMENTS_PER_SLOT`] kernel fragments (`LoadMeta`), in pinned memory
        /// the kernel reads (present with the kernel only).
        metas: Option<PinnedHostBuffer>,
        /// Kernel entries of the launch being built (capacity kept between launches).
        entries: Vec<UnpackEntry>,
    },
    /// The CPU, when the copy is seen done (emulation for tests without a GPU).
    Cpu,
}

/// Polls an emulated copy stays "in progress" before it is reported done.
const EMULATED_POLLS: u8 = 1;

/// Pieces a slot's lists hold without growing (they grow once if a longer list comes).
const SLOT_LIST_CAPACITY: usize = 64;

struct Slot {
    /// Recorded after the slot's copy (`None` in emulation).
    event: Option<CudaEvent>,
    /// Emulation: polls left before the copy is performed and reported done.
    polls_left: u8,
    state: SlotState,
    way: Way,
    /// The pieces of the copy queued or expected, in slot order.
    frags: Vec<Frag>,
    /// The memories on the other side of the slot's copy (kept alive, counted in flight).
    peers: Vec<InFlight>,
    /// Bytes the recorded pieces cover (what a drain may copy at most).
    expected: usize,
    /// The slot's copy ran through the gather kernel (its status is checked when seen done).
    by_kernel: bool,
}

/// Pinned host slots, one stream and one event per slot, for staging CUDA memory through a
/// host-only plugin. Send side: [`fill`](Self::fill) (or [`gather`](Self::gather)) a slot,
/// post the slot once [`is_copied`](Self::is_copied); receive side: post into a slot,
/// [`set_drain_target`](Self::set_drain_target) (or
/// [`set_scatter_targets`](Self::set_scatter_targets)), [`drain`](Self::drain) once the
/// receive is done, and hand the receive back once [`is_copied`](Self::is_copied).
pub struct StagingRing {
    copier: Copier,
    memory: SharedMemory,
    /// Host address of slot 0.
    base: u64,
    /// Device address of slot 0 (the kernel's side of the slots).
    base_dev: u64,
    slot_bytes: usize,
    slots: Vec<Slot>,
}

impl fmt::Debug for StagingRing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StagingRing")
            .field("device", &self.device().map(CudaDevice::ordinal))
            .field("slots", &self.slots.len())
            .field("slot_bytes", &self.slot_bytes)
            .field("gather_kernel", &self.gathers_by_kernel())
            .finish()
    }
}

impl StagingRing {
    /// Allocates `slots` × `slot_bytes` of pinned host memory (4 KiB-aligned, each slot
    /// starting on a 4 KiB boundary), a stream and one event per slot on `device`, and loads
    /// the gather kernel (once per GPU and process, [`UnpackKernel::shared`]). Without the
    /// kernel (a driver refusing its PTX and no NVRTC) the ring still works: lists then go one
    /// copy per piece.
    pub fn new(device: &CudaDevice, slots: usize, slot_bytes: usize) -> Result<Self> {
        let (stride, total) = Self::layout("StagingRing::new", slots, slot_bytes)?;
        let buffer = PinnedHostBuffer::new(device, total)?;
        // The host address: what the DtoH/HtoD copies take for their host side (and, under
        // the unified addressing CudaDevice::new requires, what cuMemcpyAsync takes too).
        let base = buffer.as_slice().as_ptr() as u64;
        let base_dev = buffer.device_ptr();
        let kernel = UnpackKernel::shared(device).and_then(|kernel| {
            let mut unpacker = Unpacker::with_kernel(kernel, device.stream()?)?;
            unpacker.set_config(GATHER_LAUNCH)?;
            let metas = PinnedHostBuffer::new(device, slots * FRAGMENTS_PER_SLOT * META_BYTES)?;
            Ok((unpacker, metas))
        });
        let (gpu, metas) = match kernel {
            Ok((unpacker, metas)) => (Gpu::Kernel(unpacker), Some(metas)),
            Err(e) => {
                tracing::warn!(target: "tcpx::cuda", "staging ring without the gather kernel (lists of pieces go one copy each): {e}");
                (Gpu::Copies(CudaStream::new(device)?), None)
            }
        };
        let slots = (0..slots)
            .map(|_| Ok(Slot::new(Some(CudaEvent::new(device, false)?))))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            copier: Copier::Cuda {
                device: device.clone(),
                gpu,
                metas,
                entries: Vec::with_capacity(SLOT_LIST_CAPACITY),
            },
            memory: SharedMemory::new(buffer),
            base,
            base_dev,
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
        let base = memory.as_ptr() as u64;
        Ok(Self {
            copier: Copier::Cpu,
            base,
            base_dev: base,
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

    /// True when lists of pieces go through the gather kernel (one launch per slot); false
    /// for an emulated ring and for a GPU ring that could not load the kernel.
    pub fn gathers_by_kernel(&self) -> bool {
        matches!(
            &self.copier,
            Copier::Cuda {
                gpu: Gpu::Kernel(_),
                ..
            }
        )
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
        self.gather(slot, [Span::new(src, offset, len)]).map(|_| ())
    }

    /// Queues the copy of `spans`, back to back from the slot's start, into slot `slot` (one
    /// plain copy for one span, one kernel launch for a list: see the module docs) and
    /// records the slot's event. Returns the bytes gathered. The memories stay alive and in
    /// flight until [`is_copied`](Self::is_copied) has seen the copy done. An empty span list
    /// queues nothing.
    pub fn gather<'m>(
        &mut self,
        slot: usize,
        spans: impl IntoIterator<Item = Span<'m>>,
    ) -> Result<usize> {
        const API: &str = "StagingRing::gather";
        let total = self.record(API, slot, spans, Way::Gather)?;
        self.start(API, slot, total)?;
        Ok(total)
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
        self.set_scatter_targets(slot, [Span::new(dst, offset, len)])
            .map(|_| ())
    }

    /// Records that slot `slot` will receive bytes destined for `spans`, back to back from the
    /// slot's start; [`drain`](Self::drain) copies them there (one launch for a list). Returns
    /// the bytes the spans cover. The memories stay alive and in flight until the drain copy is
    /// seen done (or [`synchronize`](Self::synchronize)).
    pub fn set_scatter_targets<'m>(
        &mut self,
        slot: usize,
        spans: impl IntoIterator<Item = Span<'m>>,
    ) -> Result<usize> {
        const API: &str = "StagingRing::set_scatter_targets";
        let total = self.record(API, slot, spans, Way::Scatter)?;
        if let Some(s) = self.slots.get_mut(slot) {
            s.state = SlotState::Expecting;
        }
        Ok(total)
    }

    /// Queues the copy of slot `slot`'s first `len` bytes (what the receive delivered, at most
    /// what [`set_drain_target`](Self::set_drain_target) or
    /// [`set_scatter_targets`](Self::set_scatter_targets) announced) to its recorded
    /// destinations and records the slot's event.
    pub fn drain(&mut self, slot: usize, len: usize) -> Result<()> {
        const API: &str = "StagingRing::drain";
        let s = slot_mut(&mut self.slots, self.slot_bytes, API, slot, len)?;
        if s.state != SlotState::Expecting {
            return Err(Self::busy(API, slot, s.state));
        }
        if len > s.expected {
            return Err(Error::invalid(
                API,
                format!("{len} bytes received where {} were expected", s.expected),
            ));
        }
        // A short receive fills only the first `len` bytes: copy those alone.
        if len < s.expected {
            let mut left = len;
            s.frags.retain_mut(|f| {
                let keep = left > 0;
                f.len = f.len.min(left);
                left -= f.len;
                keep
            });
        }
        self.start(API, slot, len)
    }

    /// Checks `spans` against their memories and the slot, takes their in-flight tokens and
    /// records them as slot `slot`'s pieces (the slot must be idle). Returns their total. On
    /// error the slot stays idle and holds nothing.
    fn record<'m>(
        &mut self,
        api: &'static str,
        slot: usize,
        spans: impl IntoIterator<Item = Span<'m>>,
        way: Way,
    ) -> Result<usize> {
        let slot_bytes = self.slot_bytes;
        let s = slot_mut(&mut self.slots, slot_bytes, api, slot, 0)?;
        if s.state != SlotState::Idle {
            return Err(Self::busy(api, slot, s.state));
        }
        s.frags.clear();
        s.peers.clear();
        let mut at = 0usize;
        let mut last: Option<&SharedMemory> = None;
        let recorded = spans.into_iter().try_for_each(|span| {
            span.memory.check_range(api, span.offset, span.len)?;
            let end = at.checked_add(span.len).filter(|&e| e <= slot_bytes);
            let Some(end) = end else {
                return Err(Error::invalid(
                    api,
                    format!("the pieces do not fit a slot of {slot_bytes} bytes"),
                ));
            };
            if span.len == 0 {
                return Ok(());
            }
            // One token per run of pieces in one memory (a KV list is one region).
            if !last.is_some_and(|m| m.same_as(span.memory)) {
                s.peers.push(span.memory.begin_operation(api)?);
                last = Some(span.memory);
            }
            s.frags.push(Frag {
                at,
                addr: span.memory.as_ptr() as u64 + span.offset as u64,
                len: span.len,
                kind: span.memory.kind(),
            });
            at = end;
            Ok(())
        });
        if let Err(e) = recorded {
            s.frags.clear();
            s.peers.clear();
            return Err(e);
        }
        s.way = way;
        s.expected = at;
        Ok(at)
    }

    /// Starts slot `slot`'s recorded copy of `len` bytes and marks the slot copying.
    fn start(&mut self, api: &'static str, slot: usize, len: usize) -> Result<()> {
        let slot_addr = self.base + self.slot_offset(slot) as u64;
        let slot_dev = self.base_dev + self.slot_offset(slot) as u64;
        let s = slot_mut(&mut self.slots, self.slot_bytes, api, slot, len)?;
        // SAFETY: every piece was range-checked against its memory by `record`, and that
        // memory is kept alive and in flight by the slot's tokens until the copy is seen done
        // (or the ring synchronizes); the slot's bytes `slot_addr..+len` (len ≤ slot_bytes)
        // are used by no other copy (the slot was idle or expecting), are not posted (send)
        // or reposted (receive) before `is_copied`, and on the receive side the receive that
        // wrote them is done (the caller drains only after `test` said so).
        let started = unsafe { start_copy(&mut self.copier, slot, s, slot_addr, slot_dev) };
        match started {
            Ok(()) => {
                s.state = SlotState::Copying;
                Ok(())
            }
            Err(e) => {
                // Nothing may still be queued for this slot's pieces that the tokens do not
                // cover: keep them (the link fails; synchronize releases them).
                s.state = SlotState::Copying;
                Err(e)
            }
        }
    }

    /// True once slot `slot`'s copy has completed (non-blocking: `cuEventQuery`); the slot is
    /// then idle again and the memory on the other side released. True for an idle slot. A
    /// gather whose kernel reported a fragment out of range is an error.
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
                        let slot_addr = self.base + (slot * self.slot_bytes) as u64;
                        for f in &s.frags {
                            let (dst, src) = match s.way {
                                Way::Gather => (slot_addr + f.at as u64, f.addr),
                                Way::Scatter => (f.addr, slot_addr + f.at as u64),
                            };
                            // SAFETY: recorded by `record` (range-checked, host memory: the
                            // emulated copier refuses anything else), kept alive by the slot's
                            // tokens until now, when the copy is seen done; the slot and the
                            // memories on its other side are different allocations.
                            unsafe {
                                std::ptr::copy_nonoverlapping(
                                    src as *const u8,
                                    dst as *mut u8,
                                    f.len,
                                )
                            };
                        }
                        true
                    }
                };
                if done {
                    if s.by_kernel {
                        s.by_kernel = false;
                        if let Copier::Cuda {
                            gpu: Gpu::Kernel(unpacker),
                            ..
                        } = &self.copier
                        {
                            unpacker.check()?;
                        }
                    }
                    s.state = SlotState::Idle;
                    s.peers.clear();
                    s.frags.clear();
                }
                Ok(done)
            }
        }
    }

    /// Waits for every queued copy and returns every slot to idle, releasing the memories
    /// (teardown and error paths only: never on the hot path).
    pub fn synchronize(&mut self) -> Result<()> {
        if let Copier::Cuda { gpu, .. } = &self.copier {
            gpu.stream().synchronize()?;
        }
        for s in &mut self.slots {
            s.state = SlotState::Idle;
            s.peers.clear();
            // Emulation: copies not yet seen done are dropped (only abandoned lanes get here).
            s.frags.clear();
            s.by_kernel = false;
        }
        Ok(())
    }

    /// Makes the ring as good as new for another user (a pool hands rings from closed
    /// connections to new ones): waits for every copy, releases every memory, and fails if a
    /// gather ever reported an out-of-range fragment (such a ring is not reused).
    pub fn recycle(&mut self) -> Result<()> {
        self.synchronize()?;
        if let Copier::Cuda {
            gpu: Gpu::Kernel(unpacker),
            ..
        } = &self.copier
        {
            unpacker.check()?;
        }
        Ok(())
    }
}

impl Slot {
    fn new(event: Option<CudaEvent>) -> Self {
        Self {
            event,
            polls_left: 0,
            state: SlotState::Idle,
            way: Way::Gather,
            frags: Vec::with_capacity(SLOT_LIST_CAPACITY),
            peers: Vec::with_capacity(4),
            expected: 0,
            by_kernel: false,
        }
    }
}

/// Starts slot `index`'s recorded copy (`slot.frags`, `slot.way`) and marks its completion
/// point: on the GPU, one async copy (a single piece), one gather launch (a list the kernel
/// can take) or one async copy per piece, then the slot's event; in emulation, nothing until
/// [`StagingRing::is_copied`] performs it, after [`EMULATED_POLLS`] polls.
///
/// # Safety
/// Every piece's memory range must stay valid (readable for a gather, writable for a
/// scatter), and the slot's bytes `slot_addr..` (`slot_dev..` on the GPU) writable (gather) or
/// readable (scatter), untouched by anything else until the copy is seen done.
unsafe fn start_copy(
    copier: &mut Copier,
    index: usize,
    slot: &mut Slot,
    slot_addr: u64,
    slot_dev: u64,
) -> Result<()> {
    match copier {
        Copier::Cuda {
            device,
            gpu,
            metas,
            entries,
        } => {
            device.bind()?;
            let stream = gpu.stream().raw();
            slot.by_kernel = false;
            let kernel_fits = slot.frags.len() > 1
                && slot.frags.iter().all(|f| f.kind == MemoryKind::Cuda)
                && fragments(&slot.frags) <= FRAGMENTS_PER_SLOT;
            match (gpu, metas.as_mut()) {
                (Gpu::Kernel(unpacker), Some(metas)) if kernel_fits => {
                    // SAFETY: forwarded from the caller; the metadata area of slot `index` is
                    // read by no queued launch (the slot's previous copy was seen done).
                    unsafe { launch_list(unpacker, metas, entries, index, slot, slot_dev)? };
                    slot.by_kernel = true;
                }
                _ => {
                    for f in &slot.frags {
                        let (dst, src) = match slot.way {
                            Way::Gather => (
                                (slot_addr + f.at as u64, MemoryKind::Host),
                                (f.addr, f.kind),
                            ),
                            Way::Scatter => (
                                (f.addr, f.kind),
                                (slot_addr + f.at as u64, MemoryKind::Host),
                            ),
                        };
                        // SAFETY: forwarded from the caller.
                        unsafe { copy_async(device, stream, dst, src, f.len)? };
                    }
                }
            }
            match &slot.event {
                Some(event) => {
                    // SAFETY: a live event and a live stream of this device (bound above).
                    let rc = unsafe { sys::cuEventRecord(event.raw(), stream) };
                    check("cuEventRecord", rc, || device.describe())
                }
                None => Err(Error::invalid(
                    "StagingRing",
                    "a GPU ring slot has no event",
                )),
            }
        }
        Copier::Cpu => {
            if slot.frags.iter().any(|f| f.kind != MemoryKind::Host) {
                return Err(Error::invalid(
                    "StagingRing::emulated",
                    "an emulated ring copies host memory only",
                ));
            }
            // The copy happens when it is seen done, not now: a caller that used the slot (or
            // the destination) before that would see stale bytes, as with a real DMA.
            slot.polls_left = EMULATED_POLLS;
            Ok(())
        }
    }
}

/// Kernel fragments `frags` cut into (each at most [`FRAGMENT_BYTES`]).
fn fragments(frags: &[Frag]) -> usize {
    frags.iter().map(|f| f.len.div_ceil(FRAGMENT_BYTES)).sum()
}

/// Queues one async copy of `len` bytes (`dst` and `src` with their kinds) on `stream`.
///
/// # Safety
/// Both ranges must stay valid, and untouched by anything else, until the copy completes.
unsafe fn copy_async(
    device: &CudaDevice,
    stream: sys::CUstream,
    (dst, dst_kind): (u64, MemoryKind),
    (src, src_kind): (u64, MemoryKind),
    len: usize,
) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    // SAFETY: the caller guarantees both ranges for the copy's lifetime; the stream belongs to
    // `device`'s context, which the caller bound.
    let (api, rc) = unsafe {
        match (dst_kind, src_kind) {
            (MemoryKind::Host, MemoryKind::Cuda) => (
                "cuMemcpyDtoHAsync",
                sys::cuMemcpyDtoHAsync_v2(dst as _, src, len, stream),
            ),
            (MemoryKind::Cuda, MemoryKind::Host) => (
                "cuMemcpyHtoDAsync",
                sys::cuMemcpyHtoDAsync_v2(dst, src as _, len, stream),
            ),
            _ => ("cuMemcpyAsync", sys::cuMemcpyAsync(dst, src, len, stream)),
        }
    };
    check(api, rc, || {
        format!("{len} bytes {src:#x} -> {dst:#x}, {}", device.describe())
    })
}

/// Writes slot `index`'s pieces as kernel fragments into its metadata area and queues one
/// gather (or scatter) for them on the unpacker's stream.
///
/// A gather reads device memory and writes the slot; a scatter reads the slot and writes
/// device memory. One kernel entry covers the whole list, based at its lowest address, when
/// the offsets fit (a scatter's 64-bit destination offsets always do; a gather's 32-bit
/// source offsets when the list spans at most 4 GiB): a KV list in any block order is one
/// entry. A gather spanning more is cut into entries of rising addresses within 4 GiB of
/// their base.
///
/// # Safety
/// As [`start_copy`]; the slot's metadata area must not be read by a queued launch.
unsafe fn launch_list(
    unpacker: &Unpacker,
    metas: &mut PinnedHostBuffer,
    entries: &mut Vec<UnpackEntry>,
    index: usize,
    slot: &Slot,
    slot_dev: u64,
) -> Result<()> {
    let area = index * FRAGMENTS_PER_SLOT * META_BYTES;
    let metas_dev = metas.device_ptr() + area as u64;
    let bytes = &mut metas.as_mut_slice()[area..area + FRAGMENTS_PER_SLOT * META_BYTES];
    plan_list(
        &slot.frags,
        slot.way,
        slot.expected,
        slot_dev,
        metas_dev,
        bytes,
        entries,
    );
    // SAFETY: each entry's metas lie in this slot's metadata area (pinned, mapped, written
    // above and not rewritten before the slot's copy is seen done); sources and destinations
    // are the caller's pieces (device memory, range-checked) and the slot, valid per the
    // caller until the event recorded after this launch is seen done; the lengths given to
    // the kernel are the pieces' and the slot's true extents.
    unsafe { unpacker.enqueue(entries) }?;
    Ok(())
}

/// The kernel's view of a list (pure, so that it is tested without a GPU): writes `frags`,
/// cut at [`FRAGMENT_BYTES`], as fragments (`LoadMeta`: source offset, length, destination
/// offset) into `metas` (whose first byte the GPU sees at `metas_dev`) and the entries that
/// name them into `entries` (see [`launch_list`]). The slot is at `slot_dev` and holds
/// `expected` bytes. `metas` must hold [`fragments`]`(frags)` fragments. Returns how many
/// were written.
fn plan_list(
    frags: &[Frag],
    way: Way,
    expected: usize,
    slot_dev: u64,
    metas_dev: u64,
    metas: &mut [u8],
    entries: &mut Vec<UnpackEntry>,
) -> usize {
    entries.clear();
    let mut written = 0usize;
    // One entry for the whole list when its offsets fit (see `launch_list`).
    let low = frags.iter().map(|f| f.addr).min().unwrap_or(0) & !15;
    let top = frags
        .iter()
        .map(|f| f.addr + f.len as u64)
        .max()
        .unwrap_or(0);
    let single = way == Way::Scatter || top - low <= u64::from(u32::MAX);
    // The open entry: its base address and first fragment.
    let mut open: Option<(u64, usize)> = single.then_some((low, 0));
    let close = |entries: &mut Vec<UnpackEntry>, base: u64, first: usize, end: usize, high: u64| {
        let count = (end - first) as u32;
        let metas = metas_dev + (first * META_BYTES) as u64;
        entries.push(match way {
            Way::Gather => UnpackEntry {
                metas,
                count,
                bounce: base,
                bounce_len: high - base,
                dst: slot_dev,
                dst_len: expected as u64,
            },
            Way::Scatter => UnpackEntry {
                metas,
                count,
                bounce: slot_dev,
                bounce_len: expected as u64,
                dst: base,
                dst_len: high - base,
            },
        });
    };
    // Highest address the open entry's fragments reach.
    let mut high = low;
    for f in frags {
        let mut done = 0usize;
        while done < f.len {
            let len = (f.len - done).min(FRAGMENT_BYTES);
            let addr = f.addr + done as u64;
            let at = f.at + done;
            // A fragment joins the open entry if its address lies at or above the base and,
            // for a gather, within the 32-bit reach of the source offsets.
            let fits = |base: u64| {
                addr >= base
                    && match way {
                        Way::Gather => addr + len as u64 - base <= u64::from(u32::MAX),
                        Way::Scatter => true,
                    }
            };
            let base = match open {
                Some((base, _)) if fits(base) => base,
                _ => {
                    if let Some((base, first)) = open {
                        close(entries, base, first, written, high);
                    }
                    // 16-aligned bases keep the kernel's alignment choice per fragment.
                    let base = addr & !15;
                    open = Some((base, written));
                    high = base;
                    base
                }
            };
            high = high.max(addr + len as u64);
            let (src_off, dst_off) = match way {
                Way::Gather => ((addr - base) as u32, at as u64),
                Way::Scatter => (at as u32, addr - base),
            };
            put_meta(metas, written, src_off, len as u32, dst_off);
            written += 1;
            done += len;
        }
    }
    if let Some((base, first)) = open {
        close(entries, base, first, written, high);
    }
    written
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
        let Copier::Cuda { gpu, .. } = &self.copier else {
            return;
        };
        if let Err(e) = gpu.stream().synchronize() {
            // A copy may still be running: keep the memories it touches alive and marked in
            // flight for good rather than free them under a DMA engine.
            tracing::error!(target: "tcpx::cuda", "staging ring dropped, wait failed: {e}");
            for s in &mut self.slots {
                std::mem::forget(std::mem::take(&mut s.peers));
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
        assert!(!ring.gathers_by_kernel());
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

    #[test]
    fn lists_are_gathered_and_scattered_back_to_back() {
        let mut ring = StagingRing::emulated(2, 8192).unwrap();
        let a = SharedMemory::host(4096).unwrap();
        let b = SharedMemory::host(4096).unwrap();
        a.with_bytes_mut(|x| x.iter_mut().enumerate().for_each(|(i, v)| *v = i as u8))
            .unwrap();
        b.with_bytes_mut(|x| x.fill(0xEE)).unwrap();
        let spans = [
            Span::new(&a, 100, 3),
            Span::new(&b, 0, 2),
            Span::new(&a, 7, 0),
            Span::new(&a, 1, 4),
        ];
        assert_eq!(ring.gather(1, spans).unwrap(), 9);
        assert_eq!((a.in_flight(), b.in_flight()), (2, 1), "a token per run");
        while !ring.is_copied(1).unwrap() {}
        let got = ring
            .memory()
            .with_bytes(|x| x[8192..8192 + 9].to_vec())
            .unwrap();
        assert_eq!(got, [100, 101, 102, 0xEE, 0xEE, 1, 2, 3, 4]);
        assert_eq!((a.in_flight(), b.in_flight()), (0, 0));

        // Scatter the slot back out, into pieces of other memory; a short receive fills only
        // the pieces its bytes reach.
        let c = SharedMemory::host(64).unwrap();
        let targets = [Span::new(&c, 60, 4), Span::new(&c, 0, 5)];
        assert_eq!(ring.set_scatter_targets(1, targets).unwrap(), 9);
        ring.drain(1, 6).unwrap();
        while !ring.is_copied(1).unwrap() {}
        let got = c.with_bytes(|x| x.to_vec()).unwrap();
        assert_eq!(&got[60..], &[100, 101, 102, 0xEE]);
        assert_eq!(&got[..5], &[0xEE, 1, 0, 0, 0]);
        assert_eq!(c.in_flight(), 0);

        // A list that overflows the slot, or a piece outside its memory, holds nothing.
        let over = [
            Span::new(&a, 0, 4096),
            Span::new(&b, 0, 4096),
            Span::new(&a, 0, 1),
        ];
        assert!(ring.gather(0, over).is_err());
        assert!(ring.gather(0, [Span::new(&a, 4000, 200)]).is_err());
        assert_eq!((a.in_flight(), b.in_flight()), (0, 0));
        assert!(ring.is_copied(0).unwrap(), "the slot stayed idle");
        ring.recycle().unwrap();
    }

    /// Runs `entries` the way the kernel does (every fragment checked against its entry's
    /// lengths, then copied), on host addresses standing in for device ones.
    fn run_like_the_kernel(entries: &[UnpackEntry], metas: &[u8], metas_base: u64) {
        for e in entries {
            for k in 0..e.count as usize {
                let at = (e.metas - metas_base) as usize + k * META_BYTES;
                let m = &metas[at..at + META_BYTES];
                let src_off = u32::from_ne_bytes(m[0..4].try_into().unwrap()) as u64;
                let len = u32::from_ne_bytes(m[4..8].try_into().unwrap()) as u64;
                let dst_off = u64::from_ne_bytes(m[8..16].try_into().unwrap());
                assert!(src_off + len <= e.bounce_len, "{e:?}: source out of range");
                assert!(
                    dst_off + len <= e.dst_len,
                    "{e:?}: destination out of range"
                );
                assert_eq!(e.metas % 16, 0);
                // SAFETY: host buffers of the test, checked in range of their entry above,
                // whose extents the test's spans lie in.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        (e.bounce + src_off) as *const u8,
                        (e.dst + dst_off) as *mut u8,
                        len as usize,
                    )
                };
            }
        }
    }

    proptest::proptest! {
        /// The kernel's fragments and entries for random lists (pieces in any order, of any
        /// size up to a few fragments, from or into two buffers), run as the kernel would,
        /// move exactly the bytes the CPU copies of an emulated ring move.
        #[test]
        fn kernel_lists_move_what_the_copies_move(
            pieces in proptest::collection::vec((0usize..2, 0usize..60_000, 1usize..40_000), 1..24),
            scatter in proptest::bool::ANY,
        ) {
            let mut bufs = [vec![0u8; 100_000], vec![0u8; 100_000]];
            for (k, b) in bufs.iter_mut().enumerate() {
                b.iter_mut().enumerate().for_each(|(i, x)| *x = (i * 7 + 3 + k) as u8);
            }
            let slot_bytes = 1 << 20;
            let mut slot = vec![0u8; slot_bytes];
            slot.iter_mut().enumerate().for_each(|(i, x)| *x = (i * 13 + 1) as u8);
            let way = if scatter { Way::Scatter } else { Way::Gather };
            // Destinations of a scatter never overlap in a real list (the kernel copies its
            // fragments in parallel): pieces are kept apart here.
            let mut used = [Vec::new(), Vec::new()];
            let mut kept = Vec::new();
            for &(b, off, len) in &pieces {
                let len = len.min(bufs[b].len() - off);
                if scatter && used[b].iter().any(|&(o, l): &(usize, usize)| off < o + l && o < off + len) {
                    continue;
                }
                used[b].push((off, len));
                kept.push((b, off, len));
            }
            let bases = [bufs[0].as_mut_ptr() as u64, bufs[1].as_mut_ptr() as u64];
            let mut frags = Vec::new();
            let mut at = 0;
            for &(b, off, len) in &kept {
                frags.push(Frag { at, addr: bases[b] + off as u64, len, kind: MemoryKind::Cuda });
                at += len;
            }
            // What the copies would do.
            let mut want_bufs = bufs.clone();
            let mut want_slot = slot.clone();
            for (f, &(b, off, _)) in frags.iter().zip(&kept) {
                match way {
                    Way::Gather => want_slot[f.at..f.at + f.len].copy_from_slice(&bufs[b][off..off + f.len]),
                    Way::Scatter => want_bufs[b][off..off + f.len].copy_from_slice(&slot[f.at..f.at + f.len]),
                }
            }
            let count = fragments(&frags);
            let mut metas = vec![0u8; count.max(1) * META_BYTES + 16];
            // 16-aligned metadata, as in the pinned area.
            let skew = (16 - (metas.as_ptr() as usize % 16)) % 16;
            let metas_base = metas.as_ptr() as u64 + skew as u64;
            let mut entries = Vec::new();
            let slot_dev = slot.as_mut_ptr() as u64;
            let written = plan_list(&frags, way, at, slot_dev, metas_base, &mut metas[skew..], &mut entries);
            proptest::prop_assert_eq!(written, count);
            if scatter {
                proptest::prop_assert_eq!(entries.len(), 1, "a scatter is one entry");
            }
            proptest::prop_assert_eq!(entries.iter().map(|e| e.count as usize).sum::<usize>(), count);
            run_like_the_kernel(&entries, &metas[skew..], metas_base);
            proptest::prop_assert!(slot == want_slot, "slot differs");
            proptest::prop_assert!(bufs == want_bufs, "pieces differ");
        }
    }

    #[test]
    fn a_gather_spanning_more_than_4_gib_is_cut_into_entries_within_reach() {
        // Addresses only (no copy): two pieces 5 GiB apart, then one back near the first.
        let f = |at, addr, len| Frag {
            at,
            addr,
            len,
            kind: MemoryKind::Cuda,
        };
        let frags = [
            f(0, 0x10_0000, 4096),
            f(4096, 0x10_0000 + (5 << 30), 4096),
            f(8192, 0x10_2000, 100),
        ];
        let mut metas = vec![0u8; 3 * META_BYTES];
        let mut entries = Vec::new();
        let n = plan_list(
            &frags,
            Way::Gather,
            8292,
            0x9000_0000,
            0x1000,
            &mut metas,
            &mut entries,
        );
        assert_eq!(n, 3);
        assert_eq!(entries.len(), 3, "{entries:?}");
        for e in &entries {
            assert!(e.bounce_len <= u64::from(u32::MAX) + 16, "{e:?}");
            assert_eq!((e.dst, e.dst_len), (0x9000_0000, 8292));
        }
        // A scatter of the same pieces needs one entry (64-bit destination offsets).
        let n = plan_list(
            &frags,
            Way::Scatter,
            8292,
            0x9000_0000,
            0x1000,
            &mut metas,
            &mut entries,
        );
        assert_eq!((n, entries.len()), (3, 1));
    }

    #[test]
    fn fragments_count_pieces_cut_at_the_fragment_size() {
        let f = |len| Frag {
            at: 0,
            addr: 0,
            len,
            kind: MemoryKind::Cuda,
        };
        assert_eq!(
            fragments(&[f(1), f(FRAGMENT_BYTES), f(FRAGMENT_BYTES + 1)]),
            4
        );
        assert_eq!(fragments(&[]), 0);
    }
}
