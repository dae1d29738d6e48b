//! Ties the caller's GPU and NIC lists to the discovered topology.

use std::collections::HashMap;

use crate::{PciBusId, PlanRequest, Relation, TopoError, Topology};

/// A GPU to plan: its position in the request (CUDA order) and where hwloc has it.
#[derive(Debug, Clone)]
pub(crate) struct PlanGpu {
    pub pci: PciBusId,
    /// Index into `Topology::gpus()`; `None` only when hwloc has no PCI data.
    pub topo: Option<usize>,
}

/// A NIC candidate and where hwloc has it.
#[derive(Debug, Clone)]
pub(crate) struct PlanNic {
    pub name: String,
    /// Index into `Topology::nics()`; `None` when hwloc does not know the NIC.
    pub topo: Option<usize>,
}

/// The GPUs of the request, located in the topology.
pub(crate) fn gpus(topo: &Topology, req: &PlanRequest) -> Result<Vec<PlanGpu>, TopoError> {
    let Some(list) = &req.gpus else {
        return Ok(topo
            .gpus()
            .iter()
            .map(|g| PlanGpu {
                pci: g.pci,
                topo: Some(g.index),
            })
            .collect());
    };
    let mut seen: HashMap<PciBusId, usize> = HashMap::new();
    list.iter()
        .enumerate()
        .map(|(index, pci)| {
            if let Some(first) = seen.insert(*pci, index) {
                return Err(TopoError::DuplicateGpu {
                    pci: pci.to_string(),
                    first,
                    second: index,
                });
            }
            let found = topo.gpu_by_pci(pci).map(|g| g.index);
            if found.is_none() && topo.has_pci_info() {
                let seen: Vec<String> = topo.gpus().iter().map(|g| g.pci.to_string()).collect();
                return Err(TopoError::GpuNotFound {
                    index,
                    pci: pci.to_string(),
                    seen: if seen.is_empty() {
                        "none".to_owned()
                    } else {
                        seen.join(", ")
                    },
                });
            }
            Ok(PlanGpu {
                pci: *pci,
                topo: found,
            })
        })
        .collect()
}

/// The NIC candidates of the request, located in the topology: by the PCI bus id in the
/// plugin's `pciPath` first, then by interface name. Candidates hwloc does not know stay in
/// the list with unknown locality (and a note saying so).
pub(crate) fn nics(
    topo: &Topology,
    req: &PlanRequest,
    notes: &mut Vec<String>,
) -> Result<Vec<PlanNic>, TopoError> {
    let Some(list) = &req.nics else {
        return Ok(topo
            .nics()
            .iter()
            .enumerate()
            .map(|(i, n)| PlanNic {
                name: n.name.clone(),
                topo: Some(i),
            })
            .collect());
    };
    let mut out: Vec<PlanNic> = Vec::with_capacity(list.len());
    for cand in list {
        if cand.name.trim().is_empty() {
            return Err(TopoError::InvalidRequest {
                detail: "a NIC candidate has an empty name".to_owned(),
            });
        }
        if out.iter().any(|n| n.name == cand.name) {
            return Err(TopoError::InvalidRequest {
                detail: format!("NIC {:?} is listed twice", cand.name),
            });
        }
        let by_pci = cand
            .pci_path
            .as_ref()
            .and_then(PciBusId::from_sysfs_path)
            .and_then(|pci| topo.nics().iter().position(|n| n.pci == Some(pci)));
        let by_name = || topo.nics().iter().position(|n| n.name == cand.name);
        let found = by_pci.or_else(by_name);
        if found.is_none() {
            notes.push(format!(
                "NIC {}: not in the hwloc topology; its locality is unknown",
                cand.name
            ));
        }
        out.push(PlanNic {
            name: cand.name.clone(),
            topo: found,
        });
    }
    Ok(out)
}

/// Relation between a planned GPU and a planned NIC.
pub(crate) fn relation(topo: &Topology, gpu: &PlanGpu, nic: &PlanNic) -> Relation {
    match (gpu.topo, nic.topo) {
        (Some(g), Some(n)) => topo.relation(g, n),
        _ => Relation::Unknown,
    }
}
