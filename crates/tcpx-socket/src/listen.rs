//! Listen comms and `accept`: a non-blocking listener that collects the data sockets of
//! incoming connections, checks each socket's hello, and groups sockets by connection id.
//!
//! `accept` never blocks: it accepts what is pending, reads what hellos have arrived (partial
//! hellos are kept), and returns a receive comm once every socket of some connection is in, or
//! Success with a NULL comm. A socket whose hello is malformed, carries the wrong nonce, or ends
//! early is closed and logged, and that `accept` call returns ncclRemoteError; the listen comm
//! stays usable, so the next call can still accept genuine connections.

use std::collections::{HashMap, VecDeque};
use std::io::{self, IoSliceMut};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use tcpx_sys::ResultCode;

use crate::handle::ListenInfo;
use crate::log::{log_info, log_warn};
use crate::object::{DEAD_TAG, LISTEN_TAG};
use crate::sock::{self, Io};
use crate::wire::{Hello, HELLO_LEN};

/// How long a socket may take to deliver its hello, and a connection to open all its sockets,
/// before the listener gives up on it (a connector that died half-way must not hold sockets
/// forever).
pub(crate) const ACCEPT_STALL_LIMIT: Duration = Duration::from_secs(60);
/// Most connections accepted per `accept` call (bounds the work of one call).
const ACCEPTS_PER_CALL: usize = 64;
/// Most sockets awaiting their hello; beyond this, new connections are refused (closed) so a
/// flood of junk connections cannot exhaust file descriptors.
const MAX_PENDING: usize = 1024;

struct PendingSock {
    stream: TcpStream,
    peer: SocketAddr,
    buf: [u8; HELLO_LEN],
    have: usize,
    since: Instant,
}

struct Group {
    socks: Vec<Option<TcpStream>>,
    peer: SocketAddr,
    since: Instant,
}

/// A ready connection: data sockets in index order, and the connector's address.
pub(crate) struct Ready {
    /// Data sockets, index order.
    pub socks: Vec<TcpStream>,
    /// Connection id from the hellos.
    pub conn_id: u64,
    /// Address of the connector's socket 0.
    pub peer: SocketAddr,
}

/// A listen comm (the `listenComm` handed to callers).
#[repr(C)]
pub(crate) struct ListenComm {
    tag: u64,
    listener: TcpListener,
    info: ListenInfo,
    dev: i32,
    pending: Vec<PendingSock>,
    groups: HashMap<u64, Group>,
    ready: VecDeque<Ready>,
}

impl ListenComm {
    /// Binds a listener on `addr` (port 0) for device `dev`, expecting `nsocks` sockets per
    /// connection.
    pub(crate) fn bind(dev: i32, addr: SocketAddr, nsocks: u8) -> io::Result<Box<Self>> {
        let listener = sock::listen(addr)?;
        let local = listener.local_addr()?;
        let info = ListenInfo {
            addr: local,
            nsocks,
            nonce: sock::random_u64(),
        };
        log_info!("tcpx-socket: listening on {local} (device {dev}, {nsocks} socket(s) per comm)");
        Ok(Box::new(Self {
            tag: LISTEN_TAG,
            listener,
            info,
            dev,
            pending: Vec::new(),
            groups: HashMap::new(),
            ready: VecDeque::new(),
        }))
    }

    /// What goes into the handle.
    pub(crate) fn info(&self) -> ListenInfo {
        self.info
    }

    /// One non-blocking accept step: `Ok(Some)` when a connection is complete, `Ok(None)` when
    /// none is yet, `Err` (after logging) when a peer sent something that is not a valid
    /// tcpx-socket hello.
    pub(crate) fn accept_step(&mut self) -> Result<Option<Ready>, ResultCode> {
        let mut result = Ok(());
        self.accept_new();
        self.read_hellos(&mut result);
        self.expire();
        result?;
        Ok(self.ready.pop_front())
    }

    fn accept_new(&mut self) {
        for _ in 0..ACCEPTS_PER_CALL {
            match self.listener.accept() {
                Ok((stream, peer)) => {
                    if self.pending.len() >= MAX_PENDING {
                        log_warn!(
                            "tcpx-socket: listener {}: {MAX_PENDING} connections already await \
                             their hello; closing the one from {peer}",
                            self.info.addr
                        );
                        continue;
                    }
                    if let Err(e) = stream
                        .set_nonblocking(true)
                        .and_then(|()| stream.set_nodelay(true))
                    {
                        log_warn!(
                            "tcpx-socket: listener {}: cannot configure socket from {peer}: {e}",
                            self.info.addr
                        );
                        continue;
                    }
                    self.pending.push(PendingSock {
                        stream,
                        peer,
                        buf: [0; HELLO_LEN],
                        have: 0,
                        since: Instant::now(),
                    });
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // ECONNABORTED, EMFILE…: not fatal for the listener; report and retry later.
                    log_warn!(
                        "tcpx-socket: listener {}: accept failed: {e}",
                        self.info.addr
                    );
                    break;
                }
            }
        }
    }

    fn read_hellos(&mut self, result: &mut Result<(), ResultCode>) {
        let mut i = 0;
        while i < self.pending.len() {
            let p = &mut self.pending[i];
            let mut bufs = [IoSliceMut::new(&mut p.buf[p.have..])];
            let outcome = match sock::recv_vectored(&p.stream, &mut bufs) {
                Ok(Io::Moved(n)) => {
                    p.have += n;
                    match Hello::check_prefix(&p.buf[..p.have]) {
                        Err(e) => Err(format!("is not a tcpx-socket data socket ({e})")),
                        Ok(()) => Ok(p.have == HELLO_LEN),
                    }
                }
                Ok(Io::WouldBlock) => Ok(false),
                Ok(Io::Eof) => Err(format!(
                    "closed the connection after {} of {HELLO_LEN} hello bytes",
                    p.have
                )),
                Err(e) => Err(format!("read error before the hello completed: {e}")),
            };
            match outcome {
                Ok(false) => i += 1,
                Ok(true) => {
                    let p = self.pending.swap_remove(i);
                    if let Err(msg) = self.admit(p) {
                        *result = Err(ResultCode::REMOTE_ERROR);
                        log_warn!("tcpx-socket: listener {}: {msg}", self.info.addr);
                    }
                }
                Err(msg) => {
                    let p = self.pending.swap_remove(i);
                    *result = Err(ResultCode::REMOTE_ERROR);
                    log_warn!(
                        "tcpx-socket: listener {}: connection from {} {msg}; closed it",
                        self.info.addr,
                        p.peer
                    );
                }
            }
        }
    }

    /// Validates a complete hello and files the socket under its connection.
    fn admit(&mut self, p: PendingSock) -> Result<(), String> {
        let hello = Hello::decode(&p.buf).map_err(|e| {
            format!(
                "connection from {} is not a tcpx-socket data socket ({e}); closed it",
                p.peer
            )
        })?;
        if hello.nonce != self.info.nonce {
            return Err(format!(
                "connection from {} presents a nonce that is not this listener's (a stale or \
                 foreign handle); closed it",
                p.peer
            ));
        }
        if hello.nsocks != self.info.nsocks {
            return Err(format!(
                "connection from {} opens {} sockets, this listener expects {}; closed it",
                p.peer, hello.nsocks, self.info.nsocks
            ));
        }
        let nsocks = usize::from(hello.nsocks);
        let group = self.groups.entry(hello.conn_id).or_insert_with(|| Group {
            socks: (0..nsocks).map(|_| None).collect(),
            peer: p.peer,
            since: p.since,
        });
        let slot = &mut group.socks[usize::from(hello.index)];
        if slot.is_some() {
            return Err(format!(
                "connection {:#x} from {} sent socket {} twice; closed the duplicate",
                hello.conn_id, p.peer, hello.index
            ));
        }
        *slot = Some(p.stream);
        if hello.index == 0 {
            group.peer = p.peer;
        }
        if group.socks.iter().all(Option::is_some) {
            if let Some(g) = self.groups.remove(&hello.conn_id) {
                self.ready.push_back(Ready {
                    socks: g.socks.into_iter().flatten().collect(),
                    conn_id: hello.conn_id,
                    peer: g.peer,
                });
            }
        }
        Ok(())
    }

    fn expire(&mut self) {
        let now = Instant::now();
        let addr = self.info.addr;
        self.pending.retain(|p| {
            let keep = now.duration_since(p.since) < ACCEPT_STALL_LIMIT;
            if !keep {
                log_warn!(
                    "tcpx-socket: listener {addr}: connection from {} sent no complete hello in \
                     {ACCEPT_STALL_LIMIT:?}; closed it",
                    p.peer
                );
            }
            keep
        });
        self.groups.retain(|id, g| {
            let keep = now.duration_since(g.since) < ACCEPT_STALL_LIMIT;
            if !keep {
                let have = g.socks.iter().filter(|s| s.is_some()).count();
                log_warn!(
                    "tcpx-socket: listener {addr}: connection {id:#x} from {} opened only {have} \
                     of {} sockets in {ACCEPT_STALL_LIMIT:?}; dropped it",
                    g.peer,
                    g.socks.len()
                );
            }
            keep
        });
    }

    /// Device this listener belongs to.
    pub(crate) fn dev(&self) -> i32 {
        self.dev
    }
}

/// Frees a listen comm and closes every socket it still holds.
///
/// # Safety
/// `comm` came from `Box::into_raw` of a [`ListenComm`] and is not used afterwards.
pub(crate) unsafe fn destroy(comm: *mut ListenComm) {
    // SAFETY: forwarded contract; the tag is overwritten so a double close is recognized while
    // the memory is not reused.
    unsafe {
        (*comm).tag = DEAD_TAG;
        drop(Box::from_raw(comm));
    }
}
