//! CUDA IPC: handing a device allocation to another process of the same host
//! ([`IpcExport`]) and mapping one a peer handed over ([`IpcMapping`]); the copies between
//! them go through [`super::CopyPool`].
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

use cudarc::driver::sys;

use super::device::CudaDevice;
use super::driver::check;
use crate::error::Result;

pub use tcpx_proto::ipc::{IpcMemHandle, IPC_HANDLE_BYTES};

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
    fn export_and_open_on_one_gpu() {
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
    }
}
