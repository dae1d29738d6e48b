//! `--netns`: two "nodes" on one machine. Namespaces `tcpx-a-<pid>` (servers) and `tcpx-b-<pid>`
//! (clients) are joined by five veth pairs `a:ethK <-> b:ethK` with 10.250.K.1/24 and
//! 10.250.K.2/24: eth0 carries control (servers bind 10.250.0.1), eth1..eth4 the data (both ends
//! get `TCPX_SOCKET_IFNAME=eth1,eth2,eth3,eth4`). All traffic stays between the two namespaces.
//! Teardown kills what runs inside and deletes both namespaces (which deletes the veths), on
//! success, failure, Ctrl-C and drop. After the run every data NIC must have carried traffic.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use super::launcher::{quote, quote_all, read_result, Launcher, Node, ProcSpec};
use super::process::Proc;
use crate::sysdeps;

/// Data NICs in each namespace.
pub const DATA_NICS: [&str; 4] = ["eth1", "eth2", "eth3", "eth4"];

/// Port base inside the fresh namespaces, where every port is free.
const PORT_BASE: u16 = 50000;

/// A data NIC must carry at least this much (noise such as IPv6 neighbour discovery is far less).
const MIN_NIC_BYTES: u64 = 64 << 10;

/// The netns launcher: namespaces are created in `prepare` and deleted in `teardown`.
pub struct Netns {
    a: String,
    b: String,
    bin: PathBuf,
    /// Namespaces created so far (deleted by teardown).
    created: Vec<String>,
    before: Option<Counters>,
}

/// Per-NIC `(tx_bytes, rx_bytes)` of node A then node B.
type Counters = Vec<[u64; 4]>;

impl Netns {
    /// Namespace names unique to this xtask process.
    pub fn new() -> Netns {
        let pid = std::process::id();
        Netns {
            a: format!("tcpx-a-{pid}"),
            b: format!("tcpx-b-{pid}"),
            bin: PathBuf::new(),
            created: Vec::new(),
            before: None,
        }
    }

    fn ns(&self, node: Node) -> &str {
        match node {
            Node::A => &self.a,
            Node::B => &self.b,
        }
    }

    /// The `ip` commands that build the two nodes, in order.
    fn setup_commands(&self) -> Vec<Vec<String>> {
        let s = |v: &[&str]| v.iter().map(|w| w.to_string()).collect::<Vec<_>>();
        let (a, b) = (self.a.as_str(), self.b.as_str());
        let mut cmds = vec![s(&["ip", "netns", "add", a]), s(&["ip", "netns", "add", b])];
        for ns in [a, b] {
            cmds.push(s(&["ip", "-n", ns, "link", "set", "lo", "up"]));
        }
        for k in 0..=DATA_NICS.len() {
            let nic = format!("eth{k}");
            cmds.push(s(&[
                "ip", "link", "add", &nic, "netns", a, "type", "veth", "peer", "name", &nic,
                "netns", b,
            ]));
            for (ns, host) in [(a, 1), (b, 2)] {
                let addr = format!("10.250.{k}.{host}/24");
                cmds.push(s(&["ip", "-n", ns, "addr", "add", &addr, "dev", &nic]));
                cmds.push(s(&["ip", "-n", ns, "link", "set", &nic, "up"]));
            }
        }
        cmds
    }

    /// Reads `tx_bytes`/`rx_bytes` of every data NIC in both namespaces.
    fn counters(&self) -> Result<Counters> {
        let mut all = Vec::new();
        for ns in [&self.a, &self.b] {
            let files: Vec<String> = DATA_NICS
                .iter()
                .flat_map(|nic| {
                    ["tx_bytes", "rx_bytes"].map(|c| format!("/sys/class/net/{nic}/statistics/{c}"))
                })
                .collect();
            let out = Command::new("ip")
                .args(["netns", "exec", ns, "cat"])
                .args(&files)
                .output()
                .context("run `ip netns exec … cat` for the NIC counters")?;
            if !out.status.success() {
                bail!(
                    "cannot read NIC counters in {ns}: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                );
            }
            let numbers: Vec<u64> = String::from_utf8_lossy(&out.stdout)
                .split_whitespace()
                .map(|n| n.parse().context("a NIC counter is not a number"))
                .collect::<Result<_>>()?;
            if numbers.len() != files.len() {
                bail!(
                    "expected {} NIC counters in {ns}, read {}",
                    files.len(),
                    numbers.len()
                );
            }
            for pair in numbers.chunks(2) {
                all.push([pair[0], pair[1], 0, 0]);
            }
        }
        // Fold B's counters next to A's: [a_tx, a_rx, b_tx, b_rx] per NIC.
        let n = DATA_NICS.len();
        let merged = (0..n)
            .map(|i| [all[i][0], all[i][1], all[n + i][0], all[n + i][1]])
            .collect();
        Ok(merged)
    }

    fn delete_namespaces(&mut self) -> Result<()> {
        let mut errors = Vec::new();
        for ns in std::mem::take(&mut self.created) {
            // Kill anything still running inside (a namespace with processes outlives `del`).
            if let Ok(out) = Command::new("ip").args(["netns", "pids", &ns]).output() {
                for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                    let _ = Command::new("kill").args(["-KILL", pid]).status();
                }
            }
            match Command::new("ip").args(["netns", "del", &ns]).output() {
                Ok(out) if out.status.success() => {}
                Ok(out) => errors.push(format!(
                    "`ip netns del {ns}`: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                )),
                Err(e) => errors.push(format!("`ip netns del {ns}`: {e}")),
            }
        }
        if !errors.is_empty() {
            bail!(
                "namespace teardown failed ({}); remove them by hand",
                errors.join("; ")
            );
        }
        Ok(())
    }
}

impl Launcher for Netns {
    fn name(&self) -> &'static str {
        "netns"
    }

    fn node_name(&self, node: Node) -> String {
        self.ns(node).to_string()
    }

    fn prepare(&mut self, bin: &Path, dry_run: bool) -> Result<()> {
        self.bin = bin.to_path_buf();
        if dry_run {
            println!("# create two nodes as network namespaces");
            for cmd in self.setup_commands() {
                println!("{}", quote_all(&cmd));
            }
            return Ok(());
        }
        if !sysdeps::is_root() {
            bail!(
                "--netns creates network namespaces and veth NICs, which needs root: run it as \
                 root, e.g. `sudo -E env PATH=\"$PATH\" cargo xtask bench --netns …`"
            );
        }
        warn_stale_namespaces();
        for cmd in self.setup_commands() {
            let out = Command::new(&cmd[0])
                .args(&cmd[1..])
                .output()
                .with_context(|| format!("cannot run `{}` (is iproute2 installed?)", cmd[0]))?;
            if cmd[1] == "netns" && cmd[2] == "add" && out.status.success() {
                self.created.push(cmd[3].clone());
            }
            if !out.status.success() {
                bail!(
                    "`{}` failed: {} (needs root with CAP_SYS_ADMIN and CAP_NET_ADMIN, and veth \
                     support in the kernel)",
                    quote_all(&cmd),
                    String::from_utf8_lossy(&out.stderr).trim()
                );
            }
        }
        Ok(())
    }

    fn server_ip(&self) -> String {
        "10.250.0.1".into()
    }

    fn default_port_base(&self, _slots: u16) -> Result<u16> {
        Ok(PORT_BASE)
    }

    fn env(&self) -> Vec<(String, String)> {
        let nics = DATA_NICS.join(",");
        vec![
            ("TCPX_SOCKET_IFNAME".into(), nics.clone()),
            ("NCCL_SOCKET_IFNAME".into(), nics),
        ]
    }

    fn result_path(&self, log_dir: &Path, stem: &str) -> String {
        log_dir.join(format!("{stem}.jsonl")).display().to_string()
    }

    fn spawn(&mut self, spec: &ProcSpec, log_dir: &Path, echo_stderr: bool) -> Result<Proc> {
        let mut cmd = Command::new("ip");
        // `ip netns exec` execs the command: the child's pid is the benchmark's.
        cmd.args(["netns", "exec", self.ns(spec.node)])
            .arg(&self.bin)
            .args(&spec.args)
            .envs(spec.env.iter().cloned());
        Proc::spawn(
            spec.label.clone(),
            &mut cmd,
            log_dir,
            &spec.stem,
            echo_stderr,
        )
    }

    fn render(&self, spec: &ProcSpec) -> String {
        let mut words = vec![
            "ip".to_string(),
            "netns".into(),
            "exec".into(),
            self.ns(spec.node).into(),
        ];
        if !spec.env.is_empty() {
            words.push("env".into());
            words.extend(spec.env.iter().map(|(k, v)| format!("{k}={v}")));
        }
        words.push(self.bin.display().to_string());
        words.extend(spec.args.iter().cloned());
        quote_all(&words)
    }

    fn fetch(&self, _node: Node, path: &str) -> Result<String> {
        read_result(path)
    }

    fn before_run(&mut self) -> Result<()> {
        // The first run's snapshot stands (the sweep, then the kv pairs): the striping check
        // covers all of them.
        if self.before.is_none() {
            self.before = Some(self.counters()?);
        }
        Ok(())
    }

    fn after_run(&mut self) -> Result<()> {
        let before = self
            .before
            .take()
            .context("NIC counters were not read before the run")?;
        let after = self.counters()?;
        check_striping(&before, &after)
    }

    fn teardown(&mut self, dry_run: bool) -> Result<()> {
        if dry_run {
            println!("# teardown");
            for ns in [&self.a, &self.b] {
                println!(
                    "ip netns pids {ns} | xargs -r kill -KILL; ip netns del {}",
                    quote(ns)
                );
            }
            return Ok(());
        }
        self.delete_namespaces()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Err(e) = self.delete_namespaces() {
            eprintln!("xtask: {e:#}");
        }
    }
}

/// Prints the per-NIC byte counts the run moved and fails when a data NIC carried (almost)
/// nothing: less than 64 KiB, or less than a quarter of an even share of all data bytes.
fn check_striping(before: &Counters, after: &Counters) -> Result<()> {
    let deltas: Vec<[u64; 4]> = before
        .iter()
        .zip(after)
        .map(|(b, a)| std::array::from_fn(|i| a[i].saturating_sub(b[i])))
        .collect();
    // The bytes a NIC carried: what left or entered node A on it.
    let carried: Vec<u64> = deltas.iter().map(|d| d[0] + d[1]).collect();
    let total: u64 = carried.iter().sum();
    let floor = MIN_NIC_BYTES.max(total / DATA_NICS.len() as u64 / 4);
    println!("\n# data NICs (bytes moved in the run; a = servers, b = clients)");
    println!(
        "{:>5} {:>14} {:>14} {:>14} {:>14} {:>7}",
        "nic", "a tx", "a rx", "b tx", "b rx", "share"
    );
    let mut idle = Vec::new();
    for (nic, (d, c)) in DATA_NICS.iter().zip(deltas.iter().zip(&carried)) {
        let share = if total > 0 {
            *c as f64 / total as f64
        } else {
            0.0
        };
        println!(
            "{nic:>5} {:>14} {:>14} {:>14} {:>14} {:>6.1}%",
            d[0],
            d[1],
            d[2],
            d[3],
            share * 100.0
        );
        if *c < floor {
            idle.push(*nic);
        }
    }
    if !idle.is_empty() {
        bail!(
            "multi-NIC striping check failed: {} carried less than {floor} bytes of {total} \
             (use --channels >= {} so every NIC gets a channel, and check that the plugin \
             honours TCPX_SOCKET_IFNAME)",
            idle.join(", "),
            DATA_NICS.len()
        );
    }
    println!("every data NIC carried traffic");
    Ok(())
}

/// Warns about namespaces left by an earlier xtask that died without teardown (never touches
/// them: another run may own them).
fn warn_stale_namespaces() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    let stale: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| {
            name.strip_prefix("tcpx-a-")
                .or_else(|| name.strip_prefix("tcpx-b-"))
                .and_then(|pid| pid.parse::<u32>().ok())
                .is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists())
        })
        .map(String::from)
        .collect();
    if !stale.is_empty() {
        eprintln!(
            "xtask: note: namespaces {} belong to xtask runs that are gone; remove them with \
             `ip netns del NAME`",
            stale.join(", ")
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn striping_check() {
        let before = vec![[0; 4]; 4];
        let even = vec![[1 << 20, 1 << 10, 1 << 10, 1 << 20]; 4];
        assert!(check_striping(&before, &even).is_ok());
        let mut one_idle = even.clone();
        one_idle[2] = [300, 200, 200, 300];
        assert!(check_striping(&before, &one_idle).is_err());
    }

    #[test]
    fn setup_is_five_veth_pairs() {
        let cmds = Netns::new().setup_commands();
        let veths = cmds
            .iter()
            .filter(|c| c.contains(&"veth".to_string()))
            .count();
        assert_eq!(veths, 5);
    }
}
