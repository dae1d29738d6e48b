//! An eager frame as a peer's eager comm delivers it: any bytes, any agreed eager size (the
//! first four bytes pick it); a frame that decodes must tile a prefix of its bytes with its
//! inline messages, and its detached messages (at most `EAGER_MAX_DETACHED`) come after them.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tcpx_proto::eager::{decode, header_len, EAGER_MAX_DETACHED, EAGER_MAX_MESSAGE};

fuzz_target!(|data: &[u8]| {
    let Some((max, frame)) = data.split_first_chunk::<4>() else {
        return;
    };
    let max = u32::from_le_bytes(*max) % EAGER_MAX_MESSAGE + 1;
    let mut out = Vec::new();
    if let Ok(end) = decode(frame, max, &mut out) {
        let mut at = header_len(out.len());
        let mut detached = 0;
        for m in &out {
            assert!(m.entry.len >= 1 && m.entry.len <= max);
            if m.entry.detached {
                assert_eq!(m.offset, 0);
                detached += 1;
                continue;
            }
            assert_eq!(detached, 0, "an inline message after a detached one");
            assert_eq!(m.offset, at);
            at += m.entry.len as usize;
        }
        assert!(detached <= EAGER_MAX_DETACHED);
        assert_eq!(at, end);
        assert!(end <= frame.len());
    }
});
