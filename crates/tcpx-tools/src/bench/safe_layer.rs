//! One comm pair through the safe `tcpx` layer: a sender and a receiver thread each keep up to
//! `window` requests in flight, test the oldest after every post, and retire in FIFO order.

use std::collections::VecDeque;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use tcpx::{MemoryRegion, Net, RecvComm, SendComm, SharedMemory};

/// Buffer bytes per side: in-flight slots share it round-robin (contents are not checked here).
const BUFFER_CAP: usize = 256 << 20;

/// What one size measured.
#[derive(Clone, Debug)]
pub struct Measured {
    /// Receiver-side time for all measured messages.
    pub elapsed: Duration,
    /// Post-to-completion time of each measured receive.
    pub latencies: Vec<Duration>,
}

/// A connected pair, ready to measure several sizes.
pub struct SafeLayerPair {
    send: SendComm,
    recv: RecvComm,
}

impl SafeLayerPair {
    /// Connects one comm pair on device 0 of `net` (pin `TCPX_SOCKET_IFNAME=lo` for loopback).
    pub fn connect(net: &Net) -> Result<Self> {
        let mut listener = net.listen(0)?;
        let handle = *listener.handle();
        let connector = {
            let net = net.clone();
            std::thread::spawn(move || net.connect(0, &handle, Duration::from_secs(30)))
        };
        let recv = listener.accept(Duration::from_secs(30))?;
        let send = connector
            .join()
            .map_err(|_| anyhow!("connect thread panicked"))??;
        Ok(Self { send, recv })
    }

    /// Moves `warmup + iters` messages of `size` bytes with up to `window` in flight.
    pub fn measure(
        &mut self,
        size: usize,
        warmup: usize,
        iters: usize,
        window: usize,
    ) -> Result<Measured> {
        let slots = (BUFFER_CAP / size).clamp(1, window.max(1));
        let bytes = size * slots;
        let smem = SharedMemory::host(bytes)?;
        let rmem = SharedMemory::host(bytes)?;
        let sregion = self.send.register(&smem)?;
        let rregion = self.recv.register(&rmem)?;
        let barrier = Arc::new(Barrier::new(2));
        let total = warmup + iters;
        std::thread::scope(|s| -> Result<Measured> {
            let send = &mut self.send;
            let b = barrier.clone();
            let sender = s.spawn(move || send_loop(send, &sregion, size, slots, total, window, &b));
            let measured = recv_loop(
                &mut self.recv,
                &rregion,
                size,
                slots,
                warmup,
                iters,
                window,
                &barrier,
            );
            sender.join().map_err(|_| anyhow!("sender panicked"))??;
            measured
        })
    }
}

fn deadline_check(start: Instant, what: &str) -> Result<()> {
    if start.elapsed() > Duration::from_secs(120) {
        return Err(anyhow!("{what} made no progress for 120 s"));
    }
    Ok(())
}

fn send_loop(
    comm: &mut SendComm,
    region: &MemoryRegion,
    size: usize,
    slots: usize,
    total: usize,
    window: usize,
    barrier: &Barrier,
) -> Result<()> {
    barrier.wait();
    let mut inflight = VecDeque::with_capacity(window);
    let (mut posted, mut done) = (0, 0);
    let start = Instant::now();
    while done < total {
        if posted < total && inflight.len() < window {
            if let Some(req) = comm
                .isend(region, (posted % slots) * size, size, 0)
                .context("isend")?
            {
                inflight.push_back(req);
                posted += 1;
            }
        }
        // Test the head after every post: progress only happens inside plugin calls.
        if let Some(head) = inflight.front_mut() {
            if comm.test(head).context("test send")?.is_some() {
                inflight.pop_front();
                done += 1;
            }
        }
        deadline_check(start, "sender")?;
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn recv_loop(
    comm: &mut RecvComm,
    region: &MemoryRegion,
    size: usize,
    slots: usize,
    warmup: usize,
    iters: usize,
    window: usize,
    barrier: &Barrier,
) -> Result<Measured> {
    barrier.wait();
    let total = warmup + iters;
    let mut inflight = VecDeque::with_capacity(window);
    let mut latencies = Vec::with_capacity(iters);
    let (mut posted, mut done) = (0, 0);
    let mut t0 = Instant::now();
    let start = Instant::now();
    while done < total {
        if posted < total && inflight.len() < window {
            if let Some(req) = comm
                .irecv(region, (posted % slots) * size, size, 0)
                .context("irecv")?
            {
                inflight.push_back((req, Instant::now()));
                posted += 1;
            }
        }
        if let Some((head, _)) = inflight.front_mut() {
            if comm.test(head).context("test recv")?.is_some() {
                let (req, posted_at) = inflight.pop_front().expect("head exists");
                comm.consumed(req).context("irecvConsumed")?;
                done += 1;
                if done == warmup {
                    t0 = Instant::now();
                } else if done > warmup {
                    latencies.push(posted_at.elapsed());
                }
            }
        }
        deadline_check(start, "receiver")?;
    }
    if warmup == 0 {
        t0 = start;
    }
    Ok(Measured {
        elapsed: t0.elapsed(),
        latencies,
    })
}
