//! The 64-byte advertisement blob of `tcpx.p2p`'s `advertise`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tcpx_proto::uccl::advert::Advert;

fuzz_target!(|data: &[u8]| {
    if let Ok(a) = Advert::decode(data) {
        assert_eq!(&a.encode()[..], data);
        let r = a.range();
        assert!(r.offset + r.len <= a.descriptor.len());
    }
});
