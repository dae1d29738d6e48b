//! The rendezvous calls both Python layers share: publish, connect by name and the group
//! form over a Python store ([`PyStore`]), run on a helper thread while the calling thread
//! waits without the GIL (Ctrl-C raises `KeyboardInterrupt` and cancels the store's polls).

use std::sync::Arc;
use std::time::Duration;

use pyo3::prelude::*;

use crate::core::Core;
use crate::errors::{Failure, Outcome};
use crate::store::{PyStore, DEFAULT_TIMEOUT};
use crate::wait;

/// What the group form needs besides the store.
#[derive(Debug, Clone)]
pub struct Group {
    /// Key prefix in the Python store (`"tcpx"`).
    pub prefix: String,
    /// The group's name under the prefix.
    pub job: String,
    /// This endpoint's rank.
    pub rank: i64,
    /// Number of ranks.
    pub world: i64,
    /// Seconds to wait in all (`None`: the store's `timeout`, else 300 s).
    pub timeout: Option<f64>,
}

/// The wait: `timeout` seconds, else the store's own `timeout`, else [`DEFAULT_TIMEOUT`].
fn wait_of(store: &Bound<'_, PyAny>, timeout: Option<f64>) -> Outcome<Duration> {
    Ok(wait::timeout(timeout)?
        .or_else(|| PyStore::own_timeout(store))
        .unwrap_or(DEFAULT_TIMEOUT))
}

/// Runs `work(core, store)` on a helper thread; the outer error is a signal (Ctrl-C).
fn run<T: Send + 'static>(
    py: Python<'_>,
    core: &Arc<Core>,
    store: PyStore,
    work: impl FnOnce(&Core, &PyStore) -> Outcome<T> + Send + 'static,
) -> PyResult<Outcome<T>> {
    let core = core.clone();
    let cancel = store.cancel_flag();
    wait::cancellable(py, Some(cancel), move || {
        let out = work(&core, &store);
        // The store holds a Python object: release it with the GIL.
        Python::try_attach(move |_| drop(store));
        out
    })
}

/// The group rendezvous: `(rank, conn_id)` of every other rank.
pub fn group(
    py: Python<'_>,
    core: &Arc<Core>,
    store: &Bound<'_, PyAny>,
    g: Group,
) -> PyResult<Outcome<Vec<(usize, u64)>>> {
    let checked = (|| {
        let wait = wait_of(store, g.timeout)?;
        let (rank, world) = match (usize::try_from(g.rank), usize::try_from(g.world)) {
            (Ok(r), Ok(w)) if r < w => (r, w),
            _ => {
                return Err(Failure::bad(format!(
                    "rendezvous: rank {} of world {} (need 0 <= rank < world)",
                    g.rank, g.world
                )))
            }
        };
        Ok((PyStore::new(store, &g.prefix)?, wait, rank, world))
    })();
    let (adapter, wait, rank, world) = match checked {
        Ok(v) => v,
        Err(f) => return Ok(Err(f)),
    };
    let job = g.job;
    run(py, core, adapter, move |core, store| {
        core.rendezvous(store, &job, rank, world, wait)
    })
}

/// Publishes the endpoint under `name`.
pub fn publish(
    py: Python<'_>,
    core: &Arc<Core>,
    store: &Bound<'_, PyAny>,
    prefix: &str,
    name: String,
) -> PyResult<Outcome<()>> {
    match PyStore::new(store, prefix) {
        Ok(adapter) => run(py, core, adapter, move |core, store| {
            core.publish(store, &name)
        }),
        Err(f) => Ok(Err(f)),
    }
}

/// Removes `name`; whether it was there.
pub fn unpublish(
    py: Python<'_>,
    core: &Arc<Core>,
    store: &Bound<'_, PyAny>,
    prefix: &str,
    name: String,
) -> PyResult<Outcome<bool>> {
    match PyStore::new(store, prefix) {
        Ok(adapter) => run(py, core, adapter, move |core, store| {
            core.unpublish(store, &name)
        }),
        Err(f) => Ok(Err(f)),
    }
}

/// Connects to the endpoint published under `name` (waiting up to `timeout`).
pub fn connect_by_name(
    py: Python<'_>,
    core: &Arc<Core>,
    store: &Bound<'_, PyAny>,
    prefix: &str,
    name: String,
    timeout: Option<f64>,
) -> PyResult<Outcome<u64>> {
    let checked = wait_of(store, timeout).and_then(|w| Ok((w, PyStore::new(store, prefix)?)));
    match checked {
        Ok((wait, adapter)) => run(py, core, adapter, move |core, store| {
            core.connect_by_name(store, &name, wait)
        }),
        Err(f) => Ok(Err(f)),
    }
}
