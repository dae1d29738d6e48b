//! Which core each engine thread runs on.
//!
//! The topology (tcpx-topo, hwloc) says which cores are local to a NIC; the plugin's own
//! TX/RX binding cores are left out. Everything here degrades to "not pinned", with the
//! reason logged: a machine hwloc cannot read, a NIC it does not list (loopback), a build
//! without the `topo` feature. Engines of all endpoints in the process share one tally, so
//! two engines on the same NIC land on different cores when there are enough.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// A core chosen for an engine: released from the tally when dropped.
#[derive(Debug)]
pub(crate) struct CoreLease {
    pub(crate) core: usize,
}

impl Drop for CoreLease {
    fn drop(&mut self) {
        let mut tally = tally().lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = tally.get_mut(&self.core) {
            *n = n.saturating_sub(1);
        }
    }
}

fn tally() -> &'static Mutex<HashMap<usize, usize>> {
    static TALLY: OnceLock<Mutex<HashMap<usize, usize>>> = OnceLock::new();
    TALLY.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Picks the least used of `candidates` (lowest id on ties) and counts it.
fn lease(candidates: &[usize]) -> Option<CoreLease> {
    let mut tally = tally().lock().unwrap_or_else(|p| p.into_inner());
    let core = candidates
        .iter()
        .copied()
        .min_by_key(|c| (tally.get(c).copied().unwrap_or(0), *c))?;
    *tally.entry(core).or_insert(0) += 1;
    Some(CoreLease { core })
}

/// For each NIC name, a core for its engine, or `None` (not pinned; the reason is logged).
pub(crate) fn plan_cores(nics: &[String], gpu_pci: Option<&str>) -> Vec<Option<CoreLease>> {
    let candidates = match local_cores(nics, gpu_pci) {
        Ok(c) => c,
        Err(reason) => {
            tracing::info!(target: "tcpx_runtime", %reason, "engine threads not pinned");
            return nics.iter().map(|_| None).collect();
        }
    };
    // Only cores this process may run on.
    let allowed: Option<Vec<usize>> =
        core_affinity::get_core_ids().map(|ids| ids.into_iter().map(|c| c.id).collect());
    nics.iter()
        .zip(candidates)
        .map(|(nic, cores)| {
            let cores: Vec<usize> = match (&allowed, cores) {
                (_, None) => {
                    tracing::info!(target: "tcpx_runtime", %nic, "engine not pinned: the topology lists no local cores for this NIC");
                    return None;
                }
                (Some(allowed), Some(c)) => c.into_iter().filter(|c| allowed.contains(c)).collect(),
                (None, Some(c)) => c,
            };
            let lease = lease(&cores);
            match &lease {
                Some(l) => tracing::info!(target: "tcpx_runtime", %nic, core = l.core, "engine pinned to a NIC-local core"),
                None => tracing::info!(target: "tcpx_runtime", %nic, "engine not pinned: no allowed NIC-local core left"),
            }
            lease
        })
        .collect()
}

/// NIC-local cores without the plugin's binding cores, per NIC; `Err` says why there is no
/// answer at all.
#[cfg(feature = "topo")]
fn local_cores(nics: &[String], gpu_pci: Option<&str>) -> Result<Vec<Option<Vec<usize>>>, String> {
    use tcpx_topo::{Bindings, RX_BINDINGS_VAR, TX_BINDINGS_VAR};

    let topo = live_topology()?;
    let mut reserved = std::collections::BTreeSet::new();
    for var in [TX_BINDINGS_VAR, RX_BINDINGS_VAR] {
        if let Ok(value) = std::env::var(var) {
            match Bindings::parse(var, &value) {
                Ok(b) => reserved.extend(b.all_cores()),
                Err(e) => {
                    tracing::warn!(target: "tcpx_runtime", error = %e, "ignoring malformed plugin bindings")
                }
            }
        }
    }
    if let Some(pci) = gpu_pci {
        tracing::debug!(target: "tcpx_runtime", gpu = pci, "pinning by NIC locality; the GPU's plan is tcpx-topo's");
    }
    Ok(nics
        .iter()
        .map(|nic| {
            topo.nic_local_cores(nic).map(|cores| {
                let free: Vec<usize> = cores
                    .iter()
                    .copied()
                    .filter(|c| !reserved.contains(c))
                    .collect();
                // If the plugin took every local core, share with it rather than go remote.
                if free.is_empty() {
                    cores.to_vec()
                } else {
                    free
                }
            })
        })
        .collect())
}

/// The machine's topology, discovered once per process and shared by every endpoint made
/// after (an error is kept too: it would repeat).
///
/// Why once: hwloc's discovery reads the PCI configuration space of every device through
/// sysfs, and each read traps to the hypervisor on a VM. That was about 10 ms of every
/// endpoint's creation on an H100 machine (two endpoints 19–25 ms, now 2.3–3.2 ms after the
/// first), paid again by each NIXL agent or `tcpx.p2p` endpoint a process makes. Engines only
/// take the answer as a pinning hint, so a NIC plugged in after the first endpoint leaves
/// later engines unpinned at worst.
#[cfg(feature = "topo")]
fn live_topology() -> Result<&'static tcpx_topo::Topology, String> {
    static LIVE: OnceLock<Result<tcpx_topo::Topology, String>> = OnceLock::new();
    LIVE.get_or_init(|| {
        tcpx_topo::Topology::from_live().map_err(|e| format!("topology unavailable: {e}"))
    })
    .as_ref()
    .map_err(Clone::clone)
}

#[cfg(not(feature = "topo"))]
fn local_cores(
    _nics: &[String],
    _gpu_pci: Option<&str>,
) -> Result<Vec<Option<Vec<usize>>>, String> {
    Err("built without the `topo` feature".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_spread_over_candidates_and_are_returned() {
        // Core ids far from real ones so parallel tests do not interfere.
        let cores = [10_001, 10_002];
        let a = lease(&cores).unwrap();
        let b = lease(&cores).unwrap();
        assert_ne!(a.core, b.core);
        let first = a.core;
        drop(a);
        assert_eq!(lease(&cores).unwrap().core, first);
        assert!(lease(&[]).is_none());
    }
}
