//! Network devices: which interfaces the plugin exposes, read once from the environment at
//! `init`, and their properties.
//!
//! Selection follows NCCL's `NCCL_SOCKET_IFNAME` syntax so users can reuse the settings they
//! know: a comma-separated list of interface-name prefixes; a leading `^` turns the list into an
//! exclude list; a leading `=` requires exact names. `TCPX_SOCKET_IFNAME` wins over
//! `NCCL_SOCKET_IFNAME`. Without either, every non-loopback interface that is up, else the
//! loopback interfaces. One address per interface: IPv4 interfaces first, then interfaces that
//! only have an IPv6 address (link-local IPv6 is skipped: it needs a scope to be reachable and
//! is never what a data NIC should advertise).

use std::ffi::{CStr, CString};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::Path;
use std::sync::OnceLock;

use tcpx_sys::ResultCode;

use crate::cuda::Gpu;
use crate::log::{log_info, log_warn};

/// Link speed reported when `/sys/class/net/<if>/speed` is missing or says "unknown" (-1), as it
/// does for `lo`, veth pairs and many virtual NICs: 100 Gbps, so NCCL's topology search treats
/// such a device as a fast path rather than dismissing it (its own socket transport assumes
/// 10 Gbps, which makes it pick absurdly few channels on loopback).
pub const DEFAULT_SPEED_MBPS: i32 = 100_000;

/// Most data sockets per comm (TCPX's limit as well).
pub const MAX_NSOCKS: usize = 8;

/// One exposed interface. The C strings live as long as the process (the device list is a
/// process-wide static), so `getProperties` can hand out their pointers.
#[derive(Debug)]
pub(crate) struct Device {
    /// Interface name, e.g. `eth1`.
    pub name: CString,
    /// Canonical sysfs path of the PCI function behind the interface, if it has one.
    pub pci_path: Option<CString>,
    /// The address listeners of this device bind to.
    pub addr: IpAddr,
    /// IPv6 scope id (0 for IPv4 and global IPv6).
    pub scope_id: u32,
    /// Link speed in Mbps.
    pub speed_mbps: i32,
}

/// What `init` read from the environment and found on the machine.
#[derive(Debug)]
pub(crate) struct Config {
    /// The exposed devices, in device-index order.
    pub devices: Vec<Device>,
    /// Data sockets per comm that listeners of this process advertise.
    pub nsocks: usize,
    /// Devmem emulation (`TCPX_SOCKET_DEVMEM=1`): the GPU whose bounce buffers receive CUDA
    /// payloads. `None`: host memory only (the default).
    pub devmem: Option<Gpu>,
    /// Bytes (or the rest of a part, if less) a receive socket found empty waits to have
    /// queued before it is read again, in parts of at least that size ([`READ_BATCH_ENV`]; 0:
    /// read whatever arrived).
    pub read_batch: usize,
}

/// Environment variable setting how many bytes of a large payload part (or the rest of it, if
/// less) a receive socket found empty waits for before it is read again (`SO_RCVLOWAT`; bytes,
/// `0` turns it off; parts smaller than this, and the parts of a message with no receive
/// posted behind it — a lone transfer, whose reader should copy in step with the sender —
/// are read as they arrive). Default [`DEFAULT_READ_BATCH`] where the process may use 4 cores
/// or more, else 0.
pub const READ_BATCH_ENV: &str = "TCPX_SOCKET_READ_BATCH";
/// Default [`READ_BATCH_ENV`]: 256 KiB. Measured on loopback, two processes, 8 channels,
/// against reading whatever arrived: on a 16-core H100 host, 1–256 MiB messages moved about
/// 10 % more bytes per second in each of three alternating runs (median ratio to raw TCP
/// 0.96–1.04 against 0.86–0.91); on a 32-core host, six rounds, 16 MiB 28.9 against 24.5 GB/s,
/// 64 MiB 24.5 against 21.8, 256 MiB 23.0 against 21.0. Messages whose parts are smaller
/// than the batch never wait for one.
pub const DEFAULT_READ_BATCH: usize = 256 << 10;

/// Environment variable switching devmem emulation on (`1`, `true`, `yes`, `on`).
pub const DEVMEM_ENV: &str = "TCPX_SOCKET_DEVMEM";
/// Environment variable choosing the GPU (CUDA ordinal) of devmem emulation; default 0.
pub const DEVMEM_GPU_ENV: &str = "TCPX_SOCKET_DEVMEM_GPU";

static CONFIG: OnceLock<Result<Config, String>> = OnceLock::new();

/// Reads the environment and enumerates interfaces on the first call; later calls return the
/// same answer (the plugin reads its environment once, like NCCL's own transports).
pub(crate) fn init() -> Result<&'static Config, ResultCode> {
    let cfg = CONFIG.get_or_init(|| {
        let cfg = discover()?;
        for (i, d) in cfg.devices.iter().enumerate() {
            log_info!(
                "tcpx-socket: device {i}: {} {} speed {} Mbps pci {}",
                d.name.to_string_lossy(),
                d.addr,
                d.speed_mbps,
                d.pci_path
                    .as_deref()
                    .map(|p| p.to_string_lossy().into_owned())
                    .unwrap_or_else(|| "-".into())
            );
        }
        log_info!("tcpx-socket: {} data socket(s) per comm", cfg.nsocks);
        match &cfg.devmem {
            Some(gpu) => log_info!(
                "tcpx-socket: devmem emulation on ({DEVMEM_ENV}): CUDA receives land in bounce \
                 buffers of GPU {} and must be unpacked by the consumer (netDeviceType UNPACK v7)",
                gpu.ordinal
            ),
            None => log_info!("tcpx-socket: host memory only (devmem emulation off)"),
        }
        Ok(cfg)
    });
    match cfg {
        Ok(cfg) => Ok(cfg),
        Err(msg) => {
            log_warn!("tcpx-socket: init failed: {msg}");
            Err(ResultCode::SYSTEM_ERROR)
        }
    }
}

/// The configuration, if `init` succeeded.
pub(crate) fn config() -> Result<&'static Config, ResultCode> {
    match CONFIG.get() {
        Some(Ok(cfg)) => Ok(cfg),
        Some(Err(_)) | None => {
            log_warn!("tcpx-socket: called before a successful init");
            Err(ResultCode::INVALID_USAGE)
        }
    }
}

/// The device `dev`, or InvalidArgument naming the index.
pub(crate) fn device(dev: i32) -> Result<&'static Device, ResultCode> {
    let cfg = config()?;
    usize::try_from(dev)
        .ok()
        .and_then(|i| cfg.devices.get(i))
        .ok_or_else(|| {
            log_warn!(
                "tcpx-socket: no device {dev} (this process exposes {})",
                cfg.devices.len()
            );
            ResultCode::INVALID_ARGUMENT
        })
}

fn env_nonempty(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

fn discover() -> Result<Config, String> {
    let filter = env_nonempty("TCPX_SOCKET_IFNAME")
        .or_else(|| env_nonempty("NCCL_SOCKET_IFNAME"))
        .map(|s| IfFilter::parse(&s));
    let nsocks = nsocks_from_env();
    let ifaces = interfaces()?;
    let chosen: Vec<&Interface> = match &filter {
        Some(f) => ifaces.iter().filter(|i| f.matches(&i.name)).collect(),
        None => {
            let real: Vec<&Interface> = ifaces.iter().filter(|i| !i.loopback).collect();
            if real.is_empty() {
                ifaces.iter().filter(|i| i.loopback).collect()
            } else {
                real
            }
        }
    };
    if chosen.is_empty() {
        let names: Vec<&str> = ifaces.iter().map(|i| i.name.as_str()).collect();
        return Err(match filter {
            Some(f) => format!(
                "no interface that is up matches {:?} (interfaces up: {names:?})",
                f.source
            ),
            None => "no interface is up".to_string(),
        });
    }
    let devices = chosen
        .into_iter()
        .map(|i| Device {
            name: CString::new(i.name.clone()).unwrap_or_default(),
            pci_path: pci_path(&i.name),
            addr: i.addr,
            scope_id: i.scope_id,
            speed_mbps: speed_mbps(&i.name),
        })
        .collect();
    let devmem = devmem_from_env()?;
    crate::fault::configure()?;
    Ok(Config {
        devices,
        nsocks,
        devmem,
        read_batch: read_batch_from_env(),
    })
}

/// Opens the GPU when devmem emulation is requested; an error (no driver, bad ordinal) fails
/// `init` with a message saying how to run without it.
fn devmem_from_env() -> Result<Option<Gpu>, String> {
    if !crate::switch::is_on(std::env::var(DEVMEM_ENV).ok().as_deref()) {
        return Ok(None);
    }
    let ordinal = match env_nonempty(DEVMEM_GPU_ENV) {
        None => 0,
        Some(v) => v
            .trim()
            .parse::<usize>()
            .map_err(|_| format!("{DEVMEM_GPU_ENV}={v:?} is not a CUDA device ordinal"))?,
    };
    Gpu::open(ordinal).map(Some).map_err(|e| {
        format!(
            "{DEVMEM_ENV}=1 needs a CUDA driver and GPU: {e} (unset {DEVMEM_ENV} to move host \
             memory only)"
        )
    })
}

/// The devmem GPU, when emulation is on and `init` succeeded.
pub(crate) fn devmem_gpu() -> Option<&'static Gpu> {
    match CONFIG.get() {
        Some(Ok(cfg)) => cfg.devmem.as_ref(),
        _ => None,
    }
}

/// `TCPX_SOCKET_NSOCKS`, else `NCCL_NSOCKS_PERTHREAD × NCCL_SOCKET_NTHREADS` when either is set
/// (the other counting as 1), else 1; clamped to 1..=8.
fn nsocks_from_env() -> usize {
    fn num(name: &str) -> Option<usize> {
        let v = env_nonempty(name)?;
        match v.trim().parse::<usize>() {
            Ok(n) => Some(n),
            Err(_) => {
                log_warn!("tcpx-socket: ignoring {name}={v:?}: not a non-negative integer");
                None
            }
        }
    }
    let n = num("TCPX_SOCKET_NSOCKS").unwrap_or_else(|| {
        let per = num("NCCL_NSOCKS_PERTHREAD");
        let threads = num("NCCL_SOCKET_NTHREADS");
        match (per, threads) {
            (None, None) => 1,
            (p, t) => p.unwrap_or(1).saturating_mul(t.unwrap_or(1)),
        }
    });
    clamp_nsocks(n)
}

/// [`READ_BATCH_ENV`] in bytes, else [`DEFAULT_READ_BATCH`]; a value that is not a
/// non-negative integer is ignored with a warning.
fn read_batch_from_env() -> usize {
    let default = default_read_batch();
    let Some(v) = env_nonempty(READ_BATCH_ENV) else {
        return default;
    };
    v.trim().parse::<usize>().unwrap_or_else(|_| {
        log_warn!(
            "tcpx-socket: ignoring {READ_BATCH_ENV}={v:?}: not a byte count; using {default}"
        );
        default
    })
}

/// Cores below which receive sockets read whatever arrived by default.
const MIN_CORES_TO_BATCH: usize = 4;

/// [`DEFAULT_READ_BATCH`] where this process may run on at least [`MIN_CORES_TO_BATCH`] cores,
/// else 0. With fewer, the sending and receiving threads of a local transfer take turns on the
/// same cores, and a receiver that waits for a batch only delays the sender's next turn: on a
/// 2-core host 1 MiB messages fell from 9.3 to 7.0 GB/s with batches (16 and 256 MiB level).
fn default_read_batch() -> usize {
    match std::thread::available_parallelism() {
        Ok(n) if n.get() >= MIN_CORES_TO_BATCH => DEFAULT_READ_BATCH,
        _ => 0,
    }
}

/// Clamps a requested socket count to what a comm supports.
pub(crate) fn clamp_nsocks(n: usize) -> usize {
    n.clamp(1, MAX_NSOCKS)
}

/// An interface name filter in NCCL's syntax.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct IfFilter {
    source: String,
    exclude: bool,
    exact: bool,
    names: Vec<String>,
}

impl IfFilter {
    /// Parses `[^][=]name[:port],name…` (a `:port` suffix, allowed by NCCL, is ignored).
    pub(crate) fn parse(spec: &str) -> Self {
        let source = spec.to_string();
        let mut rest = spec.trim();
        let exclude = rest.starts_with('^');
        if exclude {
            rest = &rest[1..];
        }
        let exact = rest.starts_with('=');
        if exact {
            rest = &rest[1..];
        }
        let names = rest
            .split(',')
            .map(|n| n.split(':').next().unwrap_or("").trim().to_string())
            .filter(|n| !n.is_empty())
            .collect();
        Self {
            source,
            exclude,
            exact,
            names,
        }
    }

    /// Whether interface `name` is selected.
    pub(crate) fn matches(&self, name: &str) -> bool {
        let hit = self.names.iter().any(|n| {
            if self.exact {
                name == n
            } else {
                name.starts_with(n.as_str())
            }
        });
        hit != self.exclude
    }
}

/// A network interface that is up, with the one address the plugin would use on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interface {
    /// The interface name (`eth1`, `lo`).
    pub name: String,
    /// Its first IPv4 address, else its first IPv6 address that is not link-local.
    pub addr: IpAddr,
    /// The IPv6 scope id (0 for IPv4).
    pub scope_id: u32,
    /// A loopback interface.
    pub loopback: bool,
}

/// Interfaces that are up, one address each: IPv4 ones in `getifaddrs` order, then IPv6-only
/// ones. Link-local IPv6 addresses are skipped (a peer would need their scope id).
///
/// This is the one `getifaddrs` walk of the workspace: the plugin picks its devices from it, and
/// the runtime finds the address to advertise for a named interface through `tcpx`.
pub fn interfaces() -> Result<Vec<Interface>, String> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head into `head` and returns 0, or -1 with errno.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(format!(
            "getifaddrs failed: {}",
            std::io::Error::last_os_error()
        ));
    }
    let mut v4 = Vec::new();
    let mut v6 = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, not yet freed.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        if ifa.ifa_flags & libc::IFF_UP as u32 == 0 {
            continue;
        }
        // SAFETY: a non-NULL ifa_name is a NUL-terminated string owned by the list.
        let name = unsafe { CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        let loopback = ifa.ifa_flags & libc::IFF_LOOPBACK as u32 != 0;
        // SAFETY: ifa_addr is non-NULL and points at a sockaddr whose family field is valid.
        let family = i32::from(unsafe { (*ifa.ifa_addr).sa_family });
        if family == libc::AF_INET {
            // SAFETY: the family says this is a sockaddr_in.
            let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
            let ip = Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
            v4.push(Interface {
                name,
                addr: IpAddr::V4(ip),
                scope_id: 0,
                loopback,
            });
        } else if family == libc::AF_INET6 {
            // SAFETY: the family says this is a sockaddr_in6.
            let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
            let ip = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
            if (ip.segments()[0] & 0xffc0) == 0xfe80 {
                continue;
            }
            v6.push(Interface {
                name,
                addr: IpAddr::V6(ip),
                scope_id: sin6.sin6_scope_id,
                loopback,
            });
        }
    }
    // SAFETY: `head` came from a successful getifaddrs and is freed once; no reference into
    // the list outlives this point (names were copied).
    unsafe { libc::freeifaddrs(head) };
    let mut out: Vec<Interface> = Vec::new();
    for i in v4.into_iter().chain(v6) {
        if !out.iter().any(|o| o.name == i.name) {
            out.push(i);
        }
    }
    Ok(out)
}

fn pci_path(ifname: &str) -> Option<CString> {
    let link = Path::new("/sys/class/net").join(ifname).join("device");
    let canon = std::fs::canonicalize(link).ok()?;
    CString::new(canon.to_string_lossy().into_owned()).ok()
}

fn speed_mbps(ifname: &str) -> i32 {
    let path = Path::new("/sys/class/net").join(ifname).join("speed");
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.trim().parse::<i32>().ok())
        .filter(|&s| s > 0)
        .unwrap_or(DEFAULT_SPEED_MBPS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filter_prefix_exact_and_exclude() {
        let f = IfFilter::parse("eth,ib");
        assert!(f.matches("eth0") && f.matches("ib1") && !f.matches("lo"));
        let f = IfFilter::parse("=eth1");
        assert!(f.matches("eth1") && !f.matches("eth10"));
        let f = IfFilter::parse("^lo,docker");
        assert!(f.matches("eth0") && !f.matches("lo") && !f.matches("docker0"));
        let f = IfFilter::parse("^=eth0:1234");
        assert!(!f.matches("eth0") && f.matches("eth01"));
    }

    #[test]
    fn nsocks_is_clamped() {
        assert_eq!(clamp_nsocks(0), 1);
        assert_eq!(clamp_nsocks(4), 4);
        assert_eq!(clamp_nsocks(64), 8);
    }

    #[test]
    fn loopback_is_enumerated_with_default_speed() {
        let ifaces = interfaces().expect("getifaddrs");
        let lo = ifaces
            .iter()
            .find(|i| i.loopback)
            .expect("a loopback interface");
        assert!(lo.addr.is_loopback());
        assert_eq!(speed_mbps(&lo.name), DEFAULT_SPEED_MBPS);
        assert!(pci_path(&lo.name).is_none());
    }
}
