//! [`CopyPool`]: stream-ordered copies between unified addresses (device, peer memory
//! mapped through CUDA IPC, pinned host memory) on a fixed set of streams, whose completion
//! is observed through pooled events ([`PooledCopy`]).
//!
//! A list of many small pieces is one `cuMemcpyAsync` each through [`CopyPool::submit`]: at
//! a few µs of driver time per call, 1024 blocks of 16 KiB took 3–5 ms, well under the
//! copy engines' speed. [`CopyPool::submit_list`] moves such a list (device memory on both
//! sides) with one launch of the gather kernel of [`super::unpack`] instead: the pieces,
//! cut into [`FRAGMENT_BYTES`] fragments, are written to pinned metadata the kernel reads,
//! one warp per fragment.

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;

use super::buffer::PinnedHostBuffer;
use super::device::{CudaDevice, CudaEvent, CudaStream};
use super::driver::cuda_error;
use super::staging::FRAGMENT_BYTES;
use super::unpack::{put_meta, LaunchConfig, UnpackEntry, Unpacker, META_BYTES};
use crate::error::{Error, Result};

/// Most streams a [`CopyPool`] runs (and events one [`PooledCopy`] holds).
pub const MAX_COPY_STREAMS: usize = 8;

/// One copy between two unified addresses (device, mapped peer, or pinned host memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyPiece {
    /// Destination address.
    pub dst: u64,
    /// Source address.
    pub src: u64,
    /// Bytes.
    pub len: usize,
}

/// Copies of one operation are spread over several streams only when each stream gets at
/// least this much: below it, one stream's copy engine is as fast and costs one event.
pub const SPLIT_UNIT: usize = 4 << 20;

/// Lists of at least this many pieces go through the gather kernel
/// ([`CopyPool::submit_list`]); shorter ones cost no more as plain copies.
pub const LIST_MIN_PIECES: usize = 4;

/// Fragments one kernel-copied list may be cut into (its metadata buffer, 1 MiB, holds them):
/// a list of more goes through plain copies, which at that size (at least 1 GiB of blocks, or
/// 65536 pieces) are no slower.
pub const LIST_MAX_FRAGMENTS: usize = 1 << 16;

/// Launch shape of list copies: 8 warps per block, one fragment each (as the staging rings'
/// gathers).
const LIST_LAUNCH: LaunchConfig = LaunchConfig {
    threads_per_block: 256,
    frags_per_block: 8,
    max_blocks: 0,
};

/// A fixed set of non-blocking streams on one device and a free list of events, for
/// operations that are many small or few large device copies. Streams are created once;
/// events are reused (created only when every pooled one is in use), so submitting an
/// operation creates nothing in steady state. Cheap to share (`Arc`).
pub struct CopyPool {
    device: CudaDevice,
    streams: Vec<CudaStream>,
    events: Mutex<Vec<CudaEvent>>,
    next: AtomicUsize,
    /// The gather kernel for lists, loaded on the first list (`Err`: it could not be, and
    /// lists go one copy per piece), with the pinned metadata buffers of lists in flight.
    lists: Mutex<Option<std::result::Result<ListCopier, String>>>,
}

/// What [`CopyPool::submit_list`] launches with: the kernel on a stream of its own, free
/// metadata buffers, and the entries of the launch being planned (reused).
struct ListCopier {
    unpacker: Unpacker,
    free: Vec<PinnedHostBuffer>,
    entries: Vec<UnpackEntry>,
}

impl fmt::Debug for CopyPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CopyPool")
            .field("device", &self.device.ordinal())
            .field("streams", &self.streams.len())
            .finish()
    }
}

impl CopyPool {
    /// `streams` (1..=[`MAX_COPY_STREAMS`]) streams on `device`.
    pub fn new(device: &CudaDevice, streams: usize) -> Result<Arc<Self>> {
        if !(1..=MAX_COPY_STREAMS).contains(&streams) {
            return Err(Error::invalid(
                "CopyPool::new",
                format!("{streams} streams requested; 1..={MAX_COPY_STREAMS} allowed"),
            ));
        }
        let streams = (0..streams)
            .map(|_| CudaStream::new(device))
            .collect::<Result<Vec<_>>>()?;
        Ok(Arc::new(Self {
            device: device.clone(),
            streams,
            events: Mutex::new(Vec::new()),
            next: AtomicUsize::new(0),
            lists: Mutex::new(None),
        }))
    }

    /// The device the streams belong to.
    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    /// Number of streams.
    pub fn streams(&self) -> usize {
        self.streams.len()
    }

    /// Waits for everything queued on every stream so far.
    pub fn synchronize(&self) -> Result<()> {
        let mut first = Ok(());
        for s in &self.streams {
            if let Err(e) = s.synchronize() {
                first = first.and(Err(e));
            }
        }
        first
    }

    fn take_event(&self) -> Result<CudaEvent> {
        let pooled = self.events.lock().unwrap_or_else(|p| p.into_inner()).pop();
        match pooled {
            Some(e) => Ok(e),
            None => CudaEvent::new(&self.device, false),
        }
    }

    fn give_back(&self, events: impl Iterator<Item = CudaEvent>) {
        self.events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(events);
    }

    /// Queues `pieces` and returns at once; the [`PooledCopy`] says when all of them are done.
    /// An operation under [`SPLIT_UNIT`] per stream runs on one stream (chosen round-robin, so
    /// concurrent operations overlap); a larger one is cut into contiguous shares, one per
    /// stream, each stream's share in order. Nothing is allocated per piece.
    ///
    /// On an error nothing of the operation is left running: what was queued is waited for
    /// before the error returns.
    ///
    /// # Safety
    /// Every piece's source must stay readable and its destination writable, and no Rust
    /// reference may exist to a destination, until the returned copy reports done (or is
    /// dropped, which waits).
    pub unsafe fn submit(self: &Arc<Self>, pieces: &[CopyPiece]) -> Result<PooledCopy> {
        const API: &str = "CopyPool::submit";
        let total = pieces
            .iter()
            .try_fold(0usize, |acc, p| acc.checked_add(p.len))
            .ok_or_else(|| Error::invalid(API, "the pieces' lengths overflow"))?;
        let n = self.streams.len();
        let lanes = (total / SPLIT_UNIT).clamp(1, n);
        let first = self.next.fetch_add(lanes, Ordering::Relaxed) % n;
        let share = total.div_ceil(lanes).max(1);
        let mut copy = PooledCopy {
            pool: self.clone(),
            events: Default::default(),
            metas: None,
            kernel: false,
            done: false,
        };
        self.device.bind()?;
        // `share * lanes >= total`, so the lane index never passes `lanes - 1`.
        let mut lane = 0usize;
        let mut room = share;
        let mut used = 0usize;
        let mut queued = Ok(());
        'pieces: for p in pieces {
            let mut at = 0usize;
            while at < p.len {
                if room == 0 {
                    lane += 1;
                    room = share;
                }
                let take = (p.len - at).min(room);
                let stream = &self.streams[(first + lane) % n];
                let (dst, src) = (p.dst + at as u64, p.src + at as u64);
                // SAFETY: the caller guarantees every piece's ranges until this copy
                // completes, and `at + take <= p.len`.
                let rc = unsafe { sys::cuMemcpyAsync(dst, src, take, stream.raw()) };
                if rc != sys::CUresult::CUDA_SUCCESS {
                    queued = Err(cuda_error(
                        "cuMemcpyAsync",
                        rc,
                        format!(
                            "{take} bytes {src:#x} -> {dst:#x}, {}",
                            self.device.describe()
                        ),
                    ));
                    break 'pieces;
                }
                used = lane + 1;
                at += take;
                room -= take;
            }
        }
        // Every stream that got a copy gets an event, also after an error: the error path
        // must wait for what it queued.
        for l in 0..used.max(1) {
            let stream = &self.streams[(first + l) % n];
            let event = match self.take_event() {
                Ok(e) => e,
                Err(e) => {
                    let _ = self.synchronize();
                    return Err(e);
                }
            };
            if let Err(e) = event.record(stream) {
                self.give_back(std::iter::once(event));
                let _ = self.synchronize();
                return Err(e);
            }
            copy.events[l] = Some(event);
        }
        if let Err(e) = queued {
            copy.wait()?;
            return Err(e);
        }
        Ok(copy)
    }

    /// As [`submit`](Self::submit), for a list whose every source and destination is device
    /// memory this pool's device reaches (its own, or a peer's mapped over peer-to-peer): a
    /// list of [`LIST_MIN_PIECES`] pieces or more, cut into at most [`LIST_MAX_FRAGMENTS`]
    /// fragments, is copied by one launch of the gather kernel on a stream of its own (see
    /// the module docs); anything else, or a device whose kernel cannot load, goes through
    /// [`submit`](Self::submit). [`PooledCopy::by_kernel`] says which.
    ///
    /// # Safety
    /// As [`submit`](Self::submit); besides, every address must be device memory the kernel
    /// can read (sources) or write (destinations) from this pool's device.
    pub unsafe fn submit_list(self: &Arc<Self>, pieces: &[CopyPiece]) -> Result<PooledCopy> {
        let fragments: usize = pieces.iter().map(|p| p.len.div_ceil(FRAGMENT_BYTES)).sum();
        if pieces.len() < LIST_MIN_PIECES || fragments > LIST_MAX_FRAGMENTS || !list_kernel_on() {
            // SAFETY: forwarded from the caller.
            return unsafe { self.submit(pieces) };
        }
        let mut lists = self.lists.lock().unwrap_or_else(|p| p.into_inner());
        let copier = match lists.get_or_insert_with(|| ListCopier::new(&self.device)) {
            Ok(copier) => copier,
            Err(_) => {
                drop(lists);
                // SAFETY: forwarded from the caller.
                return unsafe { self.submit(pieces) };
            }
        };
        let mut metas = match copier.free.pop() {
            Some(m) => m,
            None => PinnedHostBuffer::new(&self.device, LIST_MAX_FRAGMENTS * META_BYTES)?,
        };
        let metas_dev = metas.device_ptr();
        plan_list(
            pieces,
            FRAGMENT_BYTES,
            metas_dev,
            metas.as_mut_slice(),
            &mut copier.entries,
        );
        let event = match self.take_event() {
            Ok(e) => e,
            Err(e) => {
                copier.free.push(metas);
                return Err(e);
            }
        };
        // SAFETY: each entry's metas were just written into `metas` (pinned, mapped), which
        // the returned copy keeps out of the free list until the event recorded below is seen
        // done; sources and destinations are the caller's device memory, valid and reachable
        // per the caller's promise until then, and each entry's bounce / dst extents are the
        // true extents of its fragments (`plan_list`).
        let queued = unsafe { copier.unpacker.enqueue(&copier.entries) }
            .and_then(|_| event.record(copier.unpacker.stream()));
        if let Err(e) = queued {
            // What was launched may still run: wait for it before the metadata is reused.
            let _ = copier.unpacker.stream().synchronize();
            copier.free.push(metas);
            self.give_back(std::iter::once(event));
            return Err(e);
        }
        let mut events: [Option<CudaEvent>; MAX_COPY_STREAMS] = Default::default();
        events[0] = Some(event);
        Ok(PooledCopy {
            pool: self.clone(),
            events,
            metas: Some(metas),
            kernel: true,
            done: false,
        })
    }

    /// Loads the list kernel and makes one metadata buffer now, so that the first
    /// [`submit_list`](Self::submit_list) pays neither. Whether lists will go through the
    /// kernel (false: its load failed, or `TCPX_IPC_LIST_KERNEL=0`).
    pub fn prepare_lists(&self) -> bool {
        if !list_kernel_on() {
            return false;
        }
        let mut lists = self.lists.lock().unwrap_or_else(|p| p.into_inner());
        match lists.get_or_insert_with(|| ListCopier::new(&self.device)) {
            Ok(copier) => {
                if copier.free.is_empty() {
                    match PinnedHostBuffer::new(&self.device, LIST_MAX_FRAGMENTS * META_BYTES) {
                        Ok(m) => copier.free.push(m),
                        Err(e) => {
                            tracing::debug!(target: "tcpx::cuda", "list metadata buffer not made ahead: {e}")
                        }
                    }
                }
                true
            }
            Err(_) => false,
        }
    }

    fn give_back_metas(&self, metas: PinnedHostBuffer) {
        if let Some(Ok(copier)) = self
            .lists
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_mut()
        {
            copier.free.push(metas);
        }
    }
}

/// The copies of one [`CopyPool::submit`]: one event per stream they ran on. Dropping it
/// before it reported done waits for the copies; its events go back to the pool.
pub struct PooledCopy {
    pool: Arc<CopyPool>,
    events: [Option<CudaEvent>; MAX_COPY_STREAMS],
    /// A kernel-copied list's metadata, which the kernel reads until the copy is done.
    metas: Option<PinnedHostBuffer>,
    /// The copies went through the gather kernel.
    kernel: bool,
    done: bool,
}

impl fmt::Debug for PooledCopy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PooledCopy")
            .field("device", &self.pool.device.ordinal())
            .field("events", &self.events.iter().flatten().count())
            .field("done", &self.done)
            .finish()
    }
}

impl PooledCopy {
    /// True once every copy completed (non-blocking: one `cuEventQuery` per stream not yet
    /// seen done). An error is the driver's (a copy faulted).
    pub fn is_done(&mut self) -> Result<bool> {
        if self.done {
            return Ok(true);
        }
        for slot in &mut self.events {
            if let Some(event) = slot {
                if !event.is_done()? {
                    return Ok(false);
                }
                let event = slot.take().expect("checked above");
                self.pool.give_back(std::iter::once(event));
            }
        }
        self.finished();
        Ok(true)
    }

    /// Every copy completed: the metadata buffer goes back to the pool.
    fn finished(&mut self) {
        self.done = true;
        if let Some(metas) = self.metas.take() {
            self.pool.give_back_metas(metas);
        }
    }

    /// The copies went through the gather kernel (one launch) rather than one copy per piece.
    pub fn by_kernel(&self) -> bool {
        self.kernel
    }

    /// Blocks until every copy completed.
    pub fn wait(&mut self) -> Result<()> {
        for slot in &mut self.events {
            if let Some(event) = slot {
                event.synchronize()?;
                let event = slot.take().expect("checked above");
                self.pool.give_back(std::iter::once(event));
            }
        }
        self.finished();
        Ok(())
    }
}

impl Drop for PooledCopy {
    fn drop(&mut self) {
        if !self.done {
            if let Err(e) = self.wait() {
                // The copies' fate is unknown: the events are not reused (they stay owned here
                // and are destroyed), and the error is reported.
                tracing::error!(target: "tcpx::cuda", "PooledCopy dropped, wait failed: {e}");
            }
        }
    }
}

/// Environment variable that turns list copies by kernel off (`0`): every list then goes one
/// copy per piece, as before the kernel (for comparing, or for a driver that misbehaves).
pub const LIST_KERNEL_ENV: &str = "TCPX_IPC_LIST_KERNEL";

fn list_kernel_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var(LIST_KERNEL_ENV).map_or(true, |v| v.trim() != "0"))
}

impl ListCopier {
    fn new(device: &CudaDevice) -> std::result::Result<Self, String> {
        let make = || -> Result<Self> {
            let mut unpacker = Unpacker::new(device)?;
            unpacker.set_config(LIST_LAUNCH)?;
            Ok(Self {
                unpacker,
                free: Vec::new(),
                entries: Vec::new(),
            })
        };
        make().map_err(|e| {
            tracing::warn!(target: "tcpx::cuda", "list copies without the gather kernel (one copy per piece): {e}");
            e.to_string()
        })
    }
}

/// The kernel's view of a list (pure, so that it is tested without a GPU): writes `pieces`,
/// cut at `fragment` bytes ([`FRAGMENT_BYTES`] for the pool's lists), as fragments into
/// `metas` (whose first byte the GPU sees at `metas_dev`) and the entries naming them into
/// `entries`. A fragment's source is an offset
/// (u32) from its entry's `bounce`, so consecutive pieces share an entry while their sources
/// span at most 4 GiB; each entry's `bounce` / `dst` are the lowest source / destination of
/// its fragments and its lengths their true extents, so the kernel's bounds checks hold.
/// Returns the fragments written (`metas` must hold them all).
pub(crate) fn plan_list(
    pieces: &[CopyPiece],
    fragment: usize,
    metas_dev: u64,
    metas: &mut [u8],
    entries: &mut Vec<UnpackEntry>,
) -> usize {
    entries.clear();
    let mut written = 0usize;
    let mut first = 0usize;
    while first < pieces.len() {
        // The longest run from `first` whose sources fit one u32 window.
        let (mut lo, mut hi) = (u64::MAX, 0u64);
        let (mut dlo, mut dhi) = (u64::MAX, 0u64);
        let mut end = first;
        while end < pieces.len() {
            let p = &pieces[end];
            let (l, h) = (lo.min(p.src), hi.max(p.src + p.len as u64));
            if end > first && h - l > u64::from(u32::MAX) {
                break;
            }
            (lo, hi) = (l, h);
            (dlo, dhi) = (dlo.min(p.dst), dhi.max(p.dst + p.len as u64));
            end += 1;
        }
        let start = written;
        for p in &pieces[first..end] {
            let mut at = 0usize;
            while at < p.len {
                let len = (p.len - at).min(fragment);
                // The source offset lies within the run's window: below 2^32.
                let src_off = (p.src + at as u64 - lo) as u32;
                put_meta(metas, written, src_off, len as u32, p.dst + at as u64 - dlo);
                written += 1;
                at += len;
            }
        }
        if written > start {
            entries.push(UnpackEntry {
                metas: metas_dev + (start * META_BYTES) as u64,
                count: (written - start) as u32,
                bounce: lo,
                bounce_len: hi - lo,
                dst: dlo,
                dst_len: dhi - dlo,
            });
        }
        first = end;
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pooled_copies_of_one_gpu() {
        if let Some(why) = super::super::skip_reason() {
            println!("{why}");
            return;
        }
        let gpu = CudaDevice::new(0).unwrap();
        let pool = CopyPool::new(&gpu, 4).unwrap();
        let src = gpu.alloc(12 << 20).unwrap();
        let dst = gpu.alloc(12 << 20).unwrap();
        let pattern: Vec<u8> = (0..12 << 20).map(|i: usize| (i % 251) as u8).collect();
        src.copy_from_host(0, &pattern).unwrap();
        let pieces = [
            CopyPiece {
                dst: dst.device_ptr(),
                src: src.device_ptr(),
                len: 5 << 20,
            },
            CopyPiece {
                dst: dst.device_ptr() + (5 << 20),
                src: src.device_ptr() + (5 << 20),
                len: 7 << 20,
            },
        ];
        // SAFETY: both buffers live until the wait below.
        let mut copy = unsafe { pool.submit(&pieces) }.unwrap();
        copy.wait().unwrap();
        assert!(copy.is_done().unwrap());
        assert_eq!(dst.to_vec().unwrap(), pattern);
        // Small copies reuse the pooled events.
        for _ in 0..100 {
            // SAFETY: both buffers live until the busy wait below sees the copy done.
            let mut c = unsafe { pool.submit(&pieces[..1]) }.unwrap();
            while !c.is_done().unwrap() {}
        }
        assert!(pool.events.lock().unwrap().len() <= MAX_COPY_STREAMS);
    }

    /// Decodes what `plan_list` wrote: (absolute src, absolute dst, len) per fragment, in
    /// order, after checking every fragment against its entry's extents.
    fn planned(pieces: &[CopyPiece]) -> (Vec<(u64, u64, usize)>, Vec<UnpackEntry>) {
        let mut metas = vec![0u8; LIST_MAX_FRAGMENTS * META_BYTES];
        let mut entries = Vec::new();
        let n = plan_list(pieces, FRAGMENT_BYTES, 0x1000, &mut metas, &mut entries);
        let mut out = Vec::new();
        let mut seen = 0usize;
        for e in &entries {
            let first = ((e.metas - 0x1000) as usize) / META_BYTES;
            assert_eq!(first, seen, "entries follow one another");
            for k in first..first + e.count as usize {
                let m = &metas[k * META_BYTES..(k + 1) * META_BYTES];
                let src_off = u32::from_ne_bytes(m[0..4].try_into().unwrap());
                let len = u32::from_ne_bytes(m[4..8].try_into().unwrap());
                let dst_off = u64::from_ne_bytes(m[8..16].try_into().unwrap());
                assert!(u64::from(src_off) + u64::from(len) <= e.bounce_len, "{e:?}");
                assert!(dst_off + u64::from(len) <= e.dst_len, "{e:?}");
                assert!(len >= 1 && len as usize <= FRAGMENT_BYTES);
                out.push((e.bounce + u64::from(src_off), e.dst + dst_off, len as usize));
            }
            seen += e.count as usize;
        }
        assert_eq!(seen, n);
        (out, entries)
    }

    proptest::proptest! {
        #[test]
        fn a_planned_list_copies_every_byte_of_every_piece_once(
            raw in proptest::collection::vec(
                (0u64..1 << 40, 0u64..1 << 40, 0usize..100_000), 0..40),
        ) {
            let pieces: Vec<CopyPiece> = raw
                .iter()
                .map(|&(src, dst, len)| CopyPiece { src: src + 1, dst: dst + 1, len })
                .collect();
            let (frags, entries) = planned(&pieces);
            // Fragments, in order, tile each piece from its start.
            let mut it = frags.iter();
            for p in &pieces {
                let mut at = 0usize;
                while at < p.len {
                    let &(src, dst, len) = it.next().expect("a fragment for every byte");
                    proptest::prop_assert_eq!((src, dst), (p.src + at as u64, p.dst + at as u64));
                    at += len;
                }
            }
            proptest::prop_assert!(it.next().is_none());
            for e in &entries {
                proptest::prop_assert!(e.bounce_len <= u64::from(u32::MAX) + FRAGMENT_BYTES as u64);
            }
        }
    }

    #[test]
    fn sources_far_apart_get_entries_of_their_own() {
        let gib = 1u64 << 30;
        let pieces = [
            CopyPiece {
                src: gib,
                dst: 8 * gib,
                len: 4096,
            },
            CopyPiece {
                src: 2 * gib,
                dst: 9 * gib,
                len: 4096,
            },
            CopyPiece {
                src: 7 * gib,
                dst: 10 * gib,
                len: 20_000,
            },
            CopyPiece {
                src: 7 * gib - 100,
                dst: 11 * gib,
                len: 100,
            },
        ];
        let (frags, entries) = planned(&pieces);
        assert_eq!(frags.len(), 5);
        assert_eq!(entries.len(), 2);
        assert_eq!((entries[0].bounce, entries[0].count), (gib, 2));
        assert_eq!((entries[1].bounce, entries[1].count), (7 * gib - 100, 3));
        assert_eq!(entries[1].dst, 10 * gib);
    }

    #[test]
    fn a_list_of_small_blocks_moves_in_one_launch() {
        if let Some(why) = super::super::skip_reason() {
            println!("{why}");
            return;
        }
        let gpu = CudaDevice::new(0).unwrap();
        let pool = CopyPool::new(&gpu, 4).unwrap();
        let (n, block) = (1024usize, 16usize << 10);
        let src = gpu.alloc(2 * n * block).unwrap();
        let dst = gpu.alloc(2 * n * block).unwrap();
        let pattern: Vec<u8> = (0..2 * n * block).map(|i| (i % 251) as u8).collect();
        src.copy_from_host(0, &pattern).unwrap();
        dst.copy_from_host(0, &vec![0u8; 2 * n * block]).unwrap();
        // Block i of the source (every other slot) goes to slot n - 1 - i of the destination,
        // one byte off alignment for a third of them.
        let pieces: Vec<CopyPiece> = (0..n)
            .map(|i| {
                let skew = if i % 3 == 0 { 1 } else { 0 };
                CopyPiece {
                    src: src.device_ptr() + (2 * i * block) as u64 + skew,
                    dst: dst.device_ptr() + (2 * (n - 1 - i) * block) as u64,
                    len: block - 1,
                }
            })
            .collect();
        // SAFETY: both buffers are device memory of this GPU and live until the wait below.
        let mut copy = unsafe { pool.submit_list(&pieces) }.unwrap();
        copy.wait().unwrap();
        let loaded = matches!(pool.lists.lock().unwrap().as_ref(), Some(Ok(_)));
        assert_eq!(copy.by_kernel(), loaded, "a loaded kernel copies lists");
        let got = dst.to_vec().unwrap();
        for (i, p) in pieces.iter().enumerate() {
            let s = (p.src - src.device_ptr()) as usize;
            let d = (p.dst - dst.device_ptr()) as usize;
            assert!(got[d..d + p.len] == pattern[s..s + p.len], "block {i}");
        }
        println!("list copy by kernel: {loaded}");
        // Metadata buffers are reused.
        for _ in 0..20 {
            // SAFETY: as above.
            let mut c = unsafe { pool.submit_list(&pieces) }.unwrap();
            c.wait().unwrap();
        }
        let lists = pool.lists.lock().unwrap();
        if let Some(Ok(copier)) = lists.as_ref() {
            assert_eq!(copier.free.len(), 1);
        }
    }
}
