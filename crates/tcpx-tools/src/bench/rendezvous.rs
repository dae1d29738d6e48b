//! `--store URL --name NAME` of the two-process modes (server/client, kv server/client): the
//! server publishes its endpoint in a rendezvous store (etcd) under a name and removes it when
//! it exits; the client finds it there by name instead of being handed the hex blob.
//!
//! The key lives under the store's lease (`etcd://…/job?ttl=S`, 10 s by default), so a server
//! that dies without unpublishing leaves no key behind for longer than the TTL.

use std::time::Duration;

use tcpx_runtime::control::metadata::EndpointMetadata;
use tcpx_runtime::rendezvous::{self, Store, StoreError};
use tcpx_runtime::Endpoint;

use super::failure::{exit, peer_failure, Failure};

/// The name a `tcpx-bench server` publishes under when `--name` is not given.
pub const DEFAULT_SERVER_NAME: &str = "tcpx-bench-server";
/// The name a `tcpx-bench kv server` publishes under when `--name` is not given.
pub const DEFAULT_KV_NAME: &str = "tcpx-bench-kv-server";

/// An open rendezvous store and the name a role publishes or looks up.
pub struct Rendezvous {
    store: Box<dyn Store>,
    name: String,
}

impl std::fmt::Debug for Rendezvous {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rendezvous")
            .field("store", &self.store.describe())
            .field("name", &self.name)
            .finish()
    }
}

/// Maps a store error to the exit code scripts read: a bad URL or name is a usage error (2),
/// a store that cannot be reached or a name that never appears is an unreachable peer (3).
fn store_failure(flag: &str, e: StoreError) -> Failure {
    match e {
        StoreError::Url { .. } | StoreError::Key { .. } => Failure {
            code: exit::USAGE,
            error: anyhow::anyhow!("{flag}: {e}"),
        },
        other => peer_failure(anyhow::anyhow!("{flag}: {other}")),
    }
}

impl Rendezvous {
    /// Opens the store `url` (`etcd://host:port[,host:port]/job[?ttl=S]`) for `name`.
    pub fn open(url: &str, name: &str) -> Result<Self, Failure> {
        let store = rendezvous::open(url).map_err(|e| store_failure("--store", e))?;
        Ok(Self {
            store,
            name: name.to_owned(),
        })
    }

    /// The name published or looked up.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Publishes `endpoint` under the name; the key is removed when the returned guard drops
    /// (and, should the process die first, when the store's lease expires).
    pub fn publish<'a>(&'a self, endpoint: &'a Endpoint) -> Result<Published<'a>, Failure> {
        endpoint
            .publish(self.store.as_ref(), &self.name)
            .map_err(|e| {
                peer_failure(anyhow::anyhow!("--store: publishing {:?}: {e}", self.name))
            })?;
        Ok(Published {
            rendezvous: self,
            endpoint,
        })
    }

    /// The metadata published under the name, waiting up to `wait` for it to appear.
    pub fn find(&self, wait: Duration) -> Result<EndpointMetadata, Failure> {
        rendezvous::lookup(self.store.as_ref(), &self.name, wait).map_err(|e| {
            peer_failure(anyhow::anyhow!(
                "--store: finding {:?} in {}: {e} (is `tcpx-bench server --store` with the same \
                 URL and --name running?)",
                self.name,
                self.store.describe()
            ))
        })
    }

    /// [`Store::describe`] of the store.
    pub fn describe(&self) -> String {
        self.store.describe()
    }
}

/// A published endpoint; dropping it removes the name from the store.
#[derive(Debug)]
pub struct Published<'a> {
    rendezvous: &'a Rendezvous,
    endpoint: &'a Endpoint,
}

impl Drop for Published<'_> {
    fn drop(&mut self) {
        let r = self.rendezvous;
        if let Err(e) = self.endpoint.unpublish(r.store.as_ref(), &r.name) {
            // The lease removes it within its TTL anyway; say so rather than fail the run.
            tracing::warn!(name = %r.name, store = %r.describe(), error = %e, "could not unpublish; the key expires with the store's lease");
        }
    }
}
