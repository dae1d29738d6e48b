//! CUDA IPC: handing a device allocation to another process of the same host
//! ([`IpcExport`]), mapping one a peer handed over ([`IpcMapping`]), and
//! [`CopyPool`]: stream-ordered copies on a fixed set of streams whose completion is observed
//! through pooled events ([`PooledCopy`]).
//!
//! A legacy IPC handle (`cuIpcGetMemHandle`) names a whole `cuMemAlloc` allocation, never a
//! range inside one: [`IpcExport::of`] therefore looks the allocation up first
//! (`cuMemGetAddressRange`) and reports the pointer's offset in it; the importer adds that
//! offset to the base it maps. Memory from the virtual-memory API (`cuMemCreate`, PyTorch's
//! expandable segments) or from stream-ordered pools (`cuMemAllocAsync`) has no legacy
//! handle: the driver refuses it and the error names `cuIpcGetMemHandle`.
//!
//! Every function needs a [`CudaDevice`], which cannot exist without a usable driver, so
//! without CUDA nothing here is reachable except [`IpcMemHandle`]'s plain byte handling.

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;

use super::device::{CudaDevice, CudaEvent, CudaStream};
use super::driver::{check, cuda_error};
use crate::error::{Error, Result};

pub use tcpx_proto::ipc::{IpcMemHandle, IPC_HANDLE_BYTES};

/// Most streams a [`CopyPool`] runs (and events one [`PooledCopy`] holds).
pub const MAX_COPY_STREAMS: usize = 8;

fn handle_to_raw(h: IpcMemHandle) -> sys::CUipcMemHandle {
    sys::CUipcMemHandle {
        reserved: h.as_bytes().map(|b| b as std::ffi::c_char),
    }
}

fn handle_from_raw(raw: &sys::CUipcMemHandle) -> IpcMemHandle {
    IpcMemHandle::from_bytes(raw.reserved.map(|c| c as u8))
}

/// The allocation `ptr` points into, as (base, size), from `cuMemGetAddressRange` in
/// `device`'s context.
pub fn allocation_range(device: &CudaDevice, ptr: u64) -> Result<(u64, usize)> {
    device.bind()?;
    let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
    // SAFETY: writes one address and one size; the driver only looks the address up (an
    // address it does not know gives CUDA_ERROR_NOT_FOUND / INVALID_VALUE).
    let rc = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) };
    check("cuMemGetAddressRange", rc, || {
        format!("address {ptr:#x}, {}", device.describe())
    })?;
    Ok((base, size))
}

/// A device allocation exported for other processes: its handle, where the allocation
/// starts and how long it is in this process, and the offset of the exported pointer in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpcExport {
    /// The allocation's IPC handle.
    pub handle: IpcMemHandle,
    /// The allocation's base address in the exporting process.
    pub base: u64,
    /// The allocation's size in bytes.
    pub alloc_len: usize,
    /// The exported pointer's offset from `base`.
    pub offset: usize,
}

impl IpcExport {
    /// Exports the allocation holding `ptr`, device memory of `device`
    /// (`cuMemGetAddressRange`, then `cuIpcGetMemHandle` on its base).
    pub fn of(device: &CudaDevice, ptr: u64) -> Result<Self> {
        let (base, alloc_len) = allocation_range(device, ptr)?;
        let mut raw = sys::CUipcMemHandle {
            reserved: [0; IPC_HANDLE_BYTES],
        };
        // SAFETY: writes one handle; `base` is the start of a live allocation of the current
        // context (just looked up), which is what the call requires.
        let rc = unsafe { sys::cuIpcGetMemHandle(&mut raw, base) };
        check("cuIpcGetMemHandle", rc, || {
            format!(
                "allocation {base:#x}+{alloc_len} holding {ptr:#x}, {} (memory from \
                 cuMemCreate or cuMemAllocAsync pools has no legacy IPC handle)",
                device.describe()
            )
        })?;
        Ok(Self {
            handle: handle_from_raw(&raw),
            base,
            alloc_len,
            offset: (ptr - base) as usize,
        })
    }
}

/// A peer's allocation mapped into this process (`cuIpcOpenMemHandle` with
/// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`, so an allocation on another GPU is reached over
/// peer-to-peer). Closed (`cuIpcCloseMemHandle`) by [`close`](Self::close) or on drop: no copy
/// may use the mapping by then.
pub struct IpcMapping {
    device: CudaDevice,
    base: u64,
    len: Option<usize>,
    open: bool,
}

// SAFETY: the mapping is a device address owned by this value; every use goes through the
// driver, which is thread-safe.
unsafe impl Send for IpcMapping {}
// SAFETY: the mapping is a device address owned by this value, used only through the
// thread-safe driver; `&self` methods only read plain fields.
unsafe impl Sync for IpcMapping {}

impl fmt::Debug for IpcMapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IpcMapping")
            .field("device", &self.device.ordinal())
            .field("base", &format_args!("{:#x}", self.base))
            .field("len", &self.len)
            .field("open", &self.open)
            .finish()
    }
}

impl IpcMapping {
    /// Maps the allocation `handle` names into `device`'s context. Opening the same handle
    /// again in one context returns the same address (the driver counts the opens; each
    /// mapping closes its own).
    pub fn open(device: &CudaDevice, handle: &IpcMemHandle) -> Result<Self> {
        device.bind()?;
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: writes one device pointer; the handle is plain bytes, which the driver
        // validates (a forged or stale one gives an error, not a mapping).
        let rc = unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut base,
                handle_to_raw(*handle),
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        };
        check("cuIpcOpenMemHandle", rc, || {
            format!("handle {handle:?} on {}", device.describe())
        })?;
        let mut mapping = Self {
            device: device.clone(),
            base,
            len: None,
            open: true,
        };
        // The mapping's true size, to check a peer's claimed range against: what the driver
        // says, when it says it for imported memory.
        mapping.len = allocation_range(device, base)
            .ok()
            .filter(|&(b, _)| b == base)
            .map(|(_, len)| len);
        Ok(mapping)
    }

    /// The mapped allocation's base address in this process.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// The mapped allocation's size as the driver reports it (`None` when it does not).
    pub fn len(&self) -> Option<usize> {
        self.len
    }

    /// True when the driver reported a zero size (never for a real mapping).
    pub fn is_empty(&self) -> bool {
        self.len == Some(0)
    }

    /// The device whose context holds the mapping.
    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    /// Closes the mapping now and says whether the driver agreed. No copy may use it any
    /// more (wait for them first).
    pub fn close(mut self) -> Result<()> {
        self.close_now()
    }

    fn close_now(&mut self) -> Result<()> {
        if !self.open {
            return Ok(());
        }
        self.open = false;
        self.device.bind()?;
        // SAFETY: `base` came from cuIpcOpenMemHandle in this context and is closed once
        // (`open` is cleared first); the owner of this value guarantees no copy uses it.
        let rc = unsafe { sys::cuIpcCloseMemHandle(self.base) };
        check("cuIpcCloseMemHandle", rc, || {
            format!("mapping {:#x} on {}", self.base, self.device.describe())
        })
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        if let Err(e) = self.close_now() {
            tracing::warn!(target: "tcpx::cuda", "closing an IPC mapping: {e}");
        }
    }
}

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

/// A fixed set of non-blocking streams on one device and a free list of events, for
/// operations that are many small or few large device copies. Streams are created once;
/// events are reused (created only when every pooled one is in use), so submitting an
/// operation creates nothing in steady state. Cheap to share (`Arc`).
pub struct CopyPool {
    device: CudaDevice,
    streams: Vec<CudaStream>,
    events: Mutex<Vec<CudaEvent>>,
    next: AtomicUsize,
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
}

/// The copies of one [`CopyPool::submit`]: one event per stream they ran on. Dropping it
/// before it reported done waits for the copies; its events go back to the pool.
pub struct PooledCopy {
    pool: Arc<CopyPool>,
    events: [Option<CudaEvent>; MAX_COPY_STREAMS],
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
        self.done = true;
        Ok(true)
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
        self.done = true;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_are_plain_bytes() {
        let mut bytes = [0u8; IPC_HANDLE_BYTES];
        bytes[0] = 0xab;
        bytes[63] = 0xff;
        let h = IpcMemHandle::from_bytes(bytes);
        assert_eq!(h.as_bytes(), &bytes);
        assert_eq!(handle_from_raw(&handle_to_raw(h)), h);
        assert!(format!("{h:?}").starts_with("IpcMemHandle(ab00"));
    }

    #[test]
    fn export_open_and_copy_on_one_gpu() {
        if let Some(why) = super::super::skip_reason() {
            println!("{why}");
            return;
        }
        let gpu = CudaDevice::new(0).unwrap();
        let buf = gpu.alloc(1 << 20).unwrap();
        let e = IpcExport::of(&gpu, buf.device_ptr() + 4096).unwrap();
        assert!(e.base <= buf.device_ptr());
        assert_eq!(e.base + e.offset as u64, buf.device_ptr() + 4096);
        assert!(e.alloc_len >= 1 << 20);
        // Opening one's own handle: drivers refuse it (no process maps its own export); either
        // way the answer is a value, and a mapping, if given, closes cleanly.
        match IpcMapping::open(&gpu, &e.handle) {
            Ok(m) => m.close().unwrap(),
            Err(err) => println!("opening its own handle: {err}"),
        }
        // A forged handle is refused, naming the call.
        let forged = IpcMapping::open(&gpu, &IpcMemHandle::from_bytes([7; 64])).unwrap_err();
        assert!(
            forged.to_string().contains("cuIpcOpenMemHandle"),
            "{forged}"
        );

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
}
