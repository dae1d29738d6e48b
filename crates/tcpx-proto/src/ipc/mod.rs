//! Same-host (CUDA IPC) formats: the 64-byte CUDA IPC handle, the 128-byte
//! [`IpcDescriptor`] a peer names advertised GPU memory with, and the local protocol's
//! messages ([`wire`]).

mod descriptor;
pub mod identity;
pub mod wire;

use std::fmt;

pub use descriptor::{IpcDescriptor, IpcDescriptorError};

/// Bytes in a CUDA IPC memory handle (`CU_IPC_HANDLE_SIZE`).
pub const IPC_HANDLE_BYTES: usize = 64;

/// Longest GPU PCI bus id carried.
pub const MAX_BUS_ID: usize = 32;

/// A CUDA IPC memory handle: 64 opaque bytes naming one allocation of one process. Plain
/// bytes: building one from a peer's bytes is safe, and the driver rejects a forged one when
/// it is opened.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcMemHandle([u8; IPC_HANDLE_BYTES]);

impl IpcMemHandle {
    /// The handle with these bytes.
    pub const fn from_bytes(bytes: [u8; IPC_HANDLE_BYTES]) -> Self {
        Self(bytes)
    }

    /// Its bytes.
    pub const fn as_bytes(&self) -> &[u8; IPC_HANDLE_BYTES] {
        &self.0
    }
}

impl fmt::Debug for IpcMemHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The first 8 bytes tell handles apart in logs; all 64 would drown them.
        write!(f, "IpcMemHandle(")?;
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "…)")
    }
}
