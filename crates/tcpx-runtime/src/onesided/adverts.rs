//! [`AdvertBook`]: the regions an endpoint advertised, and the check every one-sided request
//! from a peer goes through before a byte moves.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use super::descriptor::{random_key, Descriptor};
use crate::control::rma::{Refusal, RefusalReason, RemoteEntry};
use crate::error::Result;
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
    /// descriptor stops working). Staged regions are accepted: one-sided operations on them
    /// move through the engines' pinned rings, never through a plugin registration.
    pub(crate) fn advertise(&self, region: &Region) -> Result<Descriptor> {
        let key = random_key()?;
        let id = region.inner.id;
        self.lock().insert(
            id,
            Advert {
                region: Some(region.clone()),
                key,
            },
        );
        // A staged region is advertised as CUDA memory even when it is emulated (host memory
        // taking the staged route): peers then treat it exactly like the GPU region it stands
        // in for — in particular they pack a batch naming it only as they would a GPU one
        // (through the rings, see `pack`), so an emulation run exercises the same protocol as
        // a GPU run.
        let kind = if region.is_staged() {
            tcpx::MemoryKind::Cuda
        } else {
            region.memory().kind()
        };
        Ok(Descriptor::new(id, region.len() as u64, kind, key))
    }

    /// The regions advertised and not revoked.
    pub(crate) fn live_regions(&self) -> Vec<Region> {
        self.lock()
            .values()
            .filter_map(|a| a.region.clone())
            .collect()
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

    /// Checks every entry for a job of the comms; on success, each entry's region (all staged
    /// or none). On the first bad entry, the refusal naming it (and the refusal is counted).
    pub(crate) fn validate(&self, entries: &[RemoteEntry]) -> Result<Vec<Region>, Refusal> {
        let regions = self.validate_entries(entries)?;
        // One job moves the whole list, and a job is staged as a whole or not at all: a list
        // mixing staged regions with others is refused, naming the first entry that differs
        // from the first one.
        if let Some(first) = regions.first() {
            let staged = first.is_staged();
            if let Some(index) = regions.iter().position(|r| r.is_staged() != staged) {
                self.count_refusal();
                return Err(Refusal {
                    index: u32::try_from(index).unwrap_or(u32::MAX),
                    reason: RefusalReason::UnsupportedMemory,
                });
            }
        }
        Ok(regions)
    }

    /// Checks every entry (known region, right key, not revoked, in bounds), whatever memory
    /// the regions are: what an inline operation, copied entry by entry, needs. On success,
    /// each entry's region; on the first bad entry, the refusal naming it (counted).
    pub(crate) fn validate_entries(&self, entries: &[RemoteEntry]) -> Result<Vec<Region>, Refusal> {
        let adverts = self.lock();
        let mut regions = Vec::with_capacity(entries.len());
        // The advert of the entry before: a list of many blocks in one region looks it up
        // once, not once per block.
        let mut last: Option<(u64, Option<&Advert>)> = None;
        for (index, entry) in entries.iter().enumerate() {
            let refuse = |reason| Refusal {
                index: u32::try_from(index).unwrap_or(u32::MAX),
                reason,
            };
            let advert = match last {
                Some((id, advert)) if id == entry.region_id => advert,
                _ => adverts.get(&entry.region_id),
            };
            last = Some((entry.region_id, advert));
            let checked = match advert {
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
