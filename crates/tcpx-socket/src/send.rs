//! The send side of a connection: a fixed ring of 16 request slots and the per-socket
//! transmit cursors that `test` drives.
//!
//! `isend` only records the request (and encodes the frame headers of its parts); bytes move
//! only inside `test` (the TCPX behaviour the layers above must cope with). Each socket walks
//! the posted messages in sequence order and writes the parts the striping rule
//! ([`crate::wire::Stripe`]) gives it: every part it has queued, header and payload each an
//! iovec, goes out in **one** `sendmsg` (at most [`IOV_CAP`] iovecs, more parts only while the
//! call holds under [`GATHER_BYTES`]). Many small messages thus cost one system call, not one
//! each, and a large one costs what it did: its payload is handed to the kernel straight from
//! the caller's buffer. A short write means the socket buffer is full; the cursor resumes
//! inside the part (even inside its header) at the next `test`.
//!
//! Devmem emulation: a send from CUDA memory (registered as `NCCL_PTR_CUDA`) is copied to the
//! slot's host staging buffer when it is posted (a synchronous device-to-host copy), and the
//! sockets send from there.
//!
//! Threading: a comm is used by one thread at a time (NCCL's contract), so its state is plain
//! data behind a raw pointer, with no lock on the data path.

use std::ffi::c_void;
use std::io::{self, IoSlice};
use std::net::TcpStream;

use tcpx_sys::{ResultCode, MAX_REQUESTS};

use crate::fault::{Action, Gate, Side as FaultSide};
use crate::log::log_warn;
use crate::object::{DEAD_TAG, SEND_REQ_TAG, SEND_TAG};
use crate::sock::{self, Io};
use crate::wire::{FrameHeader, Stripe, FRAME_LEN};

/// Send/receive syscalls per socket per `test` call: enough to move several MiB, few enough
/// that a call returns promptly even when the peer drains as fast as we write.
pub(crate) const SYSCALL_BUDGET: usize = 32;

/// Iovecs of one `sendmsg`: a header and a payload for each of the 16 messages a comm can have
/// in flight, so every queued part fits in one call (Linux allows 1024, `UIO_MAXIOV`).
pub(crate) const IOV_CAP: usize = 2 * MAX_REQUESTS;
const _: () = assert!(IOV_CAP <= 1024);

/// Bytes past which one `sendmsg` takes no further part: more than a socket buffer holds, so
/// the limit never costs a call while the peer keeps up, and a queue of large messages is not
/// walked for iovecs the kernel cannot take anyway.
pub(crate) const GATHER_BYTES: usize = 8 << 20;

const RING: u64 = MAX_REQUESTS as u64;

fn ring_index(seq: u64) -> usize {
    (seq % RING) as usize
}

/// One request slot; a pointer to it is the `request` handed to the caller.
#[repr(C)]
pub(crate) struct SendSlot {
    tag: u64,
    comm: *mut SendComm,
    index: usize,
    seq: u64,
    data: *const u8,
    size: u32,
    nparts: u8,
    parts_done: u8,
}

/// Where one socket stands in the stream of parts it carries.
struct TxCursor {
    /// Every message before `seq` has been handled on this socket (sent or not carried); while
    /// `active`, `seq` is the message whose part is being written.
    seq: u64,
    /// True while a part of message `seq` is being written.
    active: bool,
    /// Bytes of the active part's header already written.
    hdr_sent: usize,
    /// The active part's payload is `[start, end)` of its message; `[start, off)` is written.
    start: usize,
    off: usize,
    end: usize,
    /// The encoded header of the part this socket carries of the message in each ring slot
    /// (written by `isend`; a slot is reused only once every part of its message is written).
    hdrs: [[u8; FRAME_LEN]; MAX_REQUESTS],
}

impl TxCursor {
    fn new() -> Self {
        Self {
            seq: 0,
            active: false,
            hdr_sent: 0,
            start: 0,
            off: 0,
            end: 0,
            hdrs: [[0; FRAME_LEN]; MAX_REQUESTS],
        }
    }

    /// Makes the first part socket `j` carries of the messages `from..posted` active; false
    /// (and `seq = posted`) when it carries none of them.
    fn begin_next(
        &mut self,
        slots: &[SendSlot; MAX_REQUESTS],
        stripe: &Stripe,
        from: u64,
        posted: u64,
        j: usize,
    ) -> bool {
        for m in from..posted {
            let size = slots[ring_index(m)].size;
            if let Some(part) = stripe.part_on(m, size, j) {
                let (start, end) = stripe.range(size, part);
                *self = Self {
                    seq: m,
                    active: true,
                    hdr_sent: 0,
                    start,
                    off: start,
                    end,
                    hdrs: self.hdrs,
                };
                return true;
            }
        }
        self.seq = posted.max(from);
        self.active = false;
        false
    }

    /// Fills `iov` with what socket `j` writes next: the rest of the active part, then every
    /// later posted part it carries (while iovecs last and under [`GATHER_BYTES`]). Returns the
    /// number of iovecs and of bytes.
    fn gather<'a>(
        &'a self,
        slots: &[SendSlot; MAX_REQUESTS],
        stripe: &Stripe,
        posted: u64,
        j: usize,
        iov: &mut [IoSlice<'a>; IOV_CAP],
    ) -> (usize, usize) {
        let (mut count, mut bytes) = (0, 0);
        let mut push = |b: &'a [u8], count: &mut usize, bytes: &mut usize| {
            if !b.is_empty() {
                iov[*count] = IoSlice::new(b);
                *count += 1;
                *bytes += b.len();
            }
        };
        let first = &slots[ring_index(self.seq)];
        push(
            &self.hdrs[ring_index(self.seq)][self.hdr_sent..],
            &mut count,
            &mut bytes,
        );
        // SAFETY: isend's contract keeps `data..data+size` valid and unmodified until the
        // request completes, and this part is not complete; [off, end) ⊆ [0, size) by the
        // striping rule.
        let rest = unsafe { payload(first.data, self.off, self.end) };
        push(rest, &mut count, &mut bytes);
        for m in self.seq + 1..posted {
            if count + 2 > IOV_CAP || bytes >= GATHER_BYTES {
                break;
            }
            let slot = &slots[ring_index(m)];
            if let Some(part) = stripe.part_on(m, slot.size, j) {
                let (start, end) = stripe.range(slot.size, part);
                push(&self.hdrs[ring_index(m)], &mut count, &mut bytes);
                // SAFETY: isend's contract keeps request `m`'s `data..data+size` valid and
                // unmodified until it completes, which cannot happen before this socket wrote
                // its part; [start, end) ⊆ [0, size) by the striping rule.
                let whole = unsafe { payload(slot.data, start, end) };
                push(whole, &mut count, &mut bytes);
            }
        }
        (count, bytes)
    }

    /// Accounts `n` bytes written from what [`Self::gather`] returned (same slots, same
    /// `posted`): completes the parts they cover and leaves the cursor inside the next one.
    fn advance(
        &mut self,
        slots: &mut [SendSlot; MAX_REQUESTS],
        stripe: &Stripe,
        posted: u64,
        j: usize,
        mut n: usize,
    ) {
        loop {
            let h = n.min(FRAME_LEN - self.hdr_sent);
            self.hdr_sent += h;
            n -= h;
            let p = n.min(self.end - self.off);
            self.off += p;
            n -= p;
            if self.hdr_sent < FRAME_LEN || self.off < self.end {
                debug_assert_eq!(n, 0, "bytes written beyond an incomplete part");
                return;
            }
            slots[ring_index(self.seq)].parts_done += 1;
            let next = self.seq + 1;
            if !self.begin_next(slots, stripe, next, posted, j) || n == 0 {
                debug_assert_eq!(n, 0, "bytes written beyond the queued parts");
                return;
            }
        }
    }
}

/// `[start, end)` of the message at `data` (empty without touching `data` when the range is).
///
/// # Safety
/// When `start < end`, `data..data+end` is readable and not written for the returned lifetime.
unsafe fn payload<'a>(data: *const u8, start: usize, end: usize) -> &'a [u8] {
    if start >= end {
        return &[];
    }
    // SAFETY: forwarded contract: the range is non-empty and readable.
    unsafe { std::slice::from_raw_parts(data.add(start), end - start) }
}

/// A send comm (the `sendComm` handed to callers).
#[repr(C)]
pub(crate) struct SendComm {
    tag: u64,
    slots: [SendSlot; MAX_REQUESTS],
    socks: Vec<TcpStream>,
    tx: Vec<TxCursor>,
    stripe: Stripe,
    /// Host staging of CUDA sources, per slot (devmem emulation; empty otherwise).
    stages: [Vec<u8>; MAX_REQUESTS],
    /// Sequence number of the next isend.
    posted: u64,
    /// Oldest request not yet reported done.
    head: u64,
    failed: Option<ResultCode>,
    name: String,
    fault: Gate,
}

impl SendComm {
    /// A comm over connected data sockets (index order = socket index of the striping rule).
    pub(crate) fn new(socks: Vec<TcpStream>, name: String) -> Box<Self> {
        let n = socks.len();
        let mut comm = Box::new(Self {
            tag: SEND_TAG,
            slots: std::array::from_fn(|i| SendSlot {
                tag: SEND_REQ_TAG,
                comm: std::ptr::null_mut(),
                index: i,
                seq: 0,
                data: std::ptr::null(),
                size: 0,
                nparts: 0,
                parts_done: 0,
            }),
            socks,
            tx: (0..n).map(|_| TxCursor::new()).collect(),
            stripe: Stripe { nsocks: n },
            stages: Default::default(),
            posted: 0,
            head: 0,
            failed: None,
            name,
            fault: Gate::new(FaultSide::Send),
        });
        let me: *mut SendComm = &mut *comm;
        for s in comm.slots.iter_mut() {
            s.comm = me;
        }
        comm
    }

    /// Name for log lines.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// `isend`: records the request, or `None` when 16 are in flight (busy). `cuda`: `data` is
    /// CUDA memory (devmem emulation), copied to host staging here.
    pub(crate) fn post(
        &mut self,
        data: *const u8,
        size: usize,
        cuda: bool,
    ) -> Result<Option<*mut c_void>, ResultCode> {
        if let Some(code) = self.failed {
            return Err(code);
        }
        if self.posted - self.head >= MAX_REQUESTS as u64 {
            return Ok(None);
        }
        let Ok(size32) = u32::try_from(size) else {
            log_warn!(
                "tcpx-socket: {}: isend of {size} bytes is too large",
                self.name
            );
            return Err(ResultCode::INVALID_ARGUMENT);
        };
        let seq = self.posted;
        let index = (seq % MAX_REQUESTS as u64) as usize;
        let data = if cuda && size > 0 {
            self.stage_from_device(index, data, size)?
        } else {
            data
        };
        let nparts = self.stripe.nparts(size32);
        // Headers are encoded once here, so `test` gathers them like payload: the slot is free
        // (its previous message completed), so no socket is still writing its old header.
        for part in 0..nparts {
            self.tx[self.stripe.socket_of(seq, part)].hdrs[index] = FrameHeader {
                seq: seq as u32,
                total: size32,
                part: part as u8,
                nparts: nparts as u8,
            }
            .encode();
        }
        let nparts = nparts as u8;
        let slot = &mut self.slots[index];
        slot.seq = seq;
        slot.data = data;
        slot.size = size32;
        slot.nparts = nparts;
        slot.parts_done = 0;
        self.posted += 1;
        Ok(Some((slot as *mut SendSlot).cast()))
    }

    /// Copies `size` bytes of CUDA memory at `src` into slot `index`'s staging buffer. The slot
    /// is free (its previous message completed), so no socket reads the staging buffer.
    fn stage_from_device(
        &mut self,
        index: usize,
        src: *const u8,
        size: usize,
    ) -> Result<*const u8, ResultCode> {
        let Some(gpu) = crate::device::devmem_gpu() else {
            log_warn!(
                "tcpx-socket: {}: isend from CUDA memory without devmem emulation",
                self.name
            );
            return Err(ResultCode::INVALID_USAGE);
        };
        let stage = &mut self.stages[index];
        if stage.len() < size {
            stage.resize(size, 0);
        }
        let dst = stage.as_mut_ptr();
        // SAFETY: `dst` has `size` writable bytes and no reference to them is alive during the
        // call; `src..src+size` lies in a CUDA registration of the devmem GPU (checked by
        // `mr::check` and at `regMr`), which isend's contract keeps valid.
        let copied = gpu.scoped(|g| unsafe { g.dtoh(dst, src as u64, size) });
        if let Err(e) = copied {
            log_warn!(
                "tcpx-socket: {}: isend of {size} bytes from CUDA memory {src:p}: {e}",
                self.name
            );
            return Err(ResultCode::UNHANDLED_CUDA_ERROR);
        }
        Ok(dst.cast_const())
    }

    /// `test` on the request in slot `index` with sequence number `seq`: drives every socket,
    /// then reports whether that request is done (with its size).
    pub(crate) fn test(&mut self, index: usize, seq: u64) -> Result<Option<u32>, ResultCode> {
        if let Some(code) = self.failed {
            return Err(code);
        }
        let head_index = (self.head % MAX_REQUESTS as u64) as usize;
        if self.head == self.posted || seq != self.head || index != head_index {
            log_warn!(
                "tcpx-socket: {}: test on send request #{seq} but the oldest outstanding is {} \
                 (requests must be tested in posting order)",
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
        // A complete request needs no socket work: its successors are driven when they are
        // tested, and a caller draining completions pays no system call per request.
        if self.slots[index].parts_done < self.slots[index].nparts {
            self.progress()?;
        }
        let slot = &self.slots[index];
        if slot.parts_done == slot.nparts && self.fault.release(seq) {
            self.head += 1;
            self.fault.completed(slot.size);
            Ok(Some(slot.size))
        } else {
            Ok(None)
        }
    }

    fn progress(&mut self) -> Result<(), ResultCode> {
        for j in 0..self.socks.len() {
            if let Err(err) = self.progress_socket(j) {
                let cur = &self.tx[j];
                let slot = &self.slots[(cur.seq % MAX_REQUESTS as u64) as usize];
                let code = match err.kind() {
                    io::ErrorKind::BrokenPipe
                    | io::ErrorKind::ConnectionReset
                    | io::ErrorKind::ConnectionAborted
                    | io::ErrorKind::UnexpectedEof => ResultCode::REMOTE_ERROR,
                    _ => ResultCode::SYSTEM_ERROR,
                };
                let (written, part_len) = if cur.active {
                    (cur.off - cur.start, cur.end - cur.start)
                } else {
                    (0, 0)
                };
                log_warn!(
                    "tcpx-socket: {}: send failed on socket {j} during message #{} ({} bytes): \
                     {written} of the {part_len} payload bytes this socket carries were written, \
                     {} missing: {err}; the comm is failed",
                    self.name,
                    cur.seq,
                    slot.size,
                    part_len - written
                );
                self.failed = Some(code);
                return Err(code);
            }
        }
        Ok(())
    }

    /// Writes what socket `j` has queued, one `sendmsg` for all of it, until the queue is empty,
    /// the socket buffer is full (a short write) or the syscall budget is spent.
    fn progress_socket(&mut self, j: usize) -> io::Result<()> {
        let Self {
            slots,
            socks,
            tx,
            stripe,
            posted,
            head,
            ..
        } = self;
        let cur = &mut tx[j];
        for _ in 0..SYSCALL_BUDGET {
            // Messages before `head` are complete, so this socket carries nothing of them (and
            // their slots may already hold newer requests).
            if !cur.active && !cur.begin_next(slots, stripe, cur.seq.max(*head), *posted, j) {
                return Ok(());
            }
            let mut iov = [IoSlice::new(&[]); IOV_CAP];
            let (count, want) = cur.gather(slots, stripe, *posted, j, &mut iov);
            let n = match sock::send_vectored(&socks[j], &iov[..count])? {
                Io::Moved(n) => n,
                Io::WouldBlock | Io::Eof => return Ok(()),
            };
            cur.advance(slots, stripe, *posted, j, n);
            if n < want {
                return Ok(());
            }
        }
        Ok(())
    }
}

/// Reads the comm and position of a send request.
///
/// # Safety
/// `req` points at a live [`SendSlot`] (its tag was checked by the caller).
pub(crate) unsafe fn slot_info(req: *const SendSlot) -> (*mut SendComm, usize, u64) {
    // SAFETY: forwarded contract; plain field reads, no reference kept.
    unsafe { ((*req).comm, (*req).index, (*req).seq) }
}

/// Frees a send comm; requests in flight are abandoned.
///
/// # Safety
/// `comm` came from `Box::into_raw` of a [`SendComm`] and is not used afterwards.
pub(crate) unsafe fn destroy(comm: *mut SendComm) {
    // SAFETY: forwarded contract. Tags are overwritten so a stale pointer is recognized while
    // the memory is not reused.
    unsafe {
        (*comm).tag = DEAD_TAG;
        for s in (*comm).slots.iter_mut() {
            s.tag = DEAD_TAG;
        }
        drop(Box::from_raw(comm));
    }
}
