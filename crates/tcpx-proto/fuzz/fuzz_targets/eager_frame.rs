//! An eager frame as a peer's eager comm delivers it: any bytes, any agreed eager size (the
//! first four bytes pick it); a frame that decodes must tile a prefix of its bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tcpx_proto::eager::{decode, header_len, EAGER_MAX_MESSAGE};

fuzz_target!(|data: &[u8]| {
    let Some((max, frame)) = data.split_first_chunk::<4>() else {
        return;
    };
    let max = u32::from_le_bytes(*max) % EAGER_MAX_MESSAGE + 1;
    let mut out = Vec::new();
    if let Ok(end) = decode(frame, max, &mut out) {
        let mut at = header_len(out.len());
        for m in &out {
            assert_eq!(m.offset, at);
            assert!(m.entry.len >= 1 && m.entry.len <= max);
            at += m.entry.len as usize;
        }
        assert_eq!(at, end);
        assert!(end <= frame.len());
    }
});
