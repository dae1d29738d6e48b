//! Plugin objects handed to callers as `void *`: comms, requests and registrations.
//!
//! Every such object is `#[repr(C)]` and starts with a `u64` tag, so a pointer coming back from
//! a caller can be checked for NULL and for the right kind before it is used. That is a
//! best-effort guard against mix-ups (a send comm passed as a receive comm, a request passed as
//! a registration, a double close while the memory has not been reused), not a validation of
//! arbitrary pointers, which no C ABI can offer. A freed object's tag is overwritten first.

use std::fmt::Display;

use tcpx_sys::ResultCode;

use crate::log::log_warn;

/// Tag of a live listen comm.
pub(crate) const LISTEN_TAG: u64 = u64::from_le_bytes(*b"txListn\0");
/// Tag of a live send comm.
pub(crate) const SEND_TAG: u64 = u64::from_le_bytes(*b"txSendC\0");
/// Tag of a live receive comm.
pub(crate) const RECV_TAG: u64 = u64::from_le_bytes(*b"txRecvC\0");
/// Tag of a send request slot.
pub(crate) const SEND_REQ_TAG: u64 = u64::from_le_bytes(*b"txSReq\0\0");
/// Tag of a receive request slot.
pub(crate) const RECV_REQ_TAG: u64 = u64::from_le_bytes(*b"txRReq\0\0");
/// Tag of a live memory registration.
pub(crate) const MR_TAG: u64 = u64::from_le_bytes(*b"txMemR\0\0");
/// Written over the tag of an object being freed.
pub(crate) const DEAD_TAG: u64 = u64::from_le_bytes(*b"txDead\0\0");

/// Reads the tag of a caller-supplied object pointer; NULL → InvalidArgument naming `what`.
/// `what` is formatted only on an error: `isend` / `irecv` check every request's
/// registration, and a name built per call was an allocation per plugin request.
///
/// # Safety
/// `ptr` is NULL or points at least 8 readable, 8-aligned bytes (any object this plugin handed
/// out satisfies that, live or recently freed by the caller's own mistake).
pub(crate) unsafe fn tag_of(ptr: *const u8, what: impl Display) -> Result<u64, ResultCode> {
    if ptr.is_null() {
        log_warn!("tcpx-socket: {what} is NULL");
        return Err(ResultCode::INVALID_ARGUMENT);
    }
    if (ptr as usize) % std::mem::align_of::<u64>() != 0 {
        log_warn!("tcpx-socket: {what} {ptr:p} is misaligned: not an object of this plugin");
        return Err(ResultCode::INVALID_ARGUMENT);
    }
    // SAFETY: non-NULL and aligned; readability is the caller's contract.
    Ok(unsafe { std::ptr::read(ptr.cast::<u64>()) })
}

/// Checks that `ptr` is a live object with tag `want`; returns it cast to `T`.
///
/// # Safety
/// As [`tag_of`]; objects tagged `want` must be of type `T`.
pub(crate) unsafe fn expect<T>(
    ptr: *mut u8,
    want: u64,
    what: impl Display + Copy,
) -> Result<*mut T, ResultCode> {
    // SAFETY: forwarded contract.
    let tag = unsafe { tag_of(ptr, what) }?;
    if tag != want {
        let kind = describe(tag);
        log_warn!("tcpx-socket: {what} {ptr:p} is not what this call expects (found: {kind})");
        return Err(ResultCode::INVALID_ARGUMENT);
    }
    Ok(ptr.cast())
}

/// A human name for a tag, for error messages.
pub(crate) fn describe(tag: u64) -> &'static str {
    match tag {
        LISTEN_TAG => "a listen comm",
        SEND_TAG => "a send comm",
        RECV_TAG => "a receive comm",
        SEND_REQ_TAG => "a send request",
        RECV_REQ_TAG => "a receive request",
        MR_TAG => "a memory registration",
        DEAD_TAG => "an object that was already closed or freed",
        _ => "unknown memory",
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::cell::Cell;
    use std::fmt;

    /// A name that counts how often it is formatted (tests of what is formatted only on
    /// demand use it).
    #[derive(Clone, Copy)]
    pub(crate) struct Counted<'a>(pub(crate) &'a Cell<u32>);

    impl Display for Counted<'_> {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            self.0.set(self.0.get() + 1);
            f.write_str("counted name")
        }
    }

    #[test]
    fn a_good_object_is_checked_without_formatting_its_name() {
        let formatted = Cell::new(0);
        let mut object = [MR_TAG, 0];
        let ptr = object.as_mut_ptr().cast::<u8>();
        // SAFETY: `object` is a live, aligned array starting with a tag.
        let found = unsafe { expect::<[u64; 2]>(ptr, MR_TAG, Counted(&formatted)) };
        assert!(found.is_ok());
        assert_eq!(
            formatted.get(),
            0,
            "the name was formatted on the good path"
        );
        // SAFETY: as above.
        let wrong = unsafe { expect::<[u64; 2]>(ptr, SEND_TAG, Counted(&formatted)) };
        assert_eq!(wrong.err(), Some(ResultCode::INVALID_ARGUMENT));
        assert!(formatted.get() > 0, "the refusal names the object");
        // SAFETY: NULL is refused before any read.
        let null = unsafe { tag_of(std::ptr::null(), "a NULL handle") };
        assert_eq!(null.err(), Some(ResultCode::INVALID_ARGUMENT));
    }
}
