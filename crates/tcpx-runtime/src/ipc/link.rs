//! [`LocalLink`]: what a local connection shares with its watcher thread and with the
//! operations in flight on it — the socket's write half, requests waiting for answers, the
//! importer's cache, and whether (and why) the link is over.
//!
//! The watcher ([`LocalLink::watch`]) reads every message the peer sends: it answers
//! `Validate` from this endpoint's adverts, drops revoked descriptors, closes every mapping
//! on a goodbye or when the socket ends, and hands answers to the requests waiting for them.

use std::collections::HashMap;
use std::fmt;
use std::io::Write;
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};

use super::cache::{Cache, Mapped};
use super::shared::IpcShared;
use super::wire::{read_msg, FrameError, Hello, Msg};
use crate::error::{Error, LocalErrorKind, Result};

/// An answer to a request of this side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Reply {
    /// The owner confirmed a descriptor.
    Granted,
    /// The owner refused it, saying why.
    Refused(String),
    /// A revocation or goodbye was carried out.
    Ack,
}

/// A request sent and not yet answered.
pub(crate) struct Waiter {
    req: u64,
    rx: Receiver<Reply>,
}

/// The shared half of a local connection.
pub(crate) struct LocalLink {
    pub(crate) shared: Arc<IpcShared>,
    /// What the peer said about itself.
    pub(crate) peer: Hello,
    /// The peer's pid as the kernel saw it at connect time (its hello's when the kernel's
    /// is not visible from this pid namespace).
    pub(crate) peer_pid: u32,
    /// The GPU this side copies on when its own memory is host memory (GPU 0 when unset).
    pub(crate) default_gpu: Option<usize>,
    label: String,
    writer: Mutex<UnixStream>,
    gone: OnceLock<(LocalErrorKind, String)>,
    pending: Mutex<HashMap<u64, Sender<Reply>>>,
    next_req: AtomicU64,
    pub(crate) cache: RwLock<Cache<Arc<Mapped>>>,
}

impl fmt::Debug for LocalLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalLink")
            .field("peer", &self.label)
            .field("gone", &self.gone.get())
            .finish()
    }
}

impl LocalLink {
    pub(crate) fn new(
        shared: Arc<IpcShared>,
        peer: Hello,
        peer_pid: u32,
        default_gpu: Option<usize>,
        writer: UnixStream,
    ) -> Arc<Self> {
        let label = match &peer.gpu_bus {
            Some(bus) => format!("pid {peer_pid} (GPU {bus})"),
            None => format!("pid {peer_pid}"),
        };
        Arc::new(Self {
            shared,
            peer,
            peer_pid,
            default_gpu,
            label,
            writer: Mutex::new(writer),
            gone: OnceLock::new(),
            pending: Mutex::new(HashMap::new()),
            next_req: AtomicU64::new(1),
            cache: RwLock::new(Cache::default()),
        })
    }

    /// How errors name the peer (`pid 4242 (GPU 0000:8a:00.0)`).
    pub(crate) fn label(&self) -> &str {
        &self.label
    }

    /// An error of this link.
    pub(crate) fn error(&self, kind: LocalErrorKind, what: impl Into<String>) -> Error {
        Error::Local {
            peer: self.label.clone(),
            kind,
            what: what.into(),
        }
    }

    /// Why the link is over, as an error; `None` while it is open.
    pub(crate) fn gone_error(&self) -> Option<Error> {
        self.gone
            .get()
            .map(|(kind, why)| self.error(*kind, why.clone()))
    }

    /// Fails once the link is over.
    pub(crate) fn check_open(&self) -> Result<()> {
        match self.gone_error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Ends the link (the first reason given is kept) and fails every request waiting for
    /// an answer.
    pub(crate) fn mark_gone(&self, kind: LocalErrorKind, why: impl Into<String>) {
        if self.gone.set((kind, why.into())).is_ok() {
            tracing::debug!(target: "tcpx_runtime::ipc", peer = %self.label, why = ?self.gone.get(), "local link over");
        }
        // Dropping the senders wakes every waiter with "disconnected".
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }

    /// Sends one message (the socket has a write timeout, so a peer that stopped reading
    /// fails the send instead of blocking it).
    pub(crate) fn send(&self, msg: &Msg) -> Result<()> {
        let frame = msg.encode();
        let written = self
            .writer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .write_all(&frame);
        written.map_err(|e| {
            let why = format!("writing to the peer failed: {e}");
            self.mark_gone(LocalErrorKind::PeerClosed, why.clone());
            self.error(LocalErrorKind::PeerClosed, why)
        })
    }

    /// Sends the request `make(id)` and returns what to wait on for its answer.
    pub(crate) fn ask(&self, make: impl FnOnce(u64) -> Msg) -> Result<Waiter> {
        self.check_open()?;
        let req = self.next_req.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(req, tx);
        // Gone between the check and the insert: `mark_gone` may have cleared before the
        // insert, so check again rather than wait for an answer that cannot come.
        if let Some(e) = self.gone_error() {
            self.forget(req);
            return Err(e);
        }
        if let Err(e) = self.send(&make(req)) {
            self.forget(req);
            return Err(e);
        }
        Ok(Waiter { req, rx })
    }

    fn forget(&self, req: u64) {
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&req);
    }

    /// The answer to `waiter`, waiting until `deadline`.
    pub(crate) fn answer_by(&self, waiter: Waiter, deadline: Instant) -> Result<Reply> {
        match waiter.rx.recv_deadline(deadline) {
            Ok(reply) => Ok(reply),
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                self.forget(waiter.req);
                Err(self.error(
                    LocalErrorKind::Timeout,
                    format!(
                        "no answer to request {} within {:?}",
                        waiter.req, self.shared.timeout
                    ),
                ))
            }
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => Err(self
                .gone_error()
                .unwrap_or_else(|| self.error(LocalErrorKind::PeerClosed, "the link ended"))),
        }
    }

    /// Sends `make(id)` and waits (the configured timeout) for its answer.
    pub(crate) fn request(&self, make: impl FnOnce(u64) -> Msg) -> Result<Reply> {
        let waiter = self.ask(make)?;
        self.answer_by(waiter, Instant::now() + self.shared.timeout)
    }

    fn answer(&self, req: u64, reply: Reply) {
        let waiting = self
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&req);
        // An answer nobody waits for any more (it timed out) is dropped.
        if let Some(tx) = waiting {
            let _ = tx.send(reply);
        }
    }

    fn retire(&self, mapped: Vec<Arc<Mapped>>) {
        for m in mapped {
            if let Err(e) = m.retire() {
                tracing::error!(target: "tcpx_runtime::ipc", peer = %self.label, "closing a mapping: {e}");
            }
        }
    }

    /// Closes every mapping of this link (each after the copies queued on it finished).
    pub(crate) fn retire_all(&self) {
        let all = self
            .cache
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        self.retire(all);
    }

    /// Drops `key`'s grant, closing the mapping it leaves unused.
    fn revoke_key(&self, key: u64) {
        let orphans = self
            .cache
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .revoke(key);
        self.retire(orphans);
    }

    /// Stops the watcher: the socket is shut down both ways, so its read returns.
    pub(crate) fn shutdown(&self) {
        let w = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        let _ = w.shutdown(Shutdown::Both);
    }

    /// The watcher thread's body: serves the peer's messages until the socket ends.
    pub(crate) fn watch(self: Arc<Self>, mut reader: UnixStream) {
        loop {
            let msg = match read_msg(&mut reader) {
                Ok(m) => m,
                Err(FrameError::Closed) => {
                    self.mark_gone(
                        LocalErrorKind::PeerClosed,
                        "the peer closed the connection (its process may have exited)",
                    );
                    break;
                }
                Err(FrameError::Io(e)) => {
                    self.mark_gone(
                        LocalErrorKind::PeerClosed,
                        format!("reading from the peer failed: {e}"),
                    );
                    break;
                }
                Err(e) => {
                    let why = format!("the peer sent a bad message: {e}");
                    tracing::warn!(target: "tcpx_runtime::ipc", peer = %self.label, "{why}");
                    self.mark_gone(LocalErrorKind::Protocol, why);
                    break;
                }
            };
            match msg {
                Msg::Validate {
                    req,
                    key,
                    handle,
                    offset,
                    len,
                } => {
                    let answer = match self.shared.adverts.check(key, &handle, offset, len) {
                        Ok(()) => Msg::Granted { req },
                        Err(reason) => {
                            tracing::info!(target: "tcpx_runtime::ipc", peer = %self.label, key, "refused: {reason}");
                            Msg::Refused { req, reason }
                        }
                    };
                    let _ = self.send(&answer);
                }
                Msg::Granted { req } => self.answer(req, Reply::Granted),
                Msg::Refused { req, reason } => self.answer(req, Reply::Refused(reason)),
                Msg::RevokeAck { req } | Msg::GoodbyeAck { req } => self.answer(req, Reply::Ack),
                Msg::Revoke { req, key } => {
                    self.revoke_key(key);
                    let _ = self.send(&Msg::RevokeAck { req });
                }
                Msg::Goodbye { req, reason } => {
                    self.mark_gone(
                        LocalErrorKind::PeerClosed,
                        format!("the peer closed the connection: {reason}"),
                    );
                    self.retire_all();
                    let _ = self.send(&Msg::GoodbyeAck { req });
                }
                Msg::Hello(_) => {
                    self.mark_gone(LocalErrorKind::Protocol, "the peer sent a second hello");
                    break;
                }
            }
        }
        // Nothing of a departed peer's memory stays mapped.
        self.retire_all();
    }
}
