//! GPU → NIC(s): the operator's override first, then closest-first with balancing, or a
//! static layout when hwloc has no PCI data.

use crate::override_map::{GpuNicMap, GPU_NIC_MAP_VAR};
use crate::resolve::{self, PlanGpu, PlanNic};
use crate::{TopoError, Topology};

/// Reason given for NICs chosen by `TCPX_GPU_NIC_MAP`.
pub(crate) const REASON_OVERRIDE: &str = "override";
/// Reason given when hwloc shows no PCI device and the layout is assumed.
pub(crate) const REASON_FALLBACK: &str = "fallback: no PCI data";

/// How one GPU got its NICs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// From `TCPX_GPU_NIC_MAP`.
    Override,
    /// Static block layout: hwloc has no PCI data.
    Fallback,
    /// From the topology.
    Auto,
}

/// The NICs chosen for one GPU.
#[derive(Debug, Clone)]
pub(crate) struct Assignment {
    /// Indices into the planned NIC list, preferred first.
    pub nics: Vec<usize>,
    pub mode: Mode,
    pub reason: String,
}

/// Checks the override against the GPUs and NICs being planned.
pub(crate) fn check_override(
    map: &GpuNicMap,
    gpus: &[PlanGpu],
    nics: &[PlanNic],
) -> Result<(), TopoError> {
    for (&gpu, names) in &map.by_gpu {
        if gpu >= gpus.len() {
            return Err(TopoError::UnknownGpu {
                var: GPU_NIC_MAP_VAR.to_owned(),
                index: gpu,
                count: gpus.len(),
            });
        }
        if let Some(name) = names.iter().find(|n| !nics.iter().any(|c| &c.name == *n)) {
            return Err(TopoError::UnknownNic {
                var: GPU_NIC_MAP_VAR.to_owned(),
                name: name.clone(),
                candidates: nics
                    .iter()
                    .map(|n| n.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        }
    }
    Ok(())
}

/// Assigns NICs to every GPU. `map` must have passed [`check_override`].
///
/// Automatic choice: the GPU's closest [`Relation`](crate::Relation) tier first; within
/// that tier the NIC with the fewest GPUs so far (then the first listed). GPUs named by the
/// override are placed first, so the balancing counts them.
pub(crate) fn assign(
    topo: &Topology,
    gpus: &[PlanGpu],
    nics: &[PlanNic],
    map: Option<&GpuNicMap>,
) -> Vec<Assignment> {
    let mut load = vec![0usize; nics.len()];
    let mut out: Vec<Option<Assignment>> = vec![None; gpus.len()];

    for (g, slot) in out.iter_mut().enumerate() {
        let Some(names) = map.and_then(|m| m.nics_for(g)) else {
            continue;
        };
        let chosen: Vec<usize> = names
            .iter()
            .filter_map(|name| nics.iter().position(|n| &n.name == name))
            .collect();
        for &n in &chosen {
            load[n] += 1;
        }
        *slot = Some(Assignment {
            nics: chosen,
            mode: Mode::Override,
            reason: REASON_OVERRIDE.to_owned(),
        });
    }

    for (g, slot) in out.iter_mut().enumerate() {
        if slot.is_some() || nics.is_empty() {
            continue;
        }
        let assignment = if topo.has_pci_info() {
            let Some(gpu) = gpus.get(g) else { continue };
            let relations: Vec<_> = nics
                .iter()
                .map(|n| resolve::relation(topo, gpu, n))
                .collect();
            let Some(best) = relations.iter().min().copied() else {
                continue;
            };
            let Some(pick) = (0..nics.len())
                .filter(|&n| relations[n] == best)
                .min_by_key(|&n| (load[n], n))
            else {
                continue;
            };
            Assignment {
                nics: vec![pick],
                mode: Mode::Auto,
                reason: best.reason().to_owned(),
            }
        } else {
            // No locality at all: consecutive GPUs share consecutive NICs, the layout of
            // every multi-NIC GPU VM we know (A3-high: 0,1 → eth1 … 6,7 → eth4).
            Assignment {
                nics: vec![block(g, gpus.len(), nics.len())],
                mode: Mode::Fallback,
                reason: REASON_FALLBACK.to_owned(),
            }
        };
        for &n in &assignment.nics {
            load[n] += 1;
        }
        *slot = Some(assignment);
    }

    out.into_iter()
        .map(|a| {
            a.unwrap_or(Assignment {
                nics: Vec::new(),
                mode: Mode::Auto,
                reason: "no NIC".to_owned(),
            })
        })
        .collect()
}

/// Item `i` of `n` mapped onto `m` buckets in contiguous blocks (0 when `m` or `n` is 0).
pub(crate) fn block(i: usize, n: usize, m: usize) -> usize {
    if n == 0 || m == 0 {
        return 0;
    }
    // i < n, so i * m / n < m; widen to avoid overflow on absurd sizes.
    let b = (i as u128 * m as u128 / n as u128) as usize;
    b.min(m - 1)
}

#[cfg(test)]
mod tests {
    use super::block;

    #[test]
    fn block_layout_pairs_gpus_onto_nics() {
        let nics: Vec<usize> = (0..8).map(|g| block(g, 8, 4)).collect();
        assert_eq!(nics, [0, 0, 1, 1, 2, 2, 3, 3]);
        let numa: Vec<usize> = (0..8).map(|g| block(g, 8, 2)).collect();
        assert_eq!(numa, [0, 0, 0, 0, 1, 1, 1, 1]);
        assert_eq!(block(0, 1, 4), 0);
        assert_eq!(block(3, 4, 0), 0);
    }
}
