//! The descriptor lists of `tcpx.p2p`'s descriptor API (UCCL's `XferDesc`,
//! `get_serialized_descs` / `deserialize_descs`): the one encoder and decoder of their bytes,
//! and the keys that let a peer reach registered memory.
//!
//! **Keys.** A descriptor's `rkeys` carry what a one-sided write or read of the runtime needs
//! to name the memory on its owner's side: the registration's 26-byte [`Descriptor`] (region
//! id, length, memory kind, random access key) and the registration's base address, so that
//! `addr - base` is the offset. They are 9 little-endian `u32` words ([`RemoteKey`]), bytes
//! 34..36 zero. Like an RDMA rkey, they open the whole registration (the owner checks every
//! access against it). `lkeys` are the same words with the access key zeroed: the local name
//! of the registration, which grants nothing. Two descriptors of one registration (the same
//! buffer registered twice, or a sub-range of a registered buffer) have equal keys, as UCCL's
//! MR cache gives.
//!
//! **Serialized list** (little-endian, independent of the machine, unlike UCCL's raw
//! `size_t`s):
//!
//! | bytes | field |
//! |---|---|
//! | 4 | magic `TXDL` |
//! | 2 | format version (1) |
//! | 2 | reserved, 0 |
//! | 4 | number of descriptors |
//! | per descriptor | `addr` u64, `size` u64, `lkeys` count u32, `rkeys` count u32, IPC info length u32, the `lkeys` words, the `rkeys` words, the IPC info bytes |
//! | 8 | FNV-1a of everything before |
//!
//! Empty input decodes to an empty list (UCCL's rule). The decoder reads untrusted bytes from
//! a peer: it checks every count against the bytes that remain before allocating, refuses
//! trailing bytes, and never panics (`tests/uccl_descs.rs` and the fuzz target `uccl_descs` check it on arbitrary input).
//!

use std::fmt;

use crate::checksum::fnv1a;
use crate::onesided::Descriptor;

const MAGIC: &[u8; 4] = b"TXDL";
const VERSION: u16 = 1;
/// Magic, version, reserved, count.
const HEADER: usize = 12;
/// `addr`, `size`, three counts: the least a descriptor takes.
const FIXED: usize = 8 + 8 + 4 + 4 + 4;
/// Words in `lkeys` / `rkeys` of a tcpx registration.
pub const KEY_WORDS: usize = 9;

/// One descriptor as it travels (UCCL's `XferDesc` without `mr_id`, which is local and not
/// sent).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Desc {
    /// Address of the memory in its owner's process.
    pub addr: u64,
    /// Bytes.
    pub size: u64,
    /// Local name of the registration ([`RemoteKey::lkeys`]).
    pub lkeys: Vec<u32>,
    /// What a peer needs to reach it ([`RemoteKey::rkeys`]).
    pub rkeys: Vec<u32>,
    /// Same-host (CUDA IPC) information (the owner's 128-byte IPC descriptor for CUDA
    /// memory); empty when there is none.
    pub ipc_info: Vec<u8>,
}

/// Bytes that are not a descriptor list, or keys that name no registration: what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DescError(pub String);

impl fmt::Display for DescError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for DescError {}

fn err<T>(message: impl Into<String>) -> Result<T, DescError> {
    Err(DescError(message.into()))
}

fn count(n: usize, what: &str) -> Result<u32, DescError> {
    u32::try_from(n).or_else(|_| err(format!("{what}: {n} entries do not fit the format")))
}

/// The bytes of `descs` (see the module docs).
pub fn encode(descs: &[Desc]) -> Result<Vec<u8>, DescError> {
    let body: usize = descs
        .iter()
        .map(|d| FIXED + 4 * (d.lkeys.len() + d.rkeys.len()) + d.ipc_info.len())
        .sum();
    let mut out = Vec::with_capacity(HEADER + body + 8);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out.extend_from_slice(&count(descs.len(), "descriptor list")?.to_le_bytes());
    for (i, d) in descs.iter().enumerate() {
        out.extend_from_slice(&d.addr.to_le_bytes());
        out.extend_from_slice(&d.size.to_le_bytes());
        out.extend_from_slice(
            &count(d.lkeys.len(), &format!("descriptor {i} lkeys"))?.to_le_bytes(),
        );
        out.extend_from_slice(
            &count(d.rkeys.len(), &format!("descriptor {i} rkeys"))?.to_le_bytes(),
        );
        out.extend_from_slice(
            &count(d.ipc_info.len(), &format!("descriptor {i} IPC info"))?.to_le_bytes(),
        );
        for w in d.lkeys.iter().chain(&d.rkeys) {
            out.extend_from_slice(&w.to_le_bytes());
        }
        out.extend_from_slice(&d.ipc_info);
    }
    let hash = fnv1a(&out);
    out.extend_from_slice(&hash.to_le_bytes());
    Ok(out)
}

/// Reads fields off the front of a byte slice; every read checks what remains.
struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], DescError> {
        if n > self.rest.len() {
            return err(format!(
                "descriptor list is truncated: {what} needs {n} bytes, {} remain",
                self.rest.len()
            ));
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    fn u32(&mut self, what: &str) -> Result<u32, DescError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, what: &str) -> Result<u64, DescError> {
        let b = self.take(8, what)?;
        let mut w = [0u8; 8];
        w.copy_from_slice(b);
        Ok(u64::from_le_bytes(w))
    }

    fn words(&mut self, n: u32, what: &str) -> Result<Vec<u32>, DescError> {
        let n = n as usize;
        if n > self.rest.len() / 4 {
            return err(format!(
                "descriptor list is truncated: {what} claims {n} words, {} bytes remain",
                self.rest.len()
            ));
        }
        let bytes = self.take(4 * n, what)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
}

/// Decodes [`encode`]'s output; anything else is an error saying what is wrong, never a
/// panic.
pub fn decode(bytes: &[u8]) -> Result<Vec<Desc>, DescError> {
    if bytes.is_empty() {
        return Ok(Vec::new());
    }
    if bytes.len() < HEADER + 8 {
        return err(format!(
            "a descriptor list is at least {} bytes (from get_serialized_descs), got {}",
            HEADER + 8,
            bytes.len()
        ));
    }
    if &bytes[..4] != MAGIC {
        return err(
            "not a tcpx descriptor list (magic differs): pass the bytes get_serialized_descs \
             returned on the peer",
        );
    }
    let version = u16::from_le_bytes([bytes[4], bytes[5]]);
    if version != VERSION {
        return err(format!(
            "descriptor list format version {version} is not supported (this side reads {VERSION})"
        ));
    }
    let (signed, hash) = bytes.split_at(bytes.len() - 8);
    let mut h = [0u8; 8];
    h.copy_from_slice(hash);
    if fnv1a(signed) != u64::from_le_bytes(h) {
        return err("descriptor list is corrupted (its checksum does not match)");
    }
    if bytes[6..8] != [0, 0] {
        return err("descriptor list: reserved bytes 6..8 are not zero");
    }
    let mut r = Reader {
        rest: &signed[HEADER..],
    };
    let n = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize;
    if n > r.rest.len() / FIXED {
        return err(format!(
            "descriptor list claims {n} descriptors but holds {} bytes",
            r.rest.len()
        ));
    }
    let mut descs = Vec::with_capacity(n);
    for i in 0..n {
        let at = |field: &str| format!("descriptor {i} {field}");
        let addr = r.u64(&at("addr"))?;
        let size = r.u64(&at("size"))?;
        let nl = r.u32(&at("lkeys count"))?;
        let nr = r.u32(&at("rkeys count"))?;
        let ni = r.u32(&at("IPC info length"))?;
        let lkeys = r.words(nl, &at("lkeys"))?;
        let rkeys = r.words(nr, &at("rkeys"))?;
        let ipc_info = r.take(ni as usize, &at("IPC info"))?.to_vec();
        descs.push(Desc {
            addr,
            size,
            lkeys,
            rkeys,
            ipc_info,
        });
    }
    if !r.rest.is_empty() {
        return err(format!(
            "descriptor list has {} bytes after its {n} descriptors",
            r.rest.len()
        ));
    }
    Ok(descs)
}

/// What a peer needs to reach a registration: its runtime descriptor and base address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteKey {
    /// The advertised registration.
    pub descriptor: Descriptor,
    /// Its first byte's address in the owner's process.
    pub base: u64,
}

/// `len` bytes at `offset` in the registration `descriptor` names: one remote entry of a
/// one-sided operation, before the local side's length is known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteRange {
    /// The registration.
    pub descriptor: Descriptor,
    /// Offset in it.
    pub offset: u64,
    /// Bytes available there.
    pub len: u64,
}

impl RemoteKey {
    fn bytes(&self) -> [u8; 4 * KEY_WORDS] {
        let mut b = [0u8; 4 * KEY_WORDS];
        b[..Descriptor::BYTES].copy_from_slice(&self.descriptor.to_bytes());
        b[Descriptor::BYTES..Descriptor::BYTES + 8].copy_from_slice(&self.base.to_le_bytes());
        b
    }

    fn words(bytes: &[u8; 4 * KEY_WORDS]) -> Vec<u32> {
        bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    /// `rkeys`: the descriptor (with its access key) and the base, as 9 words.
    pub fn rkeys(&self) -> Vec<u32> {
        Self::words(&self.bytes())
    }

    /// `lkeys`: the same words with the access key zeroed (grants nothing).
    pub fn lkeys(&self) -> Vec<u32> {
        let mut b = self.bytes();
        // The key is the descriptor's last 8 bytes (see `Descriptor::to_bytes`).
        b[Descriptor::BYTES - 8..Descriptor::BYTES].fill(0);
        Self::words(&b)
    }

    /// Decodes [`RemoteKey::rkeys`]; anything else is an error, never a panic.
    pub fn from_rkeys(words: &[u32]) -> Result<Self, DescError> {
        if words.len() != KEY_WORDS {
            return err(format!(
                "rkeys of a tcpx registration are {KEY_WORDS} words (from register_memory on \
                 the peer), got {}",
                words.len()
            ));
        }
        let mut b = [0u8; 4 * KEY_WORDS];
        for (chunk, w) in b.chunks_exact_mut(4).zip(words) {
            chunk.copy_from_slice(&w.to_le_bytes());
        }
        if b[Descriptor::BYTES + 8..] != [0, 0] {
            return err("rkeys: padding bytes 34..36 are not zero");
        }
        let descriptor = Descriptor::from_bytes(&b[..Descriptor::BYTES])
            .map_err(|e| DescError(format!("rkeys: {e}")))?;
        let mut base = [0u8; 8];
        base.copy_from_slice(&b[Descriptor::BYTES..Descriptor::BYTES + 8]);
        Ok(Self {
            descriptor,
            base: u64::from_le_bytes(base),
        })
    }

    /// The `size` bytes at `addr` (the owner's address) as a range of the registration;
    /// an error when they do not lie inside it.
    pub fn range(&self, addr: u64, size: u64) -> Result<RemoteRange, DescError> {
        let inside = addr.checked_sub(self.base).filter(|off| {
            off.checked_add(size)
                .is_some_and(|end| end <= self.descriptor.len())
        });
        match inside {
            Some(offset) => Ok(RemoteRange {
                descriptor: self.descriptor,
                offset,
                len: size,
            }),
            None => err(format!(
                "{size} bytes at {addr:#x} lie outside the peer's {}-byte registration at {:#x}",
                self.descriptor.len(),
                self.base
            )),
        }
    }
}
