//! `cargo xtask soak --seconds N`: the fault soak. Builds and runs the ignored `soak` test of
//! crates/tcpx-runtime/tests/faults_soak.rs, which drives one endpoint against a succession of
//! peer processes — killed at random points, started with random plugin faults, or left to
//! finish — with random two-sided and one-sided operations, every byte checked. It prints one
//! summary line (transfers done, bytes verified, faults injected, failures seen, lost) and
//! fails when anything was lost, nothing completed, or an fd or thread leaked. Everything stays
//! on loopback.

use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::{run_command, workspace_root};

const USAGE: &str = "usage: cargo xtask soak [--seconds N]   (default 60)";

pub fn run(args: &[String]) -> Result<()> {
    let mut seconds: u64 = 60;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--seconds" => {
                let v = it.next().context(USAGE)?;
                seconds =
                    v.parse().ok().filter(|&s| s > 0).with_context(|| {
                        format!("--seconds {v:?}: a whole number above 0\n{USAGE}")
                    })?;
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            other => bail!("unknown option {other:?}\n{USAGE}"),
        }
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(workspace_root())
        .args([
            "test",
            "-p",
            "tcpx-runtime",
            "--test",
            "faults_soak",
            "--",
            "--ignored",
            "--exact",
            "soak",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("TCPX_SOAK_SECONDS", seconds.to_string())
        .env("TCPX_SOCKET_IFNAME", "lo")
        .env("NCCL_SOCKET_IFNAME", "lo")
        .env_remove("TCPX_SOCKET_FAULT");
    run_command(&mut cmd)
}
