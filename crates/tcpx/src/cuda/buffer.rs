//! [`CudaBuffer`] (device memory), [`PinnedHostBuffer`] (page-locked, mapped host memory) and
//! [`AsyncCopy`] (a stream-ordered copy in flight).

use std::fmt;

use cudarc::driver::sys;

use super::device::{CudaDevice, CudaEvent, CudaStream};
use super::driver::check;
use crate::error::{Error, Result};
use crate::memory::{InFlight, Memory, MemoryKind, SharedMemory, BUFFER_ALIGN};

/// `len` plus the slack needed to align an allocation up to [`BUFFER_ALIGN`].
fn padded(api: &'static str, len: usize) -> Result<usize> {
    if len == 0 {
        return Err(Error::invalid(api, "a buffer must hold at least one byte"));
    }
    len.checked_add(BUFFER_ALIGN - 1)
        .ok_or_else(|| Error::invalid(api, format!("{len} bytes is too large to allocate")))
}

fn align_up(addr: u64) -> u64 {
    let a = BUFFER_ALIGN as u64;
    addr.div_ceil(a) * a
}

fn check_range(
    api: &'static str,
    what: &str,
    offset: usize,
    len: usize,
    size: usize,
) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(Error::invalid(
            api,
            format!("{what} range {offset}+{len} outside a buffer of {size} bytes"),
        )),
    }
}

/// A zeroed device allocation whose start is 4 KiB-aligned (over-allocated by up to 4 KiB − 1
/// and aligned up, as devmem-TCP requires). Implements [`Memory`] with kind
/// [`MemoryKind::Cuda`]: wrap it in [`SharedMemory::new`](crate::SharedMemory::new) to register
/// it. Freed on drop.
pub struct CudaBuffer {
    device: CudaDevice,
    raw: sys::CUdeviceptr,
    ptr: sys::CUdeviceptr,
    len: usize,
}

// SAFETY: the allocation is owned by this value; device memory is not Rust memory and every
// access goes through the driver, which is thread-safe.
unsafe impl Send for CudaBuffer {}
// SAFETY: `&self` methods only pass the owned device address to the driver, which is
// thread-safe; no Rust memory is shared.
unsafe impl Sync for CudaBuffer {}

impl fmt::Debug for CudaBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaBuffer")
            .field("device", &self.device.ordinal())
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

impl CudaBuffer {
    /// Allocates `len` zeroed bytes on `device`, 4 KiB-aligned.
    pub fn new(device: &CudaDevice, len: usize) -> Result<Self> {
        const API: &str = "CudaBuffer::new";
        let total = padded(API, len)?;
        device.bind()?;
        let mut raw: sys::CUdeviceptr = 0;
        // SAFETY: writes one device pointer; freed in Drop.
        let rc = unsafe { sys::cuMemAlloc_v2(&mut raw, total) };
        check("cuMemAlloc", rc, || {
            format!("{total} bytes on {}", device.describe())
        })?;
        let buffer = Self {
            device: device.clone(),
            raw,
            ptr: align_up(raw),
            len,
        };
        // SAFETY: `raw..raw+total` is the allocation just made; nothing else uses it yet.
        let rc = unsafe { sys::cuMemsetD8_v2(raw, 0, total) };
        check("cuMemsetD8", rc, || device.describe())?;
        // SAFETY: no pointers; the context is current. The memset ran on the legacy stream:
        // finish it so that work on any other stream sees zeroes.
        let rc = unsafe { sys::cuStreamSynchronize(std::ptr::null_mut()) };
        check("cuStreamSynchronize", rc, || device.describe())?;
        Ok(buffer)
    }

    /// The device address of the first byte (4 KiB-aligned).
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true (buffers hold at least one byte); present for symmetry with `len`.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device this buffer lives on.
    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    /// Copies `src` into the buffer at `offset` and waits for it.
    pub fn copy_from_host(&self, offset: usize, src: &[u8]) -> Result<()> {
        check_range(
            "CudaBuffer::copy_from_host",
            "destination",
            offset,
            src.len(),
            self.len,
        )?;
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: the destination range is inside this allocation; `src` is borrowed for the
        // whole (synchronous) copy.
        unsafe {
            self.device
                .copy_raw(self.ptr + offset as u64, src.as_ptr() as u64, src.len())
        }
    }

    /// Copies `dst.len()` bytes of the buffer from `offset` into `dst` and waits for it.
    pub fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        check_range(
            "CudaBuffer::copy_to_host",
            "source",
            offset,
            dst.len(),
            self.len,
        )?;
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: the source range is inside this allocation; `dst` is exclusively borrowed for
        // the whole (synchronous) copy.
        unsafe {
            self.device
                .copy_raw(dst.as_mut_ptr() as u64, self.ptr + offset as u64, dst.len())
        }
    }

    /// Copies `len` bytes from `src[src_offset..]` into `self[offset..]` on the device and waits.
    pub fn copy_from_device(
        &self,
        offset: usize,
        src: &CudaBuffer,
        src_offset: usize,
        len: usize,
    ) -> Result<()> {
        const API: &str = "CudaBuffer::copy_from_device";
        check_range(API, "destination", offset, len, self.len)?;
        check_range(API, "source", src_offset, len, src.len)?;
        if len == 0 {
            return Ok(());
        }
        // SAFETY: both ranges are inside live allocations borrowed for the synchronous copy.
        unsafe {
            self.device
                .copy_raw(self.ptr + offset as u64, src.ptr + src_offset as u64, len)
        }
    }

    /// Exports the buffer's allocation for another process of this host
    /// ([`IpcExport::of`](super::IpcExport::of)); the export's offset locates
    /// [`device_ptr`](Self::device_ptr) in it (the buffer starts 4 KiB-aligned inside its
    /// allocation).
    pub fn ipc_export(&self) -> Result<super::IpcExport> {
        super::IpcExport::of(&self.device, self.ptr)
    }

    /// Reads the whole buffer back into a `Vec` (tests, debugging).
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.len];
        self.copy_to_host(0, &mut v)?;
        Ok(v)
    }
}

impl Drop for CudaBuffer {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: frees the allocation made in `new`, once.
            let _ = unsafe { sys::cuMemFree_v2(self.raw) };
        }
    }
}

// SAFETY: `ptr..ptr+len` is device memory owned by this value, stable until drop; this type never
// creates Rust references to it.
unsafe impl Memory for CudaBuffer {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr as *mut u8
    }
    fn len(&self) -> usize {
        self.len
    }
    fn kind(&self) -> MemoryKind {
        MemoryKind::Cuda
    }
}

/// Zeroed, page-locked host memory (`cuMemHostAlloc`, portable and mapped into the GPU), its
/// start 4 KiB-aligned. The staging rings of the runtime and the unpack metadata use it: the
/// GPU reads and writes it directly at [`device_ptr`](Self::device_ptr) and copies to and from
/// it overlap with other work. Implements [`Memory`] with kind [`MemoryKind::Host`].
pub struct PinnedHostBuffer {
    device: CudaDevice,
    raw: *mut u8,
    ptr: *mut u8,
    device_ptr: u64,
    len: usize,
}

// SAFETY: the allocation is owned by this value and is plain bytes.
unsafe impl Send for PinnedHostBuffer {}
// SAFETY: shared access only reads through `&self`; writes need `&mut self` (or go through the
// unsafe/SharedMemory paths that own the aliasing rules).
unsafe impl Sync for PinnedHostBuffer {}

impl fmt::Debug for PinnedHostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedHostBuffer")
            .field("device", &self.device.ordinal())
            .field("ptr", &self.ptr)
            .field("device_ptr", &format_args!("{:#x}", self.device_ptr))
            .field("len", &self.len)
            .finish()
    }
}

impl PinnedHostBuffer {
    /// Allocates `len` zeroed bytes of pinned host memory, mapped into `device`'s address space.
    pub fn new(device: &CudaDevice, len: usize) -> Result<Self> {
        const API: &str = "PinnedHostBuffer::new";
        let total = padded(API, len)?;
        device.bind()?;
        let mut raw: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: writes one host pointer; freed in Drop.
        let rc = unsafe {
            sys::cuMemHostAlloc(
                &mut raw,
                total,
                sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP,
            )
        };
        check("cuMemHostAlloc", rc, || {
            format!("{total} bytes for {}", device.describe())
        })?;
        let raw = raw as *mut u8;
        let skip = (align_up(raw as u64) - raw as u64) as usize;
        // SAFETY: `skip < BUFFER_ALIGN`, so `raw + skip + len <= raw + total`.
        let ptr = unsafe { raw.add(skip) };
        // SAFETY: the whole allocation is ours and writable.
        unsafe { std::ptr::write_bytes(raw, 0, total) };
        let mut dev_raw: sys::CUdeviceptr = 0;
        // SAFETY: `raw` is a mapped pinned allocation of this context; writes one pointer.
        let rc = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev_raw, raw.cast(), 0) };
        let mapped = check("cuMemHostGetDevicePointer", rc, || device.describe());
        let buffer = Self {
            device: device.clone(),
            raw,
            ptr,
            device_ptr: dev_raw + skip as u64,
            len,
        };
        mapped?; // on failure `buffer` drops here and frees the allocation
        Ok(buffer)
    }

    /// The address the GPU uses for the first byte (equal to the host address on systems with
    /// unified addressing, which [`CudaDevice::new`] requires).
    pub fn device_ptr(&self) -> u64 {
        self.device_ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true (buffers hold at least one byte); present for symmetry with `len`.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device the memory is mapped into.
    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    /// The bytes. No GPU work may be writing them meanwhile (the borrow cannot see GPU work:
    /// wait for it first).
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` owns `len` initialized (zeroed at allocation) bytes.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, mutably. No GPU work may be reading or writing them meanwhile.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the pinned allocation of `len` bytes is owned by this value and mapped for the
        // CPU; `&mut self` guarantees exclusivity on the CPU side (no GPU work on it, per the doc).
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedHostBuffer {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: frees the allocation made in `new`, once.
            let _ = unsafe { sys::cuMemFreeHost(self.raw.cast()) };
        }
    }
}

// The buffer constructors and the stream's copy live with the buffers they make, so that
// `device` (contexts, streams, events) never imports `buffer`: buffers sit above devices.
impl CudaDevice {
    /// Allocates a zeroed, 4 KiB-aligned device buffer of `len` bytes.
    pub fn alloc(&self, len: usize) -> Result<CudaBuffer> {
        CudaBuffer::new(self, len)
    }

    /// Allocates a zeroed, 4 KiB-aligned pinned host buffer of `len` bytes, mapped into the GPU.
    pub fn alloc_pinned(&self, len: usize) -> Result<PinnedHostBuffer> {
        PinnedHostBuffer::new(self, len)
    }
}

impl CudaStream {
    /// Queues a copy of `len` bytes from `src[src_offset..]` to `dst[dst_offset..]` (host or
    /// device memory on either side; host memory should be pinned for the copy to overlap) and
    /// returns at once. Both memories stay alive and count as in flight (CPU access fails with
    /// `Busy`) until the returned [`AsyncCopy`] is dropped; dropping it waits for the copy.
    pub fn copy_async(
        &self,
        dst: &SharedMemory,
        dst_offset: usize,
        src: &SharedMemory,
        src_offset: usize,
        len: usize,
    ) -> Result<AsyncCopy> {
        const API: &str = "CudaStream::copy_async";
        dst.check_range(API, dst_offset, len)?;
        src.check_range(API, src_offset, len)?;
        let ops = vec![dst.begin_operation(API)?, src.begin_operation(API)?];
        if len > 0 {
            // SAFETY: ranges checked; the memories are kept alive and free of CPU slices by
            // `ops`, which the AsyncCopy holds until the event says the copy is done.
            unsafe {
                self.copy_raw_async(
                    dst.as_ptr() as u64 + dst_offset as u64,
                    src.as_ptr() as u64 + src_offset as u64,
                    len,
                )?;
            }
        }
        let event = self.record()?;
        Ok(AsyncCopy::new(event, ops))
    }
}

// SAFETY: `ptr..ptr+len` is host memory owned by this value, stable until drop; once shared, the
// only slices handed out go through SharedMemory's state check.
unsafe impl Memory for PinnedHostBuffer {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn kind(&self) -> MemoryKind {
        MemoryKind::Host
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::CudaBuffer {}
    impl Sealed for super::PinnedHostBuffer {}
}

/// Memory the GPU can address directly: [`CudaBuffer`] and (mapped) [`PinnedHostBuffer`].
/// Sealed: the unpack kernel trusts these addresses and lengths.
pub trait DeviceAccessible: sealed::Sealed + Send + Sync {
    /// The address the GPU uses for the first byte.
    fn device_addr(&self) -> u64;
    /// Length in bytes.
    fn byte_len(&self) -> usize;
}

impl DeviceAccessible for CudaBuffer {
    fn device_addr(&self) -> u64 {
        self.device_ptr()
    }
    fn byte_len(&self) -> usize {
        self.len()
    }
}

impl DeviceAccessible for PinnedHostBuffer {
    fn device_addr(&self) -> u64 {
        self.device_ptr()
    }
    fn byte_len(&self) -> usize {
        self.len()
    }
}

/// A copy queued on a stream ([`CudaStream::copy_async`](super::CudaStream::copy_async)): keeps
/// both memories alive and counted in flight until it completes. Dropping it before completion
/// waits for the copy (leaking it leaks the memories, which stay marked in flight: safe).
pub struct AsyncCopy {
    event: CudaEvent,
    ops: Vec<InFlight>,
    done: bool,
}

impl fmt::Debug for AsyncCopy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AsyncCopy")
            .field("event", &self.event)
            .field("done", &self.done)
            .finish()
    }
}

impl AsyncCopy {
    pub(crate) fn new(event: CudaEvent, ops: Vec<InFlight>) -> Self {
        Self {
            event,
            ops,
            done: false,
        }
    }

    /// True once the copy has completed (non-blocking); the memories are released then.
    pub fn is_done(&mut self) -> Result<bool> {
        if !self.done && self.event.is_done()? {
            self.finish();
        }
        Ok(self.done)
    }

    /// Waits for the copy and releases the memories.
    pub fn wait(mut self) -> Result<()> {
        self.event.synchronize()?;
        self.finish();
        Ok(())
    }

    /// The event recorded after the copy (to make another stream wait, or to poll).
    pub fn event(&self) -> &CudaEvent {
        &self.event
    }

    fn finish(&mut self) {
        self.done = true;
        self.ops.clear();
    }
}

impl Drop for AsyncCopy {
    fn drop(&mut self) {
        if !self.done {
            if let Err(e) = self.event.synchronize() {
                // The copy's fate is unknown: keep the memories marked in flight forever rather
                // than let the CPU touch bytes a DMA engine may still write.
                tracing::error!(target: "tcpx::cuda", "AsyncCopy dropped, wait failed: {e}");
                std::mem::forget(std::mem::take(&mut self.ops));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alignment_math() {
        assert_eq!(align_up(0), 0);
        assert_eq!(align_up(1), 4096);
        assert_eq!(align_up(4096), 4096);
        assert_eq!(align_up(0x7f00_0000_1200), 0x7f00_0000_2000);
        assert!(padded("t", 0).is_err());
        assert!(padded("t", usize::MAX).is_err());
        assert_eq!(padded("t", 1).unwrap(), 4096);
    }

    #[test]
    fn ranges() {
        assert!(check_range("t", "x", 0, 10, 10).is_ok());
        assert!(check_range("t", "x", 1, 10, 10).is_err());
        assert!(check_range("t", "x", usize::MAX, 1, 10).is_err());
    }
}
