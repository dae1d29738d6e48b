//! The command line of `cargo xtask bench`: xtask's own options, the benchmark options it passes
//! through to both ends, and the help text.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};

/// Printed by `cargo xtask bench --help`.
pub const HELP: &str = "\
cargo xtask bench [MODE] [OPTIONS] [BENCH OPTIONS] [-- MORE BENCH OPTIONS]

Builds tcpx-bench in release, starts a server and a client (or one pair per GPU), waits for the
server's `TCPX-BENCH-METADATA` line, hands it to the client as `--peer`, then gathers the
client's JSON lines into tables, target/bench/<run>/results.{jsonl,csv} and plot.svg.
Every process, namespace and remote temp dir it starts is torn down on success, failure or
Ctrl-C.

MODES
  (none)                 Both ends on this machine over loopback, with the built-in socket
                         plugin pinned to `lo` (server --bind 127.0.0.1:0: a free pair of ports).
                         Defaults: --sizes 4KiB..64MiB --iters 200 (seconds once built).
  --netns                Two \"nodes\" on this machine: network namespaces tcpx-a-<pid> (servers)
                         and tcpx-b-<pid> (clients), joined by five veth pairs: eth0 (control,
                         10.250.0.0/24) and eth1..eth4 (data, 10.250.K.0/24). Both ends get
                         TCPX_SOCKET_IFNAME=eth1,eth2,eth3,eth4 and --channels 4 (unless given).
                         Afterwards every data NIC must have carried traffic (its
                         /sys/class/net/ethK/statistics counters moved), else the run fails.
                         Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN) and iproute2.
  --nodes A,B            Servers on A, clients on B, over ssh (`user@host` allowed). The
                         binary is used in place when A/B hold the same file at the same path
                         (sha256), else copied to a temp dir there. ssh options come from
                         TCPX_SSH_OPTS (split on whitespace, e.g. \"-i key -p 2222\"); xtask adds
                         -o BatchMode=yes -o ConnectTimeout=10 (your options win). TCPX_*, NCCL_*,
                         UCCL_* and RUST_LOG variables set here are passed to both ends.

OPTIONS
  --gpus LIST            One server/client pair per GPU (`0-7`, `0,2,4`, `0-3,6`), as vLLM runs:
                         pair N gets `--gpu N` (its NIC in the topology plan) and ports BASE+2N
                         (control) and BASE+2N+1 (raw-TCP baseline). Add --memory cuda to move
                         GPU memory.
  --single-process       With --gpus: one server and one client process for all GPUs
                         (`--gpu LIST` is passed to both; needs a tcpx-bench that drives
                         several GPUs from one process).
  --port BASE            Port base (default: 50000; on loopback every server binds port 0
                         and picks a free pair itself).
  --copy                 --nodes: copy the binary to the nodes even where it already is.
  --server-addr IP       --nodes: the address of A that B connects to (default: A's ssh
                         address when it is an IP or localhost, else the first of `hostname -I`
                         on A).
  --ready-timeout SECS   How long a server may take to print its METADATA line (default 60).
  --kv SHAPES            After the size sweep, run `tcpx-bench kv server/client` pairs (same
                         launcher, ports and --gpu) on these shapes (BLOCKSxSIZE, comma list;
                         default 1024x16KiB,512x64KiB,64x1MiB): scattered blocks by one-sided
                         WRITE and READ against the same bytes contiguous, two-sided and over
                         raw TCP, first transfers on rows of their own. Its rows go to the
                         same results files with \"bench\": \"kv\". On this machine and in
                         --netns each phase moves 8 transfers, at least 64 MiB (seconds).
                         --channels --chunk --window --memory --plugin --baseline --timeout
                         and --verify apply to it too.
  --no-kv                Skip the kv rows (also skipped with --single-process).
  --store etcd|URL       Rendezvous by name instead of handing the client the server's hex:
                         each server gets `--store URL --name server-<pair>` (it publishes its
                         endpoint there) and its client the same (it finds it there). `etcd`
                         (this machine only): xtask starts a throw-away etcd on 127.0.0.1
                         (free ports, temp data dir; Debian's etcd-server or TCPX_ETCD_BIN)
                         for the run, job = the run id, and stops it after. A URL
                         (etcd://HOST:PORT[,HOST:PORT]/JOB) uses an etcd you run, any mode.
  --out DIR              Results directory (default target/bench).
  --bin PATH             Use this tcpx-bench instead of building one.
  --no-build             Use target/release/tcpx-bench as it is.
  --dry-run              Print every command (build, namespaces, ssh, servers, clients,
                         teardown) instead of running it.
  -h, --help             This text.

BENCH OPTIONS (passed to both ends; see `tcpx-bench server --help`)
  --sizes A..B|A,B,..    --iters N   --warmup N   --channels N   --chunk SIZE   --window N
  --depth N   --batch K   --memory host|cuda   --plugin PATH   --baseline raw-tcp|none
  --timeout SECS
  --rounds N (measure each size N times against the baseline: medians and the ratios' range;
  3 or 5 on shared or noisy machines)
  --verify (the server checks every byte; exit 4 when one is wrong)
  Anything after `--` is passed to both ends verbatim.

EXAMPLES
  cargo xtask bench                                    # loopback, table with the raw-TCP baseline
  cargo xtask bench --sizes 1MiB..256MiB --iters 100 --verify
  cargo xtask bench --sizes 4KiB,64KiB,1MiB --rounds 5   # medians of five rounds on a noisy host
  cargo xtask bench --sizes 4KiB,16KiB,64KiB --batch 1024   # small messages in batches (send_batch)
  cargo xtask bench --store etcd --verify             # rendezvous through a local etcd
  cargo xtask bench --netns --sizes 1MiB,8MiB --iters 20 --verify   # as root; what CI runs
  cargo xtask bench --nodes a3-node-1,me@a3-node-2 --gpus 0-7 -- --plugin /usr/local/tcpx/lib64/libnccl-net-tcpx.so
  cargo xtask bench --nodes a,b --gpus 0-7 --dry-run   # show the ssh commands only

EXIT STATUS
  0 success; 1 a failure (the message names the process, its exit meaning and its stderr tail;
  logs stay in target/bench/<run>/logs); 130 interrupted.
";

/// Benchmark options that take a value; they are passed to both ends.
const BENCH_VALUE_FLAGS: &[&str] = &[
    "--sizes",
    "--iters",
    "--warmup",
    "--channels",
    "--chunk",
    "--window",
    "--memory",
    "--plugin",
    "--baseline",
    "--timeout",
    "--depth",
    "--batch",
    "--rounds",
];

/// Benchmark options without a value.
const BENCH_SWITCHES: &[&str] = &["--verify"];

/// Default shapes of the kv rows: vLLM-like block lists (the shapes of issue 25).
pub const KV_SHAPES: &str = "1024x16KiB,512x64KiB,64x1MiB";

/// The benchmark options `tcpx-bench kv` shares with server/client (its other options mean
/// something else there, or nothing).
const KV_VALUE_FLAGS: &[&str] = &[
    "--channels",
    "--chunk",
    "--window",
    "--memory",
    "--plugin",
    "--baseline",
    "--timeout",
];

/// Where the two ends run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Both ends on this machine over loopback.
    Local,
    /// Two network namespaces on this machine with four data NICs each.
    Netns,
    /// Two machines over ssh: servers on `a`, clients on `b`.
    Nodes {
        /// Server node (`host` or `user@host`).
        a: String,
        /// Client node.
        b: String,
    },
}

impl Mode {
    /// Short name used in run ids and messages.
    pub fn name(&self) -> &'static str {
        match self {
            Mode::Local => "local",
            Mode::Netns => "netns",
            Mode::Nodes { .. } => "nodes",
        }
    }
}

/// Everything `cargo xtask bench` was asked to do.
#[derive(Clone, Debug)]
pub struct Options {
    /// Where the ends run.
    pub mode: Mode,
    /// GPUs, one pair each (or one pair for all with `single_process`).
    pub gpus: Option<Vec<u32>>,
    /// One process per side for all GPUs.
    pub single_process: bool,
    /// Print commands instead of running them.
    pub dry_run: bool,
    /// Build tcpx-bench before running.
    pub build: bool,
    /// An explicit tcpx-bench binary.
    pub bin: Option<PathBuf>,
    /// Port base.
    pub port: Option<u16>,
    /// `--nodes`: copy the binary even where the node holds it.
    pub copy: bool,
    /// `--nodes`: the server address the client connects to.
    pub server_addr: Option<String>,
    /// How long a server may take to become ready.
    pub ready_timeout: Duration,
    /// Results directory.
    pub out: Option<PathBuf>,
    /// Options passed to both ends (xtask-known ones, then everything after `--`).
    pub bench_args: Vec<String>,
    /// `--help` was asked for.
    pub help: bool,
    /// Shapes of the kv pairs run after the sweep; `None`: no kv rows.
    pub kv: Option<String>,
    /// Rendezvous through a store instead of passing the hex (`--store`).
    pub store: Option<StoreChoice>,
}

/// `--store`: where the pairs meet by name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreChoice {
    /// `--store etcd`: a throw-away etcd on 127.0.0.1 that xtask starts for the run.
    LocalEtcd,
    /// `--store etcd://…`: an etcd the user runs.
    Url(String),
}

impl Options {
    /// Parses the arguments after `cargo xtask bench`.
    pub fn parse(args: &[String]) -> Result<Options> {
        let mut opts = Options {
            mode: Mode::Local,
            gpus: None,
            single_process: false,
            dry_run: false,
            build: true,
            bin: None,
            port: None,
            copy: false,
            server_addr: None,
            ready_timeout: Duration::from_secs(60),
            out: None,
            bench_args: Vec::new(),
            help: false,
            kv: Some(KV_SHAPES.to_string()),
            store: None,
        };
        let mut netns = false;
        let mut nodes = None;
        let mut it = args.iter();
        while let Some(arg) = it.next() {
            let (flag, inline) = match arg.split_once('=') {
                Some((f, v)) if f.starts_with("--") => (f, Some(v.to_string())),
                _ => (arg.as_str(), None),
            };
            let mut value = |name: &str| -> Result<String> {
                match inline.clone() {
                    Some(v) => Ok(v),
                    None => it
                        .next()
                        .cloned()
                        .with_context(|| format!("{name} needs a value (see --help)")),
                }
            };
            match flag {
                "-h" | "--help" => opts.help = true,
                "--" => {
                    opts.bench_args.extend(it.by_ref().cloned());
                    break;
                }
                "--netns" => netns = true,
                "--nodes" => nodes = Some(parse_nodes(&value(flag)?)?),
                "--gpus" => opts.gpus = Some(parse_gpus(&value(flag)?)?),
                "--single-process" => opts.single_process = true,
                "--dry-run" => opts.dry_run = true,
                "--no-build" => opts.build = false,
                "--bin" => opts.bin = Some(PathBuf::from(value(flag)?)),
                "--port" => {
                    let v = value(flag)?;
                    opts.port = Some(
                        v.parse()
                            .with_context(|| format!("--port `{v}` is not a port number"))?,
                    );
                }
                "--server-addr" => opts.server_addr = Some(value(flag)?),
                "--copy" => opts.copy = true,
                "--ready-timeout" => {
                    let v = value(flag)?;
                    let secs: u64 = v
                        .parse()
                        .with_context(|| format!("--ready-timeout `{v}` is not whole seconds"))?;
                    opts.ready_timeout = Duration::from_secs(secs);
                }
                "--out" => opts.out = Some(PathBuf::from(value(flag)?)),
                "--kv" => {
                    let shapes = value(flag)?;
                    if shapes.trim().is_empty() {
                        bail!("--kv needs shapes, e.g. --kv 1024x16KiB,64x1MiB (or --no-kv)");
                    }
                    opts.kv = Some(shapes);
                }
                "--no-kv" => opts.kv = None,
                "--store" => {
                    let v = value(flag)?;
                    opts.store = Some(match v.as_str() {
                        "etcd" => StoreChoice::LocalEtcd,
                        url if url.starts_with("etcd://") => StoreChoice::Url(url.to_string()),
                        other => bail!(
                            "--store `{other}`: expected `etcd` (a local etcd for the run) or \
                             an etcd://HOST:PORT/JOB URL"
                        ),
                    });
                }
                "--gpu" => bail!("use --gpus LIST (xtask gives each pair its own --gpu N)"),
                f if BENCH_VALUE_FLAGS.contains(&f) => {
                    let v = value(flag)?;
                    opts.bench_args.extend([f.to_string(), v]);
                }
                f if BENCH_SWITCHES.contains(&f) && inline.is_none() => {
                    opts.bench_args.push(f.to_string());
                }
                other => bail!(
                    "unknown option `{other}`: options for tcpx-bench that xtask does not know go \
                     after `--` (cargo xtask bench [OPTIONS] -- --flag value); see \
                     `cargo xtask bench --help`"
                ),
            }
        }
        opts.mode = match (netns, nodes) {
            (true, Some(_)) => bail!("--netns and --nodes exclude each other: pick one mode"),
            (true, None) => Mode::Netns,
            (false, Some((a, b))) => Mode::Nodes { a, b },
            (false, None) => Mode::Local,
        };
        if opts.single_process && opts.gpus.is_none() {
            bail!("--single-process needs --gpus LIST (the GPUs that one process drives)");
        }
        if opts.store == Some(StoreChoice::LocalEtcd) && opts.mode != Mode::Local {
            bail!(
                "--store etcd starts an etcd on this machine's loopback, which only the local \
                 mode reaches; with --netns or --nodes give --store etcd://HOST:PORT/JOB"
            );
        }
        if (opts.server_addr.is_some() || opts.copy) && !matches!(opts.mode, Mode::Nodes { .. }) {
            bail!("--server-addr and --copy only apply to --nodes");
        }
        Ok(opts)
    }

    /// The value of a bench option, if given (`--flag V` or `--flag=V`; the last one wins).
    pub fn bench_value(&self, flag: &str) -> Option<String> {
        let mut found = None;
        let mut it = self.bench_args.iter();
        while let Some(a) = it.next() {
            if a == flag {
                found = it.next().cloned();
            } else if let Some(v) = a.strip_prefix(flag).and_then(|r| r.strip_prefix('=')) {
                found = Some(v.to_string());
            }
        }
        found
    }
}

/// The options of `args` (the user's bench options) that `tcpx-bench kv` understands too, in
/// order; the sweep's own (`--sizes`, `--iters`, …) and their values are left out.
pub fn kv_shared_args(args: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    let mut it = args.iter().peekable();
    while let Some(arg) = it.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, _)) if f.starts_with("--") => (f, true),
            _ => (arg.as_str(), false),
        };
        let takes_value = !inline && it.peek().is_some_and(|next| !next.starts_with("--"));
        if KV_VALUE_FLAGS.contains(&flag) {
            out.push(arg.clone());
            if takes_value {
                out.extend(it.next().cloned());
            }
        } else if BENCH_SWITCHES.contains(&flag) && !inline {
            out.push(arg.clone());
        } else if takes_value && !BENCH_SWITCHES.contains(&flag) {
            // Another option's value: left out with it.
            it.next();
        }
    }
    out
}

/// Whether `args` contain `flag` as `--flag` or `--flag=…`.
pub fn has_flag(args: &[String], flag: &str) -> bool {
    args.iter()
        .any(|a| a == flag || a.strip_prefix(flag).is_some_and(|r| r.starts_with('=')))
}

/// Parses `A,B` into the server node and the client node.
fn parse_nodes(text: &str) -> Result<(String, String)> {
    let parts: Vec<&str> = text.split(',').map(str::trim).collect();
    match parts.as_slice() {
        [a, b] if !a.is_empty() && !b.is_empty() => Ok((a.to_string(), b.to_string())),
        _ => bail!(
            "--nodes takes exactly two ssh destinations, server first: `--nodes host-a,user@host-b` \
             (got `{text}`)"
        ),
    }
}

/// Parses a GPU list: `0-7`, `0,2,4`, `0-3,6` (sorted, without duplicates).
pub fn parse_gpus(text: &str) -> Result<Vec<u32>> {
    let mut gpus = Vec::new();
    for part in text.split(',').map(str::trim) {
        let bad = || format!("--gpus `{text}`: `{part}` is not a GPU index or range like 0-7");
        match part.split_once('-') {
            Some((lo, hi)) => {
                let lo: u32 = lo.trim().parse().with_context(bad)?;
                let hi: u32 = hi.trim().parse().with_context(bad)?;
                if lo > hi || hi - lo > 255 {
                    bail!("{}", bad());
                }
                gpus.extend(lo..=hi);
            }
            None => gpus.push(part.parse().with_context(bad)?),
        }
    }
    gpus.sort_unstable();
    gpus.dedup();
    Ok(gpus)
}

/// Formats a GPU list compactly (`0-3,6`), the form `--single-process` passes as `--gpu`.
pub fn format_gpus(gpus: &[u32]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < gpus.len() {
        let mut j = i;
        while j + 1 < gpus.len() && gpus[j + 1] == gpus[j] + 1 {
            j += 1;
        }
        out.push(if j > i {
            format!("{}-{}", gpus[i], gpus[j])
        } else {
            gpus[i].to_string()
        });
        i = j + 1;
    }
    out.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn gpu_lists() {
        assert_eq!(parse_gpus("0-3,6").unwrap(), vec![0, 1, 2, 3, 6]);
        assert_eq!(parse_gpus("2,0,2").unwrap(), vec![0, 2]);
        assert!(parse_gpus("3-1").is_err());
        assert!(parse_gpus("x").is_err());
        assert_eq!(format_gpus(&[0, 1, 2, 3, 6]), "0-3,6");
        assert_eq!(format_gpus(&[5]), "5");
    }

    #[test]
    fn modes_and_passthrough() {
        let o = Options::parse(&args("--netns --sizes 1MiB,8MiB --iters=20 --verify")).unwrap();
        assert_eq!(o.mode, Mode::Netns);
        assert_eq!(o.bench_args, args("--sizes 1MiB,8MiB --iters 20 --verify"));
        assert_eq!(o.bench_value("--iters").as_deref(), Some("20"));
        let o = Options::parse(&args("--nodes a,me@b --gpus 0-7 -- --plugin /x.so --odd")).unwrap();
        assert_eq!(
            o.mode,
            Mode::Nodes {
                a: "a".into(),
                b: "me@b".into()
            }
        );
        assert!(has_flag(&o.bench_args, "--plugin"));
        assert!(has_flag(&o.bench_args, "--odd"));
        assert!(Options::parse(&args("--frobnicate")).is_err());
        assert!(Options::parse(&args("--netns --nodes a,b")).is_err());
        assert!(Options::parse(&args("--nodes a")).is_err());
        assert!(Options::parse(&args("--single-process")).is_err());
        assert!(Options::parse(&args("--gpu 1")).is_err());
    }

    #[test]
    fn store_choices() {
        assert_eq!(Options::parse(&[]).unwrap().store, None);
        assert_eq!(
            Options::parse(&args("--store etcd")).unwrap().store,
            Some(StoreChoice::LocalEtcd)
        );
        assert_eq!(
            Options::parse(&args("--netns --store=etcd://10.0.0.1:2379/j"))
                .unwrap()
                .store,
            Some(StoreChoice::Url("etcd://10.0.0.1:2379/j".into()))
        );
        // A local etcd is reachable from the local mode only; other stores are refused.
        assert!(Options::parse(&args("--netns --store etcd")).is_err());
        assert!(Options::parse(&args("--store redis://h:1/j")).is_err());
    }

    #[test]
    fn kv_rows_and_their_options() {
        let o = Options::parse(&args("--sizes 1MiB --channels 8 --verify")).unwrap();
        assert_eq!(o.kv.as_deref(), Some(KV_SHAPES));
        assert_eq!(
            kv_shared_args(&o.bench_args),
            args("--channels 8 --verify"),
            "the sweep's --sizes stays with the sweep"
        );
        let o = Options::parse(&args(
            "--kv 64x1MiB --memory cuda -- --min-bytes 1GiB --plugin=/x.so --odd --timeout 9",
        ))
        .unwrap();
        assert_eq!(o.kv.as_deref(), Some("64x1MiB"));
        assert_eq!(
            kv_shared_args(&o.bench_args),
            args("--memory cuda --plugin=/x.so --timeout 9")
        );
        assert!(Options::parse(&args("--no-kv")).unwrap().kv.is_none());
        assert!(Options::parse(&args("--kv")).is_err());
    }
}
