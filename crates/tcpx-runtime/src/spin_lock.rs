//! A lock for critical sections of a few dozen instructions taken once per small message:
//! acquired with one compare-and-swap, released with a plain store.
//!
//! `std::sync::Mutex` releases with an atomic swap (it must learn whether a waiter sleeps),
//! and every locked instruction waits for all the stores before it to leave the core — such
//! as a queue entry whose cache line the engine's core holds. A 4 KiB message took four such
//! releases (the connection's order lock and the channel's queue lock, on each side); this
//! lock's release is a store that drains in the background. A waiter spins, then yields
//! ([`crossbeam_utils::Backoff`]), and never sleeps: every holder runs a short section that
//! neither blocks nor allocates much, so a waiter never waits long for a running holder.

use std::sync::atomic::{AtomicBool, Ordering};

use crossbeam_utils::Backoff;

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
        loop {
            // Read-only while held: no cache-line ping-pong with the holder.
            while self.locked.load(Ordering::Relaxed) {
                backoff.snooze();
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
}
