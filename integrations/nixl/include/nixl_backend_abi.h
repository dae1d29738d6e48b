// nixl_backend_abi.h: the part of NIXL's backend-plugin interface that libplugin_TCPX.so uses,
// declared in our own words so the plugin builds without NIXL's sources or headers.
//
// Matches NIXL 1.5.1 (PyPI nixl-cu12 1.5.1, libnixl git 1d2a52eb) on x86-64 Linux with the
// cxx11 libstdc++ ABI. The public headers of ai-dynamo/nixl release/1.4.1 (3a2342d8) and main
// (8770b655, 2026-08-21) declare the same layouts; `integrations/nixl/probe/abi_probe.cpp`
// checks every size, offset and virtual slot below against those headers (build it with
// `cargo xtask nixl --probe NIXL_SRC`). Re-run it on every NIXL release.
//
// Rules this header keeps:
// - Only layouts and virtual slot order matter to NIXL: names live in namespace `nixl_abi` so
//   the probe can include NIXL's headers next to this one.
// - Everything here is inline or a declaration the plugin never calls, so the plugin links no
//   NIXL symbol; the plugin is built with hidden visibility so these inline copies never bind
//   to libnixl's.
// - NIXL's core never uses dynamic_cast / typeid on engines or metadata; it calls the virtual
//   functions through these slots and reads the base class fields through inline getters.

#ifndef TCPX_NIXL_BACKEND_ABI_H
#define TCPX_NIXL_BACKEND_ABI_H

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace nixl_abi {

/// NIXL's plugin API version (`nixlBackendPlugin::api_version`); the agent refuses any other.
inline constexpr int kPluginApiVersion = 1;

/// The NIXL release whose layouts this header reproduces (for log lines).
inline constexpr const char *kMatchedNixlVersion = "1.5.1";

/// Where memory lives (`nixl_mem_t`).
enum MemType : int { DRAM_SEG = 0, VRAM_SEG = 1, BLK_SEG = 2, OBJ_SEG = 3, FILE_SEG = 4 };

/// Direction of a transfer, seen from the initiator (`nixl_xfer_op_t`).
enum XferOp : int { NIXL_READ = 0, NIXL_WRITE = 1 };

/// NIXL status codes (`nixl_status_t`): 0 success, 1 in progress, negative errors.
enum Status : int {
    NIXL_IN_PROG = 1,
    NIXL_SUCCESS = 0,
    NIXL_ERR_NOT_POSTED = -1,
    NIXL_ERR_INVALID_PARAM = -2,
    NIXL_ERR_BACKEND = -3,
    NIXL_ERR_NOT_FOUND = -4,
    NIXL_ERR_MISMATCH = -5,
    NIXL_ERR_NOT_ALLOWED = -6,
    NIXL_ERR_REPOST_ACTIVE = -7,
    NIXL_ERR_UNKNOWN = -8,
    NIXL_ERR_NOT_SUPPORTED = -9,
    NIXL_ERR_REMOTE_DISCONNECT = -10,
    NIXL_ERR_CANCELED = -11,
    NIXL_ERR_NO_TELEMETRY = -12,
};

/// Agent thread-safety mode handed to engines (`nixl_thread_sync_t`, int-sized).
enum class ThreadSync : int { NONE = 0, STRICT = 1, RW = 2 };

/// Cost-estimate method (`nixl_cost_t`, int-sized).
enum class CostMethod : int { ANALYTICAL_BACKEND = 0 };

/// Backend parameters by name (`nixl_b_params_t`).
using Params = std::unordered_map<std::string, std::string>;
/// Memory kinds a backend takes (`nixl_mem_list_t`).
using MemList = std::vector<MemType>;
/// Received notifications: (sending agent, message) (`notif_list_t`).
using NotifList = std::vector<std::pair<std::string, std::string>>;
/// Answer of `queryMem` per descriptor (`nixl_query_resp_t`).
using QueryResp = std::optional<Params>;
/// Opaque memory-view handle (`nixlMemViewH`).
using MemViewHandle = void *;
/// The agent's own optional arguments (`nixl_opt_args_t`); engines here only pass it on.
struct AgentOptionalArgs;

/// A contiguous range: address, length, device (`nixlBasicDesc`, 24 bytes, no vptr).
struct BasicDesc {
    uintptr_t addr;
    size_t len;
    uint64_t devId;
};

/// A range with an opaque blob (`nixlBlobDesc`): on registration the caller's string, on
/// `loadRemoteMD` the peer's `getPublicData` bytes.
struct BlobDesc : BasicDesc {
    std::string metaInfo;
};

class BackendMD;

/// A range and the backend metadata NIXL matched to it (`nixlMetaDesc`).
struct MetaDesc : BasicDesc {
    BackendMD *metadataP;
};

/// A memory-view descriptor naming its remote agent (`nixlRemoteMetaDesc`).
struct RemoteMetaDesc : MetaDesc {
    std::string remoteAgent;
};

/// NIXL's descriptor list (`nixlDescList<T>`): vptr, memory type, vector of descriptors.
/// Engines only read lists NIXL built, so construction, copying and the four virtual
/// functions (destructor, resize, addDesc, getIndex) are NIXL's and not declared here; the
/// `vptr_` member stands for its vtable pointer.
template <class T>
class DescList {
public:
    DescList() = delete;
    DescList(const DescList &) = delete;
    DescList &operator=(const DescList &) = delete;

    MemType getType() const { return type_; }
    int descCount() const { return static_cast<int>(descs_.size()); }
    bool isEmpty() const { return descs_.empty(); }
    const T &operator[](size_t i) const { return descs_[i]; }
    typename std::vector<T>::const_iterator begin() const { return descs_.begin(); }
    typename std::vector<T>::const_iterator end() const { return descs_.end(); }

private:
    friend struct LayoutProbe;
    const void *vptr_;
    MemType type_;
    std::vector<T> descs_;
};

/// `nixl_meta_dlist_t`: what prepXfer / postXfer get on both sides.
using MetaDescList = DescList<MetaDesc>;
/// `nixl_reg_dlist_t`: what queryMem gets.
using RegDescList = DescList<BlobDesc>;
/// `nixl_remote_meta_dlist_t`: what the remote prepMemView gets.
using RemoteMetaDescList = DescList<RemoteMetaDesc>;

/// Options NIXL passes to prepXfer / postXfer (`nixlBackendOptionalArgs`).
struct BackendOptionalArgs {
    std::string notifMsg;
    bool hasNotif = false;
    std::string customParam;
};

/// What `create_engine` receives (`nixlBackendInitParams`).
struct BackendInitParams {
    std::string localAgent;
    std::string type;
    Params *customParams = nullptr;
    bool enableProgTh = false;
    uint64_t pthrDelay = 0;
    ThreadSync syncMode;
    bool enableTelemetry_ = false;
};

/// Base of every request handle an engine hands out (`nixlBackendReqH`): vptr only.
class BackendReqH {
public:
    BackendReqH() = default;
    virtual ~BackendReqH() {}
};

/// Base of every metadata object an engine hands out (`nixlBackendMD`): vptr and a flag.
class BackendMD {
public:
    explicit BackendMD(bool is_private) : isPrivateMD(is_private) {}
    virtual ~BackendMD() {}

protected:
    bool isPrivateMD;
};

/// One element of the engine's telemetry queue (NIXL's `nixlTelemetryEvent`: type, value).
/// This plugin never queues events; the type only gives the vector its element size.
struct TelemetryEvent {
    uint32_t type;
    uint64_t value;
};

/// The engine base class (`nixlBackendEngine`, 208 bytes). Field order and the 27 virtual
/// slots (two destructor entries, then supportsRemote ... estimateXferCost) are NIXL's; the
/// core reads `backendType`, `customParams` and `initErr` through inline getters right after
/// `create_engine`, so they must sit where NIXL expects them.
class BackendEngine {
public:
    explicit BackendEngine(const BackendInitParams *init)
        : backendType(init->type),
          customParams(init->customParams ? *init->customParams : Params{}),
          localAgent(init->localAgent),
          enableTelemetry_(init->enableTelemetry_) {}
    BackendEngine(const BackendEngine &) = delete;
    BackendEngine &operator=(const BackendEngine &) = delete;

    // Slots 0-1: complete and deleting destructor.
    virtual ~BackendEngine() = default;

    bool getInitErr() const noexcept { return initErr; }
    const std::string &getType() const noexcept { return backendType; }
    const Params &getCustomParams() const noexcept { return customParams; }

    // Slot 2..5
    virtual bool supportsRemote() const = 0;
    virtual bool supportsLocal() const = 0;
    virtual bool supportsNotif() const = 0;
    virtual MemList getSupportedMems() const = 0;

    // Slot 6..10
    virtual Status registerMem(const BlobDesc &mem, const MemType &type, BackendMD *&out) = 0;
    virtual Status deregisterMem(BackendMD *meta) = 0;
    virtual Status connect(const std::string &remote_agent) = 0;
    virtual Status disconnect(const std::string &remote_agent) = 0;
    virtual Status unloadMD(BackendMD *input) = 0;

    // Slot 11..14
    virtual Status prepXfer(const XferOp &op,
                            const MetaDescList &local,
                            const MetaDescList &remote,
                            const std::string &remote_agent,
                            BackendReqH *&handle,
                            const BackendOptionalArgs *opt_args = nullptr) const = 0;
    virtual Status postXfer(const XferOp &op,
                            const MetaDescList &local,
                            const MetaDescList &remote,
                            const std::string &remote_agent,
                            BackendReqH *&handle,
                            const BackendOptionalArgs *opt_args = nullptr) const = 0;
    virtual Status checkXfer(BackendReqH *handle) const = 0;
    virtual Status releaseReqH(BackendReqH *handle) const = 0;

    // Slot 15..17: memory views (device-side API); not offered by this plugin.
    virtual Status prepMemView(const RemoteMetaDescList &,
                               MemViewHandle &,
                               const BackendOptionalArgs * = nullptr) const {
        return NIXL_ERR_NOT_SUPPORTED;
    }
    virtual Status prepMemView(const MetaDescList &,
                               MemViewHandle &,
                               const BackendOptionalArgs * = nullptr) const {
        return NIXL_ERR_NOT_SUPPORTED;
    }
    virtual void releaseMemView(MemViewHandle) const {}

    // Slot 18..22: remote and local metadata.
    virtual Status getPublicData(const BackendMD *, std::string &) const { return NIXL_ERR_BACKEND; }
    virtual Status getConnInfo(std::string &) const { return NIXL_ERR_BACKEND; }
    virtual Status loadRemoteConnInfo(const std::string &, const std::string &) {
        return NIXL_ERR_BACKEND;
    }
    virtual Status loadRemoteMD(const BlobDesc &, const MemType &, const std::string &,
                                BackendMD *&) {
        return NIXL_ERR_BACKEND;
    }
    virtual Status loadLocalMD(BackendMD *, BackendMD *&) { return NIXL_ERR_BACKEND; }

    // Slot 23..24: notifications.
    virtual Status getNotifs(NotifList &) { return NIXL_ERR_BACKEND; }
    virtual Status genNotif(const std::string &, const std::string &) const {
        return NIXL_ERR_BACKEND;
    }

    // Slot 25..26: optional queries.
    virtual Status queryMem(const RegDescList &, std::vector<QueryResp> &) const {
        return NIXL_ERR_NOT_SUPPORTED;
    }
    virtual Status estimateXferCost(const XferOp &,
                                    const MetaDescList &,
                                    const MetaDescList &,
                                    const std::string &,
                                    BackendReqH *const &,
                                    std::chrono::microseconds &,
                                    std::chrono::microseconds &,
                                    CostMethod &,
                                    const AgentOptionalArgs * = nullptr) const {
        return NIXL_ERR_NOT_SUPPORTED;
    }

private:
    friend struct LayoutProbe;
    std::string backendType;
    Params customParams;
    std::vector<TelemetryEvent> telemetryEvents_;
    std::mutex telemetryEventsMutex_;

protected:
    bool initErr = false;
    const std::string localAgent;
    const bool enableTelemetry_;
};

/// What `nixl_plugin_init` returns (`nixlBackendPlugin`): the API version, then six functions.
struct BackendPlugin {
    int api_version;
    BackendEngine *(*create_engine)(const BackendInitParams *init);
    void (*destroy_engine)(BackendEngine *engine);
    const char *(*get_plugin_name)();
    const char *(*get_plugin_version)();
    Params (*get_backend_options)();
    MemList (*get_backend_mems)();
};

/// Sizes and offsets of the layouts above; `abi_probe.cpp` asserts NIXL's real ones are equal.
namespace layout {
inline constexpr size_t kBasicDesc = 24;
inline constexpr size_t kBlobDesc = 56;
inline constexpr size_t kMetaDesc = 32;
inline constexpr size_t kRemoteMetaDesc = 64;
inline constexpr size_t kDescList = 40;
inline constexpr size_t kBackendMD = 16;
inline constexpr size_t kBackendReqH = 8;
inline constexpr size_t kOptionalArgs = 72;
inline constexpr size_t kInitParams = 96;
inline constexpr size_t kEngine = 208;
inline constexpr size_t kPlugin = 56;
inline constexpr size_t kEngineInitErr = 160;
inline constexpr size_t kEngineLocalAgent = 168;
inline constexpr size_t kEngineEnableTelemetry = 200;
}  // namespace layout

static_assert(sizeof(BasicDesc) == layout::kBasicDesc);
static_assert(sizeof(BlobDesc) == layout::kBlobDesc);
static_assert(sizeof(MetaDesc) == layout::kMetaDesc);
static_assert(sizeof(RemoteMetaDesc) == layout::kRemoteMetaDesc);
static_assert(sizeof(DescList<MetaDesc>) == layout::kDescList);
static_assert(sizeof(BackendMD) == layout::kBackendMD);
static_assert(sizeof(BackendReqH) == layout::kBackendReqH);
static_assert(sizeof(BackendOptionalArgs) == layout::kOptionalArgs);
static_assert(sizeof(BackendInitParams) == layout::kInitParams);
static_assert(sizeof(BackendEngine) == layout::kEngine);
static_assert(sizeof(BackendPlugin) == layout::kPlugin);

}  // namespace nixl_abi

#endif  // TCPX_NIXL_BACKEND_ABI_H
