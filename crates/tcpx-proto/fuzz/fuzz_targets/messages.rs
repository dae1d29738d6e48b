//! Message payloads straight to the message decoder (past the framing): the first two bytes
//! pick the message type, the rest is the payload.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let code = u16::from_le_bytes([data[0], data[1]]);
    if let Some(frame) = tcpx_proto_fuzz::frame(code, &data[2..]) {
        tcpx_proto_fuzz::message_round_trip(&frame);
    }
});
