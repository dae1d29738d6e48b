//! The 128-byte same-host (CUDA IPC) descriptor a peer names advertised GPU memory with.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tcpx_proto::ipc::IpcDescriptor;

fuzz_target!(|data: &[u8]| {
    if let Ok(d) = IpcDescriptor::from_bytes(data) {
        assert_eq!(&d.to_bytes()[..], data);
        assert!(d.offset + d.len <= d.alloc_len && d.len > 0);
    }
});
