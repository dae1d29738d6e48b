//! Regions: caller-owned memory registered with an endpoint (host or CUDA), or memory the
//! endpoint allocates; and the in-use accounting that keeps `tcpx_region_destroy` from
//! releasing memory a transfer still uses.

use std::ffi::c_void;
use std::sync::atomic::Ordering;

use tcpx_core::MemoryKind;

use crate::convert::{non_null, to_usize, write_out};
use crate::error::{guard, CapiError};
use crate::objects::{self, adopt_region, DESTROYING, ENDPOINTS, REGIONS};
use crate::tcpx_memory_kind::{self, *};
use crate::tcpx_status::{self, *};
use crate::{tcpx_endpoint, tcpx_region};

/// Registers caller-owned memory `[ptr, ptr + len)` with the endpoint: host memory, or a CUDA
/// device pointer (recognised through the CUDA driver, on the endpoint's GPU; staged through
/// pinned host memory when the plugin takes host memory only). `*region` is the new handle.
/// The memory stays the caller's: it must stay valid until `tcpx_region_destroy` succeeded
/// (or the endpoint was destroyed). Registration with the plugin happens per connection at
/// first use (or `tcpx_connection_register`).
/// Thread safety: any thread.
///
/// # Safety
/// `[ptr, ptr + len)` is one allocation of host or CUDA memory that stays valid as said above;
/// `region` points to writable memory for a handle.
#[no_mangle]
pub unsafe extern "C" fn tcpx_endpoint_register(
    endpoint: tcpx_endpoint,
    ptr: *mut c_void,
    len: usize,
    region: *mut tcpx_region,
) -> tcpx_status {
    guard("tcpx_endpoint_register", || {
        non_null(ptr, "ptr")?;
        non_null(region, "region (output)")?;
        if len == 0 {
            return Err(CapiError::invalid("len is 0: cannot register empty memory"));
        }
        let obj = objects::endpoint(endpoint)?;
        // SAFETY: the memory's validity is the C caller's promise, passed on unchanged.
        let registered = unsafe { obj.endpoint.register_ptr(ptr.cast(), len) }?;
        adopt_region(endpoint, registered, region)
    })
}

/// Allocates `len` bytes of zeroed, 4 KiB-aligned host memory owned by the library and
/// registers it. `tcpx_region_info` gives its address; `tcpx_region_destroy` frees it.
/// Thread safety: any thread.
///
/// # Safety
/// `region` points to writable memory for a handle.
#[no_mangle]
pub unsafe extern "C" fn tcpx_endpoint_alloc_host(
    endpoint: tcpx_endpoint,
    len: usize,
    region: *mut tcpx_region,
) -> tcpx_status {
    guard("tcpx_endpoint_alloc_host", || {
        non_null(region, "region (output)")?;
        let obj = objects::endpoint(endpoint)?;
        let allocated = obj.endpoint.alloc_host(len)?;
        adopt_region(endpoint, allocated, region)
    })
}

/// Allocates `len` bytes of zeroed device memory on the endpoint's GPU (the GPU of its first
/// CUDA region, else the one whose PCI id is `gpu_pci`, else GPU 0) and registers it.
/// `TCPX_ERR_UNSUPPORTED` without a CUDA driver or device. Thread safety: any thread.
///
/// # Safety
/// `region` points to writable memory for a handle.
#[no_mangle]
pub unsafe extern "C" fn tcpx_endpoint_alloc_cuda(
    endpoint: tcpx_endpoint,
    len: usize,
    region: *mut tcpx_region,
) -> tcpx_status {
    guard("tcpx_endpoint_alloc_cuda", || {
        non_null(region, "region (output)")?;
        let obj = objects::endpoint(endpoint)?;
        let allocated = obj.endpoint.alloc_cuda(len)?;
        adopt_region(endpoint, allocated, region)
    })
}

/// Describes a region: its base address (a device pointer for CUDA memory; for allocated
/// regions this is where the host reads and writes the data), its length and where it lives.
/// Each output may be NULL when not wanted. Thread safety: any thread.
///
/// # Safety
/// Each non-NULL output points to writable memory of its type.
#[no_mangle]
pub unsafe extern "C" fn tcpx_region_info(
    region: tcpx_region,
    ptr: *mut *mut c_void,
    len: *mut usize,
    kind: *mut tcpx_memory_kind,
) -> tcpx_status {
    guard("tcpx_region_info", || {
        let obj = REGIONS.get(region.id)?;
        let memory = obj.region.memory();
        if !ptr.is_null() {
            // SAFETY: non-null (checked); writable (the caller's promise).
            unsafe { write_out(ptr, memory.as_ptr().cast()) };
        }
        if !len.is_null() {
            // SAFETY: `len` is non-null (checked just above) and writable (the caller's promise).
            unsafe { write_out(len, memory.len()) };
        }
        if !kind.is_null() {
            let k = match memory.kind() {
                MemoryKind::Host => TCPX_MEMORY_HOST,
                MemoryKind::Cuda => TCPX_MEMORY_CUDA,
            };
            // SAFETY: `kind` is non-null (checked just above) and writable (the caller's promise).
            unsafe { write_out(kind, k) };
        }
        Ok(TCPX_OK)
    })
}

/// Releases a region: revokes its descriptor (peers' later one-sided requests on it are
/// refused), then deregisters caller-owned memory (which is the caller's to free once this
/// returned `TCPX_OK`) or frees allocated memory. Refused with `TCPX_ERR_BUSY`, the region left
/// usable (but revoked), while a transfer on it has not finished or the plugin still holds a
/// request on it (after a failed transfer, destroy the connection to abandon those).
/// Thread safety: any thread; a transfer submitted on the region by another thread at the same
/// moment makes one of the two calls fail (`TCPX_ERR_BUSY` or `TCPX_ERR_STALE_HANDLE`).
#[no_mangle]
pub extern "C" fn tcpx_region_destroy(region: tcpx_region) -> tcpx_status {
    guard("tcpx_region_destroy", || {
        let obj = REGIONS.get(region.id)?;
        if let Err(n) =
            obj.state
                .compare_exchange(0, DESTROYING, Ordering::AcqRel, Ordering::Acquire)
        {
            return Err(CapiError::new(
                TCPX_ERR_BUSY,
                if n & DESTROYING != 0 {
                    "another thread is destroying this region".to_string()
                } else {
                    format!("{n} call(s) are submitting transfers on this region right now")
                },
            ));
        }
        let busy = |why: String| {
            obj.state.store(0, Ordering::Release);
            Err(CapiError::new(TCPX_ERR_BUSY, why))
        };
        let pending = {
            let mut users = obj.users.lock().unwrap_or_else(|p| p.into_inner());
            users.retain(|t| !t.is_finished());
            users.len()
        };
        if pending > 0 {
            return busy(format!(
                "{pending} transfer(s) on this region have not finished: wait for them, or \
                 destroy their connection"
            ));
        }
        if let Ok(ep) = ENDPOINTS.get(obj.endpoint) {
            obj.revoke_on(&ep.endpoint);
        }
        let requests = obj.region.memory().in_flight();
        if requests > 0 {
            return busy(format!(
                "the plugin still holds {requests} request(s) on this memory (a failed transfer's, \
                 or a peer's one-sided operation being served): destroy the connection to \
                 abandon them"
            ));
        }
        REGIONS.remove(region.id)?;
        Ok(TCPX_OK)
    })
}

/// Copies `len` bytes from host memory `src` into the region at `offset` and waits for the
/// copy: for host regions a plain copy (the host may equally write through the address
/// `tcpx_region_info` gives), for CUDA regions a device copy, so that hosts need not link CUDA
/// themselves. Refused (`TCPX_ERR_INVALID_ARGUMENT`) for a range outside the region and, for host
/// regions, while a transfer on the region is in flight. Thread safety: any thread; for a CUDA
/// region, do not race it with a transfer on the same bytes (the GPU does not order the two).
///
/// # Safety
/// `src` points to `len` readable bytes (may be NULL when `len` is 0).
#[no_mangle]
pub unsafe extern "C" fn tcpx_region_write(
    region: tcpx_region,
    offset: u64,
    src: *const u8,
    len: usize,
) -> tcpx_status {
    guard("tcpx_region_write", || {
        // SAFETY: `len` readable bytes when non-null (the caller's promise).
        let bytes = unsafe { crate::convert::bytes(src, len, "src") }?;
        let obj = REGIONS.get(region.id)?;
        obj.region.write(to_usize(offset, "offset")?, bytes)?;
        Ok(TCPX_OK)
    })
}

/// Copies `len` bytes of the region from `offset` into host memory `dst` and waits for the copy
/// (a device copy for CUDA regions). Read after the transfer that wrote them completed.
/// Thread safety: as `tcpx_region_write`.
///
/// # Safety
/// `dst` points to `len` writable bytes (may be NULL when `len` is 0).
#[no_mangle]
pub unsafe extern "C" fn tcpx_region_read(
    region: tcpx_region,
    offset: u64,
    dst: *mut u8,
    len: usize,
) -> tcpx_status {
    guard("tcpx_region_read", || {
        if len > 0 {
            non_null(dst, "dst")?;
        }
        let obj = REGIONS.get(region.id)?;
        let out: &mut [u8] = if len == 0 {
            &mut []
        } else {
            // SAFETY: non-null (checked), `len` writable bytes (the caller's promise), not
            // aliased by anything of ours.
            unsafe { std::slice::from_raw_parts_mut(dst, len) }
        };
        obj.region.read(to_usize(offset, "offset")?, out)?;
        Ok(TCPX_OK)
    })
}
