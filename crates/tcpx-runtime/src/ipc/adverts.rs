//! The owner's side: ranges an endpoint advertised for same-host access, and the check a
//! peer's `Validate` goes through before its first use of a descriptor.

use std::collections::HashMap;
use std::sync::Mutex;

use tcpx::cuda::IpcMemHandle;

use crate::registry::Region;

/// One advertised range. A revoked entry keeps its key (so a peer naming it is told
/// *revoked*, not *unknown*) but no longer holds the region.
struct Advert {
    region: Option<Region>,
    handle: IpcMemHandle,
    offset: u64,
    len: u64,
}

/// The ranges one endpoint advertised, by key.
#[derive(Default)]
pub(crate) struct IpcAdverts {
    adverts: Mutex<HashMap<u64, Advert>>,
}

impl IpcAdverts {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Advert>> {
        self.adverts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records an advertised range; `region` stays alive until the key is revoked.
    pub(crate) fn insert(
        &self,
        key: u64,
        region: Region,
        handle: IpcMemHandle,
        offset: u64,
        len: u64,
    ) {
        self.lock().insert(
            key,
            Advert {
                region: Some(region),
                handle,
                offset,
                len,
            },
        );
    }

    /// Revokes `key`; whether it was advertised and not revoked yet.
    pub(crate) fn revoke(&self, key: u64) -> bool {
        match self.lock().get_mut(&key) {
            Some(a) if a.region.is_some() => {
                a.region = None;
                true
            }
            _ => false,
        }
    }

    /// Checks a peer's claim; the refusal's text when it does not hold.
    pub(crate) fn check(
        &self,
        key: u64,
        handle: &IpcMemHandle,
        offset: u64,
        len: u64,
    ) -> Result<(), String> {
        let adverts = self.lock();
        match adverts.get(&key) {
            None => Err("unknown key: no range was advertised with it".into()),
            Some(Advert { region: None, .. }) => Err("the descriptor was revoked".into()),
            Some(a) if a.handle != *handle => {
                Err("the descriptor's handle is not the advertised allocation's".into())
            }
            Some(a) if a.offset != offset || a.len != len => Err(format!(
                "the descriptor names {offset}+{len}, the advertised range is {}+{}",
                a.offset, a.len
            )),
            Some(_) => Ok(()),
        }
    }

    /// Keys currently advertised (not revoked).
    pub(crate) fn live(&self) -> usize {
        self.lock().values().filter(|a| a.region.is_some()).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_name_what_is_wrong() {
        let book = IpcAdverts::default();
        let region = Region::new(tcpx::SharedMemory::host(4096).unwrap());
        let h = IpcMemHandle::from_bytes([1; 64]);
        book.insert(5, region, h, 64, 128);
        assert_eq!(book.live(), 1);
        assert!(book.check(5, &h, 64, 128).is_ok());
        assert!(book
            .check(6, &h, 64, 128)
            .unwrap_err()
            .contains("unknown key"));
        let other = IpcMemHandle::from_bytes([2; 64]);
        assert!(book
            .check(5, &other, 64, 128)
            .unwrap_err()
            .contains("handle"));
        assert!(book.check(5, &h, 0, 128).unwrap_err().contains("64+128"));
        assert!(book.revoke(5));
        assert!(!book.revoke(5));
        assert!(book.check(5, &h, 64, 128).unwrap_err().contains("revoked"));
        assert_eq!(book.live(), 0);
    }
}
