//! Shared helpers for the integration tests: fixture paths and loaders.

#![allow(dead_code)] // each test binary uses a different subset

use std::path::PathBuf;

use tcpx_topo::Topology;

/// Path of a fixture shipped in `crates/tcpx-topo/fixtures/`.
pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
}

/// Loads a fixture, failing the test with hwloc's message if it does not load.
pub fn load(name: &str) -> Topology {
    Topology::from_xml_file(fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// Every XML fixture the crate ships.
pub const FIXTURES: [&str; 5] = [
    "a3-highgpu-8g.xml",
    "a3-highgpu-8g-with-cuda-osdev.xml",
    "a3-highgpu-8g-no-pci.xml",
    "two-gpu-one-nic.xml",
    "no-gpu-one-nic.xml",
];

/// Google's published TX/RX bindings for a3-highgpu-8g.
pub const A3_TX: &str = "eth1:8-21,112-125;eth2:8-21,112-125;eth3:60-73,164-177;eth4:60-73,164-177";
/// See [`A3_TX`].
pub const A3_RX: &str =
    "eth1:22-35,126-139;eth2:22-35,126-139;eth3:74-87,178-191;eth4:74-87,178-191";
