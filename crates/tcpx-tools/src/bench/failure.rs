//! How a `tcpx-bench` role fails: [`Failure`], an error with the exit code scripts read
//! ([`exit`]). Below every role and the control messages, so that they all share it.

/// Exit codes scripts can rely on.
pub mod exit {
    /// Success.
    pub const OK: i32 = 0;
    /// Any other failure.
    pub const ERROR: i32 = 1;
    /// Bad command line.
    pub const USAGE: i32 = 2;
    /// The peer could not be reached or went away.
    pub const PEER: i32 = 3;
    /// Received bytes differed from what was sent (`--verify`).
    pub const VERIFY: i32 = 4;
}

/// A failure with the exit code it maps to.
#[derive(Debug)]
pub struct Failure {
    /// Process exit code.
    pub code: i32,
    /// What went wrong.
    pub error: anyhow::Error,
}

impl<E: Into<anyhow::Error>> From<E> for Failure {
    fn from(e: E) -> Self {
        Self {
            code: exit::ERROR,
            error: e.into(),
        }
    }
}

/// A failure of the peer or of the way to it (exit code 3).
pub fn peer_failure(e: impl Into<anyhow::Error>) -> Failure {
    Failure {
        code: exit::PEER,
        error: e.into(),
    }
}
