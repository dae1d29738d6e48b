//! Growing the process's file-descriptor table once, when an endpoint is made, instead of
//! step by step while its first connection is set up.
//!
//! Why: the kernel's descriptor table starts at 64 entries and doubles (128, 256, …) when a
//! descriptor past its end is needed. In a process with more than one thread each growth waits
//! for an RCU grace period (`expand_fdtable` calls `synchronize_rcu` when the table is shared),
//! 10–25 ms on a busy 16-core machine. A connection opens about six sockets per channel (three
//! comm pairs, and their listeners while it is set up), so the first connection of a process
//! crossed two or three sizes inside its set-up: measured on an H200 machine with 8 channels,
//! 34–65 ms for the first connection of a process against 4–6 ms for the next ones, single
//! `socket`, `bind` and `accept4` calls taking 13–23 ms (`perf trace`). With the table grown
//! beforehand the first connection took 8 ms. An endpoint is made once, before it connects;
//! the grace period (at most one) is paid there, or not at all while the process has one
//! thread.

use std::os::fd::AsRawFd;

/// Descriptors the table is grown to hold when an endpoint is made: about eighteen
/// connections of 8 channels. Past it the kernel grows the table as before.
pub(crate) const RESERVED_DESCRIPTORS: u32 = 1024;

/// Grows the descriptor table to hold `wanted` descriptors (at most the soft
/// `RLIMIT_NOFILE`), by duplicating `fd` to the top of that range and closing the copy. Returns
/// the table size now guaranteed, or `None` when nothing was done (a limit at or below the
/// table's first size, or a refused call: the kernel then grows the table on demand, as
/// without this).
pub(crate) fn reserve(fd: &impl AsRawFd, wanted: u32) -> Option<u32> {
    let soft = soft_open_files_limit()?;
    let top = u64::from(wanted).min(soft).checked_sub(1)?;
    // Below 64 the table's first size already holds it.
    if top < 64 {
        return None;
    }
    let top = libc::c_int::try_from(top).ok()?;
    // SAFETY: F_DUPFD_CLOEXEC only reads the descriptor number and returns a new descriptor
    // (or -1); no memory is passed.
    let copy = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, top) };
    if copy < 0 {
        return None;
    }
    // SAFETY: `copy` was just returned by fcntl and nothing else knows its number; closing it
    // leaves the table at its grown size (tables never shrink). Only a thread that `dup2`s onto
    // this very number in these microseconds could lose a descriptor to this close; nothing in
    // the stack does, and applications `dup2` onto 0–2.
    unsafe { libc::close(copy) };
    u32::try_from(copy).ok().map(|c| c + 1)
}

/// The soft `RLIMIT_NOFILE`; `None` if it cannot be read.
fn soft_open_files_limit() -> Option<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is a valid, writable `rlimit` for the call's duration.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) };
    (rc == 0).then_some(limit.rlim_cur)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reservation covers at least what was asked, and its copy is closed again: the top
    /// descriptor number is free right after.
    #[test]
    fn the_table_is_grown_and_the_copy_closed() {
        let f = std::fs::File::open("/dev/null").unwrap();
        let Some(soft) = soft_open_files_limit() else {
            return;
        };
        let wanted = 256u32.min(u32::try_from(soft).unwrap_or(u32::MAX));
        match reserve(&f, wanted) {
            Some(n) => {
                assert!(n >= wanted, "{n} < {wanted}");
                // The copy at n - 1 is closed: the same slot is free again.
                let top = libc::c_int::try_from(n - 1).unwrap();
                // SAFETY: as in `reserve`.
                let again = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_DUPFD_CLOEXEC, top) };
                assert_eq!(again, top, "the reserved top descriptor was left open");
                // SAFETY: `again` was just returned and is owned here.
                unsafe { libc::close(again) };
            }
            None => assert!(soft <= 64, "no reservation under a limit of {soft}"),
        }
    }

    #[test]
    fn limits_at_or_below_the_first_table_size_do_nothing() {
        let f = std::fs::File::open("/dev/null").unwrap();
        assert_eq!(reserve(&f, 1), None);
        assert_eq!(reserve(&f, 64), None);
    }
}
