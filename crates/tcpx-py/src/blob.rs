//! The byte formats that `tcpx.p2p` shares with UCCL scripts.
//!
//! **Endpoint metadata** (UCCL's layout today, `get_metadata`): the IPv4 address (4 bytes)
//! or IPv6 address (16), the control port (2 bytes, network order), the length of the GPU's
//! PCI bus id (1 byte) and the bus id (`0000:8a:00.0`; empty without a GPU). Older UCCL (and
//! older tcpx) wrote the GPU index instead (4 bytes, host order, `-1` for none: 10 or 22
//! bytes in all); [`parse_uccl_metadata`] reads both.
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

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use tcpx_runtime::Descriptor;

use crate::checksum::fnv1a;
use crate::descs::RemoteRange;
use crate::errors::{Failure, Outcome};

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
    pub fn decode(bytes: &[u8]) -> Outcome<Self> {
        let bytes: &[u8; ADVERT_BYTES] = bytes.try_into().map_err(|_| {
            Failure::bad(format!(
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
            return Err(Failure::bad(
                "not a tcpx advertisement blob (magic or version differs): pass the bytes \
                 advertise() returned on the peer",
            ));
        }
        if fnv1a(&bytes[..56]) != u64_at(56) {
            return Err(Failure::bad(
                "advertisement blob is corrupted (its checksum does not match)",
            ));
        }
        let descriptor = Descriptor::from_bytes(&bytes[24..50])
            .map_err(|e| Failure::bad(format!("advertisement blob: {e}")))?;
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
            return Err(Failure::bad(format!(
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

/// UCCL's endpoint metadata for `addr` and the GPU with PCI bus id `gpu_bus` ("" for none;
/// longer than 255 bytes is cut, which no bus id is).
pub fn uccl_metadata(addr: SocketAddr, gpu_bus: &str) -> Vec<u8> {
    let mut out = match addr.ip() {
        IpAddr::V4(ip) => ip.octets().to_vec(),
        IpAddr::V6(ip) => ip.octets().to_vec(),
    };
    out.extend_from_slice(&addr.port().to_be_bytes());
    let bus = &gpu_bus.as_bytes()[..gpu_bus.len().min(255)];
    out.push(bus.len() as u8);
    out.extend_from_slice(bus);
    out
}

/// Parses UCCL's endpoint metadata into (address, GPU): the PCI bus id in today's layout
/// ("" when the peer has no GPU), the GPU index in decimal in the older 10/22-byte one.
pub fn parse_uccl_metadata(bytes: &[u8]) -> Outcome<(SocketAddr, String)> {
    if let Some(found) = parse_with_bus(bytes) {
        return Ok(found);
    }
    let (ip, rest): (IpAddr, &[u8]) = match bytes.len() {
        10 => (IpAddr::V4(Ipv4Addr::from(take::<4>(bytes))), &bytes[4..]),
        22 => (IpAddr::V6(Ipv6Addr::from(take::<16>(bytes))), &bytes[16..]),
        n => {
            return Err(Failure::bad(format!(
                "endpoint metadata of {n} bytes: expected an IP address (4 or 16 bytes), a \
                 port (2), the GPU bus id's length (1) and the bus id"
            )))
        }
    };
    let port = u16::from_be_bytes([rest[0], rest[1]]);
    let gpu = i32::from_ne_bytes([rest[2], rest[3], rest[4], rest[5]]);
    Ok((SocketAddr::new(ip, port), gpu.to_string()))
}

/// The first `N` bytes (the caller checked the length).
fn take<const N: usize>(bytes: &[u8]) -> [u8; N] {
    let mut out = [0u8; N];
    out.copy_from_slice(&bytes[..N]);
    out
}

/// Today's layout, when `bytes` is one: the length byte matches for IPv4 (else IPv6, as UCCL
/// decides) and the bus id is empty or a bus id (so an older 10-byte blob whose GPU index
/// happens to fit the length rule is not misread).
fn parse_with_bus(bytes: &[u8]) -> Option<(SocketAddr, String)> {
    let v4 = bytes.len() >= 7 && bytes.len() == 7 + bytes[6] as usize;
    let (ip, rest): (IpAddr, &[u8]) = if v4 {
        (IpAddr::V4(Ipv4Addr::from(take::<4>(bytes))), &bytes[4..])
    } else if bytes.len() >= 19 && bytes.len() == 19 + bytes[18] as usize {
        (IpAddr::V6(Ipv6Addr::from(take::<16>(bytes))), &bytes[16..])
    } else {
        return None;
    };
    let port = u16::from_be_bytes([rest[0], rest[1]]);
    let bus = std::str::from_utf8(&rest[3..]).ok()?;
    if !bus.is_empty() && tcpx_runtime::ipc::normalize_bus_id(bus).is_none() {
        return None;
    }
    Some((SocketAddr::new(ip, port), bus.to_owned()))
}
