//! Completion of transfers that finish in the order they were made: the small messages of
//! one eager channel and direction (see [`crate::eager`]).
//!
//! Such a transfer needs no completion of its own. Its lane counts how many of its transfers
//! finished, and the transfer is finished once the count passes its ordinal. The one thread
//! that finishes a lane's transfers publishes the count every few of them, so a stream of
//! small messages costs neither an allocation per message nor a cache line written by the
//! engine and read by the application per message: at 4 KiB on 8 channels those were a
//! third of the application thread's time, and the application thread was the limit.
//!
//! When the transfers' connection fails, the lane is *sealed*: its count stops moving, and
//! every transfer it has not passed fails with the connection's error. Sealing is what keeps
//! an outcome stable — a transfer seen failed is never seen finished later — because the
//! finisher's publish and the seal are read-modify-writes of the same word.

use std::sync::atomic::{fence, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;

use crate::error::{Error, Result};

/// Set in a lane's count once it is sealed.
const SEALED: u64 = 1 << 63;

/// Longest a blocked waiter sleeps before it looks again by itself: a failure is announced
/// by sealing, which wakes every waiter, so this only bounds what a missed announcement
/// would cost.
const RECHECK: Duration = Duration::from_millis(10);

/// The lanes of one set of in-order transfers (an eager connection: two per channel), and
/// the failure that ends them.
pub(crate) trait Lanes: Send + Sync + std::fmt::Debug {
    /// Lane `lane`.
    fn lane(&self, lane: usize) -> &InOrder;
    /// The connection's failure, once it failed: the lanes are then sealed by the first
    /// poll that sees it (if nobody sealed them yet).
    fn failure(&self) -> Option<Error>;
    /// The error transfers of a sealed lane end with (the failure, or that the connection
    /// closed).
    fn ended(&self) -> Error;
}

/// How far one lane's transfers have finished, and the wake-up of threads waiting for more.
#[derive(Debug, Default)]
pub(crate) struct InOrder {
    /// Transfers finished, in order; with [`SEALED`] once the lane is sealed.
    finished: CachePadded<AtomicU64>,
    /// Threads blocked (or about to block) in [`Ticket::wait`].
    waiters: CachePadded<AtomicUsize>,
    lock: Mutex<()>,
    wake: Condvar,
}

impl InOrder {
    /// Publishes that the lane's first `count` transfers finished (the finisher's running
    /// count: one thread finishes a lane). Returns `false`, publishing nothing, once the lane
    /// is sealed.
    pub(crate) fn publish(&self, count: u64) -> bool {
        // A sequentially consistent read-modify-write: pairs with the fence a waiter makes
        // after registering, so either the waiter sees the count or this sees the waiter.
        let moved = self
            .finished
            .fetch_update(Ordering::SeqCst, Ordering::Acquire, |v| {
                (v & SEALED == 0).then_some(count)
            })
            .is_ok();
        if moved && self.waiters.load(Ordering::SeqCst) > 0 {
            self.notify();
        }
        moved
    }

    /// How many of the lane's transfers finished, in order (frozen once sealed).
    pub(crate) fn finished(&self) -> u64 {
        self.finished.load(Ordering::Acquire) & !SEALED
    }

    /// Freezes the count (the transfers not finished by now fail) and wakes every waiter.
    /// Returns the count as sealed.
    pub(crate) fn seal(&self) -> u64 {
        let sealed = self.finished.fetch_or(SEALED, Ordering::SeqCst) | SEALED;
        if self.waiters.load(Ordering::SeqCst) > 0 {
            self.notify();
        }
        sealed
    }

    fn notify(&self) {
        let _guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        self.wake.notify_all();
    }

    /// The outcome of transfer `ordinal` from the count alone: finished, failed (sealed
    /// before it), or `None`.
    fn peek(&self, ordinal: u64) -> Option<bool> {
        let v = self.finished.load(Ordering::Acquire);
        if v & !SEALED > ordinal {
            Some(true)
        } else if v & SEALED != 0 {
            Some(false)
        } else {
            None
        }
    }
}

/// One in-order transfer: its lane and its place in it.
#[derive(Clone, Debug)]
pub(crate) struct Ticket {
    lanes: Arc<dyn Lanes>,
    lane: usize,
    ordinal: u64,
}

impl Ticket {
    /// Transfer number `ordinal` (from 0) of lane `lane` of `lanes`.
    pub(crate) fn new(lanes: Arc<dyn Lanes>, lane: usize, ordinal: u64) -> Self {
        Self {
            lanes,
            lane,
            ordinal,
        }
    }

    fn lane(&self) -> &InOrder {
        self.lanes.lane(self.lane)
    }

    /// `None` while in progress; then `len`, or the connection's error. Seals the lane if
    /// the connection failed and nobody did yet, so the answer never changes after.
    pub(crate) fn poll(&self, len: u64) -> Option<Result<u64>> {
        let lane = self.lane();
        let finished = match lane.peek(self.ordinal) {
            Some(finished) => finished,
            None => {
                self.lanes.failure()?;
                lane.seal() & !SEALED > self.ordinal
            }
        };
        Some(if finished {
            Ok(len)
        } else {
            Err(self.lanes.ended())
        })
    }

    /// Waits up to `timeout` for the outcome: polls for `spin` first, then sleeps until
    /// the lane's finisher (or its sealing) wakes it.
    pub(crate) fn wait(&self, len: u64, timeout: Duration, spin: Duration) -> Result<u64> {
        if let Some(outcome) = self.poll(len) {
            return outcome;
        }
        let start = Instant::now();
        if let Some(outcome) = super::spin::spin_until(start, spin.min(timeout), || self.poll(len))
        {
            return outcome;
        }
        let deadline = start + timeout;
        let lane = self.lane();
        let mut guard = lane.lock.lock().unwrap_or_else(|p| p.into_inner());
        lane.waiters.fetch_add(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        // Under the lock, only the count is read: `poll` may seal, and sealing takes the
        // lock to wake waiters.
        loop {
            if lane.peek(self.ordinal).is_some() || self.lanes.failure().is_some() {
                break;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            guard = lane
                .wake
                .wait_timeout(guard, left.min(RECHECK))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        lane.waiters.fetch_sub(1, Ordering::SeqCst);
        drop(guard);
        // An outcome or a failure never goes away: no answer here means the time ran out.
        self.poll(len).unwrap_or(Err(Error::WaitTimedOut(timeout)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    #[derive(Debug, Default)]
    struct TwoLanes {
        lanes: [InOrder; 2],
        failed: AtomicBool,
    }

    impl Lanes for TwoLanes {
        fn lane(&self, lane: usize) -> &InOrder {
            &self.lanes[lane]
        }
        fn failure(&self) -> Option<Error> {
            self.failed.load(Ordering::SeqCst).then(|| self.ended())
        }
        fn ended(&self) -> Error {
            Error::Internal("connection failed".into())
        }
    }

    fn ticket(lanes: &Arc<TwoLanes>, lane: usize, ordinal: u64) -> Ticket {
        Ticket::new(lanes.clone(), lane, ordinal)
    }

    #[test]
    fn a_transfer_finishes_when_its_lane_passes_it_and_not_before() {
        let lanes = Arc::new(TwoLanes::default());
        let (first, third, other) = (
            ticket(&lanes, 0, 0),
            ticket(&lanes, 0, 2),
            ticket(&lanes, 1, 0),
        );
        assert!(first.poll(4).is_none());
        assert!(lanes.lanes[0].publish(1));
        assert_eq!(first.poll(4).unwrap().unwrap(), 4);
        assert!(third.poll(4).is_none());
        assert!(other.poll(4).is_none(), "lanes are independent");
        assert!(lanes.lanes[0].publish(3));
        assert_eq!(third.poll(9).unwrap().unwrap(), 9);
    }

    #[test]
    fn a_failure_seals_the_lane_and_outcomes_never_change_after() {
        let lanes = Arc::new(TwoLanes::default());
        lanes.lanes[0].publish(2);
        lanes.failed.store(true, Ordering::SeqCst);
        let (done, open) = (ticket(&lanes, 0, 1), ticket(&lanes, 0, 2));
        assert_eq!(done.poll(1).unwrap().unwrap(), 1);
        assert!(matches!(open.poll(1), Some(Err(Error::Internal(_)))));
        // The finisher's late publish moves nothing: the failed transfer stays failed.
        assert!(!lanes.lanes[0].publish(10));
        assert!(matches!(open.poll(1), Some(Err(Error::Internal(_)))));
        assert_eq!(done.poll(1).unwrap().unwrap(), 1);
    }

    #[test]
    fn blocked_waiters_are_woken_by_publishing_and_by_sealing() {
        for round in 0..100 {
            let lanes = Arc::new(TwoLanes::default());
            let t = ticket(&lanes, 1, 0);
            let waiter =
                std::thread::spawn(move || t.wait(1, Duration::from_secs(10), Duration::ZERO));
            std::thread::yield_now();
            if round % 2 == 0 {
                lanes.lanes[1].publish(1);
                assert_eq!(waiter.join().unwrap().unwrap(), 1);
            } else {
                lanes.failed.store(true, Ordering::SeqCst);
                lanes.lanes[1].seal();
                assert!(matches!(waiter.join().unwrap(), Err(Error::Internal(_))));
            }
        }
    }

    #[test]
    fn a_wait_gives_up_after_its_timeout() {
        let lanes = Arc::new(TwoLanes::default());
        let t = ticket(&lanes, 0, 0);
        assert!(matches!(
            t.wait(1, Duration::from_millis(20), Duration::from_micros(50)),
            Err(Error::WaitTimedOut(_))
        ));
    }
}
