//! [`ListChooser`]: which way a list of small copies goes under
//! [`ListCopy::Auto`](super::ListCopy::Auto) — the copy engines (one `cuMemcpyBatchAsync`) or
//! one launch of the gather kernel — chosen by what each took lately.
//!
//! Neither way wins everywhere, and the difference is large either way (H200, 4 KiB pieces):
//! - the copy engines pay about 0.6 µs per piece device → host and 1.6 µs host → device
//!   (64 pieces 37–56 and 102–123 µs as one batch), where one kernel launch moves the same
//!   list in 35–38 µs: where one process has the GPU, small GPU messages in eager frames ran
//!   at 6.8–7.9 GB/s with the kernel against 3.9–4.3 with batches;
//! - but a kernel needs the GPU's multiprocessors and time slice: with two processes on one
//!   GPU a list took 500 µs as a launch where the copies took 100, and a GPU busy with a
//!   model's kernels holds them likewise.
//!
//! What the GPU is doing is not known in advance and changes, so the copier measures: each
//! list of [`FROM_COPIES`] copies or more is timed from its queuing to the end of its wait,
//! and the time goes into a running average per direction, per length class (powers of two)
//! and per way. A class first tries both ways in turn, then takes the faster, and still
//! tries the other one list in [`PROBE_EVERY`] × (how many times slower it was), so that a
//! GPU that became busy (or idle) is followed, while the probes cost about a 32nd of the
//! lists' time however slow the other way has become.
//!
//! Shared by every lane of a copier: the counters are relaxed atomics. Two engines that
//! record at once may lose one sample between them, which only makes the average a little
//! slower to move.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// Lists shorter than this go as one batch: below, a launch costs more than the copies
/// (2 × 4 KiB: 9.8 µs as two copies, 12.5 as a launch; 4 × 4 KiB: 14.0 and 13.2).
pub(crate) const FROM_COPIES: usize = 4;

/// Length classes: 4–7, 8–15, 16–31, 32–63 copies, and 64 or more.
const CLASSES: usize = 5;

/// Lists each way a class tries first, in turn, before it picks.
const WARM_UP: u32 = 4;

/// Once picked, the other way is probed one list in this many, times how much slower it
/// was (see [`ListChooser::pick`]).
pub(crate) const PROBE_EVERY: u32 = 32;

/// The kernel is taken only when its lists take at most this share of the copy engines'
/// (as a fraction: 3 / 4). A kernel costs what a list's own time does not show: the
/// multiprocessors and time slice it takes from the application's kernels and from other
/// processes' copies. With two processes on one GPU, each taking the kernel wherever it timed
/// a little faster moved 16 KiB messages at 5.2–6.5 GB/s against 6.8–8.0 through the copy
/// engines; where the kernel wins, it wins 2–10 × (twenty-seventh session).
const KERNEL_SHARE: (u64, u64) = (3, 4);

/// Whether lists of a class go as a kernel launch, by their average times.
fn kernel_wins(kernel_ns: u32, engines_ns: u32) -> bool {
    u64::from(kernel_ns) * KERNEL_SHARE.1 <= u64::from(engines_ns) * KERNEL_SHARE.0
}

/// The way lists with these average times go, probes aside: what [`ListChooser::pick`]
/// settles on, for reports of what it measured.
pub(crate) fn preferred(engines: Duration, kernel: Duration) -> Method {
    // The averages are kept as u32 ns, so this is exact for what `averages` returns.
    let ns = |d: Duration| u32::try_from(d.as_nanos()).unwrap_or(u32::MAX);
    if kernel_wins(ns(kernel), ns(engines)) {
        Method::Kernel
    } else {
        Method::Engines
    }
}

/// The weight of a new sample in a way's running average: 1 / 2^`SHIFT`.
const SHIFT: u32 = 2;

/// How a list of copies is carried out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Method {
    /// The copy engines: one `cuMemcpyBatchAsync` (a `cuMemcpyAsync` per copy on drivers
    /// older than CUDA 12.8).
    Engines,
    /// One launch of the gather kernel.
    Kernel,
}

/// Which direction a list copies: the two differ in cost per piece on the copy engines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Direction {
    /// Device memory → host (a gather into the bounce).
    ToHost,
    /// Host → device memory (a scatter from the bounce).
    ToDevice,
}

/// Running averages and a list count for one direction and length class.
#[derive(Debug, Default)]
struct Class {
    /// Average ns per list, through the copy engines and through the kernel (0: no sample
    /// yet).
    engines_ns: AtomicU32,
    kernel_ns: AtomicU32,
    /// Lists this class chose a way for.
    lists: AtomicU32,
}

/// Chooses a way per list and learns from how long lists took (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct ListChooser {
    classes: [[Class; CLASSES]; 2],
}

impl ListChooser {
    fn class(&self, direction: Direction, copies: usize) -> &Class {
        let d = match direction {
            Direction::ToHost => 0,
            Direction::ToDevice => 1,
        };
        // 4–7 → 0, 8–15 → 1, … (a list shorter than FROM_COPIES never asks).
        let c = (copies.max(FROM_COPIES) / FROM_COPIES).ilog2() as usize;
        &self.classes[d][c.min(CLASSES - 1)]
    }

    /// The way a list of `copies` copies (at least [`FROM_COPIES`]) goes.
    pub(crate) fn pick(&self, direction: Direction, copies: usize) -> Method {
        let class = self.class(direction, copies);
        let n = class.lists.fetch_add(1, Ordering::Relaxed);
        let (engines, kernel) = (
            class.engines_ns.load(Ordering::Relaxed),
            class.kernel_ns.load(Ordering::Relaxed),
        );
        // Each way a few times, in turn, and a way without a sample before anything else.
        if n < 2 * WARM_UP || engines == 0 || kernel == 0 {
            return match (engines == 0, kernel == 0) {
                (true, false) => Method::Engines,
                (false, true) => Method::Kernel,
                _ if n % 2 == 0 => Method::Engines,
                _ => Method::Kernel,
            };
        }
        let (faster, fast, slow) = if kernel_wins(kernel, engines) {
            (Method::Kernel, kernel, engines)
        } else {
            (Method::Engines, engines, kernel)
        };
        // A probe every PROBE_EVERY × slow / fast lists: the probes then cost about
        // 1 / PROBE_EVERY of the time the faster way takes, however much slower the other
        // way is (a kernel behind a model's long kernels can take milliseconds).
        let every = (u64::from(PROBE_EVERY) * u64::from(slow) / u64::from(fast.max(1)))
            .max(u64::from(PROBE_EVERY));
        if u64::from(n) % every == 0 {
            faster.other()
        } else {
            faster
        }
    }

    /// Records that a list of `copies` copies went `way` and took `took`, queuing to wait.
    pub(crate) fn record(&self, direction: Direction, copies: usize, way: Method, took: Duration) {
        let class = self.class(direction, copies);
        let average = match way {
            Method::Engines => &class.engines_ns,
            Method::Kernel => &class.kernel_ns,
        };
        // At least 1 ns: 0 means "no sample".
        let sample = u32::try_from(took.as_nanos()).unwrap_or(u32::MAX).max(1);
        let old = average.load(Ordering::Relaxed);
        let new = if old == 0 {
            sample
        } else {
            // old + (sample - old) / 2^SHIFT, in i64 so that either sign fits.
            let moved = i64::from(old) + ((i64::from(sample) - i64::from(old)) >> SHIFT);
            u32::try_from(moved.max(1)).unwrap_or(u32::MAX)
        };
        average.store(new, Ordering::Relaxed);
    }

    /// The length classes, as the fewest and the most copies of a list in each (`None`: no
    /// upper bound).
    pub(crate) fn classes() -> impl Iterator<Item = (usize, Option<usize>)> {
        (0..CLASSES).map(|c| {
            let first = FROM_COPIES << c;
            (first, (c + 1 < CLASSES).then(|| 2 * first - 1))
        })
    }

    /// The running averages of a class, copy engines and kernel (`None`: no sample yet), for
    /// tests and logs.
    pub(crate) fn averages(
        &self,
        direction: Direction,
        copies: usize,
    ) -> (Option<Duration>, Option<Duration>) {
        let class = self.class(direction, copies);
        let get = |a: &AtomicU32| match a.load(Ordering::Relaxed) {
            0 => None,
            ns => Some(Duration::from_nanos(u64::from(ns))),
        };
        (get(&class.engines_ns), get(&class.kernel_ns))
    }
}

impl Method {
    fn other(self) -> Self {
        match self {
            Self::Engines => Self::Kernel,
            Self::Kernel => Self::Engines,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Runs `lists` lists of `copies` copies through a chooser whose ways take what `cost`
    /// says for list `i`, and returns the ways taken.
    fn run(
        chooser: &ListChooser,
        copies: usize,
        lists: std::ops::Range<usize>,
        cost: impl Fn(usize, Method) -> u64,
    ) -> Vec<Method> {
        lists
            .map(|i| {
                let way = chooser.pick(Direction::ToDevice, copies);
                let took = Duration::from_micros(cost(i, way));
                chooser.record(Direction::ToDevice, copies, way, took);
                way
            })
            .collect()
    }

    #[test]
    fn both_ways_are_tried_first_then_the_faster_wins_with_rare_probes() {
        let chooser = ListChooser::default();
        let ways = run(&chooser, 16, 0..1000, |_, way| match way {
            Method::Engines => 30,
            Method::Kernel => 12,
        });
        let first: Vec<_> = ways[..2 * WARM_UP as usize].to_vec();
        assert!(first.contains(&Method::Engines) && first.contains(&Method::Kernel));
        let batches = ways[2 * WARM_UP as usize..]
            .iter()
            .filter(|w| **w == Method::Engines)
            .count();
        // Only probes go the slower way.
        let later = 1000 - 2 * WARM_UP as usize;
        assert!(batches <= later / PROBE_EVERY as usize + 1, "{batches}");
        assert!(batches >= 1, "the slower way is still probed");
    }

    #[test]
    fn a_gpu_that_turns_busy_moves_the_lists_back_to_the_copy_engines() {
        let chooser = ListChooser::default();
        // Idle at first (the kernel wins), then the kernel takes 500 µs (another process).
        let ways = run(&chooser, 20, 0..2000, |i, way| match (way, i < 500) {
            (Method::Engines, _) => 40,
            (Method::Kernel, true) => 15,
            (Method::Kernel, false) => 500,
        });
        assert!(
            ways[400..500]
                .iter()
                .filter(|w| **w == Method::Kernel)
                .count()
                >= 90
        );
        // Within two probes of the change, the lists are batches again.
        let settled = 500 + 2 * PROBE_EVERY as usize;
        let kernels = ways[settled..]
            .iter()
            .filter(|w| **w == Method::Kernel)
            .count();
        assert!(
            kernels <= (2000 - settled) / PROBE_EVERY as usize + 1,
            "{kernels}"
        );
    }

    #[test]
    fn classes_and_directions_learn_apart() {
        let chooser = ListChooser::default();
        // Short lists: batches win; long lists: the kernel wins.
        run(&chooser, 5, 0..100, |_, way| match way {
            Method::Engines => 10,
            Method::Kernel => 14,
        });
        run(&chooser, 64, 0..100, |_, way| match way {
            Method::Engines => 110,
            Method::Kernel => 38,
        });
        let (b, k) = chooser.averages(Direction::ToDevice, 5);
        assert!(b.unwrap() < k.unwrap());
        let (b, k) = chooser.averages(Direction::ToDevice, 200);
        assert!(b.unwrap() > k.unwrap());
        assert_eq!(chooser.averages(Direction::ToHost, 5), (None, None));
    }

    #[test]
    fn a_kernel_only_slightly_faster_leaves_lists_on_the_copy_engines() {
        let chooser = ListChooser::default();
        let ways = run(&chooser, 16, 0..400, |_, way| match way {
            Method::Engines => 100,
            Method::Kernel => 85,
        });
        let kernels = ways[2 * WARM_UP as usize..]
            .iter()
            .filter(|w| **w == Method::Kernel)
            .count();
        assert!(kernels <= 400 / PROBE_EVERY as usize + 1, "{kernels}");
        assert!(kernel_wins(75, 100) && !kernel_wins(76, 100));
        // What reports call the choice is what `pick` does.
        let (engines, kernel) = chooser.averages(Direction::ToDevice, 16);
        assert_eq!(
            preferred(engines.unwrap(), kernel.unwrap()),
            Method::Engines
        );
    }

    #[test]
    fn classes_cover_every_length_from_four_copies_once() {
        let classes: Vec<_> = ListChooser::classes().collect();
        assert_eq!(
            classes,
            [
                (4, Some(7)),
                (8, Some(15)),
                (16, Some(31)),
                (32, Some(63)),
                (64, None)
            ]
        );
        // Each class's lists land in that class's averages, and no other's.
        let chooser = ListChooser::default();
        for (i, &(first, last)) in classes.iter().enumerate() {
            for copies in [first, last.unwrap_or(first * 10)] {
                let took = Duration::from_micros(i as u64 + 1);
                chooser.record(Direction::ToHost, copies, Method::Kernel, took);
                assert_eq!(chooser.averages(Direction::ToHost, first).1, Some(took));
            }
        }
    }

    proptest! {
        /// Against a model: whatever the two ways cost (fixed per way), after the warm-up
        /// the chooser takes the cheaper one — the kernel only when it takes at most 3/4 of
        /// the copy engines' time — except for probes, and each average converges to its
        /// way's cost.
        #[test]
        fn the_cheaper_way_wins_except_probes(
            batch in 1u64..2000,
            kernel in 1u64..2000,
            copies in FROM_COPIES..400,
        ) {
            prop_assume!(batch != kernel);
            let chooser = ListChooser::default();
            let ways = run(&chooser, copies, 0..640, |_, way| match way {
                Method::Engines => batch,
                Method::Kernel => kernel,
            });
            let cheaper = preferred(Duration::from_nanos(batch), Duration::from_nanos(kernel));
            let dearer = ways[2 * WARM_UP as usize..].iter().filter(|w| **w != cheaper).count();
            prop_assert!(dearer <= 640 / PROBE_EVERY as usize + 1);
            let (b, k) = chooser.averages(Direction::ToDevice, copies);
            prop_assert_eq!(b, Some(Duration::from_micros(batch)));
            prop_assert_eq!(k, Some(Duration::from_micros(kernel)));
        }

        /// Whatever the two ways cost, the probes of the slower way take at most about a
        /// 32nd of the time the faster way takes (twice that, for the rounding of the probe
        /// interval), plus one slow list.
        #[test]
        fn probes_cost_a_small_share_however_slow_the_other_way(
            fast in 1u64..200,
            times in 2u64..5000,
            kernel_fast in any::<bool>(),
        ) {
            let slow = fast * times;
            let (batch, kernel) = if kernel_fast { (slow, fast) } else { (fast, slow) };
            let chooser = ListChooser::default();
            let ways = run(&chooser, 16, 0..4000, |_, way| match way {
                Method::Engines => batch,
                Method::Kernel => kernel,
            });
            let cost = |w: &Method| match w {
                Method::Engines => batch,
                Method::Kernel => kernel,
            };
            let after: Vec<_> = ways[2 * WARM_UP as usize..].to_vec();
            let faster = if kernel_fast { Method::Kernel } else { Method::Engines };
            let fast_time: u64 = after.iter().filter(|w| **w == faster).map(cost).sum();
            let probe_time: u64 = after.iter().filter(|w| **w != faster).map(cost).sum();
            prop_assert!(
                probe_time <= 2 * fast_time / u64::from(PROBE_EVERY) + slow,
                "probes {probe_time} µs against {fast_time} µs the fast way"
            );
        }

        /// Any sample, however large or small, leaves a usable average (never 0, which
        /// would read as "no sample").
        #[test]
        fn averages_stay_positive(samples in proptest::collection::vec(0u64..u64::MAX / 4, 1..50)) {
            let chooser = ListChooser::default();
            for s in samples {
                chooser.record(Direction::ToHost, 8, Method::Kernel, Duration::from_nanos(s));
                let (_, k) = chooser.averages(Direction::ToHost, 8);
                prop_assert!(k.is_some_and(|k| k.as_nanos() >= 1));
            }
        }
    }
}
