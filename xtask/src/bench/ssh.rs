//! `--nodes A,B`: servers on A, clients on B, over ssh.
//!
//! `prepare` makes a temp dir on each node (`mktemp -d /tmp/tcpx-xtask.XXXXXX`) and uses the
//! binary in place when the node holds the same file (sha256) at the same path, else copies it
//! into that dir (through `ssh … cat >`, so one set of ssh options serves every step). Every
//! benchmark runs under a small remote wrapper that prints its pid and kills it when the ssh
//! session's stdin closes — xtask exiting, crashing or killing its ssh — so remote processes
//! cannot outlive the run. `teardown` kills the recorded pids that are still ours (their cwd is
//! the run's temp dir) and removes the temp dirs.

use std::net::IpAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::launcher::{quote, quote_all, Launcher, Node, ProcSpec};
use super::process::{LineWait, Proc};

/// The environment variable holding extra ssh options (split on whitespace).
pub const OPTS_VAR: &str = "TCPX_SSH_OPTS";

/// Port base on the nodes.
const PORT_BASE: u16 = 50000;

/// First line the remote wrapper prints: the benchmark's pid on the node.
const PID_TAG: &str = "TCPX-XTASK-PID";

/// Runs `"$@"` in dir `$1` with a dead-man switch: fd 3 keeps the ssh session's stdin; a watcher
/// kills the benchmark when it reaches EOF. Exits with the benchmark's status. The benchmark's
/// own shell prints the pid tag and then `exec`s it (same pid), so the tag always comes before
/// anything the benchmark prints. (Quoted with `quote`, which escapes the inner single quotes.)
const WRAPPER: &str = "cd \"$1\" || exit 97; shift; exec 3<&0; \
sh -c 'echo \"TCPX-XTASK-PID $$\"; exec \"$@\"' tcpx-xtask-run \"$@\" </dev/null 3<&- & p=$!; \
(read -r _ <&3; kill -TERM $p 2>/dev/null) & w=$!; exec 3<&-; \
wait $p; rc=$?; kill $w 2>/dev/null; exit $rc";

/// What the launcher knows about one node.
#[derive(Default)]
struct Remote {
    /// `host` or `user@host`.
    dest: String,
    /// The run's temp dir there, once made.
    dir: Option<String>,
    /// The binary to run there.
    bin: String,
    /// Benchmark pids started there.
    pids: Vec<u32>,
    /// `hostname -I` there.
    addrs: Vec<String>,
}

/// The ssh launcher.
pub struct Ssh {
    nodes: [Remote; 2],
    opts: Vec<String>,
    server_addr: Option<String>,
    server_ip: String,
    copy: bool,
    dry_run: bool,
}

impl Ssh {
    /// A launcher for servers on `a` and clients on `b`; `server_addr` overrides the address B
    /// connects to; `copy` copies the binary even where the node has it.
    pub fn new(a: &str, b: &str, server_addr: Option<String>, copy: bool) -> Ssh {
        let node = |dest: &str| Remote {
            dest: dest.to_string(),
            ..Remote::default()
        };
        Ssh {
            nodes: [node(a), node(b)],
            opts: ssh_options(std::env::var(OPTS_VAR).ok().as_deref()),
            server_addr,
            server_ip: String::new(),
            copy,
            dry_run: false,
        }
    }

    fn node(&self, node: Node) -> &Remote {
        &self.nodes[node as usize]
    }

    /// `ssh OPTS -T dest <remote command>` with each word quoted for the remote shell.
    fn ssh_words(&self, node: Node, remote: &[String]) -> Vec<String> {
        let mut words = vec!["ssh".to_string()];
        words.extend(self.opts.iter().cloned());
        words.push("-T".into());
        words.push(self.node(node).dest.clone());
        words.push(quote_all(remote));
        words
    }

    fn command(&self, node: Node, remote: &[String]) -> Command {
        let words = self.ssh_words(node, remote);
        let mut cmd = Command::new(&words[0]);
        cmd.args(&words[1..]);
        cmd
    }

    fn render_words(&self, node: Node, remote: &[String]) -> String {
        let words = self.ssh_words(node, remote);
        let (last, head) = words.split_last().expect("ssh words are never empty");
        format!("{} {}", quote_all(head), quote(last))
    }

    /// Runs a short remote shell script and returns its stdout.
    fn run_script(&self, node: Node, script: &str, input: Option<&Path>) -> Result<String> {
        let remote = ["sh".to_string(), "-c".into(), script.into()];
        let mut cmd = self.command(node, &remote);
        match input {
            Some(path) => cmd.stdin(
                std::fs::File::open(path)
                    .with_context(|| format!("open {} to copy it", path.display()))?,
            ),
            None => cmd.stdin(Stdio::null()),
        };
        let dest = &self.node(node).dest;
        let out = cmd
            .output()
            .context("cannot run ssh (install openssh-client)")?;
        if !out.status.success() {
            let hint = if out.status.code() == Some(255) {
                format!(
                    "\n    check that `ssh {dest} true` works without a prompt (keys or agent, a \
                     known host key); extra ssh options go in {OPTS_VAR}"
                )
            } else {
                String::new()
            };
            bail!(
                "ssh {dest} failed ({}): {}{hint}\n    command: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim(),
                self.render_words(node, &remote)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Makes the temp dir, learns the node's addresses and whether it holds our binary.
    fn probe(&mut self, node: Node, bin: &Path, local_sum: &str) -> Result<()> {
        let script = probe_script(bin);
        let out = self.run_script(node, &script, None)?;
        let mut sum = None;
        for line in out.lines() {
            match line.split_once(' ') {
                Some(("dir", d)) if d.starts_with("/tmp/tcpx-xtask.") => {
                    self.nodes[node as usize].dir = Some(d.trim().to_string());
                }
                Some(("addrs", a)) => {
                    self.nodes[node as usize].addrs =
                        a.split_whitespace().map(String::from).collect();
                }
                Some(("sum", s)) => sum = Some(s.trim().to_string()),
                _ => {}
            }
        }
        let dest = self.node(node).dest.clone();
        let dir = self
            .node(node)
            .dir
            .clone()
            .with_context(|| format!("{dest}: could not make a temp dir under /tmp"))?;
        if !self.copy && sum.as_deref() == Some(local_sum) {
            self.nodes[node as usize].bin = bin.display().to_string();
            eprintln!("xtask: {dest} has this tcpx-bench at {}", bin.display());
        } else {
            let target = format!("{dir}/tcpx-bench");
            eprintln!("xtask: copying tcpx-bench to {dest}:{target}");
            self.run_script(node, &copy_script(&target), Some(bin))?;
            self.nodes[node as usize].bin = target;
        }
        Ok(())
    }

    /// Picks the address servers bind on A: `--server-addr`, else A's ssh address when it is
    /// loopback or one of A's own, else A's first `hostname -I` address.
    fn resolve_server_ip(&self) -> Result<String> {
        if let Some(addr) = &self.server_addr {
            return Ok(addr.clone());
        }
        let host = ssh_hostname(&self.node(Node::A).dest);
        let a = self.node(Node::A);
        if host == "localhost" {
            return Ok("127.0.0.1".into());
        }
        if let Ok(ip) = host.parse::<IpAddr>() {
            if ip.is_loopback() || a.addrs.iter().any(|x| x == &host) {
                return Ok(host);
            }
        }
        a.addrs.first().cloned().with_context(|| {
            format!(
                "cannot tell which address of {} the client should use (`hostname -I` printed \
                 nothing); pass --server-addr IP",
                a.dest
            )
        })
    }
}

impl Launcher for Ssh {
    fn name(&self) -> &'static str {
        "nodes"
    }

    fn node_name(&self, node: Node) -> String {
        self.node(node).dest.clone()
    }

    fn prepare(&mut self, bin: &Path, dry_run: bool) -> Result<()> {
        self.dry_run = dry_run;
        if dry_run {
            for node in [Node::A, Node::B] {
                let r = &mut self.nodes[node as usize];
                r.dir = Some("/tmp/tcpx-xtask.XXXXXX".into());
                r.bin = bin.display().to_string();
            }
            self.server_ip = self
                .resolve_server_ip()
                .unwrap_or_else(|_| "<first address of `hostname -I` on A>".into());
            println!("# on each node: make a temp dir, learn the addresses, compare the binary");
            for node in [Node::A, Node::B] {
                let remote = ["sh".to_string(), "-c".into(), probe_script(bin)];
                println!("{}", self.render_words(node, &remote));
            }
            println!("# only where the node's sha256 differs from ours: copy the binary");
            for node in [Node::A, Node::B] {
                let target = "/tmp/tcpx-xtask.XXXXXX/tcpx-bench";
                let remote = ["sh".to_string(), "-c".into(), copy_script(target)];
                println!(
                    "{} < {}",
                    self.render_words(node, &remote),
                    quote(&bin.display().to_string())
                );
            }
            return Ok(());
        }
        let sum = local_sha256(bin)?;
        for node in [Node::A, Node::B] {
            self.probe(node, bin, &sum)?;
        }
        self.server_ip = self.resolve_server_ip()?;
        eprintln!(
            "xtask: servers on {} bind {}; clients on {}",
            self.node(Node::A).dest,
            self.server_ip,
            self.node(Node::B).dest
        );
        Ok(())
    }

    fn server_ip(&self) -> String {
        self.server_ip.clone()
    }

    fn default_port_base(&self, _slots: u16) -> Result<u16> {
        Ok(PORT_BASE)
    }

    fn env(&self) -> Vec<(String, String)> {
        forwarded_env(std::env::vars())
    }

    fn result_path(&self, _log_dir: &Path, stem: &str) -> String {
        let dir = self.node(Node::B).dir.as_deref().unwrap_or("/tmp");
        format!("{dir}/{stem}.jsonl")
    }

    fn spawn(&mut self, spec: &ProcSpec, log_dir: &Path, echo_stderr: bool) -> Result<Proc> {
        let remote = self.remote_words(spec);
        let mut cmd = self.command(spec.node, &remote);
        let mut proc = Proc::spawn(
            spec.label.clone(),
            &mut cmd,
            log_dir,
            &spec.stem,
            echo_stderr,
        )?;
        // The wrapper's first line names the remote pid; ssh itself gets ConnectTimeout=10.
        match proc.next_line(Instant::now() + Duration::from_secs(30))? {
            LineWait::Line(line) => {
                let pid = line
                    .strip_prefix(PID_TAG)
                    .and_then(|p| p.trim().parse().ok())
                    .with_context(|| {
                        format!(
                            "{}: expected `{PID_TAG} <pid>` first, got `{line}`",
                            proc.label
                        )
                    })?;
                self.nodes[spec.node as usize].pids.push(pid);
            }
            LineWait::Exited(status) => proc
                .check_status(status)
                .and_then(|()| bail!("{} ended before starting the benchmark", proc.label))?,
            LineWait::TimedOut => bail!(
                "{}: no answer from ssh within 30 s\n{}",
                proc.label,
                proc.stderr_tail(8)
            ),
        }
        Ok(proc)
    }

    fn render(&self, spec: &ProcSpec) -> String {
        self.render_words(spec.node, &self.remote_words(spec))
    }

    fn fetch(&self, node: Node, path: &str) -> Result<String> {
        self.run_script(node, &format!("cat {}", quote(path)), None)
            .with_context(|| format!("fetch the client's results {path}"))
    }

    fn teardown(&mut self, dry_run: bool) -> Result<()> {
        let mut errors = Vec::new();
        for node in [Node::A, Node::B] {
            let r = &self.nodes[node as usize];
            let Some(dir) = r.dir.clone() else { continue };
            let pids: Vec<String> = if dry_run {
                vec!["<pids>".into()]
            } else {
                r.pids.iter().map(u32::to_string).collect()
            };
            let script = format!(
                "alive=; for p in {pids}; do [ \"$(readlink /proc/$p/cwd 2>/dev/null)\" = {d} ] \
                 && alive=\"$alive $p\"; done; if [ -n \"$alive\" ]; then kill -TERM $alive \
                 2>/dev/null; sleep 1; kill -KILL $alive 2>/dev/null; fi; rm -rf {d}",
                pids = pids.join(" "),
                d = quote(&dir)
            );
            if dry_run {
                if node == Node::A {
                    println!("# teardown (also on failure and Ctrl-C)");
                }
                let remote = ["sh".to_string(), "-c".into(), script];
                println!("{}", self.render_words(node, &remote));
                continue;
            }
            match self.run_script(node, &script, None) {
                Ok(_) => {
                    let r = &mut self.nodes[node as usize];
                    r.dir = None;
                    r.pids.clear();
                }
                Err(e) => errors.push(format!(
                    "{e:#}\n    clean up by hand: ssh {} 'pkill -f {dir}; rm -rf {dir}'",
                    r.dest
                )),
            }
        }
        if dry_run {
            for r in &mut self.nodes {
                r.dir = None;
            }
        }
        if !errors.is_empty() {
            bail!("remote teardown failed:\n{}", errors.join("\n"));
        }
        Ok(())
    }
}

impl Ssh {
    /// The remote command for `spec`: the wrapper, the temp dir, `env K=V …`, binary, args.
    fn remote_words(&self, spec: &ProcSpec) -> Vec<String> {
        let r = self.node(spec.node);
        let mut words = vec![
            "sh".to_string(),
            "-c".into(),
            WRAPPER.into(),
            "tcpx-xtask".into(),
            r.dir.clone().unwrap_or_else(|| "/tmp".into()),
            "env".into(),
        ];
        words.extend(spec.env.iter().map(|(k, v)| format!("{k}={v}")));
        words.push(r.bin.clone());
        words.extend(spec.args.iter().cloned());
        words
    }
}

impl Drop for Ssh {
    fn drop(&mut self) {
        if self.dry_run {
            return;
        }
        if let Err(e) = self.teardown(false) {
            eprintln!("xtask: {e:#}");
        }
    }
}

/// The remote script that makes the run's temp dir and prints `dir D`, `addrs A B…` and, when
/// the node has a file at our binary's path, `sum SHA256`.
fn probe_script(bin: &Path) -> String {
    format!(
        "d=$(mktemp -d /tmp/tcpx-xtask.XXXXXX) || exit 1; echo \"dir $d\"; \
         echo \"addrs $(hostname -I 2>/dev/null)\"; \
         if [ -f {b} ]; then echo \"sum $(sha256sum {b} | cut -d' ' -f1)\"; fi",
        b = quote(&bin.display().to_string())
    )
}

/// The remote script that writes stdin to `target` and makes it executable.
fn copy_script(target: &str) -> String {
    format!("cat > {t} && chmod +x {t}", t = quote(target))
}

/// ssh options: the user's (`TCPX_SSH_OPTS`, split on whitespace) first — ssh keeps the first
/// value of each option — then ours: no prompts (many sessions run at once), bounded connects,
/// dead-peer detection.
fn ssh_options(user: Option<&str>) -> Vec<String> {
    let mut opts: Vec<String> = user
        .unwrap_or_default()
        .split_whitespace()
        .map(String::from)
        .collect();
    for o in [
        "BatchMode=yes",
        "ConnectTimeout=10",
        "ServerAliveInterval=5",
        "ServerAliveCountMax=3",
    ] {
        opts.extend(["-o".to_string(), o.to_string()]);
    }
    opts
}

/// The variables passed to both ends: `TCPX_*` (but not `TCPX_SSH_OPTS`), `NCCL_*`, `UCCL_*`,
/// `RUST_LOG`.
fn forwarded_env(vars: impl Iterator<Item = (String, String)>) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = vars
        .filter(|(k, _)| {
            (k.starts_with("TCPX_") && k != OPTS_VAR)
                || k.starts_with("NCCL_")
                || k.starts_with("UCCL_")
                || k == "RUST_LOG"
        })
        .collect();
    env.sort();
    env
}

/// The host ssh connects to for `dest` (`ssh -G`, so aliases from ~/.ssh/config resolve).
fn ssh_hostname(dest: &str) -> String {
    let from_config = Command::new("ssh")
        .args(["-G", dest])
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .find_map(|l| l.strip_prefix("hostname ").map(|h| h.trim().to_string()))
        });
    from_config.unwrap_or_else(|| dest.rsplit('@').next().unwrap_or(dest).to_string())
}

/// sha256 of a local file (coreutils `sha256sum`).
fn local_sha256(path: &Path) -> Result<String> {
    let out = Command::new("sha256sum")
        .arg(path)
        .output()
        .context("cannot run sha256sum (coreutils)")?;
    if !out.status.success() {
        bail!("sha256sum {} failed", path.display());
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_options_come_first() {
        let o = ssh_options(Some("-i key -o BatchMode=no"));
        assert_eq!(&o[..4], ["-i", "key", "-o", "BatchMode=no"]);
        assert!(o.contains(&"ConnectTimeout=10".to_string()));
    }

    #[test]
    fn forwards_only_our_variables() {
        let vars = [
            ("TCPX_SOCKET_IFNAME", "eth1"),
            ("TCPX_SSH_OPTS", "-i k"),
            ("NCCL_DEBUG", "INFO"),
            ("HOME", "/root"),
            ("RUST_LOG", "debug"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()));
        let env = forwarded_env(vars.into_iter());
        let keys: Vec<&str> = env.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["NCCL_DEBUG", "RUST_LOG", "TCPX_SOCKET_IFNAME"]);
    }

    /// Runs the wrapper locally with `sh`, its stdin a pipe we hold (like ssh's channel).
    fn wrapped(cmd: &[&str]) -> (std::process::Child, std::process::ChildStdin) {
        let mut child = Command::new("sh")
            .args(["-c", WRAPPER, "tcpx-xtask"])
            .arg(std::env::temp_dir())
            .args(cmd)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            // The shell reports the killed job ("Terminated") there.
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        (child, stdin)
    }

    #[test]
    fn wrapper_reports_pid_and_status() {
        use std::io::Read;
        let (mut child, stdin) = wrapped(&["sh", "-c", "echo hi; exit 4"]);
        let mut text = String::new();
        child
            .stdout
            .take()
            .unwrap()
            .read_to_string(&mut text)
            .unwrap();
        assert!(text.starts_with(PID_TAG), "{text}");
        assert!(text.contains("hi"));
        assert_eq!(child.wait().unwrap().code(), Some(4));
        drop(stdin);
    }

    #[test]
    fn wrapper_kills_the_benchmark_when_stdin_closes() {
        let (mut child, stdin) = wrapped(&["sleep", "30"]);
        std::thread::sleep(Duration::from_millis(200));
        let started = Instant::now();
        drop(stdin);
        let status = child.wait().unwrap();
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(!status.success());
    }
}
