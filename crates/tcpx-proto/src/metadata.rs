//! The endpoint metadata blob an application passes out of band (e.g. through its own RPC or
//! a key-value store) so that a peer can find this endpoint's control listener.
//!
//! Layout (little-endian), at most [`MAX_METADATA_BYTES`]:
//!
//! | size | field |
//! |---|---|
//! | 4 | magic `b"TXMD"` |
//! | 1 | format version, [`METADATA_VERSION`] |
//! | … | [`EndpointInfo`], encoded as in `Hello` |
//! | 1 + 4/16 + 2 | control listener address: family tag, ip, port |
//! | 16 | the endpoint's [`Secret`], presented back by peers that connect with this blob |
//! | 4 | CRC-32 (IEEE) of all preceding bytes |
//!
//! Format version 2 added `gpu_index` (inside `EndpointInfo`) and the secret, version 4
//! `eager_bytes`, version 5 `spread_two_sided` (both inside `EndpointInfo`). Whoever holds
//! the blob can connect to an endpoint that requires the secret: share it like a password.
//!
//! The checksum catches blobs damaged in copy-paste or truncated by a transport; the text
//! form is lowercase hex.

use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;

use crate::control::message::{EndpointInfo, Secret};
use crate::wire::{Reader, TooLong, WireError, Writer};

/// First four bytes of a metadata blob.
pub const METADATA_MAGIC: [u8; 4] = *b"TXMD";

/// Format version of the blob.
pub const METADATA_VERSION: u8 = 5;

/// Largest blob accepted or produced, in bytes (hex text is twice as long).
pub const MAX_METADATA_BYTES: usize = 4096;

/// A metadata blob could not be produced or parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MetadataError {
    /// The blob is larger than [`MAX_METADATA_BYTES`].
    #[error("endpoint metadata is {len} bytes; at most {MAX_METADATA_BYTES} are allowed")]
    TooLong {
        /// Its length in bytes.
        len: usize,
    },
    /// A field is too long for its length prefix.
    #[error("endpoint metadata cannot be encoded: {0}")]
    FieldTooLong(#[from] TooLong),
    /// The text is not hex.
    #[error("endpoint metadata is not hex: unexpected character at position {position}")]
    NotHex {
        /// Byte position of the first bad character.
        position: usize,
    },
    /// The hex text has an odd number of digits.
    #[error("endpoint metadata hex has an odd number of digits ({0})")]
    OddLength(usize),
    /// The blob does not start with [`METADATA_MAGIC`].
    #[error("not tcpx endpoint metadata (bad magic)")]
    BadMagic,
    /// A format version this side does not read.
    #[error("endpoint metadata format version {0} is not supported (this side reads version {METADATA_VERSION})")]
    UnsupportedVersion(u8),
    /// The checksum does not match: the blob was damaged or truncated.
    #[error("endpoint metadata checksum mismatch (stored {stored:#010x}, computed {computed:#010x}): the blob was damaged or truncated")]
    Checksum {
        /// The checksum in the blob.
        stored: u32,
        /// The checksum of the bytes received.
        computed: u32,
    },
    /// A field is malformed.
    #[error("endpoint metadata is malformed: {0}")]
    Field(#[from] WireError),
}

/// What a peer needs to reach an endpoint: its description and its control listener.
///
/// ```
/// use std::net::{IpAddr, Ipv4Addr, SocketAddr};
/// use tcpx_proto::control::message::{EndpointInfo, Secret};
/// use tcpx_proto::metadata::EndpointMetadata;
///
/// let meta = EndpointMetadata {
///     info: EndpointInfo {
///         ip: IpAddr::V4(Ipv4Addr::new(10, 0, 0, 7)),
///         gpu_pci: Some("0000:04:00.0".into()),
///         channels: 4,
///         plugin_name: "GPUDirectTCPX_v7".into(),
///         abi_version: 7,
///         chunk_bytes: 512 << 10,
///         gpu_index: Some(0),
///         spread: 4,
///         eager_bytes: 4096,
///         spread_two_sided: true,
///     },
///     control_addr: SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 7)), 7400),
///     secret: Secret::from_bytes([7; 16]),
/// };
/// let text = meta.to_hex().unwrap();
/// assert_eq!(text.parse::<EndpointMetadata>().unwrap(), meta);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointMetadata {
    /// The endpoint's description.
    pub info: EndpointInfo,
    /// Where its control listener accepts connections.
    pub control_addr: SocketAddr,
    /// The endpoint's secret: the runtime's `Endpoint::connect` presents it,
    /// and an endpoint with `Config::require_secret` refuses peers that do
    /// not.
    pub secret: Secret,
}

impl EndpointMetadata {
    /// The binary blob.
    pub fn to_bytes(&self) -> Result<Vec<u8>, MetadataError> {
        let mut out = Vec::with_capacity(64);
        let mut w = Writer(&mut out);
        w.bytes(&METADATA_MAGIC);
        w.u8(METADATA_VERSION);
        self.info.write(&mut w)?;
        w.socket_addr(self.control_addr);
        self.secret.write(&mut w);
        let crc = crc32(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        if out.len() > MAX_METADATA_BYTES {
            return Err(MetadataError::TooLong { len: out.len() });
        }
        Ok(out)
    }

    /// Parses a binary blob.
    pub fn from_bytes(blob: &[u8]) -> Result<Self, MetadataError> {
        if blob.len() > MAX_METADATA_BYTES {
            return Err(MetadataError::TooLong { len: blob.len() });
        }
        let mut r = Reader::new(blob);
        if r.array::<4>("magic").map_err(|_| MetadataError::BadMagic)? != METADATA_MAGIC {
            return Err(MetadataError::BadMagic);
        }
        let version = r.u8("version")?;
        if version != METADATA_VERSION {
            return Err(MetadataError::UnsupportedVersion(version));
        }
        // Verify the checksum before parsing fields, so damage reads as damage.
        let Some(body_len) = blob.len().checked_sub(4) else {
            return Err(WireError::Truncated {
                field: "checksum",
                needed: 4,
                available: blob.len(),
            }
            .into());
        };
        let (body, tail) = blob.split_at(body_len);
        let mut stored = [0u8; 4];
        stored.copy_from_slice(tail);
        let stored = u32::from_le_bytes(stored);
        let computed = crc32(body);
        if stored != computed {
            return Err(MetadataError::Checksum { stored, computed });
        }
        // Re-read the fields from the body alone (without the checksum).
        let mut r = Reader::new(body);
        r.take("header", 5)?;
        let info = EndpointInfo::read(&mut r)?;
        let control_addr = r.socket_addr("control_addr")?;
        let secret = Secret::read(&mut r, "secret")?;
        r.finish()?;
        Ok(Self {
            info,
            control_addr,
            secret,
        })
    }

    /// The blob as lowercase hex text.
    pub fn to_hex(&self) -> Result<String, MetadataError> {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let bytes = self.to_bytes()?;
        let mut s = String::with_capacity(bytes.len() * 2);
        for b in bytes {
            s.push(char::from(DIGITS[usize::from(b >> 4)]));
            s.push(char::from(DIGITS[usize::from(b & 0xf)]));
        }
        Ok(s)
    }

    /// Parses hex text (either case; surrounding whitespace is ignored).
    pub fn from_hex(text: &str) -> Result<Self, MetadataError> {
        let text = text.trim();
        if text.len() > 2 * MAX_METADATA_BYTES {
            return Err(MetadataError::TooLong {
                len: text.len() / 2,
            });
        }
        let digits = text.as_bytes();
        if digits.len() % 2 != 0 {
            return Err(MetadataError::OddLength(digits.len()));
        }
        let mut bytes = Vec::with_capacity(digits.len() / 2);
        for (i, pair) in digits.chunks_exact(2).enumerate() {
            let hi = hex_value(pair[0]).ok_or(MetadataError::NotHex { position: 2 * i })?;
            let lo = hex_value(pair[1]).ok_or(MetadataError::NotHex {
                position: 2 * i + 1,
            })?;
            bytes.push(hi << 4 | lo);
        }
        Self::from_bytes(&bytes)
    }
}

impl fmt::Display for EndpointMetadata {
    /// Writes the hex form; fields too long to encode show as `<invalid endpoint metadata>`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.to_hex() {
            Ok(hex) => f.write_str(&hex),
            Err(_) => f.write_str("<invalid endpoint metadata>"),
        }
    }
}

impl FromStr for EndpointMetadata {
    type Err = MetadataError;

    fn from_str(s: &str) -> Result<Self, MetadataError> {
        Self::from_hex(s)
    }
}

fn hex_value(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// CRC-32 (IEEE 802.3, reflected, as zlib computes it). Bitwise: blobs are tiny.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            let mask = (crc & 1).wrapping_neg();
            crc = (crc >> 1) ^ (0xEDB8_8320 & mask);
        }
    }
    !crc
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{IpAddr, Ipv6Addr};

    fn sample() -> EndpointMetadata {
        EndpointMetadata {
            info: EndpointInfo {
                ip: IpAddr::V6(Ipv6Addr::LOCALHOST),
                gpu_pci: None,
                channels: 2,
                plugin_name: "tcpx-socket".into(),
                abi_version: 8,
                chunk_bytes: 1 << 19,
                gpu_index: None,
                spread: 1,
                eager_bytes: 0,
                spread_two_sided: true,
            },
            control_addr: "[::1]:9000".parse().unwrap(),
            secret: Secret::from_bytes([3; crate::control::message::SECRET_BYTES]),
        }
    }

    #[test]
    fn crc32_matches_the_standard_check_value() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
    }

    #[test]
    fn hex_round_trips_and_ignores_whitespace() {
        let meta = sample();
        let hex = format!("  {}\n", meta.to_hex().unwrap().to_uppercase());
        assert_eq!(EndpointMetadata::from_hex(&hex).unwrap(), meta);
    }

    #[test]
    fn damaged_blob_fails_the_checksum() {
        let mut bytes = sample().to_bytes().unwrap();
        bytes[10] ^= 0x40;
        assert!(matches!(
            EndpointMetadata::from_bytes(&bytes),
            Err(MetadataError::Checksum { .. })
        ));
    }

    #[test]
    fn truncated_blob_is_refused() {
        let bytes = sample().to_bytes().unwrap();
        for len in 0..bytes.len() {
            assert!(
                EndpointMetadata::from_bytes(&bytes[..len]).is_err(),
                "{len}"
            );
        }
    }

    #[test]
    fn non_hex_text_names_the_position() {
        assert_eq!(
            EndpointMetadata::from_hex("54xz"),
            Err(MetadataError::NotHex { position: 2 })
        );
        assert_eq!(
            EndpointMetadata::from_hex("545"),
            Err(MetadataError::OddLength(3))
        );
    }
}
