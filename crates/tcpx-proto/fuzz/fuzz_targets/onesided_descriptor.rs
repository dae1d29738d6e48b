//! The 26-byte descriptor of an advertised region.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tcpx_proto::onesided::Descriptor;

fuzz_target!(|data: &[u8]| {
    if let Ok(d) = Descriptor::from_bytes(data) {
        assert_eq!(&d.to_bytes()[..], data);
    }
});
