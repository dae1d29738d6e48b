//! The polling phase every wait on a transfer starts with.

use std::time::{Duration, Instant};

/// Polls `probe` back to back until it answers or `spin` has passed since `start` (the
/// clock is read once per 64 polls: a poll is a load or two, the clock ~20 ns).
pub(crate) fn spin_until<T>(
    start: Instant,
    spin: Duration,
    mut probe: impl FnMut() -> Option<T>,
) -> Option<T> {
    if spin.is_zero() {
        return None;
    }
    loop {
        for _ in 0..64 {
            if let Some(answer) = probe() {
                return Some(answer);
            }
            std::hint::spin_loop();
        }
        if start.elapsed() >= spin {
            return None;
        }
    }
}
