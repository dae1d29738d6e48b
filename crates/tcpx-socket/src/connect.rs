//! Non-blocking `connect`, with its progress kept in a process-wide registry.
//!
//! Callers re-pass the same handle buffer on every retry (TCPX's contract), so the handle
//! stores a *registry key*, never a pointer: a garbage handle can at worst name a key that does
//! not exist, which is an error, not a wild dereference. The entry is taken out of the registry
//! while a call works on it (so one slow connect never holds the lock during syscalls) and put
//! back if not finished. Entries that nobody retries for [`CONNECT_IDLE_LIMIT`] are dropped by
//! the next connect call, closing their sockets, so an abandoned connect leaks nothing forever.

use std::collections::HashMap;
use std::io::IoSlice;
use std::net::TcpStream;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use tcpx_sys::{ResultCode, HANDLE_SIZE};

use crate::handle::{self, ListenInfo};
use crate::log::{log_info, log_warn};
use crate::send::SendComm;
use crate::sock::{self, Io};
use crate::wire::{Hello, HELLO_LEN};

/// A pending connect nobody retried for this long is dropped.
pub(crate) const CONNECT_IDLE_LIMIT: Duration = Duration::from_secs(60);

struct ConnSock {
    stream: TcpStream,
    connected: bool,
    hello: [u8; HELLO_LEN],
    sent: usize,
}

struct Pending {
    info: ListenInfo,
    conn_id: u64,
    socks: Vec<ConnSock>,
    touched: Instant,
}

fn registry() -> &'static Mutex<HashMap<u64, Pending>> {
    static REGISTRY: OnceLock<Mutex<HashMap<u64, Pending>>> = OnceLock::new();
    REGISTRY.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Locks the registry; a panic elsewhere while it was held cannot leave it inconsistent (every
/// critical section is a single map operation), so poisoning is ignored.
fn lock() -> std::sync::MutexGuard<'static, HashMap<u64, Pending>> {
    registry()
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Number of connects in progress (for tests and diagnostics).
pub(crate) fn pending_count() -> usize {
    lock().len()
}

/// One non-blocking connect step on `handle`: `Ok(Some(comm))` once every data socket is
/// connected and has sent its hello, `Ok(None)` while in progress.
pub(crate) fn step(handle: &mut [u8; HANDLE_SIZE]) -> Result<Option<Box<SendComm>>, ResultCode> {
    let info = ListenInfo::decode(handle).map_err(|e| {
        log_warn!("tcpx-socket: connect: invalid handle: {e}");
        ResultCode::INVALID_ARGUMENT
    })?;
    let id = handle::state_id(handle);
    sweep(&mut lock());
    let mut pending = if id == 0 {
        let p = start(info)?;
        log_info!(
            "tcpx-socket: connecting to {} with {} socket(s), connection {:#x}",
            info.addr,
            info.nsocks,
            p.conn_id
        );
        p
    } else {
        let mut reg = lock();
        let Some(p) = reg.remove(&id) else {
            drop(reg);
            handle::set_state_id(handle, 0);
            log_warn!(
                "tcpx-socket: connect: the handle names connect state {id:#x}, which does not \
                 exist (abandoned for more than {CONNECT_IDLE_LIMIT:?}, or a corrupted handle)"
            );
            return Err(ResultCode::INVALID_ARGUMENT);
        };
        p
    };
    if pending.info != info {
        handle::set_state_id(handle, 0);
        log_warn!(
            "tcpx-socket: connect: the handle was changed between retries (now {}, the connect \
             in progress targets {}); abandoning that connect",
            info.addr,
            pending.info.addr
        );
        return Err(ResultCode::INVALID_ARGUMENT);
    }
    match advance(&mut pending) {
        Err(code) => {
            handle::set_state_id(handle, 0);
            Err(code)
        }
        Ok(true) => {
            handle::set_state_id(handle, 0);
            let name = format!(
                "send comm {:#x} to {} ({} socket(s))",
                pending.conn_id, info.addr, info.nsocks
            );
            let socks = pending.socks.into_iter().map(|s| s.stream).collect();
            log_info!("tcpx-socket: connected: {name}");
            Ok(Some(SendComm::new(socks, name)))
        }
        Ok(false) => {
            pending.touched = Instant::now();
            let mut reg = lock();
            let mut key = id;
            while key == 0 || reg.contains_key(&key) {
                key = sock::random_u64();
            }
            reg.insert(key, pending);
            drop(reg);
            handle::set_state_id(handle, key);
            Ok(None)
        }
    }
}

fn start(info: ListenInfo) -> Result<Pending, ResultCode> {
    let conn_id = sock::random_u64();
    let mut socks = Vec::with_capacity(usize::from(info.nsocks));
    for index in 0..info.nsocks {
        let stream = sock::start_connect(info.addr).map_err(|e| {
            log_warn!(
                "tcpx-socket: connect to {}: cannot open data socket {index}: {e}",
                info.addr
            );
            ResultCode::SYSTEM_ERROR
        })?;
        let hello = Hello {
            nsocks: info.nsocks,
            index,
            nonce: info.nonce,
            conn_id,
        }
        .encode();
        socks.push(ConnSock {
            stream,
            connected: false,
            hello,
            sent: 0,
        });
    }
    Ok(Pending {
        info,
        conn_id,
        socks,
        touched: Instant::now(),
    })
}

/// Moves every socket as far as it goes without blocking; true when all are ready.
fn advance(p: &mut Pending) -> Result<bool, ResultCode> {
    let mut all = true;
    for (i, s) in p.socks.iter_mut().enumerate() {
        if !s.connected {
            match sock::connect_finished(&s.stream) {
                Ok(true) => s.connected = true,
                Ok(false) => {
                    all = false;
                    continue;
                }
                Err(e) => {
                    log_warn!(
                        "tcpx-socket: connect to {} failed on data socket {i}: {e}",
                        p.info.addr
                    );
                    return Err(ResultCode::REMOTE_ERROR);
                }
            }
        }
        if s.sent < HELLO_LEN {
            match sock::send_vectored(&s.stream, &[IoSlice::new(&s.hello[s.sent..])]) {
                Ok(Io::Moved(n)) => s.sent += n,
                Ok(Io::WouldBlock | Io::Eof) => {}
                Err(e) => {
                    log_warn!(
                        "tcpx-socket: connect to {}: sending the hello on data socket {i} \
                         failed: {e}",
                        p.info.addr
                    );
                    return Err(ResultCode::REMOTE_ERROR);
                }
            }
            if s.sent < HELLO_LEN {
                all = false;
            }
        }
    }
    Ok(all)
}

/// Drops entries nobody retried within the idle limit (closing their sockets).
fn sweep(reg: &mut HashMap<u64, Pending>) {
    let now = Instant::now();
    reg.retain(|id, p| {
        let keep = now.duration_since(p.touched) < CONNECT_IDLE_LIMIT;
        if !keep {
            log_warn!(
                "tcpx-socket: dropping connect {id:#x} to {}: not retried for {CONNECT_IDLE_LIMIT:?}",
                p.info.addr
            );
        }
        keep
    });
}
