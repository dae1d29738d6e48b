//! The lane core against a model plugin: the harness executes every action the core returns
//! the way the engine does, against a model of the plugin's request queue, the staging ring's
//! slots and copies, and the unpack step's launches, and checks the rules at every step:
//! only the head is tested, receives are consumed in FIFO order and only once their copy or
//! gather finished, no ring slot is reused while in flight, posts follow submission order,
//! and every transfer finishes or fails exactly once (all of them, after a failure).

use std::cell::{Cell, OnceCell};
use std::collections::VecDeque;
use std::rc::Rc;

use proptest::prelude::*;

use super::{Action, Event, LaneCore, LaneWork, Place, Route, TestFailed, BATCH_SENDS_BELOW};
use crate::error::Direction;
use crate::schedule::{Chunk, Schedule};
use crate::window::TestOutcome;

/// A transfer as the model sees it.
#[derive(Debug)]
struct ModelJob {
    id: usize,
    route: Route,
    schedule: OnceCell<Schedule>,
    /// Chunks of it on the lane (known once its schedule is).
    expected: Cell<u64>,
    /// Chunks the model saw complete (a send done, a receive consumed).
    completed: Cell<u64>,
    finished: Cell<u32>,
    failed: Cell<u32>,
}

impl LaneWork for Rc<ModelJob> {
    fn schedule(&self) -> Option<&Schedule> {
        self.schedule.get()
    }

    fn route(&self, _chunk: &Chunk) -> Route {
        self.route
    }

    fn chunks_done(&self, n: u64) {
        assert_eq!(
            self.completed.get(),
            n,
            "job {} reported done before all its chunks completed",
            self.id
        );
        assert_eq!(n, self.expected.get(), "job {} chunk count", self.id);
        self.finished.set(self.finished.get() + 1);
    }

    fn fail(&self) {
        self.failed.set(self.failed.get() + 1);
    }
}

/// Percent odds of the model plugin's answers.
#[derive(Debug, Clone, Copy)]
struct Odds {
    done: u64,
    busy: u64,
    copy: u64,
    gather: u64,
    /// Per test call, in 1/10000.
    fail: u64,
    /// Per completion, in 1/10000.
    mismatch: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    Free,
    /// Send: copied into (`copied` once seen done), not yet posted.
    Filling {
        copied: bool,
    },
    /// Send: posted from.
    Sending,
    /// Receive: posted into.
    Receiving,
    /// Receive: done, copying out (`copied` once seen done).
    Draining {
        copied: bool,
    },
}

#[derive(Debug)]
struct Req {
    id: u64,
    job: usize,
    place: Place,
    len: u32,
    done: bool,
    queued: bool,
    gathered: bool,
}

type Core = LaneCore<u64, Rc<ModelJob>>;

struct Model {
    rng: u64,
    direction: Direction,
    odds: Odds,
    capacity: usize,
    requests: VecDeque<Req>,
    next_id: u64,
    /// Last (job, chunk index) taken for posting (fill or post): posts follow submission.
    last_taken: Option<(usize, u64)>,
    /// Send: filled slots waiting to be posted, oldest first, with their chunk index.
    ahead: VecDeque<(u16, u64)>,
    ring: Option<Vec<SlotState>>,
    unpack_present: bool,
    probed: bool,
    irecvs: u64,
    batch: Vec<u64>,
    launches: VecDeque<(Vec<u64>, bool)>,
    last_consumed: Option<u64>,
    jobs: Vec<Rc<ModelJob>>,
    mismatched: bool,
}

#[derive(Debug, PartialEq, Eq)]
enum Done {
    Posted,
    Busy,
    Retired,
    Other,
}

/// The lane failed (the engine would fail the link and abandon the lane).
#[derive(Debug)]
struct Failed;

impl Model {
    fn roll(&mut self, odds: u64, of: u64) -> bool {
        // xorshift64*
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d) % of < odds
    }

    fn job(&self, core: &Core) -> Rc<ModelJob> {
        core.posting_job()
            .expect("an action names the posting job")
            .clone()
    }

    fn take_order(&mut self, job: usize, index: u64) {
        if let Some(last) = self.last_taken {
            assert!(
                last < (job, index),
                "post order {last:?} then {:?}",
                (job, index)
            );
        }
        self.last_taken = Some((job, index));
    }

    fn slot(&mut self, slot: u16) -> &mut SlotState {
        let ring = self
            .ring
            .as_mut()
            .expect("a ring action before the ring was made");
        &mut ring[usize::from(slot)]
    }

    fn complete(&mut self, job: usize) {
        let job = &self.jobs[job];
        job.completed.set(job.completed.get() + 1);
    }

    /// Executes `action` as the engine would.
    fn exec(&mut self, core: &mut Core, action: Action) -> Result<Done, Failed> {
        let dir = self.direction;
        match action {
            Action::OpenRing { slots, slot_bytes } => {
                assert!(self.ring.is_none(), "a second ring");
                let want = match dir {
                    Direction::Send => 2 * self.capacity,
                    Direction::Recv => self.capacity,
                };
                assert_eq!(slots, want);
                assert!(slot_bytes > 0);
                assert_eq!(self.job(core).route, Route::Staged);
                self.ring = Some(vec![SlotState::Free; slots]);
                core.handle(Event::Opened).unwrap();
            }
            Action::OpenUnpack => {
                assert_eq!(dir, Direction::Recv);
                assert!(!self.probed, "probed twice");
                assert_eq!(self.job(core).route, Route::CudaDst);
                self.probed = true;
                core.handle(Event::UnpackProbed(self.unpack_present))
                    .unwrap();
            }
            Action::Fill { slot } => {
                let chunk = *core.chunk();
                assert_eq!(dir, Direction::Send);
                let job = self.job(core);
                assert_eq!(job.route, Route::Staged);
                self.take_order(job.id, chunk.index);
                let state = self.slot(slot);
                assert_eq!(*state, SlotState::Free, "slot {slot} filled while in use");
                *state = SlotState::Filling { copied: false };
                self.ahead.push_back((slot, chunk.index));
            }
            Action::PollCopy { slot } => {
                if dir == Direction::Recv {
                    let head = self.requests.front().expect("copy polled with no receive");
                    assert!(
                        head.done && head.place == Place::Ring(slot),
                        "polled a non-head copy"
                    );
                }
                let odds = self.odds.copy;
                let finish = self.roll(odds, 100);
                let state = self.slot(slot);
                let copied = match state {
                    SlotState::Filling { copied } | SlotState::Draining { copied } => {
                        *copied |= finish;
                        *copied
                    }
                    other => panic!("copy polled on slot {slot} in state {other:?}"),
                };
                core.handle(Event::Copied(copied)).unwrap();
            }
            Action::Post { place } => {
                let chunk = *core.chunk();
                if self.roll(self.odds.busy, 100) {
                    core.handle(Event::Busy).unwrap();
                    return Ok(Done::Busy);
                }
                assert!(
                    self.requests.len() < self.capacity,
                    "posted into a full window"
                );
                let job = match (dir, place) {
                    (Direction::Send, Place::Ring(slot)) => {
                        let front = self
                            .ahead
                            .pop_front()
                            .expect("ring post with nothing ahead");
                        assert_eq!(front, (slot, chunk.index), "ring posts out of order");
                        let state = self.slot(slot);
                        assert_eq!(
                            *state,
                            SlotState::Filling { copied: true },
                            "posted slot {slot} before its copy finished"
                        );
                        *state = SlotState::Sending;
                        // Its job may be behind the posting one: find it by chunk order.
                        usize::MAX
                    }
                    (Direction::Send, Place::Direct) => {
                        assert!(
                            self.ahead.is_empty(),
                            "a direct post overtook staged chunks"
                        );
                        let job = self.job(core);
                        assert_eq!(job.route, Route::Direct);
                        self.take_order(job.id, chunk.index);
                        job.id
                    }
                    (Direction::Recv, place) => {
                        let job = self.job(core);
                        self.take_order(job.id, chunk.index);
                        match place {
                            Place::Ring(slot) => {
                                assert_eq!(job.route, Route::Staged);
                                let state = self.slot(slot);
                                assert_eq!(*state, SlotState::Free, "slot {slot} reused in flight");
                                *state = SlotState::Receiving;
                            }
                            Place::Unpack(slot) => {
                                assert!(self.unpack_present && job.route == Route::CudaDst);
                                assert_eq!(u64::from(slot), self.irecvs % 16, "unpack slot");
                            }
                            Place::Direct => assert!(
                                job.route == Route::Direct
                                    || (job.route == Route::CudaDst && !self.unpack_present)
                            ),
                        }
                        self.irecvs += 1;
                        job.id
                    }
                    (Direction::Send, Place::Unpack(_)) => panic!("an unpack send"),
                };
                let id = self.next_id;
                self.next_id += 1;
                self.requests.push_back(Req {
                    id,
                    job,
                    place,
                    len: chunk.len,
                    done: false,
                    queued: false,
                    gathered: false,
                });
                // A request alone in the window is tested at once, as the engine does.
                if let Some(next) = core.posted(id).unwrap() {
                    assert!(matches!(next, Action::Test), "{next:?} right after a post");
                    self.exec(core, next)?;
                }
                return Ok(Done::Posted);
            }
            Action::Test => {
                let fail = self.roll(self.odds.fail, 10_000);
                let done = self.roll(self.odds.done, 100);
                let mismatch = self.roll(self.odds.mismatch, 10_000);
                let head = self
                    .requests
                    .iter()
                    .position(|r| !r.done)
                    .expect("tested with nothing in flight");
                let (head_id, head_len) = (self.requests[head].id, self.requests[head].len);
                if dir == Direction::Send && done && !fail && !mismatch {
                    // A done send is counted before it is reported (`LaneCore::sent`): count it first.
                    self.complete_send(head_id);
                }
                let outcome = |id: &mut u64| {
                    assert_eq!(*id, head_id, "tested a request that is not the head");
                    if fail {
                        TestOutcome::Failed("plugin")
                    } else if done {
                        let size = head_len as usize - usize::from(mismatch);
                        TestOutcome::Done { size }
                    } else {
                        TestOutcome::Pending
                    }
                };
                let next = match core.test_head(outcome) {
                    Ok(next) => next,
                    Err(TestFailed::Plugin(_)) => {
                        assert!(fail);
                        return Err(Failed);
                    }
                    Err(TestFailed::Size { size, posted, .. }) => {
                        assert!(mismatch && done && size != posted as usize);
                        self.mismatched = true;
                        return Err(Failed);
                    }
                };
                assert!(!fail, "a failed test went unreported");
                assert!(!(done && mismatch), "a size mismatch went unreported");
                if done {
                    self.requests[head].done = true;
                    if dir == Direction::Send {
                        assert_eq!(head, 0);
                        let req = self.requests.pop_front().unwrap();
                        if let Place::Ring(slot) = req.place {
                            *self.slot(slot) = SlotState::Free;
                        }
                    }
                }
                // What follows a test at once, executed as the engine does.
                if let Some(next) = next {
                    assert!(done, "an action followed a test that found nothing done");
                    return self.exec(core, next);
                }
            }
            Action::Drain { slot, size } => {
                let req = self
                    .requests
                    .iter()
                    .find(|r| r.place == Place::Ring(slot) && r.done)
                    .expect("drained a slot with no done receive");
                assert_eq!(req.len as usize, size);
                let state = self.slot(slot);
                assert_eq!(*state, SlotState::Receiving, "drained slot {slot} twice");
                *state = SlotState::Draining { copied: false };
            }
            Action::QueueUnpack { slot, size } => {
                let req = self
                    .requests
                    .iter_mut()
                    .find(|r| r.place == Place::Unpack(slot) && r.done && !r.queued)
                    .expect("queued a gather with no done receive");
                assert_eq!(req.len as usize, size);
                req.queued = true;
                self.batch.push(req.id);
            }
            Action::LaunchUnpack => {
                assert!(!self.batch.is_empty(), "an empty launch");
                let batch = std::mem::take(&mut self.batch);
                self.launches.push_back((batch, false));
            }
            Action::PollUnpack => {
                let finish = self.roll(self.odds.gather, 100);
                let (_, done) = self.launches.front_mut().expect("polled with no launch");
                *done |= finish;
                let done = *done;
                if done {
                    let (ids, _) = self.launches.pop_front().unwrap();
                    for id in ids {
                        let req = self.requests.iter_mut().find(|r| r.id == id).unwrap();
                        req.gathered = true;
                    }
                }
                core.handle(Event::Gathered(done)).unwrap();
            }
            Action::Consume { size } => {
                assert_eq!(dir, Direction::Recv);
                // Checked and counted inside: the core reports the transfer right after.
                core.consume(|token| {
                    let req = self
                        .requests
                        .pop_front()
                        .expect("consumed with nothing in flight");
                    assert_eq!(req.id, token, "consumed out of FIFO order");
                    assert!(req.done, "consumed before done");
                    assert_eq!(req.len as usize, size);
                    if let Some(last) = self.last_consumed {
                        assert!(last < token);
                    }
                    self.last_consumed = Some(token);
                    match req.place {
                        Place::Ring(slot) => {
                            let state = self.slot(slot);
                            assert_eq!(
                                *state,
                                SlotState::Draining { copied: true },
                                "consumed before its copy finished"
                            );
                            *state = SlotState::Free;
                        }
                        Place::Unpack(_) => assert!(req.gathered, "consumed before its gather"),
                        Place::Direct => {}
                    }
                    self.complete(req.job);
                    Ok::<(), ()>(())
                })
                .expect("the core refused a consume it asked for");
                return Ok(Done::Retired);
            }
            Action::Sent { .. } => {
                assert_eq!(dir, Direction::Send);
                core.sent();
                return Ok(Done::Retired);
            }
        }
        Ok(Done::Other)
    }

    /// A send completed: it belongs to the oldest job with chunks not yet completed.
    fn complete_send(&mut self, _id: u64) {
        let job = self
            .jobs
            .iter()
            .find(|j| j.schedule.get().is_some() && j.completed.get() < j.expected.get())
            .expect("a send completed with no job owing chunks")
            .id;
        self.complete(job);
    }

    fn pump(&mut self, core: &mut Core) -> Result<(), Failed> {
        while let Some(action) = core.poll_post() {
            match self.exec(core, action)? {
                Done::Posted => self.test(core)?,
                Done::Busy => return Ok(()),
                Done::Retired | Done::Other => {}
            }
        }
        Ok(())
    }

    fn test(&mut self, core: &mut Core) -> Result<(), Failed> {
        while let Some(action) = core.poll_test() {
            self.exec(core, action)?;
        }
        Ok(())
    }
}

/// A job to submit: its route, bytes, and the passes at which it is submitted and its
/// schedule published.
#[derive(Debug, Clone)]
struct Spec {
    route: Route,
    len: u64,
    submit_at: u32,
    publish_delay: u32,
}

fn spec(direction: Direction) -> impl Strategy<Value = Spec> {
    let route = match direction {
        Direction::Send => prop_oneof![Just(Route::Direct), Just(Route::Staged)].boxed(),
        Direction::Recv => prop_oneof![
            Just(Route::Direct),
            Just(Route::Staged),
            Just(Route::CudaDst)
        ]
        .boxed(),
    };
    (route, 0u64..40_000, 0u32..20, 0u32..4).prop_map(|(route, len, submit_at, publish_delay)| {
        Spec {
            route,
            len,
            submit_at,
            publish_delay,
        }
    })
}

/// The engine makes the lane's ring ahead of its first staged transfer (at connect, or when
/// CUDA memory is registered), between passes: the core must then never ask for one, and
/// refuses a second.
fn prepare(model: &mut Model, core: &mut Core) {
    let want = match model.direction {
        Direction::Send => 2 * model.capacity,
        Direction::Recv => model.capacity,
    };
    assert_eq!(core.ring_slots(), want);
    if model.ring.is_some() {
        assert!(core.has_ring());
        assert!(core.ring_made().is_err(), "a second ring was accepted");
        return;
    }
    assert!(!core.has_ring());
    core.ring_made().expect("a ring made between passes");
    model.ring = Some(vec![SlotState::Free; want]);
    assert!(core.has_ring());
}

/// Runs `specs` through a lane of `direction` and checks the rules; returns the model.
/// `prepare_at`: the pass before which the engine makes the lane's ring ahead of use.
#[allow(clippy::too_many_arguments)]
fn run(
    direction: Direction,
    specs: &[Spec],
    window: usize,
    channel: u16,
    channels: u16,
    chunk_bytes: u32,
    unpack_present: bool,
    odds: Odds,
    seed: u64,
) -> Model {
    run_prepared(
        direction,
        specs,
        window,
        channel,
        channels,
        chunk_bytes,
        unpack_present,
        odds,
        seed,
        None,
    )
}

/// [`run`], with the ring made ahead of use before pass `prepare_at`, if given.
#[allow(clippy::too_many_arguments)]
fn run_prepared(
    direction: Direction,
    specs: &[Spec],
    window: usize,
    channel: u16,
    channels: u16,
    chunk_bytes: u32,
    unpack_present: bool,
    odds: Odds,
    seed: u64,
    prepare_at: Option<u32>,
) -> Model {
    let mut core = Core::new(direction, channel, channels, window).unwrap();
    assert_eq!(core.capacity(), window);
    // Submission order is by `submit_at`, then by index (the lane sees pushes in this order).
    let mut order: Vec<usize> = (0..specs.len()).collect();
    order.sort_by_key(|&i| (specs[i].submit_at, i));
    let rank: Vec<usize> = {
        let mut rank = vec![0; specs.len()];
        for (r, &i) in order.iter().enumerate() {
            rank[i] = r;
        }
        rank
    };
    // Job ids in the model follow submission order, so post order compares ranks.
    let jobs: Vec<Rc<ModelJob>> = order
        .iter()
        .map(|&i| {
            Rc::new(ModelJob {
                id: rank[i],
                route: specs[i].route,
                schedule: OnceCell::new(),
                expected: Cell::new(0),
                completed: Cell::new(0),
                finished: Cell::new(0),
                failed: Cell::new(0),
            })
        })
        .collect();
    let mut model = Model {
        rng: seed | 1,
        direction,
        odds,
        capacity: window,
        requests: VecDeque::new(),
        next_id: 0,
        last_taken: None,
        ahead: VecDeque::new(),
        ring: None,
        unpack_present,
        probed: false,
        irecvs: 0,
        batch: Vec::new(),
        launches: VecDeque::new(),
        last_consumed: None,
        jobs: jobs.clone(),
        mismatched: false,
    };
    let specs: Vec<Spec> = order.iter().map(|&i| specs[i].clone()).collect();
    let mut failed = false;
    // Enough passes for the chunks this lane carries: with 1-byte chunks a few transfers are
    // a hundred thousand chunks, more than any fixed budget (a shrunk case once "stalled" at
    // 20 000 passes with work still moving).
    let chunks: u64 = specs
        .iter()
        .map(|s| {
            Schedule::contiguous(s.len, chunk_bytes, channels)
                .map_or(0, |sc| sc.chunk_count_on(channel))
        })
        .sum();
    let passes = u32::try_from(20_000 + 64 * chunks).unwrap_or(u32::MAX);
    for pass in 0..passes {
        if prepare_at == Some(pass) {
            prepare(&mut model, &mut core);
        }
        for (job, spec) in jobs.iter().zip(&specs) {
            if spec.submit_at == pass {
                core.push(job.clone());
            }
            if spec.submit_at + spec.publish_delay == pass {
                let schedule = Schedule::contiguous(spec.len, chunk_bytes, channels).unwrap();
                job.expected.set(schedule.chunk_count_on(channel));
                let _ = job.schedule.set(schedule);
            }
        }
        let step = model.pump(&mut core).and_then(|()| model.test(&mut core));
        if step.is_err() {
            failed = true;
            core.abandon();
            model.requests.clear();
            // The engine fails what is submitted to a failed link at once.
            for (job, spec) in jobs.iter().zip(&specs) {
                if spec.submit_at > pass {
                    job.fail();
                }
            }
            break;
        }
        let all_published = specs.iter().all(|s| pass >= s.submit_at + s.publish_delay);
        if all_published && !core.has_work() {
            break;
        }
    }
    if !failed {
        assert!(!core.has_work(), "the lane stalled with work left");
    }
    for job in &jobs {
        let outcomes = job.finished.get() + job.failed.get();
        assert_eq!(outcomes, 1, "job {} had {outcomes} outcomes", job.id);
        if !failed {
            assert_eq!(
                job.finished.get(),
                1,
                "job {} failed without a failure",
                job.id
            );
        }
    }
    model
}

const FAIR: Odds = Odds {
    done: 40,
    busy: 10,
    copy: 40,
    gather: 40,
    fail: 0,
    mismatch: 0,
};

fn spec_of(route: Route, len: u64) -> Spec {
    Spec {
        route,
        len,
        submit_at: 0,
        publish_delay: 0,
    }
}

#[test]
fn host_receive_is_consumed_right_after_done() {
    let mut core = Core::new(Direction::Recv, 0, 1, 4).unwrap();
    let job = Rc::new(ModelJob {
        id: 0,
        route: Route::Direct,
        schedule: OnceCell::from(Schedule::contiguous(100, 100, 1).unwrap()),
        expected: Cell::new(1),
        completed: Cell::new(0),
        finished: Cell::new(0),
        failed: Cell::new(0),
    });
    core.push(job.clone());
    assert!(matches!(
        core.poll_post(),
        Some(Action::Post {
            place: Place::Direct,
            ..
        })
    ));
    // Alone in the window: tested at once.
    assert!(matches!(core.posted(7), Ok(Some(Action::Test))));
    assert!(core
        .test_head(|_| TestOutcome::<()>::Pending)
        .unwrap()
        .is_none());
    assert!(core.poll_test().is_none());
    assert!(core.poll_post().is_none(), "one chunk only");
    assert!(matches!(core.poll_test(), Some(Action::Test)));
    // Done and nothing ahead of it: consumed at once.
    assert!(matches!(
        core.test_head(|_| TestOutcome::<()>::Done { size: 100 }),
        Ok(Some(Action::Consume { size: 100 }))
    ));
    job.completed.set(1);
    core.consume(|token| {
        assert_eq!(token, 7);
        Ok::<(), ()>(())
    })
    .unwrap();
    assert!(core.poll_test().is_none());
    assert_eq!(job.finished.get(), 1);
    assert!(!core.has_work());
}

#[test]
fn staged_receive_is_consumed_only_after_its_copy_finished() {
    let mut core = Core::new(Direction::Recv, 0, 1, 2).unwrap();
    let job = Rc::new(ModelJob {
        id: 0,
        route: Route::Staged,
        schedule: OnceCell::from(Schedule::contiguous(64, 64, 1).unwrap()),
        expected: Cell::new(1),
        completed: Cell::new(0),
        finished: Cell::new(0),
        failed: Cell::new(0),
    });
    core.push(job.clone());
    assert!(matches!(
        core.poll_post(),
        Some(Action::OpenRing {
            slots: 2,
            slot_bytes: 64
        })
    ));
    core.handle(Event::Opened).unwrap();
    assert!(matches!(
        core.poll_post(),
        Some(Action::Post {
            place: Place::Ring(0),
            ..
        })
    ));
    assert!(matches!(core.posted(1), Ok(Some(Action::Test))));
    assert!(core
        .test_head(|_| TestOutcome::<()>::Pending)
        .unwrap()
        .is_none());
    assert!(core.poll_test().is_none());
    assert!(core.poll_post().is_none(), "one chunk only");
    assert!(matches!(core.poll_test(), Some(Action::Test)));
    assert!(matches!(
        core.test_head(|_| TestOutcome::<()>::Done { size: 64 }),
        Ok(Some(Action::Drain { slot: 0, size: 64 }))
    ));
    assert!(matches!(
        core.poll_test(),
        Some(Action::PollCopy { slot: 0 })
    ));
    core.handle(Event::Copied(false)).unwrap();
    assert!(core.poll_test().is_none(), "no consume while the copy runs");
    assert!(matches!(
        core.poll_test(),
        Some(Action::PollCopy { slot: 0 })
    ));
    core.handle(Event::Copied(true)).unwrap();
    assert!(matches!(core.poll_test(), Some(Action::Consume { .. })));
    job.completed.set(1);
    core.consume(|token| {
        assert_eq!(token, 1);
        Ok::<(), ()>(())
    })
    .unwrap();
    assert!(core.poll_test().is_none());
    assert_eq!(job.finished.get(), 1);
}

#[test]
fn staged_send_posts_a_slot_only_after_its_copy() {
    let specs = [
        spec_of(Route::Staged, 10_000),
        spec_of(Route::Direct, 5_000),
    ];
    let odds = Odds { copy: 5, ..FAIR };
    run(Direction::Send, &specs, 4, 0, 1, 1024, false, odds, 3);
}

#[test]
fn unpack_receives_are_gathered_then_consumed_in_order() {
    let specs = [
        spec_of(Route::CudaDst, 20_000),
        spec_of(Route::Direct, 3_000),
        spec_of(Route::CudaDst, 9_000),
    ];
    run(Direction::Recv, &specs, 16, 1, 2, 1000, true, FAIR, 9);
}

#[test]
fn a_failed_test_fails_every_transfer_once() {
    let mut core = Core::new(Direction::Send, 0, 1, 4).unwrap();
    let jobs: Vec<_> = (0..3)
        .map(|id| {
            Rc::new(ModelJob {
                id,
                route: Route::Direct,
                schedule: OnceCell::from(Schedule::contiguous(300, 100, 1).unwrap()),
                expected: Cell::new(3),
                completed: Cell::new(0),
                finished: Cell::new(0),
                failed: Cell::new(0),
            })
        })
        .collect();
    for job in &jobs {
        core.push(job.clone());
    }
    assert!(matches!(core.poll_post(), Some(Action::Post { .. })));
    // A small send alone in the window waits for the posts behind it.
    assert!(matches!(core.posted(0), Ok(None)));
    assert!(core.defers_test());
    assert!(matches!(core.poll_post(), Some(Action::Post { .. })));
    assert!(matches!(core.posted(1), Ok(None)));
    // The test pass after the posts tests the head.
    assert!(matches!(core.poll_test(), Some(Action::Test)));
    assert!(matches!(
        core.test_head(|_| TestOutcome::Failed("broken")),
        Err(TestFailed::Plugin("broken"))
    ));
    core.abandon();
    for job in &jobs {
        assert_eq!((job.finished.get(), job.failed.get()), (0, 1));
    }
    assert!(!core.has_work());
    assert!(
        core.poll_post().is_none(),
        "a failed lane never posts again"
    );
}

fn odds() -> impl Strategy<Value = Odds> {
    (
        5u64..100,
        0u64..50,
        5u64..100,
        5u64..100,
        prop_oneof![Just(0u64), 0u64..40],
        prop_oneof![Just(0u64), 0u64..40],
    )
        .prop_map(|(done, busy, copy, gather, fail, mismatch)| Odds {
            done,
            busy,
            copy,
            gather,
            fail,
            mismatch,
        })
}

#[test]
fn a_prepared_lane_stages_without_asking_for_a_ring() {
    for direction in [Direction::Send, Direction::Recv] {
        let mut core = Core::new(direction, 0, 1, 2).unwrap();
        core.ring_made().unwrap();
        assert!(core.ring_made().is_err(), "a second ring");
        let job = Rc::new(ModelJob {
            id: 0,
            route: Route::Staged,
            schedule: OnceCell::from(Schedule::contiguous(64, 64, 1).unwrap()),
            expected: Cell::new(1),
            completed: Cell::new(0),
            finished: Cell::new(0),
            failed: Cell::new(0),
        });
        core.push(job);
        let first = core.poll_post();
        match direction {
            Direction::Send => assert!(matches!(first, Some(Action::Fill { slot: 0 }))),
            Direction::Recv => assert!(matches!(
                first,
                Some(Action::Post {
                    place: Place::Ring(0)
                })
            )),
        }
    }
}

#[test]
fn a_ring_made_while_the_lane_waits_for_a_report_is_refused() {
    let mut core = Core::new(Direction::Recv, 0, 1, 2).unwrap();
    let job = Rc::new(ModelJob {
        id: 0,
        route: Route::Staged,
        schedule: OnceCell::from(Schedule::contiguous(64, 64, 1).unwrap()),
        expected: Cell::new(1),
        completed: Cell::new(0),
        finished: Cell::new(0),
        failed: Cell::new(0),
    });
    core.push(job);
    assert!(matches!(core.poll_post(), Some(Action::OpenRing { .. })));
    assert!(core.ring_made().is_err(), "the OpenRing report is pending");
    core.handle(Event::Opened).unwrap();
    assert!(core.has_ring());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 192, ..ProptestConfig::default() })]

    /// As `lane_keeps_the_plugin_rules`, with the ring made ahead of use by the engine at a
    /// random pass (before the first staged transfer, amid them, or after): the core never
    /// asks for a second ring, and every rule holds.
    #[test]
    fn a_lane_whose_ring_is_made_ahead_keeps_the_plugin_rules(
        (direction, specs) in prop_oneof![Just(Direction::Send), Just(Direction::Recv)]
            .prop_flat_map(|d| (Just(d), proptest::collection::vec(spec(d), 0..12))),
        window in 1usize..=16,
        channels in 1u16..4,
        channel_pick in 0u16..4,
        chunk_bytes in prop_oneof![Just(1000u32), 1u32..9000],
        unpack_present in any::<bool>(),
        odds in odds(),
        seed in any::<u64>(),
        prepare_at in 0u32..30,
    ) {
        let channel = channel_pick % channels;
        run_prepared(
            direction, &specs, window, channel, channels, chunk_bytes, unpack_present, odds,
            seed, Some(prepare_at),
        );
    }

    /// Random transfers on every route, random plugin answers (busy, slow tests, slow copies
    /// and gathers, rare failures and size mismatches), random windows and channels: every
    /// rule holds at every step and every transfer finishes or fails exactly once.
    #[test]
    fn lane_keeps_the_plugin_rules(
        (direction, specs) in prop_oneof![Just(Direction::Send), Just(Direction::Recv)]
            .prop_flat_map(|d| (Just(d), proptest::collection::vec(spec(d), 0..12))),
        window in 1usize..=16,
        channels in 1u16..4,
        channel_pick in 0u16..4,
        chunk_bytes in prop_oneof![Just(1000u32), 1u32..9000],
        unpack_present in any::<bool>(),
        odds in odds(),
        seed in any::<u64>(),
    ) {
        let channel = channel_pick % channels;
        run(direction, &specs, window, channel, channels, chunk_bytes, unpack_present, odds, seed);
    }
}

#[test]
fn small_sends_are_tested_after_the_posts_behind_them_large_ones_at_once() {
    let job = |id, len: u64, chunk: u32| {
        Rc::new(ModelJob {
            id,
            route: Route::Direct,
            schedule: OnceCell::from(Schedule::contiguous(len, chunk, 1).unwrap()),
            expected: Cell::new(len.div_ceil(u64::from(chunk))),
            completed: Cell::new(0),
            finished: Cell::new(0),
            failed: Cell::new(0),
        })
    };
    let small = BATCH_SENDS_BELOW - 1;
    let mut core = Core::new(Direction::Send, 0, 1, 4).unwrap();
    core.push(job(0, 3 * u64::from(small), small));
    for request in 0..3 {
        assert!(matches!(core.poll_post(), Some(Action::Post { .. })));
        assert!(matches!(core.posted(request), Ok(None)), "post {request}");
        assert!(core.defers_test());
    }
    assert!(core.poll_post().is_none(), "nothing left to post");
    assert!(matches!(core.poll_test(), Some(Action::Test)));

    let large = BATCH_SENDS_BELOW;
    let mut core = Core::new(Direction::Send, 0, 1, 4).unwrap();
    core.push(job(1, 2 * u64::from(large), large));
    assert!(matches!(core.poll_post(), Some(Action::Post { .. })));
    assert!(!core.defers_test());
    assert!(matches!(core.posted(0), Ok(Some(Action::Test))));

    // Receives are never deferred: a receive alone in the window is tested at once.
    let mut core = Core::new(Direction::Recv, 0, 1, 4).unwrap();
    core.push(job(2, 2 * u64::from(small), small));
    assert!(matches!(core.poll_post(), Some(Action::Post { .. })));
    assert!(!core.defers_test());
    assert!(matches!(core.posted(0), Ok(Some(Action::Test))));
}
