//! One started child: its stdout as a stream of lines, both streams copied to log files, waits
//! that honour deadlines and Ctrl-C, and a kill on drop so nothing outlives the run.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::interrupt;

/// How often wait loops look at children and the interrupt flag.
pub const POLL: Duration = Duration::from_millis(50);

/// A running child process started by a launcher.
pub struct Proc {
    /// What it is, for messages: `server (gpu 0) on tcpx-a-123`.
    pub label: String,
    child: Child,
    /// Held open for the child's lifetime: the ssh launcher's remote wrapper kills the benchmark
    /// when this pipe closes (xtask gone, ssh killed).
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    stderr_log: PathBuf,
    status: Option<ExitStatus>,
}

/// What a wait for a stdout line ended with.
pub enum LineWait {
    /// The next stdout line.
    Line(String),
    /// Stdout closed and the process exited.
    Exited(ExitStatus),
    /// The deadline passed.
    TimedOut,
}

impl Proc {
    /// Starts `cmd` in its own process group with stdin a pipe, stdout read line by line, and
    /// stdout/stderr copied to `<log_dir>/<stem>.out` and `.err` (stderr also echoed to ours when
    /// `echo_stderr`).
    pub fn spawn(
        label: String,
        cmd: &mut Command,
        log_dir: &Path,
        stem: &str,
        echo_stderr: bool,
    ) -> Result<Proc> {
        std::fs::create_dir_all(log_dir)
            .with_context(|| format!("create the log directory {}", log_dir.display()))?;
        let stdout_log = log_dir.join(format!("{stem}.out"));
        let stderr_log = log_dir.join(format!("{stem}.err"));
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Our own process group: the terminal's Ctrl-C goes to xtask only, which tears down.
            .process_group(0)
            .spawn()
            .with_context(|| format!("cannot start {label}: {cmd:?}"))?;
        let stdin = child.stdin.take();
        let (tx, lines) = mpsc::channel();
        let stdout = child.stdout.take().expect("stdout is piped");
        let mut out_file = File::create(&stdout_log)
            .with_context(|| format!("create {}", stdout_log.display()))?;
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let _ = writeln!(out_file, "{line}");
                if tx.send(line).is_err() {
                    // Nobody listens any more; keep logging.
                }
            }
        });
        let mut stderr = child.stderr.take().expect("stderr is piped");
        let mut err_file = File::create(&stderr_log)
            .with_context(|| format!("create {}", stderr_log.display()))?;
        thread::spawn(move || {
            let mut buf = [0u8; 8192];
            while let Ok(n) = stderr.read(&mut buf) {
                if n == 0 {
                    break;
                }
                let _ = err_file.write_all(&buf[..n]);
                if echo_stderr {
                    let _ = std::io::stderr().write_all(&buf[..n]);
                }
            }
        });
        Ok(Proc {
            label,
            child,
            stdin,
            lines,
            stderr_log,
            status: None,
        })
    }

    /// Waits for the next stdout line until `deadline`, failing on Ctrl-C.
    pub fn next_line(&mut self, deadline: Instant) -> Result<LineWait> {
        loop {
            interrupt::check()?;
            let now = Instant::now();
            if now >= deadline {
                return Ok(LineWait::TimedOut);
            }
            match self.lines.recv_timeout(POLL.min(deadline - now)) {
                Ok(line) => return Ok(LineWait::Line(line)),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    // Stdout closed: the process is gone or about to be.
                    loop {
                        interrupt::check()?;
                        if let Some(status) = self.try_wait()? {
                            return Ok(LineWait::Exited(status));
                        }
                        if Instant::now() >= deadline {
                            return Ok(LineWait::TimedOut);
                        }
                        thread::sleep(POLL);
                    }
                }
            }
        }
    }

    /// Stdout lines that arrived so far, without waiting.
    pub fn ready_lines(&mut self) -> Vec<String> {
        self.lines.try_iter().collect()
    }

    /// Stdout lines still on their way after the process exited: waits until the reader has
    /// seen end of file, at most `timeout`.
    pub fn final_lines(&mut self, timeout: Duration) -> Vec<String> {
        let deadline = Instant::now() + timeout;
        let mut lines = Vec::new();
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match self.lines.recv_timeout(left) {
                Ok(line) => lines.push(line),
                Err(_) => break,
            }
        }
        lines
    }

    /// The exit status, once the process has exited.
    pub fn try_wait(&mut self) -> Result<Option<ExitStatus>> {
        if self.status.is_none() {
            self.status = self
                .child
                .try_wait()
                .with_context(|| format!("wait for {}", self.label))?;
        }
        Ok(self.status)
    }

    /// Waits up to `timeout` for the process to exit on its own (Ctrl-C aborts the wait).
    pub fn wait_for(&mut self, timeout: Duration) -> Result<Option<ExitStatus>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_wait()? {
                return Ok(Some(status));
            }
            interrupt::check()?;
            if Instant::now() >= deadline {
                return Ok(None);
            }
            thread::sleep(POLL);
        }
    }

    /// Kills the child (SIGKILL) if it still runs and reaps it. Closing its stdin first lets an
    /// ssh wrapper's dead-man switch fire on the remote side as well.
    pub fn kill(&mut self) {
        self.stdin.take();
        if matches!(self.try_wait(), Ok(Some(_))) {
            return;
        }
        let _ = self.child.kill();
        if let Ok(status) = self.child.wait() {
            self.status = Some(status);
        }
    }

    /// The last `lines` lines of the child's stderr, indented, for error messages.
    pub fn stderr_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.stderr_log).unwrap_or_default();
        let all: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        let tail = &all[all.len().saturating_sub(lines)..];
        if tail.is_empty() {
            format!("    (no stderr; log: {})", self.stderr_log.display())
        } else {
            let mut out: Vec<String> = tail.iter().map(|l| format!("    {l}")).collect();
            out.push(format!("    (full log: {})", self.stderr_log.display()));
            out.join("\n")
        }
    }

    /// Fails with the label, the exit meaning and the stderr tail unless `status` is success.
    pub fn check_status(&self, status: ExitStatus) -> Result<()> {
        if status.success() {
            return Ok(());
        }
        bail!(
            "{} failed: {}\n{}",
            self.label,
            describe_exit(status),
            self.stderr_tail(12)
        )
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Explains an exit status in the terms of tcpx-bench's exit codes (and ssh's 255).
pub fn describe_exit(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(1), _) => "exit 1 (error)".into(),
        (Some(2), _) => "exit 2 (usage: tcpx-bench rejected its arguments)".into(),
        (Some(3), _) => "exit 3 (connection or peer failure)".into(),
        (Some(4), _) => "exit 4 (data verification failed)".into(),
        (Some(126 | 127), _) => {
            "the binary could not be executed (missing, not executable, or missing libraries)"
                .into()
        }
        (Some(255), _) => "exit 255 (ssh failed: unreachable node, auth, or host key)".into(),
        (Some(code), _) => format!("exit {code}"),
        (None, Some(sig)) => format!("killed by signal {sig}"),
        (None, None) => format!("{status}"),
    }
}
