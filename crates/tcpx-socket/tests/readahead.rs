//! The read-ahead and gathered-write data path over three data sockets per comm
//! (`TCPX_SOCKET_NSOCKS=3`: a count that is not a power of two, so the rotation of small
//! messages and the striping of large ones meet at every offset). The environment is read once
//! per plugin instance, so this lives in its own test binary; the one-socket twins of these
//! tests are in `plugin.rs`.

mod common;

use std::sync::Once;

use common::*;
use proptest::prelude::*;

fn three_sockets() -> &'static tcpx_sys::NetPlugin {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| std::env::set_var("TCPX_SOCKET_NSOCKS", "3"));
    linked()
}

/// Many messages of mixed sizes (empty, one byte, pages and their neighbours, the stripe part
/// size and several MiB), so small ones rotate over the sockets between striped large ones.
fn mixed_sizes() -> Vec<usize> {
    (0..400usize)
        .map(|k| match k % 10 {
            0 => 0,
            1 => 1,
            2 => 4096,
            3 => 4095 + k % 3,
            4 => 65_536 + k % 5 - 2,
            5 => 3 << 20 | k,
            6 => 192 << 10,
            7 => 17,
            8 => (k * 7919) % 40_000,
            _ => 200,
        })
        .collect()
}

#[test]
fn mixed_messages_over_three_sockets() {
    let steps: Vec<u8> = (0..5000u32).map(|i| ((i * 3 + i / 7) % 5) as u8).collect();
    transfer_and_interleave(three_sockets(), &mixed_sizes(), 2, &steps, 51);
}

#[test]
fn late_receives_over_three_sockets() {
    let mut sizes: Vec<usize> = (0..16).map(|k| [4096, 0, 1, 3000][k % 4]).collect();
    sizes.extend(mixed_sizes().into_iter().take(100));
    receive_late_in_each_mode(three_sockets(), &sizes, 53);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Random sizes and a random interleaving of posts, tests and consumptions over three
    /// sockets: bytes in order, sizes reported, nothing written past a message.
    #[test]
    fn random_sizes_and_interleavings_match_the_model(schedule in random_schedule(260 << 10)) {
        schedule.run(three_sockets());
    }
}
