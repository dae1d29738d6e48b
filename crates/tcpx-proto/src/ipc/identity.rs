//! Who and where an endpoint is on its host: [`LocalInfo`] (the blob peers exchange to decide
//! whether the same-host route applies) and [`LocalAddr`] (where to reach its rendezvous
//! socket). The runtime decides the route and opens the sockets.
//!
//! `LocalInfo`'s byte form (little-endian):
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

use std::fmt;

use super::MAX_BUS_ID;
use crate::wire::{read_bounded, Reader, TooLong, WireError, Writer};

/// Longest rendezvous name (an abstract Unix socket name has at most 107 bytes).
pub const MAX_NAME: usize = 107;
/// Longest hostname carried.
pub const MAX_HOSTNAME: usize = 255;
/// Longest encoded [`LocalInfo`].
pub const MAX_LOCAL_INFO: usize = 4 + 1 + 16 + 4 + 4 + 8 + 6 + MAX_NAME + MAX_BUS_ID + MAX_HOSTNAME;

const MAGIC: [u8; 4] = *b"TXLI";
const VERSION: u8 = 1;

/// What a peer needs to decide that this endpoint is on its host and to reach it there:
/// exchange [`to_bytes`](Self::to_bytes) out of band (the NIXL plugin carries it in its
/// connection info), then the runtime's `Endpoint::local_route` and `Endpoint::connect_local`
/// with [`addr`](Self::addr).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalInfo {
    /// The kernel's boot id: equal boot ids mean one running kernel, so one host (containers
    /// included). All zero when it could not be read.
    pub boot_id: [u8; 16],
    /// The process's real user id (the rendezvous admits only the same user).
    pub uid: u32,
    /// The process id.
    pub pid: u32,
    /// A random id of the endpoint (descriptors name their owner by it).
    pub instance: u64,
    /// The endpoint's rendezvous name (an abstract Unix socket).
    pub name: String,
    /// The PCI bus id of the endpoint's GPU (`0000:8a:00.0`), when it has one.
    pub gpu: Option<String>,
    /// The hostname (for messages; the boot id decides).
    pub hostname: String,
}

impl LocalInfo {
    /// Where to reach this endpoint's rendezvous.
    pub fn addr(&self) -> LocalAddr {
        LocalAddr::Name(self.name.clone())
    }

    /// True when both describe processes of one running kernel and one user: the condition
    /// for the rendezvous (abstract Unix sockets, peer credentials) to work. A zero boot id
    /// (unknown) is never the same host.
    pub fn same_host(&self, other: &LocalInfo) -> bool {
        self.boot_id != [0; 16] && self.boot_id == other.boot_id && self.uid == other.uid
    }

    /// The encoding in the module docs; fails only when a field is longer than allowed.
    pub fn to_bytes(&self) -> Result<Vec<u8>, TooLong> {
        let mut out = Vec::with_capacity(64 + self.name.len() + self.hostname.len());
        let mut w = Writer(&mut out);
        w.bytes(&MAGIC);
        w.u8(VERSION);
        w.bytes(&self.boot_id);
        w.u32(self.uid);
        w.u32(self.pid);
        w.u64(self.instance);
        bounded(&mut w, "name", &self.name, MAX_NAME)?;
        bounded(&mut w, "gpu", self.gpu.as_deref().unwrap_or(""), MAX_BUS_ID)?;
        bounded(&mut w, "hostname", &self.hostname, MAX_HOSTNAME)?;
        Ok(out)
    }

    /// Decodes [`to_bytes`](Self::to_bytes)' output; any other bytes are an error naming the
    /// field, never a panic.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(bytes);
        if r.array::<4>("magic")? != MAGIC {
            return Err(WireError::Invalid {
                field: "magic",
                why: "not tcpx local endpoint info (expected \"TXLI\")",
            });
        }
        if r.u8("version")? != VERSION {
            return Err(WireError::Invalid {
                field: "version",
                why: "unsupported local info version (this side reads 1)",
            });
        }
        let boot_id = r.array::<16>("boot_id")?;
        let uid = r.u32("uid")?;
        let pid = r.u32("pid")?;
        let instance = r.u64("instance")?;
        let name = read_bounded(&mut r, "name", MAX_NAME)?;
        if name.is_empty() {
            return Err(WireError::Invalid {
                field: "name",
                why: "empty rendezvous name",
            });
        }
        let gpu = read_bounded(&mut r, "gpu", MAX_BUS_ID)?;
        let hostname = read_bounded(&mut r, "hostname", MAX_HOSTNAME)?;
        r.finish()?;
        Ok(Self {
            boot_id,
            uid,
            pid,
            instance,
            name,
            gpu: (!gpu.is_empty()).then_some(gpu),
            hostname,
        })
    }
}

fn bounded(w: &mut Writer<'_>, field: &'static str, v: &str, max: usize) -> Result<(), TooLong> {
    if v.len() > max {
        return Err(TooLong {
            field,
            len: v.len(),
            max,
        });
    }
    w.str16(field, v)
}

/// Where a same-host endpoint listens: its own name ([`LocalInfo::addr`], the runtime's
/// `Endpoint::local_addr`), or the name claimed by the first endpoint of a GPU (UCCL's
/// `connect_local(remote_gpu_bdf)`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum LocalAddr {
    /// An endpoint's own rendezvous name (unique per endpoint).
    Name(String),
    /// The endpoint that claimed the GPU with this PCI bus id (any spelling
    /// [`normalize_bus_id`](crate::bus_id::normalize_bus_id) reads): the first endpoint of this user on that GPU.
    Gpu(String),
}

impl fmt::Display for LocalAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LocalAddr::Name(n) => write!(f, "@{n}"),
            LocalAddr::Gpu(bus) => write!(f, "GPU {bus}"),
        }
    }
}
