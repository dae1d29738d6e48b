//! Handle tables: what the C handles are ids into.
//!
//! An id packs a kind tag (8 bits), a generation (24 bits) and a slot index + 1 (32 bits).
//! Destroying an object bumps its slot's generation, so the old id no longer matches and is
//! reported as stale instead of reaching another object or freed memory; freed slots are
//! reused oldest-first, so an id only aliases after its slot was reused 2^24 times. The zero
//! id is the null handle. A lookup clones an `Arc`, so an object destroyed by one thread while
//! another is inside a call on it lives until that call returns.

use std::collections::VecDeque;
use std::sync::{Arc, RwLock};

use crate::error::{CapiError, CapiResult};
use crate::tcpx_status::*;

const GENERATION_MASK: u32 = (1 << 24) - 1;

struct Slot<T> {
    generation: u32,
    value: Option<Arc<T>>,
}

struct Slots<T> {
    slots: Vec<Slot<T>>,
    free: VecDeque<u32>,
}

/// A table of one kind of object.
pub(crate) struct Table<T> {
    tag: u8,
    /// The C type name, for messages (`tcpx_region`).
    name: &'static str,
    inner: RwLock<Slots<T>>,
}

/// The tags of every table, to name the kind of a handle passed where another was expected.
const KIND_NAMES: [&str; 6] = [
    "",
    "tcpx_endpoint",
    "tcpx_connection",
    "tcpx_region",
    "tcpx_transfer",
    "tcpx_local_connection",
];

impl<T> Table<T> {
    pub(crate) const fn new(tag: u8, name: &'static str) -> Self {
        Self {
            tag,
            name,
            inner: RwLock::new(Slots {
                slots: Vec::new(),
                free: VecDeque::new(),
            }),
        }
    }

    fn split(&self, id: u64) -> CapiResult<(usize, u32)> {
        if id == 0 {
            return Err(CapiError::new(
                TCPX_ERR_NULL_POINTER,
                format!("the {} handle is null", self.name),
            ));
        }
        let tag = (id >> 56) as u8;
        if tag != self.tag {
            let other = KIND_NAMES.get(usize::from(tag)).copied().unwrap_or("");
            let what = if other.is_empty() {
                "not a handle this library made".to_string()
            } else {
                format!("a {other}")
            };
            return Err(CapiError::new(
                TCPX_ERR_STALE_HANDLE,
                format!("handle {id:#x} passed as a {} is {what}", self.name),
            ));
        }
        let generation = ((id >> 32) as u32) & GENERATION_MASK;
        let index = (id as u32) as usize;
        Ok((index.wrapping_sub(1), generation))
    }

    fn stale(&self, id: u64) -> CapiError {
        CapiError::new(
            TCPX_ERR_STALE_HANDLE,
            format!(
                "{} handle {id:#x} is stale: it was destroyed (or released) already",
                self.name
            ),
        )
    }

    /// Stores `value`, returning its id.
    pub(crate) fn insert(&self, value: Arc<T>) -> u64 {
        let mut t = self.inner.write().unwrap_or_else(|p| p.into_inner());
        let index = match t.free.pop_front() {
            Some(i) => i as usize,
            None => {
                t.slots.push(Slot {
                    generation: 1,
                    value: None,
                });
                t.slots.len() - 1
            }
        };
        let slot = &mut t.slots[index];
        slot.value = Some(value);
        (u64::from(self.tag) << 56) | (u64::from(slot.generation) << 32) | (index as u64 + 1)
    }

    /// The object `id` names, or why not.
    pub(crate) fn get(&self, id: u64) -> CapiResult<Arc<T>> {
        let (index, generation) = self.split(id)?;
        let t = self.inner.read().unwrap_or_else(|p| p.into_inner());
        match t.slots.get(index) {
            Some(Slot {
                generation: g,
                value: Some(v),
            }) if *g == generation => Ok(v.clone()),
            _ => Err(self.stale(id)),
        }
    }

    /// Takes the object out: `id` and every copy of it are stale from now on.
    pub(crate) fn remove(&self, id: u64) -> CapiResult<Arc<T>> {
        let (index, generation) = self.split(id)?;
        let mut t = self.inner.write().unwrap_or_else(|p| p.into_inner());
        let taken = match t.slots.get_mut(index) {
            Some(slot) if slot.generation == generation && slot.value.is_some() => {
                slot.generation = bump(slot.generation);
                slot.value.take()
            }
            _ => None,
        };
        match taken {
            Some(v) => {
                t.free.push_back(index as u32);
                Ok(v)
            }
            None => Err(self.stale(id)),
        }
    }

    /// Takes out every object `pred` selects (an endpoint's connections and regions when the
    /// endpoint is destroyed).
    pub(crate) fn remove_where(&self, pred: impl Fn(&T) -> bool) -> Vec<Arc<T>> {
        let mut t = self.inner.write().unwrap_or_else(|p| p.into_inner());
        let mut taken = Vec::new();
        let mut freed = Vec::new();
        for (index, slot) in t.slots.iter_mut().enumerate() {
            if slot.value.as_deref().is_some_and(&pred) {
                slot.generation = bump(slot.generation);
                taken.extend(slot.value.take());
                freed.push(index as u32);
            }
        }
        t.free.extend(freed);
        taken
    }
}

fn bump(generation: u32) -> u32 {
    match generation.wrapping_add(1) & GENERATION_MASK {
        0 => 1,
        g => g,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn destroyed_ids_are_stale_even_after_their_slot_is_reused() {
        let table: Table<u32> = Table::new(3, "tcpx_region");
        let a = table.insert(Arc::new(1));
        assert_eq!(*table.get(a).unwrap(), 1);
        table.remove(a).unwrap();
        assert_eq!(table.get(a).unwrap_err().status, TCPX_ERR_STALE_HANDLE);
        assert_eq!(table.remove(a).unwrap_err().status, TCPX_ERR_STALE_HANDLE);
        let b = table.insert(Arc::new(2));
        assert_ne!(a, b);
        assert_eq!(table.get(a).unwrap_err().status, TCPX_ERR_STALE_HANDLE);
        assert_eq!(*table.get(b).unwrap(), 2);
    }

    #[test]
    fn null_foreign_and_wrong_kind_ids_are_refused() {
        let regions: Table<u32> = Table::new(3, "tcpx_region");
        let transfers: Table<u32> = Table::new(4, "tcpx_transfer");
        assert_eq!(regions.get(0).unwrap_err().status, TCPX_ERR_NULL_POINTER);
        let t = transfers.insert(Arc::new(5));
        let e = regions.get(t).unwrap_err();
        assert_eq!(e.status, TCPX_ERR_STALE_HANDLE);
        assert!(e.message.contains("tcpx_transfer"), "{}", e.message);
        assert_eq!(
            regions.get(12345).unwrap_err().status,
            TCPX_ERR_STALE_HANDLE
        );
    }

    #[test]
    fn remove_where_takes_only_the_selected_objects() {
        let table: Table<u32> = Table::new(2, "tcpx_connection");
        let ids: Vec<u64> = (0..6).map(|i| table.insert(Arc::new(i))).collect();
        let taken = table.remove_where(|v| v % 2 == 0);
        assert_eq!(taken.len(), 3);
        for (i, id) in ids.iter().enumerate() {
            assert_eq!(table.get(*id).is_ok(), i % 2 == 1);
        }
    }
}
