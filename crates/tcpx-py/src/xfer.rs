//! The value types of UCCL's p2p module that `tcpx.p2p` exports beside `Endpoint`:
//! `FloatType`, `XferDesc` (a registered buffer as the descriptor API sees it) and
//! `XferHandle`. Their byte form lives in [`crate::descs`].

use pyo3::prelude::*;

use crate::descs::Desc;

/// UCCL's `p2p.FloatType`: the element type of a registered buffer (`reg(ptr, size,
/// floatType=...)`), which UCCL uses to compress floats on the wire. tcpx accepts it and
/// ignores it: bytes travel exactly as they are, never compressed.
#[pyclass(
    eq,
    eq_int,
    frozen,
    from_py_object,
    module = "tcpx.p2p",
    name = "FloatType"
)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FloatType {
    /// Unknown or not a float (the default).
    #[pyo3(name = "kUndefined")]
    Undefined = 0,
    /// IEEE half.
    #[pyo3(name = "kFloat16")]
    Float16 = 1,
    /// bfloat16.
    #[pyo3(name = "kBFloat16")]
    BFloat16 = 2,
    /// IEEE single.
    #[pyo3(name = "kFloat32")]
    Float32 = 3,
    /// FP8 E4M3 (finite, NaN only).
    #[pyo3(name = "kFloat8E4M3FN")]
    Float8E4M3FN = 4,
    /// FP8 E5M2.
    #[pyo3(name = "kFloat8E5M2")]
    Float8E5M2 = 5,
}

/// Every member, in value order (exported at module level too, as UCCL's `export_values`).
pub const FLOAT_TYPES: [(&str, FloatType); 6] = [
    ("kUndefined", FloatType::Undefined),
    ("kFloat16", FloatType::Float16),
    ("kBFloat16", FloatType::BFloat16),
    ("kFloat32", FloatType::Float32),
    ("kFloat8E4M3FN", FloatType::Float8E4M3FN),
    ("kFloat8E5M2", FloatType::Float8E5M2),
];

#[pymethods]
impl FloatType {
    /// The member's name (`"kFloat16"`).
    #[getter]
    fn name(&self) -> &'static str {
        FLOAT_TYPES
            .iter()
            .find(|(_, t)| t == self)
            .map_or("kUndefined", |(n, _)| n)
    }

    /// The member's value, as in UCCL's `FloatType : uint32_t`.
    #[getter]
    fn value(&self) -> u32 {
        *self as u32
    }
}

/// `mr_id` of a descriptor that names no local registration (UCCL's `UINT64_MAX`): those
/// from `deserialize_descs`, and `XferDesc()`.
pub const NO_MR: u64 = u64::MAX;

/// UCCL's `p2p.XferDesc`: `size` bytes at `addr`, registered as `mr_id` on the endpoint that
/// made it (`register_memory`), with `lkeys` / `rkeys` naming the registration (9 words each:
/// the runtime's descriptor of the registration and its base address; `rkeys` carry the
/// access key that lets a peer write and read it, like an RDMA rkey).
///
/// `XferDesc()` makes an empty one (`mr_id` 2**64-1), as UCCL's; the fields can also be given
/// as keywords. All fields are read-write.
#[pyclass(eq, module = "tcpx.p2p", name = "XferDesc")]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XferDesc {
    /// Address of the memory in its owner's process.
    #[pyo3(get, set)]
    pub addr: u64,
    /// Bytes.
    #[pyo3(get, set)]
    pub size: u64,
    /// The owner's registration id (2**64-1 for a peer's descriptor).
    #[pyo3(get, set)]
    pub mr_id: u64,
    /// The registration's local name.
    #[pyo3(get, set)]
    pub lkeys: Vec<u32>,
    /// What a peer needs to reach the memory.
    #[pyo3(get, set)]
    pub rkeys: Vec<u32>,
    /// Same-host (CUDA IPC) information, carried by the serialized form like UCCL's:
    /// `register_memory` fills it for CUDA memory (the runtime's advert of the range);
    /// `transfer` on a same-host connection reads the remote side's.
    pub ipc_info: Vec<u8>,
}

#[pymethods]
impl XferDesc {
    #[new]
    #[pyo3(signature = (addr=0, size=0, mr_id=NO_MR, lkeys=Vec::new(), rkeys=Vec::new()))]
    fn new(addr: u64, size: u64, mr_id: u64, lkeys: Vec<u32>, rkeys: Vec<u32>) -> Self {
        Self {
            addr,
            size,
            mr_id,
            lkeys,
            rkeys,
            ipc_info: Vec::new(),
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "<XferDesc addr={} size={} mr_id={}>",
            self.addr, self.size, self.mr_id
        )
    }
}

impl XferDesc {
    /// The travelling form (without `mr_id`, which means nothing to the peer).
    pub fn to_desc(&self) -> Desc {
        Desc {
            addr: self.addr,
            size: self.size,
            lkeys: self.lkeys.clone(),
            rkeys: self.rkeys.clone(),
            ipc_info: self.ipc_info.clone(),
        }
    }

    /// A peer's descriptor: no local registration.
    pub fn from_desc(d: Desc) -> Self {
        Self {
            addr: d.addr,
            size: d.size,
            mr_id: NO_MR,
            lkeys: d.lkeys,
            rkeys: d.rkeys,
            ipc_info: d.ipc_info,
        }
    }
}

/// UCCL's `p2p.XferHandle`: names an asynchronous transfer (`conn_id`, `op_name` `"read"`
/// or `"write"`, `transfer_id` for `poll_async`). Read-only.
#[pyclass(frozen, module = "tcpx.p2p", name = "XferHandle")]
#[derive(Debug, Clone)]
pub struct XferHandle {
    /// The connection.
    #[pyo3(get)]
    pub conn_id: u64,
    /// `"read"` or `"write"`.
    #[pyo3(get)]
    pub op_name: String,
    /// The id `poll_async` takes.
    #[pyo3(get)]
    pub transfer_id: u64,
}

#[pymethods]
impl XferHandle {
    #[new]
    fn new(conn_id: u64, op_name: String, transfer_id: u64) -> Self {
        Self {
            conn_id,
            op_name,
            transfer_id,
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "<XferHandle conn_id={} op_name={:?} transfer_id={}>",
            self.conn_id, self.op_name, self.transfer_id
        )
    }
}
