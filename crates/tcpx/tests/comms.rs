//! Comms over loopback through the safe layer: real plugin calls, real sockets, verified bytes.

mod common;

use std::time::{Duration, Instant};

use common::*;
use tcpx::{AbiVersion, ErrorKind, Net, ResultCode, SharedMemory};

/// Moves `len` bytes from a sender thread to this thread and checks every byte.
fn transfer_and_verify(net: &Net, len: usize, seed: u64) {
    let (mut send, mut recv) = pair(net);
    let payload = pattern(seed, len);
    let expected = payload.clone();
    let sender = std::thread::spawn(move || {
        let memory = SharedMemory::host(len).unwrap();
        memory
            .with_bytes_mut(|b| b.copy_from_slice(&payload))
            .unwrap();
        let region = send.register(&memory).unwrap();
        let mut req = post_send(&mut send, &region, 0, len);
        assert_eq!(wait_send(&mut send, &mut req), len);
    });
    let memory = SharedMemory::host(len).unwrap();
    let region = recv.register(&memory).unwrap();
    let mut req = post_recv(&mut recv, &region, 0, len);
    assert_eq!(wait_recv(&mut recv, &mut req), len);
    recv.consumed(req).unwrap();
    sender.join().unwrap();
    memory
        .with_bytes(|b| {
            if let Some(i) = b.iter().zip(&expected).position(|(a, b)| a != b) {
                panic!("{len}-byte transfer differs at byte {i}");
            }
        })
        .unwrap();
}

#[test]
fn builtin_plugin_moves_verified_bytes_of_every_size() {
    loopback();
    let net = Net::builtin().unwrap();
    for (i, len) in [1, 4096, 4097, 1 << 20, 1_000_003, 64 << 20]
        .into_iter()
        .enumerate()
    {
        transfer_and_verify(&net, len, i as u64);
    }
}

#[test]
fn dlopened_plugin_moves_verified_bytes() {
    loopback();
    let net = Net::load(socket_plugin_path()).unwrap();
    assert_eq!(net.name(), "tcpx-socket");
    assert_eq!(net.abi_version(), AbiVersion::V8);
    for (i, len) in [1, 4096, 65_537, 1 << 20].into_iter().enumerate() {
        transfer_and_verify(&net, len, 100 + i as u64);
    }
}

#[test]
fn v7_table_moves_bytes_and_refuses_registrations_of_2_gib() {
    loopback();
    let net = Net::load_versions(socket_plugin_path(), &[AbiVersion::V7]).unwrap();
    assert_eq!(net.abi_version(), AbiVersion::V7);
    transfer_and_verify(&net, 12_345, 7);

    let (send, _recv) = pair(&net);
    // calloc'd, never touched: costs address space, not memory.
    let huge = SharedMemory::host(1 << 31).unwrap();
    let err = send.register(&huge).unwrap_err();
    assert_eq!(err.api(), "regMr");
    assert!(matches!(err.kind(), ErrorKind::Abi(_)), "{err}");
    assert!(err.to_string().contains("2147483648"), "{err}");
}

#[test]
fn devices_report_loopback_with_properties() {
    loopback();
    let net = Net::builtin().unwrap();
    let devices = net.devices().unwrap();
    assert_eq!(devices.len(), 1, "{devices:?}");
    let lo = &devices[0].properties;
    assert_eq!(lo.name, "lo");
    assert!(lo.ptr_support.host());
    assert!(lo.speed_mbps > 0);
    assert_eq!(lo.max_recvs, 1);
    assert!(net.device(5).is_err());
}

#[test]
fn seventeenth_send_and_receive_answer_busy() {
    loopback();
    let net = Net::builtin().unwrap();
    let (mut send, mut recv) = pair(&net);
    let memory = SharedMemory::host(17 * 4096).unwrap();
    let send_region = send.register(&memory).unwrap();
    let recv_memory = SharedMemory::host(17 * 4096).unwrap();
    let recv_region = recv.register(&recv_memory).unwrap();

    let mut sends: Vec<_> = (0..16)
        .map(|i| {
            send.isend(&send_region, i * 4096, 4096, 0)
                .unwrap()
                .expect("slot")
        })
        .collect();
    assert!(
        send.isend(&send_region, 16 * 4096, 4096, 0)
            .unwrap()
            .is_none(),
        "17th isend must be busy"
    );
    let mut recvs: Vec<_> = (0..16)
        .map(|i| {
            recv.irecv(&recv_region, i * 4096, 4096, 0)
                .unwrap()
                .expect("slot")
        })
        .collect();
    assert!(
        recv.irecv(&recv_region, 16 * 4096, 4096, 0)
            .unwrap()
            .is_none(),
        "17th irecv must be busy"
    );

    // Drain in FIFO order on two threads; the window opens again afterwards.
    let sender = std::thread::spawn(move || {
        for req in &mut sends {
            wait_send(&mut send, req);
        }
        drop(sends);
        let mut again = post_send(&mut send, &send_region, 0, 4096);
        wait_send(&mut send, &mut again);
    });
    for mut req in recvs.drain(..) {
        wait_recv(&mut recv, &mut req);
        recv.consumed(req).unwrap();
    }
    let mut again = post_recv(&mut recv, &recv_region, 0, 4096);
    wait_recv(&mut recv, &mut again);
    recv.consumed(again).unwrap();
    sender.join().unwrap();
}

#[test]
fn testing_a_request_behind_the_head_is_refused() {
    loopback();
    let net = Net::builtin().unwrap();
    let (_send, mut recv) = pair(&net);
    let memory = SharedMemory::host(8192).unwrap();
    let region = recv.register(&memory).unwrap();
    let _first = recv.irecv(&region, 0, 4096, 0).unwrap().unwrap();
    let mut second = recv.irecv(&region, 4096, 4096, 0).unwrap().unwrap();
    let err = recv.test(&mut second).unwrap_err();
    assert_eq!(err.code(), Some(ResultCode::INVALID_USAGE), "{err}");
}

#[test]
fn receives_are_consumed_in_posting_order() {
    loopback();
    let net = Net::builtin().unwrap();
    let (mut send, mut recv) = pair(&net);
    let memory = SharedMemory::host(8192).unwrap();
    let sregion = send.register(&memory).unwrap();
    let rmemory = SharedMemory::host(8192).unwrap();
    let rregion = recv.register(&rmemory).unwrap();
    let mut a = post_recv(&mut recv, &rregion, 0, 4096);
    let mut b = post_recv(&mut recv, &rregion, 4096, 4096);
    let (finished, keep_open) = std::sync::mpsc::channel::<()>();
    let sender = std::thread::spawn(move || {
        let mut x = post_send(&mut send, &sregion, 0, 4096);
        let mut y = post_send(&mut send, &sregion, 4096, 4096);
        wait_send(&mut send, &mut x);
        wait_send(&mut send, &mut y);
        // Keep the comm open until the receiver is done checking.
        let _ = keep_open.recv_timeout(DEADLINE);
    });
    wait_recv(&mut recv, &mut a);
    wait_recv(&mut recv, &mut b);
    let err = recv.consumed(b).unwrap_err();
    assert!(err.to_string().contains("out of order"), "{err}");
    // `b` was dropped by the failed call and is consumed on its turn, right after `a`: then all
    // 16 slots are free again (an unconsumed receive would still hold one).
    recv.consumed(a).unwrap();
    let held: Vec<_> = (0..16)
        .map(|i| recv.irecv(&rregion, (i % 2) * 4096, 4096, 0).unwrap())
        .collect();
    assert!(
        held.iter().all(Option::is_some),
        "a slot is still held by an unconsumed receive"
    );
    assert!(recv.irecv(&rregion, 0, 4096, 0).unwrap().is_none());
    finished.send(()).unwrap();
    sender.join().unwrap();
}

#[test]
fn memory_is_not_cpu_accessible_while_a_receive_is_in_flight() {
    loopback();
    let net = Net::builtin().unwrap();
    let (_send, mut recv) = pair(&net);
    let memory = SharedMemory::host(4096).unwrap();
    let region = recv.register(&memory).unwrap();
    let req = recv.irecv(&region, 0, 4096, 0).unwrap().unwrap();
    assert!(matches!(
        memory.with_bytes(|_| ()).unwrap_err().kind(),
        ErrorKind::Busy(_)
    ));
    assert_eq!(memory.in_flight(), 1);
    drop(req); // abandoned: the comm keeps the memory counted until it closes
    assert!(
        recv.irecv(&region, 0, 4096, 0).is_err(),
        "a comm with an abandoned request is poisoned"
    );
    drop(region);
    drop(recv);
    assert_eq!(memory.in_flight(), 0);
    memory.with_bytes(|_| ()).unwrap();
}

#[test]
fn out_of_range_and_foreign_regions_are_refused() {
    loopback();
    let net = Net::builtin().unwrap();
    let (mut send, recv) = pair(&net);
    let memory = SharedMemory::host(4096).unwrap();
    let region = send.register(&memory).unwrap();
    let err = send.isend(&region, 4000, 200, 0).unwrap_err();
    assert!(err.to_string().contains("outside memory"), "{err}");
    let foreign = recv.register(&memory).unwrap();
    let err = send.isend(&foreign, 0, 10, 0).unwrap_err();
    assert!(err.to_string().contains("registered on recv comm"), "{err}");
}

#[test]
fn a_missing_library_names_its_path() {
    let err = Net::load("/nonexistent/libnccl-net-nothing.so").unwrap_err();
    assert_eq!(err.api(), "dlopen");
    assert!(
        err.to_string()
            .contains("/nonexistent/libnccl-net-nothing.so"),
        "{err}"
    );
}

#[test]
fn a_library_without_a_table_names_the_symbols_tried() {
    // libm is on every glibc system and exports no ncclNet table.
    let err = Net::load("libm.so.6").unwrap_err();
    let text = err.to_string();
    for symbol in ["ncclNetPlugin_v8", "ncclNetPlugin_v7", "ncclNetPlugin_v6"] {
        assert!(text.contains(symbol), "{text}");
    }
    assert!(text.contains("libm.so.6"), "{text}");
}

#[test]
fn corrupted_handles_fail_without_crashing() {
    loopback();
    let net = Net::builtin().unwrap();
    for seed in 0..32u64 {
        let bytes = pattern(seed, tcpx::ConnectHandle::SIZE);
        let handle = tcpx::ConnectHandle::from_bytes(&bytes).unwrap();
        let result = net.connect(0, &handle, Duration::from_secs(2));
        assert!(
            result.is_err(),
            "a random handle must not connect (seed {seed})"
        );
    }
    // A real listener still works afterwards.
    transfer_and_verify(&net, 333, 3);
}

#[test]
fn a_peer_closing_mid_transfer_fails_the_receive_promptly() {
    loopback();
    let net = Net::builtin().unwrap();
    let (mut send, mut recv) = pair(&net);
    let len = 64 << 20;
    // The sender starts a 64 MiB message while nobody reads: the kernel buffers a few MiB at most,
    // then the sender gives up and closes. The receive must fail, not wait for the rest.
    let sender = std::thread::spawn(move || {
        let memory = SharedMemory::host(len).unwrap();
        let region = send.register(&memory).unwrap();
        let mut req = post_send(&mut send, &region, 0, len);
        for _ in 0..3 {
            assert!(
                send.test(&mut req).unwrap().is_none(),
                "64 MiB cannot fit the socket buffers"
            );
        }
        drop(req);
        drop(region);
        drop(send);
    });
    sender.join().unwrap();
    let memory = SharedMemory::host(len).unwrap();
    let region = recv.register(&memory).unwrap();
    let mut req = post_recv(&mut recv, &region, 0, len);
    let start = Instant::now();
    let err = loop {
        match recv.test(&mut req) {
            Ok(None) => assert!(
                start.elapsed() < DEADLINE,
                "no error {DEADLINE:?} after the peer closed"
            ),
            Ok(Some(n)) => panic!("received {n} bytes of a message the peer never finished"),
            Err(e) => break e,
        }
    };
    assert!(err.code().is_some(), "{err}");
    assert!(err.context().contains("recv comm"), "{err}");
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "the error took {:?}",
        start.elapsed()
    );
}

/// A plugin that writes sizes (tcpx-socket by default) still gets a short receive reported as
/// short: the posted length is taken only when the plugin leaves the size untouched.
#[test]
fn a_short_receive_reports_the_bytes_that_arrived() {
    loopback();
    let net = Net::builtin().unwrap();
    let (mut send, mut recv) = pair(&net);
    let sender = std::thread::spawn(move || {
        let memory = SharedMemory::host(100).unwrap();
        let region = send.register(&memory).unwrap();
        let mut req = post_send(&mut send, &region, 0, 100);
        assert_eq!(wait_send(&mut send, &mut req), 100);
    });
    let memory = SharedMemory::host(4096).unwrap();
    let region = recv.register(&memory).unwrap();
    let mut req = post_recv(&mut recv, &region, 0, 4096);
    assert_eq!(wait_recv(&mut recv, &mut req), 100);
    recv.consumed(req).unwrap();
    sender.join().unwrap();
}
