//! Shared driver for the integration tests: plugin instances (linked and dlopened), a connected
//! send/recv pair over loopback, registered buffers, and a single-threaded transfer loop with a
//! deadline (progress only happens inside `test`, so one thread can drive both ends).
#![allow(dead_code)]

use std::ffi::{c_char, c_int, c_ulong, c_void, CStr};
use std::io::Write;
use std::net::TcpStream;
use std::path::PathBuf;
use std::ptr::null_mut;
use std::sync::{Mutex, Once, OnceLock};
use std::time::{Duration, Instant};

use proptest::arbitrary::any;
use proptest::collection::vec;
use proptest::prop_oneof;
use proptest::strategy::{Just, Strategy};
use tcpx_socket::wire::Hello;
use tcpx_sys::{
    logger, ncclNetDeviceHandle_v8_t, AbiVersion, NetPlugin, ResultCode, HANDLE_SIZE,
    NCCL_NET_DEVICE_UNPACK, NCCL_NET_DEVICE_UNPACK_VERSION, NCCL_PTR_HOST,
};

/// Every wait in these tests gives up after this long.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// Pins the plugin to `lo` (the house network rule) and installs the log capture. Must be the
/// first line of every test, before any plugin call.
pub fn setup() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        std::env::set_var("TCPX_SOCKET_IFNAME", "lo");
        logger::set_sink(Some(capture));
    });
}

fn logs() -> &'static Mutex<Vec<String>> {
    static LOGS: OnceLock<Mutex<Vec<String>>> = OnceLock::new();
    LOGS.get_or_init(|| Mutex::new(Vec::new()))
}

unsafe extern "C" fn capture(
    _level: c_int,
    _flags: c_ulong,
    _file: *const c_char,
    _line: c_int,
    msg: *const c_char,
) {
    if msg.is_null() {
        return;
    }
    // SAFETY: the shim passes a NUL-terminated message.
    let s = unsafe { CStr::from_ptr(msg) }
        .to_string_lossy()
        .into_owned();
    if std::env::var_os("TCPX_TEST_PRINT_LOGS").is_some() {
        eprintln!("[plugin] {s}");
    }
    logs().lock().unwrap().push(s);
}

/// True if some captured log line contains every one of `parts`.
pub fn logged(parts: &[&str]) -> bool {
    logs()
        .lock()
        .unwrap()
        .iter()
        .any(|l| parts.iter().all(|p| l.contains(p)))
}

/// The linked v8 table, initialized.
pub fn linked() -> &'static NetPlugin {
    setup();
    static P: OnceLock<NetPlugin> = OnceLock::new();
    P.get_or_init(|| {
        // SAFETY: the crate's own table.
        let p = unsafe { NetPlugin::from_static_v8(tcpx_socket::table_v8()) }.unwrap();
        init(&p);
        p
    })
}

/// Path of the built cdylib: cargo puts it next to the test executable (target/<profile>/deps).
pub fn dylib_path() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    let p = deps.join("libtcpx_socket.so");
    assert!(p.exists(), "cdylib not found at {}", p.display());
    p
}

/// The cdylib loaded through dlopen with its newest table (v8).
pub fn loaded_v8() -> &'static NetPlugin {
    setup();
    static P: OnceLock<NetPlugin> = OnceLock::new();
    P.get_or_init(|| {
        let p = NetPlugin::load(dylib_path()).unwrap();
        init(&p);
        p
    })
}

/// The cdylib loaded through dlopen, forced to its v7 table.
pub fn loaded_v7() -> &'static NetPlugin {
    setup();
    static P: OnceLock<NetPlugin> = OnceLock::new();
    P.get_or_init(|| {
        let p = NetPlugin::load_versions(dylib_path(), &[AbiVersion::V7]).unwrap();
        init(&p);
        p
    })
}

fn init(p: &NetPlugin) {
    // SAFETY: the shim logger is callable from any thread for the process lifetime.
    let rc = unsafe { p.init(logger::shim_logger()) }.unwrap();
    assert_eq!(rc, ResultCode::SUCCESS);
}

/// Asserts a plugin call succeeded.
#[track_caller]
pub fn ok(r: Result<ResultCode, tcpx_sys::AbiError>) {
    assert_eq!(r.unwrap(), ResultCode::SUCCESS);
}

/// A connected send/receive pair on device 0 and its listen comm.
pub struct Pair {
    pub p: &'static NetPlugin,
    pub listen: *mut c_void,
    pub send: *mut c_void,
    pub recv: *mut c_void,
    /// The device handle handed to accept (consume-required mode), if any.
    pub dev_handle: Option<Box<ncclNetDeviceHandle_v8_t>>,
}

/// How the accept caller treats the device handle.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum DevHandle {
    /// Pass NULL (what real NCCL does for HOST devices).
    Null,
    /// Pass a pointer to a NULL handle pointer.
    PtrToNull,
    /// Pass a preset UNPACK v7 handle (what TCPX-style callers do): consumption required.
    Preset,
}

/// Listens on device 0 and returns the handle the plugin wrote and the listen comm: the first
/// step of every connection, and of the tests that then connect with something else.
pub fn listen(p: &NetPlugin) -> ([u8; HANDLE_SIZE], *mut c_void) {
    let mut handle = [0u8; HANDLE_SIZE];
    let mut listen = null_mut();
    // SAFETY: a 128-byte handle buffer and a valid out pointer.
    ok(unsafe { p.listen(0, handle.as_mut_ptr().cast(), &mut listen) });
    assert!(!listen.is_null());
    (handle, listen)
}

/// Listens, then drives connect and accept until both comms exist.
pub fn pair(p: &'static NetPlugin, dh: DevHandle) -> Pair {
    let (mut handle, listen) = listen(p);
    Pair::connect(p, listen, &mut handle, dh)
}

/// Drives connect (re-passing the same handle buffer) and accept until both are ready.
fn connect_accept(
    p: &'static NetPlugin,
    listen: *mut c_void,
    handle: &mut [u8; HANDLE_SIZE],
    dh: DevHandle,
) -> (
    *mut c_void,
    *mut c_void,
    Option<Box<ncclNetDeviceHandle_v8_t>>,
) {
    let mut send: *mut c_void = null_mut();
    let mut recv: *mut c_void = null_mut();
    let mut preset = (dh == DevHandle::Preset).then(|| {
        Box::new(ncclNetDeviceHandle_v8_t {
            netDeviceType: NCCL_NET_DEVICE_UNPACK,
            netDeviceVersion: NCCL_NET_DEVICE_UNPACK_VERSION,
            handle: null_mut(),
            size: 0,
            needsProxyProgress: 1,
        })
    });
    let mut slot: *mut ncclNetDeviceHandle_v8_t = match preset.as_mut() {
        Some(b) => &mut **b,
        None => null_mut(),
    };
    let slot_ptr: *mut *mut ncclNetDeviceHandle_v8_t = match dh {
        DevHandle::Null => null_mut(),
        DevHandle::PtrToNull | DevHandle::Preset => &mut slot,
    };
    let start = Instant::now();
    while send.is_null() || recv.is_null() {
        assert!(start.elapsed() < DEADLINE, "connect/accept did not finish");
        if send.is_null() {
            // SAFETY: the same handle buffer on every retry, as the ABI requires.
            ok(unsafe { p.connect(0, handle.as_mut_ptr().cast(), &mut send, null_mut()) });
        }
        if recv.is_null() {
            // SAFETY: a live listen comm; `slot_ptr` is NULL or points at a valid slot.
            ok(unsafe { p.accept(listen, &mut recv, slot_ptr) });
        }
    }
    (send, recv, preset)
}

impl Pair {
    /// Connects to an existing `listen` comm through `handle`: for the tests that use the
    /// listener for something else first and then check that it still connects.
    pub fn connect(
        p: &'static NetPlugin,
        listen: *mut c_void,
        handle: &mut [u8; HANDLE_SIZE],
        dh: DevHandle,
    ) -> Pair {
        let (send, recv, dev_handle) = connect_accept(p, listen, handle, dh);
        Pair {
            p,
            listen,
            send,
            recv,
            dev_handle,
        }
    }

    /// Registers a `len`-byte send buffer of `pattern(seed, len)` and a zeroed receive buffer of
    /// the same length: the usual start of a test that posts its own requests.
    pub fn buffers(&self, seed: u64, len: usize) -> (Buf, Buf) {
        (
            register(self.p, self.send, pattern(seed, len)),
            register(self.p, self.recv, vec![0; len]),
        )
    }

    /// Closes both comms and the listener.
    pub fn close(self) {
        // SAFETY: a live send comm of this plugin, closed once.
        ok(unsafe { self.p.close_send(self.send) });
        close_recv_and_listen(self.p, self.recv, self.listen);
    }
}

/// Closes a receive comm and then its listener: the end of a pair whose send side a test closed
/// itself (to fail the receiver), or of a receiver accepted from a hand-made peer.
pub fn close_recv_and_listen(p: &NetPlugin, recv: *mut c_void, listen: *mut c_void) {
    // SAFETY: live comms of this plugin, closed once.
    unsafe {
        ok(p.close_recv(recv));
        ok(p.close_listen(listen));
    }
}

/// Tests `req` until it fails and returns the failure; `what` names the request in the panic
/// when it completes instead, or when no failure comes within `limit`. The tests of broken peers
/// and bad traffic all wait this way for the error they then check.
#[track_caller]
pub fn failure(p: &NetPlugin, req: *mut c_void, limit: Duration, what: &str) -> ResultCode {
    let start = Instant::now();
    loop {
        assert!(
            start.elapsed() < limit,
            "{what}: no failure within {limit:?}"
        );
        match test(p, req) {
            Ok(None) => continue,
            Ok(Some(n)) => panic!("{what}: completed with {n} bytes"),
            Err(e) => return e,
        }
    }
}

/// Tests each of `reqs` until done, in order, all within one [`DEADLINE`], and returns their
/// sizes: the drain at the end of the tests that post a few requests by hand.
#[track_caller]
pub fn complete_in_order(p: &NetPlugin, reqs: &[*mut c_void]) -> Vec<usize> {
    let start = Instant::now();
    reqs.iter()
        .map(|&r| loop {
            assert!(start.elapsed() < DEADLINE, "a request did not complete");
            if let Some(n) = test(p, r).unwrap() {
                break n;
            }
        })
        .collect()
}

/// Posts one `len`-byte message each way on `pair`, too large for the socket buffers, lets only
/// the sender make progress (so it is stuck mid-message), then deregisters and closes the send
/// comm with the message in flight. Returns the receive request, which must now fail, and its
/// buffer. Shared by the tests of a peer vanishing mid-message, with one socket and several.
pub fn close_sender_mid_message(pair: &Pair, len: usize, seed: u64) -> (*mut c_void, Buf) {
    let p = pair.p;
    let (mut src, mut dst) = pair.buffers(seed, len);
    let s = isend(p, pair.send, &mut src, 0, len);
    let r = irecv(p, pair.recv, &mut dst, 0, len);
    // Nobody reads, so the sender fills the socket buffers (a few MiB per socket) and can never
    // finish.
    for _ in 0..4 {
        assert_eq!(test(p, s), Ok(None));
    }
    // SAFETY: live comm and registration; the request in flight is abandoned.
    unsafe {
        ok(p.dereg_mr(pair.send, src.mh));
        ok(p.close_send(pair.send));
    }
    (r, dst)
}

/// A registered host buffer.
pub struct Buf {
    pub data: Vec<u8>,
    pub mh: *mut c_void,
}

/// Registers `data` on `comm`.
pub fn register(p: &NetPlugin, comm: *mut c_void, data: Vec<u8>) -> Buf {
    let mut data = data;
    let mut mh = null_mut();
    // SAFETY: `data` outlives the registration (deregistered by `deregister`).
    ok(unsafe {
        p.reg_mr(
            comm,
            data.as_mut_ptr().cast(),
            data.len(),
            NCCL_PTR_HOST,
            &mut mh,
        )
    });
    assert!(!mh.is_null());
    Buf { data, mh }
}

/// Deregisters a buffer and returns its bytes.
pub fn deregister(p: &NetPlugin, comm: *mut c_void, b: Buf) -> Vec<u8> {
    // SAFETY: a live registration of `comm`.
    ok(unsafe { p.dereg_mr(comm, b.mh) });
    b.data
}

/// Deterministic pseudo-random bytes (xorshift64*), different per seed.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        out.extend_from_slice(&x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Posts an isend, retrying while busy; returns the request.
pub fn isend(p: &NetPlugin, comm: *mut c_void, b: &mut Buf, off: usize, len: usize) -> *mut c_void {
    let mut req = null_mut();
    // SAFETY: [off, off+len) lies inside the registered buffer, which outlives the request.
    ok(unsafe {
        p.isend(
            comm,
            b.data.as_mut_ptr().add(off).cast(),
            len as c_int,
            0,
            b.mh,
            &mut req,
        )
    });
    req
}

/// Posts an irecv of one buffer; returns the request (NULL = busy).
pub fn irecv(p: &NetPlugin, comm: *mut c_void, b: &mut Buf, off: usize, len: usize) -> *mut c_void {
    let mut req = null_mut();
    let mut data = [b.data[off..].as_mut_ptr().cast::<c_void>()];
    let mut sizes = [len as c_int];
    let mut tags = [0 as c_int];
    let mut mhs = [b.mh];
    // SAFETY: one-entry arrays; the buffer outlives the request.
    ok(unsafe {
        p.irecv(
            comm,
            1,
            data.as_mut_ptr(),
            sizes.as_mut_ptr(),
            tags.as_mut_ptr(),
            mhs.as_mut_ptr(),
            &mut req,
        )
    });
    req
}

/// Calls irecv of `n` receives with one-entry arrays (`data`, `size`, `mh`) and NULL tags, and
/// returns its code: for the tests of what the plugin refuses, which [`irecv`] (it asserts
/// success) cannot post.
///
/// # Safety
///
/// As for `NetPlugin::irecv` with one-entry arrays: `data` lies in the registration `mh` for
/// `size` bytes and outlives the request, unless the plugin refuses the call before touching it
/// (as it must when `n` is not 1: the arrays hold one entry).
pub unsafe fn irecv_raw(
    p: &NetPlugin,
    comm: *mut c_void,
    n: c_int,
    data: *mut c_void,
    size: c_int,
    mh: *mut c_void,
    req: &mut *mut c_void,
) -> ResultCode {
    let mut data = [data];
    let mut sizes = [size];
    let mut mhs = [mh];
    // SAFETY: the caller's contract; the arrays live across the call.
    unsafe {
        p.irecv(
            comm,
            n,
            data.as_mut_ptr(),
            sizes.as_mut_ptr(),
            null_mut(),
            mhs.as_mut_ptr(),
            req,
        )
    }
    .unwrap()
}

/// One `test`: Ok(Some(size)) when done.
pub fn test(p: &NetPlugin, req: *mut c_void) -> Result<Option<usize>, ResultCode> {
    let mut done = 0;
    let mut size = -1;
    // SAFETY: `req` is a live request of this plugin.
    let rc = unsafe { p.test(req, &mut done, &mut size) }.unwrap();
    if rc != ResultCode::SUCCESS {
        return Err(rc);
    }
    Ok((done == 1).then_some(size as usize))
}

/// Sends every message of `sizes` (laid out back to back in one registered buffer each side)
/// through the pair with up to 16 in flight per direction, and checks the received bytes.
pub fn transfer(pair: &Pair, sizes: &[usize], seed: u64) {
    let p = pair.p;
    let total: usize = sizes.iter().sum();
    let mut src = register(p, pair.send, pattern(seed, total.max(1)));
    let mut dst = register(p, pair.recv, vec![0u8; total.max(1)]);
    let offs: Vec<usize> = sizes
        .iter()
        .scan(0, |acc, &s| {
            let o = *acc;
            *acc += s;
            Some(o)
        })
        .collect();
    let mut sreqs = std::collections::VecDeque::new();
    let mut rreqs = std::collections::VecDeque::new();
    let (mut sn, mut rn, mut sdone, mut rdone) = (0, 0, 0, 0);
    let start = Instant::now();
    while sdone < sizes.len() || rdone < sizes.len() {
        assert!(
            start.elapsed() < DEADLINE,
            "transfer stalled: sent {sdone}/{} received {rdone}/{}",
            sizes.len(),
            sizes.len()
        );
        while rn < sizes.len() && rreqs.len() < 16 {
            let r = irecv(p, pair.recv, &mut dst, offs[rn], sizes[rn]);
            assert!(
                !r.is_null(),
                "irecv busy with only {} outstanding",
                rreqs.len()
            );
            rreqs.push_back((r, rn));
            rn += 1;
        }
        while sn < sizes.len() && sreqs.len() < 16 {
            let r = isend(p, pair.send, &mut src, offs[sn], sizes[sn]);
            assert!(
                !r.is_null(),
                "isend busy with only {} outstanding",
                sreqs.len()
            );
            sreqs.push_back((r, sn));
            sn += 1;
        }
        if let Some(&(r, i)) = sreqs.front() {
            if let Some(n) = test(p, r).expect("send test") {
                assert_eq!(n, sizes[i]);
                sreqs.pop_front();
                sdone += 1;
            }
        }
        if let Some(&(r, i)) = rreqs.front() {
            if let Some(n) = test(p, r).expect("recv test") {
                assert_eq!(n, sizes[i], "received size of message {i}");
                if pair.dev_handle.is_some() {
                    // SAFETY: live comm and completed, oldest unconsumed request.
                    ok(unsafe { p.irecv_consumed(pair.recv, 1, r) });
                }
                rreqs.pop_front();
                rdone += 1;
            }
        }
    }
    let src = deregister(p, pair.send, src);
    let dst = deregister(p, pair.recv, dst);
    for (i, (&o, &s)) in offs.iter().zip(sizes).enumerate() {
        assert!(
            src[o..o + s] == dst[o..o + s],
            "message {i} ({s} bytes at offset {o}) differs"
        );
    }
}

/// Poison of the receive buffers of a [`Schedule`]: a byte past a message must still hold it.
const POISON: u8 = 0xa5;

/// A message schedule of `sizes`, laid out back to back in one registered buffer per side (each
/// receive gets `slack` spare bytes after its message, poisoned), driven one step at a time
/// through the plugin's ABI. Checks what a plugin owes its caller whatever the interleaving:
/// message k lands whole in receive k with its size reported, nothing past a message is
/// written, and a post answers busy exactly when 16 requests are held.
pub struct Schedule<'a> {
    pair: &'a Pair,
    sizes: Vec<usize>,
    slack: usize,
    soffs: Vec<usize>,
    roffs: Vec<usize>,
    src: Option<Buf>,
    dst: Option<Buf>,
    sreqs: Vec<*mut c_void>,
    rreqs: Vec<*mut c_void>,
    /// Sends reported done.
    pub sent: usize,
    /// Receives reported done.
    pub received: usize,
    released: usize,
}

/// One step of a [`Schedule`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Post the next send (if any is left).
    PostSend,
    /// Post the next receive.
    PostRecv,
    /// Test the oldest outstanding send.
    TestSend,
    /// Test the oldest outstanding receive.
    TestRecv,
    /// Consume the oldest completed receive (only with a preset device handle).
    Consume,
}

impl Step {
    /// Every step, in the order a drain loop takes them.
    pub const ALL: [Step; 5] = [
        Step::PostSend,
        Step::PostRecv,
        Step::TestSend,
        Step::TestRecv,
        Step::Consume,
    ];
}

impl<'a> Schedule<'a> {
    /// Registers both buffers of the schedule (send bytes from `seed`).
    pub fn new(pair: &'a Pair, sizes: &[usize], slack: usize, seed: u64) -> Self {
        let p = pair.p;
        let stotal: usize = sizes.iter().sum();
        let rtotal = stotal + sizes.len() * slack;
        Self {
            pair,
            sizes: sizes.to_vec(),
            slack,
            soffs: offsets(sizes, 0),
            roffs: offsets(sizes, slack),
            src: Some(register(p, pair.send, pattern(seed, stotal.max(1)))),
            dst: Some(register(p, pair.recv, vec![POISON; rtotal.max(1)])),
            sreqs: Vec::new(),
            rreqs: Vec::new(),
            sent: 0,
            received: 0,
            released: 0,
        }
    }

    /// Receive slots held: completed ones stay held until consumed with a device handle.
    fn held(&self) -> usize {
        if self.pair.dev_handle.is_some() {
            self.released
        } else {
            self.received
        }
    }

    /// Sends posted so far.
    pub fn sends_posted(&self) -> usize {
        self.sreqs.len()
    }

    /// Receives posted so far.
    pub fn recvs_posted(&self) -> usize {
        self.rreqs.len()
    }

    /// Takes `step` if it applies now (a post with nothing left, a test with nothing
    /// outstanding are skipped).
    pub fn step(&mut self, step: Step) {
        let p = self.pair.p;
        let n = self.sizes.len();
        let held = self.held();
        let src = self.src.as_mut().unwrap();
        let dst = self.dst.as_mut().unwrap();
        match step {
            Step::PostSend if self.sreqs.len() < n => {
                let k = self.sreqs.len();
                let r = isend(p, self.pair.send, src, self.soffs[k], self.sizes[k]);
                assert_eq!(r.is_null(), k - self.sent >= 16, "isend #{k}: busy answer");
                if !r.is_null() {
                    self.sreqs.push(r);
                }
            }
            Step::PostRecv if self.rreqs.len() < n => {
                let k = self.rreqs.len();
                let cap = self.sizes[k] + self.slack;
                let busy = k - held >= 16;
                let r = irecv(p, self.pair.recv, dst, self.roffs[k], cap);
                assert_eq!(r.is_null(), busy, "irecv #{k}: busy answer");
                if !r.is_null() {
                    self.rreqs.push(r);
                }
            }
            Step::TestSend if self.sent < self.sreqs.len() => {
                let k = self.sent;
                if let Some(size) = test(p, self.sreqs[k]).expect("send test") {
                    assert_eq!(size, self.sizes[k], "size of send #{k}");
                    self.sent += 1;
                }
            }
            Step::TestRecv if self.received < self.rreqs.len() => {
                let k = self.received;
                if let Some(size) = test(p, self.rreqs[k]).expect("receive test") {
                    let (o, s) = (self.roffs[k], self.sizes[k]);
                    assert_eq!(size, s, "size of receive #{k}");
                    assert!(
                        dst.data[o..o + s] == src.data[self.soffs[k]..self.soffs[k] + s],
                        "receive #{k} ({s} bytes) differs from send #{k}"
                    );
                    assert!(
                        dst.data[o + s..o + s + self.slack]
                            .iter()
                            .all(|&b| b == POISON),
                        "receive #{k} written past its {s} bytes"
                    );
                    self.received += 1;
                }
            }
            Step::Consume if self.pair.dev_handle.is_some() && self.released < self.received => {
                // SAFETY: a live comm and its oldest completed, unconsumed request.
                ok(unsafe { p.irecv_consumed(self.pair.recv, 1, self.rreqs[self.released]) });
                self.released += 1;
            }
            _ => {}
        }
    }

    /// Repeats `steps` until `until` holds (a deadline without progress is a stall).
    pub fn repeat(&mut self, steps: &[Step], until: impl Fn(&Self) -> bool) {
        let mut last = (usize::MAX, usize::MAX);
        let mut since = Instant::now();
        while !until(self) {
            for &s in steps {
                self.step(s);
            }
            let now = (self.sent, self.received);
            if now != last {
                (last, since) = (now, Instant::now());
            }
            assert!(
                since.elapsed() < DEADLINE,
                "stalled: sent {}/{n}, received {}/{n}",
                now.0,
                now.1,
                n = self.sizes.len()
            );
        }
    }

    /// Drives every message to completion, then deregisters both buffers.
    pub fn finish(mut self) {
        let n = self.sizes.len();
        self.repeat(&Step::ALL, |s| s.sent == n && s.received == n);
        let p = self.pair.p;
        deregister(p, self.pair.send, self.src.take().unwrap());
        deregister(p, self.pair.recv, self.dst.take().unwrap());
    }
}

/// Start offsets of `sizes` laid out back to back, each followed by `gap` bytes.
fn offsets(sizes: &[usize], gap: usize) -> Vec<usize> {
    sizes
        .iter()
        .scan(0, |acc, &s| {
            let o = *acc;
            *acc += s + gap;
            Some(o)
        })
        .collect()
}

/// Runs `steps` (each byte picks a [`Step`], mod 5) on a schedule of `sizes`, then drives it to
/// completion; every message is checked (see [`Schedule`]).
pub fn interleaved(pair: &Pair, sizes: &[usize], slack: usize, steps: &[u8], seed: u64) {
    let mut s = Schedule::new(pair, sizes, slack, seed);
    for &b in steps {
        s.step(Step::ALL[usize::from(b) % 5]);
    }
    s.finish();
}

/// Receives posted late: the first 16 messages of `sizes` (64 KiB at most together, so the
/// socket buffers hold them) are sent and reported done before any receive exists; then the
/// receives are posted one at a time, each tested to completion before the next is posted,
/// while the remaining sends follow. Every message's bytes and size are checked.
pub fn receive_late(pair: &Pair, sizes: &[usize], seed: u64) {
    let first = sizes.len().min(16);
    assert!(
        sizes[..first].iter().sum::<usize>() <= 64 << 10,
        "the messages sent before any receive must fit in the socket buffers"
    );
    let mut s = Schedule::new(pair, sizes, 1, seed);
    for _ in 0..first {
        s.step(Step::PostSend);
    }
    s.repeat(&[Step::TestSend], |s| s.sent == first);
    assert_eq!(s.recvs_posted(), 0);
    for k in 0..sizes.len() {
        s.step(Step::PostRecv);
        assert_eq!(s.recvs_posted(), k + 1);
        s.repeat(&[Step::TestRecv, Step::PostSend, Step::TestSend], |s| {
            s.received == k + 1
        });
        s.step(Step::Consume);
    }
    s.finish();
}

/// The TCP port of a listen handle (bytes 8..10, little-endian), for the tests that connect to
/// the listener with a raw socket instead of the plugin.
pub fn handle_port(handle: &[u8; HANDLE_SIZE]) -> u16 {
    u16::from_le_bytes([handle[8], handle[9]])
}

/// A receive comm accepted from a hand-made connector: a raw socket that sent a valid hello and
/// can then write any bytes, for the tests of traffic the plugin itself never sends.
pub struct RawPeer {
    /// The listen comm the raw socket connected to.
    pub listen: *mut c_void,
    /// The receive comm accepted from it.
    pub recv: *mut c_void,
    /// The raw socket, past its hello.
    pub stream: TcpStream,
}

/// Listens on device 0, connects a raw socket that says hello as connection `conn_id`, and
/// accepts it.
pub fn raw_peer(p: &NetPlugin, conn_id: u64) -> RawPeer {
    let (handle, listen) = listen(p);
    let nonce = u64::from_le_bytes(handle[32..40].try_into().unwrap());
    let mut stream = TcpStream::connect(("127.0.0.1", handle_port(&handle))).unwrap();
    let hello = Hello {
        nsocks: 1,
        index: 0,
        nonce,
        conn_id,
    };
    stream.write_all(&hello.encode()).unwrap();
    let mut recv: *mut c_void = null_mut();
    let start = Instant::now();
    while recv.is_null() {
        assert!(start.elapsed() < DEADLINE, "the raw peer was not accepted");
        // SAFETY: a live listen comm; NULL device handle slot.
        ok(unsafe { p.accept(listen, &mut recv, null_mut()) });
    }
    RawPeer {
        listen,
        recv,
        stream,
    }
}

/// The device-handle modes of real callers, under which the data-path tests run: NULL (NCCL
/// with a HOST device) and a preset UNPACK handle (consumption required).
pub const CALLER_MODES: [DevHandle; 2] = [DevHandle::Null, DevHandle::Preset];

/// On a fresh pair of `p` per caller mode, moves `sizes` with [`transfer`] (seed `seed`), then
/// again one step at a time with [`interleaved`] under `steps` and `slack` (seed `seed + 1`):
/// the fixed mixed-size scenario that each socket count runs.
pub fn transfer_and_interleave(
    p: &'static NetPlugin,
    sizes: &[usize],
    slack: usize,
    steps: &[u8],
    seed: u64,
) {
    for dh in CALLER_MODES {
        let pair = pair(p, dh);
        transfer(&pair, sizes, seed);
        interleaved(&pair, sizes, slack, steps, seed + 1);
        pair.close();
    }
}

/// [`receive_late`] of `sizes` on a fresh pair of `p` per caller mode.
pub fn receive_late_in_each_mode(p: &'static NetPlugin, sizes: &[usize], seed: u64) {
    for dh in CALLER_MODES {
        let pair = pair(p, dh);
        receive_late(&pair, sizes, seed);
        pair.close();
    }
}

/// Sizes for random schedules: empty, tiny, a page and its neighbours, and two bands of larger
/// ones split at `split` bytes, so that each test binary puts the split where its data path
/// changes behaviour.
pub fn any_size(split: usize) -> impl Strategy<Value = usize> {
    prop_oneof![
        1 => Just(0usize),
        3 => 1usize..=64,
        3 => prop_oneof![Just(4095usize), Just(4096), Just(4097)],
        3 => 65usize..16 << 10,
        2 => 16usize << 10..split,
        1 => split..4usize << 20,
    ]
}

/// A random schedule for [`interleaved`], with or without consumption.
#[derive(Clone, Debug)]
pub struct RandomSchedule {
    /// Preset device handle (consumption required) rather than NULL.
    pub consume: bool,
    /// Message sizes, in order.
    pub sizes: Vec<usize>,
    /// Spare, poisoned bytes after each receive.
    pub slack: usize,
    /// Steps taken before the drain, each picking a [`Step`] mod 5.
    pub steps: Vec<u8>,
    /// Seed of the sent bytes.
    pub seed: u64,
}

/// Up to 39 messages of [`any_size`]`(split)`, up to 2 bytes of receive slack and up to 299
/// steps: the property test that each socket count runs.
pub fn random_schedule(split: usize) -> impl Strategy<Value = RandomSchedule> {
    (
        any::<bool>(),
        vec(any_size(split), 1..40),
        0usize..3,
        vec(any::<u8>(), 0..300),
        any::<u64>(),
    )
        .prop_map(|(consume, sizes, slack, steps, seed)| RandomSchedule {
            consume,
            sizes,
            slack,
            steps,
            seed,
        })
}

impl RandomSchedule {
    /// Runs the schedule on a fresh pair of `p` (every message checked, see [`Schedule`]).
    pub fn run(&self, p: &'static NetPlugin) {
        let dh = if self.consume {
            DevHandle::Preset
        } else {
            DevHandle::Null
        };
        let pair = pair(p, dh);
        interleaved(&pair, &self.sizes, self.slack, &self.steps, self.seed);
        pair.close();
    }
}
