//! Transfers: test, wait with a timeout, release.

use tcpx_runtime::Transfer;

use crate::convert::{millis, write_out};
use crate::error::{guard, CapiError, CapiResult};
use crate::handles::Table;
use crate::tcpx_status::{self, *};
use crate::tcpx_transfer;

pub(crate) static TRANSFERS: Table<Transfer> = Table::new(4, "tcpx_transfer");

/// Hands a submitted transfer to C.
pub(crate) fn issue(transfer: Transfer) -> tcpx_transfer {
    tcpx_transfer {
        id: TRANSFERS.insert(std::sync::Arc::new(transfer)),
    }
}

/// Turns a finished (or not) outcome into a status, writing the bytes moved on success.
fn report(outcome: Option<tcpx_runtime::Result<u64>>, bytes: *mut u64) -> CapiResult<tcpx_status> {
    match outcome {
        None | Some(Err(tcpx_runtime::Error::WaitTimedOut(_))) => Ok(TCPX_PENDING),
        Some(Ok(n)) => {
            if !bytes.is_null() {
                // SAFETY: non-null (checked); writable (the C caller's promise).
                unsafe { write_out(bytes, n) };
            }
            Ok(TCPX_OK)
        }
        Some(Err(e)) => Err(CapiError::from(e)),
    }
}

/// Checks a transfer without blocking: `TCPX_OK` once it completed (`*bytes`, if not NULL,
/// gets the bytes moved), `TCPX_PENDING` while it runs, or the status of the failure that
/// ended it (`tcpx_last_error()` names peer and channel). The handle stays valid until
/// `tcpx_transfer_release`. Thread safety: any thread, also concurrently with waits on it.
///
/// # Safety
/// `bytes` is NULL or points to a writable `uint64_t`.
#[no_mangle]
pub unsafe extern "C" fn tcpx_transfer_test(
    transfer: tcpx_transfer,
    bytes: *mut u64,
) -> tcpx_status {
    guard("tcpx_transfer_test", || {
        let t = TRANSFERS.get(transfer.id)?;
        report(t.poll(), bytes)
    })
}

/// Blocks until the transfer finishes or `timeout_ms` passes: `TCPX_OK` (and `*bytes`),
/// the failure's status, or `TCPX_PENDING` when the time ran out (the transfer goes on; its
/// own limit is the endpoint's configured timeout, after which it fails with
/// `TCPX_ERR_TIMEOUT`). Thread safety: any thread; several threads may wait on one transfer.
///
/// # Safety
/// `bytes` is NULL or points to a writable `uint64_t`.
#[no_mangle]
pub unsafe extern "C" fn tcpx_transfer_wait(
    transfer: tcpx_transfer,
    timeout_ms: u32,
    bytes: *mut u64,
) -> tcpx_status {
    guard("tcpx_transfer_wait", || {
        let t = TRANSFERS.get(transfer.id)?;
        report(Some(t.wait(millis(timeout_ms))), bytes)
    })
}

/// Releases the handle. It does not cancel the transfer: an unfinished one goes on, and its
/// memory must stay valid until it finished or its connection was destroyed
/// (`tcpx_region_destroy` refuses until then). Thread safety: any thread; a wait on it in
/// another thread returns normally.
#[no_mangle]
pub extern "C" fn tcpx_transfer_release(transfer: tcpx_transfer) -> tcpx_status {
    guard("tcpx_transfer_release", || {
        TRANSFERS.remove(transfer.id)?;
        Ok(TCPX_OK)
    })
}
