//! FNV-1a, the checksum of the byte formats in [`crate::uccl::advert`] and
//! [`crate::uccl::descs`]: it
//! turns truncated or corrupted input into a clear error before anything reaches a peer (it
//! is not a defence against forgery: the access key inside a descriptor is).

/// FNV-1a (64 bits) of `bytes`.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}
