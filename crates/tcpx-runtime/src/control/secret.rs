//! [`random_secret`]: the per-endpoint secret of the metadata, from the OS's random source
//! (the secret's bytes are `tcpx-proto`'s, which does no IO).

use super::message::{Secret, SECRET_BYTES};

/// A fresh [`Secret`] from the operating system's random source (`/dev/urandom`), else from
/// the standard library's randomly seeded hasher keys mixed with the time.
pub fn random_secret() -> Secret {
    use std::io::Read;
    let mut bytes = [0u8; SECRET_BYTES];
    let from_os = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .is_ok();
    if !from_os {
        use std::hash::{BuildHasher, Hasher};
        for half in bytes.chunks_exact_mut(8) {
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u128(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos()),
            );
            half.copy_from_slice(&h.finish().to_le_bytes());
        }
    }
    Secret::from_bytes(bytes)
}
