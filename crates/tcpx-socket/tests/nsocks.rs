//! Several data sockets per comm (`TCPX_SOCKET_NSOCKS=4`): striping of large messages,
//! rotation of small ones, and failure detection across sockets. The environment is read once
//! per plugin instance, so this lives in its own test binary.

mod common;

use std::sync::Once;
use std::time::Duration;

use common::*;
use tcpx_sys::ResultCode;

const MIB: usize = 1 << 20;

fn four_sockets() -> &'static tcpx_sys::NetPlugin {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| std::env::set_var("TCPX_SOCKET_NSOCKS", "4"));
    linked()
}

#[test]
fn handle_advertises_four_sockets() {
    let p = four_sockets();
    let (handle, listen) = listen(p);
    assert_eq!(handle[7], 4);
    // SAFETY: live listen comm.
    ok(unsafe { p.close_listen(listen) });
}

#[test]
fn moves_assorted_sizes_over_four_sockets() {
    let pair = pair(four_sockets(), DevHandle::Null);
    transfer(
        &pair,
        &[1, 4096, MIB, 4097, 1_000_003, 0, 65537, 262_143],
        21,
    );
    transfer(&pair, &[64 * MIB, 3, 64 * MIB - 1], 22);
    pair.close();
}

#[test]
fn many_small_messages_rotate_over_four_sockets() {
    let pair = pair(four_sockets(), DevHandle::Preset);
    let sizes: Vec<usize> = (0..3000).map(|i| (i * 7919) % 70_000).collect();
    transfer(&pair, &sizes, 23);
    pair.close();
}

#[test]
fn dlopened_plugin_reads_its_own_environment() {
    four_sockets();
    let pair = pair(loaded_v7(), DevHandle::Preset);
    transfer(&pair, &[10 * MIB, 17, 2 * MIB + 5], 24);
    pair.close();
}

#[test]
fn peer_closing_mid_transfer_fails_the_receiver() {
    let p = four_sockets();
    let pair = pair(p, DevHandle::Null);
    let (r, dst) = close_sender_mid_message(&pair, 64 * MIB, 25);
    let err = failure(p, r, Duration::from_secs(10), "a half-sent message");
    assert_eq!(err, ResultCode::REMOTE_ERROR);
    deregister(p, pair.recv, dst);
    close_recv_and_listen(p, pair.recv, pair.listen);
}

#[test]
fn a_clean_close_after_complete_messages_fails_only_later_receives() {
    let p = four_sockets();
    let pair = pair(p, DevHandle::Null);
    transfer(&pair, &[3 * MIB, 5, 100_000], 26);
    // SAFETY: live comm, nothing in flight.
    ok(unsafe { p.close_send(pair.send) });
    let mut dst = register(p, pair.recv, vec![0; 1000]);
    let r = irecv(p, pair.recv, &mut dst, 0, 1000);
    let err = failure(
        p,
        r,
        Duration::from_secs(10),
        "a receive from a closed peer",
    );
    assert_eq!(err, ResultCode::REMOTE_ERROR);
    assert!(logged(&["peer closed the connection", "never arrived"]));
    deregister(p, pair.recv, dst);
    close_recv_and_listen(p, pair.recv, pair.listen);
}
