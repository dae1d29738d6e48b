//! End to end through tcpx-socket's devmem emulation (`TCPX_SOCKET_DEVMEM=1`): loopback comms
//! whose CUDA receives land in the plugin's GPU bounce buffer in scattered 4 KiB pages; the test
//! plays the consumer: device handle → device struct → mapped metadata → `cnt[slot]` and the
//! `loadMeta`s → the unpack kernel of `tcpx::cuda::unpack` (and the CPU reference gather) →
//! `irecvConsumed`, then compares the destination with what was sent.
//!
//! Every test prints "skipped: no CUDA driver (…)" and passes where there is no driver (CI); on
//! a GPU machine they run for real (scripts/gpu/run_gpu_suite.sh). The whole binary runs with
//! devmem mode on: the variable is set once, before the built-in plugin initializes (every
//! test goes through [`setup`]); no other test binary sees it.

mod common;

use std::sync::Once;

use common::*;
use cudarc::driver::sys;
use tcpx::cuda::unpack::{self, LoadMeta, UnpackEntry, Unpacker};
use tcpx::cuda::{self, CudaDevice};
use tcpx::{
    DeviceType, ErrorKind, MemoryKind, Net, RecvComm, RecvRequest, ResultCode, SharedMemory,
};
use tcpx_sys::{tcpxUnpackDeviceHandle, tcpxUnpackMeta, NCCL_NET_DEVICE_UNPACK};

/// Largest receive into CUDA memory the emulation takes (2048 fragments of ≤ 4 KiB).
const MAX_RECV: usize = 4 << 20;

struct Env {
    gpu: CudaDevice,
    net: Net,
    unpacker: Unpacker,
}

/// GPU 0, the built-in plugin in devmem mode and an unpacker; `None` (after printing why) when
/// there is no CUDA driver.
fn setup() -> Option<Env> {
    if let Some(why) = cuda::skip_reason() {
        println!("{why}");
        return None;
    }
    loopback();
    static DEVMEM: Once = Once::new();
    DEVMEM.call_once(|| std::env::set_var(tcpx_socket::DEVMEM_ENV, "1"));
    let gpu = CudaDevice::new(0).expect("CUDA device 0");
    let net = Net::builtin().expect("the built-in plugin initializes in devmem mode");
    let unpacker = Unpacker::new(&gpu).expect("the unpack kernel loads");
    Some(Env { gpu, net, unpacker })
}

/// What the device handle of a receive comm leads to.
struct Queue {
    /// Device address of the metadata.
    meta_dev: u64,
    /// Host address of the same (pinned, mapped) memory.
    meta: *const tcpxUnpackMeta,
    /// Device address of the bounce buffer.
    bounce: u64,
}

/// Follows the accept's device handle: UNPACK v7 → device struct → metadata and bounce buffer.
fn queue(gpu: &CudaDevice, recv: &RecvComm) -> Queue {
    let h = recv
        .device_handle()
        .expect("accept returned a device handle");
    assert_eq!(h.netDeviceType, NCCL_NET_DEVICE_UNPACK);
    assert_eq!(h.netDeviceVersion, 7);
    assert_eq!(h.size, 24);
    assert_eq!(h.needsProxyProgress, 0);
    assert!(!h.handle.is_null());
    let mut st = tcpxUnpackDeviceHandle {
        meta: std::ptr::null_mut(),
        bounce_buf: std::ptr::null_mut(),
        head: 0,
    };
    // SAFETY: the handle points at the plugin's 24-byte device struct, alive while the comm is;
    // the destination is a local of that size with no reference to it alive during the copy.
    unsafe {
        gpu.copy_raw(
            (&mut st as *mut tcpxUnpackDeviceHandle) as u64,
            h.handle as u64,
            24,
        )
    }
    .expect("read the device struct");
    assert_eq!(st.head, u64::MAX, "head starts at u64::MAX");
    assert!(!st.meta.is_null() && !st.bounce_buf.is_null());
    gpu.bind().unwrap();
    let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
    // SAFETY: writes one pointer into a local; the context is current; st.meta is a mapped
    // pinned host allocation of the plugin.
    let rc = unsafe {
        sys::cuPointerGetAttribute(
            (&mut host as *mut *mut std::ffi::c_void).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_HOST_POINTER,
            st.meta as u64,
        )
    };
    assert_eq!(rc, sys::CUresult::CUDA_SUCCESS, "meta is host memory");
    assert!(!host.is_null());
    Queue {
        meta_dev: st.meta as u64,
        meta: host.cast_const().cast(),
        bounce: st.bounce_buf as u64,
    }
}

/// Device → host copy of `len` bytes at device address `src`.
fn read_device(gpu: &CudaDevice, src: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    if len > 0 {
        // SAFETY: `src..src+len` is live device memory of the test; `out` is a fresh vector.
        unsafe { gpu.copy_raw(out.as_mut_ptr() as u64, src, len) }.unwrap();
    }
    out
}

/// After `test` reported `req` done with `size` bytes into `dst[offset..]`: checks that the
/// plugin left the destination alone, checks the fragments, gathers them with the kernel and
/// with the CPU reference, and compares both with `expected`. Returns the fragment count.
fn unpack_and_check(
    env: &Env,
    q: &Queue,
    recv: &RecvComm,
    req: &RecvRequest,
    dst: &SharedMemory,
    offset: usize,
    expected: &[u8],
) -> usize {
    let size = expected.len();
    assert_eq!(req.received(), Some(size));
    let slot = recv.unpack_slot(req);
    assert_eq!(slot as u64, req.sequence() % 16);
    // SAFETY: the plugin's mapped metadata, alive while the comm is.
    let count = unsafe { unpack::read_slot_count(q.meta, slot) }.expect("cnt[slot]") as usize;
    // SAFETY: mem[slot][..count] lies inside the metadata (count ≤ 2048 checked above).
    let metas: Vec<LoadMeta> = unsafe {
        std::slice::from_raw_parts(
            q.meta
                .cast::<u8>()
                .add(unpack::slot_offset(slot))
                .cast::<LoadMeta>(),
            count,
        )
    }
    .to_vec();
    assert!(count <= unpack::MAX_FRAGMENTS_PER_SLOT);
    assert_eq!(count == 0, size == 0);
    let total: u64 = metas.iter().map(|m| m.len as u64).sum();
    assert_eq!(total, size as u64, "fragments cover the message");
    for m in &metas {
        assert!(m.len > 0 && m.len <= 4096, "{m:?}");
        assert!(m.dst_off + m.len as u64 <= size as u64, "{m:?}");
    }
    if size >= 64 << 10 {
        assert!(
            !metas.windows(2).all(|w| w[0].src_off < w[1].src_off),
            "bounce pages of a {size}-byte receive should be scattered"
        );
        if size >= 256 << 10 || size % 4096 != 0 {
            assert!(metas.iter().any(|m| m.len < 4096), "some short fragments");
        }
    }
    let dst_addr = dst.as_ptr() as u64 + offset as u64;
    assert!(
        read_device(&env.gpu, dst_addr, size)
            .iter()
            .all(|&b| b == 0),
        "the plugin must not write the destination (the consumer unpacks)"
    );
    // The CPU reference, from a copy of the bounce span the fragments use.
    if count > 0 {
        let lo = metas.iter().map(|m| m.src_off).min().unwrap();
        let hi = metas.iter().map(|m| m.src_off + m.len).max().unwrap();
        let bounce = read_device(&env.gpu, q.bounce + lo as u64, (hi - lo) as usize);
        let rebased: Vec<LoadMeta> = metas
            .iter()
            .map(|m| LoadMeta {
                src_off: m.src_off - lo,
                ..*m
            })
            .collect();
        let mut cpu = vec![0u8; size];
        unpack::gather_cpu(&bounce, &rebased, &mut cpu).expect("CPU gather");
        assert!(cpu == expected, "CPU gather of {size} bytes differs");
    }
    let entry = UnpackEntry {
        metas: q.meta_dev + unpack::slot_offset(slot) as u64,
        count: count as u32,
        bounce: q.bounce,
        bounce_len: u64::MAX,
        dst: dst_addr,
        dst_len: size as u64,
    };
    // SAFETY: the metas are the plugin's (valid until irecvConsumed, which comes after `wait`),
    // the bounce buffer is alive while the comm is, and `dst..dst+size` is the test's device
    // buffer, which nothing else touches until the launch completes (`wait`).
    let launch = unsafe { env.unpacker.launch(&[entry]) }.expect("launch");
    launch.wait().expect("unpack kernel");
    let got = read_device(&env.gpu, dst_addr, size);
    if let Some(i) = got.iter().zip(expected).position(|(a, b)| a != b) {
        panic!("GPU unpack of {size} bytes differs at byte {i} (slot {slot}, {count} fragments)");
    }
    count
}

/// A source of `data`: CUDA memory or host memory.
fn source(gpu: &CudaDevice, data: &[u8], on_gpu: bool) -> SharedMemory {
    if on_gpu {
        let buf = gpu.alloc(data.len().max(1)).unwrap();
        buf.copy_from_host(0, data).unwrap();
        SharedMemory::new(buf)
    } else {
        let m = SharedMemory::host(data.len().max(1)).unwrap();
        m.with_bytes_mut(|b| b[..data.len()].copy_from_slice(data))
            .unwrap();
        m
    }
}

#[test]
fn devmem_device_reports_unpack_v7_and_cuda_pointers() {
    let Some(env) = setup() else { return };
    let props = env.net.device(0).unwrap().properties;
    assert!(
        props.ptr_support.host() && props.ptr_support.cuda(),
        "{props:?}"
    );
    assert_eq!(props.device_type, DeviceType::UNPACK);
    assert_eq!(props.device_version, 7);
}

#[test]
fn cuda_receives_are_unpacked_end_to_end() {
    let Some(env) = setup() else { return };
    let (mut send, mut recv) = pair(&env.net);
    let q = queue(&env.gpu, &recv);
    let lens = [1usize, 4097, 1 << 20, MAX_RECV, 65_537];
    let datas: Vec<Vec<u8>> = lens
        .iter()
        .enumerate()
        .map(|(i, &len)| pattern(i as u64 + 1, len))
        .collect();
    // Even messages come from CUDA memory (staged by the plugin), odd ones from host memory.
    let sources: Vec<SharedMemory> = datas
        .iter()
        .enumerate()
        .map(|(i, d)| source(&env.gpu, d, i % 2 == 0))
        .collect();
    let sender = std::thread::spawn(move || {
        for (src, len) in sources.iter().zip(lens) {
            let region = send.register(src).unwrap();
            let mut req = post_send(&mut send, &region, 0, len);
            assert_eq!(wait_send(&mut send, &mut req), len);
        }
    });
    for (i, data) in datas.iter().enumerate() {
        let len = data.len();
        if i == lens.len() - 1 {
            // A host destination in devmem mode: the bytes land in place and cnt[slot] is 0.
            let dst = SharedMemory::host(len).unwrap();
            let region = recv.register(&dst).unwrap();
            let mut req = post_recv(&mut recv, &region, 0, len);
            assert_eq!(wait_recv(&mut recv, &mut req), len);
            let slot = recv.unpack_slot(&req);
            // SAFETY: the plugin's mapped metadata, alive while the comm is.
            assert_eq!(unsafe { unpack::read_slot_count(q.meta, slot) }.unwrap(), 0);
            recv.consumed(req).unwrap();
            dst.with_bytes(|b| assert!(b == &data[..], "host receive differs"))
                .unwrap();
            continue;
        }
        let dst = SharedMemory::new(env.gpu.alloc(len).unwrap());
        assert_eq!(dst.kind(), MemoryKind::Cuda);
        let region = recv.register(&dst).unwrap();
        let mut req = post_recv(&mut recv, &region, 0, len);
        assert_eq!(wait_recv(&mut recv, &mut req), len);
        let n = unpack_and_check(&env, &q, &recv, &req, &dst, 0, data);
        println!("{len} bytes: {n} fragments");
        recv.consumed(req).unwrap();
    }
    sender.join().unwrap();
}

#[test]
fn sixteen_in_flight_then_busy_until_consumed_in_fifo_order() {
    let Some(env) = setup() else { return };
    let (mut send, mut recv) = pair(&env.net);
    let q = queue(&env.gpu, &recv);
    const N: usize = 17;
    const CAP: usize = 128 << 10;
    // Message i is a little shorter than the posted receive, and different in length.
    let datas: Vec<Vec<u8>> = (0..N)
        .map(|i| pattern(100 + i as u64, CAP - 4096 * i - i))
        .collect();
    let sources: Vec<SharedMemory> = datas
        .iter()
        .enumerate()
        .map(|(i, d)| source(&env.gpu, d, i % 3 != 0))
        .collect();
    let sender = std::thread::spawn(move || {
        for src in &sources {
            let region = send.register(src).unwrap();
            let len = src.len();
            let mut req = post_send(&mut send, &region, 0, len);
            assert_eq!(wait_send(&mut send, &mut req), len);
        }
    });
    let dst = SharedMemory::new(env.gpu.alloc(N * CAP).unwrap());
    let region = recv.register(&dst).unwrap();
    let mut reqs: Vec<RecvRequest> = (0..16)
        .map(|i| post_recv(&mut recv, &region, i * CAP, CAP))
        .collect();
    assert!(
        recv.irecv(&region, 16 * CAP, CAP, 0).unwrap().is_none(),
        "the 17th receive in flight must answer busy"
    );
    for (i, req) in reqs.iter_mut().enumerate() {
        assert_eq!(wait_recv(&mut recv, req), datas[i].len());
        assert_eq!(recv.unpack_slot(req), i);
    }
    assert!(
        recv.irecv(&region, 16 * CAP, CAP, 0).unwrap().is_none(),
        "done but unconsumed receives still hold their slots"
    );
    for (i, req) in reqs.iter().enumerate() {
        unpack_and_check(&env, &q, &recv, req, &dst, i * CAP, &datas[i]);
    }
    let mut reqs = reqs.into_iter();
    let r0 = reqs.next().unwrap();
    let r1 = reqs.next().unwrap();
    // Out of order: refused (the request is then consumed on its turn, after #0).
    assert!(recv.consumed(r1).is_err());
    recv.consumed(r0).unwrap();
    // Slot 0 is free again: the 17th receive takes it.
    let mut r16 = post_recv(&mut recv, &region, 16 * CAP, CAP);
    assert_eq!(recv.unpack_slot(&r16), 0);
    assert_eq!(wait_recv(&mut recv, &mut r16), datas[16].len());
    unpack_and_check(&env, &q, &recv, &r16, &dst, 16 * CAP, &datas[16]);
    for r in reqs {
        recv.consumed(r).unwrap();
    }
    recv.consumed(r16).unwrap();
    sender.join().unwrap();
}

#[test]
fn cuda_receives_over_4_mib_are_refused_and_the_comm_stays_usable() {
    let Some(env) = setup() else { return };
    let (mut send, mut recv) = pair(&env.net);
    let q = queue(&env.gpu, &recv);
    let dst = SharedMemory::new(env.gpu.alloc(MAX_RECV + 4096).unwrap());
    let region = recv.register(&dst).unwrap();
    let err = recv.irecv(&region, 0, MAX_RECV + 1, 0).unwrap_err();
    assert!(
        matches!(err.kind(), ErrorKind::Plugin(code) if *code == ResultCode::INVALID_ARGUMENT),
        "{err}"
    );
    let data = pattern(7, 3);
    let src = source(&env.gpu, &data, true);
    let sender = std::thread::spawn(move || {
        let region = send.register(&src).unwrap();
        let mut req = post_send(&mut send, &region, 0, 3);
        assert_eq!(wait_send(&mut send, &mut req), 3);
    });
    let mut req = post_recv(&mut recv, &region, 0, MAX_RECV);
    assert_eq!(wait_recv(&mut recv, &mut req), 3);
    unpack_and_check(&env, &q, &recv, &req, &dst, 0, &data);
    recv.consumed(req).unwrap();
    sender.join().unwrap();
}
