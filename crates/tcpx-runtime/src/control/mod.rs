//! The control plane: one plain TCP connection per peer pair, separate from the data comms.
//!
//! - [`codec`]: sans-IO framing (magic, version, type, capped length) and its [`Decoder`];
//! - [`message`]: the messages ([`Message`], [`EndpointInfo`]) and their payload encoding;
//! - [`conn`]: [`ControlConn`], the blocking socket shell with a timeout on every operation;
//! - [`tx`]: [`ControlTx`], a connection's sending half shared by many threads, with the
//!   flusher that writes what they queue;
//! - [`metadata`]: [`EndpointMetadata`], the blob passed out of band to find a peer;
//! - [`rma`]: the payloads of the one-sided messages ([`rma::WriteRequest`] and its kin).
//!
//! Everything but `conn` is `tcpx-proto`'s (no IO, fuzzed), re-exported here under its old
//! paths.
//!
//! A typical bootstrap: the connecting side sends `Hello` (presenting the secret from the
//! accepting side's [`EndpointMetadata`]); the accepting side answers `Hello` once the first
//! passed admission; both send `ConnectHandles` with one listen handle per channel, connect
//! their comms and send `Ready`; either side ends with `Close` (or `Error`).

pub mod conn;
mod secret;
pub mod tx;

// The bytes themselves live in `tcpx-proto` (sans-IO, fuzzed); they keep their paths here.
pub use tcpx_proto::control::{codec, message, rma};
pub use tcpx_proto::{metadata, wire};

pub use codec::{CodecError, Decoder, EncodeError, Frame, FrameHeader, PROTOCOL_VERSION};
pub use conn::{ControlConn, ControlError};
pub use message::{
    ConnectHandle, EndpointInfo, ErrorCode, Message, MessageError, MessageType, Secret,
    SECRET_BYTES,
};
pub use metadata::{EndpointMetadata, MetadataError};
pub use secret::random_secret;
pub use tx::ControlTx;
pub use wire::{TooLong, WireError};
