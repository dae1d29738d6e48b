//! Peers configured with different channel counts connect on the smaller one: both sides
//! open as many comms and cut every schedule alike, so two-sided messages (chunked and
//! eager), one-sided writes and reads all land whole, in both directions.

mod common;

use common::*;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

#[test]
fn peers_with_different_channel_counts_use_the_smaller() {
    loopback();
    for (mine, theirs) in [(2u16, 4u16), (4, 1), (3, 8)] {
        let (a, b, ab, ba) = pair_with(
            config(mine, 256 * KIB as u32),
            config(theirs, 256 * KIB as u32),
        );
        let agreed = mine.min(theirs);
        for (side, conn) in [("acceptor", &ab), ("connector", &ba)] {
            assert_eq!(conn.channels(), agreed, "{side} of {mine} / {theirs}");
            assert_eq!(
                conn.stats().len(),
                usize::from(agreed),
                "{side}: counters per channel"
            );
        }
        let what = format!("{mine} against {theirs} channels");

        // Two-sided, both ways: messages of many chunks over every channel, and small ones
        // (eager frames) in between.
        let len = 4 * MIB + 12_345;
        let (src, dst) = (source(&a, len, 11), b.alloc_host(len).unwrap());
        send_verified(&ab, &ba, &src, &dst, len, 11);
        let (src, dst) = (source(&b, len, 12), a.alloc_host(len).unwrap());
        send_verified(&ba, &ab, &src, &dst, len, 12);
        let sizes: Vec<usize> = (0..64)
            .map(|i| [1, 4 * KIB, 60 * KIB, 300 * KIB][i % 4])
            .collect();
        let stride = 300 * KIB;
        let (src, dst) = (
            source(&a, 64 * stride, 13),
            a.alloc_host(64 * stride).unwrap(),
        );
        let far = b.alloc_host(64 * stride).unwrap();
        exchange_verified((&ab, &ba), (&src, &far), &sizes, stride, &what);
        exchange_verified((&ba, &ab), (&far, &dst), &sizes, stride, &what);

        // One-sided: a write into the peer's region, then read back into a fresh one.
        let target = b.alloc_host(4 * MIB).unwrap();
        let d = b.advertise(&target).unwrap();
        write_and_read_back((&a, &ab), (&target, d), 3 * MIB + 4 * KIB, 14, &what);
        drop((ab, ba, a, b));
    }
}
