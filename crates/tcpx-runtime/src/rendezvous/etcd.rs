//! [`EtcdStore`]: etcd v3 through the maintained `etcd-client` crate.
//!
//! The client is async (tonic); the library is not. The store owns a small tokio runtime
//! with one worker thread: calls block on it (`block_on` from the caller's thread), and the
//! lease's keep-alive runs on it in the background. Dropping the store stops the keep-alive,
//! revokes the lease (so every key it put disappears at once) and shuts the runtime down.

use std::future::Future;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, EventType, PutOptions, WatchOptions};
use tokio::runtime::Runtime;
use tokio::task::JoinHandle;

use super::url::StoreUrl;
use super::{check_key, Store, StoreError};

/// How long one request to etcd (other than a wait for a key) may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// An etcd v3 [`Store`]: keys under a prefix, all tied to one lease of this store's.
///
/// The lease is kept alive (a keep-alive every third of its TTL) for as long as the store
/// lives; if the process dies, etcd drops the keys when the TTL runs out, and dropping the
/// store revokes the lease at once.
pub struct EtcdStore {
    /// `None` only while dropping.
    runtime: Option<Runtime>,
    client: Client,
    prefix: String,
    lease: i64,
    keep_alive: Option<JoinHandle<()>>,
    describe: String,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore")
            .field("store", &self.describe)
            .field("lease", &self.lease)
            .finish()
    }
}

impl EtcdStore {
    /// Connects to the cluster `url` names (`etcd://host:port[,…]/job[?ttl=S]`).
    pub fn connect(url: &str) -> Result<Self, StoreError> {
        Self::open(&StoreUrl::parse(url)?)
    }

    /// Connects to `endpoints` (`http://host:port`), keys under `prefix`, lease TTL `ttl`
    /// (whole seconds, at least one).
    pub fn connect_with(
        endpoints: &[String],
        prefix: &str,
        ttl: Duration,
    ) -> Result<Self, StoreError> {
        Self::open(&StoreUrl::Etcd {
            endpoints: endpoints.to_vec(),
            prefix: prefix.to_owned(),
            ttl,
        })
    }

    pub(super) fn open(url: &StoreUrl) -> Result<Self, StoreError> {
        let StoreUrl::Etcd {
            endpoints,
            prefix,
            ttl,
        } = url;
        let describe = format!("etcd {} under {prefix:?}", endpoints.join(","));
        let failed = |op: &'static str, e: &dyn std::fmt::Display| StoreError::Backend {
            store: describe.clone(),
            op,
            key: String::new(),
            message: e.to_string(),
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("tcpx-etcd")
            .enable_all()
            .build()
            .map_err(|e| failed("connect", &format!("starting the client's runtime: {e}")))?;
        let ttl_secs = ttl.as_secs().clamp(1, 3600) as i64;
        let options = ConnectOptions::new()
            .with_connect_timeout(REQUEST_TIMEOUT)
            .with_timeout(REQUEST_TIMEOUT);
        let (client, lease) = runtime.block_on(async {
            let connect = Client::connect(endpoints, Some(options));
            let mut client = tokio::time::timeout(REQUEST_TIMEOUT, connect)
                .await
                .map_err(|_| failed("connect", &format!("no answer within {REQUEST_TIMEOUT:?}")))?
                .map_err(|e| failed("connect", &e))?;
            let grant = tokio::time::timeout(REQUEST_TIMEOUT, client.lease_grant(ttl_secs, None))
                .await
                .map_err(|_| failed("lease", &format!("no answer within {REQUEST_TIMEOUT:?}")))?
                .map_err(|e| failed("lease", &e))?;
            Ok::<_, StoreError>((client, grant.id()))
        })?;
        let keep_alive = runtime.spawn(keep_lease_alive(
            client.clone(),
            lease,
            Duration::from_secs(ttl_secs as u64) / 3,
            describe.clone(),
        ));
        tracing::info!(target: "tcpx_runtime::rendezvous", store = %describe, lease, ttl_secs, "etcd store connected");
        Ok(Self {
            runtime: Some(runtime),
            client,
            prefix: prefix.clone(),
            lease,
            keep_alive: Some(keep_alive),
            describe,
        })
    }

    /// The lease every key of this store is tied to.
    pub fn lease_id(&self) -> i64 {
        self.lease
    }

    /// The prefix every key goes under.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn full_key(&self, key: &str) -> Result<String, StoreError> {
        check_key(key)?;
        Ok(format!("{}{key}", self.prefix))
    }

    /// Runs `op` on the store's runtime, giving up after `limit`.
    fn run<T>(
        &self,
        op: &'static str,
        key: &str,
        limit: Duration,
        f: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<Option<T>, StoreError> {
        let runtime = self.runtime.as_ref().ok_or_else(|| StoreError::Backend {
            store: self.describe.clone(),
            op,
            key: key.to_owned(),
            message: "the store is shutting down".into(),
        })?;
        match runtime.block_on(async { tokio::time::timeout(limit, f).await }) {
            Ok(Ok(v)) => Ok(Some(v)),
            Ok(Err(e)) => Err(StoreError::Backend {
                store: self.describe.clone(),
                op,
                key: key.to_owned(),
                message: e.to_string(),
            }),
            Err(_) => Ok(None),
        }
    }
}

/// Renews `lease` every `every` until aborted. A failed renewal is logged and retried on the
/// next tick: a short etcd outage must not drop the keys while the lease is still valid.
async fn keep_lease_alive(mut client: Client, lease: i64, every: Duration, store: String) {
    let mut stream = None;
    loop {
        tokio::time::sleep(every).await;
        if stream.is_none() {
            match client.lease_keep_alive(lease).await {
                Ok(pair) => stream = Some(pair),
                Err(e) => {
                    tracing::warn!(target: "tcpx_runtime::rendezvous", %store, lease, error = %e, "cannot open the lease keep-alive stream");
                    continue;
                }
            }
        }
        let Some((keeper, responses)) = stream.as_mut() else {
            continue;
        };
        let renewed = async {
            keeper.keep_alive().await?;
            responses.message().await
        };
        match tokio::time::timeout(every.max(Duration::from_millis(100)), renewed).await {
            Ok(Ok(Some(r))) if r.ttl() > 0 => {}
            Ok(Ok(Some(_))) => {
                // TTL 0: etcd no longer knows the lease (it expired during an outage); the
                // keys are gone and there is nothing to renew.
                tracing::error!(target: "tcpx_runtime::rendezvous", %store, lease, "the lease expired: published keys are gone");
                return;
            }
            outcome => {
                let why = match outcome {
                    Ok(Err(e)) => e.to_string(),
                    Ok(Ok(None)) => "the keep-alive stream ended".to_owned(),
                    _ => "no answer in time".to_owned(),
                };
                tracing::warn!(target: "tcpx_runtime::rendezvous", %store, lease, error = %why, "lease keep-alive failed; retrying");
                stream = None;
            }
        }
    }
}

impl Store for EtcdStore {
    fn put(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let full = self.full_key(key)?;
        let mut client = self.client.clone();
        let options = PutOptions::new().with_lease(self.lease);
        self.run(
            "put",
            key,
            REQUEST_TIMEOUT,
            client.put(full, value.to_vec(), Some(options)),
        )?
        .map(|_| ())
        .ok_or_else(|| self.no_answer("put", key))
    }

    fn get(&self, key: &str, wait: Duration) -> Result<Vec<u8>, StoreError> {
        let full = self.full_key(key)?;
        let mut client = self.client.clone();
        // One read first, with the request timeout: even a zero wait answers what is there.
        let now = self
            .run("get", key, REQUEST_TIMEOUT, client.get(full.clone(), None))?
            .ok_or_else(|| self.no_answer("get", key))?;
        if let Some(kv) = now.kvs().first() {
            return Ok(kv.value().to_vec());
        }
        if wait.is_zero() {
            return Err(StoreError::Timeout {
                store: self.describe.clone(),
                key: key.to_owned(),
                waited: wait,
            });
        }
        // Absent: watch from the revision after the one read, so that a put racing with the
        // read is seen.
        let revision = now.header().map_or(0, |h| h.revision());
        let waited = async move {
            let options = WatchOptions::new().with_start_revision(revision + 1);
            let mut stream = client.watch(full, Some(options)).await?;
            while let Some(response) = stream.message().await? {
                for event in response.events() {
                    if event.event_type() == EventType::Put {
                        if let Some(kv) = event.kv() {
                            return Ok(Some(kv.value().to_vec()));
                        }
                    }
                }
            }
            Ok(None)
        };
        match self.run("get", key, wait, waited)? {
            Some(Some(v)) => Ok(v),
            Some(None) => Err(StoreError::Backend {
                store: self.describe.clone(),
                op: "get",
                key: key.to_owned(),
                message: "the watch ended before the key appeared".into(),
            }),
            None => Err(StoreError::Timeout {
                store: self.describe.clone(),
                key: key.to_owned(),
                waited: wait,
            }),
        }
    }

    fn delete(&self, key: &str) -> Result<bool, StoreError> {
        let full = self.full_key(key)?;
        let mut client = self.client.clone();
        self.run("delete", key, REQUEST_TIMEOUT, client.delete(full, None))?
            .map(|r| r.deleted() > 0)
            .ok_or_else(|| self.no_answer("delete", key))
    }

    fn describe(&self) -> String {
        self.describe.clone()
    }
}

impl EtcdStore {
    fn no_answer(&self, op: &'static str, key: &str) -> StoreError {
        StoreError::Backend {
            store: self.describe.clone(),
            op,
            key: key.to_owned(),
            message: format!("no answer within {REQUEST_TIMEOUT:?}"),
        }
    }
}

impl Drop for EtcdStore {
    fn drop(&mut self) {
        if let Some(task) = self.keep_alive.take() {
            task.abort();
        }
        let mut client = self.client.clone();
        let lease = self.lease;
        match self.run("lease", "", REQUEST_TIMEOUT, client.lease_revoke(lease)) {
            Ok(Some(_)) => {
                tracing::debug!(target: "tcpx_runtime::rendezvous", store = %self.describe, lease, "lease revoked")
            }
            // Not fatal: the keys still expire with the lease's TTL.
            outcome => {
                tracing::warn!(target: "tcpx_runtime::rendezvous", store = %self.describe, lease, ?outcome, "could not revoke the lease; its keys expire with its TTL")
            }
        }
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_timeout(Duration::from_secs(1));
        }
    }
}
