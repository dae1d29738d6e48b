//! The same-host info peers exchange (the NIXL plugin carries it in its connection info).
#![no_main]

use libfuzzer_sys::fuzz_target;
use tcpx_proto::ipc::identity::{LocalInfo, MAX_LOCAL_INFO};

fuzz_target!(|data: &[u8]| {
    if let Ok(i) = LocalInfo::from_bytes(data) {
        let bytes = i.to_bytes().expect("decoded info re-encodes");
        assert!(bytes.len() <= MAX_LOCAL_INFO);
        assert_eq!(LocalInfo::from_bytes(&bytes).unwrap(), i);
    }
});
