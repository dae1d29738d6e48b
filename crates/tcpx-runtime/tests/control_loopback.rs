//! The control connection over real sockets, on 127.0.0.1 only. Every wait has a timeout.

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use tcpx_runtime::control::codec::{HEADER_LEN, MAGIC};
use tcpx_runtime::control::{
    CodecError, ControlConn, ControlError, EndpointInfo, ErrorCode, Message, MessageType,
    PROTOCOL_VERSION,
};

const STEP: Duration = Duration::from_secs(5);
const SHORT: Duration = Duration::from_millis(300);

fn listener() -> (TcpListener, SocketAddr) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    (l, addr)
}

fn info(channels: u16) -> EndpointInfo {
    EndpointInfo {
        // Both ends are on this host, so loopback is the reachable address here.
        ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
        gpu_pci: Some("0000:04:00.0".into()),
        channels,
        plugin_name: "tcpx-socket".into(),
        abi_version: 8,
        chunk_bytes: 512 << 10,
        gpu_index: None,
        spread: 1,
        eager_bytes: 0,
        spread_two_sided: true,
    }
}

#[test]
fn peers_exchange_hello_handles_and_close() {
    let (l, addr) = listener();
    let handles: Vec<[u8; 128]> = (0..4u8).map(|i| [i; 128]).collect();
    let sent_handles = handles.clone();

    // The receiving side: announces itself and its listen handles, waits for Ready.
    let receiver = thread::spawn(move || -> Result<EndpointInfo, ControlError> {
        let mut conn = ControlConn::accept(&l, STEP)?;
        conn.send(&Message::hello(info(4)))?;
        conn.send(&Message::ConnectHandles {
            handles: sent_handles,
        })?;
        let Message::Hello { endpoint, .. } = conn.recv_expecting(MessageType::Hello, STEP)? else {
            unreachable!("recv_expecting checked the type");
        };
        conn.recv_expecting(MessageType::Ready, STEP)?;
        conn.close("done")?;
        Ok(endpoint)
    });

    let mut conn = ControlConn::connect(addr, STEP).unwrap();
    let hello = conn.recv_expecting(MessageType::Hello, STEP).unwrap();
    assert_eq!(hello, Message::hello(info(4)));
    let got = conn.recv(STEP).unwrap();
    assert_eq!(got, Message::ConnectHandles { handles });
    conn.send(&Message::hello(info(2))).unwrap();
    conn.send(&Message::Ready).unwrap();
    assert_eq!(
        conn.recv(STEP).unwrap(),
        Message::Close {
            reason: "done".into()
        }
    );
    assert!(matches!(conn.recv(STEP), Err(ControlError::Closed { .. })));

    let peer_info = receiver.join().unwrap().unwrap();
    assert_eq!(peer_info, info(2));
}

#[test]
fn garbage_from_the_peer_is_a_clear_protocol_error() {
    let (l, addr) = listener();
    let client = thread::spawn(move || {
        let mut s = TcpStream::connect_timeout(&addr, STEP).unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        s
    });
    let mut conn = ControlConn::accept(&l, STEP).unwrap();
    let err = conn.recv(STEP).unwrap_err();
    let _keep_open = client.join().unwrap();
    assert!(
        matches!(
            err,
            ControlError::Protocol {
                source: CodecError::BadMagic { .. },
                ..
            }
        ),
        "{err}"
    );
    let text = err.to_string();
    assert!(text.contains(&conn.peer_addr().to_string()), "{text}");
    // The stream cannot be resynchronised: the error sticks.
    assert!(matches!(
        conn.recv(SHORT),
        Err(ControlError::Protocol { .. })
    ));
}

#[test]
fn silent_peer_times_out_within_the_limit() {
    let (l, addr) = listener();
    let _client = TcpStream::connect_timeout(&addr, STEP).unwrap();
    let mut conn = ControlConn::accept(&l, STEP).unwrap();
    let start = Instant::now();
    let err = conn.recv(SHORT).unwrap_err();
    let waited = start.elapsed();
    assert!(err.is_timeout(), "{err}");
    assert!(waited >= SHORT && waited < SHORT * 5, "waited {waited:?}");
    assert!(err.to_string().contains("timed out"), "{err}");
}

#[test]
fn peer_stalling_mid_frame_times_out_and_says_so() {
    let (l, addr) = listener();
    let mut client = TcpStream::connect_timeout(&addr, STEP).unwrap();
    let mut conn = ControlConn::accept(&l, STEP).unwrap();
    let mut frame = Vec::new();
    Message::Close {
        reason: "half of me".into(),
    }
    .encode(&mut frame)
    .unwrap();
    client.write_all(&frame[..HEADER_LEN + 3]).unwrap();
    let err = conn.recv(SHORT).unwrap_err();
    assert!(err.is_timeout(), "{err}");
    assert!(err.to_string().contains("mid-frame"), "{err}");
    // Nothing was lost: once the rest arrives, the message decodes.
    client.write_all(&frame[HEADER_LEN + 3..]).unwrap();
    assert_eq!(
        conn.recv(STEP).unwrap(),
        Message::Close {
            reason: "half of me".into()
        }
    );
}

#[test]
fn peer_closing_mid_frame_is_reported_as_truncation() {
    let (l, addr) = listener();
    let mut client = TcpStream::connect_timeout(&addr, STEP).unwrap();
    let mut conn = ControlConn::accept(&l, STEP).unwrap();
    let mut header = MAGIC.to_vec();
    header.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    header.extend_from_slice(&MessageType::Close.code().to_le_bytes());
    header.extend_from_slice(&100u32.to_le_bytes());
    client.write_all(&header).unwrap();
    drop(client);
    let err = conn.recv(STEP).unwrap_err();
    assert!(
        matches!(
            err,
            ControlError::Protocol {
                source: CodecError::Truncated { .. },
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn unexpected_and_error_messages_are_reported() {
    let (l, addr) = listener();
    let sender = thread::spawn(move || -> Result<(), ControlError> {
        let mut conn = ControlConn::connect(addr, STEP)?;
        conn.send(&Message::Ready)?;
        conn.send(&Message::Error {
            code: ErrorCode::INCOMPATIBLE,
            message: "8 channels here, 4 there".into(),
        })
    });
    let mut conn = ControlConn::accept(&l, STEP).unwrap();
    let err = conn.recv_expecting(MessageType::Hello, STEP).unwrap_err();
    assert!(
        matches!(
            err,
            ControlError::Unexpected {
                expected: MessageType::Hello,
                got: MessageType::Ready,
                ..
            }
        ),
        "{err}"
    );
    let err = conn.recv_expecting(MessageType::Hello, STEP).unwrap_err();
    assert!(
        matches!(
            err,
            ControlError::Remote {
                code: ErrorCode::INCOMPATIBLE,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("8 channels here"), "{err}");
    sender.join().unwrap().unwrap();
}

#[test]
fn accept_without_a_peer_times_out() {
    let (l, _) = listener();
    let start = Instant::now();
    let err = ControlConn::accept(&l, SHORT).unwrap_err();
    assert!(matches!(err, ControlError::AcceptTimeout { .. }), "{err}");
    assert!(start.elapsed() < SHORT * 5);
}

#[test]
fn connecting_to_a_closed_port_fails_with_the_address() {
    let (l, addr) = listener();
    drop(l);
    let err = ControlConn::connect(addr, STEP).unwrap_err();
    assert!(err.to_string().contains(&addr.to_string()), "{err}");
}

#[test]
fn peer_that_stops_reading_makes_send_time_out() {
    let (l, addr) = listener();
    // Connected but never read from.
    let _client = TcpStream::connect_timeout(&addr, STEP).unwrap();
    let mut conn = ControlConn::accept(&l, SHORT).unwrap();
    let big = Message::Segments {
        transfer_id: 1,
        lens: vec![7; 100_000],
    };
    // Loopback socket buffers hold a few MiB; 64 × 800 KB is far beyond them.
    let err = (0..64)
        .find_map(|_| conn.send(&big).err())
        .expect("the send buffer never filled");
    assert!(err.is_timeout(), "{err}");
    assert!(matches!(
        conn.send(&Message::Ready),
        Err(ControlError::Broken { .. })
    ));
}

/// A peer may send its first messages right behind the one this side waits for (the
/// connecting side notifies as soon as it saw `Ready`), and one `read` then takes them all.
/// The handle that keeps receiving after the handshake must own those buffered bytes: a
/// receiver cloned off the handshake's handle used to start empty and lost them (NIXL agents
/// re-created in a loop waited forever for a notification that had arrived).
#[test]
fn messages_read_ahead_during_the_handshake_reach_the_reader_after_split() {
    let (l, addr) = listener();
    let peer = thread::spawn(move || {
        let mut s = TcpStream::connect_timeout(&addr, STEP).unwrap();
        let mut burst = Vec::new();
        Message::Ready.encode(&mut burst).unwrap();
        for i in 0..3u8 {
            Message::Notify { bytes: vec![i; 16] }
                .encode(&mut burst)
                .unwrap();
        }
        // One write: the frames arrive together, so the first read returns all of them.
        s.write_all(&burst).unwrap();
        s
    });
    let mut conn = ControlConn::accept(&l, STEP).unwrap();
    let _keep_open = peer.join().unwrap();
    // Wait until all the bytes are in this socket's buffer, then take Ready alone.
    thread::sleep(Duration::from_millis(50));
    conn.recv_expecting(MessageType::Ready, STEP).unwrap();
    let (mut reader, mut writer) = conn.split().unwrap();
    for i in 0..3u8 {
        assert_eq!(
            reader.recv(STEP).unwrap(),
            Message::Notify { bytes: vec![i; 16] },
            "notification {i} after the split"
        );
    }
    // The writer is a working handle on the same socket.
    writer.send(&Message::Ready).unwrap();
    assert!(reader.recv(SHORT).unwrap_err().is_timeout());
}
