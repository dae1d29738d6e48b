//! Shared helpers for the runtime's end-to-end tests: loopback pinning, endpoint pairs,
//! data patterns, resource counting. Every wait has a deadline; no test may hang.
#![allow(dead_code)]

use std::sync::Once;
use std::time::Duration;

use tcpx_runtime::{Backend, Backoff, Config, Connection, Endpoint, Region};

/// Longest any single wait in these tests may take.
pub const DEADLINE: Duration = Duration::from_secs(60);

/// Pins the socket plugin to `lo` before any plugin initializes. First line of every test.
pub fn loopback() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| std::env::set_var("TCPX_SOCKET_IFNAME", "lo"));
}

/// A loopback configuration: built-in plugin, control plane on 127.0.0.1.
pub fn config(channels: u16, chunk_bytes: u32) -> Config {
    Config::builder()
        .backend(Backend::Builtin)
        .control_addr("127.0.0.1:0".parse().unwrap())
        .channels(channels)
        .chunk_bytes(chunk_bytes)
        .timeout(Duration::from_secs(30))
        .backoff(Backoff::Park)
        .build()
        .expect("valid config")
}

/// Two endpoints and a connection between them: (a, b, a's connection, b's connection).
pub fn pair_with(ca: Config, cb: Config) -> (Endpoint, Endpoint, Connection, Connection) {
    let a = Endpoint::new(ca).expect("endpoint a");
    let b = Endpoint::new(cb).expect("endpoint b");
    let (ab, ba) = connect(&a, &b);
    (a, b, ab, ba)
}

/// Connects `a` to `b` (b accepts on another thread).
pub fn connect(a: &Endpoint, b: &Endpoint) -> (Connection, Connection) {
    let meta = a.metadata().clone();
    std::thread::scope(|s| {
        let accepted = s.spawn(|| a.accept_timeout(DEADLINE));
        let ba = b.connect(&meta).expect("connect");
        let ab = accepted.join().expect("accept thread").expect("accept");
        (ab, ba)
    })
}

/// Two endpoints with the same config, connected.
pub fn pair(channels: u16, chunk_bytes: u32) -> (Endpoint, Endpoint, Connection, Connection) {
    pair_with(config(channels, chunk_bytes), config(channels, chunk_bytes))
}

/// Fills `bytes` with a pattern that depends on `seed` and the position (no two positions
/// of a 64-bit word repeat within a transfer, so misplaced chunks are caught).
pub fn fill(bytes: &mut [u8], seed: u64) {
    let mut words = bytes.chunks_exact_mut(8);
    for (i, w) in (&mut words).enumerate() {
        w.copy_from_slice(&word(seed, i as u64).to_le_bytes());
    }
    let n = bytes.len() / 8;
    let tail = &mut bytes[n * 8..];
    let last = word(seed, n as u64).to_le_bytes();
    tail.copy_from_slice(&last[..tail.len()]);
}

/// Checks `bytes` holds the pattern of `fill(seed)`; returns the first bad offset.
pub fn check(bytes: &[u8], seed: u64) -> Result<(), usize> {
    let mut words = bytes.chunks_exact(8);
    for (i, w) in (&mut words).enumerate() {
        if w != word(seed, i as u64).to_le_bytes() {
            let first = w
                .iter()
                .zip(word(seed, i as u64).to_le_bytes())
                .position(|(a, b)| *a != b)
                .unwrap_or(0);
            return Err(i * 8 + first);
        }
    }
    let n = bytes.len() / 8;
    let last = word(seed, n as u64).to_le_bytes();
    let tail = &bytes[n * 8..];
    match tail.iter().zip(last).position(|(a, b)| *a != b) {
        Some(p) => Err(n * 8 + p),
        None => Ok(()),
    }
}

fn word(seed: u64, i: u64) -> u64 {
    // splitmix64 of (seed, index)
    let mut z = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(i)
        .wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A region of `len` bytes filled with `fill(seed)`.
pub fn source(ep: &Endpoint, len: usize, seed: u64) -> Region {
    let r = ep.alloc_host(len.max(1)).expect("alloc");
    r.memory()
        .with_bytes_mut(|b| fill(&mut b[..len], seed))
        .expect("cpu access");
    r
}

/// Asserts `region[offset..offset+len]` holds `fill(seed)`.
pub fn assert_pattern(region: &Region, offset: usize, len: usize, seed: u64, what: &str) {
    region
        .memory()
        .with_bytes(|b| {
            if let Err(at) = check(&b[offset..offset + len], seed) {
                panic!("{what}: data differs at byte {at} of {len}");
            }
        })
        .expect("cpu access");
}

/// Open file descriptors of this process.
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Threads of this process.
pub fn threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Waits until `f` holds or `timeout` passes; returns whether it held.
pub fn eventually(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}
