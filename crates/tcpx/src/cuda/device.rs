//! [`CudaDevice`] (a GPU and its primary context), [`CudaStream`] and [`CudaEvent`].

use std::ffi::{c_char, CStr};
use std::fmt;
use std::sync::Arc;

use cudarc::driver::sys;

use super::driver::{check, require};
use crate::error::{Error, Result};
use crate::memory::SharedMemory;

/// One GPU: its ordinal, identity (name, PCI bus id, compute capability) and its primary
/// context, retained while any handle (buffer, stream, event, kernel) is alive. Cheap to clone.
#[derive(Clone)]
pub struct CudaDevice {
    inner: Arc<DeviceInner>,
}

struct DeviceInner {
    ordinal: usize,
    device: sys::CUdevice,
    context: sys::CUcontext,
    name: String,
    pci_bus_id: String,
    compute_capability: (u32, u32),
    multiprocessors: u32,
    total_memory: usize,
}

// SAFETY: a CUcontext is a driver handle usable from any thread (the driver API is thread-safe);
// the other fields are plain values.
unsafe impl Send for DeviceInner {}
// SAFETY: a CUcontext is usable from any thread (the driver API is thread-safe), the other
// fields are plain values, and nothing is mutated through `&self`.
unsafe impl Sync for DeviceInner {}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        // SAFETY: releases the retain taken in `CudaDevice::new`; every buffer, stream and event
        // holds a `CudaDevice`, so none outlives the context.
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) };
    }
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.inner.ordinal)
            .field("name", &self.inner.name)
            .field("pci_bus_id", &self.inner.pci_bus_id)
            .field("compute_capability", &self.inner.compute_capability)
            .finish()
    }
}

fn attribute(device: sys::CUdevice, attr: sys::CUdevice_attribute) -> Result<i32> {
    let mut value = 0;
    // SAFETY: writes one int; `device` came from cuDeviceGet.
    let rc = unsafe { sys::cuDeviceGetAttribute(&mut value, attr, device) };
    check("cuDeviceGetAttribute", rc, || format!("{attr:?}"))?;
    Ok(value)
}

impl CudaDevice {
    /// Number of CUDA devices (0 without a driver: never an error, never a panic).
    pub fn count() -> usize {
        match super::driver_status() {
            super::DriverStatus::Available { devices, .. } => *devices,
            super::DriverStatus::Unavailable(_) => 0,
        }
    }

    /// Opens device `ordinal` and retains its primary context.
    pub fn new(ordinal: usize) -> Result<Self> {
        const API: &str = "CudaDevice::new";
        require(API)?;
        let count = Self::count();
        if ordinal >= count {
            return Err(Error::invalid(
                API,
                format!("device {ordinal} requested, {count} present"),
            ));
        }
        let mut device: sys::CUdevice = 0;
        // SAFETY: writes one CUdevice; the ordinal is in range.
        let rc = unsafe { sys::cuDeviceGet(&mut device, ordinal as i32) };
        check("cuDeviceGet", rc, || format!("ordinal {ordinal}"))?;

        let mut name_buf = [0 as c_char; 256];
        // SAFETY: the driver writes a NUL-terminated string of at most `len` bytes.
        let rc = unsafe { sys::cuDeviceGetName(name_buf.as_mut_ptr(), 256, device) };
        check("cuDeviceGetName", rc, || format!("ordinal {ordinal}"))?;
        // SAFETY: NUL-terminated within the buffer (written by the driver, which was zeroed).
        let name = unsafe { CStr::from_ptr(name_buf.as_ptr()) }
            .to_string_lossy()
            .into_owned();

        use sys::CUdevice_attribute as A;
        let domain = attribute(device, A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?;
        let bus = attribute(device, A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?;
        let dev = attribute(device, A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?;
        let major = attribute(device, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attribute(device, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let sms = attribute(device, A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let unified = attribute(device, A::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING)?;
        if unified == 0 {
            return Err(Error::invalid(
                API,
                format!("device {ordinal} ({name}) lacks unified addressing"),
            ));
        }
        let mut total_memory = 0usize;
        // SAFETY: writes one size_t.
        let rc = unsafe { sys::cuDeviceTotalMem_v2(&mut total_memory, device) };
        check("cuDeviceTotalMem", rc, || format!("ordinal {ordinal}"))?;

        let mut context: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one context handle; released in DeviceInner::drop.
        let rc = unsafe { sys::cuDevicePrimaryCtxRetain(&mut context, device) };
        check("cuDevicePrimaryCtxRetain", rc, || {
            format!("ordinal {ordinal}")
        })?;

        Ok(Self {
            inner: Arc::new(DeviceInner {
                ordinal,
                device,
                context,
                name,
                pci_bus_id: format_pci_bus_id(domain as u32, bus as u32, dev as u32),
                compute_capability: (major as u32, minor as u32),
                multiprocessors: sms as u32,
                total_memory,
            }),
        })
    }

    /// The ordinal this device was opened with (CUDA's enumeration order, which follows
    /// `CUDA_DEVICE_ORDER` and `CUDA_VISIBLE_DEVICES`).
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// The marketing name (`NVIDIA H100 80GB HBM3`).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The PCI bus id as `dddd:bb:dd.0` in lowercase hex (sysfs and hwloc style), from the
    /// PCI_DOMAIN_ID / PCI_BUS_ID / PCI_DEVICE_ID attributes (CUDA reports no function: 0).
    pub fn pci_bus_id(&self) -> String {
        self.inner.pci_bus_id.clone()
    }

    /// The driver's own spelling of the bus id (`cuDeviceGetPCIBusId`, e.g. `00000000:04:00.0`),
    /// for cross-checking [`pci_bus_id`](Self::pci_bus_id).
    pub fn driver_pci_bus_id(&self) -> Result<String> {
        let mut buf = [0 as c_char; 64];
        // SAFETY: the driver writes a NUL-terminated string of at most `len` bytes.
        let rc = unsafe { sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), 64, self.inner.device) };
        check("cuDeviceGetPCIBusId", rc, || self.describe())?;
        // SAFETY: NUL-terminated within the zeroed buffer.
        Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned())
    }

    /// Compute capability (major, minor): (9, 0) for H100.
    pub fn compute_capability(&self) -> (u32, u32) {
        self.inner.compute_capability
    }

    /// Streaming multiprocessors.
    pub fn multiprocessor_count(&self) -> u32 {
        self.inner.multiprocessors
    }

    /// Device memory in bytes.
    pub fn total_memory(&self) -> usize {
        self.inner.total_memory
    }

    /// The raw `CUdevice`.
    pub fn raw(&self) -> sys::CUdevice {
        self.inner.device
    }

    /// The primary context (retained while this handle lives).
    pub(crate) fn context(&self) -> sys::CUcontext {
        self.inner.context
    }

    /// Makes this device's primary context current on the calling thread (a no-op when it
    /// already is). Every method here calls it; call it yourself before raw driver calls.
    pub fn bind(&self) -> Result<()> {
        let mut current: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one context handle.
        let rc = unsafe { sys::cuCtxGetCurrent(&mut current) };
        check("cuCtxGetCurrent", rc, || self.describe())?;
        if current != self.inner.context {
            // SAFETY: the context is retained for as long as `self` lives.
            let rc = unsafe { sys::cuCtxSetCurrent(self.inner.context) };
            check("cuCtxSetCurrent", rc, || self.describe())?;
        }
        Ok(())
    }

    /// Waits for all work on this device's context.
    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        // SAFETY: no pointers involved; the context is current.
        let rc = unsafe { sys::cuCtxSynchronize() };
        check("cuCtxSynchronize", rc, || self.describe())
    }

    /// Creates a stream (non-blocking with respect to the legacy default stream).
    pub fn stream(&self) -> Result<CudaStream> {
        CudaStream::new(self)
    }

    /// Copies `len` bytes from `src[src_offset..]` to `dst[dst_offset..]` and waits for the copy
    /// to finish. Either side may be host memory (pageable or pinned) or device memory of this
    /// device. Both count as in flight during the copy: fails with `Busy` while the CPU holds a
    /// slice of either.
    pub fn copy(
        &self,
        dst: &SharedMemory,
        dst_offset: usize,
        src: &SharedMemory,
        src_offset: usize,
        len: usize,
    ) -> Result<()> {
        const API: &str = "CudaDevice::copy";
        dst.check_range(API, dst_offset, len)?;
        src.check_range(API, src_offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let _d = dst.begin_operation(API)?;
        let _s = src.begin_operation(API)?;
        // SAFETY: both ranges were checked against live memories, kept alive and marked in
        // flight (no CPU slices) by the tokens above until the copy has completed.
        unsafe {
            self.copy_raw(
                dst.as_ptr() as u64 + dst_offset as u64,
                src.as_ptr() as u64 + src_offset as u64,
                len,
            )
        }
    }

    /// Synchronous copy between two unified addresses (host or device).
    ///
    /// # Safety
    /// `src..src+len` must be readable and `dst..dst+len` writable for the duration of the call,
    /// with no Rust reference to the destination alive.
    pub unsafe fn copy_raw(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller guarantees both ranges; cuMemcpy uses unified addressing.
        let rc = unsafe { sys::cuMemcpy(dst, src, len) };
        check("cuMemcpy", rc, || {
            format!("{} bytes {src:#x} -> {dst:#x}, {}", len, self.describe())
        })?;
        // cuMemcpy from pageable memory may return before the data reached the device, and it
        // runs on the legacy stream: wait for it so that any stream sees the data.
        // SAFETY: no pointers; the context is current.
        let rc = unsafe { sys::cuStreamSynchronize(std::ptr::null_mut()) };
        check("cuStreamSynchronize", rc, || self.describe())
    }

    /// Lets this device's context reach `peer`'s memory directly (`cuCtxEnablePeerAccess`;
    /// already enabled is fine). Copies between the two then go GPU to GPU instead of
    /// through host memory.
    pub fn enable_peer_access(&self, peer: &CudaDevice) -> Result<()> {
        if peer.ordinal() == self.ordinal() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: both contexts are retained for as long as `self` and `peer` live.
        let rc = unsafe { sys::cuCtxEnablePeerAccess(peer.inner.context, 0) };
        if rc == sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
            return Ok(());
        }
        check("cuCtxEnablePeerAccess", rc, || {
            format!("{} -> {}", self.describe(), peer.describe())
        })
    }

    pub(crate) fn describe(&self) -> String {
        format!(
            "GPU {} {} {}",
            self.inner.ordinal, self.inner.pci_bus_id, self.inner.name
        )
    }
}

/// Whether the GPU with PCI bus id `from` can access the memory of the GPU with bus id `to`
/// peer-to-peer (`cuDeviceCanAccessPeer`, no context created). `Ok(None)` when either is not
/// visible to this process; `Ok(Some(true))` for the same GPU.
pub fn peer_access_possible(from: &str, to: &str) -> Result<Option<bool>> {
    super::driver::require("peer_access_possible")?;
    let device = |bus: &str| -> Option<sys::CUdevice> {
        let text = std::ffi::CString::new(bus).ok()?;
        let mut d: sys::CUdevice = 0;
        // SAFETY: writes one CUdevice; the string is NUL-terminated and outlives the call.
        let rc = unsafe { sys::cuDeviceGetByPCIBusId(&mut d, text.as_ptr()) };
        (rc == sys::CUresult::CUDA_SUCCESS).then_some(d)
    };
    let (Some(a), Some(b)) = (device(from), device(to)) else {
        return Ok(None);
    };
    if a == b {
        return Ok(Some(true));
    }
    let mut can = 0;
    // SAFETY: writes one int; both devices came from the driver.
    let rc = unsafe { sys::cuDeviceCanAccessPeer(&mut can, a, b) };
    check("cuDeviceCanAccessPeer", rc, || format!("{from} -> {to}"))?;
    Ok(Some(can != 0))
}

/// The PCI bus id (`dddd:bb:dd.0`) of CUDA device `ordinal`, from its attributes: no context
/// is created (unlike [`CudaDevice::new`]).
pub fn device_pci_bus_id(ordinal: usize) -> Result<String> {
    const API: &str = "device_pci_bus_id";
    super::driver::require(API)?;
    let count = CudaDevice::count();
    if ordinal >= count {
        return Err(Error::invalid(
            API,
            format!("device {ordinal} requested, {count} present"),
        ));
    }
    let mut device: sys::CUdevice = 0;
    // SAFETY: writes one CUdevice; the ordinal is in range.
    let rc = unsafe { sys::cuDeviceGet(&mut device, ordinal as i32) };
    check("cuDeviceGet", rc, || format!("ordinal {ordinal}"))?;
    use sys::CUdevice_attribute as A;
    let domain = attribute(device, A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?;
    let bus = attribute(device, A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?;
    let dev = attribute(device, A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?;
    Ok(format_pci_bus_id(domain as u32, bus as u32, dev as u32))
}

/// `dddd:bb:dd.0`, lowercase.
pub(crate) fn format_pci_bus_id(domain: u32, bus: u32, device: u32) -> String {
    format!("{domain:04x}:{bus:02x}:{device:02x}.0")
}

/// A CUDA stream of one device. Work on it runs in order; it does not wait for the legacy
/// default stream. Destroyed on drop (after the work queued on it completes, as CUDA does).
pub struct CudaStream {
    device: CudaDevice,
    stream: sys::CUstream,
}

// SAFETY: a CUstream may be used from any thread; the device handle is Send + Sync.
unsafe impl Send for CudaStream {}
// SAFETY: a CUstream may be used from several threads at once (the driver serializes
// submissions to one stream); the device handle is Send + Sync.
unsafe impl Sync for CudaStream {}

impl fmt::Debug for CudaStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaStream")
            .field("device", &self.device.ordinal())
            .field("stream", &self.stream)
            .finish()
    }
}

impl CudaStream {
    /// Creates a non-blocking stream on `device`.
    pub fn new(device: &CudaDevice) -> Result<Self> {
        device.bind()?;
        let mut stream: sys::CUstream = std::ptr::null_mut();
        // SAFETY: writes one stream handle; destroyed in Drop.
        let rc = unsafe {
            sys::cuStreamCreate(
                &mut stream,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
            )
        };
        check("cuStreamCreate", rc, || device.describe())?;
        Ok(Self {
            device: device.clone(),
            stream,
        })
    }

    /// The device.
    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    /// The raw `CUstream` (for launching other work on it).
    pub fn raw(&self) -> sys::CUstream {
        self.stream
    }

    /// Waits for everything queued so far.
    pub fn synchronize(&self) -> Result<()> {
        self.device.bind()?;
        // SAFETY: a live stream.
        let rc = unsafe { sys::cuStreamSynchronize(self.stream) };
        check("cuStreamSynchronize", rc, || self.device.describe())
    }

    /// Records a new event at the current end of the stream.
    pub fn record(&self) -> Result<CudaEvent> {
        let event = CudaEvent::new(&self.device, false)?;
        event.record(self)?;
        Ok(event)
    }

    /// Queues a copy between two unified addresses.
    ///
    /// # Safety
    /// `src..src+len` must stay readable and `dst..dst+len` writable, untouched by anything
    /// else, until the copy completes (synchronize the stream or an event recorded after it).
    pub unsafe fn copy_raw_async(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        self.device.bind()?;
        // SAFETY: the caller guarantees the ranges for the copy's lifetime.
        let rc = unsafe { sys::cuMemcpyAsync(dst, src, len, self.stream) };
        check("cuMemcpyAsync", rc, || {
            format!(
                "{len} bytes {src:#x} -> {dst:#x}, {}",
                self.device.describe()
            )
        })
    }
}

impl Drop for CudaStream {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: a live stream, destroyed once; CUDA lets queued work finish.
            let _ = unsafe { sys::cuStreamDestroy_v2(self.stream) };
        }
    }
}

/// A CUDA event: a point in a stream that the host can poll or wait for, and (when created with
/// timing) measure between.
pub struct CudaEvent {
    device: CudaDevice,
    event: sys::CUevent,
}

// SAFETY: a CUevent may be used from any thread.
unsafe impl Send for CudaEvent {}
// SAFETY: a CUevent may be used from several threads at once: queries and waits are
// thread-safe in the driver.
unsafe impl Sync for CudaEvent {}

impl fmt::Debug for CudaEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaEvent")
            .field("device", &self.device.ordinal())
            .field("event", &self.event)
            .finish()
    }
}

impl CudaEvent {
    /// Creates an event; `timing` enables [`elapsed_ms`](Self::elapsed_ms) (slightly slower).
    pub fn new(device: &CudaDevice, timing: bool) -> Result<Self> {
        device.bind()?;
        let flags = if timing {
            sys::CUevent_flags::CU_EVENT_DEFAULT as u32
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
        };
        let mut event: sys::CUevent = std::ptr::null_mut();
        // SAFETY: writes one event handle; destroyed in Drop.
        let rc = unsafe { sys::cuEventCreate(&mut event, flags) };
        check("cuEventCreate", rc, || device.describe())?;
        Ok(Self {
            device: device.clone(),
            event,
        })
    }

    /// Records the event at the current end of `stream` (re-recording moves it).
    pub fn record(&self, stream: &CudaStream) -> Result<()> {
        self.device.bind()?;
        // SAFETY: a live event and a live stream of the same device.
        let rc = unsafe { sys::cuEventRecord(self.event, stream.stream) };
        check("cuEventRecord", rc, || self.device.describe())
    }

    /// True once the work before the record has completed (non-blocking).
    pub fn is_done(&self) -> Result<bool> {
        self.device.bind()?;
        // SAFETY: a live event.
        let rc = unsafe { sys::cuEventQuery(self.event) };
        match rc {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            rc => Err(super::driver::cuda_error(
                "cuEventQuery",
                rc,
                self.device.describe(),
            )),
        }
    }

    /// Blocks until the work before the record has completed.
    pub fn synchronize(&self) -> Result<()> {
        self.device.bind()?;
        // SAFETY: a live event.
        let rc = unsafe { sys::cuEventSynchronize(self.event) };
        check("cuEventSynchronize", rc, || self.device.describe())
    }

    /// Milliseconds between `start` and `self` (both recorded with timing and completed).
    pub fn elapsed_ms(&self, start: &CudaEvent) -> Result<f32> {
        self.device.bind()?;
        let mut ms = 0f32;
        // SAFETY: writes one float; both events are live.
        let rc = unsafe { sys::cuEventElapsedTime(&mut ms, start.event, self.event) };
        check("cuEventElapsedTime", rc, || self.device.describe())?;
        Ok(ms)
    }

    /// The raw `CUevent`.
    pub fn raw(&self) -> sys::CUevent {
        self.event
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: a live event, destroyed once.
            let _ = unsafe { sys::cuEventDestroy_v2(self.event) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_are_formatted_like_sysfs() {
        assert_eq!(format_pci_bus_id(0, 0x8a, 0), "0000:8a:00.0");
        assert_eq!(format_pci_bus_id(1, 4, 0x1f), "0001:04:1f.0");
    }

    #[test]
    fn no_driver_means_errors_not_panics() {
        if super::super::driver_available() {
            return;
        }
        assert!(peer_access_possible("0000:01:00.0", "0000:02:00.0").is_err());
        assert!(device_pci_bus_id(0).is_err());
        assert_eq!(CudaDevice::count(), 0);
        let err = CudaDevice::new(0).unwrap_err();
        assert!(err.to_string().contains("no usable CUDA driver"), "{err}");
    }
}
