//! `run_pairs`: the one routine every mode shares. It starts every server, reads each one's
//! `TCPX-BENCH-METADATA <hex>` line (with a deadline), starts each client with `--peer <hex>`,
//! watches all of them, and fetches the clients' JSON lines. Any failure or Ctrl-C drops the
//! started processes, which kills them; the caller's launcher teardown does the rest.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use super::interrupt;
use super::launcher::{Launcher, Node, ProcSpec};
use super::process::{LineWait, Proc, POLL};

/// The line a ready server prints, followed by its connect metadata in hex.
pub const METADATA_TAG: &str = "TCPX-BENCH-METADATA";

/// How long a server may take to exit after its client finished.
const SERVER_EXIT_GRACE: Duration = Duration::from_secs(30);

/// One server/client pair.
#[derive(Clone, Debug)]
pub struct Pair {
    /// The GPU index this pair measures (`None`: no `--gpu`, or a list in single-process mode).
    pub gpu: Option<u32>,
    /// The value passed as `--gpu` to both ends, if any.
    pub gpu_arg: Option<String>,
    /// Control port of the server (the raw-TCP baseline listens on `port + 1`).
    pub port: u16,
    /// File-name stem: `gpu3`, `gpus0-7`, `pair`.
    pub stem: String,
}

impl Pair {
    fn tag(&self) -> String {
        match &self.gpu_arg {
            Some(g) if g.contains([',', '-']) => format!(" (gpus {g})"),
            Some(g) => format!(" (gpu {g})"),
            None => String::new(),
        }
    }
}

/// What to run.
pub struct Plan {
    /// The pairs, run concurrently.
    pub pairs: Vec<Pair>,
    /// Options both ends get.
    pub common: Vec<String>,
    /// Environment both ends get.
    pub env: Vec<(String, String)>,
    /// How long servers may take to print their metadata.
    pub ready_timeout: Duration,
    /// Stream the client's stdout and stderr (one pair: its table appears live).
    pub echo: bool,
    /// Print the commands only.
    pub dry_run: bool,
    /// Where logs (and local result files) go.
    pub log_dir: PathBuf,
    /// Run `tcpx-bench kv server/client` instead of `server/client` (files and labels get a
    /// `kv` prefix, so both runs' logs sit side by side).
    pub kv: bool,
    /// A rendezvous store URL (`--store`): servers publish under their stem, clients find them
    /// by that name instead of being given `--peer HEX`.
    pub store: Option<String>,
}

impl Plan {
    /// The words before a role's options: `server`, or `kv server`.
    fn role(&self, role: &str) -> Vec<String> {
        let mut words = Vec::new();
        if self.kv {
            words.push("kv".to_string());
        }
        words.push(role.to_string());
        words
    }

    /// A file stem of pair `p`'s `what` (`server-gpu3`, `kv-client-pair`); `what` empty for
    /// the result file.
    fn stem(&self, what: &str, p: &Pair) -> String {
        let prefix = if self.kv { "kv-" } else { "" };
        if what.is_empty() {
            format!("{prefix}{}", p.stem)
        } else {
            format!("{prefix}{what}-{}", p.stem)
        }
    }

    /// `kv ` before a process label when running kv.
    fn label(&self) -> &'static str {
        if self.kv {
            "kv "
        } else {
            ""
        }
    }
}

/// The JSON lines one client wrote.
pub struct PairOutcome {
    /// The pair.
    pub pair: Pair,
    /// Its result file's content.
    pub json: String,
}

/// Runs every pair of `plan` through `launcher` (or prints the commands, for a dry run).
pub fn run_pairs(launcher: &mut dyn Launcher, plan: &Plan) -> Result<Vec<PairOutcome>> {
    if plan.dry_run {
        println!("# servers (each prints `{METADATA_TAG} <hex>` when ready)");
        for p in &plan.pairs {
            println!("{}", launcher.render(&server_spec(&*launcher, plan, p)));
        }
        println!(
            "# clients, each with its server's {}",
            if plan.store.is_some() {
                "name in the store"
            } else {
                "metadata"
            }
        );
        for p in &plan.pairs {
            let peer = format!("<hex from {}>", plan.stem("server", p));
            println!(
                "{}",
                launcher.render(&client_spec(&*launcher, plan, p, &peer))
            );
        }
        println!("# results: the clients' JSON lines");
        for p in &plan.pairs {
            println!("{}", launcher.result_path(&plan.log_dir, &plan.stem("", p)));
        }
        return Ok(Vec::new());
    }

    launcher.before_run()?;
    let mut servers = Vec::new();
    for p in &plan.pairs {
        let spec = server_spec(&*launcher, plan, p);
        servers.push(launcher.spawn(&spec, &plan.log_dir, false)?);
    }
    let deadline = Instant::now() + plan.ready_timeout;
    let mut peers = Vec::new();
    for server in &mut servers {
        peers.push(wait_metadata(server, deadline, plan.ready_timeout)?);
    }
    let mut clients = Vec::new();
    for (p, peer) in plan.pairs.iter().zip(&peers) {
        let spec = client_spec(&*launcher, plan, p, peer);
        clients.push(launcher.spawn(&spec, &plan.log_dir, plan.echo)?);
    }
    if !plan.echo {
        eprintln!(
            "xtask: {} client(s) running; their output goes to {}",
            clients.len(),
            plan.log_dir.display()
        );
    }
    watch(&mut servers, &mut clients, plan.echo)?;
    for server in &mut servers {
        match server.wait_for(SERVER_EXIT_GRACE)? {
            Some(status) => server.check_status(status)?,
            None => {
                eprintln!(
                    "xtask: warning: {} did not exit {} s after its client finished; killing it",
                    server.label,
                    SERVER_EXIT_GRACE.as_secs()
                );
                server.kill();
            }
        }
    }
    let mut outcomes = Vec::new();
    for p in &plan.pairs {
        let path = launcher.result_path(&plan.log_dir, &plan.stem("", p));
        outcomes.push(PairOutcome {
            pair: p.clone(),
            json: launcher.fetch(Node::B, &path)?,
        });
    }
    Ok(outcomes)
}

/// The server of pair `p`: `server --bind IP:PORT [--gpu N] COMMON`.
fn server_spec(launcher: &dyn Launcher, plan: &Plan, p: &Pair) -> ProcSpec {
    let mut args = plan.role("server");
    args.extend([
        "--bind".into(),
        format!("{}:{}", launcher.server_ip(), p.port),
    ]);
    args.extend(gpu_args(p));
    args.extend(store_args(plan, p));
    args.extend(plan.common.iter().cloned());
    ProcSpec {
        node: Node::A,
        label: format!(
            "{}server{} on {}",
            plan.label(),
            p.tag(),
            launcher.node_name(Node::A)
        ),
        stem: plan.stem("server", p),
        args,
        env: plan.env.clone(),
    }
}

/// `--store URL --name NAME` of pair `p` (both ends), when the plan meets through a store.
fn store_args(plan: &Plan, p: &Pair) -> Vec<String> {
    match &plan.store {
        Some(url) => vec![
            "--store".into(),
            url.clone(),
            "--name".into(),
            plan.stem("server", p),
        ],
        None => Vec::new(),
    }
}

/// The client of pair `p`: `client --peer HEX [--gpu N] COMMON --json PATH`, or with
/// `--store URL --name NAME` instead of `--peer` when the plan meets through a store.
fn client_spec(launcher: &dyn Launcher, plan: &Plan, p: &Pair, peer: &str) -> ProcSpec {
    let mut args = plan.role("client");
    if plan.store.is_some() {
        args.extend(store_args(plan, p));
    } else {
        args.extend(["--peer".into(), peer.to_string()]);
    }
    args.extend(gpu_args(p));
    args.extend(plan.common.iter().cloned());
    args.extend([
        "--json".into(),
        launcher.result_path(&plan.log_dir, &plan.stem("", p)),
    ]);
    ProcSpec {
        node: Node::B,
        label: format!(
            "{}client{} on {}",
            plan.label(),
            p.tag(),
            launcher.node_name(Node::B)
        ),
        stem: plan.stem("client", p),
        args,
        env: plan.env.clone(),
    }
}

/// `--gpu N` (or the list in single-process mode).
fn gpu_args(p: &Pair) -> Vec<String> {
    match &p.gpu_arg {
        Some(g) => vec!["--gpu".into(), g.clone()],
        None => Vec::new(),
    }
}

/// Reads `server`'s stdout until its metadata line.
fn wait_metadata(server: &mut Proc, deadline: Instant, timeout: Duration) -> Result<String> {
    loop {
        match server.next_line(deadline)? {
            LineWait::Line(line) => {
                if let Some(hex) = line.strip_prefix(METADATA_TAG) {
                    let hex = hex.trim();
                    if hex.is_empty() || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
                        bail!(
                            "{} printed a malformed metadata line: `{line}`",
                            server.label
                        );
                    }
                    return Ok(hex.to_string());
                }
            }
            LineWait::Exited(status) => {
                server.check_status(status)?;
                bail!(
                    "{} exited before printing `{METADATA_TAG}`\n{}",
                    server.label,
                    server.stderr_tail(12)
                );
            }
            LineWait::TimedOut => bail!(
                "{} printed no `{METADATA_TAG}` line within {} s (raise --ready-timeout if it \
                 is just slow)\n{}",
                server.label,
                timeout.as_secs(),
                server.stderr_tail(12)
            ),
        }
    }
}

/// Waits until every client exited successfully, streaming client output when `echo`. Fails on
/// the first failed process (naming the servers that failed too) and on Ctrl-C.
fn watch(servers: &mut [Proc], clients: &mut [Proc], echo: bool) -> Result<()> {
    let mut done = vec![false; clients.len()];
    while done.iter().any(|d| !d) {
        interrupt::check()?;
        for (client, done) in clients.iter_mut().zip(done.iter_mut()) {
            if *done {
                continue;
            }
            print_lines(echo, client.ready_lines());
            let Some(status) = client.try_wait()? else {
                continue;
            };
            print_lines(echo, client.final_lines(Duration::from_secs(2)));
            if let Err(err) = client.check_status(status) {
                return Err(with_server_failures(err, servers));
            }
            *done = true;
            if !echo {
                eprintln!("xtask: {} finished", client.label);
            }
        }
        for server in servers.iter_mut() {
            if let Some(status) = server.try_wait()? {
                server.check_status(status)?;
            }
        }
        std::thread::sleep(POLL);
    }
    Ok(())
}

fn print_lines(echo: bool, lines: Vec<String>) {
    if echo {
        for line in lines {
            println!("{line}");
        }
    }
}

/// Adds the failures of servers that exited badly (within a second) to a client's error: a
/// client's "peer failure" is often the server's story.
fn with_server_failures(err: anyhow::Error, servers: &mut [Proc]) -> anyhow::Error {
    let mut extra = Vec::new();
    for server in servers.iter_mut() {
        if let Ok(Some(status)) = server.wait_for(Duration::from_secs(1)) {
            if let Err(e) = server.check_status(status) {
                extra.push(format!("{e:#}"));
            }
        }
    }
    if extra.is_empty() {
        err
    } else {
        anyhow::anyhow!("{err:#}\nand {}", extra.join("\nand "))
    }
}
