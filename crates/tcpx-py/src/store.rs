//! [`PyStore`]: any Python object with the interface of `torch.distributed.Store` (`set`,
//! `get`, and ideally `check` / `wait`, `delete_key`) as a runtime rendezvous
//! [`Store`], so every rendezvous form of the runtime (publish, connect by name, the group
//! form) works over the store a PyTorch job already has.
//!
//! Keys keep the runtime's conventions and go under `prefix/` in the Python store (default
//! `tcpx/`: `tcpx/<job>/rank/<r>` for the group form). Calls take the GIL (from the helper
//! thread that runs the rendezvous, never an engine thread); every wait is bounded by the
//! deadline the runtime passes, in short polls, so a cancelled rendezvous (Ctrl-C) stops
//! asking the store within one poll. A Python exception becomes a [`StoreError`] naming the
//! store, the operation and the key; a timeout-like one (`TimeoutError`, torch's
//! `DistStoreError: ... timeout`) becomes [`StoreError::Timeout`]. Nothing here panics.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pyo3::exceptions::PyTimeoutError;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyString};
use tcpx_runtime::rendezvous::check_key;
use tcpx_runtime::{Store, StoreError};

/// How long one `wait([key], slice)` of a store without `check` lasts.
const WAIT_SLICE: Duration = Duration::from_millis(100);
/// The longest pause between two `check([key])` polls (they start at 1 ms and double).
const MAX_POLL_PAUSE: Duration = Duration::from_millis(50);
/// The wait when neither the caller nor the store gives one (torch's default store timeout).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// How the store is asked whether a key exists yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Presence {
    /// `check([key]) -> bool` (torch's `Store.check`), polled.
    Check,
    /// `wait([key], timedelta)` in slices (raises on a slice's timeout).
    Wait,
    /// Neither: `get(key)` blocks with the store's own timeout.
    GetOnly,
}

/// A Python store (torch's `Store` interface) as a runtime [`Store`].
pub struct PyStore {
    obj: Py<PyAny>,
    /// `"tcpx/"`, or empty for keys at the store's top level.
    prefix: String,
    /// For [`Store::describe`]: the object's type and the prefix.
    name: String,
    presence: Presence,
    /// Set when the caller gave up (Ctrl-C): every later call fails at once.
    cancel: Arc<AtomicBool>,
}

impl PyStore {
    /// Wraps `obj`, keeping keys under `prefix/` (none when `prefix` is empty). Raises
    /// `tcpx.BadArgument` when `obj` has no `set` or `get`, or `prefix` is unusable.
    pub fn new(obj: &Bound<'_, PyAny>, prefix: &str) -> Result<Self, crate::errors::Failure> {
        use crate::errors::Failure;
        for method in ["set", "get"] {
            if !obj.hasattr(method).unwrap_or(false) {
                return Err(Failure::bad(format!(
                    "the store ({}) has no {method}() method: pass an object with \
                     torch.distributed.Store's interface (set, get, check or wait, delete_key)",
                    type_name(obj)
                )));
            }
        }
        let prefix = prefix.trim_end_matches('/');
        if !prefix.is_empty() {
            check_key(prefix).map_err(|e| Failure::bad(format!("prefix: {e}")))?;
        }
        let presence = if obj.hasattr("check").unwrap_or(false) {
            Presence::Check
        } else if obj.hasattr("wait").unwrap_or(false) {
            Presence::Wait
        } else {
            Presence::GetOnly
        };
        let prefix = if prefix.is_empty() {
            String::new()
        } else {
            format!("{prefix}/")
        };
        Ok(Self {
            obj: obj.clone().unbind(),
            name: format!("Python store {} under {prefix:?}", type_name(obj)),
            prefix,
            presence,
            cancel: Arc::new(AtomicBool::new(false)),
        })
    }

    /// The flag that makes every later call fail at once (set it when the caller gives up).
    pub fn cancel_flag(&self) -> Arc<AtomicBool> {
        self.cancel.clone()
    }

    /// The store's own `timeout` attribute (torch's `Store.timeout`, a `timedelta`), if any.
    pub fn own_timeout(obj: &Bound<'_, PyAny>) -> Option<Duration> {
        obj.getattr("timeout").ok()?.extract::<Duration>().ok()
    }

    fn full(&self, key: &str) -> Result<String, StoreError> {
        check_key(key)?;
        Ok(format!("{}{key}", self.prefix))
    }

    fn backend(&self, op: &'static str, key: &str, message: impl Into<String>) -> StoreError {
        StoreError::Backend {
            store: self.name.clone(),
            op,
            key: key.to_owned(),
            message: message.into(),
        }
    }

    fn timeout(&self, key: &str, waited: Duration) -> StoreError {
        StoreError::Timeout {
            store: self.name.clone(),
            key: key.to_owned(),
            waited,
        }
    }

    /// Fails once the caller gave up.
    fn live(&self, op: &'static str, key: &str) -> Result<(), StoreError> {
        if self.cancel.load(Ordering::Relaxed) {
            return Err(self.backend(op, key, "interrupted (the rendezvous was cancelled)"));
        }
        Ok(())
    }

    /// Runs `f` with the GIL; an interpreter that is shutting down is a backend error.
    fn call<T>(
        &self,
        op: &'static str,
        key: &str,
        f: impl for<'py> FnOnce(Python<'py>, &Bound<'py, PyAny>) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        self.live(op, key)?;
        Python::try_attach(|py| f(py, self.obj.bind(py))).unwrap_or_else(|| {
            Err(self.backend(op, key, "the Python interpreter is shutting down"))
        })
    }

    /// A Python exception of `op` as a store error.
    fn error(
        &self,
        py: Python<'_>,
        op: &'static str,
        key: &str,
        e: &PyErr,
        waited: Duration,
    ) -> StoreError {
        if looks_like_timeout(py, e) {
            self.timeout(key, waited)
        } else {
            self.backend(op, key, describe_exception(py, e))
        }
    }

    /// Whether `full` exists now (`Check`), or appears within `slice` (`Wait`).
    fn present(&self, full: &str, key: &str, slice: Duration) -> Result<bool, StoreError> {
        self.call("get", key, |py, obj| match self.presence {
            Presence::Check => {
                let found = obj
                    .call_method1("check", (vec![full],))
                    .and_then(|r| r.is_truthy())
                    .map_err(|e| self.backend("check", key, describe_exception(py, &e)))?;
                Ok(found)
            }
            Presence::Wait => match obj.call_method1("wait", (vec![full], slice)) {
                Ok(_) => Ok(true),
                Err(e) if looks_like_timeout(py, &e) => Ok(false),
                Err(e) => Err(self.backend("wait", key, describe_exception(py, &e))),
            },
            Presence::GetOnly => Ok(true),
        })
    }
}

impl Store for PyStore {
    fn put(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let full = self.full(key)?;
        self.call("put", key, |py, obj| {
            obj.call_method1("set", (full.as_str(), PyBytes::new(py, value)))
                .map(drop)
                .map_err(|e| self.error(py, "put", key, &e, Duration::ZERO))
        })
    }

    fn get(&self, key: &str, wait: Duration) -> Result<Vec<u8>, StoreError> {
        let full = self.full(key)?;
        let start = Instant::now();
        let deadline = start.checked_add(wait);
        let left = || {
            deadline.map_or(Duration::MAX, |d| {
                d.saturating_duration_since(Instant::now())
            })
        };
        let mut pause = Duration::from_millis(1);
        loop {
            if self.present(&full, key, WAIT_SLICE.min(left()))? {
                break;
            }
            let rest = left();
            if rest.is_zero() {
                return Err(self.timeout(key, wait));
            }
            if self.presence == Presence::Check {
                std::thread::sleep(pause.min(rest));
                pause = (pause * 2).min(MAX_POLL_PAUSE);
            }
        }
        self.call("get", key, |py, obj| {
            let value = obj
                .call_method1("get", (full.as_str(),))
                .map_err(|e| self.error(py, "get", key, &e, start.elapsed()))?;
            bytes_of(&value).ok_or_else(|| {
                self.backend(
                    "get",
                    key,
                    format!("get() returned {}, not bytes or str", type_name(&value)),
                )
            })
        })
    }

    fn delete(&self, key: &str) -> Result<bool, StoreError> {
        let full = self.full(key)?;
        self.call("delete", key, |py, obj| {
            obj.call_method1("delete_key", (full.as_str(),))
                .and_then(|r| r.is_truthy())
                .map_err(|e| self.backend("delete", key, describe_exception(py, &e)))
        })
    }

    fn describe(&self) -> String {
        self.name.clone()
    }
}

/// The bytes of a `get` result: `bytes`, `bytearray` or `str` (UTF-8).
fn bytes_of(value: &Bound<'_, PyAny>) -> Option<Vec<u8>> {
    if let Ok(b) = value.cast::<PyBytes>() {
        return Some(b.as_bytes().to_vec());
    }
    if let Ok(b) = value.cast::<PyByteArray>() {
        return Some(b.to_vec());
    }
    if let Ok(s) = value.cast::<PyString>() {
        return s.to_cow().ok().map(|s| s.as_bytes().to_vec());
    }
    None
}

/// `TimeoutError`, or an exception whose class or message says timeout (torch raises
/// `DistStoreError` / `RuntimeError` with "Timeout" / "timed out" in the message).
fn looks_like_timeout(py: Python<'_>, e: &PyErr) -> bool {
    if e.is_instance_of::<PyTimeoutError>(py) {
        return true;
    }
    let text = describe_exception(py, e).to_lowercase();
    text.contains("timeout") || text.contains("timed out")
}

/// `ClassName: message` of a Python exception.
fn describe_exception(py: Python<'_>, e: &PyErr) -> String {
    let class = e
        .get_type(py)
        .qualname()
        .map_or_else(|_| "exception".to_owned(), |n| n.to_string());
    format!("{class}: {}", e.value(py))
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .qualname()
        .map_or_else(|_| "object".to_owned(), |n| n.to_string())
}
