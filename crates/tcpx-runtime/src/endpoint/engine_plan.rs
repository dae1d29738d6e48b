//! How many engine threads an endpoint starts, and how many of them drive one connection.
//!
//! The built-in plugin copies every byte on the engine's own thread, so large transfers move
//! at one core's copy rate per engine: an endpoint wants one engine per channel. Two limits:
//!
//! - *The cores this process may use.* More engines than cores only take turns. Engines are
//!   also kept to a divisor of the channels per device: a transfer is cut evenly over the
//!   channels, so an engine that carries two channels where the others carry one sets the
//!   pace for all of them (8 channels on 7 engines move like 8 on 4).
//! - *A peer on the same cores.* Two endpoints of one host that both may use every core
//!   (a local run) would each start one engine per channel on the same cores; a connection
//!   to such a peer is driven by at most half of them (the rest stay parked). This used to
//!   cap the endpoint itself at half the cores, which also held a process confined to its own
//!   cores (taskset, a cpuset, a container's CPU quota) to half of them: with each side of a
//!   local run held to its own 8 of 16 cores, 4 engines moved 1 MiB messages at 0.5–0.6 × raw
//!   TCP where 8 moved them at 0.85–1.0 (H100, issue 25, thirteenth session).
//!
//! "Same cores" is judged from what a connection knows: the peer's address is loopback or
//! this host's own address on the control connection, and either this process may use every
//! core of the machine or it runs more than one endpoint (two endpoints of one process share
//! its cores however few they are: a one-process benchmark under `taskset` kept 16 engines
//! on 8 cores and moved 4 KiB one-sided writes at a fifth of its rate before this). Peers in
//! other network namespaces of one host count as remote.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The largest divisor of `channels` that is at most `limit` (at least 1).
pub(crate) fn fitting(channels: usize, limit: usize) -> usize {
    let limit = limit.max(1);
    (1..=channels.max(1))
        .rev()
        .find(|&n| channels.max(1) % n == 0 && n <= limit)
        .unwrap_or(1)
}

/// Engines per device that drive a connection to a peer sharing this process's cores: half
/// the cores, fitted to the engines started (a divisor of them, so the channels stay even).
pub(crate) fn per_device_shared(started_per_device: usize, cores: usize) -> usize {
    fitting(started_per_device, cores / 2)
}

/// Cores this process may run on (its affinity mask and CPU quota).
pub(crate) fn usable_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Whether a process that may use `usable` of the machine's `online` cores (0: unknown, taken
/// as all) is held to fewer than all of them.
fn confined(usable: usize, online: usize) -> bool {
    online != 0 && usable < online
}

/// Cores online on this machine (0 when unknown).
fn online_cores() -> usize {
    // SAFETY: `sysconf` takes no pointers.
    let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    usize::try_from(online).unwrap_or(0)
}

/// The engine threads an endpoint starts, and how many of them drive a connection to a peer
/// that competes for this process's cores (see the module docs). `tcpx-info` prints it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EnginePlan {
    /// Engine threads per plugin device the endpoint starts.
    pub per_device: usize,
    /// Of those, how many per device drive a connection to a peer on the same cores.
    pub per_device_for_local_peers: usize,
    /// Cores this process may use (its affinity mask and CPU quota).
    pub usable_cores: usize,
    /// Cores online on the machine (0 when unknown).
    pub online_cores: usize,
    /// Whether `per_device` is the automatic choice (not `Config::engines_per_device`).
    pub automatic: bool,
}

impl EnginePlan {
    /// The plan of an endpoint made with `config` over a plugin with `devices` devices that
    /// copies on the caller's thread (`copies_on_caller`: the built-in socket plugin) or not
    /// (TCPX moves the bytes on threads of its own: one engine per device).
    pub fn new(config: &crate::Config, copies_on_caller: bool, devices: usize) -> Self {
        let usable = usable_cores();
        let devices = devices.max(1);
        let (per_device, shared) = match config.engines_per_device {
            Some(n) => (n, n),
            None if copies_on_caller => {
                // One per channel of the device, fitted to the cores this process may use.
                let n = fitting(usize::from(config.channels).div_ceil(devices), usable);
                (n, per_device_shared(n, usable))
            }
            None => (1, 1),
        };
        Self {
            per_device,
            per_device_for_local_peers: shared,
            usable_cores: usable,
            online_cores: online_cores(),
            automatic: config.engines_per_device.is_none(),
        }
    }

    /// Whether this process is held to fewer than all of the machine's cores.
    pub fn confined(&self) -> bool {
        confined(self.usable_cores, self.online_cores)
    }

    /// Whether a connection between `local` and `peer` (its control connection's two ends)
    /// has the peer competing for this process's cores ([`shares_cores`] with this plan's
    /// cores and the endpoints alive in this process).
    pub(crate) fn shares_cores_with(&self, local: SocketAddr, peer: SocketAddr) -> bool {
        shares_cores(
            local,
            peer,
            self.usable_cores,
            self.online_cores,
            LIVE_ENDPOINTS.load(Ordering::Relaxed),
        )
    }
}

/// Whether a connection between `local` and `peer` (its control connection's two ends) has
/// the peer competing for this process's cores (see the module docs), for a process that
/// may use `usable` of the machine's `online` cores (0: unknown, taken as all) and holds
/// `endpoints` live endpoints: a process confined to its cores keeps them, unless it runs
/// more than one endpoint — then the peer is most likely one of them, on the same cores.
pub(crate) fn shares_cores(
    local: SocketAddr,
    peer: SocketAddr,
    usable: usize,
    online: usize,
    endpoints: usize,
) -> bool {
    let same_host = peer.ip().is_loopback() || peer.ip() == local.ip();
    same_host && (!confined(usable, online) || endpoints > 1)
}

/// Endpoints alive in this process.
static LIVE_ENDPOINTS: AtomicUsize = AtomicUsize::new(0);

/// Counts one live endpoint of this process (see [`shares_cores`]) while it exists.
#[derive(Debug)]
pub(crate) struct LiveEndpoint(());

impl LiveEndpoint {
    pub(crate) fn new() -> Self {
        LIVE_ENDPOINTS.fetch_add(1, Ordering::Relaxed);
        Self(())
    }
}

impl Drop for LiveEndpoint {
    fn drop(&mut self) {
        LIVE_ENDPOINTS.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engines_divide_the_channels_within_the_limit() {
        assert_eq!(fitting(8, 16), 8);
        assert_eq!(fitting(8, 8), 8);
        assert_eq!(fitting(8, 7), 4);
        assert_eq!(fitting(8, 5), 4);
        assert_eq!(fitting(8, 2), 2);
        assert_eq!(fitting(8, 1), 1);
        assert_eq!(fitting(8, 0), 1);
        assert_eq!(fitting(6, 4), 3);
        assert_eq!(fitting(7, 6), 1);
        assert_eq!(fitting(0, 4), 1);
        for channels in 1..=64 {
            for limit in 0..=70 {
                let n = fitting(channels, limit);
                assert_eq!(channels % n, 0, "{channels} channels, limit {limit}");
                assert!(n <= limit.max(1));
            }
        }
    }

    #[test]
    fn the_plan_follows_the_plugin_and_an_explicit_count() {
        let mut config = crate::Config {
            channels: 8,
            ..crate::Config::default()
        };
        // TCPX moves the bytes itself: one engine per device.
        let tcpx = EnginePlan::new(&config, false, 4);
        assert_eq!((tcpx.per_device, tcpx.per_device_for_local_peers), (1, 1));
        // The built-in plugin: one per channel of the device, fitted to the cores.
        let cores = usable_cores();
        let auto = EnginePlan::new(&config, true, 2);
        assert!(auto.automatic);
        assert_eq!(auto.per_device, fitting(4, cores));
        assert_eq!(
            auto.per_device_for_local_peers,
            fitting(auto.per_device, cores / 2)
        );
        assert_eq!(auto.usable_cores, cores);
        // An explicit count drives every connection with all of them.
        config.engines_per_device = Some(3);
        let explicit = EnginePlan::new(&config, true, 2);
        assert!(!explicit.automatic);
        assert_eq!(
            (explicit.per_device, explicit.per_device_for_local_peers),
            (3, 3)
        );
    }

    #[test]
    fn a_peer_on_the_same_cores_gets_half_of_them() {
        // 16 cores, 8 channels: 8 engines; a local peer: 8 drive it (half of 16).
        assert_eq!(fitting(8, 16), 8);
        assert_eq!(per_device_shared(8, 16), 8);
        // 8 cores of one's own: 8 engines; sharing them with a local peer: 4.
        assert_eq!(fitting(8, 8), 8);
        assert_eq!(per_device_shared(8, 8), 4);
        // 2 cores: 2 engines, 1 for a local peer (as the 2-core measurements chose).
        assert_eq!(fitting(8, 2), 2);
        assert_eq!(per_device_shared(2, 2), 1);
    }

    #[test]
    fn a_local_peer_shares_the_cores_of_an_unconfined_process_or_of_two_endpoints() {
        let lo: SocketAddr = "127.0.0.1:7000".parse().unwrap();
        let lo2: SocketAddr = "127.0.0.1:41000".parse().unwrap();
        let other: SocketAddr = "10.1.2.3:7000".parse().unwrap();
        let me: SocketAddr = "10.9.9.9:5000".parse().unwrap();
        let me2: SocketAddr = "10.9.9.9:7000".parse().unwrap();
        // Every core usable: loopback and this host's own address are the same cores.
        assert!(shares_cores(lo2, lo, 16, 16, 1));
        assert!(shares_cores(me, me2, 16, 16, 1));
        assert!(
            shares_cores(lo2, lo, 16, 0, 1),
            "unknown core count: assume all"
        );
        // Another host never does.
        assert!(!shares_cores(me, other, 16, 16, 1));
        assert!(!shares_cores(me, other, 8, 16, 2));
        // A process held to 8 of 16 cores keeps them: the peer runs elsewhere...
        assert!(!shares_cores(lo2, lo, 8, 16, 1));
        // ...unless it runs two endpoints, which share its cores.
        assert!(shares_cores(lo2, lo, 8, 16, 2));
        // This machine's own answer follows the same rule (other tests may hold endpoints
        // meanwhile, which can only make it share).
        let live = LiveEndpoint::new();
        let plan = EnginePlan::new(&crate::Config::default(), true, 1);
        assert_eq!(plan.confined(), confined(usable_cores(), online_cores()));
        if !plan.confined() {
            assert!(plan.shares_cores_with(lo2, lo));
        }
        assert!(!plan.shares_cores_with(me, other));
        drop(live);
    }
}
