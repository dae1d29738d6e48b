//! The single path every plugin call takes: run it, turn `Err(AbiError)` or a non-success
//! `ResultCode` into an [`Error`] naming the API and the context. The context is built lazily so
//! the hot path pays nothing for it on success.

use tcpx_sys::{AbiError, ResultCode};

use crate::error::{Error, ErrorKind, Result};

/// Runs one plugin call and checks its code. `context` is only evaluated on failure.
#[inline]
pub(crate) fn call<C: FnOnce() -> String>(
    api: &'static str,
    context: C,
    f: impl FnOnce() -> Result<ResultCode, AbiError>,
) -> Result<()> {
    match f() {
        Ok(code) if code.is_success() => Ok(()),
        Ok(code) => Err(Error::new(api, ErrorKind::Plugin(code), context())),
        Err(abi) => Err(Error::new(api, ErrorKind::Abi(abi), context())),
    }
}
