//! Shared checks of the fuzz targets: each decoder must answer a value or an error for any
//! input (a panic is a finding), and what it answers must survive encode -> decode unchanged.

use tcpx_proto::control::codec::{Decoder, Frame, MessageType};
use tcpx_proto::control::message::Message;

/// Decodes `frame` as a message; an `Ok` must re-encode and decode to itself.
pub fn message_round_trip(frame: &Frame) {
    if let Ok(message) = Message::decode(frame) {
        let mut wire = Vec::new();
        message
            .encode(&mut wire)
            .expect("a decoded message re-encodes");
        let mut decoder = Decoder::new();
        let mut input = wire.as_slice();
        let again = decoder
            .decode(&mut input)
            .expect("its frame decodes")
            .expect("and is whole");
        assert_eq!(Message::decode(&again).expect("and decodes"), message);
    }
}

/// A frame of type `code` (when it is one) around `payload`.
pub fn frame(code: u16, payload: &[u8]) -> Option<Frame> {
    Some(Frame {
        version: tcpx_proto::control::codec::PROTOCOL_VERSION,
        kind: MessageType::from_code(code)?,
        payload: payload.to_vec(),
    })
}
