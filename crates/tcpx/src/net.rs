//! [`Net`]: a loaded plugin, initialized once per process, shared by every comm made from it.

use std::collections::HashMap;
use std::ffi::c_int;
use std::path::Path;
use std::sync::{Arc, Mutex};

use tcpx_sys::{AbiVersion, NetPlugin, ResultCode};

use crate::call::call;
use crate::device::{Device, Properties};
use crate::error::{Error, ErrorKind, Result};

/// Where GPUDirect-TCPX is usually installed, in the order the runtime tries them.
pub const TCPX_INSTALL_PATHS: [&str; 2] = [
    "/usr/local/tcpx/lib64/libnccl-net-tcpx.so",
    "/usr/local/tcpx/lib64/libnccl-net.so",
];

/// A loaded and initialized net plugin. Cheap to clone; comms keep it alive.
#[derive(Clone)]
pub struct Net {
    pub(crate) inner: Arc<NetInner>,
}

pub(crate) struct NetInner {
    pub(crate) plugin: NetPlugin,
}

impl std::fmt::Debug for Net {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Net")
            .field("plugin", &self.inner.plugin)
            .finish()
    }
}

/// `init` results per table address: a table is initialized once per process, whatever the
/// number of `Net`s made from it (dlopen of the same path returns the same table).
fn init_registry() -> &'static Mutex<HashMap<usize, ResultCode>> {
    static REGISTRY: std::sync::OnceLock<Mutex<HashMap<usize, ResultCode>>> =
        std::sync::OnceLock::new();
    REGISTRY.get_or_init(|| Mutex::new(HashMap::new()))
}

impl Net {
    /// Loads the plugin at `path` (newest table first: v8, v7, v6) and initializes it.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let plugin = NetPlugin::load(path)
            .map_err(|e| Error::new("dlopen", ErrorKind::Load(e), String::new()))?;
        Self::from_plugin(plugin)
    }

    /// Loads the plugin at `path`, using the first of `versions` it exports.
    pub fn load_versions(path: impl AsRef<Path>, versions: &[AbiVersion]) -> Result<Self> {
        let plugin = NetPlugin::load_versions(path, versions)
            .map_err(|e| Error::new("dlopen", ErrorKind::Load(e), String::new()))?;
        Self::from_plugin(plugin)
    }

    /// The built-in kernel-TCP plugin (`tcpx-socket`), linked in: no dlopen needed.
    pub fn builtin() -> Result<Self> {
        Self::builtin_version(AbiVersion::V8)
    }

    /// The built-in plugin through its v7 table (what TCPX speaks), for tests of v7 behaviour.
    pub fn builtin_version(version: AbiVersion) -> Result<Self> {
        let plugin = match version {
            // SAFETY: tcpx-socket's tables implement the documented ABI for the process lifetime.
            AbiVersion::V8 => unsafe { NetPlugin::from_static_v8(tcpx_socket::table_v8()) },
            // SAFETY: tcpx-socket's v7 table is `'static` and implements the documented v7 ABI
            // (it is the v8 implementation behind v7 signatures).
            AbiVersion::V7 => unsafe { NetPlugin::from_static_v7(tcpx_socket::table_v7()) },
            AbiVersion::V6 => {
                return Err(Error::invalid(
                    "builtin",
                    "the built-in plugin exports v8 and v7 tables only",
                ));
            }
        }
        .map_err(|e| Error::new("load", ErrorKind::Load(e), String::new()))?;
        Self::from_plugin(plugin)
    }

    /// Wraps an already loaded table and initializes it (once per table per process).
    pub fn from_plugin(plugin: NetPlugin) -> Result<Self> {
        crate::logging::install();
        let key = plugin.table_address();
        let mut registry = init_registry().lock().unwrap_or_else(|p| p.into_inner());
        let code = match registry.get(&key) {
            Some(code) => *code,
            None => {
                // SAFETY: first init of this table in this process; the shim logger is a static
                // function valid forever and callable from any thread.
                let code =
                    unsafe { plugin.init(tcpx_sys::logger::shim_logger()) }.map_err(|e| {
                        Error::new(
                            "init",
                            ErrorKind::Abi(e),
                            plugin.origin().display().to_string(),
                        )
                    })?;
                registry.insert(key, code);
                code
            }
        };
        drop(registry);
        if !code.is_success() {
            return Err(Error::new(
                "init",
                ErrorKind::Plugin(code),
                format!(
                    "plugin {} from {}",
                    plugin.name(),
                    plugin.origin().display()
                ),
            ));
        }
        tracing::info!(
            target: "tcpx",
            plugin = plugin.name(),
            abi = %plugin.version(),
            origin = %plugin.origin().display(),
            "net plugin ready"
        );
        Ok(Self {
            inner: Arc::new(NetInner { plugin }),
        })
    }

    /// The plugin's own name.
    pub fn name(&self) -> &str {
        self.inner.plugin.name()
    }

    /// The ABI version of the table in use.
    pub fn abi_version(&self) -> AbiVersion {
        self.inner.plugin.version()
    }

    /// The raw normalized table, for code that drives the plugin directly (benchmarks, tests).
    pub fn plugin(&self) -> &NetPlugin {
        &self.inner.plugin
    }

    /// Number of devices the plugin exposes.
    pub fn device_count(&self) -> Result<usize> {
        let mut n: c_int = 0;
        // SAFETY: the plugin is initialized; `n` is a valid out pointer.
        call("devices", String::new, || unsafe {
            self.inner.plugin.devices(&mut n)
        })?;
        usize::try_from(n).map_err(|_| {
            Error::new(
                "devices",
                ErrorKind::Contract(format!("negative device count {n}")),
                "",
            )
        })
    }

    /// Every device with its properties.
    pub fn devices(&self) -> Result<Vec<Device>> {
        (0..self.device_count()?).map(|i| self.device(i)).collect()
    }

    /// One device by index.
    pub fn device(&self, index: usize) -> Result<Device> {
        let dev = c_int::try_from(index)
            .map_err(|_| Error::invalid("getProperties", format!("device index {index}")))?;
        let mut raw = tcpx_sys::ncclNetProperties_v8_t::default();
        call(
            "getProperties",
            || format!("device {index}"),
            // SAFETY: initialized plugin; `raw` is a valid out pointer of the normalized layout.
            || unsafe { self.inner.plugin.get_properties(dev, &mut raw) },
        )?;
        // SAFETY: the plugin filled `raw` and owns its strings for the process lifetime.
        let properties = unsafe { Properties::from_raw(&raw) };
        Ok(Device { index, properties })
    }
}
