//! Receive-side "unpack" for TCPX (docs/NCCL_NET_ABI.md §6): once `test` reports receive slot
//! `s` done, the plugin has written `cnt[s]` fragments to `meta.mem[s][..]`; each fragment says
//! "copy `len` bytes from `bounce_buf + src_off` to `dst + dst_off`". This module does that copy:
//!
//! * [`gather_cpu`]: the pure-Rust reference, with every fragment bounds-checked (an
//!   out-of-range fragment is an error naming it, and nothing is written).
//! * [`Unpacker`]: the GPU path. One kernel launch gathers several completed receives
//!   ([`UnpackEntry`], up to [`MAX_ENTRIES_PER_LAUNCH`] per launch; more are split into several
//!   launches), one warp per fragment with 16/8/4/2/1-byte accesses chosen by the relative
//!   alignment of source and destination, each block staging its fragments' metadata in shared
//!   memory first; an event is recorded after the launch ([`UnpackLaunch`]).
//!
//! The kernel (`kernels/unpack.cu`) ships as PTX (`kernels/unpack.ptx`, made with nvcc for
//! `compute_80`) loaded with `cuModuleLoadData`: no compiler is needed at run time. If the driver
//! refuses that PTX (nvcc 13 writes PTX ISA 9.0, which drivers before the 580 series reject),
//! the loader retries with [`compat_ptx`] (ISA 7.0: the kernel uses nothing newer), then compiles
//! `unpack.cu` with NVRTC when `libnvrtc` is present. `TCPX_UNPACK_KERNEL` forces one way: `ptx`, `ptx-compat`,
//! `nvrtc`, or a path to a `.ptx` file.
//!
//! The kernel checks every fragment against the bounce length and the destination length it is
//! given; an out-of-range fragment is skipped, never written, and reported: the first one is
//! recorded in a status word in pinned host memory, and [`UnpackLaunch::wait`] /
//! [`Unpacker::check`] turn it into an error naming the entry and fragment.

use std::ffi::{c_char, c_void, CStr, CString};
use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::driver::sys;
pub use tcpx_sys::tcpxLoadMeta as LoadMeta;
use tcpx_sys::{tcpxUnpackMeta, UNPACK_CNT_OFFSET, UNPACK_META_SIZE};

use super::buffer::{CudaBuffer, DeviceAccessible, PinnedHostBuffer};
use super::device::{CudaDevice, CudaEvent, CudaStream};
use super::driver::{check, cuda_error, kernel_error, require};
use crate::error::{Error, Result};
use crate::memory::Memory;

/// Fragments one receive can have at most (4 MiB slice / 4 KiB pages × 2).
pub const MAX_FRAGMENTS_PER_SLOT: usize = tcpx_sys::NET_UNPACK_MAX_SLICE_PAGES as usize;
/// Receive slots per comm (`tail % 16`).
pub const SLOTS: usize = tcpx_sys::NET_UNPACK_MAX_QUEUE_DEPTH as usize;
/// Entries one kernel launch takes (the batch travels as the kernel's by-value parameter).
pub const MAX_ENTRIES_PER_LAUNCH: usize = 64;
/// Bytes of one [`LoadMeta`].
pub const META_BYTES: usize = std::mem::size_of::<LoadMeta>();
/// The kernel source (`kernels/unpack.cu`), compiled with NVRTC on the fallback path.
pub const SOURCE: &str = include_str!("../../kernels/unpack.cu");
/// The checked-in PTX of [`SOURCE`] (`kernels/unpack.ptx`).
pub const PTX: &str = include_str!("../../kernels/unpack.ptx");
/// Environment variable forcing how the kernel is loaded: `auto` (default), `ptx`,
/// `ptx-compat`, `nvrtc`, or a path to a PTX file.
pub const KERNEL_ENV: &str = "TCPX_UNPACK_KERNEL";
/// The PTX ISA version [`KernelSource::PtxCompat`] declares.
pub const COMPAT_PTX_VERSION: &str = "7.0";
const KERNEL_NAME: &CStr = c"tcpx_unpack";

const _: () = assert!(META_BYTES == 16);
const _: () = assert!(UNPACK_CNT_OFFSET == SLOTS * MAX_FRAGMENTS_PER_SLOT * META_BYTES);
const _: () = assert!(UNPACK_META_SIZE == UNPACK_CNT_OFFSET + SLOTS * 8);

// ------------------------------------------------------------------------------------------
// CPU side: metadata helpers and the reference gather.

/// Writes fragment `index` of a metadata array held as bytes (a pinned buffer the kernel
/// reads): `len` bytes from `src_off` past the entry's bounce to `dst_off` past its
/// destination, in the layout of [`LoadMeta`].
pub(crate) fn put_meta(metas: &mut [u8], index: usize, src_off: u32, len: u32, dst_off: u64) {
    let m = &mut metas[index * META_BYTES..(index + 1) * META_BYTES];
    m[0..4].copy_from_slice(&src_off.to_ne_bytes());
    m[4..8].copy_from_slice(&len.to_ne_bytes());
    m[8..16].copy_from_slice(&dst_off.to_ne_bytes());
}

/// The metadata as raw bytes (what a test writes into the meta page or a pinned buffer).
pub fn meta_bytes(metas: &[LoadMeta]) -> &[u8] {
    // SAFETY: LoadMeta is repr(C), 16 bytes with no padding (u32, u32, u64) and no invalid bit
    // patterns; the slice covers exactly the metas' memory.
    unsafe { std::slice::from_raw_parts(metas.as_ptr().cast::<u8>(), std::mem::size_of_val(metas)) }
}

/// Byte offset of `mem[slot][0]` inside [`tcpxUnpackMeta`] (add it to the meta page's device
/// address to get an [`UnpackEntry::metas`]).
pub fn slot_offset(slot: usize) -> usize {
    (slot % SLOTS) * MAX_FRAGMENTS_PER_SLOT * META_BYTES
}

/// The fragments of `slot`: `meta.mem[slot][..cnt[slot]]`; an error when the count exceeds
/// [`MAX_FRAGMENTS_PER_SLOT`] or the slot does not exist.
pub fn slot_metas(meta: &tcpxUnpackMeta, slot: usize) -> Result<&[LoadMeta]> {
    const API: &str = "unpack::slot_metas";
    if slot >= SLOTS {
        return Err(Error::invalid(API, format!("slot {slot} of {SLOTS}")));
    }
    let count = meta.cnt[slot];
    if count > MAX_FRAGMENTS_PER_SLOT as u64 {
        return Err(Error::invalid(
            API,
            format!("cnt[{slot}] = {count} exceeds {MAX_FRAGMENTS_PER_SLOT} fragments"),
        ));
    }
    Ok(&meta.mem[slot][..count as usize])
}

/// Reads `cnt[slot]` of a meta page the plugin may be writing concurrently (volatile read).
///
/// # Safety
/// `meta` must point to a live, 16-aligned `tcpxUnpackMeta` (e.g. the plugin's mapped page).
pub unsafe fn read_slot_count(meta: *const tcpxUnpackMeta, slot: usize) -> Result<u32> {
    const API: &str = "unpack::read_slot_count";
    if slot >= SLOTS {
        return Err(Error::invalid(API, format!("slot {slot} of {SLOTS}")));
    }
    // SAFETY: in bounds of the struct the caller vouches for; u64 reads are aligned.
    let count = unsafe {
        std::ptr::read_volatile(
            meta.cast::<u8>()
                .add(UNPACK_CNT_OFFSET + slot * 8)
                .cast::<u64>(),
        )
    };
    if count > MAX_FRAGMENTS_PER_SLOT as u64 {
        return Err(Error::invalid(
            API,
            format!("cnt[{slot}] = {count} exceeds {MAX_FRAGMENTS_PER_SLOT} fragments"),
        ));
    }
    Ok(count as u32)
}

fn fragment_error(api: &'static str, index: usize, m: &LoadMeta, what: String) -> Error {
    Error::invalid(
        api,
        format!(
            "fragment {index} (src_off {}, len {}, dst_off {}) {what}",
            m.src_off, m.len, m.dst_off
        ),
    )
}

/// Checks every fragment against the bounce and destination lengths; returns the bytes they
/// copy in total. The first fragment out of range is an error naming it.
pub fn check_fragments(bounce_len: usize, metas: &[LoadMeta], dst_len: usize) -> Result<u64> {
    const API: &str = "unpack::check_fragments";
    let mut total = 0u64;
    for (i, m) in metas.iter().enumerate() {
        let src_end = m.src_off as u64 + m.len as u64;
        if src_end > bounce_len as u64 {
            return Err(fragment_error(
                API,
                i,
                m,
                format!("reads past the bounce buffer of {bounce_len} bytes"),
            ));
        }
        match m.dst_off.checked_add(m.len as u64) {
            Some(end) if end <= dst_len as u64 => {}
            _ => {
                return Err(fragment_error(
                    API,
                    i,
                    m,
                    format!("writes past the destination of {dst_len} bytes"),
                ))
            }
        }
        total += m.len as u64;
    }
    Ok(total)
}

/// The reference gather: for each fragment, in order, copies `bounce[src_off..][..len]` to
/// `dst[dst_off..][..len]`. All fragments are checked first: on error nothing is written. Later
/// fragments win where destinations overlap. Returns the bytes copied.
pub fn gather_cpu(bounce: &[u8], metas: &[LoadMeta], dst: &mut [u8]) -> Result<u64> {
    let total = check_fragments(bounce.len(), metas, dst.len())?;
    for m in metas {
        let (s, d, n) = (m.src_off as usize, m.dst_off as usize, m.len as usize);
        dst[d..d + n].copy_from_slice(&bounce[s..s + n]);
    }
    Ok(total)
}

// ------------------------------------------------------------------------------------------
// The kernel's parameter block, mirrored byte for byte from kernels/unpack.cu.

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct KernelEntry {
    metas: u64,
    bounce: u64,
    bounce_len: u64,
    dst: u64,
    dst_len: u64,
    count: u32,
    first_chunk: u32,
    index: u32,
    pad: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct KernelBatch {
    status: u64,
    num_entries: u32,
    total_chunks: u32,
    frags_per_block: u32,
    seq: u32,
    entries: [KernelEntry; MAX_ENTRIES_PER_LAUNCH],
}

/// Bytes of the kernel's parameter (checked against the PTX's `.param` declaration in tests).
const BATCH_BYTES: usize = 3608;
const _: () = assert!(std::mem::size_of::<KernelEntry>() == 56);
const _: () = assert!(std::mem::size_of::<KernelBatch>() == BATCH_BYTES);
const _: () = assert!(std::mem::offset_of!(KernelBatch, entries) == 24);

/// Status word layout (kernels/unpack.cu `tcpx_unpack_status`), in pinned host memory.
const STATUS_BYTES: usize = 32;
const ST_BAD: usize = 0;
const ST_SEQ: usize = 4;
const ST_ENTRY: usize = 8;
const ST_FRAGMENT: usize = 12;
const ST_SRC_OFF: usize = 16;
const ST_LEN: usize = 20;
const ST_DST_OFF: usize = 24;

// ------------------------------------------------------------------------------------------
// Loading the kernel.

/// Where the loaded kernel came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KernelSource {
    /// The checked-in PTX ([`PTX`]).
    Ptx,
    /// The checked-in PTX with its `.version` lowered to [`COMPAT_PTX_VERSION`], for drivers
    /// older than the nvcc that made it.
    PtxCompat,
    /// [`SOURCE`] compiled at run time with NVRTC for the device's compute capability.
    Nvrtc,
    /// A PTX file named by [`KERNEL_ENV`].
    PtxFile(PathBuf),
}

impl fmt::Display for KernelSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KernelSource::Ptx => f.write_str("ptx"),
            KernelSource::PtxCompat => f.write_str("ptx-compat"),
            KernelSource::Nvrtc => f.write_str("nvrtc"),
            KernelSource::PtxFile(p) => write!(f, "ptx file {}", p.display()),
        }
    }
}

/// The checked-in PTX made loadable by older drivers: its `.version` directive replaced by
/// [`COMPAT_PTX_VERSION`] and the `.pragma "used_bytes_mask …"` hints (PTX ISA 8.3+, emitted by
/// nvcc 13 before some parameter loads; pure optimization hints) removed.
pub fn compat_ptx(ptx: &str) -> String {
    let mut out = String::with_capacity(ptx.len());
    for line in ptx.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with(".pragma \"used_bytes_mask") {
            continue;
        }
        if trimmed.starts_with(".version ") {
            out.push_str(".version ");
            out.push_str(COMPAT_PTX_VERSION);
        } else {
            out.push_str(line);
        }
        out.push('\n');
    }
    out
}

/// True when NVRTC can be loaded (cudarc panics otherwise, so this is checked first).
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen NVRTC under cudarc's candidate names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compiles [`SOURCE`] to PTX with NVRTC for `compute_<major><minor>`.
pub fn nvrtc_compile(major: u32, minor: u32) -> Result<String> {
    const API: &str = "unpack::nvrtc_compile";
    if !nvrtc_available() {
        return Err(kernel_error(API, "libnvrtc not found"));
    }
    use cudarc::nvrtc::result as nvrtc;
    let src = CString::new(SOURCE).map_err(|_| kernel_error(API, "source contains NUL"))?;
    let prog = nvrtc::create_program(&src, Some(c"unpack.cu"))
        .map_err(|e| kernel_error(API, format!("nvrtcCreateProgram: {e:?}")))?;
    let options = [format!("--gpu-architecture=compute_{major}{minor}")];
    // SAFETY: `prog` was just created and is destroyed once below.
    let compiled = unsafe { nvrtc::compile_program(prog, &options) };
    let result = match compiled {
        // SAFETY: `prog` was created above, compiled successfully, and is destroyed once below.
        Ok(()) => unsafe { nvrtc::get_ptx(prog) }
            .map(|ptx| c_chars_to_string(&ptx))
            .map_err(|e| kernel_error(API, format!("nvrtcGetPTX: {e:?}"))),
        Err(e) => {
            // SAFETY: `prog` was created above and is destroyed once below; a failed compile
            // still has a log.
            let log = unsafe { nvrtc::get_program_log(prog) }
                .map(|l| c_chars_to_string(&l))
                .unwrap_or_default();
            Err(kernel_error(
                API,
                format!("nvrtcCompileProgram {options:?}: {e:?}: {log}"),
            ))
        }
    };
    // SAFETY: created above, destroyed once.
    let _ = unsafe { nvrtc::destroy_program(prog) };
    result
}

fn c_chars_to_string(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .map(|&c| c as u8)
        .take_while(|&b| b != 0)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The unpack kernel, loaded into one device's primary context. Share it between
/// [`Unpacker`]s with an `Arc`.
pub struct UnpackKernel {
    device: CudaDevice,
    module: sys::CUmodule,
    function: sys::CUfunction,
    source: KernelSource,
}

// SAFETY: module and function handles are usable from any thread (the driver is thread-safe).
unsafe impl Send for UnpackKernel {}
// SAFETY: module and function handles are usable from any thread, and launching through
// `&self` is thread-safe in the driver.
unsafe impl Sync for UnpackKernel {}

impl fmt::Debug for UnpackKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UnpackKernel")
            .field("device", &self.device.ordinal())
            .field("source", &self.source)
            .finish()
    }
}

impl Drop for UnpackKernel {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: the module was loaded in `from_ptx` and is unloaded once; no launch can be
            // queued after the last reference is gone (queued ones keep running: CUDA defers).
            let _ = unsafe { sys::cuModuleUnload(self.module) };
        }
    }
}

/// Kernels loaded so far, by device ordinal (see [`UnpackKernel::shared`]).
static SHARED: std::sync::Mutex<Vec<(usize, std::sync::Weak<UnpackKernel>)>> =
    std::sync::Mutex::new(Vec::new());

impl UnpackKernel {
    /// The kernel on `device`, loaded once per process and shared while anyone holds it:
    /// loading JIT-compiles the PTX (milliseconds to tens of milliseconds), which every
    /// staging ring and unpack step of a GPU would otherwise pay again.
    pub fn shared(device: &CudaDevice) -> Result<Arc<Self>> {
        // The lock is held while loading: two threads asking for the same GPU's kernel load
        // it once.
        let mut cache = SHARED.lock().unwrap_or_else(|p| p.into_inner());
        cache.retain(|(_, k)| k.strong_count() > 0);
        if let Some(kernel) = cache
            .iter()
            .find(|(ordinal, _)| *ordinal == device.ordinal())
            .and_then(|(_, k)| k.upgrade())
        {
            return Ok(kernel);
        }
        let kernel = Arc::new(Self::load(device)?);
        cache.push((device.ordinal(), Arc::downgrade(&kernel)));
        Ok(kernel)
    }

    /// Loads the kernel as [`KERNEL_ENV`] says (default: the checked-in PTX, then the
    /// compat PTX, then NVRTC; the error lists why each failed).
    pub fn load(device: &CudaDevice) -> Result<Self> {
        const API: &str = "UnpackKernel::load";
        require(API)?;
        let choice = std::env::var(KERNEL_ENV).unwrap_or_default();
        let forced = match choice.trim() {
            "" | "auto" => None,
            "ptx" => Some(KernelSource::Ptx),
            "ptx-compat" => Some(KernelSource::PtxCompat),
            "nvrtc" => Some(KernelSource::Nvrtc),
            path => Some(KernelSource::PtxFile(PathBuf::from(path))),
        };
        if let Some(source) = forced {
            return Self::load_from(device, source);
        }
        let mut failures = Vec::new();
        for source in [
            KernelSource::Ptx,
            KernelSource::PtxCompat,
            KernelSource::Nvrtc,
        ] {
            match Self::load_from(device, source.clone()) {
                Ok(k) => {
                    if !failures.is_empty() {
                        tracing::info!(target: "tcpx::cuda", "unpack kernel from {source} after: {}", failures.join("; "));
                    }
                    return Ok(k);
                }
                Err(e) => failures.push(format!("{source}: {e}")),
            }
        }
        Err(kernel_error(API, failures.join("; ")))
    }

    /// Loads the kernel from one source.
    pub fn load_from(device: &CudaDevice, source: KernelSource) -> Result<Self> {
        const API: &str = "UnpackKernel::load_from";
        require(API)?;
        let ptx = match &source {
            KernelSource::Ptx => PTX.to_string(),
            KernelSource::PtxCompat => compat_ptx(PTX),
            KernelSource::Nvrtc => {
                let (major, minor) = device.compute_capability();
                nvrtc_compile(major, minor)?
            }
            KernelSource::PtxFile(path) => std::fs::read_to_string(path)
                .map_err(|e| kernel_error(API, format!("cannot read {}: {e}", path.display())))?,
        };
        Self::from_ptx(device, &ptx, source)
    }

    fn from_ptx(device: &CudaDevice, ptx: &str, source: KernelSource) -> Result<Self> {
        const API: &str = "UnpackKernel::from_ptx";
        let image = CString::new(ptx).map_err(|_| kernel_error(API, "PTX contains NUL"))?;
        device.bind()?;
        let mut log = vec![0u8; 8192];
        let mut options = [
            sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER,
            sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
        ];
        let mut values = [log.as_mut_ptr().cast::<c_void>(), log.len() as *mut c_void];
        let mut module: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: `image` is NUL-terminated PTX; the option arrays have two entries each and the
        // log buffer is as large as declared and outlives the call.
        let rc = unsafe {
            sys::cuModuleLoadDataEx(
                &mut module,
                image.as_ptr().cast(),
                options.len() as u32,
                options.as_mut_ptr(),
                values.as_mut_ptr(),
            )
        };
        if rc != sys::CUresult::CUDA_SUCCESS {
            let log =
                String::from_utf8_lossy(&log[..log.iter().position(|&b| b == 0).unwrap_or(0)])
                    .trim()
                    .to_string();
            return Err(cuda_error(
                "cuModuleLoadData",
                rc,
                format!("{source} on {}: {log}", device.describe()),
            ));
        }
        let mut function: sys::CUfunction = std::ptr::null_mut();
        // SAFETY: a freshly loaded module; the name is NUL-terminated.
        let rc = unsafe { sys::cuModuleGetFunction(&mut function, module, KERNEL_NAME.as_ptr()) };
        if rc != sys::CUresult::CUDA_SUCCESS {
            // SAFETY: loaded above, unloaded once.
            let _ = unsafe { sys::cuModuleUnload(module) };
            return Err(cuda_error(
                "cuModuleGetFunction",
                rc,
                format!("tcpx_unpack in {source}"),
            ));
        }
        Ok(Self {
            device: device.clone(),
            module,
            function,
            source,
        })
    }

    /// Where this kernel came from.
    pub fn source(&self) -> &KernelSource {
        &self.source
    }

    /// The device it is loaded on.
    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    /// Blocks of `config` that fit on one multiprocessor at once.
    pub fn blocks_per_multiprocessor(&self, config: &LaunchConfig) -> Result<u32> {
        self.device.bind()?;
        let mut n = 0;
        // SAFETY: writes one int; a live function handle.
        let rc = unsafe {
            sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(
                &mut n,
                self.function,
                config.threads_per_block as i32,
                config.shared_bytes(),
            )
        };
        check("cuOccupancyMaxActiveBlocksPerMultiprocessor", rc, || {
            format!("{config:?}")
        })?;
        Ok(n.max(0) as u32)
    }
}

// ------------------------------------------------------------------------------------------
// Launching.

/// How a launch is shaped. The defaults suit 4 KiB fragments on an H100.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Threads per block: a multiple of 32 from 32 to 1024 (one warp copies one fragment).
    pub threads_per_block: u32,
    /// Fragments a block stages in shared memory and copies per step (16 bytes of shared
    /// memory each), 1 to 3072.
    pub frags_per_block: u32,
    /// Cap on the grid (blocks loop over the chunks); 0 = as many as fit on the device at once.
    pub max_blocks: u32,
}

impl Default for LaunchConfig {
    fn default() -> Self {
        Self {
            threads_per_block: 256,
            frags_per_block: 32,
            max_blocks: 0,
        }
    }
}

impl LaunchConfig {
    fn shared_bytes(&self) -> usize {
        self.frags_per_block as usize * META_BYTES
    }

    fn validate(&self) -> Result<()> {
        let t = self.threads_per_block;
        if !(32..=1024).contains(&t) || t % 32 != 0 {
            return Err(Error::invalid(
                "LaunchConfig",
                format!("threads_per_block {t} is not a multiple of 32 in 32..=1024"),
            ));
        }
        if !(1..=3072).contains(&self.frags_per_block) {
            return Err(Error::invalid(
                "LaunchConfig",
                format!("frags_per_block {} outside 1..=3072", self.frags_per_block),
            ));
        }
        Ok(())
    }
}

/// One completed receive to gather, by device addresses (see [`Unpacker::launch`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnpackEntry {
    /// Device address of the receive's first [`LoadMeta`] (16-aligned): for TCPX, the meta
    /// page's device address + [`slot_offset`]`(slot)`.
    pub metas: u64,
    /// Fragments (`cnt[slot]`); 0 is allowed and does nothing.
    pub count: u32,
    /// Device address of the bounce buffer.
    pub bounce: u64,
    /// Readable bytes from `bounce` (`u64::MAX` when unknown, as with TCPX's handle).
    pub bounce_len: u64,
    /// Device address the `dst_off`s are relative to (the irecv's destination).
    pub dst: u64,
    /// Writable bytes from `dst` (the irecv's size).
    pub dst_len: u64,
}

/// One completed receive to gather, by borrowed buffers: the safe form used by
/// [`Unpacker::unpack`].
#[derive(Clone, Copy)]
pub struct BufferEntry<'a> {
    /// Where the metas live (device memory, or pinned host memory mapped into the GPU).
    pub metas: &'a dyn DeviceAccessible,
    /// Byte offset of the first meta in `metas` (a multiple of 16).
    pub metas_offset: usize,
    /// Fragments.
    pub count: u32,
    /// The bounce buffer (all of it readable).
    pub bounce: &'a dyn DeviceAccessible,
    /// The destination buffer.
    pub dst: &'a CudaBuffer,
    /// Where in `dst` the `dst_off`s start; the rest of `dst` is writable.
    pub dst_offset: usize,
}

impl fmt::Debug for BufferEntry<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BufferEntry")
            .field("metas", &format_args!("{:#x}", self.metas.device_addr()))
            .field("metas_offset", &self.metas_offset)
            .field("count", &self.count)
            .field("bounce", &format_args!("{:#x}", self.bounce.device_addr()))
            .field("dst", &self.dst)
            .field("dst_offset", &self.dst_offset)
            .finish()
    }
}

impl BufferEntry<'_> {
    fn raw_entry(&self, index: usize) -> Result<UnpackEntry> {
        const API: &str = "Unpacker::unpack";
        let metas_end = (self.count as usize)
            .checked_mul(META_BYTES)
            .and_then(|n| n.checked_add(self.metas_offset));
        if metas_end.is_none_or(|end| end > self.metas.byte_len()) {
            return Err(Error::invalid(
                API,
                format!(
                    "entry {index}: {} metas at offset {} overrun a buffer of {} bytes",
                    self.count,
                    self.metas_offset,
                    self.metas.byte_len()
                ),
            ));
        }
        if self.dst_offset > self.dst.len() {
            return Err(Error::invalid(
                API,
                format!(
                    "entry {index}: destination offset {} past a buffer of {} bytes",
                    self.dst_offset,
                    self.dst.len()
                ),
            ));
        }
        Ok(UnpackEntry {
            metas: self.metas.device_addr() + self.metas_offset as u64,
            count: self.count,
            bounce: self.bounce.device_addr(),
            bounce_len: self.bounce.byte_len() as u64,
            dst: self.dst.device_ptr() + self.dst_offset as u64,
            dst_len: (self.dst.len() - self.dst_offset) as u64,
        })
    }
}

/// Launches the unpack kernel on its own stream and reports out-of-range fragments.
pub struct Unpacker {
    kernel: Arc<UnpackKernel>,
    stream: CudaStream,
    status: Arc<PinnedHostBuffer>,
    seq: AtomicU32,
    config: LaunchConfig,
    grid_cap: u32,
}

impl fmt::Debug for Unpacker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Unpacker")
            .field("kernel", &self.kernel)
            .field("config", &self.config)
            .field("grid_cap", &self.grid_cap)
            .finish()
    }
}

impl Unpacker {
    /// Takes the kernel ([`UnpackKernel::shared`]: loaded once per GPU and process) and makes
    /// a stream for it on `device`.
    pub fn new(device: &CudaDevice) -> Result<Self> {
        let kernel = UnpackKernel::shared(device)?;
        Self::with_kernel(kernel, device.stream()?)
    }

    /// An unpacker launching `kernel` on `stream` (same device).
    pub fn with_kernel(kernel: Arc<UnpackKernel>, stream: CudaStream) -> Result<Self> {
        if stream.device().raw() != kernel.device().raw() {
            return Err(Error::invalid(
                "Unpacker::with_kernel",
                "the stream and the kernel belong to different devices",
            ));
        }
        let status = Arc::new(PinnedHostBuffer::new(kernel.device(), STATUS_BYTES)?);
        let mut unpacker = Self {
            kernel,
            stream,
            status,
            seq: AtomicU32::new(0),
            config: LaunchConfig::default(),
            grid_cap: 0,
        };
        unpacker.set_config(LaunchConfig::default())?;
        Ok(unpacker)
    }

    /// Changes the launch shape.
    pub fn set_config(&mut self, config: LaunchConfig) -> Result<()> {
        config.validate()?;
        let per_sm = self.kernel.blocks_per_multiprocessor(&config)?;
        if per_sm == 0 {
            return Err(Error::invalid(
                "Unpacker::set_config",
                format!("{config:?} does not fit on a multiprocessor"),
            ));
        }
        let fit = per_sm * self.kernel.device().multiprocessor_count();
        self.grid_cap = if config.max_blocks > 0 {
            config.max_blocks
        } else {
            fit
        };
        self.config = config;
        Ok(())
    }

    /// The launch shape.
    pub fn config(&self) -> LaunchConfig {
        self.config
    }

    /// The most blocks one launch uses.
    pub fn grid_cap(&self) -> u32 {
        self.grid_cap
    }

    /// The kernel.
    pub fn kernel(&self) -> &UnpackKernel {
        &self.kernel
    }

    /// The stream launches go to (make it wait on the receive, or others wait on it).
    pub fn stream(&self) -> &CudaStream {
        &self.stream
    }

    /// Queues the gathers of `entries` (split into launches of up to
    /// [`MAX_ENTRIES_PER_LAUNCH`]) on the stream and records an event after them.
    ///
    /// # Safety
    /// For every entry with `count > 0`: `metas..metas + 16*count` must be device-accessible
    /// memory holding the fragments, `bounce..bounce+bounce_len` device-readable and
    /// `dst..dst+dst_len` device memory no one else accesses, all of it staying so until the
    /// returned launch has completed. Fragments are checked against `bounce_len` and `dst_len`
    /// on the GPU; those lengths must therefore be true.
    pub unsafe fn launch(&self, entries: &[UnpackEntry]) -> Result<UnpackLaunch> {
        // SAFETY: forwarded from the caller.
        let (launches, first_seq) = unsafe { self.enqueue(entries)? };
        let event = self.stream.record()?;
        Ok(UnpackLaunch {
            event,
            status: self.status.clone(),
            launches,
            first_seq,
        })
    }

    /// As [`launch`](Self::launch), without recording an event: the caller records its own
    /// (a preallocated one: creating and destroying an event per launch costs two driver
    /// calls each time) on [`stream`](Self::stream) and polls it. Returns the kernel launches
    /// made and the sequence number of the first (reported in out-of-range errors).
    ///
    /// # Safety
    /// As [`launch`](Self::launch), until the work queued here has completed (an event
    /// recorded on the stream after this call says so).
    pub unsafe fn enqueue(&self, entries: &[UnpackEntry]) -> Result<(u32, u32)> {
        const API: &str = "Unpacker::enqueue";
        let device = self.kernel.device();
        device.bind()?;
        let fpb = self.config.frags_per_block;
        let mut batch = KernelBatch {
            status: self.status.device_ptr(),
            num_entries: 0,
            total_chunks: 0,
            frags_per_block: fpb,
            seq: 0,
            entries: [KernelEntry::default(); MAX_ENTRIES_PER_LAUNCH],
        };
        let mut launches = 0u32;
        let mut first_seq = None;
        for (index, e) in entries.iter().enumerate() {
            if e.count == 0 {
                continue;
            }
            if e.metas % 16 != 0 || e.metas == 0 || e.bounce == 0 || e.dst == 0 {
                return Err(Error::invalid(
                    API,
                    format!("entry {index}: NULL address or metas not 16-aligned: {e:?}"),
                ));
            }
            let chunks = e.count.div_ceil(fpb);
            if batch.num_entries as usize == MAX_ENTRIES_PER_LAUNCH
                || batch.total_chunks.checked_add(chunks).is_none()
            {
                // SAFETY: forwarded from the caller.
                unsafe { self.launch_batch(&mut batch, &mut first_seq)? };
                launches += 1;
            }
            batch.entries[batch.num_entries as usize] = KernelEntry {
                metas: e.metas,
                bounce: e.bounce,
                bounce_len: e.bounce_len,
                dst: e.dst,
                dst_len: e.dst_len,
                count: e.count,
                first_chunk: batch.total_chunks,
                index: index as u32,
                pad: 0,
            };
            batch.num_entries += 1;
            batch.total_chunks += chunks;
        }
        if batch.num_entries > 0 {
            // SAFETY: forwarded from the caller.
            unsafe { self.launch_batch(&mut batch, &mut first_seq)? };
            launches += 1;
        }
        Ok((
            launches,
            first_seq.unwrap_or_else(|| self.seq.load(Ordering::Relaxed)),
        ))
    }

    /// # Safety
    /// As [`launch`](Self::launch), for the entries in `batch`.
    unsafe fn launch_batch(
        &self,
        batch: &mut KernelBatch,
        first_seq: &mut Option<u32>,
    ) -> Result<()> {
        batch.seq = self.seq.fetch_add(1, Ordering::Relaxed);
        first_seq.get_or_insert(batch.seq);
        let grid = batch.total_chunks.min(self.grid_cap).max(1);
        let mut params = [(batch as *mut KernelBatch).cast::<c_void>()];
        // SAFETY: the function takes one by-value `tcpx_unpack_batch` (3608 bytes, mirrored by
        // KernelBatch); the driver copies the parameter at launch. The addresses inside are
        // vouched for by the caller; shared memory matches frags_per_block.
        let rc = unsafe {
            sys::cuLaunchKernel(
                self.kernel.function,
                grid,
                1,
                1,
                self.config.threads_per_block,
                1,
                1,
                self.config.shared_bytes() as u32,
                self.stream.raw(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        check("cuLaunchKernel", rc, || {
            format!(
                "{} entries, {} chunks, grid {grid}, {:?}, {}",
                batch.num_entries,
                batch.total_chunks,
                self.config,
                self.kernel.device().describe()
            )
        })?;
        batch.num_entries = 0;
        batch.total_chunks = 0;
        Ok(())
    }

    /// Gathers `entries` from borrowed buffers and waits for the result (checks the metas'
    /// range on the host; the fragments on the GPU). Out-of-range fragments are an error.
    pub fn unpack(&self, entries: &[BufferEntry<'_>]) -> Result<()> {
        let raw = entries
            .iter()
            .enumerate()
            .map(|(i, e)| e.raw_entry(i))
            .collect::<Result<Vec<_>>>()?;
        // SAFETY: every address comes from a live buffer borrowed for this whole call, the
        // lengths are the buffers' own, metas ranges were checked above, and `wait` returns only
        // once the work has completed (or the context failed, which stops it).
        let launch = unsafe { self.launch(&raw)? };
        launch.wait()
    }

    /// Fails when any launch of this unpacker has met an out-of-range fragment since the last
    /// [`clear_error`](Self::clear_error); the error names the launch, entry and fragment.
    /// Only launches that have completed are reflected.
    pub fn check(&self) -> Result<()> {
        read_status(&self.status)
    }

    /// Forgets a reported out-of-range fragment.
    pub fn clear_error(&self) {
        status_word(&self.status, ST_BAD).store(0, Ordering::Release);
    }
}

fn status_word(status: &PinnedHostBuffer, offset: usize) -> &AtomicU32 {
    debug_assert!(offset + 4 <= STATUS_BYTES);
    // SAFETY: the status buffer is 4 KiB-aligned, at least STATUS_BYTES long, private to the
    // unpacker (no slices are ever made of it) and only accessed atomically by the host; the GPU
    // writes it only while kernels run.
    unsafe { &*Memory::as_ptr(status).add(offset).cast::<AtomicU32>() }
}

fn read_status(status: &PinnedHostBuffer) -> Result<()> {
    if status_word(status, ST_BAD).load(Ordering::Acquire) == 0 {
        return Ok(());
    }
    let word = |o| status_word(status, o).load(Ordering::Acquire);
    // SAFETY: the status buffer is 4 KiB-aligned, at least STATUS_BYTES long, private to the
    // unpacker and only accessed atomically by the host; ST_DST_OFF + 8 <= STATUS_BYTES and
    // is 8-aligned, so the u64 word lies inside it, aligned.
    let dst_off = unsafe { &*Memory::as_ptr(status).add(ST_DST_OFF).cast::<AtomicU64>() }
        .load(Ordering::Acquire);
    Err(Error::invalid(
        "Unpacker",
        format!(
            "launch {} entry {} fragment {} (src_off {}, len {}, dst_off {dst_off}) lies outside \
             the bounce buffer or the destination; it was skipped",
            word(ST_SEQ),
            word(ST_ENTRY),
            word(ST_FRAGMENT),
            word(ST_SRC_OFF),
            word(ST_LEN),
        ),
    ))
}

/// The kernels of one [`Unpacker::launch`] call, with the event recorded after them.
pub struct UnpackLaunch {
    event: CudaEvent,
    status: Arc<PinnedHostBuffer>,
    launches: u32,
    first_seq: u32,
}

impl fmt::Debug for UnpackLaunch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UnpackLaunch")
            .field("launches", &self.launches)
            .field("first_seq", &self.first_seq)
            .finish()
    }
}

impl UnpackLaunch {
    /// True once the gathers have completed (non-blocking); the status is not checked here.
    pub fn is_done(&self) -> Result<bool> {
        self.event.is_done()
    }

    /// Waits for the gathers, then fails if an out-of-range fragment was reported (by these or
    /// any earlier launches of the same unpacker not yet cleared).
    pub fn wait(&self) -> Result<()> {
        self.event.synchronize()?;
        read_status(&self.status)
    }

    /// The event recorded after the last kernel (for other streams to wait on).
    pub fn event(&self) -> &CudaEvent {
        &self.event
    }

    /// Kernel launches this call made (entries / [`MAX_ENTRIES_PER_LAUNCH`], rounded up, minus
    /// empty ones).
    pub fn launches(&self) -> u32 {
        self.launches
    }

    /// Sequence number of the first kernel (reported in out-of-range errors).
    pub fn first_seq(&self) -> u32 {
        self.first_seq
    }
}

// ------------------------------------------------------------------------------------------
// The plugin's side of a receive comm: where its metadata and bounce buffer are.

/// Where the fragments of a receive comm's completed receives are described and where their
/// bytes lie: what an UNPACK (version 7) device handle leads to, read once per comm.
#[derive(Debug, Clone, Copy)]
pub struct UnpackQueue {
    /// Device address of the metadata ([`tcpxUnpackMeta`], pinned host memory mapped into the
    /// GPU): add [`slot_offset`] for an [`UnpackEntry::metas`].
    pub meta_dev: u64,
    /// Host address of the same page (reads of `cnt[slot]`).
    meta_host: *const tcpxUnpackMeta,
    /// Device address of the bounce buffer.
    pub bounce: u64,
}

// SAFETY: `meta_host` is only read (volatile) through `slot_count`, whose caller vouches that
// the comm (and so the page) is alive; the page belongs to the plugin, not to a thread.
unsafe impl Send for UnpackQueue {}

impl UnpackQueue {
    /// Follows `recv`'s device handle: `None` when the comm has none or it is not of type
    /// UNPACK (the plugin writes receive destinations itself); an error for an UNPACK handle
    /// of another version than 7 or one that leads nowhere. Copies the 24-byte device struct
    /// `{meta, bounce_buf, head}` to the host (a synchronous copy: call it once per comm) and
    /// asks the driver for the host address of the meta page.
    pub fn of(device: &CudaDevice, recv: &crate::RecvComm) -> Result<Option<Self>> {
        const API: &str = "UnpackQueue::of";
        let Some(h) = recv.device_handle() else {
            return Ok(None);
        };
        if h.netDeviceType != tcpx_sys::NCCL_NET_DEVICE_UNPACK {
            return Ok(None);
        }
        if h.netDeviceVersion != tcpx_sys::NCCL_NET_DEVICE_UNPACK_VERSION {
            return Err(Error::invalid(
                API,
                format!(
                    "UNPACK device handle of version {} (only {} is understood)",
                    h.netDeviceVersion,
                    tcpx_sys::NCCL_NET_DEVICE_UNPACK_VERSION
                ),
            ));
        }
        if h.handle.is_null() {
            return Err(Error::invalid(API, "UNPACK device handle without a handle"));
        }
        let mut st = tcpx_sys::tcpxUnpackDeviceHandle {
            meta: std::ptr::null_mut(),
            bounce_buf: std::ptr::null_mut(),
            head: 0,
        };
        // SAFETY: `h.handle` is the plugin's device pointer to its 24-byte struct, alive while
        // the comm (borrowed here) is; the destination is a local of that size to which no
        // reference is alive during the copy.
        unsafe {
            device.copy_raw(
                (&mut st as *mut tcpx_sys::tcpxUnpackDeviceHandle) as u64,
                h.handle as u64,
                std::mem::size_of::<tcpx_sys::tcpxUnpackDeviceHandle>(),
            )?
        };
        if st.meta.is_null() || st.bounce_buf.is_null() || st.meta as u64 % 16 != 0 {
            return Err(Error::invalid(
                API,
                format!(
                    "the device struct holds meta {:p} and bounce {:p}",
                    st.meta, st.bounce_buf
                ),
            ));
        }
        device.bind()?;
        let mut host: *mut c_void = std::ptr::null_mut();
        // SAFETY: writes one pointer into a local; the context is current; `st.meta` is the
        // plugin's mapped pinned host allocation (the driver refuses anything else).
        let rc = unsafe {
            sys::cuPointerGetAttribute(
                (&mut host as *mut *mut c_void).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_HOST_POINTER,
                st.meta as u64,
            )
        };
        check("cuPointerGetAttribute(HOST_POINTER)", rc, || {
            format!("meta page {:p}, {}", st.meta, device.describe())
        })?;
        if host.is_null() {
            return Err(Error::invalid(API, "the meta page has no host address"));
        }
        Ok(Some(Self {
            meta_dev: st.meta as u64,
            meta_host: host.cast_const().cast(),
            bounce: st.bounce_buf as u64,
        }))
    }

    /// `cnt[slot]`: the fragments of the receive in `slot`, once `test` reported it done
    /// (checked against [`MAX_FRAGMENTS_PER_SLOT`]).
    ///
    /// # Safety
    /// The comm this queue was read from must still be open (its meta page alive).
    pub unsafe fn slot_count(&self, slot: usize) -> Result<u32> {
        // SAFETY: the page is a live, 16-aligned tcpxUnpackMeta (checked in `of`; alive per the
        // caller).
        unsafe { read_slot_count(self.meta_host, slot) }
    }

    /// The [`UnpackEntry`] of the receive in `slot` with `count` fragments into
    /// `dst..dst+dst_len` (the bounce length is unknown: `u64::MAX`).
    pub fn entry(&self, slot: usize, count: u32, dst: u64, dst_len: u64) -> UnpackEntry {
        UnpackEntry {
            metas: self.meta_dev + slot_offset(slot) as u64,
            count,
            bounce: self.bounce,
            bounce_len: u64::MAX,
            dst,
            dst_len,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn meta(src_off: u32, len: u32, dst_off: u64) -> LoadMeta {
        LoadMeta {
            src_off,
            len,
            dst_off,
        }
    }

    #[test]
    fn gather_copies_in_order() {
        let bounce: Vec<u8> = (0..=255).collect();
        let mut dst = vec![0u8; 16];
        let metas = [
            meta(10, 4, 0),
            meta(0, 3, 4),
            meta(250, 6, 10),
            meta(100, 2, 1),
        ];
        assert_eq!(gather_cpu(&bounce, &metas, &mut dst).unwrap(), 15);
        assert_eq!(
            dst,
            [10, 100, 101, 13, 0, 1, 2, 0, 0, 0, 250, 251, 252, 253, 254, 255]
        );
    }

    #[test]
    fn out_of_range_fragments_are_named_and_nothing_is_written() {
        let bounce = vec![7u8; 100];
        let mut dst = vec![0u8; 50];
        let metas = [meta(0, 10, 0), meta(95, 6, 10)];
        let err = gather_cpu(&bounce, &metas, &mut dst).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("fragment 1 (src_off 95, len 6, dst_off 10)"),
            "{msg}"
        );
        assert!(msg.contains("bounce buffer of 100 bytes"), "{msg}");
        assert!(dst.iter().all(|&b| b == 0));

        let metas = [meta(0, 10, 45)];
        let msg = gather_cpu(&bounce, &metas, &mut dst)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("fragment 0") && msg.contains("destination of 50 bytes"),
            "{msg}"
        );

        let metas = [meta(0, 1, u64::MAX)];
        assert!(gather_cpu(&bounce, &metas, &mut dst).is_err());
        let metas = [meta(u32::MAX, u32::MAX, 0)];
        assert!(gather_cpu(&bounce, &metas, &mut dst).is_err());
        // Empty fragments at the very end are fine.
        let metas = [meta(100, 0, 50)];
        assert_eq!(gather_cpu(&bounce, &metas, &mut dst).unwrap(), 0);
    }

    #[test]
    fn slots_follow_the_meta_layout() {
        let mut page = Box::<tcpxUnpackMeta>::default();
        page.cnt[3] = 2;
        page.mem[3][1] = meta(4096, 100, 8);
        let m = slot_metas(&page, 3).unwrap();
        assert_eq!(m.len(), 2);
        assert_eq!(m[1].src_off, 4096);
        assert_eq!(slot_offset(3), 3 * 2048 * 16);
        assert_eq!(
            (&page.mem[3][0] as *const LoadMeta as usize) - (&*page as *const _ as usize),
            slot_offset(3)
        );
        // SAFETY: a live, aligned page.
        assert_eq!(unsafe { read_slot_count(&*page, 3) }.unwrap(), 2);
        page.cnt[5] = 2049;
        assert!(slot_metas(&page, 5).is_err());
        // SAFETY: a live, aligned page (`page` is borrowed for the call only).
        assert!(unsafe { read_slot_count(&*page, 5) }.is_err());
        assert!(slot_metas(&page, 16).is_err());
        assert_eq!(meta_bytes(&page.mem[3][..2]).len(), 32);
        assert_eq!(&meta_bytes(&page.mem[3][1..2])[..4], &4096u32.to_le_bytes());
    }

    #[test]
    fn checked_in_ptx_matches_the_rust_layout() {
        // The entry point exists and takes one by-value parameter of exactly BATCH_BYTES.
        assert!(
            PTX.contains(".entry tcpx_unpack("),
            "kernels/unpack.ptx lacks the entry"
        );
        let decl = format!("tcpx_unpack_param_0[{BATCH_BYTES}]");
        assert!(
            PTX.contains(&decl),
            "kernels/unpack.ptx does not declare {decl}"
        );
        assert!(SOURCE.contains(&format!(
            "#define TCPX_UNPACK_MAX_ENTRIES {MAX_ENTRIES_PER_LAUNCH}"
        )));
        let compat = compat_ptx(PTX);
        assert!(compat.contains(&format!(".version {COMPAT_PTX_VERSION}\n")));
        assert_eq!(compat.matches(".version").count(), 1);
        assert!(!compat.contains("used_bytes_mask"));
        assert!(compat.contains(".entry tcpx_unpack("));
    }

    #[test]
    fn launch_configs_are_validated() {
        assert!(LaunchConfig::default().validate().is_ok());
        for (t, f) in [(0, 32), (33, 32), (2048, 32), (256, 0), (256, 4096)] {
            let c = LaunchConfig {
                threads_per_block: t,
                frags_per_block: f,
                max_blocks: 0,
            };
            assert!(c.validate().is_err(), "{c:?}");
        }
    }

    /// Random fragment lists: each fragment's destination is disjoint from the others (as a
    /// real receive's are), sources anywhere (overlapping allowed), order shuffled.
    fn fragments() -> impl Strategy<Value = (usize, Vec<LoadMeta>, usize)> {
        (
            1usize..20_000,
            prop::collection::vec((1u32..4097, 0usize..64, any::<u32>()), 0..64),
        )
            .prop_flat_map(|(bounce_len, frags)| {
                let mut dst_off = 0u64;
                let mut metas = Vec::new();
                for (len, gap, seed) in frags {
                    let len = len.min(bounce_len as u32);
                    dst_off += gap as u64;
                    let src_off = seed % (bounce_len as u32 - len + 1);
                    metas.push(meta(src_off, len, dst_off));
                    dst_off += len as u64;
                }
                let dst_len = dst_off as usize;
                (Just(bounce_len), Just(metas).prop_shuffle(), Just(dst_len))
            })
    }

    proptest! {
        #[test]
        fn gather_matches_a_naive_copy((bounce_len, metas, dst_len) in fragments(), salt in any::<u8>()) {
            let bounce: Vec<u8> = (0..bounce_len).map(|i| (i as u8) ^ salt).collect();
            let mut dst = vec![0xAAu8; dst_len];
            let total = gather_cpu(&bounce, &metas, &mut dst).unwrap();
            prop_assert_eq!(total, metas.iter().map(|m| m.len as u64).sum::<u64>());
            let mut expect = vec![0xAAu8; dst_len];
            for m in &metas {
                for k in 0..m.len as usize {
                    expect[m.dst_off as usize + k] = bounce[m.src_off as usize + k];
                }
            }
            prop_assert_eq!(dst, expect);
        }

        #[test]
        fn any_out_of_range_fragment_is_refused_untouched(
            (bounce_len, mut metas, dst_len) in fragments(),
            pick in any::<prop::sample::Index>(),
            past in 1u64..5000,
            on_src in any::<bool>(),
        ) {
            prop_assume!(!metas.is_empty());
            let i = pick.index(metas.len());
            if on_src {
                let len = metas[i].len as u64;
                let off = (bounce_len as u64 + past).saturating_sub(len);
                prop_assume!(off <= u32::MAX as u64);
                metas[i].src_off = off as u32;
                if off + len <= bounce_len as u64 { metas[i].len += past as u32; }
            } else {
                metas[i].dst_off = dst_len as u64 + past - 1;
                metas[i].len = metas[i].len.max(1);
            }
            let bounce = vec![1u8; bounce_len];
            let mut dst = vec![0u8; dst_len];
            let err = gather_cpu(&bounce, &metas, &mut dst).unwrap_err().to_string();
            prop_assert!(err.contains("fragment "), "{}", err);
            prop_assert!(dst.iter().all(|&b| b == 0));
        }
    }
}
