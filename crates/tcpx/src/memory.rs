//! Memory that plugins read and write: [`HostBuffer`] (4 KiB-aligned host allocation), the
//! [`Memory`] trait other kinds (CUDA buffers) implement, and [`SharedMemory`], the shared,
//! access-checked handle that registrations and requests keep alive.
//!
//! Soundness model: while any send or receive is in flight on a memory, the plugin (or the
//! kernel, or a DMA engine) may read or write it at any moment, so Rust code must not hold a
//! reference into it. [`SharedMemory`] keeps one atomic state: `n >= 0` operations in flight, or
//! `CPU_ACCESS` while the CPU holds a slice. Posting fails with `Busy` during CPU access and CPU
//! access fails with `Busy` while operations are in flight. One atomic per post and completion.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Arc;

use crossbeam_utils::CachePadded;

use tcpx_sys::{NCCL_PTR_CUDA, NCCL_PTR_HOST};

use crate::error::{Error, ErrorKind, Result};

/// Alignment of every buffer this crate allocates (devmem-TCP requires 4 KiB for CUDA memory).
pub const BUFFER_ALIGN: usize = 4096;

/// Bytes of a transparent huge page on x86-64 (and aarch64 with 4 KiB base pages): the
/// alignment and rounding of [`HostBuffer::in_huge_pages`].
pub const HUGE_PAGE: usize = 2 << 20;

/// Where memory lives (host or CUDA): defined with the wire formats in `tcpx-proto`, whose
/// codes are the ABI's (checked below).
pub use tcpx_proto::MemoryKind;

const _: () = assert!(NCCL_PTR_HOST == 1 && NCCL_PTR_CUDA == 2);

/// Memory that can be registered with a plugin.
///
/// # Safety
/// `as_ptr()..as_ptr()+len()` must be memory of kind `kind()`, valid and not moved or freed for
/// as long as the implementor is alive, and not accessed through Rust references by the
/// implementor while it is shared (only [`SharedMemory`] hands out slices, under its state check).
pub unsafe trait Memory: Send + Sync + 'static {
    /// Start address (a device pointer for CUDA memory).
    fn as_ptr(&self) -> *mut u8;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// Where it lives.
    fn kind(&self) -> MemoryKind;
    /// True when `len()` is zero.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A zeroed, 4 KiB-aligned host allocation.
pub struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
    /// Bytes of the mapping of its own that holds it ([`HostBuffer::in_huge_pages`]); `None`
    /// when it comes from the global allocator.
    mapped: Option<usize>,
}

// SAFETY: HostBuffer uniquely owns its allocation; it is plain bytes.
unsafe impl Send for HostBuffer {}
// SAFETY: shared access only reads through `&self` methods; writes need `&mut self`.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// Allocates `len` zeroed bytes aligned to [`BUFFER_ALIGN`].
    pub fn new(len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::invalid(
                "HostBuffer::new",
                "a buffer must hold at least one byte",
            ));
        }
        let layout = Self::layout(len)?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or_else(|| {
            Error::new(
                "HostBuffer::new",
                ErrorKind::InvalidArgument(format!("out of memory allocating {len} bytes")),
                "",
            )
        })?;
        Ok(Self {
            ptr,
            len,
            mapped: None,
        })
    }

    /// Allocates `len` zeroed bytes in a mapping of their own, aligned to and rounded up to
    /// [`HUGE_PAGE`] and offered to the kernel for transparent huge pages (`MADV_HUGEPAGE`,
    /// which the default THP setting `madvise` waits for): for buffers of megabytes that a
    /// process keeps and copies through, such as pack buffers.
    ///
    /// Why: their first touch then faults 2 MiB at a time. Faulting in 4 MiB took 0.36–0.83
    /// ms so, against 1.6–2.0 ms by 4 KiB pages, on the 2 × H200 host and on the build box
    /// (docs/RESULTS.md, thirty-eighth session); the pages of a pack buffer are touched on
    /// the first transfer that needs it, or on the thread that keeps some ready. Where the
    /// kernel has no huge page to give (THP off, memory fragmented) the buffer is the same,
    /// in small pages. On systems other than Linux this is [`HostBuffer::new`].
    pub fn in_huge_pages(len: usize) -> Result<Self> {
        #[cfg(target_os = "linux")]
        {
            Self::mapped_huge(len)
        }
        #[cfg(not(target_os = "linux"))]
        {
            Self::new(len)
        }
    }

    #[cfg(target_os = "linux")]
    fn mapped_huge(len: usize) -> Result<Self> {
        let what = "HostBuffer::in_huge_pages";
        if len == 0 {
            return Err(Error::invalid(what, "a buffer must hold at least one byte"));
        }
        let too_large = || Error::invalid(what, format!("{len} bytes is too large to map"));
        let map_len = len
            .checked_next_multiple_of(HUGE_PAGE)
            .ok_or_else(too_large)?;
        // One huge page more than needed, so that an aligned stretch of `map_len` lies inside.
        let reserve = map_len.checked_add(HUGE_PAGE).ok_or_else(too_large)?;
        // SAFETY: a new private anonymous mapping at an address the kernel picks: no memory
        // of this process is touched or replaced.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                reserve,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(Error::new(
                what,
                ErrorKind::InvalidArgument(format!(
                    "cannot map {reserve} bytes: {}",
                    std::io::Error::last_os_error()
                )),
                "",
            ));
        }
        let base = base as usize;
        let start = base.next_multiple_of(HUGE_PAGE);
        let head = start - base;
        let tail = reserve - head - map_len;
        // SAFETY: both stretches lie inside the mapping just made, outside the aligned part
        // kept, and nothing refers to them; unmapping them cannot fail but for bad arguments.
        unsafe {
            if head > 0 {
                libc::munmap(base as *mut libc::c_void, head);
            }
            if tail > 0 {
                libc::munmap((start + map_len) as *mut libc::c_void, tail);
            }
        }
        // SAFETY: advice on the mapping just made; a kernel without transparent huge pages
        // refuses it, and the memory then stays in small pages (nothing else changes).
        unsafe { libc::madvise(start as *mut libc::c_void, map_len, libc::MADV_HUGEPAGE) };
        let ptr = NonNull::new(start as *mut u8)
            .ok_or_else(|| Error::invalid(what, "the kernel mapped address 0"))?;
        // Anonymous memory reads as zeros until written: the buffer is zeroed.
        Ok(Self {
            ptr,
            len,
            mapped: Some(map_len),
        })
    }

    fn layout(len: usize) -> Result<Layout> {
        Layout::from_size_align(len, BUFFER_ALIGN).map_err(|_| {
            Error::invalid(
                "HostBuffer::new",
                format!("{len} bytes is too large to allocate"),
            )
        })
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` owns `len` initialized (zeroed at allocation) bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` owns `len` initialized (zeroed at allocation) bytes, and `&mut self`
        // guarantees no other slice of them exists.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        if let Some(map_len) = self.mapped {
            // SAFETY: `ptr..ptr+map_len` is the mapping made in `mapped_huge`, owned by this
            // buffer alone, and no slice of it outlives `self`.
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), map_len) };
            return;
        }
        if let Ok(layout) = Self::layout(self.len) {
            // SAFETY: allocated in `new` with this very layout.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) }
        }
    }
}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuffer")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}

// SAFETY: the allocation is owned, stable and host memory; once shared inside SharedMemory, the
// only slices handed out go through SharedMemory's state check.
unsafe impl Memory for HostBuffer {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    fn len(&self) -> usize {
        self.len
    }
    fn kind(&self) -> MemoryKind {
        MemoryKind::Host
    }
}

/// Memory the caller owns (a host pointer or a CUDA device pointer), e.g. handed over from C
/// or Python. This value does not own the allocation: dropping it frees nothing, and the
/// caller keeps the allocation alive for as long as any [`SharedMemory`] built on it exists.
pub struct ForeignMemory {
    ptr: NonNull<u8>,
    len: usize,
    kind: MemoryKind,
}

// SAFETY: the caller promised (`ForeignMemory::new`) an allocation valid for the life of this
// value; it is plain bytes, and this type hands out no references into it.
unsafe impl Send for ForeignMemory {}
// SAFETY: the allocation stays valid for the life of this value (the caller's promise to
// `ForeignMemory::new`); `&self` methods only return the address and length, so shared use
// from several threads reads nothing but those two plain values.
unsafe impl Sync for ForeignMemory {}

impl ForeignMemory {
    /// Wraps caller-owned memory. Refuses a null pointer, zero length, and a range that wraps
    /// around the address space.
    ///
    /// # Safety
    /// `[ptr, ptr + len)` is one allocation of `kind` memory that stays valid, and is not
    /// freed or reused, until this value and every clone of the [`SharedMemory`] (and of
    /// anything built on it, such as a runtime `Region`) are dropped: transfers in flight
    /// hold clones and may read or write the memory until they complete. While the memory is
    /// shared, the caller must not hold Rust references into it either (write it through
    /// [`SharedMemory::with_bytes_mut`], or through raw pointers only while no transfer is in
    /// flight).
    pub unsafe fn new(ptr: *mut u8, len: usize, kind: MemoryKind) -> Result<Self> {
        const API: &str = "ForeignMemory::new";
        let ptr = NonNull::new(ptr).ok_or_else(|| Error::invalid(API, "the pointer is null"))?;
        if len == 0 {
            return Err(Error::invalid(
                API,
                "the memory must hold at least one byte",
            ));
        }
        if (ptr.as_ptr() as usize).checked_add(len).is_none() {
            return Err(Error::invalid(
                API,
                format!("{len} bytes at {ptr:p} wrap around the address space"),
            ));
        }
        Ok(Self { ptr, len, kind })
    }
}

impl std::fmt::Debug for ForeignMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForeignMemory")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("kind", &self.kind)
            .finish()
    }
}

// SAFETY: `new`'s contract makes the range valid `kind` memory for the life of this value and
// of every SharedMemory holding it; this type never forms references into it.
unsafe impl Memory for ForeignMemory {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    fn len(&self) -> usize {
        self.len
    }
    fn kind(&self) -> MemoryKind {
        self.kind
    }
}

const CPU_ACCESS: isize = -1;

/// Three cache lines, each with one kind of traffic: the `Arc`'s counts in front (every
/// clone and drop writes them), the memory's handle (read for every check and copy, written
/// never) and the state (written twice by every copy and every transfer in flight).
///
/// Why apart: the engines copy small messages in and out of application memory, each copy
/// counted in `state`, while the application thread reads the handle for every message it
/// posts (its length, for the bounds check). On one line, every copy an engine made evicted
/// the line the application's next posting read: a miss per message on the thread that sets
/// the rate of small messages (`scripts/perf/small_profile.sh`, 4 KiB: the length read was a
/// fourteenth of `Connection::recv`'s samples).
#[repr(C, align(128))]
struct Shared {
    memory: Box<dyn Memory>,
    /// `n >= 0`: operations in flight; `CPU_ACCESS`: a slice is out.
    state: CachePadded<AtomicIsize>,
}

// The handle and the state on lines of their own, after the `Arc`'s counts (see `Shared`).
const _: () = assert!(std::mem::align_of::<Shared>() >= 128);
const _: () = assert!(std::mem::offset_of!(Shared, state) >= 128);

/// Shared, access-checked memory: what registrations and requests hold. Cheap to clone.
#[derive(Clone)]
pub struct SharedMemory {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for SharedMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedMemory")
            .field("ptr", &self.as_ptr())
            .field("len", &self.len())
            .field("kind", &self.kind())
            .field("in_flight", &self.in_flight())
            .finish()
    }
}

impl SharedMemory {
    /// Shares `memory`.
    pub fn new(memory: impl Memory) -> Self {
        Self {
            shared: Arc::new(Shared {
                memory: Box::new(memory),
                state: CachePadded::new(AtomicIsize::new(0)),
            }),
        }
    }

    /// Allocates a shared [`HostBuffer`] of `len` bytes.
    pub fn host(len: usize) -> Result<Self> {
        Ok(Self::new(HostBuffer::new(len)?))
    }

    /// Allocates a shared [`HostBuffer::in_huge_pages`] of `len` bytes.
    pub fn host_in_huge_pages(len: usize) -> Result<Self> {
        Ok(Self::new(HostBuffer::in_huge_pages(len)?))
    }

    /// Start address.
    pub fn as_ptr(&self) -> *mut u8 {
        self.shared.memory.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.shared.memory.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where it lives.
    pub fn kind(&self) -> MemoryKind {
        self.shared.memory.kind()
    }

    /// Operations in flight (0 while the CPU holds a slice).
    pub fn in_flight(&self) -> usize {
        self.shared.state.load(Ordering::Acquire).max(0) as usize
    }

    /// True when both handles share one allocation.
    pub fn same_as(&self, other: &SharedMemory) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }

    /// Checks that `offset..offset+len` lies inside the memory.
    pub fn check_range(&self, api: &'static str, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(Error::invalid(
                api,
                format!(
                    "range {offset}+{len} outside memory of {} bytes",
                    self.len()
                ),
            )),
        }
    }

    /// Reads the host bytes; fails with `Busy` while operations are in flight.
    pub fn with_bytes<R>(&self, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
        let _guard = self.cpu_access("SharedMemory::with_bytes")?;
        // SAFETY: host memory (checked), no operation in flight and none can start while the
        // guard holds CPU_ACCESS; the memory outlives `self`.
        let bytes = unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len()) };
        Ok(f(bytes))
    }

    /// Writes the host bytes; fails with `Busy` while operations are in flight.
    pub fn with_bytes_mut<R>(&self, f: impl FnOnce(&mut [u8]) -> R) -> Result<R> {
        let _guard = self.cpu_access("SharedMemory::with_bytes_mut")?;
        // SAFETY: host memory (checked), no operation in flight and none can start while the
        // guard holds CPU_ACCESS, which is exclusive, so no other slice exists; the memory
        // outlives `self`.
        let bytes = unsafe { std::slice::from_raw_parts_mut(self.as_ptr(), self.len()) };
        Ok(f(bytes))
    }

    /// Copies `len` bytes from `src` at `src_offset` to `dst` at `dst_offset` (host memory
    /// both), as one operation in flight on each, like a plugin request would: the copy may
    /// run while sends and receives are in flight on either memory (the bytes it races with
    /// are the application's race, as with a plugin request on them), but not while the CPU
    /// holds a slice of either (`Busy`). Packing small one-sided blocks relies on this: the
    /// blocks' memory usually has other transfers in flight.
    pub fn copy(
        src: &SharedMemory,
        src_offset: usize,
        dst: &SharedMemory,
        dst_offset: usize,
        len: usize,
    ) -> Result<()> {
        Self::copy_ranges(src, dst, [(src_offset, dst_offset, len)])
    }

    /// [`SharedMemory::copy`] of many `(src_offset, dst_offset, len)` ranges between the same
    /// two memories, marked in flight once for all of them (packing thousands of small blocks
    /// pays the state atomics once, not per block). Stops at the first range outside either
    /// memory, after copying the ranges before it.
    pub fn copy_ranges(
        src: &SharedMemory,
        dst: &SharedMemory,
        ranges: impl IntoIterator<Item = (usize, usize, usize)>,
    ) -> Result<()> {
        const API: &str = "SharedMemory::copy";
        for memory in [src, dst] {
            if memory.kind() != MemoryKind::Host {
                return Err(Error::invalid(
                    API,
                    format!("{:?} memory is not CPU-accessible", memory.kind()),
                ));
            }
        }
        let _reading = src.borrow_operation(API)?;
        let _writing = dst.borrow_operation(API)?;
        for (src_offset, dst_offset, len) in ranges {
            src.check_range(API, src_offset, len)?;
            dst.check_range(API, dst_offset, len)?;
            // SAFETY: both ranges lie inside host memory that outlives the tokens; no Rust
            // slice of either exists (the tokens exclude CPU_ACCESS); only raw pointers are
            // used, and `copy` (memmove) is correct even when both ranges overlap in one
            // memory.
            unsafe {
                std::ptr::copy(
                    src.as_ptr().add(src_offset),
                    dst.as_ptr().add(dst_offset),
                    len,
                );
            }
        }
        Ok(())
    }

    /// [`SharedMemory::write_at`] of many `(offset, bytes)` pieces, marked in flight once for
    /// all of them: engines scattering many small messages into one application region
    /// would otherwise write its state atomic twice per message, from several cores. Stops
    /// at the first piece outside the memory, after writing the pieces before it.
    pub fn write_ranges<'a>(
        &self,
        pieces: impl IntoIterator<Item = (usize, &'a [u8])>,
    ) -> Result<()> {
        const API: &str = "SharedMemory::write_ranges";
        self.check_host(API)?;
        let _writing = self.borrow_operation(API)?;
        for (offset, bytes) in pieces {
            self.check_range(API, offset, bytes.len())?;
            // SAFETY: as in `write_at`: the range is inside live host memory of which no Rust
            // slice exists (the token excludes CPU_ACCESS), so `bytes` cannot overlap it.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    bytes.as_ptr(),
                    self.as_ptr().add(offset),
                    bytes.len(),
                )
            };
        }
        Ok(())
    }

    /// Appends the bytes of the `(offset, len)` ranges of host memory to `out`, marked in
    /// flight once for all of them, like [`SharedMemory::write_ranges`]: allowed while sends
    /// and receives are in flight on it (a small one-sided write gathers its blocks with it
    /// while the application's other transfers of the same region run). Stops at the first
    /// range outside the memory, after reading the ranges before it.
    pub fn read_ranges(
        &self,
        ranges: impl IntoIterator<Item = (usize, usize)>,
        out: &mut Vec<u8>,
    ) -> Result<()> {
        const API: &str = "SharedMemory::read_ranges";
        self.check_host(API)?;
        let _reading = self.borrow_operation(API)?;
        for (offset, len) in ranges {
            self.check_range(API, offset, len)?;
            out.reserve(len);
            let at = out.len();
            // SAFETY: the range is inside live host memory (checked above) of which no Rust
            // slice exists (the token excludes CPU_ACCESS), and `out` has room for `len` more
            // bytes after its `at` initialised ones, in its own allocation: the two cannot
            // overlap. Raw pointers only, as the engines use for the memory; the copied bytes
            // are then initialised, so the length may cover them.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.as_ptr().add(offset),
                    out.as_mut_ptr().add(at),
                    len,
                );
                out.set_len(at + len);
            }
        }
        Ok(())
    }

    /// Copies `bytes` into host memory at `offset`, as one operation in flight (like
    /// [`SharedMemory::copy`]: allowed while sends and receives are in flight on it, not while
    /// the CPU holds a slice of it). The eager path scatters received messages with it.
    pub fn write_at(&self, offset: usize, bytes: &[u8]) -> Result<()> {
        const API: &str = "SharedMemory::write_at";
        self.check_host(API)?;
        self.check_range(API, offset, bytes.len())?;
        let _writing = self.borrow_operation(API)?;
        // SAFETY: the range is inside live host memory of which no Rust slice exists (the
        // token excludes CPU_ACCESS, which every slice of it holds), so `bytes` cannot overlap
        // it.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.as_ptr().add(offset), bytes.len())
        };
        Ok(())
    }

    fn check_host(&self, api: &'static str) -> Result<()> {
        if self.kind() != MemoryKind::Host {
            return Err(Error::invalid(
                api,
                format!("{:?} memory is not CPU-accessible", self.kind()),
            ));
        }
        Ok(())
    }

    fn cpu_access(&self, api: &'static str) -> Result<CpuGuard<'_>> {
        if self.kind() != MemoryKind::Host {
            return Err(Error::invalid(
                api,
                format!("{:?} memory is not CPU-accessible", self.kind()),
            ));
        }
        self.shared
            .state
            .compare_exchange(0, CPU_ACCESS, Ordering::Acquire, Ordering::Relaxed)
            .map_err(|n| {
                let what = if n == CPU_ACCESS {
                    "already being accessed by the CPU".to_string()
                } else {
                    format!("{n} operations in flight")
                };
                Error::new(api, ErrorKind::Busy(what), "")
            })?;
        Ok(CpuGuard {
            state: &self.shared.state,
        })
    }

    /// Marks one operation in flight; the returned token ends it when dropped.
    pub(crate) fn begin_operation(&self, api: &'static str) -> Result<InFlight> {
        self.count_operation(api)?;
        Ok(InFlight {
            memory: self.clone(),
        })
    }

    /// [`SharedMemory::begin_operation`] for a copy that ends before the call returns: the
    /// token borrows the memory instead of holding a clone. The eager path copies every small
    /// message with it, and several threads copy out of one application buffer at once, so a
    /// reference-count increment and decrement per copy would bounce one more cache line
    /// between their cores.
    pub(crate) fn borrow_operation(&self, api: &'static str) -> Result<Operation<'_>> {
        self.count_operation(api)?;
        Ok(Operation {
            state: &self.shared.state,
        })
    }

    fn count_operation(&self, api: &'static str) -> Result<()> {
        let state = &self.shared.state;
        let mut current = state.load(Ordering::Relaxed);
        loop {
            if current == CPU_ACCESS {
                return Err(Error::new(
                    api,
                    ErrorKind::Busy("the CPU is accessing the memory".into()),
                    "",
                ));
            }
            match state.compare_exchange_weak(
                current,
                current + 1,
                Ordering::Acquire,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Ok(()),
                Err(actual) => current = actual,
            }
        }
    }
}

struct CpuGuard<'a> {
    state: &'a AtomicIsize,
}

impl Drop for CpuGuard<'_> {
    fn drop(&mut self) {
        self.state.store(0, Ordering::Release);
    }
}

/// A copy in progress on a memory (see [`SharedMemory::borrow_operation`]).
pub(crate) struct Operation<'a> {
    state: &'a AtomicIsize,
}

impl Drop for Operation<'_> {
    fn drop(&mut self) {
        self.state.fetch_sub(1, Ordering::Release);
    }
}

/// One operation in flight on a memory: keeps it alive and counted until dropped.
pub(crate) struct InFlight {
    memory: SharedMemory,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.memory.shared.state.fetch_sub(1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_buffers_are_page_aligned_and_zeroed() {
        let b = HostBuffer::new(10_000).unwrap();
        assert_eq!(b.as_slice().as_ptr() as usize % BUFFER_ALIGN, 0);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        assert!(HostBuffer::new(0).is_err());
        assert!(HostBuffer::new(usize::MAX).is_err());
    }

    #[test]
    fn huge_page_buffers_are_aligned_zeroed_and_whole() {
        // An odd length: rounded up inside, only `len` bytes visible.
        let len = HUGE_PAGE + 12_345;
        let mut b = HostBuffer::in_huge_pages(len).unwrap();
        assert_eq!(b.len(), len);
        #[cfg(target_os = "linux")]
        assert_eq!(b.as_slice().as_ptr() as usize % HUGE_PAGE, 0);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        // Every byte writable and read back (a mapping cut short would fault here).
        for (i, x) in b.as_mut_slice().iter_mut().enumerate() {
            *x = (i % 251) as u8;
        }
        assert!(b
            .as_slice()
            .iter()
            .enumerate()
            .all(|(i, &x)| x == (i % 251) as u8));
        assert!(HostBuffer::in_huge_pages(0).is_err());
        assert!(HostBuffer::in_huge_pages(usize::MAX).is_err());
        assert!(HostBuffer::in_huge_pages(usize::MAX - HUGE_PAGE).is_err());
        // Each one made and dropped unmaps what it mapped: the process's count of mappings
        // does not grow (checked where /proc is there).
        let maps = || std::fs::read_to_string("/proc/self/maps").map(|m| m.lines().count());
        let before = maps();
        for _ in 0..64 {
            let m = SharedMemory::host_in_huge_pages(4 << 20).unwrap();
            assert_eq!(m.kind(), MemoryKind::Host);
        }
        if let (Ok(before), Ok(after)) = (before, maps()) {
            assert!(
                after <= before + 4,
                "mappings before {before}, after {after}"
            );
        }
    }

    #[test]
    fn write_ranges_writes_every_piece_and_stops_at_one_outside() {
        let m = SharedMemory::host(16).unwrap();
        m.write_ranges([(0, &[1u8, 2][..]), (14, &[3u8, 4][..])])
            .unwrap();
        let err = m.write_ranges([(4, &[5u8][..]), (15, &[6u8, 7][..]), (8, &[9u8][..])]);
        assert!(err.is_err(), "a piece past the end is refused");
        m.with_bytes(|b| {
            assert_eq!(&b[..2], &[1, 2]);
            assert_eq!(&b[14..], &[3, 4]);
            assert_eq!(b[4], 5, "pieces before the bad one are written");
            assert_eq!(b[8], 0, "pieces after it are not");
        })
        .unwrap();
        assert_eq!(m.in_flight(), 0, "the operation ended");
        let held = m.with_bytes(|_| m.write_ranges([(0, &[1u8][..])]).is_err());
        assert!(held.unwrap(), "refused while the CPU holds a slice");
    }

    #[test]
    fn read_ranges_appends_every_range_while_others_are_in_flight_and_stops_at_one_outside() {
        let m = SharedMemory::host(16).unwrap();
        m.with_bytes_mut(|b| b.iter_mut().enumerate().for_each(|(i, x)| *x = i as u8))
            .unwrap();
        // Another operation in flight on the memory (a transfer) does not stop it.
        let other = m.begin_operation("test").unwrap();
        let mut out = vec![0xee];
        m.read_ranges([(0, 2), (14, 2)], &mut out).unwrap();
        assert_eq!(out, [0xee, 0, 1, 14, 15]);
        let mut out = Vec::new();
        assert!(m.read_ranges([(4, 1), (15, 2), (8, 1)], &mut out).is_err());
        assert_eq!(out, [4], "ranges before the bad one are read, none after");
        drop(other);
        assert_eq!(m.in_flight(), 0, "the operation ended");
        let held = m.with_bytes(|_| m.read_ranges([(0, 1)], &mut Vec::new()).is_err());
        assert!(held.unwrap(), "refused while the CPU holds a slice");
    }

    #[test]
    fn cpu_access_and_operations_exclude_each_other() {
        let m = SharedMemory::host(64).unwrap();
        m.with_bytes_mut(|b| b[0] = 7).unwrap();
        let op = m.begin_operation("test").unwrap();
        assert!(matches!(
            m.with_bytes(|_| ()).unwrap_err().kind(),
            ErrorKind::Busy(_)
        ));
        drop(op);
        assert_eq!(m.with_bytes(|b| b[0]).unwrap(), 7);
        m.with_bytes(|_| assert!(m.begin_operation("test").is_err()))
            .unwrap();
    }

    #[test]
    fn foreign_memory_refuses_null_empty_and_wrapping_ranges() {
        let mut owned = vec![0u8; 64];
        let p = owned.as_mut_ptr();
        // SAFETY: `owned` outlives every value built on it in this test.
        unsafe {
            assert!(ForeignMemory::new(std::ptr::null_mut(), 8, MemoryKind::Host).is_err());
            assert!(ForeignMemory::new(p, 0, MemoryKind::Host).is_err());
            assert!(ForeignMemory::new(p, usize::MAX, MemoryKind::Host).is_err());
            let m = SharedMemory::new(ForeignMemory::new(p, 64, MemoryKind::Host).unwrap());
            assert_eq!((m.as_ptr(), m.len(), m.kind()), (p, 64, MemoryKind::Host));
            m.with_bytes_mut(|b| b[63] = 9).unwrap();
            drop(m);
        }
        // Dropping the SharedMemory freed nothing: the bytes are the caller's.
        assert_eq!(owned[63], 9);
    }

    #[test]
    fn ranges_outside_the_memory_are_refused() {
        let m = SharedMemory::host(100).unwrap();
        assert!(m.check_range("t", 0, 100).is_ok());
        assert!(m.check_range("t", 1, 100).is_err());
        assert!(m.check_range("t", usize::MAX, 2).is_err());
    }

    #[test]
    fn copies_run_beside_operations_but_not_beside_cpu_slices() {
        let a = SharedMemory::host(64).unwrap();
        let b = SharedMemory::host(64).unwrap();
        a.with_bytes_mut(|m| m.iter_mut().enumerate().for_each(|(i, x)| *x = i as u8))
            .unwrap();
        // An operation in flight on the source does not stop a copy (it is one too).
        let op = a.begin_operation("test").unwrap();
        SharedMemory::copy_ranges(&a, &b, [(0, 10, 4), (60, 0, 4)]).unwrap();
        drop(op);
        b.with_bytes(|m| {
            assert_eq!(&m[10..14], &[0, 1, 2, 3]);
            assert_eq!(&m[..4], &[60, 61, 62, 63]);
        })
        .unwrap();
        // Overlapping ranges of one memory move like memmove.
        SharedMemory::copy(&a, 0, &a, 2, 8).unwrap();
        a.with_bytes(|m| assert_eq!(&m[..10], &[0, 1, 0, 1, 2, 3, 4, 5, 6, 7]))
            .unwrap();
        // Out of range: refused; a CPU slice out: Busy, and nothing copied.
        assert!(SharedMemory::copy(&a, 60, &b, 0, 5).is_err());
        let busy = b
            .with_bytes(|_| SharedMemory::copy(&a, 0, &b, 0, 4))
            .unwrap();
        assert!(matches!(busy, Err(ref e) if matches!(e.kind(), ErrorKind::Busy(_))));
        assert_eq!(a.in_flight() + b.in_flight(), 0);
    }
}
