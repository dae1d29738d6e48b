//! The control protocol's bytes: one plain TCP connection per peer pair carries these frames
//! (the runtime's `control::ControlConn` is the socket shell around them).
//!
//! - [`codec`]: sans-IO framing (magic, version, type, capped length) and its
//!   [`Decoder`](codec::Decoder);
//! - [`message`]: the messages ([`Message`](message::Message),
//!   [`EndpointInfo`](message::EndpointInfo)) and their payload encoding;
//! - [`rma`]: the payloads of the one-sided messages ([`rma::WriteRequest`] and its kin).

pub mod codec;
pub mod message;
pub mod rma;
