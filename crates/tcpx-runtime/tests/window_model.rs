//! State-machine tests: random sequences of operations applied both to the windows and to a
//! plain `VecDeque` model of the plugin's rules; every step must agree.

use std::collections::VecDeque;

use proptest::prelude::*;
use tcpx_runtime::window::{
    ConsumeError, RecvWindow, RejectReason, Release, SendWindow, TestOutcome,
};

#[derive(Debug, Clone)]
enum Op {
    Post,
    TestDone(usize),
    TestPending,
    TestFail,
    Consume,
    Abandon,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => Just(Op::Post),
        5 => (0usize..1 << 20).prop_map(Op::TestDone),
        2 => Just(Op::TestPending),
        5 => Just(Op::Consume),
        1 => Just(Op::TestFail),
        1 => Just(Op::Abandon),
    ]
}

/// The reference: requests in posting order, each with its done size once tested done.
#[derive(Debug, Default)]
struct Model {
    queue: VecDeque<(u64, Option<usize>)>,
    capacity: usize,
    failed: bool,
}

impl Model {
    fn testable(&self) -> Option<u64> {
        if self.failed {
            return None;
        }
        self.queue
            .iter()
            .find(|(_, d)| d.is_none())
            .map(|(id, _)| *id)
    }
}

/// Tracks that every posted id leaves exactly once, and completions leave in FIFO order.
#[derive(Debug, Default)]
struct Ledger {
    next_id: u64,
    left: Vec<u64>,
    last_completed: Option<u64>,
}

impl Ledger {
    fn complete(&mut self, id: u64) -> Result<(), TestCaseError> {
        prop_assert!(
            self.last_completed.is_none_or(|last| last < id),
            "completion {id} after {:?}: not FIFO",
            self.last_completed
        );
        self.last_completed = Some(id);
        self.leave(id)
    }

    fn leave(&mut self, id: u64) -> Result<(), TestCaseError> {
        prop_assert!(!self.left.contains(&id), "request {id} released twice");
        self.left.push(id);
        Ok(())
    }

    /// Every id ever posted has left or is still held, and none twice.
    fn check_conservation(&self, held: impl Iterator<Item = u64>) -> Result<(), TestCaseError> {
        let mut all: Vec<u64> = self.left.iter().copied().chain(held).collect();
        all.sort_unstable();
        let expected: Vec<u64> = (0..self.next_id).collect();
        prop_assert_eq!(all, expected, "a request was lost or duplicated");
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn recv_window_follows_the_plugin_rules(
        capacity in 1usize..=16,
        ops in proptest::collection::vec(op(), 0..200),
    ) {
        let mut win: RecvWindow<u64, u64> = RecvWindow::new(capacity).unwrap();
        let mut model = Model { capacity, ..Model::default() };
        let mut ledger = Ledger::default();

        for op in ops {
            match op {
                Op::Post => {
                    let id = ledger.next_id;
                    let result = win.try_post(id, id * 3);
                    if model.failed {
                        prop_assert_eq!(result.unwrap_err().reason, RejectReason::Failed);
                    } else if model.queue.len() == model.capacity {
                        let rejected = result.unwrap_err();
                        prop_assert_eq!(rejected.reason, RejectReason::Full);
                        prop_assert_eq!(rejected.entry.token, id);
                    } else {
                        prop_assert!(result.is_ok());
                        model.queue.push_back((id, None));
                        ledger.next_id += 1;
                    }
                }
                Op::TestDone(_) | Op::TestPending | Op::TestFail => {
                    let expected = model.testable();
                    prop_assert_eq!(win.next_to_test().map(|e| e.token), expected);
                    let mut tested = None;
                    let outcome = match &op {
                        Op::TestDone(size) => TestOutcome::Done { size: *size },
                        Op::TestPending => TestOutcome::Pending,
                        _ => TestOutcome::Failed("boom"),
                    };
                    let release = win.test_head(|t| { tested = Some(*t); outcome });
                    // `test` is called exactly on the model's head, or not at all.
                    prop_assert_eq!(tested, expected);
                    match (release, expected) {
                        (None, None) => {}
                        (Some(Release::NotReady), Some(_)) => {
                            prop_assert!(matches!(op, Op::TestPending));
                        }
                        (Some(Release::Released(r)), Some(id)) => {
                            let Op::TestDone(size) = op else { unreachable!() };
                            prop_assert_eq!((*r.data, r.size), (id * 3, size));
                            let slot = model.queue.iter_mut().find(|(i, _)| *i == id).unwrap();
                            slot.1 = Some(size);
                        }
                        (Some(Release::Error(f)), Some(id)) => {
                            prop_assert!(matches!(op, Op::TestFail));
                            prop_assert_eq!(f.failed.token, id);
                            ledger.leave(id)?;
                            let behind: Vec<u64> = model.queue.iter()
                                .map(|(i, _)| *i).filter(|i| *i > id).collect();
                            let abandoned: Vec<u64> = f.abandoned.iter().map(|e| e.token).collect();
                            prop_assert_eq!(&abandoned, &behind);
                            for a in abandoned { ledger.leave(a)?; }
                            model.queue.retain(|(i, _)| *i < id);
                            model.failed = true;
                        }
                        (release, expected) => {
                            prop_assert!(false, "window said {release:?}, model expected {expected:?}");
                        }
                    }
                }
                Op::Consume => {
                    let result = win.consume_head();
                    match model.queue.front().copied() {
                        None => prop_assert_eq!(result.unwrap_err(), ConsumeError::Empty),
                        Some((_, None)) => prop_assert_eq!(result.unwrap_err(), ConsumeError::NotDone),
                        Some((id, Some(size))) => {
                            let c = result.unwrap();
                            prop_assert_eq!((c.token, c.data, c.size), (id, id * 3, size));
                            model.queue.pop_front();
                            ledger.complete(id)?;
                        }
                    }
                }
                Op::Abandon => {
                    let tokens: Vec<u64> = win.abandon().into_iter().map(|e| e.token).collect();
                    let expected: Vec<u64> = model.queue.drain(..).map(|(i, _)| i).collect();
                    prop_assert_eq!(&tokens, &expected);
                    for t in tokens { ledger.leave(t)?; }
                    model.failed = true;
                }
            }

            // Invariants after every step.
            prop_assert!(win.len() <= capacity);
            prop_assert_eq!(win.len(), model.queue.len());
            prop_assert_eq!(win.is_failed(), model.failed);
            let done = model.queue.iter().filter(|(_, d)| d.is_some()).count();
            prop_assert_eq!(win.awaiting_consume(), done);
            // Done receives form a prefix: consumes can always proceed in FIFO order.
            prop_assert!(model.queue.iter().skip(done).all(|(_, d)| d.is_none()));
            // No dead end: a non-empty window always offers a test or a consume.
            if !win.is_empty() {
                prop_assert!(win.next_to_test().is_some() || win.consumable().is_some());
            }
        }
        ledger.check_conservation(model.queue.iter().map(|(i, _)| *i))?;
    }

    #[test]
    fn send_window_follows_the_plugin_rules(
        capacity in 1usize..=16,
        ops in proptest::collection::vec(op(), 0..200),
    ) {
        let mut win: SendWindow<u64, u64> = SendWindow::new(capacity).unwrap();
        let mut model = Model { capacity, ..Model::default() };
        let mut ledger = Ledger::default();

        for op in ops {
            match op {
                Op::Post | Op::Consume => {
                    let id = ledger.next_id;
                    let result = win.try_post(id, id * 3);
                    if model.failed || model.queue.len() == model.capacity {
                        prop_assert_eq!(result.unwrap_err().entry.token, id);
                    } else {
                        prop_assert!(result.is_ok());
                        model.queue.push_back((id, None));
                        ledger.next_id += 1;
                    }
                }
                Op::TestDone(_) | Op::TestPending | Op::TestFail => {
                    let expected = model.testable();
                    let mut tested = None;
                    let outcome = match &op {
                        Op::TestDone(size) => TestOutcome::Done { size: *size },
                        Op::TestPending => TestOutcome::Pending,
                        _ => TestOutcome::Failed(7u8),
                    };
                    let release = win.test_head(|t| { tested = Some(*t); outcome });
                    prop_assert_eq!(tested, expected);
                    match (release, expected) {
                        (None, None) | (Some(Release::NotReady), Some(_)) => {}
                        (Some(Release::Released(c)), Some(id)) => {
                            let Op::TestDone(size) = op else { unreachable!() };
                            prop_assert_eq!((c.token, c.data, c.size), (id, id * 3, size));
                            // A done send frees its slot at once.
                            model.queue.pop_front();
                            ledger.complete(id)?;
                        }
                        (Some(Release::Error(f)), Some(id)) => {
                            prop_assert_eq!(f.failed.token, id);
                            ledger.leave(id)?;
                            for e in &f.abandoned { ledger.leave(e.token)?; }
                            prop_assert_eq!(f.abandoned.len() + 1, model.queue.len());
                            model.queue.clear();
                            model.failed = true;
                        }
                        (release, expected) => {
                            prop_assert!(false, "window said {release:?}, model expected {expected:?}");
                        }
                    }
                }
                Op::Abandon => {
                    for e in win.abandon() { ledger.leave(e.token)?; }
                    model.queue.clear();
                    model.failed = true;
                }
            }
            prop_assert!(win.len() <= capacity);
            prop_assert_eq!(win.len(), model.queue.len());
            prop_assert_eq!(win.next_to_test().map(|e| e.token), model.testable());
        }
        ledger.check_conservation(model.queue.iter().map(|(i, _)| *i))?;
    }
}
