//! [`AcceptStop`]: how [`Endpoint::stop_accepting`](super::Endpoint::stop_accepting) ends
//! every accept at once, in every thread, instead of leaving each to its own timeout.
//!
//! An application that accepts in a loop with a short timeout (NIXL's agents poll every
//! few milliseconds) otherwise makes its own teardown wait for the running poll: a NIXL
//! agent's destruction took a poll's length (5 ms, against UCX's 2–3 ms) just to join its
//! accept threads. Network accepts wait on a channel and same-host accepts in `poll(2)`, so
//! the stop is said both ways: a channel whose only sender is dropped (every receiver returns
//! at once, disconnected) and a socket pair whose one end is closed (the other end stays
//! readable: end of file).

use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::Mutex;

use crossbeam_channel::{Receiver, Sender};

/// The stop signal of one endpoint's accepts (see the module docs).
#[derive(Debug)]
pub(crate) struct AcceptStop {
    /// Dropped by [`Self::stop`]: `signal` then never blocks again.
    sender: Mutex<Option<Sender<()>>>,
    signal: Receiver<()>,
    /// Closed by [`Self::stop`]: `watched` then polls readable for good.
    poke: Mutex<Option<UnixStream>>,
    watched: UnixStream,
}

impl AcceptStop {
    pub(crate) fn new() -> io::Result<Self> {
        let (sender, signal) = crossbeam_channel::bounded(0);
        let (poke, watched) = UnixStream::pair()?;
        Ok(Self {
            sender: Mutex::new(Some(sender)),
            signal,
            poke: Mutex::new(Some(poke)),
            watched,
        })
    }

    /// Stops every accept, now and later (idempotent).
    pub(crate) fn stop(&self) {
        drop(self.sender.lock().unwrap_or_else(|p| p.into_inner()).take());
        drop(self.poke.lock().unwrap_or_else(|p| p.into_inner()).take());
    }

    /// Whether [`Self::stop`] ran.
    pub(crate) fn is_stopped(&self) -> bool {
        self.sender
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_none()
    }

    /// A receiver that becomes ready (disconnected) when stopped: for `select!` beside the
    /// admission queue. Nothing is ever sent on it.
    pub(crate) fn signal(&self) -> &Receiver<()> {
        &self.signal
    }

    /// A descriptor that polls readable once stopped: for `poll(2)` beside the same-host
    /// listeners.
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.watched.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn stopping_wakes_a_waiting_receiver_at_once_and_for_good() {
        let stop = std::sync::Arc::new(AcceptStop::new().unwrap());
        assert!(!stop.is_stopped());
        assert!(stop
            .signal()
            .recv_timeout(Duration::from_millis(20))
            .unwrap_err()
            .is_timeout());
        let waiter = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let start = Instant::now();
                let r = stop.signal().recv_timeout(Duration::from_secs(30));
                (r.unwrap_err().is_disconnected(), start.elapsed())
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        stop.stop();
        stop.stop();
        let (disconnected, waited) = waiter.join().unwrap();
        assert!(
            disconnected && waited < Duration::from_secs(10),
            "{waited:?}"
        );
        assert!(stop.is_stopped());
        assert!(stop.signal().try_recv().unwrap_err().is_disconnected());
    }
}
