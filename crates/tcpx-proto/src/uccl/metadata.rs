//! UCCL's endpoint metadata (`get_metadata` / `parse_metadata`): the IPv4 address (4 bytes)
//! or IPv6 address (16), the control port (2 bytes, network order), the length of the GPU's
//! PCI bus id (1 byte) and the bus id (`0000:8a:00.0`; empty without a GPU). Older UCCL (and
//! older tcpx) wrote the GPU index instead (4 bytes, host order, `-1` for none: 10 or 22
//! bytes in all); [`parse_uccl_metadata`] reads both.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// Bytes that are UCCL metadata in neither layout.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct MetadataError(pub String);

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
pub fn parse_uccl_metadata(bytes: &[u8]) -> Result<(SocketAddr, String), MetadataError> {
    if let Some(found) = parse_with_bus(bytes) {
        return Ok(found);
    }
    let (ip, rest): (IpAddr, &[u8]) = match bytes.len() {
        10 => (IpAddr::V4(Ipv4Addr::from(take::<4>(bytes))), &bytes[4..]),
        22 => (IpAddr::V6(Ipv6Addr::from(take::<16>(bytes))), &bytes[16..]),
        n => {
            return Err(MetadataError(format!(
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
    if !bus.is_empty() && crate::bus_id::normalize_bus_id(bus).is_none() {
        return None;
    }
    Some((SocketAddr::new(ip, port), bus.to_owned()))
}
