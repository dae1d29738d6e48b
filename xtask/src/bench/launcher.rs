//! The `Launcher` abstraction: where a benchmark process runs. A launcher turns a
//! [`ProcSpec`] (node, arguments, environment) into a started [`Proc`] or, for `--dry-run`, into
//! the shell command it would run; everything else (ports, readiness, peers, results) is the
//! shared [`run_pairs`](super::pairs::run_pairs) routine. This file holds the trait, the local
//! launcher and shell quoting; `netns.rs` and `ssh.rs` hold the other two.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Result;

use super::process::Proc;

/// One of the two "machines": `A` runs the servers, `B` the clients.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Node {
    /// The server side.
    A,
    /// The client side.
    B,
}

/// One benchmark process to start.
#[derive(Clone, Debug)]
pub struct ProcSpec {
    /// Where it runs.
    pub node: Node,
    /// For messages: `server (gpu 3)`.
    pub label: String,
    /// Log file stem: `server-gpu3`.
    pub stem: String,
    /// Arguments after the binary (`server --bind …`).
    pub args: Vec<String>,
    /// Variables set for it (on top of what it inherits, for the local kinds).
    pub env: Vec<(String, String)>,
}

/// Where benchmark processes run: this machine, two namespaces on it, or two ssh nodes.
pub trait Launcher {
    /// `local`, `netns` or `nodes`.
    fn name(&self) -> &'static str;

    /// A node as people should read it in messages: `tcpx-a-4242`, `me@host-b`.
    fn node_name(&self, node: Node) -> String;

    /// Gets the nodes ready to run `bin` (namespaces, remote temp dirs, binary copies). With
    /// `dry_run`, prints the commands instead.
    fn prepare(&mut self, bin: &Path, dry_run: bool) -> Result<()>;

    /// The address servers bind on node A, reachable from node B.
    fn server_ip(&self) -> String;

    /// The default port base when the user gave none; all of `base .. base + 2 * slots` must be
    /// usable on node A. 0: every server binds port 0 and picks a free pair of ports itself
    /// (its metadata line carries the one it got).
    fn default_port_base(&self, slots: u16) -> Result<u16>;

    /// Variables every benchmark process gets from this launcher (e.g. the NICs it may use).
    fn env(&self) -> Vec<(String, String)>;

    /// Where the client writing `<stem>.jsonl` puts it, as a path on node B.
    fn result_path(&self, log_dir: &Path, stem: &str) -> String;

    /// Starts `spec`, its logs under `log_dir`.
    fn spawn(&mut self, spec: &ProcSpec, log_dir: &Path, echo_stderr: bool) -> Result<Proc>;

    /// The shell command `spawn` would run (for `--dry-run` and messages).
    fn render(&self, spec: &ProcSpec) -> String;

    /// Reads a result file written on `node`.
    fn fetch(&self, node: Node, path: &str) -> Result<String>;

    /// Called just before the first process starts (e.g. to snapshot NIC counters).
    fn before_run(&mut self) -> Result<()> {
        Ok(())
    }

    /// Called after every process exited successfully, before teardown (e.g. to check that every
    /// NIC carried traffic).
    fn after_run(&mut self) -> Result<()> {
        Ok(())
    }

    /// Removes everything `prepare` and `spawn` created. Idempotent; also run on drop.
    fn teardown(&mut self, dry_run: bool) -> Result<()>;
}

/// Both ends on this machine over loopback (the README's first command).
pub struct Local {
    bin: PathBuf,
}

impl Local {
    /// A local launcher; `prepare` records the binary.
    pub fn new() -> Local {
        Local {
            bin: PathBuf::new(),
        }
    }
}

impl Launcher for Local {
    fn name(&self) -> &'static str {
        "local"
    }

    fn node_name(&self, _node: Node) -> String {
        "this machine (loopback)".into()
    }

    fn prepare(&mut self, bin: &Path, _dry_run: bool) -> Result<()> {
        self.bin = bin.to_path_buf();
        Ok(())
    }

    fn server_ip(&self) -> String {
        Ipv4Addr::LOCALHOST.to_string()
    }

    fn default_port_base(&self, _slots: u16) -> Result<u16> {
        // Each server picks its own pair: ports found free here and handed over would race
        // with the host's other connections until the servers bound them.
        Ok(0)
    }

    fn env(&self) -> Vec<(String, String)> {
        // The local benchmark never leaves loopback (README, "Network rule").
        vec![
            ("TCPX_SOCKET_IFNAME".into(), "lo".into()),
            ("NCCL_SOCKET_IFNAME".into(), "lo".into()),
        ]
    }

    fn result_path(&self, log_dir: &Path, stem: &str) -> String {
        log_dir.join(format!("{stem}.jsonl")).display().to_string()
    }

    fn spawn(&mut self, spec: &ProcSpec, log_dir: &Path, echo_stderr: bool) -> Result<Proc> {
        let mut cmd = Command::new(&self.bin);
        cmd.args(&spec.args).envs(spec.env.iter().cloned());
        Proc::spawn(
            spec.label.clone(),
            &mut cmd,
            log_dir,
            &spec.stem,
            echo_stderr,
        )
    }

    fn render(&self, spec: &ProcSpec) -> String {
        let mut words: Vec<String> = Vec::new();
        words.extend(spec.env.iter().map(|(k, v)| format!("{k}={}", quote(v))));
        words.push(quote(&self.bin.display().to_string()));
        words.extend(spec.args.iter().map(|a| quote(a)));
        words.join(" ")
    }

    fn fetch(&self, _node: Node, path: &str) -> Result<String> {
        read_result(path)
    }

    fn teardown(&mut self, _dry_run: bool) -> Result<()> {
        Ok(())
    }
}

/// Reads a result file on this machine, saying which run wrote nothing.
pub fn read_result(path: &str) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| {
        anyhow::anyhow!("cannot read the client's results {path}: {e} (the client wrote no JSON)")
    })
}

/// Quotes `word` for a POSIX shell (unchanged when it needs no quoting).
pub fn quote(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,@%+".contains(c));
    if plain {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// Quotes every word and joins them with spaces.
pub fn quote_all<S: AsRef<str>>(words: &[S]) -> String {
    words
        .iter()
        .map(|w| quote(w.as_ref()))
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting() {
        assert_eq!(quote("--bind"), "--bind");
        assert_eq!(quote("10.250.0.1:50000"), "10.250.0.1:50000");
        assert_eq!(quote("a b"), "'a b'");
        assert_eq!(quote("it's"), r"'it'\''s'");
        assert_eq!(quote(""), "''");
        assert_eq!(quote_all(&["echo", "$x"]), "echo '$x'");
    }
}
