//! [`ConnectHandle`]: the 128 opaque bytes a listener produces and a connector consumes, carried
//! out of band (our control plane, or the application's own channel).

use tcpx_sys::HANDLE_SIZE;

use crate::error::{Error, Result};

/// A listen comm's connect handle (128 bytes, opaque). Serializes as a lowercase hex string.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConnectHandle(pub [u8; HANDLE_SIZE]);

impl ConnectHandle {
    /// Size in bytes.
    pub const SIZE: usize = HANDLE_SIZE;

    /// The raw bytes.
    pub fn as_bytes(&self) -> &[u8; HANDLE_SIZE] {
        &self.0
    }

    /// Builds a handle from exactly 128 bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let array: [u8; HANDLE_SIZE] = bytes.try_into().map_err(|_| {
            Error::invalid(
                "ConnectHandle::from_bytes",
                format!("expected {HANDLE_SIZE} bytes, got {}", bytes.len()),
            )
        })?;
        Ok(Self(array))
    }

    /// Lowercase hex (256 characters).
    pub fn to_hex(&self) -> String {
        use std::fmt::Write;
        self.0
            .iter()
            .fold(String::with_capacity(2 * HANDLE_SIZE), |mut s, b| {
                let _ = write!(s, "{b:02x}");
                s
            })
    }

    /// Parses the hex produced by [`ConnectHandle::to_hex`].
    pub fn from_hex(hex: &str) -> Result<Self> {
        let hex = hex.trim();
        if hex.len() != 2 * HANDLE_SIZE || !hex.is_ascii() {
            return Err(Error::invalid(
                "ConnectHandle::from_hex",
                format!(
                    "expected {} hex digits, got {} characters",
                    2 * HANDLE_SIZE,
                    hex.len()
                ),
            ));
        }
        let mut out = [0u8; HANDLE_SIZE];
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| {
                Error::invalid(
                    "ConnectHandle::from_hex",
                    format!("not a hex digit pair at offset {}", 2 * i),
                )
            })?;
        }
        Ok(Self(out))
    }
}

impl std::fmt::Debug for ConnectHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ConnectHandle({}…)", &self.to_hex()[..16])
    }
}

impl serde::Serialize for ConnectHandle {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> serde::Deserialize<'de> for ConnectHandle {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Self::from_hex(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn hex_round_trips(bytes in proptest::collection::vec(any::<u8>(), HANDLE_SIZE)) {
            let h = ConnectHandle::from_bytes(&bytes).unwrap();
            prop_assert_eq!(ConnectHandle::from_hex(&h.to_hex()).unwrap(), h);
        }

        #[test]
        fn arbitrary_strings_never_panic(s in ".{0,300}") {
            let _ = ConnectHandle::from_hex(&s);
        }
    }

    #[test]
    fn wrong_lengths_are_refused_with_the_length() {
        let err = ConnectHandle::from_bytes(&[0; 12]).unwrap_err();
        assert!(err.to_string().contains("got 12"), "{err}");
        assert!(ConnectHandle::from_hex("zz").is_err());
    }
}
