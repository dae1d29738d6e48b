//! Finding a peer of the same host: the listeners an endpoint holds (its own name and,
//! when it is the first of its user on its GPU, the GPU's name) and the hello exchange that
//! turns a socket into a [`LocalConnection`].
//!
//! Admission: the kernel's word on the peer's user id must be ours, its hello must be one of
//! this protocol's version with our boot id. Anything else — another user, garbage, silence
//! past the hello deadline — is turned away (logged) while `accept` keeps waiting.

use std::os::fd::BorrowedFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::connection::LocalConnection;
use super::identity::gpu_socket_name;
use super::link::LocalLink;
use super::links::Links;
use super::shared::IpcShared;
use super::socket::{self, Accepted};
use super::wire::{read_msg, Hello, Msg, LOCAL_PROTOCOL_VERSION};
use crate::error::{Error, LocalErrorKind, Result};

/// Longest a connecting socket may take to say hello before it is turned away.
const HELLO_LIMIT: Duration = Duration::from_secs(5);

/// The rendezvous sockets of one endpoint; closed (names released) when dropped.
pub(crate) struct Listeners {
    primary: std::result::Result<UnixListener, String>,
    /// The GPU's name, once claimed. Shared out (`Arc`) so that `accept` waits on it without
    /// holding this lock: a waiter holding it starved every other user of the lock
    /// (`claimed_gpu`, hence `Endpoint::local_route`) for seconds to a minute on a 16-core
    /// machine, where the accepting loop took the lock back at once after each round.
    alias: Mutex<Option<(String, Arc<UnixListener>)>>,
}

impl Listeners {
    /// Binds the endpoint's own name. A failure is kept, not returned: an endpoint that
    /// cannot listen locally still works over the network, and `accept_local` says why not.
    pub(crate) fn bind(name: &str) -> Self {
        let primary = socket::bind(name).map_err(|e| {
            tracing::warn!(target: "tcpx_runtime::ipc", name, "no local rendezvous: {e}");
            format!("binding the local rendezvous @{name}: {e}")
        });
        Self {
            primary,
            alias: Mutex::new(None),
        }
    }

    /// Why this endpoint has no local rendezvous, if it has none.
    pub(crate) fn unavailable(&self) -> Option<&str> {
        self.primary.as_ref().err().map(String::as_str)
    }

    /// Claims the name of GPU `bus` (normalized) for `uid`, unless this endpoint holds one
    /// already or another endpoint got it first (then peers reach this one by its own name).
    pub(crate) fn claim_gpu(&self, uid: u32, bus: &str) {
        let mut alias = self.alias.lock().unwrap_or_else(|p| p.into_inner());
        if alias.is_some() {
            return;
        }
        let name = gpu_socket_name(uid, bus);
        match socket::bind(&name) {
            Ok(l) => *alias = Some((bus.to_owned(), Arc::new(l))),
            Err(e) => {
                tracing::debug!(target: "tcpx_runtime::ipc", name, "GPU name not claimed: {e}")
            }
        }
    }

    /// The GPU whose name this endpoint holds.
    pub(crate) fn claimed_gpu(&self) -> Option<String> {
        let alias = self.alias.lock().unwrap_or_else(|p| p.into_inner());
        alias.as_ref().map(|(bus, _)| bus.clone())
    }

    /// Waits up to `wait` for a peer and sets the connection up; ends at once, with
    /// [`LocalErrorKind::Closed`], when `stop` is or becomes readable (the endpoint stopped
    /// accepting).
    pub(crate) fn accept(
        &self,
        shared: &Arc<IpcShared>,
        links: &Links,
        (me, default_gpu): (&Hello, Option<usize>),
        stop: BorrowedFd<'_>,
        wait: Duration,
    ) -> Result<LocalConnection> {
        let primary = self.primary.as_ref().map_err(|why| Error::Local {
            peer: "-".into(),
            kind: LocalErrorKind::Rendezvous,
            what: why.clone(),
        })?;
        let deadline = Instant::now() + wait;
        let mut turned_away = 0usize;
        let mut last = None;
        loop {
            // The alias is read per round: claiming it may happen while this waits.
            let accepted = {
                // Copied out: the lock is not held while this waits (see `alias`).
                let alias = self
                    .alias
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .as_ref()
                    .map(|(_, l)| l.clone());
                let mut listeners = vec![primary];
                if let Some(l) = alias.as_deref() {
                    listeners.push(l);
                }
                // Short rounds, so a name claimed meanwhile is served too.
                let round = deadline.min(Instant::now() + Duration::from_millis(100));
                socket::accept_any(&listeners, stop, round)
            };
            let stream = match accepted {
                Ok(Accepted::Stream(s)) => s,
                Ok(Accepted::Stopped) => {
                    return Err(Error::Local {
                        peer: "-".into(),
                        kind: LocalErrorKind::Closed,
                        what: format!("@{} stopped accepting", shared.name),
                    })
                }
                Ok(Accepted::TimedOut) if Instant::now() < deadline => continue,
                Ok(Accepted::TimedOut) => {
                    return Err(Error::Local {
                        peer: "-".into(),
                        kind: LocalErrorKind::Timeout,
                        what: format!(
                            "no local peer connected to @{} within {wait:?}{}",
                            shared.name,
                            match (turned_away, last) {
                                (0, _) => String::new(),
                                (n, Some(why)) =>
                                    format!(" ({n} turned away, the last because {why})"),
                                (n, None) => format!(" ({n} turned away)"),
                            }
                        ),
                    })
                }
                Err(e) => {
                    return Err(Error::Local {
                        peer: "-".into(),
                        kind: LocalErrorKind::Rendezvous,
                        what: format!("accepting on @{}: {e}", shared.name),
                    })
                }
            };
            match admit(shared, links, me, default_gpu, stream, None) {
                Ok(conn) => return Ok(conn),
                Err(why) => {
                    tracing::warn!(target: "tcpx_runtime::ipc", "turned a local connection away: {why}");
                    turned_away += 1;
                    last = Some(why);
                }
            }
        }
    }
}

/// Connects to the rendezvous `name` (retrying up to `listen_wait` while nobody listens
/// there) and sets the connection up, waiting up to `timeout` in all for the peer to accept.
pub(crate) fn connect(
    shared: &Arc<IpcShared>,
    links: &Links,
    name: &str,
    me: &Hello,
    default_gpu: Option<usize>,
    listen_wait: Duration,
    timeout: Duration,
) -> Result<LocalConnection> {
    let fail = |kind, what: String| Error::Local {
        peer: format!("@{name}"),
        kind,
        what,
    };
    let start = Instant::now();
    let deadline = start + timeout;
    let stream = socket::connect(name, start + listen_wait.min(timeout)).map_err(|e| {
        fail(
            LocalErrorKind::Rendezvous,
            format!(
                "no endpoint of this user listens there (same host and network namespace?): {e}"
            ),
        )
    })?;
    admit(shared, links, me, default_gpu, stream, Some(deadline))
        .map_err(|why| fail(LocalErrorKind::Rendezvous, why))
}

/// The hello exchange on a fresh socket. The connecting side (`deadline` given) speaks first
/// and waits until its deadline for the answer; the accepting side reads within
/// [`HELLO_LIMIT`]. An `Err` says why the peer is not admitted.
fn admit(
    shared: &Arc<IpcShared>,
    links: &Links,
    me: &Hello,
    default_gpu: Option<usize>,
    mut stream: UnixStream,
    deadline: Option<Instant>,
) -> std::result::Result<LocalConnection, String> {
    let (cred_pid, cred_uid) =
        socket::peer_cred(&stream).map_err(|e| format!("SO_PEERCRED: {e}"))?;
    if cred_uid != shared.uid {
        return Err(format!(
            "the process at the other end (pid {cred_pid}) runs as uid {cred_uid}, not {}",
            shared.uid
        ));
    }
    let read_limit = match deadline {
        Some(d) => d.saturating_duration_since(Instant::now()),
        None => shared.timeout.min(HELLO_LIMIT),
    }
    .max(Duration::from_millis(1));
    let io = |what: &str, e: std::io::Error| format!("{what}: {e}");
    stream
        .set_read_timeout(Some(read_limit))
        .map_err(|e| io("setting the read timeout", e))?;
    stream
        .set_write_timeout(Some(shared.timeout))
        .map_err(|e| io("setting the write timeout", e))?;
    let hello = Msg::Hello(me.clone()).encode();
    let send = |s: &mut UnixStream| {
        use std::io::Write;
        s.write_all(&hello).map_err(|e| io("sending hello", e))
    };
    if deadline.is_some() {
        send(&mut stream)?;
    }
    let peer = match read_msg(&mut stream) {
        Ok(Msg::Hello(h)) => h,
        Ok(other) => return Err(format!("expected a hello, got {other:?}")),
        Err(e) => return Err(format!("reading the peer's hello: {e}")),
    };
    if peer.version != LOCAL_PROTOCOL_VERSION {
        return Err(format!(
            "the peer speaks local protocol version {}, this side {LOCAL_PROTOCOL_VERSION}",
            peer.version
        ));
    }
    if peer.boot_id != shared.boot_id {
        return Err("the peer reports another boot id: not the same host".into());
    }
    if deadline.is_none() {
        send(&mut stream)?;
    }
    stream
        .set_read_timeout(None)
        .map_err(|e| io("clearing the read timeout", e))?;
    let reader = stream
        .try_clone()
        .map_err(|e| io("cloning the socket", e))?;
    // The kernel's pid is the truth; its 0 (another pid namespace) falls back to the hello's.
    let pid = if cred_pid != 0 { cred_pid } else { peer.pid };
    let link = LocalLink::new(shared.clone(), peer, pid, default_gpu, stream);
    links.add_link(&link);
    let watched = link.clone();
    let watcher = std::thread::Builder::new()
        .name("tcpx-ipc".into())
        .spawn(move || watched.watch(reader))
        .map_err(|e| io("starting the connection's thread", e))?;
    tracing::info!(target: "tcpx_runtime::ipc", peer = %link.label(), "local connection up");
    Ok(LocalConnection::new(link, watcher))
}
