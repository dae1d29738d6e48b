//! Devices and their properties, copied out of the plugin into owned Rust values.

use std::ffi::CStr;
use std::path::PathBuf;

use tcpx_sys::{
    ncclNetProperties_v8_t, NCCL_NET_DEVICE_HOST, NCCL_NET_DEVICE_UNPACK, NCCL_PTR_CUDA,
    NCCL_PTR_DMABUF, NCCL_PTR_HOST,
};

/// One plugin device (a NIC, for TCPX and for our socket plugin).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Device {
    /// The device index used in `listen`/`connect`.
    pub index: usize,
    /// Its properties.
    pub properties: Properties,
}

/// Memory kinds a device can send from and receive into (`ptrSupport`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct PtrSupport(pub i32);

impl PtrSupport {
    /// Host memory.
    pub fn host(self) -> bool {
        self.0 & NCCL_PTR_HOST != 0
    }
    /// CUDA device memory.
    pub fn cuda(self) -> bool {
        self.0 & NCCL_PTR_CUDA != 0
    }
    /// dma-buf registration.
    pub fn dmabuf(self) -> bool {
        self.0 & NCCL_PTR_DMABUF != 0
    }
}

/// How received data reaches the consumer (`netDeviceType`): an integer, unknown values kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct DeviceType(pub i32);

impl DeviceType {
    /// Data lands in the destination buffer.
    pub const HOST: Self = Self(NCCL_NET_DEVICE_HOST);
    /// Data lands in a bounce buffer and must be gathered ("unpack", TCPX devmem).
    pub const UNPACK: Self = Self(NCCL_NET_DEVICE_UNPACK);
}

/// Properties of a device, normalized to the v8 layout.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Properties {
    /// Device name (the interface name for TCPX and tcpx-socket).
    pub name: String,
    /// sysfs path of the PCI device, when the plugin reports one.
    pub pci_path: Option<PathBuf>,
    /// Globally unique id.
    pub guid: u64,
    /// Memory kinds supported.
    pub ptr_support: PtrSupport,
    /// v8 `regIsGlobal` (0 for older tables).
    pub reg_is_global: bool,
    /// Link speed in Mbps.
    pub speed_mbps: i32,
    /// Port number.
    pub port: i32,
    /// Latency in microseconds.
    pub latency_us: f32,
    /// Maximum comms.
    pub max_comms: i32,
    /// Maximum receives grouped in one `irecv`.
    pub max_recvs: i32,
    /// Net device type.
    pub device_type: DeviceType,
    /// Net device version (7 for TCPX unpack).
    pub device_version: i32,
}

impl Properties {
    /// Copies the raw properties.
    ///
    /// # Safety
    /// The string pointers are NULL or NUL-terminated strings valid for the call.
    pub(crate) unsafe fn from_raw(raw: &ncclNetProperties_v8_t) -> Self {
        // SAFETY: forwarded from the caller.
        let name = unsafe { opt_string(raw.name) }.unwrap_or_default();
        // SAFETY: forwarded from the caller.
        let pci_path = unsafe { opt_string(raw.pciPath) }
            .filter(|s| !s.is_empty())
            .map(PathBuf::from);
        Self {
            name,
            pci_path,
            guid: raw.guid,
            ptr_support: PtrSupport(raw.ptrSupport),
            reg_is_global: raw.regIsGlobal != 0,
            speed_mbps: raw.speed,
            port: raw.port,
            latency_us: raw.latency,
            max_comms: raw.maxComms,
            max_recvs: raw.maxRecvs,
            device_type: DeviceType(raw.netDeviceType),
            device_version: raw.netDeviceVersion,
        }
    }
}

/// # Safety
/// `p` is NULL or a NUL-terminated string valid for the call.
unsafe fn opt_string(p: *const std::ffi::c_char) -> Option<String> {
    if p.is_null() {
        None
    } else {
        // SAFETY: guaranteed by the caller.
        Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    }
}
