//! The plugin driven through `tcpx_sys::NetPlugin`, linked and dlopened, over loopback.

mod common;

use std::ffi::{c_void, CStr};
use std::io::Write;
use std::net::TcpStream;
use std::ptr::null_mut;
use std::time::{Duration, Instant};

use common::*;
use proptest::prelude::*;
use tcpx_sys::{
    ncclNetProperties_v8_t, AbiError, AbiVersion, NetPlugin, ResultCode, HANDLE_SIZE,
    NCCL_NET_DEVICE_HOST, NCCL_PTR_CUDA, NCCL_PTR_HOST,
};

const MIB: usize = 1 << 20;

fn props(p: &NetPlugin) -> ncclNetProperties_v8_t {
    let mut ndev = 0;
    // SAFETY: initialized plugin, valid out pointers.
    ok(unsafe { p.devices(&mut ndev) });
    assert_eq!(ndev, 1, "TCPX_SOCKET_IFNAME=lo exposes exactly lo");
    // SAFETY: ncclNetProperties_v8_t is plain C data, for which all-zero bytes are valid.
    let mut props: ncclNetProperties_v8_t = unsafe { std::mem::zeroed() };
    // SAFETY: device 0 exists.
    ok(unsafe { p.get_properties(0, &mut props) });
    props
}

#[test]
fn properties_describe_loopback_as_a_host_device() {
    setup();
    for p in [linked(), loaded_v8(), loaded_v7()] {
        let props = props(p);
        // SAFETY: the plugin's name string lives for the process.
        let name = unsafe { CStr::from_ptr(props.name) }.to_str().unwrap();
        assert_eq!(name, "lo");
        assert!(props.pciPath.is_null(), "lo has no PCI device");
        assert_eq!(props.ptrSupport, NCCL_PTR_HOST);
        assert_eq!(props.speed, tcpx_socket::DEFAULT_SPEED_MBPS);
        assert_eq!(props.maxRecvs, 1);
        assert_eq!(props.maxComms, 65536);
        assert_eq!(props.netDeviceType, NCCL_NET_DEVICE_HOST);
        assert_eq!(props.netDeviceVersion, 0);
        assert_eq!(props.regIsGlobal, 0);
        assert_eq!(props.guid, 0);
        assert_eq!(p.name(), tcpx_socket::PLUGIN_NAME);
        // SAFETY: out of range device.
        let rc = unsafe { p.get_properties(7, &mut props.clone()) }.unwrap();
        assert_eq!(rc, ResultCode::INVALID_ARGUMENT);
    }
    assert_eq!(loaded_v7().version(), AbiVersion::V7);
    assert_eq!(loaded_v8().version(), AbiVersion::V8);
}

#[test]
fn init_twice_is_fine() {
    let p = linked();
    // SAFETY: the shim logger stays valid.
    ok(unsafe { p.init(tcpx_sys::logger::shim_logger()) });
    props(p);
}

#[test]
fn moves_assorted_sizes_linked() {
    let pair = pair(linked(), DevHandle::Null);
    transfer(&pair, &[1, 4096, MIB, 4097, 1_000_003, 0, 7, 65536], 1);
    transfer(&pair, &[MIB; 40], 2);
    pair.close();
}

#[test]
fn moves_64_mib_messages() {
    let pair = pair(linked(), DevHandle::Null);
    transfer(&pair, &[64 * MIB, 64 * MIB + 1], 3);
    pair.close();
}

#[test]
fn moves_many_small_messages() {
    let pair = pair(linked(), DevHandle::Preset);
    let sizes: Vec<usize> = (0..2000).map(|i| (i * 37) % 300).collect();
    transfer(&pair, &sizes, 4);
    pair.close();
}

#[test]
fn moves_data_through_dlopened_v8_and_v7_tables() {
    for p in [loaded_v8(), loaded_v7()] {
        let pair = pair(p, DevHandle::Preset);
        transfer(&pair, &[1, 4097, 1_000_003, 4 * MIB], 5);
        pair.close();
    }
}

#[test]
fn v7_refuses_registrations_of_2_gib() {
    let p = loaded_v7();
    let pair = pair(p, DevHandle::Null);
    let mut mh = null_mut();
    // The loader refuses before calling the plugin: no memory is touched.
    // SAFETY: refused by the loader; the pointer is never dereferenced.
    let err = unsafe {
        p.reg_mr(
            pair.send,
            std::ptr::NonNull::<u8>::dangling().as_ptr().cast(),
            1 << 31,
            NCCL_PTR_HOST,
            &mut mh,
        )
    }
    .unwrap_err();
    assert!(matches!(err, AbiError::SizeTooLarge { .. }), "{err:?}");
    pair.close();
}

#[test]
fn both_tables_are_exported_by_the_cdylib() {
    setup();
    // SAFETY: loading our own plugin library.
    let lib = unsafe { libloading::Library::new(dylib_path()) }.unwrap();
    for sym in ["ncclNetPlugin_v8", "ncclNetPlugin_v7"] {
        // SAFETY: data symbols; only their address is taken.
        let s = unsafe { lib.get::<*const c_void>(sym.as_bytes()) }.unwrap();
        assert!(!(*s).is_null(), "{sym}");
    }
}

#[test]
fn seventeenth_post_is_busy_until_a_request_completes() {
    let p = linked();
    let pair = pair(p, DevHandle::Null);
    let (mut src, mut dst) = pair.buffers(9, 17 * 100);
    let sreqs: Vec<_> = (0..16)
        .map(|i| isend(p, pair.send, &mut src, i * 100, 100))
        .collect();
    let rreqs: Vec<_> = (0..16)
        .map(|i| irecv(p, pair.recv, &mut dst, i * 100, 100))
        .collect();
    assert!(sreqs.iter().chain(&rreqs).all(|r| !r.is_null()));
    assert!(
        isend(p, pair.send, &mut src, 1600, 100).is_null(),
        "17th isend must be busy"
    );
    assert!(
        irecv(p, pair.recv, &mut dst, 1600, 100).is_null(),
        "17th irecv must be busy"
    );
    let start = Instant::now();
    let (mut s0, mut r0) = (false, false);
    while !(s0 && r0) {
        assert!(start.elapsed() < DEADLINE);
        s0 = s0 || test(p, sreqs[0]).unwrap().is_some();
        r0 = r0 || test(p, rreqs[0]).unwrap().is_some();
    }
    let s17 = isend(p, pair.send, &mut src, 1600, 100);
    let r17 = irecv(p, pair.recv, &mut dst, 1600, 100);
    assert!(
        !s17.is_null() && !r17.is_null(),
        "a slot frees once the oldest completes"
    );
    let mut sq: Vec<_> = sreqs[1..].to_vec();
    sq.push(s17);
    let mut rq: Vec<_> = rreqs[1..].to_vec();
    rq.push(r17);
    let start = Instant::now();
    while !sq.is_empty() || !rq.is_empty() {
        assert!(start.elapsed() < DEADLINE);
        if let Some(&r) = sq.first() {
            if test(p, r).unwrap().is_some() {
                sq.remove(0);
            }
        }
        if let Some(&r) = rq.first() {
            if test(p, r).unwrap().is_some() {
                rq.remove(0);
            }
        }
    }
    let src = deregister(p, pair.send, src);
    let dst = deregister(p, pair.recv, dst);
    assert_eq!(src, dst);
    pair.close();
}

#[test]
fn test_is_legal_only_on_the_oldest_request() {
    let p = linked();
    let pair = pair(p, DevHandle::Null);
    let (mut src, mut dst) = pair.buffers(10, 200);
    let s0 = isend(p, pair.send, &mut src, 0, 100);
    let s1 = isend(p, pair.send, &mut src, 100, 100);
    let r0 = irecv(p, pair.recv, &mut dst, 0, 100);
    let r1 = irecv(p, pair.recv, &mut dst, 100, 100);
    assert_eq!(test(p, s1), Err(ResultCode::INVALID_USAGE));
    assert_eq!(test(p, r1), Err(ResultCode::INVALID_USAGE));
    assert!(logged(&[
        "test on send request #1",
        "oldest outstanding is #0"
    ]));
    // The comm is still usable: the misuse did not fail it.
    complete_in_order(p, &[s0, r0, s1, r1]);
    assert_eq!(deregister(p, pair.send, src), deregister(p, pair.recv, dst));
    pair.close();
}

#[test]
fn consumption_is_required_with_a_preset_device_handle() {
    let p = linked();
    let pair = pair(p, DevHandle::Preset);
    let dh = pair.dev_handle.as_ref().unwrap();
    assert_eq!(dh.netDeviceType, NCCL_NET_DEVICE_HOST);
    assert_eq!(dh.netDeviceVersion, 0);
    assert!(dh.handle.is_null());
    assert_eq!((dh.size, dh.needsProxyProgress), (0, 0));

    let (mut src, mut dst) = pair.buffers(11, 17 * 64);
    let rreqs: Vec<_> = (0..16)
        .map(|i| irecv(p, pair.recv, &mut dst, i * 64, 64))
        .collect();
    // Consuming before done is refused.
    // SAFETY: live comm and request.
    let rc = unsafe { p.irecv_consumed(pair.recv, 1, rreqs[0]) }.unwrap();
    assert_eq!(rc, ResultCode::INVALID_USAGE);
    let sreqs: Vec<_> = (0..16)
        .map(|i| isend(p, pair.send, &mut src, i * 64, 64))
        .collect();
    let start = Instant::now();
    let (mut si, mut ri) = (0, 0);
    while si < 16 || ri < 16 {
        assert!(start.elapsed() < DEADLINE);
        if si < 16 && test(p, sreqs[si]).unwrap().is_some() {
            si += 1;
        }
        if ri < 16 && test(p, rreqs[ri]).unwrap().is_some() {
            ri += 1;
        }
    }
    // All 16 done, none consumed: the slots are still held.
    assert!(irecv(p, pair.recv, &mut dst, 16 * 64, 64).is_null());
    // Out of order is refused.
    // SAFETY: live comm and request.
    let rc = unsafe { p.irecv_consumed(pair.recv, 1, rreqs[1]) }.unwrap();
    assert_eq!(rc, ResultCode::INVALID_USAGE);
    assert!(logged(&["out of order", "oldest unconsumed receive is #0"]));
    // In order frees exactly one slot.
    // SAFETY: live comm, oldest completed request.
    ok(unsafe { p.irecv_consumed(pair.recv, 1, rreqs[0]) });
    let r16 = irecv(p, pair.recv, &mut dst, 16 * 64, 64);
    assert!(!r16.is_null());
    assert!(irecv(p, pair.recv, &mut dst, 16 * 64, 64).is_null());
    for &r in &rreqs[1..] {
        // SAFETY: live comm, requests consumed in order.
        ok(unsafe { p.irecv_consumed(pair.recv, 1, r) });
    }
    let s16 = isend(p, pair.send, &mut src, 16 * 64, 64);
    complete_in_order(p, &[s16, r16]);
    // SAFETY: live comm, oldest completed request.
    ok(unsafe { p.irecv_consumed(pair.recv, 1, r16) });
    assert_eq!(deregister(p, pair.send, src), deregister(p, pair.recv, dst));
    pair.close();
}

#[test]
fn without_a_device_handle_test_releases_slots() {
    for dh in [DevHandle::Null, DevHandle::PtrToNull] {
        let p = linked();
        let pair = pair(p, dh);
        // 40 messages through a 16-slot ring without a single irecvConsumed.
        transfer(&pair, &[128; 40], 12);
        // irecvConsumed is an accepted no-op in this mode.
        let mut dst = register(p, pair.recv, vec![0; 8]);
        let mut src = register(p, pair.send, vec![1; 8]);
        let r = irecv(p, pair.recv, &mut dst, 0, 8);
        let s = isend(p, pair.send, &mut src, 0, 8);
        complete_in_order(p, &[s, r]);
        // SAFETY: live comm and request.
        ok(unsafe { p.irecv_consumed(pair.recv, 1, r) });
        deregister(p, pair.send, src);
        deregister(p, pair.recv, dst);
        pair.close();
    }
}

#[test]
fn a_message_larger_than_the_posted_receive_is_an_error() {
    let p = linked();
    let pair = pair(p, DevHandle::Null);
    let (mut src, mut dst) = pair.buffers(13, 5000);
    let s = isend(p, pair.send, &mut src, 0, 5000);
    let r = irecv(p, pair.recv, &mut dst, 0, 4000);
    let start = Instant::now();
    let err = loop {
        assert!(start.elapsed() < DEADLINE);
        let _ = test(p, s);
        match test(p, r) {
            Ok(None) => continue,
            Ok(Some(n)) => panic!("received {n} bytes into a 4000-byte receive"),
            Err(e) => break e,
        }
    };
    assert_eq!(err, ResultCode::INVALID_USAGE);
    assert!(logged(&["5000 bytes", "only 4000 bytes"]));
    assert!(
        dst.data.iter().all(|&b| b == 0),
        "nothing written past a refused header"
    );
    // Every later call on the failed comm fails promptly.
    assert_eq!(test(p, r), Err(ResultCode::INVALID_USAGE));
    let mut req = null_mut();
    let data = dst.data.as_mut_ptr().cast();
    // SAFETY: ten bytes of the registered buffer, which outlives the (refused) request.
    let rc = unsafe { irecv_raw(p, pair.recv, 1, data, 10, dst.mh, &mut req) };
    assert_eq!(rc, ResultCode::INVALID_USAGE);
    deregister(p, pair.send, src);
    deregister(p, pair.recv, dst);
    pair.close();
}

#[test]
fn peer_closing_mid_transfer_fails_the_receiver_promptly() {
    let p = linked();
    let pair = pair(p, DevHandle::Null);
    let (r, dst) = close_sender_mid_message(&pair, 64 * MIB, 14);
    let err = failure(p, r, Duration::from_secs(10), "a half-sent message");
    assert_eq!(err, ResultCode::REMOTE_ERROR);
    assert!(logged(&["peer closed", "message #0", "of 67108864 bytes"]));
    assert_eq!(test(p, r), Err(ResultCode::REMOTE_ERROR));
    deregister(p, pair.recv, dst);
    close_recv_and_listen(p, pair.recv, pair.listen);
}

#[test]
fn receiver_closing_fails_the_sender() {
    let p = linked();
    let pair = pair(p, DevHandle::Null);
    let len = 64 * MIB;
    let mut src = register(p, pair.send, pattern(15, len));
    let s = isend(p, pair.send, &mut src, 0, len);
    close_recv_and_listen(p, pair.recv, pair.listen);
    // 64 MiB cannot all fit in the socket buffers of a closed peer.
    let err = failure(p, s, Duration::from_secs(10), "a send to a closed peer");
    assert_eq!(err, ResultCode::REMOTE_ERROR);
    deregister(p, pair.send, src);
    // SAFETY: live comm.
    ok(unsafe { p.close_send(pair.send) });
}

#[test]
fn garbage_on_the_listen_port_is_refused_and_the_listener_survives() {
    let p = linked();
    let (mut handle, listen) = listen(p);
    let port = handle_port(&handle);
    for garbage in [
        pattern(16, 24),
        pattern(17, 5000),
        b"GET / HTTP/1.0\r\n\r\n".to_vec(),
    ] {
        let mut junk = TcpStream::connect(("127.0.0.1", port)).unwrap();
        junk.write_all(&garbage).unwrap();
        let start = Instant::now();
        let rc = loop {
            assert!(start.elapsed() < DEADLINE);
            let mut recv = null_mut();
            // SAFETY: live listen comm.
            let rc = unsafe { p.accept(listen, &mut recv, null_mut()) }.unwrap();
            assert!(recv.is_null());
            if rc != ResultCode::SUCCESS {
                break rc;
            }
        };
        assert_eq!(rc, ResultCode::REMOTE_ERROR);
    }
    // A connection that closes half-way through its hello is refused too.
    {
        let mut short = TcpStream::connect(("127.0.0.1", port)).unwrap();
        short.write_all(b"TXHL").unwrap();
    }
    let start = Instant::now();
    loop {
        assert!(start.elapsed() < DEADLINE);
        let mut recv = null_mut();
        // SAFETY: live listen comm.
        if unsafe { p.accept(listen, &mut recv, null_mut()) }.unwrap() == ResultCode::REMOTE_ERROR {
            break;
        }
    }
    assert!(logged(&["not a tcpx-socket data socket"]));
    // A genuine connect still works.
    let pair = Pair::connect(p, listen, &mut handle, DevHandle::Null);
    transfer(&pair, &[1000, 4097], 18);
    pair.close();
}

#[test]
fn corrupted_handles_are_refused_without_crashing() {
    let p = linked();
    let (mut good, listen) = listen(p);
    let mut cases: Vec<[u8; HANDLE_SIZE]> = (0..50)
        .map(|i| pattern(100 + i, HANDLE_SIZE).try_into().unwrap())
        .collect();
    cases.push([0u8; HANDLE_SIZE]);
    for byte in [0usize, 5, 6, 7, 9, 13, 33, 41] {
        let mut h = good;
        h[byte] ^= 0x40;
        cases.push(h);
    }
    // A well-formed handle whose connect-state key names nothing.
    let mut h = good;
    h[48..56].copy_from_slice(&0xdead_beef_u64.to_le_bytes());
    cases.push(h);
    for mut h in cases {
        let mut send = null_mut();
        // SAFETY: a 128-byte buffer, garbage inside; the plugin must refuse it.
        let rc = unsafe { p.connect(0, h.as_mut_ptr().cast(), &mut send, null_mut()) }.unwrap();
        assert_eq!(rc, ResultCode::INVALID_ARGUMENT);
        assert!(send.is_null());
    }
    assert!(logged(&["invalid handle"]));
    assert!(logged(&["does not exist"]));
    // NULL handle and NULL out pointer.
    let mut send = null_mut();
    // SAFETY: NULL handle must be refused.
    let rc = unsafe { p.connect(0, null_mut(), &mut send, null_mut()) }.unwrap();
    assert_eq!(rc, ResultCode::INVALID_ARGUMENT);
    // The listener is unaffected.
    Pair::connect(p, listen, &mut good, DevHandle::Null).close();
}

#[test]
fn bad_buffers_and_arguments_are_refused() {
    let p = linked();
    let pair = pair(p, DevHandle::Null);
    let mut buf = vec![0u8; 4096];
    let mut other = vec![0u8; 4096];
    let mut mh = null_mut();
    // CUDA memory is not ours to move.
    // SAFETY: refused by type before any use of the pointer.
    let rc = unsafe {
        p.reg_mr(
            pair.send,
            buf.as_mut_ptr().cast(),
            4096,
            NCCL_PTR_CUDA,
            &mut mh,
        )
    }
    .unwrap();
    assert_eq!(rc, ResultCode::INVALID_ARGUMENT);
    assert!(mh.is_null());
    assert!(logged(&["CUDA memory needs a CUDA-capable plugin"]));
    let mut reg = register(p, pair.send, std::mem::take(&mut buf));
    // A buffer outside the registration.
    let mut req = null_mut();
    // SAFETY: refused by the range check.
    let rc = unsafe {
        p.isend(
            pair.send,
            other.as_mut_ptr().cast(),
            100,
            0,
            reg.mh,
            &mut req,
        )
    }
    .unwrap();
    assert_eq!(rc, ResultCode::INVALID_ARGUMENT);
    assert!(req.is_null());
    // Overlapping the end of the registration.
    // SAFETY: refused by the range check.
    let rc = unsafe {
        p.isend(
            pair.send,
            reg.data.as_mut_ptr().add(4000).cast(),
            200,
            0,
            reg.mh,
            &mut req,
        )
    }
    .unwrap();
    assert_eq!(rc, ResultCode::INVALID_ARGUMENT);
    assert!(logged(&["outside its registration"]));
    // A registration of another comm.
    let data = reg.data.as_mut_ptr().cast();
    // SAFETY: refused: the registration belongs to the send comm.
    let rc = unsafe { irecv_raw(p, pair.recv, 1, data, 100, reg.mh, &mut req) };
    assert_eq!(rc, ResultCode::INVALID_ARGUMENT);
    // n != 1.
    // SAFETY: refused before reading the one-entry arrays beyond index 0.
    let rc = unsafe { irecv_raw(p, pair.recv, 2, data, 100, reg.mh, &mut req) };
    assert_eq!(rc, ResultCode::INVALID_ARGUMENT);
    // NULL comms, requests, wrong object kinds.
    // SAFETY: each must be refused.
    unsafe {
        let mut done = 0;
        assert_eq!(
            p.test(null_mut(), &mut done, null_mut()).unwrap(),
            ResultCode::INVALID_ARGUMENT
        );
        assert_eq!(
            p.test(pair.send, &mut done, null_mut()).unwrap(),
            ResultCode::INVALID_ARGUMENT
        );
        assert_eq!(
            p.isend(
                pair.recv,
                reg.data.as_mut_ptr().cast(),
                1,
                0,
                reg.mh,
                &mut req
            )
            .unwrap(),
            ResultCode::INVALID_ARGUMENT
        );
        assert_eq!(
            p.isend(
                pair.send,
                reg.data.as_mut_ptr().cast(),
                -1,
                0,
                reg.mh,
                &mut req
            )
            .unwrap(),
            ResultCode::INVALID_ARGUMENT
        );
        assert_eq!(
            p.isend(
                pair.send,
                reg.data.as_mut_ptr().cast(),
                1,
                0,
                null_mut(),
                &mut req
            )
            .unwrap(),
            ResultCode::INVALID_ARGUMENT
        );
        assert_eq!(
            p.close_send(null_mut()).unwrap(),
            ResultCode::INVALID_ARGUMENT
        );
        assert_eq!(
            p.close_recv(pair.send).unwrap(),
            ResultCode::INVALID_ARGUMENT
        );
        assert_eq!(
            p.dereg_mr(pair.recv, reg.mh).unwrap(),
            ResultCode::INVALID_ARGUMENT
        );
        assert_eq!(
            p.irecv_consumed(pair.recv, 1, null_mut()).unwrap(),
            ResultCode::INVALID_ARGUMENT
        );
        let mut dmh = std::ptr::dangling_mut::<c_void>();
        ok(p.get_device_mr(pair.send, reg.mh, &mut dmh));
        assert!(dmh.is_null());
        let mut freq = std::ptr::dangling_mut::<c_void>();
        ok(p.iflush(pair.recv, 1, null_mut(), null_mut(), null_mut(), &mut freq));
        assert!(freq.is_null());
    }
    reg.data.fill(1);
    deregister(p, pair.send, reg);
    pair.close();
}

#[test]
fn different_comms_progress_concurrently_on_different_threads() {
    let p = linked();
    let threads: Vec<_> = (0..4)
        .map(|t| {
            std::thread::spawn(move || {
                let pair = pair(p, DevHandle::Preset);
                transfer(&pair, &[3 * MIB, 1, 70_000, 4 * MIB + 3], 30 + t);
                pair.close();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

#[test]
fn zero_byte_messages_need_no_registration() {
    let p = linked();
    let pair = pair(p, DevHandle::Null);
    let (mut s, mut r) = (null_mut(), null_mut());
    // SAFETY: zero-byte operations touch no memory.
    unsafe {
        ok(p.isend(pair.send, null_mut(), 0, 0, null_mut(), &mut s));
        let rc = irecv_raw(p, pair.recv, 1, null_mut(), 0, null_mut(), &mut r);
        assert_eq!(rc, ResultCode::SUCCESS);
    }
    let sizes = complete_in_order(p, &[s, r]);
    assert_eq!(sizes[1], 0);
    pair.close();
}

/// A hand-made connector: a raw socket that sends a valid hello, then whatever `traffic` is.
fn fake_peer_then_receive(traffic: &[u8], close: bool) -> Result<Option<usize>, ResultCode> {
    let p = linked();
    let RawPeer {
        listen,
        recv,
        stream: mut raw,
    } = raw_peer(p, 42);
    raw.write_all(traffic).unwrap();
    if close {
        drop(raw);
    }
    let mut dst = register(p, recv, vec![0u8; 1 << 16]);
    let r = irecv(p, recv, &mut dst, 0, 1 << 16);
    let start = Instant::now();
    let outcome = loop {
        if start.elapsed() > Duration::from_millis(500) {
            break Ok(None);
        }
        match test(p, r) {
            Ok(None) => continue,
            other => break other,
        }
    };
    deregister(p, recv, dst);
    close_recv_and_listen(p, recv, listen);
    outcome
}

#[test]
fn malformed_or_truncated_frames_fail_the_comm_without_crashing() {
    setup();
    use tcpx_socket::wire::FrameHeader;
    let good = |total: u32| {
        FrameHeader {
            seq: 0,
            total,
            part: 0,
            nparts: 1,
        }
        .encode()
    };
    // Sanity: a well-formed frame is received.
    let mut ok_frame = good(5).to_vec();
    ok_frame.extend_from_slice(b"hello");
    assert_eq!(fake_peer_then_receive(&ok_frame, false), Ok(Some(5)));
    // Random bytes instead of a header.
    for seed in 0..20 {
        let rc = fake_peer_then_receive(&pattern(200 + seed, 64), false);
        assert_eq!(rc, Err(ResultCode::REMOTE_ERROR), "seed {seed}");
    }
    // Wrong sequence number, wrong part count, non-zero reserved bytes.
    for hdr in [
        FrameHeader {
            seq: 3,
            total: 5,
            part: 0,
            nparts: 1,
        }
        .encode(),
        FrameHeader {
            seq: 0,
            total: 5,
            part: 1,
            nparts: 2,
        }
        .encode(),
        {
            let mut h = good(5);
            h[15] = 1;
            h
        },
    ] {
        assert_eq!(
            fake_peer_then_receive(&hdr, false),
            Err(ResultCode::REMOTE_ERROR)
        );
    }
    // Truncated header, truncated payload.
    assert_eq!(
        fake_peer_then_receive(&good(5)[..9], true),
        Err(ResultCode::REMOTE_ERROR)
    );
    let mut short = good(1000).to_vec();
    short.extend_from_slice(&[7; 10]);
    assert_eq!(
        fake_peer_then_receive(&short, true),
        Err(ResultCode::REMOTE_ERROR)
    );
    assert!(logged(&["990 of 1000 bytes missing"]));
    // Larger than posted.
    assert_eq!(
        fake_peer_then_receive(&good(1 << 20), false),
        Err(ResultCode::INVALID_USAGE)
    );
}

/// NCCL may pass NULL for the size of a `test` (and ignores the size of a send): the plugin
/// reports completion without touching the size, for sends and receives alike.
#[test]
fn test_with_a_null_size_reports_completion() {
    setup();
    let pair = pair(linked(), DevHandle::Null);
    let p = pair.p;
    let len = 100_000;
    let (mut src, mut dst) = pair.buffers(9, len);
    let rreq = irecv(p, pair.recv, &mut dst, 0, len);
    let sreq = isend(p, pair.send, &mut src, 0, len);
    let start = std::time::Instant::now();
    let (mut sent, mut received) = (false, false);
    while !(sent && received) {
        let mut done = 0;
        // SAFETY: live requests of this plugin, each tested until done, then no more.
        unsafe {
            if !sent {
                ok(p.test(sreq, &mut done, null_mut()));
                sent = done == 1;
            }
            if !received {
                ok(p.test(rreq, &mut done, null_mut()));
                received = done == 1;
            }
        }
        assert!(
            start.elapsed() < std::time::Duration::from_secs(30),
            "not done in 30 s"
        );
    }
    let got = deregister(p, pair.recv, dst);
    assert!(got == pattern(9, len), "received bytes differ");
    deregister(p, pair.send, src);
    pair.close();
}

/// Sizes that straddle every threshold of the data path (empty, one byte, a page and its
/// neighbours, the stripe part size, several MiB), in an order that mixes them.
fn mixed_sizes() -> Vec<usize> {
    let base = [
        0,
        1,
        4096,
        4095,
        4097,
        3,
        65_535,
        65_536,
        65_537,
        (5 << 20) + 3,
        7,
        0,
        12_289,
        32 << 10,
        (32 << 10) - 1,
        128 << 10,
        (128 << 10) + 17,
        1 << 20,
        100,
        2,
    ];
    (0..6)
        .flat_map(|r| base.iter().map(move |&s| s + r % 2))
        .collect()
}

#[test]
fn mixed_small_and_large_messages_interleaved() {
    // A fixed uneven interleaving: receives run ahead of sends and lag behind them.
    let steps: Vec<u8> = (0..3000u32).map(|i| ((i * 7 + i / 13) % 5) as u8).collect();
    transfer_and_interleave(linked(), &mixed_sizes(), 3, &steps, 31);
}

#[test]
fn receives_posted_after_the_sender_finished_find_their_messages() {
    let mut sizes: Vec<usize> = (0..16).map(|k| [0, 1, 4096, 1000, 3][k % 5]).collect();
    sizes.extend(mixed_sizes());
    receive_late_in_each_mode(linked(), &sizes, 33);
}

/// Frames that arrive together are read ahead together: the good ones are delivered into their
/// buffers, the bad one behind them fails the comm (at whichever `test` decodes it, as a
/// corrupt stream fails the whole comm), and no byte of it reaches any posted buffer.
#[test]
fn a_bad_frame_read_ahead_behind_good_ones_fails_the_comm_and_lands_nowhere() {
    setup();
    use tcpx_socket::wire::FrameHeader;
    let p = linked();
    let RawPeer {
        listen,
        recv,
        stream: mut raw,
    } = raw_peer(p, 43);
    let payloads = [pattern(40, 300), pattern(41, 5000)];
    let mut traffic = Vec::new();
    for (seq, body) in payloads.iter().enumerate() {
        let h = FrameHeader {
            seq: seq as u32,
            total: body.len() as u32,
            part: 0,
            nparts: 1,
        };
        traffic.extend_from_slice(&h.encode());
        traffic.extend_from_slice(body);
    }
    // Message #2 claims to be message #7, then carries bytes that must land nowhere.
    let bad = FrameHeader {
        seq: 7,
        total: 100,
        part: 0,
        nparts: 1,
    };
    traffic.extend_from_slice(&bad.encode());
    traffic.extend_from_slice(&[0xee; 100]);
    raw.write_all(&traffic).unwrap();
    let mut dst = register(p, recv, vec![0u8; 3 * 8192]);
    let reqs: Vec<_> = (0..3)
        .map(|k| irecv(p, recv, &mut dst, k * 8192, 8192))
        .collect();
    let mut outcomes = Vec::new();
    for &r in &reqs {
        let start = Instant::now();
        let outcome = loop {
            assert!(start.elapsed() < DEADLINE, "no outcome for a receive");
            match test(p, r) {
                Ok(None) => continue,
                other => break other,
            }
        };
        outcomes.push(outcome);
        if outcomes.last().unwrap().is_err() {
            break;
        }
    }
    let (last, done) = outcomes.split_last().unwrap();
    assert_eq!(*last, Err(ResultCode::REMOTE_ERROR), "{outcomes:?}");
    assert!(done.len() <= 2 && [Ok(Some(300)), Ok(Some(5000))].starts_with(done));
    assert!(logged(&["frame for message #7", "expected message #2"]));
    assert!(dst.data[..300] == payloads[0][..]);
    assert!(dst.data[8192..8192 + 5000] == payloads[1][..]);
    assert!(dst.data[300..8192].iter().all(|&b| b == 0));
    assert!(dst.data[8192 + 5000..].iter().all(|&b| b == 0));
    deregister(p, recv, dst);
    close_recv_and_listen(p, recv, listen);
    drop(raw);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Random sizes and a random interleaving of posts, tests and consumptions, through the
    /// ABI: bytes in order, sizes reported, nothing written past a message (see `Schedule`).
    #[test]
    fn random_sizes_and_interleavings_match_the_model(schedule in random_schedule(200 << 10)) {
        schedule.run(linked());
    }
}
