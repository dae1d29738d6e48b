//! [`Descriptor`]: what a peer needs to name an advertised region in one-sided operations,
//! and [`RemoteSegment`]: a piece of one.
//!
//! The byte form is fixed little-endian, 26 bytes:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 1 | format version, [`Descriptor::VERSION`] |
//! | 1 | 8 | region id (u64) |
//! | 9 | 8 | length in bytes (u64) |
//! | 17 | 1 | memory kind (`NCCL_PTR_HOST` 1, `NCCL_PTR_CUDA` 2) |
//! | 18 | 8 | access key (u64) |
//!
//! The decoder checks the length, the version and the kind, and never panics.

use crate::MemoryKind;

/// A registered region advertised for one-sided access (the runtime's `Endpoint::advertise`).
///
/// Hand it to the peer out of band ([`Descriptor::to_bytes`]); the peer names it in the
/// runtime's `Connection::write` and `Connection::read`. The key is random: a peer that has
/// not been given the descriptor cannot guess it, and revoking it (`Endpoint::revoke`) refuses
/// every later request that names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Descriptor {
    region_id: u64,
    len: u64,
    kind: MemoryKind,
    key: u64,
}

/// A descriptor's bytes could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DescriptorError {
    /// Not [`Descriptor::BYTES`] long.
    #[error("a descriptor is {expected} bytes, got {got}")]
    Length {
        /// Bytes a descriptor has.
        expected: usize,
        /// Bytes given.
        got: usize,
    },
    /// A format version this side does not read.
    #[error("descriptor format version {0} is not supported (this side reads version 1)")]
    Version(u8),
    /// A memory kind code other than host (1) or CUDA (2).
    #[error("descriptor memory kind {0} is unknown (expected 1 for host or 2 for CUDA)")]
    Kind(u8),
}

impl Descriptor {
    /// Format version written by [`Descriptor::to_bytes`].
    pub const VERSION: u8 = 1;
    /// Bytes in the encoded form.
    pub const BYTES: usize = 26;

    /// A descriptor of region `region_id` (`len` bytes of `kind` memory) guarded by `key`.
    /// Only the advertising endpoint makes them (with a random key); a peer decodes the
    /// bytes it was handed.
    pub fn new(region_id: u64, len: u64, kind: MemoryKind, key: u64) -> Self {
        Self {
            region_id,
            len,
            kind,
            key,
        }
    }

    /// The advertising endpoint's id of the region.
    pub fn region_id(&self) -> u64 {
        self.region_id
    }

    /// Bytes in the region.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True for an empty region (never advertised: registration refuses empty memory).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Host or CUDA memory.
    pub fn kind(&self) -> MemoryKind {
        self.kind
    }

    /// The access key every request naming this region must carry.
    pub fn key(&self) -> u64 {
        self.key
    }

    /// The fixed 26-byte encoding (see the module docs).
    pub fn to_bytes(&self) -> [u8; Self::BYTES] {
        let mut out = [0u8; Self::BYTES];
        out[0] = Self::VERSION;
        out[1..9].copy_from_slice(&self.region_id.to_le_bytes());
        out[9..17].copy_from_slice(&self.len.to_le_bytes());
        out[17] = kind_code(self.kind);
        out[18..26].copy_from_slice(&self.key.to_le_bytes());
        out
    }

    /// Decodes [`Descriptor::to_bytes`]' output; anything else is an error, never a panic.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, DescriptorError> {
        let bytes: &[u8; Self::BYTES] = bytes.try_into().map_err(|_| DescriptorError::Length {
            expected: Self::BYTES,
            got: bytes.len(),
        })?;
        if bytes[0] != Self::VERSION {
            return Err(DescriptorError::Version(bytes[0]));
        }
        let u64_at = |at: usize| {
            let mut word = [0u8; 8];
            word.copy_from_slice(&bytes[at..at + 8]);
            u64::from_le_bytes(word)
        };
        let kind = match bytes[17] {
            1 => MemoryKind::Host,
            2 => MemoryKind::Cuda,
            other => return Err(DescriptorError::Kind(other)),
        };
        Ok(Self {
            region_id: u64_at(1),
            len: u64_at(9),
            kind,
            key: u64_at(18),
        })
    }
}

fn kind_code(kind: MemoryKind) -> u8 {
    match kind {
        MemoryKind::Host => 1,
        MemoryKind::Cuda => 2,
    }
}

/// `len` bytes at `offset` in the peer's region named by `descriptor`: one entry of the
/// remote list of a one-sided operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteSegment {
    /// The advertised region.
    pub descriptor: Descriptor,
    /// Offset in the region.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

impl RemoteSegment {
    /// `len` bytes at `offset` in the region `descriptor` names.
    pub fn new(descriptor: Descriptor, offset: u64, len: u64) -> Self {
        Self {
            descriptor,
            offset,
            len,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip_and_damage_is_refused() {
        let d = Descriptor::new(42, 1 << 20, MemoryKind::Cuda, 0xDEAD_BEEF_0123_4567);
        let bytes = d.to_bytes();
        assert_eq!(Descriptor::from_bytes(&bytes).unwrap(), d);
        assert!(matches!(
            Descriptor::from_bytes(&bytes[..25]),
            Err(DescriptorError::Length { got: 25, .. })
        ));
        let mut bad = bytes;
        bad[0] = 2;
        assert_eq!(
            Descriptor::from_bytes(&bad),
            Err(DescriptorError::Version(2))
        );
        let mut bad = bytes;
        bad[17] = 9;
        assert_eq!(Descriptor::from_bytes(&bad), Err(DescriptorError::Kind(9)));
    }
}
