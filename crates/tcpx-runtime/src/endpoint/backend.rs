//! Which plugin an endpoint runs on: an explicit path, else the TCPX install paths, else the
//! built-in socket plugin. The choice and its reason are logged and kept in [`BackendInfo`].

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tcpx::Net;

use crate::config::{Backend, TCPX_INSTALL_PATHS};
use crate::error::{Error, Result};

/// Where the plugin in use came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendOrigin {
    /// The built-in kernel-TCP plugin (`tcpx-socket`).
    Builtin,
    /// A plugin library loaded from this path.
    Library(PathBuf),
    /// A [`Net`] the caller built (e.g. a test or benchmark plugin).
    Provided,
}

/// The plugin an endpoint uses, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendInfo {
    /// The plugin's own name (`GPUDirectTCPX_v7`, `tcpx-socket`).
    pub name: String,
    /// The ncclNet ABI version in use.
    pub abi_version: u8,
    /// Where it came from.
    pub origin: BackendOrigin,
    /// Why it was chosen (`explicit plugin path`, `found at …`, `no TCPX install found`).
    pub reason: String,
    /// The plugin moves the bytes on the calling (engine) thread, so engines should scale with
    /// channels: the built-in plugin, or a loaded one whose first device takes host memory
    /// only (a kernel-TCP plugin such as the built-in one's `.so`; a GPUDirect plugin takes
    /// CUDA memory and moves it off the caller). `false` for a [`BackendOrigin::Provided`] net.
    pub copies_on_caller: bool,
}

impl BackendInfo {
    pub(crate) fn of(net: &Net, origin: BackendOrigin, reason: impl Into<String>) -> Self {
        let copies_on_caller = match &origin {
            BackendOrigin::Builtin => true,
            BackendOrigin::Library(_) => net
                .device(0)
                .is_ok_and(|d| !d.properties.ptr_support.cuda()),
            BackendOrigin::Provided => false,
        };
        Self {
            name: net.name().to_owned(),
            abi_version: u8::try_from(net.abi_version().number()).unwrap_or(u8::MAX),
            origin,
            reason: reason.into(),
            copies_on_caller,
        }
    }
}

/// Loads the configured backend and says which plugin it is and why it was chosen (what
/// `Endpoint::new` does first; `tcpx-info` calls it to show the same choice).
pub fn open(backend: &Backend) -> Result<(Net, BackendInfo)> {
    let (net, info) = match backend {
        Backend::Path(path) => {
            let net = load(path)?;
            let info = BackendInfo::of(
                &net,
                BackendOrigin::Library(path.clone()),
                "explicit plugin path",
            );
            (net, info)
        }
        Backend::Builtin => builtin("built-in backend requested")?,
        Backend::Auto => auto()?,
    };
    tracing::info!(
        target: "tcpx_runtime",
        plugin = %info.name,
        abi = info.abi_version,
        origin = ?info.origin,
        reason = %info.reason,
        "backend chosen"
    );
    Ok((net, info))
}

fn auto() -> Result<(Net, BackendInfo)> {
    let mut skipped = Vec::new();
    for path in TCPX_INSTALL_PATHS.map(Path::new) {
        if !path.exists() {
            continue;
        }
        match load(path) {
            Ok(net) => {
                let info = BackendInfo::of(
                    &net,
                    BackendOrigin::Library(path.to_owned()),
                    format!("TCPX install found at {}", path.display()),
                );
                return Ok((net, info));
            }
            Err(e) => {
                tracing::warn!(target: "tcpx_runtime", path = %path.display(), error = %e, "TCPX install present but unusable; trying the next backend");
                skipped.push(format!("{} ({e})", path.display()));
            }
        }
    }
    let reason = if skipped.is_empty() {
        format!("no TCPX install at {}", TCPX_INSTALL_PATHS.join(" or "))
    } else {
        format!("TCPX install unusable: {}", skipped.join("; "))
    };
    builtin(&reason)
}

fn builtin(reason: &str) -> Result<(Net, BackendInfo)> {
    let net = Net::builtin().map_err(|e| Error::Backend {
        what: "initializing the built-in socket plugin".into(),
        source: Arc::new(e),
    })?;
    let info = BackendInfo::of(&net, BackendOrigin::Builtin, reason);
    Ok((net, info))
}

fn load(path: &Path) -> Result<Net> {
    Net::load(path).map_err(|e| Error::Backend {
        what: format!("loading {}", path.display()),
        source: Arc::new(e),
    })
}
