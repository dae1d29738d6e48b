//! The Python half of `cargo xtask test`: builds `crates/tcpx-py` (dev profile, so it stays a
//! matter of a minute or two) into the virtualenv `target/py-venv` and runs its pytest suite.
//! The virtualenv gets maturin, numpy, pytest and prometheus_client from PyPI once and is
//! reused afterwards.

use std::path::Path;
use std::process::Command;

use anyhow::Result;

use crate::{run_command, workspace_root};

/// Builds the `tcpx` package into `target/py-venv` and runs `crates/tcpx-py/tests`.
pub fn test() -> Result<()> {
    let root = workspace_root();
    let venv = root.join("target/py-venv");
    let bin = venv.join("bin");
    let python = bin.join("python");
    if !python.exists() {
        run_command(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
    }
    let have = |module: &str| {
        Command::new(&python)
            .args(["-c", &format!("import {module}")])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if !bin.join("maturin").exists()
        || !have("numpy")
        || !have("pytest")
        || !have("prometheus_client")
    {
        run_command(Command::new(&python).args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "maturin",
            "numpy",
            "pytest",
            // tests/test_rendezvous.py parses the metrics exporter's text with it.
            "prometheus_client",
        ]))?;
    }
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let crate_dir = root.join("crates/tcpx-py");
    run_command(
        Command::new(bin.join("maturin"))
            .current_dir(&crate_dir)
            .args(["develop", "--quiet"])
            .env("VIRTUAL_ENV", &venv)
            .env("PATH", &path),
    )?;
    run_command(
        Command::new(&python)
            .current_dir(&crate_dir)
            .args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
            .arg(Path::new("tests"))
            // Loopback only (README, "Network rule"); tests/conftest.py pins it as well.
            .env("TCPX_SOCKET_IFNAME", "lo")
            .env("NCCL_SOCKET_IFNAME", "lo")
            .env("TCPX_CONTROL_ADDR", "127.0.0.1:0"),
    )
}
