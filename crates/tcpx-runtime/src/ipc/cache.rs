//! The importer's side: the peer allocations a connection mapped ([`Mapped`], one per
//! (device, handle)) and the descriptors the owner confirmed ([`Grant`], one per
//! (device, key)), so that repeated operations on a descriptor neither ask the owner again
//! nor reopen its handle.
//!
//! A mapping goes when its peer revokes the last descriptor of it, says goodbye, or goes away,
//! and when the connection closes: [`Mapped::retire`] refuses new copies, waits for those
//! already queued and closes the handle. Copies are queued under the mapping's read lock
//! and retiring takes the write lock, so no copy can slip in between the wait and the close.

use std::collections::HashMap;
use std::sync::{Arc, RwLock, RwLockReadGuard};

use tcpx::cuda::{CopyPool, IpcMapping, IpcMemHandle};

/// Where a peer's allocation is reachable from here.
#[derive(Debug)]
pub(crate) enum Target {
    /// Mapped through CUDA IPC.
    Ipc(IpcMapping),
    /// The peer is this process: its own address (no handle can be opened in the exporting
    /// process, and none is needed).
    Direct(u64),
}

/// A peer allocation as this connection reaches it, with the copy pool of the device it was
/// opened on.
#[derive(Debug)]
pub(crate) struct Mapped {
    target: RwLock<Option<Target>>,
    pub(crate) pool: Arc<CopyPool>,
}

impl Mapped {
    pub(crate) fn new(target: Target, pool: Arc<CopyPool>) -> Self {
        Self {
            target: RwLock::new(Some(target)),
            pool,
        }
    }

    /// The mapping, for queuing copies while the guard is held (`None` once retired).
    pub(crate) fn read(&self) -> RwLockReadGuard<'_, Option<Target>> {
        self.target.read().unwrap_or_else(|p| p.into_inner())
    }

    /// The allocation's size as the driver reports it, when it does.
    pub(crate) fn len(&self) -> Option<usize> {
        match &*self.read() {
            Some(Target::Ipc(m)) => m.len(),
            _ => None,
        }
    }

    /// Refuses new copies, waits for every copy queued on the device's pool, then closes the
    /// handle. Idempotent.
    pub(crate) fn retire(&self) -> tcpx::Result<()> {
        let taken = self
            .target
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        let Some(target) = taken else {
            return Ok(());
        };
        // Copies queued under the read lock before we took the write lock are on the pool's
        // streams; after this wait none of them touches the mapping.
        let waited = self.pool.synchronize();
        match target {
            Target::Ipc(m) => {
                if waited.is_err() {
                    // Unknown whether a copy still uses it: never unmap under a DMA engine.
                    std::mem::forget(m);
                    return waited;
                }
                m.close()
            }
            Target::Direct(_) => waited,
        }
    }
}

/// What the owner confirmed for a key on this connection: the allocation and the range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Grant {
    pub(crate) handle: IpcMemHandle,
    pub(crate) offset: u64,
    pub(crate) len: u64,
}

/// The grants (by key) and mappings (by device and handle) of one connection (`M`:
/// `Arc<Mapped>` in use, any cheap handle in tests). A mapping is kept only while a grant
/// names its handle.
#[derive(Debug)]
pub(crate) struct Cache<M> {
    grants: HashMap<u64, Grant>,
    mappings: HashMap<(usize, IpcMemHandle), M>,
}

impl<M> Default for Cache<M> {
    fn default() -> Self {
        Self {
            grants: HashMap::new(),
            mappings: HashMap::new(),
        }
    }
}

impl<M: Clone> Cache<M> {
    /// What the owner confirmed for `key`.
    pub(crate) fn grant(&self, key: u64) -> Option<Grant> {
        self.grants.get(&key).copied()
    }

    /// Records the owner's confirmation of `key`.
    pub(crate) fn confirm(&mut self, key: u64, grant: Grant) {
        self.grants.insert(key, grant);
    }

    /// The mapping of `handle` on device `ordinal`, if open.
    pub(crate) fn mapping(&self, ordinal: usize, handle: &IpcMemHandle) -> Option<M> {
        self.mappings.get(&(ordinal, *handle)).cloned()
    }

    /// Records a mapping just opened. Returns the one to use: an existing mapping if another
    /// thread recorded one first, `mapped` itself, or `None` when no grant names the handle
    /// any more (revoked meanwhile: the caller retires what it opened).
    pub(crate) fn add_mapping(
        &mut self,
        ordinal: usize,
        handle: IpcMemHandle,
        mapped: M,
    ) -> Option<M> {
        if !self.grants.values().any(|g| g.handle == handle) {
            return None;
        }
        Some(
            self.mappings
                .entry((ordinal, handle))
                .or_insert(mapped)
                .clone(),
        )
    }

    /// Drops `key`'s grant; returns the mappings no grant names any more (to retire, outside
    /// the cache's lock).
    pub(crate) fn revoke(&mut self, key: u64) -> Vec<M> {
        let Some(gone) = self.grants.remove(&key) else {
            return Vec::new();
        };
        if self.grants.values().any(|g| g.handle == gone.handle) {
            return Vec::new();
        }
        let keys: Vec<(usize, IpcMemHandle)> = self
            .mappings
            .keys()
            .filter(|(_, h)| *h == gone.handle)
            .copied()
            .collect();
        keys.iter()
            .filter_map(|k| self.mappings.remove(k))
            .collect()
    }

    /// Empties the cache; returns every mapping (to retire).
    pub(crate) fn clear(&mut self) -> Vec<M> {
        self.grants.clear();
        self.mappings.drain().map(|(_, m)| m).collect()
    }

    /// Open mappings.
    pub(crate) fn mappings(&self) -> usize {
        self.mappings.len()
    }

    /// Confirmed keys.
    pub(crate) fn grants(&self) -> usize {
        self.grants.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    #[derive(Debug, Clone)]
    enum Step {
        Confirm { key: u64, handle: u8 },
        Map { ordinal: usize, handle: u8 },
        Revoke { key: u64 },
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (0u64..6, 0u8..3).prop_map(|(key, handle)| Step::Confirm { key, handle }),
            (0usize..2, 0u8..3).prop_map(|(ordinal, handle)| Step::Map { ordinal, handle }),
            (0u64..6).prop_map(|key| Step::Revoke { key }),
        ]
    }

    fn h(b: u8) -> IpcMemHandle {
        IpcMemHandle::from_bytes([b; 64])
    }

    proptest! {
        /// Whatever the order of confirmations, mappings and revocations: a mapping is open
        /// only while a grant names its handle, a revocation hands back exactly the mappings
        /// it orphaned, and clearing hands back every open one.
        #[test]
        fn mappings_live_exactly_as_long_as_a_grant_names_them(
            steps in proptest::collection::vec(step(), 0..48)
        ) {
            let mut cache: Cache<(usize, u8)> = Cache::default();
            let mut grants: std::collections::HashMap<u64, u8> = Default::default();
            let mut open: HashSet<(usize, u8)> = HashSet::new();
            for s in steps {
                match s {
                    Step::Confirm { key, handle } => {
                        // As the connection does: a key is confirmed once (its handle fixed).
                        if cache.grant(key).is_some() {
                            continue;
                        }
                        cache.confirm(key, Grant { handle: h(handle), offset: 0, len: 1 });
                        grants.insert(key, handle);
                    }
                    Step::Map { ordinal, handle } => {
                        let got = cache.add_mapping(ordinal, h(handle), (ordinal, handle));
                        if grants.values().any(|&g| g == handle) {
                            prop_assert_eq!(got, Some((ordinal, handle)));
                            open.insert((ordinal, handle));
                        } else {
                            prop_assert_eq!(got, None);
                        }
                    }
                    Step::Revoke { key } => {
                        let was = grants.remove(&key);
                        let mut orphans = cache.revoke(key);
                        orphans.sort();
                        let mut want: Vec<(usize, u8)> = match was {
                            Some(handle) if !grants.values().any(|&g| g == handle) => {
                                open.iter().filter(|(_, hh)| *hh == handle).copied().collect()
                            }
                            _ => Vec::new(),
                        };
                        want.sort();
                        for w in &want {
                            open.remove(w);
                        }
                        prop_assert_eq!(orphans, want);
                    }
                }
                prop_assert_eq!(cache.mappings(), open.len());
                prop_assert_eq!(cache.grants(), grants.len());
            }
            let mut all = cache.clear();
            all.sort();
            let mut want: Vec<_> = open.into_iter().collect();
            want.sort();
            prop_assert_eq!(all, want);
        }
    }
}
