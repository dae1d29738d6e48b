// wire.h: the bytes this plugin puts into NIXL's metadata and into tcpx notifications.
//
// The formats (connection info "TXC1" [+ "TXL1"], public memory data "TXM1" [+ IPC tail],
// notification payload kind | agent | message) are defined, encoded and decoded by tcpx itself
// (tcpx-proto's `nixl` module, fuzzed there) and reached through the C API's `tcpx_nixl_*`
// functions: this plugin keeps no parser of peer bytes of its own. These wrappers only turn
// the C calls into C++ values; a decoder answers nothing (std::nullopt) for bytes that are
// not ours, and `lastDecodeError()` says what was wrong.

#ifndef TCPX_NIXL_WIRE_H
#define TCPX_NIXL_WIRE_H

#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "tcpx.h"

namespace tcpx_nixl::wire {

/// Why a notification was sent: the first byte of every payload this plugin sends.
enum class NotifKind : uint8_t {
    /// Sent once by the side that dialed a connection, naming its agent, so that the accepting
    /// side knows which agent the accepted connection belongs to (tcpx reports only addresses).
    /// Its message is the dialer's control address (empty from older plugins): the same agent
    /// dialing again comes from the same endpoint, an agent replaced under the same name from
    /// another one.
    Hello = TCPX_NIXL_NOTIF_HELLO,
    /// A NIXL notification (genNotif, or the one of a WRITE / READ).
    User = TCPX_NIXL_NOTIF_USER,
};

/// Largest agent name a notification can carry (u16 length).
inline constexpr size_t kMaxAgentName = TCPX_NIXL_MAX_AGENT_NAME;

/// What tcpx said about the last bytes a decoder here refused (this thread).
inline std::string lastDecodeError() { return tcpx_last_error(); }

/// Runs a `tcpx_nixl_*_encode` call with the size protocol of `tcpx_endpoint_metadata`
/// (ask, then fill); throws with tcpx's message when the values cannot be encoded.
template <class Call>
inline std::string encodeWith(const char *what, Call call) {
    size_t len = 0;
    tcpx_status st = call(nullptr, &len);
    if (st != TCPX_ERR_BUFFER_TOO_SMALL && st != TCPX_OK) {
        throw std::runtime_error(std::string(what) + ": " + tcpx_last_error());
    }
    std::string out(len, '\0');
    st = call(reinterpret_cast<uint8_t *>(out.data()), &len);
    if (st != TCPX_OK) throw std::runtime_error(std::string(what) + ": " + tcpx_last_error());
    out.resize(len);
    return out;
}

inline const uint8_t *bytesOf(const std::string &s) {
    return reinterpret_cast<const uint8_t *>(s.data());
}

/// What a peer's connection info holds: its endpoint metadata and, when it sent it, its
/// same-host info.
struct ConnInfo {
    std::vector<uint8_t> metadata;
    std::vector<uint8_t> local;  // empty: no same-host route offered
};

/// Connection info: the endpoint metadata a peer needs to reach this engine, and the
/// same-host info that lets a peer of this host use CUDA IPC (empty: none).
inline std::string encodeConnInfo(const std::vector<uint8_t> &metadata,
                                  const std::vector<uint8_t> &local) {
    return encodeWith("encoding the connection info", [&](uint8_t *buf, size_t *len) {
        return tcpx_nixl_conn_info_encode(metadata.data(), metadata.size(), local.data(),
                                          local.size(), buf, len);
    });
}

/// The contents of a peer's connection info, or nothing when it is not ours.
inline std::optional<ConnInfo> decodeConnInfo(const std::string &in) {
    tcpx_nixl_conn_info parts{};
    if (tcpx_nixl_conn_info_decode(bytesOf(in), in.size(), &parts) != TCPX_OK) return std::nullopt;
    const uint8_t *b = bytesOf(in);
    ConnInfo out;
    out.metadata.assign(b + parts.metadata_offset, b + parts.metadata_offset + parts.metadata_len);
    out.local.assign(b + parts.local_offset, b + parts.local_offset + parts.local_len);
    return out;
}

/// What a peer needs to address one registered range: its base, length and tcpx descriptor.
struct PublicMem {
    uint32_t memType = 0;
    uint64_t base = 0;
    uint64_t len = 0;
    uint8_t descriptor[TCPX_DESCRIPTOR_BYTES] = {};
    bool hasIpc = false;
    uint8_t ipcDescriptor[TCPX_IPC_DESCRIPTOR_BYTES] = {};
};

inline std::string encodePublicMem(const PublicMem &m) {
    tcpx_nixl_public_mem c{};
    c.mem_type = m.memType;
    c.base = m.base;
    c.len = m.len;
    std::memcpy(c.descriptor, m.descriptor, TCPX_DESCRIPTOR_BYTES);
    c.has_ipc = m.hasIpc;
    std::memcpy(c.ipc_descriptor, m.ipcDescriptor, TCPX_IPC_DESCRIPTOR_BYTES);
    return encodeWith("encoding public memory data", [&](uint8_t *buf, size_t *len) {
        return tcpx_nixl_public_mem_encode(&c, buf, len);
    });
}

inline std::optional<PublicMem> decodePublicMem(const std::string &in) {
    tcpx_nixl_public_mem c{};
    if (tcpx_nixl_public_mem_decode(bytesOf(in), in.size(), &c) != TCPX_OK) return std::nullopt;
    PublicMem m;
    m.memType = c.mem_type;
    m.base = c.base;
    m.len = c.len;
    std::memcpy(m.descriptor, c.descriptor, TCPX_DESCRIPTOR_BYTES);
    m.hasIpc = c.has_ipc;
    std::memcpy(m.ipcDescriptor, c.ipc_descriptor, TCPX_IPC_DESCRIPTOR_BYTES);
    return m;
}

/// A notification payload: kind, sending agent, message.
inline std::string encodeNotif(NotifKind kind, const std::string &agent, const std::string &msg) {
    return encodeWith("encoding a notification", [&](uint8_t *buf, size_t *len) {
        return tcpx_nixl_notif_encode(static_cast<uint8_t>(kind), bytesOf(agent), agent.size(),
                                      bytesOf(msg), msg.size(), buf, len);
    });
}

/// Bytes a payload adds to the message (for the TCPX_NOTIFICATION_MAX_BYTES check).
inline size_t notifOverhead(const std::string &agent) { return 3 + agent.size(); }

struct Notif {
    NotifKind kind;
    std::string agent;
    std::string msg;
};

inline std::optional<Notif> decodeNotif(const std::string &in) {
    tcpx_nixl_notif parts{};
    if (tcpx_nixl_notif_decode(bytesOf(in), in.size(), &parts) != TCPX_OK) return std::nullopt;
    return Notif{static_cast<NotifKind>(parts.kind), in.substr(parts.agent_offset, parts.agent_len),
                 in.substr(parts.msg_offset, parts.msg_len)};
}

}  // namespace tcpx_nixl::wire

#endif  // TCPX_NIXL_WIRE_H
