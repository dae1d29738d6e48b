//! `cargo xtask fuzz`: coverage-guided fuzzing of every decoder of `tcpx-proto` with
//! libFuzzer (`crates/tcpx-proto/fuzz`, through `libfuzzer-sys`).
//!
//! The targets are built on the stable toolchain: the coverage instrumentation libFuzzer
//! feeds on (`-Cpasses=sancov-module` and its `-Cllvm-args`) is a stable codegen option;
//! only sanitizers would need nightly, and the crate is `forbid(unsafe_code)` so ASan would
//! find nothing safe Rust can do. Debug assertions and overflow checks are on, so a wrapped
//! length is a finding too. `--target` restricts RUSTFLAGS to the targets (build scripts stay
//! uninstrumented).
//!
//! Each target starts from the checked-in seed corpus (`corpus/<target>`, written by
//! `cargo run -p tcpx-proto --example fuzz_seeds`) and a working corpus under
//! `target/fuzz/corpus/<target>` that grows across runs; it runs for `--seconds` with a
//! 256 MiB malloc limit (a decoder that allocates past its stated cap is a finding). The table
//! gives executions, coverage (`cov`: edges, `ft`: features) and corpus size per target;
//! crashes land in `target/fuzz/artifacts/<target>/` and fail the task.

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::workspace_root;

/// Every fuzz target, one per decoder of peer or user input.
const TARGETS: &[&str] = &[
    "control_frames",
    "messages",
    "metadata",
    "onesided_descriptor",
    "uccl_metadata",
    "uccl_advert",
    "uccl_descs",
    "ipc_descriptor",
    "ipc_local_msg",
    "local_info",
    "nixl_formats",
    "eager_frame",
];

const TRIPLE: &str = "x86_64-unknown-linux-gnu";

const RUSTFLAGS: &str = "--cfg fuzzing -Cpasses=sancov-module \
    -Cllvm-args=-sanitizer-coverage-level=4 \
    -Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
    -Cllvm-args=-sanitizer-coverage-pc-table \
    -Cllvm-args=-sanitizer-coverage-trace-compares \
    -Cdebug-assertions -Coverflow-checks";

/// What one target's run printed at the end.
#[derive(Debug, Default)]
struct Outcome {
    execs: u64,
    cov: u64,
    ft: u64,
    corpus: u64,
    crashed: bool,
}

pub fn run(args: &[String]) -> Result<()> {
    let mut seconds = 30u64;
    let mut only: Vec<String> = Vec::new();
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--seconds" => {
                seconds = it
                    .next()
                    .context("--seconds needs a number")?
                    .parse()
                    .context("--seconds needs a whole number of seconds")?
            }
            "--target" => only.push(it.next().context("--target needs a name")?.clone()),
            "-h" | "--help" => {
                println!(
                    "cargo xtask fuzz [--seconds N] [--target NAME]...\n\n\
                     Builds the libFuzzer targets of crates/tcpx-proto/fuzz (stable toolchain, \
                     coverage instrumentation) and runs each for N seconds (default 30) from \
                     its seed corpus; prints executions, coverage and corpus per target and \
                     fails on any crash.\nTargets: {}",
                    TARGETS.join(", ")
                );
                return Ok(());
            }
            other => bail!("fuzz: unknown option `{other}` (try --help)"),
        }
    }
    for t in &only {
        if !TARGETS.contains(&t.as_str()) {
            bail!("fuzz: no target `{t}` (targets: {})", TARGETS.join(", "));
        }
    }
    let root = workspace_root();
    let fuzz_dir = root.join("crates/tcpx-proto/fuzz");
    let target_dir = root.join("target/fuzz");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    crate::run_command(
        Command::new(&cargo)
            .current_dir(&fuzz_dir)
            .args(["build", "--release", "--locked", "--target", TRIPLE])
            .arg("--target-dir")
            .arg(&target_dir)
            .env("RUSTFLAGS", RUSTFLAGS)
            .env_remove("CARGO_TARGET_DIR"),
    )?;
    let bin_dir = target_dir.join(TRIPLE).join("release");
    let mut rows = Vec::new();
    for target in TARGETS
        .iter()
        .filter(|t| only.is_empty() || only.iter().any(|o| o == *t))
    {
        let outcome = fuzz_one(&bin_dir, &fuzz_dir, &target_dir, target, seconds)?;
        println!(
            "fuzz {target}: {} executions, cov {}, ft {}, corpus {}{}",
            outcome.execs,
            outcome.cov,
            outcome.ft,
            outcome.corpus,
            if outcome.crashed { ", CRASHED" } else { "" }
        );
        rows.push((target, outcome));
    }
    println!(
        "\n{:<22} {:>12} {:>8} {:>8} {:>8}  result",
        "target", "executions", "cov", "ft", "corpus"
    );
    for (target, o) in &rows {
        println!(
            "{target:<22} {:>12} {:>8} {:>8} {:>8}  {}",
            o.execs,
            o.cov,
            o.ft,
            o.corpus,
            if o.crashed {
                "CRASH (see target/fuzz/artifacts)"
            } else {
                "ok"
            }
        );
    }
    let crashed: Vec<_> = rows
        .iter()
        .filter(|(_, o)| o.crashed)
        .map(|(t, _)| **t)
        .collect();
    if !crashed.is_empty() {
        bail!("fuzz: crashes in {}", crashed.join(", "));
    }
    Ok(())
}

fn fuzz_one(
    bin_dir: &Path,
    fuzz_dir: &Path,
    target_dir: &Path,
    target: &str,
    seconds: u64,
) -> Result<Outcome> {
    let corpus = target_dir.join("corpus").join(target);
    let artifacts = target_dir.join("artifacts").join(target);
    std::fs::create_dir_all(&corpus).with_context(|| format!("creating {}", corpus.display()))?;
    std::fs::create_dir_all(&artifacts)?;
    let seeds = fuzz_dir.join("corpus").join(target);
    let output = Command::new(bin_dir.join(target))
        .arg(format!("-max_total_time={seconds}"))
        .arg("-malloc_limit_mb=256")
        .arg("-rss_limit_mb=1024")
        .arg("-print_final_stats=1")
        .arg(format!("-artifact_prefix={}/", artifacts.display()))
        .arg(&corpus)
        .arg(&seeds)
        .output()
        .with_context(|| format!("running fuzz target {target}"))?;
    let log = String::from_utf8_lossy(&output.stderr);
    let mut o = Outcome {
        crashed: !output.status.success(),
        ..Outcome::default()
    };
    for line in log.lines() {
        if let Some(v) = line.strip_prefix("stat::number_of_executed_units:") {
            o.execs = v.trim().parse().unwrap_or(0);
        }
        // The last status line: "#123 DONE cov: 456 ft: 789 corp: 12/3Kb ...".
        if line.starts_with('#') && line.contains("cov:") {
            let field = |name: &str| {
                line.split_whitespace()
                    .skip_while(|w| *w != name)
                    .nth(1)
                    .and_then(|v| v.split('/').next())
                    .and_then(|v| v.parse().ok())
            };
            o.cov = field("cov:").unwrap_or(o.cov);
            o.ft = field("ft:").unwrap_or(o.ft);
            o.corpus = field("corp:").unwrap_or(o.corpus);
        }
    }
    if o.crashed {
        let tail: Vec<&str> = log.lines().rev().take(30).collect();
        eprintln!(
            "fuzz {target} failed; last lines:\n{}",
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }
    Ok(o)
}
