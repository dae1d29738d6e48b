//! The plan the runtime follows: per GPU, its NIC(s), the cores for its progress threads,
//! its channel count, and why.

use std::collections::BTreeSet;

use serde::Serialize;

use crate::assign::{self, Mode};
use crate::bindings::Bindings;
use crate::cores::{self, Pool};
use crate::override_map::{GpuNicMap, GPU_NIC_MAP_VAR};
use crate::request::{RX_BINDINGS_VAR, TX_BINDINGS_VAR};
use crate::resolve::{self, PlanGpu, PlanNic};
use crate::{PlanRequest, TopoError, Topology};

/// TCPX connections one NIC needs to reach its ceiling (≈ 21 GB/s of 25 GB/s on A3-high,
/// Google's figure); automatic channel counts share these among a NIC's GPUs.
pub const CONNECTIONS_PER_NIC: usize = 8;

/// What one GPU does.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuPlan {
    /// The GPU's index: its position in [`PlanRequest::gpus`] (CUDA order) when given, else
    /// in [`Topology::gpus`] (PCI bus order).
    pub gpu: usize,
    /// PCI bus id, `0000:04:00.0`.
    pub pci: String,
    /// NUMA node of the GPU, when known (never guessed: `null` in the no-PCI fallback).
    pub numa: Option<u32>,
    /// NIC interface names, preferred first.
    pub nics: Vec<String>,
    /// PUs (OS indices) for this GPU's progress threads: local to its NIC(s), without the
    /// plugin's TX/RX binding cores, disjoint from other GPUs' where the machine allows.
    pub cores: Vec<usize>,
    /// Why these NICs: `same PCIe switch`, `override`, `fallback: no PCI data`, …
    pub reason: String,
    /// Channels (TCPX connections) for this GPU.
    pub channels: usize,
}

/// The whole plan: one entry per GPU, plus notes on everything the planner assumed or left
/// out. Serializes as `{"plan":[…],"notes":[…]}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Plan {
    /// One entry per GPU, in GPU order.
    #[serde(rename = "plan")]
    pub entries: Vec<GpuPlan>,
    /// Human-readable remarks (fallbacks, NICs not planned, shared cores).
    pub notes: Vec<String>,
}

impl Plan {
    /// Plans `req` on `topo`.
    ///
    /// Errors name the GPU, NIC or variable at fault: a requested GPU hwloc does not see, a
    /// malformed or inconsistent `TCPX_GPU_NIC_MAP`, malformed bindings, GPUs but no NIC.
    pub fn build(topo: &Topology, req: &PlanRequest) -> Result<Self, TopoError> {
        let mut notes = Vec::new();
        let plugin_cores = plugin_cores(req)?;
        let map = req
            .gpu_nic_map
            .as_deref()
            .map(|m| GpuNicMap::parse(GPU_NIC_MAP_VAR, m))
            .transpose()?;
        let gpus = resolve::gpus(topo, req)?;
        let nics = resolve::nics(topo, req, &mut notes)?;

        if gpus.is_empty() {
            notes.push(format!(
                "no GPU to plan; NICs seen: {}",
                names(nics.iter().map(|n| n.name.as_str()))
            ));
            if !topo.has_pci_info() {
                notes.push(
                    "hwloc shows no PCI devices: pass the GPUs' bus ids from CUDA \
                     (PlanRequest::gpus) to get the static fallback plan"
                        .to_owned(),
                );
            }
            if map.is_some() {
                notes.push(format!("{GPU_NIC_MAP_VAR} ignored: there is no GPU to map"));
            }
            return Ok(Self {
                entries: Vec::new(),
                notes,
            });
        }
        if nics.is_empty() {
            return Err(TopoError::NoNics { gpus: gpus.len() });
        }
        if let Some(map) = &map {
            assign::check_override(map, &gpus, &nics)?;
        }
        if !topo.has_pci_info() {
            notes.push(
                "hwloc shows no PCI devices: GPUs not in TCPX_GPU_NIC_MAP follow the static \
                 layout (consecutive GPUs share consecutive NICs, GPUs spread over NUMA nodes \
                 in blocks)"
                    .to_owned(),
            );
        }

        let assignments = assign::assign(topo, &gpus, &nics, map.as_ref());
        note_unplanned(&nics, &assignments, &mut notes);

        let pools: Vec<Vec<usize>> = assignments
            .iter()
            .enumerate()
            .map(|(g, a)| {
                let (local, who) = local_cpus(topo, &gpus, &nics, g, a.mode, &a.nics, &mut notes);
                let Pool { cpus, note } = cores::exclude_plugin_cores(&local, &plugin_cores, &who);
                notes.extend(note);
                cpus
            })
            .collect();
        let cores = cores::split(topo, &pools);
        let channels = channels(req.channels_per_gpu, &assignments, nics.len());

        let entries = gpus
            .iter()
            .zip(assignments)
            .zip(cores)
            .zip(channels)
            .enumerate()
            .map(|(g, (((gpu, a), cores), channels))| GpuPlan {
                gpu: g,
                pci: gpu.pci.to_string(),
                numa: gpu
                    .topo
                    .and_then(|i| topo.gpus().get(i))
                    .and_then(|t| t.numa),
                nics: a.nics.iter().map(|&n| nics[n].name.clone()).collect(),
                cores,
                reason: a.reason,
                channels,
            })
            .collect();
        let plan = Self { entries, notes };
        tracing::debug!(plan = %plan.to_json(), "topology plan built");
        Ok(plan)
    }

    /// The entry of GPU `gpu` (its plan index).
    pub fn entry(&self, gpu: usize) -> Option<&GpuPlan> {
        self.entries.iter().find(|e| e.gpu == gpu)
    }

    /// The cores planned for the GPUs that use NIC `name` (sorted, deduplicated): where a
    /// process that runs one progress thread per NIC pins that NIC's thread. Empty when no
    /// GPU uses the NIC.
    pub fn cores_for_nic(&self, name: &str) -> Vec<usize> {
        let cores: BTreeSet<usize> = self
            .entries
            .iter()
            .filter(|e| e.nics.iter().any(|n| n == name))
            .flat_map(|e| e.cores.iter().copied())
            .collect();
        cores.into_iter().collect()
    }

    /// `{"plan":[{"gpu":0,"pci":"0000:04:00.0","numa":0,"nics":["eth1"],"cores":[…],
    /// "reason":"same PCIe switch","channels":4},…],"notes":[…]}`.
    pub fn to_json(&self) -> String {
        // Plain structs of strings and numbers always serialize; the fallback exists only so
        // that this never panics.
        serde_json::to_string(self)
            .unwrap_or_else(|e| format!("{{\"plan\":[],\"notes\":[{:?}]}}", e.to_string()))
    }
}

/// Every core named in the plugin's TX and RX bindings.
fn plugin_cores(req: &PlanRequest) -> Result<BTreeSet<usize>, TopoError> {
    let mut all = BTreeSet::new();
    for (var, value) in [
        (TX_BINDINGS_VAR, &req.tx_bindings),
        (RX_BINDINGS_VAR, &req.rx_bindings),
    ] {
        if let Some(value) = value {
            all.extend(Bindings::parse(var, value)?.all_cores());
        }
    }
    Ok(all)
}

/// The PUs local to GPU `g`'s NICs, with a label for notes. Falls back to the GPU's own
/// local PUs, then to the whole machine, when no NIC has a known locality; in the no-PCI
/// fallback, to the NUMA node the static layout assigns.
fn local_cpus(
    topo: &Topology,
    gpus: &[PlanGpu],
    nics: &[PlanNic],
    g: usize,
    mode: Mode,
    chosen: &[usize],
    notes: &mut Vec<String>,
) -> (Vec<usize>, String) {
    let who = format!("GPU {g}");
    if mode == Mode::Fallback || !topo.has_pci_info() {
        let nodes = topo.numa_nodes();
        if let Some(node) = nodes.get(assign::block(g, gpus.len(), nodes.len())) {
            notes.push(format!(
                "{who}: cores from NUMA node {} by the static layout (no PCI data)",
                node.os_index
            ));
            return (node.cpus.clone(), who);
        }
        return (topo.pus().to_vec(), who);
    }
    let from_nics: BTreeSet<usize> = chosen
        .iter()
        .filter_map(|&n| nics.get(n)?.topo)
        .filter_map(|i| topo.nics().get(i))
        .flat_map(|n| n.local_cpus.iter().copied())
        .collect();
    if !from_nics.is_empty() {
        return (from_nics.into_iter().collect(), who);
    }
    let gpu_local = gpus
        .get(g)
        .and_then(|gpu| gpu.topo)
        .and_then(|i| topo.gpus().get(i))
        .map(|t| t.local_cpus.clone())
        .unwrap_or_default();
    if !gpu_local.is_empty() {
        notes.push(format!(
            "{who}: NIC locality unknown; cores local to the GPU instead"
        ));
        return (gpu_local, who);
    }
    notes.push(format!(
        "{who}: no locality known; cores from the whole machine"
    ));
    (topo.pus().to_vec(), who)
}

/// Channels per GPU: the explicit count, or [`CONNECTIONS_PER_NIC`] of each of its NICs
/// shared among the GPUs using that NIC (at least 1).
fn channels(explicit: usize, assignments: &[assign::Assignment], nic_count: usize) -> Vec<usize> {
    if explicit > 0 {
        return vec![explicit; assignments.len()];
    }
    let mut users = vec![0usize; nic_count];
    for a in assignments {
        for &n in &a.nics {
            users[n] += 1;
        }
    }
    assignments
        .iter()
        .map(|a| {
            a.nics
                .iter()
                .map(|&n| CONNECTIONS_PER_NIC / users[n].max(1))
                .sum::<usize>()
                .max(1)
        })
        .collect()
}

/// Says which candidate NICs no GPU got (eth0 on A3-high, when every interface is a
/// candidate): they are not data NICs for this plan.
fn note_unplanned(nics: &[PlanNic], assignments: &[assign::Assignment], notes: &mut Vec<String>) {
    let used: BTreeSet<usize> = assignments
        .iter()
        .flat_map(|a| a.nics.iter().copied())
        .collect();
    let unused: Vec<&str> = nics
        .iter()
        .enumerate()
        .filter(|(i, _)| !used.contains(i))
        .map(|(_, n)| n.name.as_str())
        .collect();
    if !unused.is_empty() {
        notes.push(format!(
            "NICs no GPU uses (none is closest to any GPU, nor named by an override): {}",
            unused.join(", ")
        ));
    }
}

fn names<'a>(it: impl Iterator<Item = &'a str>) -> String {
    let v: Vec<&str> = it.collect();
    if v.is_empty() {
        "none".to_owned()
    } else {
        v.join(", ")
    }
}
