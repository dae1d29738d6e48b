//! The exported ncclNet tables and their `extern "C"` entry points.
//!
//! Every entry point validates its pointers, runs its body under `catch_unwind` (a panic must
//! never unwind into C: it becomes ncclInternalError plus a log line), and maps failures to
//! result codes. v7 and v8 share every function except `getProperties` (v7 properties have no
//! `regIsGlobal`) and `regMr` (v7 takes an `int` size). `regMrDmaBuf` is left NULL: host
//! memory is all this plugin moves, `ptrSupport` does not advertise DMABUF, so NCCL never calls
//! it, and a direct caller gets the loader's "not implemented" rather than a misleading code.

use std::ffi::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};

use tcpx_sys::{
    ncclDebugLogger_t, ncclNetDeviceHandle_v8_t, ncclNetProperties_v7_t, ncclNetProperties_v8_t,
    ncclNet_v7_t, ncclNet_v8_t, ncclResult_t, ResultCode, HANDLE_SIZE, NCCL_NET_DEVICE_HOST,
    NCCL_NET_DEVICE_UNPACK, NCCL_NET_DEVICE_UNPACK_VERSION, NCCL_PTR_CUDA, NCCL_PTR_HOST,
};

use crate::log::{self, log_info, log_warn};
use crate::object::{self, LISTEN_TAG, RECV_REQ_TAG, RECV_TAG, SEND_REQ_TAG, SEND_TAG};
use crate::{connect, device, devmem, listen, mr, recv, send};

/// Most comms a device supports, as reported in properties (TCPX reports the same).
const MAX_COMMS: i32 = 65536;

/// A function table that may live in a `static`: the tables hold raw pointers (the name), which
/// are not `Sync`, although the table is immutable data valid for the whole process.
/// `repr(transparent)` keeps the exported symbol's layout exactly that of `T`.
#[repr(transparent)]
pub struct PluginTable<T>(pub T);

// SAFETY: the wrapped tables are never mutated and point only at static data and functions.
unsafe impl<T> Sync for PluginTable<T> {}

/// The ncclNet v8 table, exported for NCCL and for `dlopen` users.
#[allow(non_upper_case_globals)]
#[no_mangle]
pub static ncclNetPlugin_v8: PluginTable<ncclNet_v8_t> = PluginTable(ncclNet_v8_t {
    name: crate::PLUGIN_NAME_C.as_ptr(),
    init: Some(init),
    devices: Some(devices),
    getProperties: Some(get_properties_v8),
    listen: Some(listen),
    connect: Some(connect),
    accept: Some(accept),
    regMr: Some(reg_mr_v8),
    regMrDmaBuf: None,
    deregMr: Some(dereg_mr),
    isend: Some(isend),
    irecv: Some(irecv),
    iflush: Some(iflush),
    test: Some(test),
    closeSend: Some(close_send),
    closeRecv: Some(close_recv),
    closeListen: Some(close_listen),
    getDeviceMr: Some(get_device_mr),
    irecvConsumed: Some(irecv_consumed),
});

/// The ncclNet v7 table (what TCPX exports; consumers written against TCPX load this one).
#[allow(non_upper_case_globals)]
#[no_mangle]
pub static ncclNetPlugin_v7: PluginTable<ncclNet_v7_t> = PluginTable(ncclNet_v7_t {
    name: crate::PLUGIN_NAME_C.as_ptr(),
    init: Some(init),
    devices: Some(devices),
    getProperties: Some(get_properties_v7),
    listen: Some(listen),
    connect: Some(connect),
    accept: Some(accept),
    regMr: Some(reg_mr_v7),
    regMrDmaBuf: None,
    deregMr: Some(dereg_mr),
    isend: Some(isend),
    irecv: Some(irecv),
    iflush: Some(iflush),
    test: Some(test),
    closeSend: Some(close_send),
    closeRecv: Some(close_recv),
    closeListen: Some(close_listen),
    getDeviceMr: Some(get_device_mr),
    irecvConsumed: Some(irecv_consumed),
});

/// Runs an entry point body: no panic crosses into C, errors become their code.
fn guard(call: &'static str, body: impl FnOnce() -> Result<(), ResultCode>) -> ncclResult_t {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => ResultCode::SUCCESS.0,
        Ok(Err(code)) => code.0,
        Err(_) => {
            log_warn!("tcpx-socket: internal error: {call} panicked (this is a plugin bug)");
            ResultCode::INTERNAL_ERROR.0
        }
    }
}

/// Turns an out-pointer into a reference, refusing NULL.
///
/// # Safety
/// `p` is NULL or valid for writes of a `T`.
unsafe fn out<'a, T>(p: *mut T, what: &str) -> Result<&'a mut T, ResultCode> {
    if p.is_null() {
        log_warn!("tcpx-socket: {what} is NULL");
        return Err(ResultCode::INVALID_ARGUMENT);
    }
    // SAFETY: non-NULL; validity is the caller's contract.
    Ok(unsafe { &mut *p })
}

unsafe extern "C" fn init(logger: ncclDebugLogger_t) -> ncclResult_t {
    guard("init", || {
        log::set_logger(logger);
        device::init().map(|_| ())
    })
}

unsafe extern "C" fn devices(ndev: *mut c_int) -> ncclResult_t {
    guard("devices", || {
        let cfg = device::config()?;
        // SAFETY: out-pointer contract of `devices`.
        *unsafe { out(ndev, "devices: ndev") }? = cfg.devices.len() as c_int;
        Ok(())
    })
}

fn properties(dev: c_int) -> Result<ncclNetProperties_v8_t, ResultCode> {
    let d = device::device(dev)?;
    // Devmem emulation presents the device as TCPX does: CUDA pointers, UNPACK v7.
    let (ptr_support, dev_type, dev_version) = if device::devmem_gpu().is_some() {
        (
            NCCL_PTR_HOST | NCCL_PTR_CUDA,
            NCCL_NET_DEVICE_UNPACK,
            NCCL_NET_DEVICE_UNPACK_VERSION,
        )
    } else {
        (NCCL_PTR_HOST, NCCL_NET_DEVICE_HOST, 0)
    };
    Ok(ncclNetProperties_v8_t {
        name: d.name.as_ptr().cast_mut(),
        pciPath: d
            .pci_path
            .as_ref()
            .map_or(std::ptr::null_mut(), |p| p.as_ptr().cast_mut()),
        guid: dev as u64,
        ptrSupport: ptr_support,
        regIsGlobal: 0,
        speed: d.speed_mbps,
        port: 0,
        latency: 0.0,
        maxComms: MAX_COMMS,
        maxRecvs: 1,
        netDeviceType: dev_type,
        netDeviceVersion: dev_version,
    })
}

unsafe extern "C" fn get_properties_v8(
    dev: c_int,
    props: *mut ncclNetProperties_v8_t,
) -> ncclResult_t {
    guard("getProperties", || {
        let p = properties(dev)?;
        // SAFETY: out-pointer contract of `getProperties`.
        *unsafe { out(props, "getProperties: props") }? = p;
        Ok(())
    })
}

unsafe extern "C" fn get_properties_v7(
    dev: c_int,
    props: *mut ncclNetProperties_v7_t,
) -> ncclResult_t {
    guard("getProperties", || {
        let p = properties(dev)?;
        // SAFETY: out-pointer contract of `getProperties` (v7 layout).
        *unsafe { out(props, "getProperties: props") }? = ncclNetProperties_v7_t {
            name: p.name,
            pciPath: p.pciPath,
            guid: p.guid,
            ptrSupport: p.ptrSupport,
            speed: p.speed,
            port: p.port,
            latency: p.latency,
            maxComms: p.maxComms,
            maxRecvs: p.maxRecvs,
            netDeviceType: p.netDeviceType,
            netDeviceVersion: p.netDeviceVersion,
        };
        Ok(())
    })
}

unsafe extern "C" fn listen(
    dev: c_int,
    handle: *mut c_void,
    listen_comm: *mut *mut c_void,
) -> ncclResult_t {
    guard("listen", || {
        // SAFETY: out-pointer contract of `listen`.
        let lc = unsafe { out(listen_comm, "listen: listenComm") }?;
        *lc = std::ptr::null_mut();
        // SAFETY: the handle buffer is HANDLE_SIZE writable bytes (ABI contract).
        let h = unsafe { out(handle.cast::<[u8; HANDLE_SIZE]>(), "listen: handle") }?;
        let d = device::device(dev)?;
        let nsocks = device::config()?.nsocks as u8;
        let addr = match d.addr {
            std::net::IpAddr::V4(ip) => std::net::SocketAddr::new(ip.into(), 0),
            std::net::IpAddr::V6(ip) => std::net::SocketAddrV6::new(ip, 0, 0, d.scope_id).into(),
        };
        let comm = listen::ListenComm::bind(dev, addr, nsocks).map_err(|e| {
            log_warn!(
                "tcpx-socket: listen on device {dev} ({} {}) failed: {e}",
                d.name.to_string_lossy(),
                d.addr
            );
            ResultCode::SYSTEM_ERROR
        })?;
        *h = comm.info().encode();
        *lc = Box::into_raw(comm).cast();
        Ok(())
    })
}

unsafe extern "C" fn connect(
    dev: c_int,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
    _send_dev_comm: *mut *mut ncclNetDeviceHandle_v8_t,
) -> ncclResult_t {
    // The send side has no device-side work for host memory: `sendDevComm` is left untouched.
    guard("connect", || {
        // SAFETY: out-pointer contract of `connect`.
        let sc = unsafe { out(send_comm, "connect: sendComm") }?;
        *sc = std::ptr::null_mut();
        device::device(dev)?;
        // SAFETY: the handle buffer is HANDLE_SIZE bytes, the caller's, re-passed on retries.
        let h = unsafe { out(handle.cast::<[u8; HANDLE_SIZE]>(), "connect: handle") }?;
        if let Some(comm) = connect::step(h)? {
            *sc = Box::into_raw(comm).cast();
        }
        Ok(())
    })
}

unsafe extern "C" fn accept(
    listen_comm: *mut c_void,
    recv_comm: *mut *mut c_void,
    recv_dev_comm: *mut *mut ncclNetDeviceHandle_v8_t,
) -> ncclResult_t {
    guard("accept", || {
        // SAFETY: out-pointer contract of `accept`.
        let rc = unsafe { out(recv_comm, "accept: recvComm") }?;
        *rc = std::ptr::null_mut();
        // SAFETY: a listen comm pointer of this plugin (tag checked).
        let lc = unsafe {
            object::expect::<listen::ListenComm>(
                listen_comm.cast(),
                LISTEN_TAG,
                "accept: listenComm",
            )
        }?;
        // SAFETY: tag checked; one thread at a time per comm (NCCL's contract).
        let lc = unsafe { &mut *lc };
        let Some(ready) = lc.accept_step()? else {
            return Ok(());
        };
        let name = format!(
            "recv comm {:#x} from {} ({} socket(s), device {})",
            ready.conn_id,
            ready.peer,
            ready.socks.len(),
            lc.dev()
        );
        // Device handle. Host mode: a caller that hands us a preset handle (TCPX-style: UNPACK,
        // v7) gets TCPX's receive lifecycle, consumption required; we are a HOST device and say
        // so in its handle. NULL (or a NULL slot, what real NCCL passes for HOST devices) means
        // the caller will never call irecvConsumed, so `test` releases slots itself.
        // Devmem mode: any non-NULL slot gets an UNPACK v7 handle with this comm's unpack queue
        // (written into the caller's preset handle, or into one the comm owns when the slot is
        // empty, NCCL-style); a NULL slot gets no queue, and CUDA receives are refused.
        let slot_given = !recv_dev_comm.is_null();
        let dev_handle = if slot_given {
            // SAFETY: non-NULL slot pointer provided by the caller.
            unsafe { *recv_dev_comm }
        } else {
            std::ptr::null_mut()
        };
        let mut owned_handle = None;
        let mut devmem_queue = None;
        let consume_required = match device::devmem_gpu() {
            Some(gpu) if slot_given => {
                let seed = ready.conn_id ^ (lc as *const listen::ListenComm as u64);
                let queue = devmem::DevmemRecv::new(gpu, seed, &name)?;
                let handle = queue.device_handle();
                if dev_handle.is_null() {
                    let mut boxed = Box::new(handle);
                    // SAFETY: non-NULL slot (checked above); the box lives as long as the comm.
                    unsafe { *recv_dev_comm = &mut *boxed };
                    owned_handle = Some(boxed);
                } else {
                    // SAFETY: the caller's device handle, valid for writes (ABI contract).
                    unsafe { *dev_handle = handle };
                }
                devmem_queue = Some(queue);
                true
            }
            _ if !dev_handle.is_null() => {
                // SAFETY: the caller's device handle, valid for writes (ABI contract).
                unsafe {
                    *dev_handle = ncclNetDeviceHandle_v8_t {
                        netDeviceType: NCCL_NET_DEVICE_HOST,
                        netDeviceVersion: 0,
                        handle: std::ptr::null_mut(),
                        size: 0,
                        needsProxyProgress: 0,
                    };
                }
                true
            }
            _ => false,
        };
        log_info!(
            "tcpx-socket: accepted: {name}, irecvConsumed {}{}",
            if consume_required {
                "required"
            } else {
                "not used"
            },
            if devmem_queue.is_some() {
                ", devmem unpack queue (UNPACK v7)"
            } else {
                ""
            }
        );
        let mut comm = recv::RecvComm::new(
            ready.socks,
            consume_required,
            devmem_queue,
            owned_handle,
            name,
        );
        comm.set_read_batch(device::config().map_or(0, |c| c.read_batch));
        *rc = Box::into_raw(comm).cast();
        Ok(())
    })
}

fn reg_mr_common(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    ptr_type: c_int,
    mhandle: *mut *mut c_void,
) -> Result<(), ResultCode> {
    // SAFETY: out-pointer contract of `regMr`.
    let mh = unsafe { out(mhandle, "regMr: mhandle") }?;
    *mh = std::ptr::null_mut();
    // SAFETY: `comm` is NULL or an object of this plugin (checked inside).
    *mh = unsafe { mr::register(comm, data, size, ptr_type) }?;
    Ok(())
}

unsafe extern "C" fn reg_mr_v8(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    ptr_type: c_int,
    mhandle: *mut *mut c_void,
) -> ncclResult_t {
    guard("regMr", || {
        reg_mr_common(comm, data, size, ptr_type, mhandle)
    })
}

unsafe extern "C" fn reg_mr_v7(
    comm: *mut c_void,
    data: *mut c_void,
    size: c_int,
    ptr_type: c_int,
    mhandle: *mut *mut c_void,
) -> ncclResult_t {
    guard("regMr", || {
        let size = usize::try_from(size).map_err(|_| {
            log_warn!("tcpx-socket: regMr with negative size {size}");
            ResultCode::INVALID_ARGUMENT
        })?;
        reg_mr_common(comm, data, size, ptr_type, mhandle)
    })
}

unsafe extern "C" fn dereg_mr(comm: *mut c_void, mhandle: *mut c_void) -> ncclResult_t {
    // SAFETY: `mhandle` is NULL or an object of this plugin (checked inside).
    guard("deregMr", || unsafe { mr::deregister(comm, mhandle) })
}

unsafe extern "C" fn isend(
    send_comm: *mut c_void,
    data: *mut c_void,
    size: c_int,
    _tag: c_int,
    mhandle: *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    guard("isend", || {
        // SAFETY: out-pointer contract of `isend`.
        let req = unsafe { out(request, "isend: request") }?;
        *req = std::ptr::null_mut();
        // SAFETY: a send comm pointer of this plugin (tag checked).
        let comm = unsafe {
            object::expect::<send::SendComm>(send_comm.cast(), SEND_TAG, "isend: sendComm")
        }?;
        let size = usize::try_from(size).map_err(|_| {
            log_warn!("tcpx-socket: isend with negative size {size}");
            ResultCode::INVALID_ARGUMENT
        })?;
        // SAFETY: `mhandle` is NULL or an object of this plugin (checked inside).
        let ptr_type = unsafe { mr::check(send_comm, mhandle, data, size, "isend") }?;
        // SAFETY: tag checked; one thread at a time per comm.
        let comm = unsafe { &mut *comm };
        let cuda = ptr_type == NCCL_PTR_CUDA;
        if let Some(r) = comm.post(data.cast_const().cast(), size, cuda)? {
            *req = r;
        }
        Ok(())
    })
}

unsafe extern "C" fn irecv(
    recv_comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut c_int,
    _tags: *mut c_int,
    mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    guard("irecv", || {
        // SAFETY: out-pointer contract of `irecv`.
        let req = unsafe { out(request, "irecv: request") }?;
        *req = std::ptr::null_mut();
        // SAFETY: a receive comm pointer of this plugin (tag checked).
        let comm = unsafe {
            object::expect::<recv::RecvComm>(recv_comm.cast(), RECV_TAG, "irecv: recvComm")
        }?;
        if n != 1 {
            log_warn!(
                "tcpx-socket: irecv with n = {n}: this plugin (like TCPX) takes exactly one buffer"
            );
            return Err(ResultCode::INVALID_ARGUMENT);
        }
        if data.is_null() || sizes.is_null() || mhandles.is_null() {
            log_warn!("tcpx-socket: irecv: data, sizes or mhandles array is NULL");
            return Err(ResultCode::INVALID_ARGUMENT);
        }
        // SAFETY: the arrays hold n = 1 entries (ABI contract), checked non-NULL above.
        let (buf, size, mh) = unsafe { (*data, *sizes, *mhandles) };
        let size = usize::try_from(size).map_err(|_| {
            log_warn!("tcpx-socket: irecv with negative size {size}");
            ResultCode::INVALID_ARGUMENT
        })?;
        // SAFETY: `mh` is NULL or an object of this plugin (checked inside).
        let ptr_type = unsafe { mr::check(recv_comm, mh, buf, size, "irecv") }?;
        // SAFETY: tag checked; one thread at a time per comm.
        let comm = unsafe { &mut *comm };
        if let Some(r) = comm.post(buf.cast(), size, ptr_type == NCCL_PTR_CUDA)? {
            *req = r;
        }
        Ok(())
    })
}

unsafe extern "C" fn iflush(
    _recv_comm: *mut c_void,
    _n: c_int,
    _data: *mut *mut c_void,
    _sizes: *mut c_int,
    _mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> ncclResult_t {
    // Host memory written by recv(2) is visible to the CPU as soon as the receive completes:
    // there is nothing to flush, so no request (NCCL treats NULL as "already done").
    guard("iflush", || {
        // SAFETY: out-pointer contract of `iflush`.
        *unsafe { out(request, "iflush: request") }? = std::ptr::null_mut();
        Ok(())
    })
}

unsafe extern "C" fn test(
    request: *mut c_void,
    done: *mut c_int,
    sizes: *mut c_int,
) -> ncclResult_t {
    guard("test", || {
        // SAFETY: out-pointer contract of `test`.
        let done = unsafe { out(done, "test: done") }?;
        *done = 0;
        // SAFETY: `request` is NULL or an object of this plugin.
        let tag = unsafe { object::tag_of(request.cast(), "test: request") }?;
        let result = match tag {
            SEND_REQ_TAG => {
                // SAFETY: tag checked: a send slot.
                let (comm, index, seq) = unsafe { send::slot_info(request.cast()) };
                // SAFETY: a slot's comm pointer is its owner, alive while the slot is.
                let comm = unsafe {
                    object::expect::<send::SendComm>(comm.cast(), SEND_TAG, "test: request's comm")
                }?;
                // SAFETY: tag checked; one thread at a time per comm.
                unsafe { &mut *comm }.test(index, seq)?
            }
            RECV_REQ_TAG => {
                // SAFETY: tag checked: a receive slot.
                let (comm, index, seq) = unsafe { recv::slot_info(request.cast()) };
                // SAFETY: `comm` is the comm pointer the tag-checked receive slot recorded: a
                // live RecvComm until closeRecv, which NCCL calls only after its requests.
                let comm = unsafe {
                    object::expect::<recv::RecvComm>(comm.cast(), RECV_TAG, "test: request's comm")
                }?;
                // SAFETY: tag checked; one thread at a time per comm.
                unsafe { &mut *comm }.test(index, seq)?
            }
            other => {
                log_warn!(
                    "tcpx-socket: test on {request:p}, which is {}, not a request",
                    object::describe(other)
                );
                return Err(ResultCode::INVALID_ARGUMENT);
            }
        };
        if let Some(size) = result {
            *done = 1;
            if !sizes.is_null() && !crate::fault::no_sizes() {
                // SAFETY: a non-NULL sizes array has room for n = 1 entries.
                unsafe { *sizes = size as c_int };
            }
        }
        Ok(())
    })
}

unsafe extern "C" fn close_send(send_comm: *mut c_void) -> ncclResult_t {
    guard("closeSend", || {
        // SAFETY: a send comm pointer of this plugin (tag checked).
        let comm = unsafe {
            object::expect::<send::SendComm>(send_comm.cast(), SEND_TAG, "closeSend: sendComm")
        }?;
        // SAFETY: tag checked; created by Box::into_raw in `connect`; closed once.
        let name = unsafe { &*comm }.name().to_string();
        // SAFETY: tag checked; created by Box::into_raw in `connect`; closeSend is called
        // once, so this is the only destroy and nothing uses it afterwards.
        unsafe { send::destroy(comm) };
        log_info!("tcpx-socket: closed {name}");
        Ok(())
    })
}

unsafe extern "C" fn close_recv(recv_comm: *mut c_void) -> ncclResult_t {
    guard("closeRecv", || {
        // SAFETY: a receive comm pointer of this plugin (tag checked).
        let comm = unsafe {
            object::expect::<recv::RecvComm>(recv_comm.cast(), RECV_TAG, "closeRecv: recvComm")
        }?;
        // SAFETY: tag checked; created by Box::into_raw in `accept`; closed once.
        let name = unsafe { &*comm }.name().to_string();
        // SAFETY: tag checked; created by Box::into_raw in `accept`; closeRecv is called
        // once, so this is the only destroy and nothing uses it afterwards.
        unsafe { recv::destroy(comm) };
        log_info!("tcpx-socket: closed {name}");
        Ok(())
    })
}

unsafe extern "C" fn close_listen(listen_comm: *mut c_void) -> ncclResult_t {
    guard("closeListen", || {
        // SAFETY: a listen comm pointer of this plugin (tag checked).
        let comm = unsafe {
            object::expect::<listen::ListenComm>(
                listen_comm.cast(),
                LISTEN_TAG,
                "closeListen: listenComm",
            )
        }?;
        // SAFETY: tag checked; created by Box::into_raw in `listen`; closed once.
        unsafe { listen::destroy(comm) };
        Ok(())
    })
}

unsafe extern "C" fn get_device_mr(
    _comm: *mut c_void,
    _mhandle: *mut c_void,
    dptr_mhandle: *mut *mut c_void,
) -> ncclResult_t {
    // No device-side view of a host registration exists: report none.
    guard("getDeviceMr", || {
        // SAFETY: out-pointer contract of `getDeviceMr`.
        *unsafe { out(dptr_mhandle, "getDeviceMr: dptr_mhandle") }? = std::ptr::null_mut();
        Ok(())
    })
}

unsafe extern "C" fn irecv_consumed(
    recv_comm: *mut c_void,
    n: c_int,
    request: *mut c_void,
) -> ncclResult_t {
    guard("irecvConsumed", || {
        // SAFETY: a receive comm pointer of this plugin (tag checked).
        let comm = unsafe {
            object::expect::<recv::RecvComm>(recv_comm.cast(), RECV_TAG, "irecvConsumed: recvComm")
        }?;
        if n != 1 {
            log_warn!("tcpx-socket: irecvConsumed with n = {n}: receives take exactly one buffer");
            return Err(ResultCode::INVALID_ARGUMENT);
        }
        // SAFETY: `request` is NULL or an object of this plugin.
        let tag = unsafe { object::tag_of(request.cast(), "irecvConsumed: request") }?;
        if tag != RECV_REQ_TAG {
            log_warn!(
                "tcpx-socket: irecvConsumed on {request:p}, which is {}, not a receive request",
                object::describe(tag)
            );
            return Err(ResultCode::INVALID_ARGUMENT);
        }
        // SAFETY: tag checked: a receive slot.
        let (owner, _, seq) = unsafe { recv::slot_info(request.cast()) };
        if owner != comm {
            log_warn!("tcpx-socket: irecvConsumed: request {request:p} belongs to another comm");
            return Err(ResultCode::INVALID_ARGUMENT);
        }
        // SAFETY: tag checked; one thread at a time per comm.
        unsafe { &mut *comm }.consumed(seq)
    })
}

/// Number of connects in progress in this process (diagnostics).
pub fn pending_connects() -> usize {
    connect::pending_count()
}
