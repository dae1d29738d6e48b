// abi_probe.cpp: checks that include/nixl_backend_abi.h reproduces NIXL's real backend layouts.
//
// Built only against a NIXL source checkout that lives outside this repository (NIXL's headers
// are not part of it): `cargo xtask nixl --probe /path/to/nixl` compiles this file with
// -I <nixl>/src/api/cpp -I <nixl>/src/api/cpp/backend -I <nixl>/src/core/telemetry
// -I <nixl>/src/utils and a stand-in for NIXL's absl logging header, then runs it.
// Sizes are static_asserts; private offsets and virtual slots are read at run time (through
// NIXL's own inline getters and the Itanium member-pointer encoding), and any difference fails
// with the name of what differs.

#include <cstddef>
#include <cstdio>
#include <cstring>

#include "backend/backend_engine.h"
#include "backend/backend_plugin.h"
#include "nixl_backend_abi.h"

namespace ours = nixl_abi;

#pragma GCC diagnostic ignored "-Winvalid-offsetof"
#pragma GCC diagnostic ignored "-Wenum-compare"

#define SAME_SIZE(theirs, mine) \
    static_assert(sizeof(theirs) == sizeof(mine), "size of " #theirs " differs")
#define SAME_OFFSET(theirs, mine, field) \
    static_assert(offsetof(theirs, field) == offsetof(mine, field), #theirs "::" #field)

SAME_SIZE(nixlBasicDesc, ours::BasicDesc);
SAME_SIZE(nixlBlobDesc, ours::BlobDesc);
SAME_SIZE(nixlMetaDesc, ours::MetaDesc);
SAME_SIZE(nixlRemoteMetaDesc, ours::RemoteMetaDesc);
SAME_SIZE(nixl_meta_dlist_t, ours::MetaDescList);
SAME_SIZE(nixl_reg_dlist_t, ours::RegDescList);
SAME_SIZE(nixlBackendMD, ours::BackendMD);
SAME_SIZE(nixlBackendReqH, ours::BackendReqH);
SAME_SIZE(nixlBackendOptionalArgs, ours::BackendOptionalArgs);
SAME_SIZE(nixlBackendInitParams, ours::BackendInitParams);
SAME_SIZE(nixlBackendEngine, ours::BackendEngine);
SAME_SIZE(nixlBackendPlugin, ours::BackendPlugin);
SAME_SIZE(nixl_mem_t, ours::MemType);
SAME_SIZE(nixl_xfer_op_t, ours::XferOp);
SAME_SIZE(nixl_status_t, ours::Status);
SAME_SIZE(nixl_thread_sync_t, ours::ThreadSync);
SAME_SIZE(nixl_cost_t, ours::CostMethod);
SAME_SIZE(nixl_b_params_t, ours::Params);
SAME_SIZE(nixl_mem_list_t, ours::MemList);
SAME_SIZE(notif_list_t, ours::NotifList);

SAME_OFFSET(nixlBasicDesc, ours::BasicDesc, addr);
SAME_OFFSET(nixlBasicDesc, ours::BasicDesc, len);
SAME_OFFSET(nixlBasicDesc, ours::BasicDesc, devId);
SAME_OFFSET(nixlBlobDesc, ours::BlobDesc, metaInfo);
SAME_OFFSET(nixlMetaDesc, ours::MetaDesc, metadataP);
SAME_OFFSET(nixlRemoteMetaDesc, ours::RemoteMetaDesc, remoteAgent);
SAME_OFFSET(nixlBackendOptionalArgs, ours::BackendOptionalArgs, notifMsg);
SAME_OFFSET(nixlBackendOptionalArgs, ours::BackendOptionalArgs, hasNotif);
SAME_OFFSET(nixlBackendOptionalArgs, ours::BackendOptionalArgs, customParam);
SAME_OFFSET(nixlBackendInitParams, ours::BackendInitParams, localAgent);
SAME_OFFSET(nixlBackendInitParams, ours::BackendInitParams, type);
SAME_OFFSET(nixlBackendInitParams, ours::BackendInitParams, customParams);
SAME_OFFSET(nixlBackendInitParams, ours::BackendInitParams, enableProgTh);
SAME_OFFSET(nixlBackendInitParams, ours::BackendInitParams, pthrDelay);
SAME_OFFSET(nixlBackendInitParams, ours::BackendInitParams, syncMode);
SAME_OFFSET(nixlBackendInitParams, ours::BackendInitParams, enableTelemetry_);
SAME_OFFSET(nixlBackendPlugin, ours::BackendPlugin, api_version);
SAME_OFFSET(nixlBackendPlugin, ours::BackendPlugin, create_engine);
SAME_OFFSET(nixlBackendPlugin, ours::BackendPlugin, destroy_engine);
SAME_OFFSET(nixlBackendPlugin, ours::BackendPlugin, get_plugin_name);
SAME_OFFSET(nixlBackendPlugin, ours::BackendPlugin, get_plugin_version);
SAME_OFFSET(nixlBackendPlugin, ours::BackendPlugin, get_backend_options);
SAME_OFFSET(nixlBackendPlugin, ours::BackendPlugin, get_backend_mems);
static_assert(NIXL_PLUGIN_API_VERSION == ours::kPluginApiVersion, "plugin API version");

static_assert(DRAM_SEG == ours::DRAM_SEG && VRAM_SEG == ours::VRAM_SEG && BLK_SEG == ours::BLK_SEG &&
              OBJ_SEG == ours::OBJ_SEG && FILE_SEG == ours::FILE_SEG, "nixl_mem_t values");
static_assert(NIXL_READ == ours::NIXL_READ && NIXL_WRITE == ours::NIXL_WRITE, "xfer op values");
static_assert(NIXL_IN_PROG == ours::NIXL_IN_PROG && NIXL_SUCCESS == ours::NIXL_SUCCESS &&
              NIXL_ERR_NOT_POSTED == ours::NIXL_ERR_NOT_POSTED &&
              NIXL_ERR_INVALID_PARAM == ours::NIXL_ERR_INVALID_PARAM &&
              NIXL_ERR_BACKEND == ours::NIXL_ERR_BACKEND &&
              NIXL_ERR_NOT_FOUND == ours::NIXL_ERR_NOT_FOUND &&
              NIXL_ERR_MISMATCH == ours::NIXL_ERR_MISMATCH &&
              NIXL_ERR_NOT_ALLOWED == ours::NIXL_ERR_NOT_ALLOWED &&
              NIXL_ERR_REPOST_ACTIVE == ours::NIXL_ERR_REPOST_ACTIVE &&
              NIXL_ERR_UNKNOWN == ours::NIXL_ERR_UNKNOWN &&
              NIXL_ERR_NOT_SUPPORTED == ours::NIXL_ERR_NOT_SUPPORTED &&
              NIXL_ERR_REMOTE_DISCONNECT == ours::NIXL_ERR_REMOTE_DISCONNECT &&
              NIXL_ERR_CANCELED == ours::NIXL_ERR_CANCELED &&
              NIXL_ERR_NO_TELEMETRY == ours::NIXL_ERR_NO_TELEMETRY,
              "nixl_status_t values");
static_assert(int(nixl_thread_sync_t::NIXL_THREAD_SYNC_STRICT) == int(ours::ThreadSync::STRICT) &&
              int(nixl_thread_sync_t::NIXL_THREAD_SYNC_RW) == int(ours::ThreadSync::RW),
              "thread sync values");

namespace nixl_abi {
// Friend of our classes: reads their private offsets.
struct LayoutProbe {
    static size_t listType() { return offsetof(MetaDescList, type_); }
    static size_t listDescs() { return offsetof(MetaDescList, descs_); }
    static size_t engType() { return offsetof(BackendEngine, backendType); }
    static size_t engParams() { return offsetof(BackendEngine, customParams); }
    static size_t engTelemetry() { return offsetof(BackendEngine, telemetryEvents_); }
    static size_t engMutex() { return offsetof(BackendEngine, telemetryEventsMutex_); }
    static size_t engInitErr() { return offsetof(BackendEngine, initErr); }
    static size_t engLocalAgent() { return offsetof(BackendEngine, localAgent); }
    static size_t engTelemetryFlag() { return offsetof(BackendEngine, enableTelemetry_); }
};
}  // namespace nixl_abi

// Derived from NIXL's classes: reads their protected offsets.
struct TheirList : nixl_meta_dlist_t {
    static size_t typeOff() { return offsetof(TheirList, type); }
    static size_t descsOff() { return offsetof(TheirList, descs); }
};

struct TheirEngine : nixlBackendEngine {
    using nixlBackendEngine::nixlBackendEngine;
    static size_t initErrOff() { return offsetof(TheirEngine, initErr); }
    static size_t localAgentOff() { return offsetof(TheirEngine, localAgent); }
    static size_t telemetryOff() { return offsetof(TheirEngine, enableTelemetry_); }
    bool supportsRemote() const override { return true; }
    bool supportsLocal() const override { return true; }
    bool supportsNotif() const override { return true; }
    nixl_mem_list_t getSupportedMems() const override { return {}; }
    nixl_status_t registerMem(const nixlBlobDesc &, const nixl_mem_t &, nixlBackendMD *&) override {
        return NIXL_SUCCESS;
    }
    nixl_status_t deregisterMem(nixlBackendMD *) override { return NIXL_SUCCESS; }
    nixl_status_t connect(const std::string &) override { return NIXL_SUCCESS; }
    nixl_status_t disconnect(const std::string &) override { return NIXL_SUCCESS; }
    nixl_status_t unloadMD(nixlBackendMD *) override { return NIXL_SUCCESS; }
    nixl_status_t prepXfer(const nixl_xfer_op_t &, const nixl_meta_dlist_t &,
                           const nixl_meta_dlist_t &, const std::string &, nixlBackendReqH *&,
                           const nixl_opt_b_args_t *) const override {
        return NIXL_SUCCESS;
    }
    nixl_status_t postXfer(const nixl_xfer_op_t &, const nixl_meta_dlist_t &,
                           const nixl_meta_dlist_t &, const std::string &, nixlBackendReqH *&,
                           const nixl_opt_b_args_t *) const override {
        return NIXL_SUCCESS;
    }
    nixl_status_t checkXfer(nixlBackendReqH *) const override { return NIXL_SUCCESS; }
    nixl_status_t releaseReqH(nixlBackendReqH *) const override { return NIXL_SUCCESS; }
};

static int failures = 0;

static void expect(const char *what, size_t theirs, size_t mine) {
    if (theirs != mine) {
        std::printf("MISMATCH %-40s NIXL %zu, ours %zu\n", what, theirs, mine);
        failures++;
    } else {
        std::printf("ok       %-40s %zu\n", what, mine);
    }
}

// Itanium C++ ABI: a pointer to a virtual member function holds 1 + the byte offset of its
// vtable slot; the slot number is (ptr - 1) / sizeof(void *).
template <class PMF>
static size_t slot(PMF pmf) {
    struct {
        uintptr_t ptr;
        ptrdiff_t adj;
    } raw;
    static_assert(sizeof(raw) == sizeof(pmf));
    std::memcpy(&raw, &pmf, sizeof(raw));
    if ((raw.ptr & 1) == 0) return ~size_t{0};  // not virtual
    return (raw.ptr - 1) / sizeof(void *);
}

#define SLOT(name, theirs, mine) expect("slot " name, slot(theirs), slot(mine))

int main() {
    expect("DescList::type", TheirList::typeOff(), ours::LayoutProbe::listType());
    expect("DescList::descs", TheirList::descsOff(), ours::LayoutProbe::listDescs());
    expect("Engine::initErr", TheirEngine::initErrOff(), ours::LayoutProbe::engInitErr());
    expect("Engine::localAgent", TheirEngine::localAgentOff(), ours::LayoutProbe::engLocalAgent());
    expect("Engine::enableTelemetry_", TheirEngine::telemetryOff(),
           ours::LayoutProbe::engTelemetryFlag());
    expect("layout::kEngineInitErr", TheirEngine::initErrOff(), ours::layout::kEngineInitErr);
    expect("layout::kEngineLocalAgent", TheirEngine::localAgentOff(),
           ours::layout::kEngineLocalAgent);

    // Private fields of NIXL's engine, through its inline getters on a live object.
    nixl_b_params_t params{{"k", "v"}};
    nixlBackendInitParams init;
    init.localAgent = "agent";
    init.type = "PROBE";
    init.customParams = &params;
    init.syncMode = nixl_thread_sync_t::NIXL_THREAD_SYNC_NONE;
    TheirEngine engine(&init);
    const char *base = reinterpret_cast<const char *>(&engine);
    expect("Engine::backendType",
           size_t(reinterpret_cast<const char *>(&engine.getType()) - base),
           ours::LayoutProbe::engType());
    expect("Engine::customParams",
           size_t(reinterpret_cast<const char *>(&engine.getCustomParams()) - base),
           ours::LayoutProbe::engParams());
    // The telemetry vector and the mutex fill the gap between customParams and initErr.
    expect("Engine::telemetryEvents_ + mutex end",
           ours::LayoutProbe::engParams() + sizeof(nixl_b_params_t) +
               sizeof(std::vector<nixlTelemetryEvent>) + sizeof(std::mutex),
           ours::LayoutProbe::engInitErr());
    expect("Engine::telemetryEvents_", ours::LayoutProbe::engParams() + sizeof(nixl_b_params_t),
           ours::LayoutProbe::engTelemetry());
    expect("sizeof(nixlTelemetryEvent)", sizeof(nixlTelemetryEvent), sizeof(ours::TelemetryEvent));

    using E = nixlBackendEngine;
    using O = ours::BackendEngine;
    SLOT("supportsRemote (2)", &E::supportsRemote, &O::supportsRemote);
    SLOT("supportsLocal (3)", &E::supportsLocal, &O::supportsLocal);
    SLOT("supportsNotif (4)", &E::supportsNotif, &O::supportsNotif);
    SLOT("getSupportedMems (5)", &E::getSupportedMems, &O::getSupportedMems);
    SLOT("registerMem (6)", &E::registerMem, &O::registerMem);
    SLOT("deregisterMem (7)", &E::deregisterMem, &O::deregisterMem);
    SLOT("connect (8)", &E::connect, &O::connect);
    SLOT("disconnect (9)", &E::disconnect, &O::disconnect);
    SLOT("unloadMD (10)", &E::unloadMD, &O::unloadMD);
    SLOT("prepXfer (11)", &E::prepXfer, &O::prepXfer);
    SLOT("postXfer (12)", &E::postXfer, &O::postXfer);
    SLOT("checkXfer (13)", &E::checkXfer, &O::checkXfer);
    SLOT("releaseReqH (14)", &E::releaseReqH, &O::releaseReqH);
    SLOT("prepMemView remote (15)",
         static_cast<nixl_status_t (E::*)(const nixl_remote_meta_dlist_t &, nixlMemViewH &,
                                          const nixl_opt_b_args_t *) const>(&E::prepMemView),
         static_cast<ours::Status (O::*)(const ours::RemoteMetaDescList &, ours::MemViewHandle &,
                                         const ours::BackendOptionalArgs *) const>(&O::prepMemView));
    SLOT("prepMemView local (16)",
         static_cast<nixl_status_t (E::*)(const nixl_meta_dlist_t &, nixlMemViewH &,
                                          const nixl_opt_b_args_t *) const>(&E::prepMemView),
         static_cast<ours::Status (O::*)(const ours::MetaDescList &, ours::MemViewHandle &,
                                         const ours::BackendOptionalArgs *) const>(&O::prepMemView));
    SLOT("releaseMemView (17)", &E::releaseMemView, &O::releaseMemView);
    SLOT("getPublicData (18)", &E::getPublicData, &O::getPublicData);
    SLOT("getConnInfo (19)", &E::getConnInfo, &O::getConnInfo);
    SLOT("loadRemoteConnInfo (20)", &E::loadRemoteConnInfo, &O::loadRemoteConnInfo);
    SLOT("loadRemoteMD (21)", &E::loadRemoteMD, &O::loadRemoteMD);
    SLOT("loadLocalMD (22)", &E::loadLocalMD, &O::loadLocalMD);
    SLOT("getNotifs (23)", &E::getNotifs, &O::getNotifs);
    SLOT("genNotif (24)", &E::genNotif, &O::genNotif);
    SLOT("queryMem (25)", &E::queryMem, &O::queryMem);
    SLOT("estimateXferCost (26)", &E::estimateXferCost, &O::estimateXferCost);
    expect("first slot after the two destructors", slot(&O::supportsRemote), 2);
    expect("last slot", slot(&O::estimateXferCost), 26);

    if (failures) {
        std::printf("%d difference(s): nixl_backend_abi.h does not match these NIXL headers\n",
                    failures);
        return 1;
    }
    std::printf("nixl_backend_abi.h matches these NIXL headers\n");
    return 0;
}
