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
//!
//! The control loop never blocks on a write (`ControlTx::flush_now`): it writes what the
//! socket takes and keeps the rest for later, so that it always goes on reading. Two peers
//! whose control streams are both full would otherwise each wait for the other to read.
//! Other threads write with [`ControlTx::flush`], which waits (up to the write timeout).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};

use super::conn::{ControlConn, ControlError};
use super::message::Message;
use crate::wakeup::Wakeup;

/// Frames queued by callers, not yet taken by a writer.
struct Queue {
    bytes: Vec<u8>,
    /// A write failed part-way: the stream can no longer be framed.
    broken: bool,
}

/// The socket, held while writing, and the bytes taken from the queue that the socket did not
/// take yet (`unsent[sent..]`; the buffer is swapped with the queue's when empty, so the
/// steady state allocates nothing).
struct Socket {
    conn: ControlConn,
    unsent: Vec<u8>,
    sent: usize,
}

/// The sending half of one control connection (see the module docs).
pub struct ControlTx {
    queue: Mutex<Queue>,
    socket: Mutex<Socket>,
    /// Bytes ever queued (see [`ControlTx::queued_mark`]); changed under the queue lock.
    queued: AtomicU64,
    /// Bytes ever written (see [`ControlTx::written`]); changed under the socket lock. Equal
    /// to `queued` when nothing waits: the spinning control loop checks that without locks.
    written: AtomicU64,
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
                unsent: Vec::new(),
                sent: 0,
            }),
            queued: AtomicU64::new(0),
            written: AtomicU64::new(0),
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
        let before_len = queue.bytes.len();
        let encoded = msg
            .encode(&mut queue.bytes)
            .map_err(|source| ControlError::Encode {
                peer: self.peer,
                kind: msg.kind(),
                source,
            });
        self.queued
            .fetch_add((queue.bytes.len() - before_len) as u64, Ordering::AcqRel);
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

    /// The stream position after everything queued so far: once [`Self::written`] reaches
    /// it, every frame queued before this call is on the wire.
    pub fn queued_mark(&self) -> u64 {
        self.queued.load(Ordering::Acquire)
    }

    /// Bytes written to the socket so far.
    pub fn written(&self) -> u64 {
        self.written.load(Ordering::Acquire)
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
        self.write_taken(&mut socket, true).map(|_| ())
    }

    /// For the control loop: writes what the socket takes now, without waiting for it or for
    /// another thread's write, and keeps the rest (in order) for the next call. `Ok(true)`
    /// when nothing is left unwritten.
    pub(crate) fn flush_now(&self) -> Result<bool, ControlError> {
        // Nothing queued or unsent: no lock taken (the loop calls this on every pass).
        if self.written.load(Ordering::Acquire) == self.queued.load(Ordering::Acquire) {
            return Ok(true);
        }
        let mut socket = match self.socket.try_lock() {
            Ok(socket) => socket,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            // Another thread is writing: it takes the queue too.
            Err(TryLockError::WouldBlock) => return Ok(false),
        };
        self.write_taken(&mut socket, false)
    }

    /// Whether any queued byte is not written yet (the loop then polls for writability).
    pub(crate) fn has_unsent(&self) -> bool {
        self.written() != self.queued_mark()
    }

    /// Takes the queue behind what is still unsent and writes: all of it (`wait`), or what
    /// the socket takes now. `Ok(true)` when nothing is left.
    fn write_taken(&self, socket: &mut Socket, wait: bool) -> Result<bool, ControlError> {
        let Socket { conn, unsent, sent } = socket;
        {
            let mut queue = self.queue_lock();
            if queue.broken {
                return Err(ControlError::Broken { peer: self.peer });
            }
            if *sent == unsent.len() {
                unsent.clear();
                *sent = 0;
                std::mem::swap(&mut queue.bytes, unsent);
            } else {
                unsent.extend_from_slice(&queue.bytes);
                queue.bytes.clear();
            }
        }
        if *sent == unsent.len() {
            return Ok(true);
        }
        let result = if wait {
            conn.write_raw(&unsent[*sent..])
                .map(|()| unsent.len() - *sent)
        } else {
            conn.write_now(&unsent[*sent..])
        };
        match result {
            Ok(n) => {
                *sent += n;
                self.written.fetch_add(n as u64, Ordering::AcqRel);
                if *sent == unsent.len() {
                    unsent.clear();
                    *sent = 0;
                    Ok(true)
                } else {
                    Ok(false)
                }
            }
            Err(e) => {
                self.queue_lock().broken = true;
                Err(e)
            }
        }
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
