//! Loading a plugin and presenting its table, whatever its ABI version, through one interface.
//!
//! Every method here is a thin forwarder: it checks what the *table* can express (a NULL
//! function pointer, a v7 size that does not fit an `int`, a v6 table without device handles)
//! and otherwise passes the call through. Whether the plugin's answer makes sense is the safe
//! layer's business.

use std::ffi::{c_int, c_void, CStr};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

use crate::bindings::*;
use crate::ResultCode;

/// The table symbols tried by [`NetPlugin::load`], newest first.
pub const PLUGIN_SYMBOLS: [&str; 3] = ["ncclNetPlugin_v8", "ncclNetPlugin_v7", "ncclNetPlugin_v6"];

/// The ncclNet ABI version of a table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum AbiVersion {
    /// `ncclNet_v6_t`: no device handles, `getDeviceMr` or `irecvConsumed`.
    V6,
    /// `ncclNet_v7_t`: what GPUDirect-TCPX exports; `regMr` takes an `int` size.
    V7,
    /// `ncclNet_v8_t`: `size_t` registration size, `regIsGlobal` property.
    V8,
}

impl AbiVersion {
    /// The symbol that exports a table of this version.
    pub fn symbol(self) -> &'static str {
        match self {
            AbiVersion::V8 => PLUGIN_SYMBOLS[0],
            AbiVersion::V7 => PLUGIN_SYMBOLS[1],
            AbiVersion::V6 => PLUGIN_SYMBOLS[2],
        }
    }

    /// The version number (6, 7 or 8).
    pub fn number(self) -> u32 {
        match self {
            AbiVersion::V6 => 6,
            AbiVersion::V7 => 7,
            AbiVersion::V8 => 8,
        }
    }

    /// All versions, newest first (the order NCCL and our loader try them in).
    pub const NEWEST_FIRST: [AbiVersion; 3] = [AbiVersion::V8, AbiVersion::V7, AbiVersion::V6];
}

impl std::fmt::Display for AbiVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "v{}", self.number())
    }
}

/// Why a plugin could not be loaded. Every variant names the path.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// `dlopen` failed (missing file, wrong architecture, unresolved dependency…).
    #[error("cannot open net plugin {path}: {reason}")]
    Open {
        /// The path given to the loader.
        path: PathBuf,
        /// The dynamic loader's message.
        reason: String,
    },
    /// The library exports none of the table symbols tried.
    #[error("{path} exports no ncclNet table: tried {tried:?}")]
    NoTable {
        /// The path given to the loader.
        path: PathBuf,
        /// The symbols looked up, in order.
        tried: Vec<&'static str>,
    },
    /// The table exists but misses a function every consumer needs, or its name.
    #[error("{path}: table {symbol} is incomplete: field `{field}` is NULL")]
    Incomplete {
        /// The path given to the loader (or `<linked>` for a static table).
        path: PathBuf,
        /// The symbol whose table is incomplete.
        symbol: &'static str,
        /// The NULL field.
        field: &'static str,
    },
}

/// A call that the table itself cannot express (as opposed to a code the plugin returned).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AbiError {
    /// The plugin left this optional entry NULL.
    #[error("the plugin does not implement `{field}` (NULL in its {version} table)")]
    NotImplemented {
        /// The table field.
        field: &'static str,
        /// The table's version.
        version: AbiVersion,
    },
    /// The entry does not exist in this table version.
    #[error("`{field}` does not exist in an ncclNet {version} table")]
    NotInVersion {
        /// The table field.
        field: &'static str,
        /// The table's version.
        version: AbiVersion,
    },
    /// A size that the table's `int` parameter cannot hold; refusing beats truncating.
    #[error("{field}: {size} bytes does not fit the {version} table's int size (max {max})")]
    SizeTooLarge {
        /// The table field.
        field: &'static str,
        /// The requested size.
        size: usize,
        /// The largest size this version accepts.
        max: usize,
        /// The table's version.
        version: AbiVersion,
    },
}

#[derive(Clone, Copy)]
enum Table {
    V6(NonNull<ncclNet_v6_t>),
    V7(NonNull<ncclNet_v7_t>),
    V8(NonNull<ncclNet_v8_t>),
}

/// A loaded plugin table, normalized over v6/v7/v8.
///
/// A plugin loaded from a file stays mapped for the rest of the process (it is never
/// `dlclose`d): NCCL does the same, and plugins such as TCPX start threads and keep state that
/// must not outlive their code.
pub struct NetPlugin {
    table: Table,
    name: String,
    origin: PathBuf,
}

// SAFETY: the table is immutable data (a name and function pointers) that lives for the rest of
// the process; the ncclNet ABI lets any thread call its functions (NCCL calls them from its
// proxy threads).
unsafe impl Send for NetPlugin {}
// SAFETY: the table is immutable data that lives for the rest of the process and every
// `&NetPlugin` method only reads it; concurrent calls into the plugin are allowed by the ncclNet
// ABI (NCCL calls them from several threads).
unsafe impl Sync for NetPlugin {}

impl std::fmt::Debug for NetPlugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetPlugin")
            .field("name", &self.name)
            .field("version", &self.version())
            .field("origin", &self.origin)
            .finish()
    }
}

/// The first NULL among the fields every consumer needs (optional: regMrDmaBuf, iflush,
/// getDeviceMr, irecvConsumed — those are checked at call time).
macro_rules! first_missing {
    ($t:expr, [$($field:ident),*]) => {{
        let t = $t;
        let mut missing = None;
        $( if missing.is_none() && t.$field.is_none() { missing = Some(stringify!($field)); } )*
        missing
    }};
}

/// Runs `$body` with `$t` bound to the table (as `&'static ncclNet_vN_t`) and `$version` to
/// its [`AbiVersion`]: one body, type-checked once per table layout.
macro_rules! with_table {
    ($table:expr, |$t:ident, $version:ident| $body:expr) => {
        match $table {
            Table::V6(p) => {
                let ($t, $version) = (table_ref(p), AbiVersion::V6);
                $body
            }
            Table::V7(p) => {
                let ($t, $version) = (table_ref(p), AbiVersion::V7);
                $body
            }
            Table::V8(p) => {
                let ($t, $version) = (table_ref(p), AbiVersion::V8);
                $body
            }
        }
    };
}

/// Calls table entry `$field` through `$f` with the call written once per group of versions
/// whose signatures agree (`[V6 V7 V8] |f| …` by default); a NULL entry is
/// [`AbiError::NotImplemented`], and a version listed after `absent` has no such entry
/// ([`AbiError::NotInVersion`]). The `unsafe` call and its SAFETY line are the caller's.
macro_rules! call_table {
    ($self:ident, $field:ident, |$f:ident| $call:expr) => {
        call_table!($self, $field, [V6 V7 V8] |$f| $call)
    };
    ($self:ident, $field:ident, $([$($ver:ident)+] |$f:ident| $call:expr),+
        $(; absent [$($absent:ident)+])?) => {
        match $self.table {
            $($(
                Table::$ver(t) => match table_ref(t).$field {
                    Some($f) => Ok(ResultCode($call)),
                    None => Err(not_implemented(stringify!($field), AbiVersion::$ver)),
                },
            )+)+
            $($(
                Table::$absent(_) => Err(AbiError::NotInVersion {
                    field: stringify!($field),
                    version: AbiVersion::$absent,
                }),
            )+)?
        }
    };
}

impl NetPlugin {
    /// Opens `path` and resolves `ncclNetPlugin_v8`, else `_v7`, else `_v6`.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, LoadError> {
        Self::load_versions(path, &AbiVersion::NEWEST_FIRST)
    }

    /// Opens `path` and resolves the first table of `versions` it exports (used to force an
    /// older table of a plugin that exports several, e.g. TCPX's v7 behaviour).
    pub fn load_versions(
        path: impl AsRef<Path>,
        versions: &[AbiVersion],
    ) -> Result<Self, LoadError> {
        let path = path.as_ref();
        // SAFETY: loading a library runs its initializers; that is the contract of a plugin, the
        // same thing NCCL does with NCCL_NET_PLUGIN.
        let lib = unsafe { libloading::Library::new(path) }.map_err(|e| LoadError::Open {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        for &version in versions {
            let symbol = version.symbol();
            // SAFETY: the symbol is a data symbol (a table); we only take its address.
            let found = unsafe { lib.get::<*mut c_void>(symbol.as_bytes()) };
            let Ok(sym) = found else { continue };
            let addr: *mut c_void = *sym;
            let Some(addr) = NonNull::new(addr) else {
                continue;
            };
            let table = match version {
                AbiVersion::V6 => Table::V6(addr.cast()),
                AbiVersion::V7 => Table::V7(addr.cast()),
                AbiVersion::V8 => Table::V8(addr.cast()),
            };
            // SAFETY: the library exported the symbol under its ncclNet name; it stays mapped
            // because the library handle is leaked just below.
            let plugin = unsafe { Self::from_table(table, path.to_path_buf()) }?;
            // Keep the code mapped for the rest of the process (see the type's docs).
            std::mem::forget(lib);
            return Ok(plugin);
        }
        Err(LoadError::NoTable {
            path: path.to_path_buf(),
            tried: versions.iter().map(|v| v.symbol()).collect(),
        })
    }

    /// Wraps a v8 table linked into this program (no dlopen).
    ///
    /// # Safety
    /// Every non-NULL field must point at a function with the documented ncclNet v8 signature
    /// and behaviour, and `name` at a NUL-terminated string.
    pub unsafe fn from_static_v8(table: &'static ncclNet_v8_t) -> Result<Self, LoadError> {
        // SAFETY: `table` is `'static` (valid for the process) and the caller vouches that its
        // fields are v8 functions with the documented signatures and `name` a C string.
        unsafe { Self::from_table(Table::V8(NonNull::from(table)), PathBuf::from("<linked>")) }
    }

    /// Wraps a v7 table linked into this program (no dlopen).
    ///
    /// # Safety
    /// As [`NetPlugin::from_static_v8`], for the v7 signatures.
    pub unsafe fn from_static_v7(table: &'static ncclNet_v7_t) -> Result<Self, LoadError> {
        // SAFETY: `table` is `'static` (valid for the process) and the caller vouches that its
        // fields are v7 functions with the documented signatures and `name` a C string.
        unsafe { Self::from_table(Table::V7(NonNull::from(table)), PathBuf::from("<linked>")) }
    }

    /// Wraps a v6 table linked into this program (no dlopen).
    ///
    /// # Safety
    /// As [`NetPlugin::from_static_v8`], for the v6 signatures.
    pub unsafe fn from_static_v6(table: &'static ncclNet_v6_t) -> Result<Self, LoadError> {
        // SAFETY: `table` is `'static` (valid for the process) and the caller vouches that its
        // fields are v6 functions with the documented signatures and `name` a C string.
        unsafe { Self::from_table(Table::V6(NonNull::from(table)), PathBuf::from("<linked>")) }
    }

    /// # Safety
    /// `table` points at a live table of the version its variant names, valid for the process.
    unsafe fn from_table(table: Table, origin: PathBuf) -> Result<Self, LoadError> {
        // `table_ref` relies on this function's contract: the pointer is live, aligned and
        // valid for the process, which every `Table` must be.
        let (symbol, name_ptr, missing) = with_table!(table, |t, version| (
            version.symbol(),
            t.name,
            first_missing!(
                t,
                [
                    init,
                    devices,
                    getProperties,
                    listen,
                    connect,
                    accept,
                    regMr,
                    deregMr,
                    isend,
                    irecv,
                    test,
                    closeSend,
                    closeRecv,
                    closeListen
                ]
            )
        ));
        let incomplete = |field| LoadError::Incomplete {
            path: origin.clone(),
            symbol,
            field,
        };
        if let Some(field) = missing {
            return Err(incomplete(field));
        }
        if name_ptr.is_null() {
            return Err(incomplete("name"));
        }
        // SAFETY: non-NULL and, by the ABI, a NUL-terminated string owned by the plugin.
        let name = unsafe { CStr::from_ptr(name_ptr) }
            .to_string_lossy()
            .into_owned();
        Ok(Self {
            table,
            name,
            origin,
        })
    }

    /// The plugin's own name (`"GPUDirectTCPX_v7"`, `"tcpx-socket"`, …).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The ABI version of the table in use.
    pub fn version(&self) -> AbiVersion {
        with_table!(self.table, |_t, version| version)
    }

    /// Where the table came from: the library path, or `<linked>`.
    pub fn origin(&self) -> &Path {
        &self.origin
    }

    /// Address of the table, stable for the process: identifies a plugin instance (the safe
    /// layer initializes each table once).
    pub fn table_address(&self) -> usize {
        with_table!(self.table, |t, _version| std::ptr::from_ref(t) as usize)
    }

    /// Whether the table has device-handle arguments, `getDeviceMr` and `irecvConsumed` (v7+).
    pub fn has_device_handles(&self) -> bool {
        self.version() >= AbiVersion::V7
    }

    /// Largest size `reg_mr` accepts with this table.
    pub fn max_registration(&self) -> usize {
        match self.version() {
            AbiVersion::V8 => usize::MAX,
            AbiVersion::V6 | AbiVersion::V7 => MAX_INT_REG_SIZE_USIZE,
        }
    }

    /// `init(logger)`.
    ///
    /// # Safety
    /// Call once per table; `logger`, if set, must stay callable from any thread forever.
    pub unsafe fn init(&self, logger: ncclDebugLogger_t) -> Result<ResultCode, AbiError> {
        // SAFETY: `f` is this table's entry, which lives for the process (see NetPlugin); the
        // caller calls `init` once per table and `logger`, if set, stays callable from any thread
        // forever.
        call_table!(self, init, |f| unsafe { f(logger) })
    }

    /// `devices(&ndev)`.
    ///
    /// # Safety
    /// After a successful `init`.
    pub unsafe fn devices(&self, ndev: &mut c_int) -> Result<ResultCode, AbiError> {
        // SAFETY: `ndev` is a valid out pointer.
        call_table!(self, devices, |f| unsafe { f(ndev) })
    }

    /// `getProperties(dev, props)`, normalized to the v8 layout: a v7 table reports
    /// `regIsGlobal = 0`; a v6 table additionally reports a HOST device of version 0.
    ///
    /// # Safety
    /// After a successful `init`; string pointers in the result are owned by the plugin.
    pub unsafe fn get_properties(
        &self,
        dev: c_int,
        out: &mut ncclNetProperties_v8_t,
    ) -> Result<ResultCode, AbiError> {
        call_table!(self, getProperties,
            [V6 V7] |f| {
                let mut p = Default::default();
                // SAFETY: `f` is this table's entry, which lives for the process (see
                // NetPlugin), called after `init` (caller); `p` is a valid out pointer of the
                // table's own properties layout, the one `f` takes.
                let code = unsafe { f(dev, &mut p) };
                *out = WidenProperties::widen(p);
                code
            },
            // SAFETY: `f` is this table's entry, which lives for the process (see NetPlugin),
            // called after `init` (caller); `out` is a valid out pointer of the v8 layout.
            [V8] |f| unsafe { f(dev, out) }
        )
    }

    /// `listen(dev, handle, &listenComm)`.
    ///
    /// # Safety
    /// `handle` points at [`crate::HANDLE_SIZE`] writable bytes.
    pub unsafe fn listen(
        &self,
        dev: c_int,
        handle: *mut c_void,
        listen_comm: &mut *mut c_void,
    ) -> Result<ResultCode, AbiError> {
        // SAFETY: `f` is this table's entry, which lives for the process (see NetPlugin); `handle`
        // points at HANDLE_SIZE writable bytes (caller) and `listen_comm` is a valid out pointer.
        call_table!(self, listen, |f| unsafe { f(dev, handle, listen_comm) })
    }

    /// `connect(dev, handle, &sendComm, &devHandle)`; a v6 table gets no device handle.
    ///
    /// # Safety
    /// `handle` is the peer's handle buffer, the *same* buffer on every retry; `dev_handle`
    /// follows the plugin's device-handle contract (NULL, or a slot the plugin may fill).
    pub unsafe fn connect(
        &self,
        dev: c_int,
        handle: *mut c_void,
        send_comm: &mut *mut c_void,
        dev_handle: *mut *mut ncclNetDeviceHandle_v8_t,
    ) -> Result<ResultCode, AbiError> {
        call_table!(
            self,
            connect,
            // SAFETY: `f` is this table's entry, which lives for the process (see NetPlugin);
            // `handle` is the peer's handle buffer, the same on every retry (caller), and
            // `send_comm` a valid out pointer. A v6 table takes no device handle.
            [V6] |f| unsafe { f(dev, handle, send_comm) },
            // SAFETY: `f` is this table's entry, which lives for the process (see NetPlugin);
            // `handle` is the peer's handle buffer, the same on every retry, and `dev_handle`
            // NULL or a slot the plugin may fill (caller); `send_comm` is a valid out pointer;
            // v7 and v8 device handles share one layout.
            [V7 V8] |f| unsafe { f(dev, handle, send_comm, dev_handle) }
        )
    }

    /// `accept(listenComm, &recvComm, &devHandle)`; a v6 table gets no device handle.
    ///
    /// # Safety
    /// `listen_comm` is a live listen comm of this plugin; `dev_handle` as for `connect`.
    pub unsafe fn accept(
        &self,
        listen_comm: *mut c_void,
        recv_comm: &mut *mut c_void,
        dev_handle: *mut *mut ncclNetDeviceHandle_v8_t,
    ) -> Result<ResultCode, AbiError> {
        call_table!(
            self,
            accept,
            // SAFETY: `f` is this table's entry, which lives for the process (see NetPlugin);
            // `listen_comm` is a live listen comm of this plugin (caller) and `recv_comm` a
            // valid out pointer. A v6 table takes no device handle.
            [V6] |f| unsafe { f(listen_comm, recv_comm) },
            // SAFETY: `f` is this table's entry, which lives for the process (see NetPlugin);
            // `listen_comm` is a live listen comm of this plugin and `dev_handle` NULL or a slot
            // the plugin may fill (caller); `recv_comm` is a valid out pointer.
            [V7 V8] |f| unsafe { f(listen_comm, recv_comm, dev_handle) }
        )
    }

    /// `regMr(comm, data, size, type, &mh)`. A v6/v7 table takes an `int` size: a size of
    /// 2^31 bytes or more is refused with [`AbiError::SizeTooLarge`], never truncated.
    ///
    /// # Safety
    /// `comm` is a live comm of this plugin and `data..data+size` memory of kind `ptr_type`.
    pub unsafe fn reg_mr(
        &self,
        comm: *mut c_void,
        data: *mut c_void,
        size: usize,
        ptr_type: c_int,
        mhandle: &mut *mut c_void,
    ) -> Result<ResultCode, AbiError> {
        // A NULL `regMr` never reaches here (`from_table` refuses the table), so checking the
        // size inside the call changes no answer.
        call_table!(self, regMr,
            [V6 V7] |f| {
                let size = int_size("regMr", size, self.version())?;
                // SAFETY: `f` is this table's entry, which lives for the process (see NetPlugin);
                // `comm` is a live comm of this plugin and `data..data+size` memory of kind
                // `ptr_type` (caller); `mhandle` is a valid out pointer; `size` fits the `int`.
                unsafe { f(comm, data, size, ptr_type, mhandle) }
            },
            // SAFETY: `f` is this table's entry, which lives for the process (see NetPlugin);
            // `comm` is a live comm of this plugin and `data..data+size` memory of kind
            // `ptr_type` (caller); `mhandle` is a valid out pointer.
            [V8] |f| unsafe { f(comm, data, size, ptr_type, mhandle) }
        )
    }

    /// `regMrDmaBuf(comm, data, size, type, offset, fd, &mh)` (optional in every version).
    ///
    /// # Safety
    /// As [`NetPlugin::reg_mr`]; `fd` is a dma-buf file descriptor describing `data`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn reg_mr_dma_buf(
        &self,
        comm: *mut c_void,
        data: *mut c_void,
        size: usize,
        ptr_type: c_int,
        offset: u64,
        fd: c_int,
        mhandle: &mut *mut c_void,
    ) -> Result<ResultCode, AbiError> {
        // SAFETY: `f` is this table's entry, which lives for the process (see NetPlugin); `comm` is
        // a live comm of this plugin, `data..data+size` memory of kind `ptr_type` described by
        // dma-buf `fd` at `offset` (caller); `mhandle` is a valid out pointer.
        call_table!(self, regMrDmaBuf, |f| unsafe {
            f(comm, data, size, ptr_type, offset, fd, mhandle)
        })
    }

    /// `deregMr(comm, mh)`.
    ///
    /// # Safety
    /// `mhandle` came from `reg_mr` on `comm` and is deregistered once.
    pub unsafe fn dereg_mr(
        &self,
        comm: *mut c_void,
        mhandle: *mut c_void,
    ) -> Result<ResultCode, AbiError> {
        // SAFETY: `f` is this table's entry, which lives for the process (see NetPlugin); `mhandle`
        // came from `reg_mr` on the live `comm` and is deregistered once (caller).
        call_table!(self, deregMr, |f| unsafe { f(comm, mhandle) })
    }

    /// `isend(sendComm, data, size, tag, mh, &req)`; a NULL request with success means busy.
    ///
    /// # Safety
    /// `data..data+size` stays valid and unmodified until the request completes.
    pub unsafe fn isend(
        &self,
        send_comm: *mut c_void,
        data: *mut c_void,
        size: c_int,
        tag: c_int,
        mhandle: *mut c_void,
        request: &mut *mut c_void,
    ) -> Result<ResultCode, AbiError> {
        // SAFETY: `f` is this table's entry, which lives for the process (see NetPlugin);
        // `send_comm` is a live send comm and `data..data+size` stays valid and unmodified until
        // the request completes (caller); `request` is a valid out pointer.
        call_table!(self, isend, |f| unsafe {
            f(send_comm, data, size, tag, mhandle, request)
        })
    }

    /// `irecv(recvComm, n, data, sizes, tags, mhs, &req)`; a NULL request with success means busy.
    ///
    /// # Safety
    /// The arrays hold `n` entries; every buffer stays valid until the request completes.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn irecv(
        &self,
        recv_comm: *mut c_void,
        n: c_int,
        data: *mut *mut c_void,
        sizes: *mut c_int,
        tags: *mut c_int,
        mhandles: *mut *mut c_void,
        request: &mut *mut c_void,
    ) -> Result<ResultCode, AbiError> {
        // SAFETY: `f` is this table's entry, which lives for the process (see NetPlugin);
        // `recv_comm` is a live receive comm, the arrays hold `n` entries and every buffer stays
        // valid until the request completes (caller); `request` is a valid out pointer.
        call_table!(self, irecv, |f| unsafe {
            f(recv_comm, n, data, sizes, tags, mhandles, request)
        })
    }

    /// `iflush(recvComm, n, data, sizes, mhs, &req)` (must not be called on TCPX).
    ///
    /// # Safety
    /// As [`NetPlugin::irecv`].
    pub unsafe fn iflush(
        &self,
        recv_comm: *mut c_void,
        n: c_int,
        data: *mut *mut c_void,
        sizes: *mut c_int,
        mhandles: *mut *mut c_void,
        request: &mut *mut c_void,
    ) -> Result<ResultCode, AbiError> {
        // SAFETY: `f` is this table's entry, which lives for the process (see NetPlugin);
        // `recv_comm` is a live receive comm, the arrays hold `n` entries and every buffer stays
        // valid until the request completes (caller); `request` is a valid out pointer.
        call_table!(self, iflush, |f| unsafe {
            f(recv_comm, n, data, sizes, mhandles, request)
        })
    }

    /// `test(req, &done, sizes)`: drives progress; `sizes` (may be NULL) is filled when done.
    ///
    /// # Safety
    /// `request` is a live request, the oldest of its comm (TCPX rule).
    pub unsafe fn test(
        &self,
        request: *mut c_void,
        done: &mut c_int,
        sizes: *mut c_int,
    ) -> Result<ResultCode, AbiError> {
        // SAFETY: `f` is this table's entry, which lives for the process (see NetPlugin); `request`
        // is a live request, the oldest of its comm (caller); `done` is a valid out pointer and
        // `sizes` NULL or valid for one int.
        call_table!(self, test, |f| unsafe { f(request, done, sizes) })
    }

    /// `closeSend(sendComm)`.
    ///
    /// # Safety
    /// `comm` is a live send comm, closed once, with no registration left on it.
    pub unsafe fn close_send(&self, comm: *mut c_void) -> Result<ResultCode, AbiError> {
        // SAFETY: `f` is this table's entry, which lives for the process (see NetPlugin); `comm` is
        // a live send comm with no registration left, closed once (caller).
        call_table!(self, closeSend, |f| unsafe { f(comm) })
    }

    /// `closeRecv(recvComm)`.
    ///
    /// # Safety
    /// `comm` is a live receive comm, closed once, with no registration left on it.
    pub unsafe fn close_recv(&self, comm: *mut c_void) -> Result<ResultCode, AbiError> {
        // SAFETY: `f` is this table's entry, which lives for the process (see NetPlugin); `comm` is
        // a live receive comm with no registration left, closed once (caller).
        call_table!(self, closeRecv, |f| unsafe { f(comm) })
    }

    /// `closeListen(listenComm)`.
    ///
    /// # Safety
    /// `comm` is a live listen comm, closed once.
    pub unsafe fn close_listen(&self, comm: *mut c_void) -> Result<ResultCode, AbiError> {
        // SAFETY: `f` is this table's entry, which lives for the process (see NetPlugin); `comm` is
        // a live listen comm, closed once (caller).
        call_table!(self, closeListen, |f| unsafe { f(comm) })
    }

    /// `getDeviceMr(comm, mh, &dptr_mh)` (v7+).
    ///
    /// # Safety
    /// `mhandle` is a live registration of `comm`.
    pub unsafe fn get_device_mr(
        &self,
        comm: *mut c_void,
        mhandle: *mut c_void,
        out: &mut *mut c_void,
    ) -> Result<ResultCode, AbiError> {
        // SAFETY: `f` is this table's entry, which lives for the process (see NetPlugin);
        // `mhandle` is a live registration of the live `comm` (caller); `out` is a valid out
        // pointer.
        call_table!(self, getDeviceMr, [V7 V8] |f| unsafe { f(comm, mhandle, out) }; absent [V6])
    }

    /// `irecvConsumed(recvComm, n, req)` (v7+): the receive's data has been used.
    ///
    /// # Safety
    /// `request` completed on `recv_comm` and is the oldest not yet consumed.
    pub unsafe fn irecv_consumed(
        &self,
        recv_comm: *mut c_void,
        n: c_int,
        request: *mut c_void,
    ) -> Result<ResultCode, AbiError> {
        // SAFETY: `f` is this table's entry, which lives for the process (see NetPlugin);
        // `request` completed on the live `recv_comm` and is the oldest not yet consumed
        // (caller).
        call_table!(self, irecvConsumed, [V7 V8] |f| unsafe { f(recv_comm, n, request) }; absent [V6])
    }
}

const MAX_INT_REG_SIZE_USIZE: usize = crate::MAX_INT_REG_SIZE;

fn int_size(field: &'static str, size: usize, version: AbiVersion) -> Result<c_int, AbiError> {
    c_int::try_from(size).map_err(|_| AbiError::SizeTooLarge {
        field,
        size,
        max: MAX_INT_REG_SIZE_USIZE,
        version,
    })
}

fn not_implemented(field: &'static str, version: AbiVersion) -> AbiError {
    AbiError::NotImplemented { field, version }
}

/// The table behind one of [`Table`]'s pointers.
///
/// Only ever given a `Table`'s pointer: a `Table` is built only by `from_table`, whose contract
/// (upheld by `load_versions`, which leaks the library, and by the `'static` tables of
/// `from_static_*`) is a live, aligned table that stays valid for the rest of the process.
fn table_ref<T>(t: NonNull<T>) -> &'static T {
    // SAFETY: `t` is a `Table`'s pointer (see above): live, aligned, valid and never written for
    // the rest of the process, so a shared `'static` reference to it is sound.
    unsafe { t.as_ref() }
}

/// A v6 or v7 properties layout, widened to v8: `regIsGlobal = 0`, and a v6 device reports a
/// HOST device of version 0.
trait WidenProperties: Default {
    fn widen(self) -> ncclNetProperties_v8_t;
}

impl WidenProperties for ncclNetProperties_v6_t {
    fn widen(self) -> ncclNetProperties_v8_t {
        let p = self;
        ncclNetProperties_v8_t {
            name: p.name,
            pciPath: p.pciPath,
            guid: p.guid,
            ptrSupport: p.ptrSupport,
            regIsGlobal: 0,
            speed: p.speed,
            port: p.port,
            latency: p.latency,
            maxComms: p.maxComms,
            maxRecvs: p.maxRecvs,
            netDeviceType: NCCL_NET_DEVICE_HOST,
            netDeviceVersion: 0,
        }
    }
}

impl WidenProperties for ncclNetProperties_v7_t {
    fn widen(self) -> ncclNetProperties_v8_t {
        let p = self;
        ncclNetProperties_v8_t {
            name: p.name,
            pciPath: p.pciPath,
            guid: p.guid,
            ptrSupport: p.ptrSupport,
            regIsGlobal: 0,
            speed: p.speed,
            port: p.port,
            latency: p.latency,
            maxComms: p.maxComms,
            maxRecvs: p.maxRecvs,
            netDeviceType: p.netDeviceType,
            netDeviceVersion: p.netDeviceVersion,
        }
    }
}
