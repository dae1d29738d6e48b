//! Endpoint metadata as it arrives out of band (bytes, and the hex form users paste).
#![no_main]

use libfuzzer_sys::fuzz_target;
use tcpx_proto::metadata::EndpointMetadata;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = EndpointMetadata::from_bytes(data) {
        let bytes = m.to_bytes().expect("decoded metadata re-encodes");
        let again = EndpointMetadata::from_bytes(&bytes).expect("and decodes");
        assert_eq!(again.control_addr, m.control_addr);
        assert_eq!(again.info, m.info);
        assert_eq!(again.secret.to_bytes(), m.secret.to_bytes());
    }
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = EndpointMetadata::from_hex(text);
    }
});
