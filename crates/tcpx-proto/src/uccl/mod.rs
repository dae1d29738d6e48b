//! The byte formats `tcpx.p2p` shares with UCCL scripts (written by tcpx; UCCL's layouts
//! where scripts depend on them):
//!
//! - [`metadata`]: UCCL's endpoint metadata, today's layout with the GPU bus id and the older
//!   one with the index;
//! - [`advert`]: the 64-byte advertisement blob of `advertise` / `write(..., meta)`;
//! - [`descs`]: the descriptor lists of the descriptor API (`get_serialized_descs`) and the
//!   keys inside them.

pub mod advert;
pub mod descs;
pub mod metadata;
