//! The in-run baseline: plain kernel TCP streams over loopback moving the same bytes, so every
//! figure comes with a ratio measured on the same machine in the same minute.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

/// Moves `iters` messages of `size` bytes over `streams` TCP connections on 127.0.0.1 (each
/// message split evenly across the streams) and returns the elapsed time at the receiver.
pub fn raw_tcp(size: usize, iters: usize, streams: usize) -> Result<Duration> {
    let streams = streams.max(1);
    let listener =
        TcpListener::bind("127.0.0.1:0").context("bind baseline listener on 127.0.0.1")?;
    let addr = listener.local_addr()?;
    let share = size.div_ceil(streams);
    let start = Arc::new(Barrier::new(2 * streams));
    let mut senders = Vec::new();
    for _ in 0..streams {
        let start = start.clone();
        let mut stream = TcpStream::connect(addr).context("connect baseline stream")?;
        stream.set_nodelay(true)?;
        senders.push(std::thread::spawn(move || -> std::io::Result<()> {
            let buf = vec![0x5au8; share];
            start.wait();
            for _ in 0..iters {
                stream.write_all(&buf)?;
            }
            Ok(())
        }));
    }
    let mut receivers = Vec::new();
    for _ in 0..streams {
        let (mut stream, _) = listener.accept().context("accept baseline stream")?;
        stream.set_read_timeout(Some(Duration::from_secs(60)))?;
        let start = start.clone();
        receivers.push(std::thread::spawn(move || -> std::io::Result<Duration> {
            let mut buf = vec![0u8; share];
            start.wait();
            let t0 = Instant::now();
            for _ in 0..iters {
                stream.read_exact(&mut buf)?;
            }
            Ok(t0.elapsed())
        }));
    }
    for s in senders {
        s.join()
            .map_err(|_| anyhow::anyhow!("baseline sender panicked"))??;
    }
    let mut slowest = Duration::ZERO;
    for r in receivers {
        slowest = slowest.max(
            r.join()
                .map_err(|_| anyhow::anyhow!("baseline receiver panicked"))??,
        );
    }
    Ok(slowest)
}
