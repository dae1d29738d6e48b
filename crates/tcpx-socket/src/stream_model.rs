//! Model tests of the data path: a send comm and a receive comm built directly over loopback TCP
//! pairs (1 to 4 sockets, optionally with socket buffers of a few KiB so that every `sendmsg`
//! and `recv` stops at arbitrary points, inside headers too), driven by a random interleaving
//! of posts, tests and consumptions, against a model: message k lands whole in receive k, the
//! reported sizes are the sent ones, nothing past a message is written, and the 16-request
//! limits answer busy exactly when the model says so. Large payloads are read in batches of
//! 0 (off) to 256 KiB (`SO_RCVLOWAT`), so no batch may wait for bytes that never come.

use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use tcpx_sys::MAX_REQUESTS;

use crate::recv::RecvComm;
use crate::send::SendComm;

const RING: u64 = MAX_REQUESTS as u64;
/// Poison of the receive buffers: a byte past a message must still hold it.
const POISON: u8 = 0xa5;

fn set_buf(fd: &impl AsRawFd, opt: libc::c_int, bytes: libc::c_int) {
    let set = crate::sock::set_int_option(fd, libc::SOL_SOCKET, opt, bytes);
    assert!(set.is_ok(), "setsockopt: {set:?}");
}

/// `n` connected loopback pairs (sender side, receiver side), non-blocking like the plugin's.
fn socket_pairs(n: usize, tiny: bool) -> (Vec<TcpStream>, Vec<TcpStream>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    if tiny {
        // Inherited by the accepted sockets, so it holds from the handshake on.
        set_buf(&l, libc::SO_RCVBUF, 2048);
    }
    let addr = l.local_addr().unwrap();
    let (mut tx, mut rx) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let c = TcpStream::connect(addr).unwrap();
        let (a, _) = l.accept().unwrap();
        if tiny {
            set_buf(&c, libc::SO_SNDBUF, 2048);
        }
        for s in [&c, &a] {
            s.set_nodelay(true).unwrap();
            s.set_nonblocking(true).unwrap();
        }
        tx.push(c);
        rx.push(a);
    }
    (tx, rx)
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// One step of the interleaving.
#[derive(Clone, Copy, Debug)]
enum Op {
    PostSend,
    PostRecv,
    TestSend,
    TestRecv,
    Consume,
}

/// The connection under test and the model's counters.
struct Run {
    send: Box<SendComm>,
    recv: Box<RecvComm>,
    /// The receive comm's first socket, shared: its options can be read.
    rx_probe: TcpStream,
    consume: bool,
    sizes: Vec<usize>,
    src: Vec<Vec<u8>>,
    dst: Vec<Vec<u8>>,
    sent_posted: usize,
    sent_done: usize,
    recv_posted: usize,
    recv_done: usize,
    released: usize,
}

impl Run {
    fn new(nsocks: usize, tiny: bool, consume: bool, sizes: Vec<usize>, slack: &[usize]) -> Self {
        let (tx, rx) = socket_pairs(nsocks, tiny);
        let src = sizes
            .iter()
            .enumerate()
            .map(|(k, &s)| pattern(k as u64 + 1, s))
            .collect();
        let dst = sizes
            .iter()
            .enumerate()
            .map(|(k, &s)| vec![POISON; s + slack[k % slack.len()]])
            .collect();
        let rx_probe = rx[0].try_clone().expect("dup the receive socket");
        Self {
            send: SendComm::new(tx, "model send".into()),
            recv: RecvComm::new(rx, consume, None, None, "model recv".into()),
            rx_probe,
            consume,
            sizes,
            src,
            dst,
            sent_posted: 0,
            sent_done: 0,
            recv_posted: 0,
            recv_done: 0,
            released: 0,
        }
    }

    fn released(&self) -> usize {
        if self.consume {
            self.released
        } else {
            self.recv_done
        }
    }

    /// Executes `op` where it is legal; checks busy answers against the model.
    fn step(&mut self, op: Op) -> Result<(), TestCaseError> {
        let n = self.sizes.len();
        match op {
            Op::PostSend if self.sent_posted < n => {
                let k = self.sent_posted;
                let r = self
                    .send
                    .post(self.src[k].as_ptr(), self.sizes[k], false)
                    .map_err(|c| TestCaseError::fail(format!("isend #{k}: {c:?}")))?;
                let busy = self.sent_posted - self.sent_done >= MAX_REQUESTS;
                prop_assert_eq!(r.is_none(), busy, "isend #{} busy answer", k);
                if r.is_some() {
                    self.sent_posted += 1;
                }
            }
            Op::PostRecv if self.recv_posted < n => {
                let k = self.recv_posted;
                let cap = self.dst[k].len();
                let r = self
                    .recv
                    .post(self.dst[k].as_mut_ptr(), cap, false)
                    .map_err(|c| TestCaseError::fail(format!("irecv #{k}: {c:?}")))?;
                let busy = self.recv_posted - self.released() >= MAX_REQUESTS;
                prop_assert_eq!(r.is_none(), busy, "irecv #{} busy answer", k);
                if r.is_some() {
                    self.recv_posted += 1;
                }
            }
            Op::TestSend if self.sent_done < self.sent_posted => {
                let k = self.sent_done;
                let done = self
                    .send
                    .test((k as u64 % RING) as usize, k as u64)
                    .map_err(|c| TestCaseError::fail(format!("send test #{k}: {c:?}")))?;
                if let Some(size) = done {
                    prop_assert_eq!(size as usize, self.sizes[k], "send #{} size", k);
                    self.sent_done += 1;
                }
            }
            Op::TestRecv if self.recv_done < self.recv_posted => {
                let k = self.recv_done;
                let done = self
                    .recv
                    .test((k as u64 % RING) as usize, k as u64)
                    .map_err(|c| TestCaseError::fail(format!("recv test #{k}: {c:?}")))?;
                if let Some(size) = done {
                    let s = self.sizes[k];
                    prop_assert_eq!(size as usize, s, "receive #{} size", k);
                    prop_assert!(self.dst[k][..s] == self.src[k][..], "receive #{} bytes", k);
                    prop_assert!(
                        self.dst[k][s..].iter().all(|&b| b == POISON),
                        "receive #{} written past its {} bytes",
                        k,
                        s
                    );
                    self.recv_done += 1;
                }
            }
            Op::Consume if self.consume && self.released < self.recv_done => {
                let k = self.released;
                self.recv
                    .consumed(k as u64)
                    .map_err(|c| TestCaseError::fail(format!("consume #{k}: {c:?}")))?;
                self.released += 1;
            }
            _ => {}
        }
        Ok(())
    }

    /// Runs `ops`, then drives everything to completion (10 s without progress is a stall).
    fn run(&mut self, ops: &[Op]) -> Result<(), TestCaseError> {
        for &op in ops {
            self.step(op)?;
        }
        let n = self.sizes.len();
        let mut last = (usize::MAX, usize::MAX);
        let mut since = Instant::now();
        while self.sent_done < n || self.recv_done < n {
            for op in [
                Op::PostSend,
                Op::PostRecv,
                Op::TestSend,
                Op::TestRecv,
                Op::Consume,
            ] {
                self.step(op)?;
            }
            if (self.sent_done, self.recv_done) != last {
                last = (self.sent_done, self.recv_done);
                since = Instant::now();
            }
            prop_assert!(
                since.elapsed() < Duration::from_secs(10),
                "stalled: sent {}/{n}, received {}/{n}",
                self.sent_done,
                self.recv_done
            );
        }
        Ok(())
    }
}

fn size() -> impl Strategy<Value = usize> {
    prop_oneof![
        1 => Just(0usize),
        3 => 1usize..=64,
        3 => prop_oneof![Just(4095usize), Just(4096), Just(4097)],
        3 => 65usize..16 << 10,
        2 => 16usize << 10..200 << 10,
        1 => 200usize << 10..3 << 20,
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        Just(Op::PostSend),
        Just(Op::PostRecv),
        Just(Op::TestSend),
        Just(Op::TestRecv),
        Just(Op::Consume),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn messages_arrive_whole_and_in_order(
        nsocks in 1usize..=4,
        tiny: bool,
        consume: bool,
        sizes in proptest::collection::vec(size(), 1..48),
        slack in proptest::collection::vec(0usize..3, 1..4),
        ops in proptest::collection::vec(op(), 0..400),
        read_batch in prop_oneof![Just(0usize), Just(1000), Just(64 << 10), Just(256 << 10)],
    ) {
        let mut run = Run::new(nsocks, tiny, consume, sizes, &slack);
        run.recv.set_read_batch(read_batch);
        run.run(&ops)?;
    }
}

/// Sixteen small sends queued on one socket leave in one `sendmsg`: once the oldest is done,
/// every other one is done at its first `test` (which does no socket work when complete).
#[test]
fn queued_small_sends_leave_together() {
    let sizes = vec![256; MAX_REQUESTS];
    let mut run = Run::new(1, false, false, sizes, &[0]);
    for _ in 0..MAX_REQUESTS {
        run.step(Op::PostSend).unwrap();
    }
    assert_eq!(run.sent_posted, MAX_REQUESTS);
    let start = Instant::now();
    while run.sent_done == 0 {
        assert!(start.elapsed() < Duration::from_secs(30));
        run.step(Op::TestSend).unwrap();
    }
    for k in 1..MAX_REQUESTS {
        run.step(Op::TestSend).unwrap();
        assert_eq!(
            run.sent_done,
            k + 1,
            "send #{k} not done after the first one"
        );
    }
}

/// Receives posted after the sender is done find their messages; the bytes of messages not
/// yet posted wait in the read-ahead buffer and are delivered to receives posted later.
#[test]
fn late_receives_find_read_ahead_data() {
    let sizes: Vec<usize> = (0..40).map(|k| [0, 1, 4096, 777, 70_000][k % 5]).collect();
    let mut run = Run::new(1, false, false, sizes, &[1]);
    let start = Instant::now();
    // Fill the send window and complete it, with no receive posted yet.
    while run.sent_done < MAX_REQUESTS {
        assert!(start.elapsed() < Duration::from_secs(30));
        run.step(Op::PostSend).unwrap();
        run.step(Op::TestSend).unwrap();
    }
    // One receive at a time: each completes from data that arrived long before it was posted.
    while run.recv_done < run.sizes.len() {
        assert!(start.elapsed() < Duration::from_secs(30));
        run.step(Op::PostRecv).unwrap();
        run.step(Op::TestRecv).unwrap();
        run.step(Op::PostSend).unwrap();
        run.step(Op::TestSend).unwrap();
    }
}

/// A lone large receive is read as its bytes land (the watermark stays 1); once another
/// receive is posted behind it, the stream is read in batches (the watermark rises). Socket
/// buffers of 2 KiB keep both 1 MiB messages in flight for many steps.
#[test]
fn a_lone_receive_reads_as_bytes_land_and_a_stream_in_batches() {
    let lowat = |run: &Run| {
        crate::sock::int_option(&run.rx_probe, libc::SOL_SOCKET, libc::SO_RCVLOWAT).unwrap()
    };
    let mut run = Run::new(1, true, false, vec![1 << 20, 1 << 20], &[0]);
    run.recv.set_read_batch(256 << 10);
    run.step(Op::PostSend).unwrap();
    run.step(Op::PostRecv).unwrap();
    // Several tests per send step: once the sender's queued bytes are in, a test finds the
    // socket empty, so the next one asks the readiness check, before which the watermark is
    // set.
    for _ in 0..100 {
        run.step(Op::TestSend).unwrap();
        for _ in 0..4 {
            run.step(Op::TestRecv).unwrap();
        }
        assert_eq!(lowat(&run), 1, "a lone receive waited for a batch");
    }
    assert_eq!(
        run.recv_done, 0,
        "the first message must still be in flight"
    );
    run.step(Op::PostSend).unwrap();
    run.step(Op::PostRecv).unwrap();
    let mut batched = 1;
    let start = Instant::now();
    while run.recv_done < 2 {
        assert!(start.elapsed() < Duration::from_secs(30), "stalled");
        run.step(Op::TestSend).unwrap();
        for _ in 0..4 {
            run.step(Op::TestRecv).unwrap();
        }
        if run.recv_done == 0 {
            batched = batched.max(lowat(&run));
        }
    }
    assert!(
        batched > 1,
        "a receive with another behind it never batched"
    );
}
