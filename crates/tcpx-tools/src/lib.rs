//! Shared code of the `tcpx-bench` and `tcpx-info` binaries: size parsing, the raw-TCP baseline,
//! the measured paths and the report (table for people, JSON lines for machines).

pub mod bench;
pub mod cores;
pub mod logging;
pub mod watch;

use anyhow::Result;
use tcpx_runtime::{Backend, Config};

/// The variables that choose the plugin, as [`Config::from_env`] reads them.
const BACKEND_VARS: [&str; 3] = ["TCPX_BACKEND", "TCPX_PLUGIN_PATH", "UCCL_TCPX_PLUGIN_PATH"];

/// The plugin the environment asks for, with [`Config::from_env`]'s names and precedence
/// (`TCPX_PLUGIN_PATH` before `UCCL_TCPX_PLUGIN_PATH`, both before `TCPX_BACKEND`); `None`
/// when it names none, so that each tool keeps its own default.
pub fn env_backend() -> Result<Option<Backend>> {
    let set = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    if BACKEND_VARS.iter().all(|v| set(v).is_none()) {
        return Ok(None);
    }
    let config = Config::from_vars(|name| {
        if BACKEND_VARS.contains(&name) {
            set(name)
        } else {
            None
        }
    })?;
    Ok(Some(config.backend))
}

/// `--plugin` if given, else the environment's choice, else `default`.
pub fn backend_choice(flag: Option<&std::path::Path>, default: Backend) -> Result<Backend> {
    Ok(match flag {
        Some(path) => Backend::Path(path.to_path_buf()),
        None => env_backend()?.unwrap_or(default),
    })
}

/// An error and its causes as one line, each cause once: library errors often repeat their
/// source's text in their own message, which `{:#}` would print twice (`X: X`).
pub fn error_text(err: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in err.chain() {
        let text = cause.to_string();
        if out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}
