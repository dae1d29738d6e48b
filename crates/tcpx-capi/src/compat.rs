//! Stand-ins for runtime API that lands on branch `endpoint` (register_ptr, connect_addr,
//! gpu_index, peer_gpu). Removed by the merge: the inherent methods then take precedence.

use std::net::SocketAddr;

use tcpx_core::{Memory, MemoryKind, SharedMemory};
use tcpx_runtime::{Config, Connection, Endpoint, Error, Region, Result};

use crate::error::{CapiError, CapiResult};
use crate::tcpx_status::*;

struct CallerHost {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain host memory the caller keeps valid (register_ptr's contract); the pointer is
// only handed to the plugin and to SharedMemory's checked accessors.
unsafe impl Send for CallerHost {}
// SAFETY: as above.
unsafe impl Sync for CallerHost {}

// SAFETY: host memory of `len` bytes, valid until the region and its clones are dropped
// (register_ptr's contract, passed on to the C caller).
unsafe impl Memory for CallerHost {
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

pub(crate) trait EndpointCompat {
    fn connect_addr(&self, addr: SocketAddr) -> Result<Connection>;
    fn gpu_index(&self) -> Option<u32>;
    unsafe fn register_ptr(&self, ptr: *mut u8, len: usize) -> Result<Region>;
}

impl EndpointCompat for Endpoint {
    fn connect_addr(&self, addr: SocketAddr) -> Result<Connection> {
        Err(Error::Unsupported(format!(
            "connect by address ({addr}) needs the runtime's connect_addr"
        )))
    }
    fn gpu_index(&self) -> Option<u32> {
        None
    }
    unsafe fn register_ptr(&self, ptr: *mut u8, len: usize) -> Result<Region> {
        if ptr.is_null() || len == 0 {
            return Err(Error::InvalidArgument("null or empty memory".into()));
        }
        self.register(SharedMemory::new(CallerHost { ptr, len }))
    }
}

pub(crate) trait ConnectionCompat {
    fn peer_gpu(&self) -> Option<u32>;
}

impl ConnectionCompat for Connection {
    fn peer_gpu(&self) -> Option<u32> {
        None
    }
}

pub(crate) fn set_gpu_index(_config: &mut Config, index: u32) -> CapiResult<()> {
    Err(CapiError::new(
        TCPX_ERR_UNSUPPORTED,
        format!("options->gpu_index {index}: needs the runtime's gpu_index"),
    ))
}
