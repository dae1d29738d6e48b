//! The safe layer against a plugin whose `test` never writes sizes (tcpx-socket with
//! `TCPX_SOCKET_NO_SIZES=1`, behaving like nccl-fastsocket): sends report their posted length,
//! receives the posted length when the plugin is silent, and every byte still arrives. Its own
//! test binary, because the plugin reads the variable once per process.

mod common;

use std::sync::Once;

use common::*;
use tcpx::{Net, SharedMemory};

fn no_sizes_on_loopback() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| std::env::set_var(tcpx_socket::NO_SIZES_ENV, "1"));
    loopback();
}

#[test]
fn sizes_come_from_the_posted_lengths_and_the_bytes_verify() {
    no_sizes_on_loopback();
    let net = Net::builtin().unwrap();
    for (i, len) in [1usize, 4096, 4097, 1 << 20, 8_000_003]
        .into_iter()
        .enumerate()
    {
        let (mut send, mut recv) = pair(&net);
        let payload = pattern(i as u64, len);
        let expected = payload.clone();
        let sender = std::thread::spawn(move || {
            let memory = SharedMemory::host(len).unwrap();
            memory
                .with_bytes_mut(|b| b.copy_from_slice(&payload))
                .unwrap();
            let region = send.register(&memory).unwrap();
            // A window of sends, each tested to completion in order: every one reports `len`
            // although the plugin writes no size.
            let mut reqs: Vec<_> = (0..4)
                .map(|_| post_send(&mut send, &region, 0, len))
                .collect();
            for req in &mut reqs {
                assert_eq!(wait_send(&mut send, req), len, "send of {len} bytes");
            }
        });
        let memory = SharedMemory::host(len).unwrap();
        let region = recv.register(&memory).unwrap();
        for k in 0..4 {
            let mut req = post_recv(&mut recv, &region, 0, len);
            assert_eq!(
                wait_recv(&mut recv, &mut req),
                len,
                "receive {k} of {len} bytes"
            );
            assert_eq!(req.received(), Some(len));
            recv.consumed(req).unwrap();
            memory
                .with_bytes(|b| {
                    if let Some(at) = b.iter().zip(&expected).position(|(a, b)| a != b) {
                        panic!("receive {k} of {len} bytes differs at byte {at}");
                    }
                })
                .unwrap();
        }
        sender.join().unwrap();
    }
}
