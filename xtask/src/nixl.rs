//! `cargo xtask nixl [--test] [--bench [ARGS]] [--probe NIXL_SRC]`: the NIXL backend plugin.
//!
//! - Builds `libtcpx.so` (release, `tcpx-capi`) and `libplugin_TCPX.so` from
//!   `integrations/nixl/src` with the system C++ compiler (`$CXX`, else `c++`), C++17, hidden
//!   visibility and a version script, into `target/nixl/plugins/` next to a copy of
//!   `libtcpx.so` (the plugin's RPATH is `$ORIGIN`: an RPATH, not a RUNPATH, so that the copy
//!   beside it wins over any `libtcpx.so` on `LD_LIBRARY_PATH` — `cargo run` puts
//!   `target/debug` there, and a stale one made NIXL report the backend as unsupported, the
//!   plugin failing to load on a missing symbol). Point NIXL at that directory with
//!   `NIXL_PLUGIN_DIR`. Fails if the plugin exports anything but NIXL's two entry points.
//! - `--test` creates `target/nixl/venv` (PyPI `nixl-cu12==1.5.1` without its optional torch
//!   dependency, and numpy) once, then runs `integrations/nixl/tests/test_agents.py`: two NIXL
//!   agents in two processes over 127.0.0.1; then `integrations/nixl/tests/recreate.py`: 20
//!   agent pairs re-created under the same names (UCCL's benchmark_nixl.py's loop), bounded;
//!   then `integrations/nixl/tests/test_etcd.py`: NIXL's own etcd metadata exchange
//!   (`NIXL_ETCD_ENDPOINTS`) between two agents over TCPX, an agent restarted under the same
//!   name found again, against a throw-away etcd on 127.0.0.1 (Debian's `etcd-server`,
//!   installed when missing and root; without an etcd binary that test says SKIP).
//! - `--bench [ARGS]` builds `tcpx-bench` (release) and runs `integrations/nixl/bench/compare.py
//!   --tcpx-bench target/release/tcpx-bench ARGS`: NIXL's UCX backend against TCPX, large
//!   blocks and KV lists, WRITE and READ, plus the same bytes through `tcpx-bench
//!   server/client` with the same channels (`ARGS`: e.g. `--memory cuda`, `--channels 8`).
//! - `--probe NIXL_SRC` compiles and runs `integrations/nixl/probe/abi_probe.cpp` against a
//!   NIXL source checkout (kept outside this repository), proving that our
//!   `nixl_backend_abi.h` matches NIXL's real layouts and virtual slots.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::capi::run_limited;
use crate::{run_command, sysdeps, workspace_root};

const USAGE: &str = "usage: cargo xtask nixl [--test] [--bench [ARGS...]] [--probe NIXL_SRC]";

/// The NIXL release the plugin's header matches and the test installs.
const NIXL_WHEEL: &str = "nixl-cu12==1.5.1";
/// The agent test's limit (it takes about a minute on a 2-core box).
const TEST_LIMIT: Duration = Duration::from_secs(600);
const BENCH_LIMIT: Duration = Duration::from_secs(1800);
/// The re-creation regression test: 20 agent pairs, 4 transfers each, host memory (about
/// 15 s on a 2-core box); each wait inside gives up after 20 s.
const RECREATE_ARGS: &[&str] = &[
    "--backend",
    "TCPX",
    "--iterations",
    "20",
    "--transfers",
    "4",
    "--timeout",
    "20",
];
const RECREATE_LIMIT: Duration = Duration::from_secs(300);
/// The etcd test: an etcd start, three agent generations (a few seconds); every wait inside
/// gives up after 30 s.
const ETCD_LIMIT: Duration = Duration::from_secs(300);

struct Options {
    test: bool,
    bench: Option<Vec<String>>,
    probe: Option<PathBuf>,
}

fn parse(args: &[String]) -> Result<Options> {
    let mut o = Options {
        test: false,
        bench: None,
        probe: None,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--test" => o.test = true,
            "--bench" => {
                o.bench = Some(it.by_ref().cloned().collect());
            }
            "--probe" => {
                let dir = it.next().context("--probe needs a NIXL source directory")?;
                o.probe = Some(PathBuf::from(dir));
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => bail!("unknown argument `{other}`\n{USAGE}"),
        }
    }
    Ok(o)
}

pub fn run(args: &[String]) -> Result<()> {
    let o = parse(args)?;
    let root = workspace_root();
    if let Some(src) = &o.probe {
        return probe(&root, src);
    }
    let plugins = build(&root)?;
    println!(
        "NIXL plugin: {}",
        plugins.join("libplugin_TCPX.so").display()
    );
    if !o.test && o.bench.is_none() {
        println!("use it with: NIXL_PLUGIN_DIR={}", plugins.display());
        return Ok(());
    }
    let python = venv(&root)?;
    if o.test {
        let mut cmd = Command::new(&python);
        cmd.arg(root.join("integrations/nixl/tests/test_agents.py"));
        run_limited(loopback(&mut cmd, &plugins), TEST_LIMIT)?;
        // The agent re-creation loop (UCCL's benchmark_nixl.py's shape): a new agent pair per
        // iteration under the same names; every wait in it is bounded, a stall fails.
        let mut cmd = Command::new(&python);
        cmd.arg(root.join("integrations/nixl/tests/recreate.py"))
            .args(RECREATE_ARGS);
        run_limited(loopback(&mut cmd, &plugins), RECREATE_LIMIT)?;
        // NIXL's etcd metadata path with our backend; the test starts and removes its etcd.
        if crate::etcd::binary().is_none() {
            if let Err(e) = sysdeps::ensure(&["etcd-server"]) {
                eprintln!("xtask: {e:#}\nxtask: without an etcd binary test_etcd.py skips");
            }
        }
        let mut cmd = Command::new(&python);
        cmd.arg(root.join("integrations/nixl/tests/test_etcd.py"));
        if let Some(etcd) = crate::etcd::binary() {
            cmd.env("TCPX_ETCD_BIN", etcd);
        }
        run_limited(loopback(&mut cmd, &plugins), ETCD_LIMIT)?;
    }
    if let Some(args) = &o.bench {
        // tcpx without NIXL, same channels and sizes, in the same run (the plugin's overhead).
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        run_command(Command::new(&cargo).current_dir(&root).args([
            "build",
            "--release",
            "-p",
            "tcpx-tools",
            "--bin",
            "tcpx-bench",
        ]))?;
        let mut cmd = Command::new(&python);
        cmd.arg(root.join("integrations/nixl/bench/compare.py"))
            .arg("--tcpx-bench")
            .arg(root.join("target/release/tcpx-bench"))
            .args(args);
        run_limited(loopback(&mut cmd, &plugins), BENCH_LIMIT)?;
    }
    Ok(())
}

/// Pins everything the agents start to loopback (the repository's network rule).
fn loopback<'a>(cmd: &'a mut Command, plugins: &Path) -> &'a mut Command {
    cmd.env("NIXL_PLUGIN_DIR", plugins)
        .env("TCPX_SOCKET_IFNAME", "lo")
        .env("NCCL_SOCKET_IFNAME", "lo")
        .env("UCX_TLS", "tcp,self")
        .env("UCX_NET_DEVICES", "lo")
}

fn cxx() -> String {
    std::env::var("CXX").unwrap_or_else(|_| "c++".into())
}

/// Builds libtcpx.so and the plugin into target/nixl/plugins; returns that directory.
fn build(root: &Path) -> Result<PathBuf> {
    if Command::new(cxx()).arg("--version").output().is_err() {
        sysdeps::ensure(&["g++"])?;
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    run_command(Command::new(&cargo).current_dir(root).args([
        "build",
        "--release",
        "-p",
        "tcpx-capi",
        "--lib",
    ]))?;
    let out = root.join("target/nixl/plugins");
    std::fs::create_dir_all(&out)?;
    let lib = root.join("target/release/libtcpx.so");
    // Replace, never overwrite in place: a running agent may have the old copy mapped.
    let tmp = out.join(".libtcpx.so.new");
    std::fs::copy(&lib, &tmp).with_context(|| format!("copying {}", lib.display()))?;
    std::fs::rename(&tmp, out.join("libtcpx.so"))?;

    let src = root.join("integrations/nixl/src");
    let plugin = out.join("libplugin_TCPX.so");
    let tmp = out.join(".libplugin_TCPX.so.new");
    run_command(
        Command::new(cxx())
            .args([
                "-std=c++17",
                "-O2",
                "-g",
                "-Wall",
                "-Wextra",
                "-Werror",
                "-fPIC",
            ])
            .args([
                "-fvisibility=hidden",
                "-fvisibility-inlines-hidden",
                "-shared",
            ])
            .arg(format!(
                "-I{}",
                root.join("integrations/nixl/include").display()
            ))
            .arg(format!(
                "-I{}",
                root.join("crates/tcpx-capi/include").display()
            ))
            .arg(src.join("engine.cpp"))
            .arg(src.join("plugin.cpp"))
            .arg("-o")
            .arg(&tmp)
            .arg(format!(
                "-Wl,--version-script={}",
                src.join("exports.map").display()
            ))
            .args([
                "-Wl,-z,defs",
                "-Wl,--disable-new-dtags",
                "-Wl,-rpath,$ORIGIN",
            ])
            .arg(format!("-L{}", out.display()))
            .args(["-ltcpx", "-pthread"]),
    )?;
    check_exports(&tmp)?;
    std::fs::rename(&tmp, &plugin)?;
    Ok(out)
}

/// The plugin must export NIXL's two entry points and nothing else (its inline copies of the
/// NIXL-shaped classes must never interpose on libnixl's). Skipped without `nm`.
fn check_exports(plugin: &Path) -> Result<()> {
    let Ok(output) = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(plugin)
        .output()
    else {
        eprintln!("xtask: nm not found; not checking the plugin's exported symbols");
        return Ok(());
    };
    let text = String::from_utf8_lossy(&output.stdout);
    let exported: Vec<&str> = text
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2))
        .collect();
    let mut sorted = exported.clone();
    sorted.sort_unstable();
    if sorted != ["nixl_plugin_fini", "nixl_plugin_init"] {
        bail!(
            "{} exports {exported:?}; expected only nixl_plugin_init and nixl_plugin_fini",
            plugin.display()
        );
    }
    Ok(())
}

/// target/nixl/venv with the NIXL wheel and numpy; returns its python.
fn venv(root: &Path) -> Result<PathBuf> {
    let dir = root.join("target/nixl/venv");
    let python = dir.join("bin/python");
    let ready = |p: &Path| {
        Command::new(p)
            .args(["-c", "import nixl_cu12, numpy"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if python.exists() && ready(&python) {
        return Ok(python);
    }
    let host = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    if Command::new(&host).arg("--version").output().is_err() {
        sysdeps::ensure(&["python3", "python3-venv"])?;
    }
    let started = Instant::now();
    let mut create = Command::new(&host);
    create.args(["-m", "venv", "--clear"]).arg(&dir);
    if run_command(&mut create).is_err() {
        // Debian splits venv/ensurepip into python3-venv.
        sysdeps::ensure(&["python3-venv"])?;
        run_command(&mut create)?;
    }
    let pip = dir.join("bin/pip");
    // nixl-cu12 declares torch as a dependency but imports it only when handed torch tensors;
    // without --no-deps pip would fetch several GB of torch and CUDA wheels.
    run_command(
        Command::new(&pip)
            .args(["install", "-q", "--disable-pip-version-check", "--no-deps"])
            .arg(NIXL_WHEEL),
    )?;
    run_command(Command::new(&pip).args([
        "install",
        "-q",
        "--disable-pip-version-check",
        "numpy",
    ]))?;
    if !ready(&python) {
        bail!("{} cannot import nixl_cu12 and numpy", python.display());
    }
    println!(
        "NIXL virtualenv ready in {:.0?}: {}",
        started.elapsed(),
        dir.display()
    );
    Ok(python)
}

/// Compiles and runs the layout probe against NIXL's headers in `src` (a NIXL checkout).
fn probe(root: &Path, src: &Path) -> Result<()> {
    let api = src.join("src/api/cpp");
    if !api.join("backend/backend_engine.h").exists() {
        bail!(
            "{} is not a NIXL source checkout (no src/api/cpp/backend/backend_engine.h)",
            src.display()
        );
    }
    let out = root.join("target/nixl/probe");
    // NIXL's logging header pulls in absl; the probe needs none of it.
    let stub = out.join("stub/common");
    std::fs::create_dir_all(&stub)?;
    std::fs::write(
        stub.join("nixl_log.h"),
        "#pragma once\n#include <iostream>\n#define NIXL_ERROR std::cerr\n#define NIXL_ASSERT(x) ((void)0)\n",
    )?;
    let exe = out.join("abi_probe");
    run_command(
        Command::new(cxx())
            .args(["-std=c++20", "-O0"])
            .arg(format!("-I{}", out.join("stub").display()))
            .arg(format!("-I{}", api.display()))
            .arg(format!("-I{}", api.join("backend").display()))
            .arg(format!("-I{}", src.join("src/core/telemetry").display()))
            .arg(format!("-I{}", src.join("src/utils").display()))
            .arg(format!(
                "-I{}",
                root.join("integrations/nixl/include").display()
            ))
            .arg(root.join("integrations/nixl/probe/abi_probe.cpp"))
            .arg("-o")
            .arg(&exe),
    )?;
    run_command(&mut Command::new(&exe))
}
