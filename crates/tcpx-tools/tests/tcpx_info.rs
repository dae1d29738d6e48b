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

/// The engine line: one engine per channel up to the cores (a divisor of the channels), the
/// count set by `TCPX_ENGINES_PER_NIC` when given.
#[test]
fn the_engine_plan_is_shown_automatic_and_explicit() {
    let run = |extra: &[(&str, &str)]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tcpx-info"));
        cmd.env("TCPX_SOCKET_IFNAME", "lo")
            .env("TCPX_NUM_CHANNELS", "2");
        for (k, v) in extra {
            cmd.env(k, v);
        }
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let auto = run(&[]);
    let line = auto
        .lines()
        .find(|l| l.starts_with("engines:"))
        .expect(&auto);
    // 2 channels on one device (lo): 2 engines with 2 cores or more, else 1.
    let want = if cores >= 2 { 2 } else { 1 };
    assert!(
        line.starts_with(&format!(
            "engines:  {want} per device for 2 channels (automatic"
        )),
        "{line}"
    );
    let explicit = run(&[("TCPX_ENGINES_PER_NIC", "3")]);
    let line = explicit
        .lines()
        .find(|l| l.starts_with("engines:"))
        .expect(&explicit);
    assert!(
        line.starts_with("engines:  3 per device for 2 channels (TCPX_ENGINES_PER_NIC")
            && line.ends_with("uses 3 per device"),
        "{line}"
    );
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

/// `tcpx-info --watch` against a live endpoint whose exporter listens where
/// `TCPX_METRICS_ADDR=127.0.0.1:PORT` says: the bytes a real transfer moved show up per NIC
/// (`lo`) and on the connection, in the table and in the JSON, and `--count` stops it.
#[test]
fn watch_shows_the_bytes_a_live_endpoint_moved_per_nic_and_connection() {
    use std::time::Duration;
    use tcpx_runtime::{Backend, Config, Endpoint};

    std::env::set_var("TCPX_SOCKET_IFNAME", "lo");
    // Port 0: the exporter binds a free port and the endpoint says which. A port found free
    // and released first could be taken by another test before the exporter bound it.
    let vars = |with_metrics: bool| {
        move |name: &str| match name {
            "TCPX_METRICS_ADDR" if with_metrics => Some("127.0.0.1:0".to_owned()),
            "TCPX_CONTROL_ADDR" => Some("127.0.0.1:0".to_owned()),
            "TCPX_NUM_CHANNELS" => Some("2".to_owned()),
            _ => None,
        }
    };
    let config = |with_metrics| Config {
        backend: Backend::Builtin,
        timeout: Duration::from_secs(30),
        ..Config::from_vars(vars(with_metrics)).expect("config")
    };
    let server = Endpoint::new(config(true)).expect("server endpoint");
    let client = Endpoint::new(config(false)).expect("client endpoint");
    let metrics = server
        .metrics_addr()
        .expect("TCPX_METRICS_ADDR starts the exporter")
        .to_string();
    assert!(metrics.starts_with("127.0.0.1:"), "{metrics}");
    assert!(
        !metrics.ends_with(":0"),
        "the exporter reports its bound port: {metrics}"
    );
    let peer = server.metadata().clone();
    let accepting = std::thread::spawn(move || {
        let conn = server.accept_timeout(Duration::from_secs(30)).unwrap();
        (server, conn)
    });
    let cc = client.connect(&peer).unwrap();
    let (server, sc) = accepting.join().unwrap();
    const LEN: usize = 3 << 20;
    let src = client.alloc_host(LEN).unwrap();
    src.write(0, &vec![0x5a; LEN]).unwrap();
    let dst = server.alloc_host(LEN).unwrap();
    let rx = sc.recv(&dst, 0, LEN).unwrap();
    cc.send(&src, 0, LEN)
        .unwrap()
        .wait(Duration::from_secs(30))
        .unwrap();
    rx.wait(Duration::from_secs(30)).unwrap();
    let mut back = vec![0; LEN];
    dst.read(0, &mut back).unwrap();
    assert!(
        back.iter().all(|&b| b == 0x5a),
        "the transfer's bytes differ"
    );

    let watch = |extra: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_tcpx-info"))
            .args(["--watch", &metrics, "--count", "2", "--interval", "0.2"])
            .args(extra)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let json = watch(&["--json"]);
    let polls: Vec<serde_json::Value> = json
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(polls.len(), 2, "{json}");
    let last = &polls[1];
    let lo = last["nics"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["nic"] == "lo")
        .unwrap_or_else(|| panic!("no lo row: {last}"));
    assert!(
        lo["received_bytes"].as_u64().unwrap() >= LEN as u64,
        "{last}"
    );
    // Nothing moved between the polls: 0 GB/s, and a rate (not null) on the second poll.
    assert_eq!(lo["received_gbps"].as_f64(), Some(0.0), "{last}");
    assert!(polls[0]["nics"][0]["received_gbps"].is_null());
    let conns = last["connections"].as_array().unwrap();
    assert_eq!(conns.len(), 1, "{last}");
    assert!(conns[0]["received_bytes"].as_u64().unwrap() >= LEN as u64);
    let table = watch(&[]);
    assert!(
        table.contains("# poll 2") && table.contains("lo "),
        "{table}"
    );
    assert!(table.contains(&(LEN as u64).to_string()), "{table}");
    drop((cc, sc));
}
