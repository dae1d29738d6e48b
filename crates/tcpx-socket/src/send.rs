//! The send side of a connection: a fixed ring of 16 request slots and the per-socket
//! transmit cursors that `test` drives.
//!
//! `isend` only records the request; bytes move only inside `test` (the TCPX behaviour the
//! layers above must cope with). Each socket walks the posted messages in sequence order and
//! writes the parts the striping rule ([`crate::wire::Stripe`]) gives it, header and payload in
//! one `sendmsg`.
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
    /// Every message before `seq` has been handled on this socket (sent or not carried).
    seq: u64,
    /// True while a part of message `seq` is being written.
    active: bool,
    hdr: [u8; FRAME_LEN],
    hdr_sent: usize,
    start: usize,
    off: usize,
    end: usize,
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
            tx: (0..n)
                .map(|_| TxCursor {
                    seq: 0,
                    active: false,
                    hdr: [0; FRAME_LEN],
                    hdr_sent: 0,
                    start: 0,
                    off: 0,
                    end: 0,
                })
                .collect(),
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
        let nparts = self.stripe.nparts(size32) as u8;
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
        self.progress()?;
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
        let sock = &socks[j];
        for _ in 0..SYSCALL_BUDGET {
            if !cur.active {
                // Messages before `head` are complete, so this socket carries nothing of them
                // (and their slots may already hold newer requests).
                cur.seq = cur.seq.max(*head);
                loop {
                    if cur.seq >= *posted {
                        return Ok(());
                    }
                    let slot = &slots[(cur.seq % MAX_REQUESTS as u64) as usize];
                    if let Some(part) = stripe.part_on(cur.seq, slot.size, j) {
                        let (start, end) = stripe.range(slot.size, part);
                        cur.hdr = FrameHeader {
                            seq: cur.seq as u32,
                            total: slot.size,
                            part: part as u8,
                            nparts: slot.nparts,
                        }
                        .encode();
                        cur.hdr_sent = 0;
                        cur.start = start;
                        cur.off = start;
                        cur.end = end;
                        cur.active = true;
                        break;
                    }
                    cur.seq += 1;
                }
            }
            let slot = &mut slots[(cur.seq % MAX_REQUESTS as u64) as usize];
            let payload: &[u8] = if cur.end > cur.off {
                // SAFETY: isend's contract keeps `data..data+size` valid and unmodified until
                // the request completes; [off, end) lies within [0, size) by the striping rule.
                unsafe { std::slice::from_raw_parts(slot.data.add(cur.off), cur.end - cur.off) }
            } else {
                &[]
            };
            let bufs = [
                IoSlice::new(&cur.hdr[cur.hdr_sent..]),
                IoSlice::new(payload),
            ];
            let n = match sock::send_vectored(sock, &bufs)? {
                Io::Moved(n) => n,
                Io::WouldBlock | Io::Eof => return Ok(()),
            };
            let from_hdr = n.min(FRAME_LEN - cur.hdr_sent);
            cur.hdr_sent += from_hdr;
            cur.off += n - from_hdr;
            if cur.hdr_sent == FRAME_LEN && cur.off == cur.end {
                slot.parts_done += 1;
                cur.active = false;
                cur.seq += 1;
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
