//! [`LocalSide`]: what an endpoint holds for peers of its host (its rendezvous listeners,
//! the state its local connections share, the connections themselves). The operations on it
//! are `Endpoint` methods, in [`super::local`].

use std::sync::Arc;
use std::time::Duration;

use crate::config::Config;
use crate::error::Result;
use crate::ipc::identity::endpoint_socket_name;
use crate::ipc::links::Links;
use crate::ipc::normalize_bus_id;
use crate::ipc::rendezvous::Listeners;
use crate::ipc::shared::IpcShared;
use crate::ipc::socket;
use crate::onesided::descriptor::random_key;

/// How long [`Endpoint::connect_local`] retries an endpoint's own name while nobody listens
/// there (another network namespace, an endpoint that is gone): a short grace, not the
/// whole timeout, so that callers fall back to the network quickly.
pub(crate) const NAME_GRACE: Duration = Duration::from_millis(500);

/// What an endpoint holds for same-host peers; its listeners close with the endpoint.
pub(crate) struct LocalSide {
    pub(crate) shared: Arc<IpcShared>,
    /// Its local connections, for revocations.
    pub(crate) links: Links,
    pub(crate) listeners: Listeners,
}

impl LocalSide {
    /// Binds the rendezvous of the endpoint whose control listener is `control`; a failure
    /// leaves the endpoint without a same-host route (said by `accept_local` and the route).
    pub(crate) fn start(config: &Config, control: std::net::SocketAddr) -> Result<Self> {
        let uid = socket::uid();
        let name = endpoint_socket_name(uid, control);
        let instance = random_key()?;
        let listeners = Listeners::bind(&name);
        let shared = Arc::new(IpcShared::new(
            config.timeout,
            config.wait_spin,
            uid,
            instance,
            name,
        ));
        let side = Self {
            shared,
            links: Links::default(),
            listeners,
        };
        // A configured GPU is claimed at once, so that peers dialing it by bus id find this
        // endpoint before it ever calls accept_local.
        if let Some(bus) = config.gpu_pci.as_deref().and_then(normalize_bus_id) {
            side.listeners.claim_gpu(uid, &bus);
        }
        Ok(side)
    }
}
