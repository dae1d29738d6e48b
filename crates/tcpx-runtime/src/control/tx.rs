//! [`ControlTx`]: the sending half of a control connection, shared by every thread that
//! writes to it; the connection's control loop writes what they queue.
//!
//! One-sided operations put a control frame on the stream per operation (a request from the
//! initiator, an answer from the target). Written by the calling thread, each cost a `write`
//! syscall; on loopback that syscall also runs the peer's TCP receive path and wakes its
//! reader, 5–10 µs in all, and it capped a single thread submitting 64 KiB writes at about a
//! third of the two-sided rate (measured: `tcpx-bench onesided`, issue 25). So a caller only
//! *queues* its frame (an encode and an append under a short lock); the control loop, which
//! spins while the connection is busy, writes everything queued with one syscall — under
//! load, many frames per write. When the loop sleeps, the caller writes the queue itself
//! ([`ControlTx::signal`]), as before: no thread hop is added to an idle connection.
//!
//! Two locks keep the order and keep queuers off the syscall:
//! - `queue`: the frames not yet taken. Held only to append (and, for a data sender, to
//!   hand its job to the engines in the same critical section: the order rule of
//!   [`crate::onesided`]) or to take the whole queue.
//! - `socket`: held by whoever writes, from taking the queue to the end of the write. Queues
//!   are taken only under it, so they reach the stream in the order they were taken, and
//!   every frame in the order it was queued, whichever thread flushes.

use std::sync::{Arc, Mutex, MutexGuard};

use super::conn::{ControlConn, ControlError};
use super::message::Message;
use crate::wakeup::Wakeup;

/// Frames queued by callers, not yet taken by a writer.
struct Queue {
    bytes: Vec<u8>,
    /// A write failed part-way: the stream can no longer be framed.
    broken: bool,
}

/// The socket, held while writing, and the buffer a writer swaps with the queue (so the
/// steady state allocates nothing).
struct Socket {
    conn: ControlConn,
    spare: Vec<u8>,
}

/// The sending half of one control connection (see the module docs).
pub struct ControlTx {
    queue: Mutex<Queue>,
    socket: Mutex<Socket>,
    /// The control loop's: says whether it sleeps (then a queuer writes for it).
    wakeup: Arc<Wakeup>,
    peer: std::net::SocketAddr,
}

impl std::fmt::Debug for ControlTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlTx")
            .field("peer", &self.peer)
            .finish()
    }
}

impl ControlTx {
    /// Wraps the writing handle of a split control connection whose loop sleeps on `wakeup`.
    pub(crate) fn new(conn: ControlConn, wakeup: Arc<Wakeup>) -> Self {
        Self {
            peer: conn.peer_addr(),
            queue: Mutex::new(Queue {
                bytes: Vec::new(),
                broken: false,
            }),
            socket: Mutex::new(Socket {
                conn,
                spare: Vec::new(),
            }),
            wakeup,
        }
    }

    fn queue_lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn socket_lock(&self) -> MutexGuard<'_, Socket> {
        self.socket.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `msg` after running `before` in the same critical section: a data sender hands
    /// its job to the engines there, so that jobs and their markers are in one order. Nothing
    /// is written; see [`Self::post`] and [`Self::flush`]. An encoding error queues nothing
    /// (`before` has run).
    pub fn queue_with<R>(
        &self,
        before: impl FnOnce() -> R,
        msg: &Message,
    ) -> (R, Result<(), ControlError>) {
        let mut queue = self.queue_lock();
        let r = before();
        if queue.broken {
            return (r, Err(ControlError::Broken { peer: self.peer }));
        }
        // `encode` appends one whole frame, or nothing when it fails.
        let encoded = msg
            .encode(&mut queue.bytes)
            .map_err(|source| ControlError::Encode {
                peer: self.peer,
                kind: msg.kind(),
                source,
            });
        (r, encoded)
    }

    /// Queues `msg` without writing it.
    pub fn queue(&self, msg: &Message) -> Result<(), ControlError> {
        self.queue_with(|| (), msg).1
    }

    /// Makes sure what this thread queued leaves: the control loop writes it if it is awake
    /// (it checks the queue before it sleeps); if it sleeps, this thread writes it now.
    pub fn signal(&self) -> Result<(), ControlError> {
        if self.wakeup.is_sleeping() {
            self.flush()
        } else {
            Ok(())
        }
    }

    /// Queues `msg` and makes sure it leaves ([`Self::signal`]).
    pub fn post(&self, msg: &Message) -> Result<(), ControlError> {
        self.queue(msg)?;
        self.signal()
    }

    /// Whether frames are queued and not yet taken by a writer.
    pub fn has_queued(&self) -> bool {
        !self.queue_lock().bytes.is_empty()
    }

    /// Queues `msg` and writes it (with everything queued before it) on this thread.
    pub fn send(&self, msg: &Message) -> Result<(), ControlError> {
        self.queue(msg)?;
        self.flush()
    }

    /// Writes everything queued so far on this thread (waiting for a write in progress on
    /// another thread first). A failed write breaks the stream for good: every later call
    /// returns [`ControlError::Broken`].
    pub fn flush(&self) -> Result<(), ControlError> {
        let mut socket = self.socket_lock();
        let Socket { conn, spare } = &mut *socket;
        {
            let mut queue = self.queue_lock();
            if queue.broken {
                return Err(ControlError::Broken { peer: self.peer });
            }
            std::mem::swap(&mut queue.bytes, spare);
        }
        if spare.is_empty() {
            return Ok(());
        }
        let written = conn.write_raw(spare);
        spare.clear();
        if written.is_err() {
            self.queue_lock().broken = true;
        }
        written
    }

    /// Writes what is queued, then `Close { reason }`, and shuts down the sending half.
    pub fn close(&self, reason: &str) -> Result<(), ControlError> {
        self.send(&Message::Close {
            reason: reason.to_owned(),
        })?;
        self.socket_lock().conn.shutdown_write()
    }

    /// Shuts both directions of the socket down (a reader blocked on it returns).
    pub fn shutdown(&self) {
        self.socket_lock().conn.shutdown();
    }

    /// This side's address of the connection.
    pub fn local_addr(&self) -> Result<std::net::SocketAddr, ControlError> {
        self.socket_lock().conn.local_addr()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};
    use std::time::Duration;

    const WAIT: Duration = Duration::from_secs(10);

    /// A control connection over loopback: the sending half wrapped in a `ControlTx`, and
    /// the peer's receiving handle.
    fn connected() -> (ControlTx, Arc<Wakeup>, ControlConn) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let client = TcpStream::connect(addr).unwrap();
        let (server, _) = listener.accept().unwrap();
        let wakeup = Arc::new(Wakeup::new().unwrap());
        let tx = ControlTx::new(
            ControlConn::from_stream(client, WAIT).unwrap(),
            wakeup.clone(),
        );
        (tx, wakeup, ControlConn::from_stream(server, WAIT).unwrap())
    }

    fn note(thread: u8, seq: u32) -> Message {
        let mut bytes = vec![thread];
        bytes.extend_from_slice(&seq.to_le_bytes());
        Message::Notify { bytes }
    }

    #[test]
    fn frames_from_many_threads_arrive_once_each_in_each_threads_order() {
        let (tx, _wakeup, mut rx) = connected();
        const THREADS: u8 = 4;
        const PER_THREAD: u32 = 500;
        let reader = std::thread::spawn(move || {
            let mut next = [0u32; THREADS as usize];
            for _ in 0..u32::from(THREADS) * PER_THREAD {
                let Message::Notify { bytes } = rx.recv(WAIT).unwrap() else {
                    panic!("not a Notify");
                };
                let (t, seq) = (
                    usize::from(bytes[0]),
                    u32::from_le_bytes(bytes[1..5].try_into().unwrap()),
                );
                assert_eq!(seq, next[t], "thread {t}'s frames out of order or lost");
                next[t] += 1;
            }
            next
        });
        std::thread::scope(|s| {
            for t in 0..THREADS {
                let tx = &tx;
                s.spawn(move || {
                    for seq in 0..PER_THREAD {
                        // Queue-only, queue under the critical section, and write-now mixed:
                        // whoever writes, the queue leaves whole and in order.
                        match seq % 3 {
                            0 => tx.queue(&note(t, seq)).unwrap(),
                            1 => tx.queue_with(|| (), &note(t, seq)).1.unwrap(),
                            _ => tx.send(&note(t, seq)).unwrap(),
                        }
                    }
                });
            }
        });
        tx.flush().unwrap();
        assert_eq!(reader.join().unwrap(), [PER_THREAD; THREADS as usize]);
    }

    #[test]
    fn a_frame_posted_while_the_loop_sleeps_is_written_by_the_poster() {
        let (tx, wakeup, mut rx) = connected();
        // Awake: the loop will write it, so posting writes nothing.
        tx.post(&note(0, 1)).unwrap();
        assert!(tx.has_queued());
        // Asleep: the poster writes everything queued, its own frame last.
        wakeup.going_to_sleep();
        tx.post(&note(0, 2)).unwrap();
        assert!(!tx.has_queued());
        for seq in 1..=2 {
            assert!(matches!(rx.recv(WAIT).unwrap(), Message::Notify { bytes } if bytes[1] == seq));
        }
    }

    #[test]
    fn a_failed_write_breaks_the_stream_for_every_later_call() {
        let (tx, _wakeup, rx) = connected();
        drop(rx);
        // The peer is gone: sooner or later a write fails (reset), and then every call does.
        let failed = (0..10_000).any(|seq| tx.send(&note(0, seq)).is_err());
        assert!(failed, "writing to a closed peer never failed");
        assert!(matches!(
            tx.queue(&note(0, 0)),
            Err(ControlError::Broken { .. })
        ));
        assert!(matches!(tx.flush(), Err(ControlError::Broken { .. })));
    }
}
