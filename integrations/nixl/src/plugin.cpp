// plugin.cpp: the two symbols NIXL looks up in libplugin_TCPX.so, and the plugin descriptor.
//
// NIXL dlopens the plugin, calls nixl_plugin_init() and refuses the plugin unless
// api_version == 1. Before answering, this file checks what it can itself: that the libtcpx
// it was linked with speaks the C ABI of the tcpx.h it was built against, and, when an engine
// is created, that the init parameters NIXL passes look like the NIXL 1.5 layout this plugin
// was built for (a NIXL with another layout would hand over garbage there first).

#include <string>

#include "engine.h"

#if !defined(_GLIBCXX_USE_CXX11_ABI) || _GLIBCXX_USE_CXX11_ABI != 1
#error "NIXL's wheels use the cxx11 libstdc++ ABI; build this plugin with it"
#endif

namespace tcpx_nixl {
namespace {

BackendEngine *createEngine(const BackendInitParams *init) {
    try {
        if (!init || !init->customParams || init->type != kBackendName ||
            init->localAgent.empty() || static_cast<int>(init->syncMode) < 0 ||
            static_cast<int>(init->syncMode) > 2) {
            logError(std::string("NIXL passed engine parameters this plugin cannot read: it was "
                                 "built for NIXL ") +
                     kMatchedNixlVersion + " (plugin API " + std::to_string(kPluginApiVersion) +
                     "); rebuild it against this NIXL's layout (integrations/nixl/probe)");
            return nullptr;
        }
        return new Engine(init);
    } catch (const std::exception &e) {
        logError(std::string("creating the TCPX engine: ") + e.what());
    } catch (...) {
        logError("creating the TCPX engine: unknown exception");
    }
    return nullptr;
}

void destroyEngine(BackendEngine *engine) { delete engine; }

const char *pluginName() { return kBackendName; }
const char *pluginVersion() { return kPluginVersion; }

Params backendOptions() {
    try {
        return Engine::options();
    } catch (...) {
        return {};
    }
}

MemList backendMems() {
    try {
        return {DRAM_SEG, VRAM_SEG};
    } catch (...) {
        return {};
    }
}

BackendPlugin descriptor = {kPluginApiVersion, createEngine, destroyEngine, pluginName,
                            pluginVersion,     backendOptions, backendMems};

}  // namespace
}  // namespace tcpx_nixl

extern "C" __attribute__((visibility("default"))) nixl_abi::BackendPlugin *nixl_plugin_init() {
    using namespace tcpx_nixl;
    const tcpx_status st = tcpx_init(TCPX_ABI_VERSION);
    if (st != TCPX_OK) {
        logError(std::string("libtcpx does not serve the C ABI this plugin was built against: ") +
                 tcpx_last_error());
        return nullptr;
    }
    return &descriptor;
}

extern "C" __attribute__((visibility("default"))) void nixl_plugin_fini() {}
