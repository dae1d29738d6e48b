//! Behaviour switched on by the environment to test the layers above against plugins that
//! misbehave or fail: the **no-size mode** and **fault injection**. Both are read once, at the
//! first `init`, like the rest of the plugin's environment; both are off by default and cost one
//! relaxed atomic load (no size mode) or one `Option` check per `test` (faults) when off.
//!
//! ## No-size mode (`TCPX_SOCKET_NO_SIZES=1`)
//!
//! `test` reports completion but never writes `*sizes`, for sends or receives, the way some
//! deployed v6 host-memory plugins (nccl-fastsocket) behave. NCCL tolerates that: it never reads
//! the size of a send, and a receive's size only where it must. The safe layer (`tcpx::comm`)
//! follows the same contract; this mode lets CI prove it.
//!
//! ## Faults (`TCPX_SOCKET_FAULT=key:value[,key:value...]`)
//!
//! Keys (each at most once; at least one of the first four):
//! * `fail_after_bytes:N` — once a comm's completed requests total at least N bytes, its next
//!   `test` fails with ncclSystemError and the comm stays failed (a request fails part-way
//!   through a stream, with the connection still open).
//! * `test_error:K` — the K-th `test` on a comm (1-based) fails with ncclInternalError and the
//!   comm stays failed.
//! * `drop_conn_after_bytes:N` — once a comm's completed requests total at least N bytes, its
//!   next `test` shuts its data sockets down in both directions; the ordinary error paths take
//!   over (the messages in flight at that moment are cut mid-stream on both sides).
//! * `delay_us:D` — every completion is reported no earlier than D microseconds after `test`
//!   first found it complete (completions held back, order kept; no thread sleeps).
//! * `side:send|recv|both` — which comms get the faults (default both).
//! * `comms:N` — only the first N comms of that side created in this process (connect and
//!   accept, in creation order) get the faults; later comms behave normally. Default: all. With
//!   it, a fault hits "one connection" and the tests can check that the next one works.
//!
//! A value that does not parse makes `init` fail with a log line naming the variable and the
//! offending part. [`faults_injected`] counts the faults actually triggered in this process.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use tcpx_sys::ResultCode;

use crate::log::log_warn;

/// Environment variable of the no-size mode (`1`, `true`, `yes`, `on`).
pub const NO_SIZES_ENV: &str = "TCPX_SOCKET_NO_SIZES";
/// Environment variable of fault injection (syntax in the module docs).
pub const FAULT_ENV: &str = "TCPX_SOCKET_FAULT";

static NO_SIZES: AtomicBool = AtomicBool::new(false);
static SPEC: OnceLock<Option<Spec>> = OnceLock::new();
static INJECTED: AtomicU64 = AtomicU64::new(0);
static SEND_COMMS: AtomicU64 = AtomicU64::new(0);
static RECV_COMMS: AtomicU64 = AtomicU64::new(0);

/// Number of faults triggered in this process so far (one per comm hit by a fault, plus one per
/// held-back completion under `delay_us`).
pub fn faults_injected() -> u64 {
    INJECTED.load(Ordering::Relaxed)
}

/// Whether `test` must leave `*sizes` untouched.
pub(crate) fn no_sizes() -> bool {
    NO_SIZES.load(Ordering::Relaxed)
}

/// Which comms a fault applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Side {
    Send,
    Recv,
    Both,
}

/// A parsed `TCPX_SOCKET_FAULT`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Spec {
    pub fail_after_bytes: Option<u64>,
    pub test_error: Option<u64>,
    pub drop_after_bytes: Option<u64>,
    pub delay: Option<Duration>,
    pub side: Side,
    pub comms: Option<u64>,
}

/// Parses a `TCPX_SOCKET_FAULT` value; the error says which part is wrong and why.
pub(crate) fn parse(value: &str) -> Result<Spec, String> {
    let mut spec = Spec {
        fail_after_bytes: None,
        test_error: None,
        drop_after_bytes: None,
        delay: None,
        side: Side::Both,
        comms: None,
    };
    let mut seen: Vec<&str> = Vec::new();
    for part in value.split(',').map(str::trim) {
        let (key, val) = part
            .split_once(':')
            .map(|(k, v)| (k.trim(), v.trim()))
            .ok_or_else(|| format!("{part:?} is not key:value"))?;
        if seen.contains(&key) {
            return Err(format!("{key} given twice"));
        }
        seen.push(key);
        let num = || {
            val.parse::<u64>()
                .map_err(|_| format!("{key}: {val:?} is not a non-negative integer"))
        };
        match key {
            "fail_after_bytes" => spec.fail_after_bytes = Some(num()?),
            "drop_conn_after_bytes" => spec.drop_after_bytes = Some(num()?),
            "test_error" => match num()? {
                0 => return Err("test_error: counts tests from 1, 0 never fires".into()),
                k => spec.test_error = Some(k),
            },
            "delay_us" => spec.delay = Some(Duration::from_micros(num()?)),
            "comms" => spec.comms = Some(num()?),
            "side" => {
                spec.side = match val {
                    "send" => Side::Send,
                    "recv" => Side::Recv,
                    "both" => Side::Both,
                    other => return Err(format!("side: {other:?} is not send, recv or both")),
                }
            }
            other => {
                return Err(format!(
                    "unknown key {other:?} (fail_after_bytes, test_error, drop_conn_after_bytes, \
                     delay_us, side, comms)"
                ))
            }
        }
    }
    if spec.fail_after_bytes.is_none()
        && spec.test_error.is_none()
        && spec.drop_after_bytes.is_none()
        && spec.delay.is_none()
    {
        return Err(
            "no fault given (fail_after_bytes, test_error, drop_conn_after_bytes or \
                    delay_us)"
                .into(),
        );
    }
    Ok(spec)
}

/// Reads both variables (once, from `init`); an error names the variable and the bad part.
pub(crate) fn configure() -> Result<(), String> {
    let no_sizes_value = std::env::var(NO_SIZES_ENV).ok();
    NO_SIZES.store(
        crate::switch::is_on(no_sizes_value.as_deref()),
        Ordering::Relaxed,
    );
    let spec = match std::env::var(FAULT_ENV) {
        Ok(v) if !v.trim().is_empty() => Some(parse(&v).map_err(|e| format!("{FAULT_ENV}: {e}"))?),
        _ => None,
    };
    if let Some(s) = &spec {
        crate::log::log_info!("tcpx-socket: fault injection on ({FAULT_ENV}): {s:?}");
    }
    if no_sizes() {
        crate::log::log_info!("tcpx-socket: {NO_SIZES_ENV}: test never writes sizes");
    }
    let _ = SPEC.set(spec);
    Ok(())
}

/// What `test` must do before progressing.
pub(crate) enum Action {
    Proceed,
    /// Fail the comm with this code.
    Fail(ResultCode),
    /// Shut the data sockets down, then proceed.
    Drop,
}

/// A comm's fault state: `None` inside when no fault applies to this comm (the common case).
pub(crate) struct Gate(Option<Box<GateState>>);

struct GateState {
    spec: &'static Spec,
    tests: u64,
    bytes: u64,
    dropped: bool,
    /// The request whose completion is being held back (`delay_us`) and since when.
    held: Option<(u64, Instant)>,
}

impl Gate {
    /// The gate of a new comm of `side` (counts the comm towards `comms:N`).
    pub(crate) fn new(side: Side) -> Self {
        let Some(Some(spec)) = SPEC.get() else {
            return Self(None);
        };
        if spec.side != Side::Both && spec.side != side {
            return Self(None);
        }
        let counter = if side == Side::Send {
            &SEND_COMMS
        } else {
            &RECV_COMMS
        };
        let nth = counter.fetch_add(1, Ordering::Relaxed);
        if spec.comms.is_some_and(|n| nth >= n) {
            return Self(None);
        }
        Self(Some(Box::new(GateState {
            spec,
            tests: 0,
            bytes: 0,
            dropped: false,
            held: None,
        })))
    }

    /// Called at the start of every `test` of the comm named `name`.
    #[inline]
    pub(crate) fn before_test(&mut self, name: &str) -> Action {
        match &mut self.0 {
            None => Action::Proceed,
            Some(g) => g.before_test(name),
        }
    }

    /// Whether the complete request `seq` may be reported done now (`delay_us`).
    #[inline]
    pub(crate) fn release(&mut self, seq: u64) -> bool {
        match &mut self.0 {
            None => true,
            Some(g) => g.release(seq),
        }
    }

    /// Records a completion of `size` bytes.
    #[inline]
    pub(crate) fn completed(&mut self, size: u32) {
        if let Some(g) = &mut self.0 {
            g.bytes += u64::from(size);
        }
    }
}

impl GateState {
    fn before_test(&mut self, name: &str) -> Action {
        self.tests += 1;
        let spec = self.spec;
        if spec.test_error == Some(self.tests) {
            INJECTED.fetch_add(1, Ordering::Relaxed);
            log_warn!(
                "tcpx-socket: {name}: injected fault: test #{} fails ({FAULT_ENV} test_error); \
                 the comm is failed",
                self.tests
            );
            return Action::Fail(ResultCode::INTERNAL_ERROR);
        }
        if let Some(n) = spec.fail_after_bytes.filter(|&n| self.bytes >= n) {
            INJECTED.fetch_add(1, Ordering::Relaxed);
            log_warn!(
                "tcpx-socket: {name}: injected fault: {} bytes completed (fail_after_bytes {n}); \
                 the comm is failed",
                self.bytes
            );
            return Action::Fail(ResultCode::SYSTEM_ERROR);
        }
        if let Some(n) = spec
            .drop_after_bytes
            .filter(|&n| !self.dropped && self.bytes >= n)
        {
            self.dropped = true;
            INJECTED.fetch_add(1, Ordering::Relaxed);
            log_warn!(
                "tcpx-socket: {name}: injected fault: {} bytes completed \
                 (drop_conn_after_bytes {n}); shutting the data sockets down",
                self.bytes
            );
            return Action::Drop;
        }
        Action::Proceed
    }

    fn release(&mut self, seq: u64) -> bool {
        let Some(delay) = self.spec.delay else {
            return true;
        };
        match self.held {
            Some((s, since)) if s == seq => {
                if since.elapsed() >= delay {
                    self.held = None;
                    true
                } else {
                    false
                }
            }
            _ => {
                INJECTED.fetch_add(1, Ordering::Relaxed);
                self.held = Some((seq, Instant::now()));
                delay.is_zero()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_key() {
        let s = parse("fail_after_bytes:10, test_error:3,drop_conn_after_bytes:7,delay_us:5,side:recv,comms:2")
            .unwrap();
        assert_eq!(s.fail_after_bytes, Some(10));
        assert_eq!(s.test_error, Some(3));
        assert_eq!(s.drop_after_bytes, Some(7));
        assert_eq!(s.delay, Some(Duration::from_micros(5)));
        assert_eq!(s.side, Side::Recv);
        assert_eq!(s.comms, Some(2));
    }

    #[test]
    fn rejects_bad_values_with_the_part_named() {
        for (bad, needle) in [
            ("fail_after_bytes", "not key:value"),
            ("fail_after_bytes:-1", "fail_after_bytes"),
            ("test_error:0", "0 never fires"),
            ("delay_us:abc", "delay_us"),
            ("side:left", "left"),
            ("bogus:1", "unknown key"),
            ("comms:1", "no fault given"),
            ("test_error:1,test_error:2", "twice"),
        ] {
            let err = parse(bad).unwrap_err();
            assert!(err.contains(needle), "{bad}: {err}");
        }
    }
}
