//! The connection handshake, symmetric on both sides:
//!
//! 1. `Hello` both ways, the connecting side's first (presenting the secret from the
//!    accepting side's metadata, if it has it): the accepting side answers only a `Hello`
//!    that carries its secret when [`Config::require_secret`](crate::Config) is on, so a
//!    stranger learns nothing. Plugin and protocol version must agree, or the set-up fails
//!    with `INCOMPATIBLE` naming both values. Channel count and chunk size need not: the
//!    connection uses the smaller of each (N channels below), as both sides compute from
//!    the two `Hello`s — a decode server started with 4 channels and 256 KiB chunks takes a
//!    prefill peer's 8 channels of 512 KiB;
//! 2. each side listens once per channel (channel `c` on device `c mod devices`) — 2N
//!    channels: N two-sided ones, then N for one-sided traffic (see [`crate::onesided`] for
//!    why they are separate), then, when both sides offer eager frames (`eager_bytes` in
//!    `Hello`, see [`crate::eager`]), N eager ones — and sends `ConnectHandles`;
//! 3. each side connects channel `c` to the peer's handle `c` while accepting on its own
//!    listen `c`, polling every pending connect and accept in one loop so neither side
//!    waits on the other;
//! 4. `Ready` both ways.
//!
//! So this side's send comm `c` pairs with the peer's receive comm `c` and vice versa. The
//! whole set-up has the configured timeout; any failure is reported to the peer with an
//! `Error` message (best effort) before returning.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tcpx::{ConnectHandle, ErrorKind, ListenComm, RecvComm, SendComm};

use super::shared::EndpointShared;
use crate::control::{ControlConn, EndpointInfo, Message, MessageType, Secret, PROTOCOL_VERSION};
use crate::error::{Error, Result};
use crate::metrics::EndpointCounters;

/// The comms of a set-up connection, indexed by channel: `0..N` two-sided, `N..2N` one-sided,
/// `2N..3N` eager (when `eager_bytes` > 0).
pub(crate) struct Established {
    pub(crate) peer_info: EndpointInfo,
    /// Channels each way: the smaller of both sides' counts ([`agreed_channels`]).
    pub(crate) channels: u16,
    /// Largest plugin request of the connection's schedules: the smaller of both sides'
    /// chunk sizes ([`agreed_chunk_bytes`]).
    pub(crate) chunk_bytes: u32,
    /// Largest message both sides send in eager frames; 0: no eager comms.
    pub(crate) eager_bytes: u32,
    pub(crate) sends: Vec<SendComm>,
    pub(crate) recvs: Vec<RecvComm>,
}

/// Which end of the control connection this side is.
#[derive(Debug)]
pub(crate) enum Side {
    /// Accepted the control connection; admission ([`super::admission`]) already read the
    /// peer's `Hello` (and checked its secret): this side answers with its own.
    Accepted {
        /// The peer's `Hello`.
        hello: Message,
    },
    /// Opened the control connection: sends `Hello` first, presenting `secret`.
    Connecting {
        /// The secret from the peer's metadata; `None` for address-only connects.
        secret: Option<Secret>,
    },
}

/// Runs the handshake on `ctl` and hands back the control connection with the comms set up;
/// the endpoint starts the [`Connection`](super::Connection) on them, so that this module
/// stays below the connection it prepares.
pub(crate) fn establish(
    shared: &EndpointShared,
    mut ctl: ControlConn,
    side: Side,
) -> Result<(ControlConn, Established)> {
    let deadline = Instant::now() + shared.config.timeout;
    let peer = ctl.peer_addr();
    let span = tracing::info_span!(
        target: "tcpx_runtime",
        "connection_setup",
        %peer,
        side = match side {
            Side::Accepted { .. } => "accept",
            Side::Connecting { .. } => "connect",
        }
    );
    let _entered = span.enter();
    let outcome = match handshake(shared, &mut ctl, side, deadline) {
        Ok(established) => {
            tracing::info!(target: "tcpx_runtime", %peer, channels = established.sends.len(), "connection established");
            Ok((ctl, established))
        }
        Err(e) => {
            // Tell the peer why, unless it is the one who told us.
            if !matches!(&e, Error::Control(c) if matches!(**c, crate::control::ControlError::Remote { .. }))
            {
                let _ = ctl.send(&Message::Error {
                    code: e.wire_code(),
                    message: e.to_string(),
                });
            }
            tracing::warn!(target: "tcpx_runtime", %peer, error = %e, "connection set-up failed");
            Err(e)
        }
    };
    let counters = &shared.counters;
    EndpointCounters::bump(match outcome {
        Ok(_) => &counters.connections_opened,
        Err(_) => &counters.setup_failures,
    });
    outcome
}

fn handshake(
    shared: &EndpointShared,
    ctl: &mut ControlConn,
    side: Side,
    deadline: Instant,
) -> Result<Established> {
    let peer = ctl.peer_addr();
    let left = || deadline.saturating_duration_since(Instant::now());

    let peer_hello = match side {
        Side::Connecting { secret } => {
            ctl.send(&Message::hello_presenting(shared.info.clone(), secret))?;
            ctl.recv_expecting(MessageType::Hello, left())?
        }
        Side::Accepted { hello } => {
            ctl.send(&Message::hello(shared.info.clone()))?;
            hello
        }
    };
    let Message::Hello {
        protocol_version,
        endpoint: peer_info,
        ..
    } = peer_hello
    else {
        return Err(Error::Internal(
            "recv_expecting returned another type".into(),
        ));
    };
    check_compatible(&shared.info, protocol_version, &peer_info)
        .map_err(|what| Error::Incompatible { peer, what })?;

    let channels = agreed_channels(shared.config.channels, peer_info.channels);
    if channels < shared.config.channels {
        tracing::info!(target: "tcpx_runtime", %peer, own = shared.config.channels, peer_channels = peer_info.channels, "the peer offers fewer channels: the connection uses its count");
    }
    let chunk_bytes = agreed_chunk_bytes(shared.config.chunk_bytes, peer_info.chunk_bytes);
    if chunk_bytes < shared.config.chunk_bytes {
        tracing::info!(target: "tcpx_runtime", %peer, own = shared.config.chunk_bytes, peer_chunk_bytes = peer_info.chunk_bytes, "the peer cuts smaller chunks: the connection uses its size");
    }
    let eager_bytes = agreed_eager_bytes(shared.info.eager_bytes, peer_info.eager_bytes);
    // N two-sided channels, then N one-sided (RMA) ones, then N eager ones when both sides
    // offer eager frames; channel k · N + c uses c's device.
    let sets = if eager_bytes > 0 { 3 } else { 2 };
    let total = channels
        .checked_mul(sets)
        .ok_or_else(|| Error::Config(format!("{channels} channels: too many comms")))?;
    let device_of = |c: u16| shared.device_of(c % channels);
    let setup_err = |source: tcpx::Error| Error::Setup {
        peer,
        source: Arc::new(source),
    };
    let mut listens: Vec<ListenComm> = (0..total)
        .map(|c| shared.net.listen(device_of(c)))
        .collect::<tcpx::Result<_>>()
        .map_err(setup_err)?;
    ctl.send(&Message::ConnectHandles {
        handles: listens.iter().map(|l| l.handle().0).collect(),
    })?;
    let Message::ConnectHandles { handles } =
        ctl.recv_expecting(MessageType::ConnectHandles, left())?
    else {
        return Err(Error::Internal(
            "recv_expecting returned another type".into(),
        ));
    };
    if handles.len() != usize::from(total) {
        return Err(Error::Incompatible {
            peer,
            what: format!(
                "the peer sent {} connect handles for {channels} channels (expected {total}: \
                 two-sided, one-sided and, when both offer them, eager)",
                handles.len()
            ),
        });
    }

    let mut connects = handles
        .iter()
        .enumerate()
        .map(|(c, h)| {
            // `c` < total, a u16.
            let device = device_of(c as u16);
            shared.net.begin_connect(device, &ConnectHandle(*h))
        })
        .collect::<tcpx::Result<Vec<_>>>()
        .map_err(setup_err)?;
    let mut accepts: Vec<_> = listens.iter_mut().map(|l| l.begin_accept()).collect();
    let mut sends: Vec<Option<SendComm>> = (0..total).map(|_| None).collect();
    let mut recvs: Vec<Option<RecvComm>> = (0..total).map(|_| None).collect();
    let mut idle = 0u32;
    loop {
        let mut moved = false;
        for (slot, pending) in sends.iter_mut().zip(&mut connects) {
            if slot.is_none() {
                *slot = pending.poll().map_err(setup_err)?;
                moved |= slot.is_some();
            }
        }
        for (slot, pending) in recvs.iter_mut().zip(&mut accepts) {
            if slot.is_none() {
                *slot = pending.poll().map_err(setup_err)?;
                moved |= slot.is_some();
            }
        }
        let connected = sends.iter().filter(|s| s.is_some()).count();
        let accepted = recvs.iter().filter(|r| r.is_some()).count();
        if connected + accepted == 2 * usize::from(total) {
            break;
        }
        if Instant::now() >= deadline {
            return Err(setup_err(tcpx::Error::new(
                "connect/accept",
                ErrorKind::Timeout(shared.config.timeout),
                format!("{connected} of {total} channels connected, {accepted} accepted"),
            )));
        }
        idle = if moved { 0 } else { idle + 1 };
        if idle > 64 {
            std::thread::sleep(Duration::from_micros(100));
        } else {
            std::thread::yield_now();
        }
    }
    drop(accepts);
    drop(listens);

    ctl.send(&Message::Ready)?;
    ctl.recv_expecting(MessageType::Ready, left())?;
    Ok(Established {
        peer_info,
        channels,
        chunk_bytes,
        eager_bytes,
        sends: sends.into_iter().flatten().collect(),
        recvs: recvs.into_iter().flatten().collect(),
    })
}

/// `Err` says why a peer's `Hello` does not get in: this endpoint requires its secret and the
/// peer presented none, or another one.
pub(crate) fn check_secret(
    required: bool,
    own: Secret,
    presented: Option<Secret>,
) -> std::result::Result<(), String> {
    match presented {
        _ if !required => Ok(()),
        Some(s) if s == own => Ok(()),
        Some(_) => Err(
            "this endpoint requires its secret and the peer presented a wrong one \
                        (connect with this endpoint's current metadata)"
                .into(),
        ),
        None => Err(
            "this endpoint requires its secret and the peer presented none \
                     (connect with the endpoint's metadata, not its address alone)"
                .into(),
        ),
    }
}

/// The channels a connection uses: the smaller of both sides' counts. Both sides compute it
/// from the two `Hello`s, so both open as many comms and cut every schedule alike.
/// ([`check_compatible`] refused a peer announcing none.)
pub(crate) fn agreed_channels(local: u16, peer: u16) -> u16 {
    local.min(peer)
}

/// The chunk size a connection's schedules use: the smaller of both sides' sizes. Both sides
/// cut every transfer alike from it (a receive is posted for each chunk the peer sends), and
/// every buffer sized by this side's own chunk (staging slots, the discard region) holds it.
/// ([`check_compatible`] refused a peer announcing 0.)
pub(crate) fn agreed_chunk_bytes(local: u32, peer: u32) -> u32 {
    local.min(peer)
}

/// The eager size a connection uses: the smaller of both sides' offers, 0 if either is 0.
pub(crate) fn agreed_eager_bytes(local: u32, peer: u32) -> u32 {
    local.min(peer)
}

/// `Err` names the setting that differs, with both values.
fn check_compatible(
    local: &EndpointInfo,
    peer_version: u16,
    peer: &EndpointInfo,
) -> std::result::Result<(), String> {
    if peer_version != PROTOCOL_VERSION {
        return Err(format!(
            "protocol version: this side {PROTOCOL_VERSION}, peer {peer_version}"
        ));
    }
    if peer.channels == 0 {
        return Err(format!(
            "channel count: the peer announced none (this side {})",
            local.channels
        ));
    }
    if peer.chunk_bytes == 0 {
        return Err(format!(
            "chunk size: the peer announced 0 bytes (this side {})",
            local.chunk_bytes
        ));
    }
    if local.plugin_name != peer.plugin_name {
        return Err(format!(
            "plugin: this side {:?}, peer {:?}",
            local.plugin_name, peer.plugin_name
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{IpAddr, Ipv4Addr};

    fn info(channels: u16, chunk_bytes: u32) -> EndpointInfo {
        EndpointInfo {
            ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
            gpu_pci: None,
            channels,
            plugin_name: "tcpx-socket".into(),
            abi_version: 8,
            chunk_bytes,
            gpu_index: None,
            spread: 1,
            eager_bytes: 0,
            spread_two_sided: true,
        }
    }

    #[test]
    fn both_sides_agree_on_the_smaller_channel_count() {
        for (a, b) in [(1, 1), (2, 8), (8, 2), (7, 3), (u16::MAX, 4)] {
            assert_eq!(agreed_channels(a, b), agreed_channels(b, a));
            assert_eq!(agreed_channels(a, b), a.min(b));
        }
    }

    #[test]
    fn both_sides_agree_on_the_smaller_chunk_size() {
        for (a, b) in [
            (1, 1),
            (4096, 1 << 20),
            (1 << 20, 4096),
            (7, 3),
            (u32::MAX, 512),
        ] {
            assert_eq!(agreed_chunk_bytes(a, b), agreed_chunk_bytes(b, a));
            assert_eq!(agreed_chunk_bytes(a, b), a.min(b));
        }
    }

    #[test]
    fn secrets_are_checked_only_when_required() {
        let own = crate::control::random_secret();
        let other = crate::control::random_secret();
        assert!(check_secret(false, own, None).is_ok());
        assert!(check_secret(false, own, Some(other)).is_ok());
        assert!(check_secret(true, own, Some(own)).is_ok());
        let e = check_secret(true, own, Some(other)).unwrap_err();
        assert!(e.contains("wrong"), "{e}");
        let e = check_secret(true, own, None).unwrap_err();
        assert!(e.contains("presented none"), "{e}");
    }

    #[test]
    fn differences_name_both_values() {
        assert!(check_compatible(&info(4, 1024), PROTOCOL_VERSION, &info(4, 1024)).is_ok());
        // Channel counts may differ (the connection takes the smaller), but not be zero.
        assert!(check_compatible(&info(4, 1024), PROTOCOL_VERSION, &info(2, 1024)).is_ok());
        let e = check_compatible(&info(4, 1024), PROTOCOL_VERSION, &info(0, 1024)).unwrap_err();
        assert!(e.contains("none") && e.contains("this side 4"), "{e}");
        // Chunk sizes too (the connection takes the smaller), but not 0.
        assert!(check_compatible(&info(4, 1024), PROTOCOL_VERSION, &info(4, 4096)).is_ok());
        let e = check_compatible(&info(4, 1024), PROTOCOL_VERSION, &info(4, 0)).unwrap_err();
        assert!(e.contains("chunk") && e.contains("this side 1024"), "{e}");
        let e = check_compatible(&info(4, 1024), PROTOCOL_VERSION + 1, &info(4, 1024)).unwrap_err();
        assert!(e.contains("protocol"), "{e}");
    }
}
