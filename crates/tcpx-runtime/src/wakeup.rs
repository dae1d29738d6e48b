//! [`Wakeup`]: how other threads wake a connection's control loop when it sleeps in `poll`.
//!
//! The loop spins while there is work (the next control frame or job completion is usually
//! microseconds away) and only then sleeps in `poll` on its control socket and an eventfd.
//! Whoever has something for it — an engine finishing the job it waits on — calls
//! [`Wakeup::wake`], which costs a syscall only while the loop is actually asleep.
//!
//! The race is the usual one, closed the usual way: the loop sets `sleeping`, fences, then
//! checks for work once more before it polls; a waker publishes its work, fences, then reads
//! `sleeping`. Whichever order they run in, one of them sees the other.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{fence, AtomicBool, Ordering};

/// An eventfd and the flag saying its poller is asleep (see the module docs).
#[derive(Debug)]
pub(crate) struct Wakeup {
    fd: OwnedFd,
    sleeping: AtomicBool,
}

impl Wakeup {
    pub(crate) fn new() -> io::Result<Self> {
        // SAFETY: `eventfd` takes no pointers; a negative result is an error, checked below.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Self {
            // SAFETY: `fd` was just returned by `eventfd` and is owned by nothing else.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            sleeping: AtomicBool::new(false),
        })
    }

    /// The descriptor to poll for `POLLIN`.
    pub(crate) fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Whether the poller is asleep (or about to be): work published before this call and
    /// not picked up needs a [`Self::wake`], or the publisher doing it itself.
    pub(crate) fn is_sleeping(&self) -> bool {
        fence(Ordering::SeqCst);
        self.sleeping.load(Ordering::SeqCst)
    }

    /// Wakes the poller if it sleeps. Call after publishing the work it should see.
    pub(crate) fn wake(&self) {
        if self.is_sleeping() {
            let one: u64 = 1;
            // SAFETY: writes the 8 bytes of `one`, a live local, to our own eventfd. A full
            // counter (EAGAIN) still leaves the descriptor readable, which is all we need.
            unsafe {
                libc::write(
                    self.fd.as_raw_fd(),
                    std::ptr::from_ref(&one).cast(),
                    std::mem::size_of::<u64>(),
                )
            };
        }
    }

    /// The poller is about to sleep; it must check for work once more after this.
    pub(crate) fn going_to_sleep(&self) {
        self.sleeping.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    /// The poller is awake again: clears the flag and the eventfd's count.
    pub(crate) fn awake(&self) {
        self.sleeping.store(false, Ordering::SeqCst);
        let mut count: u64 = 0;
        // SAFETY: reads at most 8 bytes into `count`, a live local; the descriptor is
        // non-blocking, so an empty counter returns EAGAIN at once.
        unsafe {
            libc::read(
                self.fd.as_raw_fd(),
                std::ptr::from_mut(&mut count).cast(),
                std::mem::size_of::<u64>(),
            )
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    fn readable(fd: RawFd, timeout_ms: i32) -> bool {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid `pollfd`, a live local, for the duration of the call.
        unsafe { libc::poll(&mut p, 1, timeout_ms) == 1 }
    }

    #[test]
    fn a_wake_reaches_a_sleeper_and_costs_nothing_when_awake() {
        let w = Arc::new(Wakeup::new().unwrap());
        // Awake: a wake writes nothing.
        w.wake();
        assert!(!readable(w.raw_fd(), 0));
        // Asleep: the wake makes the eventfd readable, from another thread.
        w.going_to_sleep();
        let waker = {
            let w = w.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                w.wake();
            })
        };
        let started = Instant::now();
        assert!(readable(w.raw_fd(), 5_000));
        assert!(started.elapsed() < Duration::from_secs(5));
        waker.join().unwrap();
        w.awake();
        assert!(!readable(w.raw_fd(), 0), "awake() drains the count");
        assert!(!w.is_sleeping());
    }
}
