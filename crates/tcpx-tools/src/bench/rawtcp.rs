//! The raw-TCP baseline of the two-process benchmarks (`server`/`client`, `kv`): the same bytes
//! as the measured transfers over as many plain TCP streams as the connection has channels,
//! cut as the stack cuts them, to the server's port + 1, in the same run.
//!
//! The streams move those bytes through as much memory as the measured side does
//! ([`StreamPlan::footprint`]: its message slots), each stream cycling through its share. A
//! baseline that wrote one cache-resident chunk over and over measured the kernel's copy from
//! L2, not from DRAM: at 256 MiB × 4 slots the stack reads 1 GiB per round and the old
//! baseline 512 KiB, so large sizes compared a DRAM-bound stack with a cache-bound baseline.
//!
//! The streams prove they belong to this run: the server sends a random token over the
//! (authenticated) tcpx connection first, and every baseline stream must open with it.
//! Anything else connecting to port + 1 is dropped after a short deadline of its own, logged
//! with its address, without holding up the real streams. Every wait gives up once nothing
//! moved for the plan's timeout.

use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

/// How long a stranger on the baseline port may take to present the run's token.
const STRANGER_DEADLINE: Duration = Duration::from_secs(2);

/// Unproven baseline connections held at once; beyond this the oldest is dropped.
const MAX_PENDING: usize = 256;

/// One baseline measurement: `messages` messages of `size` bytes over `channels` streams.
#[derive(Clone, Copy, Debug)]
pub struct StreamPlan {
    /// Bytes per message.
    pub size: usize,
    /// Messages.
    pub messages: usize,
    /// Chunk size: how a message is cut over the streams, as the stack cuts it.
    pub chunk: usize,
    /// Streams (the connection's channels).
    pub channels: usize,
    /// Any wait without progress gives up after this long.
    pub timeout: Duration,
    /// Bytes of memory the measured side moves its messages through (its slots × the
    /// message size); the streams together cycle through as much, so both read and write
    /// the same amount of distinct memory. 0 means one chunk per stream.
    pub footprint: usize,
}

impl StreamPlan {
    /// Bytes each stream cycles through: its share of the footprint, whole chunks, at least
    /// one chunk.
    pub fn stream_buffer(&self) -> usize {
        let chunk = self.chunk.max(1);
        let share = self.footprint.div_ceil(self.channels.max(1));
        share.div_ceil(chunk).max(1) * chunk
    }
}

/// Where a stream's next write (or read) of at most one chunk lies in its buffer: chunk after
/// chunk, wrapping at the end, so the stream touches all of its share of the footprint.
struct Cycle {
    len: usize,
    chunk: usize,
    at: usize,
}

impl Cycle {
    fn new(len: usize, chunk: usize) -> Self {
        Self {
            len: len.max(1),
            chunk: chunk.max(1),
            at: 0,
        }
    }

    /// The next span (offset, length) for a stream with `left` bytes still to move.
    fn next(&mut self, left: u64) -> (usize, usize) {
        if self.at >= self.len {
            self.at = 0;
        }
        let n = (left.min(self.chunk as u64) as usize).min(self.len - self.at);
        let at = self.at;
        self.at += n;
        (at, n)
    }
}

/// A fresh random token for this run's baseline streams.
pub fn new_token() -> Result<u64> {
    let mut bytes = [0u8; 8];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .context("read a baseline token from /dev/urandom")?;
    Ok(u64::from_le_bytes(bytes))
}

/// The baseline address of a server whose control address is `control`: its port + 1.
pub fn baseline_addr(control: SocketAddr) -> SocketAddr {
    SocketAddr::new(control.ip(), control.port().wrapping_add(1))
}

/// How many times a server bound to port 0 lets the kernel pick again when the port after
/// its pick is taken.
pub const BASELINE_PICKS: usize = 32;

/// Opens a server's control side with `open` (which returns it and the port it bound) and
/// binds the raw-TCP baseline listener on `requested`'s IP at that port + 1.
///
/// With port 0 asked for, the port after the kernel's pick may be taken: Linux gives
/// `bind(0)` odd ports and `connect()` even ones, so the neighbour is where a busy host's
/// outgoing connections sit (a CI run lost a test to it). Then the control side is dropped
/// and opened again, up to [`BASELINE_PICKS`] times. A port the user named is never moved:
/// its neighbour being taken is an error naming the address.
pub fn open_beside_baseline<T>(
    requested: SocketAddr,
    mut open: impl FnMut() -> Result<(T, u16)>,
) -> Result<(T, TcpListener)> {
    let mut attempt = 1;
    loop {
        let (control, port) = open()?;
        if port == u16::MAX {
            bail!("the control port {port} leaves no port after it for the raw-TCP baseline");
        }
        let baseline = baseline_addr(SocketAddr::new(requested.ip(), port));
        match TcpListener::bind(baseline) {
            Ok(listener) => return Ok((control, listener)),
            Err(e)
                if requested.port() == 0
                    && attempt < BASELINE_PICKS
                    && e.kind() == ErrorKind::AddrInUse =>
            {
                tracing::debug!(%baseline, attempt, "baseline port taken; picking again");
                drop(control);
                attempt += 1;
            }
            Err(e) => {
                return Err(e).with_context(|| {
                    format!("bind the baseline listener {baseline} (attempt {attempt})")
                })
            }
        }
    }
}

/// Bytes each baseline stream carries for `messages` messages of `size`: the stack's own
/// schedule (chunks of `chunk`, rotated per message over `channels`), so that small messages
/// go whole on one stream each, as they do through the stack, instead of in slivers.
pub fn baseline_plan(size: usize, messages: usize, chunk: usize, channels: usize) -> Vec<u64> {
    let channels = channels.max(1);
    let chunk = chunk.max(1) as u64;
    let mut per = vec![0u64; channels];
    let size = size as u64;
    let chunks = size.div_ceil(chunk).max(1);
    let whole_rounds = messages as u64 / channels as u64;
    // Every `channels` consecutive messages put the same bytes on every channel in total.
    let per_round: u64 = size;
    for bytes in per.iter_mut() {
        *bytes = whole_rounds * per_round;
    }
    for m in 0..(messages % channels) as u64 {
        for c in 0..chunks {
            let len = (size - c * chunk).min(chunk);
            per[((c + m) % channels as u64) as usize] += len;
        }
    }
    per
}

/// Turns an I/O error of the baseline into one that says what timed out.
fn io_context(e: std::io::Error, what: &str, timeout: Duration) -> anyhow::Error {
    match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => {
            anyhow!(
                "{what}: timed out after {} s (--timeout)",
                timeout.as_secs_f64()
            )
        }
        _ => anyhow::Error::from(e).context(what.to_string()),
    }
}

/// How long one blocking socket call may sleep before the caller looks at its clock again.
const POLL: Duration = Duration::from_millis(100);

/// `write_all` that fails once no byte has moved for `timeout` (each call sleeps at most
/// [`POLL`], set on the socket beforehand), however the kernel splits the writes.
fn write_all_by(s: &mut TcpStream, mut buf: &[u8], timeout: Duration, what: &str) -> Result<()> {
    let mut progress = Instant::now();
    while !buf.is_empty() {
        match s.write(buf) {
            Ok(0) => bail!("{what}: the peer closed the connection"),
            Ok(n) => {
                buf = &buf[n..];
                progress = Instant::now();
            }
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) =>
            {
                if progress.elapsed() >= timeout {
                    bail!(
                        "{what}: timed out after {} s (--timeout)",
                        timeout.as_secs_f64()
                    );
                }
            }
            Err(e) => return Err(anyhow::Error::from(e).context(what.to_string())),
        }
    }
    Ok(())
}

/// `read_exact` that fails once no byte has arrived for `timeout` (see [`write_all_by`]).
fn read_exact_by(
    s: &mut TcpStream,
    mut buf: &mut [u8],
    timeout: Duration,
    what: &str,
) -> Result<()> {
    let mut progress = Instant::now();
    while !buf.is_empty() {
        match s.read(buf) {
            Ok(0) => bail!("{what}: the peer closed the connection"),
            Ok(n) => {
                buf = &mut buf[n..];
                progress = Instant::now();
            }
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) =>
            {
                if progress.elapsed() >= timeout {
                    bail!(
                        "{what}: timed out after {} s (--timeout)",
                        timeout.as_secs_f64()
                    );
                }
            }
            Err(e) => return Err(anyhow::Error::from(e).context(what.to_string())),
        }
    }
    Ok(())
}

/// Short socket timeouts so that every blocking call comes back to [`write_all_by`] /
/// [`read_exact_by`] in time to honour `--timeout`.
fn poll_timeouts(s: &TcpStream) -> Result<()> {
    s.set_read_timeout(Some(POLL))?;
    s.set_write_timeout(Some(POLL))?;
    Ok(())
}

fn remaining(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

/// The client's side of one measurement: opens the streams to `addr`, presents `token` on
/// each, waits for the server's GO, writes the plan's bytes and returns the time from GO to
/// the server's acknowledgement that everything arrived.
pub fn send(addr: SocketAddr, streams: &StreamPlan, token: u64) -> Result<Duration> {
    let plan = baseline_plan(
        streams.size,
        streams.messages,
        streams.chunk,
        streams.channels,
    );
    let deadline = Instant::now() + streams.timeout;
    let timeout = streams.timeout;
    let mut conns = Vec::with_capacity(plan.len());
    for i in 0..plan.len() {
        let mut s = TcpStream::connect_timeout(&addr, remaining(deadline))
            .map_err(|e| io_context(e, &format!("connect stream {i}"), timeout))?;
        s.set_nodelay(true)?;
        poll_timeouts(&s)?;
        write_all_by(
            &mut s,
            &token.to_le_bytes(),
            remaining(deadline),
            &format!("stream {i}: send the run's token"),
        )?;
        conns.push(s);
    }
    // The server says GO on every stream once all of them are in: the clock starts then.
    for (i, s) in conns.iter_mut().enumerate() {
        let mut go = [0u8; 1];
        read_exact_by(
            s,
            &mut go,
            remaining(deadline),
            &format!("stream {i}: wait for the server's GO"),
        )?;
    }
    let chunk = streams.chunk.max(1);
    // Filled (every page touched) before the clock starts.
    let buffers: Vec<Vec<u8>> = plan
        .iter()
        .map(|_| vec![0x5au8; streams.stream_buffer()])
        .collect();
    let t0 = Instant::now();
    std::thread::scope(|scope| -> Result<()> {
        let workers: Vec<_> = conns
            .iter_mut()
            .zip(&plan)
            .zip(&buffers)
            .enumerate()
            .map(|(i, ((c, &bytes), buf))| {
                scope.spawn(move || -> Result<()> {
                    let what = format!("stream {i}: write");
                    let mut cycle = Cycle::new(buf.len(), chunk);
                    let mut left = bytes;
                    while left > 0 {
                        let (at, n) = cycle.next(left);
                        write_all_by(c, &buf[at..at + n], timeout, &what)?;
                        left -= n as u64;
                    }
                    Ok(())
                })
            })
            .collect();
        for w in workers {
            w.join()
                .map_err(|_| anyhow!("baseline writer panicked"))??;
        }
        Ok(())
    })?;
    let mut ack = [0u8; 1];
    read_exact_by(
        &mut conns[0],
        &mut ack,
        timeout,
        "wait for the server's acknowledgement",
    )?;
    Ok(t0.elapsed())
}

/// Connections on the baseline port that have not proven they belong to the run yet; kept
/// across measurements so that a slow stranger is judged on its own deadline.
#[derive(Default)]
pub struct Strangers {
    pending: VecDeque<Pending>,
}

struct Pending {
    stream: TcpStream,
    peer: SocketAddr,
    since: Instant,
    got: [u8; 8],
    len: usize,
}

/// What one poll of an unproven connection found.
enum Proof {
    Member,
    Waiting,
    Stranger(String),
}

impl Pending {
    fn poll(&mut self, token: u64) -> Proof {
        loop {
            match self.stream.read(&mut self.got[self.len..]) {
                Ok(0) => return Proof::Stranger("closed before sending the run's token".into()),
                Ok(n) => {
                    self.len += n;
                    if self.len == 8 {
                        return if u64::from_le_bytes(self.got) == token {
                            Proof::Member
                        } else {
                            Proof::Stranger("sent a wrong token".into())
                        };
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    return if self.since.elapsed() > STRANGER_DEADLINE {
                        Proof::Stranger(format!(
                            "no token within {} s",
                            STRANGER_DEADLINE.as_secs()
                        ))
                    } else {
                        Proof::Waiting
                    };
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Proof::Stranger(format!("read failed: {e}")),
            }
        }
    }
}

/// The server's side of one measurement: accepts the plan's streams on `listener` (each must
/// open with `token`; strangers are dropped and logged), says GO on each, reads every byte
/// and acknowledges.
pub fn receive(
    listener: &TcpListener,
    streams: &StreamPlan,
    token: u64,
    strangers: &mut Strangers,
) -> Result<()> {
    let plan = baseline_plan(
        streams.size,
        streams.messages,
        streams.chunk,
        streams.channels,
    );
    let wanted = plan.len();
    let mut conns: Vec<TcpStream> = Vec::with_capacity(wanted);
    listener.set_nonblocking(true)?;
    let deadline = Instant::now() + streams.timeout;
    while conns.len() < wanted {
        let mut progressed = false;
        match listener.accept() {
            Ok((s, peer)) => {
                s.set_nonblocking(true)?;
                if strangers.pending.len() >= MAX_PENDING {
                    if let Some(old) = strangers.pending.pop_front() {
                        tracing::warn!(peer = %old.peer, "baseline: dropped an unproven connection (too many pending)");
                    }
                }
                strangers.pending.push_back(Pending {
                    stream: s,
                    peer,
                    since: Instant::now(),
                    got: [0; 8],
                    len: 0,
                });
                progressed = true;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            // Transient per-connection failures (aborted before accept, out of fds) must not
            // end the run: note them and keep waiting for the real streams.
            Err(e) => tracing::warn!("baseline: accept failed: {e}"),
        }
        let mut i = 0;
        while i < strangers.pending.len() && conns.len() < wanted {
            match strangers.pending[i].poll(token) {
                Proof::Waiting => i += 1,
                Proof::Member => {
                    let p = strangers.pending.remove(i).expect("index in range");
                    p.stream.set_nonblocking(false)?;
                    conns.push(p.stream);
                    progressed = true;
                }
                Proof::Stranger(why) => {
                    let p = strangers.pending.remove(i).expect("index in range");
                    tracing::warn!(peer = %p.peer, "baseline: dropped a stranger: {why}");
                    progressed = true;
                }
            }
        }
        if conns.len() < wanted && !progressed {
            if Instant::now() > deadline {
                bail!(
                    "{} of {wanted} streams presented the run's token within {} s (--timeout)",
                    conns.len(),
                    streams.timeout.as_secs_f64()
                );
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    let timeout = streams.timeout;
    let chunk = streams.chunk.max(1);
    // Touched before GO, as the stack's slots are before its clock.
    let mut buffers: Vec<Vec<u8>> = plan
        .iter()
        .map(|_| vec![1u8; streams.stream_buffer()])
        .collect();
    for (i, c) in conns.iter_mut().enumerate() {
        poll_timeouts(c)?;
        write_all_by(c, &[1], timeout, &format!("stream {i}: send GO"))?;
    }
    std::thread::scope(|scope| -> Result<()> {
        let workers: Vec<_> = conns
            .iter_mut()
            .zip(&plan)
            .zip(buffers.iter_mut())
            .enumerate()
            .map(|(i, ((c, &bytes), buf))| {
                scope.spawn(move || -> Result<()> {
                    let what = format!("stream {i}: read");
                    let mut cycle = Cycle::new(buf.len(), chunk);
                    let mut left = bytes;
                    while left > 0 {
                        let (at, n) = cycle.next(left);
                        read_exact_by(c, &mut buf[at..at + n], timeout, &what)?;
                        left -= n as u64;
                    }
                    Ok(())
                })
            })
            .collect();
        for w in workers {
            w.join()
                .map_err(|_| anyhow!("baseline reader panicked"))??;
        }
        Ok(())
    })?;
    write_all_by(&mut conns[0], &[1], timeout, "send the acknowledgement")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A control side bound to a port the kernel picked, as the endpoint's listener is; it
    /// counts its drops.
    #[derive(Debug)]
    struct Pick {
        listener: TcpListener,
        _neighbour: Option<TcpListener>,
        drops: std::rc::Rc<std::cell::Cell<usize>>,
    }

    impl Drop for Pick {
        fn drop(&mut self) {
            self.drops.set(self.drops.get() + 1);
        }
    }

    type Drops = std::rc::Rc<std::cell::Cell<usize>>;

    /// A pick; with `hold_neighbour`, one whose neighbour this test holds itself (so that
    /// nobody can free it meanwhile).
    fn pick(drops: &Drops, hold_neighbour: bool) -> (Pick, u16) {
        for _ in 0..100 {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let port = listener.local_addr().unwrap().port();
            let neighbour = TcpListener::bind(("127.0.0.1", port + 1)).ok();
            if hold_neighbour && neighbour.is_none() {
                continue;
            }
            let pick = Pick {
                listener,
                _neighbour: neighbour.filter(|_| hold_neighbour),
                drops: drops.clone(),
            };
            return (pick, port);
        }
        panic!("no pick with a free neighbour to hold");
    }

    /// Port 0: a pick whose neighbour is taken is dropped and the kernel picks again; the
    /// baseline ends up right after the control port that is kept.
    #[test]
    fn a_taken_neighbour_of_a_picked_port_is_picked_around() {
        let requested: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let drops = Drops::default();
        let mut first_port = None;
        let mut opened = 0;
        let (kept, listener) = open_beside_baseline(requested, || {
            opened += 1;
            if opened == 1 {
                let (blocked, port) = pick(&drops, true);
                first_port = Some(port);
                Ok((blocked, port))
            } else {
                // Later picks may meet a taken neighbour too (other tests run beside this
                // one): the loop then simply goes on.
                Ok(pick(&drops, false))
            }
        })
        .unwrap();
        let port = kept.listener.local_addr().unwrap().port();
        assert!(opened >= 2, "the blocked pick was kept");
        assert_ne!(Some(port), first_port);
        assert_eq!(listener.local_addr().unwrap().port(), port + 1);
        assert_eq!(drops.get(), opened - 1, "every pick given up was closed");
    }

    /// A named port is never moved: its taken neighbour is an error naming the address, after
    /// one attempt.
    #[test]
    fn a_named_port_with_a_taken_neighbour_is_an_error() {
        let drops = Drops::default();
        let (blocked, port) = pick(&drops, true);
        let requested = SocketAddr::from(([127, 0, 0, 1], port));
        let mut slot = Some(blocked);
        let mut opened = 0;
        let e = open_beside_baseline(requested, || {
            opened += 1;
            Ok((slot.take().expect("opened once"), port))
        })
        .unwrap_err();
        assert_eq!(opened, 1);
        assert_eq!(drops.get(), 1);
        let text = format!("{e:#}");
        assert!(text.contains(&format!("127.0.0.1:{}", port + 1)), "{text}");
        assert!(text.contains("attempt 1"), "{text}");
    }

    /// Port 0 with every pick blocked gives up after [`BASELINE_PICKS`] and says so; port
    /// 65535 has no neighbour (never port 0, which would be any port); an error opening the
    /// control side ends the loop at once.
    #[test]
    fn picking_again_is_bounded_and_open_errors_pass_through() {
        let requested: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let drops = Drops::default();
        let mut opened = 0;
        let e = open_beside_baseline(requested, || {
            opened += 1;
            Ok(pick(&drops, true))
        })
        .unwrap_err();
        assert_eq!(opened, BASELINE_PICKS);
        assert_eq!(drops.get(), BASELINE_PICKS);
        assert!(
            format!("{e:#}").contains(&format!("attempt {BASELINE_PICKS}")),
            "{e:#}"
        );
        let e = open_beside_baseline(requested, || Ok(((), 65535))).unwrap_err();
        assert!(e.to_string().contains("no port after it"), "{e}");
        let e = open_beside_baseline::<()>(requested, || Err(anyhow!("no endpoint"))).unwrap_err();
        assert_eq!(e.to_string(), "no endpoint");
    }

    #[test]
    fn baseline_plan_matches_the_stack_schedule() {
        // Small messages go whole, one stream each, rotating.
        assert_eq!(
            baseline_plan(4096, 10, 512 << 10, 4),
            vec![3 * 4096, 3 * 4096, 2 * 4096, 2 * 4096]
        );
        // 3 chunks per message over 4 channels, rotated: every channel gets 3 of 4 messages.
        assert_eq!(baseline_plan(3 * 1024, 4, 1024, 4), vec![3 * 1024; 4]);
        assert_eq!(baseline_plan(2500, 1, 1024, 2), vec![1024 + 452, 1024]);
        let plan = baseline_plan(5 << 20, 7, 512 << 10, 8);
        assert_eq!(plan.iter().sum::<u64>(), 7 * (5 << 20));
    }

    #[test]
    fn streams_cycle_through_their_share_of_the_footprint() {
        let plan = StreamPlan {
            size: 256 << 20,
            messages: 4,
            chunk: 512 << 10,
            channels: 8,
            timeout: Duration::from_secs(1),
            footprint: 4 * (256 << 20),
        };
        // 1 GiB over 8 streams: 128 MiB each, whole chunks.
        assert_eq!(plan.stream_buffer(), 128 << 20);
        // No footprint: one chunk, as the old baseline.
        assert_eq!(
            StreamPlan {
                footprint: 0,
                ..plan
            }
            .stream_buffer(),
            512 << 10
        );
        // Every byte of the buffer is visited before any is visited twice, spans never cross
        // its end, and a short tail is honoured.
        let mut cycle = Cycle::new(10, 4);
        let spans: Vec<_> = (0..5).map(|_| cycle.next(100)).collect();
        assert_eq!(spans, vec![(0, 4), (4, 4), (8, 2), (0, 4), (4, 4)]);
        assert_eq!(cycle.next(3), (8, 2));
        assert_eq!(cycle.next(3), (0, 3));
    }
}
