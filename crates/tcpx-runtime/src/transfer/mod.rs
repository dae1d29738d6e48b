//! [`Transfer`]: the application's handle on one send or receive, and the completion state
//! the engines finish it through.
//!
//! Completion is a write-once outcome plus a wake-up. The engine finishing a transfer
//! publishes the outcome and touches the wake-up (a `Mutex<bool>` and a `Condvar`) only if a
//! thread is blocked in [`Transfer::wait`]: a futex wake per transfer on the engine thread,
//! and the waiter's context switch onto a core an engine is polling on, are what a stream of
//! small transfers would otherwise pay. The handle holds no comm, registration or
//! connection, so keeping an old `Transfer` around keeps no fd open.
//!
//! A transfer that no engine finishes — a same-host copy of the `ipc` module, whose progress
//! is a CUDA event — carries a [`Drive`]: polling or waiting on the handle drives it (one
//! event query), so the waiting thread itself sees the copy end, with no thread hop.
//!
//! A small two-sided message (an eager one) has no completion of its own: it finishes in
//! order on its channel, and a counter per channel says how far ([`in_order`]).

pub(crate) mod in_order;
mod spin;

use std::sync::atomic::{fence, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::error::{Direction, Error, Result};
use crate::wakeup::Wakeup;
use in_order::Ticket;
use spin::spin_until;

/// Progress for a transfer no engine finishes: [`Transfer::poll`], [`Transfer::wait`] and
/// [`Transfer::is_finished`] call [`drive`](Drive::drive) until the completion is set.
pub(crate) trait Drive: Send + Sync + std::fmt::Debug {
    /// Checks, without blocking, whether the work is done, and finishes the completion when
    /// it is (or when it failed, or ran past its deadline).
    fn drive(&self);
}

/// How long a driven wait keeps polling (yielding the core between polls) after its spin,
/// before it sleeps: long enough for a 256 MiB copy over PCIe. Sleeping earlier would add
/// the timer's slack (about 50 µs per sleep) to every large copy; CUDA's own synchronous
/// waits spin or yield the same way.
const DRIVE_YIELD_FOR: Duration = Duration::from_millis(20);

/// Longest sleep between two drives once the yielding is over: a copy running that long
/// is seen done at most this late (under 3 %).
const DRIVE_PAUSE_MAX: Duration = Duration::from_micros(500);

/// Write-once outcome of a transfer and the wake-up of its waiters.
#[derive(Debug, Default)]
pub(crate) struct Completion {
    /// The outcome.
    outcome: OnceLock<Result<u64>>,
    /// Threads blocked (or about to block) in `wait`.
    waiters: AtomicUsize,
    finished: Mutex<bool>,
    wake: Condvar,
    /// A control loop that sleeps until this finishes (see [`Completion::wake_on_finish`]).
    loop_wakeup: OnceLock<Arc<Wakeup>>,
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
        if let Some(wakeup) = self.loop_wakeup.get() {
            wakeup.wake();
        }
        true
    }

    /// The outcome, once set.
    fn outcome(&self) -> Option<&Result<u64>> {
        self.outcome.get()
    }

    /// Has `finish` wake a connection's control loop that is about to sleep waiting for this
    /// (a syscall only if it does sleep). Returns whether it is finished already, checked
    /// after registering (the fence pairs with the one in `finish`), so a loop that gets
    /// `false` is sure to be woken.
    pub(crate) fn wake_on_finish(&self, wakeup: &Arc<Wakeup>) -> bool {
        let _ = self.loop_wakeup.set(wakeup.clone());
        fence(Ordering::SeqCst);
        self.outcome().is_some()
    }

    pub(crate) fn get(&self) -> Option<&Result<u64>> {
        self.outcome()
    }

    pub(crate) fn is_finished(&self) -> bool {
        self.outcome().is_some()
    }

    /// Waits up to `timeout`, polling for the first `spin` of it before sleeping.
    fn wait(&self, timeout: Duration, spin: Duration) -> Option<&Result<u64>> {
        if let Some(outcome) = self.outcome() {
            return Some(outcome);
        }
        let start = Instant::now();
        if let Some(outcome) = spin_until(start, spin.min(timeout), || self.outcome()) {
            return Some(outcome);
        }
        let deadline = start + timeout;
        let mut finished = self.finished.lock().unwrap_or_else(|p| p.into_inner());
        self.waiters.fetch_add(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        // Under the lock: a finisher that saw us registered notifies only after we wait.
        while !*finished && self.outcome().is_none() {
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
        self.outcome()
    }
}

/// One send or receive submitted on a [`crate::Connection`].
///
/// It completes with the number of bytes moved, or with the error that ended it (the peer
/// went away, a plugin error naming channel and peer, the configured timeout). Dropping the
/// handle does not cancel the transfer.
#[derive(Debug, Clone)]
pub struct Transfer {
    source: Source,
    direction: Direction,
    len: u64,
    /// How long [`Transfer::wait`] polls before sleeping ([`crate::Config::wait_spin`]).
    spin: Duration,
}

/// Where a transfer's outcome comes from.
#[derive(Debug, Clone)]
enum Source {
    /// Its own completion, finished by an engine, or by `driver` when the handle is polled.
    Completion {
        completion: Arc<Completion>,
        driver: Option<Arc<dyn Drive>>,
    },
    /// Its place in an in-order lane (an eager message).
    InOrder(Ticket),
}

impl Transfer {
    pub(crate) fn new(
        completion: Arc<Completion>,
        direction: Direction,
        len: u64,
        spin: Duration,
    ) -> Self {
        let source = Source::Completion {
            completion,
            driver: None,
        };
        Self::from_source(source, direction, len, spin)
    }

    /// A transfer finished in order on its lane (see [`in_order`]).
    pub(crate) fn in_order(ticket: Ticket, direction: Direction, len: u64, spin: Duration) -> Self {
        Self::from_source(Source::InOrder(ticket), direction, len, spin)
    }

    fn from_source(source: Source, direction: Direction, len: u64, spin: Duration) -> Self {
        Self {
            source,
            direction,
            len,
            spin,
        }
    }

    /// A transfer finished by `driver` when the handle is polled or waited on.
    pub(crate) fn driven(
        completion: Arc<Completion>,
        driver: Arc<dyn Drive>,
        direction: Direction,
        len: u64,
        spin: Duration,
    ) -> Self {
        let source = Source::Completion {
            completion,
            driver: Some(driver),
        };
        Self::from_source(source, direction, len, spin)
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
        match &self.source {
            Source::Completion { completion, driver } => {
                if let Some(driver) = driver {
                    if !completion.is_finished() {
                        driver.drive();
                    }
                }
                completion.get().cloned()
            }
            Source::InOrder(ticket) => ticket.poll(self.len),
        }
    }

    /// True once finished (successfully or not).
    pub fn is_finished(&self) -> bool {
        match &self.source {
            Source::InOrder(ticket) => ticket.poll(self.len).is_some(),
            Source::Completion { completion, .. } => {
                completion.is_finished() || self.poll().is_some()
            }
        }
    }

    /// Blocks until the transfer finishes or `timeout` passes. Running out of time returns
    /// [`Error::WaitTimedOut`] and leaves the transfer running (the configured transfer
    /// timeout, enforced by the engines, is what fails it).
    pub fn wait(&self, timeout: Duration) -> Result<u64> {
        match &self.source {
            Source::InOrder(ticket) => ticket.wait(self.len, timeout, self.spin),
            Source::Completion {
                completion,
                driver: Some(driver),
            } => self.wait_driven(completion, driver.as_ref(), timeout),
            Source::Completion {
                completion,
                driver: None,
            } => match completion.wait(timeout, self.spin) {
                Some(outcome) => outcome.clone(),
                None => Err(Error::WaitTimedOut(timeout)),
            },
        }
    }

    /// Drives until finished: back to back for the spin, yielding the core between drives
    /// for [`DRIVE_YIELD_FOR`], then with sleeps that double up to [`DRIVE_PAUSE_MAX`]
    /// (nothing would wake a sleeper: the driver is the only progress).
    fn wait_driven(
        &self,
        completion: &Completion,
        driver: &dyn Drive,
        timeout: Duration,
    ) -> Result<u64> {
        let start = Instant::now();
        let mut pause = Duration::from_micros(20);
        loop {
            if !completion.is_finished() {
                driver.drive();
            }
            if let Some(outcome) = completion.get() {
                return outcome.clone();
            }
            let elapsed = start.elapsed();
            if elapsed >= timeout {
                return Err(Error::WaitTimedOut(timeout));
            }
            if elapsed < self.spin {
                std::hint::spin_loop();
                continue;
            }
            if elapsed < DRIVE_YIELD_FOR {
                std::thread::yield_now();
                continue;
            }
            std::thread::sleep(pause.min(timeout - elapsed));
            pause = (pause * 2).min(DRIVE_PAUSE_MAX);
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

    /// Finishes its completion on the `after`-th drive.
    #[derive(Debug)]
    struct Countdown {
        completion: Arc<Completion>,
        left: std::sync::atomic::AtomicUsize,
    }

    impl Drive for Countdown {
        fn drive(&self) {
            if self.left.fetch_sub(1, Ordering::AcqRel) == 1 {
                self.completion.finish(Ok(7));
            }
        }
    }

    #[test]
    fn driven_transfers_finish_through_their_handle() {
        let c = Arc::new(Completion::default());
        let driver = Arc::new(Countdown {
            completion: c.clone(),
            left: AtomicUsize::new(3),
        });
        let t = Transfer::driven(c.clone(), driver, Direction::Send, 7, Duration::ZERO);
        assert!(t.poll().is_none());
        assert!(!t.is_finished());
        // The third drive finishes it; the wait sleeps between drives and returns it.
        assert_eq!(t.wait(Duration::from_secs(10)).unwrap(), 7);
        assert!(t.is_finished());

        let never = Arc::new(Countdown {
            completion: Arc::new(Completion::default()),
            left: AtomicUsize::new(usize::MAX),
        });
        let stuck = Transfer::driven(
            never.completion.clone(),
            never,
            Direction::Recv,
            1,
            Duration::from_micros(10),
        );
        assert!(matches!(
            stuck.wait(Duration::from_millis(5)),
            Err(Error::WaitTimedOut(_))
        ));
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
