//! `TCPX_GPU_NIC_MAP` on the a3-highgpu-8g fixture: valid maps win over discovery; unknown
//! GPUs and NICs and malformed text are errors that name the culprit.

mod common;

use common::load;
use tcpx_topo::{NicCandidate, Plan, PlanRequest, TopoError};

fn with_map(map: &str) -> PlanRequest {
    PlanRequest {
        nics: Some(
            ["eth1", "eth2", "eth3", "eth4"]
                .into_iter()
                .map(NicCandidate::new)
                .collect(),
        ),
        gpu_nic_map: Some(map.to_owned()),
        ..PlanRequest::default()
    }
}

#[test]
fn full_override_is_followed_and_marked() {
    let topo = load("a3-highgpu-8g.xml");
    // Deliberately cross-socket, to show the override wins over the topology.
    let plan = Plan::build(&topo, &with_map("0,1:eth4;2,3:eth3;4,5:eth2;6,7:eth1")).unwrap();
    let got: Vec<&str> = plan.entries.iter().map(|e| e.nics[0].as_str()).collect();
    assert_eq!(
        got,
        ["eth4", "eth4", "eth3", "eth3", "eth2", "eth2", "eth1", "eth1"]
    );
    assert!(plan.entries.iter().all(|e| e.reason == "override"));
    // Progress threads follow the NIC: GPU 0 now uses eth4, local to socket 1.
    let eth4 = topo.nic_local_cores("eth4").unwrap();
    assert!(plan.entries[0].cores.iter().all(|c| eth4.contains(c)));
}

#[test]
fn the_documented_example_matches_discovery() {
    let topo = load("a3-highgpu-8g.xml");
    let plan = Plan::build(&topo, &with_map("0,1:eth1;2,3:eth2;4,5:eth3;6,7:eth4")).unwrap();
    let auto = Plan::build(&topo, &PlanRequest::default()).unwrap();
    for (o, a) in plan.entries.iter().zip(&auto.entries) {
        assert_eq!(o.nics, a.nics);
        assert_eq!(o.cores, a.cores);
        assert_eq!(o.reason, "override");
    }
}

#[test]
fn partial_override_leaves_the_rest_to_discovery_and_counts_its_load() {
    let topo = load("a3-highgpu-8g.xml");
    let plan = Plan::build(&topo, &with_map("0:eth1,eth2")).unwrap();
    assert_eq!(plan.entries[0].nics, ["eth1", "eth2"]);
    assert_eq!(plan.entries[0].reason, "override");
    assert_eq!(plan.entries[1].nics, ["eth1"]);
    assert_eq!(plan.entries[1].reason, "same PCIe switch");
    // Automatic channels: GPU 0 shares eth1 with GPU 1 (8 / 2) and eth2 with GPUs 2, 3 (8 / 3).
    assert_eq!(plan.entries[0].channels, 8 / 2 + 8 / 3);
}

#[test]
fn unknown_gpu_index_is_named() {
    let topo = load("a3-highgpu-8g.xml");
    let err = Plan::build(&topo, &with_map("0,1:eth1;8:eth2")).unwrap_err();
    assert!(
        matches!(
            err,
            TopoError::UnknownGpu {
                index: 8,
                count: 8,
                ..
            }
        ),
        "{err}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("TCPX_GPU_NIC_MAP") && msg.contains("GPU 8"),
        "{msg}"
    );
}

#[test]
fn unknown_nic_name_is_named_with_the_candidates() {
    let topo = load("a3-highgpu-8g.xml");
    let err = Plan::build(&topo, &with_map("0,1:eth1;2,3:eth7")).unwrap_err();
    match &err {
        TopoError::UnknownNic {
            name, candidates, ..
        } => {
            assert_eq!(name, "eth7");
            assert_eq!(candidates, "eth1, eth2, eth3, eth4");
        }
        other => panic!("expected UnknownNic, got {other}"),
    }
    // eth0 exists in hwloc but is not one of the plugin's devices: not plannable.
    let err = Plan::build(&topo, &with_map("0:eth0")).unwrap_err();
    assert!(err.to_string().contains("\"eth0\""), "{err}");
}

#[test]
fn malformed_override_is_an_error_naming_the_variable() {
    let topo = load("a3-highgpu-8g.xml");
    for bad in ["0,1", "a:eth1", "0:", "0:eth1;0:eth2", ";;", "0,,1:eth1"] {
        let err = Plan::build(&topo, &with_map(bad)).unwrap_err();
        assert!(matches!(err, TopoError::Malformed { .. }), "{bad:?}: {err}");
        assert!(
            err.to_string().contains("TCPX_GPU_NIC_MAP"),
            "{bad:?}: {err}"
        );
    }
}

#[test]
fn override_on_a_box_without_pci_data_is_still_followed() {
    let topo = load("a3-highgpu-8g-no-pci.xml");
    let mut req = with_map("0:eth2");
    req.gpus = Some(vec![
        "0000:04:00.0".parse().unwrap(),
        "0000:05:00.0".parse().unwrap(),
    ]);
    let plan = Plan::build(&topo, &req).unwrap();
    assert_eq!(plan.entries[0].nics, ["eth2"]);
    assert_eq!(plan.entries[0].reason, "override");
    assert_eq!(plan.entries[1].reason, "fallback: no PCI data");
}
