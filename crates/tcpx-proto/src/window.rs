//! Per-comm sliding windows of outstanding plugin requests (sans-IO).
//!
//! The ncclNet plugins (TCPX above all) impose rules on the requests of one comm that are easy
//! to break by accident in an engine loop:
//!
//! - at most [`DEFAULT_CAPACITY`] (16) requests may be outstanding on a comm;
//! - `test` is legal only on the comm's *oldest* untested request;
//! - a receive that `test` reported done still holds its slot until `irecvConsumed` is called
//!   for it, and consumes happen in FIFO order too.
//!
//! [`SendWindow`] and [`RecvWindow`] encode those rules in their API instead of in comments:
//! the only way to test is [`SendWindow::test_head`], which hands the closure the head's token
//! (mutably: the safe layer's `test` updates the request it is given) and nothing else; a receive can be consumed only through [`RecvWindow::consume_head`],
//! which refuses unless the oldest receive is done; and a failed test fails the whole window,
//! handing back every request that can no longer complete, so no slot stays occupied by a
//! request nobody will ever test.
//!
//! The windows do no I/O: the caller performs the plugin calls and feeds the outcomes in.
//! A token `T` is whatever identifies a request to the plugin (the request pointer, wrapped by
//! the caller); `D` is the caller's bookkeeping for it (e.g. transfer id and chunk index).
//!
//! ```
//! use tcpx_proto::window::{Release, RecvWindow, TestOutcome};
//!
//! let mut win: RecvWindow<u32, &str> = RecvWindow::new(2).unwrap();
//! win.try_post(7, "chunk 0").unwrap();
//! win.try_post(8, "chunk 1").unwrap();
//! assert!(win.try_post(9, "chunk 2").is_err()); // full
//!
//! // Only the head (token 7) is ever handed to the test closure.
//! let step = win.test_head(|token: &mut u32| {
//!     assert_eq!(*token, 7);
//!     TestOutcome::<()>::Done { size: 4096 }
//! });
//! assert!(matches!(step, Some(Release::Released(r)) if r.size == 4096));
//!
//! // Done, but still holding its slot until consumed.
//! assert!(win.is_full());
//! let done = win.consume_head().unwrap();
//! assert_eq!((done.token, done.data), (7, "chunk 0"));
//! assert!(!win.is_full());
//! ```

use std::collections::VecDeque;

/// Requests in flight per comm that TCPX accepts (`MAX_REQUESTS` in the plugin).
pub const DEFAULT_CAPACITY: usize = 16;

/// A window was asked for a capacity of zero, which could never make progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a request window needs a capacity of at least 1 (the TCPX limit is {DEFAULT_CAPACITY})")]
pub struct ZeroCapacity;

/// One posted request: the plugin's token and the caller's data for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry<T, D> {
    /// What identifies the request to the plugin (e.g. the wrapped request pointer).
    pub token: T,
    /// The caller's bookkeeping for the request (e.g. transfer id and chunk index).
    pub data: D,
}

/// A request that has left its window for good, with the size `test` reported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion<T, D> {
    /// The request's token. For a receive, pass it to `irecvConsumed`.
    pub token: T,
    /// The caller's data given at post time.
    pub data: D,
    /// Bytes transferred, as reported by `test`.
    pub size: usize,
}

/// A receive that `test` just reported done. It stays in the window (holding its slot) until
/// [`RecvWindow::consume_head`] removes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Received<'a, D> {
    /// The caller's data given at post time.
    pub data: &'a D,
    /// Bytes received, as reported by `test`.
    pub size: usize,
}

/// What the plugin's `test` said about the head request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TestOutcome<E> {
    /// The request completed; `size` bytes were moved.
    Done {
        /// Bytes moved, as reported by the plugin.
        size: usize,
    },
    /// Not complete yet; test again later.
    Pending,
    /// `test` returned an error for this request.
    Failed(E),
}

/// The result of testing a window's head: released, not ready, or an error.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a released request or a failure must be handed on to its transfer"]
pub enum Release<C, T, D, E> {
    /// The head completed (`C` is [`Completion`] for sends, [`Received`] for receives).
    Released(C),
    /// The head is still in progress.
    NotReady,
    /// The head failed; the window is now failed and gives back every request that will
    /// never complete.
    Error(Failure<T, D, E>),
}

/// A failed `test` and everything it took down with it.
///
/// Requests complete in posting order, so once the head fails nothing behind it can complete
/// either: the window is marked failed and returns all of them, to be failed by the caller.
#[derive(Debug, PartialEq, Eq)]
pub struct Failure<T, D, E> {
    /// The error `test` reported.
    pub error: E,
    /// The request whose test failed.
    pub failed: Entry<T, D>,
    /// Requests posted after it, oldest first; they will never complete.
    pub abandoned: Vec<Entry<T, D>>,
}

/// Why [`SendWindow::try_post`] / [`RecvWindow::try_post`] refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectReason {
    /// Every slot is in use; test (and, for receives, consume) first.
    Full,
    /// The window failed earlier; the comm must not be used any more.
    Failed,
}

/// A request the window refused, handed back so that neither token nor data is lost.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("request window refused a post: {reason:?}")]
pub struct Rejected<T, D> {
    /// Why it was refused.
    pub reason: RejectReason,
    /// The request, untouched.
    pub entry: Entry<T, D>,
}

/// Why [`RecvWindow::consume_head`] refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ConsumeError {
    /// No receive is outstanding.
    #[error("no receive to consume: the window is empty")]
    Empty,
    /// The oldest receive has not been reported done by `test` yet.
    #[error("the oldest receive is not done yet; consuming it would hand its buffer back early")]
    NotDone,
}

/// A request and, once tested done, its size.
#[derive(Debug)]
struct Slot<T, D> {
    entry: Entry<T, D>,
    done: Option<usize>,
}

/// The FIFO both windows are built on.
///
/// Invariant: the first `done` slots (and only those) have `Slot::done` set; for send windows
/// `done` is always 0 because a completed send leaves at once.
#[derive(Debug)]
struct Slots<T, D> {
    slots: VecDeque<Slot<T, D>>,
    done: usize,
    capacity: usize,
    failed: bool,
}

/// What [`RecvWindow::test_head_copied`] found: [`RecvWindow::test_head`] for a caller that
/// needs only a copy of the done head's data and, on failure, only the error (the engine's
/// lanes, once per request: nothing here is built that the caller would drop at once).
#[derive(Debug, PartialEq, Eq)]
pub enum HeadTest<D, E> {
    /// Nothing to test (no request, or every one already done), or the window failed.
    Nothing,
    /// The head is still in progress.
    Pending,
    /// The head completed with `size` bytes; it keeps its slot until consumed.
    Done {
        /// Bytes the request completed with.
        size: usize,
        /// A copy of the request's data.
        data: D,
    },
    /// The head failed: the window is now failed, and the head and every request behind it
    /// were dropped (receives already done stay, as with [`RecvWindow::test_head`]).
    Failed(E),
}

/// What testing the head did, before the window type shapes it into a [`Release`].
enum Step<T, D, E> {
    Done { index: usize, size: usize },
    Pending,
    Failed(Failure<T, D, E>),
}

impl<T, D> Slots<T, D> {
    fn new(capacity: usize) -> Result<Self, ZeroCapacity> {
        if capacity == 0 {
            return Err(ZeroCapacity);
        }
        Ok(Self {
            // Reserve once so posting never allocates.
            slots: VecDeque::with_capacity(capacity),
            done: 0,
            capacity,
            failed: false,
        })
    }

    fn with_default_capacity() -> Self {
        Self {
            slots: VecDeque::with_capacity(DEFAULT_CAPACITY),
            done: 0,
            capacity: DEFAULT_CAPACITY,
            failed: false,
        }
    }

    fn try_post(&mut self, token: T, data: D) -> Result<(), Rejected<T, D>> {
        let reason = if self.failed {
            RejectReason::Failed
        } else if self.slots.len() >= self.capacity {
            RejectReason::Full
        } else {
            self.slots.push_back(Slot {
                entry: Entry { token, data },
                done: None,
            });
            return Ok(());
        };
        Err(Rejected {
            reason,
            entry: Entry { token, data },
        })
    }

    fn next_to_test(&self) -> Option<&Entry<T, D>> {
        if self.failed {
            return None;
        }
        self.slots.get(self.done).map(|s| &s.entry)
    }

    fn test_head<E>(
        &mut self,
        test: impl FnOnce(&mut T) -> TestOutcome<E>,
    ) -> Option<Step<T, D, E>> {
        if self.failed {
            return None;
        }
        let index = self.done;
        let slot = self.slots.get_mut(index)?;
        Some(match test(&mut slot.entry.token) {
            TestOutcome::Pending => Step::Pending,
            TestOutcome::Done { size } => {
                slot.done = Some(size);
                self.done += 1;
                Step::Done { index, size }
            }
            TestOutcome::Failed(error) => {
                self.failed = true;
                let mut rest = self.slots.drain(index..).map(|s| s.entry);
                // `index` was a valid position, so the drain yields at least one entry.
                match rest.next() {
                    Some(failed) => Step::Failed(Failure {
                        error,
                        failed,
                        abandoned: rest.collect(),
                    }),
                    None => Step::Pending,
                }
            }
        })
    }

    // Always inline: the engine's lanes call it once per request.
    #[inline(always)]
    fn test_head_copied<E>(&mut self, test: impl FnOnce(&mut T) -> TestOutcome<E>) -> HeadTest<D, E>
    where
        D: Copy,
    {
        if self.failed {
            return HeadTest::Nothing;
        }
        let index = self.done;
        let Some(slot) = self.slots.get_mut(index) else {
            return HeadTest::Nothing;
        };
        match test(&mut slot.entry.token) {
            TestOutcome::Pending => HeadTest::Pending,
            TestOutcome::Done { size } => {
                slot.done = Some(size);
                let data = slot.entry.data;
                self.done += 1;
                HeadTest::Done { size, data }
            }
            TestOutcome::Failed(error) => {
                // Requests complete in posting order: nothing behind the head will complete.
                self.failed = true;
                self.slots.truncate(index);
                HeadTest::Failed(error)
            }
        }
    }

    #[inline(always)]
    fn drop_done_head(&mut self) -> bool {
        if self.slots.front().is_none_or(|s| s.done.is_none()) {
            return false;
        }
        drop(self.slots.pop_front());
        self.done -= 1;
        true
    }

    #[inline(always)]
    fn pop_done_head_into<X>(&mut self, f: impl FnOnce(T, D) -> X) -> Option<X> {
        if self.slots.front().is_none_or(|s| s.done.is_none()) {
            return None;
        }
        let slot = self.slots.pop_front()?;
        self.done -= 1;
        Some(f(slot.entry.token, slot.entry.data))
    }

    fn pop_done_head(&mut self) -> Result<Completion<T, D>, ConsumeError> {
        match self.slots.front() {
            None => return Err(ConsumeError::Empty),
            Some(slot) if slot.done.is_none() => return Err(ConsumeError::NotDone),
            Some(_) => {}
        }
        let slot = self.slots.pop_front().ok_or(ConsumeError::Empty)?;
        self.done -= 1;
        Ok(Completion {
            token: slot.entry.token,
            data: slot.entry.data,
            size: slot.done.unwrap_or_default(),
        })
    }

    fn abandon(&mut self) -> Vec<Entry<T, D>> {
        self.failed = true;
        self.done = 0;
        self.slots.drain(..).map(|s| s.entry).collect()
    }
}

/// Generates the accessors both window types share.
macro_rules! common_accessors {
    () => {
        /// Slots in this window (requests that may be outstanding at once).
        pub fn capacity(&self) -> usize {
            self.inner.capacity
        }

        /// Requests holding a slot (posted and, for receives, done but not yet consumed).
        pub fn len(&self) -> usize {
            self.inner.slots.len()
        }

        /// No request holds a slot.
        pub fn is_empty(&self) -> bool {
            self.inner.slots.is_empty()
        }

        /// Every slot is taken: a post now would be refused.
        pub fn is_full(&self) -> bool {
            self.inner.slots.len() >= self.inner.capacity
        }

        /// A test failed earlier (or [`Self::abandon`] was called): the window accepts no
        /// posts and offers nothing to test.
        pub fn is_failed(&self) -> bool {
            self.inner.failed
        }

        /// The only request that may be tested now: the oldest one not yet reported done.
        /// `None` when there is none or the window failed.
        pub fn next_to_test(&self) -> Option<&Entry<T, D>> {
            self.inner.next_to_test()
        }

        /// Posts a request into a free slot, or hands it back with the reason it was refused.
        pub fn try_post(&mut self, token: T, data: D) -> Result<(), Rejected<T, D>> {
            self.inner.try_post(token, data)
        }

        /// Empties the window for shutdown or after the comm broke elsewhere: returns every
        /// request still holding a slot, oldest first, and marks the window failed.
        pub fn abandon(&mut self) -> Vec<Entry<T, D>> {
            self.inner.abandon()
        }
    };
}

/// The outstanding sends of one send comm.
///
/// A send leaves the window as soon as `test` reports it done.
#[derive(Debug)]
pub struct SendWindow<T, D> {
    inner: Slots<T, D>,
}

impl<T, D> Default for SendWindow<T, D> {
    /// A window with the TCPX limit of [`DEFAULT_CAPACITY`] slots.
    fn default() -> Self {
        Self {
            inner: Slots::with_default_capacity(),
        }
    }
}

impl<T, D> SendWindow<T, D> {
    /// A window of `capacity` slots. Use less than [`DEFAULT_CAPACITY`] to keep headroom on
    /// the send side.
    pub fn new(capacity: usize) -> Result<Self, ZeroCapacity> {
        Ok(Self {
            inner: Slots::new(capacity)?,
        })
    }

    common_accessors!();

    /// Tests the head: calls `test` with the oldest outstanding request's token (and no other)
    /// and applies the outcome. Returns `None`, without calling `test`, when there is nothing
    /// to test or the window failed.
    pub fn test_head<E>(
        &mut self,
        test: impl FnOnce(&mut T) -> TestOutcome<E>,
    ) -> Option<Release<Completion<T, D>, T, D, E>> {
        Some(match self.inner.test_head(test)? {
            Step::Pending => Release::NotReady,
            Step::Failed(failure) => Release::Error(failure),
            // A send is finished once done: it leaves the window at once.
            Step::Done { .. } => match self.inner.pop_done_head() {
                Ok(completion) => Release::Released(completion),
                // Unreachable by the invariant (done sends sit at the front), kept total.
                Err(_) => Release::NotReady,
            },
        })
    }
}

/// The outstanding receives of one recv comm: posted → done → consumed.
///
/// A receive reported done keeps its slot until [`RecvWindow::consume_head`] (which the caller
/// pairs with the plugin's `irecvConsumed`), in FIFO order.
#[derive(Debug)]
pub struct RecvWindow<T, D> {
    inner: Slots<T, D>,
}

impl<T, D> Default for RecvWindow<T, D> {
    /// A window with the TCPX limit of [`DEFAULT_CAPACITY`] slots.
    fn default() -> Self {
        Self {
            inner: Slots::with_default_capacity(),
        }
    }
}

impl<T, D> RecvWindow<T, D> {
    /// A window of `capacity` slots.
    pub fn new(capacity: usize) -> Result<Self, ZeroCapacity> {
        Ok(Self {
            inner: Slots::new(capacity)?,
        })
    }

    common_accessors!();

    /// Tests the head: calls `test` with the oldest receive not yet done (and no other) and
    /// applies the outcome. A done receive stays in its slot until consumed. Returns `None`,
    /// without calling `test`, when there is nothing to test or the window failed.
    ///
    /// On failure, receives already done stay in the window: their data arrived and may
    /// still be unpacked and consumed.
    pub fn test_head<E>(
        &mut self,
        test: impl FnOnce(&mut T) -> TestOutcome<E>,
    ) -> Option<Release<Received<'_, D>, T, D, E>> {
        Some(match self.inner.test_head(test)? {
            Step::Pending => Release::NotReady,
            Step::Failed(failure) => Release::Error(failure),
            Step::Done { index, size } => match self.inner.slots.get(index) {
                Some(slot) => Release::Released(Received {
                    data: &slot.entry.data,
                    size,
                }),
                // Unreachable: the slot was just marked done and nothing removed it.
                None => Release::NotReady,
            },
        })
    }

    /// Receives reported done and not yet consumed (they still hold their slots).
    pub fn awaiting_consume(&self) -> usize {
        self.inner.done
    }

    /// The receive that [`Self::consume_head`] would remove, if it is done.
    pub fn consumable(&self) -> Option<Received<'_, D>> {
        let slot = self.inner.slots.front()?;
        slot.done.map(|size| Received {
            data: &slot.entry.data,
            size,
        })
    }

    /// Frees the oldest receive's slot. Legal only once `test` reported it done; the caller
    /// then calls the plugin's `irecvConsumed` with the returned token.
    pub fn consume_head(&mut self) -> Result<Completion<T, D>, ConsumeError> {
        self.inner.pop_done_head()
    }

    /// As [`Self::test_head`], handing back only what the engine's lanes use: a copy of the
    /// done head's data, or the error (the requests the failure took down are dropped
    /// here, not handed back).
    #[inline(always)]
    pub fn test_head_copied<E>(
        &mut self,
        test: impl FnOnce(&mut T) -> TestOutcome<E>,
    ) -> HeadTest<D, E>
    where
        D: Copy,
    {
        self.inner.test_head_copied(test)
    }

    /// As [`Self::consume_head`], handing the token and the data straight to `f` (no
    /// [`Completion`] built in between); `None`, without calling `f`, when the oldest
    /// receive is not done or there is none.
    #[inline(always)]
    pub fn consume_head_into<X>(&mut self, f: impl FnOnce(T, D) -> X) -> Option<X> {
        self.inner.pop_done_head_into(f)
    }

    /// As [`Self::consume_head`] for a request with nothing to hand back (a done send):
    /// frees the head's slot and drops its token. `false`, touching nothing, when the head is
    /// not done or there is none.
    #[inline(always)]
    pub fn drop_done_head(&mut self) -> bool {
        self.inner.drop_done_head()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn done(size: usize) -> impl FnOnce(&mut u32) -> TestOutcome<&'static str> {
        move |_| TestOutcome::Done { size }
    }

    #[test]
    fn zero_capacity_is_refused() {
        assert_eq!(SendWindow::<u32, ()>::new(0).unwrap_err(), ZeroCapacity);
        assert_eq!(RecvWindow::<u32, ()>::new(0).unwrap_err(), ZeroCapacity);
    }

    #[test]
    fn default_capacity_is_the_tcpx_limit() {
        assert_eq!(SendWindow::<u32, ()>::default().capacity(), 16);
        assert_eq!(RecvWindow::<u32, ()>::default().capacity(), 16);
    }

    #[test]
    fn full_window_hands_the_request_back() {
        let mut win = SendWindow::new(1).unwrap();
        win.try_post(1u32, "a").unwrap();
        let rejected = win.try_post(2, "b").unwrap_err();
        assert_eq!(rejected.reason, RejectReason::Full);
        assert_eq!(
            rejected.entry,
            Entry {
                token: 2,
                data: "b"
            }
        );
    }

    #[test]
    fn send_is_released_when_done_and_frees_its_slot() {
        let mut win = SendWindow::new(1).unwrap();
        win.try_post(1u32, "a").unwrap();
        let release = win.test_head(done(10));
        assert_eq!(
            release,
            Some(Release::Released(Completion {
                token: 1,
                data: "a",
                size: 10
            }))
        );
        assert!(win.is_empty());
        win.try_post(2, "b").unwrap();
    }

    #[test]
    fn test_is_only_offered_the_head() {
        let mut win = SendWindow::new(4).unwrap();
        for t in 1u32..=3 {
            win.try_post(t, ()).unwrap();
        }
        let mut seen = Vec::new();
        for _ in 0..3 {
            let release = win.test_head(|t: &mut u32| {
                seen.push(*t);
                TestOutcome::<()>::Done { size: 0 }
            });
            assert!(matches!(release, Some(Release::Released(_))));
        }
        assert_eq!(seen, [1, 2, 3]);
    }

    #[test]
    fn empty_window_does_not_call_test() {
        let mut win = RecvWindow::<u32, ()>::new(2).unwrap();
        let release = win.test_head(|_| -> TestOutcome<()> { panic!("nothing to test") });
        assert!(release.is_none());
    }

    #[test]
    fn recv_is_consumed_only_after_done() {
        let mut win = RecvWindow::new(2).unwrap();
        win.try_post(1u32, "a").unwrap();
        assert_eq!(win.consume_head().unwrap_err(), ConsumeError::NotDone);
        let release = win.test_head(|_| TestOutcome::<()>::Pending);
        assert_eq!(release, Some(Release::NotReady));
        assert_eq!(win.consume_head().unwrap_err(), ConsumeError::NotDone);
        assert!(matches!(win.test_head(done(5)), Some(Release::Released(r)) if *r.data == "a"));
        let c = win.consume_head().unwrap();
        assert_eq!((c.token, c.data, c.size), (1, "a", 5));
        assert_eq!(win.consume_head().unwrap_err(), ConsumeError::Empty);
    }

    #[test]
    fn done_recv_holds_its_slot_until_consumed() {
        let mut win = RecvWindow::new(1).unwrap();
        win.try_post(1u32, ()).unwrap();
        assert!(matches!(win.test_head(done(1)), Some(Release::Released(_))));
        assert_eq!(win.awaiting_consume(), 1);
        assert_eq!(win.try_post(2, ()).unwrap_err().reason, RejectReason::Full);
        // Nothing left to test, but the window is not stuck: a consume is available.
        assert!(win.next_to_test().is_none());
        assert!(win.consumable().is_some());
        win.consume_head().unwrap();
        win.try_post(2, ()).unwrap();
    }

    #[test]
    fn next_recv_is_tested_while_older_awaits_consume() {
        let mut win = RecvWindow::new(3).unwrap();
        for t in 1u32..=3 {
            win.try_post(t, ()).unwrap();
        }
        assert!(matches!(win.test_head(done(1)), Some(Release::Released(_))));
        assert_eq!(win.next_to_test().map(|e| e.token), Some(2));
    }

    #[test]
    fn failed_test_abandons_everything_behind_the_head() {
        let mut win = RecvWindow::new(4).unwrap();
        for t in 1u32..=4 {
            win.try_post(t, t * 10).unwrap();
        }
        assert!(matches!(win.test_head(done(1)), Some(Release::Released(_))));
        let release = win.test_head(|_| TestOutcome::Failed("peer closed"));
        let Some(Release::Error(failure)) = release else {
            panic!("expected an error, got {release:?}");
        };
        assert_eq!(failure.error, "peer closed");
        assert_eq!(failure.failed.token, 2);
        let abandoned: Vec<_> = failure.abandoned.iter().map(|e| e.token).collect();
        assert_eq!(abandoned, [3, 4]);
        assert!(win.is_failed());
        assert!(win.next_to_test().is_none());
        assert_eq!(
            win.try_post(5, 50).unwrap_err().reason,
            RejectReason::Failed
        );
        // The receive that completed before the failure can still be consumed.
        assert_eq!(win.consume_head().unwrap().token, 1);
        assert!(win.is_empty());
    }

    #[test]
    fn copied_test_keeps_done_receives_and_drops_the_rest_on_failure() {
        let mut win = RecvWindow::new(4).unwrap();
        for t in 1u32..=4 {
            win.try_post(t, t * 10).unwrap();
        }
        assert_eq!(
            win.test_head_copied(done(3)),
            HeadTest::Done { size: 3, data: 10 }
        );
        let mut seen = None;
        let pending = win.test_head_copied(|t: &mut u32| {
            seen = Some(*t);
            TestOutcome::<&str>::Pending
        });
        assert_eq!((pending, seen), (HeadTest::Pending, Some(2)));
        assert_eq!(
            win.test_head_copied(|_| TestOutcome::Failed("peer closed")),
            HeadTest::Failed("peer closed")
        );
        assert!(win.is_failed() && win.next_to_test().is_none());
        assert_eq!(win.len(), 1, "only the done receive stays");
        assert_eq!(
            win.test_head_copied(|_| -> TestOutcome<()> { panic!("a failed window tests") }),
            HeadTest::Nothing
        );
        assert_eq!(win.consume_head().unwrap().token, 1);
    }

    #[test]
    fn consume_head_into_hands_over_only_a_done_head() {
        let mut win = RecvWindow::new(2).unwrap();
        assert_eq!(
            win.consume_head_into(|t: u32, d: &str| (t, d)),
            None,
            "empty"
        );
        win.try_post(1u32, "a").unwrap();
        win.try_post(2u32, "b").unwrap();
        assert_eq!(win.consume_head_into(|t, d| (t, d)), None, "not done yet");
        assert!(matches!(win.test_head(done(4)), Some(Release::Released(_))));
        assert_eq!(win.consume_head_into(|t, d| (t, d)), Some((1, "a")));
        assert_eq!((win.len(), win.awaiting_consume()), (1, 0));
        assert_eq!(
            win.consume_head_into(|t, d| (t, d)),
            None,
            "the next is not done"
        );
    }

    #[test]
    fn drop_done_head_frees_only_a_done_head() {
        let mut win = RecvWindow::new(2).unwrap();
        assert!(!win.drop_done_head(), "empty");
        win.try_post(1u32, ()).unwrap();
        win.try_post(2u32, ()).unwrap();
        assert!(!win.drop_done_head(), "not done yet");
        assert_eq!(
            win.test_head_copied(done(1)),
            HeadTest::Done { size: 1, data: () }
        );
        assert!(win.drop_done_head());
        assert_eq!((win.len(), win.awaiting_consume()), (1, 0));
        assert_eq!(win.next_to_test().map(|e| e.token), Some(2));
    }

    #[test]
    fn abandon_returns_every_slot_holder() {
        let mut win = RecvWindow::new(3).unwrap();
        for t in 1u32..=3 {
            win.try_post(t, ()).unwrap();
        }
        assert!(matches!(win.test_head(done(1)), Some(Release::Released(_))));
        let tokens: Vec<_> = win.abandon().into_iter().map(|e| e.token).collect();
        assert_eq!(tokens, [1, 2, 3]);
        assert!(win.is_empty() && win.is_failed());
        assert_eq!(win.awaiting_consume(), 0);
    }
}
