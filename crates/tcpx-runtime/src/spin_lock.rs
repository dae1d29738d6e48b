//! A lock for critical sections of a few dozen instructions taken once per small message:
//! acquired with one compare-and-swap, released with a plain store.
//!
//! `std::sync::Mutex` releases with an atomic swap (it must learn whether a waiter sleeps),
//! and every locked instruction waits for all the stores before it to leave the core — such
//! as a queue entry whose cache line the engine's core holds. A 4 KiB message took four such
//! releases (the connection's order lock and the channel's queue lock, on each side); this
//! lock's release is a store that drains in the background.
//!
//! The price is that a release cannot wake a sleeping waiter. A waiter spins, then yields
//! ([`crossbeam_utils::Backoff`]), then sleeps in short steps ([`NAP_MAX`] at most) until
//! the lock is free. The small-message sections under these locks are a few dozen
//! instructions, so waiters rarely get past the spin; but the connection's order lock is
//! also held while a larger transfer is numbered and handed over (a vectored one writes its
//! segment list on the control stream then), and a second thread sending on the same
//! connection must not burn a core for that long.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crossbeam_utils::Backoff;

/// Longest sleep of a waiter between two looks at a lock still held after its spin: how
/// late at most it notices the release.
const NAP_MAX: Duration = Duration::from_micros(100);

/// The raw lock behind [`SpinLock`].
pub(crate) struct RawSpinLock {
    locked: AtomicBool,
}

// SAFETY: `lock` and `try_lock` succeed only by moving `locked` from false to true with an
// Acquire compare-exchange, so one thread holds the lock at a time; `unlock` (called only by
// the holder, as the trait requires) stores false with Release, so the holder's writes are
// visible to the next thread that acquires it.
unsafe impl lock_api::RawMutex for RawSpinLock {
    #[allow(clippy::declare_interior_mutable_const)]
    const INIT: Self = Self {
        locked: AtomicBool::new(false),
    };

    type GuardMarker = lock_api::GuardSend;

    fn lock(&self) {
        if self.try_lock() {
            return;
        }
        let backoff = Backoff::new();
        let mut nap = Duration::from_micros(5);
        loop {
            // Read-only while held: no cache-line ping-pong with the holder.
            while self.locked.load(Ordering::Relaxed) {
                if backoff.is_completed() {
                    std::thread::sleep(nap);
                    nap = (nap * 2).min(NAP_MAX);
                } else {
                    backoff.snooze();
                }
            }
            if self.try_lock() {
                return;
            }
        }
    }

    fn try_lock(&self) -> bool {
        self.locked
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }

    unsafe fn unlock(&self) {
        self.locked.store(false, Ordering::Release);
    }
}

/// A value behind a [`RawSpinLock`].
pub(crate) type SpinLock<T> = lock_api::Mutex<RawSpinLock, T>;

/// Access to a [`SpinLock`]'s value; releases it when dropped.
pub(crate) type SpinGuard<'a, T> = lock_api::MutexGuard<'a, RawSpinLock, T>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn one_holder_at_a_time_and_every_update_is_seen() {
        let lock = Arc::new(SpinLock::new((0u64, 0u64)));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let lock = lock.clone();
                std::thread::spawn(move || {
                    for _ in 0..50_000 {
                        let mut g = lock.lock();
                        // Two fields updated apart: a second holder would see them differ.
                        assert_eq!(g.0, g.1);
                        g.0 += 1;
                        g.1 += 1;
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(*lock.lock(), (200_000, 200_000));
        assert!(lock.try_lock().is_some());
    }

    #[test]
    fn a_waiter_behind_a_long_holder_gets_the_lock_without_spinning_all_along() {
        let lock = Arc::new(SpinLock::new(0u32));
        let held = lock.lock();
        let waiter = {
            let lock = lock.clone();
            std::thread::spawn(move || {
                let start = std::time::Instant::now();
                *lock.lock() += 1;
                start.elapsed()
            })
        };
        // Held for 50 ms: far past the spin, so the waiter sleeps in naps.
        std::thread::sleep(Duration::from_millis(50));
        drop(held);
        let waited = waiter.join().unwrap();
        assert!(waited >= Duration::from_millis(45), "{waited:?}");
        assert!(waited < Duration::from_secs(5), "{waited:?}");
        assert_eq!(*lock.lock(), 1);
    }
}
