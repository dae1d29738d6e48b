//! Every shipped fixture must load in hwloc's own tool too (hwloc 2.9 segfaults on fixtures
//! missing complete_cpuset/complete_nodeset, so this guards the fixtures themselves).

mod common;

use std::process::Command;

#[test]
fn every_fixture_loads_in_lstopo() {
    let probe = Command::new("lstopo-no-graphics").arg("--version").output();
    if probe.is_err() {
        eprintln!("skipping: lstopo-no-graphics not found (install hwloc-nox to run this check)");
        return;
    }
    for name in common::FIXTURES {
        let out = Command::new("lstopo-no-graphics")
            .arg("--input")
            .arg(common::fixture(name))
            .arg("--whole-io")
            .arg("--of")
            .arg("console")
            .output()
            .expect("lstopo-no-graphics runs");
        assert!(
            out.status.success(),
            "{name}: lstopo failed ({:?}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("Machine"), "{name}: {text}");
        // Every loadable fixture must also load through our own path.
        common::load(name);
    }
}

#[test]
fn derived_fixtures_match_their_generator() {
    let script = common::fixture("derive_fixtures.py");
    let Ok(out) = Command::new("python3").arg(&script).arg("--check").output() else {
        eprintln!("skipping: python3 not found");
        return;
    };
    assert!(
        out.status.success(),
        "derived fixtures are stale: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
