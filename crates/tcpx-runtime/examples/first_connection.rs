//! What a fresh endpoint pair pays before its transfers run at speed, and to go away:
//! endpoint creation, the connection's set-up, its first one-sided write, then closing the
//! connection and dropping the endpoints (as an agent's destructor does), for three pairs in
//! turn in one process (the first pair is the process's first connection). Loopback, host
//! memory. Also the process's resident memory the connection added (both ends are in it).
//!
//!     cargo run --release -p tcpx-runtime --example first_connection -- [CHANNELS] [BYTES]

use std::time::{Duration, Instant};

use tcpx_runtime::{Backend, Backoff, Config, Endpoint, RemoteSegment, Segment};

const TIMEOUT: Duration = Duration::from_secs(30);

fn config(channels: u16) -> Config {
    Config::builder()
        .backend(Backend::Builtin)
        .control_addr("127.0.0.1:0".parse().expect("an address"))
        .channels(channels)
        .timeout(TIMEOUT)
        .backoff(Backoff::Park)
        .build()
        .expect("a valid configuration")
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The process's resident memory in MiB (`VmRSS`), 0 where /proc does not say.
fn resident_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or(0.0, |kib| kib / 1024.0)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Loopback only (see the README's network rule), unless the caller chose an interface.
    if std::env::var_os("TCPX_SOCKET_IFNAME").is_none() {
        std::env::set_var("TCPX_SOCKET_IFNAME", "lo");
    }
    let mut args = std::env::args().skip(1);
    let channels: u16 = args.next().map_or(Ok(8), |a| a.parse())?;
    let bytes: usize = args.next().map_or(Ok(1 << 20), |a| a.parse())?;
    for pair in 0..3 {
        let t = Instant::now();
        let a = Endpoint::new(config(channels))?;
        let b = Endpoint::new(config(channels))?;
        let endpoints = t.elapsed();
        let src = a.alloc_host(bytes)?;
        let dst = b.alloc_host(bytes)?;
        let target = b.advertise(&dst)?;
        let meta = b.metadata().clone();
        let before = resident_mib();
        let t = Instant::now();
        let (ab, ba) = std::thread::scope(|s| {
            let accepted = s.spawn(|| b.accept_timeout(TIMEOUT));
            let ab = a.connect(&meta);
            (ab, accepted.join().expect("the accepting thread"))
        });
        let ab = ab?;
        let connect = t.elapsed();
        let added = resident_mib() - before;
        let t = Instant::now();
        ab.write(
            &[Segment::new(&src, 0, bytes)],
            &[RemoteSegment::new(target, 0, bytes as u64)],
            None,
        )?
        .wait(TIMEOUT)?;
        let write = t.elapsed();
        // Teardown as an agent's destructor does it: the connections, then the endpoints.
        let t = Instant::now();
        drop(ab);
        drop(ba);
        let close = t.elapsed();
        let t = Instant::now();
        drop((src, dst));
        drop(a);
        drop(b);
        let teardown = t.elapsed();
        println!(
            "pair {pair}: endpoints {:.1} ms, connection {:.2} ms (+{added:.1} MiB resident), \
             first write of {bytes} B {:.3} ms, connections closed {:.2} ms, endpoints dropped \
             {:.2} ms",
            ms(endpoints),
            ms(connect),
            ms(write),
            ms(close),
            ms(teardown)
        );
    }
    Ok(())
}
