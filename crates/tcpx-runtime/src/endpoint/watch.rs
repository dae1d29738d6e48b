//! The thread that reads a connection's control stream for its whole life.
//!
//! It delivers the peer's segment lists to vectored transfers, serves and answers one-sided
//! operations (in stream order: see [`crate::onesided`]), and it is how a peer's
//! departure is noticed quickly: `Close`, end of stream or a reset mark the peer gone (the
//! engines then fail whatever stops progressing), and a peer `Error` fails the connection at
//! once. The other way round too: when this side fails the connection (its plugin failed, a
//! transfer timed out), the watcher tells the peer with an `Error` within one poll, so the
//! peer's transfers fail with the reason instead of waiting for their own deadline. It exits when the stream ends or the connection is dropped (which shuts the socket
//! down, waking a blocked read).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use crate::carrier::Carrier;
use crate::control::{ControlConn, ControlError, Message, MessageType};
use crate::error::{Error, Result};
use crate::onesided::state::Rma;
use crate::onesided::target::TargetItem;

/// How long one read waits before checking the stop flag again.
const POLL: Duration = Duration::from_millis(200);

pub(crate) fn spawn(
    carrier: Arc<Carrier>,
    reader: ControlConn,
    stop: Arc<AtomicBool>,
    chunk_bytes: u32,
    rma: Arc<Rma>,
    acker: Sender<TargetItem>,
) -> Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("tcpx-ctl-{}", carrier.link.id))
        .spawn(move || {
            watch(&carrier, reader, &stop, chunk_bytes, &rma, &acker);
            let link = &carrier.link;
            // No answer to a one-sided operation can arrive any more.
            let error = link.failure().cloned().unwrap_or(Error::PeerClosed {
                peer: link.peer,
                reason: "the control connection ended".into(),
            });
            rma.close(error);
            // Dropping `acker` (the only sender) lets the acknowledger finish.
        })
        .map_err(|e| Error::Internal(format!("cannot start the control watcher: {e}")))
}

fn watch(
    carrier: &Carrier,
    mut reader: ControlConn,
    stop: &AtomicBool,
    chunk_bytes: u32,
    rma: &Rma,
    acker: &Sender<TargetItem>,
) {
    let link = &carrier.link;
    let peer = link.peer;
    let mut told_peer = false;
    loop {
        if stop.load(Ordering::Acquire) {
            return;
        }
        if !told_peer {
            if let Some(error) = link.failure() {
                told_peer = true;
                tell_peer(rma, error);
            }
        }
        rma.sweep(Instant::now());
        match reader.recv(POLL) {
            Ok(
                message @ (Message::WriteRequest(_)
                | Message::ReadRequest(_)
                | Message::Notify { .. }
                | Message::WriteAck { .. }
                | Message::ReadData { .. }
                | Message::ReadRefused { .. }),
            ) => {
                if let Err(e) = rma.on_message(message, acker) {
                    link.fail(e);
                    return;
                }
            }
            Ok(Message::Segments { transfer_id, lens }) => {
                if !carrier.on_peer_segments(transfer_id, lens, chunk_bytes) {
                    return;
                }
            }
            Ok(Message::Close { reason }) => {
                link.set_peer_gone(format!("the peer closed the connection ({reason})"));
            }
            Ok(Message::Error { code, message }) => {
                link.fail(Error::PeerClosed {
                    peer,
                    reason: format!("the peer reported a {code} error: {message}"),
                });
                return;
            }
            Ok(other) => {
                link.fail(
                    ControlError::Unexpected {
                        peer,
                        expected: MessageType::Segments,
                        got: other.kind(),
                    }
                    .into(),
                );
                return;
            }
            Err(e) if e.is_timeout() => {}
            Err(ControlError::Closed { .. }) => {
                link.set_peer_gone("the control connection ended".into());
                return;
            }
            Err(e) => {
                if !stop.load(Ordering::Acquire) {
                    link.set_peer_gone(format!("the control connection failed: {e}"));
                }
                return;
            }
        }
    }
}

/// Longest error text sent to the peer (the rest is cut at a character boundary).
const MAX_ERROR_TEXT: usize = 1024;

/// Tells the peer why this side failed the connection. Errors that came from the peer are not
/// echoed back, and neither is our own close (dropping the connection sends `Close`). Best
/// effort: a peer that is gone cannot be told, and its own deadline still ends its transfers.
fn tell_peer(rma: &Rma, error: &Error) {
    if matches!(error, Error::PeerClosed { .. } | Error::Closed { .. }) {
        return;
    }
    let mut text = error.to_string();
    if text.len() > MAX_ERROR_TEXT {
        let mut cut = MAX_ERROR_TEXT;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
    }
    let message = Message::Error {
        code: error.wire_code(),
        message: text,
    };
    if let Err(e) = rma.writer().send(&message) {
        tracing::debug!(target: "tcpx_runtime", peer = %rma.link.peer, error = %e, "could not tell the peer why the connection failed");
    }
}
