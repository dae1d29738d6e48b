//! Rendezvous: endpoints find each other by name through a key-value store instead of a hex
//! blob copied by hand.
//!
//! A [`Store`] is the smallest surface every store an operator already runs can offer: put,
//! get-with-wait and delete of byte values under string keys. Values are the endpoint's
//! existing metadata blob ([`EndpointMetadata::to_bytes`](crate::control::EndpointMetadata)),
//! secret included: whoever may read the store may connect, exactly as with the hex blob.
//!
//! - [`MemoryStore`]: in-process, for tests and for ranks that are threads of one process;
//! - `EtcdStore` (feature `etcd`): etcd v3, every key under a lease kept alive by the store
//!   and revoked when it is dropped, so the keys of a dead endpoint expire within the lease's
//!   TTL;
//! - `LocalEtcd` (feature `etcd`): a throw-away etcd on 127.0.0.1 for tests and one-machine
//!   runs;
//! - [`open`]: a store from a URL (`etcd://host:port[,host:port]/job`).
//!
//! On top ([`Endpoint::publish`](crate::Endpoint::publish),
//! [`Endpoint::connect_by_name`](crate::Endpoint::connect_by_name) and the group form
//! [`Endpoint::rendezvous`](crate::Endpoint::rendezvous), in `endpoint_ext`) the store is
//! only ever asked for these three operations, so bindings (a C callback table, a Python
//! `torch.distributed.Store`) need only implement [`Store`] to get every rendezvous form.

mod endpoint_ext;
mod group;
mod memory;
mod url;

#[cfg(feature = "etcd")]
mod etcd;
#[cfg(feature = "etcd")]
mod local_etcd;

use std::fmt;
use std::time::Duration;

use crate::control::MetadataError;

pub use endpoint_ext::lookup;
#[cfg(feature = "etcd")]
pub use etcd::EtcdStore;
pub use group::Group;
#[cfg(feature = "etcd")]
pub use local_etcd::LocalEtcd;
pub use memory::MemoryStore;
pub use url::StoreUrl;

/// A key-value store endpoints meet through. Keys are relative to the store's own prefix
/// (a store opened for job `job1` keeps its keys apart from another job's).
///
/// Implementations block the calling thread and never wait longer than asked (or their own
/// per-request timeout).
pub trait Store: Send + Sync {
    /// Sets `key` to `value` (replacing any previous value). Stores with leases tie the key
    /// to the store's lease, so it expires when its writer dies.
    fn put(&self, key: &str, value: &[u8]) -> Result<(), StoreError>;

    /// The value of `key`, waiting up to `wait` for it to appear
    /// ([`StoreError::Timeout`] if it does not).
    fn get(&self, key: &str, wait: Duration) -> Result<Vec<u8>, StoreError>;

    /// Removes `key`; returns whether it was there.
    fn delete(&self, key: &str) -> Result<bool, StoreError>;

    /// Names the store in errors and logs (`etcd http://127.0.0.1:2379 under "tcpx/job1/"`).
    fn describe(&self) -> String;
}

impl fmt::Debug for dyn Store + '_ {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe())
    }
}

/// A rendezvous store failed or did not answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// A key did not appear within the wait.
    #[error("{store}: key {key:?} did not appear within {waited:?}")]
    Timeout {
        /// [`Store::describe`].
        store: String,
        /// The key waited for.
        key: String,
        /// How long it was waited for.
        waited: Duration,
    },
    /// The store's server failed or could not be reached.
    #[error("{store}: {op} {key:?}: {message}")]
    Backend {
        /// [`Store::describe`].
        store: String,
        /// `put`, `get`, `delete`, `connect`, `lease`.
        op: &'static str,
        /// The key concerned (empty for store-wide operations).
        key: String,
        /// The client's error.
        message: String,
    },
    /// A store URL could not be used.
    #[error("rendezvous store URL {url:?}: {what}")]
    Url {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        what: String,
    },
    /// A key was not usable (empty, control characters) or a value not what was expected.
    #[error("rendezvous key {key:?}: {what}")]
    Key {
        /// The key.
        key: String,
        /// What is wrong.
        what: String,
    },
    /// A key's value is not endpoint metadata.
    #[error("{store}: key {key:?} does not hold tcpx endpoint metadata: {source}")]
    Value {
        /// [`Store::describe`].
        store: String,
        /// The key.
        key: String,
        /// Why the blob was refused.
        source: MetadataError,
    },
}

impl StoreError {
    /// Whether this is a wait that ran out.
    pub fn is_timeout(&self) -> bool {
        matches!(self, Self::Timeout { .. })
    }
}

impl From<StoreError> for crate::error::Error {
    fn from(e: StoreError) -> Self {
        Self::Rendezvous {
            timed_out: e.is_timeout(),
            message: e.to_string(),
        }
    }
}

/// Refuses keys no store handles alike: empty ones, and those with control characters
/// (they would corrupt logs and some stores' text protocols). Public so that stores
/// implemented elsewhere (the Python bindings' adapter) refuse the same keys.
pub fn check_key(key: &str) -> Result<(), StoreError> {
    let what = if key.is_empty() {
        "is empty"
    } else if key.chars().any(char::is_control) {
        "contains a control character"
    } else if key.len() > 1024 {
        "is longer than 1024 bytes"
    } else {
        return Ok(());
    };
    Err(StoreError::Key {
        key: key.to_owned(),
        what: what.to_owned(),
    })
}

/// Opens the store `url` names: `etcd://host:port[,host:port…]/job[?ttl=SECONDS]` (feature
/// `etcd`). Keys go under `tcpx/<job>/`.
pub fn open(url: &str) -> Result<Box<dyn Store>, StoreError> {
    let parsed = StoreUrl::parse(url)?;
    match parsed {
        #[cfg(feature = "etcd")]
        StoreUrl::Etcd { .. } => Ok(Box::new(EtcdStore::open(&parsed)?)),
        #[cfg(not(feature = "etcd"))]
        StoreUrl::Etcd { .. } => Err(StoreError::Url {
            url: url.to_owned(),
            what: "this build of tcpx-runtime has no etcd support (cargo feature `etcd`)".into(),
        }),
    }
}
