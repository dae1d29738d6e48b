//! Loopback throughput of the plugin (one comm, one sender and one receiver thread, 16 requests
//! in flight) against one raw blocking TCP stream, measured side by side in the same run.
//!
//! ```text
//! cargo run --release -p tcpx-socket --example socket_throughput -- [MSG_MIB] [TOTAL_MIB] [REPS]
//! ```
//! Sockets per comm come from `TCPX_SOCKET_NSOCKS` (default 1). Traffic stays on 127.0.0.1.
//! GB/s are 10^9 bytes per second; the figure printed is the median of REPS runs.

use std::ffi::c_void;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::ptr::null_mut;
use std::time::{Duration, Instant};

use tcpx_sys::{NetPlugin, ResultCode, HANDLE_SIZE, NCCL_PTR_HOST};

struct Comm(*mut c_void);
// SAFETY: a comm is used by one thread at a time, which is all the plugin requires.
unsafe impl Send for Comm {}

fn check(r: Result<ResultCode, tcpx_sys::AbiError>, what: &str) {
    match r {
        Ok(ResultCode::SUCCESS) => {}
        other => panic!("{what}: {other:?}"),
    }
}

fn pair(p: &NetPlugin) -> (Comm, Comm, Comm) {
    let mut handle = [0u8; HANDLE_SIZE];
    let mut listen = null_mut();
    // SAFETY: valid handle buffer and out pointer.
    check(
        unsafe { p.listen(0, handle.as_mut_ptr().cast(), &mut listen) },
        "listen",
    );
    let (mut send, mut recv): (*mut c_void, *mut c_void) = (null_mut(), null_mut());
    let start = Instant::now();
    while send.is_null() || recv.is_null() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "connect timed out"
        );
        if send.is_null() {
            // SAFETY: same handle buffer on every retry.
            check(
                unsafe { p.connect(0, handle.as_mut_ptr().cast(), &mut send, null_mut()) },
                "connect",
            );
        }
        if recv.is_null() {
            // SAFETY: live listen comm.
            check(unsafe { p.accept(listen, &mut recv, null_mut()) }, "accept");
        }
    }
    (Comm(listen), Comm(send), Comm(recv))
}

/// Drives one side: keeps 16 requests posted, tests the oldest, until `count` completed.
fn drive(p: &NetPlugin, comm: Comm, sending: bool, msg: usize, count: usize) -> Comm {
    let mut buf = vec![0x5au8; msg];
    let mut mh = null_mut();
    // SAFETY: the buffer outlives the registration.
    check(
        unsafe { p.reg_mr(comm.0, buf.as_mut_ptr().cast(), msg, NCCL_PTR_HOST, &mut mh) },
        "regMr",
    );
    let mut window = std::collections::VecDeque::new();
    let (mut posted, mut done) = (0, 0);
    let deadline = Instant::now() + Duration::from_secs(300);
    while done < count {
        assert!(Instant::now() < deadline, "transfer timed out");
        while posted < count && window.len() < 16 {
            let mut req = null_mut();
            // SAFETY: registered buffer, valid until the request completes (benchmark: every
            // request reuses the same bytes).
            let rc = unsafe {
                if sending {
                    p.isend(comm.0, buf.as_mut_ptr().cast(), msg as i32, 0, mh, &mut req)
                } else {
                    let mut data = [buf.as_mut_ptr().cast::<c_void>()];
                    let mut sizes = [msg as i32];
                    let mut mhs = [mh];
                    p.irecv(
                        comm.0,
                        1,
                        data.as_mut_ptr(),
                        sizes.as_mut_ptr(),
                        null_mut(),
                        mhs.as_mut_ptr(),
                        &mut req,
                    )
                }
            };
            check(rc, "post");
            if req.is_null() {
                break;
            }
            window.push_back(req);
            posted += 1;
        }
        if let Some(&req) = window.front() {
            let mut d = 0;
            // SAFETY: the oldest live request of this comm.
            check(unsafe { p.test(req, &mut d, null_mut()) }, "test");
            if d == 1 {
                window.pop_front();
                done += 1;
            }
        }
    }
    // SAFETY: live registration.
    check(unsafe { p.dereg_mr(comm.0, mh) }, "deregMr");
    comm
}

fn plugin_run(p: &'static NetPlugin, msg: usize, count: usize) -> f64 {
    let (listen, send, recv) = pair(p);
    let start = Instant::now();
    let rx = std::thread::spawn(move || drive(p, recv, false, msg, count));
    let tx = std::thread::spawn(move || drive(p, send, true, msg, count));
    let send = tx.join().unwrap();
    let recv = rx.join().unwrap();
    let secs = start.elapsed().as_secs_f64();
    // SAFETY: live comms, closed once.
    unsafe {
        check(p.close_send(send.0), "closeSend");
        check(p.close_recv(recv.0), "closeRecv");
        check(p.close_listen(listen.0), "closeListen");
    }
    (msg * count) as f64 / secs / 1e9
}

fn raw_run(msg: usize, count: usize) -> f64 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let start = Instant::now();
    let tx = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_nodelay(true).unwrap();
        let buf = vec![0x5au8; msg];
        for _ in 0..count {
            s.write_all(&buf).unwrap();
        }
    });
    let (mut r, _) = l.accept().unwrap();
    let mut buf = vec![0u8; msg];
    for _ in 0..count {
        r.read_exact(&mut buf).unwrap();
    }
    tx.join().unwrap();
    (msg * count) as f64 / start.elapsed().as_secs_f64() / 1e9
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    // House rule: benchmarks stay on loopback.
    std::env::set_var("TCPX_SOCKET_IFNAME", "lo");
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("numbers"))
        .collect();
    let msg = args.first().copied().unwrap_or(64) << 20;
    let total = args.get(1).copied().unwrap_or(4096) << 20;
    let reps = args.get(2).copied().unwrap_or(5);
    let count = (total / msg).max(1);
    // SAFETY: the crate's own table.
    let p: &'static NetPlugin = Box::leak(Box::new(
        unsafe { NetPlugin::from_static_v8(tcpx_socket::table_v8()) }.unwrap(),
    ));
    // SAFETY: NULL logger: warnings go to stderr.
    check(unsafe { p.init(None) }, "init");
    let (mut plug, mut raw) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        raw.push(raw_run(msg, count));
        plug.push(plugin_run(p, msg, count));
    }
    let (pm, rm) = (median(plug.clone()), median(raw.clone()));
    println!(
        "msg {} MiB x {count}, {reps} reps: plugin {pm:.2} GB/s (runs {plug:.2?}), raw TCP {rm:.2} GB/s (runs {raw:.2?}), ratio {:.3}",
        msg >> 20,
        pm / rm
    );
}
