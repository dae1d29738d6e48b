//! Which cores each GPU's progress threads get: local to its NIC(s), minus the cores the
//! TCPX plugin binds its own threads to, split by whole physical cores among the GPUs that
//! draw from the same pool so that processes driving different GPUs do not collide.

use std::collections::{BTreeMap, BTreeSet};

use crate::Topology;

/// A GPU's pool of candidate PUs, before splitting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Pool {
    /// Candidate PUs (OS indices), sorted.
    pub cpus: Vec<usize>,
    /// Why the pool is not the plain NIC-local set, if it is not.
    pub note: Option<String>,
}

/// Removes the plugin's cores from `local`. When that leaves nothing, keeps `local` (sharing
/// with the plugin beats an unpinned thread) and says so.
pub(crate) fn exclude_plugin_cores(local: &[usize], plugin: &BTreeSet<usize>, who: &str) -> Pool {
    let free: Vec<usize> = local
        .iter()
        .copied()
        .filter(|c| !plugin.contains(c))
        .collect();
    if free.is_empty() && !local.is_empty() && !plugin.is_empty() {
        return Pool {
            cpus: local.to_vec(),
            note: Some(format!(
                "{who}: every local core is in the plugin's TX/RX bindings; sharing them"
            )),
        };
    }
    Pool {
        cpus: free,
        note: None,
    }
}

/// Splits each distinct pool among the GPUs that have it: GPU `k` of `n` sharing a pool
/// gets the `k`-th contiguous block of its physical cores (all hyperthreads of each core).
/// With fewer cores than GPUs, GPUs share cores round-robin.
pub(crate) fn split(topo: &Topology, pools: &[Vec<usize>]) -> Vec<Vec<usize>> {
    let mut sharers: BTreeMap<&[usize], Vec<usize>> = BTreeMap::new();
    for (gpu, pool) in pools.iter().enumerate() {
        sharers.entry(pool.as_slice()).or_default().push(gpu);
    }
    let mut out = vec![Vec::new(); pools.len()];
    for (pool, gpus) in sharers {
        let cores = by_core(topo, pool);
        for (k, &gpu) in gpus.iter().enumerate() {
            let mine: Vec<usize> = if cores.is_empty() {
                Vec::new()
            } else if cores.len() >= gpus.len() {
                let start = k * cores.len() / gpus.len();
                let end = (k + 1) * cores.len() / gpus.len();
                cores[start..end].concat()
            } else {
                cores[k % cores.len()].clone()
            };
            let mut mine = mine;
            mine.sort_unstable();
            out[gpu] = mine;
        }
    }
    out
}

/// Groups PUs by physical core, cores ordered by their lowest PU.
fn by_core(topo: &Topology, pus: &[usize]) -> Vec<Vec<usize>> {
    let mut cores: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for &pu in pus {
        cores.entry(topo.core_of(pu)).or_default().push(pu);
    }
    let mut cores: Vec<Vec<usize>> = cores.into_values().collect();
    cores.iter_mut().for_each(|c| c.sort_unstable());
    cores.sort_by_key(|c| c.first().copied());
    cores
}
