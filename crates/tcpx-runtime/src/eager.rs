//! Small two-sided messages in eager frames: what a connection shares with the engines that
//! carry them.
//!
//! A send or receive of 1 byte up to the connection's agreed eager size (see
//! [`tcpx_proto::eager`] and [`crate::Config::eager_bytes`]) takes no job and no plugin
//! request of its own. Message `seq` belongs to eager channel
//! [`channel_of`]`(seq, channels)` — runs of [`tcpx_proto::eager::EAGER_RUN`] consecutive
//! messages per channel — on both sides. A send queues its message in that channel's share
//! of the connection's [`Eager`] state, in sequence order; the channel's engine takes the
//! queue, copies each message into its open frame and finishes the send there (its memory may
//! be reused, as after a socket `send`), and sends the frame as one request. A receive
//! names its sequence number in the same channel's inbox; the engine whose frame brings that
//! message copies it into the receive's memory and finishes it. A message that arrives before
//! its receive stays in its frame until the receive comes ([`Early`]).
//!
//! A channel's sends finish in the order they were made, and so do its receives: each
//! transfer is finished by a count per channel and direction that its engine publishes
//! (see [`crate::transfer::in_order`]), not by a completion of its own.
//!
//! The state is split by channel because one shared outbox and inbox, which every engine of
//! the connection polled and locked, ran 4 KiB messages at 1.3 GB/s on 16 cores: the
//! engines and the application queued behind each other on two locks. Split, each lock is
//! met by one engine and the application only. Within a channel, what the application writes
//! per message and what the engine writes per message sit on different cache lines: at 4 KiB
//! a line moving between their cores per message was half of each application thread's time.
//!
//! Why frames and not one request per message: each request costs a job, a hand-off to an
//! engine and a completion (about 2 µs of the sending thread's time), and TCPX admits 16
//! requests per comm; 4 KiB messages one by one ran at 0.05–0.14 × raw TCP (issue 25). A
//! frame is formed from whatever queued while the comm's previous frames were in flight, so a
//! lone message still leaves at once (one message, one frame) and a stream of them shares
//! requests as soon as the comm is busy — Nagle's batching without its timer.
//!
//! Messages of host memory from [`crate::Config::eager_detach`] on are not copied at all: the
//! frame carries their entries and their bytes follow it on the comm, sent from the
//! application's memory, and the receiving engine takes them straight into their receives'
//! memory when it can (see `engine::eager`). Copying was most of what separated 64 KiB
//! messages from raw TCP: each byte copied twice per side where the kernel copies it once.
//!
//! Both sides know which messages go eager from the length alone (a send and the receive it
//! matches have the same length), so the connection's other comms keep their posting order:
//! eager frames ride comms of their own.

use std::collections::VecDeque;
use std::mem::ManuallyDrop;
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;
use tcpx_proto::eager::{channel_of, EagerMessage};

use crate::error::{Direction, Error};
use crate::link::{Link, Pending};
use crate::registry::Region;
use crate::spin_lock::{SpinGuard, SpinLock};
use crate::transfer::in_order::{InOrder, Lanes, Ticket};
use crate::transfer::Transfer;
use rustc_hash::FxHashMap;

/// A message that arrived before its receive: where it sits in the channel's receive frames.
///
/// It stays there, and the frame stays off the wire, until its receive comes and the engine
/// copies it out. An earlier design copied such messages into vectors of their own (an
/// allocation and a copy under the inbox lock the posting thread waits for): at 4 KiB on 8
/// channels a fifth of the messages arrived before their receives. Holding the frame instead
/// bounds what a peer can put ahead of the receives by the frames themselves, and that is
/// flow control: the peer's next frames wait in TCP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Early {
    /// Index of the receive frame in the channel's engine.
    pub(crate) frame: usize,
    /// Where the message's bytes start in that frame, and their length.
    pub(crate) offset: usize,
    pub(crate) len: u32,
}

/// A small transfer's handle on its region that holds no reference count of its own.
///
/// A region's count is an atomic the application's thread wrote twice per small transfer
/// (a clone when queued, a release when done): two locked instructions per message, and each
/// one waits for every store before it, such as the queue entry the engine reads. So a
/// channel counts a region once while any of its transfers is queued or in flight
/// ([`HeldRegions`]), and each transfer carries this alias, valid for as long as that count
/// is held: until the lane's finished count passes the region's newest transfer (the engine
/// is done with them all), or the connection's eager state is dropped. With the spin locks
/// of [`crate::spin_lock`], 4 KiB messages on 8 channels moved 18 % faster (docs/RESULTS.md,
/// thirty-ninth session).
///
/// Never cloned and never dropped as a [`Region`] (that would release a count it does not
/// hold); what must outlive its transfer (a plugin request reading or writing the memory)
/// takes a counted clone with `Region::clone(&kept)`.
pub(crate) struct Kept(ManuallyDrop<Region>);

impl Kept {
    /// An alias of `region` that holds no count.
    ///
    /// # Safety
    /// A counted handle on the same region must stay alive for as long as the alias is
    /// used; [`HeldRegions::alias`] is the only caller.
    unsafe fn new(region: &Region) -> Self {
        let inner = Arc::as_ptr(&region.inner);
        // SAFETY: `inner` comes from a live `Arc` (the caller's `region`), so it is a pointer
        // `Arc::into_raw` could have returned; the result is never dropped (`ManuallyDrop`),
        // so it never releases the count it did not take, and the caller keeps a counted
        // handle alive for as long as the alias is used.
        let inner = unsafe { Arc::from_raw(inner) };
        Self(ManuallyDrop::new(Region { inner }))
    }
}

impl Deref for Kept {
    type Target = Region;

    fn deref(&self) -> &Region {
        &self.0
    }
}

/// Regions held past this many per channel and direction are looked over for release when
/// another one comes (each transfer in flight may name its own region, as `tcpx-bench`'s
/// message slots do); past twice as many as stay after a look, the next look waits, so
/// that many regions in flight cost a look per that many new ones, not one each.
const HELD_REGIONS_LOOKED_OVER: usize = 1024;

/// The regions one channel's transfers of one direction name, counted once per region
/// while any of its transfers is queued or in flight (see [`Kept`]), each with the lane
/// ordinal of its newest transfer. Keyed by address: a held region is alive, so no other
/// region has its address.
#[derive(Default)]
struct HeldRegions {
    held: FxHashMap<usize, (u64, Region)>,
    /// Held regions at which the next new one looks the others over (0: the floor,
    /// [`HELD_REGIONS_LOOKED_OVER`]).
    look_over_at: usize,
}

impl HeldRegions {
    /// Counts `region` for transfer `ordinal` of `lane` (the newest), unless it is held
    /// already; when the set is large, first moves the regions whose transfers all finished
    /// to `released` (dropped by the caller outside its lock: a region's last release may
    /// deregister it). Returns the transfer's alias.
    fn alias(
        &mut self,
        region: &Region,
        ordinal: u64,
        lane: &InOrder,
        released: &mut Vec<Region>,
    ) -> Kept {
        let key = Arc::as_ptr(&region.inner) as usize;
        if let Some((last, _)) = self.held.get_mut(&key) {
            *last = ordinal;
        } else {
            if self.held.len() >= self.look_over_at.max(HELD_REGIONS_LOOKED_OVER) {
                self.release_finished(lane.finished(), released);
                self.look_over_at = 2 * self.held.len();
            }
            self.held.insert(key, (ordinal, region.clone()));
        }
        // SAFETY: `held` now counts `region` until the lane's finished count passes
        // `ordinal` — the engine is then done with this transfer — or until the eager state
        // is dropped, after every engine let go of it.
        unsafe { Kept::new(region) }
    }

    /// Moves the regions whose transfers all finished (the lane's count `finished` passed
    /// their newest ordinal) to `released`.
    fn release_finished(&mut self, finished: u64, released: &mut Vec<Region>) {
        // Collecting nothing allocates nothing: an engine going to sleep with every region
        // still in flight pays one scan.
        let done: Vec<usize> = self
            .held
            .iter()
            .filter(|(_, (last, _))| *last < finished)
            .map(|(key, _)| *key)
            .collect();
        for key in done {
            if let Some((_, region)) = self.held.remove(&key) {
                released.push(region);
            }
        }
    }
}

/// Asks for the cache line at `at` in a state this core may write (`PREFETCHW`) ahead of a
/// store to a line another core reads. Its ownership then travels while the thread does other
/// work, instead of at the next locked instruction, which waits for every store before it:
/// the receiving thread's stalls at 4 KiB (`scripts/perf/small_profile.sh`). Only where
/// [`prefetch_for_write_available`]; any address is allowed (a hint never faults).
///
/// Measured with each peer on 16 cores of its own (docs/RESULTS.md, thirty-first session):
/// 4 KiB messages one call each 2–12 % faster in three ABBA calls (16.9 against 15.1 GB/s
/// in the clearest, 17.8 against 17.5 in the least clear); 16 and 64 KiB level.
#[inline(always)]
fn prefetch_for_write<T>(at: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `prefetchw` reads and writes no memory, register or flag the program can
    // observe and never faults, whatever the address; the caller checked that the CPU has it.
    unsafe {
        std::arch::asm!(
            "prefetchw [{0}]",
            in(reg) at,
            options(nostack, preserves_flags, readonly)
        );
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = at;
}

/// Whether the CPU has `PREFETCHW` (CPUID 0x8000_0001, ECX bit 8: every x86-64 AMD, Intel
/// since Broadwell), which older CPUs may not decode. Asked once per process: in a VM,
/// `CPUID` traps to the hypervisor.
fn prefetch_for_write_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *AVAILABLE.get_or_init(|| {
            use std::arch::x86_64::__cpuid;
            // SAFETY: `CPUID` exists on every x86-64 CPU and only reads identification
            // registers (the function is safe on newer toolchains; the block keeps the
            // workspace's oldest supported one building).
            #[allow(unused_unsafe)]
            let (highest, ecx) = unsafe {
                let highest = __cpuid(0x8000_0000).eax;
                let ecx = if highest >= 0x8000_0001 {
                    __cpuid(0x8000_0001).ecx
                } else {
                    0
                };
                (highest, ecx)
            };
            highest >= 0x8000_0001 && ecx & (1 << 8) != 0
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// What [`Eager::deliver`] did with a frame's messages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Delivered {
    /// Waiting receives it took (see [`Eager::posted_total`]).
    pub(crate) taken: u64,
    /// Messages left in the frame for receives to come: the frame is held until they are
    /// copied out.
    pub(crate) kept: usize,
    /// Receives of the list handed back that precede the first bad entry (all of them
    /// unless the frame broke the protocol).
    pub(crate) good: usize,
}

/// A small send, queued until its channel's engine copies it into a frame.
///
/// 32 bytes, two to a cache line, and so is a queued [`Posted`] with its number. The engine
/// reads every entry the application wrote, so each line of a queue moves to the engine's
/// core and back once per lap, and the application's next locked instruction waits for its
/// write of that line: the profile's largest single stall at 4 KiB. Entries of 48 bytes (a
/// deadline in each) cost most of a line per message; deadlines are now kept once per queue
/// ([`Oldest`]). Measured level at 4 KiB within the hosts' noise (docs/RESULTS.md,
/// twenty-second session): the other lines a message publishes remain.
pub(crate) struct Outgoing {
    /// The send's sequence number (the receive it matches).
    pub(crate) seq: u64,
    /// Where its bytes are (counted by the channel's [`HeldRegions`]).
    pub(crate) region: Kept,
    pub(crate) offset: usize,
    pub(crate) len: u32,
}

// Kept at two to a cache line (see `Outgoing`); a field added here costs every small message.
const _: () = assert!(std::mem::size_of::<Outgoing>() == 32);
const _: () = assert!(std::mem::size_of::<(u64, Posted)>() == 32);

/// The deadline of a channel's oldest queued send or posted receive: set when a deadline
/// check first sees that entry oldest (see [`Eager::overdue`]), not when it was queued: a
/// clock read per message was a tenth of the posting thread's time at 4 KiB, and an entry is
/// never older than when it was queued. One per queue, not one per entry: only the oldest
/// entry's deadline is ever looked at, and entries are kept small (see [`Outgoing`]).
#[derive(Clone, Copy, Debug, Default)]
struct Oldest {
    /// The entry's sequence number and its deadline.
    due: Option<(u64, Instant)>,
}

impl Oldest {
    /// Whether entry `seq`, now the oldest, is past its deadline (starting it if `seq` was
    /// not the oldest at the last check).
    fn passed(&mut self, seq: u64, now: Instant, timeout: Duration) -> bool {
        let deadline = match self.due {
            Some((due_seq, deadline)) if due_seq == seq => deadline,
            _ => {
                let deadline = now + timeout;
                self.due = Some((seq, deadline));
                deadline
            }
        };
        now >= deadline
    }
}

/// One channel's queued sends.
#[derive(Default)]
struct Outbox {
    /// Sends not yet taken by the engine, oldest first.
    queue: VecDeque<Outgoing>,
    /// Sends accepted and not yet on the wire: queued, taken, or in frames in flight (the
    /// engine counts them off when their frames are sent; see [`Eager::in_flight`]).
    unsent: usize,
    /// Sends ever queued on this channel: the next one's place in its lane.
    accepted: u64,
    /// The regions of the sends queued or in flight, one count each.
    regions: HeldRegions,
    /// The deadline of the oldest queued send.
    oldest: Oldest,
}

/// A posted small receive (24 bytes: see [`Outgoing`] for why it stays small).
pub(crate) struct Posted {
    region: Kept,
    offset: usize,
    len: u32,
}

impl Posted {
    /// Where the receive's bytes go: its region, the offset in it and the length.
    pub(crate) fn target(&self) -> (&Region, usize, u32) {
        (&self.region, self.offset, self.len)
    }
}

/// One channel's receives and arrivals. A channel's messages arrive in sequence order (its
/// frames leave in that order on one comm) and its receives are posted in that order, so
/// both are queues, and at most one of them holds anything: a message either finds the
/// oldest waiting receive or waits itself for the next receive.
#[derive(Default)]
struct Inbox {
    /// Receives waiting for their message, oldest first.
    posted: VecDeque<(u64, Posted)>,
    /// Messages that arrived before their receive, oldest first (they stay in their frames).
    early: VecDeque<(u64, Early)>,
    /// Early messages whose receive has come: the channel's engine copies them in (so that
    /// the application's thread, which posts every receive, does not copy every byte) and
    /// releases their frames.
    matched: Vec<(u64, Posted, Early)>,
    /// Receives ever posted on this channel: the next one's place in its lane.
    accepted: u64,
    /// Receives ever queued in `posted`: what [`Share::posted_total`] publishes, counted
    /// here so that publishing it is a plain store, not a locked read-modify-write of a line
    /// the engine reads (see [`Eager::recv`]).
    queued_ever: u64,
    /// The regions of the receives posted and not landed, one count each.
    regions: HeldRegions,
    /// The deadline of the oldest waiting receive.
    oldest: Oldest,
}

/// One eager channel's share of the connection's eager state.
///
/// Every field the application writes per message sits on cache lines the engine does not
/// write per message, and the engine reads them only when its own view runs out (see
/// `posted_total`): at 4 KiB a cache line moving between the two cores per message was
/// most of both threads' time.
struct Share {
    outbox: CachePadded<SpinLock<Outbox>>,
    /// Whether `Outbox::queue` holds anything: set by the application when it queues into
    /// an empty queue, cleared by the engine when it takes the queue, both under the lock;
    /// the engine's passes read it without the lock.
    queued: CachePadded<AtomicBool>,
    inbox: CachePadded<SpinLock<Inbox>>,
    /// Receives ever queued in `Inbox::posted` (the engine counts those it took).
    posted_total: CachePadded<AtomicU64>,
    /// Entries in `matched`.
    matched: CachePadded<AtomicUsize>,
    /// How far the channel's sends (copied into frames) and receives (landed) finished.
    sends: InOrder,
    recvs: InOrder,
}

impl Share {
    fn new() -> Self {
        Self {
            outbox: CachePadded::new(SpinLock::new(Outbox::default())),
            queued: CachePadded::new(AtomicBool::new(false)),
            inbox: CachePadded::new(SpinLock::new(Inbox::default())),
            posted_total: CachePadded::new(AtomicU64::new(0)),
            matched: CachePadded::new(AtomicUsize::new(0)),
            sends: InOrder::default(),
            recvs: InOrder::default(),
        }
    }

    fn outbox(&self) -> SpinGuard<'_, Outbox> {
        self.outbox.lock()
    }

    fn inbox(&self) -> SpinGuard<'_, Inbox> {
        self.inbox.lock()
    }
}

/// The eager half of one connection: per eager channel, the outbox of small sends and the
/// inbox of small receives.
///
/// Aligned to 128 bytes so that the reference count in front of it, which every small
/// transfer's handle increments and decrements on the application's thread, does not share
/// a cache line with the fields the engines read on every pass: sharing one halved the rate
/// of 4 KiB messages on 8 channels.
#[repr(align(128))]
pub(crate) struct Eager {
    /// Largest message of the eager path on this connection (agreed in `Hello`).
    pub(crate) max_message: u32,
    /// Smallest message of host memory this side sends detached (0: none; see
    /// [`crate::Config::eager_detach`]).
    pub(crate) detach_from: u32,
    /// Whether frames that announce detached messages are padded so that the peer's plugin
    /// does not read the detached bytes ahead into its own buffer: the built-in plugin's
    /// read-ahead (see `engine::eager`'s `ANNOUNCING_BYTES`). Other plugins (TCPX) would
    /// only carry the padding on the wire.
    pub(crate) pad_announcing: bool,
    /// The connection's two-sided link: its failure, timeout and engines.
    pub(crate) link: Arc<Link>,
    spin: Duration,
    /// Whether this CPU has `PREFETCHW` (see [`prefetch_for_write`]).
    prefetch_writes: bool,
    shares: Vec<Share>,
}

impl std::fmt::Debug for Eager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Eager")
            .field("max_message", &self.max_message)
            .field("channels", &self.shares.len())
            .finish()
    }
}

impl Eager {
    /// The eager state of a connection with `channels` eager channels.
    pub(crate) fn new(
        max_message: u32,
        detach_from: u32,
        pad_announcing: bool,
        link: Arc<Link>,
        spin: Duration,
        channels: u16,
    ) -> Self {
        Self {
            max_message,
            detach_from,
            pad_announcing,
            link,
            spin,
            prefetch_writes: prefetch_for_write_available(),
            shares: (0..channels.max(1)).map(|_| Share::new()).collect(),
        }
    }

    /// Whether a contiguous message of `len` bytes travels eager on this connection.
    pub(crate) fn carries(&self, len: usize) -> bool {
        len >= 1 && len <= self.max_message as usize
    }

    /// The eager channel of message `seq`.
    fn channel_of(&self, seq: u64) -> u16 {
        // `shares` has between 1 and u16::MAX entries.
        channel_of(seq, self.shares.len() as u16)
    }

    /// Channel `channel`'s share. Every caller names a channel below the count (from
    /// [`channel_of`] or an engine's own index); an index past it reads channel 0 rather
    /// than panic on an engine thread. Not a modulo: that is a division per call, and an
    /// engine's empty pass makes several calls.
    fn share(&self, channel: u16) -> &Share {
        self.shares
            .get(usize::from(channel))
            .unwrap_or(&self.shares[0])
    }

    /// Whether sends of `channel` wait in its queue (read without the lock).
    pub(crate) fn queued(&self, channel: u16) -> bool {
        self.share(channel).queued.load(Ordering::Acquire)
    }

    /// Moves the sends queued on `channel` to the back of `into` (the engine's list), in
    /// sequence order.
    pub(crate) fn take_queued(&self, channel: u16, into: &mut VecDeque<Outgoing>) {
        let share = self.share(channel);
        let mut outbox = share.outbox();
        if into.is_empty() {
            // Swap rather than move: both lists keep their capacity, nothing is copied.
            std::mem::swap(&mut outbox.queue, into);
        } else {
            into.append(&mut outbox.queue);
        }
        share.queued.store(false, Ordering::Release);
    }

    /// Counts `messages` sends of `channel` as on the wire (their frames were sent).
    pub(crate) fn sent(&self, channel: u16, messages: usize) {
        let mut outbox = self.share(channel).outbox();
        outbox.unsent = outbox.unsent.saturating_sub(messages);
    }

    /// Releases the counts of `channel`'s regions whose transfers all finished: its engine is
    /// about to sleep, and a region its owner dropped must not wait for the channel's next
    /// transfer to be freed (see [`Kept`]).
    pub(crate) fn release_finished(&self, channel: u16) {
        let share = self.share(channel);
        let mut released = Vec::new();
        share
            .outbox()
            .regions
            .release_finished(share.sends.finished(), &mut released);
        share
            .inbox()
            .regions
            .release_finished(share.recvs.finished(), &mut released);
        // Outside the locks: a region's last release may deregister it.
        drop(released);
    }

    /// Small transfers accepted and not finished: sends not yet on the wire (including those
    /// that finished when copied), receives not yet landed. 0 once the link failed.
    fn in_flight(&self) -> usize {
        if self.link.is_failed() {
            return 0;
        }
        self.shares
            .iter()
            .map(|share| {
                let unsent = share.outbox().unsent;
                let inbox = share.inbox();
                unsent + inbox.posted.len() + inbox.matched.len()
            })
            .sum()
    }

    /// Receives ever queued on `channel` to wait for their message (see
    /// [`Eager::deliver`], which returns how many it took).
    pub(crate) fn posted_total(&self, channel: u16) -> u64 {
        self.share(channel).posted_total.load(Ordering::Acquire)
    }

    /// Takes the receive of detached message `seq` of `channel` if it has been posted (it is
    /// then the oldest waiting: every earlier message of the channel has arrived), so that
    /// the engine receives the message straight into its memory.
    pub(crate) fn take_posted(&self, channel: u16, seq: u64) -> Option<Posted> {
        let mut inbox = self.share(channel).inbox();
        match inbox.posted.front() {
            Some(&(due, _)) if due == seq => inbox.posted.pop_front().map(|(_, posted)| posted),
            _ => None,
        }
    }

    /// Gives back a receive [`Eager::take_posted`] took (the plugin had no room for it).
    pub(crate) fn untake_posted(&self, channel: u16, seq: u64, posted: Posted) {
        self.share(channel).inbox().posted.push_front((seq, posted));
    }

    /// A detached message that came with another length than its receive's: fails the
    /// connection (the receive cannot finish, nor the channel's later ones).
    pub(crate) fn fail_mismatch(&self, channel: u16, seq: u64, sent: usize, expected: u32) {
        self.link.fail(self.mismatch(channel, seq, sent, expected));
    }

    /// Whether early messages of `channel` wait for the engine to copy them in.
    pub(crate) fn has_matched(&self, channel: u16) -> bool {
        self.share(channel).matched.load(Ordering::Acquire) > 0
    }

    /// Moves the early messages of `channel` whose receives have come since the last call
    /// into `into` (the engine's reusable list, empty): the engine copies each in with
    /// [`Eager::land`] and releases its frame. Returns whether there were any.
    pub(crate) fn take_matched(&self, channel: u16, into: &mut Vec<(u64, Posted, Early)>) -> bool {
        let share = self.share(channel);
        if share.matched.load(Ordering::Acquire) == 0 {
            return false;
        }
        let mut inbox = share.inbox();
        std::mem::swap(&mut inbox.matched, into);
        share.matched.store(0, Ordering::Release);
        true
    }

    /// Queues send `seq` of `len` bytes at `offset` in `region` (the caller holds the send
    /// order, so each queue stays in sequence order and frames carry rising numbers). The
    /// channel's engine copies it into a frame and finishes it then: its memory may be reused
    /// once the transfer finishes, before the frame is on the wire, as after a socket `send`.
    pub(crate) fn send(
        self: &Arc<Self>,
        seq: u64,
        region: &Region,
        offset: usize,
        len: usize,
    ) -> Transfer {
        let channel = self.channel_of(seq);
        let share = self.share(channel);
        let mut released = Vec::new();
        let (ordinal, was_empty) = {
            let mut outbox = share.outbox();
            let outbox = &mut *outbox;
            let ordinal = outbox.accepted;
            let region = outbox
                .regions
                .alias(region, ordinal, &share.sends, &mut released);
            outbox.queue.push_back(Outgoing {
                seq,
                region,
                offset,
                // `carries` checked it: at most 64 KiB.
                len: len as u32,
            });
            outbox.unsent += 1;
            outbox.accepted += 1;
            let was_empty = outbox.queue.len() == 1;
            if was_empty {
                share.queued.store(true, Ordering::Release);
            }
            (ordinal, was_empty)
        };
        // Released outside the lock.
        drop(released);
        let transfer = self.transfer(channel, Direction::Send, ordinal, len);
        let link = &self.link;
        if was_empty {
            // The channel's engine may be asleep; a busy one reads the flag anyway.
            link.wake_one(u64::from(channel));
        }
        // A failure between the caller's check and the push: the engines may have swept.
        if link.is_failed() {
            self.fail_all();
        }
        transfer
    }

    /// Posts receive `seq` of `len` bytes into `region` at `offset` (the caller holds the
    /// receive order). A message that already arrived goes to the channel's engine, which
    /// copies it in.
    pub(crate) fn recv(
        self: &Arc<Self>,
        seq: u64,
        region: &Region,
        offset: usize,
        len: usize,
    ) -> Transfer {
        let link = &self.link;
        let channel = self.channel_of(seq);
        let share = self.share(channel);
        if self.prefetch_writes {
            // The engine reads the count whenever it runs out of receives it knows of, so
            // the line is usually in its cache: ask for it now, and it travels while this
            // thread takes the lock and fills in the entry.
            prefetch_for_write(&*share.posted_total);
        }
        let mut released = Vec::new();
        let mut inbox = share.inbox();
        let ordinal = inbox.accepted;
        inbox.accepted += 1;
        let posted = Posted {
            region: inbox
                .regions
                .alias(region, ordinal, &share.recvs, &mut released),
            offset,
            len: len as u32,
        };
        let transfer = self.transfer(channel, Direction::Recv, ordinal, len);
        // Whether this is the first piece of work of its kind: the engine may be asleep.
        let first = match inbox.early.front() {
            Some(&(head, _)) if head != seq => {
                // The next message of this channel is not the next receive of it: the peer
                // sent out of order or on the wrong channel. The receive fails with the link.
                drop(inbox);
                self.violation(
                    channel,
                    format!("message #{head} arrived where #{seq} was due"),
                );
                return transfer;
            }
            Some(&(_, early)) => {
                inbox.early.pop_front();
                inbox.matched.push((seq, posted, early));
                share.matched.store(inbox.matched.len(), Ordering::Release);
                inbox.matched.len() == 1
            }
            None => {
                inbox.posted.push_back((seq, posted));
                inbox.queued_ever += 1;
                // A plain store: only the thread holding the inbox lock writes the count. A
                // locked increment was the receiving thread's largest single stall at 4 KiB
                // (`scripts/perf/small_profile.sh`), waiting for the entry's line and its own
                // to come back from the engine's core; the unlock now waits for both at once.
                share
                    .posted_total
                    .store(inbox.queued_ever, Ordering::Release);
                if self.prefetch_writes {
                    // The next entries, two to a line, go where the engine read the entries
                    // of the previous lap: ask for that line before the next receive's store.
                    if let Some(last) = inbox.posted.back() {
                        let last: *const (u64, Posted) = last;
                        prefetch_for_write(last.cast::<u8>().wrapping_add(64));
                    }
                }
                inbox.posted.len() == 1
            }
        };
        drop(inbox);
        // Released outside the lock.
        drop(released);
        if first {
            link.wake_one(u64::from(channel));
        }
        // A failure between the check and the push: the engines may have swept already.
        if link.is_failed() {
            self.fail_all();
        }
        transfer
    }

    /// Takes the messages of a frame received on `channel` (frame `index` of its engine):
    /// the receives waiting for its first messages go to `landed`, in order, and the rest of
    /// the messages stay in the frame ([`Early`]) until their receives come. `matched` (the
    /// engine's list, empty) receives the early messages whose receives came since the
    /// engine last looked: they were posted before every receive in `landed`, so the engine
    /// copies them in first — a channel's receives finish in order.
    ///
    /// A message of another channel, or one out of its channel's sequence order, is a
    /// protocol violation: the link fails, and [`Delivered::good`] says how many receives of
    /// `landed` precede the first bad entry.
    pub(crate) fn deliver(
        &self,
        channel: u16,
        index: usize,
        messages: &[EagerMessage],
        landed: &mut Vec<(u64, Posted)>,
        matched: &mut Vec<(u64, Posted, Early)>,
    ) -> Delivered {
        let share = self.share(channel);
        landed.clear();
        let mut violation = None;
        let mut kept = 0;
        {
            // Short: the application's next receive waits for this lock. The receives the
            // frame's first messages match are taken in one go and checked after it.
            let mut inbox = share.inbox();
            if !inbox.matched.is_empty() {
                if matched.is_empty() {
                    std::mem::swap(&mut inbox.matched, matched);
                } else {
                    matched.append(&mut inbox.matched);
                }
                share.matched.store(0, Ordering::Release);
            }
            let k = messages.len().min(inbox.posted.len());
            landed.extend(inbox.posted.drain(..k));
            for m in &messages[k..] {
                let seq = m.entry.seq;
                if self.channel_of(seq) != channel {
                    violation = Some(format!(
                        "message #{seq} belongs to eager channel {}",
                        self.channel_of(seq)
                    ));
                    break;
                }
                if inbox.early.back().is_some_and(|&(last, _)| seq <= last) {
                    violation = Some(format!("message #{seq} arrived out of order"));
                    break;
                }
                let early = Early {
                    frame: index,
                    offset: m.offset,
                    len: m.entry.len,
                };
                inbox.early.push_back((seq, early));
                kept += 1;
            }
        }
        // Each taken receive must be the one its message was sent for.
        let good = landed
            .iter()
            .zip(messages)
            .position(|(&(due, _), m)| m.entry.seq != due)
            .unwrap_or(landed.len());
        if good < landed.len() {
            let (due, got) = (landed[good].0, messages[good].entry.seq);
            violation = Some(format!("message #{got} arrived where #{due} was due"));
        }
        if let Some(what) = violation {
            self.violation(channel, what);
        }
        Delivered {
            taken: landed.len() as u64,
            kept,
            good,
        }
    }

    fn mismatch(&self, channel: u16, seq: u64, sent: usize, expected: u32) -> Error {
        Error::Mismatch {
            channel,
            peer: self.link.peer,
            what: format!(
                "send #{seq} of {sent} bytes met a receive of {expected} bytes (both sides \
                 must use the same length)"
            ),
        }
    }

    /// Fails the connection over a frame no well-behaved peer sends.
    pub(crate) fn violation(&self, channel: u16, what: String) {
        self.link.fail(Error::Violation {
            peer: self.link.peer,
            what: format!("eager channel {channel}: {what}"),
        });
    }

    /// Copies a message into its receive's memory; returns whether it landed. A length that
    /// differs from the receive's, or memory that cannot take the bytes, fails the
    /// connection: the receive cannot finish, and the channel's later receives finish only
    /// after it.
    pub(crate) fn land(&self, channel: u16, seq: u64, posted: &Posted, bytes: &[u8]) -> bool {
        if posted.len as usize != bytes.len() {
            self.link
                .fail(self.mismatch(channel, seq, bytes.len(), posted.len));
            return false;
        }
        let piece = (&*posted.region, posted.offset, bytes);
        self.write(seq, &posted.region, [piece].into_iter())
    }

    /// How many of the first early messages of `matched` land as one copy: those of one frame
    /// whose receives have their lengths and are copied together ([`Region::copied_with`]);
    /// at least one (the first, whatever it is: [`Self::land`] reports its mismatch).
    pub(crate) fn early_run(matched: &[(u64, Posted, Early)]) -> usize {
        let Some((_, first, early)) = matched.first() else {
            return 0;
        };
        if first.len != early.len {
            return 1;
        }
        1 + matched[1..]
            .iter()
            .take_while(|(_, p, e)| {
                e.frame == early.frame && p.len == e.len && p.region.copied_with(&first.region)
            })
            .count()
    }

    /// Copies a run of early messages (see [`Self::early_run`]) out of `frame`, the bytes of
    /// the frame that holds them all, into their receives' memory; returns whether they
    /// landed. Every message lies inside `frame` (checked by the caller).
    pub(crate) fn land_early_run(&self, run: &[(u64, Posted, Early)], frame: &[u8]) -> bool {
        let Some((seq, first, _)) = run.first() else {
            return true;
        };
        let pieces = run.iter().map(|(_, posted, early)| {
            let bytes = &frame[early.offset..early.offset + early.len as usize];
            (&*posted.region, posted.offset, bytes)
        });
        self.write(*seq, &first.region, pieces)
    }

    /// Writes `(offset, bytes)` pieces of messages from `seq` on into `region` (host memory:
    /// one operation on it for all of them; CUDA memory: one copy list through the GPU's
    /// small copier, one wait for all of them — see `engine::eager`'s `copy_in` for why);
    /// returns whether they landed. Memory that cannot take them fails the connection.
    fn write<'a, 'r>(
        &self,
        seq: u64,
        first: &Region,
        pieces: impl Iterator<Item = (&'r Region, usize, &'a [u8])>,
    ) -> bool {
        let memory = first.memory();
        let written = if memory.kind() == tcpx::MemoryKind::Host {
            // One region (see `Region::copied_with`).
            memory.write_ranges(pieces.map(|(_, offset, bytes)| (offset, bytes)))
        } else {
            first.small_copier().and_then(|copier| {
                copier
                    .scatter(pieces.map(|(region, offset, bytes)| (region.memory(), offset, bytes)))
            })
        }
        .map_err(|e| Error::InvalidArgument(format!("eager receives from #{seq}: {e}")));
        if let Err(e) = written {
            self.link.fail(e);
            return false;
        }
        true
    }

    /// Lands a frame's messages in the receives taken for them, in order (`receives[i]` is
    /// the receive of `messages[i]`, whose bytes are in `frame`); returns how many landed.
    /// Consecutive receives into one region are written as one operation on it (its state
    /// atomic is written once per run, not twice per message from every engine). A length
    /// that differs from its receive's, or memory that cannot take the bytes, fails the
    /// connection; the receives before it land.
    pub(crate) fn land_run(
        &self,
        channel: u16,
        receives: &[(u64, Posted)],
        messages: &[EagerMessage],
        frame: &[u8],
    ) -> usize {
        let pairs = receives.len().min(messages.len());
        let fitting = receives
            .iter()
            .zip(messages)
            .position(|((_, posted), m)| posted.len != m.entry.len)
            .unwrap_or(pairs);
        let bytes_of = |m: &EagerMessage| &frame[m.offset..m.offset + m.entry.len as usize];
        let mut landed = 0;
        while landed < fitting {
            let region = &receives[landed].1.region;
            let end = landed
                + receives[landed..fitting]
                    .iter()
                    .take_while(|(_, posted)| posted.region.copied_with(region))
                    .count();
            let pieces = receives[landed..end]
                .iter()
                .zip(&messages[landed..end])
                .map(|((_, posted), m)| (&*posted.region, posted.offset, bytes_of(m)));
            if !self.write(receives[landed].0, region, pieces) {
                return landed;
            }
            landed = end;
        }
        if fitting < pairs {
            let (seq, posted) = &receives[fitting];
            let sent = messages[fitting].entry.len as usize;
            self.link
                .fail(self.mismatch(channel, *seq, sent, posted.len));
        }
        landed
    }

    /// Publishes that the first `count` sends of `channel` were copied into frames (the
    /// engine's running count).
    pub(crate) fn sends_finished(&self, channel: u16, count: u64) {
        self.share(channel).sends.publish(count);
    }

    /// Publishes that the first `count` receives of `channel` landed.
    pub(crate) fn recvs_finished(&self, channel: u16, count: u64) {
        self.share(channel).recvs.publish(count);
    }

    /// The transfer of the `ordinal`-th send or receive of `channel`.
    fn transfer(
        self: &Arc<Self>,
        channel: u16,
        direction: Direction,
        ordinal: u64,
        len: usize,
    ) -> Transfer {
        let lane = usize::from(channel) * 2 + usize::from(direction == Direction::Recv);
        let lanes: Arc<dyn Lanes> = self.clone();
        Transfer::in_order(
            Ticket::new(lanes, lane, ordinal),
            direction,
            len as u64,
            self.spin,
        )
    }

    /// The oldest unfinished eager work of `channel` whose deadline has passed, if any,
    /// described for the timeout error.
    ///
    /// Only the oldest of each kind is looked at: sends wait and receives are posted in
    /// sequence order under the connection's order locks, so the lowest number has the
    /// earliest deadline. A receive's deadline starts when a check first sees it oldest
    /// (never earlier than its posting), which costs the posting thread no clock read.
    pub(crate) fn overdue(&self, channel: u16, now: Instant) -> Option<String> {
        let share = self.share(channel);
        let timeout = self.link.timeout;
        {
            let mut outbox = share.outbox();
            let outbox = &mut *outbox;
            if let Some(m) = outbox.queue.front() {
                if outbox.oldest.passed(m.seq, now, timeout) {
                    return Some(format!("eager send #{} of {} bytes", m.seq, m.len));
                }
            }
        }
        let mut inbox = share.inbox();
        let inbox = &mut *inbox;
        let (seq, posted) = inbox.posted.front()?;
        inbox
            .oldest
            .passed(*seq, now, timeout)
            .then(|| format!("eager receive #{seq} of {} bytes", posted.len))
    }

    /// Fails every queued send and waiting receive with the link's failure (or `Closed`):
    /// seals every lane, so the transfers they have not passed fail, and forgets what is
    /// queued and early (sends already copied into frames finished then, as a socket write
    /// does before a reset). Idempotent: every engine of the connection calls it when the
    /// link fails, and the connection when it closes.
    ///
    /// The regions' counts ([`HeldRegions`]) stay until the eager state is dropped: another
    /// engine may still be copying a message when this runs, and a sealed lane's count no
    /// longer says when it is done.
    pub(crate) fn fail_all(&self) {
        for share in &self.shares {
            {
                let mut outbox = share.outbox();
                outbox.unsent = 0;
                share.queued.store(false, Ordering::Release);
                outbox.queue.clear();
            }
            {
                let mut inbox = share.inbox();
                inbox.early.clear();
                share.matched.store(0, Ordering::Release);
                inbox.matched.clear();
                inbox.posted.clear();
            }
            share.sends.seal();
            share.recvs.seal();
        }
    }
}

impl Lanes for Eager {
    fn lane(&self, lane: usize) -> &InOrder {
        let share = self.shares.get(lane / 2).unwrap_or(&self.shares[0]);
        if lane % 2 == 0 {
            &share.sends
        } else {
            &share.recvs
        }
    }

    fn failure(&self) -> Option<Error> {
        self.link.failure().cloned()
    }

    fn ended(&self) -> Error {
        self.link.failure_or_closed()
    }
}

impl Pending for Eager {
    fn pending(&self) -> usize {
        self.in_flight()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(region: &Region) -> usize {
        Arc::strong_count(&region.inner)
    }

    #[test]
    fn a_region_is_counted_once_while_its_transfers_run_and_released_when_they_finished() {
        let one = Region::new(tcpx::SharedMemory::host(4096).unwrap());
        let two = Region::new(tcpx::SharedMemory::host(4096).unwrap());
        let lane = InOrder::default();
        let mut held = HeldRegions::default();
        let mut released = Vec::new();
        // Transfers 0 and 1 name `one`, 2 names `two`: one count each, none per alias.
        let aliases = [
            held.alias(&one, 0, &lane, &mut released),
            held.alias(&one, 1, &lane, &mut released),
            held.alias(&two, 2, &lane, &mut released),
        ];
        assert!(aliases[0].same(&one) && aliases[1].same(&one) && aliases[2].same(&two));
        assert_eq!((counts(&one), counts(&two)), (2, 2));
        // Nothing finished: nothing goes.
        held.release_finished(0, &mut released);
        assert!(released.is_empty());
        // Transfer 1 is `one`'s newest: it goes once the lane passed it, not before.
        held.release_finished(1, &mut released);
        assert!(released.is_empty());
        held.release_finished(2, &mut released);
        assert_eq!(released.len(), 1);
        drop(released);
        // The aliases never held a count: letting them go changes nothing.
        let _ = aliases;
        assert_eq!((counts(&one), counts(&two)), (1, 2));
        // A region named again after its release is counted again.
        let mut released = Vec::new();
        let again = held.alias(&one, 3, &lane, &mut released);
        assert!(again.same(&one));
        assert_eq!(counts(&one), 2);
        held.release_finished(4, &mut released);
        assert_eq!(released.len(), 2);
        drop(released);
        assert_eq!((counts(&one), counts(&two)), (1, 1));
    }

    #[test]
    fn held_regions_look_over_finished_ones_only_when_many() {
        let lane = InOrder::default();
        let mut held = HeldRegions::default();
        let mut released = Vec::new();
        let regions: Vec<Region> = (0..HELD_REGIONS_LOOKED_OVER + 2)
            .map(|_| Region::new(tcpx::SharedMemory::host(64).unwrap()))
            .collect();
        for (i, r) in regions.iter().enumerate().take(HELD_REGIONS_LOOKED_OVER) {
            let _ = held.alias(r, i as u64, &lane, &mut released);
        }
        assert!(released.is_empty());
        // The lane finished all of them: the next new region makes room.
        assert!(lane.publish(HELD_REGIONS_LOOKED_OVER as u64));
        let last = HELD_REGIONS_LOOKED_OVER;
        let _ = held.alias(&regions[last], last as u64, &lane, &mut released);
        assert_eq!(released.len(), HELD_REGIONS_LOOKED_OVER);
        assert_eq!(held.held.len(), 1);
        // The next look waits until twice the regions that stayed (or the floor).
        let mut released = Vec::new();
        let _ = held.alias(&regions[last + 1], last as u64 + 1, &lane, &mut released);
        assert!(released.is_empty());
        assert_eq!(held.held.len(), 2);
    }

    #[test]
    fn an_oldest_entry_s_deadline_starts_when_first_seen_and_restarts_for_the_next() {
        let timeout = Duration::from_secs(10);
        let t0 = Instant::now();
        let mut oldest = Oldest::default();
        // First sight of #5 starts its deadline; it is not past at once.
        assert!(!oldest.passed(5, t0, timeout));
        // The same entry keeps the deadline it got: past only once the timeout ran from t0.
        assert!(!oldest.passed(5, t0 + Duration::from_secs(9), timeout));
        assert!(oldest.passed(5, t0 + Duration::from_secs(10), timeout));
        // A new oldest entry gets a fresh deadline, whatever the previous one's.
        let t1 = t0 + Duration::from_secs(11);
        assert!(!oldest.passed(6, t1, timeout));
        assert!(oldest.passed(6, t1 + timeout, timeout));
    }

    /// The CPUID decoding agrees with the kernel's reading of the same bit (`3dnowprefetch`
    /// is how Linux names `PREFETCHW`), and the hint runs on any address once available.
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    #[test]
    fn write_prefetch_is_detected_as_the_kernel_sees_it_and_never_faults() {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").expect("read /proc/cpuinfo");
        let flags = cpuinfo
            .lines()
            .find(|l| l.starts_with("flags"))
            .expect("a flags line");
        let kernel = flags.split_whitespace().any(|f| f == "3dnowprefetch");
        assert_eq!(prefetch_for_write_available(), kernel);
        if kernel {
            let word = AtomicU64::new(0);
            prefetch_for_write(&word);
            prefetch_for_write(std::ptr::null::<u8>());
            prefetch_for_write(usize::MAX as *const u8);
            word.store(1, Ordering::Release);
            assert_eq!(word.load(Ordering::Acquire), 1);
        }
    }
}
