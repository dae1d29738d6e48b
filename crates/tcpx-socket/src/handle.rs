//! The 128-byte connect handle: opaque to callers, exchanged out of band, and reused by
//! `connect` to remember its progress across retries (TCPX keeps its connect state in the
//! handle buffer and callers re-pass the same buffer; we do the same).
//!
//! Layout (little-endian):
//! ```text
//!   0..4    magic "TXSH"
//!   4..6    handle version (HANDLE_VERSION)
//!   6       address family: 4 or 6
//!   7       nsocks: data sockets the listener expects (1..=8)
//!   8..10   listener TCP port
//!  10..12   reserved, zero
//!  12..28   listener address (IPv4 in the first 4 bytes, rest zero)
//!  28..32   IPv6 scope id
//!  32..40   listen nonce (random; proves a data socket was opened from this handle)
//!  40..48   checksum: FNV-1a 64 of bytes 0..40
//!  48..56   connect state id: 0 = no connect in progress, else a key of the plugin's
//!           pending-connect registry (never a pointer: a garbage handle cannot make us
//!           dereference anything)
//!  56..128  zero
//! ```
//! The checksum covers everything a connect trusts, so a corrupted or random handle is refused
//! before any socket is opened.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6};

use tcpx_sys::HANDLE_SIZE;

/// Handle magic.
pub const HANDLE_MAGIC: [u8; 4] = *b"TXSH";
/// Handle layout version.
pub const HANDLE_VERSION: u16 = 1;
const CHECKED_LEN: usize = 40;
const STATE_AT: usize = 48;

/// What a listener publishes in its handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ListenInfo {
    /// Where the listener accepts.
    pub addr: SocketAddr,
    /// Data sockets per connection.
    pub nsocks: u8,
    /// The listen nonce.
    pub nonce: u64,
}

/// Why a handle was refused.
#[allow(clippy::enum_variant_names)] // "Bad…" reads naturally in log lines
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HandleError {
    /// Not a tcpx-socket handle (or another plugin's).
    BadMagic([u8; 4]),
    /// A handle of another layout version.
    BadVersion(u16),
    /// Bytes do not match their checksum: corrupted in transit or storage.
    BadChecksum,
    /// Address family other than 4/6.
    BadFamily(u8),
    /// nsocks outside 1..=8.
    BadNsocks(u8),
    /// Port 0 cannot be connected to.
    BadPort,
}

impl std::fmt::Display for HandleError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HandleError::BadMagic(m) => write!(f, "bad handle magic {m:02x?}"),
            HandleError::BadVersion(v) => {
                write!(f, "handle version {v}, expected {HANDLE_VERSION}")
            }
            HandleError::BadChecksum => write!(f, "handle checksum mismatch (corrupted handle)"),
            HandleError::BadFamily(x) => write!(f, "handle address family {x} is not 4 or 6"),
            HandleError::BadNsocks(n) => write!(f, "handle asks for {n} sockets (1..=8)"),
            HandleError::BadPort => write!(f, "handle port is 0"),
        }
    }
}

impl ListenInfo {
    /// Writes a fresh handle (connect state cleared).
    pub fn encode(&self) -> [u8; HANDLE_SIZE] {
        let mut b = [0u8; HANDLE_SIZE];
        b[0..4].copy_from_slice(&HANDLE_MAGIC);
        b[4..6].copy_from_slice(&HANDLE_VERSION.to_le_bytes());
        b[7] = self.nsocks;
        b[8..10].copy_from_slice(&self.addr.port().to_le_bytes());
        match self.addr {
            SocketAddr::V4(a) => {
                b[6] = 4;
                b[12..16].copy_from_slice(&a.ip().octets());
            }
            SocketAddr::V6(a) => {
                b[6] = 6;
                b[12..28].copy_from_slice(&a.ip().octets());
                b[28..32].copy_from_slice(&a.scope_id().to_le_bytes());
            }
        }
        b[32..40].copy_from_slice(&self.nonce.to_le_bytes());
        let sum = fnv1a(&b[..CHECKED_LEN]);
        b[40..48].copy_from_slice(&sum.to_le_bytes());
        b
    }

    /// Validates and decodes a handle; everything a connect relies on is checked here.
    pub fn decode(b: &[u8; HANDLE_SIZE]) -> Result<Self, HandleError> {
        let magic = [b[0], b[1], b[2], b[3]];
        if magic != HANDLE_MAGIC {
            return Err(HandleError::BadMagic(magic));
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != HANDLE_VERSION {
            return Err(HandleError::BadVersion(version));
        }
        if fnv1a(&b[..CHECKED_LEN]) != u64_at(b, 40) {
            return Err(HandleError::BadChecksum);
        }
        let nsocks = b[7];
        if nsocks == 0 || usize::from(nsocks) > crate::device::MAX_NSOCKS {
            return Err(HandleError::BadNsocks(nsocks));
        }
        let port = u16::from_le_bytes([b[8], b[9]]);
        if port == 0 {
            return Err(HandleError::BadPort);
        }
        let addr = match b[6] {
            4 => SocketAddr::new(IpAddr::V4(Ipv4Addr::new(b[12], b[13], b[14], b[15])), port),
            6 => {
                let mut o = [0u8; 16];
                o.copy_from_slice(&b[12..28]);
                let scope = u32::from_le_bytes([b[28], b[29], b[30], b[31]]);
                SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::from(o), port, 0, scope))
            }
            other => return Err(HandleError::BadFamily(other)),
        };
        Ok(Self {
            addr,
            nsocks,
            nonce: u64_at(b, 32),
        })
    }
}

/// The connect state id stored in a handle (0 = none).
pub fn state_id(b: &[u8; HANDLE_SIZE]) -> u64 {
    u64_at(b, STATE_AT)
}

/// Stores a connect state id into a handle (0 clears it).
pub fn set_state_id(b: &mut [u8; HANDLE_SIZE], id: u64) {
    b[STATE_AT..STATE_AT + 8].copy_from_slice(&id.to_le_bytes());
}

/// FNV-1a, 64 bit: not a MAC (the handle travels over a channel the caller trusts), just a
/// reliable way to notice corrupted or foreign bytes.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
        (h ^ u64::from(x)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn info() -> ListenInfo {
        ListenInfo {
            addr: "127.0.0.1:4242".parse().unwrap(),
            nsocks: 4,
            nonce: 0x1234_5678_9abc_def0,
        }
    }

    #[test]
    fn round_trip_v4_and_v6() {
        let i = info();
        assert_eq!(ListenInfo::decode(&i.encode()), Ok(i));
        let i6 = ListenInfo {
            addr: "[::1]:9".parse().unwrap(),
            ..info()
        };
        assert_eq!(ListenInfo::decode(&i6.encode()), Ok(i6));
    }

    #[test]
    fn state_id_does_not_affect_validity() {
        let mut b = info().encode();
        set_state_id(&mut b, 77);
        assert_eq!(state_id(&b), 77);
        assert_eq!(ListenInfo::decode(&b), Ok(info()));
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(v in proptest::collection::vec(any::<u8>(), HANDLE_SIZE)) {
            let mut b = [0u8; HANDLE_SIZE];
            b.copy_from_slice(&v);
            let _ = ListenInfo::decode(&b);
            // With a valid magic and version, random content still fails the checksum.
            b[0..4].copy_from_slice(&HANDLE_MAGIC);
            b[4..6].copy_from_slice(&HANDLE_VERSION.to_le_bytes());
            let _ = ListenInfo::decode(&b);
        }

        #[test]
        fn any_flipped_checked_byte_is_refused(at in 0usize..48, bit in 0u8..8) {
            let mut b = info().encode();
            b[at] ^= 1 << bit;
            prop_assert!(ListenInfo::decode(&b).is_err());
        }
    }
}
