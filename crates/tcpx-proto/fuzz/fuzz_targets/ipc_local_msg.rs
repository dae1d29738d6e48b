//! A frame body of the local (same-host) protocol, as a peer process sends it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tcpx_proto::ipc::wire::{Msg, MAX_FRAME};

fuzz_target!(|data: &[u8]| {
    if data.len() > MAX_FRAME {
        return;
    }
    if let Ok(m) = Msg::decode(data) {
        let frame = m.encode();
        assert!(frame.len() <= 4 + MAX_FRAME);
        assert_eq!(
            Msg::decode(&frame[4..]).expect("re-encoded message decodes"),
            m
        );
    }
});
