//! [`MemoryStore`]: an in-process store (threads of one process, tests).

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{check_key, Store, StoreError};

/// An in-process [`Store`]: a map behind a mutex, with a condition variable for waiting
/// readers. Clones share the map.
#[derive(Debug, Clone, Default)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// The keys present now, sorted.
    pub fn keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self.lock().keys().cloned().collect();
        keys.sort();
        keys
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Vec<u8>>> {
        // A panic while holding the lock leaves a consistent map (every update is one
        // insert or remove), so a poisoned lock is still usable.
        self.inner.map.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Store for MemoryStore {
    fn put(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        check_key(key)?;
        self.lock().insert(key.to_owned(), value.to_vec());
        self.inner.changed.notify_all();
        Ok(())
    }

    fn get(&self, key: &str, wait: Duration) -> Result<Vec<u8>, StoreError> {
        check_key(key)?;
        let deadline = Instant::now().checked_add(wait);
        let mut map = self.lock();
        loop {
            if let Some(v) = map.get(key) {
                return Ok(v.clone());
            }
            let left = deadline.map_or(Duration::from_secs(3600), |d| {
                d.saturating_duration_since(Instant::now())
            });
            if left.is_zero() {
                return Err(StoreError::Timeout {
                    store: self.describe(),
                    key: key.to_owned(),
                    waited: wait,
                });
            }
            map = self
                .inner
                .changed
                .wait_timeout(map, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    fn delete(&self, key: &str) -> Result<bool, StoreError> {
        check_key(key)?;
        Ok(self.lock().remove(key).is_some())
    }

    fn describe(&self) -> String {
        "in-memory store".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn get_waits_for_a_later_put_and_times_out_otherwise() {
        let store = MemoryStore::new();
        let writer = store.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            writer.put("a/b", b"v").unwrap();
        });
        assert_eq!(store.get("a/b", Duration::from_secs(20)).unwrap(), b"v");
        t.join().unwrap();
        let e = store.get("missing", Duration::from_millis(10)).unwrap_err();
        assert!(e.is_timeout() && e.to_string().contains("missing"), "{e}");
        assert!(store.delete("a/b").unwrap());
        assert!(!store.delete("a/b").unwrap());
        assert!(store.keys().is_empty());
    }

    #[test]
    fn unusable_keys_are_refused() {
        let store = MemoryStore::new();
        assert!(store.put("", b"").is_err());
        assert!(store.put("a\nb", b"").is_err());
        assert!(store.get("", Duration::ZERO).is_err());
    }
}
