//! [`Links`]: the live same-host connections of one endpoint, so that a revocation reaches
//! every peer that may have mapped the revoked range.

use std::sync::Arc;
use std::time::Instant;

use super::link::{LocalLink, Reply};
use super::shared::IpcShared;
use super::wire::Msg;
use crate::error::{LocalErrorKind, Result};
use crate::weak_list::WeakList;

/// An endpoint's local connections, held weakly (a dropped connection leaves by itself).
#[derive(Default)]
pub(crate) struct Links {
    links: WeakList<LocalLink>,
}

impl Links {
    /// Remembers a new connection (revocations reach it).
    pub(crate) fn add_link(&self, link: &Arc<LocalLink>) {
        self.links.add(link);
    }

    /// Revokes `key` and waits until every connected peer dropped it (and closed its mapping
    /// if that was the last descriptor of the allocation), at most the timeout in all.
    /// Whether the key was advertised; an error names a peer that did not confirm in time.
    pub(crate) fn revoke(&self, shared: &IpcShared, key: u64) -> Result<bool> {
        let was = shared.adverts.revoke(key);
        if !was {
            return Ok(false);
        }
        // All asks first, then all answers: one timeout for the lot, not one per peer.
        let asked: Vec<_> = self
            .links
            .live()
            .into_iter()
            .filter_map(|link| {
                let waiter = link.ask(|req| Msg::Revoke { req, key }).ok()?;
                Some((link, waiter))
            })
            .collect();
        let deadline = Instant::now() + shared.timeout;
        for (link, waiter) in asked {
            match link.answer_by(waiter, deadline) {
                Ok(Reply::Ack) => {}
                Ok(other) => {
                    return Err(link.error(
                        LocalErrorKind::Protocol,
                        format!("answered a revocation with {other:?}"),
                    ))
                }
                // Gone, or closed here meanwhile: its mappings were dropped on the way out.
                Err(e)
                    if matches!(
                        e.local_kind(),
                        Some(LocalErrorKind::PeerClosed | LocalErrorKind::Closed)
                    ) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }
}
