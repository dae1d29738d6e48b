//! Framing of the control protocol (sans-IO).
//!
//! Every message travels in one frame:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `b"TXCP"` |
//! | 4 | 2 | protocol version (u16 LE), currently [`PROTOCOL_VERSION`] |
//! | 6 | 2 | message type (u16 LE), see [`MessageType`] |
//! | 8 | 4 | payload length (u32 LE), at most the cap ([`MAX_PAYLOAD`] by default) |
//! | 12 | len | payload |
//!
//! [`Decoder`] is fed bytes as they arrive and yields whole frames. It validates the header
//! before reserving anything, so a hostile length can never make it allocate more than the
//! cap, and after the first error it refuses all further input (the stream cannot be
//! resynchronised).

use crate::wire::TooLong;

/// The message type codes of the protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum MessageType {
    /// [`Message::Hello`](super::message::Message::Hello).
    Hello = 0x0001,
    /// [`Message::ConnectHandles`](super::message::Message::ConnectHandles).
    ConnectHandles = 0x0002,
    /// [`Message::Ready`](super::message::Message::Ready).
    Ready = 0x0003,
    /// [`Message::Close`](super::message::Message::Close).
    Close = 0x0004,
    /// [`Message::Error`](super::message::Message::Error).
    Error = 0x0005,
    /// [`Message::Segments`](super::message::Message::Segments).
    Segments = 0x0006,
    /// [`Message::WriteRequest`](super::message::Message::WriteRequest).
    WriteRequest = 0x0100,
    /// [`Message::ReadRequest`](super::message::Message::ReadRequest).
    ReadRequest = 0x0101,
    /// [`Message::Notify`](super::message::Message::Notify).
    Notify = 0x0102,
    /// [`Message::WriteAck`](super::message::Message::WriteAck).
    WriteAck = 0x0103,
    /// [`Message::ReadData`](super::message::Message::ReadData).
    ReadData = 0x0104,
    /// [`Message::ReadRefused`](super::message::Message::ReadRefused).
    ReadRefused = 0x0105,
    /// [`Message::ReadInline`](super::message::Message::ReadInline) (protocol version 6).
    ReadInline = 0x0106,
}

impl MessageType {
    /// Every type this version defines.
    pub const ALL: [MessageType; 13] = [
        Self::Hello,
        Self::ConnectHandles,
        Self::Ready,
        Self::Close,
        Self::Error,
        Self::Segments,
        Self::WriteRequest,
        Self::ReadRequest,
        Self::Notify,
        Self::WriteAck,
        Self::ReadData,
        Self::ReadRefused,
        Self::ReadInline,
    ];

    /// The wire code.
    pub fn code(self) -> u16 {
        self as u16
    }

    /// The type with wire code `code`, if this version defines it.
    pub fn from_code(code: u16) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.code() == code)
    }

    /// What a code reserved for later versions is set aside for (`None` if not reserved).
    pub fn reserved_name(code: u16) -> Option<&'static str> {
        match code {
            0x0107..=0x01FF => Some("one-sided operation"),
            0xF000..=0xFFFF => Some("experimental extension"),
            _ => None,
        }
    }
}

/// First four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"TXCP";

/// The protocol version this crate speaks (and the only one it accepts). Version 5: eager
/// frames may carry detached messages ([`crate::eager::DETACHED`]), which a version 4 peer
/// would refuse mid-stream; the handshake refuses it instead. Version 6: a `WriteRequest` may
/// carry its data inline ([`crate::control::rma::WriteRequest::inline`]), and a read be answered
/// with its data (`ReadInline`), likewise. Version 7: inline operations may name GPU memory on
/// the target (a version 6 target refuses them with `UnsupportedMemory`, failing operations
/// that a version 7 initiator sends inline); the handshake refuses the mix instead. Version 8:
/// `EndpointInfo` says whether a side spreads two-sided transfers, and two connected sides that
/// both do cut them finer (a version 7 peer would cut the same transfer differently). Version
/// 9: a packed one-sided transfer into or out of host memory may carry up to 64 MiB (several
/// pack buffers), where a version 8 target takes more than 4 MiB as a protocol violation and
/// fails the connection mid-stream; the handshake refuses the mix instead.
pub const PROTOCOL_VERSION: u16 = 9;

/// Bytes in a frame header.
pub const HEADER_LEN: usize = 12;

/// Default hard cap on a frame's payload: 1 MiB.
pub const MAX_PAYLOAD: u32 = 1 << 20;

/// A malformed or unacceptable frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    /// The stream does not start with [`MAGIC`]: the peer is not speaking this protocol.
    #[error("bad magic {found:02x?} (expected {MAGIC:02x?}): the peer does not speak the tcpx control protocol")]
    BadMagic {
        /// The four bytes found instead.
        found: [u8; 4],
    },
    /// A protocol version this side does not speak.
    #[error("unsupported protocol version {found} (this side speaks version {PROTOCOL_VERSION})")]
    UnsupportedVersion {
        /// The version in the frame.
        found: u16,
    },
    /// A message type this version does not define.
    #[error("unknown message type {code:#06x}")]
    UnknownType {
        /// The type code in the frame.
        code: u16,
    },
    /// A type reserved for a later feature, not supported by this version.
    #[error("message type {code:#06x} ({name}) is reserved and not supported by protocol version {PROTOCOL_VERSION}")]
    UnsupportedType {
        /// The type code in the frame.
        code: u16,
        /// What the code is reserved for.
        name: &'static str,
    },
    /// The header announces a payload over the cap.
    #[error("frame payload of {len} bytes exceeds the cap of {max} bytes")]
    TooLong {
        /// The announced length.
        len: u32,
        /// The cap.
        max: u32,
    },
    /// The stream ended inside a frame.
    #[error("stream ended inside a frame: got {got} of {expected} bytes")]
    Truncated {
        /// Bytes of the frame (header + payload) expected; for a partial header, the header.
        expected: usize,
        /// Bytes received.
        got: usize,
    },
}

/// A message could not be encoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    /// A field does not fit its length prefix.
    #[error(transparent)]
    FieldTooLong(#[from] TooLong),
    /// The whole payload exceeds the frame cap.
    #[error("message payload of {len} bytes exceeds the frame cap of {max} bytes")]
    PayloadTooLong {
        /// Payload length.
        len: usize,
        /// The cap.
        max: u32,
    },
}

/// A validated frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// Protocol version of the frame.
    pub version: u16,
    /// Message type.
    pub kind: MessageType,
    /// Payload length, within the cap.
    pub len: u32,
}

impl FrameHeader {
    /// Validates a raw header against `max_payload`.
    pub fn parse(raw: &[u8; HEADER_LEN], max_payload: u32) -> Result<Self, CodecError> {
        let [m0, m1, m2, m3, v0, v1, t0, t1, l0, l1, l2, l3] = *raw;
        let magic = [m0, m1, m2, m3];
        if magic != MAGIC {
            return Err(CodecError::BadMagic { found: magic });
        }
        let version = u16::from_le_bytes([v0, v1]);
        if version != PROTOCOL_VERSION {
            return Err(CodecError::UnsupportedVersion { found: version });
        }
        let code = u16::from_le_bytes([t0, t1]);
        let kind = match MessageType::from_code(code) {
            Some(kind) => kind,
            None => {
                return Err(match MessageType::reserved_name(code) {
                    Some(name) => CodecError::UnsupportedType { code, name },
                    None => CodecError::UnknownType { code },
                })
            }
        };
        let len = u32::from_le_bytes([l0, l1, l2, l3]);
        if len > max_payload {
            return Err(CodecError::TooLong {
                len,
                max: max_payload,
            });
        }
        Ok(Self { version, kind, len })
    }
}

/// One whole frame: header fields and payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// Protocol version of the frame.
    pub version: u16,
    /// Message type.
    pub kind: MessageType,
    /// The payload, exactly as long as the header said.
    pub payload: Vec<u8>,
}

/// Writes one frame of type `kind` to `out`: the header, then whatever `payload` appends.
/// On error `out` is left as it was.
pub(crate) fn encode_frame(
    out: &mut Vec<u8>,
    kind: MessageType,
    max_payload: u32,
    payload: impl FnOnce(&mut Vec<u8>) -> Result<(), TooLong>,
) -> Result<(), EncodeError> {
    let start = out.len();
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    out.extend_from_slice(&kind.code().to_le_bytes());
    out.extend_from_slice(&[0; 4]); // length, patched below
    let body = start + HEADER_LEN;
    if let Err(e) = payload(out) {
        out.truncate(start);
        return Err(e.into());
    }
    let len = out.len() - body;
    match u32::try_from(len) {
        Ok(len32) if len32 <= max_payload => {
            out[body - 4..body].copy_from_slice(&len32.to_le_bytes());
            Ok(())
        }
        _ => {
            out.truncate(start);
            Err(EncodeError::PayloadTooLong {
                len,
                max: max_payload,
            })
        }
    }
}

/// Incremental frame decoder: feed it bytes, get frames.
///
/// ```
/// use tcpx_proto::control::codec::Decoder;
/// use tcpx_proto::control::message::Message;
///
/// let mut wire = Vec::new();
/// Message::Ready.encode(&mut wire).unwrap();
///
/// let mut decoder = Decoder::new();
/// let (first, rest) = wire.split_at(5);
/// let mut input = first;
/// assert_eq!(decoder.decode(&mut input).unwrap(), None); // header incomplete
/// let mut input = rest;
/// let frame = decoder.decode(&mut input).unwrap().unwrap();
/// assert_eq!(Message::decode(&frame).unwrap(), Message::Ready);
/// assert!(decoder.finish().is_ok());
/// ```
#[derive(Debug, Clone)]
pub struct Decoder {
    max_payload: u32,
    header: [u8; HEADER_LEN],
    header_len: usize,
    /// Set once the header of the current frame is complete and valid.
    current: Option<FrameHeader>,
    payload: Vec<u8>,
    /// The first error; the decoder refuses further input after it.
    error: Option<CodecError>,
}

impl Default for Decoder {
    fn default() -> Self {
        Self::new()
    }
}

impl Decoder {
    /// A decoder with the default cap of [`MAX_PAYLOAD`].
    pub fn new() -> Self {
        Self::with_max_payload(MAX_PAYLOAD)
    }

    /// A decoder that refuses payloads over `max_payload` bytes.
    pub fn with_max_payload(max_payload: u32) -> Self {
        Self {
            max_payload,
            header: [0; HEADER_LEN],
            header_len: 0,
            current: None,
            payload: Vec::new(),
            error: None,
        }
    }

    /// The payload cap.
    pub fn max_payload(&self) -> u32 {
        self.max_payload
    }

    /// Consumes bytes from the front of `input` until one frame is complete (returned, with
    /// `input` advanced past it) or `input` is exhausted (`Ok(None)`; the partial frame is kept
    /// for the next call). After an error every later call returns the same error.
    pub fn decode(&mut self, input: &mut &[u8]) -> Result<Option<Frame>, CodecError> {
        if let Some(e) = &self.error {
            return Err(e.clone());
        }
        let header = match self.current {
            Some(h) => h,
            None => {
                let want = HEADER_LEN - self.header_len;
                let n = want.min(input.len());
                let (head, rest) = input.split_at(n);
                self.header[self.header_len..self.header_len + n].copy_from_slice(head);
                self.header_len += n;
                *input = rest;
                if self.header_len < HEADER_LEN {
                    return Ok(None);
                }
                match FrameHeader::parse(&self.header, self.max_payload) {
                    Ok(h) => {
                        // The length is within the cap: this is the only allocation.
                        self.payload = Vec::with_capacity(h.len as usize);
                        self.current = Some(h);
                        h
                    }
                    Err(e) => {
                        self.error = Some(e.clone());
                        return Err(e);
                    }
                }
            }
        };
        let want = header.len as usize - self.payload.len();
        let n = want.min(input.len());
        let (head, rest) = input.split_at(n);
        self.payload.extend_from_slice(head);
        *input = rest;
        if self.payload.len() < header.len as usize {
            return Ok(None);
        }
        self.current = None;
        self.header_len = 0;
        Ok(Some(Frame {
            version: header.version,
            kind: header.kind,
            payload: std::mem::take(&mut self.payload),
        }))
    }

    /// Call at end of stream: fails if it ended inside a frame (or after an error).
    pub fn finish(&self) -> Result<(), CodecError> {
        if let Some(e) = &self.error {
            return Err(e.clone());
        }
        match self.current {
            Some(h) => Err(CodecError::Truncated {
                expected: HEADER_LEN + h.len as usize,
                got: HEADER_LEN + self.payload.len(),
            }),
            None if self.header_len > 0 => Err(CodecError::Truncated {
                expected: HEADER_LEN,
                got: self.header_len,
            }),
            None => Ok(()),
        }
    }

    /// Part of a frame has been fed and not yet returned.
    pub fn is_mid_frame(&self) -> bool {
        self.current.is_some() || self.header_len > 0
    }

    /// Bytes the decoder holds reserved for the frame in progress; never more than the cap.
    pub fn reserved_bytes(&self) -> usize {
        self.payload.capacity()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(magic: [u8; 4], version: u16, code: u16, len: u32) -> Vec<u8> {
        let mut h = magic.to_vec();
        h.extend_from_slice(&version.to_le_bytes());
        h.extend_from_slice(&code.to_le_bytes());
        h.extend_from_slice(&len.to_le_bytes());
        h
    }

    fn decode_all(bytes: &[u8]) -> Result<Option<Frame>, CodecError> {
        let mut input = bytes;
        Decoder::new().decode(&mut input)
    }

    #[test]
    fn wrong_magic_is_reported() {
        let err = decode_all(&header(*b"HTTP", PROTOCOL_VERSION, 3, 0)).unwrap_err();
        assert_eq!(err, CodecError::BadMagic { found: *b"HTTP" });
        assert!(err.to_string().contains("does not speak"));
    }

    #[test]
    fn other_versions_are_refused() {
        for other in [1, PROTOCOL_VERSION + 1, u16::MAX] {
            let err = decode_all(&header(MAGIC, other, 3, 0)).unwrap_err();
            assert_eq!(err, CodecError::UnsupportedVersion { found: other });
        }
    }

    #[test]
    fn unknown_and_reserved_types_are_refused() {
        let err = decode_all(&header(MAGIC, PROTOCOL_VERSION, 0x7777, 0)).unwrap_err();
        assert_eq!(err, CodecError::UnknownType { code: 0x7777 });
        let err = decode_all(&header(MAGIC, PROTOCOL_VERSION, 0x0107, 0)).unwrap_err();
        assert!(matches!(
            err,
            CodecError::UnsupportedType { code: 0x0107, .. }
        ));
    }

    #[test]
    fn length_over_cap_is_refused_before_allocating() {
        let mut decoder = Decoder::with_max_payload(16);
        let bytes = header(MAGIC, PROTOCOL_VERSION, 3, 17);
        let mut input = &bytes[..];
        let err = decoder.decode(&mut input).unwrap_err();
        assert_eq!(err, CodecError::TooLong { len: 17, max: 16 });
        assert_eq!(decoder.reserved_bytes(), 0);
    }

    #[test]
    fn decoder_stays_failed_after_an_error() {
        let mut decoder = Decoder::new();
        let bad = header(*b"XXXX", PROTOCOL_VERSION, 3, 0);
        let mut input = &bad[..];
        assert!(decoder.decode(&mut input).is_err());
        let good = header(MAGIC, PROTOCOL_VERSION, 3, 0);
        let mut input = &good[..];
        assert_eq!(
            decoder.decode(&mut input).unwrap_err(),
            CodecError::BadMagic { found: *b"XXXX" }
        );
    }

    #[test]
    fn end_of_stream_inside_a_frame_is_truncation() {
        let mut bytes = header(MAGIC, PROTOCOL_VERSION, 4, 8);
        bytes.extend_from_slice(&[1, 2, 3]);
        let mut decoder = Decoder::new();
        let mut input = &bytes[..];
        assert_eq!(decoder.decode(&mut input).unwrap(), None);
        assert!(decoder.is_mid_frame());
        assert_eq!(
            decoder.finish().unwrap_err(),
            CodecError::Truncated {
                expected: 20,
                got: 15
            }
        );
    }

    #[test]
    fn two_frames_in_one_read_are_both_returned() {
        let mut bytes = header(MAGIC, PROTOCOL_VERSION, 3, 0);
        bytes.extend(header(MAGIC, PROTOCOL_VERSION, 3, 0));
        let mut decoder = Decoder::new();
        let mut input = &bytes[..];
        assert!(decoder.decode(&mut input).unwrap().is_some());
        assert_eq!(input.len(), HEADER_LEN);
        assert!(decoder.decode(&mut input).unwrap().is_some());
        assert!(input.is_empty());
    }
}
