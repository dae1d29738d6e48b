//! Which process an object belongs to, so that `fork()` condemns only what the child
//! inherited.
//!
//! After `fork()` the child has a copy of the parent's memory but none of its threads: an
//! endpoint created before the fork has no engines in the child, and a lock one of them held
//! at that moment stays locked there forever. So every endpoint (and every transfer handle)
//! records the process that created it ([`Origin`]); in any other process it refuses every
//! call without touching its state, and dropping it frees nothing. Endpoints the child
//! creates itself carry the child's id and work normally.
//!
//! The current process id is cached and refreshed by a `pthread_atfork` child handler (it
//! runs inside `fork()` for every fork, whether Python's `os.fork`, multiprocessing's *fork*
//! start method or a C library), so checking costs an atomic load, not a system call.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Once;

use crate::errors::{Failure, Kind};

/// This process's id once [`install`] ran; 0 means "ask the kernel" (no fork handler).
static PID: AtomicU32 = AtomicU32::new(0);

/// Runs in the child inside `fork()`: only async-signal-safe work (`getpid`, a store).
extern "C" fn refresh_in_child() {
    // SAFETY: getpid has no preconditions and is async-signal-safe, as a pthread_atfork
    // child handler requires.
    let pid = unsafe { libc::getpid() };
    PID.store(pid as u32, Ordering::Relaxed);
}

/// Caches the process id and registers the fork handler (once; called at module import,
/// before any endpoint exists).
pub fn install() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        PID.store(std::process::id(), Ordering::Relaxed);
        // SAFETY: the handler is a plain `extern "C" fn` that lives as long as the process
        // (this library is never unloaded: CPython does not unload extension modules), and
        // it does only async-signal-safe work.
        let rc = unsafe { libc::pthread_atfork(None, None, Some(refresh_in_child)) };
        if rc != 0 {
            // Without the handler the cache could go stale in a child: ask the kernel.
            PID.store(0, Ordering::Relaxed);
        }
    });
}

/// The id of the process running now.
pub fn current_pid() -> u32 {
    match PID.load(Ordering::Relaxed) {
        0 => std::process::id(),
        pid => pid,
    }
}

/// The process that created an object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Origin {
    pid: u32,
}

impl Origin {
    /// The process running now.
    pub fn here() -> Self {
        Self { pid: current_pid() }
    }

    /// True in a process other than the creator: a child that inherited the object through
    /// `fork()`.
    pub fn inherited(&self) -> bool {
        self.pid != current_pid()
    }

    /// The failure every call on an inherited `what` ("endpoint", "transfer") reports.
    pub fn failure(&self, what: &str) -> Failure {
        Failure::new(
            Kind::Closed,
            format!(
                "this {what} was created in process {} and inherited by this process ({}) \
                 through fork(): its engine threads do not exist here; create a new endpoint \
                 in this process",
                self.pid,
                current_pid()
            ),
        )
    }
}
