//! The engine's idle decision (sans-IO): what to do after a pass over the channels moved
//! nothing. The engine loop only pumps it; the thresholds are tested here without threads.
//!
//! Progress happens only inside plugin calls, so while requests are in flight the engine must
//! keep testing; backing off trades latency for CPU only after a streak of empty passes, and
//! any pass that moves something resets the streak.

use std::time::Duration;

use crate::config::Backoff;

/// Empty passes spent spinning before yielding.
pub(crate) const SPIN_PASSES: u32 = 64;
/// Empty passes (spin included) before the park policy starts sleeping.
pub(crate) const YIELD_PASSES: u32 = 1024;
/// Shortest sleep of the park policy while requests are in flight.
pub(crate) const MIN_SLEEP: Duration = Duration::from_micros(10);
/// Longest sleep of the park policy while requests are in flight: bounds the latency a
/// completion can wait for the engine to notice it.
pub(crate) const MAX_SLEEP: Duration = Duration::from_micros(200);

/// What the engine does before its next pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pause {
    /// Go again at once (a CPU spin hint at most).
    Spin,
    /// Give the core away once.
    Yield,
    /// Wait for a command at most this long, then go again.
    Sleep(Duration),
    /// Nothing is in flight or queued: wait for the next command.
    Block,
}

/// The streak of empty passes and the policy applied to it.
#[derive(Debug, Clone)]
pub(crate) struct Idle {
    policy: Backoff,
    streak: u32,
}

impl Idle {
    pub(crate) fn new(policy: Backoff) -> Self {
        Self { policy, streak: 0 }
    }

    /// A pass moved something: start over.
    #[inline]
    pub(crate) fn moved(&mut self) {
        self.streak = 0;
    }

    /// A pass moved nothing; `busy` says whether anything is in flight or queued.
    pub(crate) fn empty_pass(&mut self, busy: bool) -> Pause {
        self.streak = self.streak.saturating_add(1);
        match self.policy {
            Backoff::Spin => Pause::Spin,
            _ if !busy && self.policy == Backoff::Park => Pause::Block,
            _ if self.streak <= SPIN_PASSES => Pause::Spin,
            Backoff::Yield => Pause::Yield,
            _ if self.streak <= YIELD_PASSES => Pause::Yield,
            _ => {
                // Double the sleep every 64 passes past the yield phase, up to the cap.
                let doublings = ((self.streak - YIELD_PASSES) / 64).min(16);
                Pause::Sleep((MIN_SLEEP * (1u32 << doublings)).min(MAX_SLEEP))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spin_policy_never_backs_off() {
        let mut idle = Idle::new(Backoff::Spin);
        for _ in 0..100_000 {
            assert_eq!(idle.empty_pass(false), Pause::Spin);
        }
    }

    #[test]
    fn yield_policy_spins_then_yields_forever() {
        let mut idle = Idle::new(Backoff::Yield);
        for _ in 0..SPIN_PASSES {
            assert_eq!(idle.empty_pass(true), Pause::Spin);
        }
        for _ in 0..10_000 {
            assert_eq!(idle.empty_pass(true), Pause::Yield);
        }
    }

    #[test]
    fn park_policy_sleeps_boundedly_while_busy_and_blocks_when_idle() {
        let mut idle = Idle::new(Backoff::Park);
        let pauses: Vec<_> = (0..YIELD_PASSES + 5000)
            .map(|_| idle.empty_pass(true))
            .collect();
        assert!(pauses[..SPIN_PASSES as usize]
            .iter()
            .all(|p| *p == Pause::Spin));
        assert_eq!(pauses[SPIN_PASSES as usize], Pause::Yield);
        let sleeps: Vec<Duration> = pauses
            .iter()
            .filter_map(|p| match p {
                Pause::Sleep(d) => Some(*d),
                _ => None,
            })
            .collect();
        assert_eq!(sleeps.first(), Some(&MIN_SLEEP));
        assert!(sleeps.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(sleeps.last(), Some(&MAX_SLEEP));
        assert_eq!(idle.empty_pass(false), Pause::Block);
    }

    #[test]
    fn progress_resets_the_streak() {
        let mut idle = Idle::new(Backoff::Park);
        for _ in 0..YIELD_PASSES + 100 {
            idle.empty_pass(true);
        }
        idle.moved();
        assert_eq!(idle.empty_pass(true), Pause::Spin);
    }
}
