//! `tcpx-bench latency`: one-way latency from ping-pong round trips, through the whole stack and
//! through one raw TCP connection with `TCP_NODELAY`, in the same run.
//!
//! tcpx: two endpoints in this process over loopback; A posts its receive for the pong, sends
//! the ping and waits for the pong; B keeps its next receive posted and answers each ping at
//! once. Raw TCP: one connection, a thread at each end doing the same with blocking
//! `write_all` / `read_exact`. One-way = round trip / 2; p50 and p99 over the measured round
//! trips, after a warm-up. The target (PERFORMANCE.md, P5) is tcpx p50 ≤ 1.3 × raw TCP p50 at
//! 4 KiB.
//!
//! With a gap ([`Options::gap`]) the pinger sleeps that long before each round trip, on both
//! paths: what a message costs after the stack went idle (engines that stopped polling and
//! blocked, threads whose cores went to others), as a server answering sporadic requests
//! sees it; back to back, every thread of the stack is still polling.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use serde::Serialize;
use tcpx_runtime::{Backend, Backoff, Config, Connection, Endpoint, Region};

use super::stats::percentile;

/// What to measure.
#[derive(Debug, Clone)]
pub struct Options {
    /// Message sizes.
    pub sizes: Vec<usize>,
    /// Measured round trips per size.
    pub iters: usize,
    /// Unmeasured round trips per size.
    pub warmup: usize,
    /// Channels of the connection.
    pub channels: u16,
    /// Chunk size.
    pub chunk_bytes: u32,
    /// Engine idle policy.
    pub backoff: Backoff,
    /// How long each wait polls before sleeping ([`Config::wait_spin`]).
    pub wait_spin: Duration,
    /// Plugin.
    pub backend: Backend,
    /// Any single wait gives up after this long.
    pub timeout: Duration,
    /// Idle time before each round trip (zero: back to back), not timed.
    pub gap: Duration,
}

/// One size's one-way latencies, µs.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// Message size in bytes.
    pub bytes: usize,
    /// tcpx one-way p50 (round trip / 2).
    pub p50_us: f64,
    /// tcpx one-way p99.
    pub p99_us: f64,
    /// Raw TCP (TCP_NODELAY) one-way p50.
    pub tcp_p50_us: f64,
    /// Raw TCP one-way p99.
    pub tcp_p99_us: f64,
    /// p50 / raw TCP p50 (P5 wants ≤ 1.3 at 4 KiB).
    pub ratio: f64,
}

/// Runs the sweep, handing each row to `on_row`.
pub fn run(o: &Options, mut on_row: impl FnMut(&Row)) -> Result<()> {
    let config = Config::builder()
        .backend(o.backend.clone())
        .control_addr("127.0.0.1:0".parse().context("loopback address")?)
        .channels(o.channels)
        .chunk_bytes(o.chunk_bytes)
        .backoff(o.backoff)
        .wait_spin(o.wait_spin)
        .timeout(o.timeout)
        .build()?;
    let a = Endpoint::new(config.clone())?;
    let b = Endpoint::new(config)?;
    let meta = b.metadata().clone();
    let (ab, ba) = std::thread::scope(|s| {
        let accepted = s.spawn(|| b.accept());
        let ab = a.connect(&meta);
        let ba = accepted
            .join()
            .map_err(|_| anyhow!("accept thread panicked"))?;
        Ok::<_, anyhow::Error>((ab?, ba?))
    })
    .context("connect the two endpoints")?;
    let max = o.sizes.iter().copied().max().unwrap_or(1).max(1);
    let (pa, pb) = (a.alloc_host(max)?, b.alloc_host(max)?);
    // Touch and register before any clock.
    pa.write(0, &vec![0x5a; max])?;
    pb.write(0, &vec![0; max])?;
    ab.register(&pa)?;
    ba.register(&pb)?;
    for &size in &o.sizes {
        let mut tcpx = tcpx_pingpong(&ab, &ba, &pa, &pb, size, o)?;
        let mut tcp = tcp_pingpong(size, o)?;
        let us = |v: &mut Vec<Duration>, p| percentile(v, p).as_secs_f64() * 1e6 / 2.0;
        let row = Row {
            bytes: size,
            p50_us: us(&mut tcpx, 50.0),
            p99_us: us(&mut tcpx, 99.0),
            tcp_p50_us: us(&mut tcp, 50.0),
            tcp_p99_us: us(&mut tcp, 99.0),
            ratio: 0.0,
        };
        let row = Row {
            ratio: if row.tcp_p50_us > 0.0 {
                row.p50_us / row.tcp_p50_us
            } else {
                0.0
            },
            ..row
        };
        on_row(&row);
    }
    Ok(())
}

/// Round trips through the stack (A → B → A), measured ones only.
fn tcpx_pingpong(
    ab: &Connection,
    ba: &Connection,
    pa: &Region,
    pb: &Region,
    size: usize,
    o: &Options,
) -> Result<Vec<Duration>> {
    let total = o.warmup + o.iters;
    std::thread::scope(|s| {
        let echo = s.spawn(|| -> Result<()> {
            let mut next = ba.recv(pb, 0, size)?;
            for i in 0..total {
                let got = next
                    .wait(o.timeout)
                    .context("echo side: wait for the ping")?;
                if got as usize != size {
                    return Err(anyhow!("echo side: ping of {got} bytes, expected {size}"));
                }
                let pong = ba.send(pb, 0, size)?;
                if i + 1 < total {
                    next = ba.recv(pb, 0, size)?;
                }
                pong.wait(o.timeout).context("echo side: send the pong")?;
            }
            Ok(())
        });
        let mut rtts = Vec::with_capacity(o.iters);
        for i in 0..total {
            let pong = ab.recv(pa, 0, size)?;
            idle(o.gap);
            let t0 = Instant::now();
            let ping = ab.send(pa, 0, size)?;
            let got = pong.wait(o.timeout).context("wait for the pong")?;
            let rtt = t0.elapsed();
            ping.wait(o.timeout).context("send the ping")?;
            if got as usize != size {
                return Err(anyhow!("pong of {got} bytes, expected {size}"));
            }
            if i >= o.warmup {
                rtts.push(rtt);
            }
        }
        echo.join().map_err(|_| anyhow!("echo thread panicked"))??;
        Ok(rtts)
    })
}

/// Round trips over one loopback TCP connection with TCP_NODELAY.
fn tcp_pingpong(size: usize, o: &Options) -> Result<Vec<Duration>> {
    let listener = TcpListener::bind("127.0.0.1:0").context("raw TCP: bind 127.0.0.1")?;
    let addr = listener.local_addr()?;
    let mut a = TcpStream::connect(addr).context("raw TCP: connect")?;
    let (mut b, _) = listener.accept().context("raw TCP: accept")?;
    for s in [&a, &b] {
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(o.timeout))?;
        s.set_write_timeout(Some(o.timeout))?;
    }
    let total = o.warmup + o.iters;
    std::thread::scope(|s| {
        let echo = s.spawn(move || -> std::io::Result<()> {
            let mut buf = vec![0u8; size];
            for _ in 0..total {
                b.read_exact(&mut buf)?;
                b.write_all(&buf)?;
            }
            Ok(())
        });
        let mut buf = vec![0x5au8; size];
        let mut rtts = Vec::with_capacity(o.iters);
        for i in 0..total {
            idle(o.gap);
            let t0 = Instant::now();
            a.write_all(&buf).context("raw TCP: send the ping")?;
            a.read_exact(&mut buf)
                .context("raw TCP: wait for the pong")?;
            if i >= o.warmup {
                rtts.push(t0.elapsed());
            }
        }
        echo.join()
            .map_err(|_| anyhow!("raw TCP echo thread panicked"))?
            .context("raw TCP echo side")?;
        Ok(rtts)
    })
}

/// Sleeps `gap` unless it is zero (a zero sleep is still a syscall and a reschedule).
fn idle(gap: Duration) {
    if !gap.is_zero() {
        std::thread::sleep(gap);
    }
}
