//! The control stream as a peer sends it: bytes fed to the frame decoder in pieces (the first
//! byte picks the piece size), every whole frame decoded as a message and round-tripped.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tcpx_proto::control::codec::Decoder;

fuzz_target!(|data: &[u8]| {
    let Some((&step, rest)) = data.split_first() else {
        return;
    };
    let step = usize::from(step).max(1);
    // A cap of 64 KiB: no input may make the decoder hold more than that.
    let mut decoder = Decoder::with_max_payload(64 << 10);
    for piece in rest.chunks(step) {
        let mut input = piece;
        loop {
            match decoder.decode(&mut input) {
                Ok(Some(frame)) => tcpx_proto_fuzz::message_round_trip(&frame),
                Ok(None) => break,
                Err(_) => return,
            }
            assert!(decoder.reserved_bytes() <= (64 << 10) + 64);
        }
    }
    let _ = decoder.finish();
});
