//! The engine's idle decision (sans-IO): what to do after a pass over the channels moved
//! nothing. The engine loop only pumps it; the thresholds are tested here without threads.
//!
//! Progress happens only inside plugin calls, so while requests are in flight the engine must
//! keep testing; backing off trades latency for CPU only after a streak of empty passes, and
//! any pass that moves something resets the streak.
//!
//! The park policy starts sleeping after a *time* without progress ([`PARK_AFTER`]), not a
//! number of passes: a pass that only meets a full socket takes well under a microsecond, so
//! a pass count would put an engine to sleep between two chunks of a peer that is merely
//! slower, and a sleeping sender leaves its socket idle (a blocked `write` would have woken
//! the moment space freed). Two milliseconds without a single completion means the peer is
//! not keeping up at all.
//!
//! With nothing in flight the park policy blocks on the engine's queue, but only after a
//! *linger* ([`crate::Config::idle_linger`]) of polling: a stream of small transfers spread
//! over several engines leaves each one idle between two of its messages, and blocking at
//! once made every submission pay a futex wake plus the engine's reschedule.

use std::time::{Duration, Instant};

use crate::config::Backoff;

/// Empty passes spent spinning before yielding.
pub(crate) const SPIN_PASSES: u32 = 64;
/// Empty spinning passes per clock read (see [`Idle::wants_clock`]): an empty pass is a few
/// atomic loads, and reading the clock on every one was a twentieth of an engine's time.
pub(crate) const CLOCK_EVERY_SPINS: u32 = 16;
/// Time without progress (while busy) before the park policy starts sleeping.
pub(crate) const PARK_AFTER: Duration = Duration::from_millis(2);
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
    /// How long the park policy keeps polling with nothing in flight before it blocks.
    linger: Duration,
    streak: u32,
    /// When the current streak began (read from the clock once per streak).
    since: Option<Instant>,
    /// Sleeps taken in this streak.
    sleeps: u32,
}

impl Idle {
    pub(crate) fn new(policy: Backoff, linger: Duration) -> Self {
        Self {
            policy,
            linger,
            streak: 0,
            since: None,
            sleeps: 0,
        }
    }

    /// Whether the next empty pass needs a fresh clock reading: the first of a streak, every
    /// [`CLOCK_EVERY_SPINS`]-th while spinning, and every one after (a yield or a sleep costs
    /// far more than the read). The engine reuses its last reading otherwise, so deadlines and
    /// the thresholds here run late by at most a few spins.
    #[inline]
    pub(crate) fn wants_clock(&self) -> bool {
        self.streak > SPIN_PASSES || self.streak % CLOCK_EVERY_SPINS == 0
    }

    /// A pass moved something: start over.
    #[inline]
    pub(crate) fn moved(&mut self) {
        self.streak = 0;
        self.since = None;
        self.sleeps = 0;
    }

    /// A pass moved nothing at `now`; `busy` says whether anything is in flight or queued.
    pub(crate) fn empty_pass(&mut self, busy: bool, now: Instant) -> Pause {
        self.streak = self.streak.saturating_add(1);
        let since = *self.since.get_or_insert(now);
        match self.policy {
            Backoff::Spin => Pause::Spin,
            _ if !busy
                && self.policy == Backoff::Park
                && now.duration_since(since) >= self.linger =>
            {
                Pause::Block
            }
            _ if self.streak <= SPIN_PASSES => Pause::Spin,
            Backoff::Yield => Pause::Yield,
            _ if !busy || now.duration_since(since) < PARK_AFTER => Pause::Yield,
            _ => {
                // Double the sleep every 16 sleeps, up to the cap.
                let doublings = (self.sleeps / 16).min(16);
                self.sleeps = self.sleeps.saturating_add(1);
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
        let mut idle = Idle::new(Backoff::Spin, Duration::ZERO);
        let t0 = Instant::now();
        for i in 0..100_000u64 {
            let now = t0 + Duration::from_micros(i);
            assert_eq!(idle.empty_pass(false, now), Pause::Spin);
        }
    }

    #[test]
    fn yield_policy_spins_then_yields_forever() {
        let mut idle = Idle::new(Backoff::Yield, Duration::ZERO);
        let t0 = Instant::now();
        for _ in 0..SPIN_PASSES {
            assert_eq!(idle.empty_pass(true, t0), Pause::Spin);
        }
        for i in 0..10_000u64 {
            let now = t0 + Duration::from_micros(i);
            assert_eq!(idle.empty_pass(true, now), Pause::Yield);
        }
    }

    #[test]
    fn park_policy_sleeps_only_after_a_quiet_time_and_boundedly() {
        let mut idle = Idle::new(Backoff::Park, Duration::ZERO);
        let t0 = Instant::now();
        // Many fast empty passes inside PARK_AFTER: spin, then yield, never sleep.
        let early: Vec<_> = (0..100_000u64)
            .map(|i| idle.empty_pass(true, t0 + PARK_AFTER * (i as u32) / 200_000))
            .collect();
        assert!(early[..SPIN_PASSES as usize]
            .iter()
            .all(|p| *p == Pause::Spin));
        assert!(early[SPIN_PASSES as usize..]
            .iter()
            .all(|p| *p == Pause::Yield));
        // Past PARK_AFTER: growing sleeps up to the cap.
        let sleeps: Vec<Duration> = (0..1000u64)
            .filter_map(|i| {
                match idle.empty_pass(true, t0 + PARK_AFTER + Duration::from_micros(i)) {
                    Pause::Sleep(d) => Some(d),
                    _ => None,
                }
            })
            .collect();
        assert_eq!(sleeps.len(), 1000);
        assert_eq!(sleeps.first(), Some(&MIN_SLEEP));
        assert!(sleeps.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(sleeps.last(), Some(&MAX_SLEEP));
        // Nothing in flight or queued: block until a command comes.
        assert_eq!(idle.empty_pass(false, t0), Pause::Block);
    }

    #[test]
    fn progress_resets_the_streak() {
        let mut idle = Idle::new(Backoff::Park, Duration::ZERO);
        let t0 = Instant::now();
        for i in 0..2000u64 {
            idle.empty_pass(true, t0 + Duration::from_micros(i * 10));
        }
        idle.moved();
        let later = t0 + Duration::from_secs(1);
        assert_eq!(idle.empty_pass(true, later), Pause::Spin);
        for _ in 0..SPIN_PASSES {
            idle.empty_pass(true, later);
        }
        assert_eq!(idle.empty_pass(true, later), Pause::Yield);
    }

    #[test]
    fn park_policy_lingers_before_blocking_when_idle() {
        let linger = Duration::from_micros(200);
        let mut idle = Idle::new(Backoff::Park, linger);
        let t0 = Instant::now();
        // Inside the linger: spin, then yield, never block nor sleep.
        let inside: Vec<_> = (0..10_000u64)
            .map(|i| idle.empty_pass(false, t0 + linger * (i as u32) / 10_000))
            .collect();
        assert!(inside[..SPIN_PASSES as usize]
            .iter()
            .all(|p| *p == Pause::Spin));
        assert!(inside[SPIN_PASSES as usize..]
            .iter()
            .all(|p| *p == Pause::Yield));
        // Once the linger has passed without work: block.
        assert_eq!(idle.empty_pass(false, t0 + linger), Pause::Block);
        // New work resets the linger.
        idle.moved();
        assert_eq!(idle.empty_pass(false, t0 + linger * 2), Pause::Spin);
    }
}
