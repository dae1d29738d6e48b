//! Boxes other than A3-high: two GPUs behind one NIC, a NIC but no GPU, a VM that hides
//! PCI data, NICs hwloc does not know.

mod common;

use std::collections::BTreeSet;

use common::{load, A3_RX, A3_TX};
use tcpx_topo::{NicCandidate, PciBusId, Plan, PlanRequest, TopoError};

#[test]
fn two_gpus_share_the_one_nic_on_disjoint_cores() {
    let topo = load("two-gpu-one-nic.xml");
    assert_eq!(topo.gpus().len(), 2);
    let plan = Plan::build(&topo, &PlanRequest::default()).unwrap();
    assert_eq!(plan.entries.len(), 2);
    for e in &plan.entries {
        assert_eq!(e.nics, ["eth1"]);
        assert_eq!(e.reason, "same PCIe switch");
        assert_eq!(e.numa, Some(0));
        assert_eq!(e.channels, 4);
    }
    // 4 cores × 2 threads (PU i and i+4 are siblings): two whole cores each.
    assert_eq!(plan.entries[0].cores, [0, 1, 4, 5]);
    assert_eq!(plan.entries[1].cores, [2, 3, 6, 7]);
    assert!(plan.notes.is_empty(), "{:?}", plan.notes);
}

#[test]
fn box_without_gpu_plans_nothing_but_lists_its_nic() {
    let topo = load("no-gpu-one-nic.xml");
    assert!(topo.gpus().is_empty());
    assert!(topo.has_pci_info());
    let nic = topo.nic("eth1").expect("eth1 discovered");
    assert_eq!(nic.numa, Some(0));
    assert_eq!(nic.local_cpus, (0..8).collect::<Vec<_>>());
    assert_eq!(
        topo.nic_local_cores("eth1"),
        Some(&[0, 1, 2, 3, 4, 5, 6, 7][..])
    );
    let plan = Plan::build(&topo, &PlanRequest::default()).unwrap();
    assert!(plan.entries.is_empty());
    assert!(plan
        .notes
        .iter()
        .any(|n| n.contains("no GPU") && n.contains("eth1")));
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&plan.to_json()).unwrap()["plan"],
        serde_json::json!([])
    );
}

fn a3_bus_ids() -> Vec<PciBusId> {
    ["04", "05", "0a", "0b", "84", "85", "8a", "8b"]
        .iter()
        .map(|b| format!("0000:{b}:00.0").parse().unwrap())
        .collect()
}

#[test]
fn no_pci_data_falls_back_to_the_static_layout_and_says_so() {
    let topo = load("a3-highgpu-8g-no-pci.xml");
    assert!(!topo.has_pci_info());
    assert!(topo.gpus().is_empty() && topo.nics().is_empty());
    let req = PlanRequest {
        gpus: Some(a3_bus_ids()),
        nics: Some(
            ["eth1", "eth2", "eth3", "eth4"]
                .into_iter()
                .map(NicCandidate::new)
                .collect(),
        ),
        tx_bindings: Some(A3_TX.to_owned()),
        rx_bindings: Some(A3_RX.to_owned()),
        ..PlanRequest::default()
    };
    let plan = Plan::build(&topo, &req).unwrap();
    let want = [
        "eth1", "eth1", "eth2", "eth2", "eth3", "eth3", "eth4", "eth4",
    ];
    let plugin: BTreeSet<usize> = (8..36)
        .chain(112..140)
        .chain(60..88)
        .chain(164..192)
        .collect();
    for (g, e) in plan.entries.iter().enumerate() {
        assert_eq!(e.nics, [want[g]]);
        assert_eq!(e.reason, "fallback: no PCI data");
        assert_eq!(e.numa, None, "the fallback never invents a NUMA node");
        let node = &topo.numa_nodes()[g / 4];
        assert!(!e.cores.is_empty());
        assert!(e
            .cores
            .iter()
            .all(|c| node.cpus.contains(c) && !plugin.contains(c)));
    }
    assert!(plan.notes.iter().any(|n| n.contains("no PCI")));
}

#[test]
fn no_pci_data_and_no_gpu_list_plans_nothing() {
    let topo = load("a3-highgpu-8g-no-pci.xml");
    let req = PlanRequest {
        gpu_nic_map: Some("0:eth1".to_owned()),
        ..PlanRequest::default()
    };
    let plan = Plan::build(&topo, &req).unwrap();
    assert!(plan.entries.is_empty());
    assert!(
        plan.notes.iter().any(|n| n.contains("PlanRequest::gpus")),
        "{:?}",
        plan.notes
    );
    assert!(
        plan.notes
            .iter()
            .any(|n| n.contains("TCPX_GPU_NIC_MAP ignored")),
        "{:?}",
        plan.notes
    );
}

#[test]
fn gpus_without_any_nic_are_an_error() {
    let topo = load("two-gpu-one-nic.xml");
    let req = PlanRequest {
        nics: Some(Vec::new()),
        ..PlanRequest::default()
    };
    let err = Plan::build(&topo, &req).unwrap_err();
    assert!(matches!(err, TopoError::NoNics { gpus: 2 }), "{err}");
}

#[test]
fn nic_unknown_to_hwloc_is_planned_with_unknown_locality() {
    // Our kernel-TCP plugin in a network namespace offers veth NICs hwloc never saw.
    let topo = load("two-gpu-one-nic.xml");
    let req = PlanRequest {
        nics: Some(vec![NicCandidate::new("veth1")]),
        ..PlanRequest::default()
    };
    let plan = Plan::build(&topo, &req).unwrap();
    for e in &plan.entries {
        assert_eq!(e.nics, ["veth1"]);
        assert!(e.reason.starts_with("locality unknown"), "{}", e.reason);
        assert!(
            !e.cores.is_empty(),
            "cores fall back to the GPU's local set"
        );
    }
    assert!(plan.notes.iter().any(|n| n.contains("veth1")));
}

#[test]
fn known_nic_beats_unknown_nic() {
    let topo = load("two-gpu-one-nic.xml");
    let req = PlanRequest {
        nics: Some(vec![NicCandidate::new("veth1"), NicCandidate::new("eth1")]),
        ..PlanRequest::default()
    };
    let plan = Plan::build(&topo, &req).unwrap();
    assert!(plan.entries.iter().all(|e| e.nics == ["eth1"]));
}

#[test]
fn duplicate_or_empty_nic_candidates_are_rejected() {
    let topo = load("two-gpu-one-nic.xml");
    for nics in [
        vec![NicCandidate::new("eth1"), NicCandidate::new("eth1")],
        vec![NicCandidate::new(" ")],
    ] {
        let req = PlanRequest {
            nics: Some(nics),
            ..PlanRequest::default()
        };
        let err = Plan::build(&topo, &req).unwrap_err();
        assert!(matches!(err, TopoError::InvalidRequest { .. }), "{err}");
    }
}

#[test]
fn malformed_bindings_are_named() {
    let topo = load("two-gpu-one-nic.xml");
    let req = PlanRequest {
        rx_bindings: Some("eth1:3-1".to_owned()),
        ..PlanRequest::default()
    };
    let err = Plan::build(&topo, &req).unwrap_err();
    assert!(
        err.to_string().contains("NCCL_GPUDIRECTTCPX_RX_BINDINGS"),
        "{err}"
    );
}

#[test]
fn bindings_covering_every_local_core_are_shared_with_a_note() {
    let topo = load("two-gpu-one-nic.xml");
    let req = PlanRequest {
        tx_bindings: Some("eth1:0-7".to_owned()),
        ..PlanRequest::default()
    };
    let plan = Plan::build(&topo, &req).unwrap();
    assert!(plan.entries.iter().all(|e| !e.cores.is_empty()));
    assert!(
        plan.notes.iter().any(|n| n.contains("sharing")),
        "{:?}",
        plan.notes
    );
}
