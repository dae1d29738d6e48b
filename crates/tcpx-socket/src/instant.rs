//! A plugin that completes instantly (feature `instant`): the edge under the engine-overhead
//! benchmark (`tcpx-bench overhead`).
//!
//! Its comms are tokens; `connect`/`accept` succeed at once; `isend`/`irecv` hand out a
//! request that encodes the posted size in the pointer value (nothing is allocated per
//! request and no memory is touched); `test` reports it done with that size on the first
//! call. What remains per request is the safe layer's and the engine's own work, which is what
//! the benchmark measures. Not a transport: nothing is delivered.

use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicU64, Ordering};

use tcpx_sys::{
    ncclDebugLogger_t, ncclNetDeviceHandle_v8_t, ncclNetProperties_v8_t, ncclNet_v8_t,
    ncclResult_t, NCCL_NET_DEVICE_HOST, NCCL_PTR_HOST, NCCL_SUCCESS,
};

/// The plugin's name.
pub const NAME: &str = "fake-instant";

const INVALID_ARGUMENT: ncclResult_t = 4;

/// Distinguishes listens in their handles (the fake never looks them up).
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A comm: a boxed id, freed by the matching close.
struct Comm {
    _id: u64,
}

fn new_comm() -> *mut c_void {
    Box::into_raw(Box::new(Comm {
        _id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
    }))
    .cast()
}

/// # Safety
/// `comm` is NULL or came from [`new_comm`] and is not used again.
unsafe fn free_comm(comm: *mut c_void) -> ncclResult_t {
    if comm.is_null() {
        return INVALID_ARGUMENT;
    }
    // SAFETY: per the contract, `comm` is a `Box<Comm>` leaked by `new_comm`, freed once.
    drop(unsafe { Box::from_raw(comm.cast::<Comm>()) });
    NCCL_SUCCESS
}

/// Requests carry their size: `(size << 1) | 1`, never NULL, never dereferenced.
fn request_for(size: c_int) -> *mut c_void {
    ((usize::try_from(size).unwrap_or(0) << 1) | 1) as *mut c_void
}

unsafe extern "C" fn init(_logger: ncclDebugLogger_t) -> ncclResult_t {
    NCCL_SUCCESS
}

unsafe extern "C" fn devices(ndev: *mut c_int) -> ncclResult_t {
    if ndev.is_null() {
        return INVALID_ARGUMENT;
    }
    // SAFETY: the caller passes a valid out pointer (checked non-NULL).
    unsafe { *ndev = 1 };
    NCCL_SUCCESS
}

unsafe extern "C" fn get_properties(
    dev: c_int,
    props: *mut ncclNetProperties_v8_t,
) -> ncclResult_t {
    if dev != 0 || props.is_null() {
        return INVALID_ARGUMENT;
    }
    let properties = ncclNetProperties_v8_t {
        name: c"fake0".as_ptr().cast_mut(),
        pciPath: std::ptr::null_mut(),
        guid: 0xfa4e,
        ptrSupport: NCCL_PTR_HOST,
        regIsGlobal: 0,
        speed: 400_000,
        port: 0,
        latency: 0.0,
        maxComms: 65536,
        maxRecvs: 1,
        netDeviceType: NCCL_NET_DEVICE_HOST,
        netDeviceVersion: 0,
    };
    // SAFETY: valid out pointer (checked non-NULL); the name is a static C string.
    unsafe { props.write(properties) };
    NCCL_SUCCESS
}

unsafe extern "C" fn listen(
    dev: c_int,
    handle: *mut c_void,
    listen_comm: *mut *mut c_void,
) -> ncclResult_t {
    if dev != 0 || handle.is_null() || listen_comm.is_null() {
        return INVALID_ARGUMENT;
    }
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed).to_le_bytes();
    // SAFETY: the handle buffer has 128 writable bytes (ncclNet contract); 8 are written.
    unsafe { std::ptr::copy_nonoverlapping(id.as_ptr(), handle.cast::<u8>(), id.len()) };
    // SAFETY: valid out pointer (checked non-NULL).
    unsafe { *listen_comm = new_comm() };
    NCCL_SUCCESS
}

unsafe extern "C" fn connect(
    _dev: c_int,
    _handle: *mut c_void,
    send_comm: *mut *mut c_void,
    _dev_comm: *mut *mut ncclNetDeviceHandle_v8_t,
) -> ncclResult_t {
    if send_comm.is_null() {
        return INVALID_ARGUMENT;
    }
    // SAFETY: valid out pointer (checked non-NULL).
    unsafe { *send_comm = new_comm() };
    NCCL_SUCCESS
}

unsafe extern "C" fn accept(
    listen_comm: *mut c_void,
    recv_comm: *mut *mut c_void,
    _dev_comm: *mut *mut ncclNetDeviceHandle_v8_t,
) -> ncclResult_t {
    if listen_comm.is_null() || recv_comm.is_null() {
        return INVALID_ARGUMENT;
    }
    // SAFETY: valid out pointer (checked non-NULL).
    unsafe { *recv_comm = new_comm() };
    NCCL_SUCCESS
}

unsafe extern "C" fn reg_mr(
    _comm: *mut c_void,
    _data: *mut c_void,
    _size: usize,
    _type: c_int,
    mhandle: *mut *mut c_void,
) -> ncclResult_t {
    if mhandle.is_null() {
        return INVALID_ARGUMENT;
    }
    // SAFETY: valid out pointer (checked non-NULL). The handle is a token, never dereferenced.
    unsafe { *mhandle = std::ptr::dangling_mut::<u8>().cast() };
    NCCL_SUCCESS
}

unsafe extern "C" fn dereg_mr(_comm: *mut c_void, _mhandle: *mut c_void) -> ncclResult_t {
    NCCL_SUCCESS
}

unsafe extern "C" fn isend(
    _comm: *mut c_void,
    _data: *mut c_void,
    size: c_int,
    _tag: c_int,
    _mhandle: *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    if request.is_null() {
        return INVALID_ARGUMENT;
    }
    // SAFETY: valid out pointer (checked non-NULL).
    unsafe { *request = request_for(size) };
    NCCL_SUCCESS
}

unsafe extern "C" fn irecv(
    _comm: *mut c_void,
    n: c_int,
    _data: *mut *mut c_void,
    sizes: *mut c_int,
    _tags: *mut c_int,
    _mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    if n != 1 || sizes.is_null() || request.is_null() {
        return INVALID_ARGUMENT;
    }
    // SAFETY: `sizes` has `n` = 1 readable entries; `request` is a valid out pointer.
    unsafe { *request = request_for(*sizes) };
    NCCL_SUCCESS
}

unsafe extern "C" fn test(
    request: *mut c_void,
    done: *mut c_int,
    sizes: *mut c_int,
) -> ncclResult_t {
    if request.is_null() || done.is_null() {
        return INVALID_ARGUMENT;
    }
    let size = c_int::try_from(request as usize >> 1).unwrap_or(c_int::MAX);
    // SAFETY: valid out pointers (checked non-NULL; `sizes` may be NULL per the ABI).
    unsafe {
        *done = 1;
        if !sizes.is_null() {
            *sizes = size;
        }
    }
    NCCL_SUCCESS
}

unsafe extern "C" fn close(comm: *mut c_void) -> ncclResult_t {
    // SAFETY: the caller closes each comm it got from listen/connect/accept once.
    unsafe { free_comm(comm) }
}

unsafe extern "C" fn irecv_consumed(
    _comm: *mut c_void,
    _n: c_int,
    _request: *mut c_void,
) -> ncclResult_t {
    NCCL_SUCCESS
}

unsafe extern "C" fn get_device_mr(
    _comm: *mut c_void,
    _mhandle: *mut c_void,
    dptr: *mut *mut c_void,
) -> ncclResult_t {
    if !dptr.is_null() {
        // SAFETY: valid out pointer (checked non-NULL).
        unsafe { *dptr = std::ptr::null_mut() };
    }
    NCCL_SUCCESS
}

/// The table, in a wrapper that may live in a `static`.
struct Table(ncclNet_v8_t);

// SAFETY: the table is immutable; `name` points at a static C string and every function is
// thread-safe (they touch only their arguments and an atomic counter).
unsafe impl Sync for Table {}

const NAME_C: &std::ffi::CStr = c"fake-instant";

static TABLE: Table = Table(ncclNet_v8_t {
    name: NAME_C.as_ptr() as *const c_char,
    init: Some(init),
    devices: Some(devices),
    getProperties: Some(get_properties),
    listen: Some(listen),
    connect: Some(connect),
    accept: Some(accept),
    regMr: Some(reg_mr),
    regMrDmaBuf: None,
    deregMr: Some(dereg_mr),
    isend: Some(isend),
    irecv: Some(irecv),
    iflush: None,
    test: Some(test),
    closeSend: Some(close),
    closeRecv: Some(close),
    closeListen: Some(close),
    getDeviceMr: Some(get_device_mr),
    irecvConsumed: Some(irecv_consumed),
});

/// The instant plugin's ncclNet v8 table, for use without `dlopen`
/// (`tcpx_sys::NetPlugin::from_static_v8`).
pub fn table_v8() -> &'static ncclNet_v8_t {
    &TABLE.0
}
