//! The NIXL backend plugin's byte formats (`integrations/nixl`): connection info, public
//! memory data and notification payloads, encoded and decoded by `tcpx-proto` (fuzzed there)
//! so the C++ plugin keeps no parser of peer bytes of its own. Decoders copy nothing: they
//! report where each part lies in the caller's bytes.

use tcpx_proto::nixl::{self, NixlWireError, NotifKind, PublicMem};

use crate::convert::{bytes, copy_out, non_null, write_out};
use crate::error::{guard, CapiError};
use crate::tcpx_status::{self, *};

/// `tcpx_nixl_notif::kind` of the Hello a dialing plugin sends first.
pub const TCPX_NIXL_NOTIF_HELLO: u8 = 1;
/// `tcpx_nixl_notif::kind` of a NIXL notification.
pub const TCPX_NIXL_NOTIF_USER: u8 = 2;
/// Largest public-memory blob (`tcpx_nixl_public_mem_encode`).
pub const TCPX_NIXL_PUBLIC_MEM_MAX_BYTES: usize = 179;
/// Largest agent name a notification carries.
pub const TCPX_NIXL_MAX_AGENT_NAME: usize = 65535;

// Literals above so that cbindgen writes them into the header; the formats' own limits:
const _: () = assert!(TCPX_NIXL_PUBLIC_MEM_MAX_BYTES == nixl::PUBLIC_MEM_IPC_BYTES);
const _: () = assert!(TCPX_NIXL_MAX_AGENT_NAME == nixl::MAX_AGENT_NAME);

/// Where the parts of a decoded connection info lie in the decoded bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct tcpx_nixl_conn_info {
    /// Offset of the endpoint metadata (for `tcpx_endpoint_connect`).
    pub metadata_offset: usize,
    /// Its length.
    pub metadata_len: usize,
    /// Offset of the same-host info (for `tcpx_endpoint_local_route`).
    pub local_offset: usize,
    /// Its length; 0 when the peer offered no same-host route.
    pub local_len: usize,
}

/// One registered range as a peer addresses it.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct tcpx_nixl_public_mem {
    /// NIXL's memory type, as NIXL numbers it.
    pub mem_type: u32,
    /// The owner's address of the range.
    pub base: u64,
    /// Bytes.
    pub len: u64,
    /// The one-sided descriptor (`tcpx_region_advertise`).
    pub descriptor: [u8; crate::TCPX_DESCRIPTOR_BYTES],
    /// Whether `ipc_descriptor` holds a same-host descriptor.
    pub has_ipc: bool,
    /// The same-host (CUDA IPC) descriptor (`tcpx_region_advertise_ipc`) when `has_ipc`.
    pub ipc_descriptor: [u8; crate::TCPX_IPC_DESCRIPTOR_BYTES],
}

/// Where the parts of a decoded notification payload lie in the decoded bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct tcpx_nixl_notif {
    /// `TCPX_NIXL_NOTIF_HELLO` or `TCPX_NIXL_NOTIF_USER`.
    pub kind: u8,
    /// Offset of the sending agent's name.
    pub agent_offset: usize,
    /// Its length (never 0).
    pub agent_len: usize,
    /// Offset of the message.
    pub msg_offset: usize,
    /// Its length.
    pub msg_len: usize,
}

fn protocol(e: NixlWireError) -> CapiError {
    CapiError::new(TCPX_ERR_PROTOCOL, e.to_string())
}

fn invalid(e: NixlWireError) -> CapiError {
    CapiError::invalid(e.to_string())
}

/// Encodes the connection info of an endpoint: its metadata (`tcpx_endpoint_metadata`) and
/// its same-host info (`tcpx_endpoint_local_info`; `local_len` 0: none) into `buf`, whose
/// capacity is `*len` (see `tcpx_endpoint_metadata` for the size protocol). Thread safety:
/// any thread.
///
/// # Safety
/// `metadata` points to `metadata_len` readable bytes, `local` to `local_len` (or is NULL
/// with 0); `len` points to a readable and writable `size_t`; `buf` is NULL or points to
/// `*len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn tcpx_nixl_conn_info_encode(
    metadata: *const u8,
    metadata_len: usize,
    local: *const u8,
    local_len: usize,
    buf: *mut u8,
    len: *mut usize,
) -> tcpx_status {
    guard("tcpx_nixl_conn_info_encode", || {
        non_null(len, "len")?;
        // SAFETY: the caller's promise on both ranges.
        let (metadata, local) = unsafe {
            (
                bytes(metadata, metadata_len, "metadata")?,
                bytes(local, local_len, "local")?,
            )
        };
        let blob = nixl::encode_conn_info(metadata, local).map_err(invalid)?;
        // SAFETY: `len` checked non-null; the rest is the caller's promise.
        unsafe { copy_out(&blob, buf, len, "connection info")? };
        Ok(TCPX_OK)
    })
}

/// Decodes a peer's connection info (`in_len` bytes at `in`) into `*out`: where its metadata
/// and same-host info lie in those bytes. Bytes that are not one fail with
/// `TCPX_ERR_PROTOCOL` and a message saying what is wrong. Thread safety: any thread.
///
/// # Safety
/// `in` points to `in_len` readable bytes; `out` to a writable `tcpx_nixl_conn_info`.
#[no_mangle]
pub unsafe extern "C" fn tcpx_nixl_conn_info_decode(
    r#in: *const u8,
    in_len: usize,
    out: *mut tcpx_nixl_conn_info,
) -> tcpx_status {
    guard("tcpx_nixl_conn_info_decode", || {
        non_null(out, "out")?;
        // SAFETY: the caller's promise.
        let input = unsafe { bytes(r#in, in_len, "in")? };
        let p = nixl::decode_conn_info(input).map_err(protocol)?;
        let value = tcpx_nixl_conn_info {
            metadata_offset: p.metadata.0,
            metadata_len: p.metadata.1,
            local_offset: p.local.0,
            local_len: p.local.1,
        };
        // SAFETY: non-null (checked); writable (the caller's promise).
        unsafe { write_out(out, value) };
        Ok(TCPX_OK)
    })
}

/// Encodes `*mem` into `buf` (at most `TCPX_NIXL_PUBLIC_MEM_MAX_BYTES`; capacity `*len`, as
/// `tcpx_endpoint_metadata`). Thread safety: any thread.
///
/// # Safety
/// `mem` points to a readable `tcpx_nixl_public_mem`; `len` to a readable and writable
/// `size_t`; `buf` is NULL or points to `*len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn tcpx_nixl_public_mem_encode(
    mem: *const tcpx_nixl_public_mem,
    buf: *mut u8,
    len: *mut usize,
) -> tcpx_status {
    guard("tcpx_nixl_public_mem_encode", || {
        non_null(mem, "mem")?;
        non_null(len, "len")?;
        // SAFETY: non-null (checked); a readable struct (the caller's promise).
        let m = unsafe { mem.read() };
        let blob = PublicMem {
            mem_type: m.mem_type,
            base: m.base,
            len: m.len,
            descriptor: m.descriptor,
            ipc: m.has_ipc.then_some(m.ipc_descriptor),
        }
        .encode();
        // SAFETY: `len` checked non-null; the rest is the caller's promise.
        unsafe { copy_out(&blob, buf, len, "public memory data")? };
        Ok(TCPX_OK)
    })
}

/// Decodes a peer's public memory data into `*out`; bytes that are not one fail with
/// `TCPX_ERR_PROTOCOL`. The descriptors inside are checked when used (`tcpx_connection_write`
/// and its kin). Thread safety: any thread.
///
/// # Safety
/// `in` points to `in_len` readable bytes; `out` to a writable `tcpx_nixl_public_mem`.
#[no_mangle]
pub unsafe extern "C" fn tcpx_nixl_public_mem_decode(
    r#in: *const u8,
    in_len: usize,
    out: *mut tcpx_nixl_public_mem,
) -> tcpx_status {
    guard("tcpx_nixl_public_mem_decode", || {
        non_null(out, "out")?;
        // SAFETY: the caller's promise.
        let input = unsafe { bytes(r#in, in_len, "in")? };
        let m = PublicMem::decode(input).map_err(protocol)?;
        let value = tcpx_nixl_public_mem {
            mem_type: m.mem_type,
            base: m.base,
            len: m.len,
            descriptor: m.descriptor,
            has_ipc: m.ipc.is_some(),
            ipc_descriptor: m.ipc.unwrap_or([0; crate::TCPX_IPC_DESCRIPTOR_BYTES]),
        };
        // SAFETY: non-null (checked); writable (the caller's promise).
        unsafe { write_out(out, value) };
        Ok(TCPX_OK)
    })
}

/// Encodes a notification payload of `kind` (`TCPX_NIXL_NOTIF_*`) from agent
/// `agent[0..agent_len)` (1..=`TCPX_NIXL_MAX_AGENT_NAME` bytes) with message
/// `msg[0..msg_len)` into `buf` (capacity `*len`, as `tcpx_endpoint_metadata`; the payload is
/// `3 + agent_len + msg_len` bytes). Thread safety: any thread.
///
/// # Safety
/// `agent` points to `agent_len` readable bytes, `msg` to `msg_len` (or is NULL with 0);
/// `len` to a readable and writable `size_t`; `buf` is NULL or points to `*len` writable
/// bytes.
#[no_mangle]
pub unsafe extern "C" fn tcpx_nixl_notif_encode(
    kind: u8,
    agent: *const u8,
    agent_len: usize,
    msg: *const u8,
    msg_len: usize,
    buf: *mut u8,
    len: *mut usize,
) -> tcpx_status {
    guard("tcpx_nixl_notif_encode", || {
        non_null(len, "len")?;
        let kind = match kind {
            TCPX_NIXL_NOTIF_HELLO => NotifKind::Hello,
            TCPX_NIXL_NOTIF_USER => NotifKind::User,
            k => {
                return Err(CapiError::invalid(format!(
                    "notification kind {k} (TCPX_NIXL_NOTIF_HELLO or TCPX_NIXL_NOTIF_USER)"
                )))
            }
        };
        // SAFETY: the caller's promise on both ranges.
        let (agent, msg) = unsafe {
            (
                bytes(agent, agent_len, "agent")?,
                bytes(msg, msg_len, "msg")?,
            )
        };
        let blob = nixl::encode_notif(kind, agent, msg).map_err(invalid)?;
        // SAFETY: `len` checked non-null; the rest is the caller's promise.
        unsafe { copy_out(&blob, buf, len, "notification payload")? };
        Ok(TCPX_OK)
    })
}

/// Decodes a notification payload into `*out` (where its agent name and message lie); bytes
/// that are not one fail with `TCPX_ERR_PROTOCOL`. Thread safety: any thread.
///
/// # Safety
/// `in` points to `in_len` readable bytes; `out` to a writable `tcpx_nixl_notif`.
#[no_mangle]
pub unsafe extern "C" fn tcpx_nixl_notif_decode(
    r#in: *const u8,
    in_len: usize,
    out: *mut tcpx_nixl_notif,
) -> tcpx_status {
    guard("tcpx_nixl_notif_decode", || {
        non_null(out, "out")?;
        // SAFETY: the caller's promise.
        let input = unsafe { bytes(r#in, in_len, "in")? };
        let p = nixl::decode_notif(input).map_err(protocol)?;
        let value = tcpx_nixl_notif {
            kind: p.kind as u8,
            agent_offset: p.agent.0,
            agent_len: p.agent.1,
            msg_offset: p.msg.0,
            msg_len: p.msg.1,
        };
        // SAFETY: non-null (checked); writable (the caller's promise).
        unsafe { write_out(out, value) };
        Ok(TCPX_OK)
    })
}
