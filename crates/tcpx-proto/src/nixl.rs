//! The NIXL backend plugin's byte formats (`integrations/nixl`; the C++ plugin encodes and
//! decodes through the C API's `tcpx_nixl_*` functions, which call these). Each opens with a
//! 4-byte magic or a kind byte, so a blob from another backend, an older plugin or a corrupted
//! exchange is refused with a message instead of being trusted. Integers little-endian.
//!
//! - **connection info** (`getConnInfo`): `"TXC1"` | u32 metadata length | tcpx endpoint
//!   metadata, then optionally `"TXL1"` | u32 length | same-host info (`LocalInfo` bytes);
//! - **public memory** (`getPublicData`): `"TXM1"` | u32 NIXL memory type | u64 base | u64
//!   length | 26-byte one-sided descriptor, then optionally u8 1 | 128-byte CUDA IPC
//!   descriptor (VRAM that could be exported);
//! - **notification payload**: u8 kind (1 Hello, 2 User) | u16 agent-name length | agent name
//!   | message.
//!
//! Decoders check lengths only; the blobs inside (metadata, descriptors) are decoded by their
//! own decoders when used.

use crate::ipc::identity::MAX_LOCAL_INFO;
use crate::ipc::IpcDescriptor;
use crate::onesided::Descriptor;

/// Largest endpoint metadata a connection info may carry.
pub const MAX_METADATA: usize = 4096;
/// Largest agent name a notification carries (u16 length).
pub const MAX_AGENT_NAME: usize = 0xffff;
/// Bytes of a public-memory blob without the IPC tail.
pub const PUBLIC_MEM_BYTES: usize = 4 + 4 + 8 + 8 + Descriptor::BYTES;
/// Bytes of a public-memory blob with the IPC tail.
pub const PUBLIC_MEM_IPC_BYTES: usize = PUBLIC_MEM_BYTES + 1 + IpcDescriptor::BYTES;

const CONN_MAGIC: [u8; 4] = *b"TXC1";
const LOCAL_MAGIC: [u8; 4] = *b"TXL1";
const MEM_MAGIC: [u8; 4] = *b"TXM1";

/// Bytes that are not one of these formats: which one, and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("NIXL {format}: {why}")]
pub struct NixlWireError {
    /// Which format ("connection info", "public memory", "notification").
    pub format: &'static str,
    /// What is wrong.
    pub why: String,
}

fn err<T>(format: &'static str, why: impl Into<String>) -> Result<T, NixlWireError> {
    Err(NixlWireError {
        format,
        why: why.into(),
    })
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(w)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

/// Where the parts of a connection info lie in its bytes (decoding copies nothing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnInfoParts {
    /// Offset and length of the endpoint metadata.
    pub metadata: (usize, usize),
    /// Offset and length of the same-host info (length 0: none sent).
    pub local: (usize, usize),
}

/// A connection info of `metadata` (1..=[`MAX_METADATA`] bytes) and `local` (empty: no
/// same-host route offered; else at most [`MAX_LOCAL_INFO`] bytes).
pub fn encode_conn_info(metadata: &[u8], local: &[u8]) -> Result<Vec<u8>, NixlWireError> {
    const F: &str = "connection info";
    if metadata.is_empty() || metadata.len() > MAX_METADATA {
        return err(
            F,
            format!("metadata of {} bytes (1..={MAX_METADATA})", metadata.len()),
        );
    }
    if local.len() > MAX_LOCAL_INFO {
        return err(
            F,
            format!(
                "same-host info of {} bytes (at most {MAX_LOCAL_INFO})",
                local.len()
            ),
        );
    }
    let mut out = Vec::with_capacity(16 + metadata.len() + local.len());
    out.extend_from_slice(&CONN_MAGIC);
    out.extend_from_slice(&(metadata.len() as u32).to_le_bytes());
    out.extend_from_slice(metadata);
    if !local.is_empty() {
        out.extend_from_slice(&LOCAL_MAGIC);
        out.extend_from_slice(&(local.len() as u32).to_le_bytes());
        out.extend_from_slice(local);
    }
    Ok(out)
}

/// The parts of a connection info [`encode_conn_info`] made; anything else is an error.
pub fn decode_conn_info(bytes: &[u8]) -> Result<ConnInfoParts, NixlWireError> {
    const F: &str = "connection info";
    if bytes.len() < 8 || bytes[..4] != CONN_MAGIC {
        return err(F, "not a TCPX connection info (expected \"TXC1\")");
    }
    let n = u32_at(bytes, 4) as usize;
    if n == 0 || n > MAX_METADATA || bytes.len() - 8 < n {
        return err(
            F,
            format!(
                "metadata length {n} does not fit (1..={MAX_METADATA}, {} bytes follow)",
                bytes.len() - 8
            ),
        );
    }
    let metadata = (8, n);
    let rest = &bytes[8 + n..];
    if rest.is_empty() {
        return Ok(ConnInfoParts {
            metadata,
            local: (8 + n, 0),
        });
    }
    if rest.len() < 8 || rest[..4] != LOCAL_MAGIC {
        return err(
            F,
            "trailing bytes are not a same-host part (expected \"TXL1\")",
        );
    }
    let m = u32_at(rest, 4) as usize;
    if m == 0 || m > MAX_LOCAL_INFO || rest.len() - 8 != m {
        return err(
            F,
            format!(
                "same-host info length {m} does not match the {} bytes that follow",
                rest.len() - 8
            ),
        );
    }
    Ok(ConnInfoParts {
        metadata,
        local: (8 + n + 8, m),
    })
}

/// What a peer needs to address one registered range: memory type, base, length and tcpx
/// descriptor, and for VRAM that could be exported the CUDA IPC descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PublicMem {
    /// NIXL's memory type (DRAM_SEG, VRAM_SEG, ...), as NIXL numbers it.
    pub mem_type: u32,
    /// The owner's address of the range.
    pub base: u64,
    /// Bytes.
    pub len: u64,
    /// The one-sided descriptor's bytes.
    pub descriptor: [u8; Descriptor::BYTES],
    /// The CUDA IPC descriptor's bytes, when there is one.
    pub ipc: Option<[u8; IpcDescriptor::BYTES]>,
}

impl PublicMem {
    /// The blob (see the module docs).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(PUBLIC_MEM_IPC_BYTES);
        out.extend_from_slice(&MEM_MAGIC);
        out.extend_from_slice(&self.mem_type.to_le_bytes());
        out.extend_from_slice(&self.base.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
        out.extend_from_slice(&self.descriptor);
        if let Some(ipc) = &self.ipc {
            out.push(1);
            out.extend_from_slice(ipc);
        }
        out
    }

    /// Decodes [`encode`](Self::encode)'s output; anything else is an error, never a panic.
    pub fn decode(bytes: &[u8]) -> Result<Self, NixlWireError> {
        const F: &str = "public memory";
        if bytes.len() != PUBLIC_MEM_BYTES && bytes.len() != PUBLIC_MEM_IPC_BYTES {
            return err(
                F,
                format!(
                    "{} bytes ({PUBLIC_MEM_BYTES} or {PUBLIC_MEM_IPC_BYTES} expected)",
                    bytes.len()
                ),
            );
        }
        if bytes[..4] != MEM_MAGIC {
            return err(F, "not TCPX public memory data (expected \"TXM1\")");
        }
        let mut descriptor = [0u8; Descriptor::BYTES];
        descriptor.copy_from_slice(&bytes[24..PUBLIC_MEM_BYTES]);
        let ipc = if bytes.len() == PUBLIC_MEM_IPC_BYTES {
            if bytes[PUBLIC_MEM_BYTES] != 1 {
                return err(
                    F,
                    format!("IPC tail flag {} (expected 1)", bytes[PUBLIC_MEM_BYTES]),
                );
            }
            let mut ipc = [0u8; IpcDescriptor::BYTES];
            ipc.copy_from_slice(&bytes[PUBLIC_MEM_BYTES + 1..]);
            Some(ipc)
        } else {
            None
        };
        let (base, len) = (u64_at(bytes, 8), u64_at(bytes, 16));
        if len == 0 || base.checked_add(len).is_none() {
            return err(F, format!("range {base:#x}+{len} is empty or wraps"));
        }
        Ok(Self {
            mem_type: u32_at(bytes, 4),
            base,
            len,
            descriptor,
            ipc,
        })
    }
}

/// Why a notification was sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum NotifKind {
    /// Sent once by the side that dialed a connection, naming its agent (its message is the
    /// dialer's control address, empty from older plugins).
    Hello = 1,
    /// A NIXL notification (genNotif, or the one of a WRITE / READ).
    User = 2,
}

/// Where the parts of a notification payload lie in its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotifParts {
    /// The kind.
    pub kind: NotifKind,
    /// Offset and length of the sending agent's name (never empty).
    pub agent: (usize, usize),
    /// Offset and length of the message.
    pub msg: (usize, usize),
}

/// Bytes a payload adds to the message.
pub fn notif_overhead(agent: &[u8]) -> usize {
    3 + agent.len()
}

/// A notification payload of `kind` from `agent` (1..=[`MAX_AGENT_NAME`] bytes) carrying
/// `msg`.
pub fn encode_notif(kind: NotifKind, agent: &[u8], msg: &[u8]) -> Result<Vec<u8>, NixlWireError> {
    if agent.is_empty() || agent.len() > MAX_AGENT_NAME {
        return err(
            "notification",
            format!("agent name of {} bytes (1..={MAX_AGENT_NAME})", agent.len()),
        );
    }
    let mut out = Vec::with_capacity(notif_overhead(agent) + msg.len());
    out.push(kind as u8);
    out.extend_from_slice(&(agent.len() as u16).to_le_bytes());
    out.extend_from_slice(agent);
    out.extend_from_slice(msg);
    Ok(out)
}

/// The parts of a payload [`encode_notif`] made; anything else is an error.
pub fn decode_notif(bytes: &[u8]) -> Result<NotifParts, NixlWireError> {
    const F: &str = "notification";
    if bytes.len() < 3 {
        return err(F, format!("{} bytes (at least 3)", bytes.len()));
    }
    let kind = match bytes[0] {
        1 => NotifKind::Hello,
        2 => NotifKind::User,
        k => return err(F, format!("kind {k} (1 hello or 2 user)")),
    };
    let n = usize::from(u16::from_le_bytes([bytes[1], bytes[2]]));
    if n == 0 || bytes.len() - 3 < n {
        return err(
            F,
            format!("agent name length {n} (1..={} here)", bytes.len() - 3),
        );
    }
    Ok(NotifParts {
        kind,
        agent: (3, n),
        msg: (3 + n, bytes.len() - 3 - n),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn conn_info_with_and_without_local_round_trips() {
        let meta = vec![7u8; 100];
        for local in [vec![], vec![9u8; 40]] {
            let b = encode_conn_info(&meta, &local).unwrap();
            let p = decode_conn_info(&b).unwrap();
            assert_eq!(&b[p.metadata.0..p.metadata.0 + p.metadata.1], &meta[..]);
            assert_eq!(&b[p.local.0..p.local.0 + p.local.1], &local[..]);
        }
        assert!(decode_conn_info(b"TXC1\0\0\0\0").is_err());
        assert!(encode_conn_info(&[], &[]).is_err());
    }

    #[test]
    fn public_mem_and_notif_round_trip() {
        for ipc in [None, Some([5u8; 128])] {
            let m = PublicMem {
                mem_type: 1,
                base: 0x1000,
                len: 4096,
                descriptor: [3; 26],
                ipc,
            };
            assert_eq!(PublicMem::decode(&m.encode()).unwrap(), m);
        }
        let b = encode_notif(NotifKind::User, b"agent-a", b"done").unwrap();
        let p = decode_notif(&b).unwrap();
        assert_eq!(
            (p.kind, &b[p.agent.0..p.agent.0 + p.agent.1], &b[p.msg.0..]),
            (NotifKind::User, &b"agent-a"[..], &b"done"[..])
        );
        assert!(decode_notif(&[3, 1, 0, b'a']).is_err());
        assert!(decode_notif(&[1, 0, 0]).is_err());
    }

    proptest! {
        #[test]
        fn any_bytes_decode_or_fail_and_parts_lie_inside(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            if let Ok(p) = decode_conn_info(&bytes) {
                prop_assert!(p.metadata.0 + p.metadata.1 <= bytes.len());
                prop_assert!(p.local.0 + p.local.1 <= bytes.len());
            }
            let _ = PublicMem::decode(&bytes);
            if let Ok(p) = decode_notif(&bytes) {
                prop_assert_eq!(p.msg.0 + p.msg.1, bytes.len());
            }
        }
    }
}
