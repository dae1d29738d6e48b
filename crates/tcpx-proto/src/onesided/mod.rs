//! What a peer hands over to name memory in one-sided operations: [`Descriptor`] (26 bytes)
//! and [`RemoteSegment`] (a piece of one). The request payloads that carry them are in
//! [`crate::control::rma`].

mod descriptor;

pub use descriptor::{Descriptor, DescriptorError, RemoteSegment};
