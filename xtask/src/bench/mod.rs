//! `cargo xtask bench`: the main job. Builds `tcpx-bench` in release, runs server/client pairs
//! through a [`Launcher`] — this machine over loopback (default), two network namespaces
//! (`--netns`) or two ssh nodes (`--nodes a,b`) — and turns the clients' JSON lines into tables,
//! `results.jsonl`, `results.csv` and `plot.svg` under `target/bench/<run>/`.
//!
//! Modules, one job each: [`options`] (command line), [`launcher`] (the trait, the local
//! launcher), [`netns`] and [`ssh`] (the other launchers), [`process`] (a started child),
//! [`pairs`] (the shared `run_pairs` routine), [`results`] (tables and files), [`plot`] (SVG),
//! [`interrupt`] (Ctrl-C).

mod interrupt;
mod launcher;
mod netns;
mod options;
mod pairs;
mod plot;
mod process;
mod results;
mod ssh;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};

pub use interrupt::Interrupted;
use launcher::{Launcher, Local};
use options::{format_gpus, Mode, Options, StoreChoice, HELP};
use pairs::{Pair, Plan};

use crate::{run_command, sysdeps, workspace_root};

/// Default sizes of the local run: about a minute on a 2-core machine.
const LOCAL_SIZES: &str = "4KiB..64MiB";
/// Default measured messages per size of the local run.
const LOCAL_ITERS: &str = "200";
/// Measured transfers per kv phase on this machine and in namespaces (with `KV_MIN_BYTES`:
/// seconds per shape on a 2-core box).
const KV_LOCAL_ITERS: &str = "8";
/// Bytes each kv phase moves at least, on this machine and in namespaces.
const KV_LOCAL_MIN_BYTES: &str = "64MiB";
/// Channels of a netns run: one per data NIC.
const NETNS_CHANNELS: usize = netns::DATA_NICS.len();

/// Runs `cargo xtask bench ARGS`.
pub fn run(args: &[String]) -> Result<()> {
    let opts = Options::parse(args)?;
    if opts.help {
        print!("{HELP}");
        return Ok(());
    }
    interrupt::install()?;
    let root = workspace_root();
    let bin = binary(&opts, &root)?;
    let mut launcher: Box<dyn Launcher> = match &opts.mode {
        Mode::Local => Box::new(Local::new()),
        Mode::Netns => Box::new(netns::Netns::new()),
        Mode::Nodes { a, b } => Box::new(ssh::Ssh::new(a, b, opts.server_addr.clone(), opts.copy)),
    };
    let out_root = match &opts.out {
        Some(dir) => dir.clone(),
        None => root.join("target/bench"),
    };
    let run_id = run_id(opts.mode.name(), &out_root);
    let run_dir = out_root.join(&run_id);
    // `--store etcd`: a throw-away etcd on 127.0.0.1 for this run (job = the run id), stopped
    // when `_etcd` drops after the pairs finished (or failed).
    let (_etcd, store) = match &opts.store {
        None => (None, None),
        Some(StoreChoice::Url(url)) => (None, Some(url.clone())),
        Some(StoreChoice::LocalEtcd) if opts.dry_run => {
            (None, Some(format!("etcd://127.0.0.1:<free port>/{run_id}")))
        }
        Some(StoreChoice::LocalEtcd) => {
            let etcd = crate::etcd::LocalEtcd::start().context("--store etcd")?;
            let url = etcd.url(&run_id);
            eprintln!("xtask: local etcd for the run: {url}");
            (Some(etcd), Some(url))
        }
    };
    let outcome = run_with(&mut *launcher, &opts, &bin, &run_id, &run_dir, store);
    let teardown = launcher.teardown(opts.dry_run);
    match (outcome, teardown) {
        (Err(e), Err(t)) => Err(e.context(format!("and teardown failed too: {t:#}"))),
        (Err(e), Ok(())) => Err(e),
        (Ok(()), Err(t)) => Err(t),
        (Ok(()), Ok(())) => Ok(()),
    }
}

/// Everything between building and teardown: prepare the nodes, run the pairs, write and print
/// the results, then the launcher's after-run check.
fn run_with(
    launcher: &mut dyn Launcher,
    opts: &Options,
    bin: &Path,
    run_id: &str,
    run_dir: &Path,
    store: Option<String>,
) -> Result<()> {
    launcher.prepare(bin, opts.dry_run)?;
    let pairs = plan_pairs(opts, &*launcher)?;
    let plan = Plan {
        echo: pairs.len() == 1,
        pairs,
        common: common_args(opts),
        env: launcher.env(),
        ready_timeout: opts.ready_timeout,
        dry_run: opts.dry_run,
        log_dir: run_dir.join("logs"),
        kv: false,
        store,
    };
    if !opts.dry_run {
        std::fs::create_dir_all(&plan.log_dir)
            .with_context(|| format!("create {}", plan.log_dir.display()))?;
        eprintln!(
            "xtask: {} run {run_id}: {} pair(s), servers on {}, clients on {}",
            launcher.name(),
            plan.pairs.len(),
            launcher.node_name(launcher::Node::A),
            launcher.node_name(launcher::Node::B)
        );
    }
    let outcomes = pairs::run_pairs(launcher, &plan)?;
    let kv_outcomes = match kv_plan(opts, &plan) {
        Some(kv) => pairs::run_pairs(launcher, &kv)?,
        None => Vec::new(),
    };
    if opts.dry_run {
        return Ok(());
    }
    let rows = results::parse(&outcomes, run_id, launcher.name())?;
    let kv_rows = results::parse(&kv_outcomes, run_id, launcher.name())?;
    results::write_files(run_dir, &[rows.as_slice(), &kv_rows].concat())?;
    let title = plot_title(&rows, run_id);
    std::fs::write(
        run_dir.join("plot.svg"),
        plot::render(&title, &series(&rows)),
    )
    .with_context(|| format!("write {}", run_dir.join("plot.svg").display()))?;
    if plan.pairs.len() > 1 {
        print!("\n{}", results::multi_table(&rows));
    } else if !plan.echo {
        print!("\n{}", results::single_table(&rows));
    }
    if !kv_rows.is_empty() && !plan.echo {
        print!("\n{}", results::kv_table(&kv_rows));
    }
    point_latest(run_dir);
    println!(
        "\nresults: {dir}/results.jsonl, results.csv, plot.svg (logs in {dir}/logs)",
        dir = run_dir.display()
    );
    launcher.after_run()
}

/// The tcpx-bench to run: `--bin`, else the release build (built here unless `--no-build`).
fn binary(opts: &Options, root: &Path) -> Result<PathBuf> {
    if let Some(bin) = &opts.bin {
        if opts.dry_run {
            return Ok(bin.clone());
        }
        return bin
            .canonicalize()
            .with_context(|| format!("--bin {}: no such file", bin.display()));
    }
    let target = match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => root.join(dir),
        None => root.join("target"),
    };
    let bin = target.join("release/tcpx-bench");
    let build = [
        "build",
        "--release",
        "-p",
        "tcpx-tools",
        "--bin",
        "tcpx-bench",
    ];
    if opts.dry_run {
        println!("# build\ncargo {}", build.join(" "));
        return Ok(bin);
    }
    if opts.build {
        sysdeps::ensure(sysdeps::ALL)?;
        eprintln!(
            "xtask: building tcpx-bench in release (`cargo {}`; the first build takes a few \
             minutes on a small machine)…",
            build.join(" ")
        );
        run_command(
            Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
                .current_dir(root)
                .args(build),
        )
        .map_err(|e| {
            // Ctrl-C reaches cargo too (same process group): say so instead of "build failed".
            if interrupt::requested() {
                Interrupted.into()
            } else {
                e
            }
        })?;
    }
    if !bin.is_file() {
        bail!(
            "{} does not exist: run without --no-build, or pass --bin PATH",
            bin.display()
        );
    }
    Ok(bin)
}

/// One pair per GPU (ports `base + 2 * gpu`; base 0: every server picks its own), one pair
/// for all GPUs (`--single-process`), or one pair without `--gpu`.
fn plan_pairs(opts: &Options, launcher: &dyn Launcher) -> Result<Vec<Pair>> {
    let highest = opts
        .gpus
        .as_ref()
        .and_then(|g| g.last().copied())
        .unwrap_or(0);
    let slots = u16::try_from(highest + 1).context("GPU index too large")?;
    let base = match opts.port {
        Some(p) => p,
        None => launcher.default_port_base(slots)?,
    };
    let port = |slot: u32| -> Result<u16> {
        if base == 0 {
            // Every server picks a free pair itself (see `Launcher::default_port_base`).
            return Ok(0);
        }
        u16::try_from(u32::from(base) + 2 * slot)
            .ok()
            .filter(|p| *p < u16::MAX)
            .with_context(|| format!("--port {base} leaves no room for GPU {slot}'s ports"))
    };
    Ok(match (&opts.gpus, opts.single_process) {
        (None, _) => vec![Pair {
            gpu: None,
            gpu_arg: None,
            port: port(0)?,
            stem: "pair".into(),
        }],
        (Some(gpus), true) => vec![Pair {
            gpu: None,
            gpu_arg: Some(format_gpus(gpus)),
            port: port(0)?,
            stem: format!("gpus{}", format_gpus(gpus).replace(',', "_")),
        }],
        (Some(gpus), false) => gpus
            .iter()
            .map(|&g| {
                Ok(Pair {
                    gpu: Some(g),
                    gpu_arg: Some(g.to_string()),
                    port: port(g)?,
                    stem: format!("gpu{g}"),
                })
            })
            .collect::<Result<_>>()?,
    })
}

/// The kv pairs that follow the sweep: the same pairs, ports and launcher, `tcpx-bench kv`
/// with the shapes of `--kv` and the options it shares with the sweep; `None` with `--no-kv`
/// or `--single-process` (kv drives one GPU per process).
fn kv_plan(opts: &Options, sweep: &Plan) -> Option<Plan> {
    let shapes = opts.kv.as_ref()?;
    if opts.single_process {
        eprintln!("xtask: note: no kv rows with --single-process (kv drives one GPU per process)");
        return None;
    }
    if !opts.dry_run {
        eprintln!("xtask: then kv pairs (tcpx-bench kv) on {shapes}");
    }
    let mut common = options::kv_shared_args(&opts.bench_args);
    common.extend(["--shapes".to_string(), shapes.clone()]);
    if matches!(opts.mode, Mode::Local | Mode::Netns) {
        common.extend([
            "--iters".to_string(),
            KV_LOCAL_ITERS.to_string(),
            "--min-bytes".to_string(),
            KV_LOCAL_MIN_BYTES.to_string(),
        ]);
    }
    if opts.mode == Mode::Netns && !options::has_flag(&common, "--channels") {
        common.extend(["--channels".to_string(), NETNS_CHANNELS.to_string()]);
    }
    Some(Plan {
        pairs: sweep.pairs.clone(),
        common,
        env: sweep.env.clone(),
        ready_timeout: sweep.ready_timeout,
        echo: sweep.echo,
        dry_run: sweep.dry_run,
        log_dir: sweep.log_dir.clone(),
        kv: true,
        store: sweep.store.clone(),
    })
}

/// The options both ends get: the user's, plus the mode's defaults for what they left out.
fn common_args(opts: &Options) -> Vec<String> {
    let mut args = opts.bench_args.clone();
    let mut default = |flag: &str, value: &str| {
        if !options::has_flag(&args, flag) {
            args.extend([flag.to_string(), value.to_string()]);
        }
    };
    match opts.mode {
        Mode::Local => {
            default("--sizes", LOCAL_SIZES);
            default("--iters", LOCAL_ITERS);
        }
        Mode::Netns => {
            default("--channels", &NETNS_CHANNELS.to_string());
            let channels = opts.bench_value("--channels").and_then(|c| c.parse().ok());
            if channels.is_some_and(|c: usize| c < NETNS_CHANNELS) {
                eprintln!(
                    "xtask: note: --channels below {NETNS_CHANNELS} leaves some data NICs idle; \
                     the striping check will fail"
                );
            }
        }
        Mode::Nodes { .. } => {}
    }
    args
}

/// `(bytes, GB/s)` lines for the plot: the pair and its baseline, or the sum over GPUs, its
/// baseline sum, and each GPU thin.
fn series(rows: &[results::Row]) -> Vec<plot::Series> {
    let gpus = results::gpus(rows);
    let line = |label: String, points, dashed, thin| plot::Series {
        label,
        points,
        dashed,
        thin,
    };
    if gpus.len() <= 1 {
        let pick = |key: &str| rows.iter().map(|r| (r.bytes(), r.num(key))).collect();
        return vec![
            line("tcpx".into(), pick("gbps"), false, false),
            line(
                "baseline (raw TCP)".into(),
                pick("baseline_gbps"),
                true,
                false,
            ),
        ];
    }
    let sums = results::sums(rows);
    let n = gpus.len();
    let mut out = vec![
        line(
            format!("SUM over {n} GPUs"),
            sums.iter().map(|s| (s.0, s.1)).collect(),
            false,
            false,
        ),
        line(
            format!("baseline SUM ({n})"),
            sums.iter().map(|s| (s.0, s.2)).collect(),
            true,
            false,
        ),
    ];
    for gpu in gpus {
        let points = rows
            .iter()
            .filter(|r| r.gpu == gpu)
            .map(|r| (r.bytes(), r.num("gbps")))
            .collect();
        let label = gpu.map_or("pair".into(), |g| format!("gpu{g}"));
        out.push(line(label, points, false, true));
    }
    out
}

/// `tcpx-bench <run>: 4 channels, host memory` (from the first row).
fn plot_title(rows: &[results::Row], run_id: &str) -> String {
    let mut title = format!("tcpx-bench {run_id}");
    if let Some(r) = rows.first() {
        let channels = r.num("channels");
        if channels > 0.0 {
            title.push_str(&format!(": {channels} channels"));
        }
        if let Some(memory) = r.fields.get("memory").and_then(|m| m.as_str()) {
            title.push_str(&format!(", {memory} memory"));
        }
    }
    title
}

/// `<mode>-<UTC yyyymmdd-hhmmss>`, with a suffix when that directory exists already.
fn run_id(mode: &str, out_root: &Path) -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let base = format!("{mode}-{}", utc_stamp(secs));
    let mut id = base.clone();
    let mut n = 2;
    while out_root.join(&id).exists() {
        id = format!("{base}-{n}");
        n += 1;
    }
    id
}

/// `yyyymmdd-hhmmss` (UTC) for seconds since the epoch.
fn utc_stamp(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}{month:02}{day:02}-{:02}{:02}{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Points `<out>/latest` at this run (best effort).
fn point_latest(run_dir: &Path) {
    let (Some(parent), Some(name)) = (run_dir.parent(), run_dir.file_name()) else {
        return;
    };
    let link = parent.join("latest");
    if link.is_symlink() {
        let _ = std::fs::remove_file(&link);
    }
    if !link.exists() {
        let _ = std::os::unix::fs::symlink(name, &link);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(s: &str) -> Options {
        Options::parse(&s.split_whitespace().map(String::from).collect::<Vec<_>>()).unwrap()
    }

    #[test]
    fn stamps() {
        assert_eq!(utc_stamp(0), "19700101-000000");
        assert_eq!(utc_stamp(1_709_210_096), "20240229-123456");
    }

    #[test]
    fn defaults_per_mode() {
        let local = common_args(&opts("--iters 5"));
        assert_eq!(local, ["--iters", "5", "--sizes", LOCAL_SIZES]);
        let netns = common_args(&opts("--netns --verify"));
        assert_eq!(netns, ["--verify", "--channels", "4"]);
        let nodes = common_args(&opts("--nodes a,b --gpus 0-1 -- --memory=cuda"));
        assert_eq!(nodes, ["--memory=cuda"]);
    }

    #[test]
    fn pairs_per_gpu() {
        let launcher = netns::Netns::new();
        let p = plan_pairs(&opts("--netns --gpus 0,3 --port 40000"), &launcher).unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!((p[1].port, p[1].gpu_arg.as_deref()), (40006, Some("3")));
        let p = plan_pairs(&opts("--netns --gpus 0-7 --single-process"), &launcher).unwrap();
        assert_eq!(p.len(), 1);
        assert_eq!(p[0].gpu_arg.as_deref(), Some("0-7"));
        assert!(plan_pairs(&opts("--netns --gpus 0-7 --port 65530"), &launcher).is_err());
    }
}
