//! One error type for everything the safe layer does: it names the plugin API that failed, the
//! code the plugin returned (when there is one) and the context (device, comm, sizes, peer).

use std::time::Duration;

use tcpx_sys::{AbiError, LoadError, ResultCode};

/// What went wrong, without the where (that is [`Error::api`] and [`Error::context`]).
#[derive(Debug, thiserror::Error)]
pub enum ErrorKind {
    /// The plugin returned a code other than success.
    #[error("plugin returned {0}")]
    Plugin(ResultCode),
    /// The call cannot be expressed by the plugin's table (NULL entry, v7 int size, v6 table).
    #[error(transparent)]
    Abi(#[from] AbiError),
    /// The plugin library could not be loaded.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// A wait ran past its deadline.
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    /// The caller passed something the layer refuses before reaching the plugin.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The memory is in use by operations in flight (or by CPU access) and cannot be used now.
    #[error("memory busy: {0}")]
    Busy(String),
    /// The plugin answered in a way the ABI does not allow (e.g. success with a NULL comm after
    /// claiming completion, a negative size).
    #[error("plugin broke the ABI contract: {0}")]
    Contract(String),
    /// A CUDA driver or NVRTC call failed, or no usable CUDA driver is present.
    #[error(transparent)]
    Cuda(#[from] CudaError),
}

/// Why a CUDA operation failed (the `kind` of an [`Error`] from [`crate::cuda`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    /// No usable CUDA driver in this process; says why (library missing, `cuInit` failed, no
    /// devices, disabled with `TCPX_CUDA_DISABLE`).
    #[error("no usable CUDA driver: {0}")]
    NoDriver(String),
    /// A driver call returned an error code.
    #[error("{name} ({code})")]
    Driver {
        /// The `CUresult` value.
        code: i32,
        /// Its name (`CUDA_ERROR_OUT_OF_MEMORY`, …).
        name: String,
    },
    /// The unpack kernel could not be built or loaded (NVRTC missing or failing, bad PTX).
    #[error("unpack kernel: {0}")]
    Kernel(String),
}

impl CudaError {
    /// The driver's `CUresult`, when a driver call failed.
    pub fn code(&self) -> Option<i32> {
        match self {
            CudaError::Driver { code, .. } => Some(*code),
            _ => None,
        }
    }
}

/// An error from the safe layer: `"<api>: <what> (<context>)"`.
#[derive(Debug, thiserror::Error)]
#[error("{api}: {kind}{}", fmt_context(.context))]
pub struct Error {
    api: &'static str,
    kind: ErrorKind,
    context: String,
}

fn fmt_context(context: &str) -> String {
    if context.is_empty() {
        String::new()
    } else {
        format!(" ({context})")
    }
}

impl Error {
    /// Builds an error for `api` with a context string.
    pub fn new(api: &'static str, kind: ErrorKind, context: impl Into<String>) -> Self {
        Self {
            api,
            kind,
            context: context.into(),
        }
    }

    /// The API that failed (`"isend"`, `"connect"`, `"dlopen"`, …).
    pub fn api(&self) -> &'static str {
        self.api
    }

    /// What went wrong.
    pub fn kind(&self) -> &ErrorKind {
        &self.kind
    }

    /// Where it went wrong (device, comm, sizes, peer).
    pub fn context(&self) -> &str {
        &self.context
    }

    /// The plugin's result code, when the plugin returned one.
    pub fn code(&self) -> Option<ResultCode> {
        match self.kind {
            ErrorKind::Plugin(code) => Some(code),
            _ => None,
        }
    }

    /// True when the error is a wait that ran out of time.
    pub fn is_timeout(&self) -> bool {
        matches!(self.kind, ErrorKind::Timeout(_))
    }

    pub(crate) fn invalid(api: &'static str, what: impl Into<String>) -> Self {
        Self::new(api, ErrorKind::InvalidArgument(what.into()), String::new())
    }
}

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
