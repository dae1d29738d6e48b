//! [`Descriptor`] and [`RemoteSegment`] (their bytes are `tcpx-proto`'s), and the random
//! access keys this side puts in its descriptors.

use std::io::Read;

use crate::error::{Error, Result};

pub use tcpx_proto::onesided::{Descriptor, DescriptorError, RemoteSegment};

/// A 64-bit access key from the kernel's random source (`/dev/urandom`, std only).
pub(crate) fn random_key() -> Result<u64> {
    let mut bytes = [0u8; 8];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(|e| Error::Internal(format!("cannot read /dev/urandom for an access key: {e}")))?;
    Ok(u64::from_le_bytes(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_differ() {
        assert_ne!(random_key().unwrap(), random_key().unwrap());
    }
}
