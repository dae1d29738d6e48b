//! The unpack path of one receive lane: receives into CUDA memory through a plugin whose
//! receive comm hands out an UNPACK device handle (GPUDirect-TCPX, or tcpx-socket with
//! `TCPX_SOCKET_DEVMEM=1`; docs/ARCHITECTURE.md, data path step 4; docs/NCCL_NET_ABI.md §6).
//!
//! Such a plugin does not write the destination: the payload lands in its GPU bounce buffer
//! and, once `test` reports the receive done, `cnt[slot]` `loadMeta` fragments in its meta page
//! say where. The lane gathers them into the destination with the unpack kernel and only then
//! calls `irecvConsumed` (the fragments and bounce pages stay the lane's until then).
//!
//! * A lane gets its [`LaneUnpack`] when the first receive into CUDA memory reaches it, once:
//!   the GPU's context is bound to the engine thread, an [`Unpacker`] (kernel + stream) made,
//!   and the comm's device handle followed to the meta page and bounce buffer
//!   ([`UnpackQueue::of`]). A comm without an UNPACK handle gets none: its plugin writes CUDA
//!   destinations itself (ptrSupport CUDA with netDeviceType HOST) and such receives are
//!   plain direct ones.
//! * Slots: the k-th irecv posted on a comm uses slot `k mod 16` (TCPX's `tail % 16`); the lane
//!   counts its irecvs (every route: host, staged and unpack receives all advance the plugin's
//!   tail) and records the slot in the window tag ([`super::lane::Place::Unpack`]); the destination is
//!   kept per slot in [`LaneUnpack::dst`] (no per-chunk allocation).
//! * When `test` reports such a receive done, its entry (`cnt[slot]` fragments) joins
//!   [`LaneUnpack::batch`]; when the lane's test pass ends, the batch — every done receive
//!   found in that pass — goes out in one [`Unpacker::launch`] (one event). The receives stay
//!   in the window; they are consumed and retired in FIFO order once their launch's event is
//!   seen done (polled, never waited for), after [`Unpacker::check`] found no out-of-range
//!   fragment.
//! * Each launch is followed by one of the lane's [`SLOTS`] events, made with the lane and
//!   reused in turn (at most one launch per receive is outstanding, and a window holds at most
//!   16): creating and destroying an event per launch cost two more driver calls each time.

use std::collections::VecDeque;

use tcpx::cuda::unpack::{UnpackEntry, UnpackQueue, Unpacker, SLOTS};
use tcpx::cuda::{CudaDevice, CudaEvent};
use tcpx::RecvComm;

/// A lane's unpack state (receive lanes only).
pub(crate) struct LaneUnpack {
    /// The GPU whose context the engine thread binds.
    pub(crate) device: CudaDevice,
    pub(crate) unpacker: Unpacker,
    /// The comm's meta page and bounce buffer.
    pub(crate) queue: UnpackQueue,
    /// Destination (device address, bytes posted) of the receive in each slot.
    pub(crate) dst: [(u64, u64); SLOTS],
    /// Done receives whose gathers are not launched yet, oldest first.
    pub(crate) batch: Vec<UnpackEntry>,
    /// Launches not yet seen done, oldest first: the index of the event recorded after each.
    launches: VecDeque<usize>,
    /// The lane's events, used in turn.
    events: Vec<CudaEvent>,
    /// The event the next launch records.
    next_event: usize,
}

impl LaneUnpack {
    /// The unpack state of `comm` for receives into memory of `device`; `None` when the comm
    /// has no UNPACK device handle (its plugin writes destinations itself).
    pub(crate) fn open(device: &CudaDevice, comm: &RecvComm) -> tcpx::Result<Option<Self>> {
        device.bind()?;
        let Some(queue) = UnpackQueue::of(device, comm)? else {
            return Ok(None);
        };
        let unpacker = Unpacker::new(device)?;
        let events = (0..SLOTS)
            .map(|_| CudaEvent::new(device, false))
            .collect::<tcpx::Result<Vec<_>>>()?;
        Ok(Some(Self {
            device: device.clone(),
            unpacker,
            queue,
            dst: [(0, 0); SLOTS],
            batch: Vec::with_capacity(SLOTS),
            launches: VecDeque::with_capacity(SLOTS),
            events,
            next_event: 0,
        }))
    }

    /// Queues the gathers of the batch in one launch.
    pub(crate) fn launch(&mut self) -> tcpx::Result<()> {
        if self.batch.is_empty() {
            return Ok(());
        }
        if self.launches.len() >= self.events.len() {
            // Never: each launch gathers at least one receive of a window of at most 16.
            return Err(tcpx::Error::new(
                "unpack launch",
                tcpx::ErrorKind::InvalidArgument(format!(
                    "{} launches outstanding on a lane of {} events",
                    self.launches.len(),
                    self.events.len()
                )),
                String::new(),
            ));
        }
        // SAFETY: every entry names the plugin's meta slot and bounce buffer of a receive that
        // `test` reported done and that is not consumed before this launch is seen done (the
        // lane consumes only then, and `abandon` waits for the stream before the requests are
        // dropped), so metas and bounce pages stay valid; `dst..dst+dst_len` is the range the
        // receive was posted into, kept alive and marked in flight by its job's pieces and
        // registration until the receive is retired, which comes after the launch completes;
        // nothing else writes it while the receive is in flight. `bounce_len` is unknown
        // (u64::MAX), as with TCPX's handle; `dst_len` is the posted length.
        unsafe { self.unpacker.enqueue(&self.batch)? };
        let index = self.next_event;
        self.next_event = (index + 1) % self.events.len();
        self.events[index].record(self.unpacker.stream())?;
        self.launches.push_back(index);
        self.batch.clear();
        Ok(())
    }

    /// Adds the gather of the done receive in `slot` (`size` bytes reported) to the batch:
    /// reads its fragment count from the meta page.
    pub(crate) fn queue(&mut self, slot: usize, size: usize) -> tcpx::Result<()> {
        // SAFETY: the queue was read from this lane's comm, which is open (the lane owns it).
        let count = unsafe { self.queue.slot_count(slot)? };
        let Some(&(dst, posted)) = self.dst.get(slot) else {
            return Err(tcpx::Error::new(
                "unpack queue",
                tcpx::ErrorKind::InvalidArgument(format!("slot {slot} is out of range")),
                String::new(),
            ));
        };
        // The plugin reported `size` ≤ posted bytes; the kernel checks every fragment against
        // the posted length and skips (and reports) any that would write past it.
        debug_assert!(size as u64 <= posted);
        let entry = self.queue.entry(slot, count, dst, posted);
        self.batch.push(entry);
        Ok(())
    }

    /// Whether the oldest launch completed (it is then forgotten): its receives may be
    /// consumed. An out-of-range fragment reported by a completed launch is an error.
    pub(crate) fn poll_head(&mut self) -> tcpx::Result<bool> {
        let Some(&index) = self.launches.front() else {
            return Ok(false);
        };
        if !self.events[index].is_done()? {
            return Ok(false);
        }
        self.unpacker.check()?;
        self.launches.pop_front();
        Ok(true)
    }

    /// Waits for every queued gather and forgets every receive (the lane was abandoned; its
    /// requests are dropped right after, which must not happen while a kernel reads their
    /// fragments or writes their destinations).
    pub(crate) fn abandon(&mut self) {
        if let Err(e) = self
            .device
            .bind()
            .and_then(|()| self.unpacker.stream().synchronize())
        {
            tracing::error!(target: "tcpx_runtime", error = %e, "unpack: waiting for gathers failed");
        }
        self.batch.clear();
        self.launches.clear();
    }
}
