//! Rendezvous by name through a store (etcd): publish an endpoint under a name, remove it, and
//! connect to the endpoint published under a name, instead of passing metadata blobs around.

use std::ffi::c_char;

use tcpx_runtime::rendezvous::{self, StoreError};

use crate::convert::{c_str, millis, non_null, write_out};
use crate::error::{guard, CapiError, CapiResult};
use crate::objects::{self, adopt_connection, Publication};
use crate::tcpx_status::{self, *};
use crate::{tcpx_connection, tcpx_endpoint};

/// A store error as a C error: a bad URL or name is the caller's argument, a name that never
/// appeared a timeout, anything else an unreachable store.
fn store_error(e: StoreError) -> CapiError {
    let status = match &e {
        StoreError::Url { .. } | StoreError::Key { .. } => TCPX_ERR_INVALID_ARGUMENT,
        StoreError::Timeout { .. } => TCPX_ERR_TIMEOUT,
        StoreError::Value { .. } => TCPX_ERR_PROTOCOL,
        StoreError::Backend { .. } => TCPX_ERR_CONNECT,
    };
    CapiError::new(status, e.to_string())
}

/// The store URL and the name, as text.
///
/// # Safety
/// Both are NULL or NUL-terminated strings.
unsafe fn url_and_name<'a>(
    store_url: *const c_char,
    name: *const c_char,
) -> CapiResult<(&'a str, &'a str)> {
    // SAFETY: NUL-terminated when non-null (the caller's promise; null is checked).
    let url = unsafe { c_str(store_url, "store_url") }?;
    // SAFETY: NUL-terminated when non-null (the caller's promise; null is checked).
    let name = unsafe { c_str(name, "name") }?;
    // The runtime refuses these too, but only as a store failure; here they are the caller's
    // argument (the same rules as the runtime's).
    let what = if name.is_empty() {
        "is empty"
    } else if name.chars().any(char::is_control) {
        "contains a control character"
    } else if name.len() > 1024 {
        "is longer than 1024 bytes"
    } else {
        return Ok((url, name));
    };
    Err(CapiError::invalid(format!("name {name:?} {what}")))
}

/// Publishes the endpoint's metadata (secret included) under `name` in the store
/// `store_url` (`"etcd://host:port[,host:port]/job[?ttl=SECONDS]"`), so that peers can
/// `tcpx_endpoint_connect_by_name` to it. The key is tied to a lease the library keeps alive;
/// it disappears on `tcpx_endpoint_unpublish`, when the endpoint is destroyed, or at most the
/// lease's TTL (10 s unless `?ttl=` says otherwise) after this process dies. Publishing a name
/// again replaces its value. `TCPX_ERR_INVALID_ARGUMENT` for a malformed URL or name (or a
/// library built without etcd support), `TCPX_ERR_CONNECT` when the store cannot be reached.
/// Thread safety: any thread.
///
/// # Safety
/// `store_url` and `name` are NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn tcpx_endpoint_publish(
    endpoint: tcpx_endpoint,
    store_url: *const c_char,
    name: *const c_char,
) -> tcpx_status {
    guard("tcpx_endpoint_publish", || {
        // SAFETY: the caller's promise on both strings.
        let (url, name) = unsafe { url_and_name(store_url, name) }?;
        let obj = objects::endpoint(endpoint)?;
        let mut published = obj.published.lock().unwrap_or_else(|p| p.into_inner());
        // One store (one lease) per URL: a name published again goes to the same store.
        let at = match published.iter().position(|p| p.url == url) {
            Some(i) => i,
            None => {
                let store = rendezvous::open(url).map_err(store_error)?;
                published.push(Publication {
                    url: url.to_owned(),
                    names: Vec::new(),
                    store,
                });
                published.len() - 1
            }
        };
        let publication = &mut published[at];
        let done = obj.endpoint.publish(publication.store.as_ref(), name);
        if let Err(e) = done {
            if publication.names.is_empty() {
                published.remove(at);
            }
            return Err(e.into());
        }
        if !publication.names.iter().any(|n| n == name) {
            publication.names.push(name.to_owned());
        }
        Ok(TCPX_OK)
    })
}

/// Removes `name`, published by this endpoint with `tcpx_endpoint_publish` in `store_url`,
/// from the store at once. `TCPX_ERR_INVALID_ARGUMENT` when this endpoint did not publish
/// that name in that store. Thread safety: any thread.
///
/// # Safety
/// `store_url` and `name` are NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn tcpx_endpoint_unpublish(
    endpoint: tcpx_endpoint,
    store_url: *const c_char,
    name: *const c_char,
) -> tcpx_status {
    guard("tcpx_endpoint_unpublish", || {
        // SAFETY: the caller's promise on both strings.
        let (url, name) = unsafe { url_and_name(store_url, name) }?;
        let obj = objects::endpoint(endpoint)?;
        let mut published = obj.published.lock().unwrap_or_else(|p| p.into_inner());
        let found = published.iter().position(|p| p.url == url).and_then(|i| {
            let at = published[i].names.iter().position(|n| n == name)?;
            Some((i, at))
        });
        let Some((i, at)) = found else {
            return Err(CapiError::invalid(format!(
                "this endpoint did not publish {name:?} in {url:?}"
            )));
        };
        let publication = &mut published[i];
        publication.names.remove(at);
        let deleted = obj
            .endpoint
            .unpublish(publication.store.as_ref(), name)
            .map(|_| ());
        if publication.names.is_empty() {
            // Its last name: dropping the store revokes its lease (the key goes with it even
            // if the delete above failed).
            published.remove(i);
        }
        deleted?;
        Ok(TCPX_OK)
    })
}

/// Waits at most `timeout_ms` for `name` to appear in the store `store_url` (see
/// `tcpx_endpoint_publish`), then connects to the endpoint published there, presenting its
/// secret (each connection set-up within the configured timeout). A stale name of a dead
/// endpoint is read again until a restarted one replaces it or the time runs out.
/// `*connection` is the new handle. `TCPX_ERR_TIMEOUT` when the name did not appear in time,
/// `TCPX_ERR_CONNECT` when the store or the endpoint could not be reached.
/// Thread safety: any thread; several connects may run at once on one endpoint.
///
/// # Safety
/// `store_url` and `name` are NUL-terminated strings; `connection` points to writable memory
/// for a handle.
#[no_mangle]
pub unsafe extern "C" fn tcpx_endpoint_connect_by_name(
    endpoint: tcpx_endpoint,
    store_url: *const c_char,
    name: *const c_char,
    timeout_ms: u32,
    connection: *mut tcpx_connection,
) -> tcpx_status {
    guard("tcpx_endpoint_connect_by_name", || {
        non_null(connection, "connection (output)")?;
        // SAFETY: the caller's promise on both strings.
        let (url, name) = unsafe { url_and_name(store_url, name) }?;
        let obj = objects::endpoint(endpoint)?;
        let store = rendezvous::open(url).map_err(store_error)?;
        let conn = obj
            .endpoint
            .connect_by_name(store.as_ref(), name, millis(timeout_ms))?;
        drop(store);
        let handle = adopt_connection(endpoint.id, conn)?;
        // SAFETY: non-null (checked); writable (the caller's promise).
        unsafe { write_out(connection, handle) };
        Ok(TCPX_OK)
    })
}
