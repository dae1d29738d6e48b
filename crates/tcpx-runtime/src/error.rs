//! The runtime's one error type.
//!
//! Every error says what failed and where: the channel and the peer for anything on the data
//! path, the plugin API and its code for plugin failures, the variable for configuration.
//! Errors are `Clone` because one failure completes many transfers (every transfer pending on
//! a failed connection gets the same cause); sources that are not `Clone` sit behind an `Arc`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::control::{ControlError, ErrorCode};

/// Which way data flows on a channel, from this endpoint's point of view.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// This endpoint sends.
    Send,
    /// This endpoint receives.
    Recv,
}

impl std::fmt::Display for Direction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Send => "send",
            Self::Recv => "recv",
        })
    }
}

/// An error of the transfer runtime.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// A configuration value is missing, malformed or out of range.
    #[error("configuration: {0}")]
    Config(String),
    /// The caller passed something unusable (a range outside a region, a zero-length list…).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// No usable plugin could be loaded or initialized.
    #[error("backend: {what}: {source}")]
    Backend {
        /// What was being done (`loading /usr/local/tcpx/lib64/libnccl-net-tcpx.so`).
        what: String,
        /// The safe layer's error.
        source: Arc<tcpx::Error>,
    },
    /// A plugin call failed on a channel's comm (isend, irecv, test, irecvConsumed, regMr…).
    #[error("channel {channel} ({direction}) to peer {peer}: {source}")]
    Plugin {
        /// The channel index within its connection.
        channel: u16,
        /// The comm's direction.
        direction: Direction,
        /// The peer's control address.
        peer: SocketAddr,
        /// The safe layer's error: API, plugin code and comm.
        source: Arc<tcpx::Error>,
    },
    /// A CUDA step of a channel failed: the staged path (copy to or from the pinned ring,
    /// event query, ring allocation or registration) or the unpack path (device handle,
    /// fragment count, gather kernel, out-of-range fragment). The connection is failed.
    #[error("channel {channel} ({direction}) to peer {peer}: CUDA staging or unpack: {source}")]
    Staging {
        /// The channel index within its connection.
        channel: u16,
        /// The lane's direction.
        direction: Direction,
        /// The peer's control address.
        peer: SocketAddr,
        /// The safe layer's error: the CUDA API and its result code.
        source: Arc<tcpx::Error>,
    },
    /// The operation is not available with this plugin or memory (says which and why).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A plugin call failed while setting a connection up (listen, connect, accept).
    #[error("connection set-up with peer {peer}: {source}")]
    Setup {
        /// The peer's control address.
        peer: SocketAddr,
        /// The safe layer's error.
        source: Arc<tcpx::Error>,
    },
    /// The control plane failed (connect, framing, unexpected message, peer error).
    #[error(transparent)]
    Control(Arc<ControlError>),
    /// The two endpoints cannot work together.
    #[error("peer {peer} is incompatible: {what}")]
    Incompatible {
        /// The peer's control address.
        peer: SocketAddr,
        /// Which setting differs, with both values.
        what: String,
    },
    /// A transfer did not complete within the configured timeout; its connection is failed.
    #[error("{what} on channel {channel} to peer {peer} did not complete within {waited:?}")]
    Timeout {
        /// The channel where the oldest unfinished request sat.
        channel: u16,
        /// The peer's control address.
        peer: SocketAddr,
        /// How long it was given.
        waited: Duration,
        /// Which transfer (`send #3 of 1048576 bytes`).
        what: String,
    },
    /// [`crate::Transfer::wait`] ran out of time; the transfer itself is still in progress.
    #[error("transfer not complete after waiting {0:?} (it is still in progress)")]
    WaitTimedOut(Duration),
    /// The peer closed the connection or went away (control connection closed or reset).
    #[error("peer {peer} closed the connection: {reason}")]
    PeerClosed {
        /// The peer's control address.
        peer: SocketAddr,
        /// The peer's reason, or what this side observed.
        reason: String,
    },
    /// The peer sent what the protocol forbids (a one-sided request whose lists disagree, a
    /// pack past its limit, an eager message out of sequence); this side failed the
    /// connection and tells the peer why.
    #[error("protocol violation by peer {peer}: {what}")]
    Violation {
        /// The peer's control address.
        peer: SocketAddr,
        /// What was wrong, naming the request or channel.
        what: String,
    },
    /// The data the peer sent does not match what this side expected.
    #[error("channel {channel} from peer {peer}: {what}")]
    Mismatch {
        /// The channel index.
        channel: u16,
        /// The peer's control address.
        peer: SocketAddr,
        /// What differed.
        what: String,
    },
    /// This side closed the connection (or the endpoint) while the transfer was pending.
    #[error("connection to peer {peer} was closed by this side")]
    Closed {
        /// The peer's control address.
        peer: SocketAddr,
    },
    /// The endpoint stopped accepting ([`crate::Endpoint::stop_accepting`]) before a peer
    /// arrived.
    #[error("endpoint {local} stopped accepting")]
    AcceptStopped {
        /// The endpoint's control address.
        local: SocketAddr,
    },
    /// The peer refused a one-sided operation: an entry of its remote list names an unknown
    /// or revoked region, carries the wrong key, or lies outside the region. Nothing was
    /// written or read.
    #[error("peer {peer} refused the one-sided operation: remote segment {descriptor}: {reason}")]
    Access {
        /// The peer's control address.
        peer: SocketAddr,
        /// Index of the refused entry in the operation's remote list.
        descriptor: usize,
        /// Why (`wrong access key`, `descriptor revoked`…).
        reason: String,
    },
    /// A rendezvous store failed, did not answer, or a name did not appear in time (the
    /// store's own error, [`crate::rendezvous::StoreError`], as text: this module sits below
    /// the rendezvous layer).
    #[error("rendezvous: {message}")]
    Rendezvous {
        /// What failed, naming the store and the key.
        message: String,
        /// Whether a wait ran out (as opposed to the store failing).
        timed_out: bool,
    },
    /// A runtime thread could not be started or stopped, or an internal channel broke.
    #[error("internal: {0}")]
    Internal(String),
    /// A same-host operation (CUDA IPC, [`crate::ipc`]) or its rendezvous failed: the peer
    /// is named by process and GPU, `kind` says what class of failure, `what` the details.
    #[error("local peer {peer}: {kind}: {what}")]
    Local {
        /// The peer (`pid 4242, GPU 0000:8a:00.0`), or the rendezvous name before one is known.
        peer: String,
        /// The class of failure.
        kind: LocalErrorKind,
        /// What failed, with the call and values involved.
        what: String,
    },
}

/// Classes of [`Error::Local`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LocalErrorKind {
    /// No peer could be reached or admitted at the rendezvous name.
    Rendezvous,
    /// The peer's process or connection went away (or said goodbye).
    PeerClosed,
    /// The peer refused access: unknown, revoked or mismatching descriptor, wrong key, or a
    /// descriptor of another endpoint.
    Access,
    /// A CUDA call of the operation failed (opening the peer's handle, queuing a copy, a
    /// copy's event); the error names it.
    Cuda,
    /// A reply or a copy did not come within the configured timeout.
    Timeout,
    /// This side closed the connection.
    Closed,
    /// The peer broke the local protocol (a malformed or unexpected message).
    Protocol,
}

impl std::fmt::Display for LocalErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Rendezvous => "rendezvous failed",
            Self::PeerClosed => "peer gone",
            Self::Access => "access refused",
            Self::Cuda => "CUDA",
            Self::Timeout => "timed out",
            Self::Closed => "closed by this side",
            Self::Protocol => "protocol violation",
        })
    }
}

impl Error {
    /// The peer reported by the error, when it concerns one.
    pub fn peer(&self) -> Option<SocketAddr> {
        match self {
            Self::Plugin { peer, .. }
            | Self::Staging { peer, .. }
            | Self::Setup { peer, .. }
            | Self::Incompatible { peer, .. }
            | Self::Timeout { peer, .. }
            | Self::PeerClosed { peer, .. }
            | Self::Violation { peer, .. }
            | Self::Mismatch { peer, .. }
            | Self::Access { peer, .. }
            | Self::Closed { peer } => Some(*peer),
            Self::Control(e) => control_peer(e),
            _ => None,
        }
    }

    /// The channel named by the error, for data-path errors.
    pub fn channel(&self) -> Option<u16> {
        match self {
            Self::Plugin { channel, .. }
            | Self::Staging { channel, .. }
            | Self::Timeout { channel, .. }
            | Self::Mismatch { channel, .. } => Some(*channel),
            _ => None,
        }
    }

    /// The plugin's result code, for plugin failures.
    pub fn plugin_code(&self) -> Option<tcpx::ResultCode> {
        match self {
            Self::Plugin { source, .. }
            | Self::Setup { source, .. }
            | Self::Backend { source, .. } => source.code(),
            _ => None,
        }
    }

    /// True for a transfer timeout or a wait that ran out of time.
    pub fn is_timeout(&self) -> bool {
        match self {
            Self::Timeout { .. } | Self::WaitTimedOut(_) => true,
            Self::Rendezvous { timed_out, .. } => *timed_out,
            Self::Local { kind, .. } => *kind == LocalErrorKind::Timeout,
            Self::Control(e) => e.is_timeout(),
            Self::Setup { source, .. } => source.is_timeout(),
            _ => false,
        }
    }

    /// The class of a same-host failure ([`Error::Local`]).
    pub fn local_kind(&self) -> Option<LocalErrorKind> {
        match self {
            Self::Local { kind, .. } => Some(*kind),
            _ => None,
        }
    }

    /// The control-plane error code to send to the peer when this error ends a set-up.
    pub(crate) fn wire_code(&self) -> ErrorCode {
        match self {
            Self::Incompatible { .. } => ErrorCode::INCOMPATIBLE,
            Self::Setup { .. } | Self::Plugin { .. } | Self::Backend { .. } => ErrorCode::PLUGIN,
            Self::Control(_) | Self::Violation { .. } => ErrorCode::PROTOCOL,
            _ => ErrorCode::INTERNAL,
        }
    }
}

fn control_peer(e: &ControlError) -> Option<SocketAddr> {
    match e {
        ControlError::Connect { peer, .. }
        | ControlError::Timeout { peer, .. }
        | ControlError::Io { peer, .. }
        | ControlError::Closed { peer }
        | ControlError::Protocol { peer, .. }
        | ControlError::Malformed { peer, .. }
        | ControlError::Encode { peer, .. }
        | ControlError::Unexpected { peer, .. }
        | ControlError::Remote { peer, .. }
        | ControlError::ClosedByPeer { peer, .. }
        | ControlError::Broken { peer } => Some(*peer),
        ControlError::AcceptTimeout { .. } | ControlError::Accept { .. } => None,
    }
}

impl From<ControlError> for Error {
    fn from(e: ControlError) -> Self {
        Self::Control(Arc::new(e))
    }
}

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staging_errors_name_channel_direction_and_peer() {
        let source = tcpx::Error::new(
            "cuMemcpyDtoHAsync",
            tcpx::ErrorKind::Cuda(tcpx::cuda::CudaError::Driver {
                code: 700,
                name: "CUDA_ERROR_ILLEGAL_ADDRESS".into(),
            }),
            "GPU 0",
        );
        let peer: SocketAddr = "127.0.0.1:7700".parse().unwrap();
        let e = Error::Staging {
            channel: 3,
            direction: Direction::Send,
            peer,
            source: Arc::new(source),
        };
        let text = e.to_string();
        for want in [
            "channel 3",
            "send",
            "127.0.0.1:7700",
            "cuMemcpyDtoHAsync",
            "CUDA_ERROR_ILLEGAL_ADDRESS",
        ] {
            assert!(text.contains(want), "{text} lacks {want}");
        }
        assert_eq!((e.channel(), e.peer()), (Some(3), Some(peer)));
    }
}
