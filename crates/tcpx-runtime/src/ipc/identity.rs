//! Who and where an endpoint is on its host: [`LocalInfo`] (the blob peers exchange to decide
//! whether the same-host route applies), [`LocalAddr`] (where to reach its rendezvous
//! socket) and [`LocalRoute`] (the decision).
//!
//! (`LocalInfo` and `LocalAddr` are `tcpx-proto`'s, re-exported.) `LocalInfo`'s byte form (little-endian):
//!
//! | size | field |
//! |---|---|
//! | 4 | magic `b"TXLI"` |
//! | 1 | format version (1) |
//! | 16 | boot id (`/proc/sys/kernel/random/boot_id`; zero when unknown) |
//! | 4 | uid |
//! | 4 | pid |
//! | 8 | endpoint instance id |
//! | 2 + n | rendezvous name (u16 length, UTF-8, at most [`MAX_NAME`]) |
//! | 2 + n | GPU PCI bus id (u16 length, empty when none) |
//! | 2 + n | hostname (u16 length, at most [`MAX_HOSTNAME`]) |

pub use tcpx_proto::ipc::identity::{LocalAddr, LocalInfo, MAX_HOSTNAME, MAX_LOCAL_INFO, MAX_NAME};
pub use tcpx_proto::ipc::MAX_BUS_ID;

/// The abstract socket name `addr` resolves to for user `uid`.
pub(crate) fn socket_name(addr: &LocalAddr, uid: u32) -> Result<String, crate::Error> {
    match addr {
        LocalAddr::Name(n) => {
            if n.is_empty() || n.len() > MAX_NAME {
                return Err(crate::Error::InvalidArgument(format!(
                    "local rendezvous name of {} bytes (1..={MAX_NAME} allowed)",
                    n.len()
                )));
            }
            Ok(n.clone())
        }
        LocalAddr::Gpu(bus) => {
            let bus = normalize_bus_id(bus).ok_or_else(|| {
                crate::Error::InvalidArgument(format!(
                    "`{bus}` is not a PCI bus id (domain:bus:device.function in hex)"
                ))
            })?;
            Ok(gpu_socket_name(uid, &bus))
        }
    }
}

/// The rendezvous name of the endpoint whose control listener is `control` (unique on the
/// host: no two listeners share an address and port).
pub(crate) fn endpoint_socket_name(uid: u32, control: std::net::SocketAddr) -> String {
    format!("tcpx-ipc/{uid}/ep/{control}")
}

/// The name the first endpoint of user `uid` on GPU `bus` (normalized) claims.
pub(crate) fn gpu_socket_name(uid: u32, bus: &str) -> String {
    format!("tcpx-ipc/{uid}/gpu/{bus}")
}

pub use tcpx_proto::bus_id::normalize_bus_id;

/// Whether two endpoints should move GPU memory through CUDA IPC or the network
/// ([`crate::Endpoint::local_route`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LocalRoute {
    /// Same host, same user, CUDA here: use [`crate::Endpoint::connect_local`] and the
    /// `*_ipc` operations for GPU memory on both sides.
    Ipc,
    /// Use the network path; the string says why not IPC.
    Network(String),
}

/// This host's boot id, or zeros when it cannot be read.
pub(crate) fn boot_id() -> [u8; 16] {
    let Ok(text) = std::fs::read_to_string("/proc/sys/kernel/random/boot_id") else {
        return [0; 16];
    };
    let hex: Vec<u8> = text.bytes().filter(u8::is_ascii_hexdigit).collect();
    if hex.len() != 32 {
        return [0; 16];
    }
    let mut out = [0u8; 16];
    for (i, pair) in hex.chunks_exact(2).enumerate() {
        // Both are ASCII hex digits (filtered above), so this parses.
        let s = std::str::from_utf8(pair).unwrap_or("00");
        out[i] = u8::from_str_radix(s, 16).unwrap_or(0);
    }
    out
}

/// This host's name (`/proc/sys/kernel/hostname`), or `"?"`.
pub(crate) fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().chars().take(MAX_HOSTNAME).collect())
        .unwrap_or_else(|_| "?".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn info() -> LocalInfo {
        LocalInfo {
            boot_id: [3; 16],
            uid: 1000,
            pid: 4242,
            instance: 99,
            name: "tcpx-ipc/1000/ep/127.0.0.1:5000".into(),
            gpu: Some("0000:8a:00.0".into()),
            hostname: "a3-1".into(),
        }
    }

    #[test]
    fn round_trip_and_same_host() {
        let a = info();
        assert_eq!(LocalInfo::from_bytes(&a.to_bytes().unwrap()).unwrap(), a);
        let mut b = a.clone();
        b.gpu = None;
        assert_eq!(LocalInfo::from_bytes(&b.to_bytes().unwrap()).unwrap(), b);
        assert!(a.same_host(&b));
        b.uid = 0;
        assert!(!a.same_host(&b));
        let mut unknown = a.clone();
        unknown.boot_id = [0; 16];
        assert!(!unknown.same_host(&unknown.clone()));
        let mut long = a.clone();
        long.name = "x".repeat(MAX_NAME + 1);
        assert!(long.to_bytes().is_err());
    }

    #[test]
    fn this_host_has_a_boot_id() {
        // Linux always has one; the test documents that same_host works here.
        assert_ne!(boot_id(), [0; 16]);
        assert!(!hostname().is_empty());
    }

    #[test]
    fn bus_ids_in_every_spelling() {
        for (text, want) in [
            ("0000:8a:00.0", "0000:8a:00.0"),
            ("00000000:8A:00.0", "0000:8a:00.0"),
            ("8a:00.0", "0000:8a:00.0"),
            (" 0001:04:1f.7 ", "0001:04:1f.7"),
        ] {
            assert_eq!(normalize_bus_id(text).as_deref(), Some(want), "{text}");
        }
        for bad in [
            "",
            "8a",
            "8a:00",
            "zz:00.0",
            "0000:8a:20.0",
            "0000:8a:00.8",
            "1:2:3:4.0",
        ] {
            assert_eq!(normalize_bus_id(bad), None, "{bad}");
        }
        assert!(socket_name(&LocalAddr::Gpu("nope".into()), 1).is_err());
        assert_eq!(
            socket_name(&LocalAddr::Gpu("00000000:8A:00.0".into()), 7).unwrap(),
            "tcpx-ipc/7/gpu/0000:8a:00.0"
        );
    }

    proptest! {
        #[test]
        fn any_bytes_decode_or_fail(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            let _ = LocalInfo::from_bytes(&bytes);
        }

        #[test]
        fn any_text_normalizes_or_not(text in ".{0,24}") {
            if let Some(n) = normalize_bus_id(&text) {
                prop_assert_eq!(normalize_bus_id(&n), Some(n.clone()));
            }
        }

        #[test]
        fn valid_info_round_trips(
            boot in any::<[u8; 16]>(), uid in any::<u32>(), pid in any::<u32>(),
            instance in any::<u64>(), name in "[a-z0-9/.:]{1,100}",
            gpu in proptest::option::of("[0-9a-f]{4}:[0-9a-f]{2}:[0-1][0-9a-f]\\.[0-7]"),
            hostname in "[a-z0-9-]{0,60}",
        ) {
            let i = LocalInfo { boot_id: boot, uid, pid, instance, name, gpu, hostname };
            prop_assert_eq!(LocalInfo::from_bytes(&i.to_bytes().unwrap()).unwrap(), i);
        }
    }
}
