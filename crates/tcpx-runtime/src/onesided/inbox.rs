//! [`Inbox`]: notifications delivered to one endpoint, waiting for the application.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Mutex;

/// Notifications held before the application drains them; past this, new ones are dropped
/// (with a warning) rather than letting a peer grow memory without bound.
const MAX_HELD: usize = 1 << 16;

/// The endpoint's delivered notifications, in delivery order (per connection: send order).
#[derive(Default)]
pub(crate) struct Inbox {
    held: Mutex<VecDeque<(SocketAddr, Vec<u8>)>>,
}

impl Inbox {
    /// Queues one notification from `peer`.
    pub(crate) fn deliver(&self, peer: SocketAddr, bytes: Vec<u8>) {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if held.len() >= MAX_HELD {
            tracing::warn!(target: "tcpx_runtime", %peer, held = held.len(), "notification dropped: the application is not draining notifications");
            return;
        }
        held.push_back((peer, bytes));
    }

    /// Takes every held notification.
    pub(crate) fn drain(&self) -> Vec<(SocketAddr, Vec<u8>)> {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        held.drain(..).collect()
    }
}
