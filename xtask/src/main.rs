//! Developer tasks for the tcpx workspace, reached through `cargo xtask` (see `.cargo/config.toml`).
//!
//! ```text
//! cargo xtask test              install missing system packages (root) and run every test
//! cargo xtask bench [ARGS]      benchmark: loopback (default), --netns, or --nodes a,b over ssh
//! cargo xtask bindgen [--check] regenerate tcpx-sys bindings, or fail when they drifted
//! cargo xtask capi [--check] [--test]  C API: header (drift check), libtcpx, C tests
//! cargo xtask nixl [--test]     NIXL backend plugin libplugin_TCPX.so; --test: two NIXL agents
//! cargo xtask soak [--seconds N] fault soak: verified traffic against killed and faulted peers
//! cargo xtask layers [-v]       fail when the modules (files) of a library import each other in a loop
//! cargo xtask fuzz [--seconds N] coverage-guided fuzzing of every tcpx-proto decoder (libFuzzer)
//! cargo xtask sysdeps           install (or print how to install) the system packages
//! ```
//!
//! The xtask stays light on purpose: std, anyhow and bindgen (libclang is loaded at run time).

mod bench;
mod bindgen_task;
mod capi;
mod etcd;
mod fuzz;
mod layers;
mod nixl;
mod python;
mod soak;
mod sysdeps;
mod test_task;

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};

const HELP: &str = "\
cargo xtask <task> [options]

Tasks:
  test [-- CARGO_TEST_ARGS]   Install missing system packages (as root on Debian/Ubuntu), then run
                              the whole test suite with the socket plugin pinned to `lo`.
  bench [OPTIONS]             Build tcpx-bench in release and run server/client pairs against
                              an in-run raw-TCP baseline: over loopback (default), between two
                              network namespaces with four NICs each (--netns), or between two
                              machines over ssh (--nodes a,b [--gpus 0-7]). Results, CSV and an
                              SVG plot land in target/bench/. See `cargo xtask bench --help`.
  bindgen [--check]           Regenerate crates/tcpx-sys/src/bindings.rs from include/tcpx_net.h;
                              with --check, fail (exit 1) when the checked-in file has drifted.
  capi [--check] [--test] [--install PREFIX]
                              Generate crates/tcpx-capi/include/tcpx.h (cbindgen; --check fails
                              on drift), build libtcpx.{so,a}, target/capi/tcpx.pc and the C
                              examples and tests; --test runs them (also under valgrind).
  nixl [--test] [--bench [ARGS]] [--probe NIXL_SRC]
                              Build the NIXL backend plugin (target/nixl/plugins); --test runs two
                              NIXL agents (PyPI nixl-cu12) over it, --bench compares with UCX.
  soak [--seconds N]          Fault soak (default 60 s): random two-sided and one-sided traffic,
                              every byte checked, against peers killed or faulted at random;
                              prints done / verified / faults / failures / lost (must be 0).
  layers [-v]                 Fail when the modules (files) of a workspace library import each
                              other in a loop (crate::, super::, self:: paths); -v prints each
                              crate's module order.
  fuzz [--seconds N] [--target NAME]
                              Build the libFuzzer targets of crates/tcpx-proto/fuzz (stable
                              toolchain) and run each decoder's for N seconds (default 30) from
                              the checked-in seeds; executions, coverage, corpus; fails on a crash.
  sysdeps                     Install the system packages the workspace needs, or print the
                              one command that does when not root.
";

fn main() {
    if let Err(err) = run() {
        eprintln!("xtask: error: {err:#}");
        let interrupted = err.downcast_ref::<bench::Interrupted>().is_some();
        std::process::exit(if interrupted { 130 } else { 1 });
    }
}

fn run() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let task = args.next();
    let rest: Vec<String> = args.collect();
    match task.as_deref() {
        Some("test") => test_task::run(&rest),
        Some("bench") => bench::run(&rest),
        Some("bindgen") => bindgen_task::run(&rest),
        Some("capi") => capi::run(&rest),
        Some("nixl") => nixl::run(&rest),
        Some("soak") => soak::run(&rest),
        Some("layers") => layers::run(&rest),
        Some("fuzz") => fuzz::run(&rest),
        Some("sysdeps") => sysdeps::ensure(sysdeps::ALL),
        Some("-h" | "--help" | "help") | None => {
            print!("{HELP}");
            Ok(())
        }
        Some(other) => bail!("unknown task `{other}`\n\n{HELP}"),
    }
}

/// The workspace root (the parent of this crate's manifest directory).
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

/// Runs a command to completion, failing with the command line when it exits non-zero.
fn run_command(cmd: &mut std::process::Command) -> Result<()> {
    let status = cmd
        .status()
        .map_err(|e| anyhow::anyhow!("cannot start {cmd:?}: {e}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}
