//! Thin socket helpers over std and libc: non-blocking connect, vectored send that can never
//! raise SIGPIPE, and the process-local randomness used for nonces and ids.

use std::io::{self, IoSlice, IoSliceMut, Read};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// Sets an integer socket option (`setsockopt` with a `c_int` value).
pub(crate) fn set_int_option(
    fd: &impl AsRawFd,
    level: libc::c_int,
    option: libc::c_int,
    value: libc::c_int,
) -> io::Result<()> {
    // SAFETY: a valid descriptor and a live c_int of the size passed.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            option,
            std::ptr::from_ref(&value).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Sets `SO_RCVLOWAT`: `poll` reports the socket readable only once `bytes` are queued (or
/// the peer closed it).
pub(crate) fn set_rcvlowat(s: &TcpStream, bytes: usize) -> io::Result<()> {
    let v = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
    set_int_option(s, libc::SOL_SOCKET, libc::SO_RCVLOWAT, v)
}

/// The socket's receive buffer size (`SO_RCVBUF`, as the kernel accounts it: about twice the
/// window it can advertise). Reading it takes no socket lock.
pub(crate) fn rcvbuf(s: &TcpStream) -> io::Result<usize> {
    int_option(s, libc::SOL_SOCKET, libc::SO_RCVBUF).map(|v| usize::try_from(v).unwrap_or(0))
}

/// Reads an integer socket option (`getsockopt`).
pub(crate) fn int_option(
    fd: &impl AsRawFd,
    level: libc::c_int,
    option: libc::c_int,
) -> io::Result<libc::c_int> {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: a valid descriptor, a live c_int and its length, both written by the kernel.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            level,
            option,
            std::ptr::from_mut(&mut v).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(v)
}

/// Binds a non-blocking listener on `addr` with an ephemeral port.
pub(crate) fn listen(addr: SocketAddr) -> io::Result<TcpListener> {
    let l = TcpListener::bind(addr)?;
    l.set_nonblocking(true)?;
    Ok(l)
}

/// Starts a non-blocking connect; completion is observed with [`connect_finished`].
pub(crate) fn start_connect(addr: SocketAddr) -> io::Result<TcpStream> {
    let family = match addr {
        SocketAddr::V4(_) => libc::AF_INET,
        SocketAddr::V6(_) => libc::AF_INET6,
    };
    // SAFETY: plain socket(2); the result is checked before use.
    let fd = unsafe {
        libc::socket(
            family,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    let (storage, len) = sockaddr(addr);
    // SAFETY: `storage` holds a valid sockaddr of `len` bytes for the socket's family.
    let rc = unsafe {
        libc::connect(
            owned.as_raw_fd(),
            &storage as *const libc::sockaddr_storage as *const libc::sockaddr,
            len,
        )
    };
    if rc != 0 {
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EINPROGRESS) {
            return Err(err);
        }
    }
    let stream = TcpStream::from(owned);
    stream.set_nodelay(true)?;
    Ok(stream)
}

/// Whether a connect started by [`start_connect`] has finished: `Ok(false)` while in progress,
/// the connect error if it failed.
pub(crate) fn connect_finished(s: &TcpStream) -> io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd: s.as_raw_fd(),
        events: libc::POLLOUT,
        revents: 0,
    };
    // SAFETY: one valid pollfd, zero timeout (never blocks).
    let rc = unsafe { libc::poll(&mut pfd, 1, 0) };
    if rc < 0 {
        let err = io::Error::last_os_error();
        return if err.kind() == io::ErrorKind::Interrupted {
            Ok(false)
        } else {
            Err(err)
        };
    }
    if rc == 0 {
        return Ok(false);
    }
    if let Some(err) = s.take_error()? {
        return Err(err);
    }
    if pfd.revents & (libc::POLLERR | libc::POLLHUP) != 0 {
        return Err(io::Error::new(
            io::ErrorKind::ConnectionRefused,
            "connection failed (POLLERR/POLLHUP)",
        ));
    }
    Ok(true)
}

fn sockaddr(addr: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain old data; all-zero is a valid value.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from(*a.ip()).to_be(),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is large and aligned enough for any sockaddr.
            unsafe {
                std::ptr::write(
                    &mut storage as *mut libc::sockaddr_storage as *mut libc::sockaddr_in,
                    sin,
                )
            };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: sockaddr_storage is large and aligned enough for a sockaddr_in6.
            unsafe {
                std::ptr::write(
                    &mut storage as *mut libc::sockaddr_storage as *mut libc::sockaddr_in6,
                    sin6,
                )
            };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (storage, len as libc::socklen_t)
}

/// Outcome of one non-blocking transfer call.
pub(crate) enum Io {
    /// Bytes moved (never 0 for a send; 0 for a receive only when the buffers were empty).
    Moved(usize),
    /// The socket has no room / no data now.
    WouldBlock,
    /// Orderly shutdown by the peer (receive only).
    Eof,
}

/// One `sendmsg` with `MSG_NOSIGNAL`: a peer that went away yields EPIPE, never a SIGPIPE
/// that would kill the host process (NCCL does not ignore SIGPIPE for its plugins).
pub(crate) fn send_vectored(s: &TcpStream, bufs: &[IoSlice<'_>]) -> io::Result<Io> {
    // SAFETY: msghdr is plain old data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    // IoSlice is ABI-compatible with iovec on unix (documented guarantee).
    msg.msg_iov = bufs.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = bufs.len() as _;
    loop {
        // SAFETY: `msg` points at `bufs`, valid readable slices for the duration of the call.
        let n =
            unsafe { libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
        if n >= 0 {
            return Ok(Io::Moved(n as usize));
        }
        let err = io::Error::last_os_error();
        match err.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => return Ok(Io::WouldBlock),
            _ => return Err(err),
        }
    }
}

/// One non-blocking vectored receive.
pub(crate) fn recv_vectored(s: &TcpStream, bufs: &mut [IoSliceMut<'_>]) -> io::Result<Io> {
    let want: usize = bufs.iter().map(|b| b.len()).sum();
    loop {
        match (&*s).read_vectored(bufs) {
            Ok(0) if want > 0 => return Ok(Io::Eof),
            Ok(n) => return Ok(Io::Moved(n)),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(Io::WouldBlock),
            Err(e) => return Err(e),
        }
    }
}

/// Whether a receive on `s` would find something now: data, the peer's close or an error.
///
/// `poll(2)` answers from the socket's queue state without taking the socket lock, which a
/// non-blocking `recv` on an empty socket does take. While the receiver holds that lock, the
/// sender's segments (delivered by the sender's own softirq over loopback, or by the NIC's)
/// cannot be queued directly and wait in the socket's backlog until the lock is released, in
/// the receiver's context. A receiver that polls an empty socket with `recv` in a tight loop
/// thus keeps deferring the very segments it waits for. If `poll` itself fails the answer is
/// "ready", so the `recv` that follows reports what is wrong.
pub(crate) fn readable(s: &TcpStream) -> bool {
    let mut pfd = libc::pollfd {
        fd: s.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, zero timeout (never blocks).
    let rc = unsafe { libc::poll(&mut pfd, 1, 0) };
    rc != 0
}

/// A random u64 from the kernel; falls back to a clock-and-counter mix if getrandom is
/// unavailable (old kernels, seccomp), which is still unique enough for ids and nonces.
pub(crate) fn random_u64() -> u64 {
    let mut x = [0u8; 8];
    // SAFETY: getrandom writes at most 8 bytes into the 8-byte buffer.
    let n = unsafe { libc::getrandom(x.as_mut_ptr().cast(), x.len(), 0) };
    if n == 8 {
        return u64::from_le_bytes(x);
    }
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0x9e37_79b9_7f4a_7c15);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let c = COUNTER.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed);
    let mut z = t ^ c ^ u64::from(std::process::id()).rotate_left(32);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Shuts every socket down in both directions (fault injection: a connection dropped under the
/// comm). Errors are ignored: a socket the peer already closed is as dropped as it gets.
pub(crate) fn shutdown_all(socks: &[TcpStream]) {
    for s in socks {
        let _ = s.shutdown(std::net::Shutdown::Both);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::time::{Duration, Instant};

    fn wait_until(mut f: impl FnMut() -> bool) -> bool {
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if f() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        false
    }

    #[test]
    fn readable_follows_data_close_and_drain() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut tx = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (rx, _) = listener.accept().unwrap();
        rx.set_nonblocking(true).unwrap();
        assert!(!readable(&rx), "an empty socket is not readable");

        tx.write_all(b"abc").unwrap();
        assert!(wait_until(|| readable(&rx)), "data makes it readable");
        let mut buf = [0u8; 8];
        let mut bufs = [IoSliceMut::new(&mut buf)];
        assert!(matches!(recv_vectored(&rx, &mut bufs), Ok(Io::Moved(3))));
        assert!(!readable(&rx), "drained again");

        drop(tx);
        assert!(wait_until(|| readable(&rx)), "the peer's close is readable");
        let mut bufs = [IoSliceMut::new(&mut buf)];
        assert!(matches!(recv_vectored(&rx, &mut bufs), Ok(Io::Eof)));
    }

    /// What the receive side's read batching relies on: with a low watermark, the readiness
    /// check waits for that many bytes, yet still reports the peer's close; back at 1, any
    /// byte will do.
    #[test]
    fn readable_waits_for_the_low_watermark_but_not_past_a_close() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut tx = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (rx, _) = listener.accept().unwrap();
        rx.set_nonblocking(true).unwrap();
        set_rcvlowat(&rx, 64 << 10).unwrap();

        tx.write_all(&[7u8; 1000]).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert!(!readable(&rx), "1000 bytes queued, 64 KiB wanted");
        tx.write_all(&vec![7u8; 64 << 10]).unwrap();
        assert!(wait_until(|| readable(&rx)), "a whole batch is queued");

        let mut buf = vec![0u8; 128 << 10];
        let mut bufs = [IoSliceMut::new(&mut buf)];
        assert!(matches!(recv_vectored(&rx, &mut bufs), Ok(Io::Moved(n)) if n > 0));
        while let Ok(Io::Moved(_)) = recv_vectored(&rx, &mut [IoSliceMut::new(&mut buf)]) {}
        tx.write_all(&[7u8; 10]).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert!(!readable(&rx), "10 bytes queued, 64 KiB wanted");
        set_rcvlowat(&rx, 1).unwrap();
        assert!(readable(&rx), "back at 1 byte");

        set_rcvlowat(&rx, 64 << 10).unwrap();
        let mut bufs = [IoSliceMut::new(&mut buf)];
        assert!(matches!(recv_vectored(&rx, &mut bufs), Ok(Io::Moved(10))));
        tx.write_all(&[7u8; 10]).unwrap();
        drop(tx);
        assert!(
            wait_until(|| readable(&rx)),
            "the peer's close is readable below the watermark"
        );
    }
}
