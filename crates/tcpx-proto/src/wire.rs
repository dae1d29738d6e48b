//! Little-endian primitives shared by the control messages and the metadata blob.
//!
//! Every read is bounds-checked and every variable-length field is length-prefixed, so a
//! decoder never trusts a length it has not checked against the bytes actually present.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// A field could not be read from a payload.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The payload ended inside a field.
    #[error("payload ends inside `{field}` (needs {needed} more bytes, {available} left)")]
    Truncated {
        /// The field being read.
        field: &'static str,
        /// Bytes the field needs.
        needed: usize,
        /// Bytes that were left.
        available: usize,
    },
    /// A string field was not UTF-8.
    #[error("`{field}` is not valid UTF-8")]
    InvalidUtf8 {
        /// The field being read.
        field: &'static str,
    },
    /// An address family tag other than 4 or 6.
    #[error("`{field}` has address family tag {tag}; expected 4 or 6")]
    BadAddressFamily {
        /// The field being read.
        field: &'static str,
        /// The tag found.
        tag: u8,
    },
    /// A field held a value outside its allowed range.
    #[error("`{field}` is invalid: {why}")]
    Invalid {
        /// The field being read.
        field: &'static str,
        /// What was wrong.
        why: &'static str,
    },
    /// Bytes were left after the last field.
    #[error("{0} unexpected bytes after the last field")]
    TrailingBytes(usize),
}

/// A value is too large for its length prefix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{field}` is {len} long; the wire format allows at most {max}")]
pub struct TooLong {
    /// The field being written.
    pub field: &'static str,
    /// Its length (bytes or items).
    pub len: usize,
    /// The most the format allows.
    pub max: usize,
}

/// Appends little-endian fields to a buffer.
pub struct Writer<'a>(pub &'a mut Vec<u8>);

impl Writer<'_> {
    /// One byte.
    pub fn u8(&mut self, v: u8) {
        self.0.push(v);
    }

    /// A u16, little-endian.
    pub fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }

    /// A u32, little-endian.
    pub fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }

    /// A u64, little-endian.
    pub fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }

    /// Raw bytes, no length prefix.
    pub fn bytes(&mut self, v: &[u8]) {
        self.0.extend_from_slice(v);
    }

    /// A string with a u16 byte-length prefix.
    pub fn str16(&mut self, field: &'static str, v: &str) -> Result<(), TooLong> {
        let len = u16::try_from(v.len()).map_err(|_| TooLong {
            field,
            len: v.len(),
            max: usize::from(u16::MAX),
        })?;
        self.u16(len);
        self.bytes(v.as_bytes());
        Ok(())
    }

    /// An IP address: family tag (4 or 6) then the address bytes.
    pub fn ip(&mut self, ip: IpAddr) {
        match ip {
            IpAddr::V4(v4) => {
                self.u8(4);
                self.bytes(&v4.octets());
            }
            IpAddr::V6(v6) => {
                self.u8(6);
                self.bytes(&v6.octets());
            }
        }
    }

    /// An IP address then a u16 port.
    pub fn socket_addr(&mut self, addr: SocketAddr) {
        self.ip(addr.ip());
        self.u16(addr.port());
    }
}

/// Reads little-endian fields from a payload, never past its end.
pub struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    /// A reader over `buf` (a whole payload).
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf }
    }

    /// Bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.buf.len()
    }

    /// The next `n` bytes, or [`WireError::Truncated`] naming `field`.
    pub fn take(&mut self, field: &'static str, n: usize) -> Result<&'a [u8], WireError> {
        if n > self.buf.len() {
            return Err(WireError::Truncated {
                field,
                needed: n,
                available: self.buf.len(),
            });
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    /// The next `N` bytes as an array.
    pub fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], WireError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(field, N)?);
        Ok(out)
    }

    /// One byte.
    pub fn u8(&mut self, field: &'static str) -> Result<u8, WireError> {
        Ok(self.array::<1>(field)?[0])
    }

    /// A little-endian u16.
    pub fn u16(&mut self, field: &'static str) -> Result<u16, WireError> {
        self.array(field).map(u16::from_le_bytes)
    }

    /// A little-endian u32.
    pub fn u32(&mut self, field: &'static str) -> Result<u32, WireError> {
        self.array(field).map(u32::from_le_bytes)
    }

    /// A little-endian u64.
    pub fn u64(&mut self, field: &'static str) -> Result<u64, WireError> {
        self.array(field).map(u64::from_le_bytes)
    }

    /// A string with a u16 byte-length prefix.
    pub fn str16(&mut self, field: &'static str) -> Result<String, WireError> {
        let len = usize::from(self.u16(field)?);
        let bytes = self.take(field, len)?;
        std::str::from_utf8(bytes)
            .map(str::to_owned)
            .map_err(|_| WireError::InvalidUtf8 { field })
    }

    /// An IP address as [`Writer::ip`] writes it.
    pub fn ip(&mut self, field: &'static str) -> Result<IpAddr, WireError> {
        match self.u8(field)? {
            4 => Ok(IpAddr::V4(Ipv4Addr::from(self.array::<4>(field)?))),
            6 => Ok(IpAddr::V6(Ipv6Addr::from(self.array::<16>(field)?))),
            tag => Err(WireError::BadAddressFamily { field, tag }),
        }
    }

    /// An IP address then a u16 port, as [`Writer::socket_addr`] writes them.
    pub fn socket_addr(&mut self, field: &'static str) -> Result<SocketAddr, WireError> {
        let ip = self.ip(field)?;
        let port = self.u16(field)?;
        Ok(SocketAddr::new(ip, port))
    }

    /// Fails unless every byte was read.
    pub fn finish(self) -> Result<(), WireError> {
        match self.buf.len() {
            0 => Ok(()),
            n => Err(WireError::TrailingBytes(n)),
        }
    }
}

/// A u16-prefixed string of at most `max` bytes (longer is [`WireError::Invalid`]).
pub fn read_bounded(
    r: &mut Reader<'_>,
    field: &'static str,
    max: usize,
) -> Result<String, WireError> {
    let s = r.str16(field)?;
    if s.len() > max {
        return Err(WireError::Invalid {
            field,
            why: "longer than the format allows",
        });
    }
    Ok(s)
}
