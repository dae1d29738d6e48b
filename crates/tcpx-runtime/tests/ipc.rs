//! Same-host endpoints through the `ipc` module.
//!
//! Without a GPU (CI): the rendezvous in one and in two processes, strangers on the socket,
//! descriptors refused for the right reason (another endpoint's, an unknown key, a range
//! outside), a departed peer noticed, all before any CUDA call.
//!
//! With a GPU (the device machine; skipped with a message otherwise): a child process owns a
//! CUDA region and advertises it; the parent writes and reads it through CUDA IPC, contiguous
//! and vectored, verified byte for byte by the side that did not move them; the mapping is
//! opened once for many operations; a revoked or altered descriptor and an out-of-range one
//! are refused; a child killed while writes stream in fails them within the timeout.
//! `TCPX_IPC_TEST_GPUS=a,b` puts the parent on GPU a and the child on GPU b (default 0,0).
//!
//! The child is this test binary itself, run with `TCPX_IPC_CHILD=<role>` on the ignored
//! `child` test; it talks to the parent over its stdin / stdout, one line per step.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::linux::net::SocketAddrExt;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use tcpx::cuda::CudaDevice;
use tcpx_runtime::ipc::{IpcDescriptor, IpcSegment, LocalAddr, LocalInfo, LocalRoute};
use tcpx_runtime::{Endpoint, Error, LocalConnection, LocalErrorKind, Region};

const MIB: usize = 1 << 20;
const ROLE_VAR: &str = "TCPX_IPC_CHILD";
const GPUS_VAR: &str = "TCPX_IPC_TEST_GPUS";
/// The child's advertised region.
const TARGET_LEN: usize = 32 * MIB;

fn endpoint() -> Endpoint {
    loopback();
    Endpoint::new(config(1, 1 << 20)).expect("endpoint")
}

/// An endpoint whose GPU is `gpu` (host memory it moves is copied by that GPU).
fn endpoint_on(gpu: usize) -> Endpoint {
    loopback();
    let mut cfg = config(1, 1 << 20);
    cfg.gpu_index = Some(gpu as u32);
    Endpoint::new(cfg).expect("endpoint")
}

/// The tests of this file one at a time: they count fds and threads, and the GPU ones
/// share the device (a fault in one would poison the others' contexts).
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// `a` accepts locally while `b` connects to it: (a's connection, b's connection).
fn local_pair(a: &Endpoint, b: &Endpoint) -> (LocalConnection, LocalConnection) {
    std::thread::scope(|s| {
        let accepted = s.spawn(|| a.accept_local_timeout(DEADLINE));
        let ba = b.connect_local(&a.local_addr()).expect("connect_local");
        let ab = accepted
            .join()
            .expect("accept thread")
            .expect("accept_local");
        (ab, ba)
    })
}

/// A descriptor of `owner` with a key it never issued.
fn forged(owner: &Endpoint, key: u64) -> IpcDescriptor {
    let info = owner.local_info();
    let mut bytes = [0u8; IpcDescriptor::BYTES];
    bytes[0..4].copy_from_slice(b"TXIP");
    bytes[4] = 1;
    bytes[8..72].fill(0x42);
    bytes[72..80].copy_from_slice(&info.instance.to_le_bytes());
    bytes[80..84].copy_from_slice(&info.pid.to_le_bytes());
    bytes[96..104].copy_from_slice(&(8 * MIB as u64).to_le_bytes());
    bytes[112..120].copy_from_slice(&(MIB as u64).to_le_bytes());
    bytes[120..128].copy_from_slice(&key.to_le_bytes());
    IpcDescriptor::from_bytes(&bytes).expect("a well-formed descriptor")
}

fn kind(e: &Error) -> Option<LocalErrorKind> {
    e.local_kind()
}

/// Bindings share connections and transfers between threads.
#[test]
fn handles_are_send_and_sync() {
    fn both<T: Send + Sync>() {}
    both::<LocalConnection>();
    both::<IpcDescriptor>();
    both::<tcpx_runtime::Transfer>();
}

#[test]
fn rendezvous_in_one_process_and_the_route_it_implies() {
    let _serial = serial();
    let a = endpoint();
    let b = endpoint();
    let (ab, ba) = local_pair(&a, &b);
    let (ia, ib) = (a.local_info(), b.local_info());
    assert_eq!(ba.peer().instance, ia.instance);
    assert_eq!(ab.peer().instance, ib.instance);
    assert_eq!(ba.peer().pid, std::process::id());
    assert!(ab.error().is_none() && ba.error().is_none());
    // The info blob survives the trip out of band and names the same host.
    let back = LocalInfo::from_bytes(&ia.to_bytes().unwrap()).unwrap();
    assert_eq!(back, ia);
    assert!(ia.same_host(&ib));
    match a.local_route(&ib) {
        LocalRoute::Ipc => assert!(tcpx::cuda::driver_available()),
        LocalRoute::Network(why) => {
            assert!(!tcpx::cuda::driver_available(), "network route: {why}");
            assert!(why.contains("CUDA"), "{why}");
        }
    }
    assert!(matches!(a.local_route(&ia), LocalRoute::Network(_)));
    let mut elsewhere = ib.clone();
    elsewhere.boot_id = [0xee; 16];
    match a.local_route(&elsewhere) {
        LocalRoute::Network(why) => assert!(why.contains("another host"), "{why}"),
        LocalRoute::Ipc => panic!("another boot id is another host"),
    }
    // The address derived from the metadata alone is the endpoint's own.
    assert_eq!(Endpoint::local_addr_of(a.metadata()), a.local_addr());
}

#[test]
fn strangers_on_the_socket_are_turned_away_and_a_peer_still_gets_in() {
    let _serial = serial();
    let a = endpoint();
    let b = endpoint();
    let name = a.local_info().name;
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    // Garbage, then an early close.
    let mut garbage = std::os::unix::net::UnixStream::connect_addr(&addr).unwrap();
    garbage.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    let early = std::os::unix::net::UnixStream::connect_addr(&addr).unwrap();
    drop(early);
    let (ab, ba) = local_pair(&a, &b);
    assert_eq!(ba.peer().instance, a.local_info().instance);
    drop((ab, ba));
    // Nobody there at all: a bounded wait that names the socket.
    let e = a
        .accept_local_timeout(Duration::from_millis(200))
        .unwrap_err();
    assert_eq!(kind(&e), Some(LocalErrorKind::Timeout), "{e}");
    let gone = LocalAddr::Name("tcpx-ipc/nobody/here".into());
    let start = Instant::now();
    let cfg = tcpx_runtime::Config::builder()
        .backend(tcpx_runtime::Backend::Builtin)
        .control_addr("127.0.0.1:0".parse().unwrap())
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let quick = Endpoint::new(cfg).unwrap();
    let e = quick.connect_local(&gone).unwrap_err();
    assert_eq!(kind(&e), Some(LocalErrorKind::Rendezvous), "{e}");
    assert!(start.elapsed() < DEADLINE);
    assert!(matches!(
        quick.connect_local(&LocalAddr::Gpu("not a bus id".into())),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn descriptors_are_refused_for_the_right_reason_before_any_copy() {
    let _serial = serial();
    let a = endpoint();
    let b = endpoint();
    let (_ab, ba) = local_pair(&a, &b);
    let local = b.alloc_host(2 * MIB).unwrap();

    // A key `a` never issued: `a` refuses it, named as an access refusal.
    let unknown = forged(&a, 0x1234);
    let e = ba.write_ipc(&local, 0, &unknown, 0, 4096).unwrap_err();
    assert_eq!(kind(&e), Some(LocalErrorKind::Access), "{e}");
    assert!(e.to_string().contains("unknown key"), "{e}");
    let e = ba.read_ipc(&local, 0, &unknown, 0, 4096).unwrap_err();
    assert_eq!(kind(&e), Some(LocalErrorKind::Access), "{e}");
    // Preparing it ahead is refused the same way, before any CUDA call.
    let e = ba.prepare_ipc(&unknown, None).unwrap_err();
    assert_eq!(kind(&e), Some(LocalErrorKind::Access), "{e}");
    assert!(e.to_string().contains("unknown key"), "{e}");

    // A descriptor of another endpoint (b's own) on the connection to a.
    let foreign = forged(&b, 1);
    let e = ba.write_ipc(&local, 0, &foreign, 0, 4096).unwrap_err();
    assert_eq!(kind(&e), Some(LocalErrorKind::Access), "{e}");
    assert!(e.to_string().contains("belongs to endpoint"), "{e}");
    let e = ba.prepare_ipc(&foreign, Some(0)).unwrap_err();
    assert!(e.to_string().contains("belongs to endpoint"), "{e}");

    // Out of range, on either side, and an empty list.
    let e = ba
        .write_ipc(&local, 0, &unknown, MIB as u64 - 10, 4096)
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    let e = ba
        .write_ipc(&local, 2 * MIB - 10, &unknown, 0, 4096)
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    let e = ba
        .write_ipc(&local, 0, &unknown, u64::MAX - 1, 4096)
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert!(matches!(ba.writev_ipc(&[]), Err(Error::InvalidArgument(_))));
    // Raw pointers: a null one.
    // SAFETY: the pointer is null: refused before anything reads it.
    let e = unsafe { ba.write_ipc_ptr(std::ptr::null(), 16, &unknown, 0) }.unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");

    // Bad bytes never become a descriptor.
    for bad in [&[][..], &[0u8; 26][..], &unknown.to_bytes()[..127]] {
        assert!(IpcDescriptor::from_bytes(bad).is_err());
    }
    // Nothing was mapped, the connection is still fine, and host memory cannot be advertised.
    assert_eq!(ba.mapped_allocations(), 0);
    assert!(ba.error().is_none());
    assert!(matches!(
        a.advertise_ipc(&a.alloc_host(4096).unwrap()),
        Err(Error::InvalidArgument(_))
    ));
    assert!(!a.revoke_ipc(&unknown).unwrap());
}

#[test]
fn a_departed_peer_is_noticed_and_fails_operations() {
    let _serial = serial();
    let a = endpoint();
    let b = endpoint();
    let (ab, ba) = local_pair(&a, &b);
    let unknown = forged(&a, 7);
    drop(ab);
    // The goodbye arrived before `drop` returned.
    let e = ba.error().expect("the peer said goodbye");
    assert_eq!(kind(&e), Some(LocalErrorKind::PeerClosed), "{e}");
    let local = b.alloc_host(4096).unwrap();
    let e = ba.write_ipc(&local, 0, &unknown, 0, 16).unwrap_err();
    assert_eq!(kind(&e), Some(LocalErrorKind::PeerClosed), "{e}");
    // And a new connection to the same endpoint works.
    let (_ab, ba2) = local_pair(&a, &b);
    assert!(ba2.error().is_none());
}

#[test]
fn fds_and_threads_are_released() {
    let _serial = serial();
    let a = endpoint();
    let b = endpoint();
    let _ = local_pair(&a, &b);
    let (fds, threads) = (open_fds(), settled(runtime_threads));
    for _ in 0..20 {
        let pair = local_pair(&a, &b);
        drop(pair);
    }
    assert!(
        eventually(DEADLINE, || open_fds() <= fds
            && runtime_threads() <= threads),
        "fds {fds} -> {}, runtime threads {threads} -> {} (threads: {:?})",
        open_fds(),
        runtime_threads(),
        thread_names()
    );
}

// ---------------------------------------------------------------------------------------
// Two processes.

/// The child process and its line protocol.
struct Peer {
    child: Option<Child>,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Peer {
    fn spawn(role: &str) -> Self {
        let exe = std::env::current_exe().expect("test binary path");
        let mut child = Command::new(exe)
            .args([
                "--exact",
                "child",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ROLE_VAR, role)
            .env("TCPX_SOCKET_IFNAME", "lo")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the child process");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = BufReader::new(child.stdout.take().expect("stdout"));
        Self {
            child: Some(child),
            stdin,
            stdout,
        }
    }

    /// What follows `tag ` on the next line holding it (other output is skipped; the test
    /// harness may have started the line with its `test child ... `).
    fn expect(&mut self, tag: &str) -> String {
        let needle = format!("{tag} ");
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.stdout.read_line(&mut line).expect("child stdout");
            assert!(n > 0, "the child exited before saying {tag}");
            if let Some(at) = line.find(&needle) {
                return line[at + needle.len()..].trim_end().to_owned();
            }
        }
    }

    fn say(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").expect("write to the child");
        self.stdin.flush().expect("flush");
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().expect("child").id()
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn finish(mut self) {
        self.say("EXIT");
        let mut c = self.child.take().expect("child");
        let deadline = Instant::now() + DEADLINE;
        loop {
            if let Some(status) = c.try_wait().expect("try_wait") {
                assert!(status.success(), "child failed: {status}");
                return;
            }
            assert!(Instant::now() < deadline, "the child did not exit");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.kill();
    }
}

#[test]
fn rendezvous_between_two_processes_and_a_killed_peer() {
    let _serial = serial();
    let ep = endpoint();
    let mut peer = Peer::spawn("listener");
    let name = peer.expect("ADDR");
    let conn = ep
        .connect_local(&LocalAddr::Name(name))
        .expect("connect to the child");
    assert_eq!(conn.peer().pid, peer.pid());
    peer.expect("ACCEPTED");
    peer.kill();
    assert!(
        eventually(DEADLINE, || conn.error().is_some()),
        "the killed child was not noticed"
    );
    let e = conn.error().unwrap();
    assert_eq!(kind(&e), Some(LocalErrorKind::PeerClosed), "{e}");
}

/// The GPUs of parent and child, or `None` (with the reason printed) without CUDA.
fn gpus() -> Option<(usize, usize)> {
    if let Some(why) = tcpx::cuda::skip_reason() {
        println!("{why}");
        return None;
    }
    let (a, b) = match std::env::var(GPUS_VAR) {
        Ok(v) => {
            let mut it = v
                .split(',')
                .map(|s| s.trim().parse::<usize>().expect(GPUS_VAR));
            (it.next().unwrap_or(0), it.next().unwrap_or(0))
        }
        Err(_) => (0, 0),
    };
    let n = CudaDevice::count();
    if a >= n || b >= n {
        println!("skipped: {GPUS_VAR} asks for GPUs {a},{b}, {n} present");
        return None;
    }
    Some((a, b))
}

/// The parent's side of a GPU test: its endpoint on GPU `mine`, the child owning a region on
/// its GPU, a local connection and the child's descriptor.
fn gpu_parent(role: &str) -> Option<(Endpoint, Peer, LocalConnection, IpcDescriptor, CudaDevice)> {
    let (mine, theirs) = gpus()?;
    let ep = endpoint_on(mine);
    let device = CudaDevice::new(mine).expect("parent GPU");
    let mut peer = Peer::spawn(role);
    peer.say(&theirs.to_string());
    let name = peer.expect("ADDR");
    let desc = IpcDescriptor::from_bytes(&hex_decode(&peer.expect("DESC"))).expect("descriptor");
    let conn = ep.connect_local(&LocalAddr::Name(name)).expect("connect");
    peer.expect("ACCEPTED");
    Some((ep, peer, conn, desc, device))
}

fn cuda_source(ep: &Endpoint, device: &CudaDevice, len: usize, seed: u64) -> Region {
    let r = ep.alloc_cuda_on(device, len).expect("CUDA region");
    let mut bytes = vec![0u8; len];
    fill(&mut bytes, seed);
    r.write(0, &bytes).expect("fill");
    r
}

#[test]
fn gpu_write_and_read_between_two_processes_verified() {
    let _serial = serial();
    let Some((ep, mut peer, conn, desc, device)) = gpu_parent("target") else {
        return;
    };
    // Prepared ahead: confirmed and mapped before the first transfer.
    conn.prepare_ipc(&desc, Some(device.ordinal())).unwrap();
    assert_eq!(conn.mapped_allocations(), 1);
    assert_eq!(conn.confirmed_descriptors(), 1);
    // Write: 8 MiB at offset 1 MiB + 4 KiB, then the child checks.
    let len = 8 * MIB;
    let src = cuda_source(&ep, &device, len, 11);
    let t = conn
        .write_ipc(&src, 0, &desc, (MIB + 4096) as u64, len)
        .unwrap();
    assert_eq!(t.wait(DEADLINE).unwrap(), len as u64);
    peer.say(&format!("CHECK {} {len} 11", MIB + 4096));
    assert_eq!(peer.expect("CHECKED"), "OK");

    // Read what the child wrote at 16 MiB.
    peer.say(&format!("FILL {} {len} 23", 16 * MIB));
    assert_eq!(peer.expect("FILLED"), "OK");
    let dst = ep.alloc_cuda_on(&device, len).unwrap();
    let t = conn
        .read_ipc(&dst, 0, &desc, (16 * MIB) as u64, len)
        .unwrap();
    assert_eq!(t.wait(DEADLINE).unwrap(), len as u64);
    if let Err(at) = check(&snapshot(&dst), 23) {
        panic!("read_ipc: data differs at byte {at}");
    }

    // Host memory on this side: the endpoint's GPU copies it.
    let host = source(&ep, 4096 + 17, 31);
    conn.write_ipc(&host, 0, &desc, 3, 4096 + 17)
        .unwrap()
        .wait(DEADLINE)
        .unwrap();
    peer.say("CHECK 3 4113 31");
    assert_eq!(peer.expect("CHECKED"), "OK");

    // One mapping and one confirmation for all of it, however many operations.
    for _ in 0..100 {
        conn.write_ipc(&src, 0, &desc, 0, 4096)
            .unwrap()
            .wait(DEADLINE)
            .unwrap();
    }
    assert_eq!(conn.mapped_allocations(), 1);
    assert_eq!(conn.confirmed_descriptors(), 1);
    assert!(conn.error().is_none());
    peer.finish();
}

#[test]
fn gpu_vectored_write_and_read_verified() {
    let _serial = serial();
    let Some((ep, mut peer, conn, desc, device)) = gpu_parent("target") else {
        return;
    };
    let mut rng = Rng(5);
    let total = 6 * MIB + 333;
    let layout = random_layout(&mut rng, total, TARGET_LEN / 2, 2 * MIB);
    let src = cuda_source(&ep, &device, total, 41);
    let mut segs = Vec::new();
    let mut at = 0usize;
    for &(off, len) in &layout {
        segs.push(IpcSegment::new(&src, at, &desc, off as u64, len));
        at += len;
    }
    let t = conn.writev_ipc(&segs).unwrap();
    assert_eq!(t.wait(DEADLINE).unwrap(), total as u64);
    // The child checks each block against the pattern's slice at its place in the source.
    let mut at = 0usize;
    for &(off, len) in &layout {
        peer.say(&format!("CHECKSLICE {off} {len} 41 {at}"));
        assert_eq!(peer.expect("CHECKED"), "OK", "block at {off}");
        at += len;
    }
    // And back: the same blocks read into a zeroed region land where they came from.
    let dst = ep.alloc_cuda_on(&device, total).unwrap();
    let mut segs = Vec::new();
    let mut at = 0usize;
    for &(off, len) in &layout {
        segs.push(IpcSegment::new(&dst, at, &desc, off as u64, len));
        at += len;
    }
    let t = conn.readv_ipc(&segs).unwrap();
    assert_eq!(t.wait(DEADLINE).unwrap(), total as u64);
    if let Err(at) = check(&snapshot(&dst), 41) {
        panic!("readv_ipc: data differs at byte {at}");
    }
    peer.finish();
}

#[test]
fn gpu_refusals_revocation_and_a_peer_killed_mid_stream() {
    let _serial = serial();
    let Some((ep, mut peer, conn, desc, device)) = gpu_parent("target") else {
        return;
    };
    let src = cuda_source(&ep, &device, 64 * MIB, 3);
    // Out of range.
    let e = conn
        .write_ipc(&src, 0, &desc, (TARGET_LEN - 100) as u64, 4096)
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    // Altered: another key with the same handle.
    let mut bytes = desc.to_bytes();
    bytes[120] ^= 0xff;
    let altered = IpcDescriptor::from_bytes(&bytes).unwrap();
    let e = conn.write_ipc(&src, 0, &altered, 0, 4096).unwrap_err();
    assert_eq!(kind(&e), Some(LocalErrorKind::Access), "{e}");
    // Altered: a range the owner never advertised.
    let mut bytes = desc.to_bytes();
    bytes[112..120].copy_from_slice(&(desc.len() - 4096).to_le_bytes());
    let shrunk = IpcDescriptor::from_bytes(&bytes).unwrap();
    let e = conn.write_ipc(&src, 0, &shrunk, 0, 4096).unwrap_err();
    assert_eq!(kind(&e), Some(LocalErrorKind::Access), "{e}");

    // Works, then the owner revokes: refused afterwards, the mapping closed.
    conn.write_ipc(&src, 0, &desc, 0, 4096)
        .unwrap()
        .wait(DEADLINE)
        .unwrap();
    assert_eq!(conn.mapped_allocations(), 1);
    peer.say("REVOKE");
    assert_eq!(peer.expect("REVOKED"), "true");
    assert_eq!(conn.mapped_allocations(), 0);
    let e = conn.write_ipc(&src, 0, &desc, 0, 4096).unwrap_err();
    assert_eq!(kind(&e), Some(LocalErrorKind::Access), "{e}");
    assert!(e.to_string().contains("revoked"), "{e}");

    // A fresh descriptor; writes stream while the child is killed: one fails, none hangs.
    peer.say("ADVERTISE");
    let fresh = IpcDescriptor::from_bytes(&hex_decode(&peer.expect("DESC"))).unwrap();
    let timeout = ep.config().timeout;
    let killer = {
        let pid = peer.pid();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            // SAFETY: kill(2) has no memory preconditions; the pid is this test's child,
            // still unreaped (the parent reaps it only in `peer.kill()` below).
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        })
    };
    let mut failed = None;
    let start = Instant::now();
    while failed.is_none() && start.elapsed() < DEADLINE {
        match conn.write_ipc(&src, 0, &fresh, 0, 16 * MIB) {
            Ok(t) => {
                if let Err(e) = t.wait(timeout + Duration::from_secs(5)) {
                    failed = Some(e);
                }
            }
            Err(e) => failed = Some(e),
        }
    }
    killer.join().unwrap();
    let e = failed.expect("writes to a killed peer kept succeeding");
    assert!(!matches!(e, Error::WaitTimedOut(_)), "a write hung: {e}");
    // Noticed as gone (the usual case), or the driver failing a copy into memory whose
    // owner died: either way an error naming the peer, within the timeout.
    assert!(
        matches!(
            kind(&e),
            Some(LocalErrorKind::PeerClosed | LocalErrorKind::Cuda)
        ),
        "{e}"
    );
    eprintln!(
        "write to the killed peer failed after {:?}: {e}",
        start.elapsed()
    );
    peer.kill();
}

fn hex_encode(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn hex_decode(text: &str) -> Vec<u8> {
    (0..text.len() / 2)
        .map(|i| u8::from_str_radix(&text[2 * i..2 * i + 2], 16).expect("hex"))
        .collect()
}

/// The child side; does nothing unless started by a parent test.
#[test]
#[ignore = "run by the two-process tests as their child"]
fn child() {
    let Ok(role) = std::env::var(ROLE_VAR) else {
        return;
    };
    let ep = endpoint();
    let mut stdin = std::io::stdin().lock();
    let mut line = String::new();
    let mut next = move || {
        line.clear();
        stdin.read_line(&mut line).expect("stdin");
        line.trim().to_owned()
    };
    match role.as_str() {
        "listener" => {
            println!("ADDR {}", ep.local_info().name);
            let conn = ep.accept_local_timeout(DEADLINE).expect("accept_local");
            println!("ACCEPTED {}", conn.peer().pid);
            // Until killed (or told to stop).
            let _ = next();
        }
        "target" => {
            let gpu: usize = next().parse().expect("GPU ordinal");
            let device = CudaDevice::new(gpu).expect("child GPU");
            let region = ep.alloc_cuda_on(&device, TARGET_LEN).expect("child region");
            let mut desc = ep.advertise_ipc(&region).expect("advertise_ipc");
            println!("ADDR {}", ep.local_info().name);
            println!("DESC {}", hex_encode(&desc.to_bytes()));
            let conn = ep.accept_local_timeout(DEADLINE).expect("accept_local");
            println!("ACCEPTED {}", conn.peer().pid);
            loop {
                let cmd = next();
                let words: Vec<&str> = cmd.split_whitespace().collect();
                let num = |i: usize| words[i].parse::<usize>().expect("number");
                match words.first().copied() {
                    Some("CHECK") => {
                        let (off, len, seed) = (num(1), num(2), num(3) as u64);
                        let bytes = snapshot(&region);
                        let ok = check(&bytes[off..off + len], seed).is_ok();
                        println!("CHECKED {}", if ok { "OK" } else { "BAD" });
                    }
                    Some("CHECKSLICE") => {
                        // Bytes [off, off+len) must be the pattern's bytes [at, at+len).
                        let (off, len, seed, at) = (num(1), num(2), num(3) as u64, num(4));
                        let mut want = vec![0u8; at + len];
                        fill(&mut want, seed);
                        let bytes = snapshot(&region);
                        let ok = bytes[off..off + len] == want[at..];
                        println!("CHECKED {}", if ok { "OK" } else { "BAD" });
                    }
                    Some("FILL") => {
                        let (off, len, seed) = (num(1), num(2), num(3) as u64);
                        let mut bytes = vec![0u8; len];
                        fill(&mut bytes, seed);
                        region.write(off, &bytes).expect("fill");
                        println!("FILLED OK");
                    }
                    Some("REVOKE") => {
                        println!("REVOKED {}", ep.revoke_ipc(&desc).expect("revoke_ipc"));
                    }
                    Some("ADVERTISE") => {
                        desc = ep.advertise_ipc(&region).expect("advertise_ipc");
                        println!("DESC {}", hex_encode(&desc.to_bytes()));
                    }
                    Some("EXIT") | None => break,
                    Some(other) => panic!("unknown command {other}"),
                }
            }
            drop(conn);
        }
        other => panic!("unknown role {other}"),
    }
}

/// A thread waiting for local peers (as the NIXL plugin's accept loop does; the wait goes in
/// 100 ms rounds, back to back) must not hold up the endpoint's other users: `local_route` (every NIXL
/// metadata load asks it) read the claimed GPU name under the lock the waiting thread held
/// for each whole round, and on a 16-core machine it waited from seconds to over a minute.
#[test]
fn asking_the_route_is_not_held_up_by_a_thread_waiting_for_local_peers() {
    let _serial = serial();
    loopback();
    let mut cfg = config(1, 1 << 20);
    // A GPU named by its bus id: accepting claims the GPU's rendezvous name as well, and
    // then waits on both names.
    cfg.gpu_pci = Some("0000:ab:00.0".into());
    let a = Endpoint::new(cfg).expect("endpoint");
    let b = endpoint();
    let peer = b.local_info();
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let e = a
                    .accept_local_timeout(Duration::from_millis(700))
                    .expect_err("nobody connects");
                assert_eq!(kind(&e), Some(LocalErrorKind::Timeout), "{e}");
            }
        });
        // Let the waiter claim the GPU name and start its rounds.
        std::thread::sleep(Duration::from_millis(150));
        // Asked at scattered moments of the waiter's rounds: held up by them, most answers
        // would wait for the rest of a round (up to 100 ms). Answered directly, each is a few
        // reads; two slow ones are tolerated (a busy CI machine).
        let mut slow = Vec::new();
        for _ in 0..30 {
            let started = Instant::now();
            let _ = a.local_route(&peer);
            assert!(a.local_info().gpu.is_some(), "the GPU name was claimed");
            let took = started.elapsed();
            if took > Duration::from_millis(40) {
                slow.push(took);
            }
            std::thread::sleep(Duration::from_millis(7));
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        assert!(
            slow.len() <= 2,
            "answers held up by the waiting thread: {slow:?}"
        );
    });
}
