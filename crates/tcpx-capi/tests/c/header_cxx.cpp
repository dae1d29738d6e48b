// A C++17 host's view of tcpx.h: the header compiles under -Wall -Wextra -Werror, the handle
// and option types behave as plain C structs, and the program links against the static
// library alone (plus the system libraries tcpx.pc lists). Run by `cargo xtask capi --test`.
#include "tcpx.h"

#include <cstdio>
#include <cstring>
#include <type_traits>

static_assert(std::is_trivially_copyable<tcpx_endpoint>::value, "handles are plain values");
static_assert(sizeof(tcpx_connection) == 8, "a handle is one 64-bit id");
static_assert(std::is_standard_layout<tcpx_endpoint_options>::value, "options are a C struct");

int main() {
    if (TCPX_ABI_CHECK() != TCPX_OK) {
        std::fprintf(stderr, "ABI check failed: %s\n", tcpx_last_error());
        return 1;
    }
    tcpx_endpoint_options options;
    if (tcpx_endpoint_options_init(&options) != TCPX_OK) return 1;
    options.backend = "builtin";
    options.control_addr = "127.0.0.1:0";
    tcpx_endpoint ep{};
    if (tcpx_endpoint_create(&options, &ep) != TCPX_OK) {
        std::fprintf(stderr, "tcpx_endpoint_create: %s\n", tcpx_last_error());
        return 1;
    }
    tcpx_endpoint_info info;
    if (tcpx_endpoint_get_info(ep, &info) != TCPX_OK) return 1;
    tcpx_status st = tcpx_endpoint_destroy(ep);
    // The handle is stale now, and says so.
    tcpx_status again = tcpx_endpoint_destroy(ep);
    if (st != TCPX_OK || again != TCPX_ERR_STALE_HANDLE ||
        std::strstr(tcpx_last_error(), "stale") == nullptr) {
        std::fprintf(stderr, "destroy: %s / %s\n", tcpx_status_str(st), tcpx_status_str(again));
        return 1;
    }
    std::printf("C++17, static libtcpx: ABI %u.%u, endpoint at %s (%s) created and destroyed\n",
                tcpx_abi_version() >> 16, tcpx_abi_version() & 0xffff, info.control_addr,
                info.plugin);
    return 0;
}
