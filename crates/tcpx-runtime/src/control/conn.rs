//! One control connection over a blocking `std::net::TcpStream`, with a timeout on every
//! connect, accept, read and write.
//!
//! This is the thin I/O shell around the sans-IO [`Decoder`]: it reads whatever bytes arrive,
//! feeds them in, and turns frames into [`Message`]s. Every error names the peer's address.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::thread;
use std::time::{Duration, Instant};

use super::codec::{CodecError, Decoder, EncodeError};
use super::message::{ErrorCode, Message, MessageError, MessageType};

/// Timeout for writes when none is given: the control plane carries small messages, so a
/// write that cannot finish in this long means the peer stopped reading.
pub const DEFAULT_WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// Bytes read from the socket at a time. Frames larger than this arrive over several reads.
const READ_CHUNK: usize = 64 * 1024;

/// How far past a receive's deadline a read may wait before its socket timeout is reset
/// (resetting it is a syscall).
const READ_TIMEOUT_SLACK: Duration = Duration::from_millis(2);

/// Longest sleep between polls of a listener while waiting in [`ControlConn::accept`].
const ACCEPT_POLL: Duration = Duration::from_millis(5);

/// A control-plane failure. Every variant names the peer (or, for accepts, the listener).
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// The TCP connection could not be established.
    #[error("control connection to {peer}: connect failed: {source}")]
    Connect {
        /// The address dialled.
        peer: SocketAddr,
        /// The OS error.
        source: io::Error,
    },
    /// No peer connected (and passed admission) before the accept timeout.
    #[error("control listener {local}: no peer connected within {waited:?}{}", rejected_note(*.rejected, .last_rejection))]
    AcceptTimeout {
        /// The listener's address.
        local: SocketAddr,
        /// How long it waited.
        waited: Duration,
        /// Connections rejected since the last timed-out accept reported them (bad or slow
        /// handshakes, missing secret).
        rejected: u64,
        /// The last of them: `peer: reason`.
        last_rejection: Option<String>,
    },
    /// Accepting failed.
    #[error("control listener {local}: accept failed: {source}")]
    Accept {
        /// The listener's address.
        local: SocketAddr,
        /// The OS error.
        source: io::Error,
    },
    /// An operation did not finish in time.
    #[error("control connection to {peer}: timed out after {waited:?} {during}")]
    Timeout {
        /// The peer.
        peer: SocketAddr,
        /// How long it waited.
        waited: Duration,
        /// What it was doing (e.g. "waiting for a message; the peer stalled mid-frame").
        during: &'static str,
    },
    /// A socket call failed.
    #[error("control connection to {peer}: {op} failed: {source}")]
    Io {
        /// The peer.
        peer: SocketAddr,
        /// The operation.
        op: &'static str,
        /// The OS error.
        source: io::Error,
    },
    /// The peer closed the connection between messages.
    #[error("control connection to {peer}: the peer closed the connection")]
    Closed {
        /// The peer.
        peer: SocketAddr,
    },
    /// The byte stream is not valid framing (or ended inside a frame).
    #[error("control connection to {peer}: {source}")]
    Protocol {
        /// The peer.
        peer: SocketAddr,
        /// What was wrong with the framing.
        source: CodecError,
    },
    /// A frame's payload is not a valid message.
    #[error("control connection to {peer}: {source}")]
    Malformed {
        /// The peer.
        peer: SocketAddr,
        /// What was wrong with the payload.
        source: MessageError,
    },
    /// A message could not be encoded (a field or the payload is too long).
    #[error("control connection to {peer}: cannot send {kind:?}: {source}")]
    Encode {
        /// The peer.
        peer: SocketAddr,
        /// The message type.
        kind: MessageType,
        /// Why.
        source: EncodeError,
    },
    /// A message arrived that the protocol does not allow at this point.
    #[error("control connection to {peer}: expected {expected:?}, got {got:?}")]
    Unexpected {
        /// The peer.
        peer: SocketAddr,
        /// The type that was expected.
        expected: MessageType,
        /// The type received.
        got: MessageType,
    },
    /// The peer reported an error.
    #[error("control connection to {peer}: the peer reported a {code} error: {message}")]
    Remote {
        /// The peer.
        peer: SocketAddr,
        /// The peer's error code.
        code: ErrorCode,
        /// The peer's message.
        message: String,
    },
    /// The peer closed the session with a reason.
    #[error("control connection to {peer}: the peer closed the session: {reason}")]
    ClosedByPeer {
        /// The peer.
        peer: SocketAddr,
        /// The peer's reason.
        reason: String,
    },
    /// An earlier send failed part-way, so the stream can no longer be framed.
    #[error("control connection to {peer} is unusable after an earlier failed send")]
    Broken {
        /// The peer.
        peer: SocketAddr,
    },
}

fn rejected_note(rejected: u64, last: &Option<String>) -> String {
    match (rejected, last) {
        (0, _) => String::new(),
        (n, Some(last)) => format!(" ({n} connection(s) rejected; last: {last})"),
        (n, None) => format!(" ({n} connection(s) rejected)"),
    }
}

impl ControlError {
    /// The operation ran out of time (as opposed to failing).
    pub fn is_timeout(&self) -> bool {
        matches!(self, Self::Timeout { .. } | Self::AcceptTimeout { .. })
    }
}

/// A framed, versioned control connection to one peer.
#[derive(Debug)]
pub struct ControlConn {
    stream: TcpStream,
    peer: SocketAddr,
    decoder: Decoder,
    /// Bytes read but not yet fed to the decoder live in `rx[rx_start..rx_end]`.
    rx: Box<[u8]>,
    rx_start: usize,
    rx_end: usize,
    /// The encoding buffer of [`ControlConn::send`], kept between messages.
    tx: Vec<u8>,
    write_timeout: Duration,
    /// The timeouts last set on the socket: setting one is a syscall, which the control loop
    /// would otherwise pay per message.
    applied_write_timeout: Option<Duration>,
    applied_read_timeout: Option<Duration>,
    broken: bool,
}

impl ControlConn {
    /// Connects to `addr`, waiting at most `timeout`. Later writes also use `timeout`
    /// (see [`Self::set_write_timeout`]).
    pub fn connect(addr: SocketAddr, timeout: Duration) -> Result<Self, ControlError> {
        if timeout.is_zero() {
            return Err(ControlError::Timeout {
                peer: addr,
                waited: timeout,
                during: "connecting",
            });
        }
        let stream = TcpStream::connect_timeout(&addr, timeout).map_err(|source| {
            if is_timeout(&source) {
                ControlError::Timeout {
                    peer: addr,
                    waited: timeout,
                    during: "connecting",
                }
            } else {
                ControlError::Connect { peer: addr, source }
            }
        })?;
        Self::from_stream(stream, timeout)
    }

    /// Accepts one connection on `listener`, waiting at most `timeout`. Later writes also use
    /// `timeout`. The listener is polled in non-blocking mode and left in blocking mode.
    pub fn accept(listener: &TcpListener, timeout: Duration) -> Result<Self, ControlError> {
        let local = listener
            .local_addr()
            .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
        let accept_err = |source| ControlError::Accept { local, source };
        listener.set_nonblocking(true).map_err(accept_err)?;
        let deadline = Instant::now() + timeout;
        let accepted = loop {
            match listener.accept() {
                Ok((stream, _)) => break Ok(stream),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let now = Instant::now();
                    if now >= deadline {
                        break Err(ControlError::AcceptTimeout {
                            local,
                            waited: timeout,
                            rejected: 0,
                            last_rejection: None,
                        });
                    }
                    thread::sleep(ACCEPT_POLL.min(deadline - now));
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => break Err(accept_err(e)),
            }
        };
        // Restore blocking mode even when the accept failed.
        let restored = listener.set_nonblocking(false);
        let stream = accepted?;
        restored.map_err(accept_err)?;
        Self::from_stream(stream, timeout)
    }

    /// Wraps an already connected stream; writes time out after `write_timeout`.
    pub fn from_stream(stream: TcpStream, write_timeout: Duration) -> Result<Self, ControlError> {
        let peer = stream.peer_addr().map_err(|source| ControlError::Io {
            peer: SocketAddr::from(([0, 0, 0, 0], 0)),
            op: "reading the peer address",
            source,
        })?;
        let io_err = |op| move |source| ControlError::Io { peer, op, source };
        stream
            .set_nonblocking(false)
            .map_err(io_err("setting blocking mode"))?;
        // Control messages are small and latency-bound: do not let Nagle hold them back.
        stream
            .set_nodelay(true)
            .map_err(io_err("setting TCP_NODELAY"))?;
        let mut conn = Self {
            stream,
            peer,
            decoder: Decoder::new(),
            rx: vec![0; READ_CHUNK].into_boxed_slice(),
            rx_start: 0,
            rx_end: 0,
            tx: Vec::new(),
            write_timeout: DEFAULT_WRITE_TIMEOUT,
            applied_write_timeout: None,
            applied_read_timeout: None,
            broken: false,
        };
        conn.set_write_timeout(write_timeout);
        Ok(conn)
    }

    /// Splits the connection into a receiving and a sending handle (`(reader, writer)`), so
    /// that one thread can receive while another sends. The reader is this handle: it keeps
    /// whatever was read from the socket but not yet returned — a peer may send its next
    /// messages right behind the last one this side waited for, and one `read` can take them
    /// all — so no frame is lost in the hand-over. The writer's receive buffer starts empty;
    /// never receive on it.
    pub fn split(self) -> Result<(Self, Self), ControlError> {
        let writer = self.try_clone()?;
        Ok((self, writer))
    }

    /// A second handle on the same connection, with its own, empty, receive buffer and
    /// decoder. Bytes this handle already read and buffered stay here: to hand the receiving
    /// to another thread, use [`Self::split`], not a clone. Use one handle for receiving and
    /// the other for sending: two receivers would split frames between them.
    pub fn try_clone(&self) -> Result<Self, ControlError> {
        let stream = self.stream.try_clone().map_err(|source| ControlError::Io {
            peer: self.peer,
            op: "cloning the socket",
            source,
        })?;
        Ok(Self {
            stream,
            peer: self.peer,
            decoder: Decoder::new(),
            rx: vec![0; READ_CHUNK].into_boxed_slice(),
            rx_start: 0,
            rx_end: 0,
            tx: Vec::new(),
            write_timeout: self.write_timeout,
            // Socket options are shared by every handle on the socket, so a clone must set
            // its own before relying on them.
            applied_write_timeout: None,
            applied_read_timeout: None,
            broken: self.broken,
        })
    }

    /// Shuts both directions of the socket down (for every handle on it): a thread blocked in
    /// [`Self::recv`] on another handle returns at once with [`ControlError::Closed`]. Bytes
    /// already sent are still delivered.
    pub fn shutdown(&self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }

    /// The socket's descriptor, to `poll` for readability.
    pub(crate) fn raw_fd(&self) -> std::os::fd::RawFd {
        self.stream.as_raw_fd()
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    /// This side's address of the connection.
    pub fn local_addr(&self) -> Result<SocketAddr, ControlError> {
        self.stream.local_addr().map_err(|source| ControlError::Io {
            peer: self.peer,
            op: "reading the local address",
            source,
        })
    }

    /// Sets how long a [`Self::send`] may block (a zero duration means the default).
    pub fn set_write_timeout(&mut self, timeout: Duration) {
        self.write_timeout = if timeout.is_zero() {
            DEFAULT_WRITE_TIMEOUT
        } else {
            timeout
        };
    }

    /// Sends one message, failing if it cannot be written within the write timeout. A send
    /// that fails part-way leaves the connection [`ControlError::Broken`].
    pub fn send(&mut self, msg: &Message) -> Result<(), ControlError> {
        if self.broken {
            return Err(ControlError::Broken { peer: self.peer });
        }
        let mut tx = std::mem::take(&mut self.tx);
        tx.clear();
        let sent = msg
            .encode(&mut tx)
            .map_err(|source| ControlError::Encode {
                peer: self.peer,
                kind: msg.kind(),
                source,
            })
            .and_then(|()| self.write_raw(&tx));
        // The buffer is kept for the next message.
        self.tx = tx;
        sent
    }

    /// Writes `frames` (whole encoded frames) within the write timeout. A write that fails
    /// part-way leaves the connection [`ControlError::Broken`].
    pub(crate) fn write_raw(&mut self, frames: &[u8]) -> Result<(), ControlError> {
        if self.broken {
            return Err(ControlError::Broken { peer: self.peer });
        }
        let peer = self.peer;
        let waited = self.write_timeout;
        let result = if self.applied_write_timeout == Some(waited) {
            Ok(())
        } else {
            self.stream.set_write_timeout(Some(waited))
        }
        .and_then(|()| {
            self.applied_write_timeout = Some(waited);
            self.stream.write_all(frames)
        });
        result.map_err(|source| {
            self.broken = true;
            if is_timeout(&source) {
                ControlError::Timeout {
                    peer,
                    waited,
                    during: "sending a message; the peer is not reading",
                }
            } else {
                ControlError::Io {
                    peer,
                    op: "sending a message",
                    source,
                }
            }
        })
    }

    /// Writes what the socket takes of `bytes` now, without blocking (the socket itself stays
    /// blocking: the reading handle shares its flags), and returns how many it took. A failed
    /// write leaves the connection [`ControlError::Broken`].
    pub(crate) fn write_now(&mut self, bytes: &[u8]) -> Result<usize, ControlError> {
        if self.broken {
            return Err(ControlError::Broken { peer: self.peer });
        }
        let mut done = 0;
        while done < bytes.len() {
            let rest = &bytes[done..];
            // SAFETY: `rest` is a live slice of `rest.len()` readable bytes for the whole
            // call, and the descriptor belongs to `self.stream`, open while `self` lives.
            // MSG_NOSIGNAL: a peer that reset the connection is an error here, not SIGPIPE in
            // a host application that did not ignore it.
            let n = unsafe {
                libc::send(
                    self.stream.as_raw_fd(),
                    rest.as_ptr().cast(),
                    rest.len(),
                    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                )
            };
            if n > 0 {
                // Positive and at most `rest.len()`.
                done += n as usize;
                continue;
            }
            if n == 0 {
                // Nothing taken from a non-empty buffer: try again on the next call.
                break;
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::WouldBlock => break,
                io::ErrorKind::Interrupted => {}
                _ => {
                    self.broken = true;
                    return Err(ControlError::Io {
                        peer: self.peer,
                        op: "sending a message",
                        source: e,
                    });
                }
            }
        }
        Ok(done)
    }

    /// Shuts down the sending half: the peer reads end of stream after what was sent.
    pub(crate) fn shutdown_write(&self) -> Result<(), ControlError> {
        self.stream
            .shutdown(Shutdown::Write)
            .map_err(|source| ControlError::Io {
                peer: self.peer,
                op: "shutting down",
                source,
            })
    }

    /// Receives the next message, waiting at most `timeout` for it to arrive whole.
    ///
    /// A timeout does not lose data: part of a frame received so far is kept for the next
    /// call. A framing error is final; every later call returns it again.
    pub fn recv(&mut self, timeout: Duration) -> Result<Message, ControlError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(message) = self.next_buffered() {
                return message;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(self.recv_timeout(timeout));
            }
            // The socket keeps the last timeout set, so a watcher polling with the same
            // interval sets it once (a syscall per message otherwise). A read waits at most
            // that long and a timed-out read with time left loops, so it is reset only when it
            // would overshoot what is left by more than the slack, or poll far too often.
            if self
                .applied_read_timeout
                .is_none_or(|applied| applied > left + READ_TIMEOUT_SLACK || applied < left / 2)
            {
                if let Err(source) = self.stream.set_read_timeout(Some(left)) {
                    return Err(ControlError::Io {
                        peer: self.peer,
                        op: "setting the read timeout",
                        source,
                    });
                }
                self.applied_read_timeout = Some(left);
            }
            match self.stream.read(&mut self.rx) {
                Ok(0) => return Err(self.end_of_stream()),
                Ok(n) => self.rx_end = n,
                // An earlier, shorter socket timeout ran out: wait on for what is left.
                Err(e) if is_timeout(&e) && Instant::now() < deadline => {}
                Err(e) if is_timeout(&e) => return Err(self.recv_timeout(timeout)),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(source) => return Err(self.read_failed(source)),
            }
        }
    }

    /// The next whole message among the bytes already read, if any. Once it returns `None`
    /// every buffered byte was fed to the decoder (a partial frame waits inside it).
    pub(crate) fn next_buffered(&mut self) -> Option<Result<Message, ControlError>> {
        if self.rx_start < self.rx_end {
            let mut input = &self.rx[self.rx_start..self.rx_end];
            let decoded = self.decoder.decode(&mut input);
            self.rx_start = self.rx_end - input.len();
            match decoded {
                Ok(Some(frame)) => {
                    return Some(Message::decode(&frame).map_err(|source| {
                        ControlError::Malformed {
                            peer: self.peer,
                            source,
                        }
                    }))
                }
                Ok(None) => {}
                Err(source) => {
                    return Some(Err(ControlError::Protocol {
                        peer: self.peer,
                        source,
                    }))
                }
            }
        }
        self.rx_start = 0;
        self.rx_end = 0;
        None
    }

    /// Reads whatever the socket holds without blocking (the socket itself stays blocking:
    /// the writing handle shares its flags), for a loop that polls the socket itself.
    /// `Ok(false)`: nothing there yet.
    pub(crate) fn read_now(&mut self) -> Result<bool, ControlError> {
        // SAFETY: `rx` is a live buffer this handle owns exclusively (`&mut self`), writable
        // for `rx.len()` bytes, and the descriptor belongs to `self.stream`, open for as long
        // as `self` lives. `recv` writes at most `rx.len()` bytes into it.
        let n = unsafe {
            libc::recv(
                self.stream.as_raw_fd(),
                self.rx.as_mut_ptr().cast(),
                self.rx.len(),
                libc::MSG_DONTWAIT,
            )
        };
        match n {
            0 => Err(self.end_of_stream()),
            // Positive and at most `rx.len()`.
            n if n > 0 => {
                self.rx_start = 0;
                self.rx_end = n as usize;
                Ok(true)
            }
            _ => {
                let e = io::Error::last_os_error();
                match e.kind() {
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(false),
                    _ => Err(self.read_failed(e)),
                }
            }
        }
    }

    /// The error for a stream that ended: cleanly between frames, or inside one.
    fn end_of_stream(&mut self) -> ControlError {
        match self.decoder.finish() {
            Ok(()) => ControlError::Closed { peer: self.peer },
            Err(source) => ControlError::Protocol {
                peer: self.peer,
                source,
            },
        }
    }

    fn read_failed(&self, source: io::Error) -> ControlError {
        ControlError::Io {
            peer: self.peer,
            op: "receiving a message",
            source,
        }
    }

    /// Receives the next message and checks it is of type `expected`. A peer's `Error` or
    /// `Close` becomes [`ControlError::Remote`] / [`ControlError::ClosedByPeer`].
    pub fn recv_expecting(
        &mut self,
        expected: MessageType,
        timeout: Duration,
    ) -> Result<Message, ControlError> {
        let msg = self.recv(timeout)?;
        let peer = self.peer;
        match msg {
            msg if msg.kind() == expected => Ok(msg),
            Message::Error { code, message } => Err(ControlError::Remote {
                peer,
                code,
                message,
            }),
            Message::Close { reason } => Err(ControlError::ClosedByPeer { peer, reason }),
            other => Err(ControlError::Unexpected {
                peer,
                expected,
                got: other.kind(),
            }),
        }
    }

    /// Sends `Close { reason }` and shuts down the sending half; the peer's `recv` then sees
    /// the `Close` followed by end of stream.
    pub fn close(&mut self, reason: &str) -> Result<(), ControlError> {
        self.send(&Message::Close {
            reason: reason.to_owned(),
        })?;
        self.shutdown_write()
    }

    fn recv_timeout(&self, waited: Duration) -> ControlError {
        ControlError::Timeout {
            peer: self.peer,
            waited,
            during: if self.decoder.is_mid_frame() {
                "waiting for a message; the peer stalled mid-frame"
            } else {
                "waiting for a message"
            },
        }
    }
}

/// Blocking sockets report an expired timeout as `WouldBlock` on Unix, `TimedOut` elsewhere.
fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}
