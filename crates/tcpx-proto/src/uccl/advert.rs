//! The 64-byte advertisement blob of `tcpx.p2p`'s `advertise` (the size of UCCL's serialized
//! `FifoItem`).
//!
//! **Advertisement blob** (`advertise`): 64 bytes, the size of UCCL's serialized `FifoItem`,
//! so scripts that ship it as a 64-byte tensor work unchanged. Little-endian:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 8 | address the advertiser passed (`ptr`, informational, like `FifoItem.addr`) |
//! | 8 | 8 | bytes advertised (`size`) |
//! | 16 | 8 | offset of `ptr` in the advertised registration |
//! | 24 | 26 | the runtime's [`Descriptor`] of the registration (id, length, kind, key) |
//! | 50 | 4 | magic `TXAB` |
//! | 54 | 2 | format version (1) |
//! | 56 | 8 | FNV-1a hash of bytes 0..56 (catches truncated or corrupted blobs) |
//!
//! The key inside the descriptor is what grants access; the hash only turns garbage into a
//! clear error before anything reaches the peer. As with an RDMA rkey, the key opens the whole
//! registration: the peer checks every access against it, not against `size`.

use crate::checksum::fnv1a;
use crate::onesided::Descriptor;
use crate::uccl::descs::RemoteRange;

/// Bytes that are not an advertisement blob: what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct AdvertError(pub String);

impl AdvertError {
    fn new(message: impl Into<String>) -> Self {
        Self(message.into())
    }
}

/// Bytes in an advertisement blob.
pub const ADVERT_BYTES: usize = 64;
const MAGIC: &[u8; 4] = b"TXAB";
const VERSION: u16 = 1;

/// A decoded advertisement: `len` bytes at `offset` in the registration `descriptor` names.
#[derive(Debug, Clone, Copy)]
pub struct Advert {
    /// The advertiser's pointer.
    pub addr: u64,
    /// Bytes advertised.
    pub len: u64,
    /// Offset of `addr` in the registration.
    pub offset: u64,
    /// The registration.
    pub descriptor: Descriptor,
}

impl Advert {
    /// The 64-byte form.
    pub fn encode(&self) -> [u8; ADVERT_BYTES] {
        let mut out = [0u8; ADVERT_BYTES];
        out[0..8].copy_from_slice(&self.addr.to_le_bytes());
        out[8..16].copy_from_slice(&self.len.to_le_bytes());
        out[16..24].copy_from_slice(&self.offset.to_le_bytes());
        out[24..50].copy_from_slice(&self.descriptor.to_bytes());
        out[50..54].copy_from_slice(MAGIC);
        out[54..56].copy_from_slice(&VERSION.to_le_bytes());
        let hash = fnv1a(&out[..56]);
        out[56..64].copy_from_slice(&hash.to_le_bytes());
        out
    }

    /// Decodes [`Advert::encode`]'s output; anything else is a bad argument naming what is
    /// wrong, never a panic.
    pub fn decode(bytes: &[u8]) -> Result<Self, AdvertError> {
        let bytes: &[u8; ADVERT_BYTES] = bytes.try_into().map_err(|_| {
            AdvertError::new(format!(
                "an advertisement blob is {ADVERT_BYTES} bytes (from advertise/advertisev), got {}",
                bytes.len()
            ))
        })?;
        let u64_at = |at: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&bytes[at..at + 8]);
            u64::from_le_bytes(w)
        };
        if &bytes[50..54] != MAGIC || bytes[54..56] != VERSION.to_le_bytes() {
            return Err(AdvertError::new(
                "not a tcpx advertisement blob (magic or version differs): pass the bytes \
                 advertise() returned on the peer",
            ));
        }
        if fnv1a(&bytes[..56]) != u64_at(56) {
            return Err(AdvertError::new(
                "advertisement blob is corrupted (its checksum does not match)",
            ));
        }
        let descriptor = Descriptor::from_bytes(&bytes[24..50])
            .map_err(|e| AdvertError::new(format!("advertisement blob: {e}")))?;
        let advert = Self {
            addr: u64_at(0),
            len: u64_at(8),
            offset: u64_at(16),
            descriptor,
        };
        if advert
            .offset
            .checked_add(advert.len)
            .is_none_or(|end| end > descriptor.len())
        {
            return Err(AdvertError::new(format!(
                "advertisement blob: {} bytes at offset {} lie outside the {}-byte registration",
                advert.len,
                advert.offset,
                descriptor.len()
            )));
        }
        Ok(advert)
    }

    /// The advertised bytes as a range of the registration.
    pub fn range(&self) -> RemoteRange {
        RemoteRange {
            descriptor: self.descriptor,
            offset: self.offset,
            len: self.len,
        }
    }
}
