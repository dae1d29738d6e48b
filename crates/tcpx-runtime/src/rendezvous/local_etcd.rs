//! [`LocalEtcd`]: a throw-away single-member etcd on 127.0.0.1, for tests and one-machine
//! runs (`tcpx-bench`, `cargo xtask bench --store etcd` has its own copy).

use std::collections::VecDeque;
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::StoreError;

/// How long a fresh member may take to elect itself and serve clients.
const READY_WITHIN: Duration = Duration::from_secs(30);

/// What etcd logs once it serves clients: "ready to serve client requests" (capnslog, 3.4)
/// or "serving client traffic insecurely…" (zap, 3.4 and 3.5); both contain this.
const READY_LINE: &str = "serving client";

/// A single-member etcd server this process started on 127.0.0.1 (client and peer URLs), with
/// a temporary data directory. Dropping it kills the server and removes the directory —
/// during a panic's unwinding too — and the server is also killed if the thread that
/// started it dies without unwinding (`PR_SET_PDEATHSIG`).
pub struct LocalEtcd {
    child: Child,
    dir: PathBuf,
    client: SocketAddr,
}

impl std::fmt::Debug for LocalEtcd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalEtcd")
            .field("pid", &self.child.id())
            .field("client", &self.client)
            .field("dir", &self.dir)
            .finish()
    }
}

impl LocalEtcd {
    /// The etcd binary: `$TCPX_ETCD_BIN`, else `etcd` on `PATH` (Debian's `etcd-server`
    /// installs `/usr/bin/etcd`); `None` when there is none.
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

    /// Starts a server on free 127.0.0.1 ports and waits until it serves clients. Ports are
    /// picked by binding port 0 and released before etcd binds them; should another process
    /// take one in between, the start is retried on new ports (three tries).
    pub fn start() -> Result<Self, StoreError> {
        let binary = Self::binary().ok_or_else(|| StoreError::Backend {
            store: "local etcd".into(),
            op: "connect",
            key: String::new(),
            message: "no etcd binary (install Debian's etcd-server or set TCPX_ETCD_BIN)".into(),
        })?;
        let mut last = None;
        for _ in 0..3 {
            match Self::start_once(&binary) {
                Ok(etcd) => return Ok(etcd),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| failed("no try was made".into())))
    }

    fn start_once(binary: &Path) -> Result<Self, StoreError> {
        static STARTED: AtomicU32 = AtomicU32::new(0);
        let client = free_port()?;
        let peer = free_port()?;
        let dir = std::env::temp_dir().join(format!(
            "tcpx-etcd-{}-{}",
            std::process::id(),
            STARTED.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)
            .map_err(|e| failed(format!("creating {}: {e}", dir.display())))?;
        let client_url = format!("http://{client}");
        let peer_url = format!("http://{peer}");
        let mut command = Command::new(binary);
        command
            .args(["--name", "tcpx-test", "--data-dir"])
            .arg(dir.join("data"))
            .args(["--listen-client-urls", &client_url])
            .args(["--advertise-client-urls", &client_url])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("tcpx-test={peer_url}")])
            .args(["--initial-cluster-state", "new"])
            .args(["--logger", "zap", "--log-outputs", "stderr"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        // SAFETY: the closure runs in the forked child before exec and calls only prctl(2),
        // which is async-signal-safe; it touches no memory of the parent's.
        unsafe {
            command.pre_exec(|| {
                // Dies with the thread that started it, even if that thread never unwinds.
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command
            .spawn()
            .map_err(|e| failed(format!("starting {}: {e}", binary.display())))?;
        let mut etcd = Self { child, dir, client };
        let Some(stderr) = etcd.child.stderr.take() else {
            return Err(failed("etcd's stderr was not captured".into()));
        };
        let (ready_tx, ready_rx) = crossbeam_channel::bounded(1);
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let log = tail.clone();
        // Drains etcd's log for as long as it runs (a full pipe would stall it), keeping the
        // last lines to explain a failed start.
        std::thread::Builder::new()
            .name("tcpx-etcd-log".into())
            .spawn(move || {
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    if line.contains(READY_LINE) || line.contains("ready to serve client") {
                        let _ = ready_tx.try_send(());
                    }
                    let mut tail = log.lock().unwrap_or_else(|p| p.into_inner());
                    if tail.len() == 20 {
                        tail.pop_front();
                    }
                    tail.push_back(line);
                }
            })
            .map_err(|e| failed(format!("starting the log reader: {e}")))?;
        let deadline = Instant::now() + READY_WITHIN;
        loop {
            if ready_rx.recv_timeout(Duration::from_millis(50)).is_ok() {
                tracing::info!(target: "tcpx_runtime::rendezvous", client = %etcd.client, pid = etcd.child.id(), "local etcd ready");
                return Ok(etcd);
            }
            let exited = etcd.child.try_wait().ok().flatten();
            if exited.is_some() || Instant::now() > deadline {
                let tail = tail.lock().unwrap_or_else(|p| p.into_inner());
                let tail: Vec<&str> = tail.iter().map(String::as_str).collect();
                return Err(failed(format!(
                    "etcd on {client} {}; its last log lines:\n{}",
                    match exited {
                        Some(status) => format!("exited ({status})"),
                        None => format!("did not serve clients within {READY_WITHIN:?}"),
                    },
                    tail.join("\n")
                )));
            }
        }
    }

    /// The client address (`127.0.0.1:PORT`).
    pub fn client_addr(&self) -> SocketAddr {
        self.client
    }

    /// The store URL for `job`: `etcd://127.0.0.1:PORT/job`.
    pub fn url(&self, job: &str) -> String {
        format!("etcd://{}/{job}", self.client)
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for LocalEtcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn failed(message: String) -> StoreError {
    StoreError::Backend {
        store: "local etcd".into(),
        op: "connect",
        key: String::new(),
        message,
    }
}

fn free_port() -> Result<SocketAddr, StoreError> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| failed(format!("finding a free port on 127.0.0.1: {e}")))
}
