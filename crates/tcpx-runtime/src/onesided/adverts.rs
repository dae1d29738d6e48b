//! [`AdvertBook`]: the regions an endpoint advertised, and the check every one-sided request
//! from a peer goes through before a byte moves.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use super::descriptor::{random_key, Descriptor};
use super::wire::{Refusal, RefusalReason, RemoteEntry};
use crate::error::{Error, Result};
use crate::registry::Region;

/// One advertised region. A revoked entry keeps its id and key (so a request naming it is
/// refused as *revoked*, not *unknown*) but no longer holds the region.
struct Advert {
    region: Option<Region>,
    key: u64,
}

/// The advertised regions of one endpoint, shared by all its connections.
#[derive(Default)]
pub(crate) struct AdvertBook {
    adverts: Mutex<HashMap<u64, Advert>>,
    refusals: AtomicU64,
}

impl AdvertBook {
    /// Advertises `region` (again: a region advertised twice gets a fresh key, and the old
    /// descriptor stops working).
    pub(crate) fn advertise(&self, region: &Region) -> Result<Descriptor> {
        if region.is_staged() {
            return Err(Error::Unsupported(
                "a staged CUDA region (CUDA memory on a host-only plugin) cannot be advertised                  for one-sided access yet"
                    .into(),
            ));
        }
        let key = random_key()?;
        let id = region.inner.id;
        self.lock().insert(
            id,
            Advert {
                region: Some(region.clone()),
                key,
            },
        );
        Ok(Descriptor::new(
            id,
            region.len() as u64,
            region.memory().kind(),
            key,
        ))
    }

    /// Revokes `descriptor`; returns whether it was advertised and not yet revoked. Requests
    /// already accepted run to completion.
    pub(crate) fn revoke(&self, descriptor: &Descriptor) -> bool {
        let mut adverts = self.lock();
        match adverts.get_mut(&descriptor.region_id()) {
            Some(advert) if advert.key == descriptor.key() && advert.region.is_some() => {
                advert.region = None;
                true
            }
            _ => false,
        }
    }

    /// Checks every entry; on success, each entry's region. On the first bad entry, the
    /// refusal naming it (and the refusal is counted).
    pub(crate) fn validate(&self, entries: &[RemoteEntry]) -> Result<Vec<Region>, Refusal> {
        let adverts = self.lock();
        let mut regions = Vec::with_capacity(entries.len());
        for (index, entry) in entries.iter().enumerate() {
            let refuse = |reason| Refusal {
                index: u32::try_from(index).unwrap_or(u32::MAX),
                reason,
            };
            let checked = match adverts.get(&entry.region_id) {
                None => Err(RefusalReason::UnknownRegion),
                Some(a) if a.key != entry.key => Err(RefusalReason::WrongKey),
                Some(Advert { region: None, .. }) => Err(RefusalReason::Revoked),
                Some(Advert {
                    region: Some(region),
                    ..
                }) => match entry.offset.checked_add(entry.len) {
                    Some(end) if end <= region.len() as u64 => Ok(region.clone()),
                    _ => Err(RefusalReason::OutOfBounds),
                },
            };
            match checked {
                Ok(region) => regions.push(region),
                Err(reason) => {
                    drop(adverts);
                    self.count_refusal();
                    return Err(refuse(reason));
                }
            }
        }
        Ok(regions)
    }

    /// Counts one refused request.
    pub(crate) fn count_refusal(&self) {
        self.refusals.fetch_add(1, Ordering::Relaxed);
    }

    /// Requests refused so far.
    pub(crate) fn refusals(&self) -> u64 {
        self.refusals.load(Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Advert>> {
        self.adverts.lock().unwrap_or_else(|p| p.into_inner())
    }
}
