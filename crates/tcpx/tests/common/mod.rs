//! Shared helpers for the safe-layer integration tests: loopback pinning, connected pairs and
//! drivers with deadlines (no test may hang).
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Once;
use std::time::{Duration, Instant};

use tcpx::{MemoryRegion, Net, RecvComm, RecvRequest, SendComm, SendRequest};

/// Every wait in these tests gives up after this long.
pub const DEADLINE: Duration = Duration::from_secs(60);

/// Pins the socket plugin to `lo` before any plugin initializes. Call first in every test:
/// every test goes through the same `Once`, so the variable is set before any thread reads it.
pub fn loopback() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| std::env::set_var("TCPX_SOCKET_IFNAME", "lo"));
}

/// The built cdylib of tcpx-socket (cargo puts dependency cdylibs in `target/<profile>/deps`).
pub fn socket_plugin_path() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let deps = exe.parent().expect("deps directory");
    for dir in [deps, deps.parent().unwrap_or(deps)] {
        let candidate = dir.join("libtcpx_socket.so");
        if candidate.exists() {
            return candidate;
        }
    }
    panic!("libtcpx_socket.so not found next to {}", exe.display());
}

/// A connected (send, recv) pair on device 0 of `net`.
pub fn pair(net: &Net) -> (SendComm, RecvComm) {
    let mut listener = net.listen(0).expect("listen");
    let handle = *listener.handle();
    let connector = {
        let net = net.clone();
        std::thread::spawn(move || net.connect(0, &handle, DEADLINE))
    };
    let recv = listener.accept(DEADLINE).expect("accept");
    let send = connector.join().expect("connect thread").expect("connect");
    (send, recv)
}

/// Posts a send, retrying while the plugin answers busy.
pub fn post_send(
    comm: &mut SendComm,
    region: &MemoryRegion,
    offset: usize,
    len: usize,
) -> SendRequest {
    let start = Instant::now();
    loop {
        if let Some(r) = comm.isend(region, offset, len, 0).expect("isend") {
            return r;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "isend stayed busy for {DEADLINE:?}"
        );
    }
}

/// Posts a receive, retrying while the plugin answers busy.
pub fn post_recv(
    comm: &mut RecvComm,
    region: &MemoryRegion,
    offset: usize,
    len: usize,
) -> RecvRequest {
    let start = Instant::now();
    loop {
        if let Some(r) = comm.irecv(region, offset, len, 0).expect("irecv") {
            return r;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "irecv stayed busy for {DEADLINE:?}"
        );
    }
}

/// Tests a send until done.
pub fn wait_send(comm: &mut SendComm, req: &mut SendRequest) -> usize {
    let start = Instant::now();
    loop {
        if let Some(n) = comm.test(req).expect("test send") {
            return n;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "send not done after {DEADLINE:?}"
        );
    }
}

/// Tests a receive until done.
pub fn wait_recv(comm: &mut RecvComm, req: &mut RecvRequest) -> usize {
    let start = Instant::now();
    loop {
        if let Some(n) = comm.test(req).expect("test recv") {
            return n;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "recv not done after {DEADLINE:?}"
        );
    }
}

/// A deterministic, position- and seed-dependent byte pattern (catches shifted or reordered data).
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}
