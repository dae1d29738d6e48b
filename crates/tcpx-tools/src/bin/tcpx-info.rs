//! `tcpx-info`: which plugin is in use, its devices, the machine's GPU/NIC topology and the
//! GPU→NIC plan the runtime would follow, as tables or as JSON.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Parser;
use tcpx_runtime::endpoint::backend;
use tcpx_runtime::{Backend, Config, EnginePlan};
use tcpx_tools::cores::format_ranges;
use tcpx_topo::{NicCandidate, Plan, PlanRequest, Topology};

/// Show the net plugin, its devices, the GPU/NIC topology and the GPU→NIC plan.
///
/// Without --topology, the live machine is examined (hwloc) and the plugin's devices are the
/// NIC candidates. With --topology, the plan is made for the machine that XML describes
/// (e.g. one saved with `lstopo-no-graphics --of xml --whole-io`), considering all its NICs.
/// Overrides honoured: TCPX_PLUGIN_PATH / UCCL_TCPX_PLUGIN_PATH / TCPX_BACKEND, TCPX_GPU_NIC_MAP, NCCL_GPUDIRECTTCPX_TX_BINDINGS / RX_BINDINGS,
/// TCPX_NUM_CHANNELS (or UCCL_TCPX_NUM_CHANNELS).
///
/// With --watch ADDR, watch a running endpoint instead: start it with
/// TCPX_METRICS_ADDR=127.0.0.1:9464 (any tcpx program: tcpx-bench, the C or Python API), then
///   tcpx-info --watch 127.0.0.1:9464               (a table every second, until Ctrl-C)
///   tcpx-info --watch 127.0.0.1:9464 --count 5 --json
/// Each poll scrapes GET /metrics and prints bytes and GB/s (10^9 B/s, since the previous
/// poll) per NIC and per connection.
#[derive(Parser, Debug)]
#[command(version, about, long_about)]
struct Cli {
    /// Net plugin to load. Default: TCPX_PLUGIN_PATH, else UCCL_TCPX_PLUGIN_PATH (or
    /// TCPX_BACKEND), else a TCPX install, else the built-in one.
    #[arg(long)]
    plugin: Option<PathBuf>,
    /// Plan for the machine described by this hwloc XML instead of this one.
    #[arg(long, value_name = "FILE.xml")]
    topology: Option<PathBuf>,
    /// Print JSON: {"plan":[{"gpu":0,"pci":"…","numa":0,"nics":["eth1"],"cores":[…],"reason":"…"},…]};
    /// with --watch, one object per poll and line: {"poll":N,"interval_s":S,"nics":[…],"connections":[…]}.
    #[arg(long)]
    json: bool,
    /// Watch the endpoint whose Prometheus exporter (TCPX_METRICS_ADDR) listens at ADDR
    /// (host:port, or a full http:// URL): per NIC and per connection, bytes and GB/s.
    #[arg(long, value_name = "ADDR", conflicts_with = "topology")]
    watch: Option<String>,
    /// With --watch: stop after N polls (default: until interrupted).
    #[arg(long, value_name = "N", requires = "watch")]
    count: Option<u64>,
    /// With --watch: seconds between polls.
    #[arg(long, value_name = "SECS", default_value_t = 1.0, requires = "watch")]
    interval: f64,
}

fn main() {
    tcpx_tools::logging::init("warn");
    if let Err(err) = run(Cli::parse()) {
        eprintln!("tcpx-info: error: {}", tcpx_tools::error_text(&err));
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    if let Some(addr) = &cli.watch {
        return watch(addr, &cli);
    }
    let mut request =
        PlanRequest::from_env().context("reading the plan overrides from the environment")?;
    let (topology, devices, backend) = match &cli.topology {
        Some(path) => (Topology::from_xml_file(path)?, Vec::new(), None),
        None => {
            let choice = tcpx_tools::backend_choice(cli.plugin.as_deref(), Backend::Auto)
                .context("choosing the net plugin")?;
            let (net, backend) = backend::open(&choice).context("loading the net plugin")?;
            let devices = net.devices()?;
            if request.nics.is_none() && !devices.is_empty() {
                request.nics = Some(
                    devices
                        .iter()
                        .map(|d| {
                            let c = NicCandidate::new(&d.properties.name);
                            match &d.properties.pci_path {
                                Some(p) => c.with_pci_path(p),
                                None => c,
                            }
                        })
                        .collect(),
                );
            }
            (Topology::from_live()?, devices, Some((backend, net)))
        }
    };
    let plan = Plan::build(&topology, &request)?;
    if cli.json {
        println!("{}", plan.to_json());
        return Ok(());
    }
    if let Some((backend, net)) = &backend {
        println!(
            "plugin:   {} (ncclNet {}), {}",
            net.name(),
            net.abi_version(),
            backend.reason
        );
        println!(
            "\n{:<4} {:<10} {:>10} {:<6} {:<8} pci path",
            "dev", "name", "Mbps", "memory", "type"
        );
        for d in &devices {
            let p = &d.properties;
            let memory = match (p.ptr_support.host(), p.ptr_support.cuda()) {
                (true, true) => "host+cuda",
                (false, true) => "cuda",
                _ => "host",
            };
            let kind = if p.device_type == tcpx::DeviceType::UNPACK {
                "unpack"
            } else {
                "host"
            };
            let pci = p
                .pci_path
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_else(|| "-".into());
            println!(
                "{:<4} {:<10} {:>10} {:<6} {:<8} {pci}",
                d.index, p.name, p.speed_mbps, memory, kind
            );
        }
        let config = Config::from_env().context("reading the TCPX_* configuration")?;
        println!(
            "\n{}",
            engines_line(
                &EnginePlan::new(&config, backend.copies_on_caller, devices.len()),
                config.channels
            )
        );
    } else {
        println!("topology: {}", topology.origin());
    }
    println!(
        "\n{:<6} {:<14} {:<5} {:<14} cores",
        "nic", "pci", "numa", ""
    );
    for nic in topology.nics() {
        let pci = nic.pci.map(|p| p.to_string()).unwrap_or_else(|| "-".into());
        let numa = nic
            .numa
            .map(|n| n.to_string())
            .unwrap_or_else(|| "-".into());
        println!(
            "{:<6} {:<14} {:<5} {:<14} {}",
            nic.name,
            pci,
            numa,
            "",
            format_ranges(&nic.local_cpus)
        );
    }
    if topology.gpus().is_empty() {
        println!(
            "\nno GPU found: nothing to plan (the NICs above and their local cores still apply)"
        );
    } else {
        println!(
            "\n{:<4} {:<14} {:<5} {:<12} {:>4}  {:<24} reason",
            "gpu", "pci", "numa", "nics", "chan", "cores"
        );
        for e in &plan.entries {
            let numa = e.numa.map(|n| n.to_string()).unwrap_or_else(|| "-".into());
            println!(
                "{:<4} {:<14} {:<5} {:<12} {:>4}  {:<24} {}",
                e.gpu,
                e.pci,
                numa,
                e.nics.join(","),
                e.channels,
                format_ranges(&e.cores),
                e.reason
            );
        }
    }
    for note in &plan.notes {
        println!("note: {note}");
    }
    Ok(())
}

/// One line on the engine threads an endpoint of this process would start: how many, why, and
/// how many drive a connection to a peer on the same cores (a local run).
fn engines_line(plan: &EnginePlan, channels: u16) -> String {
    let confined = plan.confined();
    let cores = if confined {
        format!(
            "{} of the machine's {} cores: confined",
            plan.usable_cores, plan.online_cores
        )
    } else {
        format!("{} cores", plan.usable_cores)
    };
    let why = if plan.automatic {
        "automatic"
    } else {
        "TCPX_ENGINES_PER_NIC"
    };
    // A confined process counts a local peer as on its cores only when it runs two endpoints.
    let local = if confined {
        "a connection between two endpoints of this process"
    } else {
        "a connection to a peer on the same cores"
    };
    format!(
        "engines:  {} per device for {channels} channels ({why}; {cores}); {local} uses {} \
         per device",
        plan.per_device, plan.per_device_for_local_peers
    )
}

/// `--watch ADDR`: scrape every `--interval` seconds, print each poll, stop after `--count`.
fn watch(addr: &str, cli: &Cli) -> Result<()> {
    use std::io::Write as _;
    use std::time::{Duration, Instant};
    use tcpx_tools::watch::{json, scrape, table, Sample};

    if !(cli.interval.is_finite() && cli.interval >= 0.05) {
        anyhow::bail!("--interval {}: give at least 0.05 seconds", cli.interval);
    }
    if cli.count == Some(0) {
        anyhow::bail!("--count 0: give at least one poll");
    }
    let interval = Duration::from_secs_f64(cli.interval);
    // A scrape may take at most the interval, and never less than two seconds.
    let timeout = interval.max(Duration::from_secs(2));
    let mut previous: Option<(Sample, Instant)> = None;
    let mut poll = 0u64;
    let mut out = std::io::stdout();
    loop {
        let started = Instant::now();
        let sample = Sample::parse(&scrape(addr, timeout)?);
        poll += 1;
        let secs = previous
            .as_ref()
            .map_or(0.0, |(_, at)| started.duration_since(*at).as_secs_f64());
        let before = previous.as_ref().map(|(s, _)| s);
        if cli.json {
            writeln!(out, "{}", json(poll, &sample, before, secs))?;
        } else {
            write!(out, "{}", table(poll, &sample, before, secs))?;
            if cli.count != Some(poll) {
                writeln!(out)?;
            }
        }
        out.flush()?;
        if cli.count.is_some_and(|n| poll >= n) {
            return Ok(());
        }
        previous = Some((sample, started));
        std::thread::sleep(interval.saturating_sub(started.elapsed()));
    }
}
