//! [`IpcDescriptor`]: what a process of the same host needs to reach advertised GPU memory
//! through CUDA IPC, in a fixed 128-byte form.
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `b"TXIP"` |
//! | 4 | 1 | format version, [`IpcDescriptor::VERSION`] |
//! | 5 | 3 | reserved, zero |
//! | 8 | 64 | CUDA IPC handle of the allocation holding the range |
//! | 72 | 8 | owner: the advertising endpoint's instance id (u64) |
//! | 80 | 4 | owner's process id (u32) |
//! | 84 | 4 | reserved, zero |
//! | 88 | 8 | allocation base in the owner's address space (same-process use only) |
//! | 96 | 8 | allocation size (u64) |
//! | 104 | 8 | offset of the range in the allocation (u64) |
//! | 112 | 8 | length of the range (u64, > 0) |
//! | 120 | 8 | access key (u64) |
//!
//! Integers are little-endian. The decoder takes any bytes and answers a descriptor or an
//! error naming what is wrong; it never panics. Decoding proves nothing about the handle:
//! the owner confirms key, handle and range before the first use on a connection, and the
//! driver refuses a forged handle.

use super::{IpcMemHandle, IPC_HANDLE_BYTES};

/// A range of GPU memory advertised for same-host access (the runtime's
/// `Endpoint::advertise_ipc`); hand [`to_bytes`](Self::to_bytes) to the peer out of band,
/// which names it in the runtime's `LocalConnection::write_ipc` and its kin.
///
/// The fields are public for the advertising endpoint, which builds it; a peer's bytes go
/// through [`from_bytes`](Self::from_bytes), which checks them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcDescriptor {
    /// The CUDA IPC handle of the allocation holding the range.
    pub handle: IpcMemHandle,
    /// The advertising endpoint's instance id.
    pub owner: u64,
    /// The advertising process.
    pub owner_pid: u32,
    /// The allocation's base in the owner's address space.
    pub base: u64,
    /// The allocation's size.
    pub alloc_len: u64,
    /// The range's offset in the allocation.
    pub offset: u64,
    /// The range's length (> 0).
    pub len: u64,
    /// The access key the owner checks.
    pub key: u64,
}

/// Bytes that cannot be an [`IpcDescriptor`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IpcDescriptorError {
    /// Not [`IpcDescriptor::BYTES`] long.
    #[error("an IPC descriptor is {expected} bytes, got {got}")]
    Length {
        /// Bytes a descriptor has.
        expected: usize,
        /// Bytes given.
        got: usize,
    },
    /// The bytes do not start with `TXIP`: not an IPC descriptor (perhaps a network one).
    #[error("not an IPC descriptor (magic {0:02x?}, expected \"TXIP\")")]
    Magic([u8; 4]),
    /// A format version this side does not read.
    #[error("IPC descriptor format version {0} is not supported (this side reads version 1)")]
    Version(u8),
    /// A reserved field is not zero.
    #[error("IPC descriptor reserved bytes are not zero")]
    Reserved,
    /// The range is empty.
    #[error("IPC descriptor names an empty range")]
    Empty,
    /// The range does not lie inside the allocation.
    #[error(
        "IPC descriptor range {offset}+{len} lies outside its allocation of {alloc_len} bytes"
    )]
    Range {
        /// Offset in the allocation.
        offset: u64,
        /// Length.
        len: u64,
        /// Allocation size.
        alloc_len: u64,
    },
}

impl IpcDescriptor {
    /// Format version written by [`to_bytes`](Self::to_bytes).
    pub const VERSION: u8 = 1;
    /// Bytes in the encoded form.
    pub const BYTES: usize = 128;
    const MAGIC: [u8; 4] = *b"TXIP";

    /// Bytes in the advertised range.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Never true for a decoded or advertised descriptor (empty ranges are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The access key the owner checks.
    pub fn key(&self) -> u64 {
        self.key
    }

    /// The instance id of the advertising endpoint (its `LocalInfo::instance`).
    pub fn owner(&self) -> u64 {
        self.owner
    }

    /// The advertising process.
    pub fn owner_pid(&self) -> u32 {
        self.owner_pid
    }

    /// The CUDA IPC handle of the allocation holding the range.
    pub fn handle(&self) -> &IpcMemHandle {
        &self.handle
    }

    /// Offset of the range in its allocation.
    pub fn allocation_offset(&self) -> u64 {
        self.offset
    }

    /// Where the range starts in the owner's address space (the allocation's base plus
    /// [`allocation_offset`](Self::allocation_offset)): lets a peer address a sub-range by
    /// the owner's pointers (UCCL descriptors carry them).
    pub fn address(&self) -> u64 {
        self.base.wrapping_add(self.offset)
    }

    /// Size of the allocation holding the range.
    pub fn allocation_len(&self) -> u64 {
        self.alloc_len
    }

    /// The fixed 128-byte encoding (see the module docs).
    pub fn to_bytes(&self) -> [u8; Self::BYTES] {
        let mut out = [0u8; Self::BYTES];
        out[0..4].copy_from_slice(&Self::MAGIC);
        out[4] = Self::VERSION;
        out[8..72].copy_from_slice(self.handle.as_bytes());
        out[72..80].copy_from_slice(&self.owner.to_le_bytes());
        out[80..84].copy_from_slice(&self.owner_pid.to_le_bytes());
        out[88..96].copy_from_slice(&self.base.to_le_bytes());
        out[96..104].copy_from_slice(&self.alloc_len.to_le_bytes());
        out[104..112].copy_from_slice(&self.offset.to_le_bytes());
        out[112..120].copy_from_slice(&self.len.to_le_bytes());
        out[120..128].copy_from_slice(&self.key.to_le_bytes());
        out
    }

    /// Decodes [`to_bytes`](Self::to_bytes)' output; anything else is an error, never a panic.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, IpcDescriptorError> {
        let bytes: &[u8; Self::BYTES] =
            bytes.try_into().map_err(|_| IpcDescriptorError::Length {
                expected: Self::BYTES,
                got: bytes.len(),
            })?;
        let magic = [bytes[0], bytes[1], bytes[2], bytes[3]];
        if magic != Self::MAGIC {
            return Err(IpcDescriptorError::Magic(magic));
        }
        if bytes[4] != Self::VERSION {
            return Err(IpcDescriptorError::Version(bytes[4]));
        }
        if bytes[5..8].iter().chain(&bytes[84..88]).any(|&b| b != 0) {
            return Err(IpcDescriptorError::Reserved);
        }
        let u64_at = |at: usize| {
            let mut word = [0u8; 8];
            word.copy_from_slice(&bytes[at..at + 8]);
            u64::from_le_bytes(word)
        };
        let mut handle = [0u8; IPC_HANDLE_BYTES];
        handle.copy_from_slice(&bytes[8..72]);
        let d = Self {
            handle: IpcMemHandle::from_bytes(handle),
            owner: u64_at(72),
            owner_pid: u32::from_le_bytes([bytes[80], bytes[81], bytes[82], bytes[83]]),
            base: u64_at(88),
            alloc_len: u64_at(96),
            offset: u64_at(104),
            len: u64_at(112),
            key: u64_at(120),
        };
        if d.len == 0 {
            return Err(IpcDescriptorError::Empty);
        }
        if d.offset
            .checked_add(d.len)
            .is_none_or(|end| end > d.alloc_len)
        {
            return Err(IpcDescriptorError::Range {
                offset: d.offset,
                len: d.len,
                alloc_len: d.alloc_len,
            });
        }
        Ok(d)
    }

    /// Decodes a list of blobs, each run of equal blobs once: a KV list names one or a few
    /// advertised ranges block after block, and a 128-byte compare is far cheaper than a
    /// decode and its checks. Returns the distinct decodings and, per blob, the index of its
    /// decoding; or the index of the first blob that does not decode, with why.
    pub fn decode_runs<'a>(
        blobs: impl IntoIterator<Item = &'a [u8]>,
    ) -> Result<(Vec<Self>, Vec<usize>), (usize, IpcDescriptorError)> {
        let mut decoded = Vec::new();
        let mut which = Vec::new();
        let mut previous: Option<&[u8]> = None;
        for (i, blob) in blobs.into_iter().enumerate() {
            if previous != Some(blob) {
                decoded.push(Self::from_bytes(blob).map_err(|e| (i, e))?);
                previous = Some(blob);
            }
            which.push(decoded.len() - 1);
        }
        Ok((decoded, which))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_of_equal_blobs_decode_once_and_a_bad_blob_is_named_by_index() {
        let a = sample(1);
        let (a_bytes, b_bytes) = (a.to_bytes(), sample(2).to_bytes());
        let list: [&[u8]; 4] = [&b_bytes, &b_bytes, &a_bytes, &b_bytes];
        let (decoded, which) = IpcDescriptor::decode_runs(list).unwrap();
        assert_eq!(which, vec![0, 0, 1, 2]);
        assert_eq!(decoded.len(), 3);
        assert_eq!(decoded[1], a);
        assert_eq!(decoded[0], decoded[2]);
        let short: [&[u8]; 3] = [&b_bytes, &b_bytes, &b_bytes[..10]];
        let (at, _) = IpcDescriptor::decode_runs(short).unwrap_err();
        assert_eq!(at, 2);
    }
    use proptest::prelude::*;

    pub(crate) fn sample(key: u64) -> IpcDescriptor {
        IpcDescriptor {
            handle: IpcMemHandle::from_bytes([0x5a; IPC_HANDLE_BYTES]),
            owner: 77,
            owner_pid: 4242,
            base: 0x7f00_0000_0000,
            alloc_len: 2 << 20,
            offset: 4096,
            len: 1 << 20,
            key,
        }
    }

    #[test]
    fn round_trip_and_each_kind_of_damage() {
        let d = sample(9);
        let bytes = d.to_bytes();
        assert_eq!(IpcDescriptor::from_bytes(&bytes).unwrap(), d);
        assert!(matches!(
            IpcDescriptor::from_bytes(&bytes[..127]),
            Err(IpcDescriptorError::Length { got: 127, .. })
        ));
        let mut bad = bytes;
        bad[0] = b'X';
        assert!(matches!(
            IpcDescriptor::from_bytes(&bad),
            Err(IpcDescriptorError::Magic(_))
        ));
        let mut bad = bytes;
        bad[4] = 2;
        assert_eq!(
            IpcDescriptor::from_bytes(&bad),
            Err(IpcDescriptorError::Version(2))
        );
        let mut bad = bytes;
        bad[86] = 1;
        assert_eq!(
            IpcDescriptor::from_bytes(&bad),
            Err(IpcDescriptorError::Reserved)
        );
        let mut empty = d;
        empty.len = 0;
        assert_eq!(
            IpcDescriptor::from_bytes(&empty.to_bytes()),
            Err(IpcDescriptorError::Empty)
        );
        let mut outside = d;
        outside.offset = u64::MAX;
        assert!(matches!(
            IpcDescriptor::from_bytes(&outside.to_bytes()),
            Err(IpcDescriptorError::Range { .. })
        ));
        // A network descriptor (26 bytes) is told apart by its length.
        assert!(IpcDescriptor::from_bytes(&[1u8; 26]).is_err());
    }

    fn any_descriptor() -> impl Strategy<Value = IpcDescriptor> {
        (
            any::<[u8; 32]>(),
            any::<u64>(),
            any::<u32>(),
            any::<u64>(),
            1u64..u64::MAX / 2,
            any::<u64>(),
        )
            .prop_flat_map(|(h, owner, pid, base, alloc_len, key)| {
                (0..alloc_len).prop_flat_map(move |offset| {
                    (1..=alloc_len - offset).prop_map(move |len| {
                        let mut handle = [0u8; IPC_HANDLE_BYTES];
                        handle[..32].copy_from_slice(&h);
                        handle[32..].copy_from_slice(&h);
                        IpcDescriptor {
                            handle: IpcMemHandle::from_bytes(handle),
                            owner,
                            owner_pid: pid,
                            base,
                            alloc_len,
                            offset,
                            len,
                            key,
                        }
                    })
                })
            })
    }

    proptest! {
        /// Any bytes at all: a descriptor or an error, never a panic.
        #[test]
        fn any_bytes_decode_or_fail(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = IpcDescriptor::from_bytes(&bytes);
        }

        /// Valid framing with random fields: decoding succeeds exactly when the range fits.
        #[test]
        fn random_fields_behind_a_valid_header(mut body in any::<[u8; 128]>()) {
            body[0..4].copy_from_slice(b"TXIP");
            body[4] = 1;
            body[5..8].fill(0);
            body[84..88].fill(0);
            if let Ok(d) = IpcDescriptor::from_bytes(&body) {
                prop_assert!(d.len > 0 && d.offset + d.len <= d.alloc_len);
                prop_assert_eq!(d.to_bytes(), body);
            }
        }

        #[test]
        fn every_valid_descriptor_round_trips(d in any_descriptor()) {
            prop_assert_eq!(IpcDescriptor::from_bytes(&d.to_bytes()).unwrap(), d);
        }
    }
}
