//! Shared helpers for the runtime's end-to-end tests: loopback pinning, endpoint pairs,
//! data patterns, resource counting. Every wait has a deadline; no test may hang.
#![allow(dead_code)]

use std::sync::Once;
use std::time::Duration;

use tcpx_runtime::{
    Backend, Backoff, Config, Connection, Descriptor, Endpoint, Region, RemoteSegment, Segment,
    Transfer,
};

/// Longest any single wait in these tests may take.
pub const DEADLINE: Duration = Duration::from_secs(60);

/// Pins the socket plugin to `lo` before any plugin initializes. First line of every test.
pub fn loopback() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| std::env::set_var("TCPX_SOCKET_IFNAME", "lo"));
}

/// A loopback configuration: built-in plugin, control plane on 127.0.0.1.
pub fn config(channels: u16, chunk_bytes: u32) -> Config {
    Config::builder()
        .backend(Backend::Builtin)
        .control_addr("127.0.0.1:0".parse().unwrap())
        .channels(channels)
        .chunk_bytes(chunk_bytes)
        .timeout(Duration::from_secs(30))
        .backoff(Backoff::Park)
        .build()
        .expect("valid config")
}

/// Two endpoints and a connection between them: (a, b, a's connection, b's connection).
pub fn pair_with(ca: Config, cb: Config) -> (Endpoint, Endpoint, Connection, Connection) {
    let a = Endpoint::new(ca).expect("endpoint a");
    let b = Endpoint::new(cb).expect("endpoint b");
    let (ab, ba) = connect(&a, &b);
    (a, b, ab, ba)
}

/// Connects `a` to `b` (b accepts on another thread).
pub fn connect(a: &Endpoint, b: &Endpoint) -> (Connection, Connection) {
    let meta = a.metadata().clone();
    std::thread::scope(|s| {
        let accepted = s.spawn(|| a.accept_timeout(DEADLINE));
        let ba = b.connect(&meta).expect("connect");
        let ab = accepted.join().expect("accept thread").expect("accept");
        (ab, ba)
    })
}

/// Two endpoints with the same config, connected.
pub fn pair(channels: u16, chunk_bytes: u32) -> (Endpoint, Endpoint, Connection, Connection) {
    pair_with(config(channels, chunk_bytes), config(channels, chunk_bytes))
}

/// Fills `bytes` with a pattern that depends on `seed` and the position (no two positions
/// of a 64-bit word repeat within a transfer, so misplaced chunks are caught).
pub fn fill(bytes: &mut [u8], seed: u64) {
    let mut words = bytes.chunks_exact_mut(8);
    for (i, w) in (&mut words).enumerate() {
        w.copy_from_slice(&word(seed, i as u64).to_le_bytes());
    }
    let n = bytes.len() / 8;
    let tail = &mut bytes[n * 8..];
    let last = word(seed, n as u64).to_le_bytes();
    tail.copy_from_slice(&last[..tail.len()]);
}

/// Checks `bytes` holds the pattern of `fill(seed)`; returns the first bad offset.
pub fn check(bytes: &[u8], seed: u64) -> Result<(), usize> {
    let mut words = bytes.chunks_exact(8);
    for (i, w) in (&mut words).enumerate() {
        if w != word(seed, i as u64).to_le_bytes() {
            let first = w
                .iter()
                .zip(word(seed, i as u64).to_le_bytes())
                .position(|(a, b)| *a != b)
                .unwrap_or(0);
            return Err(i * 8 + first);
        }
    }
    let n = bytes.len() / 8;
    let last = word(seed, n as u64).to_le_bytes();
    let tail = &bytes[n * 8..];
    match tail.iter().zip(last).position(|(a, b)| *a != b) {
        Some(p) => Err(n * 8 + p),
        None => Ok(()),
    }
}

fn word(seed: u64, i: u64) -> u64 {
    // splitmix64 of (seed, index)
    let mut z = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(i)
        .wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A region of `len` bytes filled with `fill(seed)`.
pub fn source(ep: &Endpoint, len: usize, seed: u64) -> Region {
    let r = ep.alloc_host(len.max(1)).expect("alloc");
    r.memory()
        .with_bytes_mut(|b| fill(&mut b[..len], seed))
        .expect("cpu access");
    r
}

/// Asserts `region[offset..offset+len]` holds `fill(seed)`.
///
/// The region may still be in flight for a moment after the transfer that the test waited
/// for: a one-sided read completes on the initiator once the data arrived, while the target's
/// engine may not have retired the send out of this region yet. So a busy region is asked
/// again, for a bounded time, before its bytes are checked.
pub fn assert_pattern(region: &Region, offset: usize, len: usize, seed: u64, what: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let checked = region.memory().with_bytes(|b| {
            if let Err(at) = check(&b[offset..offset + len], seed) {
                panic!("{what}: data differs at byte {at} of {len}");
            }
        });
        match checked {
            Ok(()) => return,
            Err(e)
                if matches!(e.kind(), tcpx::ErrorKind::Busy(_))
                    && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => panic!("{what}: cpu access: {e:?}"),
        }
    }
}

/// Open file descriptors of this process.
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Threads of this process.
pub fn threads() -> usize {
    // The thread that faults in the process's kept pack buffers (`tcpx-pack-warm`) is not
    // counted: it ends on its own once four buffers are ready, whenever that is (on a busy
    // 2-core machine it was still running when a count was taken).
    thread_names()
        .iter()
        .filter(|name| *name != "tcpx-pack-warm")
        .count()
}

/// The runtime's own threads of this process (every one is named `tcpx-…`), but for the
/// one that faults in kept pack buffers (see [`threads`]).
///
/// For a test binary of several tests: the harness runs them on threads of their own, and
/// a test waiting for a serial lock is one more thread. Where one test ends and the next
/// waits, the harness may start that waiting thread before or after a count is taken — on a
/// busy 2-core machine once after, so a count of every thread rose by one and stayed there
/// ("threads 6 -> 7" in `ipc::fds_and_threads_are_released`). Counting ours alone measures
/// what those tests mean to: that the runtime leaves no thread behind. A thread names itself
/// as it starts, so take a baseline with [`settled`].
pub fn runtime_threads() -> usize {
    thread_names()
        .iter()
        .filter(|name| name.starts_with("tcpx-") && *name != "tcpx-pack-warm")
        .count()
}

/// The names of this process's threads, sorted (for failure messages).
pub fn thread_names() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
                .map(|name| name.trim_end().to_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// `count()` once two reads 20 ms apart agree (at most 5 s): a baseline that threads just
/// spawned, not yet named, cannot skew.
pub fn settled(count: impl Fn() -> usize) -> usize {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let mut last = count();
    loop {
        std::thread::sleep(Duration::from_millis(20));
        let now = count();
        if now == last || std::time::Instant::now() > deadline {
            return now;
        }
        last = now;
    }
}

/// Waits until `f` holds or `timeout` passes; returns whether it held.
pub fn eventually(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// splitmix64: a small deterministic generator for random layouts.
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `[0, n)`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Cuts `[0, total)` into random blocks of at most `max_block` bytes (some contiguous, some
/// with gaps) placed in a region of `region_len` bytes; returns (offset, len) per block.
pub fn random_layout(
    rng: &mut Rng,
    total: usize,
    region_len: usize,
    max_block: usize,
) -> Vec<(usize, usize)> {
    let mut blocks = Vec::new();
    let mut left = total;
    let mut at = 0usize;
    let mut slack_left = region_len - total;
    while left > 0 {
        let len = (1 + rng.below(max_block as u64) as usize).min(left);
        if slack_left > 0 && rng.below(3) == 0 {
            let gap = rng.below(slack_left as u64 + 1) as usize / 4;
            at += gap;
            slack_left -= gap;
        }
        blocks.push((at, len));
        at += len;
        left -= len;
    }
    blocks
}

/// Every byte of `region` (host or CUDA memory), copied out.
pub fn snapshot(region: &Region) -> Vec<u8> {
    let mut bytes = vec![0u8; region.len()];
    region.read(0, &mut bytes).expect("read the region back");
    bytes
}

/// [`snapshot`] of a region a peer's engines read from: an operation there (the target's
/// send of a read) finishes a moment after the initiator's receive did, and the memory counts
/// it in flight until then, so this waits (up to [`DEADLINE`]) for the region to settle.
pub fn settled_snapshot(region: &Region) -> Vec<u8> {
    let mut bytes = vec![0u8; region.len()];
    assert!(
        eventually(DEADLINE, || region.read(0, &mut bytes).is_ok()),
        "the region never settled: {:?}",
        region.read(0, &mut bytes)
    );
    bytes
}

/// The descriptor index and reason of a one-sided access error; panics on anything else.
pub fn access_error(result: tcpx_runtime::Result<u64>) -> (usize, String) {
    match result {
        Err(tcpx_runtime::Error::Access {
            descriptor, reason, ..
        }) => (descriptor, reason),
        other => panic!("expected an access error, got {other:?}"),
    }
}

/// Writes the pattern of `fill(seed)` over the first `len` bytes of `region` (host or CUDA).
pub fn write_pattern(region: &Region, len: usize, seed: u64) {
    let mut bytes = vec![0u8; len];
    fill(&mut bytes, seed);
    region.write(0, &bytes).expect("write the pattern");
}

/// Panics, naming `what`, unless the first `len` bytes of `region` (host or CUDA) hold the
/// pattern of `fill(seed)`.
pub fn verify_region(region: &Region, len: usize, seed: u64, what: &str) {
    let mut back = vec![0u8; len];
    region.read(0, &mut back).expect("read back");
    if let Err(at) = check(&back, seed) {
        panic!("{what}: data differs at byte {at} of {len}");
    }
}

/// Sends `len` bytes of `src` over `ab` into `dst` over `ba` and checks they hold `fill(seed)`.
pub fn send_verified(
    ab: &Connection,
    ba: &Connection,
    src: &Region,
    dst: &Region,
    len: usize,
    seed: u64,
) {
    let rx = ba.recv(dst, 0, len).expect("post recv");
    let tx = ab.send(src, 0, len).expect("post send");
    assert_eq!(tx.wait(DEADLINE).expect("send"), len as u64);
    assert_eq!(rx.wait(DEADLINE).expect("recv"), len as u64);
    verify_region(
        dst,
        len,
        seed,
        &format!("{len} bytes on {} channels", ab.channels()),
    );
}

/// Every rank of `group` sends `len` bytes to every other and checks what it received:
/// rank r sends `fill(seed(r, p))` to rank p. Receives are posted before sends, all in
/// flight at once; every wait has [`DEADLINE`].
pub fn all_to_all(ep: &Endpoint, group: &tcpx_runtime::Group, len: usize) {
    let seed = |from: usize, to: usize| (from * 1000 + to) as u64 + 1;
    let me = group.rank();
    let world = group.world();
    let inbox = ep.alloc_host(len * world).expect("inbox");
    let outbox: Vec<Option<Region>> = (0..world)
        .map(|p| (p != me).then(|| source(ep, len, seed(me, p))))
        .collect();
    let mut pending = Vec::new();
    for p in (0..world).filter(|&p| p != me) {
        let conn = group
            .connection(p)
            .expect("a connection to every other rank");
        assert_eq!(group.rank_of(conn), Some(p));
        pending.push(conn.recv(&inbox, p * len, len).expect("recv"));
    }
    for p in (0..world).filter(|&p| p != me) {
        let conn = group.connection(p).unwrap();
        let out = outbox[p].as_ref().unwrap();
        pending.push(conn.send(out, 0, len).expect("send"));
    }
    for t in pending {
        assert_eq!(t.wait(DEADLINE).expect("transfer"), len as u64);
    }
    for p in (0..world).filter(|&p| p != me) {
        assert_pattern(
            &inbox,
            p * len,
            len,
            seed(p, me),
            &format!("rank {me} from {p}"),
        );
    }
}

/// Bytes each channel in `stats` (`Connection::stats` or `one_sided_stats`) received since
/// `before` (the totals a previous call returned, or zeros), channels with none left out, and
/// the new totals.
pub fn received_since(
    stats: &[tcpx_runtime::ChannelStats],
    before: &[u64],
) -> (Vec<u64>, Vec<u64>) {
    let now: Vec<u64> = stats.iter().map(|s| s.bytes_received).collect();
    let got = now
        .iter()
        .zip(before)
        .map(|(n, b)| n - b)
        .filter(|&d| d > 0)
        .collect();
    (got, now)
}

/// Sends `sizes[i]` bytes from offset `i · stride` of `src` to the same offset of `dst` on
/// `ab` → `ba`: the first half's receives are posted before every send, the second half's
/// after them and a pause (their messages arrive first). Every transfer must report its
/// length and every message land whole (`what` names the run in a failure).
pub fn exchange_verified(
    (ab, ba): (&Connection, &Connection),
    (src, dst): (&Region, &Region),
    sizes: &[usize],
    stride: usize,
    what: &str,
) {
    let half = sizes.len() / 2;
    let mut recvs: Vec<_> = (0..half)
        .map(|i| ba.recv(dst, i * stride, sizes[i]).unwrap())
        .collect();
    let sends: Vec<_> = sizes
        .iter()
        .enumerate()
        .map(|(i, &len)| ab.send(src, i * stride, len).unwrap())
        .collect();
    // Waiting for the second half's sends before posting their receives would ask the
    // transport to buffer megabytes nobody receives.
    std::thread::sleep(Duration::from_millis(100));
    recvs.extend((half..sizes.len()).map(|i| ba.recv(dst, i * stride, sizes[i]).unwrap()));
    for (i, s) in sends.iter().enumerate() {
        assert_eq!(
            s.wait(DEADLINE).unwrap(),
            sizes[i] as u64,
            "{what}: send {i}"
        );
    }
    for (i, r) in recvs.iter().enumerate() {
        assert_eq!(
            r.wait(DEADLINE).unwrap(),
            sizes[i] as u64,
            "{what}: receive {i}"
        );
    }
    let (sent, got) = (snapshot(src), snapshot(dst));
    for (i, &len) in sizes.iter().enumerate() {
        let at = i * stride;
        assert!(
            got[at..at + len] == sent[at..at + len],
            "{what}: message {i} of {len} bytes"
        );
    }
}

/// Writes `len` bytes of `fill(seed)` from a fresh region of `a` into the start of `target`
/// (advertised as `d`) over `ab`, checks them there, reads them back into another fresh
/// region and checks that too (`what` names the run in a failure).
pub fn write_and_read_back(
    (a, ab): (&Endpoint, &Connection),
    (target, d): (&Region, tcpx_runtime::Descriptor),
    len: usize,
    seed: u64,
    what: &str,
) {
    let src = source(a, len, seed);
    let w = ab
        .write(
            &[tcpx_runtime::Segment::new(&src, 0, len)],
            &[tcpx_runtime::RemoteSegment::new(d, 0, len as u64)],
            None,
        )
        .expect("post write");
    assert_eq!(
        w.wait(DEADLINE).expect("write"),
        len as u64,
        "{what}: write"
    );
    assert_pattern(target, 0, len, seed, &format!("{what}: written"));
    let back = a.alloc_host(len).expect("alloc");
    let r = ab
        .read(
            &[tcpx_runtime::Segment::new(&back, 0, len)],
            &[tcpx_runtime::RemoteSegment::new(d, 0, len as u64)],
        )
        .expect("post read");
    assert_eq!(r.wait(DEADLINE).expect("read"), len as u64, "{what}: read");
    assert_pattern(&back, 0, len, seed, &format!("{what}: read back"));
}

// ---- One-sided scenarios shared by `onesided.rs` (host memory) and `onesided_staged.rs`
// (staged memory): the same steps with each file's regions and checks passed in. ----

/// A zeroed host region of `len` bytes on `ep`, advertised, and its descriptor: the target
/// side of most one-sided scenarios.
pub fn advertised_host(ep: &Endpoint, len: usize) -> (Region, Descriptor) {
    let region = ep.alloc_host(len).expect("alloc_host");
    let d = ep.advertise(&region).expect("advertise");
    (region, d)
}

/// Posts the one-block write most one-sided scenarios issue: the first `len` bytes of
/// `local` to the first `len` bytes behind `d`, with `note`.
pub fn write_one(
    conn: &Connection,
    local: &Region,
    d: Descriptor,
    len: usize,
    note: Option<&[u8]>,
) -> Transfer {
    conn.write(
        &[Segment::new(local, 0, len)],
        &[RemoteSegment::new(d, 0, len as u64)],
        note,
    )
    .expect("post write")
}

/// Posts [`write_one`]'s read: the first `len` bytes behind `d` into the start of `local`.
pub fn read_one(conn: &Connection, local: &Region, d: Descriptor, len: usize) -> Transfer {
    conn.read(
        &[Segment::new(local, 0, len)],
        &[RemoteSegment::new(d, 0, len as u64)],
    )
    .expect("post read")
}

/// `blocks` (offset, len) of `region` as a local list, in the order given. Scenarios keep
/// their lists as layouts, since the same layout then checks where the bytes landed.
pub fn local_segments<'r>(region: &'r Region, blocks: &[(usize, usize)]) -> Vec<Segment<'r>> {
    blocks
        .iter()
        .map(|&(o, l)| Segment::new(region, o, l))
        .collect()
}

/// `blocks` (offset, len) behind `d` as a remote list, in the order given (see
/// [`local_segments`] for why lists start out as layouts).
pub fn remote_segments(d: Descriptor, blocks: &[(usize, usize)]) -> Vec<RemoteSegment> {
    spread_remote_segments(&[d], blocks, &vec![0; blocks.len()])
}

/// `blocks` (offset, len) as a remote list over several advertised regions: block k behind
/// `d[which[k]]`.
pub fn spread_remote_segments(
    d: &[Descriptor],
    blocks: &[(usize, usize)],
    which: &[usize],
) -> Vec<RemoteSegment> {
    assert_eq!(blocks.len(), which.len());
    blocks
        .iter()
        .zip(which)
        .map(|(&(o, l), &w)| RemoteSegment::new(d[w], o as u64, l as u64))
        .collect()
}

/// `n` blocks of `block` bytes in every other slot of that size, from slot `first` (0 or 1):
/// adjacent in the list but never in memory, so nothing coalesces and the packing and
/// KV-list scenarios really move `n` separate runs.
pub fn every_other_block(n: usize, block: usize, first: usize) -> Vec<(usize, usize)> {
    (0..n).map(|i| ((2 * i + first) * block, block)).collect()
}

/// What a list of `blocks` (offset, len) of `bytes` carries: the blocks' bytes in list order,
/// to check the blocks at the other end against with [`assert_blocks`].
pub fn gather(bytes: &[u8], blocks: &[(usize, usize)]) -> Vec<u8> {
    blocks
        .iter()
        .flat_map(|&(o, l)| bytes[o..o + l].iter().copied())
        .collect()
}

/// Asserts that `stream` (what a list moved, in list order) sits in `blocks` (offset, len) of
/// `dst`: stream byte k in the k-th byte of the blocks.
pub fn assert_blocks(dst: &Region, blocks: &[(usize, usize)], stream: &[u8], what: &str) {
    assert_spread_blocks(&[dst], blocks, &vec![0; blocks.len()], stream, what);
}

/// [`assert_blocks`] over several regions: block k in `regions[which[k]]` (each region
/// snapshotted once, after the transfer, once no engine holds it: [`settled_snapshot`]).
pub fn assert_spread_blocks(
    regions: &[&Region],
    blocks: &[(usize, usize)],
    which: &[usize],
    stream: &[u8],
    what: &str,
) {
    assert_eq!(blocks.len(), which.len());
    let got: Vec<Vec<u8>> = regions.iter().map(|r| settled_snapshot(r)).collect();
    let mut pos = 0;
    for (i, (&(o, l), &w)) in blocks.iter().zip(which).enumerate() {
        assert!(
            got[w][o..o + l] == stream[pos..pos + l],
            "{what}: block {i} ({l} bytes at {o} in region {w}) differs"
        );
        pos += l;
    }
}

/// Waits for `t` and asserts the target refused it for `reason` (a word of the error),
/// naming entry `index` of its remote list: the first check of every refusal scenario.
pub fn assert_refused(t: &Transfer, index: usize, reason: &str, what: &str) {
    let (at, why) = access_error(t.wait(DEADLINE));
    assert_eq!(at, index, "{what}: the error names the bad entry");
    assert!(
        why.contains(reason),
        "{what}: {why:?} should say {reason:?}"
    );
}

/// Collects `ep`'s notifications until `n` arrived (at most [`DEADLINE`]); returns all that
/// arrived, so a caller comparing them with what it expects also catches extra ones.
pub fn wait_notifications(ep: &Endpoint, n: usize) -> Vec<Vec<u8>> {
    let mut got = Vec::new();
    assert!(
        eventually(DEADLINE, || {
            got.extend(ep.notifications().into_iter().map(|(_, b)| b));
            got.len() >= n
        }),
        "only {} of {n} notifications arrived",
        got.len()
    );
    got
}

/// The "a notification is never delivered before its data" scenario: write i sends all of
/// `sources[i]` to the list `remote(d)` of `targets[i]` (`d` its descriptor, advertised by
/// `target`) with note "done i", all issued back to back on `conn` (then, with `standalone`,
/// a standalone "all sent", which must queue behind every one of them), while a thread
/// collects `target`'s notifications and calls `landed(i)` the moment "done i" arrives: that
/// check must already find all of write i's bytes. Every write moves all of its source and
/// the notifications arrive in send order. The memory kinds, the remote lists and how a file
/// checks its regions differ; the ordering promise under test does not.
pub fn notifications_after_their_data(
    (target, conn): (&Endpoint, &Connection),
    (sources, targets): (&[Region], &[Region]),
    remote: impl Fn(Descriptor) -> Vec<RemoteSegment>,
    standalone: bool,
    landed: impl Fn(usize) + Sync,
) {
    let n = sources.len();
    assert_eq!(targets.len(), n);
    let descriptors: Vec<Descriptor> = targets
        .iter()
        .map(|r| target.advertise(r).unwrap())
        .collect();
    let expected: Vec<String> = (0..n)
        .map(|i| format!("done {i}"))
        .chain(standalone.then(|| "all sent".to_string()))
        .collect();
    let order = std::thread::scope(|s| {
        let checker = s.spawn(|| {
            let mut order = Vec::new();
            let deadline = std::time::Instant::now() + DEADLINE;
            while order.len() < expected.len() && std::time::Instant::now() < deadline {
                for (_, bytes) in target.notifications() {
                    let text = String::from_utf8(bytes).unwrap();
                    if let Some(i) = text.strip_prefix("done ") {
                        landed(i.parse().unwrap());
                    }
                    order.push(text);
                }
                std::thread::yield_now();
            }
            order
        });
        let transfers: Vec<Transfer> = (0..n)
            .map(|i| {
                let local = [Segment::new(&sources[i], 0, sources[i].len())];
                let note = Some(expected[i].as_bytes());
                conn.write(&local, &remote(descriptors[i]), note).unwrap()
            })
            .collect();
        if standalone {
            conn.notify(b"all sent").unwrap();
        }
        for (t, src) in transfers.iter().zip(sources) {
            assert_eq!(t.wait(DEADLINE).unwrap(), src.len() as u64);
        }
        checker.join().unwrap()
    });
    assert_eq!(order, expected, "notifications in send order");
}

/// One round of the random-descriptor-list scenario, run on host memory by `onesided.rs` and
/// on staged memory by `onesided_staged.rs`: all of `src`, cut into random local blocks of at
/// most `max_block[0]` bytes, is written to random blocks of at most `max_block[1]` spread
/// over the two `targets` (each region's blocks at their own offsets, so they never overlap),
/// every block checked; then the same remote list is read back into `back()` cut another way
/// (blocks of at most `max_block[2]`). Returns that region for the caller to check against
/// `src`'s pattern its own way. Draws from `rng` in a fixed order, so a seed is one layout.
pub fn random_lists_round(
    rng: &mut Rng,
    ab: &Connection,
    targets: [(&Region, Descriptor); 2],
    src: &Region,
    max_block: [usize; 3],
    back: impl FnOnce() -> Region,
    what: &str,
) -> Region {
    let total = src.len();
    let local_layout = random_layout(rng, total, total, max_block[0]);
    let remote_layout = random_layout(rng, total, targets[0].0.len(), max_block[1]);
    let which: Vec<usize> = remote_layout
        .iter()
        .map(|_| rng.below(2) as usize)
        .collect();
    let remote = spread_remote_segments(&[targets[0].1, targets[1].1], &remote_layout, &which);
    let tx = ab
        .write(&local_segments(src, &local_layout), &remote, None)
        .unwrap();
    assert_eq!(tx.wait(DEADLINE).unwrap(), total as u64, "{what}: write");
    assert_spread_blocks(
        &[targets[0].0, targets[1].0],
        &remote_layout,
        &which,
        &snapshot(src),
        &format!("{what}: write"),
    );
    let back = back();
    let back_layout = random_layout(rng, total, total, max_block[2]);
    let rx = ab
        .read(&local_segments(&back, &back_layout), &remote)
        .unwrap();
    assert_eq!(rx.wait(DEADLINE).unwrap(), total as u64, "{what}: read");
    back
}

/// A configuration whose transfers spread: 8 channels of 512 KiB chunks driven by 8 engines
/// a side, so a transfer below 4 MiB alone on its connection is cut into pieces of at least
/// 128 KiB over up to 8 channels, one-sided ones too.
pub fn spread_config() -> Config {
    let mut c = config(8, 512 << 10);
    c.engines_per_device = Some(8);
    c
}

/// Writes all of `src` alone on `ab` into `dst` (advertised as `d`), checks every byte landed,
/// and returns the bytes each of `ba`'s one-sided channels received for it (channels with
/// none left out): how the write was cut. `totals` carries those channels' byte counts from
/// one call to the next.
pub fn lone_write_pieces(
    (ab, ba): (&Connection, &Connection),
    src: &Region,
    (dst, d): (&Region, Descriptor),
    totals: &mut Vec<u64>,
    what: &str,
) -> Vec<u64> {
    let len = src.len();
    let tx = write_one(ab, src, d, len, None);
    assert_eq!(tx.wait(DEADLINE).unwrap(), len as u64, "{what}");
    let (got, now) = received_since(&ba.one_sided_stats(), totals);
    *totals = now;
    assert!(snapshot(dst) == snapshot(src), "{what}");
    got
}
