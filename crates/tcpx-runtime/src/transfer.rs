//! [`Transfer`]: the application's handle on one send or receive, and the completion state
//! the engines finish it through.
//!
//! Completion is a write-once outcome plus a wake-up. The engine finishing a transfer
//! publishes the outcome and touches the wake-up (a `Mutex<bool>` and a `Condvar`) only if a
//! thread is blocked in [`Transfer::wait`]: a futex wake per transfer on the engine thread,
//! and the waiter's context switch onto a core an engine is polling on, are what a stream of
//! small transfers would otherwise pay. The handle holds no comm, registration or
//! connection, so keeping an old `Transfer` around keeps no fd open.

use std::sync::atomic::{fence, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::error::{Direction, Error, Result};

/// Write-once outcome of a transfer and the wake-up of its waiters.
#[derive(Debug, Default)]
pub(crate) struct Completion {
    outcome: OnceLock<Result<u64>>,
    /// Threads blocked (or about to block) in `wait`.
    waiters: AtomicUsize,
    finished: Mutex<bool>,
    wake: Condvar,
}

impl Completion {
    /// Records the outcome (the first call wins) and wakes waiters. Returns whether this call
    /// was the one that finished it.
    pub(crate) fn finish(&self, outcome: Result<u64>) -> bool {
        if self.outcome.set(outcome).is_err() {
            return false;
        }
        // Pairs with the fence in `wait`: either this load sees the waiter, or the waiter's
        // check after registering sees the outcome and does not block.
        fence(Ordering::SeqCst);
        if self.waiters.load(Ordering::SeqCst) > 0 {
            let mut finished = self.finished.lock().unwrap_or_else(|p| p.into_inner());
            *finished = true;
            self.wake.notify_all();
        }
        true
    }

    pub(crate) fn get(&self) -> Option<&Result<u64>> {
        self.outcome.get()
    }

    pub(crate) fn is_finished(&self) -> bool {
        self.outcome.get().is_some()
    }

    /// Waits up to `timeout`, polling for the first `spin` of it before sleeping.
    fn wait(&self, timeout: Duration, spin: Duration) -> Option<&Result<u64>> {
        if let Some(outcome) = self.outcome.get() {
            return Some(outcome);
        }
        let start = Instant::now();
        let spin = spin.min(timeout);
        if !spin.is_zero() {
            // The clock is read once per batch of polls: a poll is one load, the clock ~20 ns.
            loop {
                for _ in 0..64 {
                    if let Some(outcome) = self.outcome.get() {
                        return Some(outcome);
                    }
                    std::hint::spin_loop();
                }
                if start.elapsed() >= spin {
                    break;
                }
            }
        }
        let deadline = start + timeout;
        let mut finished = self.finished.lock().unwrap_or_else(|p| p.into_inner());
        self.waiters.fetch_add(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        // Under the lock: a finisher that saw us registered notifies only after we wait.
        while !*finished && self.outcome.get().is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            finished = self
                .wake
                .wait_timeout(finished, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        self.waiters.fetch_sub(1, Ordering::SeqCst);
        drop(finished);
        self.outcome.get()
    }
}

/// One send or receive submitted on a [`crate::Connection`].
///
/// It completes with the number of bytes moved, or with the error that ended it (the peer
/// went away, a plugin error naming channel and peer, the configured timeout). Dropping the
/// handle does not cancel the transfer.
#[derive(Debug, Clone)]
pub struct Transfer {
    completion: Arc<Completion>,
    direction: Direction,
    len: u64,
    /// How long [`Transfer::wait`] polls before sleeping ([`crate::Config::wait_spin`]).
    spin: Duration,
}

impl Transfer {
    pub(crate) fn new(
        completion: Arc<Completion>,
        direction: Direction,
        len: u64,
        spin: Duration,
    ) -> Self {
        Self {
            completion,
            direction,
            len,
            spin,
        }
    }

    /// Whether this side sends or receives.
    pub fn direction(&self) -> Direction {
        self.direction
    }

    /// Bytes in the transfer.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True for a zero-byte transfer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `None` while in progress; then the bytes moved or the error. Never blocks.
    pub fn poll(&self) -> Option<Result<u64>> {
        self.completion.get().cloned()
    }

    /// True once finished (successfully or not).
    pub fn is_finished(&self) -> bool {
        self.completion.is_finished()
    }

    /// Blocks until the transfer finishes or `timeout` passes. Running out of time returns
    /// [`Error::WaitTimedOut`] and leaves the transfer running (the configured transfer
    /// timeout, enforced by the engines, is what fails it).
    pub fn wait(&self, timeout: Duration) -> Result<u64> {
        match self.completion.wait(timeout, self.spin) {
            Some(outcome) => outcome.clone(),
            None => Err(Error::WaitTimedOut(timeout)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finishing_without_waiters_and_racing_waiters_never_lose_a_wake_up() {
        for _ in 0..200 {
            let c = Arc::new(Completion::default());
            let t = Transfer::new(c.clone(), Direction::Recv, 1, Duration::ZERO);
            let waiter = std::thread::spawn(move || t.wait(Duration::from_secs(10)));
            std::thread::yield_now();
            c.finish(Ok(1));
            assert_eq!(waiter.join().unwrap().unwrap(), 1);
        }
    }

    #[test]
    fn first_outcome_wins_and_wakes_a_waiter() {
        let c = Arc::new(Completion::default());
        let t = Transfer::new(c.clone(), Direction::Send, 10, Duration::from_micros(50));
        assert!(t.poll().is_none());
        assert!(matches!(
            t.wait(Duration::from_millis(1)),
            Err(Error::WaitTimedOut(_))
        ));
        let waiter = std::thread::spawn(move || t.wait(Duration::from_secs(10)));
        std::thread::sleep(Duration::from_millis(20));
        assert!(c.finish(Ok(10)));
        assert!(!c.finish(Err(Error::Internal("late".into()))));
        assert_eq!(waiter.join().unwrap().unwrap(), 10);
    }
}
