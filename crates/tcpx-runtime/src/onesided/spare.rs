//! Pack buffer memory kept ready for pack pools, its pages already touched.
//!
//! A pool's new buffer made fresh costs its first packed batch the faults of 4 MiB of pages,
//! in the engines' copies and the kernel's: on an H200 host the first 4 MiB list of 16 KiB
//! blocks of a new connection took 1.6–2.8 ms packed against 0.7–1.3 unpacked, the first
//! 16 MiB list (four buffers a side) 5.7–6.3 ms against 1.5–1.9 (docs/RESULTS.md,
//! thirty-seventh session). So the process keeps buffers here:
//! - those of closed connections, up to [`MOST`] (re-created connections, agents re-made
//!   under the same names, do not pay again);
//! - and, from the first endpoint on, [`WARM`] made ahead on a short-lived thread of their
//!   own ([`warm_for`]), refilled as each endpoint and each connection starts: the first
//!   packed batches of a new connection find their buffers faulted in. That is 16 MiB a
//!   process holds from its first endpoint whose configuration packs (the default), whether
//!   it packs or not.
//!
//! Every buffer is made in huge pages where the kernel gives them
//! ([`tcpx::HostBuffer::in_huge_pages`]): its pages fault in four times faster, so the
//! warming ends sooner after an endpoint or connection starts, and a pool that finds no kept
//! buffer pays less for a fresh one.
//!
//! The list is never waited for (a busy list counts as empty): it is a cache, and a child
//! forked while a parent's thread held its lock must not hang on it. Such a child may also
//! never warm (the flag of a thread that is not there stays set); its pools make their
//! buffers as they need them.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, TryLockError};

use tcpx::{HostBuffer, SharedMemory};

/// Bytes of one pack buffer: what this module keeps, and `pack::PACK_BYTES` (defined here so
/// that the pools, which take and keep buffers here, sit above this module).
pub(crate) const BUFFER_BYTES: usize = 4 << 20;

/// Most buffers kept (64 MiB).
const MOST: usize = 16;

/// Buffers [`warm`] keeps ready (16 MiB): a list of up to 16 MiB, four buffers, finds its
/// side's all ready.
const WARM: usize = 4;

/// Page size the warming touches by (the smallest x86-64 and aarch64 pages).
const PAGE: usize = 4096;

static SPARE: Mutex<Vec<SharedMemory>> = Mutex::new(Vec::new());

/// A warming thread is running.
static WARMING: AtomicBool = AtomicBool::new(false);

/// The kept buffers, unless another thread holds them this instant. Never waited for: the
/// buffers are a cache (a pool that finds none makes its own), and a process forked while a
/// thread of its parent held the lock finds it held for ever — the child's endpoints must
/// not hang on it.
fn spare() -> Option<MutexGuard<'static, Vec<SharedMemory>>> {
    match SPARE.try_lock() {
        Ok(guard) => Some(guard),
        Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}

/// A kept buffer of [`BUFFER_BYTES`], if any.
///
/// It does not start the warming thread to make the next one: a pool takes buffers on the
/// path of a transfer, and starting a thread there cost that transfer 60–100 µs (two of
/// them on a new connection's first packed write, one a side; docs/RESULTS.md,
/// thirty-eighth session). The kept buffers are made again as endpoints and connections
/// start ([`warm_for`]), off any transfer's path.
pub(crate) fn take() -> Option<SharedMemory> {
    spare().and_then(|mut s| s.pop())
}

/// Keeps `memory` (a whole pack buffer, nothing leased or in flight) for a later pool while
/// fewer than [`MOST`] are kept; otherwise it is freed.
pub(crate) fn keep(memory: SharedMemory) {
    if !whole(&memory) {
        return;
    }
    if let Some(mut spare) = spare() {
        if spare.len() < MOST {
            spare.push(memory);
        }
    }
}

/// Whether `memory` is a whole pack buffer, the only size kept.
fn whole(memory: &SharedMemory) -> bool {
    memory.len() == BUFFER_BYTES
}

/// [`warm`], where `config` may pack (pack buffers allowed, a threshold above 0): called as
/// an endpoint starts and as each connection does, so that even the first connection's first
/// packed batches find their buffers ready.
pub(crate) fn warm_for(config: &crate::Config) {
    if config.pack_buffers > 0 && (config.pack_below > 0 || config.pack_staged_below > 0) {
        warm();
    }
}

/// Makes buffers on a thread of its own until [`WARM`] are kept, unless as many are kept or
/// a thread is at it already. Buffers pools take after that thread's last look are made
/// again at the next call (the next endpoint or connection to start); a thread that cannot be
/// spawned, or memory that cannot be had, leaves pools to make their buffers as they need
/// them.
fn warm() {
    if spare().is_none_or(|s| s.len() >= WARM) || WARMING.swap(true, Ordering::AcqRel) {
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("tcpx-pack-warm".into())
        .spawn(|| {
            while spare().is_some_and(|s| s.len() < WARM) {
                match touched() {
                    Some(memory) => keep(memory),
                    None => break,
                }
            }
            WARMING.store(false, Ordering::Release);
        });
    if spawned.is_err() {
        WARMING.store(false, Ordering::Release);
    }
}

/// A new buffer of [`BUFFER_BYTES`] with every page faulted in.
fn touched() -> Option<SharedMemory> {
    let mut buffer = HostBuffer::in_huge_pages(BUFFER_BYTES).ok()?;
    for page in buffer.as_mut_slice().chunks_mut(PAGE) {
        // An opaque value: a store of zero into zeroed memory could be left out.
        page[0] = std::hint::black_box(0);
    }
    Some(SharedMemory::new(buffer))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Buffers kept now (0 while the list is busy).
    fn kept() -> usize {
        spare().map_or(0, |s| s.len())
    }

    #[test]
    fn warming_keeps_whole_touched_buffers_and_refills_them_after_a_take() {
        warm();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while kept() < WARM && std::time::Instant::now() < deadline {
            warm();
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert!(kept() >= WARM, "warmed: {}", kept());
        let taken = take().expect("a kept buffer");
        assert_eq!(taken.len(), BUFFER_BYTES);
        // Taking does not start a refill (it is on a transfer's path); the next warming does.
        warm();
        while kept() < WARM && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(1));
            warm();
        }
        assert!(kept() >= WARM, "refilled: {}", kept());
        // A buffer of another size is not kept.
        assert!(whole(&taken));
        assert!(
            !whole(&SharedMemory::host(4096).unwrap()),
            "only whole buffers are kept"
        );
    }
}
