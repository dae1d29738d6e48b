//! A peer that crafts packed one-sided requests the protocol forbids, over a real,
//! authenticated connection (`Connection::post_control`, a testing aid): an empty list, a
//! remote and a local list that disagree, a packed write into host memory past the largest
//! pack, and a refused write whose data never follows. Each ends the hostile connection with
//! an error that says what was wrong, within the target's timeout — never a hang — and the
//! target goes on serving: a well-behaved peer connects after it and writes a packed list of
//! small blocks whose every byte is checked. Nothing is left behind (threads and descriptors
//! counted once the connections are gone).
//!
//! The tests of this file run one at a time (`SERIAL`), so the process-wide counts are theirs.

mod common;

use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use common::*;
use tcpx_runtime::control::Message;
use tcpx_runtime::onesided::{RemoteEntry, WriteRequest};
use tcpx_runtime::{Connection, Descriptor, Endpoint};

const KIB: usize = 1 << 10;

/// The target's timeout: a refused write whose data never comes fails within it.
const TARGET_TIMEOUT: Duration = Duration::from_secs(3);

/// How long a test waits for an outcome the target owes within its timeout.
const OUTCOME_WAIT: Duration = Duration::from_secs(20);

/// Largest packed write into host memory.
const PACKED_HOST_MAX: usize = tcpx_runtime::onesided::PACKED_HOST_MAX_BYTES as usize;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The target: two channels of 64 KiB chunks, a short timeout.
fn target() -> Endpoint {
    let mut c = config(2, 64 * KIB as u32);
    c.timeout = TARGET_TIMEOUT;
    Endpoint::new(c).expect("target endpoint")
}

fn peer() -> Endpoint {
    Endpoint::new(config(2, 64 * KIB as u32)).expect("peer endpoint")
}

/// One entry of the region behind `d`.
fn entry(d: Descriptor, offset: usize, len: usize) -> RemoteEntry {
    RemoteEntry {
        region_id: d.region_id(),
        key: d.key(),
        offset: offset as u64,
        len: len as u64,
    }
}

/// A packed write request (no notification, not spread, not inline).
fn packed_write(op_id: u64, entries: Vec<RemoteEntry>, local_lens: Vec<u64>) -> Message {
    Message::WriteRequest(WriteRequest {
        op_id,
        entries,
        local_lens,
        notification: None,
        packed: true,
        spread: false,
        inline: None,
    })
}

/// Sends `request` from a hostile peer connected to `t` and returns the errors the target's
/// side and the hostile side of that connection ended with (the target tells the peer why).
fn errors_after(t: &Endpoint, request: &Message) -> (String, String) {
    let hostile = peer();
    let (th, ht) = connect(t, &hostile);
    ht.post_control(request).expect("post the crafted request");
    assert!(
        eventually(OUTCOME_WAIT, || th.error().is_some()),
        "the target's connection still stands {OUTCOME_WAIT:?} after {request:?}"
    );
    assert!(
        eventually(OUTCOME_WAIT, || ht.error().is_some()),
        "the hostile side was not told its connection ended"
    );
    (
        th.error().expect("checked above").to_string(),
        ht.error().expect("checked above").to_string(),
    )
}

/// A well-behaved peer writes 32 blocks of 4 KiB, 8 KiB apart (a list that travels packed),
/// into `region` behind `d` on `t`, and every byte lands.
fn a_good_peer_still_writes_packed(t: &Endpoint, region: &tcpx_runtime::Region, d: Descriptor) {
    let good = peer();
    let (_tg, gt): (Connection, Connection) = connect(t, &good);
    let blocks: Vec<(usize, usize)> = (0..32).map(|i| (i * 8 * KIB, 4 * KIB)).collect();
    let src = source(&good, 256 * KIB, 39);
    let local = local_segments(&src, &blocks);
    let remote = remote_segments(d, &blocks);
    let moved = gt
        .write(&local, &remote, None)
        .expect("post the good write")
        .wait(OUTCOME_WAIT)
        .expect("the good write");
    assert_eq!(moved, 128 * KIB as u64);
    let sent = snapshot(&src);
    for &(offset, len) in &blocks {
        let want = &sent[offset..offset + len];
        assert!(
            eventually(OUTCOME_WAIT, || snapshot(region)[offset..offset + len]
                == *want),
            "block at {offset} did not land"
        );
    }
}

#[test]
fn malformed_packed_writes_end_their_connection_with_what_was_wrong() {
    let _serial = serial();
    loopback();
    let t = target();
    let (region, d) = advertised_host(&t, PACKED_HOST_MAX + 64 * KIB);
    let threads_before = settled(runtime_threads);
    let fds_before = open_fds();

    let cases = [
        (
            "an empty list",
            packed_write(1, vec![], vec![]),
            "empty, or the lists disagree",
        ),
        (
            "lists that disagree",
            packed_write(2, vec![entry(d, 0, 8 * KIB)], vec![4 * KIB as u64]),
            "empty, or the lists disagree",
        ),
        (
            "a pack past the largest into host memory",
            packed_write(
                3,
                vec![entry(d, 0, PACKED_HOST_MAX + 4 * KIB)],
                vec![(PACKED_HOST_MAX + 4 * KIB) as u64],
            ),
            "past",
        ),
    ];
    for (what, request, says) in &cases {
        let (error, told) = errors_after(&t, request);
        assert!(
            error.contains("protocol violation") && error.contains(says),
            "{what}: the target ended with {error:?}"
        );
        // The peer learns the target's reason, not only that the stream ended.
        assert!(
            told.contains("protocol violation") && told.contains(says),
            "{what}: the hostile side ended with {told:?}"
        );
    }
    // Nothing the crafted requests named was written.
    assert!(snapshot(&region)[..64 * KIB].iter().all(|&b| b == 0));

    a_good_peer_still_writes_packed(&t, &region, d);
    assert!(
        eventually(OUTCOME_WAIT, || runtime_threads() <= threads_before
            && open_fds() <= fds_before),
        "left behind: {} runtime threads (had {threads_before}), {} descriptors (had {fds_before})",
        runtime_threads(),
        open_fds()
    );
}

#[test]
fn a_refused_packed_write_whose_data_never_comes_ends_within_the_timeout() {
    let _serial = serial();
    loopback();
    let t = target();
    let (region, d) = advertised_host(&t, 1 << 20);
    // A key the target never gave: refused, and the target still expects the write's 8 KiB
    // on its comms (to discard them); the hostile peer sends none.
    let mut wrong = entry(d, 0, 8 * KIB);
    wrong.key ^= 0x5a5a;
    let started = std::time::Instant::now();
    let (error, _) = errors_after(&t, &packed_write(7, vec![wrong], vec![8 * KIB as u64]));
    assert!(
        started.elapsed() < TARGET_TIMEOUT + OUTCOME_WAIT,
        "ended after {:?}: {error}",
        started.elapsed()
    );
    assert!(
        snapshot(&region).iter().all(|&b| b == 0),
        "a refused write wrote"
    );
    a_good_peer_still_writes_packed(&t, &region, d);
}
