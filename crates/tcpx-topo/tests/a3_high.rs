//! The a3-highgpu-8g fixture: the layout Google documents must come out of discovery and
//! planning exactly.

mod common;

use std::collections::BTreeSet;

use common::{load, A3_RX, A3_TX};
use tcpx_topo::{NicCandidate, PciBusId, Plan, PlanRequest, Relation, TopoError, Topology};

const GPU_BUS: [&str; 8] = [
    "0000:04:00.0",
    "0000:05:00.0",
    "0000:0a:00.0",
    "0000:0b:00.0",
    "0000:84:00.0",
    "0000:85:00.0",
    "0000:8a:00.0",
    "0000:8b:00.0",
];
const EXPECTED_NIC: [&str; 8] = [
    "eth1", "eth1", "eth2", "eth2", "eth3", "eth3", "eth4", "eth4",
];

fn a3() -> Topology {
    load("a3-highgpu-8g.xml")
}

/// PUs of the NUMA node (= socket on A3-high) with this OS index.
fn socket_cpus(topo: &Topology, numa: u32) -> BTreeSet<usize> {
    let node = topo
        .numa_nodes()
        .iter()
        .find(|n| n.os_index == numa)
        .expect("NUMA node exists");
    node.cpus.iter().copied().collect()
}

fn data_nics() -> Vec<NicCandidate> {
    ["eth1", "eth2", "eth3", "eth4"]
        .into_iter()
        .map(NicCandidate::new)
        .collect()
}

#[test]
fn discovers_eight_gpus_in_bus_order_with_their_numa_nodes() {
    let topo = a3();
    assert!(topo.has_pci_info());
    let bus: Vec<String> = topo.gpus().iter().map(|g| g.pci.to_string()).collect();
    assert_eq!(bus, GPU_BUS);
    for g in topo.gpus() {
        let want = if g.index < 4 { 0 } else { 1 };
        assert_eq!(g.numa, Some(want), "GPU {} NUMA", g.index);
        assert_eq!(g.package, Some(want), "GPU {} package", g.index);
    }
}

#[test]
fn discovers_five_nics_with_socket_local_cores() {
    let topo = a3();
    let names: Vec<&str> = topo.nics().iter().map(|n| n.name.as_str()).collect();
    assert_eq!(names, ["eth0", "eth1", "eth2", "eth3", "eth4"]);
    let eth3 = topo.nic("eth3").expect("eth3");
    assert_eq!(eth3.pci, Some("0000:86:00.0".parse().unwrap()));
    assert_eq!(eth3.numa, Some(1));
    // Socket 1 = PUs 52–103 and 156–207.
    let want: Vec<usize> = (52..104).chain(156..208).collect();
    assert_eq!(topo.nic_local_cores("eth3"), Some(want.as_slice()));
    let want0: Vec<usize> = (0..52).chain(104..156).collect();
    assert_eq!(topo.nic_local_cores("eth1"), Some(want0.as_slice()));
    assert_eq!(topo.nic_local_cores("eth9"), None);
}

#[test]
fn relations_follow_the_deepest_common_ancestor() {
    let topo = a3();
    let nic = |name: &str| {
        topo.nics()
            .iter()
            .position(|n| n.name == name)
            .expect("nic")
    };
    assert_eq!(topo.relation(0, nic("eth1")), Relation::SameSwitch);
    assert_eq!(topo.relation(0, nic("eth2")), Relation::SameHostBridge);
    // eth0 hangs directly off socket 0's host bridge: never a switch peer of any GPU.
    assert_eq!(topo.relation(0, nic("eth0")), Relation::SameHostBridge);
    assert_eq!(topo.relation(0, nic("eth3")), Relation::OtherSocket);
    assert_eq!(topo.relation(7, nic("eth4")), Relation::SameSwitch);
    assert_eq!(topo.relation(7, nic("eth1")), Relation::OtherSocket);
    assert_eq!(topo.relation(99, 0), Relation::Unknown);
    assert!(Relation::SameSwitch < Relation::SameHostBridge);
    assert!(Relation::SameNuma < Relation::OtherSocket);
}

/// The issue's "done when", with every interface a candidate (eth0 included).
#[test]
fn default_plan_pairs_gpus_with_their_switch_nic() {
    let topo = a3();
    let plan = Plan::build(&topo, &PlanRequest::default()).unwrap();
    assert_eq!(plan.entries.len(), 8);
    let mut all_cores = BTreeSet::new();
    for (g, e) in plan.entries.iter().enumerate() {
        assert_eq!(e.gpu, g);
        assert_eq!(e.pci, GPU_BUS[g]);
        assert_eq!(e.nics, [EXPECTED_NIC[g]], "GPU {g}");
        assert_eq!(e.reason, "same PCIe switch", "GPU {g}");
        let numa = if g < 4 { 0 } else { 1 };
        assert_eq!(e.numa, Some(numa), "GPU {g}");
        assert!(!e.cores.is_empty(), "GPU {g} has cores");
        let socket = socket_cpus(&topo, numa);
        for c in &e.cores {
            assert!(
                socket.contains(c),
                "GPU {g}: core {c} outside socket {numa}"
            );
            assert!(all_cores.insert(*c), "core {c} planned twice");
        }
        assert_eq!(e.channels, 4, "8 connections per NIC shared by two GPUs");
    }
    assert!(plan
        .notes
        .iter()
        .any(|n| n.contains("no GPU uses") && n.contains("eth0")));
}

#[test]
fn cores_for_nic_are_the_union_of_its_gpus_cores() {
    let topo = a3();
    let plan = Plan::build(&topo, &PlanRequest::default()).unwrap();
    let eth3 = plan.cores_for_nic("eth3");
    let mut want: Vec<usize> = plan.entries[4]
        .cores
        .iter()
        .chain(&plan.entries[5].cores)
        .copied()
        .collect();
    want.sort_unstable();
    assert_eq!(eth3, want);
    let local = topo.nic_local_cores("eth3").unwrap();
    assert!(eth3.iter().all(|c| local.contains(c)));
    assert!(plan.cores_for_nic("eth0").is_empty());
}

#[test]
fn hyperthread_siblings_stay_with_one_gpu() {
    let plan = Plan::build(&a3(), &PlanRequest::default()).unwrap();
    for e in &plan.entries {
        let set: BTreeSet<usize> = e.cores.iter().copied().collect();
        for &c in &e.cores {
            // On A3-high the sibling of PU i is PU i+104.
            let sibling = if c < 104 { c + 104 } else { c - 104 };
            assert!(
                set.contains(&sibling),
                "GPU {}: PU {c} without {sibling}",
                e.gpu
            );
        }
    }
}

#[test]
fn plugin_binding_cores_are_left_to_the_plugin() {
    let topo = a3();
    let req = PlanRequest {
        nics: Some(data_nics()),
        tx_bindings: Some(A3_TX.to_owned()),
        rx_bindings: Some(A3_RX.to_owned()),
        ..PlanRequest::default()
    };
    let plan = Plan::build(&topo, &req).unwrap();
    let plugin: BTreeSet<usize> = (8..36)
        .chain(112..140)
        .chain(60..88)
        .chain(164..192)
        .collect();
    for e in &plan.entries {
        assert_eq!(e.nics, [EXPECTED_NIC[e.gpu]]);
        assert!(!e.cores.is_empty(), "GPU {} still has cores", e.gpu);
        let socket = socket_cpus(&topo, e.numa.unwrap());
        for c in &e.cores {
            assert!(
                !plugin.contains(c),
                "GPU {}: core {c} belongs to the plugin",
                e.gpu
            );
            assert!(socket.contains(c), "GPU {}: core {c} off-socket", e.gpu);
        }
    }
    // Socket 0 keeps 0-7 and 36-51 (24 cores, 48 PUs) for four GPUs: 12 PUs each.
    assert_eq!(
        plan.entries[0].cores,
        [0, 1, 2, 3, 4, 5, 104, 105, 106, 107, 108, 109]
    );
    assert!(plan.entries.iter().all(|e| e.cores.len() == 12));
}

#[test]
fn plugin_devices_with_pci_path_exclude_eth0_without_a_note() {
    let topo = a3();
    // The plugin reports sysfs paths; the names here are deliberately not hwloc's to show
    // that pciPath wins over the name.
    let nics = [
        (
            "data1",
            "/sys/devices/pci0000:00/0000:00:02.0/0000:02:00.0/0000:03:02.0/0000:06:00.0",
        ),
        (
            "data2",
            "/sys/devices/pci0000:00/0000:00:03.0/0000:08:00.0/0000:09:02.0/0000:0c:00.0",
        ),
        (
            "data3",
            "/sys/devices/pci0000:80/0000:80:02.0/0000:82:00.0/0000:83:02.0/0000:86:00.0",
        ),
        (
            "data4",
            "/sys/devices/pci0000:80/0000:80:03.0/0000:88:00.0/0000:89:02.0/0000:8c:00.0",
        ),
    ]
    .into_iter()
    .map(|(n, p)| NicCandidate::new(n).with_pci_path(p))
    .collect();
    let req = PlanRequest {
        nics: Some(nics),
        ..PlanRequest::default()
    };
    let plan = Plan::build(&topo, &req).unwrap();
    let got: Vec<&str> = plan.entries.iter().map(|e| e.nics[0].as_str()).collect();
    assert_eq!(
        got,
        ["data1", "data1", "data2", "data2", "data3", "data3", "data4", "data4"]
    );
    assert!(plan.entries.iter().all(|e| e.reason == "same PCIe switch"));
    assert!(plan.notes.is_empty(), "{:?}", plan.notes);
}

#[test]
fn cuda_order_and_subsets_are_respected() {
    let topo = a3();
    let gpus: Vec<PciBusId> = ["00000000:84:00.0", "00000000:04:00.0"]
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
    let req = PlanRequest {
        gpus: Some(gpus),
        nics: Some(data_nics()),
        ..PlanRequest::default()
    };
    let plan = Plan::build(&topo, &req).unwrap();
    assert_eq!(plan.entries[0].pci, "0000:84:00.0");
    assert_eq!(plan.entries[0].nics, ["eth3"]);
    assert_eq!(plan.entries[0].numa, Some(1));
    assert_eq!(plan.entries[1].nics, ["eth1"]);
    // One GPU per NIC: it gets all eight connections.
    assert!(plan.entries.iter().all(|e| e.channels == 8));
}

#[test]
fn explicit_channel_count_wins() {
    let req = PlanRequest {
        channels_per_gpu: 2,
        ..PlanRequest::default()
    };
    let plan = Plan::build(&a3(), &req).unwrap();
    assert!(plan.entries.iter().all(|e| e.channels == 2));
}

#[test]
fn unknown_or_duplicate_gpu_bus_ids_are_named() {
    let topo = a3();
    let req = PlanRequest {
        gpus: Some(vec![
            "0000:04:00.0".parse().unwrap(),
            "0000:99:00.0".parse().unwrap(),
        ]),
        ..PlanRequest::default()
    };
    let err = Plan::build(&topo, &req).unwrap_err();
    assert!(
        matches!(err, TopoError::GpuNotFound { index: 1, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("0000:99:00.0"), "{err}");

    let dup = PlanRequest {
        gpus: Some(vec!["0000:04:00.0".parse().unwrap(); 2]),
        ..PlanRequest::default()
    };
    let err = Plan::build(&topo, &dup).unwrap_err();
    assert!(
        matches!(
            err,
            TopoError::DuplicateGpu {
                first: 0,
                second: 1,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn json_has_the_documented_shape() {
    let plan = Plan::build(&a3(), &PlanRequest::default()).unwrap();
    let v: serde_json::Value = serde_json::from_str(&plan.to_json()).unwrap();
    let first = &v["plan"][0];
    assert_eq!(first["gpu"], 0);
    assert_eq!(first["pci"], "0000:04:00.0");
    assert_eq!(first["numa"], 0);
    assert_eq!(first["nics"], serde_json::json!(["eth1"]));
    assert_eq!(first["reason"], "same PCIe switch");
    assert!(first["cores"].as_array().is_some_and(|c| !c.is_empty()));
    assert_eq!(v["plan"].as_array().map(Vec::len), Some(8));
    // The field order the runtime's logs show.
    let text = plan.to_json();
    assert!(
        text.starts_with(
            r#"{"plan":[{"gpu":0,"pci":"0000:04:00.0","numa":0,"nics":["eth1"],"cores":[0,"#
        ),
        "{text}"
    );
}

#[test]
fn cuda_os_devices_do_not_change_the_plan() {
    let with_cuda = load("a3-highgpu-8g-with-cuda-osdev.xml");
    let a = Plan::build(&a3(), &PlanRequest::default()).unwrap();
    let b = Plan::build(&with_cuda, &PlanRequest::default()).unwrap();
    assert_eq!(a.entries, b.entries);
}
