//! A throw-away single-member etcd on 127.0.0.1 for the runs xtask drives (`bench --store
//! etcd`, the C API's rendezvous test): free ports, a temporary data directory, killed and
//! removed on drop. The runtime has its own (`tcpx_runtime::rendezvous::LocalEtcd`); xtask
//! does not link the runtime, so this is the same idea over `std::process` alone.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// How long a fresh member may take to elect itself and serve clients.
const READY_WITHIN: Duration = Duration::from_secs(30);

/// A running etcd this process started; dropping it stops it and removes its directory.
pub struct LocalEtcd {
    child: Child,
    dir: PathBuf,
    client: SocketAddr,
}

/// The etcd binary: `$TCPX_ETCD_BIN`, else `etcd` on `PATH` (Debian's `etcd-server`).
pub fn binary() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("TCPX_ETCD_BIN") {
        return Some(PathBuf::from(path)).filter(|p| p.is_file());
    }
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|dir| dir.join("etcd"))
        .find(|p| p.is_file())
}

fn free_port() -> Result<SocketAddr> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .context("finding a free port on 127.0.0.1")
}

impl LocalEtcd {
    /// Starts etcd on free 127.0.0.1 ports (three tries, should a port be taken in between)
    /// and waits until it serves clients.
    pub fn start() -> Result<Self> {
        let binary = binary().context(
            "no etcd binary: install Debian's etcd-server (cargo xtask sysdeps) or set TCPX_ETCD_BIN",
        )?;
        let mut last = None;
        for attempt in 0..3 {
            match Self::start_once(&binary, attempt) {
                Ok(etcd) => return Ok(etcd),
                Err(e) => last = Some(e),
            }
        }
        Err(last.expect("three tries were made"))
    }

    fn start_once(binary: &Path, attempt: u32) -> Result<Self> {
        let client = free_port()?;
        let peer = free_port()?;
        let dir =
            std::env::temp_dir().join(format!("tcpx-xtask-etcd-{}-{attempt}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let log_path = dir.join("etcd.log");
        let log = std::fs::File::create(&log_path)
            .with_context(|| format!("creating {}", log_path.display()))?;
        let (client_url, peer_url) = (format!("http://{client}"), format!("http://{peer}"));
        let child = Command::new(binary)
            .args(["--name", "tcpx-xtask", "--data-dir"])
            .arg(dir.join("data"))
            .args(["--listen-client-urls", &client_url])
            .args(["--advertise-client-urls", &client_url])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("tcpx-xtask={peer_url}")])
            .args(["--initial-cluster-state", "new"])
            .args(["--logger", "zap", "--log-outputs", "stderr"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let mut etcd = Self { child, dir, client };
        let deadline = Instant::now() + READY_WITHIN;
        loop {
            let text = std::fs::read_to_string(&log_path).unwrap_or_default();
            if text.contains("serving client") || text.contains("ready to serve client") {
                return Ok(etcd);
            }
            let exited = etcd.child.try_wait().ok().flatten();
            if exited.is_some() || Instant::now() > deadline {
                let tail: Vec<&str> = text.lines().rev().take(15).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                bail!(
                    "etcd on {client} {}; its last log lines:\n{}",
                    match exited {
                        Some(status) => format!("exited ({status})"),
                        None => format!("did not serve clients within {READY_WITHIN:?}"),
                    },
                    tail.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The store URL for `job`: `etcd://127.0.0.1:PORT/job`.
    pub fn url(&self, job: &str) -> String {
        format!("etcd://{}/{job}", self.client)
    }
}

impl Drop for LocalEtcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
