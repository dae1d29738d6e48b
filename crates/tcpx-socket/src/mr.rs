//! Memory registration. Host memory needs no pinning or mapping for kernel sockets, so a
//! registration only records the range and its kind, which lets `isend`/`irecv` refuse a buffer
//! that lies outside what the caller registered (the mistake a real RDMA/TCPX plugin would
//! punish with corrupted data or a fault) and tells them whether it is CUDA memory.
//!
//! CUDA memory is accepted only in devmem emulation (`TCPX_SOCKET_DEVMEM=1`), and only when the
//! driver says the range is device memory of the plugin's GPU.

use std::ffi::c_void;

use tcpx_sys::{ResultCode, NCCL_PTR_CUDA, NCCL_PTR_HOST};

use crate::log::{log_trace, log_warn};
use crate::object::{self, MR_TAG, RECV_TAG, SEND_TAG};

/// A registration, handed to callers as the `mhandle`.
#[repr(C)]
pub(crate) struct Mr {
    tag: u64,
    comm: usize,
    base: usize,
    len: usize,
    ptr_type: i32,
}

/// `regMr`: records `[data, data + size)` of host memory for `comm`.
///
/// # Safety
/// `comm` is NULL or an object pointer of this plugin.
pub(crate) unsafe fn register(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    ptr_type: i32,
) -> Result<*mut c_void, ResultCode> {
    // SAFETY: forwarded contract.
    let tag = unsafe { object::tag_of(comm.cast(), "regMr comm") }?;
    if tag != SEND_TAG && tag != RECV_TAG {
        log_warn!(
            "tcpx-socket: regMr on {comm:p}, which is {}, not a send or receive comm",
            object::describe(tag)
        );
        return Err(ResultCode::INVALID_ARGUMENT);
    }
    if ptr_type == NCCL_PTR_CUDA {
        if let Some(gpu) = crate::device::devmem_gpu() {
            check_cuda(gpu, data, size)?;
        } else {
            log_warn!(
            "tcpx-socket: regMr of CUDA memory {data:p} ({size} bytes) refused: this plugin moves \
             host memory only; CUDA memory needs a CUDA-capable plugin (e.g. GPUDirect-TCPX) or \
             staging through pinned host buffers (or devmem emulation: {})",
                crate::device::DEVMEM_ENV
            );
            return Err(ResultCode::INVALID_ARGUMENT);
        }
    } else if ptr_type != NCCL_PTR_HOST {
        log_warn!(
            "tcpx-socket: regMr with pointer type {ptr_type}: only NCCL_PTR_HOST (1), and \
             NCCL_PTR_CUDA (2) in devmem emulation, are supported"
        );
        return Err(ResultCode::INVALID_ARGUMENT);
    }
    if data.is_null() && size > 0 {
        log_warn!("tcpx-socket: regMr of a NULL buffer with {size} bytes");
        return Err(ResultCode::INVALID_ARGUMENT);
    }
    if (data as usize).checked_add(size).is_none() {
        log_warn!("tcpx-socket: regMr range {data:p} + {size} wraps the address space");
        return Err(ResultCode::INVALID_ARGUMENT);
    }
    let mr = Box::new(Mr {
        tag: MR_TAG,
        comm: comm as usize,
        base: data as usize,
        len: size,
        ptr_type,
    });
    log_trace!("tcpx-socket: regMr comm {comm:p} {data:p} + {size} type {ptr_type}");
    Ok(Box::into_raw(mr).cast())
}

/// Refuses a CUDA registration whose range is not device memory of the devmem GPU.
fn check_cuda(gpu: &crate::cuda::Gpu, data: *mut c_void, size: usize) -> Result<(), ResultCode> {
    if size == 0 {
        return Ok(());
    }
    let last = (data as u64).saturating_add(size as u64 - 1);
    let owner = gpu.scoped(|g| Ok((g.device_of(data as u64)?, g.device_of(last)?)));
    match owner {
        Ok((Some(a), Some(b))) if a == gpu.ordinal && b == gpu.ordinal => Ok(()),
        Ok(found) => {
            log_warn!(
                "tcpx-socket: regMr of CUDA memory {data:p} + {size} bytes refused: the driver \
                 says its first/last byte are on {found:?} (None: not device memory), but devmem \
                 emulation receives on GPU {} ({})",
                gpu.ordinal,
                crate::device::DEVMEM_GPU_ENV
            );
            Err(ResultCode::INVALID_ARGUMENT)
        }
        Err(e) => {
            log_warn!("tcpx-socket: regMr of CUDA memory {data:p} + {size} bytes: {e}");
            Err(ResultCode::UNHANDLED_CUDA_ERROR)
        }
    }
}

/// `deregMr`: frees a registration of `comm`.
///
/// # Safety
/// `mh` is NULL or a pointer this plugin handed out, not yet deregistered.
pub(crate) unsafe fn deregister(comm: *mut c_void, mh: *mut c_void) -> Result<(), ResultCode> {
    // SAFETY: forwarded contract.
    let mr = unsafe { object::expect::<Mr>(mh.cast(), MR_TAG, "deregMr mhandle") }?;
    // SAFETY: the tag says this is a live registration created by `register`.
    let owner = unsafe { (*mr).comm };
    if owner != comm as usize {
        log_warn!(
            "tcpx-socket: deregMr of {mh:p} on comm {comm:p}, but it was registered on {owner:#x}"
        );
        return Err(ResultCode::INVALID_ARGUMENT);
    }
    // SAFETY: `mr` came from Box::into_raw in `register` and is freed once (tag overwritten so a
    // second deregMr of the same pointer is refused while the memory is not reused).
    unsafe {
        (*mr).tag = object::DEAD_TAG;
        drop(Box::from_raw(mr));
    }
    Ok(())
}

/// Checks that `[data, data + size)` lies inside registration `mh` of `comm`; returns the
/// registration's pointer type (`NCCL_PTR_HOST` for an empty message without one).
///
/// # Safety
/// `mh` is NULL or a pointer this plugin handed out.
pub(crate) unsafe fn check(
    comm: *const c_void,
    mh: *mut c_void,
    data: *const c_void,
    size: usize,
    call: &str,
) -> Result<i32, ResultCode> {
    // An empty message touches no memory: accept it without a registration (callers sometimes
    // post zero-byte operations with whatever handle they have, including none).
    if size == 0 && mh.is_null() {
        return Ok(NCCL_PTR_HOST);
    }
    // Formatted only if the handle is refused: this runs for every isend / irecv.
    let what = format_args!("{call} mhandle");
    // SAFETY: forwarded contract.
    let mr = unsafe { object::expect::<Mr>(mh.cast(), MR_TAG, what) }?;
    // SAFETY: a live registration (tag checked).
    let mr = unsafe { &*mr };
    if mr.comm != comm as usize {
        log_warn!(
            "tcpx-socket: {call} on comm {comm:p} with a registration of comm {:#x}",
            mr.comm
        );
        return Err(ResultCode::INVALID_ARGUMENT);
    }
    if size == 0 {
        return Ok(mr.ptr_type);
    }
    let start = data as usize;
    let inside = start >= mr.base
        && start
            .checked_add(size)
            .is_some_and(|end| end <= mr.base + mr.len);
    if !inside {
        log_warn!(
            "tcpx-socket: {call} buffer {data:p} + {size} bytes is outside its registration \
             {:#x} + {} bytes",
            mr.base,
            mr.len
        );
        return Err(ResultCode::INVALID_ARGUMENT);
    }
    Ok(mr.ptr_type)
}
