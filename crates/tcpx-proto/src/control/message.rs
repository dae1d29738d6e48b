//! The control messages and their payload encoding.
//!
//! Payloads are hand-written little-endian with explicit lengths (no serde on the wire):
//!
//! | type | code | payload |
//! |---|---|---|
//! | `Hello` | 0x0001 | protocol_version u16, [`EndpointInfo`], secret (u8 0 = none, 1 = present then 16 bytes) |
//! | `ConnectHandles` | 0x0002 | count u16, count × 128 bytes |
//! | `Ready` | 0x0003 | empty |
//! | `Close` | 0x0004 | reason str16 |
//! | `Error` | 0x0005 | code u32, message str16 |
//! | `Segments` | 0x0006 | transfer_id u64, count u32, count × u64 |
//! | `WriteRequest` | 0x0100 | see [`super::rma::WriteRequest`] |
//! | `ReadRequest` | 0x0101 | see [`super::rma::ReadRequest`] |
//! | `Notify` | 0x0102 | u32 length + bytes (at most 64 KiB) |
//! | `WriteAck` | 0x0103 | op_id u64, u8 0 = done / 1 = refused, then index u32 + reason u8 |
//! | `ReadData` | 0x0104 | op_id u64, packed u8 (0 / 1) |
//! | `ReadRefused` | 0x0105 | op_id u64, index u32, reason u8 |
//! | `ReadInline` | 0x0106 | op_id u64, u32 length + bytes (at most [`MAX_INLINE`](super::rma::MAX_INLINE)) |
//! | reserved | 0x0107–0x01FF | later one-sided operations |
//! | reserved | 0xF000–0xFFFF | experimental extensions |
//!
//! `EndpointInfo` is: ip (u8 family tag 4 or 6, then 4 or 16 bytes), gpu_pci (u8 0 = none,
//! 1 = present then str16), channels u16, plugin_name str16, abi_version u8, chunk_bytes u32,
//! gpu_index (u8 0 = none, 1 = present then u32), spread u16, eager_bytes u32,
//! spread_two_sided u8 (0 / 1) (protocol version 2 added
//! `gpu_index` and the `Hello` secret, version 3 `spread`, version 4 `eager_bytes`; version 5
//! changed no message here, only eager frames: detached messages; version 6 added inline data
//! to `WriteRequest`, the inline flag to `ReadRequest` and `ReadInline`; version 7 changed no
//! message, only what inline operations may name: GPU memory; version 8
//! `spread_two_sided`; version 9 changed no message, only how large a packed transfer of host
//! memory may be).
//! A `str16` is a u16 byte length then UTF-8 bytes.
//!
//! Decoding checks every length against the bytes present before allocating, rejects
//! trailing bytes, and never panics.

use std::fmt;
use std::net::IpAddr;

use super::codec::{encode_frame, EncodeError, Frame, MAX_PAYLOAD, PROTOCOL_VERSION};
use super::rma::{read_blob, read_inline, read_refusal, write_blob, write_inline, write_refusal};
use super::rma::{ReadRequest, Refusal, WriteRequest};
use crate::wire::{Reader, TooLong, WireError, Writer};

/// Bytes in an ncclNet connect handle (`NCCL_NET_HANDLE_MAXSIZE`).
pub const HANDLE_BYTES: usize = 128;

/// One 128-byte listen handle, opaque to everyone but the plugin.
pub type ConnectHandle = [u8; HANDLE_BYTES];

// The type codes belong to the frame header (the codec reads them before any payload); they
// are re-exported here because every message is named by one.
pub use super::codec::MessageType;

/// An error code carried by [`Message::Error`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ErrorCode(pub u32);

impl ErrorCode {
    /// The peer sent something that breaks the protocol.
    pub const PROTOCOL: Self = Self(1);
    /// The two endpoints cannot work together (versions, chunk sizes, plugins…).
    pub const INCOMPATIBLE: Self = Self(2);
    /// The plugin failed on this side (listen, connect, accept).
    pub const PLUGIN: Self = Self(3);
    /// Anything else that went wrong on this side.
    pub const INTERNAL: Self = Self(4);
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match *self {
            Self::PROTOCOL => "protocol",
            Self::INCOMPATIBLE => "incompatible",
            Self::PLUGIN => "plugin",
            Self::INTERNAL => "internal",
            _ => "unknown",
        };
        write!(f, "{name} ({})", self.0)
    }
}

/// What one endpoint tells its peer (and what the out-of-band metadata carries).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointInfo {
    /// An address of this endpoint that the peer can reach. Loopback only when both ends are
    /// on one host; the caller chooses it.
    pub ip: IpAddr,
    /// PCI bus id of the GPU this endpoint serves (e.g. `0000:04:00.0`), if any.
    pub gpu_pci: Option<String>,
    /// Channels this endpoint opens to the peer.
    pub channels: u16,
    /// The plugin's name string (e.g. `GPUDirectTCPX_v7`).
    pub plugin_name: String,
    /// The ncclNet ABI version in use (6, 7 or 8).
    pub abi_version: u8,
    /// Chunk size this endpoint schedules with.
    pub chunk_bytes: u32,
    /// The GPU index this endpoint announces (`Config::gpu_index`), if any:
    /// an application-level label (e.g. a rank's local GPU), not checked against CUDA.
    pub gpu_index: Option<u32>,
    /// How many channels this side can drive at once (its engine threads, at most
    /// `channels`). A one-sided operation whose request asks for it is spread over the
    /// smaller of the two sides' values
    /// ([`Schedule::spread_over`](crate::schedule::Schedule::spread_over)); 1 keeps whole
    /// chunks.
    pub spread: u16,
    /// Largest two-sided message this side sends and receives through eager frames
    /// ([`crate::eager`]), at most [`crate::eager::EAGER_MAX_MESSAGE`]; 0: none. Both sides
    /// use the smaller value (0 if either is 0).
    pub eager_bytes: u32,
    /// Whether this side cuts its two-sided transfers smaller than `spread` chunks into
    /// pieces over the channels
    /// ([`Schedule::spread_over_floor`](crate::schedule::Schedule::spread_over_floor) with
    /// [`TWO_SIDED_SPREAD_FLOOR_BYTES`](crate::schedule::TWO_SIDED_SPREAD_FLOOR_BYTES)).
    /// Both sides cut a transfer alike, so a connection spreads them only when both say so.
    pub spread_two_sided: bool,
}

/// Bytes in a [`Secret`].
pub const SECRET_BYTES: usize = 16;

/// A random per-endpoint secret: carried in the endpoint's out-of-band
/// [`EndpointMetadata`](crate::metadata::EndpointMetadata) and presented back in the connecting side's
/// `Hello`, so that an endpoint with `Config::require_secret` only accepts
/// peers that were given its metadata. The runtime makes them (`control::random_secret`: this
/// crate does no IO). `Debug` does not print it, and comparison takes the
/// same time wherever the first difference lies.
#[derive(Clone, Copy, Eq)]
pub struct Secret([u8; SECRET_BYTES]);

impl Secret {
    /// The secret with these bytes.
    pub const fn from_bytes(bytes: [u8; SECRET_BYTES]) -> Self {
        Self(bytes)
    }

    /// Its bytes.
    pub const fn to_bytes(self) -> [u8; SECRET_BYTES] {
        self.0
    }

    pub(crate) fn write(&self, w: &mut Writer<'_>) {
        w.bytes(&self.0);
    }

    pub(crate) fn read(r: &mut Reader<'_>, field: &'static str) -> Result<Self, WireError> {
        Ok(Self(r.array::<SECRET_BYTES>(field)?))
    }
}

impl PartialEq for Secret {
    fn eq(&self, other: &Self) -> bool {
        // No early exit: a stranger must not learn how many leading bytes it guessed.
        self.0
            .iter()
            .zip(other.0.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(..)")
    }
}

fn write_optional_secret(w: &mut Writer<'_>, secret: &Option<Secret>) {
    match secret {
        None => w.u8(0),
        Some(s) => {
            w.u8(1);
            s.write(w);
        }
    }
}

fn read_optional_secret(r: &mut Reader<'_>) -> Result<Option<Secret>, WireError> {
    match r.u8("secret")? {
        0 => Ok(None),
        1 => Ok(Some(Secret::read(r, "secret")?)),
        _ => Err(WireError::Invalid {
            field: "secret",
            why: "presence flag is neither 0 nor 1",
        }),
    }
}

impl EndpointInfo {
    pub(crate) fn write(&self, w: &mut Writer<'_>) -> Result<(), TooLong> {
        w.ip(self.ip);
        match &self.gpu_pci {
            None => w.u8(0),
            Some(pci) => {
                w.u8(1);
                w.str16("gpu_pci", pci)?;
            }
        }
        w.u16(self.channels);
        w.str16("plugin_name", &self.plugin_name)?;
        w.u8(self.abi_version);
        w.u32(self.chunk_bytes);
        match self.gpu_index {
            None => w.u8(0),
            Some(g) => {
                w.u8(1);
                w.u32(g);
            }
        }
        w.u16(self.spread);
        w.u32(self.eager_bytes);
        w.u8(u8::from(self.spread_two_sided));
        Ok(())
    }

    pub(crate) fn read(r: &mut Reader<'_>) -> Result<Self, WireError> {
        let ip = r.ip("ip")?;
        let gpu_pci = match r.u8("gpu_pci")? {
            0 => None,
            1 => Some(r.str16("gpu_pci")?),
            _ => {
                return Err(WireError::Invalid {
                    field: "gpu_pci",
                    why: "presence flag is neither 0 nor 1",
                })
            }
        };
        let channels = r.u16("channels")?;
        let plugin_name = r.str16("plugin_name")?;
        let abi_version = r.u8("abi_version")?;
        let chunk_bytes = r.u32("chunk_bytes")?;
        let gpu_index = match r.u8("gpu_index")? {
            0 => None,
            1 => Some(r.u32("gpu_index")?),
            _ => {
                return Err(WireError::Invalid {
                    field: "gpu_index",
                    why: "presence flag is neither 0 nor 1",
                })
            }
        };
        let spread = r.u16("spread")?;
        let eager_bytes = r.u32("eager_bytes")?;
        if eager_bytes > crate::eager::EAGER_MAX_MESSAGE {
            return Err(WireError::Invalid {
                field: "eager_bytes",
                why: "larger than the eager path's largest message (64 KiB)",
            });
        }
        let spread_two_sided = match r.u8("spread_two_sided")? {
            0 => false,
            1 => true,
            _ => {
                return Err(WireError::Invalid {
                    field: "spread_two_sided",
                    why: "neither 0 nor 1",
                })
            }
        };
        Ok(Self {
            ip,
            gpu_pci,
            channels,
            plugin_name,
            abi_version,
            chunk_bytes,
            gpu_index,
            spread,
            eager_bytes,
            spread_two_sided,
        })
    }
}

/// A control-plane message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// First message in each direction: who this endpoint is.
    Hello {
        /// Highest protocol version the sender speaks.
        protocol_version: u16,
        /// The sender's endpoint description.
        endpoint: EndpointInfo,
        /// The connecting side presents the secret from the metadata of the endpoint it
        /// connects to; the accepting side sends none.
        secret: Option<Secret>,
    },
    /// The receiving side's listen handles, one per channel, in channel order.
    ConnectHandles {
        /// One 128-byte handle per channel.
        handles: Vec<ConnectHandle>,
    },
    /// The sender finished its part of the setup (its comms are connected / accepted).
    Ready,
    /// Orderly shutdown.
    Close {
        /// Why, for the peer's logs.
        reason: String,
    },
    /// The sender hit an error and will close.
    Error {
        /// What kind of error.
        code: ErrorCode,
        /// Human-readable detail.
        message: String,
    },
    /// The sender's segment lengths for a vectored transfer (see the runtime's `schedule`).
    Segments {
        /// Which transfer these segments describe.
        transfer_id: u64,
        /// Segment lengths in stream order.
        lens: Vec<u64>,
    },
    /// A one-sided write; the initiator queued the data before sending it (see
    /// the runtime's `onesided`).
    WriteRequest(WriteRequest),
    /// A one-sided read request.
    ReadRequest(ReadRequest),
    /// A standalone notification for the peer application.
    Notify {
        /// At most [`MAX_NOTIFICATION`](super::rma::MAX_NOTIFICATION) bytes.
        bytes: Vec<u8>,
    },
    /// The target's answer to a write once its data landed (or was discarded).
    WriteAck {
        /// The write's operation id.
        op_id: u64,
        /// `None`: the write is done; otherwise why it was refused.
        refusal: Option<Refusal>,
    },
    /// The target accepted a read and queued its data (the initiator queues its receive).
    ReadData {
        /// The read's operation id.
        op_id: u64,
        /// The data travels packed (one contiguous transfer; the initiator scatters it).
        packed: bool,
    },
    /// The target refused a read; no data follows.
    ReadRefused {
        /// The read's operation id.
        op_id: u64,
        /// Which entry and why.
        refusal: Refusal,
    },
    /// The target's answer to a read that asked for its data inline
    /// ([`ReadRequest::inline`](super::rma::ReadRequest::inline)): the data itself, in
    /// stream order; nothing follows on the one-sided comms.
    ReadInline {
        /// The read's operation id.
        op_id: u64,
        /// At most [`MAX_INLINE`](super::rma::MAX_INLINE) bytes.
        data: Vec<u8>,
    },
}

/// A frame whose payload does not decode as its message type.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed {kind:?} message: {source}")]
pub struct MessageError {
    /// The type the frame announced.
    pub kind: MessageType,
    /// What was wrong with its payload.
    #[source]
    pub source: WireError,
}

impl Message {
    /// A `Hello` at this crate's protocol version.
    pub fn hello(endpoint: EndpointInfo) -> Self {
        Self::hello_presenting(endpoint, None)
    }

    /// A `Hello` at this crate's protocol version that presents `secret` (the connecting
    /// side's, taken from the peer's metadata).
    pub fn hello_presenting(endpoint: EndpointInfo, secret: Option<Secret>) -> Self {
        Self::Hello {
            protocol_version: PROTOCOL_VERSION,
            endpoint,
            secret,
        }
    }

    /// The message's type code.
    pub fn kind(&self) -> MessageType {
        match self {
            Self::Hello { .. } => MessageType::Hello,
            Self::ConnectHandles { .. } => MessageType::ConnectHandles,
            Self::Ready => MessageType::Ready,
            Self::Close { .. } => MessageType::Close,
            Self::Error { .. } => MessageType::Error,
            Self::Segments { .. } => MessageType::Segments,
            Self::WriteRequest(_) => MessageType::WriteRequest,
            Self::ReadRequest(_) => MessageType::ReadRequest,
            Self::Notify { .. } => MessageType::Notify,
            Self::WriteAck { .. } => MessageType::WriteAck,
            Self::ReadData { .. } => MessageType::ReadData,
            Self::ReadRefused { .. } => MessageType::ReadRefused,
            Self::ReadInline { .. } => MessageType::ReadInline,
        }
    }

    /// Appends the message as one frame to `out` (unchanged on error).
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        encode_frame(out, self.kind(), MAX_PAYLOAD, |buf| self.write_payload(buf))
    }

    fn write_payload(&self, buf: &mut Vec<u8>) -> Result<(), TooLong> {
        let mut w = Writer(buf);
        match self {
            Self::Hello {
                protocol_version,
                endpoint,
                secret,
            } => {
                w.u16(*protocol_version);
                endpoint.write(&mut w)?;
                write_optional_secret(&mut w, secret);
            }
            Self::ConnectHandles { handles } => {
                let count = u16::try_from(handles.len()).map_err(|_| TooLong {
                    field: "handles",
                    len: handles.len(),
                    max: usize::from(u16::MAX),
                })?;
                w.u16(count);
                for h in handles {
                    w.bytes(h);
                }
            }
            Self::Ready => {}
            Self::Close { reason } => w.str16("reason", reason)?,
            Self::Error { code, message } => {
                w.u32(code.0);
                w.str16("message", message)?;
            }
            Self::Segments { transfer_id, lens } => {
                let count = u32::try_from(lens.len()).map_err(|_| TooLong {
                    field: "lens",
                    len: lens.len(),
                    max: u32::MAX as usize,
                })?;
                w.u64(*transfer_id);
                w.u32(count);
                for &len in lens {
                    w.u64(len);
                }
            }
            Self::WriteRequest(req) => req.write(&mut w)?,
            Self::ReadRequest(req) => req.write(&mut w)?,
            Self::Notify { bytes } => write_blob(&mut w, bytes)?,
            Self::WriteAck { op_id, refusal } => {
                w.u64(*op_id);
                match refusal {
                    None => w.u8(0),
                    Some(refusal) => {
                        w.u8(1);
                        write_refusal(&mut w, refusal);
                    }
                }
            }
            Self::ReadData { op_id, packed } => {
                w.u64(*op_id);
                w.u8(u8::from(*packed));
            }
            Self::ReadRefused { op_id, refusal } => {
                w.u64(*op_id);
                write_refusal(&mut w, refusal);
            }
            Self::ReadInline { op_id, data } => {
                w.u64(*op_id);
                write_inline(&mut w, data)?;
            }
        }
        Ok(())
    }

    /// Decodes a frame's payload as the message its type announces.
    pub fn decode(frame: &Frame) -> Result<Self, MessageError> {
        Self::read_payload(frame.kind, &frame.payload).map_err(|source| MessageError {
            kind: frame.kind,
            source,
        })
    }

    fn read_payload(kind: MessageType, payload: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(payload);
        let msg = match kind {
            MessageType::Hello => Self::Hello {
                protocol_version: r.u16("protocol_version")?,
                endpoint: EndpointInfo::read(&mut r)?,
                secret: read_optional_secret(&mut r)?,
            },
            MessageType::ConnectHandles => {
                let count = usize::from(r.u16("handles")?);
                // Check the bytes are there before reserving room for them.
                if count * HANDLE_BYTES != r.remaining() {
                    return Err(WireError::Invalid {
                        field: "handles",
                        why: "count does not match the payload length",
                    });
                }
                let mut handles = Vec::with_capacity(count);
                for _ in 0..count {
                    handles.push(r.array::<HANDLE_BYTES>("handles")?);
                }
                Self::ConnectHandles { handles }
            }
            MessageType::Ready => Self::Ready,
            MessageType::Close => Self::Close {
                reason: r.str16("reason")?,
            },
            MessageType::Error => Self::Error {
                code: ErrorCode(r.u32("code")?),
                message: r.str16("message")?,
            },
            MessageType::Segments => {
                let transfer_id = r.u64("transfer_id")?;
                let count = r.u32("lens")? as usize;
                if count.checked_mul(8) != Some(r.remaining()) {
                    return Err(WireError::Invalid {
                        field: "lens",
                        why: "count does not match the payload length",
                    });
                }
                let mut lens = Vec::with_capacity(count);
                for _ in 0..count {
                    lens.push(r.u64("lens")?);
                }
                Self::Segments { transfer_id, lens }
            }
            MessageType::WriteRequest => Self::WriteRequest(WriteRequest::read(&mut r)?),
            MessageType::ReadRequest => Self::ReadRequest(ReadRequest::read(&mut r)?),
            MessageType::Notify => Self::Notify {
                bytes: read_blob(&mut r)?,
            },
            MessageType::WriteAck => {
                let op_id = r.u64("op_id")?;
                let refusal = match r.u8("status")? {
                    0 => None,
                    1 => Some(read_refusal(&mut r)?),
                    _ => {
                        return Err(WireError::Invalid {
                            field: "status",
                            why: "neither 0 (done) nor 1 (refused)",
                        })
                    }
                };
                Self::WriteAck { op_id, refusal }
            }
            MessageType::ReadData => Self::ReadData {
                op_id: r.u64("op_id")?,
                packed: match r.u8("packed")? {
                    0 => false,
                    1 => true,
                    _ => {
                        return Err(WireError::Invalid {
                            field: "packed",
                            why: "neither 0 nor 1",
                        })
                    }
                },
            },
            MessageType::ReadRefused => Self::ReadRefused {
                op_id: r.u64("op_id")?,
                refusal: read_refusal(&mut r)?,
            },
            MessageType::ReadInline => Self::ReadInline {
                op_id: r.u64("op_id")?,
                data: read_inline(&mut r)?,
            },
        };
        r.finish()?;
        Ok(msg)
    }
}

#[cfg(test)]
mod tests {
    const SEED: [u8; super::SECRET_BYTES] = [7; super::SECRET_BYTES];
    use super::*;
    use crate::control::codec::Decoder;
    use std::net::Ipv4Addr;

    fn roundtrip(msg: &Message) -> Message {
        let mut wire = Vec::new();
        msg.encode(&mut wire).unwrap();
        let mut input = &wire[..];
        let frame = Decoder::new().decode(&mut input).unwrap().unwrap();
        assert!(input.is_empty());
        Message::decode(&frame).unwrap()
    }

    fn info() -> EndpointInfo {
        EndpointInfo {
            ip: IpAddr::V4(Ipv4Addr::new(10, 0, 1, 2)),
            gpu_pci: Some("0000:04:00.0".into()),
            channels: 8,
            plugin_name: "GPUDirectTCPX_v7".into(),
            abi_version: 7,
            chunk_bytes: 512 << 10,
            gpu_index: Some(3),
            spread: 8,
            eager_bytes: 0,
            spread_two_sided: true,
        }
    }

    #[test]
    fn hello_round_trips() {
        let msg = Message::hello(info());
        assert_eq!(roundtrip(&msg), msg);
        let secret = Secret::from_bytes(SEED);
        let msg = Message::hello_presenting(
            EndpointInfo {
                gpu_index: None,
                ..info()
            },
            Some(secret),
        );
        assert_eq!(roundtrip(&msg), msg);
    }

    #[test]
    fn the_two_sided_spread_flag_is_zero_or_one() {
        let msg = Message::hello(EndpointInfo {
            spread_two_sided: false,
            ..info()
        });
        assert_eq!(roundtrip(&msg), msg);
        let mut wire = Vec::new();
        msg.encode(&mut wire).unwrap();
        let mut input = &wire[..];
        let mut frame = Decoder::new().decode(&mut input).unwrap().unwrap();
        // The payload ends with the flag, then the secret's presence byte (none).
        let at = frame.payload.len() - 2;
        assert_eq!(frame.payload[at..], [0, 0]);
        frame.payload[at] = 2;
        let err = Message::decode(&frame).unwrap_err();
        assert!(
            matches!(
                err.source,
                WireError::Invalid {
                    field: "spread_two_sided",
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn secrets_are_random_compare_by_value_and_stay_out_of_logs() {
        let (a, b) = (
            Secret::from_bytes(SEED),
            Secret::from_bytes([9; SECRET_BYTES]),
        );
        assert_ne!(a, b);
        assert_eq!(a, Secret::from_bytes(a.to_bytes()));
        assert_eq!(format!("{a:?}"), "Secret(..)");
    }

    #[test]
    fn connect_handles_round_trip() {
        let msg = Message::ConnectHandles {
            handles: vec![[7; HANDLE_BYTES], [9; HANDLE_BYTES]],
        };
        assert_eq!(roundtrip(&msg), msg);
    }

    #[test]
    fn handle_count_must_match_payload() {
        let frame = Frame {
            version: PROTOCOL_VERSION,
            kind: MessageType::ConnectHandles,
            payload: vec![2, 0, 1, 2, 3],
        };
        let err = Message::decode(&frame).unwrap_err();
        assert_eq!(err.kind, MessageType::ConnectHandles);
        assert!(err.to_string().contains("handles"));
    }

    #[test]
    fn trailing_bytes_are_refused() {
        let frame = Frame {
            version: PROTOCOL_VERSION,
            kind: MessageType::Ready,
            payload: vec![0],
        };
        assert_eq!(
            Message::decode(&frame).unwrap_err().source,
            WireError::TrailingBytes(1)
        );
    }

    #[test]
    fn oversized_message_is_not_encoded() {
        let msg = Message::Segments {
            transfer_id: 1,
            lens: vec![1; (MAX_PAYLOAD as usize) / 8],
        };
        let mut wire = vec![0xAA];
        assert!(matches!(
            msg.encode(&mut wire),
            Err(EncodeError::PayloadTooLong { .. })
        ));
        assert_eq!(wire, [0xAA]);
    }

    #[test]
    fn every_type_code_is_distinct_and_not_reserved() {
        for t in MessageType::ALL {
            assert_eq!(MessageType::from_code(t.code()), Some(t));
            assert_eq!(MessageType::reserved_name(t.code()), None);
        }
    }
}
