//! The few CUDA driver calls devmem emulation needs, loaded at run time with `libloading`.
//!
//! This crate must not depend on `tcpx` (which depends on it) and must build and run on machines
//! without CUDA, so it resolves `libcuda.so.1` itself, once, when devmem mode is switched on
//! (`TCPX_SOCKET_DEVMEM=1`, read at `init`). A missing library, a missing symbol, a failing
//! `cuInit` or no device is an error string the caller logs and turns into a result code: never
//! a panic. `TCPX_CUDA_DISABLE` (set, not `0`) makes this module behave as if no driver were
//! installed, exactly like the `tcpx` crate, so GPU machines can exercise the failure path.
//!
//! Every call runs with the plugin's GPU's primary context pushed on the calling thread and
//! popped afterwards ([`Gpu::scoped`]), so the caller's own current context is left as it was.
//! The primary context is the one `tcpx::cuda::CudaDevice` (and the CUDA runtime) use, so the
//! device pointers handed out here are valid in the consumer's kernels.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};

/// `CUresult` (0 = success).
type CuResult = c_int;
/// `CUdevice`.
type CuDevice = c_int;
/// `CUcontext` / `CUstream`: opaque pointers.
type CuHandle = *mut c_void;
/// `CUdeviceptr`.
pub(crate) type DevPtr = u64;

/// `CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP`.
const HOSTALLOC_FLAGS: c_uint = 0x1 | 0x2;
/// `CU_STREAM_NON_BLOCKING`: the plugin's copies do not wait for the legacy default stream.
const STREAM_NON_BLOCKING: c_uint = 1;
/// `CU_POINTER_ATTRIBUTE_MEMORY_TYPE`.
const ATTR_MEMORY_TYPE: c_int = 2;
/// `CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL`.
const ATTR_DEVICE_ORDINAL: c_int = 9;
/// `CU_MEMORYTYPE_DEVICE`.
const MEMORYTYPE_DEVICE: c_uint = 2;

/// Environment variable that makes the plugin behave as if no CUDA driver were installed (the
/// same name the `tcpx` crate honours).
pub(crate) const DISABLE_ENV: &str = "TCPX_CUDA_DISABLE";
/// Environment variable naming the driver library to load instead of `libcuda.so.1` (a driver
/// outside the loader's path, or a stand-in driver for tests).
pub const CUDA_LIB_ENV: &str = "TCPX_SOCKET_CUDA_LIB";

/// The driver entry points, resolved once (plain function pointers; the library is leaked so
/// they stay valid for the life of the process).
struct Fns {
    get_error_name: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
    device_get: unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult,
    device_get_count: unsafe extern "C" fn(*mut c_int) -> CuResult,
    primary_ctx_retain: unsafe extern "C" fn(*mut CuHandle, CuDevice) -> CuResult,
    ctx_push: unsafe extern "C" fn(CuHandle) -> CuResult,
    ctx_pop: unsafe extern "C" fn(*mut CuHandle) -> CuResult,
    mem_alloc: unsafe extern "C" fn(*mut DevPtr, usize) -> CuResult,
    mem_free: unsafe extern "C" fn(DevPtr) -> CuResult,
    host_alloc: unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> CuResult,
    host_free: unsafe extern "C" fn(*mut c_void) -> CuResult,
    host_get_device_ptr: unsafe extern "C" fn(*mut DevPtr, *mut c_void, c_uint) -> CuResult,
    htod_async: unsafe extern "C" fn(DevPtr, *const c_void, usize, CuHandle) -> CuResult,
    dtoh_async: unsafe extern "C" fn(*mut c_void, DevPtr, usize, CuHandle) -> CuResult,
    stream_create: unsafe extern "C" fn(*mut CuHandle, c_uint) -> CuResult,
    stream_destroy: unsafe extern "C" fn(CuHandle) -> CuResult,
    stream_sync: unsafe extern "C" fn(CuHandle) -> CuResult,
    pointer_get_attribute: unsafe extern "C" fn(*mut c_void, c_int, DevPtr) -> CuResult,
}

/// A failed driver call: which API, its code and the code's name.
#[derive(Debug)]
pub(crate) struct CudaFail {
    api: &'static str,
    rc: c_int,
    name: String,
}

impl std::fmt::Display for CudaFail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} failed: {} ({})", self.api, self.name, self.rc)
    }
}

/// The plugin's GPU: the driver's entry points, the device and its retained primary context.
pub(crate) struct Gpu {
    fns: Fns,
    /// CUDA device ordinal (`TCPX_SOCKET_DEVMEM_GPU`, default 0).
    pub ordinal: usize,
    /// The plugin's stream for its copies (non-blocking, never destroyed: process lifetime).
    stream: CuHandle,
    context: CuHandle,
}

// SAFETY: CUDA contexts and streams may be used from any thread (the driver serializes what it
// must); the function pointers are plain code addresses.
unsafe impl Send for Gpu {}
// SAFETY: the CUDA handles may be used from several threads at once (the driver serializes
// what it must), the function pointers are plain code addresses, and `Gpu` has no interior
// mutability of its own.
unsafe impl Sync for Gpu {}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GPU {}", self.ordinal)
    }
}

/// Resolves one symbol as a plain function pointer of type `T`.
///
/// # Safety
/// `T` must be the symbol's true C signature.
unsafe fn sym<T: Copy>(lib: &libloading::Library, name: &str) -> Result<T, String> {
    let cname = format!("{name}\0");
    // SAFETY: forwarded contract; the pointer is copied out and the library is never unloaded.
    unsafe { lib.get::<T>(cname.as_bytes()) }
        .map(|s| *s)
        .map_err(|e| format!("libcuda lacks {name}: {e}"))
}

impl Gpu {
    /// Loads the driver, initializes it and retains the primary context of GPU `ordinal`.
    /// Never panics: every failure is a message saying what is missing.
    pub(crate) fn open(ordinal: usize) -> Result<Self, String> {
        if std::env::var_os(DISABLE_ENV).is_some_and(|v| !v.is_empty() && v != "0") {
            return Err(format!("no CUDA driver: disabled by {DISABLE_ENV}"));
        }
        let mut failures = Vec::new();
        let mut found = None;
        let names = match std::env::var(CUDA_LIB_ENV) {
            Ok(path) if !path.trim().is_empty() => vec![path],
            _ => vec!["libcuda.so.1".to_string(), "libcuda.so".to_string()],
        };
        for name in &names {
            // SAFETY: loading the driver runs its ELF initializers, which have no
            // preconditions; the library is leaked below (unloading after cuInit is unsupported).
            match unsafe { libloading::Library::new(name.as_str()) } {
                Ok(lib) => {
                    found = Some(lib);
                    break;
                }
                Err(e) => failures.push(format!("{name}: {e}")),
            }
        }
        let Some(lib) = found else {
            return Err(format!(
                "no CUDA driver: cannot load libcuda ({})",
                failures.join("; ")
            ));
        };
        // SAFETY: each type below is the documented C signature of that driver entry point
        // (CUDA driver API, `_v2` variants where the driver exports both).
        let (init, fns) = unsafe {
            let init: unsafe extern "C" fn(c_uint) -> CuResult = sym(&lib, "cuInit")?;
            let fns = Fns {
                get_error_name: sym(&lib, "cuGetErrorName")?,
                device_get: sym(&lib, "cuDeviceGet")?,
                device_get_count: sym(&lib, "cuDeviceGetCount")?,
                primary_ctx_retain: sym(&lib, "cuDevicePrimaryCtxRetain")?,
                ctx_push: sym(&lib, "cuCtxPushCurrent_v2")?,
                ctx_pop: sym(&lib, "cuCtxPopCurrent_v2")?,
                mem_alloc: sym(&lib, "cuMemAlloc_v2")?,
                mem_free: sym(&lib, "cuMemFree_v2")?,
                host_alloc: sym(&lib, "cuMemHostAlloc")?,
                host_free: sym(&lib, "cuMemFreeHost")?,
                host_get_device_ptr: sym(&lib, "cuMemHostGetDevicePointer_v2")?,
                htod_async: sym(&lib, "cuMemcpyHtoDAsync_v2")?,
                dtoh_async: sym(&lib, "cuMemcpyDtoHAsync_v2")?,
                stream_create: sym(&lib, "cuStreamCreate")?,
                stream_destroy: sym(&lib, "cuStreamDestroy_v2")?,
                stream_sync: sym(&lib, "cuStreamSynchronize")?,
                pointer_get_attribute: sym(&lib, "cuPointerGetAttribute")?,
            };
            (init, fns)
        };
        std::mem::forget(lib);
        // SAFETY: cuInit takes flags (must be 0) and has no other preconditions.
        let rc = unsafe { init(0) };
        if rc != 0 {
            return Err(format!("no CUDA driver: cuInit(0) returned {rc}"));
        }
        let mut count: c_int = 0;
        // SAFETY: out-pointer to a local.
        let rc = unsafe { (fns.device_get_count)(&mut count) };
        if rc != 0 || count <= 0 {
            return Err(format!(
                "no CUDA device: cuDeviceGetCount returned {rc} with {count} device(s)"
            ));
        }
        if ordinal >= count as usize {
            return Err(format!(
                "GPU {ordinal} requested (TCPX_SOCKET_DEVMEM_GPU) but the driver sees {count}"
            ));
        }
        let mut dev: CuDevice = 0;
        // SAFETY: out-pointer to a local; the ordinal is in range.
        let rc = unsafe { (fns.device_get)(&mut dev, ordinal as c_int) };
        if rc != 0 {
            return Err(format!("cuDeviceGet({ordinal}) returned {rc}"));
        }
        let mut context: CuHandle = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the retained context is never released (the plugin
        // keeps using it for the life of the process).
        let rc = unsafe { (fns.primary_ctx_retain)(&mut context, dev) };
        if rc != 0 {
            return Err(format!(
                "cuDevicePrimaryCtxRetain(GPU {ordinal}) returned {rc}"
            ));
        }
        let mut gpu = Gpu {
            fns,
            ordinal,
            stream: std::ptr::null_mut(),
            context,
        };
        let stream = gpu
            .scoped(|g| {
                let mut s: CuHandle = std::ptr::null_mut();
                // SAFETY: out-pointer to a local; our context is current.
                g.check("cuStreamCreate", unsafe {
                    (g.fns.stream_create)(&mut s, STREAM_NON_BLOCKING)
                })?;
                Ok(s)
            })
            .map_err(|e| e.to_string())?;
        gpu.stream = stream;
        Ok(gpu)
    }

    fn check(&self, api: &'static str, rc: CuResult) -> Result<(), CudaFail> {
        if rc == 0 {
            return Ok(());
        }
        let mut name: *const c_char = std::ptr::null();
        // SAFETY: writes a pointer to a static string, or leaves NULL.
        let ok = unsafe { (self.fns.get_error_name)(rc, &mut name) } == 0;
        let name = if ok && !name.is_null() {
            // SAFETY: non-NULL, NUL-terminated static string owned by the driver.
            unsafe { CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned()
        } else {
            format!("CUresult {rc}")
        };
        Err(CudaFail { api, rc, name })
    }

    /// Runs `f` with this GPU's primary context current on the calling thread, then restores
    /// the caller's context.
    pub(crate) fn scoped<R>(
        &self,
        f: impl FnOnce(&Self) -> Result<R, CudaFail>,
    ) -> Result<R, CudaFail> {
        // SAFETY: the context was retained in `open` and is never released.
        self.check("cuCtxPushCurrent", unsafe {
            (self.fns.ctx_push)(self.context)
        })?;
        let out = f(self);
        let mut popped: CuHandle = std::ptr::null_mut();
        // SAFETY: pops the context pushed above (out-pointer to a local).
        let pop = self.check("cuCtxPopCurrent", unsafe {
            (self.fns.ctx_pop)(&mut popped)
        });
        let out = out?;
        pop?;
        Ok(out)
    }

    /// `cuMemAlloc` (context must be current: call inside [`scoped`](Self::scoped)).
    pub(crate) fn alloc(&self, len: usize) -> Result<DevPtr, CudaFail> {
        let mut p: DevPtr = 0;
        // SAFETY: out-pointer to a local.
        self.check("cuMemAlloc", unsafe { (self.fns.mem_alloc)(&mut p, len) })?;
        Ok(p)
    }

    /// `cuMemFree` of a pointer from [`alloc`](Self::alloc).
    ///
    /// # Safety
    /// `p` came from `alloc` and is not used afterwards (by the host or by queued GPU work).
    pub(crate) unsafe fn free(&self, p: DevPtr) -> Result<(), CudaFail> {
        // SAFETY: forwarded contract.
        self.check("cuMemFree", unsafe { (self.fns.mem_free)(p) })
    }

    /// Pinned host memory mapped into the GPU (`cuMemHostAlloc` PORTABLE | DEVICEMAP) and its
    /// device address (`cuMemHostGetDevicePointer`).
    pub(crate) fn host_alloc_mapped(&self, len: usize) -> Result<(*mut u8, DevPtr), CudaFail> {
        let mut host: *mut c_void = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        self.check("cuMemHostAlloc", unsafe {
            (self.fns.host_alloc)(&mut host, len, HOSTALLOC_FLAGS)
        })?;
        let mut dev: DevPtr = 0;
        // SAFETY: `host` is a live mapped allocation of this context; out-pointer to a local.
        let rc = unsafe { (self.fns.host_get_device_ptr)(&mut dev, host, 0) };
        if let Err(e) = self.check("cuMemHostGetDevicePointer", rc) {
            // SAFETY: allocated just above, never handed out.
            let _ = unsafe { (self.fns.host_free)(host) };
            return Err(e);
        }
        Ok((host.cast(), dev))
    }

    /// `cuMemFreeHost`.
    ///
    /// # Safety
    /// `p` came from [`host_alloc_mapped`](Self::host_alloc_mapped) and is not used afterwards.
    pub(crate) unsafe fn host_free(&self, p: *mut u8) -> Result<(), CudaFail> {
        // SAFETY: forwarded contract.
        self.check("cuMemFreeHost", unsafe { (self.fns.host_free)(p.cast()) })
    }

    /// Copies host → device on the plugin's stream and waits for the copy.
    ///
    /// # Safety
    /// `src` is readable for `len` bytes and `dst..dst+len` is device memory of this GPU that
    /// nothing else accesses during the call.
    pub(crate) unsafe fn htod(
        &self,
        dst: DevPtr,
        src: *const u8,
        len: usize,
    ) -> Result<(), CudaFail> {
        // SAFETY: forwarded contract; the copy completes before we return (synchronize).
        self.check("cuMemcpyHtoDAsync", unsafe {
            (self.fns.htod_async)(dst, src.cast(), len, self.stream)
        })?;
        // SAFETY: our own stream.
        self.check("cuStreamSynchronize", unsafe {
            (self.fns.stream_sync)(self.stream)
        })
    }

    /// Copies device → host on the plugin's stream and waits for the copy.
    ///
    /// # Safety
    /// `dst` is writable for `len` bytes with no Rust reference to it alive, and
    /// `src..src+len` is readable device memory of this GPU.
    pub(crate) unsafe fn dtoh(
        &self,
        dst: *mut u8,
        src: DevPtr,
        len: usize,
    ) -> Result<(), CudaFail> {
        // SAFETY: forwarded contract; the copy completes before we return (synchronize).
        self.check("cuMemcpyDtoHAsync", unsafe {
            (self.fns.dtoh_async)(dst.cast(), src, len, self.stream)
        })?;
        // SAFETY: our own stream.
        self.check("cuStreamSynchronize", unsafe {
            (self.fns.stream_sync)(self.stream)
        })
    }

    /// Whether `p` is device memory (`cuMemAlloc`-style) and on which GPU. `Ok(None)` for
    /// pointers the driver does not know (host memory).
    pub(crate) fn device_of(&self, p: DevPtr) -> Result<Option<usize>, CudaFail> {
        let mut kind: c_uint = 0;
        // SAFETY: the attribute is an unsigned int written into a local.
        let rc = unsafe {
            (self.fns.pointer_get_attribute)((&mut kind as *mut c_uint).cast(), ATTR_MEMORY_TYPE, p)
        };
        if rc != 0 || kind != MEMORYTYPE_DEVICE {
            // CUDA_ERROR_INVALID_VALUE for unknown (host) pointers: not device memory.
            return Ok(None);
        }
        let mut ordinal: c_int = -1;
        // SAFETY: the attribute is an int written into a local.
        self.check("cuPointerGetAttribute", unsafe {
            (self.fns.pointer_get_attribute)(
                (&mut ordinal as *mut c_int).cast(),
                ATTR_DEVICE_ORDINAL,
                p,
            )
        })?;
        Ok(usize::try_from(ordinal).ok())
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // Only reached when `open` fails after creating nothing, or never (the plugin's GPU is a
        // process-wide static): the stream is destroyed if one exists.
        if !self.stream.is_null() {
            let stream = self.stream;
            let _ = self.scoped(|g| {
                // SAFETY: our own stream, not used afterwards.
                g.check("cuStreamDestroy", unsafe { (g.fns.stream_destroy)(stream) })
            });
        }
    }
}
