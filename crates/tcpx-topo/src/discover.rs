//! hwloc → [`Topology`]: the only module that talks to hwloc.
//!
//! It loads a topology (live or XML) with I/O objects kept, finds GPUs among the PCI devices
//! and NICs among the network OS devices, and computes every GPU–NIC [`Relation`] from the
//! deepest common ancestor, using hwlocality's own `first_common_ancestor` (hwloc's C helper
//! crashes on I/O objects).

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use hwlocality::object::attributes::ObjectAttributes;
use hwlocality::object::types::{BridgeType, OSDeviceType, ObjectType};
use hwlocality::object::TopologyObject;
use hwlocality::topology::builder::{TopologyBuilder, TypeFilter};
use hwlocality::Topology as HwlocTopology;

use crate::topology::{Gpu, Nic, NumaNode, Topology};
use crate::{PciBusId, Relation, TopoError};

/// NVIDIA's PCI vendor id.
const NVIDIA_VENDOR: u16 = 0x10de;
/// PCI classes a GPU shows up with: 3D controller (H100 and other compute GPUs), VGA.
const GPU_CLASSES: [u16; 2] = [0x0302, 0x0300];

/// Discovers the live machine.
pub(crate) fn live() -> Result<Topology, TopoError> {
    let origin = "live".to_owned();
    guarded(&origin, || {
        let topo = keep_io(HwlocTopology::builder())
            .map_err(|detail| hwloc_err("hwloc_topology_set_io_types_filter", detail))
            .and_then(without_gpu_runtimes)?
            .build()
            .map_err(|e| hwloc_err("hwloc_topology_load", e.to_string()))?;
        Ok(extract(&topo, origin.clone()))
    })
}

/// Loads an XML topology held in memory; `origin` names it in errors.
pub(crate) fn xml(xml: &str, origin: String) -> Result<Topology, TopoError> {
    if xml.trim().is_empty() {
        return Err(TopoError::EmptyXml { origin });
    }
    precheck_xml(xml).map_err(|detail| TopoError::InvalidXml {
        origin: origin.clone(),
        detail,
    })?;
    guarded(&origin, || {
        let invalid = |detail: String| TopoError::InvalidXml {
            origin: origin.clone(),
            detail,
        };
        let builder = keep_io(HwlocTopology::builder()).map_err(&invalid)?;
        let topo = builder
            .from_xml(xml)
            .map_err(|e| {
                invalid(format!(
                    "hwloc could not parse it ({})",
                    plain_errno(&e.to_string())
                ))
            })?
            .build()
            .map_err(|e| {
                invalid(format!(
                    "hwloc could not load it ({})",
                    plain_errno(&e.to_string())
                ))
            })?;
        Ok(extract(&topo, origin.clone()))
    })
}

/// hwlocality prints the errno of a failed hwloc call with `Debug`
/// (`Some(Errno { code: 22, description: Some("Invalid argument") })`); users get
/// `22 (Invalid argument)` instead.
fn plain_errno(message: &str) -> String {
    const OPEN: &str = "Some(Errno { code: ";
    let Some(start) = message.find(OPEN) else {
        return message.to_owned();
    };
    let rest = &message[start + OPEN.len()..];
    let code: String = rest.chars().take_while(char::is_ascii_digit).collect();
    let description = rest
        .split_once("description: Some(\"")
        .and_then(|(_, d)| d.split_once('"'))
        .map(|(d, _)| d);
    let Some(end) = rest.find("})") else {
        return message.to_owned();
    };
    let mut tail = &rest[end + 2..];
    tail = tail.strip_prefix(')').unwrap_or(tail);
    let plain = match description {
        Some(d) => format!("{code} ({d})"),
        None => code,
    };
    format!("{}{plain}{tail}", &message[..start])
}

/// Runs hwloc work, turning a panic inside hwlocality into an error.
///
/// hwlocality 1.0.0-alpha answers some unexpected hwloc return codes with `unreachable!`
/// or `expect`; a topology library must not take the process down with it.
fn guarded(
    origin: &str,
    work: impl FnOnce() -> Result<Topology, TopoError>,
) -> Result<Topology, TopoError> {
    catch_unwind(AssertUnwindSafe(work)).unwrap_or_else(|panic| {
        let detail = panic
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| panic.downcast_ref::<&str>().copied())
            .unwrap_or("unknown panic");
        Err(TopoError::Hwloc {
            step: format!("loading topology {origin}"),
            detail: format!("hwlocality panicked: {detail}"),
        })
    })
}

/// Keeps every I/O object: the default filter drops bridges, PCI and OS devices.
fn keep_io(builder: TopologyBuilder) -> Result<TopologyBuilder, String> {
    builder
        .with_io_type_filter(TypeFilter::KeepAll)
        .map_err(|e| format!("cannot keep I/O objects: {e}"))
}

/// hwloc components that discover accelerators by starting their vendors' runtimes: CUDA,
/// NVML, OpenCL, ROCm SMI, oneAPI Level Zero, and the X display ("gl").
///
/// The plan finds GPUs by their PCI vendor and class and NICs by their network devices, so
/// these components add nothing to it, and each costs its runtime's start: on the H100
/// machines, where hwloc's OpenCL and GL plugins are installed, loading the topology started
/// NVIDIA's OpenCL runtime, which created a CUDA context — 230 ms of the first endpoint a
/// process made (issue 25).
const GPU_RUNTIME_COMPONENTS: [&str; 6] = ["cuda", "nvml", "opencl", "rsmi", "levelzero", "gl"];

/// Leaves out those of [`GPU_RUNTIME_COMPONENTS`] that this hwloc has (built in or as
/// plugins).
///
/// hwloc refuses the name of a component it does not have (`EINVAL`), and hwlocality's call
/// consumes the builder even when refused, so each name is first tried on a throwaway
/// builder; meanwhile the real one keeps hwloc's plugins loaded, so the probes load nothing.
fn without_gpu_runtimes(builder: TopologyBuilder) -> Result<TopologyBuilder, TopoError> {
    GPU_RUNTIME_COMPONENTS
        .iter()
        .filter(|name| HwlocTopology::builder().without_component(name).is_ok())
        .try_fold(builder, |builder, name| {
            builder
                .without_component(name)
                .map_err(|e| hwloc_err("hwloc_topology_set_components", format!("{name}: {e}")))
        })
}

fn hwloc_err(step: &str, detail: String) -> TopoError {
    TopoError::Hwloc {
        step: step.to_owned(),
        detail,
    }
}

/// Rejects XML that hwloc 2.9 accepts and then crashes on: objects with a `cpuset` but no
/// `complete_cpuset`, or a `nodeset` but no `complete_nodeset`.
fn precheck_xml(xml: &str) -> Result<(), String> {
    for (n, chunk) in xml.split("<object").skip(1).enumerate() {
        let tag = chunk.split('>').next().unwrap_or_default();
        for (set, complete) in [
            ("cpuset", "complete_cpuset"),
            ("nodeset", "complete_nodeset"),
        ] {
            if has_attr(tag, set) && !has_attr(tag, complete) {
                let what = tag.split_whitespace().take(2).collect::<Vec<_>>().join(" ");
                return Err(format!(
                    "<object> #{} ({what}) has {set} but no {complete}; hwloc crashes on such files",
                    n + 1
                ));
            }
        }
    }
    Ok(())
}

/// Whether `tag` has the attribute `name=` as a whole word (so `cpuset` does not match
/// `complete_cpuset`).
fn has_attr(tag: &str, name: &str) -> bool {
    let pattern = format!("{name}=");
    tag.match_indices(&pattern).any(|(at, _)| {
        tag[..at]
            .chars()
            .next_back()
            .is_some_and(char::is_whitespace)
    })
}

/// Where an I/O device sits on the CPU side.
struct Locality {
    numa: Option<u32>,
    package: Option<u32>,
    cpus: Vec<usize>,
}

fn locality(obj: &TopologyObject) -> Locality {
    let Some(anchor) = (if obj.cpuset().is_some() {
        Some(obj)
    } else {
        obj.first_non_io_ancestor()
    }) else {
        return Locality {
            numa: None,
            package: None,
            cpus: Vec::new(),
        };
    };
    let numa = anchor.nodeset().and_then(|set| {
        // A single NUMA node only: a device attached to the whole machine has none.
        (set.weight() == Some(1))
            .then(|| set.first_set())
            .flatten()
            .and_then(|i| u32::try_from(usize::from(i)).ok())
    });
    let package = if anchor.object_type() == ObjectType::Package {
        Some(anchor)
    } else {
        anchor.first_ancestor_with_type(ObjectType::Package)
    }
    .and_then(|p| p.os_index())
    .and_then(|i| u32::try_from(i).ok());
    let cpus = anchor
        .cpuset()
        .map(|set| set.iter_set().map(usize::from).collect())
        .unwrap_or_default();
    Locality {
        numa,
        package,
        cpus,
    }
}

fn pci_id(obj: &TopologyObject) -> Option<PciBusId> {
    match obj.attributes() {
        Some(ObjectAttributes::PCIDevice(p)) => {
            PciBusId::new(p.domain().into(), p.bus_id(), p.bus_device(), p.function()).ok()
        }
        _ => None,
    }
}

fn is_gpu(obj: &TopologyObject) -> bool {
    matches!(
        obj.attributes(),
        Some(ObjectAttributes::PCIDevice(p))
            if p.vendor_id() == NVIDIA_VENDOR && GPU_CLASSES.contains(&p.class_id())
    )
}

/// The relation of two I/O objects, from their deepest common ancestor.
fn relation(gpu_obj: &TopologyObject, gpu: &Gpu, nic_obj: &TopologyObject, nic: &Nic) -> Relation {
    let Some(common) = gpu_obj.first_common_ancestor(nic_obj) else {
        return Relation::Unknown;
    };
    match common.attributes() {
        Some(ObjectAttributes::Bridge(b)) => match b.upstream_type() {
            BridgeType::Host => Relation::SameHostBridge,
            _ => Relation::SameSwitch,
        },
        // One device below the other (a NIC function under a GPU device): as close as it gets.
        Some(ObjectAttributes::PCIDevice(_)) => Relation::SameSwitch,
        _ => cpu_side_relation(gpu.numa, gpu.package, nic.numa, nic.package),
    }
}

/// The relation of two devices whose paths meet only on the CPU side.
fn cpu_side_relation(
    gpu_numa: Option<u32>,
    gpu_pkg: Option<u32>,
    nic_numa: Option<u32>,
    nic_pkg: Option<u32>,
) -> Relation {
    match (gpu_numa, nic_numa, gpu_pkg, nic_pkg) {
        (Some(a), Some(b), _, _) if a == b => Relation::SameNuma,
        (_, _, Some(a), Some(b)) if a == b => Relation::SameSocket,
        (_, _, Some(_), Some(_)) | (Some(_), Some(_), _, _) => Relation::OtherSocket,
        _ => Relation::Unknown,
    }
}

/// Reads everything the planner needs out of a loaded hwloc topology.
fn extract(topo: &HwlocTopology, origin: String) -> Topology {
    let has_pci = topo.pci_devices().len() > 0;

    let mut gpu_objs: Vec<(PciBusId, &TopologyObject)> = topo
        .pci_devices()
        .filter(|o| is_gpu(o))
        .filter_map(|o| pci_id(o).map(|id| (id, o)))
        .collect();
    gpu_objs.sort_by_key(|(id, _)| *id);
    let gpus: Vec<Gpu> = gpu_objs
        .iter()
        .enumerate()
        .map(|(index, (pci, obj))| {
            let loc = locality(obj);
            Gpu {
                index,
                pci: *pci,
                numa: loc.numa,
                package: loc.package,
                local_cpus: loc.cpus,
            }
        })
        .collect();

    let mut nic_objs: Vec<(Nic, &TopologyObject)> = topo
        .os_devices()
        .filter(|o| {
            matches!(o.attributes(), Some(ObjectAttributes::OSDevice(d))
                if d.device_type() == OSDeviceType::Network)
        })
        .filter_map(|o| {
            let name = o.name()?.to_str().ok()?.to_owned();
            if name == "lo" {
                return None;
            }
            // The PCI device behind the interface anchors it in the PCIe tree.
            let pci_obj = o
                .ancestors()
                .find(|a| a.object_type() == ObjectType::PCIDevice);
            let loc = locality(o);
            let nic = Nic {
                name,
                pci: pci_obj.and_then(pci_id),
                numa: loc.numa,
                package: loc.package,
                local_cpus: loc.cpus,
            };
            Some((nic, pci_obj.unwrap_or(o)))
        })
        .collect();
    // PCI order (None last), then name: eth0 on bus 00 comes before eth1 on bus 06.
    nic_objs.sort_by(|(a, _), (b, _)| {
        (a.pci.is_none(), a.pci, &a.name).cmp(&(b.pci.is_none(), b.pci, &b.name))
    });

    let relations = gpu_objs
        .iter()
        .zip(&gpus)
        .map(|((_, gobj), gpu)| {
            nic_objs
                .iter()
                .map(|(nic, nobj)| relation(gobj, gpu, nobj, nic))
                .collect()
        })
        .collect();

    let mut numa_nodes: Vec<NumaNode> = topo
        .objects_with_type(ObjectType::NUMANode)
        .filter_map(|n| {
            Some(NumaNode {
                os_index: u32::try_from(n.os_index()?).ok()?,
                package: n
                    .first_ancestor_with_type(ObjectType::Package)
                    .and_then(|p| p.os_index())
                    .and_then(|i| u32::try_from(i).ok()),
                cpus: n
                    .cpuset()
                    .map(|s| s.iter_set().map(usize::from).collect())
                    .unwrap_or_default(),
            })
        })
        .collect();
    numa_nodes.sort_by_key(|n| n.os_index);

    let mut core_of_pu = BTreeMap::new();
    for (core_id, core) in topo.objects_with_type(ObjectType::Core).enumerate() {
        if let Some(set) = core.cpuset() {
            for pu in set.iter_set() {
                core_of_pu.insert(usize::from(pu), core_id);
            }
        }
    }
    let mut pus: Vec<usize> = topo
        .objects_with_type(ObjectType::PU)
        .filter_map(TopologyObject::os_index)
        .collect();
    pus.sort_unstable();

    Topology {
        origin,
        gpus,
        nics: nic_objs.into_iter().map(|(nic, _)| nic).collect(),
        relations,
        numa_nodes,
        pus,
        core_of_pu,
        has_pci,
    }
}

/// The constructors live here, with the discovery they run, so that `topology` (the plain data)
/// does not depend on hwloc code.
impl Topology {
    /// Discovers the machine this process runs on, keeping I/O objects (PCI devices,
    /// bridges, network interfaces), which hwloc drops by default, and leaving out hwloc's
    /// components that start GPU runtimes to list accelerators (CUDA, NVML, OpenCL, …): GPUs
    /// are found by their PCI ids, and those runtimes took 230 ms to start.
    pub fn from_live() -> Result<Self, TopoError> {
        live()
    }

    /// Loads an hwloc XML topology (as written by `lstopo --of xml`) from a file.
    ///
    /// The file is read here, not by hwloc, so a missing or unreadable file is an error that
    /// names it instead of a failure inside hwloc.
    pub fn from_xml_file(path: impl AsRef<Path>) -> Result<Self, TopoError> {
        let path = path.as_ref();
        let xml = std::fs::read_to_string(path).map_err(|source| TopoError::ReadXml {
            path: path.to_path_buf(),
            source,
        })?;
        self::xml(&xml, path.display().to_string())
    }

    /// Loads an hwloc XML topology from a string.
    pub fn from_xml_str(xml: &str) -> Result<Self, TopoError> {
        self::xml(xml, "<string>".to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_runtime_components_are_left_out_whether_or_not_hwloc_has_them() {
        // The names this hwloc refuses (not built in, no plugin: `EINVAL` from hwloc 2.9)
        // are skipped, the others taken: either way the builder comes back and still loads
        // this machine.
        let builder = without_gpu_runtimes(HwlocTopology::builder()).expect("a builder");
        let topo = builder.build().expect("hwloc loads this machine");
        assert!(topo.objects_with_type(ObjectType::PU).count() > 0);
    }

    #[test]
    fn precheck_rejects_objects_without_complete_sets() {
        let bad = r#"<topology><object type="PU" os_index="0" cpuset="0x1" nodeset="0x1" complete_nodeset="0x1"/></topology>"#;
        let err = precheck_xml(bad).unwrap_err();
        assert!(err.contains("complete_cpuset"), "{err}");
        let good = r#"<object type="PU" cpuset="0x1" complete_cpuset="0x1" nodeset="0x1" complete_nodeset="0x1"/>"#;
        assert_eq!(precheck_xml(good), Ok(()));
    }

    #[test]
    fn cpu_side_relation_orders_numa_socket_other() {
        assert_eq!(
            cpu_side_relation(Some(0), Some(0), Some(0), Some(0)),
            Relation::SameNuma
        );
        assert_eq!(
            cpu_side_relation(Some(0), Some(0), Some(1), Some(0)),
            Relation::SameSocket
        );
        assert_eq!(
            cpu_side_relation(Some(0), Some(0), Some(1), Some(1)),
            Relation::OtherSocket
        );
        assert_eq!(cpu_side_relation(None, None, None, None), Relation::Unknown);
    }
}

#[cfg(test)]
mod errno_tests {
    use super::plain_errno;

    #[test]
    fn errno_debug_output_becomes_plain() {
        let raw = "hwloc_topology_set_xmlbuffer() failed with errno Some(Errno { code: 22, \
                   description: Some(\"Invalid argument\") }) and return value -1";
        let got = plain_errno(raw);
        assert_eq!(
            got,
            "hwloc_topology_set_xmlbuffer() failed with errno 22 (Invalid argument) and \
             return value -1"
        );
        assert!(!got.contains("Some("), "{got}");
        assert_eq!(plain_errno("no errno here"), "no errno here");
    }
}
