//! Admission: who gets past an endpoint's control listener.
//!
//! Anything can connect to the control port: a port scanner, a health check, a stray client of
//! another protocol, an attacker. None of them may end the endpoint's wait for its real peer,
//! nor delay it. So one thread per endpoint (started by the first
//! [`Endpoint::accept`](super::Endpoint::accept)) accepts every connection and reads its first
//! message in a `poll(2)` loop over non-blocking sockets: each connection has its own deadline
//! (the configured timeout, at most [`HELLO_LIMIT`]) and a small cap on what it may send
//! ([`MAX_HELLO_PAYLOAD`]), and all of them progress concurrently, so a silent or slowly
//! dripping stranger costs one idle socket and nobody waits on it. The first message must be
//! a well-formed `Hello` of this protocol version, alone, carrying this endpoint's secret when
//! [`Config::require_secret`](crate::Config) is on. Connections that pass queue as
//! [`Candidate`]s for `accept`; the others are told why (one best-effort `Error` frame),
//! closed, and logged with the peer's address.
//!
//! The thread keeps admitting between `accept` calls (like a listen backlog that filters),
//! and stops and is joined when the endpoint is dropped.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TrySendError};

use crate::control::{Decoder, ErrorCode, Message, MessageType, Secret};
use crate::error::{Error, Result};

/// Longest a connection may take to deliver its `Hello` (when the configured timeout is
/// longer): a real peer sends it right after connecting.
pub(crate) const HELLO_LIMIT: Duration = Duration::from_secs(10);

/// Largest `Hello` payload admitted. Real ones are well under 200 bytes; the cap keeps what
/// a stranger can make this side buffer small (the general control limit is 1 MiB).
pub(crate) const MAX_HELLO_PAYLOAD: u32 = 8 << 10;

/// Connections in admission at once; a new one beyond this evicts the oldest, so a flood of
/// silent strangers cannot lock a real peer out for long.
pub(crate) const MAX_PENDING: usize = 256;

/// Admitted connections waiting for `accept`; more are refused (`busy`) until it takes some.
pub(crate) const MAX_READY: usize = 64;

/// A connection whose `Hello` passed, waiting for [`Endpoint::accept`](super::Endpoint::accept).
pub(crate) struct Candidate {
    pub(crate) stream: TcpStream,
    pub(crate) peer: SocketAddr,
    /// The peer's `Hello` (the handshake continues after it).
    pub(crate) hello: Message,
}

impl Candidate {
    /// True when the peer gave up while it waited in the queue (e.g. after its own set-up
    /// timeout): it closed the connection, it failed, or it sent something, which a peer
    /// waiting for this side's `Hello` never does (one that gives up sends an `Error` first).
    /// Such a candidate is skipped, not handed over.
    pub(crate) fn is_gone(&self) -> bool {
        let mut byte = [0u8; 1];
        // The stream is still non-blocking here: "would block" means nothing arrived.
        match self.stream.peek(&mut byte) {
            Err(e) => !matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
            ),
            Ok(_) => true,
        }
    }
}

/// What the admission thread needs to judge a `Hello`.
pub(crate) struct Policy {
    pub(crate) secret: Secret,
    pub(crate) require_secret: bool,
    pub(crate) hello_timeout: Duration,
}

/// Rejections so far, for the accept-timeout error ("N rejected, last: …").
#[derive(Default)]
pub(crate) struct Rejections {
    count: AtomicU64,
    /// `count` as the last timed-out accept reported it.
    reported: AtomicU64,
    last: Mutex<Option<String>>,
}

impl Rejections {
    fn record(&self, peer: SocketAddr, why: &str) {
        tracing::warn!(target: "tcpx_runtime", %peer, reason = why, "control connection rejected");
        self.count.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut last) = self.last.lock() {
            *last = Some(format!("{peer}: {why}"));
        }
    }

    /// Connections rejected since the thread started.
    pub(crate) fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// Rejections no timed-out accept has reported yet, now marked reported. A peer turned
    /// away while no accept was waiting (before the first one, between two) is reported by
    /// the next one that times out, not lost.
    pub(crate) fn take_unreported(&self) -> u64 {
        let now = self.count();
        now.saturating_sub(self.reported.swap(now, Ordering::Relaxed))
    }

    /// The most recent rejection, `peer: reason`.
    pub(crate) fn last(&self) -> Option<String> {
        self.last.lock().ok().and_then(|l| l.clone())
    }
}

/// The running admission thread of one endpoint.
pub(crate) struct Admission {
    pub(crate) ready: Receiver<Candidate>,
    pub(crate) rejections: Arc<Rejections>,
    /// Closing this end wakes the thread's `poll` and stops it.
    wake: Option<UnixStream>,
    thread: Option<JoinHandle<()>>,
}

impl Admission {
    /// Starts admitting connections from `listener` (a handle of the endpoint's own).
    pub(crate) fn start(listener: TcpListener, policy: Policy) -> Result<Self> {
        let internal =
            |what: &str, e: io::Error| Error::Internal(format!("admission: {what}: {e}"));
        listener
            .set_nonblocking(true)
            .map_err(|e| internal("non-blocking listener", e))?;
        let (wake, woken) = UnixStream::pair().map_err(|e| internal("wake-up pair", e))?;
        let (tx, ready) = crossbeam_channel::bounded(MAX_READY);
        let rejections = Arc::new(Rejections::default());
        let worker = Worker {
            listener,
            woken,
            policy,
            ready: tx,
            rejections: rejections.clone(),
            pending: VecDeque::new(),
        };
        let thread = std::thread::Builder::new()
            .name("tcpx-admit".into())
            .spawn(move || worker.run())
            .map_err(|e| internal("spawning the thread", e))?;
        Ok(Self {
            ready,
            rejections,
            wake: Some(wake),
            thread: Some(thread),
        })
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        // Closing our end makes the other readable (end of stream): the thread's poll returns
        // and it stops, closing every connection still in admission or queued.
        drop(self.wake.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// One connection in admission.
struct Pending {
    stream: TcpStream,
    peer: SocketAddr,
    deadline: Instant,
    decoder: Decoder,
}

/// Where a connection in admission stands after reading what arrived.
enum Progress {
    Waiting,
    Hello(Message),
    Rejected(String),
}

impl Pending {
    /// Reads whatever arrived (non-blocking) and feeds it to the decoder.
    fn advance(&mut self) -> Progress {
        let mut buf = [0u8; 2048];
        loop {
            let n = match self.stream.read(&mut buf) {
                Ok(0) => {
                    return Progress::Rejected(if self.decoder.is_mid_frame() {
                        "closed the connection in the middle of its first message".into()
                    } else {
                        "closed the connection without sending a Hello".into()
                    })
                }
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Progress::Waiting,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Progress::Rejected(format!("reading its first message: {e}")),
            };
            let mut input = &buf[..n];
            match self.decoder.decode(&mut input) {
                Ok(None) => {}
                Ok(Some(frame)) => {
                    if !input.is_empty() {
                        return Progress::Rejected(
                            "sent more than a Hello before this side answered".into(),
                        );
                    }
                    return match Message::decode(&frame) {
                        Ok(hello @ Message::Hello { .. }) => Progress::Hello(hello),
                        Ok(other) => Progress::Rejected(format!(
                            "sent {:?} as its first message, not Hello",
                            other.kind()
                        )),
                        Err(e) => Progress::Rejected(e.to_string()),
                    };
                }
                Err(e) => return Progress::Rejected(e.to_string()),
            }
        }
    }

    /// Tells the peer why (one non-blocking write, best effort) and closes.
    fn reject(self, code: ErrorCode, why: &str, rejections: &Rejections) {
        rejections.record(self.peer, why);
        // Read what already arrived (a little): closing with unread input sends a reset,
        // which can overtake the message below.
        let mut sink = [0u8; 4096];
        for _ in 0..16 {
            match (&self.stream).read(&mut sink) {
                Ok(n) if n > 0 => {}
                _ => break,
            }
        }
        let mut frame = Vec::new();
        let message = Message::Error {
            code,
            message: format!("connection refused: {why}"),
        };
        if message.encode(&mut frame).is_ok() {
            let _ = (&self.stream).write(&frame);
        }
    }
}

struct Worker {
    listener: TcpListener,
    woken: UnixStream,
    policy: Policy,
    ready: Sender<Candidate>,
    rejections: Arc<Rejections>,
    pending: VecDeque<Pending>,
}

impl Worker {
    fn run(mut self) {
        let mut fds: Vec<libc::pollfd> = Vec::with_capacity(2 + MAX_PENDING);
        loop {
            fds.clear();
            fds.extend(
                [self.woken.as_raw_fd(), self.listener.as_raw_fd()]
                    .into_iter()
                    .chain(self.pending.iter().map(|p| p.stream.as_raw_fd()))
                    .map(|fd| libc::pollfd {
                        fd,
                        events: libc::POLLIN,
                        revents: 0,
                    }),
            );
            // With nothing in admission, wait for a connection (or the wake-up) alone.
            let now = Instant::now();
            let ms = match self.pending.iter().map(|p| p.deadline).min() {
                None => -1,
                // Round up, so a deadline is not polled for 0 ms over and over before it.
                Some(d) => d
                    .saturating_duration_since(now)
                    .as_micros()
                    .div_ceil(1000)
                    .min(i32::MAX as u128) as libc::c_int,
            };
            // SAFETY: `fds` is a live, initialised array of `fds.len()` pollfd structs, each
            // naming a descriptor this thread owns for the whole call.
            let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
            if rc < 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    tracing::error!(target: "tcpx_runtime", error = %e, "admission poll failed; retrying");
                    std::thread::sleep(Duration::from_millis(10));
                }
                continue;
            }
            if fds[0].revents != 0 {
                // The endpoint is going away: every pending and queued connection closes.
                return;
            }
            if fds[1].revents != 0 {
                self.accept_all();
            }
            self.advance_all();
        }
    }

    fn accept_all(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, peer)) => {
                    if stream.set_nonblocking(true).is_err() {
                        self.rejections
                            .record(peer, "cannot make its socket non-blocking");
                        continue;
                    }
                    if self.pending.len() >= MAX_PENDING {
                        if let Some(oldest) = self.pending.pop_front() {
                            oldest.reject(
                                ErrorCode::INTERNAL,
                                &format!(
                                    "evicted: {MAX_PENDING} connections were in admission and \
                                     a newer one arrived"
                                ),
                                &self.rejections,
                            );
                        }
                    }
                    tracing::debug!(target: "tcpx_runtime", %peer, "control connection in admission");
                    self.pending.push_back(Pending {
                        stream,
                        peer,
                        deadline: Instant::now() + self.policy.hello_timeout,
                        decoder: Decoder::with_max_payload(MAX_HELLO_PAYLOAD),
                    });
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted
                    ) => {}
                Err(e) => {
                    // Out of descriptors, most likely: back off instead of spinning on a
                    // listener that stays readable.
                    tracing::warn!(target: "tcpx_runtime", error = %e, "control listener accept failed");
                    std::thread::sleep(Duration::from_millis(10));
                    return;
                }
            }
        }
    }

    fn advance_all(&mut self) {
        let now = Instant::now();
        let mut i = 0;
        while i < self.pending.len() {
            let progress = self.pending[i].advance();
            let expired = now >= self.pending[i].deadline;
            if matches!(progress, Progress::Waiting) && !expired {
                i += 1;
                continue;
            }
            let Some(p) = self.pending.remove(i) else {
                break;
            };
            match progress {
                Progress::Waiting => {
                    let why = format!(
                        "sent no complete Hello within {:?}{}",
                        self.policy.hello_timeout,
                        if p.decoder.is_mid_frame() {
                            " (stalled in the middle of a message)"
                        } else {
                            ""
                        }
                    );
                    p.reject(ErrorCode::PROTOCOL, &why, &self.rejections);
                }
                Progress::Rejected(why) => p.reject(ErrorCode::PROTOCOL, &why, &self.rejections),
                Progress::Hello(hello) => self.judge(p, hello),
            }
        }
    }

    /// Queues a connection whose `Hello` arrived, unless its secret is missing or wrong.
    fn judge(&mut self, p: Pending, hello: Message) {
        let presented = match &hello {
            Message::Hello { secret, .. } => *secret,
            _ => None,
        };
        if let Err(why) =
            super::setup::check_secret(self.policy.require_secret, self.policy.secret, presented)
        {
            p.reject(ErrorCode::INCOMPATIBLE, &why, &self.rejections);
            return;
        }
        debug_assert_eq!(hello.kind(), MessageType::Hello);
        let candidate = Candidate {
            stream: p.stream,
            peer: p.peer,
            hello,
        };
        match self.ready.try_send(candidate) {
            Ok(()) => {}
            Err(TrySendError::Full(c)) | Err(TrySendError::Disconnected(c)) => {
                let p = Pending {
                    stream: c.stream,
                    peer: c.peer,
                    deadline: p.deadline,
                    decoder: p.decoder,
                };
                p.reject(
                    ErrorCode::INTERNAL,
                    &format!("busy: {MAX_READY} admitted peers are already waiting for accept"),
                    &self.rejections,
                );
            }
        }
    }
}
