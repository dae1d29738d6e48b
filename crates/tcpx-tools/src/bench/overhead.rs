//! `tcpx-bench overhead`: requests retired per second per engine thread, on the instant
//! plugin (`tcpx_socket::instant`). Two endpoints in one process; one engine posts only sends, the other
//! only receives; each side is timed from its first submission to its last completion.

use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use tcpx_runtime::{Backoff, Config, Endpoint, Transfer};

/// The instant plugin (`tcpx_socket::instant`) as a [`tcpx::Net`].
pub fn instant_net() -> Result<tcpx::Net> {
    // SAFETY: the instant table implements the ncclNet v8 ABI as its module documents (every
    // function checks its pointers and touches only its arguments and an atomic counter); the
    // table and its name are statics that live for the whole process.
    let plugin = unsafe { tcpx_sys::NetPlugin::from_static_v8(tcpx_socket::instant::table_v8()) }
        .context("load the instant plugin")?;
    tcpx::Net::from_plugin(plugin).context("initialise the instant plugin")
}

/// What to measure.
#[derive(Debug, Clone)]
pub struct OverheadOptions {
    /// Channels of the connection (all on the one fake device, so one engine per side).
    pub channels: u16,
    /// Chunk size: one request each.
    pub chunk_bytes: u32,
    /// Bytes per transfer (the memory is never touched).
    pub transfer_bytes: usize,
    /// Transfers per side per repetition.
    pub transfers: usize,
    /// Repetitions (after one warm-up); the median is reported.
    pub reps: usize,
    /// Engine idle policy.
    pub backoff: Backoff,
}

impl Default for OverheadOptions {
    fn default() -> Self {
        Self {
            channels: 4,
            chunk_bytes: 4096,
            transfer_bytes: 64 << 20,
            transfers: 64,
            reps: 5,
            backoff: Backoff::Spin,
        }
    }
}

/// Median rates of the sending and receiving engines.
#[derive(Debug, Clone, PartialEq)]
pub struct OverheadReport {
    /// Requests per side per repetition.
    pub requests: u64,
    /// Send requests retired per second by the sending engine.
    pub send_per_sec: f64,
    /// Receive requests retired (tested done and consumed) per second by the receiving
    /// engine.
    pub recv_per_sec: f64,
}

/// Runs the measurement.
pub fn engine_overhead(opts: &OverheadOptions) -> Result<OverheadReport> {
    let net = instant_net()?;
    let config = Config::builder()
        .control_addr("127.0.0.1:0".parse().context("loopback address")?)
        .channels(opts.channels)
        .chunk_bytes(opts.chunk_bytes)
        .backoff(opts.backoff)
        .timeout(Duration::from_secs(120))
        // The instant plugin moves no bytes: eager frames (small messages packed into frames
        // that the receiver parses) would arrive as zeros and fail the connection as a
        // protocol violation. Every message takes the job path, which is what this measures.
        .eager_bytes(0)
        .build()?;
    let a = Endpoint::with_net(config.clone(), net.clone())?;
    let b = Endpoint::with_net(config, net)?;
    let meta = a.metadata().clone();
    let (ab, ba) = std::thread::scope(|s| {
        let accepted = s.spawn(|| a.accept());
        let ba = b.connect(&meta);
        let ab = accepted
            .join()
            .map_err(|_| anyhow!("accept thread panicked"))?;
        Ok::<_, anyhow::Error>((ab?, ba?))
    })?;
    let src = a.alloc_host(opts.transfer_bytes)?;
    let dst = b.alloc_host(opts.transfer_bytes)?;
    ab.register(&src)?;
    ba.register(&dst)?;
    let chunks = (opts.transfer_bytes as u64).div_ceil(u64::from(opts.chunk_bytes));
    let requests = chunks * opts.transfers as u64;

    let mut send_rates = Vec::with_capacity(opts.reps);
    let mut recv_rates = Vec::with_capacity(opts.reps);
    for rep in 0..=opts.reps {
        let (t_send, t_recv) = std::thread::scope(|s| {
            let receiver =
                s.spawn(|| timed(opts.transfers, || ba.recv(&dst, 0, opts.transfer_bytes)));
            let t_send = timed(opts.transfers, || ab.send(&src, 0, opts.transfer_bytes));
            let t_recv = receiver.join().map_err(|_| anyhow!("receiver panicked"))?;
            Ok::<_, anyhow::Error>((t_send?, t_recv?))
        })?;
        if rep > 0 {
            send_rates.push(requests as f64 / t_send.as_secs_f64());
            recv_rates.push(requests as f64 / t_recv.as_secs_f64());
        }
    }
    Ok(OverheadReport {
        requests,
        send_per_sec: super::stack::median(&mut send_rates),
        recv_per_sec: super::stack::median(&mut recv_rates),
    })
}

/// Submits `n` transfers and waits for all; returns the time from first submission to last
/// completion.
fn timed(n: usize, mut submit: impl FnMut() -> tcpx_runtime::Result<Transfer>) -> Result<Duration> {
    let start = Instant::now();
    let transfers = (0..n)
        .map(|_| submit())
        .collect::<tcpx_runtime::Result<Vec<_>>>()?;
    for t in &transfers {
        t.wait(Duration::from_secs(120))?;
    }
    Ok(start.elapsed())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instant_plugin_runs_the_engines_end_to_end() {
        let report = engine_overhead(&OverheadOptions {
            channels: 2,
            chunk_bytes: 4096,
            transfer_bytes: 1 << 20,
            transfers: 4,
            reps: 1,
            backoff: Backoff::Park,
        })
        .unwrap();
        assert_eq!(report.requests, 4 * 256);
        assert!(report.send_per_sec > 0.0 && report.recv_per_sec > 0.0);
    }

    /// One request per transfer (the whole per-message path): small transfers take the job
    /// path here, never eager frames, which the instant plugin cannot carry.
    #[test]
    fn small_transfers_measure_the_per_message_path() {
        let report = engine_overhead(&OverheadOptions {
            channels: 2,
            chunk_bytes: 4096,
            transfer_bytes: 4096,
            transfers: 200,
            reps: 1,
            backoff: Backoff::Park,
        })
        .unwrap();
        assert_eq!(report.requests, 200);
        assert!(report.send_per_sec > 0.0 && report.recv_per_sec > 0.0);
    }
}
