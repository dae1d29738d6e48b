//! Comms: [`ListenComm`], [`SendComm`], [`RecvComm`], and the non-blocking connection set-up
//! ([`PendingConnect`], [`PendingAccept`]) the blocking helpers drive to completion.
//!
//! Threading: the ncclNet contract lets one thread at a time drive a comm. Every data-path call
//! (`isend`, `irecv`, `test`, `consumed`) therefore takes `&mut self`, and comms are `Send` but
//! not `Sync`. Registration and deregistration may happen from other threads (NCCL registers
//! user buffers while its proxy thread progresses), which is why [`MemoryRegion`] can move.

use std::ffi::{c_int, c_void};
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tcpx_sys::{ncclNetDeviceHandle_v8_t, NCCL_NET_DEVICE_UNPACK, NCCL_NET_DEVICE_UNPACK_VERSION};

use crate::call::call;
use crate::error::{Error, ErrorKind, Result};
use crate::handle::ConnectHandle;
use crate::memory::SharedMemory;
use crate::net::Net;
use inner::{CommInner, Side};
use request::{DroppedDone, RequestCore, RequestState};
pub use request::{RecvRequest, SendRequest};

// What a comm shares with its regions and requests sits below both, so that requests (which
// hold the comm alive) and the comms that make, test and consume them never import each other.
mod inner;
mod request;

static NEXT_COMM_ID: AtomicU64 = AtomicU64::new(1);

/// A listening comm on one device, with the handle a peer connects with.
pub struct ListenComm {
    net: Net,
    raw: *mut c_void,
    device: usize,
    handle: ConnectHandle,
}

// SAFETY: a listen comm is only driven through `&mut self` (accept) and closed once in Drop.
unsafe impl Send for ListenComm {}

impl std::fmt::Debug for ListenComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ListenComm")
            .field("device", &self.device)
            .field("handle", &self.handle)
            .finish()
    }
}

impl Net {
    /// Starts listening on `device`; the handle goes to the peer out of band.
    pub fn listen(&self, device: usize) -> Result<ListenComm> {
        let dev = c_int::try_from(device)
            .map_err(|_| Error::invalid("listen", format!("device index {device}")))?;
        let mut handle = ConnectHandle([0; ConnectHandle::SIZE]);
        let mut raw = ptr::null_mut();
        call(
            "listen",
            || format!("device {device}"),
            // SAFETY: `handle` has HANDLE_SIZE writable bytes; `raw` is a valid out pointer.
            || unsafe {
                self.inner
                    .plugin
                    .listen(dev, handle.0.as_mut_ptr().cast(), &mut raw)
            },
        )?;
        if raw.is_null() {
            return Err(Error::new(
                "listen",
                ErrorKind::Contract("success with a NULL listen comm".into()),
                format!("device {device}"),
            ));
        }
        Ok(ListenComm {
            net: self.clone(),
            raw,
            device,
            handle,
        })
    }

    /// Starts connecting to the peer whose listen handle is `handle`, from `device`.
    pub fn begin_connect(&self, device: usize, handle: &ConnectHandle) -> Result<PendingConnect> {
        let dev = c_int::try_from(device)
            .map_err(|_| Error::invalid("connect", format!("device index {device}")))?;
        Ok(PendingConnect {
            net: self.clone(),
            device,
            dev,
            // Boxed: TCPX keeps connect state inside the handle, so every retry must pass the
            // same buffer at the same address.
            handle: Box::new(handle.0),
            dev_handle: Box::new(preset_device_handle()),
            dev_handle_ptr: ptr::null_mut(),
        })
    }

    /// Connects to `handle` from `device`, retrying until ready or `timeout`.
    pub fn connect(
        &self,
        device: usize,
        handle: &ConnectHandle,
        timeout: Duration,
    ) -> Result<SendComm> {
        let mut pending = self.begin_connect(device, handle)?;
        drive(
            timeout,
            "connect",
            || format!("device {device}"),
            || pending.poll(),
        )
    }

    fn new_comm(&self, raw: *mut c_void, side: Side, device: usize) -> Arc<CommInner> {
        Arc::new(CommInner {
            net: self.clone(),
            raw,
            side,
            device,
            id: NEXT_COMM_ID.fetch_add(1, Ordering::Relaxed),
            poisoned: AtomicBool::new(false),
            abandoned: Mutex::new(Vec::new()),
            closing: AtomicBool::new(false),
        })
    }
}

/// The device handle a TCPX-style caller presets: UNPACK, version 7. A host plugin overwrites
/// it with HOST; TCPX fills in the unpack queue.
fn preset_device_handle() -> ncclNetDeviceHandle_v8_t {
    ncclNetDeviceHandle_v8_t {
        netDeviceType: NCCL_NET_DEVICE_UNPACK,
        netDeviceVersion: NCCL_NET_DEVICE_UNPACK_VERSION,
        ..Default::default()
    }
}

/// Polls `step` until it yields a value or `timeout` passes, backing off from spinning to
/// short sleeps so a slow peer does not burn a core.
fn drive<T>(
    timeout: Duration,
    api: &'static str,
    context: impl Fn() -> String,
    mut step: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    let deadline = Instant::now() + timeout;
    let mut idle = 0u32;
    loop {
        if let Some(value) = step()? {
            return Ok(value);
        }
        if Instant::now() >= deadline {
            return Err(Error::new(api, ErrorKind::Timeout(timeout), context()));
        }
        idle += 1;
        if idle < 64 {
            std::hint::spin_loop();
        } else if idle < 256 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

impl ListenComm {
    /// The handle to give the peer.
    pub fn handle(&self) -> &ConnectHandle {
        &self.handle
    }

    /// The device this comm listens on.
    pub fn device(&self) -> usize {
        self.device
    }

    /// Starts accepting one connection (non-blocking; poll the result).
    pub fn begin_accept(&mut self) -> PendingAccept<'_> {
        PendingAccept {
            listen: self,
            dev_handle: Box::new(preset_device_handle()),
            dev_handle_ptr: ptr::null_mut(),
        }
    }

    /// Accepts one connection, retrying until ready or `timeout`.
    pub fn accept(&mut self, timeout: Duration) -> Result<RecvComm> {
        let device = self.device;
        let mut pending = self.begin_accept();
        drive(
            timeout,
            "accept",
            || format!("device {device}"),
            || pending.poll(),
        )
    }
}

impl Drop for ListenComm {
    fn drop(&mut self) {
        // SAFETY: live listen comm, closed exactly once.
        match unsafe { self.net.inner.plugin.close_listen(self.raw) } {
            Ok(code) if code.is_success() => {}
            other => {
                tracing::warn!(target: "tcpx", device = self.device, result = ?other, "closeListen failed")
            }
        }
    }
}

/// A connection in progress from this side (the sender).
pub struct PendingConnect {
    net: Net,
    device: usize,
    dev: c_int,
    handle: Box<[u8; ConnectHandle::SIZE]>,
    dev_handle: Box<ncclNetDeviceHandle_v8_t>,
    dev_handle_ptr: *mut ncclNetDeviceHandle_v8_t,
}

// SAFETY: the pending state is plain memory the plugin reads during `poll` (`&mut self`).
unsafe impl Send for PendingConnect {}

impl PendingConnect {
    /// One non-blocking attempt: `Ok(None)` while the plugin is not ready.
    pub fn poll(&mut self) -> Result<Option<SendComm>> {
        let mut raw = ptr::null_mut();
        self.dev_handle_ptr = &mut *self.dev_handle;
        let plugin = &self.net.inner.plugin;
        call(
            "connect",
            || format!("device {}", self.device),
            // SAFETY: the handle buffer and the device-handle slot are boxed, so their addresses are
            // the same on every retry, and live as long as `self`.
            || unsafe {
                plugin.connect(
                    self.dev,
                    self.handle.as_mut_ptr().cast(),
                    &mut raw,
                    &mut self.dev_handle_ptr,
                )
            },
        )?;
        if raw.is_null() {
            return Ok(None);
        }
        Ok(Some(SendComm {
            inner: self.net.new_comm(raw, Side::Send, self.device),
        }))
    }
}

/// An accept in progress on a [`ListenComm`].
pub struct PendingAccept<'l> {
    listen: &'l mut ListenComm,
    dev_handle: Box<ncclNetDeviceHandle_v8_t>,
    dev_handle_ptr: *mut ncclNetDeviceHandle_v8_t,
}

impl PendingAccept<'_> {
    /// One non-blocking attempt: `Ok(None)` while no peer has fully connected.
    pub fn poll(&mut self) -> Result<Option<RecvComm>> {
        let mut raw = ptr::null_mut();
        if self.dev_handle_ptr.is_null() {
            self.dev_handle_ptr = &mut *self.dev_handle;
        }
        let listen = &*self.listen;
        let plugin = &listen.net.inner.plugin;
        let has_handles = plugin.has_device_handles();
        call(
            "accept",
            || format!("device {}", listen.device),
            // SAFETY: live listen comm; the device-handle slot is boxed and stable across retries.
            || unsafe {
                plugin.accept(
                    listen.raw,
                    &mut raw,
                    if has_handles {
                        &mut self.dev_handle_ptr
                    } else {
                        ptr::null_mut()
                    },
                )
            },
        )?;
        if raw.is_null() {
            return Ok(None);
        }
        let device_handle = if !has_handles || self.dev_handle_ptr.is_null() {
            None
        } else if ptr::eq(self.dev_handle_ptr, &*self.dev_handle) {
            Some(*self.dev_handle)
        } else {
            // SAFETY: the plugin replaced the slot with a handle it owns (NCCL-style); it stays
            // valid while the comm lives. We copy it.
            Some(unsafe { *self.dev_handle_ptr })
        };
        let inner = listen.net.new_comm(raw, Side::Recv, listen.device);
        Ok(Some(RecvComm {
            inner,
            device_handle,
            needs_consume: has_handles,
            next_seq: 0,
            next_consume: 0,
            dropped_done: Arc::new(DroppedDone::default()),
        }))
    }
}

/// A memory registration on one comm. Keeps the comm and the memory alive; deregistered on drop.
pub struct MemoryRegion {
    pub(crate) comm: Arc<CommInner>,
    pub(crate) mhandle: *mut c_void,
    pub(crate) memory: SharedMemory,
}

// SAFETY: `mhandle` is an opaque token; deregMr may run on any thread (see module docs).
unsafe impl Send for MemoryRegion {}
// SAFETY: `&MemoryRegion` only exposes the token for posting (on the comm's own thread).
unsafe impl Sync for MemoryRegion {}

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("comm", &self.comm.label())
            .field("memory", &self.memory)
            .finish()
    }
}

impl MemoryRegion {
    /// The registered memory.
    pub fn memory(&self) -> &SharedMemory {
        &self.memory
    }

    /// The plugin's registration handle (for device-side consumers).
    pub fn raw_handle(&self) -> *mut c_void {
        self.mhandle
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        let plugin = &self.comm.net.inner.plugin;
        // SAFETY: registered on this comm, deregistered once; the comm is alive (we hold it).
        match unsafe { plugin.dereg_mr(self.comm.raw, self.mhandle) } {
            Ok(code) if code.is_success() => {}
            other => {
                tracing::warn!(target: "tcpx", comm = %self.comm.label(), result = ?other, "deregMr failed")
            }
        }
    }
}

fn register(comm: &Arc<CommInner>, memory: &SharedMemory) -> Result<MemoryRegion> {
    let plugin = &comm.net.inner.plugin;
    let mut mhandle = ptr::null_mut();
    let (ptr, len, kind) = (memory.as_ptr(), memory.len(), memory.kind());
    call(
        "regMr",
        || {
            format!(
                "{}, {len} bytes of {kind:?} memory at {ptr:p}",
                comm.label()
            )
        },
        // SAFETY: `memory` is `len` bytes of `kind`, kept alive by the region we return.
        || unsafe { plugin.reg_mr(comm.raw, ptr.cast(), len, kind.ptr_type(), &mut mhandle) },
    )?;
    Ok(MemoryRegion {
        comm: comm.clone(),
        mhandle,
        memory: memory.clone(),
    })
}

fn check_region(
    api: &'static str,
    comm: &Arc<CommInner>,
    region: &MemoryRegion,
    offset: usize,
    len: usize,
) -> Result<c_int> {
    if !Arc::ptr_eq(comm, &region.comm) {
        return Err(Error::invalid(
            api,
            format!(
                "region registered on {} used on {}",
                region.comm.label(),
                comm.label()
            ),
        ));
    }
    region.memory.check_range(api, offset, len)?;
    c_int::try_from(len).map_err(|_| {
        Error::invalid(
            api,
            format!("{len} bytes exceeds the plugin's int message size"),
        )
    })
}

/// The sending end of a connection.
pub struct SendComm {
    pub(crate) inner: Arc<CommInner>,
}

impl std::fmt::Debug for SendComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.inner.label())
    }
}

impl SendComm {
    /// Registers `memory` with this comm.
    pub fn register(&self, memory: &SharedMemory) -> Result<MemoryRegion> {
        register(&self.inner, memory)
    }

    /// Posts a send of `region[offset..offset+len]`. `Ok(None)` means the plugin is busy (its
    /// window is full): test the oldest request and retry.
    pub fn isend(
        &mut self,
        region: &MemoryRegion,
        offset: usize,
        len: usize,
        tag: i32,
    ) -> Result<Option<SendRequest>> {
        self.inner.check_usable("isend")?;
        let size = check_region("isend", &self.inner, region, offset, len)?;
        let op = region.memory.begin_operation("isend")?;
        let mut req = ptr::null_mut();
        let plugin = &self.inner.net.inner.plugin;
        call(
            "isend",
            || format!("{}, {len} bytes at offset {offset}", self.inner.label()),
            // SAFETY: range checked; the memory stays alive and counted in flight (`op`) until the
            // request completes or the comm closes.
            || unsafe {
                plugin.isend(
                    self.inner.raw,
                    region.memory.as_ptr().add(offset).cast(),
                    size,
                    tag,
                    region.mhandle,
                    &mut req,
                )
            },
        )?;
        if req.is_null() {
            return Ok(None);
        }
        Ok(Some(SendRequest::new(req, self.inner.clone(), op, len)))
    }

    /// Tests `request` (which must be this comm's oldest): `Some(len)` once sent, `len` being
    /// the posted length. A send completes whole or fails; like NCCL, the size a plugin may
    /// report for a send is not read (some plugins, e.g. nccl-fastsocket, never write it).
    pub fn test(&mut self, request: &mut SendRequest) -> Result<Option<usize>> {
        test_request(
            &self.inner,
            &mut request.state,
            "test (send)",
            SizeRule::Posted,
        )
    }

    /// The comm's identity in logs and errors.
    pub fn label(&self) -> String {
        self.inner.label()
    }
}

/// The receiving end of a connection.
pub struct RecvComm {
    pub(crate) inner: Arc<CommInner>,
    device_handle: Option<ncclNetDeviceHandle_v8_t>,
    /// v7+ tables get `irecvConsumed`; v6 has none.
    needs_consume: bool,
    next_seq: u64,
    next_consume: u64,
    /// Requests dropped after `test` said done but before being consumed, by sequence number:
    /// consumed on their turn so the plugin sees FIFO order.
    pub(crate) dropped_done: Arc<DroppedDone>,
}

// SAFETY: the device handle is plain data copied from the plugin; see CommInner for the comm.
unsafe impl Send for RecvComm {}

impl std::fmt::Debug for RecvComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.inner.label())
    }
}

impl RecvComm {
    /// Registers `memory` with this comm.
    pub fn register(&self, memory: &SharedMemory) -> Result<MemoryRegion> {
        register(&self.inner, memory)
    }

    /// The device handle the plugin filled at accept (type UNPACK for TCPX, HOST otherwise).
    ///
    /// For an UNPACK (version 7) handle — GPUDirect-TCPX, or tcpx-socket with
    /// `TCPX_SOCKET_DEVMEM=1` — `handle` is the *device* address of a 24-byte
    /// `tcpxUnpackDeviceHandle` `{meta, bounce_buf, head}`: copy it to the host once (e.g.
    /// `CudaDevice::copy_raw`) to learn the metadata's device address (pinned host memory mapped
    /// into the GPU; the same address on the host under unified addressing) and the bounce
    /// buffer's. A receive into CUDA memory then lands in the bounce buffer, not in its
    /// destination: after [`test`](Self::test) reports it done, read `cnt[slot]` and
    /// `mem[slot][..cnt]` ([`unpack_slot`](Self::unpack_slot) gives `slot`), gather the
    /// fragments into the destination (`tcpx::cuda::unpack`), wait for the gather, and only then
    /// call [`consumed`](Self::consumed): until then the slot and its bounce pages stay yours.
    pub fn device_handle(&self) -> Option<&ncclNetDeviceHandle_v8_t> {
        self.device_handle.as_ref()
    }

    /// The unpack slot of a receive of this comm: TCPX's `tail % 16`, i.e. the request's
    /// position in this comm's posting order ([`RecvRequest::sequence`]) modulo 16. Every
    /// successful [`irecv`](Self::irecv) takes the next position; a busy answer takes none. A
    /// consumer that drives the plugin directly can track it the same way: count successful
    /// irecvs per comm.
    pub fn unpack_slot(&self, request: &RecvRequest) -> usize {
        (request.sequence() % tcpx_sys::MAX_REQUESTS as u64) as usize
    }

    /// Says that this comm is being closed with receives still posted on purpose (a comm
    /// that always keeps receives posted, such as an eager comm of the runtime): dropping
    /// them poisons the comm as usual, without the warning a lost request deserves.
    pub fn closing(&self) {
        self.inner.closing.store(true, Ordering::Relaxed);
    }

    /// Posts a receive of at most `len` bytes into `region[offset..]`. `Ok(None)`: busy.
    pub fn irecv(
        &mut self,
        region: &MemoryRegion,
        offset: usize,
        len: usize,
        tag: i32,
    ) -> Result<Option<RecvRequest>> {
        self.inner.check_usable("irecv")?;
        let size = check_region("irecv", &self.inner, region, offset, len)?;
        self.flush_dropped()?;
        let op = region.memory.begin_operation("irecv")?;
        let mut req = ptr::null_mut();
        let plugin = &self.inner.net.inner.plugin;
        let mut data = region.memory.as_ptr().wrapping_add(offset).cast::<c_void>();
        let mut sizes = size;
        let mut tags = tag;
        let mut mh = region.mhandle;
        call(
            "irecv",
            || format!("{}, {len} bytes at offset {offset}", self.inner.label()),
            // SAFETY: one-element arrays live across the call; the range is checked and the memory
            // stays alive and counted in flight (`op`) until completion or close.
            || unsafe {
                plugin.irecv(
                    self.inner.raw,
                    1,
                    &mut data,
                    &mut sizes,
                    &mut tags,
                    &mut mh,
                    &mut req,
                )
            },
        )?;
        if req.is_null() {
            return Ok(None);
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        Ok(Some(RecvRequest::new(
            req,
            self.inner.clone(),
            op,
            len,
            seq,
            self.dropped_done.clone(),
        )))
    }

    /// Tests `request` (which must be this comm's oldest): `Some(size)` once received. The
    /// request still holds its slot until [`RecvComm::consumed`].
    ///
    /// `size` is what the plugin reported, or the posted length when the plugin left the size
    /// untouched (NCCL's contract lets v6 host plugins such as nccl-fastsocket skip it). A
    /// reported size above the posted length is a contract error; a shorter one is returned as
    /// is, for the caller to compare with what it expects.
    pub fn test(&mut self, request: &mut RecvRequest) -> Result<Option<usize>> {
        test_request(
            &self.inner,
            &mut request.state,
            "test (recv)",
            SizeRule::Reported,
        )
    }

    /// Tells the plugin the received data has been used (`irecvConsumed`); must follow
    /// completion, in posting order. Frees the plugin's slot.
    pub fn consumed(&mut self, mut request: RecvRequest) -> Result<()> {
        if !Arc::ptr_eq(&request.state.comm, &self.inner) {
            return Err(Error::invalid(
                "irecvConsumed",
                format!(
                    "request of {} consumed on {}",
                    request.state.comm.label(),
                    self.inner.label()
                ),
            ));
        }
        if !matches!(request.state.state, RequestState::Done(_)) {
            return Err(Error::invalid(
                "irecvConsumed",
                format!(
                    "request {} is not done yet ({})",
                    request.seq,
                    self.inner.label()
                ),
            ));
        }
        self.flush_dropped()?;
        if request.seq != self.next_consume {
            return Err(Error::invalid(
                "irecvConsumed",
                format!(
                    "request {} consumed out of order: {} is older ({})",
                    request.seq,
                    self.next_consume,
                    self.inner.label()
                ),
            ));
        }
        request.state.state = RequestState::Consumed;
        self.consume_raw(request.state.raw)
    }

    fn consume_raw(&mut self, raw: *mut c_void) -> Result<()> {
        self.next_consume += 1;
        if !self.needs_consume {
            return Ok(());
        }
        let plugin = &self.inner.net.inner.plugin;
        call(
            "irecvConsumed",
            || self.inner.label(),
            // SAFETY: `raw` completed on this comm and is the oldest unconsumed (checked by callers).
            || unsafe { plugin.irecv_consumed(self.inner.raw, 1, raw) },
        )
    }

    /// Consumes requests that were dropped after completion, when their turn has come.
    fn flush_dropped(&mut self) -> Result<()> {
        while let Some(raw) = self.dropped_done.take(self.next_consume) {
            self.consume_raw(raw as *mut c_void)?;
        }
        Ok(())
    }

    /// The comm's identity in logs and errors.
    pub fn label(&self) -> String {
        self.inner.label()
    }
}

/// How a completed request's size is found.
#[derive(Clone, Copy, PartialEq, Eq)]
enum SizeRule {
    /// Sends: the posted length; the plugin's report is not read.
    Posted,
    /// Receives: the plugin's report, or the posted length if it wrote none.
    Reported,
}

/// Preset in the size a plugin's `test` may fill: no valid size is negative, so a value still
/// equal to it after completion means "not written".
const SIZE_UNSET: c_int = -1;

fn test_request(
    comm: &Arc<CommInner>,
    core: &mut RequestCore,
    api: &'static str,
    rule: SizeRule,
) -> Result<Option<usize>> {
    match core.state {
        RequestState::Done(size) => return Ok(Some(size)),
        RequestState::Consumed => return Err(Error::invalid(api, "request already consumed")),
        RequestState::Failed => {
            return Err(Error::invalid(
                api,
                format!("request already failed ({})", comm.label()),
            ))
        }
        RequestState::Pending => {}
    }
    if !Arc::ptr_eq(comm, &core.comm) {
        return Err(Error::invalid(
            api,
            format!(
                "request of {} tested on {}",
                core.comm.label(),
                comm.label()
            ),
        ));
    }
    comm.check_usable(api)?;
    let mut done: c_int = 0;
    // Sends get a valid pointer too (NCCL passes one and ignores the result), so a plugin that
    // writes the size unconditionally is served; what it writes there is not read.
    let mut size: c_int = SIZE_UNSET;
    let plugin = &comm.net.inner.plugin;
    // SAFETY: a live request of this comm; the plugin enforces the FIFO rule itself.
    let result = call(
        api,
        || comm.label(),
        || unsafe { plugin.test(core.raw, &mut done, &mut size) },
    );
    if let Err(e) = result {
        // The plugin owns a failed request; the memory stays counted until the comm closes.
        core.state = RequestState::Failed;
        if let Some(op) = core.op.take() {
            comm.abandoned
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(op);
        }
        return Err(e);
    }
    if done == 0 {
        return Ok(None);
    }
    let size = if rule == SizeRule::Posted || size == SIZE_UNSET {
        Some(core.len)
    } else {
        usize::try_from(size).ok().filter(|&s| s <= core.len)
    }
    .ok_or_else(|| {
        Error::new(
            api,
            ErrorKind::Contract(format!(
                "completed with size {size} for a {}-byte request",
                core.len
            )),
            comm.label(),
        )
    })?;
    core.state = RequestState::Done(size);
    // Done: the plugin no longer touches the memory.
    core.op = None;
    Ok(Some(size))
}
