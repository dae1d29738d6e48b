//! Finding the CUDA driver without panicking, and turning `CUresult`s into [`Error`]s.

use std::ffi::{c_char, c_int, c_uint, CStr};
use std::fmt;
use std::sync::OnceLock;

use cudarc::driver::sys;

use super::CudaError;
use crate::error::{Error, ErrorKind, Result};

/// Environment variable that, set to anything but `0` or empty, makes this process behave as if
/// no CUDA driver were installed (to exercise the skip paths on a GPU machine).
pub const DISABLE_ENV: &str = "TCPX_CUDA_DISABLE";

/// What this process found when it looked for the CUDA driver (probed once, then cached).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DriverStatus {
    /// `libcuda` loaded, `cuInit(0)` succeeded and at least one device is visible.
    Available {
        /// `cuDriverGetVersion`, e.g. 13000 for CUDA 13.0.
        version: i32,
        /// `cuDeviceGetCount`.
        devices: usize,
        /// The library name that loaded (`libcuda.so.1`).
        library: String,
    },
    /// No usable driver; the string says why.
    Unavailable(String),
}

impl DriverStatus {
    /// True when CUDA calls can be made.
    pub fn is_available(&self) -> bool {
        matches!(self, DriverStatus::Available { .. })
    }
}

impl fmt::Display for DriverStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DriverStatus::Available {
                version,
                devices,
                library,
            } => write!(
                f,
                "CUDA driver {}.{} ({library}), {devices} device(s)",
                version / 1000,
                (version % 1000) / 10
            ),
            DriverStatus::Unavailable(why) => f.write_str(why),
        }
    }
}

/// The driver's status, probed on first use and cached for the life of the process. Never
/// panics: a missing library, a failing `cuInit` or zero devices all give `Unavailable`.
pub fn driver_status() -> &'static DriverStatus {
    static STATUS: OnceLock<DriverStatus> = OnceLock::new();
    STATUS.get_or_init(probe)
}

/// True when a usable CUDA driver with at least one device is present (see [`driver_status`]).
pub fn driver_available() -> bool {
    driver_status().is_available()
}

/// `None` when CUDA is usable, else the line GPU tests print before skipping:
/// `"skipped: no CUDA driver (<why>)"`.
pub fn skip_reason() -> Option<String> {
    match driver_status() {
        DriverStatus::Available { .. } => None,
        DriverStatus::Unavailable(why) => Some(format!("skipped: no CUDA driver ({why})")),
    }
}

type CuInit = unsafe extern "C" fn(c_uint) -> c_int;
type CuGetInt = unsafe extern "C" fn(*mut c_int) -> c_int;

fn probe() -> DriverStatus {
    if std::env::var_os(DISABLE_ENV).is_some_and(|v| !v.is_empty() && v != "0") {
        return DriverStatus::Unavailable(format!("disabled by {DISABLE_ENV}"));
    }
    let mut failures = Vec::new();
    let mut found = None;
    for name in ["libcuda.so.1", "libcuda.so"] {
        // SAFETY: loading the CUDA driver library runs its ELF initializers, which have no
        // preconditions; the handle is kept for the life of the process below.
        match unsafe { libloading::Library::new(name) } {
            Ok(lib) => {
                found = Some((name, lib));
                break;
            }
            Err(e) => failures.push(e.to_string()),
        }
    }
    let Some((name, lib)) = found else {
        return DriverStatus::Unavailable(format!("cannot load libcuda ({})", failures.join("; ")));
    };
    // SAFETY: these symbols have exactly these C signatures in every CUDA driver
    // (`CUresult cuInit(unsigned)`, `CUresult cuDriverGetVersion(int*)`,
    // `CUresult cuDeviceGetCount(int*)`); the library outlives the calls (it is leaked below).
    let probed = unsafe {
        let init = lib.get::<CuInit>(b"cuInit\0");
        let version = lib.get::<CuGetInt>(b"cuDriverGetVersion\0");
        let count = lib.get::<CuGetInt>(b"cuDeviceGetCount\0");
        match (init, version, count) {
            (Ok(init), Ok(version), Ok(count)) => {
                let rc = init(0);
                if rc != 0 {
                    Err(format!("cuInit(0) returned {rc} ({name})"))
                } else {
                    let (mut v, mut n) = (0, 0);
                    let rc_v = version(&mut v);
                    let rc_n = count(&mut n);
                    if rc_v != 0 || rc_n != 0 {
                        Err(format!(
                            "cuDriverGetVersion/cuDeviceGetCount returned {rc_v}/{rc_n}"
                        ))
                    } else {
                        Ok((v, n))
                    }
                }
            }
            _ => Err(format!(
                "{name} lacks cuInit/cuDriverGetVersion/cuDeviceGetCount"
            )),
        }
    };
    // The driver stays loaded: unloading libcuda after cuInit is not supported.
    std::mem::forget(lib);
    let (version, devices) = match probed {
        Ok(v) => v,
        Err(why) => return DriverStatus::Unavailable(why),
    };
    if devices <= 0 {
        return DriverStatus::Unavailable(format!(
            "the driver ({name}, version {version}) sees no CUDA devices"
        ));
    }
    // cudarc resolves the library by its own list of names and panics when none loads: make
    // sure it will find one before any call goes through it.
    // SAFETY: only tries to dlopen candidate names (the same initializers as above).
    if !unsafe { sys::is_culib_present() } {
        return DriverStatus::Unavailable(format!(
            "{name} loads but cudarc finds no CUDA driver library under its names"
        ));
    }
    DriverStatus::Available {
        version,
        devices: devices as usize,
        library: name.to_string(),
    }
}

/// Which GPU `ptr` lives on: `Some(ordinal)` for CUDA device memory, `None` for host memory
/// (pageable, or pinned with `cuMemHostAlloc`), pointers CUDA does not know, and when no
/// CUDA driver is usable. Never panics; the only CUDA work it may trigger is the one-time
/// [`driver_status`] probe (dlopen, `cuInit`). Unified (managed) memory reports the device it
/// was allocated for.
pub fn pointer_device(ptr: *const u8) -> Option<usize> {
    if ptr.is_null() || !driver_available() {
        return None;
    }
    // Read into plain integers, not cudarc's enums: the driver may write values the enum
    // does not list (newer memory types).
    let memory_type: c_uint = pointer_attribute(
        ptr,
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
    )?;
    // CU_MEMORYTYPE_DEVICE = 2; CU_MEMORYTYPE_UNIFIED = 4 (managed memory).
    if !(memory_type == 2 || memory_type == 4) {
        return None;
    }
    let ordinal: c_int = pointer_attribute(
        ptr,
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
    )?;
    usize::try_from(ordinal).ok()
}

/// The CUDA allocation `ptr` points into, as (start address, length in bytes); `None` when
/// `ptr` is not CUDA device memory or no driver is usable (as [`pointer_device`]). Lets a
/// caller check that a range lies inside one allocation.
pub fn pointer_allocation(ptr: *const u8) -> Option<(u64, usize)> {
    pointer_device(ptr)?;
    let start: sys::CUdeviceptr = pointer_attribute(
        ptr,
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
    )?;
    let len: usize = pointer_attribute(
        ptr,
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
    )?;
    Some((start, len))
}

/// Plain-integer pointer attributes: `T` must be the C type the driver writes for
/// `attribute` (`unsigned int` for MEMORY_TYPE, `int` for DEVICE_ORDINAL, `CUdeviceptr` for
/// RANGE_START_ADDR, `size_t` for RANGE_SIZE). Callers checked the driver is available.
fn pointer_attribute<T: Default + Copy>(
    ptr: *const u8,
    attribute: sys::CUpointer_attribute,
) -> Option<T> {
    let mut value = T::default();
    // SAFETY: the driver is loaded and initialised (callers check `driver_available`);
    // cuPointerGetAttribute writes one value of the attribute's C type, which is `T` (see
    // above), into `value`, and only inspects the address, which need not be valid
    // (unknown ones give CUDA_ERROR_INVALID_VALUE).
    let rc = unsafe {
        sys::cuPointerGetAttribute(
            (&mut value as *mut T).cast(),
            attribute,
            ptr as sys::CUdeviceptr,
        )
    };
    (rc == sys::CUresult::CUDA_SUCCESS).then_some(value)
}

/// Fails with [`CudaError::NoDriver`] unless the driver is usable; every driver entry point
/// calls this before reaching `cudarc`.
pub(crate) fn require(api: &'static str) -> Result<()> {
    match driver_status() {
        DriverStatus::Available { .. } => Ok(()),
        DriverStatus::Unavailable(why) => Err(Error::new(
            api,
            ErrorKind::Cuda(CudaError::NoDriver(why.clone())),
            "",
        )),
    }
}

/// The name of a driver result code (`CUDA_ERROR_INVALID_VALUE`).
pub(crate) fn error_name(rc: sys::CUresult) -> String {
    let mut name: *const c_char = std::ptr::null();
    // SAFETY: cuGetErrorName writes a pointer to a static string or leaves it NULL; the driver is
    // loaded (callers only get a CUresult from an earlier call that went through `require`).
    let ok = unsafe { sys::cuGetErrorName(rc, &mut name) } == sys::CUresult::CUDA_SUCCESS;
    if ok && !name.is_null() {
        // SAFETY: non-NULL, NUL-terminated static string owned by the driver.
        unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned()
    } else {
        format!("CUresult {}", rc as i32)
    }
}

/// Turns a driver result into `Ok(())` or an error naming `api` and `context`.
pub(crate) fn check(
    api: &'static str,
    rc: sys::CUresult,
    context: impl FnOnce() -> String,
) -> Result<()> {
    if rc == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(cuda_error(api, rc, context()))
    }
}

/// The error for a failed driver call.
pub(crate) fn cuda_error(api: &'static str, rc: sys::CUresult, context: String) -> Error {
    Error::new(
        api,
        ErrorKind::Cuda(CudaError::Driver {
            code: rc as i32,
            name: error_name(rc),
        }),
        context,
    )
}

/// An error of kind [`CudaError::Kernel`].
pub(crate) fn kernel_error(api: &'static str, what: impl Into<String>) -> Error {
    Error::new(api, ErrorKind::Cuda(CudaError::Kernel(what.into())), "")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_is_cached_and_never_panics() {
        let a = driver_status();
        let b = driver_status();
        assert!(std::ptr::eq(a, b));
        assert_eq!(driver_available(), a.is_available());
        assert_eq!(skip_reason().is_none(), a.is_available());
        if let Some(why) = skip_reason() {
            assert!(why.starts_with("skipped: no CUDA driver ("), "{why}");
            let err = require("test").unwrap_err();
            assert!(matches!(
                err.kind(),
                ErrorKind::Cuda(CudaError::NoDriver(_))
            ));
            assert!(err.to_string().contains("no usable CUDA driver"), "{err}");
        }
    }

    #[test]
    fn host_pointers_are_on_no_gpu() {
        let host = vec![1u8; 4096];
        assert_eq!(pointer_device(host.as_ptr()), None);
        assert_eq!(pointer_device(std::ptr::null()), None);
        // An address nothing is mapped at: unknown to CUDA, and never dereferenced.
        assert_eq!(pointer_device(0x10 as *const u8), None);
        assert_eq!(pointer_allocation(host.as_ptr()), None);
    }

    #[test]
    fn device_pointers_name_their_gpu_and_allocation() {
        if let Some(why) = skip_reason() {
            println!("{why}");
            return;
        }
        let gpu = crate::cuda::CudaDevice::new(0).unwrap();
        let buf = gpu.alloc(1 << 20).unwrap();
        let base = buf.device_ptr() as *const u8;
        assert_eq!(pointer_device(base), Some(0));
        assert_eq!(pointer_device(base.wrapping_add(4095)), Some(0));
        // The buffer is over-allocated by up to 4 KiB - 1 to align its start: the driver's
        // allocation holds it, starting at or before it.
        let (start, len) = pointer_allocation(base.wrapping_add(100)).unwrap();
        assert!(start <= buf.device_ptr() && buf.device_ptr() - start < 4096);
        assert!(start + len as u64 >= buf.device_ptr() + (1 << 20) && len < (1 << 20) + 4096);
        let pinned = crate::cuda::PinnedHostBuffer::new(&gpu, 4096).unwrap();
        assert_eq!(pointer_device(pinned.as_slice().as_ptr()), None);
    }
}
