//! The rendezvous sockets: abstract-namespace Unix stream sockets (no file to create or clean
//! up; the name goes with the last descriptor), accepts and connects bounded by deadlines,
//! and the kernel's word on who is at the other end (`SO_PEERCRED`).
//!
//! Abstract names are visible to every process of the network namespace and carry no
//! permissions, so both sides check the other's user id through `SO_PEERCRED` before they
//! trust a byte: a process of another user that squats a name, or dials one, is refused.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::time::{Duration, Instant};

/// Binds a listener to the abstract name `name`.
pub(crate) fn bind(name: &str) -> io::Result<UnixListener> {
    let addr = SocketAddr::from_abstract_name(name.as_bytes())?;
    let listener = UnixListener::bind_addr(&addr)?;
    // Accepts go through poll with a deadline; the listener itself never blocks.
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// What [`accept_any`] came back with.
#[derive(Debug)]
pub(crate) enum Accepted {
    /// A connection, in blocking mode.
    Stream(UnixStream),
    /// The deadline passed with nobody there.
    TimedOut,
    /// `stop` turned readable: the endpoint stopped accepting.
    Stopped,
}

/// Accepts one connection on any of `listeners` before `deadline`, unless `stop` (a
/// descriptor that turns readable for good when accepting ends) is or becomes readable
/// first: a stopped accept takes nothing, even a connection already pending.
pub(crate) fn accept_any(
    listeners: &[&UnixListener],
    stop: BorrowedFd<'_>,
    deadline: Instant,
) -> io::Result<Accepted> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if poll_readable(listeners, stop, left)? {
            return Ok(Accepted::Stopped);
        }
        for l in listeners {
            match l.accept() {
                Ok((stream, _)) => {
                    stream.set_nonblocking(false)?;
                    return Ok(Accepted::Stream(stream));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                // A connection that died in the backlog: take the next one.
                Err(e) if e.kind() == io::ErrorKind::ConnectionAborted => {}
                Err(e) => return Err(e),
            }
        }
        if left.is_zero() {
            return Ok(Accepted::TimedOut);
        }
    }
}

/// Waits until one of `listeners` has a connection pending, `stop` is readable or `wait`
/// passed; returns whether `stop` is readable.
fn poll_readable(
    listeners: &[&UnixListener],
    stop: BorrowedFd<'_>,
    wait: Duration,
) -> io::Result<bool> {
    let mut fds: Vec<libc::pollfd> = std::iter::once(stop.as_raw_fd())
        .chain(listeners.iter().map(|l| l.as_raw_fd()))
        .map(|fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    // Rounded up: a sub-millisecond remainder must still wait, not spin.
    let ms = wait.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
    // SAFETY: `fds` is a live array of `fds.len()` pollfd structs that poll may write the
    // `revents` of; the descriptors stay open (borrowed from `listeners` and `stop`) during
    // the call.
    let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
        return Ok(false);
    }
    Ok(fds[0].revents != 0)
}

/// Connects to the abstract name `name`, retrying while nobody listens there yet (the peer
/// may still be starting) until `deadline`. The last error when it never answered.
pub(crate) fn connect(name: &str, deadline: Instant) -> io::Result<UnixStream> {
    let addr = SocketAddr::from_abstract_name(name.as_bytes())?;
    let mut pause = Duration::from_millis(1);
    loop {
        match UnixStream::connect_addr(&addr) {
            Ok(s) => return Ok(s),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::ConnectionRefused
                        | io::ErrorKind::NotFound
                        | io::ErrorKind::WouldBlock
                        | io::ErrorKind::Interrupted
                ) =>
            {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(e);
                }
                std::thread::sleep(pause.min(left));
                pause = (pause * 2).min(Duration::from_millis(50));
            }
            Err(e) => return Err(e),
        }
    }
}

/// The process id and user id of the process that made the other end of `stream` (as the
/// kernel recorded them at connect / listen time). The pid is 0 when that process lives in
/// a pid namespace this one cannot see.
pub(crate) fn peer_cred(stream: &UnixStream) -> io::Result<(u32, u32)> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, a live ucred of that size;
    // the descriptor is open (borrowed from `stream`).
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((cred.pid.max(0) as u32, cred.uid))
}

/// This process's real user id.
pub(crate) fn uid() -> u32 {
    // SAFETY: getuid has no preconditions and cannot fail.
    unsafe { libc::getuid() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::fd::AsFd;

    #[test]
    fn bind_connect_accept_and_credentials() {
        let name = format!("tcpx-ipc-test/{}/{:?}", std::process::id(), Instant::now());
        let l = bind(&name).unwrap();
        let (poke, stop) = UnixStream::pair().unwrap();
        let accept = |wait: Duration| accept_any(&[&l], stop.as_fd(), Instant::now() + wait);
        // Nothing pending: a short accept times out at its deadline.
        assert!(matches!(
            accept(Duration::from_millis(20)).unwrap(),
            Accepted::TimedOut
        ));
        let mut c = connect(&name, Instant::now() + Duration::from_secs(5)).unwrap();
        let Accepted::Stream(mut s) = accept(Duration::from_secs(5)).unwrap() else {
            panic!("the pending connection was not accepted");
        };
        assert_eq!(peer_cred(&s).unwrap(), (std::process::id(), uid()));
        assert_eq!(peer_cred(&c).unwrap(), (std::process::id(), uid()));
        c.write_all(b"hi").unwrap();
        let mut buf = [0u8; 2];
        s.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"hi");
        // Once `stop` is readable, accepts end at once and take nothing, even a connection
        // already pending.
        let _pending = connect(&name, Instant::now() + Duration::from_secs(5)).unwrap();
        drop(poke);
        let start = Instant::now();
        assert!(matches!(
            accept(Duration::from_secs(30)).unwrap(),
            Accepted::Stopped
        ));
        assert!(start.elapsed() < Duration::from_secs(10));
        // The name is taken while the listener lives, free again after.
        assert!(bind(&name).is_err());
        drop(l);
        assert!(bind(&name).is_ok());
    }

    #[test]
    fn connecting_to_nobody_gives_up_at_the_deadline() {
        let start = Instant::now();
        let e = connect("tcpx-ipc-test/nobody", start + Duration::from_millis(50)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused);
    }
}
