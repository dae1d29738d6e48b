//! The thread that reads a connection's control stream for its whole life.
//!
//! It delivers the peer's segment lists to vectored transfers, serves and answers one-sided
//! operations (in stream order: see [`crate::onesided`]), and it is how a peer's
//! departure is noticed quickly: `Close`, end of stream or a reset mark the peer gone (the
//! engines then fail whatever stops progressing), and a peer `Error` fails the connection at
//! once. It exits when the stream ends or the connection is dropped (which shuts the socket
//! down, waking a blocked read).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use super::connection::{apply_segments, hold_early_segments};
use crate::control::{ControlConn, ControlError, Message, MessageType};
use crate::error::{Error, Result};
use crate::link::{local_key_of_peer_segments, Link};
use crate::onesided::state::Rma;
use crate::onesided::target::TargetItem;

/// How long one read waits before checking the stop flag again.
const POLL: Duration = Duration::from_millis(200);

pub(crate) fn spawn(
    link: Arc<Link>,
    reader: ControlConn,
    stop: Arc<AtomicBool>,
    chunk_bytes: u32,
    rma: Arc<Rma>,
    acker: Sender<TargetItem>,
) -> Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("tcpx-ctl-{}", link.id))
        .spawn(move || {
            watch(&link, reader, &stop, chunk_bytes, &rma, &acker);
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
    link: &Link,
    mut reader: ControlConn,
    stop: &AtomicBool,
    chunk_bytes: u32,
    rma: &Rma,
    acker: &Sender<TargetItem>,
) {
    let peer = link.peer;
    loop {
        if stop.load(Ordering::Acquire) {
            return;
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
                let key = local_key_of_peer_segments(transfer_id);
                let waiting = link
                    .segments
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .waiting
                    .remove(&key);
                match waiting {
                    Some(job) => apply_segments(&job, &lens, chunk_bytes),
                    None => {
                        if !hold_early_segments(link, key, lens) {
                            link.fail(Error::PeerClosed {
                                peer,
                                reason: "protocol violation: too many segment lists ahead of \
                                         this side's transfers"
                                    .into(),
                            });
                            return;
                        }
                    }
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
