//! Blocking waits that stay interruptible: the GIL is released while waiting, in slices short
//! enough that Ctrl-C (a pending signal, checked between slices) raises `KeyboardInterrupt`
//! within about one slice.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use tcpx_runtime::Transfer;

use crate::errors::{Failure, Kind, Outcome};

/// How long one slice of a blocking wait lasts without looking at signals.
pub const SLICE: Duration = Duration::from_millis(20);

/// `seconds` as a timeout (`None`: no limit of its own).
pub fn timeout(seconds: Option<f64>) -> Outcome<Option<Duration>> {
    match seconds {
        None => Ok(None),
        Some(s) if s.is_finite() && s >= 0.0 => Ok(Some(Duration::from_secs_f64(s.min(1e9)))),
        Some(s) => Err(Failure::bad(format!(
            "timeout must be a non-negative number of seconds, got {s}"
        ))),
    }
}

/// Waits for `transfer` up to `limit` (`None`: until it finishes; the runtime's own transfer
/// timeout, `TCPX_TIMEOUT_MS`, fails a stuck one). The outer error is a signal (Ctrl-C); the
/// inner one the transfer's failure or the wait running out.
pub fn transfer(py: Python<'_>, t: &Transfer, limit: Option<Duration>) -> PyResult<Outcome<u64>> {
    if let Some(outcome) = t.poll() {
        return Ok(outcome.map_err(Failure::from));
    }
    let deadline = limit.map(|l| Instant::now() + l);
    loop {
        let slice = match deadline {
            Some(d) => SLICE.min(d.saturating_duration_since(Instant::now())),
            None => SLICE,
        };
        match py.detach(|| t.wait(slice)) {
            Ok(n) => return Ok(Ok(n)),
            Err(tcpx_runtime::Error::WaitTimedOut(_)) => {}
            Err(e) => return Ok(Err(e.into())),
        }
        py.check_signals()?;
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(Err(Failure::new(
                Kind::Timeout,
                format!(
                    "transfer not complete after waiting {:?} (it is still in progress)",
                    limit.unwrap_or_default()
                ),
            )));
        }
    }
}

/// Runs `work` on a helper thread and waits for it without the GIL, in slices, so that a
/// slow connect can be interrupted with Ctrl-C (the helper then finishes on its own and
/// drops what it made).
pub fn blocking<T: Send + 'static>(
    py: Python<'_>,
    work: impl FnOnce() -> T + Send + 'static,
) -> PyResult<T> {
    cancellable(py, None, work)
}

/// [`blocking`], and on Ctrl-C also sets `cancel` (when given) before raising, so that work
/// which looks at it (a rendezvous polling a Python store) stops within one of its polls
/// instead of running to its deadline.
pub fn cancellable<T: Send + 'static>(
    py: Python<'_>,
    cancel: Option<Arc<AtomicBool>>,
    work: impl FnOnce() -> T + Send + 'static,
) -> PyResult<T> {
    let (tx, rx) = mpsc::sync_channel(1);
    // A `Receiver` is `Send` but not `Sync`; the mutex lets the GIL-free closure borrow it.
    let rx = std::sync::Mutex::new(rx);
    std::thread::Builder::new()
        .name("tcpx-py-connect".into())
        .spawn(move || {
            let _ = tx.send(work());
        })
        .map_err(|e| Failure::new(Kind::Other, format!("starting a thread: {e}")).into_py(py))?;
    loop {
        match py.detach(|| {
            rx.lock()
                .unwrap_or_else(|p| p.into_inner())
                .recv_timeout(SLICE)
        }) {
            Ok(v) => return Ok(v),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if let Err(signal) = py.check_signals() {
                    if let Some(flag) = &cancel {
                        flag.store(true, Ordering::Relaxed);
                    }
                    return Err(signal);
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(Failure::new(Kind::Other, "the helper thread panicked").into_py(py))
            }
        }
    }
}
