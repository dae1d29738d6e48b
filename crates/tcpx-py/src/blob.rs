//! The byte formats that `tcpx.p2p` shares with UCCL scripts live in `tcpx-proto`
//! (`tcpx_proto::uccl`, fuzzed there); this re-exports them and turns their errors into
//! the bindings' failures.

use std::net::SocketAddr;

pub use tcpx_proto::uccl::advert::{Advert, ADVERT_BYTES};
pub use tcpx_proto::uccl::metadata::uccl_metadata;

use crate::errors::{Failure, Outcome};

/// UCCL's metadata (either layout) as (address, GPU bus id or older index); a bad argument
/// naming what is wrong otherwise.
pub fn parse_uccl_metadata(bytes: &[u8]) -> Outcome<(SocketAddr, String)> {
    tcpx_proto::uccl::metadata::parse_uccl_metadata(bytes).map_err(|e| Failure::bad(e.to_string()))
}

/// [`Advert::decode`], failing as a bad argument.
pub fn decode_advert(bytes: &[u8]) -> Outcome<Advert> {
    Advert::decode(bytes).map_err(|e| Failure::bad(e.to_string()))
}
