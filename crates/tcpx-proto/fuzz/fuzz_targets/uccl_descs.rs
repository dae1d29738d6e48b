//! The descriptor lists of the descriptor API (`deserialize_descs`) and the keys inside them.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tcpx_proto::uccl::descs::{decode, encode, RemoteKey};

fuzz_target!(|data: &[u8]| {
    if let Ok(list) = decode(data) {
        let bytes = encode(&list).expect("a decoded list re-encodes");
        assert_eq!(decode(&bytes).expect("and decodes"), list);
        for d in &list {
            if let Ok(key) = RemoteKey::from_rkeys(&d.rkeys) {
                assert_eq!(RemoteKey::from_rkeys(&key.rkeys()).unwrap(), key);
                if let Ok(r) = key.range(d.addr, d.size) {
                    assert!(r.offset + r.len <= key.descriptor.len());
                }
            }
        }
    }
});
