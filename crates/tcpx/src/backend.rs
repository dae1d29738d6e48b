//! Choosing the plugin: an explicit path, else a TCPX install, else the built-in socket plugin.
//! The choice and its reason are logged and reported (tcpx-info shows them).

use std::path::{Path, PathBuf};

use crate::error::Result;
use crate::net::Net;

/// Where GPUDirect-TCPX is usually installed, in the order tried.
pub const TCPX_INSTALL_PATHS: [&str; 2] = [
    "/usr/local/tcpx/lib64/libnccl-net-tcpx.so",
    "/usr/local/tcpx/lib64/libnccl-net.so",
];

/// Which plugin was chosen, and why.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Backend {
    /// The path the caller (flag, config or `UCCL_TCPX_PLUGIN_PATH`) named.
    Explicit(PathBuf),
    /// A TCPX install found at one of [`TCPX_INSTALL_PATHS`].
    Installed(PathBuf),
    /// The linked-in kernel-TCP plugin (no TCPX found).
    Builtin,
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Backend::Explicit(p) => write!(f, "{} (explicit path)", p.display()),
            Backend::Installed(p) => write!(f, "{} (TCPX install found)", p.display()),
            Backend::Builtin => write!(f, "built-in tcpx-socket (no TCPX install found)"),
        }
    }
}

impl Backend {
    /// Decides without loading anything: `explicit`, else the first existing install path.
    pub fn choose(explicit: Option<&Path>) -> Self {
        if let Some(path) = explicit {
            return Backend::Explicit(path.to_path_buf());
        }
        TCPX_INSTALL_PATHS
            .iter()
            .map(Path::new)
            .find(|p| p.exists())
            .map(|p| Backend::Installed(p.to_path_buf()))
            .unwrap_or(Backend::Builtin)
    }

    /// Loads the chosen plugin.
    pub fn open(&self) -> Result<Net> {
        let net = match self {
            Backend::Explicit(path) | Backend::Installed(path) => Net::load(path)?,
            Backend::Builtin => Net::builtin()?,
        };
        tracing::info!(target: "tcpx", backend = %self, plugin = net.name(), "backend chosen");
        Ok(net)
    }
}
