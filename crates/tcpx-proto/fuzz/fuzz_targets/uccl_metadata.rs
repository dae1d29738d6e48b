//! UCCL's endpoint metadata, today's layout and the older one.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tcpx_proto::uccl::metadata::{parse_uccl_metadata, uccl_metadata};

fuzz_target!(|data: &[u8]| {
    if let Ok((addr, gpu)) = parse_uccl_metadata(data) {
        // Today's layout round-trips (the older one is read, never written).
        if gpu.is_empty() || gpu.contains(':') {
            assert_eq!(
                parse_uccl_metadata(&uccl_metadata(addr, &gpu)).unwrap(),
                (addr, gpu)
            );
        }
    }
});
