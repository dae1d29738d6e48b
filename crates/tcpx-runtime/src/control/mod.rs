//! The control plane: one plain TCP connection per peer pair, separate from the data comms.
//!
//! - [`codec`]: sans-IO framing (magic, version, type, capped length) and its [`Decoder`];
//! - [`message`]: the messages ([`Message`], [`EndpointInfo`]) and their payload encoding;
//! - [`conn`]: [`ControlConn`], the blocking socket shell with a timeout on every operation;
//! - [`metadata`]: [`EndpointMetadata`], the blob passed out of band to find a peer;
//! - [`rma`]: the payloads of the one-sided messages ([`rma::WriteRequest`] and its kin),
//!   here rather than in [`crate::onesided`] because the messages carry them: the control
//!   plane sits below everything that uses it.
//!
//! A typical bootstrap: the connecting side sends `Hello` (presenting the secret from the
//! accepting side's [`EndpointMetadata`]); the accepting side answers `Hello` once the first
//! passed admission; both send `ConnectHandles` with one listen handle per channel, connect
//! their comms and send `Ready`; either side ends with `Close` (or `Error`).

pub mod codec;
pub mod conn;
pub mod message;
pub mod metadata;
pub mod rma;
pub(crate) mod wire;

pub use codec::{CodecError, Decoder, EncodeError, Frame, FrameHeader, PROTOCOL_VERSION};
pub use conn::{ControlConn, ControlError};
pub use message::{
    ConnectHandle, EndpointInfo, ErrorCode, Message, MessageError, MessageType, Secret,
    SECRET_BYTES,
};
pub use metadata::{EndpointMetadata, MetadataError};
pub use wire::{TooLong, WireError};
