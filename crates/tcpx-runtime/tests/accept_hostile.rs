//! Strangers on the control port, and an endpoint that stops accepting: garbage, all `0xff`, a slow drip, an instant close, `TXCP`
//! plus junk, an oversized or wrong first message, silent sockets held open, and tcpx peers
//! without the endpoint's secret. None of them ends or delays `accept`: each is turned away
//! on its own deadline while the real peer that connects after them gets through and moves
//! verified bytes; nothing is left behind (descriptors and threads counted).
//!
//! The tests of this file run one at a time (`SERIAL`), so the process-wide counts are theirs.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::*;
use tcpx_runtime::control::codec::MAGIC;
use tcpx_runtime::control::{Decoder, EndpointInfo, EndpointMetadata, Message, PROTOCOL_VERSION};
use tcpx_runtime::{Config, Connection, Endpoint, Error};

const KIB: usize = 1 << 10;

/// Every test here holds this: they count the process's descriptors and threads.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The server's configuration: its timeout is also each stranger's deadline for a `Hello`.
fn server_config(timeout: Duration, require_secret: bool) -> Config {
    let mut c = config(2, 64 * KIB as u32);
    c.timeout = timeout;
    c.require_secret = require_secret;
    c
}

/// A `Hello` as a tcpx peer would send it.
fn hello_bytes() -> Vec<u8> {
    let info = EndpointInfo {
        ip: "127.0.0.1".parse().unwrap(),
        gpu_pci: None,
        channels: 2,
        plugin_name: "tcpx-socket".into(),
        abi_version: 8,
        chunk_bytes: 64 << 10,
        gpu_index: None,
        spread: 1,
        eager_bytes: 0,
        spread_two_sided: true,
    };
    let mut out = Vec::new();
    Message::hello(info).encode(&mut out).unwrap();
    out
}

/// One stranger: its socket, and the thread feeding it (slow drips only).
struct Stranger {
    socket: Option<TcpStream>,
    feeder: Option<JoinHandle<()>>,
    stop: Arc<AtomicBool>,
}

impl Drop for Stranger {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        drop(self.socket.take());
        if let Some(f) = self.feeder.take() {
            f.join().unwrap();
        }
    }
}

const KINDS: [&str; 9] = [
    "random bytes",
    "all 0xff",
    "slow drip",
    "instant close",
    "TXCP plus junk",
    "oversized first frame",
    "Ready instead of Hello",
    "old protocol version",
    "silent",
];

/// Connects a stranger of kind `what` to `addr` and starts its behaviour.
fn stranger(addr: SocketAddr, what: &'static str, seed: u64) -> Stranger {
    let mut socket = TcpStream::connect_timeout(&addr, DEADLINE).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let mut feeder = None;
    let header = |version: u16, code: u16, len: u32| {
        let mut h = MAGIC.to_vec();
        h.extend_from_slice(&version.to_le_bytes());
        h.extend_from_slice(&code.to_le_bytes());
        h.extend_from_slice(&len.to_le_bytes());
        h
    };
    match what {
        "random bytes" => {
            let mut rng = Rng(seed);
            let bytes: Vec<u8> = (0..1000).map(|_| rng.next() as u8).collect();
            socket.write_all(&bytes).unwrap();
        }
        "all 0xff" => socket.write_all(&[0xff; 4096]).unwrap(),
        "slow drip" => {
            // A real Hello, one byte every 250 ms: it would take far longer than the deadline.
            let mut drip = socket.try_clone().unwrap();
            let stop = stop.clone();
            feeder = Some(std::thread::spawn(move || {
                for b in hello_bytes() {
                    if stop.load(Ordering::Relaxed) || drip.write_all(&[b]).is_err() {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(250));
                }
            }));
        }
        "instant close" => return closed(),
        "TXCP plus junk" => {
            let mut junk = MAGIC.to_vec();
            junk.extend_from_slice(&[0x13, 0x37, 0xde, 0xad, 0xbe, 0xef, 0, 1, 2, 3, 4, 5]);
            socket.write_all(&junk).unwrap();
        }
        // Announces 64 MiB of payload: refused from the header, before any allocation.
        "oversized first frame" => socket
            .write_all(&header(PROTOCOL_VERSION, 1, 64 << 20))
            .unwrap(),
        "Ready instead of Hello" => {
            let mut ready = Vec::new();
            Message::Ready.encode(&mut ready).unwrap();
            socket.write_all(&ready).unwrap();
        }
        // A Hello of protocol version 1 (no GPU index, no secret field).
        "old protocol version" => {
            let hello = hello_bytes();
            let mut old = header(1, 1, (hello.len() - 12 - 2) as u32);
            old.extend_from_slice(&hello[12..hello.len() - 2]);
            socket.write_all(&old).unwrap();
        }
        "silent" => {}
        other => panic!("unknown stranger kind {other}"),
    }
    Stranger {
        socket: Some(socket),
        feeder,
        stop,
    }
}

fn closed() -> Stranger {
    Stranger {
        socket: None,
        feeder: None,
        stop: Arc::new(AtomicBool::new(true)),
    }
}

/// Connects `client` to `server` (by metadata) while `server` accepts; returns both ends and
/// how long it took.
fn real_peer(server: &Endpoint, client: &Endpoint) -> (Connection, Connection, Duration) {
    let meta = server.metadata().clone();
    std::thread::scope(|s| {
        let started = Instant::now();
        let accepted = s.spawn(|| server.accept_timeout(DEADLINE));
        let cs = client.connect(&meta).expect("the real peer connects");
        let sc = accepted
            .join()
            .unwrap()
            .expect("accept hands over the real peer");
        (sc, cs, started.elapsed())
    })
}

/// Moves `len` verified bytes client → server and server → client.
fn verified_both_ways(server: &Endpoint, client: &Endpoint, sc: &Connection, cs: &Connection) {
    let len = 192 * KIB + 5;
    let src = source(client, len, 11);
    let dst = server.alloc_host(len).unwrap();
    send_verified(cs, sc, &src, &dst, len, 11);
    let src = source(server, len, 12);
    let dst = client.alloc_host(len).unwrap();
    send_verified(sc, cs, &src, &dst, len, 12);
}

/// Reads what the server says to a stranger before closing: its `Error` message's text, or
/// `None` when it closed without one. Waits at most `limit`.
fn refusal(socket: &mut TcpStream, limit: Duration) -> Option<String> {
    socket.set_read_timeout(Some(limit)).unwrap();
    let mut bytes = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match socket.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => bytes.extend_from_slice(&buf[..n]),
        }
    }
    let mut input = &bytes[..];
    let frame = Decoder::new().decode(&mut input).ok()??;
    match Message::decode(&frame).ok()? {
        Message::Error { message, .. } => Some(message),
        _ => None,
    }
}

#[test]
fn each_kind_of_stranger_is_turned_away_and_the_real_peer_gets_through() {
    let _serial = serial();
    loopback();
    let hello_deadline = Duration::from_secs(8);
    let server = Endpoint::new(server_config(hello_deadline, false)).unwrap();
    let client = Endpoint::new(config(2, 64 * KIB as u32)).unwrap();
    let addr = server.metadata().control_addr;
    for (i, what) in KINDS.into_iter().enumerate() {
        let mut s = stranger(addr, what, i as u64);
        let (sc, cs, took) = real_peer(&server, &client);
        assert!(
            took < hello_deadline / 4,
            "{what}: the real peer took {took:?} (stranger deadline {hello_deadline:?})"
        );
        verified_both_ways(&server, &client, &sc, &cs);
        // Everything but the silent and dripping strangers was refused already: closed, and
        // told why (unless the close raced ahead of the message as a reset).
        if let (Some(socket), false) = (s.socket.as_mut(), matches!(what, "silent" | "slow drip")) {
            let started = Instant::now();
            let why = refusal(socket, Duration::from_secs(10));
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "{what}: not closed"
            );
            assert!(
                why.as_deref()
                    .is_none_or(|w| w.starts_with("connection refused")),
                "{what}: {why:?}"
            );
        }
        drop(s);
    }
}

#[test]
fn silent_strangers_do_not_delay_the_real_peer_and_leave_nothing_behind() {
    let _serial = serial();
    loopback();
    let hello_deadline = Duration::from_secs(8);
    let server = Endpoint::new(server_config(hello_deadline, false)).unwrap();
    let client = Endpoint::new(config(2, 64 * KIB as u32)).unwrap();
    let addr = server.metadata().control_addr;
    // Warm up: the first connection creates process-wide state (plugin, logging).
    drop(real_peer(&server, &client));
    let (fds, threads_before) = (open_fds(), settled(runtime_threads));

    // 48 strangers: half silent, the rest every other kind in turn (slow drips included).
    let strangers: Vec<Stranger> = (0..48)
        .map(|i| {
            let what = if i % 2 == 0 {
                "silent"
            } else {
                KINDS[(i as usize / 2) % KINDS.len()]
            };
            stranger(addr, what, i)
        })
        .collect();
    let (sc, cs, took) = real_peer(&server, &client);
    eprintln!("real peer connected in {took:?} behind 48 strangers");
    assert!(
        took < hello_deadline / 4,
        "the real peer took {took:?} behind 48 strangers \
         (their deadline is {hello_deadline:?})"
    );
    verified_both_ways(&server, &client, &sc, &cs);
    drop((sc, cs));
    drop(strangers);
    assert!(
        eventually(Duration::from_secs(10), || open_fds() == fds
            && runtime_threads() == threads_before),
        "descriptors {} (before {fds}), runtime threads {} (before {threads_before})",
        open_fds(),
        runtime_threads()
    );
}

#[test]
fn a_silent_stranger_is_refused_at_its_deadline_and_accept_reports_it() {
    let _serial = serial();
    loopback();
    let deadline = Duration::from_millis(1500);
    let server = Endpoint::new(server_config(deadline, false)).unwrap();
    let addr = server.metadata().control_addr;
    let mut s = stranger(addr, "silent", 0);
    let local = s.socket.as_ref().unwrap().local_addr().unwrap();
    let started = Instant::now();
    let err = server.accept_timeout(Duration::from_secs(3)).unwrap_err();
    let text = err.to_string();
    assert!(err.is_timeout(), "{text}");
    assert!(
        text.contains("1 connection(s) rejected") && text.contains(&local.to_string()),
        "{text}"
    );
    assert!(text.contains("no complete Hello"), "{text}");
    let why = refusal(s.socket.as_mut().unwrap(), Duration::from_secs(10)).unwrap();
    let waited = started.elapsed();
    assert!(why.contains("no complete Hello"), "{why}");
    assert!(
        waited >= Duration::from_secs(3) && waited < Duration::from_secs(10),
        "{waited:?}"
    );
}

#[test]
fn an_endpoint_that_requires_its_secret_refuses_peers_without_it_and_keeps_accepting() {
    let _serial = serial();
    loopback();
    let server = Endpoint::new(server_config(Duration::from_secs(10), true)).unwrap();
    let client = Endpoint::new(config(2, 64 * KIB as u32)).unwrap();
    let meta = server.metadata().clone();
    let wrong = EndpointMetadata {
        secret: tcpx_runtime::control::random_secret(),
        ..meta.clone()
    };
    let (sc, cs) = std::thread::scope(|s| {
        // One accept call outlives both refusals and takes the right peer.
        let accepted = s.spawn(|| server.accept_timeout(DEADLINE));
        let err = client.connect_addr(meta.control_addr).unwrap_err();
        assert!(refused_for_secret(&err, "presented none"), "{err}");
        let err = client.connect(&wrong).unwrap_err();
        assert!(refused_for_secret(&err, "wrong"), "{err}");
        let cs = client.connect(&meta).expect("the right secret gets in");
        (accepted.join().unwrap().expect("accept"), cs)
    });
    verified_both_ways(&server, &client, &sc, &cs);
    drop((sc, cs));

    // And again, for a later accept.
    let (sc, cs, _) = real_peer(&server, &client);
    verified_both_ways(&server, &client, &sc, &cs);

    // The metadata blob carries the secret: a peer that parsed the text gets in too.
    let parsed: EndpointMetadata = meta.to_hex().unwrap().parse().unwrap();
    assert_eq!(parsed.secret, meta.secret);
}

#[test]
fn peers_that_arrive_before_accept_wait_for_it_and_those_that_gave_up_are_skipped() {
    let _serial = serial();
    loopback();
    let server = Endpoint::new(server_config(Duration::from_secs(10), false)).unwrap();
    let meta = server.metadata().clone();

    // A peer that gives up (1 s set-up timeout) before anyone accepts: the next accept
    // skips it instead of failing on it.
    let impatient = Endpoint::new(server_config(Duration::from_secs(1), false)).unwrap();
    let err = impatient.connect(&meta).unwrap_err();
    assert!(err.is_timeout(), "{err}");
    let err = server
        .accept_timeout(Duration::from_millis(500))
        .unwrap_err();
    assert!(err.is_timeout(), "{err}");

    // A patient peer that connects first, then accept comes: it is admitted, queued, and
    // handed over.
    let client = Endpoint::new(config(2, 64 * KIB as u32)).unwrap();
    let (sc, cs) = std::thread::scope(|s| {
        let connecting = s.spawn(|| client.connect(&meta));
        std::thread::sleep(Duration::from_millis(300));
        let sc = server
            .accept_timeout(DEADLINE)
            .expect("accept the queued peer");
        (sc, connecting.join().unwrap().expect("connect"))
    });
    verified_both_ways(&server, &client, &sc, &cs);
}

fn refused_for_secret(err: &Error, why: &str) -> bool {
    let text = err.to_string();
    text.contains("secret") && text.contains(why) && text.contains("refused")
}

/// `stop_accepting` ends accepts blocked in other threads (network and same-host, each
/// waiting a minute) at once, and every later one; connections already made keep working,
/// and the endpoint still connects out.
#[test]
fn stopping_ends_blocked_accepts_at_once_and_spares_live_connections() {
    let _serial = serial();
    loopback();
    let (a, b, ab, ba) = pair(2, 64 * KIB as u32);
    let wait = Duration::from_secs(60);
    let (network, local) = std::thread::scope(|s| {
        let network = s.spawn(|| {
            let start = Instant::now();
            (a.accept_timeout(wait).map(|_| ()), start.elapsed())
        });
        let local = s.spawn(|| {
            let start = Instant::now();
            (a.accept_local_timeout(wait).map(|_| ()), start.elapsed())
        });
        std::thread::sleep(Duration::from_millis(200));
        a.stop_accepting();
        (network.join().unwrap(), local.join().unwrap())
    });
    for (what, (result, took)) in [("network", network), ("same-host", local)] {
        let e = result.unwrap_err();
        assert!(e.to_string().contains("stopped accepting"), "{what}: {e}");
        assert!(
            took < Duration::from_secs(20),
            "{what} accept took {took:?}"
        );
    }
    assert!(matches!(
        a.accept_timeout(wait).map(|_| ()),
        Err(Error::AcceptStopped { .. })
    ));
    a.stop_accepting();
    // The live connection still moves bytes, and the endpoint still dials.
    let (src, dst) = (source(&a, 300 * KIB, 5), b.alloc_host(300 * KIB).unwrap());
    send_verified(&ab, &ba, &src, &dst, 300 * KIB, 5);
    let (on_b, on_a) = connect(&b, &a);
    let (src, dst) = (source(&a, 100 * KIB, 6), b.alloc_host(100 * KIB).unwrap());
    send_verified(&on_a, &on_b, &src, &dst, 100 * KIB, 6);
}
