// wire.h: the bytes this plugin puts into NIXL's metadata and into tcpx notifications.
//
// Three small formats, each opened by a 4-byte magic so that a blob from another backend, an
// older plugin or a corrupted exchange is refused with a message instead of being trusted:
// - connection info (getConnInfo):  "TXC1" | u32 metadata length | tcpx endpoint metadata
//   [ | "TXL1" | u32 local info length | tcpx same-host info (tcpx_endpoint_local_info) ]
// - public memory data (getPublicData): "TXM1" | u32 memory type | u64 base | u64 length |
//   tcpx descriptor (TCPX_DESCRIPTOR_BYTES) [ | u8 1 | same-host (CUDA IPC) descriptor
//   (TCPX_IPC_DESCRIPTOR_BYTES), VRAM that could be exported only ]
// - notification payload: u8 kind | u16 agent-name length | agent name | message
// The bracketed tails are optional: a peer without them (no same-host info, memory without an
// IPC descriptor) is reached over the network.
// Integers are little-endian (x86-64 and aarch64 hosts only; both ends run this plugin).

#ifndef TCPX_NIXL_WIRE_H
#define TCPX_NIXL_WIRE_H

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "tcpx.h"

namespace tcpx_nixl::wire {

inline constexpr char kConnMagic[4] = {'T', 'X', 'C', '1'};
inline constexpr char kMemMagic[4] = {'T', 'X', 'M', '1'};
inline constexpr char kLocalMagic[4] = {'T', 'X', 'L', '1'};

/// Why a notification was sent: the first byte of every payload this plugin sends.
enum class NotifKind : uint8_t {
    /// Sent once by the side that dialed a connection, naming its agent, so that the accepting
    /// side knows which agent the accepted connection belongs to (tcpx reports only addresses).
    /// Its message is the dialer's control address (empty from older plugins): the same agent
    /// dialing again comes from the same endpoint, an agent replaced under the same name from
    /// another one.
    Hello = 1,
    /// A NIXL notification (genNotif, or the one of a WRITE / READ).
    User = 2,
};

/// Largest agent name a notification can carry (u16 length).
inline constexpr size_t kMaxAgentName = 0xffff;

template <class T>
inline void put(std::string &out, T v) {
    out.append(reinterpret_cast<const char *>(&v), sizeof v);
}

template <class T>
inline bool get(const std::string &in, size_t &at, T &v) {
    if (in.size() < at || in.size() - at < sizeof v) return false;
    std::memcpy(&v, in.data() + at, sizeof v);
    at += sizeof v;
    return true;
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
    std::string out(kConnMagic, 4);
    put<uint32_t>(out, static_cast<uint32_t>(metadata.size()));
    out.append(reinterpret_cast<const char *>(metadata.data()), metadata.size());
    if (!local.empty()) {
        out.append(kLocalMagic, 4);
        put<uint32_t>(out, static_cast<uint32_t>(local.size()));
        out.append(reinterpret_cast<const char *>(local.data()), local.size());
    }
    return out;
}

/// The contents of a peer's connection info, or nothing when it is not ours.
inline std::optional<ConnInfo> decodeConnInfo(const std::string &in) {
    size_t at = 4;
    uint32_t n = 0;
    if (in.size() < 4 || std::memcmp(in.data(), kConnMagic, 4) != 0) return std::nullopt;
    if (!get(in, at, n) || n == 0 || n > TCPX_METADATA_MAX_BYTES || in.size() - at < n) {
        return std::nullopt;
    }
    ConnInfo out;
    out.metadata.assign(in.begin() + at, in.begin() + at + n);
    at += n;
    if (at == in.size()) return out;
    uint32_t m = 0;
    if (in.size() - at < 4 || std::memcmp(in.data() + at, kLocalMagic, 4) != 0) {
        return std::nullopt;
    }
    at += 4;
    if (!get(in, at, m) || m == 0 || m > TCPX_LOCAL_INFO_MAX_BYTES || in.size() - at != m) {
        return std::nullopt;
    }
    out.local.assign(in.begin() + at, in.end());
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

inline constexpr size_t kMemBytes = 4 + 4 + 8 + 8 + TCPX_DESCRIPTOR_BYTES;

inline std::string encodePublicMem(const PublicMem &m) {
    std::string out(kMemMagic, 4);
    put(out, m.memType);
    put(out, m.base);
    put(out, m.len);
    out.append(reinterpret_cast<const char *>(m.descriptor), TCPX_DESCRIPTOR_BYTES);
    if (m.hasIpc) {
        put<uint8_t>(out, 1);
        out.append(reinterpret_cast<const char *>(m.ipcDescriptor), TCPX_IPC_DESCRIPTOR_BYTES);
    }
    return out;
}

inline std::optional<PublicMem> decodePublicMem(const std::string &in) {
    PublicMem m;
    size_t at = 4;
    if (in.size() != kMemBytes && in.size() != kMemBytes + 1 + TCPX_IPC_DESCRIPTOR_BYTES) {
        return std::nullopt;
    }
    if (std::memcmp(in.data(), kMemMagic, 4) != 0) return std::nullopt;
    if (!get(in, at, m.memType) || !get(in, at, m.base) || !get(in, at, m.len)) {
        return std::nullopt;
    }
    std::memcpy(m.descriptor, in.data() + at, TCPX_DESCRIPTOR_BYTES);
    at += TCPX_DESCRIPTOR_BYTES;
    if (at < in.size()) {
        uint8_t flag = 0;
        if (!get(in, at, flag) || flag != 1) return std::nullopt;
        std::memcpy(m.ipcDescriptor, in.data() + at, TCPX_IPC_DESCRIPTOR_BYTES);
        m.hasIpc = true;
    }
    if (m.len == 0 || m.base + m.len < m.base) return std::nullopt;
    return m;
}

/// A notification payload: kind, sending agent, message.
inline std::string encodeNotif(NotifKind kind, const std::string &agent, const std::string &msg) {
    std::string out;
    out.reserve(3 + agent.size() + msg.size());
    put<uint8_t>(out, static_cast<uint8_t>(kind));
    put<uint16_t>(out, static_cast<uint16_t>(agent.size()));
    out += agent;
    out += msg;
    return out;
}

/// Bytes a payload adds to the message (for the TCPX_NOTIFICATION_MAX_BYTES check).
inline size_t notifOverhead(const std::string &agent) { return 3 + agent.size(); }

struct Notif {
    NotifKind kind;
    std::string agent;
    std::string msg;
};

inline std::optional<Notif> decodeNotif(const std::string &in) {
    size_t at = 0;
    uint8_t kind = 0;
    uint16_t n = 0;
    if (!get(in, at, kind) || !get(in, at, n) || in.size() - at < n) return std::nullopt;
    if (kind != static_cast<uint8_t>(NotifKind::Hello) &&
        kind != static_cast<uint8_t>(NotifKind::User)) {
        return std::nullopt;
    }
    Notif out{static_cast<NotifKind>(kind), in.substr(at, n), in.substr(at + n)};
    if (out.agent.empty()) return std::nullopt;
    return out;
}

}  // namespace tcpx_nixl::wire

#endif  // TCPX_NIXL_WIRE_H
