//! `cargo xtask test`: the README's test command. Installs missing system packages (as root),
//! then runs the workspace tests with every plugin and control connection pinned to loopback,
//! and the runtime's etcd rendezvous tests (`--features etcd`) against real etcd servers.

use std::process::Command;

use anyhow::Result;

use crate::{run_command, sysdeps, workspace_root};

pub fn run(args: &[String]) -> Result<()> {
    sysdeps::ensure(sysdeps::ALL)?;
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    if args.is_empty() {
        // xtask's own unit tests (options, quoting, results, plot, the ssh wrapper) in the dev
        // profile that `cargo xtask` already built, so its dependencies are not rebuilt at the
        // test profile's opt-level.
        run_command(Command::new(&cargo).current_dir(workspace_root()).args([
            "test",
            "--quiet",
            "--profile",
            "dev",
            "-p",
            "xtask",
        ]))?;
    }
    let mut cmd = Command::new(cargo);
    cmd.current_dir(workspace_root())
        .args([
            "test",
            "--workspace",
            "--exclude",
            "xtask",
            "--exclude",
            "tcpx-py",
        ])
        .args(args)
        // Tests pin themselves to `lo`; the environment is a second lock on the same door, so
        // no test traffic can ever leave loopback (see README, "Network rule").
        .env("TCPX_SOCKET_IFNAME", "lo")
        .env("NCCL_SOCKET_IFNAME", "lo");
    run_command(&mut cmd)?;
    if args.is_empty() {
        // Extra arguments are for the workspace run above only.
        etcd_tests()?;
        // The Python package (an extension module: built by maturin, tested by pytest).
        crate::python::test()?;
    }
    Ok(())
}

/// Rendezvous through a real etcd (`etcd-server`, installed by [`sysdeps::ensure`]): the
/// runtime's etcd tests exist only with its `etcd` feature, so they are run by name with it,
/// whatever other members turn on. Each test starts its own etcd on 127.0.0.1 with a
/// temporary data directory and stops it; without an etcd binary they say so and pass.
fn etcd_tests() -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    run_command(
        Command::new(cargo)
            .current_dir(workspace_root())
            .args([
                "test",
                "-p",
                "tcpx-runtime",
                "--features",
                "etcd",
                "--test",
                "rendezvous_etcd",
            ])
            .env("TCPX_SOCKET_IFNAME", "lo")
            .env("NCCL_SOCKET_IFNAME", "lo"),
    )
}
