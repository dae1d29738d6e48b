//! The local protocol's frames on the socket: [`read_msg`] reads one (blocking, bounded);
//! the messages and their bytes are `tcpx-proto`'s (`tcpx_proto::ipc::wire`, fuzzed there),
//! re-exported here.

use std::io::Read;

pub use tcpx_proto::ipc::wire::{Hello, Msg, LOCAL_PROTOCOL_VERSION, MAX_FRAME, MAX_REASON};
use tcpx_proto::wire::WireError;

/// Why no message could be read.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The stream ended cleanly between two frames.
    #[error("the connection was closed")]
    Closed,
    /// Reading failed (including a read timeout, `WouldBlock` / `TimedOut`).
    #[error("reading: {0}")]
    Io(#[from] std::io::Error),
    /// The length prefix is 0 or above [`MAX_FRAME`].
    #[error("frame length {0} outside 1..={MAX_FRAME}")]
    Length(u32),
    /// The body is not a message.
    #[error("malformed message: {0}")]
    Malformed(#[from] WireError),
}

/// Reads one frame from `stream` and decodes it. Never reads past the frame, never
/// allocates more than [`MAX_FRAME`].
pub fn read_msg(stream: &mut impl Read) -> Result<Msg, FrameError> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match stream.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Err(FrameError::Closed),
            Ok(0) => {
                return Err(FrameError::Io(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "the stream ended inside a frame header",
                )))
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    let len = u32::from_le_bytes(len);
    if len == 0 || len as usize > MAX_FRAME {
        return Err(FrameError::Length(len));
    }
    let mut body = [0u8; MAX_FRAME];
    let body = &mut body[..len as usize];
    stream.read_exact(body)?;
    Ok(Msg::decode(body)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use tcpx::cuda::IpcMemHandle;

    fn hello() -> Hello {
        Hello {
            version: LOCAL_PROTOCOL_VERSION,
            pid: 42,
            instance: 7,
            boot_id: [9; 16],
            gpu_ordinal: Some(1),
            gpu_bus: Some("0000:8a:00.0".into()),
            hostname: "host".into(),
        }
    }

    fn all() -> Vec<Msg> {
        vec![
            Msg::Hello(hello()),
            Msg::Hello(Hello {
                gpu_ordinal: None,
                gpu_bus: None,
                ..hello()
            }),
            Msg::Validate {
                req: 1,
                key: 2,
                handle: IpcMemHandle::from_bytes([3; 64]),
                offset: 4,
                len: 5,
            },
            Msg::Granted { req: 6 },
            Msg::Refused {
                req: 7,
                reason: "revoked".into(),
            },
            Msg::Revoke { req: 8, key: 9 },
            Msg::RevokeAck { req: 10 },
            Msg::Goodbye {
                req: 11,
                reason: "bye".into(),
            },
            Msg::GoodbyeAck { req: 12 },
        ]
    }

    #[test]
    fn every_message_round_trips_through_a_stream() {
        let msgs = all();
        let stream: Vec<u8> = msgs.iter().flat_map(Msg::encode).collect();
        let mut cursor = std::io::Cursor::new(stream);
        for m in &msgs {
            assert_eq!(&read_msg(&mut cursor).unwrap(), m);
        }
        assert!(matches!(read_msg(&mut cursor), Err(FrameError::Closed)));
    }

    #[test]
    fn bad_frames_are_errors() {
        let mut zero = std::io::Cursor::new(vec![0, 0, 0, 0]);
        assert!(matches!(read_msg(&mut zero), Err(FrameError::Length(0))));
        let mut huge = std::io::Cursor::new(u32::MAX.to_le_bytes().to_vec());
        assert!(matches!(read_msg(&mut huge), Err(FrameError::Length(_))));
        let mut cut = std::io::Cursor::new(vec![9, 0]);
        assert!(matches!(read_msg(&mut cut), Err(FrameError::Io(_))));
        let mut unknown = std::io::Cursor::new(vec![1, 0, 0, 0, 99]);
        assert!(matches!(
            read_msg(&mut unknown),
            Err(FrameError::Malformed(_))
        ));
        // A trailing byte after a valid message.
        let mut frame = Msg::Granted { req: 1 }.encode();
        frame.push(0);
        frame[0] += 1;
        assert!(matches!(
            read_msg(&mut std::io::Cursor::new(frame)),
            Err(FrameError::Malformed(WireError::TrailingBytes(1)))
        ));
    }

    #[test]
    fn long_reasons_are_clipped_not_refused() {
        let m = Msg::Refused {
            req: 1,
            reason: "é".repeat(2000),
        };
        let frame = m.encode();
        match read_msg(&mut std::io::Cursor::new(frame)).unwrap() {
            Msg::Refused { reason, .. } => assert!(reason.len() <= MAX_REASON),
            other => panic!("{other:?}"),
        }
    }

    proptest! {
        /// Any bytes at all: messages or an error, never a panic or a read past the input.
        #[test]
        fn any_stream_reads_or_fails(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let mut cursor = std::io::Cursor::new(bytes);
            for _ in 0..64 {
                if read_msg(&mut cursor).is_err() {
                    break;
                }
            }
        }

        #[test]
        fn any_body_decodes_or_fails(body in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = Msg::decode(&body);
        }

        /// A valid type byte followed by random payload.
        #[test]
        fn random_payload_behind_each_type(t in 1u8..=8, payload in proptest::collection::vec(any::<u8>(), 0..120)) {
            let mut body = vec![t];
            body.extend(payload);
            if let Ok(m) = Msg::decode(&body) {
                prop_assert_eq!(Msg::decode(&m.encode()[4..]).unwrap(), m);
            }
        }

        #[test]
        fn requests_round_trip(req in any::<u64>(), key in any::<u64>(), h in any::<[u8; 32]>(),
                               offset in any::<u64>(), len in any::<u64>(), reason in ".{0,80}") {
            let mut handle = [0u8; 64];
            handle[..32].copy_from_slice(&h);
            for m in [
                Msg::Validate { req, key, handle: IpcMemHandle::from_bytes(handle), offset, len },
                Msg::Refused { req, reason: reason.clone() },
                Msg::Goodbye { req, reason },
                Msg::Revoke { req, key },
            ] {
                prop_assert_eq!(Msg::decode(&m.encode()[4..]).unwrap(), m);
            }
        }
    }
}
