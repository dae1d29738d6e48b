//! The rendezvous forms of [`Endpoint`]: publish under a name, connect by name, and the group
//! form (in `group`).

use std::time::{Duration, Instant};

use super::{Store, StoreError};
use crate::control::{ControlError, EndpointMetadata};
use crate::endpoint::{Connection, Endpoint};
use crate::error::{Error, Result};

/// How long to wait before reading a name again after its endpoint refused the connection
/// (a stale key of a dead endpoint, about to be replaced by its restarted successor).
const STALE_RETRY: Duration = Duration::from_millis(200);

impl Endpoint {
    /// Publishes this endpoint's metadata (secret included) in `store` under `name`, so that
    /// peers can [`connect_by_name`](Self::connect_by_name). On stores with leases (etcd) the
    /// key expires when this process dies; [`unpublish`](Self::unpublish) removes it at once.
    pub fn publish(&self, store: &dyn Store, name: &str) -> Result<()> {
        let blob = self
            .metadata()
            .to_bytes()
            .map_err(|e| Error::Internal(format!("encoding this endpoint's metadata: {e}")))?;
        store.put(name, &blob)?;
        tracing::info!(target: "tcpx_runtime::rendezvous", store = %store.describe(), name, control = %self.metadata().control_addr, "endpoint published");
        Ok(())
    }

    /// Removes `name` from `store`; returns whether it was there.
    pub fn unpublish(&self, store: &dyn Store, name: &str) -> Result<bool> {
        Ok(store.delete(name)?)
    }

    /// Waits up to `wait` for `name` to appear in `store`, then connects to the endpoint it
    /// describes, presenting its secret. If the endpoint named there refuses the control
    /// connection (a stale key of an endpoint that died), the name is read again until `wait`
    /// runs out, so a restarted peer that publishes again is found.
    pub fn connect_by_name(
        &self,
        store: &dyn Store,
        name: &str,
        wait: Duration,
    ) -> Result<Connection> {
        let deadline = Instant::now() + wait;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let peer = lookup(store, name, left)?;
            match self.connect(&peer) {
                Err(Error::Control(c))
                    if matches!(*c, ControlError::Connect { .. })
                        && Instant::now() + STALE_RETRY < deadline =>
                {
                    tracing::info!(target: "tcpx_runtime::rendezvous", name, peer = %peer.control_addr, error = %c, "published endpoint unreachable; reading the name again");
                    std::thread::sleep(STALE_RETRY);
                }
                other => return other,
            }
        }
    }
}

/// Reads `name` from `store` (waiting up to `wait`) as endpoint metadata: what
/// [`Endpoint::connect_by_name`] connects to, for callers that need the metadata first (to
/// pick a bind address, or to connect later).
pub fn lookup(store: &dyn Store, name: &str, wait: Duration) -> Result<EndpointMetadata> {
    let blob = store.get(name, wait)?;
    EndpointMetadata::from_bytes(&blob).map_err(|source| {
        StoreError::Value {
            store: store.describe(),
            key: name.to_owned(),
            source,
        }
        .into()
    })
}
