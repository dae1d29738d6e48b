//! The local protocol: the messages two endpoints of one host exchange over their Unix
//! socket, and their framing (sans-IO; the runtime's `ipc::wire::read_msg` reads frames from
//! the socket).
//!
//! A frame is a u32 little-endian body length (1..=[`MAX_FRAME`]) and the body: a type byte
//! and the payload. The first frame each way is a [`Hello`]; after it:
//!
//! - `Validate` / `Granted` | `Refused`: before its first use of a descriptor on a
//!   connection, the importer asks the owner to confirm key, handle and range;
//! - `Revoke` / `RevokeAck`: the owner revoked a descriptor; the importer dropped it (and
//!   closed its mapping once no descriptor of that allocation is left) before it acks;
//! - `Goodbye` / `GoodbyeAck`: the sender is leaving; the receiver closed every mapping of
//!   the sender's memory before it acks.
//!
//! Every request carries an id its answer repeats. The decoder takes any bytes and returns a
//! message or an error naming the field; nothing a peer sends can make it panic or allocate
//! more than [`MAX_FRAME`].

use super::{IpcMemHandle, IPC_HANDLE_BYTES, MAX_BUS_ID};
use crate::wire::{read_bounded, Reader, WireError, Writer};

/// Largest frame body.
pub const MAX_FRAME: usize = 4096;
/// Version of the local protocol spoken (and the only one accepted).
pub const LOCAL_PROTOCOL_VERSION: u16 = 1;
/// Longest reason text carried.
pub const MAX_REASON: usize = 1024;
const HELLO_MAGIC: [u8; 4] = *b"TXLH";

/// What each side says first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// The protocol version of the sender.
    pub version: u16,
    /// The sender's process id.
    pub pid: u32,
    /// The sender endpoint's instance id.
    pub instance: u64,
    /// The sender's boot id (must equal the receiver's).
    pub boot_id: [u8; 16],
    /// The sender's GPU ordinal (in its own numbering), if it has one.
    pub gpu_ordinal: Option<u32>,
    /// The sender's GPU PCI bus id, if it has one.
    pub gpu_bus: Option<String>,
    /// The sender's hostname.
    pub hostname: String,
}

/// One message of the local protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Msg {
    /// The first message each way.
    Hello(Hello),
    /// "May I use this range?" (importer → owner).
    Validate {
        /// Request id.
        req: u64,
        /// The descriptor's key.
        key: u64,
        /// The descriptor's handle.
        handle: IpcMemHandle,
        /// The descriptor's offset in its allocation.
        offset: u64,
        /// The descriptor's length.
        len: u64,
    },
    /// The owner confirmed a `Validate`.
    Granted {
        /// The request answered.
        req: u64,
    },
    /// The owner refused a `Validate`; the reason says why.
    Refused {
        /// The request answered.
        req: u64,
        /// Why (`unknown key`, `revoked`, `handle differs`…).
        reason: String,
    },
    /// The owner revoked the descriptor with this key (owner → importer).
    Revoke {
        /// Request id.
        req: u64,
        /// The revoked key.
        key: u64,
    },
    /// The importer dropped the key (and its mapping, if it was the last user).
    RevokeAck {
        /// The request answered.
        req: u64,
    },
    /// The sender leaves; the receiver closes every mapping of the sender's memory.
    Goodbye {
        /// Request id.
        req: u64,
        /// Why the sender leaves.
        reason: String,
    },
    /// The receiver of a goodbye closed its mappings.
    GoodbyeAck {
        /// The request answered.
        req: u64,
    },
}

mod code {
    pub const HELLO: u8 = 1;
    pub const VALIDATE: u8 = 2;
    pub const GRANTED: u8 = 3;
    pub const REFUSED: u8 = 4;
    pub const REVOKE: u8 = 5;
    pub const REVOKE_ACK: u8 = 6;
    pub const GOODBYE: u8 = 7;
    pub const GOODBYE_ACK: u8 = 8;
}

/// Texts are cut (at a character boundary) rather than refused: a long reason is the
/// sender's problem, not a protocol error.
fn clip(text: &str) -> &str {
    clip_to(text, MAX_REASON)
}

fn clip_to(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

impl Msg {
    /// The whole frame: length prefix, type, payload.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![0u8; 4];
        let mut w = Writer(&mut out);
        // Every text is clipped to its bound first, so no length prefix can overflow.
        match self {
            Msg::Hello(h) => {
                w.u8(code::HELLO);
                w.bytes(&HELLO_MAGIC);
                w.u16(h.version);
                w.u32(h.pid);
                w.u64(h.instance);
                w.bytes(&h.boot_id);
                w.u32(h.gpu_ordinal.unwrap_or(u32::MAX));
                let bus = h.gpu_bus.as_deref().unwrap_or("");
                let _ = w.str16("gpu_bus", clip_to(bus, MAX_BUS_ID));
                let _ = w.str16("hostname", clip(&h.hostname));
            }
            Msg::Validate {
                req,
                key,
                handle,
                offset,
                len,
            } => {
                w.u8(code::VALIDATE);
                w.u64(*req);
                w.u64(*key);
                w.bytes(handle.as_bytes());
                w.u64(*offset);
                w.u64(*len);
            }
            Msg::Granted { req } => {
                w.u8(code::GRANTED);
                w.u64(*req);
            }
            Msg::Refused { req, reason } => {
                w.u8(code::REFUSED);
                w.u64(*req);
                let _ = w.str16("reason", clip(reason));
            }
            Msg::Revoke { req, key } => {
                w.u8(code::REVOKE);
                w.u64(*req);
                w.u64(*key);
            }
            Msg::RevokeAck { req } => {
                w.u8(code::REVOKE_ACK);
                w.u64(*req);
            }
            Msg::Goodbye { req, reason } => {
                w.u8(code::GOODBYE);
                w.u64(*req);
                let _ = w.str16("reason", clip(reason));
            }
            Msg::GoodbyeAck { req } => {
                w.u8(code::GOODBYE_ACK);
                w.u64(*req);
            }
        }
        let body = (out.len() - 4) as u32;
        out[..4].copy_from_slice(&body.to_le_bytes());
        out
    }

    /// Decodes a frame body (type byte and payload).
    pub fn decode(body: &[u8]) -> Result<Msg, WireError> {
        let mut r = Reader::new(body);
        let msg = match r.u8("type")? {
            code::HELLO => {
                if r.array::<4>("magic")? != HELLO_MAGIC {
                    return Err(WireError::Invalid {
                        field: "magic",
                        why: "not a tcpx local hello",
                    });
                }
                let version = r.u16("version")?;
                let pid = r.u32("pid")?;
                let instance = r.u64("instance")?;
                let boot_id = r.array::<16>("boot_id")?;
                let ordinal = r.u32("gpu_ordinal")?;
                let bus = read_bounded(&mut r, "gpu_bus", MAX_BUS_ID)?;
                let hostname = read_bounded(&mut r, "hostname", MAX_REASON)?;
                Msg::Hello(Hello {
                    version,
                    pid,
                    instance,
                    boot_id,
                    gpu_ordinal: (ordinal != u32::MAX).then_some(ordinal),
                    gpu_bus: (!bus.is_empty()).then_some(bus),
                    hostname,
                })
            }
            code::VALIDATE => Msg::Validate {
                req: r.u64("req")?,
                key: r.u64("key")?,
                handle: IpcMemHandle::from_bytes(r.array::<IPC_HANDLE_BYTES>("handle")?),
                offset: r.u64("offset")?,
                len: r.u64("len")?,
            },
            code::GRANTED => Msg::Granted { req: r.u64("req")? },
            code::REFUSED => Msg::Refused {
                req: r.u64("req")?,
                reason: read_bounded(&mut r, "reason", MAX_REASON)?,
            },
            code::REVOKE => Msg::Revoke {
                req: r.u64("req")?,
                key: r.u64("key")?,
            },
            code::REVOKE_ACK => Msg::RevokeAck { req: r.u64("req")? },
            code::GOODBYE => Msg::Goodbye {
                req: r.u64("req")?,
                reason: read_bounded(&mut r, "reason", MAX_REASON)?,
            },
            code::GOODBYE_ACK => Msg::GoodbyeAck { req: r.u64("req")? },
            _ => {
                return Err(WireError::Invalid {
                    field: "type",
                    why: "unknown local message type",
                })
            }
        };
        r.finish()?;
        Ok(msg)
    }
}
