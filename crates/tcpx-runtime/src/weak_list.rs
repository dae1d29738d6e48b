//! [`WeakList`]: the live members of a set that must not keep them alive — an endpoint's
//! connections (their one-sided carriers, their same-host links), which go when the
//! application drops them, yet must each be reached by what the endpoint does later
//! (advertising a region, revoking a descriptor).

use std::sync::{Arc, Mutex, Weak};

/// Members held weakly; dead ones are pruned as new ones come.
pub(crate) struct WeakList<T> {
    members: Mutex<Vec<Weak<T>>>,
}

impl<T> Default for WeakList<T> {
    fn default() -> Self {
        Self {
            members: Mutex::new(Vec::new()),
        }
    }
}

impl<T> WeakList<T> {
    /// Adds `member` (and forgets members already dropped).
    pub(crate) fn add(&self, member: &Arc<T>) {
        let mut members = self.members.lock().unwrap_or_else(|p| p.into_inner());
        members.retain(|w| w.strong_count() > 0);
        members.push(Arc::downgrade(member));
    }

    /// The members still alive, held for as long as the caller keeps the list it gets (the
    /// lock is not held meanwhile).
    pub(crate) fn live(&self) -> Vec<Arc<T>> {
        let members = self.members.lock().unwrap_or_else(|p| p.into_inner());
        members.iter().filter_map(Weak::upgrade).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropped_members_leave_and_are_pruned() {
        let list = WeakList::default();
        let (a, b) = (Arc::new(1), Arc::new(2));
        list.add(&a);
        list.add(&b);
        assert_eq!(list.live().len(), 2);
        drop(a);
        assert_eq!(list.live().iter().map(|m| **m).collect::<Vec<_>>(), [2]);
        let c = Arc::new(3);
        list.add(&c);
        let held = list.members.lock().unwrap().len();
        assert_eq!(held, 2, "the dropped member was pruned when one came");
    }
}
