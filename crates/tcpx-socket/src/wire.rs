//! What travels on the data sockets: the hello each data socket opens with, the header in front
//! of every message part, and the striping rule both ends derive. Pure encode/decode, no I/O;
//! decoding never panics, whatever the bytes (proptested below).
//!
//! All integers are little-endian.
//!
//! Hello (24 bytes), sent once by the connector on each data socket:
//! ```text
//!  0..4   magic "TXHL"
//!  4..6   protocol version (PROTOCOL_VERSION)
//!  6      nsocks (1..=8): data sockets of this connection
//!  7      index of this socket (< nsocks)
//!  8..16  listen nonce copied from the handle (a stray connection does not know it)
//! 16..24  connection id (random, groups the sockets of one connection on the acceptor)
//! ```
//!
//! Frame header (16 bytes), in front of each part of each message:
//! ```text
//!  0..4   magic "TXFR"
//!  4..8   message sequence number (posting order on the comm, wrapping u32)
//!  8..12  total message size in bytes (≤ i32::MAX: isend takes an int)
//! 12      part index
//! 13      number of parts of this message
//! 14..16  reserved, zero
//! ```
//!
//! Striping: a message of `total` bytes on a comm with `nsocks` sockets is cut into
//! `nparts = clamp(ceil(total / STRIPE_PART_MIN), 1, nsocks)` parts of `ceil(total / nparts)`
//! bytes (the last one shorter); part `i` of message `seq` travels on socket
//! `(seq + i) mod nsocks`. Small messages therefore use one socket, rotating with the sequence
//! number so consecutive small messages spread over all sockets; large ones use every socket.
//! Each socket carries its parts in sequence order, so a receiver can reassemble without any
//! extra control traffic, and checks every header against this same rule.

/// Version of the hello/frame protocol (bumped on any incompatible change).
pub const PROTOCOL_VERSION: u16 = 1;
/// Hello magic.
pub const HELLO_MAGIC: [u8; 4] = *b"TXHL";
/// Frame magic.
pub const FRAME_MAGIC: [u8; 4] = *b"TXFR";
/// Encoded hello size.
pub const HELLO_LEN: usize = 24;
/// Encoded frame header size.
pub const FRAME_LEN: usize = 16;
/// Smallest part worth a socket of its own: below this, striping costs more syscalls than the
/// extra stream gains.
pub const STRIPE_PART_MIN: u64 = 64 * 1024;

/// The first bytes of every data socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Data sockets of the connection.
    pub nsocks: u8,
    /// This socket's index.
    pub index: u8,
    /// The listener's nonce, from the handle.
    pub nonce: u64,
    /// Identifies the connection the socket belongs to.
    pub conn_id: u64,
}

/// Why a hello was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HelloError {
    /// Not our magic: not a tcpx-socket connector.
    BadMagic([u8; 4]),
    /// A connector speaking another protocol version.
    BadVersion(u16),
    /// nsocks out of 1..=8 or index ≥ nsocks.
    BadSocketIndex {
        /// Claimed index.
        index: u8,
        /// Claimed socket count.
        nsocks: u8,
    },
}

impl std::fmt::Display for HelloError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HelloError::BadMagic(m) => write!(f, "bad hello magic {m:02x?}"),
            HelloError::BadVersion(v) => write!(
                f,
                "protocol version {v}, this plugin speaks {PROTOCOL_VERSION}"
            ),
            HelloError::BadSocketIndex { index, nsocks } => {
                write!(f, "socket index {index} of {nsocks} is out of range")
            }
        }
    }
}

impl Hello {
    /// Encodes the hello.
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(&HELLO_MAGIC);
        b[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        b[6] = self.nsocks;
        b[7] = self.index;
        b[8..16].copy_from_slice(&self.nonce.to_le_bytes());
        b[16..24].copy_from_slice(&self.conn_id.to_le_bytes());
        b
    }

    /// Checks the first bytes of a hello that is still arriving, so a stray client that sends a
    /// few wrong bytes and then waits is refused at once instead of holding a socket.
    pub fn check_prefix(prefix: &[u8]) -> Result<(), HelloError> {
        let n = prefix.len().min(4);
        if prefix[..n] != HELLO_MAGIC[..n] {
            let mut m = [0u8; 4];
            m[..n].copy_from_slice(&prefix[..n]);
            return Err(HelloError::BadMagic(m));
        }
        if prefix.len() >= 8 {
            let mut b = [0u8; HELLO_LEN];
            b[..8].copy_from_slice(&prefix[..8]);
            // Only the checks on bytes 0..8 can fail on this zero-padded copy.
            Self::decode(&b)?;
        } else if prefix.len() >= 6 {
            let version = u16::from_le_bytes([prefix[4], prefix[5]]);
            if version != PROTOCOL_VERSION {
                return Err(HelloError::BadVersion(version));
            }
        }
        Ok(())
    }

    /// Decodes and validates a hello (the nonce is checked by the caller, who knows it).
    pub fn decode(b: &[u8; HELLO_LEN]) -> Result<Self, HelloError> {
        let magic = [b[0], b[1], b[2], b[3]];
        if magic != HELLO_MAGIC {
            return Err(HelloError::BadMagic(magic));
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != PROTOCOL_VERSION {
            return Err(HelloError::BadVersion(version));
        }
        let (nsocks, index) = (b[6], b[7]);
        if nsocks == 0 || usize::from(nsocks) > crate::device::MAX_NSOCKS || index >= nsocks {
            return Err(HelloError::BadSocketIndex { index, nsocks });
        }
        Ok(Self {
            nsocks,
            index,
            nonce: u64_at(b, 8),
            conn_id: u64_at(b, 16),
        })
    }
}

/// The header in front of one part of one message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// Message sequence number (low 32 bits).
    pub seq: u32,
    /// Total size of the message.
    pub total: u32,
    /// Index of this part.
    pub part: u8,
    /// Number of parts of the message.
    pub nparts: u8,
}

/// Why a frame header was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FrameError {
    /// Not a frame header: the stream is out of sync or not ours.
    BadMagic([u8; 4]),
    /// Reserved bytes not zero.
    Reserved(u16),
    /// A size an int-sized isend cannot have produced.
    SizeTooLarge(u32),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::BadMagic(m) => write!(f, "bad frame magic {m:02x?}"),
            FrameError::Reserved(r) => write!(f, "reserved frame bytes are {r:#x}, not 0"),
            FrameError::SizeTooLarge(s) => write!(f, "message size {s} exceeds i32::MAX"),
        }
    }
}

impl FrameHeader {
    /// Encodes the header.
    pub fn encode(&self) -> [u8; FRAME_LEN] {
        let mut b = [0u8; FRAME_LEN];
        b[0..4].copy_from_slice(&FRAME_MAGIC);
        b[4..8].copy_from_slice(&self.seq.to_le_bytes());
        b[8..12].copy_from_slice(&self.total.to_le_bytes());
        b[12] = self.part;
        b[13] = self.nparts;
        b
    }

    /// Decodes a header; whether it fits the striping rule is checked by [`Stripe::check`].
    pub fn decode(b: &[u8; FRAME_LEN]) -> Result<Self, FrameError> {
        let magic = [b[0], b[1], b[2], b[3]];
        if magic != FRAME_MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        let reserved = u16::from_le_bytes([b[14], b[15]]);
        if reserved != 0 {
            return Err(FrameError::Reserved(reserved));
        }
        let total = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
        if total > i32::MAX as u32 {
            return Err(FrameError::SizeTooLarge(total));
        }
        Ok(Self {
            seq: u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
            total,
            part: b[12],
            nparts: b[13],
        })
    }
}

/// The striping rule for one comm (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stripe {
    /// Data sockets of the comm (1..=8).
    pub nsocks: usize,
}

impl Stripe {
    /// Number of parts of a message of `total` bytes.
    pub fn nparts(&self, total: u32) -> usize {
        let by_size = u64::from(total).div_ceil(STRIPE_PART_MIN).max(1);
        usize::try_from(by_size)
            .unwrap_or(usize::MAX)
            .min(self.nsocks.max(1))
    }

    /// Byte range `[start, end)` of part `part` of a message of `total` bytes.
    pub fn range(&self, total: u32, part: usize) -> (usize, usize) {
        let total = total as usize;
        let nparts = self.nparts(total as u32);
        let chunk = total.div_ceil(nparts);
        let start = part.saturating_mul(chunk).min(total);
        let end = part.saturating_add(1).saturating_mul(chunk).min(total);
        (start, end)
    }

    /// Socket that carries part `part` of message `seq`.
    pub fn socket_of(&self, seq: u64, part: usize) -> usize {
        let n = self.nsocks.max(1) as u64;
        ((seq % n + part as u64 % n) % n) as usize
    }

    /// The part of message `seq` that socket `sock` carries, if any.
    pub fn part_on(&self, seq: u64, total: u32, sock: usize) -> Option<usize> {
        let n = self.nsocks.max(1) as u64;
        let part = ((sock as u64 % n + n - seq % n) % n) as usize;
        (part < self.nparts(total)).then_some(part)
    }

    /// Checks a header received on socket `sock` for message `seq` against the rule.
    pub fn check(&self, h: &FrameHeader, seq: u64, sock: usize) -> Result<(), String> {
        if u64::from(h.seq) != seq & 0xffff_ffff {
            return Err(format!(
                "frame for message {} where message {} was expected",
                h.seq,
                seq & 0xffff_ffff
            ));
        }
        let nparts = self.nparts(h.total);
        if usize::from(h.nparts) != nparts {
            return Err(format!(
                "message {seq} of {} bytes claims {} parts, the striping rule gives {nparts}",
                h.total, h.nparts
            ));
        }
        match self.part_on(seq, h.total, sock) {
            Some(p) if p == usize::from(h.part) => Ok(()),
            _ => Err(format!(
                "part {} of message {seq} arrived on socket {sock}, which does not carry it",
                h.part
            )),
        }
    }
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

    proptest! {
        #[test]
        fn hello_decode_never_panics(bytes in proptest::array::uniform24(any::<u8>())) {
            let _ = Hello::decode(&bytes);
        }

        #[test]
        fn frame_decode_never_panics(bytes in proptest::array::uniform16(any::<u8>())) {
            if let Ok(h) = FrameHeader::decode(&bytes) {
                let s = Stripe { nsocks: 4 };
                for sock in 0..4 {
                    let _ = s.check(&h, u64::from(h.seq), sock);
                }
            }
        }

        #[test]
        fn hello_prefix_check_never_panics_and_accepts_real_prefixes(
            bytes in proptest::collection::vec(any::<u8>(), 0..=HELLO_LEN),
            nsocks in 1u8..=8, nonce: u64, conn_id: u64, cut in 0usize..=HELLO_LEN,
        ) {
            let _ = Hello::check_prefix(&bytes);
            let real = Hello { nsocks, index: 0, nonce, conn_id }.encode();
            prop_assert!(Hello::check_prefix(&real[..cut]).is_ok());
        }

        #[test]
        fn hello_round_trips(nsocks in 1u8..=8, idx in 0u8..8, nonce: u64, conn_id: u64) {
            let h = Hello { nsocks, index: idx % nsocks, nonce, conn_id };
            prop_assert_eq!(Hello::decode(&h.encode()), Ok(h));
        }

        #[test]
        fn frame_round_trips(seq: u32, total in 0u32..=i32::MAX as u32, part: u8, nparts: u8) {
            let h = FrameHeader { seq, total, part, nparts };
            prop_assert_eq!(FrameHeader::decode(&h.encode()), Ok(h));
        }

        /// The parts tile the message exactly, each on a distinct socket, and every part's
        /// header passes the receiver's check on the socket that carries it (and no other).
        #[test]
        fn stripes_tile_the_message(total in 0u32..=(64 << 20), nsocks in 1usize..=8, seq: u64) {
            let s = Stripe { nsocks };
            let n = s.nparts(total);
            prop_assert!(n >= 1 && n <= nsocks);
            let mut next = 0usize;
            let mut socks = Vec::new();
            for part in 0..n {
                let (a, b) = s.range(total, part);
                prop_assert_eq!(a, next);
                prop_assert!(b >= a);
                next = b;
                let sock = s.socket_of(seq, part);
                prop_assert_eq!(s.part_on(seq, total, sock), Some(part));
                socks.push(sock);
                let h = FrameHeader { seq: seq as u32, total, part: part as u8, nparts: n as u8 };
                for other in 0..nsocks {
                    prop_assert_eq!(s.check(&h, seq, other).is_ok(), other == sock);
                }
            }
            prop_assert_eq!(next, total as usize);
            socks.sort_unstable();
            socks.dedup();
            prop_assert_eq!(socks.len(), n);
        }
    }

    #[test]
    fn small_messages_use_one_socket_large_ones_all() {
        let s = Stripe { nsocks: 4 };
        assert_eq!(s.nparts(0), 1);
        assert_eq!(s.nparts(4096), 1);
        assert_eq!(s.nparts(1 << 20), 4);
        assert_eq!(s.socket_of(5, 0), 1);
    }
}
