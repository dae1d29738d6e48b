//! Conversions at the boundary: checked pointers, C strings, fixed text fields, lengths.

use std::ffi::{c_char, CStr};

use crate::error::{CapiError, CapiResult};
use crate::tcpx_status::TCPX_ERR_BUFFER_TOO_SMALL;

/// Fails with `TCPX_ERR_NULL_POINTER` naming `what` when `ptr` is NULL.
pub(crate) fn non_null<T>(ptr: *const T, what: &str) -> CapiResult<()> {
    if ptr.is_null() {
        Err(CapiError::null(what))
    } else {
        Ok(())
    }
}

/// Writes `value` through an output pointer the caller checked with [`non_null`].
///
/// # Safety
/// `out` is non-null, aligned and valid for a write of `T` (the C caller's promise).
pub(crate) unsafe fn write_out<T>(out: *mut T, value: T) {
    // SAFETY: the caller checked `out` for null; alignment and validity are the C contract.
    unsafe { out.write(value) }
}

/// A UTF-8 string from a NUL-terminated C string.
///
/// # Safety
/// `ptr` is non-null and points to a NUL-terminated string.
pub(crate) unsafe fn c_str<'a>(ptr: *const c_char, what: &str) -> CapiResult<&'a str> {
    non_null(ptr, what)?;
    // SAFETY: non-null (checked) and NUL-terminated (the caller's promise).
    let text = unsafe { CStr::from_ptr(ptr) };
    text.to_str()
        .map_err(|_| CapiError::invalid(format!("{what} is not valid UTF-8")))
}

/// `[ptr, ptr + len)` as a slice; NULL is accepted only when `len` is 0.
///
/// # Safety
/// A non-null `ptr` points to `len` readable bytes that stay unchanged during the call.
pub(crate) unsafe fn bytes<'a>(ptr: *const u8, len: usize, what: &str) -> CapiResult<&'a [u8]> {
    if len == 0 {
        return Ok(&[]);
    }
    non_null(ptr, what)?;
    // SAFETY: non-null (checked), `len` readable bytes (the caller's promise).
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
}

/// `[ptr, ptr + n)` as a slice of C structs; NULL is accepted only when `n` is 0.
///
/// # Safety
/// A non-null `ptr` points to `n` initialized values of `T`.
pub(crate) unsafe fn array<'a, T>(ptr: *const T, n: usize, what: &str) -> CapiResult<&'a [T]> {
    if n == 0 {
        return Ok(&[]);
    }
    non_null(ptr, what)?;
    // SAFETY: non-null (checked), `n` initialized values (the caller's promise).
    Ok(unsafe { std::slice::from_raw_parts(ptr, n) })
}

/// Copies `text` into a fixed C text field, NUL-terminated, cut at a character boundary when
/// it does not fit.
pub(crate) fn fill_text<const N: usize>(field: &mut [c_char; N], text: &str) {
    let mut end = text.len().min(N - 1);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    for (dst, &src) in field.iter_mut().zip(&text.as_bytes()[..end]) {
        *dst = src as c_char;
    }
    field[end..].fill(0);
}

/// A C `uint64_t` length or offset as `usize`.
pub(crate) fn to_usize(value: u64, what: &str) -> CapiResult<usize> {
    usize::try_from(value).map_err(|_| CapiError::invalid(format!("{what} {value} is too large")))
}

/// A timeout in milliseconds from C.
pub(crate) fn millis(ms: u32) -> std::time::Duration {
    std::time::Duration::from_millis(u64::from(ms))
}

/// Copies `blob` into `buf` with the size protocol of every variable-size output of this API
/// (`tcpx_endpoint_metadata` and its kin): `*len` is the capacity on entry and the blob's size
/// on return; too small (or NULL) copies nothing and fails with
/// `TCPX_ERR_BUFFER_TOO_SMALL`.
///
/// # Safety
/// `len` is non-null (checked by the caller) and points to a readable and writable `size_t`;
/// `buf` is NULL or points to `*len` writable bytes that do not overlap `blob`.
pub(crate) unsafe fn copy_out(
    blob: &[u8],
    buf: *mut u8,
    len: *mut usize,
    what: &str,
) -> CapiResult<()> {
    // SAFETY: non-null (the caller checked); readable and writable (the C caller's promise).
    let capacity = unsafe { len.read() };
    // SAFETY: non-null (the caller checked) and writable (the C caller's promise); the read
    // ended, so this is the only access.
    unsafe { write_out(len, blob.len()) };
    if buf.is_null() || capacity < blob.len() {
        return Err(CapiError::new(
            TCPX_ERR_BUFFER_TOO_SMALL,
            format!(
                "the {what} is {} bytes and the buffer holds {capacity}{}",
                blob.len(),
                if buf.is_null() { " (buf is NULL)" } else { "" }
            ),
        ));
    }
    // SAFETY: `buf` has room for `capacity` >= blob.len() bytes (the caller's promise) and is
    // not `blob` (ours).
    unsafe { std::ptr::copy_nonoverlapping(blob.as_ptr(), buf, blob.len()) };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_text_terminates_and_cuts_at_a_character_boundary() {
        let mut field = [1 as c_char; 6];
        fill_text(&mut field, "ab");
        assert_eq!(&field[..3], &[b'a' as c_char, b'b' as c_char, 0]);
        // "aé…": 'é' takes bytes 1..3 and '…' 3..6; 5 bytes fit, so the cut lands before '…'.
        fill_text(&mut field, "aé…");
        // SAFETY: fill_text always NUL-terminates inside the field.
        let text = unsafe { CStr::from_ptr(field.as_ptr()) };
        assert_eq!(text.to_str().unwrap(), "aé");
    }
}
