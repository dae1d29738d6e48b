//! Packing small scattered blocks: a one-sided batch of many small host-memory blocks travels
//! as one contiguous transfer through pack buffers, instead of one plugin request per block.
//!
//! - The data sender decides ([`worth_packing`] under [`crate::Config::pack_below`], or
//!   [`crate::Config::pack_staged_below`] when a side is staged: [`PackSide::threshold`])
//!   and its engines gather the blocks into a pack buffer, chunk by chunk, as they send; the
//!   flag travels in its marker (`WriteRequest` for writes; for reads the initiator *offers*
//!   in `ReadRequest` and the target decides in `ReadData`), so both sides derive the same
//!   contiguous schedule ([`packed_schedule`]).
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
//!   link (the registration is cached on the link by region). A batch leases only the
//!   [`PACK_SLICE`]s its bytes need, consecutive in one buffer, so one buffer carries 32
//!   lists of 32 × 4 KiB in flight at once; a batch past a buffer takes whole free buffers
//!   and slices of one more for the rest ([`PACKED_HOST_MAX_BYTES`] at most), all or none.
//!   A sender finding no room falls back to the unpacked transfer (counted in
//!   [`PackStats::fallbacks`]); a receiver must follow the sender, so it takes one-off space
//!   past the pool ([`PackStats::overflows`]): kept buffers while they last
//!   ([`super::spare`]), else made to measure, and no more than [`ONE_OFF_MAX_BYTES`] at
//!   once ([`PackPool::overflow_room`]).
//! - Space goes back to the pool only once the job using it finished: a sender's lease is
//!   held next to its job ([`PackPool::hold`]) and reclaimed when the job is done; a lease of
//!   a job that may still run (the connection failed) is poisoned and never reused.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use tcpx::SharedMemory;

use crate::link::Link;

use crate::carrier::Carrier;
use crate::engine::job::{HostParts, Job, Pieces};
use crate::error::{Direction, Error, Result};
use crate::registry::Region;
use crate::schedule::Schedule;

/// Bytes of one pack buffer (1024 blocks of 4 KiB), and the most a two-sided batch carries.
/// A packed one-sided transfer of host memory past it spans several buffers of its pool, up
/// to [`PACKED_HOST_MAX_BYTES`].
pub const PACK_BYTES: u64 = super::spare::BUFFER_BYTES as u64;

/// The most a packed one-sided transfer may carry into or out of host memory (both sides know
/// it: a packed request past it into host memory is a protocol violation): sixteen pack
/// buffers. A side packs what spans as many buffers as its pool may hold
/// ([`crate::Config::pack_buffers`], eight by default: 32 MiB); a receiver whose pool has no
/// room follows with a one-off buffer, as for one buffer's worth. Staged memory has no cap.
///
/// Why several buffers: a KV list of 1024 × 16 KiB blocks in GPU memory on one side and host
/// memory on the other (a cache in host memory serving GPUs, or the other way round) could
/// not pack while a host side was capped at one buffer, and moved at a quarter of the same
/// list between two GPUs (docs/RESULTS.md, thirty-seventh session).
pub const PACKED_HOST_MAX_BYTES: u64 = 16 * PACK_BYTES;

/// The most one-off space past its pool a receiver holds for a peer's packed transfers at
/// once: what the largest pool a peer may have ([`crate::config::MAX_PACK_BUFFERS`] buffers)
/// has in flight (see [`PackPool::overflow_room`]).
pub(crate) const ONE_OFF_MAX_BYTES: u64 = crate::config::MAX_PACK_BUFFERS as u64 * PACK_BYTES;

/// Whether a packed stream of `len` bytes cut at `cut` bytes may lie in several pack buffers:
/// every buffer boundary (a multiple of [`PACK_BYTES`]) must fall on a chunk boundary, so
/// that the side's schedule over its buffers cuts the stream exactly as the peer's schedule
/// over one contiguous stream does. True for any length within one buffer.
pub(crate) fn spans_buffers(len: u64, cut: u32) -> bool {
    len <= PACK_BYTES || (cut > 0 && PACK_BYTES % u64::from(cut) == 0)
}

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
    /// The packing threshold of a batch between `a` and `b` under `config`: a batch touching
    /// staged memory on either side pays a ring copy per block unpacked, where packed its
    /// chunks are gathered or scattered as one copy list each, so it packs larger blocks
    /// ([`crate::Config::pack_staged_below`]) than a batch of host memory on both sides, whose
    /// pack costs a memcpy the unpacked path does not make ([`crate::Config::pack_below`]).
    pub(crate) fn threshold(a: PackSide, b: PackSide, config: &crate::Config) -> u32 {
        if PackSide::either_staged(a, b) {
            config.pack_staged_below
        } else {
            config.pack_below
        }
    }

    /// Whether either side of a batch is staged: each unpacked piece then costs a ring copy,
    /// which both the packing threshold and the lone-batch rule weigh.
    pub(crate) fn either_staged(a: PackSide, b: PackSide) -> bool {
        a == PackSide::Staged || b == PackSide::Staged
    }

    /// The largest batch both sides can pack, `host` when either side is host memory (what
    /// its pack buffers hold: see [`PACKED_HOST_MAX_BYTES`]).
    pub(crate) fn cap(a: PackSide, b: PackSide, host: u64) -> u64 {
        if a == PackSide::Host || b == PackSide::Host {
            host
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

/// Bytes of one slice of a pack buffer: leases are cut in whole slices. A batch takes as
/// many consecutive slices of one buffer as its bytes need, so a buffer carries many small
/// batches at once. Leasing whole buffers, eight buffers let eight batches of 32 × 4 KiB
/// (128 KiB each) be in flight: at depth 32 the rest went unpacked, one plugin request per
/// block, or, on the receiving side, through one-off 4 MiB buffers (`tcpx-bench kv`, two
/// processes, 32 × 4 KiB writes at depth 32: 0.44–0.48 GB/s, p50 9 ms, against 11–12 GB/s
/// for the same bytes contiguous; docs/RESULTS.md, thirty-second session).
pub const PACK_SLICE: u64 = 64 << 10;

/// Slices per pack buffer: one bit each of [`Buffer::used`].
const SLICES: u32 = (PACK_BYTES / PACK_SLICE) as u32;
const _: () = assert!(SLICES == u64::BITS && PACK_BYTES % PACK_SLICE == 0);

/// Slices a batch of `len` bytes takes (at least one).
fn slices_for(len: u64) -> u32 {
    len.div_ceil(PACK_SLICE).max(1) as u32
}

/// Batches of `bytes` (at most [`PACK_BYTES`]) one pack buffer holds at once, each in the
/// whole [`PACK_SLICE`]s it takes (at least one batch): what a window of batches in flight
/// needs of [`crate::Config::pack_buffers`].
pub fn batches_per_pack_buffer(bytes: u64) -> usize {
    (SLICES / slices_for(bytes.min(PACK_BYTES))) as usize
}

/// The bits of `count` slices from slice `first` on.
fn slice_bits(first: u32, count: u32) -> u64 {
    let run = if count >= u64::BITS {
        u64::MAX
    } else {
        (1u64 << count) - 1
    };
    run << first
}

/// The first slice of the lowest run of `count` free slices in `used`, if any.
fn free_run(used: u64, count: u32) -> Option<u32> {
    if count == 0 || count > SLICES {
        return None;
    }
    (0..=SLICES - count).find(|&first| used & slice_bits(first, count) == 0)
}

/// One pooled pack buffer and which of its slices are leased.
struct Buffer {
    region: Region,
    /// Leased (or poisoned) slices, one bit each.
    used: u64,
}

struct PoolInner {
    /// The pooled buffers, in the order they were made (a lease names its buffer by index;
    /// buffers leave only with the pool).
    buffers: Mutex<Vec<Buffer>>,
    /// Pooled buffers alive or being made (at most the pool's cap).
    pooled: AtomicUsize,
}

impl PoolInner {
    fn buffers(&self) -> MutexGuard<'_, Vec<Buffer>> {
        self.buffers.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for PoolInner {
    fn drop(&mut self) {
        let buffers = std::mem::take(self.buffers.get_mut().unwrap_or_else(|p| p.into_inner()));
        for buffer in buffers {
            // Nothing leased or poisoned in it, nothing in flight, and no longer the pool's:
            // the next connection may have it. Its old registrations, if any, are released
            // with their link.
            if buffer.used == 0 && buffer.region.memory().in_flight() == 0 {
                super::spare::keep(buffer.region.memory().clone());
            }
        }
    }
}

/// One connection's pack buffers (see the module docs).
pub(crate) struct PackPool {
    cap: usize,
    inner: Arc<PoolInner>,
    /// Bytes of one-off space past the pool outstanding ([`PackPool::for_receiver`]).
    one_off: Arc<AtomicU64>,
    /// Senders' leases waiting for their job to finish.
    held: Mutex<Vec<(Arc<Job>, PackLease)>>,
    counters: Counters,
}

/// Where a pooled lease lies: which buffer of which pool, and its slices (kept small: a
/// lease travels inside the control loop's items).
struct Slices {
    pool: Weak<PoolInner>,
    buffer: u32,
    first: u8,
    count: u8,
}

/// One stretch of a lease: `len` bytes of one buffer, at its slices' start (a one-off
/// buffer: at 0).
struct Span {
    region: Region,
    slices: Option<Slices>,
    len: u64,
    /// One-off space past the pool: the pool's count of such bytes outstanding, and this
    /// span's share of it, given back on release.
    one_off: Option<(Arc<AtomicU64>, u64)>,
}

impl Span {
    fn offset(&self) -> usize {
        self.slices
            .as_ref()
            .map_or(0, |s| (u64::from(s.first) * PACK_SLICE) as usize)
    }

    /// Hands the span's slices back to its pool; one-off space goes out of the pool's count,
    /// and a one-off whole buffer to the process's kept ones ([`super::spare`]) once nothing
    /// is in flight on it.
    fn release(&mut self) {
        if let Some((outstanding, bytes)) = self.one_off.take() {
            outstanding.fetch_sub(bytes, Ordering::AcqRel);
            if self.region.memory().in_flight() == 0 {
                // Kept only if it is a whole buffer.
                super::spare::keep(self.region.memory().clone());
            }
        }
        let Some(slices) = self.slices.take() else {
            return;
        };
        let Some(pool) = slices.pool.upgrade() else {
            return;
        };
        let mut buffers = pool.buffers();
        if let Some(buffer) = buffers.get_mut(slices.buffer as usize) {
            buffer.used &= !slice_bits(u32::from(slices.first), u32::from(slices.count));
        }
    }
}

/// Pack space in use: the packed stream in order, one span per buffer — one span for a batch
/// within a pack buffer, whole buffers and then the rest for a larger one. On drop, unless
/// poisoned, its slices go back to the pool and its one-off whole buffers to the kept ones
/// (other one-off memory is freed).
pub(crate) struct PackLease {
    spans: smallvec::SmallVec<[Span; 1]>,
    poisoned: bool,
}

impl PackLease {
    /// The stream's stretches in order: the buffer, where the stretch starts in it, and its
    /// bytes.
    pub(crate) fn spans(&self) -> impl Iterator<Item = (&Region, usize, u64)> + '_ {
        self.spans.iter().map(|s| (&s.region, s.offset(), s.len))
    }

    /// Bytes of each stretch, in stream order: the lengths a schedule of the lease cuts.
    pub(crate) fn span_lens(&self) -> smallvec::SmallVec<[u64; 1]> {
        self.spans.iter().map(|s| s.len).collect()
    }

    /// Never reuse this space: a job that may still post on it is not known to be done.
    pub(crate) fn poison(mut self) {
        self.poisoned = true;
    }
}

impl Drop for PackLease {
    fn drop(&mut self) {
        // A poisoned lease keeps its slices: the job that may still use them holds the
        // buffer's memory alive, and the pool never hands them out again.
        if self.poisoned {
            return;
        }
        // The lease's job finished (a sender's lease is held until then, a receiver's until
        // its item was handled): the plugin is done with these bytes. A request's hold on
        // the memory, which the engine drops just after, only counts it in flight; other
        // batches' requests use other slices of the same buffer at the same time anyway.
        for span in &mut self.spans {
            span.release();
        }
    }
}

impl PackPool {
    /// An empty pool of at most `cap` buffers.
    pub(crate) fn new(cap: usize) -> Self {
        Self {
            cap,
            inner: Arc::new(PoolInner {
                buffers: Mutex::new(Vec::new()),
                pooled: AtomicUsize::new(0),
            }),
            held: Mutex::new(Vec::new()),
            one_off: Arc::new(AtomicU64::new(0)),
            counters: Counters::default(),
        }
    }

    /// Puts a kept buffer ([`super::spare`], its pages faulted in) into the pool while it is
    /// empty, and returns its region, for the caller to register on the connection's comms
    /// with the regions it registers anyway: the connection's first packed transfer then
    /// finds it ready. Registered by that transfer instead, each side waited 50–250 µs for
    /// its engines, which sleep by then (docs/RESULTS.md, thirty-eighth session). `None`
    /// (nothing done) when the pool has a buffer already, may hold none, or no buffer is
    /// kept: no memory is made for a connection that may never pack.
    pub(crate) fn ready_first(&self) -> Option<Region> {
        if self.cap == 0 {
            return None;
        }
        self.inner
            .pooled
            .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire)
            .ok()?;
        let Some(memory) = super::spare::take() else {
            self.inner.pooled.fetch_sub(1, Ordering::AcqRel);
            return None;
        };
        let region = Region::new(memory);
        self.counters.buffers.fetch_add(1, Ordering::Relaxed);
        self.inner.buffers().push(Buffer {
            region: region.clone(),
            used: 0,
        });
        Some(region)
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

    /// Pooled space for `len` bytes (at most [`PACKED_HOST_MAX_BYTES`]): within a pack
    /// buffer, free slices of one; past it, whole free buffers and slices of one more for the
    /// rest. `None` (nothing leased) when the pool at its cap has no room for all of it;
    /// buffers it grew by on the way stay in the pool, free for the next batch.
    fn pooled(&self, len: u64) -> Result<Option<PackLease>> {
        if len > PACKED_HOST_MAX_BYTES {
            return Err(Error::Internal(format!(
                "a packed batch of {len} bytes is larger than {PACKED_HOST_MAX_BYTES} bytes"
            )));
        }
        self.reclaim();
        let mut lease = PackLease {
            spans: smallvec::SmallVec::new(),
            poisoned: false,
        };
        let mut left = len;
        loop {
            let part = left.min(PACK_BYTES);
            // Not all of it: dropping `lease` hands back the spans already taken.
            let Some(span) = self.span(part)? else {
                return Ok(None);
            };
            lease.spans.push(span);
            left -= part;
            if left == 0 {
                return Ok(Some(lease));
            }
        }
    }

    /// Pooled space for `len` bytes of one buffer (at most [`PACK_BYTES`]).
    fn span(&self, len: u64) -> Result<Option<Span>> {
        let count = slices_for(len);
        {
            let mut buffers = self.inner.buffers();
            for (index, buffer) in buffers.iter_mut().enumerate() {
                if let Some(first) = free_run(buffer.used, count) {
                    buffer.used |= slice_bits(first, count);
                    return Ok(Some(self.lease(&buffer.region, index, first, count, len)));
                }
            }
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
        // Made outside the lock: other batches take slices of the buffers there meanwhile.
        let region = match allocate(PACK_BYTES as usize) {
            Ok(region) => region,
            Err(e) => {
                self.inner.pooled.fetch_sub(1, Ordering::AcqRel);
                return Err(e);
            }
        };
        self.counters.buffers.fetch_add(1, Ordering::Relaxed);
        let mut buffers = self.inner.buffers();
        buffers.push(Buffer {
            region: region.clone(),
            used: slice_bits(0, count),
        });
        Ok(Some(self.lease(&region, buffers.len() - 1, 0, count, len)))
    }

    fn lease(&self, region: &Region, buffer: usize, first: u32, count: u32, len: u64) -> Span {
        // A pool holds at most `cap` buffers (a handful) of 64 slices.
        Span {
            region: region.clone(),
            slices: Some(Slices {
                pool: Arc::downgrade(&self.inner),
                buffer: buffer as u32,
                first: first as u8,
                count: count as u8,
            }),
            len,
            one_off: None,
        }
    }

    /// Space for a data sender's `len` bytes (or a read initiator's, offering to receive
    /// packed), or `None` when the pool has none: the caller goes unpacked. Past a pack
    /// buffer the caller checked [`spans_buffers`] (its cap says so: `Rma::host_pack_cap`).
    pub(crate) fn for_sender(&self, len: u64) -> Result<Option<PackLease>> {
        let lease = self.pooled(len)?;
        if lease.is_none() {
            self.counters.fallbacks.fetch_add(1, Ordering::Relaxed);
        }
        Ok(lease)
    }

    /// Space for a receiver's `len` bytes (at most [`PACKED_HOST_MAX_BYTES`]), which must
    /// follow a packing sender: pooled if the pool has room or may grow (in several buffers
    /// only when `spans` allows it: [`spans_buffers`]), else one-off space past the pool.
    ///
    /// One-off space is taken, a buffer's worth at a time, from the process's kept buffers
    /// ([`super::spare`]) while they last, and whole buffers go back there after use, so that
    /// their pages are faulted in once, not per batch: a sender's own pool bounds what it has
    /// in flight, but a staged sender has none, and four 32 MiB lists in flight from GPU
    /// memory into host memory overflowed a pool of eight buffers by 24 at a time. The rest
    /// is made to measure (a batch past a buffer that buffers may not hold, `spans` false,
    /// in one piece) and freed after use. [`Self::overflow_room`] bounds what a peer can make
    /// this side hold so.
    pub(crate) fn for_receiver(&self, len: u64, spans: bool) -> Result<PackLease> {
        if len > PACKED_HOST_MAX_BYTES {
            return Err(Error::Internal(format!(
                "a packed batch of {len} bytes is larger than {PACKED_HOST_MAX_BYTES} bytes"
            )));
        }
        // Within a buffer, or in several that hold whole chunks.
        let splits = len <= PACK_BYTES || spans;
        if splits {
            if let Some(lease) = self.pooled(len)? {
                return Ok(lease);
            }
        }
        self.counters.overflows.fetch_add(1, Ordering::Relaxed);
        let mut lease = PackLease {
            spans: smallvec::SmallVec::new(),
            poisoned: false,
        };
        let piece = if splits { PACK_BYTES } else { len };
        let mut left = len;
        loop {
            let part = left.min(piece);
            let kept = if part <= PACK_BYTES {
                super::spare::take()
            } else {
                None
            };
            let region = match kept {
                Some(memory) => Region::new(memory),
                // At most PACKED_HOST_MAX_BYTES (checked above): it fits a usize.
                None => fresh(part.max(1) as usize)?,
            };
            // Counted as it is made: dropping the lease (on an error too) gives back what
            // its spans counted.
            self.one_off.fetch_add(part, Ordering::AcqRel);
            lease.spans.push(Span {
                region,
                slices: None,
                len: part,
                one_off: Some((self.one_off.clone(), part)),
            });
            left -= part;
            if left == 0 {
                return Ok(lease);
            }
        }
    }

    /// Whether `len` more bytes of one-off space, should this pool have no room for them,
    /// keep this side within [`ONE_OFF_MAX_BYTES`]. A peer keeps to its own pool (a staged
    /// one to a pool's worth), so more than that outstanding past this side's pool is a
    /// peer that would have it hold memory without bound: the target refuses it as a
    /// protocol violation.
    pub(crate) fn overflow_room(&self, len: u64) -> bool {
        self.one_off
            .load(Ordering::Acquire)
            .checked_add(len)
            .is_some_and(|total| total <= ONE_OFF_MAX_BYTES)
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
        while self
            .inner
            .pooled
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < count.min(self.cap)).then_some(n + 1)
            })
            .is_ok()
        {
            match allocate(PACK_BYTES as usize) {
                Ok(region) => {
                    self.counters.buffers.fetch_add(1, Ordering::Relaxed);
                    self.inner.buffers().push(Buffer {
                        region: region.clone(),
                        used: 0,
                    });
                    made.push(region);
                }
                Err(e) => {
                    self.inner.pooled.fetch_sub(1, Ordering::AcqRel);
                    return Err(e);
                }
            }
        }
        made.iter().try_for_each(&mut prepare)?;
        Ok(self.inner.pooled.load(Ordering::Acquire))
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

/// Host memory of `len` bytes for packing: a whole buffer kept ready when one is asked for
/// and there ([`super::spare`]), else fresh.
fn allocate(len: usize) -> Result<Region> {
    if len == PACK_BYTES as usize {
        if let Some(memory) = super::spare::take() {
            return Ok(Region::new(memory));
        }
    }
    fresh(len)
}

/// New host memory of `len` bytes for packing: in huge pages from [`tcpx::HUGE_PAGE`] on
/// (see [`tcpx::HostBuffer::in_huge_pages`]: its first touch, in the transfer that needs it,
/// is then four times faster).
fn fresh(len: usize) -> Result<Region> {
    let memory = if len >= tcpx::HUGE_PAGE {
        SharedMemory::host_in_huge_pages(len)
    } else {
        SharedMemory::host(len)
    }
    .map_err(|e| Error::Internal(format!("cannot allocate a pack buffer: {e}")))?;
    Ok(Region::new(memory))
}

/// Bytes of writes a staged side has in flight packed into host memory (see
/// [`PackCredits::take`]).
#[derive(Debug, Default)]
pub(crate) struct PackCredits(Arc<AtomicU64>);

impl PackCredits {
    /// Credit for a packed write of `len` bytes while no more than `cap` are in flight, or
    /// `None` (the write goes unpacked). A host sender is bounded by its pool: it packs only
    /// what its free buffers hold. A staged sender gathers through its ring slots and has no
    /// pool, so without this bound it packed every list in flight, and the host target,
    /// whose pool holds what a host sender's does, followed past it in one-off buffers:
    /// four 32 MiB lists of 64 KiB GPU blocks in flight into host memory moved at 9.7–10.0
    /// GB/s against 17.2–18.4 unpacked (docs/RESULTS.md, thirty-seventh session). So a staged
    /// side keeps to what the target's pool holds if configured as its own.
    pub(crate) fn take(&self, len: u64, cap: u64) -> Option<PackCredit> {
        self.0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                n.checked_add(len).filter(|&total| total <= cap)
            })
            .ok()
            .map(|_| PackCredit {
                credits: self.0.clone(),
                len,
            })
    }

    /// Bytes in flight.
    #[cfg(test)]
    fn in_flight(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }
}

/// A packed write's share of [`PackCredits`], given back when dropped (with its pending
/// operation: answered, failed or timed out).
#[derive(Debug)]
pub(crate) struct PackCredit {
    credits: Arc<AtomicU64>,
    len: u64,
}

impl Drop for PackCredit {
    fn drop(&mut self) {
        self.credits.fetch_sub(self.len, Ordering::AcqRel);
    }
}

/// The job pieces of `lease`: its stretches in stream order, registered for `direction`.
pub(crate) fn lease_pieces(
    carrier: &Carrier,
    lease: &PackLease,
    direction: Direction,
) -> Result<Pieces> {
    lease
        .spans()
        .map(|(region, offset, len)| carrier.region_piece(region, offset, len, direction, false))
        .collect()
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

    impl PackLease {
        /// The buffer of the first stretch.
        fn region(&self) -> &Region {
            &self.spans[0].region
        }

        /// Where the first stretch starts in its buffer.
        fn offset(&self) -> usize {
            self.spans[0].offset()
        }
    }

    #[test]
    fn a_kept_buffer_is_readied_into_an_empty_pool_only_and_serves_its_first_lease() {
        assert!(
            PackPool::new(0).ready_first().is_none(),
            "a pool that holds none"
        );
        let pool = PackPool::new(2);
        // The kept buffers are the process's and other tests take them: keep one and try
        // until this pool gets one.
        let readied = (0..100)
            .find_map(|_| {
                super::super::spare::keep(SharedMemory::host(PACK_BYTES as usize).unwrap());
                pool.ready_first()
            })
            .expect("a kept buffer readied");
        assert_eq!(readied.len(), PACK_BYTES as usize);
        assert_eq!(pool.stats().buffers, 1);
        assert!(pool.ready_first().is_none(), "only into an empty pool");
        // The first lease takes the readied buffer: nothing new is made.
        let lease = pool.for_sender(64 << 10).unwrap().expect("a lease");
        assert!(lease.region().memory().same_as(readied.memory()));
        assert_eq!(pool.stats().buffers, 1);
    }

    #[test]
    fn staged_memory_on_either_side_takes_the_staged_threshold() {
        let config = crate::Config::builder()
            .pack_below(32 << 10)
            .pack_staged_below(512 << 10)
            .build()
            .unwrap();
        use PackSide::{Host, Staged};
        assert_eq!(PackSide::threshold(Host, Host, &config), 32 << 10);
        for (a, b) in [(Host, Staged), (Staged, Host), (Staged, Staged)] {
            assert_eq!(PackSide::threshold(a, b, &config), 512 << 10, "{a:?} {b:?}");
        }
        // 64 × 64 KiB: a host list goes unpacked, a staged one packs.
        let (total, runs) = (4 << 20, 64);
        assert!(!worth_packing(
            total,
            runs,
            PackSide::threshold(Host, Host, &config),
            PACK_BYTES
        ));
        assert!(worth_packing(
            total,
            runs,
            PackSide::threshold(Host, Staged, &config),
            PACK_BYTES
        ));
    }

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
        let cap = PackSide::cap(Staged, Staged, PACKED_HOST_MAX_BYTES);
        // A KV list of 1024 × 16 KiB GPU blocks: packed, though 4 × a pack buffer.
        assert!(worth_packing(16 << 20, 1024, 64 << 10, cap));
        assert!(
            !worth_packing(16 << 20, 64, 64 << 10, cap),
            "256 KiB blocks"
        );
        for (a, b) in [(Host, Staged), (Staged, Host), (Host, Host)] {
            assert_eq!(PackSide::cap(a, b, PACK_BYTES), PACK_BYTES, "{a:?} / {b:?}");
            assert!(!worth_packing(
                16 << 20,
                1024,
                64 << 10,
                PackSide::cap(a, b, PACK_BYTES)
            ));
            // A host side whose buffers hold whole chunks packs across several.
            assert!(worth_packing(
                16 << 20,
                1024,
                64 << 10,
                PackSide::cap(a, b, PACKED_HOST_MAX_BYTES)
            ));
        }
    }

    #[test]
    fn a_full_pool_says_so_and_refills_on_drop() {
        let pool = PackPool::new(1);
        let whole = pool.for_sender(PACK_BYTES).unwrap().expect("first buffer");
        assert!(pool.for_sender(1).unwrap().is_none(), "every slice leased");
        let overflow = pool.for_receiver(4096, false).unwrap();
        assert_eq!(overflow.offset(), 0);
        assert!(
            [4096, PACK_BYTES as usize].contains(&overflow.region().len()),
            "one-off space is a kept buffer, or one of the batch's size"
        );
        assert_eq!(overflow.span_lens().as_slice(), [4096]);
        drop(overflow);
        drop(whole);
        let again = pool
            .for_sender(PACK_BYTES)
            .unwrap()
            .expect("returned slices");
        again.poison();
        assert!(
            pool.for_sender(1).unwrap().is_none(),
            "a poisoned lease's slices are never handed out again"
        );
        let s = pool.stats();
        assert_eq!((s.fallbacks, s.overflows, s.buffers), (2, 1, 1));
        assert!(
            pool.for_sender(PACKED_HOST_MAX_BYTES + 1).is_err(),
            "past the most a packed transfer carries"
        );
    }

    #[test]
    fn a_batch_past_a_buffer_takes_whole_buffers_or_nothing() {
        let pool = PackPool::new(4);
        let ten = pool
            .for_sender(10 << 20)
            .unwrap()
            .expect("three buffers of four");
        let spans: Vec<(usize, u64)> = ten.spans().map(|(_, off, len)| (off, len)).collect();
        assert_eq!(spans, [(0, PACK_BYTES), (0, PACK_BYTES), (0, 2 << 20)]);
        let regions: Vec<&Region> = ten.spans().map(|(r, _, _)| r).collect();
        assert!(
            !regions[0].memory().same_as(regions[1].memory())
                && !regions[1].memory().same_as(regions[2].memory()),
            "one buffer per stretch"
        );
        assert_eq!(
            ten.span_lens().as_slice(),
            [PACK_BYTES, PACK_BYTES, 2 << 20]
        );
        // 8 MiB needs two whole buffers: the pool grows to its cap (one) and has no second,
        // so nothing is kept — the new buffer's space is free for the next batch.
        assert!(pool.for_sender(8 << 20).unwrap().is_none());
        let whole = pool
            .for_sender(PACK_BYTES)
            .unwrap()
            .expect("the fourth buffer");
        assert_eq!(pool.stats().buffers, 4);
        // The rest of the third buffer still holds a small batch.
        let small = pool
            .for_sender(1 << 20)
            .unwrap()
            .expect("slices after 2 MiB");
        assert_eq!(small.offset(), 2 << 20);
        drop((whole, small));
        drop(ten);
        let again = pool
            .for_sender(16 << 20)
            .unwrap()
            .expect("every buffer free");
        assert_eq!(again.spans().count(), 4);
        drop(again);
        // A receiver follows a sender past its pool with one-off whole buffers, or with one
        // buffer of the batch's size where its buffers may not hold whole chunks.
        let held = pool
            .for_sender(16 << 20)
            .unwrap()
            .expect("every buffer free");
        let overflow = pool.for_receiver(10 << 20, true).unwrap();
        let spans: Vec<(usize, u64)> = overflow.spans().map(|(_, o, l)| (o, l)).collect();
        assert_eq!(spans, [(0, PACK_BYTES), (0, PACK_BYTES), (0, 2 << 20)]);
        assert!(!pool.overflow_room(ONE_OFF_MAX_BYTES - (10 << 20) + 1));
        assert!(pool.overflow_room(ONE_OFF_MAX_BYTES - (10 << 20)));
        drop(overflow);
        assert!(
            pool.overflow_room(ONE_OFF_MAX_BYTES),
            "given back on release"
        );
        drop(held);
        let refused = pool.for_receiver(10 << 20, false).unwrap();
        let spans: Vec<(usize, u64)> = refused.spans().map(|(_, o, l)| (o, l)).collect();
        assert_eq!(spans, [(0, 10 << 20)], "buffers must not split the chunks");
        assert_eq!(refused.region().len(), 10 << 20);
        let s = pool.stats();
        assert_eq!((s.fallbacks, s.overflows), (1, 2));
    }

    #[test]
    fn credits_bound_the_bytes_in_flight_and_come_back_on_drop() {
        let credits = PackCredits::default();
        let a = credits.take(16 << 20, 32 << 20).expect("room");
        let b = credits.take(16 << 20, 32 << 20).expect("room");
        assert!(credits.take(1, 32 << 20).is_none(), "full");
        drop(a);
        assert_eq!(credits.in_flight(), 16 << 20);
        let c = credits.take(8 << 20, 32 << 20).expect("room again");
        drop((b, c));
        assert_eq!(credits.in_flight(), 0);
        assert!(credits.take(u64::MAX, u64::MAX).is_some(), "no overflow");
    }

    #[test]
    fn buffers_hold_a_stream_only_in_whole_chunks() {
        assert!(spans_buffers(PACK_BYTES, 3 << 20), "one buffer: any cut");
        assert!(spans_buffers(16 << 20, 512 << 10));
        assert!(spans_buffers(16 << 20, 4 << 20));
        assert!(!spans_buffers(16 << 20, 3 << 20));
        assert!(!spans_buffers(16 << 20, 384 << 10));
        assert!(!spans_buffers(16 << 20, 0));
    }

    #[test]
    fn small_batches_share_one_buffer_side_by_side() {
        // 32 lists of 32 × 4 KiB in flight: one buffer holds them all.
        let pool = PackPool::new(1);
        let batch = 128 << 10;
        let mut leases: Vec<PackLease> = (0..32)
            .map(|i| {
                pool.for_sender(batch)
                    .unwrap()
                    .unwrap_or_else(|| panic!("batch {i} found no room"))
            })
            .collect();
        assert_eq!(batches_per_pack_buffer(batch), 32);
        let offsets: Vec<usize> = leases.iter().map(PackLease::offset).collect();
        let expected: Vec<usize> = (0..32).map(|i| i * batch as usize).collect();
        assert_eq!(offsets, expected);
        assert!(leases
            .iter()
            .all(|l| l.region().memory().same_as(leases[0].region().memory())));
        assert!(pool.for_sender(1).unwrap().is_none(), "the buffer is full");
        // The fifth batch's space is free again once its lease is dropped.
        drop(leases.remove(5));
        let next = pool.for_sender(batch).unwrap().expect("freed slices");
        assert_eq!(next.offset(), 5 * batch as usize);
        assert_eq!(pool.stats().buffers, 1);
    }

    #[test]
    fn free_runs_are_found_lowest_first() {
        assert_eq!(free_run(0, 1), Some(0));
        assert_eq!(free_run(0, SLICES), Some(0));
        assert_eq!(free_run(1, SLICES), None);
        assert_eq!(free_run(0b1011, 2), Some(4));
        assert_eq!(free_run(0b1011, 1), Some(2));
        assert_eq!(free_run(u64::MAX, 1), None);
        assert_eq!(free_run(u64::MAX >> 1, 1), Some(63));
        assert_eq!(free_run(0, 0), None);
        assert_eq!(slice_bits(62, 2), 0b11 << 62);
        assert_eq!(slice_bits(0, 64), u64::MAX);
        assert_eq!(
            (slices_for(0), slices_for(1), slices_for(PACK_SLICE + 1)),
            (1, 1, 2)
        );
    }

    #[derive(Debug, Clone)]
    enum Step {
        /// Ask for this many bytes, as a sender (`false`) or a receiver (`true`).
        Take(u64, bool),
        /// Drop the live lease at this index (modulo the live count).
        Drop(usize),
        /// Poison the live lease at this index.
        Poison(usize),
    }

    fn step() -> impl proptest::strategy::Strategy<Value = Step> {
        use proptest::prelude::*;
        let len = prop_oneof![
            3 => 1u64..=(256 << 10),
            1 => 1u64..=PACK_BYTES,
        ];
        prop_oneof![
            4 => (len, any::<bool>()).prop_map(|(l, r)| Step::Take(l, r)),
            3 => any::<usize>().prop_map(Step::Drop),
            1 => any::<usize>().prop_map(Step::Poison),
        ]
    }

    /// A batch of up to three buffers' worth (as a sender or a receiver), or a drop.
    fn big_step() -> impl proptest::strategy::Strategy<Value = Step> {
        use proptest::prelude::*;
        prop_oneof![
            3 => (1u64..=(3 * PACK_BYTES), any::<bool>()).prop_map(|(l, r)| Step::Take(l, r)),
            2 => any::<usize>().prop_map(Step::Drop),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]

        /// Against a model of which bytes of which buffer are taken (by live leases and by
        /// poisoned ones, which keep theirs for ever): a lease never overlaps another, lies
        /// on slice boundaries inside its buffer, and the pool answers "none" (a sender
        /// falls back, a receiver gets a one-off buffer) only when it is at its cap and no
        /// buffer has room for the batch.
        #[test]
        fn leases_never_overlap_and_fall_back_only_when_full(
            cap in 0usize..=2,
            steps in proptest::collection::vec(step(), 1..60),
        ) {
            let pool = PackPool::new(cap);
            // (buffer address, first byte, end) of every lease that holds pool space.
            let mut live: Vec<(PackLease, usize, usize, usize)> = Vec::new();
            let mut poisoned: Vec<(usize, usize, usize)> = Vec::new();
            let mut buffers: Vec<usize> = Vec::new();
            for s in steps {
                match s {
                    Step::Take(len, receiver) => {
                        let taken: Vec<(usize, usize, usize)> = live
                            .iter()
                            .map(|&(_, b, s, e)| (b, s, e))
                            .chain(poisoned.iter().copied())
                            .collect();
                        let slices = slices_for(len) as usize * PACK_SLICE as usize;
                        let room = buffers.iter().any(|&b| {
                            (0..=(PACK_BYTES as usize - slices))
                                .step_by(PACK_SLICE as usize)
                                .any(|at| !taken.iter().any(|&(tb, ts, te)| {
                                    tb == b && ts < at + slices && at < te
                                }))
                        });
                        let full = buffers.len() >= cap && !room;
                        let overflows = pool.stats().overflows;
                        let lease = if receiver {
                            let lease = pool.for_receiver(len, false).unwrap();
                            let one_off = pool.stats().overflows > overflows;
                            proptest::prop_assert_eq!(one_off, full);
                            (!one_off).then_some(lease)
                        } else {
                            let lease = pool.for_sender(len).unwrap();
                            proptest::prop_assert_eq!(lease.is_none(), full);
                            lease
                        };
                        if let Some(lease) = lease {
                            let base = lease.region().memory().as_ptr() as usize;
                            proptest::prop_assert_eq!(lease.region().len(), PACK_BYTES as usize);
                            let (start, end) = (lease.offset(), lease.offset() + slices);
                            proptest::prop_assert_eq!(start % PACK_SLICE as usize, 0);
                            proptest::prop_assert!(end <= PACK_BYTES as usize);
                            proptest::prop_assert!(
                                !taken.iter().any(|&(b, s, e)| b == base && s < end && start < e),
                                "{len} bytes at {start} overlap a lease"
                            );
                            if !buffers.contains(&base) {
                                buffers.push(base);
                            }
                            live.push((lease, base, start, end));
                        }
                    }
                    Step::Drop(i) if !live.is_empty() => {
                        drop(live.remove(i % live.len()));
                    }
                    Step::Poison(i) if !live.is_empty() => {
                        let (lease, b, s, e) = live.remove(i % live.len());
                        lease.poison();
                        poisoned.push((b, s, e));
                    }
                    Step::Drop(_) | Step::Poison(_) => {}
                }
                proptest::prop_assert!(buffers.len() <= cap);
                proptest::prop_assert_eq!(pool.stats().buffers, buffers.len() as u64);
            }
        }

        /// Batches past a buffer, against a model of each buffer's slices: a lease's spans
        /// lie in distinct buffers, whole ones at offset 0 and the rest on slice boundaries,
        /// cover its bytes in order and overlap no other lease; a sender gets none (and a
        /// receiver one-off space) exactly when the pool at its cap has too few free buffers
        /// for the whole spans or no room left for the rest; and a refused batch keeps nothing.
        #[test]
        fn leases_past_a_buffer_take_whole_buffers_all_or_nothing(
            cap in 0usize..=4,
            steps in proptest::collection::vec(big_step(), 1..40),
        ) {
            let pool = PackPool::new(cap);
            // Per buffer (by address, in the pool's order), the bits of its leased slices.
            let mut model: Vec<(usize, u64)> = Vec::new();
            let mut live: Vec<(PackLease, Vec<(usize, u64)>)> = Vec::new();
            for s in steps {
                match s {
                    Step::Take(len, receiver) => {
                        let whole = (len / PACK_BYTES) as usize;
                        let rest = len % PACK_BYTES;
                        // Buffers the pool made for a batch that then found no room were
                        // never handed out: free, though the model has not seen them.
                        let pooled = pool.stats().buffers as usize;
                        let unseen = pooled - model.len();
                        let free = model.iter().filter(|&&(_, used)| used == 0).count() + unseen;
                        let grow = cap - pooled;
                        let feasible = whole <= free + grow && (rest == 0 || {
                            // Whole spans take the lowest free buffers, then new ones.
                            let mut spare_free = free.saturating_sub(whole);
                            let grow_left = grow - whole.saturating_sub(free);
                            let count = slices_for(rest);
                            let partly = model.iter().any(|&(_, used)| {
                                used != 0 && free_run(used, count).is_some()
                            });
                            if partly { spare_free = 1; }
                            spare_free > 0 || grow_left > 0
                        });
                        let overflows = pool.stats().overflows;
                        let lease = if receiver {
                            let lease = pool.for_receiver(len, true).unwrap();
                            let one_off = pool.stats().overflows > overflows;
                            proptest::prop_assert_eq!(one_off, !feasible, "{} bytes", len);
                            (!one_off).then_some(lease)
                        } else {
                            let lease = pool.for_sender(len).unwrap();
                            proptest::prop_assert_eq!(lease.is_some(), feasible, "{} bytes", len);
                            lease
                        };
                        let Some(lease) = lease else { continue };
                        let spans: Vec<(usize, usize, u64)> = lease
                            .spans()
                            .map(|(r, o, l)| (r.memory().as_ptr() as usize, o, l))
                            .collect();
                        proptest::prop_assert_eq!(spans.iter().map(|s| s.2).sum::<u64>(), len);
                        let mut held = Vec::new();
                        for (i, &(base, offset, bytes)) in spans.iter().enumerate() {
                            if i + 1 < spans.len() {
                                proptest::prop_assert_eq!((offset, bytes), (0, PACK_BYTES));
                            }
                            proptest::prop_assert_eq!(offset as u64 % PACK_SLICE, 0);
                            let first = (offset as u64 / PACK_SLICE) as u32;
                            let bits = slice_bits(first, slices_for(bytes));
                            let at = match model.iter().position(|&(b, _)| b == base) {
                                Some(at) => at,
                                None => {
                                    model.push((base, 0));
                                    model.len() - 1
                                }
                            };
                            proptest::prop_assert_eq!(model[at].1 & bits, 0, "overlap");
                            model[at].1 |= bits;
                            held.push((base, bits));
                        }
                        live.push((lease, held));
                    }
                    Step::Drop(i) if !live.is_empty() => {
                        let (lease, held) = live.remove(i % live.len());
                        drop(lease);
                        for (base, bits) in held {
                            if let Some(entry) = model.iter_mut().find(|(b, _)| *b == base) {
                                entry.1 &= !bits;
                            }
                        }
                    }
                    _ => {}
                }
                let pooled = pool.stats().buffers as usize;
                proptest::prop_assert!(model.len() <= pooled && pooled <= cap);
            }
        }
    }
}
