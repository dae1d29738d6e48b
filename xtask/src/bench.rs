//! `cargo xtask bench`: build in release and run the local loopback benchmark.

use std::process::Command;

use anyhow::Result;

use crate::{run_command, sysdeps, workspace_root};

pub fn run(args: &[String]) -> Result<()> {
    sysdeps::ensure(sysdeps::ALL)?;
    let root = workspace_root();
    run_command(
        Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .current_dir(&root)
            .args([
                "build",
                "--release",
                "-p",
                "tcpx-tools",
                "--bin",
                "tcpx-bench",
            ]),
    )?;
    let bin = root.join("target/release/tcpx-bench");
    run_command(
        Command::new(bin)
            .arg("local")
            .args(args)
            // The local default never leaves loopback.
            .env("TCPX_SOCKET_IFNAME", "lo"),
    )
}
