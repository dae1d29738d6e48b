//! [`Job`]: the engine-side descriptor of one transfer, shared by every engine that owns one
//! of its channels.
//!
//! One `Job` travels to each engine once (one message per transfer per engine, never one per
//! chunk). Engines compute its chunks from the schedule on the fly; each lane counts its own
//! chunks and reports them with one atomic subtraction when its share is done; the
//! transfer's [`Completion`] is touched once, at the end.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use crate::engine::lane::{LaneWork, Route};
use crate::engine::stage::Staging;
use crate::error::{Direction, Error, Result};
use crate::link::Link;
use crate::registry::{Region, Registration};
use crate::schedule::{Chunk, Schedule};
use crate::transfer::Completion;

/// A transfer's pieces: inline for one (a message, a contiguous write), so that a job costs
/// no allocation for them (see `tcpx_proto::schedule::Schedule`'s extents, for the same
/// reason).
pub(crate) type Pieces = smallvec::SmallVec<[Piece; 1]>;

/// One local segment of a transfer: where its bytes are, registered on the link's comms
/// (or, for a staged transfer, the CUDA memory the engines copy through their rings).
#[derive(Debug)]
pub(crate) struct Piece {
    /// The region's plugin registrations; `None` in a staged transfer (the plugin never sees
    /// the region, only the channel's ring).
    pub(crate) registration: Option<Arc<Registration>>,
    /// The region's memory (staged transfers copy from or into it).
    pub(crate) memory: tcpx::SharedMemory,
    /// Offset of the segment in its region.
    pub(crate) offset: usize,
    /// Length of the segment.
    pub(crate) len: u64,
    /// The GPU of a CUDA region (`None` for host memory): a direct receive into it runs the
    /// lane's unpack step ([`Job::cuda_dst`]).
    pub(crate) cuda: Option<tcpx::cuda::CudaDevice>,
}

/// Whether a transfer over `regions` in `direction` is staged, and on which GPU.
///
/// A transfer is staged as a whole (every chunk through the ring) or not at all, so its
/// regions must all be staged CUDA regions or none. Unstaged CUDA regions (a plugin that takes
/// CUDA pointers) go direct; a receive into them runs the unpack step where the comm has an
/// UNPACK device handle ([`Job::cuda_dst`], [`super::unpack`]).
pub(crate) fn staging_of<'r>(
    regions: impl Iterator<Item = &'r Region> + Clone,
    // Both directions stage alike; kept for the callers' symmetry with `direct_cuda_of`.
    _direction: Direction,
) -> Result<Option<Staging>> {
    let mut staged = regions.clone().filter(|r| r.is_staged());
    let Some(first) = staged.next() else {
        return Ok(None);
    };
    if regions.clone().any(|r| !r.is_staged()) {
        return Err(Error::InvalidArgument(
            "a transfer cannot mix staged CUDA regions with other memory: submit the CUDA \
             and the host segments as separate transfers"
                .into(),
        ));
    }
    Ok(staging_for(first))
}

/// Where a staged region's copies run: its GPU, or the CPU for an emulated staged region
/// ([`crate::Endpoint::register_staged_emulation`]); `None` for a region that is not staged.
pub(crate) fn staging_for(region: &Region) -> Option<Staging> {
    if !region.is_staged() {
        return None;
    }
    Some(match region.cuda_device() {
        Some(device) => Staging::Cuda(device.clone()),
        None => Staging::Emulated,
    })
}

/// Stream offset of each piece of a packed staged transfer (see [`Job::packed`]).
#[derive(Debug)]
pub(crate) struct PackedPieces {
    starts: Vec<u64>,
}

impl PackedPieces {
    fn of(pieces: &[Piece]) -> Self {
        let mut at = 0u64;
        let starts = pieces
            .iter()
            .map(|p| {
                let start = at;
                at += p.len;
                start
            })
            .collect();
        Self { starts }
    }

    /// The pieces a stretch of the packed stream covers (`len` bytes from `offset`).
    fn spans<'j>(&self, pieces: &'j [Piece], offset: u64, len: u64) -> StagedSpans<'j> {
        // The last piece starting at or before the stretch's first byte.
        let index = self
            .starts
            .partition_point(|&s| s <= offset)
            .saturating_sub(1);
        let start = self.starts.get(index).copied().unwrap_or(0);
        StagedSpans {
            pieces: pieces.get(index..).unwrap_or(&[]),
            offset: offset.saturating_sub(start),
            left: len,
        }
    }
}

/// The application's blocks of a scattered host-memory list (a two-sided batch, a one-sided
/// write or read) that travels through a pack buffer ([`Job::host_parts`]): the engines copy
/// each chunk's share of them into the pack buffer just before they post it (send) or out of
/// it once its receive is done (receive), through [`tcpx::PackedRanges`], which touches
/// neither the blocks' handles nor their reference counts.
///
/// Why in the engines: copied by the submitting thread, a 4 MiB batch of 4 KiB blocks was
/// gathered (and, on the other side, scattered) by one core through memory that had left
/// its caches, before (after) any of it moved — batches of 4 KiB messages ran at 0.2–0.3 ×
/// raw TCP on 16 cores, half the rate of the same messages sent one by one (issue 25). Per
/// chunk, the copies run on every channel's engine at once, each next to the system call
/// that reads or wrote the same bytes while they are still in its cache.
#[derive(Debug)]
pub(crate) struct HostParts {
    /// The blocks, in stream order (the plugin never sees them, only the pack buffer).
    ranges: tcpx::PackedRanges,
}

impl HostParts {
    /// The blocks of a list, in stream order.
    pub(crate) fn new(ranges: tcpx::PackedRanges) -> Self {
        Self { ranges }
    }

    /// Copies `chunk`'s share of the blocks into the pack buffer `pack` at `pack_offset`
    /// (`into_pack`, before a send is posted) or from it into the blocks (once a receive is
    /// done). Fails (naming what) if the blocks do not cover the chunk — a bug — or a block's
    /// memory is held by a CPU slice.
    pub(crate) fn copy_chunk(
        &self,
        chunk: &Chunk,
        pack: &tcpx::SharedMemory,
        pack_offset: usize,
        into_pack: bool,
    ) -> std::result::Result<(), &'static str> {
        let len = chunk.len as usize;
        match self
            .ranges
            .copy(pack, pack_offset, chunk.offset, len, into_pack)
        {
            Ok(n) if n == len => Ok(()),
            Ok(_) => Err("a packed chunk lies outside its list"),
            Err(_) => Err(
                "a packed chunk's copy was refused (outside its list or pack buffer, or the \
                 application holds a slice of a block's memory)",
            ),
        }
    }
}

/// The pieces of memory one staged chunk covers, in stream order ([`Job::staged_spans`]).
pub(crate) struct StagedSpans<'j> {
    /// Pieces from the one holding the chunk's next byte on.
    pieces: &'j [Piece],
    /// Offset of that byte in the first piece.
    offset: u64,
    /// Bytes of the chunk not yet covered.
    left: u64,
}

impl<'j> Iterator for StagedSpans<'j> {
    type Item = tcpx::cuda::Span<'j>;

    #[inline]
    fn next(&mut self) -> Option<Self::Item> {
        while self.left > 0 {
            let (piece, rest) = self.pieces.split_first()?;
            let avail = piece.len.saturating_sub(self.offset);
            if avail == 0 {
                self.pieces = rest;
                self.offset = 0;
                continue;
            }
            let len = avail.min(self.left);
            // Pieces lie inside their regions (checked at submission), so this fits; should
            // it not, the spans end short and the lane reports the chunk outside its piece.
            let at = usize::try_from(self.offset)
                .ok()
                .and_then(|o| piece.offset.checked_add(o));
            let (Some(at), Ok(n)) = (at, usize::try_from(len)) else {
                self.left = 0;
                return None;
            };
            let span = tcpx::cuda::Span::new(&piece.memory, at, n);
            self.left -= len;
            self.offset += len;
            return Some(span);
        }
        None
    }
}

/// One transfer as the engines see it.
#[derive(Debug)]
pub(crate) struct Job {
    pub(crate) direction: Direction,
    pub(crate) link: Arc<Link>,
    /// Position among the link's transfers in this direction (pairs it with the peer's).
    pub(crate) seq: u64,
    pub(crate) len: u64,
    pub(crate) pieces: Pieces,
    /// Set when the transfer is staged (CUDA memory, host-only plugin): every chunk goes
    /// through the channel's pinned ring. `None` for direct transfers.
    pub(crate) staging: Option<Staging>,
    /// Set on a direct receive with CUDA segments (a plugin taking CUDA pointers): their GPU
    /// (that of the first one). The receive lane routes those segments' chunks through its
    /// unpack step. Computed from the pieces at creation: two-sided and one-sided alike.
    pub(crate) cuda_dst: Option<tcpx::cuda::CudaDevice>,
    /// Set on a staged transfer that travels packed (a one-sided batch of small blocks, see
    /// [`crate::onesided`]): its schedule cuts one contiguous stream over all its pieces, so
    /// a chunk may span many pieces; the lane gathers them into its ring slot, or scatters the
    /// slot into them, in one copy ([`Job::staged_spans`]). `None` otherwise: a chunk then
    /// lies in its schedule segment's piece.
    pub(crate) packed: Option<PackedPieces>,
    /// Set on a batch of scattered host memory sent from or received into a pack buffer (the
    /// job's one piece): the engines gather or scatter each chunk's blocks (see
    /// [`HostParts`]). `None` otherwise.
    pub(crate) host_parts: Option<Box<HostParts>>,
    /// Set at creation for contiguous transfers; for vectored ones once the peer's segment
    /// list arrived. Engines post nothing from a job (nor from any job behind it on a lane)
    /// before it is set.
    schedule: OnceLock<Schedule>,
    /// Chunks not yet completed; set before the schedule is published.
    remaining: AtomicU64,
    pub(crate) deadline: Instant,
    pub(crate) completion: Arc<Completion>,
}

impl Job {
    pub(crate) fn new(
        direction: Direction,
        link: Arc<Link>,
        seq: u64,
        pieces: Pieces,
        staging: Option<Staging>,
        submitted: Instant,
    ) -> Self {
        let len = pieces.iter().map(|p| p.len).sum();
        let cuda_dst = match (direction, &staging) {
            (Direction::Recv, None) => pieces.iter().find_map(|p| match p.memory.kind() {
                tcpx::MemoryKind::Cuda => p.cuda.clone(),
                tcpx::MemoryKind::Host => None,
            }),
            _ => None,
        };
        Self {
            direction,
            deadline: submitted + link.timeout,
            link,
            seq,
            len,
            pieces,
            staging,
            cuda_dst,
            packed: None,
            host_parts: None,
            schedule: OnceLock::new(),
            remaining: AtomicU64::new(0),
            completion: Arc::new(Completion::default()),
        }
    }

    /// The local segment lengths, in stream order.
    pub(crate) fn local_lens(&self) -> Vec<u64> {
        self.pieces.iter().map(|p| p.len).collect()
    }

    /// Marks a staged transfer as packed: its schedule is the packed one (one segment of the
    /// whole length), and its pieces are gathered and scattered per chunk by the lanes.
    pub(crate) fn set_packed(&mut self) {
        self.packed = Some(PackedPieces::of(&self.pieces));
    }

    /// Where a staged `chunk`'s bytes are: the pieces of memory the lane copies into its ring
    /// slot (send) or out of it (receive), back to back. One span for an unpacked transfer
    /// (the chunk lies in its segment's piece), as many as the chunk covers for a packed one.
    /// The spans cover fewer than `chunk.len` bytes only if the chunk lies outside the
    /// transfer (a bug the ring's caller reports).
    #[inline]
    pub(crate) fn staged_spans(&self, chunk: &Chunk) -> StagedSpans<'_> {
        match &self.packed {
            // Unpacked: the chunk never leaves its segment.
            None => StagedSpans {
                pieces: self
                    .pieces
                    .get(chunk.segment..=chunk.segment)
                    .unwrap_or(&[]),
                offset: chunk.segment_offset,
                left: u64::from(chunk.len),
            },
            Some(packed) => packed.spans(&self.pieces, chunk.offset, u64::from(chunk.len)),
        }
    }

    /// The schedule, once known.
    pub(crate) fn schedule(&self) -> Option<&Schedule> {
        self.schedule.get()
    }

    /// Publishes the schedule; a transfer without chunks finishes here. Later calls are
    /// ignored (the first schedule stays).
    pub(crate) fn set_schedule(&self, schedule: Schedule) {
        let chunks = schedule.chunk_count();
        // Ordered before the publication: an engine that sees the schedule sees the count.
        self.remaining.store(chunks, Ordering::Relaxed);
        if self.schedule.set(schedule).is_ok() && chunks == 0 {
            self.finish(Ok(0));
        }
    }

    /// Counts `n` chunks done (a lane reports all of its chunks of this transfer at once);
    /// the last ones complete the transfer.
    #[inline]
    pub(crate) fn chunks_done(&self, n: u64) {
        if n > 0 && self.remaining.fetch_sub(n, Ordering::AcqRel) == n {
            self.finish(Ok(self.len));
        }
    }

    /// Completes the transfer (first outcome wins) and updates the link's in-flight count.
    pub(crate) fn finish(&self, outcome: Result<u64>) {
        if self.completion.finish(outcome) {
            self.link
                .in_flight
                .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
        }
    }

    /// Fails the transfer with the link's error.
    pub(crate) fn fail_with_link(&self) {
        self.finish(Err(self.link.failure_or_closed()));
    }

    pub(crate) fn is_finished(&self) -> bool {
        self.completion.is_finished()
    }

    /// `send #3 of 1048576 bytes`, for timeout errors.
    pub(crate) fn describe(&self) -> String {
        format!("{} #{} of {} bytes", self.direction, self.seq, self.len)
    }

    /// Fails the transfer with `error` (used when it never reached an engine).
    pub(crate) fn fail(&self, error: Error) {
        self.finish(Err(error));
    }
}

impl LaneWork for Arc<Job> {
    #[inline]
    fn schedule(&self) -> Option<&Schedule> {
        Job::schedule(self)
    }

    #[inline]
    fn route(&self, chunk: &Chunk) -> Route {
        if self.staging.is_some() {
            Route::Staged
        } else if self.cuda_dst.is_some()
            && self
                .pieces
                .get(chunk.segment)
                .is_some_and(|p| p.memory.kind() == tcpx::MemoryKind::Cuda)
        {
            Route::CudaDst
        } else {
            Route::Direct
        }
    }

    #[inline]
    fn chunks_done(&self, n: u64) {
        Job::chunks_done(self, n);
    }

    fn fail(&self) {
        self.fail_with_link();
    }
}
