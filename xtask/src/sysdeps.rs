//! System packages: detect what is missing and install it when we are root on Debian/Ubuntu,
//! otherwise print the one command that does.

use std::process::Command;

use anyhow::{bail, Result};

/// Packages the whole workspace needs to build and test.
/// hwloc (tcpx-topo) needs libhwloc-dev and pkg-config, hwlocality links libudev through hwloc;
/// bindgen loads libclang at run time; lstopo-no-graphics (hwloc-nox) validates fixtures;
/// iproute2 drives the network-namespace runs; valgrind checks the C API's test program;
/// python3-venv holds the virtualenv the Python package (`crates/tcpx-py`) is built and tested in;
/// etcd-server is the real etcd the rendezvous tests start on 127.0.0.1 (`LocalEtcd`);
/// protobuf-compiler is the `protoc` that etcd-client's build script runs (tonic-prost-build
/// compiles etcd's .proto files and bundles no protoc) and libprotobuf-dev its well-known
/// types (`google/protobuf/descriptor.proto`, which etcd's protos import).
pub const ALL: &[&str] = &[
    "pkg-config",
    "libhwloc-dev",
    "libudev-dev",
    "hwloc-nox",
    "libclang-dev",
    "iproute2",
    "valgrind",
    "python3-venv",
    "etcd-server",
    "protobuf-compiler",
    "libprotobuf-dev",
];

/// Makes sure every package in `packages` is installed.
pub fn ensure(packages: &[&str]) -> Result<()> {
    let missing: Vec<&str> = packages.iter().copied().filter(|p| !installed(p)).collect();
    if missing.is_empty() {
        return Ok(());
    }
    let install = format!(
        "apt-get install -y --no-install-recommends {}",
        missing.join(" ")
    );
    let have_apt = Command::new("apt-get").arg("--version").output().is_ok();
    if !have_apt {
        bail!(
            "missing system packages {missing:?} and no apt-get here: install the equivalents \
             of {} with your package manager",
            missing.join(" ")
        );
    }
    if !is_root() {
        bail!("missing system packages; install them with:\n    sudo apt-get update && sudo {install}");
    }
    eprintln!(
        "xtask: installing missing system packages: {}",
        missing.join(" ")
    );
    let status = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive {install} -q"
        ))
        .status()?;
    if !status.success() {
        bail!("`{install}` failed ({status})");
    }
    Ok(())
}

fn installed(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", package])
        .output()
        .map(|o| {
            o.status.success()
                && String::from_utf8_lossy(&o.stdout).contains("install ok installed")
        })
        // No dpkg: not a Debian system; assume the user provides the libraries themselves.
        .unwrap_or(true)
}

/// Whether xtask runs as root (uid 0).
pub fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}
