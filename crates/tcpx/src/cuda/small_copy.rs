//! [`SmallCopier`]: synchronous copies of a few KiB between device memory and host bytes, for
//! the runtime's small one-sided operations that travel inline in control messages.
//!
//! A 4 KiB one-sided write of GPU memory through the staged comms pays a ring slot, an
//! engine hand-off, an event poll and a plugin request on each side; the host figure for the
//! same write, carried inline, is about a third of it. Inline, a GPU operation needs only one
//! small copy on each side: the initiator gathers its blocks into the control message, the
//! target copies the message's bytes into its blocks. Done here, each is one `cuMemcpyAsync`
//! per piece into (or out of) a pinned bounce buffer on a non-blocking stream of the copier's
//! own, and one wait for the stream (a spin, then polls, at most [`SMALL_COPY_TIMEOUT`]):
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

use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::sys;

use super::buffer::PinnedHostBuffer;
use super::device::{CudaDevice, CudaStream};
use super::driver::{check, require};
use crate::error::{Error, ErrorKind, Result};
use crate::memory::{MemoryKind, Operation, SharedMemory};

/// Bytes one lane's bounce buffer holds: one copy of more goes through it in several rounds.
/// As large as the largest inline operation, so an inline operation is one round.
pub const SMALL_COPY_BOUNCE_BYTES: usize = 64 * 1024;

/// Lanes of one GPU's copier: each a stream and a bounce buffer.
const LANES: usize = 4;

/// Longest a copy is waited for. A copy of at most 64 KiB takes µs, or as long as the copy
/// engine's queue ahead of it (a large staged transfer of another stream): past this, the GPU
/// is taken as stuck and the copy fails with a timeout instead of blocking the caller (the
/// target's control loop, or the application) for ever.
pub const SMALL_COPY_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a wait spins on the stream before it sleeps between polls: a small copy is done
/// within it (6.5–9 µs on an H200), a copy queued behind a large one is not and should not
/// cost a core meanwhile.
const SPIN: Duration = Duration::from_micros(50);

/// Synchronous small copies between one GPU's memory and host bytes (see the module docs).
pub struct SmallCopier {
    device: CudaDevice,
    lanes: Vec<Mutex<Lane>>,
}

/// One stream and its bounce buffer, used by one copy at a time.
struct Lane {
    stream: CudaStream,
    bounce: PinnedHostBuffer,
    /// Set when a copy of the lane timed out or failed: the GPU may still use the bounce, so
    /// the lane is never used again.
    retired: bool,
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
/// (a stream and 64 KiB of pinned memory per lane).
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

    /// A copier of its own for `device` (most callers share the process's: [`Self::for_ordinal`]).
    pub fn new(device: &CudaDevice) -> Result<Self> {
        let lanes = (0..LANES)
            .map(|_| {
                Ok(Mutex::new(Lane {
                    stream: device.stream()?,
                    bounce: device.alloc_pinned(SMALL_COPY_BOUNCE_BYTES)?,
                    retired: false,
                }))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            device: device.clone(),
            lanes,
        })
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
        let mut lane = self.lane()?;
        let _current = Current::push(&self.device)?;
        let mut tokens = Tokens::default();
        let mut queued = 0;
        let queuing = queue_reads(&mut lane, pieces, &mut tokens, out, &mut queued);
        // Whatever ended the loop, no copy outlives the call: the bounce is the next copy's,
        // and the memories stop counting in flight on return.
        let drained = lane.drain_into(queued, out);
        queuing.and(drained)
    }

    /// [`Self::write_ranges`] over pieces `(memory, offset, bytes)` of several CUDA memories,
    /// with one wait for all of them (see [`Self::gather`]).
    pub fn scatter<'m, 'b>(
        &self,
        pieces: impl IntoIterator<Item = (&'m SharedMemory, usize, &'b [u8])>,
    ) -> Result<()> {
        let mut lane = self.lane()?;
        let _current = Current::push(&self.device)?;
        let mut tokens = Tokens::default();
        let mut queued = 0;
        let queuing = queue_writes(&mut lane, pieces, &mut tokens, &mut queued);
        // As for reads: every queued copy has read the bounce and written its memory before
        // the call returns, whatever ended the loop.
        let synced = if queued > 0 {
            lane.synchronize()
        } else {
            Ok(())
        };
        queuing.and(synced)
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

/// Queues the device → bounce copies of `pieces` on `lane`, draining the bounce into `out`
/// whenever it is full; `queued` says how many bytes of the bounce the copies queued last
/// fill (the caller drains them, also after an error).
fn queue_reads<'m>(
    lane: &mut Lane,
    pieces: impl IntoIterator<Item = (&'m SharedMemory, usize, usize)>,
    tokens: &mut Tokens<'m>,
    out: &mut Vec<u8>,
    queued: &mut usize,
) -> Result<()> {
    const API: &str = "SmallCopier::read_ranges";
    for (memory, offset, len) in pieces {
        tokens.admit(API, memory, offset, len)?;
        let mut done = 0;
        while done < len {
            if *queued == SMALL_COPY_BOUNCE_BYTES {
                lane.drain_into(*queued, out)?;
                *queued = 0;
            }
            let n = (len - done).min(SMALL_COPY_BOUNCE_BYTES - *queued);
            // SAFETY: the source lies inside live device memory (checked), kept alive and
            // counted in flight by `tokens` until the caller drains the lane; the destination
            // is the lane's bounce, which no one else touches while the lane is locked, and
            // `queued + n` stays inside it.
            unsafe {
                lane.queue(
                    lane.bounce.device_ptr() + *queued as u64,
                    memory.as_ptr() as u64 + (offset + done) as u64,
                    n,
                )?;
            }
            *queued += n;
            done += n;
        }
    }
    Ok(())
}

/// Copies `pieces` into the bounce and queues the bounce → device copies on `lane`, waiting
/// for them whenever the bounce is full; `queued` says how many bytes the copies queued last
/// read (the caller waits for them, also after an error).
fn queue_writes<'m, 'b>(
    lane: &mut Lane,
    pieces: impl IntoIterator<Item = (&'m SharedMemory, usize, &'b [u8])>,
    tokens: &mut Tokens<'m>,
    queued: &mut usize,
) -> Result<()> {
    const API: &str = "SmallCopier::write_ranges";
    for (memory, offset, bytes) in pieces {
        tokens.admit(API, memory, offset, bytes.len())?;
        let mut done = 0;
        while done < bytes.len() {
            if *queued == SMALL_COPY_BOUNCE_BYTES {
                // The bounce is reused: its copies must have read it first.
                lane.synchronize()?;
                *queued = 0;
            }
            let n = (bytes.len() - done).min(SMALL_COPY_BOUNCE_BYTES - *queued);
            lane.bounce.as_mut_slice()[*queued..*queued + n]
                .copy_from_slice(&bytes[done..done + n]);
            // SAFETY: the destination lies inside live device memory (checked), kept alive and
            // counted in flight by `tokens` until the caller waits for the lane; the source is
            // the lane's bounce, which no one else touches while the lane is locked and which
            // is not written again before the copy is waited for.
            unsafe {
                lane.queue(
                    memory.as_ptr() as u64 + (offset + done) as u64,
                    lane.bounce.device_ptr() + *queued as u64,
                    n,
                )?;
            }
            *queued += n;
            done += n;
        }
    }
    Ok(())
}

impl Lane {
    /// Queues one copy on the lane's stream (the device's context is current).
    ///
    /// # Safety
    /// `src..src+len` must stay readable and `dst..dst+len` writable until the stream is
    /// synchronized.
    unsafe fn queue(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        // SAFETY: forwarded from this function's contract.
        let rc = unsafe { sys::cuMemcpyAsync(dst, src, len, self.stream.raw()) };
        check("cuMemcpyAsync", rc, || {
            format!("{len} bytes {src:#x} -> {dst:#x} (small copy)")
        })
    }

    /// Waits for the lane's copies (the device's context is current): spins on the stream,
    /// then sleeps between polls, at most [`SMALL_COPY_TIMEOUT`]. A copy that failed or did
    /// not finish retires the lane.
    fn synchronize(&mut self) -> Result<()> {
        let started = Instant::now();
        loop {
            // SAFETY: a live stream of the current context.
            let rc = unsafe { sys::cuStreamQuery(self.stream.raw()) };
            if rc == sys::CUresult::CUDA_SUCCESS {
                return Ok(());
            }
            if rc != sys::CUresult::CUDA_ERROR_NOT_READY {
                self.retired = true;
                return check("cuStreamQuery", rc, || "small copy".to_string());
            }
            let waited = started.elapsed();
            if waited > SMALL_COPY_TIMEOUT {
                self.retired = true;
                return Err(Error::new(
                    "SmallCopier",
                    ErrorKind::Timeout(waited),
                    "a small GPU copy did not complete (its lane is retired)",
                ));
            }
            if waited < SPIN {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }

    /// Waits for the lane's copies into the bounce, then appends its first `queued` bytes
    /// (nothing once the lane is retired: its bounce holds no complete copy).
    fn drain_into(&mut self, queued: usize, out: &mut Vec<u8>) -> Result<()> {
        if self.retired {
            return Err(retired("the lane was retired by a failed copy".into()));
        }
        if queued > 0 {
            self.synchronize()?;
            out.extend_from_slice(&self.bounce.as_slice()[..queued]);
        }
        Ok(())
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
