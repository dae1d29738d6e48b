//! Result codes as an integer newtype: a plugin may return any `int`, so the code is never
//! transmuted into a closed enum; known values get names.

use crate::bindings as b;

/// A code returned by a plugin call (`ncclResult_t`). Unknown values are kept as they are.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct ResultCode(pub b::ncclResult_t);

impl ResultCode {
    /// `ncclSuccess`.
    pub const SUCCESS: Self = Self(b::NCCL_SUCCESS);
    /// `ncclUnhandledCudaError`.
    pub const UNHANDLED_CUDA_ERROR: Self = Self(b::NCCL_UNHANDLED_CUDA_ERROR);
    /// `ncclSystemError`.
    pub const SYSTEM_ERROR: Self = Self(b::NCCL_SYSTEM_ERROR);
    /// `ncclInternalError`.
    pub const INTERNAL_ERROR: Self = Self(b::NCCL_INTERNAL_ERROR);
    /// `ncclInvalidArgument`.
    pub const INVALID_ARGUMENT: Self = Self(b::NCCL_INVALID_ARGUMENT);
    /// `ncclInvalidUsage`.
    pub const INVALID_USAGE: Self = Self(b::NCCL_INVALID_USAGE);
    /// `ncclRemoteError`.
    pub const REMOTE_ERROR: Self = Self(b::NCCL_REMOTE_ERROR);
    /// `ncclInProgress`.
    pub const IN_PROGRESS: Self = Self(b::NCCL_IN_PROGRESS);

    /// True for `ncclSuccess`.
    pub fn is_success(self) -> bool {
        self == Self::SUCCESS
    }

    /// NCCL's name for a known code, `None` for anything else.
    pub fn name(self) -> Option<&'static str> {
        Some(match self.0 {
            b::NCCL_SUCCESS => "ncclSuccess",
            b::NCCL_UNHANDLED_CUDA_ERROR => "ncclUnhandledCudaError",
            b::NCCL_SYSTEM_ERROR => "ncclSystemError",
            b::NCCL_INTERNAL_ERROR => "ncclInternalError",
            b::NCCL_INVALID_ARGUMENT => "ncclInvalidArgument",
            b::NCCL_INVALID_USAGE => "ncclInvalidUsage",
            b::NCCL_REMOTE_ERROR => "ncclRemoteError",
            b::NCCL_IN_PROGRESS => "ncclInProgress",
            _ => return None,
        })
    }
}

impl std::fmt::Display for ResultCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.name() {
            Some(name) => write!(f, "{name} ({})", self.0),
            None => write!(f, "unknown result code {}", self.0),
        }
    }
}

impl std::fmt::Debug for ResultCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_codes_are_kept_not_transmuted() {
        assert_eq!(ResultCode(42).name(), None);
        assert_eq!(ResultCode(-1).to_string(), "unknown result code -1");
        assert_eq!(ResultCode::REMOTE_ERROR.to_string(), "ncclRemoteError (6)");
    }
}
