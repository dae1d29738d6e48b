//! `tcpx-info` as a user runs it: on the a3-highgpu-8g fixture with --json, and on this machine.

use std::process::Command;

fn fixture(name: &str) -> String {
    format!(
        "{}/../tcpx-topo/fixtures/{name}",
        env!("CARGO_MANIFEST_DIR")
    )
}

#[test]
fn json_plan_for_a3_high_pairs_each_gpu_with_its_switch_nic() {
    let out = Command::new(env!("CARGO_BIN_EXE_tcpx-info"))
        .args(["--topology", &fixture("a3-highgpu-8g.xml"), "--json"])
        .env_remove("TCPX_GPU_NIC_MAP")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let plan = json["plan"].as_array().unwrap();
    assert_eq!(plan.len(), 8);
    let expected = [
        "eth1", "eth1", "eth2", "eth2", "eth3", "eth3", "eth4", "eth4",
    ];
    for (i, entry) in plan.iter().enumerate() {
        assert_eq!(entry["gpu"], i);
        assert_eq!(entry["nics"][0], expected[i], "{entry}");
        assert_eq!(entry["numa"], if i < 4 { 0 } else { 1 });
        assert_eq!(entry["reason"], "same PCIe switch");
        assert!(!entry["cores"].as_array().unwrap().is_empty());
    }
    assert_eq!(plan[0]["pci"], "0000:04:00.0");
}

#[test]
fn this_machine_gets_a_sensible_answer() {
    let out = Command::new(env!("CARGO_BIN_EXE_tcpx-info"))
        .env("TCPX_SOCKET_IFNAME", "lo")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("plugin:"), "{stdout}");
    assert!(stdout.contains("tcpx-socket"), "{stdout}");
}

#[test]
fn a_missing_topology_file_is_a_clear_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_tcpx-info"))
        .args(["--topology", "/nonexistent.xml"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("/nonexistent.xml"), "{stderr}");
}
