//! Benchmarks (figures, not tests) that the tools and the examples call.
//!
//! - [`throughput`]: host memory through the whole stack (endpoint → engine → plugin →
//!   loopback) against raw TCP with the same number of streams, in the same run;
//! - [`overhead`] (feature `bench-fake`): requests retired per second per engine thread with
//!   a plugin that completes instantly ([`fake`]).
//!
//! Figures are GB/s = 10^9 bytes per second, medians of the repetitions.

#[cfg(any(test, feature = "bench-fake"))]
pub mod fake;
#[cfg(any(test, feature = "bench-fake"))]
pub mod overhead;
pub mod throughput;

use std::time::Duration;

/// The median of `samples` (0 when empty).
pub(crate) fn median(samples: &mut [f64]) -> f64 {
    samples.sort_by(f64::total_cmp);
    match samples.len() {
        0 => 0.0,
        n if n % 2 == 1 => samples[n / 2],
        n => (samples[n / 2 - 1] + samples[n / 2]) / 2.0,
    }
}

/// 10^9 bytes per second.
pub(crate) fn gbps(bytes: u64, elapsed: Duration) -> f64 {
    bytes as f64 / elapsed.as_secs_f64().max(1e-9) / 1e9
}
