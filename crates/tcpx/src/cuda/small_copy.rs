//! [`SmallCopier`]: synchronous copies of a few KiB between device memory and host bytes, for
//! the runtime's small one-sided operations that travel inline in control messages.
//!
//! A 4 KiB one-sided write of GPU memory through the staged comms pays a ring slot, an
//! engine hand-off, an event poll and a plugin request on each side; the host figure for the
//! same write, carried inline, is about a third of it. Inline, a GPU operation needs only one
//! small copy on each side: the initiator gathers its blocks into the control message, the
//! target copies the message's bytes into its blocks. Done here, each is one `cuMemcpyAsync`
//! per piece into (or out of) a pinned bounce buffer on a non-blocking stream of the copier's
//! own, and one wait for the stream (a spin, yields, then sleeps, at most
//! [`SMALL_COPY_TIMEOUT`]):
//! * pinned, because a copy from or to pageable memory goes through the driver's own staging
//!   and costs several µs more at these sizes;
//! * a stream of its own, non-blocking, because a copy on the legacy default stream would
//!   wait for whatever the application runs there (a model's kernels, for milliseconds), and
//!   the target copies on its control loop;
//! * the context pushed and popped around the copy, not set, because the initiator copies on
//!   the application's thread: its current device (what the CUDA runtime reports) must not
//!   change under it.
//!
//! One copier per GPU serves the whole process ([`SmallCopier::for_ordinal`]): a few lanes
//! (stream + bounce each), taken with `try_lock` in turn, so that several control loops and
//! application threads copying at once rarely wait for each other.
//!
//! **Lists of pieces.** Pieces adjacent in one memory are copied as one. Each other piece
//! was a `cuMemcpyAsync` of its own, about 2–3 µs of submission each on an H200: sixteen
//! 1 KiB tensors of a `writev` cost about 110 µs over the two sides where one 16 KiB block
//! cost about 45. How a list of copies is queued is a [`ListCopy`]:
//! * [`ListCopy::Batch`] (the default where the driver has it, CUDA 12.8+): one
//!   `cuMemcpyBatchAsync`, still the copy engines' work;
//! * [`ListCopy::Kernel`]: one launch of the gather kernel of [`super::unpack`], planned as
//!   the copy pool plans its lists ([`super::CopyPool::submit_list`]), one warp per 4 KiB
//!   fragment. Fastest on an idle GPU of one process, but a kernel needs the GPU's
//!   multiprocessors and time slice: with two processes on one GPU it took 500 µs where the
//!   copies took 100, and a GPU busy with a model's kernels would hold it likewise. Alone,
//!   opt-in; `Auto` takes it where it measures faster;
//! * [`ListCopy::Each`]: a `cuMemcpyAsync` per copy (older drivers);
//! * [`ListCopy::Auto`] (the default where the kernel loads): each list of four copies or
//!   more goes whichever of the copy engines (`Batch`, or `Each` on older drivers) and the
//!   kernel took less time lately for lists of its length and direction, measured as they
//!   run, the other way still tried now and then (see [`super::list_choice`]). Where one
//!   process has the GPU the kernel wins lists of small GPU messages about 2 ×; where other
//!   processes or a model's kernels hold the GPU, the copy engines win, and lists follow.
//!
//! `TCPX_SMALL_COPY_LISTS=auto|batch|kernel|each` chooses for the process.

use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::sys;

use super::buffer::PinnedHostBuffer;
use super::copy::{plan_list, CopyPiece};
use super::device::{CudaDevice, CudaStream};
use super::driver::{check, require};
use super::list_choice::{self, ListChooser};
use super::unpack::{LaunchConfig, UnpackEntry, UnpackKernel, Unpacker, META_BYTES};
use crate::error::{Error, ErrorKind, Result};
use crate::memory::{MemoryKind, Operation, SharedMemory};

/// Bytes one lane's bounce buffer holds: one copy of more goes through it in several rounds,
/// a wait each. As large as the payload of the runtime's eager frame (256 KiB), so that a
/// frame's run of small GPU messages is one round, and so an inline operation (64 KiB at
/// most) too.
pub const SMALL_COPY_BOUNCE_BYTES: usize = 256 * 1024;

/// Lanes of one GPU's copier: each a stream and a bounce buffer. As many as a process's
/// engines on one NIC usually are (eight), each of which may copy its frames at once, plus
/// the control loops and application threads that copy small one-sided operations.
const LANES: usize = 8;

/// Copies one flush makes from which [`ListCopy::Kernel`] launches the kernel (and from
/// which [`ListCopy::Auto`] chooses): below, a launch costs more than the copies. Measured
/// on an H200 (`small_copy_bench`): 2 × 4 KiB took 9.8 µs as two copies and 12.5 as a
/// launch, 4 × 4 KiB 14.0 and 13.2, 16 × 4 KiB 39.1 and 18.7, 64 × 1 KiB 134 and 20.0
/// (device to host; host to device alike).
const KERNEL_FROM_COPIES: usize = list_choice::FROM_COPIES;

/// Environment variable choosing how lists of copies are queued ([`ListCopy`]).
pub const SMALL_COPY_LISTS_ENV: &str = "TCPX_SMALL_COPY_LISTS";

/// How a [`SmallCopier`] queues the copies of one call when there are several (see the
/// module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ListCopy {
    /// A `cuMemcpyAsync` per copy.
    Each,
    /// One `cuMemcpyBatchAsync` (drivers of CUDA 12.8 and later).
    Batch,
    /// One launch of the gather kernel, from four copies (below, a launch costs more).
    Kernel,
    /// Per list, the copy engines (`Batch`, or `Each` on older drivers) or the kernel,
    /// whichever took less time lately for lists like it (see the module docs).
    Auto,
}

impl ListCopy {
    /// The value of [`SMALL_COPY_LISTS_ENV`]: `auto`, `each`, `batch` or `kernel` (any case,
    /// spaces around ignored); `None` for anything else.
    pub fn parse(value: &str) -> Option<Self> {
        match value.trim().to_ascii_lowercase().as_str() {
            "each" => Some(Self::Each),
            "batch" => Some(Self::Batch),
            "kernel" => Some(Self::Kernel),
            "auto" => Some(Self::Auto),
            _ => None,
        }
    }

    fn encode(self) -> u8 {
        self as u8
    }

    fn decode(v: u8) -> Self {
        match v {
            1 => Self::Batch,
            2 => Self::Kernel,
            3 => Self::Auto,
            _ => Self::Each,
        }
    }
}

/// Copies one lane plans before it must flush them (16 bytes of pinned metadata each): a
/// longer list goes in several rounds, as a list of more bytes than the bounce does.
const PLANNED_COPIES: usize = 1024;

/// The most bytes one warp of the kernel moves for one copy: a longer copy is cut into
/// fragments of this size, moved by as many warps at once (a warp moves 4 KiB per pass, and
/// a pass that reads host memory waits for the bus).
const KERNEL_FRAGMENT: usize = 4096;

/// Kernel metadata entries of one lane: one per planned copy, plus one per fragment
/// boundary the bounce can hold (a copy of `len` bytes is `ceil(len / KERNEL_FRAGMENT)`
/// fragments, and the copies of one flush hold at most the bounce).
const METAS: usize = PLANNED_COPIES + SMALL_COPY_BOUNCE_BYTES / KERNEL_FRAGMENT;

/// The kernel's shape for small copies: few fragments per block, so that a list's copies
/// spread over many multiprocessors, each warp moving one piece (4 KiB per pass).
const KERNEL_SHAPE: LaunchConfig = LaunchConfig {
    threads_per_block: 128,
    frags_per_block: 4,
    max_blocks: 0,
};

/// Longest a copy is waited for. A copy of at most 256 KiB takes µs, or as long as the copy
/// engine's queue ahead of it (a large staged transfer of another stream): past this, the GPU
/// is taken as stuck and the copy fails with a timeout instead of blocking the caller (the
/// target's control loop, or the application) for ever.
pub const SMALL_COPY_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a wait spins on the stream: one copy is done well within it (6.5–9 µs on an
/// H200), a list too (a batch of 16 pieces 25–45 µs). A sleep would cost more than the copy:
/// asked for 20 µs, it returns after about 70 (the kernel's timer slack), and with a 50 µs
/// spin UCCL's 16 × 1 KiB `writev` took 86 µs against 65 with a longer one.
const SPIN: Duration = Duration::from_micros(200);

/// Past [`SPIN`], how long a wait yields its core between polls before it sleeps: a copy
/// queued behind another stream's large one should not hold a core for long.
const YIELD: Duration = Duration::from_millis(1);

/// Synchronous small copies between one GPU's memory and host bytes (see the module docs).
pub struct SmallCopier {
    device: CudaDevice,
    lanes: Vec<Mutex<Lane>>,
    /// How lists of copies are queued ([`ListCopy`], encoded).
    lists: std::sync::atomic::AtomicU8,
    /// The driver has `cuMemcpyBatchAsync`.
    batch: bool,
    /// The gather kernel loaded.
    kernel: bool,
    /// What [`ListCopy::Auto`] learned, shared with the lanes.
    chooser: Arc<ListChooser>,
}

/// What [`ListCopy::Auto`] measured for one direction and length class of lists
/// ([`SmallCopier::auto_list_times`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ListTimes {
    /// Lists toward device memory (else from it).
    pub to_device: bool,
    /// The fewest and the most copies of a list of the class (`None`: no upper bound).
    pub copies: (usize, Option<usize>),
    /// Average time of one list through the copy engines.
    pub engines: Duration,
    /// Average time of one list as one launch of the gather kernel.
    pub kernel: Duration,
}

impl ListTimes {
    /// Which way `Auto` takes for these lists now, probes aside (`Batch`: the copy engines,
    /// one copy each on drivers without batches). The kernel only where it takes at most 3/4
    /// of the copy engines' time, as the chooser decides.
    pub fn chosen(&self) -> ListCopy {
        match list_choice::preferred(self.engines, self.kernel) {
            list_choice::Method::Kernel => ListCopy::Kernel,
            list_choice::Method::Engines => ListCopy::Batch,
        }
    }
}

/// One stream and its bounce buffer, used by one copy at a time.
struct Lane {
    /// The lane's stream, inside the kernel's launcher when the kernel loaded.
    stream: LaneStream,
    bounce: PinnedHostBuffer,
    /// The copies planned since the last flush, in order (capacity [`PLANNED_COPIES`]).
    plan: Vec<PlannedCopy>,
    /// The planned copies by address, and the kernel's entries, of a flush (reused).
    pieces: Vec<CopyPiece>,
    entries: Vec<UnpackEntry>,
    /// A batch's destinations, sources and sizes (reused).
    batch: [Vec<u64>; 2],
    sizes: Vec<usize>,
    /// Set when a copy of the lane timed out or failed: the GPU may still use the bounce, so
    /// the lane is never used again.
    retired: bool,
    /// The copier's choice of way for [`ListCopy::Auto`], shared by its lanes.
    chooser: Arc<ListChooser>,
    /// The list [`ListCopy::Auto`] chose a way for, in flight: what the chooser learns once
    /// the lane's wait ends.
    timed: Option<TimedList>,
}

/// A list queued the way [`ListCopy::Auto`] chose, timed from its queuing to its wait's end.
struct TimedList {
    started: Instant,
    direction: list_choice::Direction,
    copies: usize,
    method: list_choice::Method,
}

/// The lane's stream: with the kernel's launcher on it and the metadata of a launch (mapped
/// pinned memory: the kernel reads it there), or alone.
enum LaneStream {
    Kernel(Unpacker, PinnedHostBuffer),
    CopiesOnly(CudaStream),
}

impl LaneStream {
    fn stream(&self) -> &CudaStream {
        match self {
            Self::Kernel(unpacker, _) => unpacker.stream(),
            Self::CopiesOnly(stream) => stream,
        }
    }
}

/// Which way a lane's copies go.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Way {
    /// Device memory → the bounce (a gather).
    ToBounce,
    /// The bounce → device memory (a scatter).
    FromBounce,
}

/// One copy between a CUDA memory and the lane's bounce.
#[derive(Clone, Copy)]
struct PlannedCopy {
    /// Device address of the memory's first byte (copies merge only within one memory).
    memory: u64,
    /// Where in the memory.
    offset: usize,
    len: usize,
    /// Where in the bounce.
    at: usize,
}

impl PlannedCopy {
    /// The copy by address, `way` between its memory and the bounce at `bounce`.
    fn piece(&self, way: Way, bounce: u64) -> CopyPiece {
        let (device, at) = (self.memory + self.offset as u64, bounce + self.at as u64);
        let (dst, src) = match way {
            Way::ToBounce => (at, device),
            Way::FromBounce => (device, at),
        };
        CopyPiece {
            dst,
            src,
            len: self.len,
        }
    }
}

impl std::fmt::Debug for SmallCopier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SmallCopier")
            .field("device", &self.device.ordinal())
            .field("lanes", &self.lanes.len())
            .finish()
    }
}

/// The process's copiers, by GPU ordinal: created on first use, kept for the process's life
/// (a stream and 256 KiB of pinned memory per lane).
static COPIERS: OnceLock<Mutex<Vec<Option<Arc<SmallCopier>>>>> = OnceLock::new();

impl SmallCopier {
    /// The process's copier for GPU `ordinal`, created on first use.
    pub fn for_ordinal(ordinal: usize) -> Result<Arc<Self>> {
        require("SmallCopier::for_ordinal")?;
        let copiers = COPIERS.get_or_init(|| Mutex::new(Vec::new()));
        let mut copiers = copiers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(Some(copier)) = copiers.get(ordinal) {
            return Ok(copier.clone());
        }
        let copier = Arc::new(Self::new(&CudaDevice::new(ordinal)?)?);
        if copiers.len() <= ordinal {
            copiers.resize(ordinal + 1, None);
        }
        copiers[ordinal] = Some(copier.clone());
        Ok(copier)
    }

    /// The process's copier for GPU `ordinal` if one was made (see [`Self::for_ordinal`]),
    /// without making one.
    pub fn existing(ordinal: usize) -> Option<Arc<Self>> {
        let copiers = COPIERS.get()?;
        let copiers = copiers.lock().unwrap_or_else(|e| e.into_inner());
        copiers.get(ordinal).cloned().flatten()
    }

    /// A copier of its own for `device` (most callers share the process's: [`Self::for_ordinal`]).
    /// Lists of copies go as [`SMALL_COPY_LISTS_ENV`] says (default [`ListCopy::Auto`]); the
    /// gather kernel is loaded unless it asks for `batch` or `each`.
    pub fn new(device: &CudaDevice) -> Result<Self> {
        let wanted = lists_from_env();
        Self::build(
            device,
            wanted,
            matches!(wanted, ListCopy::Kernel | ListCopy::Auto),
        )
    }

    /// [`Self::new`] with the gather kernel loaded whatever the environment says, so that
    /// [`Self::set_list_copy`]`(`[`ListCopy::Kernel`]`)` can switch to it (benchmarks, tests).
    pub fn with_kernel(device: &CudaDevice) -> Result<Self> {
        Self::build(device, lists_from_env(), true)
    }

    /// Makes the lanes now (streams, pinned buffers, the kernel when `load_kernel`), so that
    /// no copy pays for them.
    fn build(device: &CudaDevice, wanted: ListCopy, load_kernel: bool) -> Result<Self> {
        // The calling thread may be the application's: whatever the driver calls below make
        // current, its own context is back on return.
        let _current = Current::push(device)?;
        let chooser = Arc::new(ListChooser::default());
        let kernel = if load_kernel {
            UnpackKernel::shared(device)
                .inspect_err(|e| {
                    tracing::warn!(
                        "GPU {}: the gather kernel did not load ({e}); lists of small copies \
                         cannot use it",
                        device.ordinal()
                    )
                })
                .ok()
        } else {
            None
        };
        let lanes = (0..LANES)
            .map(|_| {
                let stream = match &kernel {
                    Some(kernel) => {
                        let mut unpacker = Unpacker::with_kernel(kernel.clone(), device.stream()?)?;
                        unpacker.set_config(KERNEL_SHAPE)?;
                        LaneStream::Kernel(unpacker, device.alloc_pinned(METAS * META_BYTES)?)
                    }
                    None => LaneStream::CopiesOnly(device.stream()?),
                };
                Ok(Mutex::new(Lane {
                    stream,
                    bounce: device.alloc_pinned(SMALL_COPY_BOUNCE_BYTES)?,
                    plan: Vec::with_capacity(PLANNED_COPIES),
                    pieces: Vec::with_capacity(PLANNED_COPIES),
                    entries: Vec::with_capacity(PLANNED_COPIES),
                    batch: [
                        Vec::with_capacity(PLANNED_COPIES),
                        Vec::with_capacity(PLANNED_COPIES),
                    ],
                    sizes: Vec::with_capacity(PLANNED_COPIES),
                    retired: false,
                    chooser: chooser.clone(),
                    timed: None,
                }))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut copier = Self {
            device: device.clone(),
            lanes,
            lists: std::sync::atomic::AtomicU8::new(ListCopy::Each.encode()),
            batch: batch_available(),
            kernel: kernel.is_some(),
            chooser,
        };
        if copier.kernel {
            // The kernel's first launch in a context loads it onto the GPU (CUDA loads
            // functions lazily): paid here, when the copier is made (at an endpoint's first
            // CUDA registration), not by the first list that `Auto` tries the kernel on. A
            // kernel that loaded but does not run leaves lists to the copy engines.
            let warmed = copier.lane().and_then(|mut lane| lane.warm_up());
            if let Err(e) = warmed {
                tracing::warn!(
                    "GPU {}: the gather kernel did not run ({e}); lists of small copies \
                     go through the copy engines",
                    device.ordinal()
                );
                copier.kernel = false;
            }
        }
        // (`Auto` without the kernel falls back quietly: its load failure was logged.)
        if !copier.set_list_copy(wanted) && !matches!(wanted, ListCopy::Batch | ListCopy::Auto) {
            tracing::warn!(
                "{SMALL_COPY_LISTS_ENV}: {wanted:?} is not available on GPU {}; one copy each",
                device.ordinal()
            );
        }
        Ok(copier)
    }

    /// How lists of copies are queued now.
    pub fn list_copy(&self) -> ListCopy {
        ListCopy::decode(self.lists.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Queues lists of copies `how` from now on (for every user of this copier: for
    /// benchmarks and tuning). Returns false when the driver lacks `cuMemcpyBatchAsync`
    /// (`Batch`) or the kernel did not load (`Kernel`, `Auto`): lists then go one copy each,
    /// or, for `Auto`, as `Batch` where the driver has it.
    pub fn set_list_copy(&self, how: ListCopy) -> bool {
        let usable = match how {
            ListCopy::Each => true,
            ListCopy::Batch => self.batch,
            ListCopy::Kernel | ListCopy::Auto => self.kernel,
        };
        let how = match (usable, how) {
            (true, how) => how,
            (false, ListCopy::Auto) if self.batch => ListCopy::Batch,
            (false, _) => ListCopy::Each,
        };
        self.lists
            .store(how.encode(), std::sync::atomic::Ordering::Relaxed);
        usable
    }

    /// What [`ListCopy::Auto`] has measured lately, per direction and length class where
    /// both ways have been timed: which lists and the average time of one through the copy
    /// engines and through the kernel.
    pub fn auto_list_times(&self) -> Vec<ListTimes> {
        let directions = [
            (false, list_choice::Direction::ToHost),
            (true, list_choice::Direction::ToDevice),
        ];
        directions
            .into_iter()
            .flat_map(|(to_device, direction)| {
                ListChooser::classes().filter_map(move |(first, last)| {
                    match self.chooser.averages(direction, first) {
                        (Some(engines), Some(kernel)) => Some(ListTimes {
                            to_device,
                            copies: (first, last),
                            engines,
                            kernel,
                        }),
                        _ => None,
                    }
                })
            })
            .collect()
    }

    /// The GPU.
    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    /// Appends the bytes of the `(offset, len)` ranges of CUDA `memory` to `out`, and returns
    /// when they are there. `memory` counts as one operation in flight meanwhile (like
    /// [`SharedMemory::read_ranges`] for host memory: allowed while other transfers of it
    /// run). Stops at the first range outside the memory, after reading the ranges before it.
    pub fn read_ranges(
        &self,
        memory: &SharedMemory,
        ranges: impl IntoIterator<Item = (usize, usize)>,
        out: &mut Vec<u8>,
    ) -> Result<()> {
        self.gather(
            ranges
                .into_iter()
                .map(|(offset, len)| (memory, offset, len)),
            out,
        )
    }

    /// Copies each `(offset, bytes)` piece into CUDA `memory` at `offset`, and returns when the
    /// bytes are in device memory. `memory` counts as one operation in flight meanwhile (like
    /// [`SharedMemory::write_ranges`] for host memory). Stops at the first piece outside the
    /// memory, after writing the pieces before it.
    pub fn write_ranges<'a>(
        &self,
        memory: &SharedMemory,
        pieces: impl IntoIterator<Item = (usize, &'a [u8])>,
    ) -> Result<()> {
        self.scatter(
            pieces
                .into_iter()
                .map(|(offset, bytes)| (memory, offset, bytes)),
        )
    }

    /// [`Self::read_ranges`] over pieces `(memory, offset, len)` of several CUDA memories
    /// (allocations the GPU can reach), with one wait for all of them: a list of small blocks
    /// in separately registered tensors costs one GPU round trip, not one per tensor. Each
    /// memory counts as in flight until the call returns.
    pub fn gather<'m>(
        &self,
        pieces: impl IntoIterator<Item = (&'m SharedMemory, usize, usize)>,
        out: &mut Vec<u8>,
    ) -> Result<()> {
        self.gather_into(pieces, out)
    }

    /// [`Self::gather`] into `out` from its first byte on, back to back, instead of appended
    /// to a vector: the runtime's eager frames take the bytes of a run of small messages of
    /// GPU memory this way, one copy list for the run. Returns the bytes written. A piece that
    /// would not fit in what is left of `out` fails the call (`InvalidArgument`), after the
    /// pieces before it were written.
    pub fn gather_to<'m>(
        &self,
        pieces: impl IntoIterator<Item = (&'m SharedMemory, usize, usize)>,
        out: &mut [u8],
    ) -> Result<usize> {
        let mut sink = SliceSink { out, at: 0 };
        self.gather_into(pieces, &mut sink)?;
        Ok(sink.at)
    }

    fn gather_into<'m>(
        &self,
        pieces: impl IntoIterator<Item = (&'m SharedMemory, usize, usize)>,
        out: &mut impl Sink,
    ) -> Result<()> {
        let (mut lane, _current, lists) = self.begin()?;
        let mut tokens = Tokens::default();
        let queuing = queue_reads(&mut lane, pieces, &mut tokens, out, lists);
        // Whatever ended the loop, no copy outlives the call: the bounce is the next copy's,
        // and the memories stop counting in flight on return. What was planned before a bad
        // range is still copied and appended (the ranges before it are read); a flush that
        // failed left nothing planned.
        let drained = lane
            .flush(Way::ToBounce, lists)
            .and_then(|queued| lane.drain_into(queued, out));
        lane.plan.clear();
        queuing.and(drained)
    }

    /// [`Self::write_ranges`] over pieces `(memory, offset, bytes)` of several CUDA memories,
    /// with one wait for all of them (see [`Self::gather`]).
    pub fn scatter<'m, 'b>(
        &self,
        pieces: impl IntoIterator<Item = (&'m SharedMemory, usize, &'b [u8])>,
    ) -> Result<()> {
        let (mut lane, _current, lists) = self.begin()?;
        let mut tokens = Tokens::default();
        let queuing = queue_writes(&mut lane, pieces, &mut tokens, lists);
        // As for reads: every queued copy has read the bounce and written its memory before
        // the call returns, whatever ended the loop.
        let synced = lane.flush(Way::FromBounce, lists).and_then(|queued| {
            if queued > 0 {
                lane.synchronize()
            } else {
                Ok(())
            }
        });
        lane.plan.clear();
        queuing.and(synced)
    }

    /// What a call copies with: a lane with nothing planned, its GPU's context current on
    /// this thread (until the guard drops), and how lists go now.
    fn begin(&self) -> Result<(MutexGuard<'_, Lane>, Current, ListCopy)> {
        let mut lane = self.lane()?;
        let current = Current::push(&self.device)?;
        lane.plan.clear();
        Ok((lane, current, self.list_copy()))
    }

    /// A free lane, or the first one in service (wait for it) when all are busy; an error
    /// once every lane is retired.
    fn lane(&self) -> Result<MutexGuard<'_, Lane>> {
        for lane in &self.lanes {
            if let Ok(guard) = lane.try_lock() {
                if !guard.retired {
                    return Ok(guard);
                }
            }
        }
        for lane in &self.lanes {
            let guard = lane.lock().unwrap_or_else(|e| e.into_inner());
            if !guard.retired {
                return Ok(guard);
            }
        }
        Err(retired(format!(
            "every lane of GPU {}'s small copier was retired after a copy failed or timed out",
            self.device.ordinal()
        )))
    }
}

/// How [`SMALL_COPY_LISTS_ENV`] asks lists of copies to go (default, and for a value it does
/// not know, logged: [`ListCopy::Auto`]).
fn lists_from_env() -> ListCopy {
    match std::env::var(SMALL_COPY_LISTS_ENV) {
        Err(_) => ListCopy::Auto,
        Ok(value) => ListCopy::parse(&value).unwrap_or_else(|| {
            tracing::warn!(
                "{SMALL_COPY_LISTS_ENV}={value}: expected auto, batch, kernel or each; using auto"
            );
            ListCopy::Auto
        }),
    }
}

/// Whether the driver has `cuMemcpyBatchAsync` (CUDA 12.8 and later), looked up once: the
/// loader resolves a function on its first call and would panic on one the driver lacks.
fn batch_available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        // SAFETY: the driver library is loaded (a device exists); looking a symbol up runs
        // no code of it.
        unsafe {
            sys::culib()
                .get::<unsafe extern "C" fn()>(b"cuMemcpyBatchAsync\0")
                .is_ok()
        }
    })
}

/// The memories a call copies from or into, each counted in flight once (a run of pieces in
/// one memory takes one token) until the call returns.
#[derive(Default)]
struct Tokens<'m> {
    held: Vec<(&'m SharedMemory, Operation<'m>)>,
}

impl<'m> Tokens<'m> {
    /// Checks that `memory` is CUDA memory and `offset + len` lies inside it, and counts it in
    /// flight unless the previous piece's memory is the same.
    fn admit(
        &mut self,
        api: &'static str,
        memory: &'m SharedMemory,
        offset: usize,
        len: usize,
    ) -> Result<()> {
        check_cuda(api, memory)?;
        memory.check_range(api, offset, len)?;
        if !self.held.last().is_some_and(|(m, _)| m.same_as(memory)) {
            self.held.push((memory, memory.borrow_operation(api)?));
        }
        Ok(())
    }
}

/// Plans the device → bounce copies of `pieces` on `lane`, flushing them and draining the
/// bounce into `out` whenever it (or the plan) is full. The caller flushes and drains what is
/// planned last, also after an error.
fn queue_reads<'m>(
    lane: &mut Lane,
    pieces: impl IntoIterator<Item = (&'m SharedMemory, usize, usize)>,
    tokens: &mut Tokens<'m>,
    out: &mut impl Sink,
    lists: ListCopy,
) -> Result<()> {
    const API: &str = "SmallCopier::read_ranges";
    // What the destination takes, before any of it is drained into.
    let room = out.room();
    let mut taken = 0usize;
    for (memory, offset, len) in pieces {
        taken = taken.saturating_add(len);
        if taken > room {
            return Err(Error::invalid(
                API,
                format!("the pieces hold more bytes than their destination's {room}"),
            ));
        }
        tokens.admit(API, memory, offset, len)?;
        let mut done = 0;
        while done < len {
            if lane.full() {
                let queued = lane.flush(Way::ToBounce, lists)?;
                lane.drain_into(queued, out)?;
                lane.plan.clear();
            }
            let n = (len - done).min(SMALL_COPY_BOUNCE_BYTES - lane.planned_bytes());
            lane.plan_copy(memory, offset + done, n);
            done += n;
        }
    }
    Ok(())
}

/// Copies `pieces` into the bounce and plans the bounce → device copies on `lane`, flushing
/// them and waiting whenever the bounce (or the plan) is full. The caller flushes and waits
/// for what is planned last, also after an error.
fn queue_writes<'m, 'b>(
    lane: &mut Lane,
    pieces: impl IntoIterator<Item = (&'m SharedMemory, usize, &'b [u8])>,
    tokens: &mut Tokens<'m>,
    lists: ListCopy,
) -> Result<()> {
    const API: &str = "SmallCopier::write_ranges";
    for (memory, offset, bytes) in pieces {
        tokens.admit(API, memory, offset, bytes.len())?;
        let mut done = 0;
        while done < bytes.len() {
            if lane.full() {
                // The bounce is reused: its copies must have read it first.
                if lane.flush(Way::FromBounce, lists)? > 0 {
                    lane.synchronize()?;
                }
                lane.plan.clear();
            }
            let at = lane.planned_bytes();
            let n = (bytes.len() - done).min(SMALL_COPY_BOUNCE_BYTES - at);
            lane.bounce.as_mut_slice()[at..at + n].copy_from_slice(&bytes[done..done + n]);
            lane.plan_copy(memory, offset + done, n);
            done += n;
        }
    }
    Ok(())
}

impl Lane {
    /// Bytes of the bounce the planned copies use.
    fn planned_bytes(&self) -> usize {
        self.plan.last().map_or(0, |c| c.at + c.len)
    }

    /// Whether no copy can be planned before a flush.
    fn full(&self) -> bool {
        self.planned_bytes() == SMALL_COPY_BOUNCE_BYTES || self.plan.len() == PLANNED_COPIES
    }

    /// Plans a copy of `len` bytes at `offset` in `memory` (checked) next in the bounce,
    /// merged with the previous one when it continues it in the same memory.
    fn plan_copy(&mut self, memory: &SharedMemory, offset: usize, len: usize) {
        let base = memory.as_ptr() as u64;
        if let Some(last) = self.plan.last_mut() {
            if last.memory == base && last.offset + last.len == offset {
                last.len += len;
                return;
            }
        }
        let at = self.planned_bytes();
        self.plan.push(PlannedCopy {
            memory: base,
            offset,
            len,
            at,
        });
    }

    /// Queues the planned copies on the lane's stream (the device's context is current), as
    /// `lists` says when there are several (see [`ListCopy`]). Returns the bytes of the bounce
    /// they cover (the caller waits for them before reusing the bounce or reading it; it
    /// clears the plan). A copy that cannot be queued retires the lane, after waiting for
    /// those queued before it.
    fn flush(&mut self, way: Way, lists: ListCopy) -> Result<usize> {
        let queued = self.planned_bytes();
        let copies = self.plan.len();
        // Only a list timed below teaches the chooser at the next wait.
        self.timed = None;
        let lists = match lists {
            ListCopy::Auto if copies >= KERNEL_FROM_COPIES => {
                let direction = match way {
                    Way::ToBounce => list_choice::Direction::ToHost,
                    Way::FromBounce => list_choice::Direction::ToDevice,
                };
                let chosen = self.chooser.pick(direction, copies);
                self.timed = Some(TimedList {
                    started: Instant::now(),
                    direction,
                    copies,
                    method: chosen,
                });
                match chosen {
                    list_choice::Method::Kernel => ListCopy::Kernel,
                    list_choice::Method::Engines if batch_available() => ListCopy::Batch,
                    list_choice::Method::Engines => ListCopy::Each,
                }
            }
            ListCopy::Auto if batch_available() => ListCopy::Batch,
            ListCopy::Auto => ListCopy::Each,
            how => how,
        };
        let queuing = match lists {
            ListCopy::Batch if copies > 1 => self.copy_batch(way),
            ListCopy::Kernel if copies >= KERNEL_FROM_COPIES => self.launch(way),
            _ => self.copy_each(way),
        };
        match queuing {
            Ok(()) => Ok(queued),
            Err(e) => {
                self.timed = None;
                let _ = self.synchronize();
                self.retired = true;
                self.plan.clear();
                Err(e)
            }
        }
    }

    /// Queues a `cuMemcpyAsync` per planned copy.
    fn copy_each(&self, way: Way) -> Result<()> {
        let bounce = self.bounce.device_ptr();
        for c in &self.plan {
            let CopyPiece { dst, src, len } = c.piece(way, bounce);
            // SAFETY: each planned range lies inside live device memory (checked when it was
            // planned; the caller's tokens keep it alive and in flight until the lane is
            // waited for) and inside the lane's bounce, which no one else touches while the
            // lane is locked and which the caller does not reuse before the wait.
            unsafe { self.queue(dst, src, len)? };
        }
        Ok(())
    }

    /// Queues the planned copies as one `cuMemcpyBatchAsync`.
    fn copy_batch(&mut self, way: Way) -> Result<()> {
        let bounce = self.bounce.device_ptr();
        let [dsts, srcs] = &mut self.batch;
        dsts.clear();
        srcs.clear();
        self.sizes.clear();
        for c in &self.plan {
            let piece = c.piece(way, bounce);
            dsts.push(piece.dst);
            srcs.push(piece.src);
            self.sizes.push(piece.len);
        }
        // One attribute for every copy: sources read in stream order (what a
        // `cuMemcpyAsync` does); the location hints only matter for managed memory.
        let device = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: self.stream.stream().device().ordinal() as i32,
        };
        let host = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST,
            id: 0,
        };
        let (src_hint, dst_hint) = match way {
            Way::ToBounce => (device, host),
            Way::FromBounce => (host, device),
        };
        let mut attributes = sys::CUmemcpyAttributes {
            srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            srcLocHint: src_hint,
            dstLocHint: dst_hint,
            flags: 0,
        };
        let mut first = [0usize];
        let mut failed = usize::MAX;
        let count = self.sizes.len();
        // SAFETY: the three arrays hold `count` entries each; every range lies inside live
        // device memory (checked when planned, kept alive by the caller's tokens) or inside
        // the lane's bounce, which no one else touches while the lane is locked and which the
        // caller does not reuse before it waits for the stream the batch is queued on.
        let rc = unsafe {
            sys::cuMemcpyBatchAsync(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                self.sizes.as_mut_ptr(),
                count,
                &mut attributes,
                first.as_mut_ptr(),
                1,
                &mut failed,
                self.stream.stream().raw(),
            )
        };
        check("cuMemcpyBatchAsync", rc, || {
            format!("{count} small copies (copy {failed} failed)")
        })
    }

    /// Queues the planned copies as one kernel launch (more for more than 64 runs of
    /// sources: see [`plan_list`]).
    fn launch(&mut self, way: Way) -> Result<()> {
        let LaneStream::Kernel(unpacker, metas) = &mut self.stream else {
            return self.copy_each(way);
        };
        let bounce = self.bounce.device_ptr();
        self.pieces.clear();
        self.pieces
            .extend(self.plan.iter().map(|c| c.piece(way, bounce)));
        let metas_addr = metas.device_ptr();
        plan_list(
            &self.pieces,
            KERNEL_FRAGMENT,
            metas_addr,
            metas.as_mut_slice(),
            &mut self.entries,
        );
        // SAFETY: every entry's fragments lie inside live memory the GPU can reach (device
        // memory checked when planned and kept alive by the caller's tokens; the lane's mapped
        // bounce), and its extents are theirs (`plan_list`); its metas lie in the lane's mapped
        // metadata buffer, written above and large enough ([`METAS`]); nothing is reused
        // before the caller waits for the lane's stream, which the launches are queued on.
        unsafe { unpacker.enqueue(&self.entries)? };
        Ok(())
    }

    /// Launches the kernel once on a copy inside the lane's own bounce (its first 64 bytes
    /// onto the next 64) and waits for it (the device's context is current).
    fn warm_up(&mut self) -> Result<()> {
        self.plan.clear();
        self.plan.push(PlannedCopy {
            memory: self.bounce.device_ptr(),
            offset: 64,
            len: 64,
            at: 0,
        });
        let launched = self
            .launch(Way::FromBounce)
            .and_then(|()| self.synchronize());
        self.plan.clear();
        launched
    }

    /// Queues one copy on the lane's stream (the device's context is current).
    ///
    /// # Safety
    /// `src..src+len` must stay readable and `dst..dst+len` writable until the stream is
    /// synchronized.
    unsafe fn queue(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        // SAFETY: forwarded from this function's contract.
        let rc = unsafe { sys::cuMemcpyAsync(dst, src, len, self.stream.stream().raw()) };
        check("cuMemcpyAsync", rc, || {
            format!("{len} bytes {src:#x} -> {dst:#x} (small copy)")
        })
    }

    /// Waits for the lane's copies (the device's context is current): polls the stream
    /// spinning ([`SPIN`]), then yielding ([`YIELD`]), then sleeping, at most
    /// [`SMALL_COPY_TIMEOUT`]. A copy that failed or did
    /// not finish retires the lane.
    fn synchronize(&mut self) -> Result<()> {
        let started = Instant::now();
        loop {
            // SAFETY: a live stream of the current context.
            let rc = unsafe { sys::cuStreamQuery(self.stream.stream().raw()) };
            if rc == sys::CUresult::CUDA_SUCCESS {
                if let Some(list) = self.timed.take() {
                    let took = list.started.elapsed();
                    self.chooser
                        .record(list.direction, list.copies, list.method, took);
                }
                return self.kernel_status();
            }
            if rc != sys::CUresult::CUDA_ERROR_NOT_READY {
                self.timed = None;
                self.retired = true;
                return check("cuStreamQuery", rc, || "small copy".to_string());
            }
            let waited = started.elapsed();
            if waited > SMALL_COPY_TIMEOUT {
                self.timed = None;
                self.retired = true;
                return Err(Error::new(
                    "SmallCopier",
                    ErrorKind::Timeout(waited),
                    "a small GPU copy did not complete (its lane is retired)",
                ));
            }
            if waited < SPIN {
                std::hint::spin_loop();
            } else if waited < YIELD {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }

    /// A fragment the kernel skipped as out of range (every range is checked before it is
    /// planned, so this is a bug): the lane is retired, the copy fails.
    fn kernel_status(&mut self) -> Result<()> {
        let LaneStream::Kernel(unpacker, _) = &self.stream else {
            return Ok(());
        };
        unpacker.check().inspect_err(|_| {
            unpacker.clear_error();
            self.retired = true;
        })
    }

    /// Waits for the lane's copies into the bounce, then appends its first `queued` bytes
    /// (nothing once the lane is retired: its bounce holds no complete copy).
    fn drain_into(&mut self, queued: usize, out: &mut impl Sink) -> Result<()> {
        if self.retired {
            return Err(retired("the lane was retired by a failed copy".into()));
        }
        if queued > 0 {
            self.synchronize()?;
            out.put(&self.bounce.as_slice()[..queued]);
        }
        Ok(())
    }
}

/// Where a gather's bytes go, in order: appended to a vector, or written into a slice.
trait Sink {
    /// Bytes it can still take (checked before a piece is planned, so `put` always fits).
    fn room(&self) -> usize;
    fn put(&mut self, bytes: &[u8]);
}

impl Sink for Vec<u8> {
    fn room(&self) -> usize {
        usize::MAX
    }
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

/// A slice filled from its first byte on.
struct SliceSink<'a> {
    out: &'a mut [u8],
    at: usize,
}

impl Sink for SliceSink<'_> {
    fn room(&self) -> usize {
        self.out.len() - self.at
    }
    fn put(&mut self, bytes: &[u8]) {
        self.out[self.at..self.at + bytes.len()].copy_from_slice(bytes);
        self.at += bytes.len();
    }
}

/// The error of a copy refused because its lane (or every lane) was retired.
fn retired(why: String) -> Error {
    Error::new("SmallCopier", ErrorKind::InvalidArgument(why), "")
}

fn check_cuda(api: &'static str, memory: &SharedMemory) -> Result<()> {
    if memory.kind() != MemoryKind::Cuda {
        return Err(Error::invalid(
            api,
            format!("{:?} memory is not CUDA memory", memory.kind()),
        ));
    }
    Ok(())
}

thread_local! {
    /// Set on the library's own threads ([`own_this_thread`]).
    static OWNED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks the calling thread as the library's own (the runtime's control loops): small copies
/// made on it leave their GPU's context current instead of pushing and popping it around
/// each copy (0.3–0.7 µs a copy on an H200), since no application code runs there that a
/// current context could surprise. Application threads keep their current context intact.
pub fn own_this_thread() {
    OWNED.with(|owned| owned.set(true));
}

/// The device's context made current on this thread for a scope, and the one before it
/// restored after: pushed only when another one (or none) was current, and on the library's
/// own threads simply made current and left so.
struct Current {
    pushed: bool,
    /// Contexts are pushed per thread: the guard must be dropped on the thread that made it.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Current {
    fn push(device: &CudaDevice) -> Result<Self> {
        let mut current: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one context handle.
        let rc = unsafe { sys::cuCtxGetCurrent(&mut current) };
        check("cuCtxGetCurrent", rc, || device.describe())?;
        if current == device.context() {
            return Ok(Self {
                pushed: false,
                _not_send: std::marker::PhantomData,
            });
        }
        if OWNED.with(std::cell::Cell::get) {
            // SAFETY: the device retains its primary context for as long as it lives, and
            // the copier holding it lives for the process.
            let rc = unsafe { sys::cuCtxSetCurrent(device.context()) };
            check("cuCtxSetCurrent", rc, || device.describe())?;
            return Ok(Self {
                pushed: false,
                _not_send: std::marker::PhantomData,
            });
        }
        // SAFETY: the device retains its primary context for as long as it lives, and it
        // outlives this guard (the copier holds it).
        let rc = unsafe { sys::cuCtxPushCurrent_v2(device.context()) };
        check("cuCtxPushCurrent", rc, || device.describe())?;
        Ok(Self {
            pushed: true,
            _not_send: std::marker::PhantomData,
        })
    }
}

impl Drop for Current {
    fn drop(&mut self) {
        if self.pushed {
            let mut popped: sys::CUcontext = std::ptr::null_mut();
            // SAFETY: pops the context `push` pushed on this thread (the guard is not Send).
            let _ = unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ListCopy;

    #[test]
    fn list_copy_values_parse_and_round_trip() {
        assert_eq!(ListCopy::parse("each"), Some(ListCopy::Each));
        assert_eq!(ListCopy::parse(" Batch "), Some(ListCopy::Batch));
        assert_eq!(ListCopy::parse("KERNEL"), Some(ListCopy::Kernel));
        assert_eq!(ListCopy::parse("auto"), Some(ListCopy::Auto));
        for bad in ["", "batches", "1", "0"] {
            assert_eq!(ListCopy::parse(bad), None, "{bad:?}");
        }
        for how in [
            ListCopy::Each,
            ListCopy::Batch,
            ListCopy::Kernel,
            ListCopy::Auto,
        ] {
            assert_eq!(ListCopy::decode(how.encode()), how);
        }
    }
}
