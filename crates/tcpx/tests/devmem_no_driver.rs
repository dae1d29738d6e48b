//! Devmem emulation's failure path: `TCPX_SOCKET_DEVMEM=1` without a usable CUDA driver makes
//! the plugin's `init` fail with a clear code (ncclSystemError) and a log line, never a panic.
//!
//! This binary holds only this test, so the variables it sets cannot leak into other tests. On
//! a machine with a GPU it hides the driver with `TCPX_CUDA_DISABLE=1` (honoured by the plugin
//! as by `tcpx::cuda`); elsewhere the driver is really missing.

use tcpx::{AbiVersion, ErrorKind, Net, ResultCode};

#[test]
fn devmem_without_a_driver_fails_init_with_a_clear_code() {
    // Probe before touching the environment: the answer is cached for the process.
    let real_driver = tcpx::cuda::driver_available();
    std::env::set_var("TCPX_SOCKET_IFNAME", "lo");
    std::env::set_var(tcpx_socket::DEVMEM_ENV, "1");
    if real_driver {
        std::env::set_var("TCPX_CUDA_DISABLE", "1");
        println!("a CUDA driver is present: hiding it with TCPX_CUDA_DISABLE=1");
    }
    for version in [AbiVersion::V8, AbiVersion::V7] {
        let err = Net::builtin_version(version).expect_err("devmem init must fail without CUDA");
        assert!(
            matches!(err.kind(), ErrorKind::Plugin(code) if *code == ResultCode::SYSTEM_ERROR),
            "{err}"
        );
        println!("{version}: {err}");
    }
}
