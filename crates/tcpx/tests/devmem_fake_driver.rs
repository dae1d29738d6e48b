//! tcpx-socket's devmem emulation against a stand-in CUDA driver (`fake_cuda/fake_libcuda.c`,
//! host memory posing as device memory), so the plugin's side of the mode — driver loading,
//! the UNPACK v7 device handle, per-comm allocations and their release on close, scattered
//! bounce pages, `loadMeta`/`cnt`, 16 in flight, busy, FIFO consumption, the 4 MiB limit, CUDA
//! sends — runs in CI without a GPU. The consumer's gather is the CPU reference
//! (`tcpx::cuda::unpack::gather_cpu`); `gpu_devmem.rs` does the same with the GPU kernel.
//!
//! The test builds the stand-in with the system C compiler (`$CC`, else `cc`) and points the
//! plugin at it with `TCPX_SOCKET_CUDA_LIB`; without a compiler it prints "skipped: …". This
//! binary holds one test, so its environment (`TCPX_SOCKET_DEVMEM=1`) reaches no other test.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::*;
use tcpx::cuda::unpack::{self, LoadMeta};
use tcpx::{
    DeviceType, ErrorKind, Memory, MemoryKind, Net, RecvComm, RecvRequest, ResultCode, SharedMemory,
};
use tcpx_sys::{tcpxUnpackDeviceHandle, tcpxUnpackMeta};

/// Pages of one slot region × 16 slots × 4 KiB: the plugin's bounce buffer size.
const BOUNCE_BYTES: usize = 16 * 1088 * 4096;

/// Builds the stand-in driver; `None` (after printing why) without a C compiler.
fn build_fake_driver() -> Option<PathBuf> {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fake_cuda/fake_libcuda.c");
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fake_cuda");
    std::fs::create_dir_all(&dir).expect("create the build directory");
    let out = dir.join("libcuda.so.1");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args(["-shared", "-fPIC", "-O1", "-pthread", "-o"])
        .arg(&out)
        .arg(&src)
        .status();
    match status {
        Ok(s) if s.success() => Some(out),
        other => {
            println!("skipped: cannot build the stand-in CUDA driver with {cc}: {other:?}");
            None
        }
    }
}

/// The stand-in driver, opened by the test for its helpers (the same library instance the
/// plugin uses: same path).
struct Fake {
    lib: libloading::Library,
}

impl Fake {
    /// A zeroed "device" allocation the stand-in knows, as CUDA memory.
    fn device(&self, len: usize) -> SharedMemory {
        // SAFETY: the stand-in's helper has exactly this signature.
        let alloc = unsafe {
            self.lib
                .get::<unsafe extern "C" fn(usize) -> u64>(b"fake_device_alloc\0")
                .unwrap()
        };
        // SAFETY: plain allocation, no preconditions.
        let p = unsafe { alloc(len.max(1)) };
        SharedMemory::new(FakeDeviceMemory(p as *mut u8, len.max(1)))
    }

    /// A "device" allocation holding `data`.
    fn device_with(&self, data: &[u8]) -> SharedMemory {
        let m = self.device(data.len());
        // SAFETY: the stand-in's device memory is host memory of at least data.len() bytes,
        // not shared with anyone yet.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), m.as_ptr(), data.len()) };
        m
    }

    /// Allocations the stand-in tracks (device and pinned host).
    fn live(&self) -> i32 {
        // SAFETY: the stand-in's helper has exactly this signature.
        let f = unsafe {
            self.lib
                .get::<unsafe extern "C" fn() -> i32>(b"fake_live_allocs\0")
                .unwrap()
        };
        // SAFETY: no arguments, no preconditions.
        unsafe { f() }
    }
}

/// "Device" memory of the stand-in driver (host memory in truth; leaked: tests are short).
struct FakeDeviceMemory(*mut u8, usize);

// SAFETY: a plain allocation, valid for the life of the process, used through SharedMemory.
unsafe impl Send for FakeDeviceMemory {}
// SAFETY: a plain allocation, valid for the life of the process; shared use reads only the
// pointer and length, and the bytes are accessed through SharedMemory's own checks.
unsafe impl Sync for FakeDeviceMemory {}
// SAFETY: the range is one live allocation of the stand-in, never freed; kind Cuda is what the
// plugin checks it as (the stand-in answers DEVICE for it).
unsafe impl Memory for FakeDeviceMemory {
    fn as_ptr(&self) -> *mut u8 {
        self.0
    }
    fn len(&self) -> usize {
        self.1
    }
    fn kind(&self) -> MemoryKind {
        MemoryKind::Cuda
    }
}

/// Metadata and bounce buffer, found through the accept's device handle.
struct Queue {
    meta: *const tcpxUnpackMeta,
    bounce: *const u8,
}

fn queue(recv: &RecvComm) -> Queue {
    let h = recv
        .device_handle()
        .expect("accept returned a device handle");
    assert_eq!(
        (
            h.netDeviceType,
            h.netDeviceVersion,
            h.size,
            h.needsProxyProgress
        ),
        (1, 7, 24, 0)
    );
    // SAFETY: with the stand-in, the device struct is host memory of 24 bytes, alive while the
    // comm is.
    let st = unsafe { *(h.handle as *const tcpxUnpackDeviceHandle) };
    assert_eq!(st.head, u64::MAX);
    Queue {
        meta: st.meta,
        bounce: st.bounce_buf as *const u8,
    }
}

/// The consumer's side of one completed receive into `dst[offset..]`: the destination is
/// untouched, the fragments are sane, and gathering them gives `expected`. Returns the count.
fn unpack(
    q: &Queue,
    recv: &RecvComm,
    req: &RecvRequest,
    dst: &SharedMemory,
    offset: usize,
    expected: &[u8],
) -> usize {
    let slot = recv.unpack_slot(req);
    // SAFETY: the plugin's metadata, alive while the comm is.
    let count = unsafe { unpack::read_slot_count(q.meta, slot) }.unwrap() as usize;
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
    // SAFETY: the destination is the test's own allocation; the receive is done, so the plugin
    // no longer owns it, and no other reference to it exists.
    let out = unsafe { std::slice::from_raw_parts_mut(dst.as_ptr().add(offset), expected.len()) };
    assert!(
        out.iter().all(|&b| b == 0),
        "the plugin wrote the destination"
    );
    assert!(metas.iter().all(|m| m.len > 0 && m.len <= 4096));
    if expected.len() >= 256 << 10 {
        assert!(
            !metas.windows(2).all(|w| w[0].src_off < w[1].src_off),
            "pages not scattered"
        );
        assert!(metas.iter().any(|m| m.len < 4096), "no short fragments");
    }
    // SAFETY: the bounce buffer is BOUNCE_BYTES of (stand-in) memory, alive while the comm is.
    let bounce = unsafe { std::slice::from_raw_parts(q.bounce, BOUNCE_BYTES) };
    assert_eq!(
        unpack::gather_cpu(bounce, &metas, out).unwrap(),
        expected.len() as u64
    );
    assert!(&out[..] == expected, "gathered bytes differ");
    count
}

#[test]
fn devmem_mode_runs_end_to_end_on_a_stand_in_driver() {
    let Some(path) = build_fake_driver() else {
        return;
    };
    loopback();
    std::env::set_var(tcpx_socket::CUDA_LIB_ENV, &path);
    std::env::set_var(tcpx_socket::DEVMEM_ENV, "1");
    let net = Net::builtin().expect("devmem init with the stand-in driver");
    // SAFETY: the stand-in has no ELF initializers; it is the library the plugin loaded.
    let lib = unsafe { libloading::Library::new(&path) }.unwrap();
    let fake = Fake { lib };
    let props = net.device(0).unwrap().properties;
    assert!(props.ptr_support.host() && props.ptr_support.cuda());
    assert_eq!(
        (props.device_type, props.device_version),
        (DeviceType::UNPACK, 7)
    );
    let base = fake.live();

    // Sizes, from "device" and host sources, into "device" memory and (last) host memory.
    let (mut send, mut recv) = pair(&net);
    assert_eq!(
        fake.live(),
        base + 3,
        "metadata, bounce buffer and device struct"
    );
    let q = queue(&recv);
    let lens = [1usize, 4097, 1 << 20, 4 << 20, 65_537];
    let datas: Vec<Vec<u8>> = lens
        .iter()
        .enumerate()
        .map(|(i, &l)| pattern(i as u64 + 1, l))
        .collect();
    let sources: Vec<SharedMemory> = datas
        .iter()
        .enumerate()
        .map(|(i, d)| {
            if i % 2 == 0 {
                fake.device_with(d)
            } else {
                let m = SharedMemory::host(d.len()).unwrap();
                m.with_bytes_mut(|b| b.copy_from_slice(d)).unwrap();
                m
            }
        })
        .collect();
    let sender = std::thread::spawn(move || {
        for s in &sources {
            let region = send.register(s).unwrap();
            let mut req = post_send(&mut send, &region, 0, s.len());
            assert_eq!(wait_send(&mut send, &mut req), s.len());
        }
        send
    });
    for (i, d) in datas.iter().enumerate() {
        let host = i == datas.len() - 1;
        let dst = if host {
            SharedMemory::host(d.len()).unwrap()
        } else {
            fake.device(d.len())
        };
        let region = recv.register(&dst).unwrap();
        let mut req = post_recv(&mut recv, &region, 0, d.len());
        assert_eq!(wait_recv(&mut recv, &mut req), d.len());
        if host {
            let slot = recv.unpack_slot(&req);
            // SAFETY: the plugin's metadata, alive while the comm is.
            assert_eq!(unsafe { unpack::read_slot_count(q.meta, slot) }.unwrap(), 0);
            recv.consumed(req).unwrap();
            dst.with_bytes(|b| assert!(b == &d[..])).unwrap();
        } else {
            let n = unpack(&q, &recv, &req, &dst, 0, d);
            println!("{} bytes: {n} fragments", d.len());
            recv.consumed(req).unwrap();
        }
    }
    drop(sender.join().unwrap());
    let before_close = fake.live();
    drop(recv);
    assert_eq!(
        fake.live(),
        before_close - 3,
        "closeRecv freed the comm's three allocations"
    );

    // 16 in flight, the 17th busy until the oldest is consumed, consumption in FIFO order.
    let (mut send, mut recv) = pair(&net);
    let q = queue(&recv);
    const CAP: usize = 128 << 10;
    let datas: Vec<Vec<u8>> = (0..17)
        .map(|i| pattern(100 + i as u64, CAP - 4096 * i - i))
        .collect();
    let sources: Vec<SharedMemory> = datas.iter().map(|d| fake.device_with(d)).collect();
    let sender = std::thread::spawn(move || {
        for s in &sources {
            let region = send.register(s).unwrap();
            let mut req = post_send(&mut send, &region, 0, s.len());
            assert_eq!(wait_send(&mut send, &mut req), s.len());
        }
        send
    });
    let dst = fake.device(17 * CAP);
    let region = recv.register(&dst).unwrap();
    let mut reqs: Vec<RecvRequest> = (0..16)
        .map(|i| post_recv(&mut recv, &region, i * CAP, CAP))
        .collect();
    assert!(
        recv.irecv(&region, 16 * CAP, CAP, 0).unwrap().is_none(),
        "17th: busy"
    );
    for (i, r) in reqs.iter_mut().enumerate() {
        assert_eq!(wait_recv(&mut recv, r), datas[i].len());
        assert_eq!(recv.unpack_slot(r), i);
    }
    assert!(
        recv.irecv(&region, 16 * CAP, CAP, 0).unwrap().is_none(),
        "still busy: none consumed"
    );
    for (i, r) in reqs.iter().enumerate() {
        unpack(&q, &recv, r, &dst, i * CAP, &datas[i]);
    }
    let mut reqs = reqs.into_iter();
    let (r0, r1) = (reqs.next().unwrap(), reqs.next().unwrap());
    assert!(recv.consumed(r1).is_err(), "out of order");
    recv.consumed(r0).unwrap();
    let mut r16 = post_recv(&mut recv, &region, 16 * CAP, CAP);
    assert_eq!(recv.unpack_slot(&r16), 0);
    assert_eq!(wait_recv(&mut recv, &mut r16), datas[16].len());
    unpack(&q, &recv, &r16, &dst, 16 * CAP, &datas[16]);
    for r in reqs {
        recv.consumed(r).unwrap();
    }
    recv.consumed(r16).unwrap();
    drop(sender.join().unwrap());

    // Over 4 MiB into CUDA memory: refused, the comm stays usable.
    let big = fake.device(5 << 20);
    let big_region = recv.register(&big).unwrap();
    let err = recv.irecv(&big_region, 0, (4 << 20) + 1, 0).unwrap_err();
    assert!(
        matches!(err.kind(), ErrorKind::Plugin(c) if *c == ResultCode::INVALID_ARGUMENT),
        "{err}"
    );
    assert!(recv.irecv(&big_region, 0, 4 << 20, 0).unwrap().is_some());
    drop(big_region);
    drop(region);
    let before_close = fake.live();
    drop(recv);
    assert_eq!(
        fake.live(),
        before_close - 3,
        "closeRecv with a receive in flight"
    );
}
