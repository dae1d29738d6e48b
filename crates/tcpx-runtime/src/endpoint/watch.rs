//! The connection's control loop: the one thread that reads its control stream for its whole
//! life, answers one-sided operations and writes what other threads queue on it.
//!
//! It delivers the peer's segment lists to vectored transfers, serves and answers one-sided
//! operations (in stream order: see [`crate::onesided`]), and it is how a peer's
//! departure is noticed quickly: `Close`, end of stream or a reset mark the peer gone (the
//! engines then fail whatever stops progressing), and a peer `Error` fails the connection at
//! once. The other way round too: when this side fails the connection (its plugin failed, a
//! transfer timed out, the peer broke the protocol), the loop tells the peer with an `Error`
//! within one poll — or as it exits, when what ended it was a frame it read — so the peer's
//! transfers fail with the reason instead of waiting for their own deadline.
//!
//! # Why one loop, spinning while busy
//! A one-sided operation crosses the control stream twice (request, answer). With a reader
//! blocked in `read`, an acknowledger thread waiting on each job and every caller writing its
//! own frame, each operation paid three thread wake-ups and two write syscalls on the
//! critical path, and 64 KiB writes ran at a third of two-sided sends on a 16-core machine
//! (issue 25). So one loop does it all without blocking while there is work: reads whatever
//! arrived (without waiting), builds and queues jobs, hands over every answered item whose
//! job finished, and writes all queued frames — its own answers and other threads' requests —
//! in one syscall. It spins for the configured wait spin (or the engines' idle linger, if
//! longer) after the last progress, then sleeps
//! in `poll` on the socket and an eventfd that an engine finishing the job the loop waits for
//! rings ([`crate::wakeup::Wakeup`]); a thread that queues a frame while the loop sleeps
//! writes it itself. The loop never waits on data: a job that is not done stays queued.
//!
//! It exits when the stream ends or the connection is dropped (which shuts the socket down),
//! then hands over what is left, waiting for each job (bounded by its deadline).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::carrier::Carrier;
use crate::control::{ControlConn, ControlError, Message, MessageType};
use crate::error::{Error, Result};
use crate::onesided::state::Rma;
use crate::onesided::target::Acknowledger;
use crate::wakeup::Wakeup;

/// Longest sleep before the loop checks its stop flag, the link's failure and the pending
/// operations' deadlines again.
const POLL: Duration = Duration::from_millis(200);

/// How often a busy loop checks the pending operations' deadlines (`Rma::sweep`, which acts
/// every 50 ms at most anyway).
const SWEEP_EVERY: Duration = Duration::from_millis(5);

/// Most frames handled between two writes of what is queued: bounds how long an answer
/// waits behind a burst of requests.
const FRAMES_PER_PASS: usize = 64;

pub(crate) fn spawn(
    carrier: Arc<Carrier>,
    reader: ControlConn,
    stop: Arc<AtomicBool>,
    rma: Arc<Rma>,
    wakeup: Arc<Wakeup>,
) -> Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("tcpx-ctl-{}", carrier.link.id))
        .spawn(move || {
            // Small one-sided operations on GPU memory copy on this thread: it may keep
            // their GPU's context current between copies.
            tcpx::cuda::own_this_thread();
            let mut acks = Acknowledger::default();
            let mut told_peer = false;
            run(
                &carrier,
                reader,
                &stop,
                &rma,
                &wakeup,
                &mut acks,
                &mut told_peer,
            );
            let link = &carrier.link;
            // A failure the loop found in what the peer sent (a protocol violation) ends the
            // loop at once: the peer still learns why, before the stream closes, instead of
            // waiting for its own deadline.
            if let (false, Some(error)) = (told_peer, link.failure()) {
                tell_peer(&rma, error);
            }
            // Nobody flushes for a thread that queues a frame from now on: it writes its own
            // (or learns that the stream is gone). What was queued before leaves now.
            wakeup.going_to_sleep();
            let _ = rma.writer.flush();
            // No answer to a one-sided operation can arrive any more.
            let error = link.failure().cloned().unwrap_or(Error::PeerClosed {
                peer: link.peer,
                reason: "the control connection ended".into(),
            });
            rma.close(error);
            acks.drain(&rma);
        })
        .map_err(|e| Error::Internal(format!("cannot start the control loop: {e}")))
}

/// What one received frame means for the loop.
enum Next {
    Go,
    Exit,
}

fn run(
    carrier: &Carrier,
    mut reader: ControlConn,
    stop: &AtomicBool,
    rma: &Rma,
    wakeup: &Arc<Wakeup>,
    acks: &mut Acknowledger,
    told_peer: &mut bool,
) {
    let link = &carrier.link;
    // As long as an idle engine lingers: an application that polls (NIXL's agents) leaves
    // 100-300 us between one transfer's end and the next one's request, and a loop asleep
    // by then made each transfer pay two more wake-ups (1 MiB NIXL writes at 0.35 x).
    let spin = rma.config.wait_spin.max(rma.config.idle_linger);
    let mut last_progress = Instant::now();
    // Since when queued frames have waited for a socket that takes nothing.
    let mut unsent_since: Option<Instant> = None;
    let mut last_sweep = Instant::now()
        .checked_sub(SWEEP_EVERY)
        .unwrap_or_else(Instant::now);
    loop {
        if stop.load(Ordering::Acquire) {
            return;
        }
        if !*told_peer {
            if let Some(error) = link.failure() {
                *told_peer = true;
                tell_peer(rma, error);
            }
        }
        // Deadlines are checked at most every few milliseconds: `sweep` takes the pending
        // operations' lock, which a spinning loop would otherwise take on every pass.
        if last_sweep.elapsed() >= SWEEP_EVERY {
            last_sweep = Instant::now();
            rma.sweep(last_sweep);
        }
        let mut progressed = false;
        // Everything that arrived, without waiting.
        let mut frames = 0;
        while frames < FRAMES_PER_PASS {
            match reader.next_buffered() {
                Some(Ok(message)) => {
                    frames += 1;
                    if let Next::Exit = on_message(carrier, rma, message, acks) {
                        return;
                    }
                    continue;
                }
                Some(Err(e)) => {
                    on_read_error(link, stop, e);
                    return;
                }
                None => {}
            }
            match reader.read_now() {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => {
                    on_read_error(link, stop, e);
                    return;
                }
            }
        }
        progressed |= frames > 0;
        progressed |= acks.advance(rma);
        // Written without waiting for the socket: this loop must go on reading whatever the
        // peer sends, or two peers whose streams are both full would wait for each other.
        let before = rma.writer.written();
        match rma.writer.flush_now() {
            Ok(true) => unsent_since = None,
            Ok(false) => {
                let since = *unsent_since.get_or_insert_with(Instant::now);
                if since.elapsed() > rma.config.timeout {
                    link.fail(
                        ControlError::Timeout {
                            peer: link.peer,
                            waited: rma.config.timeout,
                            during: "sending control messages; the peer is not reading",
                        }
                        .into(),
                    );
                    return;
                }
            }
            Err(e) => {
                link.fail(e.into());
                return;
            }
        }
        if rma.writer.written() != before {
            progressed = true;
            unsent_since = unsent_since.map(|_| Instant::now());
        }
        acks.delivered(rma);
        if progressed {
            last_progress = Instant::now();
            continue;
        }
        if last_progress.elapsed() < spin {
            std::hint::spin_loop();
            continue;
        }
        // Nothing to do for a while: sleep until the socket, an engine finishing the job the
        // head item waits for, or the poll interval wakes us. Frames other threads queue
        // from now on are theirs to write (they see `sleeping`).
        wakeup.going_to_sleep();
        let sleep = if rma.writer.has_queued() {
            Duration::ZERO
        } else {
            acks.may_sleep(wakeup, POLL)
        };
        if !sleep.is_zero() {
            poll_readable(
                reader.raw_fd(),
                rma.writer.has_unsent(),
                wakeup.raw_fd(),
                sleep,
            );
        }
        wakeup.awake();
        last_progress = Instant::now();
    }
}

/// Handles one frame from the peer.
fn on_message(carrier: &Carrier, rma: &Rma, message: Message, acks: &mut Acknowledger) -> Next {
    let link = &carrier.link;
    let peer = link.peer;
    match message {
        message @ (Message::WriteRequest(_)
        | Message::ReadRequest(_)
        | Message::Notify { .. }
        | Message::WriteAck { .. }
        | Message::ReadData { .. }
        | Message::ReadRefused { .. }
        | Message::ReadInline { .. }) => {
            if let Err(e) = rma.on_message(message, acks.items()) {
                link.fail(e);
                return Next::Exit;
            }
        }
        Message::Segments { transfer_id, lens } => {
            if !carrier.on_peer_segments(transfer_id, lens) {
                return Next::Exit;
            }
        }
        Message::Close { reason } => {
            link.set_peer_gone(format!("the peer closed the connection ({reason})"));
        }
        Message::Error { code, message } => {
            link.fail(Error::PeerClosed {
                peer,
                reason: format!("the peer reported a {code} error: {message}"),
            });
            return Next::Exit;
        }
        other => {
            link.fail(
                ControlError::Unexpected {
                    peer,
                    expected: MessageType::Segments,
                    got: other.kind(),
                }
                .into(),
            );
            return Next::Exit;
        }
    }
    Next::Go
}

fn on_read_error(link: &crate::link::Link, stop: &AtomicBool, e: ControlError) {
    match e {
        ControlError::Closed { .. } => link.set_peer_gone("the control connection ended".into()),
        e => {
            if !stop.load(Ordering::Acquire) {
                link.set_peer_gone(format!("the control connection failed: {e}"));
            }
        }
    }
}

/// Sleeps until `socket` is readable (or writable, when `unsent` frames wait for it), hung
/// up, `wakeup` rang, or `timeout` passed.
fn poll_readable(
    socket: std::os::fd::RawFd,
    unsent: bool,
    wakeup: std::os::fd::RawFd,
    timeout: Duration,
) {
    let mut fds = [
        libc::pollfd {
            fd: socket,
            events: if unsent {
                libc::POLLIN | libc::POLLOUT
            } else {
                libc::POLLIN
            },
            revents: 0,
        },
        libc::pollfd {
            fd: wakeup,
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    // Round up: a sub-millisecond wait must not become a busy zero-timeout poll.
    let ms = i32::try_from(timeout.as_micros().div_ceil(1000)).unwrap_or(i32::MAX);
    // SAFETY: `fds` is a live array of two initialised `pollfd`s for the whole call, and the
    // count passed is its length. Both descriptors stay open: the socket is `reader`'s, the
    // eventfd the loop's `Wakeup`'s, both held by the caller.
    unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
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
    if let Err(e) = rma.writer.send(&message) {
        tracing::debug!(target: "tcpx_runtime", peer = %rma.link.peer, error = %e, "could not tell the peer why the connection failed");
    }
}
