//! The receive side of a connection: a fixed ring of 16 request slots, per-socket receive
//! cursors, and the consumption rule.
//!
//! Receives match sends in posting order: the k-th `irecv` gets message k. Each socket carries
//! the parts of the messages the striping rule assigns to it, in order. A header is checked
//! against the rule before anything is written anywhere, so a confused or hostile peer yields
//! an error code, never a write outside the posted buffer.
//!
//! **Read-ahead.** Each socket owns a buffer of [`READ_AHEAD`] bytes, allocated with the comm.
//! After a short part, one `recv` fills it: the headers and payloads of many small messages
//! arrive in one system call and are copied out into their posted buffers. A part's payload
//! that is not buffered yet is read straight into its destination, together with what follows
//! it in the stream (all of the read-ahead buffer after a short remainder, only the next header
//! after a long one), and after a long part the socket reads just the next header: a stream of
//! large messages is copied once, by the kernel, as before. Bytes of messages that are not
//! posted yet stay in the buffer (and the socket is not read further) until their `irecv`
//! comes.
//!
//! **An empty socket is asked before it is read again.** After a `recv` that found nothing, the
//! next attempt on that socket first asks `poll(2)`, which takes no socket lock: a tight loop
//! of empty `recv`s held the lock the peer's arriving segments need, pushing them into the
//! socket's backlog (see `sock::readable`).
//!
//! **Large payloads of a stream are read in batches.** In a payload part of at least
//! [`RecvComm::set_read_batch`] bytes (256 KiB by default where the process has 4 cores or
//! more, else off) whose message has another receive posted behind it (a stream; a lone
//! transfer is read as it lands, see [`watermark`]), the socket's `SO_RCVLOWAT` is set,
//! before each readiness check, to a batch or to the rest of the part if less is to come
//! (at most a quarter of the receive buffer), so the check reports the socket ready only
//! once that much is queued: the engine reads 256 KiB
//! per `recv` instead of the 64–80 KiB that had arrived since its last look, the end of a
//! part in one read, and each read that frees receive-window space (and makes the kernel send
//! a window update) frees a lot of it. Between parts and in smaller ones it is 1. No check
//! waits for bytes that are not coming: the rest of a part whose header arrived is on its
//! way, and the kernel also reports a socket ready when its receive window is nearly closed or
//! its peer closed it.
//!
//! Request lifetime: posted → done (reported by `test`) → released. When the accept caller asked
//! for a device handle (TCPX-style callers preset an UNPACK handle), a slot is released only by
//! `irecvConsumed`, in FIFO order, like TCPX. Otherwise (real NCCL passes no handle for HOST
//! devices and never calls `irecvConsumed`) `test` releases the slot as it reports done and
//! `irecvConsumed` is an accepted no-op.
//!
//! Devmem emulation (`crate::devmem`): a comm accepted with a device handle in that mode owns a
//! [`DevmemRecv`]. A receive into CUDA memory is then read into the slot's host staging buffer
//! instead of its destination, and published (bounce pages, `loadMeta`s, `cnt[slot]`) just
//! before `test` reports it done; the destination itself is the consumer's to fill.
//!
//! Threading: one thread at a time per comm (NCCL's contract); no lock on the data path.

use std::ffi::c_void;
use std::io::{self, IoSliceMut};
use std::net::TcpStream;

use tcpx_sys::{ncclNetDeviceHandle_v8_t, ResultCode, MAX_REQUESTS};

use crate::devmem::{DevmemRecv, MAX_RECV_BYTES};
use crate::fault::{Action, Gate, Side as FaultSide};
use crate::log::log_warn;
use crate::object::{DEAD_TAG, RECV_REQ_TAG, RECV_TAG};
use crate::send::SYSCALL_BUDGET;
use crate::sock::{self, Io};
use crate::wire::{FrameHeader, Stripe, FRAME_LEN};

const RING: u64 = MAX_REQUESTS as u64;

/// Bytes of each socket's read-ahead buffer: about 30 messages of 4 KiB per `recv`, small
/// enough to stay in cache between the kernel's copy into it and ours out of it.
pub(crate) const READ_AHEAD: usize = 128 << 10;

/// A part whose payload (or unread rest of it) is at least this long is read straight into its
/// destination with only the next header behind it, and after such a part only the next
/// header is read: copying it through the read-ahead buffer would cost more than the system
/// call it saves.
///
/// Why 8 KiB and not more: the runtime pads an eager frame that announces detached messages
/// to this length (so that the read after it takes only the next header, and the detached
/// bytes go straight into their receives), and in a stream of 64 KiB messages (about seven
/// per frame) 32 KiB pads added 6.6 % to the payload's bytes, 8 KiB pads add 1.7 %: bytes a
/// real NIC would carry for nothing. 8 KiB is above a frame of one 4 KiB message (a
/// ping-pong of those still reads each in one `recv`). On loopback (H200, docs/RESULTS.md,
/// thirtieth session, four calls of four to six alternations) 64 KiB moved 24.0 against 22.5
/// GB/s, higher in three calls and level in one; 4 and 16 KiB and the 4 KiB round trip level.
pub const DIRECT_MIN: usize = 8 << 10;
const _: () = assert!(DIRECT_MIN <= READ_AHEAD && FRAME_LEN < DIRECT_MIN);

/// One request slot; a pointer to it is the `request` handed to the caller.
#[repr(C)]
pub(crate) struct RecvSlot {
    tag: u64,
    comm: *mut RecvComm,
    index: usize,
    seq: u64,
    data: *mut u8,
    cap: usize,
    /// The destination is CUDA memory (devmem emulation): `data` is the slot's host staging.
    cuda: bool,
    /// Message size, known from the first header of the message.
    total: Option<u32>,
    nparts: u8,
    /// Bit p set once part p is fully received.
    parts_mask: u8,
}

impl RecvSlot {
    fn complete(&self) -> bool {
        self.total.is_some() && u32::from(self.parts_mask) == (1u32 << self.nparts) - 1
    }
}

#[derive(Clone, Copy)]
enum RxState {
    /// Reading (or holding a partial) frame header.
    Header,
    /// A header for message `seq`, which is not posted yet.
    Parked { seq: u64, hdr: FrameHeader },
    /// Reading the payload of part `part` of message `seq` into `[off, end)` of its buffer.
    Payload {
        seq: u64,
        part: u8,
        off: usize,
        end: usize,
    },
}

struct RxCursor {
    /// Lower bound of the next message this socket carries a part of.
    seq: u64,
    state: RxState,
    /// Read-ahead buffer; `[lo, hi)` holds received bytes not consumed yet.
    ra: Box<[u8]>,
    lo: usize,
    hi: usize,
    /// The last part delivered was shorter than [`DIRECT_MIN`]: read ahead as far as the
    /// buffer goes. After a long part only the next header is read ahead.
    wide: bool,
    /// The peer closed this socket at a frame boundary.
    eof: bool,
    /// The last `recv` found the socket empty: ask [`sock::readable`] (which takes no socket
    /// lock) before the next one.
    starved: bool,
    /// The socket's `SO_RCVLOWAT` as last set (1: the kernel's default).
    lowat: usize,
    /// What [`RecvComm::pace_reads`] last wanted before capping it to the receive buffer: the
    /// buffer is looked at again only when this changes.
    paced_for: usize,
}

impl RxCursor {
    fn new() -> Self {
        Self {
            seq: 0,
            state: RxState::Header,
            ra: vec![0u8; READ_AHEAD].into_boxed_slice(),
            lo: 0,
            hi: 0,
            wide: true,
            eof: false,
            starved: false,
            lowat: 1,
            paced_for: 1,
        }
    }

    fn buffered(&self) -> usize {
        self.hi - self.lo
    }
}

/// What one `recv` on a socket found.
enum Filled {
    /// Everything asked for: more may be waiting in the socket.
    All,
    /// Less than asked for, nothing, or the peer's orderly close at a frame boundary: the
    /// socket has nothing more now.
    Drained,
}

/// A failure found while driving the sockets: code and log line.
struct Failure {
    code: ResultCode,
    msg: String,
}

fn remote(msg: String) -> Failure {
    Failure {
        code: ResultCode::REMOTE_ERROR,
        msg,
    }
}

/// The low watermark a socket found empty should get while it carries a payload part of
/// `part_len` bytes with `rest` still to come, under a read batch of `read_batch` bytes: a
/// batch, or the rest if less is to come, in a part of at least a batch whose message has
/// another receive posted behind it; else 1 (any byte wakes the reader).
///
/// Why only with a receive behind: a batch saves reads where bytes keep coming — a stream,
/// whose next messages are already posted. A lone transfer is waited for: its reader should
/// copy each piece as it lands, in step with the sender, and a batch only moves the last
/// copies to after the arrival. A 1 MiB ping-pong over 8 channels (H200, five alternations):
/// p50 152–165 µs with batches for every part, 121–148 without, 131–152 with this rule;
/// 16 MiB 597–661, 574–639 and 571–621 µs.
fn watermark(read_batch: usize, part_len: usize, rest: usize, more_posted: bool) -> usize {
    if read_batch > 1 && more_posted && part_len >= read_batch {
        rest.clamp(1, read_batch)
    } else {
        1
    }
}

/// A receive comm (the `recvComm` handed to callers).
#[repr(C)]
pub(crate) struct RecvComm {
    tag: u64,
    slots: [RecvSlot; MAX_REQUESTS],
    socks: Vec<TcpStream>,
    rx: Vec<RxCursor>,
    stripe: Stripe,
    /// Sequence number of the next irecv.
    posted: u64,
    /// Oldest request not yet reported done.
    head: u64,
    /// Oldest request whose slot is not yet released (== head unless consumption is required).
    released: u64,
    consume_required: bool,
    /// Devmem emulation resources (only when accepted with a device handle in that mode).
    devmem: Option<Box<DevmemRecv>>,
    /// The device handle this comm filled when the accept caller's slot was empty (NCCL-style):
    /// the caller keeps a pointer to it, so it lives as long as the comm.
    _owned_handle: Option<Box<ncclNetDeviceHandle_v8_t>>,
    failed: Option<ResultCode>,
    name: String,
    fault: Gate,
    /// In payload parts of at least this many bytes, a socket found empty waits for this
    /// many, or the rest of the part, to be queued (see the module docs); 0 or 1: no batching.
    read_batch: usize,
}

impl RecvComm {
    /// A comm over accepted data sockets (index order = socket index of the striping rule).
    pub(crate) fn new(
        socks: Vec<TcpStream>,
        consume_required: bool,
        devmem: Option<Box<DevmemRecv>>,
        owned_handle: Option<Box<ncclNetDeviceHandle_v8_t>>,
        name: String,
    ) -> Box<Self> {
        let n = socks.len();
        let mut comm = Box::new(Self {
            tag: RECV_TAG,
            slots: std::array::from_fn(|i| RecvSlot {
                tag: RECV_REQ_TAG,
                comm: std::ptr::null_mut(),
                index: i,
                seq: 0,
                data: std::ptr::null_mut(),
                cap: 0,
                cuda: false,
                total: None,
                nparts: 0,
                parts_mask: 0,
            }),
            socks,
            rx: (0..n).map(|_| RxCursor::new()).collect(),
            stripe: Stripe { nsocks: n },
            posted: 0,
            head: 0,
            released: 0,
            consume_required,
            devmem,
            _owned_handle: owned_handle,
            failed: None,
            name,
            fault: Gate::new(FaultSide::Recv),
            read_batch: 0,
        });
        let me: *mut RecvComm = &mut *comm;
        for s in comm.slots.iter_mut() {
            s.comm = me;
        }
        comm
    }

    /// Name for log lines.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Reads large payloads in batches of `bytes` (see the module docs); 0 or 1 turns it off.
    pub(crate) fn set_read_batch(&mut self, bytes: usize) {
        self.read_batch = bytes;
    }

    /// Sets socket `j`'s low watermark before its readiness check: what [`watermark`] wants
    /// for the part being read, at most a quarter of the socket's receive buffer. Only the
    /// check reads it (a non-blocking `recv` returns what is queued whatever the watermark),
    /// so it is set only there: a few system calls per part. A socket that refuses the option
    /// ends batching on this comm (reads work either way).
    ///
    /// Why the cap: a watermark the buffer cannot comfortably hold makes the kernel grow the
    /// buffer and clamp the advertised window to the watermark itself. The sender then stops
    /// with a full window exactly when the receiver's batch is complete, and the two take
    /// turns instead of overlapping (seen on a 2-core host: 1 MiB messages a third slower).
    /// Under a quarter of the buffer leaves the window alone; autotuning grows the buffer,
    /// and the batch with it, as the stream speeds up.
    fn pace_reads(&mut self, j: usize) {
        let cur = &self.rx[j];
        let wanted = match cur.state {
            RxState::Payload {
                seq,
                part,
                off,
                end,
            } => {
                let start = self.slots[(seq % RING) as usize]
                    .total
                    .map_or(0, |t| self.stripe.range(t, usize::from(part)).0);
                watermark(
                    self.read_batch,
                    end - start,
                    end - off,
                    seq + 1 < self.posted,
                )
            }
            _ => 1,
        };
        if wanted == cur.paced_for {
            return;
        }
        let lowat = if wanted > 1 {
            match sock::rcvbuf(&self.socks[j]) {
                Ok(buf) => wanted.min(buf / 4).max(1),
                Err(_) => 1,
            }
        } else {
            1
        };
        self.rx[j].paced_for = wanted;
        if lowat == self.rx[j].lowat {
            return;
        }
        match sock::set_rcvlowat(&self.socks[j], lowat) {
            Ok(()) => self.rx[j].lowat = lowat,
            Err(e) => {
                log_warn!(
                    "tcpx-socket: {}: SO_RCVLOWAT on socket {j}: {e}; large payloads are read \
                     as they arrive",
                    self.name
                );
                self.read_batch = 0;
                if self.rx[j].lowat != 1 && sock::set_rcvlowat(&self.socks[j], 1).is_ok() {
                    self.rx[j].lowat = 1;
                }
            }
        }
    }

    /// `irecv` with one buffer: records the request, or `None` when 16 slots are held (busy).
    /// `cuda`: the buffer is CUDA memory (registered as such, so devmem emulation is on).
    pub(crate) fn post(
        &mut self,
        data: *mut u8,
        cap: usize,
        cuda: bool,
    ) -> Result<Option<*mut c_void>, ResultCode> {
        if let Some(code) = self.failed {
            return Err(code);
        }
        if cuda {
            if self.devmem.is_none() {
                log_warn!(
                    "tcpx-socket: {}: irecv into CUDA memory, but this comm has no unpack queue \
                     (accept was called without a device handle slot): nobody could unpack it",
                    self.name
                );
                return Err(ResultCode::INVALID_USAGE);
            }
            if cap > MAX_RECV_BYTES {
                log_warn!(
                    "tcpx-socket: {}: irecv of {cap} bytes into CUDA memory exceeds the devmem \
                     limit of {MAX_RECV_BYTES} bytes per receive (2048 fragments of at most 4 \
                     KiB, as in TCPX): post smaller receives",
                    self.name
                );
                return Err(ResultCode::INVALID_ARGUMENT);
            }
        }
        if self.posted - self.released >= RING {
            return Ok(None);
        }
        let seq = self.posted;
        let index = (seq % RING) as usize;
        let data = match (&mut self.devmem, cuda) {
            // The slot is free (released), so no socket writes into its staging buffer.
            (Some(d), true) => d.stage(index, cap),
            _ => data,
        };
        let slot = &mut self.slots[index];
        slot.seq = seq;
        slot.data = data;
        slot.cap = cap;
        slot.cuda = cuda;
        slot.total = None;
        slot.nparts = 0;
        slot.parts_mask = 0;
        self.posted += 1;
        Ok(Some((slot as *mut RecvSlot).cast()))
    }

    /// `test` on the request in slot `index` with sequence number `seq`.
    pub(crate) fn test(&mut self, index: usize, seq: u64) -> Result<Option<u32>, ResultCode> {
        if let Some(code) = self.failed {
            return Err(code);
        }
        if self.head == self.posted || seq != self.head || index != (self.head % RING) as usize {
            log_warn!(
                "tcpx-socket: {}: test on receive request #{seq} but the oldest outstanding is \
                 {} (requests must be tested in posting order)",
                self.name,
                if self.head == self.posted {
                    "none".to_string()
                } else {
                    format!("#{}", self.head)
                }
            );
            return Err(ResultCode::INVALID_USAGE);
        }
        match self.fault.before_test(&self.name) {
            Action::Proceed => {}
            Action::Fail(code) => {
                self.failed = Some(code);
                return Err(code);
            }
            Action::Drop => sock::shutdown_all(&self.socks),
        }
        // A complete request needs no socket work (a read-ahead often completes several at
        // once): its successors are driven when they are tested.
        if !self.slots[index].complete() {
            let outcome = self.progress().and_then(|()| self.check_head_reachable());
            if let Err(f) = outcome {
                log_warn!("tcpx-socket: {}: {}; the comm is failed", self.name, f.msg);
                self.failed = Some(f.code);
                return Err(f.code);
            }
        }
        let slot = &self.slots[index];
        if slot.complete() && self.fault.release(seq) {
            let (total, cuda) = (slot.total.unwrap_or(0) as usize, slot.cuda);
            if let Some(d) = &mut self.devmem {
                if let Err(msg) = d.publish(index, total, cuda) {
                    log_warn!(
                        "tcpx-socket: {}: devmem: receive #{seq} ({total} bytes): {msg}; the \
                         comm is failed",
                        self.name
                    );
                    self.failed = Some(ResultCode::UNHANDLED_CUDA_ERROR);
                    return Err(ResultCode::UNHANDLED_CUDA_ERROR);
                }
            }
            let slot = &self.slots[index];
            self.head += 1;
            if !self.consume_required {
                self.released = self.head;
            }
            self.fault.completed(slot.total.unwrap_or(0));
            Ok(slot.total)
        } else {
            Ok(None)
        }
    }

    /// `irecvConsumed` for the request with sequence number `seq`.
    pub(crate) fn consumed(&mut self, seq: u64) -> Result<(), ResultCode> {
        if !self.consume_required {
            return Ok(());
        }
        if let Some(code) = self.failed {
            return Err(code);
        }
        if self.released == self.head {
            log_warn!(
                "tcpx-socket: {}: irecvConsumed on receive request #{seq}, but no completed \
                 receive awaits consumption (test must report done first)",
                self.name
            );
            return Err(ResultCode::INVALID_USAGE);
        }
        if seq != self.released {
            log_warn!(
                "tcpx-socket: {}: irecvConsumed on receive request #{seq} out of order: the \
                 oldest unconsumed receive is #{}",
                self.name,
                self.released
            );
            return Err(ResultCode::INVALID_USAGE);
        }
        self.released += 1;
        Ok(())
    }

    fn progress(&mut self) -> Result<(), Failure> {
        for j in 0..self.socks.len() {
            self.progress_socket(j)?;
        }
        Ok(())
    }

    /// Fails the comm when the oldest outstanding message can no longer arrive: a socket that
    /// must still deliver one of its parts has been closed by the peer.
    fn check_head_reachable(&self) -> Result<(), Failure> {
        let h = self.head;
        if h == self.posted {
            return Ok(());
        }
        let slot = &self.slots[(h % RING) as usize];
        if slot.complete() {
            return Ok(());
        }
        let dead_part = match slot.total {
            None => self.rx[self.stripe.socket_of(h, 0)].eof.then_some(0),
            Some(_) => (0..usize::from(slot.nparts)).find(|&p| {
                slot.parts_mask & (1 << p) == 0 && self.rx[self.stripe.socket_of(h, p)].eof
            }),
        };
        match dead_part {
            None => Ok(()),
            Some(p) => Err(remote(format!(
                "peer closed the connection: message #{h} is missing {} (part {p} on socket {} \
                 never arrived)",
                self.missing(h),
                self.stripe.socket_of(h, p)
            ))),
        }
    }

    /// "N of T bytes" for message `seq`, for error messages.
    fn missing(&self, seq: u64) -> String {
        let slot = &self.slots[(seq % RING) as usize];
        let Some(total) = slot.total else {
            return format!("all bytes (size unknown, {} bytes posted)", slot.cap);
        };
        let mut got = 0usize;
        for p in 0..usize::from(slot.nparts) {
            let (a, b) = self.stripe.range(total, p);
            if slot.parts_mask & (1 << p) != 0 {
                got += b - a;
            }
        }
        for cur in &self.rx {
            if let RxState::Payload {
                seq: s, off, part, ..
            } = cur.state
            {
                if s == seq {
                    got += off - self.stripe.range(total, usize::from(part)).0;
                }
            }
        }
        format!("{} of {total} bytes", total as usize - got)
    }

    /// Delivers what socket `j` has buffered, then reads while a posted message needs the
    /// socket, until it has nothing more or the syscall budget is spent.
    fn progress_socket(&mut self, j: usize) -> Result<(), Failure> {
        for _ in 0..SYSCALL_BUDGET {
            self.drain(j)?;
            let cur = &self.rx[j];
            let needed = match cur.state {
                // `drain` began every posted part: this one's message is not posted, and its
                // bytes wait in the buffer.
                RxState::Parked { .. } => false,
                // Read only when a posted message may need this socket: its next frame can
                // belong to a message that is not posted yet.
                RxState::Header => cur.seq.max(self.head) < self.posted,
                RxState::Payload { .. } => true,
            };
            if !needed {
                return Ok(());
            }
            if let Filled::Drained = self.fill(j)? {
                break;
            }
        }
        // What the last `recv` brought may complete the request being tested.
        self.drain(j)
    }

    /// Consumes socket `j`'s buffered bytes: decodes and checks headers, begins parts of posted
    /// messages, copies payload out into posted buffers. Stops when the buffer holds less than
    /// a header or when the next part's message is not posted yet.
    fn drain(&mut self, j: usize) -> Result<(), Failure> {
        loop {
            let cur = &mut self.rx[j];
            match cur.state {
                RxState::Header => {
                    if cur.buffered() < FRAME_LEN {
                        break;
                    }
                    let mut hdr = [0u8; FRAME_LEN];
                    hdr.copy_from_slice(&cur.ra[cur.lo..cur.lo + FRAME_LEN]);
                    cur.lo += FRAME_LEN;
                    self.on_header(j, &hdr)?;
                }
                RxState::Parked { seq, hdr } => {
                    if seq >= self.posted {
                        break;
                    }
                    self.begin_part(j, seq, hdr)?;
                }
                RxState::Payload {
                    seq,
                    part,
                    off,
                    end,
                } => {
                    let k = cur.buffered().min(end - off);
                    if k == 0 {
                        break;
                    }
                    let slot = &self.slots[(seq % RING) as usize];
                    // SAFETY: irecv's contract keeps the posted buffer valid, and untouched by
                    // the caller, until the request completes; [off, off+k) ⊆ [0, total) and
                    // total ≤ cap was checked when the part began. `ra[lo..lo+k]` is buffered
                    // data of this comm's own allocation, which cannot overlap the caller's.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            cur.ra.as_ptr().add(cur.lo),
                            slot.data.add(off),
                            k,
                        )
                    };
                    cur.lo += k;
                    if off + k == end {
                        self.finish_part(j, seq, part, end);
                    } else {
                        cur.state = RxState::Payload {
                            seq,
                            part,
                            off: off + k,
                            end,
                        };
                    }
                }
            }
        }
        let cur = &mut self.rx[j];
        if cur.lo == cur.hi {
            (cur.lo, cur.hi) = (0, 0);
        }
        Ok(())
    }

    /// One `recv` on socket `j`, after [`Self::drain`] (so the buffer holds no payload of a
    /// posted part and at most a partial header). In a payload: straight into the destination,
    /// then into the buffer. Between parts: into the buffer.
    fn fill(&mut self, j: usize) -> Result<Filled, Failure> {
        // An engine tests its requests in a tight loop; after a `recv` that found nothing, a
        // lockless readiness check keeps the empty reads from holding the socket lock while
        // the peer's segments arrive (see `sock::readable`). Measured on loopback: large
        // messages about 5 % faster, one stream up to a fifth.
        // Large payloads wait for a batch there (see the module docs).
        if self.rx[j].starved {
            self.pace_reads(j);
            if !sock::readable(&self.socks[j]) {
                return Ok(Filled::Drained);
            }
        }
        let (io, want) = {
            let cur = &mut self.rx[j];
            if cur.lo > 0 {
                // At most a partial header: a few bytes to move so the buffer is whole again.
                cur.ra.copy_within(cur.lo..cur.hi, 0);
                (cur.lo, cur.hi) = (0, cur.hi - cur.lo);
            }
            match cur.state {
                RxState::Payload { seq, off, end, .. } => {
                    debug_assert_eq!(cur.hi, 0, "payload left in the read-ahead buffer");
                    let tail = if end - off >= DIRECT_MIN {
                        FRAME_LEN
                    } else {
                        cur.ra.len()
                    };
                    let slot = &self.slots[(seq % RING) as usize];
                    // SAFETY: [off, end) lies inside the buffer irecv posted for this slot
                    // (the striping rule), which stays valid, with the caller's hands off it,
                    // until the request completes; it is not complete while this part is open.
                    let dst =
                        unsafe { std::slice::from_raw_parts_mut(slot.data.add(off), end - off) };
                    let mut bufs = [IoSliceMut::new(dst), IoSliceMut::new(&mut cur.ra[..tail])];
                    (
                        sock::recv_vectored(&self.socks[j], &mut bufs),
                        end - off + tail,
                    )
                }
                RxState::Header | RxState::Parked { .. } => {
                    let want = if cur.wide {
                        cur.ra.len() - cur.hi
                    } else {
                        FRAME_LEN - cur.hi
                    };
                    let mut bufs = [IoSliceMut::new(&mut cur.ra[cur.hi..cur.hi + want])];
                    (sock::recv_vectored(&self.socks[j], &mut bufs), want)
                }
            }
        };
        let io = io.map_err(|e| self.io(j, e))?;
        self.rx[j].starved = matches!(io, Io::WouldBlock);
        let n = match io {
            Io::WouldBlock => return Ok(Filled::Drained),
            Io::Moved(n) => n,
            Io::Eof => return self.on_eof(j).map(|()| Filled::Drained),
        };
        let cur = &mut self.rx[j];
        match cur.state {
            RxState::Payload {
                seq,
                part,
                off,
                end,
            } => {
                let into_payload = n.min(end - off);
                cur.hi = n - into_payload;
                if off + into_payload == end {
                    self.finish_part(j, seq, part, end);
                } else {
                    cur.state = RxState::Payload {
                        seq,
                        part,
                        off: off + into_payload,
                        end,
                    };
                }
            }
            RxState::Header | RxState::Parked { .. } => cur.hi += n,
        }
        Ok(if n == want {
            Filled::All
        } else {
            Filled::Drained
        })
    }

    /// The peer closed socket `j` (a `recv` returned 0, with nothing left in the buffer but
    /// maybe a partial header): fine between frames (`check_head_reachable` decides whether a
    /// posted message is lost), an error inside one.
    fn on_eof(&mut self, j: usize) -> Result<(), Failure> {
        let cur = &mut self.rx[j];
        match cur.state {
            RxState::Payload { seq, .. } => Err(remote(format!(
                "peer closed socket {j} in the middle of message #{seq}: {} missing",
                self.missing(seq)
            ))),
            _ if cur.buffered() > 0 => Err(remote(format!(
                "peer closed socket {j} in the middle of a frame header ({} of {FRAME_LEN}                  bytes received)",
                cur.buffered()
            ))),
            _ => {
                cur.eof = true;
                Ok(())
            }
        }
    }

    fn io(&self, j: usize, e: io::Error) -> Failure {
        let code = match e.kind() {
            io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe => ResultCode::REMOTE_ERROR,
            _ => ResultCode::SYSTEM_ERROR,
        };
        let what = if self.head < self.posted {
            format!(
                ", message #{} is missing {}",
                self.head,
                self.missing(self.head)
            )
        } else {
            String::new()
        };
        Failure {
            code,
            msg: format!("receive failed on socket {j}: {e}{what}"),
        }
    }

    /// Part `part` of message `seq`, ending at byte `end` of it, is complete on socket `j`.
    fn finish_part(&mut self, j: usize, seq: u64, part: u8, end: usize) {
        let slot = &mut self.slots[(seq % RING) as usize];
        slot.parts_mask |= 1 << part;
        let start = slot
            .total
            .map_or(0, |t| self.stripe.range(t, usize::from(part)).0);
        let cur = &mut self.rx[j];
        cur.seq = seq + 1;
        cur.state = RxState::Header;
        cur.wide = end - start < DIRECT_MIN;
    }

    /// A complete header arrived on socket `j`: place it in the message sequence and check it.
    fn on_header(&mut self, j: usize, hdr: &[u8; FRAME_LEN]) -> Result<(), Failure> {
        let hdr = match FrameHeader::decode(hdr) {
            Ok(h) => h,
            Err(e) => return Err(remote(format!("malformed frame header on socket {j}: {e}"))),
        };
        let base = self.rx[j].seq.max(self.head);
        let ahead = u64::from(hdr.seq.wrapping_sub(base as u32));
        // Part 0 of message m always travels on socket m mod nsocks, so no socket can skip
        // nsocks messages or more; anything further ahead is a corrupt stream.
        if ahead >= self.stripe.nsocks as u64 {
            return Err(remote(format!(
                "frame for message #{} on socket {j}, which expected message #{base} or one of \
                 the next {}",
                hdr.seq,
                self.stripe.nsocks - 1
            )));
        }
        let seq = base + ahead;
        for m in base..seq {
            let skipped = self.stripe.socket_of(m, 0) == j
                || (m < self.posted
                    && self.slots[(m % RING) as usize]
                        .total
                        .is_some_and(|t| self.stripe.part_on(m, t, j).is_some()));
            if skipped {
                return Err(remote(format!(
                    "socket {j} skipped its part of message #{m} (next frame is for #{seq})"
                )));
            }
        }
        self.stripe
            .check(&hdr, seq, j)
            .map_err(|e| remote(format!("socket {j}: {e}")))?;
        self.rx[j].seq = seq;
        if seq < self.posted {
            self.begin_part(j, seq, hdr)
        } else {
            self.rx[j].state = RxState::Parked { seq, hdr };
            Ok(())
        }
    }

    /// Starts reading part `hdr.part` of posted message `seq` on socket `j`.
    fn begin_part(&mut self, j: usize, seq: u64, hdr: FrameHeader) -> Result<(), Failure> {
        let nsocks = self.stripe.nsocks;
        let slot = &mut self.slots[(seq % RING) as usize];
        match slot.total {
            Some(t) if t != hdr.total => {
                return Err(remote(format!(
                    "message #{seq}: socket {j} says {} bytes, an earlier part said {t}",
                    hdr.total
                )))
            }
            Some(_) => {}
            None => {
                if hdr.total as usize > slot.cap {
                    return Err(Failure {
                        code: ResultCode::INVALID_USAGE,
                        msg: format!(
                            "message #{seq} is {} bytes but the posted receive holds only {} \
                             bytes (sizes of matching isend/irecv disagree)",
                            hdr.total, slot.cap
                        ),
                    });
                }
                slot.total = Some(hdr.total);
                slot.nparts = hdr.nparts;
                // A socket already past this message must not owe a part of it.
                for k in 0..nsocks {
                    if k != j
                        && self.rx[k].seq > seq
                        && self.stripe.part_on(seq, hdr.total, k).is_some()
                    {
                        return Err(remote(format!(
                            "socket {k} skipped its part of message #{seq} ({} bytes)",
                            hdr.total
                        )));
                    }
                }
            }
        }
        let (start, end) = self.stripe.range(hdr.total, usize::from(hdr.part));
        if start == end {
            self.finish_part(j, seq, hdr.part, end);
        } else {
            self.rx[j].state = RxState::Payload {
                seq,
                part: hdr.part,
                off: start,
                end,
            };
        }
        Ok(())
    }
}

/// Reads the comm and position of a receive request.
///
/// # Safety
/// `req` points at a live [`RecvSlot`] (its tag was checked by the caller).
pub(crate) unsafe fn slot_info(req: *const RecvSlot) -> (*mut RecvComm, usize, u64) {
    // SAFETY: forwarded contract; plain field reads, no reference kept.
    unsafe { ((*req).comm, (*req).index, (*req).seq) }
}

/// Frees a receive comm; requests in flight are abandoned.
///
/// # Safety
/// `comm` came from `Box::into_raw` of a [`RecvComm`] and is not used afterwards.
pub(crate) unsafe fn destroy(comm: *mut RecvComm) {
    // SAFETY: forwarded contract; tags overwritten as in `send::destroy`.
    unsafe {
        (*comm).tag = DEAD_TAG;
        for s in (*comm).slots.iter_mut() {
            s.tag = DEAD_TAG;
        }
        drop(Box::from_raw(comm));
    }
}
