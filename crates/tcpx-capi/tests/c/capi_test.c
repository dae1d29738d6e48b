/*
 * The C API's test program: every call family of tcpx.h with verified bytes, and its error
 * paths, between real processes over 127.0.0.1 with the built-in kernel-TCP plugin.
 *
 * The main process only coordinates: it never calls into libtcpx, so forking it is safe (no
 * runtime threads exist yet). Each scenario forks one or two children that create their own
 * endpoints and talk over pipes (metadata, descriptors, addresses, "go" signals); a child exits
 * 0 only when every check passed and everything it made was destroyed (valgrind's leak check
 * runs at that exit). `--valgrind` shrinks the sizes and widens the waits.
 *
 * Run by `cargo xtask capi --test`, plain and under valgrind. The rendezvous scenario uses the
 * etcd the harness starts on 127.0.0.1 (TCPX_TEST_ETCD, a store URL) and skips without it.
 */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tcpx.h"

static const char *g_role = "main";
static int g_valgrind;

#define FAIL(...)                                                                      \
    do {                                                                               \
        fprintf(stderr, "[%s] FAILED at %s:%d: ", g_role, __FILE__, __LINE__);         \
        fprintf(stderr, __VA_ARGS__);                                                  \
        fprintf(stderr, "\n");                                                         \
        exit(1);                                                                       \
    } while (0)

#define CHECK(call)                                                                    \
    do {                                                                               \
        tcpx_status st_ = (call);                                                      \
        if (st_ != TCPX_OK)                                                            \
            FAIL("%s -> %s: %s", #call, tcpx_status_str(st_), tcpx_last_error());     \
    } while (0)

/* Expects `want`, and for failures a last-error message that names the function. */
#define EXPECT(call, want, fn_name)                                                    \
    do {                                                                               \
        tcpx_status st_ = (call);                                                      \
        if (st_ != (want))                                                             \
            FAIL("%s -> %s, expected %s (last error: %s)", #call, tcpx_status_str(st_),  \
                 tcpx_status_str(want), tcpx_last_error());                            \
        if ((want) > TCPX_PENDING && strstr(tcpx_last_error(), fn_name) == NULL)       \
            FAIL("%s: last error does not name %s: \"%s\"", #call, fn_name,            \
                 tcpx_last_error());                                                   \
    } while (0)

#define ASSERT(cond, ...)                                                              \
    do {                                                                               \
        if (!(cond)) FAIL("assertion `" #cond "` failed: " __VA_ARGS__);               \
    } while (0)

/* ---------------------------------------------------------------- helpers */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* How long a child waits for its peer's next message. */
static int msg_wait_ms(void) { return g_valgrind ? 600000 : 60000; }
/* How long a test waits for a transfer. */
static uint32_t wait_ms(void) { return g_valgrind ? 300000 : 30000; }

typedef struct {
    int rd, wr;
} link_t;

static void send_msg(link_t l, const void *buf, uint32_t len) {
    if (write(l.wr, &len, sizeof len) != (ssize_t)sizeof len) FAIL("pipe write: %s", strerror(errno));
    const uint8_t *p = buf;
    while (len > 0) {
        ssize_t n = write(l.wr, p, len);
        if (n <= 0) FAIL("pipe write: %s", strerror(errno));
        p += n;
        len -= (uint32_t)n;
    }
}

static void read_exact(link_t l, void *buf, size_t len) {
    uint8_t *p = buf;
    while (len > 0) {
        struct pollfd pfd = {.fd = l.rd, .events = POLLIN};
        int r = poll(&pfd, 1, msg_wait_ms());
        if (r == 0) FAIL("the peer process sent nothing for %d ms", msg_wait_ms());
        if (r < 0 && errno == EINTR) continue;
        ssize_t n = read(l.rd, p, len);
        if (n == 0) FAIL("the peer process went away (pipe closed)");
        if (n < 0) FAIL("pipe read: %s", strerror(errno));
        p += n;
        len -= (size_t)n;
    }
}

/* Receives one message into buf (capacity cap); returns its length. */
static uint32_t recv_msg(link_t l, void *buf, uint32_t cap) {
    uint32_t len;
    read_exact(l, &len, sizeof len);
    if (len > cap) FAIL("message of %u bytes, buffer of %u", len, cap);
    read_exact(l, buf, len);
    return len;
}

static void signal_peer(link_t l, const char *word) { send_msg(l, word, (uint32_t)strlen(word)); }

static void await_peer(link_t l, const char *word) {
    char buf[64];
    uint32_t n = recv_msg(l, buf, sizeof buf - 1);
    buf[n] = 0;
    if (strcmp(buf, word) != 0) FAIL("expected \"%s\" from the peer, got \"%s\"", word, buf);
}

static uint8_t pattern(uint64_t seed, uint64_t i) {
    return (uint8_t)(seed * 131u + i * 7u + (i >> 9) * 13u + (i >> 17));
}

static void fill(uint8_t *p, size_t n, uint64_t seed, uint64_t start) {
    for (size_t i = 0; i < n; i++) p[i] = pattern(seed, start + i);
}

static void verify(const uint8_t *p, size_t n, uint64_t seed, uint64_t start, const char *what) {
    for (size_t i = 0; i < n; i++)
        if (p[i] != pattern(seed, start + i))
            FAIL("%s: byte %zu is %u, expected %u", what, i, p[i], pattern(seed, start + i));
}

static void *alloc_aligned(size_t n) {
    void *p = NULL;
    if (posix_memalign(&p, 4096, n) != 0) FAIL("posix_memalign(%zu) failed", n);
    return p;
}

static tcpx_endpoint make_endpoint(uint64_t timeout_ms, int32_t gpu_index) {
    tcpx_endpoint_options o;
    CHECK(tcpx_endpoint_options_init(&o));
    o.backend = "builtin";
    o.control_addr = "127.0.0.1:0";
    o.channels = 2;
    o.chunk_bytes = 256 * 1024;
    o.timeout_ms = timeout_ms;
    o.gpu_index = gpu_index;
    o.pin_engines = 0;
    tcpx_endpoint ep;
    CHECK(tcpx_endpoint_create(&o, &ep));
    return ep;
}

static void *region_ptr(tcpx_region r, size_t *len) {
    void *p = NULL;
    CHECK(tcpx_region_info(r, &p, len, NULL));
    return p;
}

/* Waits for a transfer to succeed with `want` bytes, then releases it. */
static void finish(tcpx_transfer t, uint64_t want, const char *what) {
    uint64_t got = 0;
    tcpx_status st = tcpx_transfer_wait(t, wait_ms(), &got);
    if (st != TCPX_OK) FAIL("%s: wait -> %s: %s", what, tcpx_status_str(st), tcpx_last_error());
    if (got != want) FAIL("%s: %llu bytes moved, expected %llu", what, (unsigned long long)got,
                          (unsigned long long)want);
    CHECK(tcpx_transfer_release(t));
}

/* Server side of a connection: metadata out over the pipe, accept, peer info back. */
static tcpx_connection accept_peer(tcpx_endpoint ep, link_t l, tcpx_peer_info *peer) {
    uint8_t meta[TCPX_METADATA_MAX_BYTES];
    size_t len = sizeof meta;
    CHECK(tcpx_endpoint_metadata(ep, meta, &len));
    send_msg(l, meta, (uint32_t)len);
    tcpx_connection c;
    CHECK(tcpx_endpoint_accept(ep, wait_ms(), &c, peer));
    return c;
}

static tcpx_connection connect_peer(tcpx_endpoint ep, link_t l) {
    uint8_t meta[TCPX_METADATA_MAX_BYTES];
    uint32_t len = recv_msg(l, meta, sizeof meta);
    tcpx_connection c;
    CHECK(tcpx_endpoint_connect(ep, meta, len, &c));
    return c;
}

/* ---------------------------------------------------------------- scenario: arguments */

struct thread_check {
    int ok;
    char seen_first[256];
};

static void *other_thread(void *arg) {
    struct thread_check *t = arg;
    /* Last errors are per thread: this one has seen no failure yet. */
    snprintf(t->seen_first, sizeof t->seen_first, "%s", tcpx_last_error());
    tcpx_status st = tcpx_transfer_release((tcpx_transfer){0});
    t->ok = st == TCPX_ERR_NULL_POINTER && strstr(tcpx_last_error(), "tcpx_transfer_release");
    return NULL;
}

static void scenario_arguments(link_t unused) {
    (void)unused;
    /* ABI: this header against this library, then hosts of other versions. */
    ASSERT(tcpx_abi_version() == TCPX_ABI_VERSION, "abi %u", tcpx_abi_version());
    CHECK(TCPX_ABI_CHECK());
    EXPECT(tcpx_init(((uint32_t)TCPX_ABI_VERSION_MAJOR + 1) << 16), TCPX_ERR_ABI_MISMATCH, "tcpx_init");
    ASSERT(strstr(tcpx_last_error(), "ABI") != NULL, "%s", tcpx_last_error());
    EXPECT(tcpx_init(TCPX_ABI_VERSION + 1), TCPX_ERR_ABI_MISMATCH, "tcpx_init");
    ASSERT(strcmp(tcpx_status_str(TCPX_ERR_TIMEOUT), "TCPX_ERR_TIMEOUT") == 0, "status name");
    ASSERT(strcmp(tcpx_status_str(12345), "TCPX_UNKNOWN_STATUS") == 0, "unknown status name");

    /* Options and creation. */
    tcpx_endpoint ep;
    EXPECT(tcpx_endpoint_options_init(NULL), TCPX_ERR_NULL_POINTER, "tcpx_endpoint_options_init");
    EXPECT(tcpx_endpoint_create(NULL, NULL), TCPX_ERR_NULL_POINTER, "tcpx_endpoint_create");
    tcpx_endpoint_options o;
    CHECK(tcpx_endpoint_options_init(&o));
    o.backend = "builtin";
    o.control_addr = "127.0.0.1:0";
    o.struct_size = 8;
    EXPECT(tcpx_endpoint_create(&o, &ep), TCPX_ERR_INVALID_ARGUMENT, "struct_size");
    CHECK(tcpx_endpoint_options_init(&o));
    o.backend = "builtin";
    o.control_addr = "not an address";
    EXPECT(tcpx_endpoint_create(&o, &ep), TCPX_ERR_CONFIG, "control_addr");
    o.control_addr = "127.0.0.1:0";
    o.window = 99;
    EXPECT(tcpx_endpoint_create(&o, &ep), TCPX_ERR_CONFIG, "window");
    o.window = 0;
    o.pin_engines = 7;
    EXPECT(tcpx_endpoint_create(&o, &ep), TCPX_ERR_CONFIG, "pin_engines");
    o.pin_engines = -1;
    o.eager_bytes = 1 << 20;
    EXPECT(tcpx_endpoint_create(&o, &ep), TCPX_ERR_CONFIG, "eager_bytes");
    ASSERT(strstr(tcpx_last_error(), "eager") != NULL, "%s", tcpx_last_error());
    o.eager_bytes = -7;
    EXPECT(tcpx_endpoint_create(&o, &ep), TCPX_ERR_CONFIG, "eager_bytes");
    /* Eager frames off; then a host built against ABI minor 5, whose struct ended before
     * eager_bytes: taken, the missing field unset. */
    o.eager_bytes = 0;
    CHECK(tcpx_endpoint_create(&o, &ep));
    CHECK(tcpx_endpoint_destroy(ep));
    o.eager_bytes = -1;
    o.struct_size = (uint32_t)offsetof(tcpx_endpoint_options, eager_bytes);
    CHECK(tcpx_endpoint_create(&o, &ep));
    CHECK(tcpx_endpoint_destroy(ep));
    o.struct_size = (uint32_t)sizeof o;
    o.backend = "/nonexistent/libnccl-net-missing.so";
    EXPECT(tcpx_endpoint_create(&o, &ep), TCPX_ERR_BACKEND, "tcpx_endpoint_create");

    ep = make_endpoint(5000, 2);
    tcpx_endpoint_info info;
    CHECK(tcpx_endpoint_get_info(ep, &info));
    ASSERT(strncmp(info.control_addr, "127.0.0.1:", 10) == 0, "control address %s", info.control_addr);
    ASSERT(info.channels == 2 && info.chunk_bytes == 256 * 1024 && info.timeout_ms == 5000,
           "info %u %u %llu", info.channels, info.chunk_bytes, (unsigned long long)info.timeout_ms);
    ASSERT(info.gpu_index == 2, "gpu index %d", info.gpu_index);
    ASSERT(info.plugin[0] != 0, "plugin name");

    /* Metadata: size query, too small, exact. */
    size_t need = 0;
    EXPECT(tcpx_endpoint_metadata(ep, NULL, &need), TCPX_ERR_BUFFER_TOO_SMALL, "tcpx_endpoint_metadata");
    ASSERT(need > 0 && need <= TCPX_METADATA_MAX_BYTES, "metadata size %zu", need);
    uint8_t meta[TCPX_METADATA_MAX_BYTES];
    size_t small = need - 1;
    EXPECT(tcpx_endpoint_metadata(ep, meta, &small), TCPX_ERR_BUFFER_TOO_SMALL, "tcpx_endpoint_metadata");
    ASSERT(small == need, "needed %zu, told %zu", need, small);
    size_t len = sizeof meta;
    CHECK(tcpx_endpoint_metadata(ep, meta, &len));
    ASSERT(len == need, "metadata %zu vs %zu", len, need);
    EXPECT(tcpx_endpoint_metadata(ep, meta, NULL), TCPX_ERR_NULL_POINTER, "tcpx_endpoint_metadata");

    /* Null handles and null pointers. */
    tcpx_endpoint null_ep = {0};
    tcpx_connection null_conn = {0};
    tcpx_transfer t;
    EXPECT(tcpx_endpoint_get_info(null_ep, &info), TCPX_ERR_NULL_POINTER, "tcpx_endpoint_get_info");
    EXPECT(tcpx_endpoint_get_info(ep, NULL), TCPX_ERR_NULL_POINTER, "tcpx_endpoint_get_info");
    EXPECT(tcpx_connection_send(null_conn, (tcpx_region){0}, 0, 1, &t), TCPX_ERR_NULL_POINTER,
           "tcpx_connection_send");
    EXPECT(tcpx_transfer_wait((tcpx_transfer){0}, 0, NULL), TCPX_ERR_NULL_POINTER, "tcpx_transfer_wait");
    EXPECT(tcpx_endpoint_connect(ep, NULL, 10, &null_conn), TCPX_ERR_NULL_POINTER, "tcpx_endpoint_connect");
    EXPECT(tcpx_endpoint_connect_addr(ep, NULL, &null_conn), TCPX_ERR_NULL_POINTER,
           "tcpx_endpoint_connect_addr");
    EXPECT(tcpx_connection_send_vectored(null_conn, NULL, 1, &t), TCPX_ERR_NULL_POINTER,
           "tcpx_connection_send_vectored");

    /* Last errors are per thread. */
    char mine[256];
    snprintf(mine, sizeof mine, "%s", tcpx_last_error());
    struct thread_check tc = {0};
    pthread_t th;
    ASSERT(pthread_create(&th, NULL, other_thread, &tc) == 0, "pthread_create");
    pthread_join(th, NULL);
    ASSERT(tc.seen_first[0] == 0, "a new thread saw \"%s\"", tc.seen_first);
    ASSERT(tc.ok, "the other thread's failure was not reported to it");
    ASSERT(strcmp(mine, tcpx_last_error()) == 0, "another thread changed this thread's last error");

    /* Memory: null, empty, CUDA without a GPU, a handle of the wrong kind. */
    tcpx_region r;
    EXPECT(tcpx_endpoint_register(ep, NULL, 4096, &r), TCPX_ERR_NULL_POINTER, "tcpx_endpoint_register");
    uint8_t *mem = alloc_aligned(1 << 16);
    EXPECT(tcpx_endpoint_register(ep, mem, 0, &r), TCPX_ERR_INVALID_ARGUMENT, "tcpx_endpoint_register");
    EXPECT(tcpx_endpoint_alloc_host(ep, 0, &r), TCPX_ERR_INVALID_ARGUMENT, "tcpx_endpoint_alloc_host");
    /* The CUDA driver is not valgrind-clean: under valgrind, GPU memory is not probed. */
    tcpx_status cuda = g_valgrind ? TCPX_ERR_UNSUPPORTED : tcpx_endpoint_alloc_cuda(ep, 1 << 20, &r);
    if (g_valgrind) {
        printf("[%s] under valgrind: CUDA not probed\n", g_role);
    } else if (cuda == TCPX_OK) {
        tcpx_memory_kind kind;
        CHECK(tcpx_region_info(r, NULL, NULL, &kind));
        ASSERT(kind == TCPX_MEMORY_CUDA, "kind %d", (int)kind);
        CHECK(tcpx_region_destroy(r));
        printf("[%s] a CUDA device is present: alloc_cuda works\n", g_role);
    } else {
        ASSERT(cuda == TCPX_ERR_UNSUPPORTED, "alloc_cuda without a GPU -> %s: %s",
               tcpx_status_str(cuda), tcpx_last_error());
        printf("[%s] no CUDA device: alloc_cuda says \"%s\"\n", g_role, tcpx_last_error());
    }
    CHECK(tcpx_endpoint_register(ep, mem, 1 << 16, &r));
    void *base;
    size_t rlen;
    tcpx_memory_kind kind;
    CHECK(tcpx_region_info(r, &base, &rlen, &kind));
    ASSERT(base == mem && rlen == (1 << 16) && kind == TCPX_MEMORY_HOST, "region info");
    CHECK(tcpx_region_info(r, NULL, NULL, NULL));
    EXPECT(tcpx_endpoint_get_info((tcpx_endpoint){r.id}, &info), TCPX_ERR_STALE_HANDLE,
           "tcpx_endpoint_get_info");
    ASSERT(strstr(tcpx_last_error(), "tcpx_region") != NULL, "%s", tcpx_last_error());
    EXPECT(tcpx_transfer_test((tcpx_transfer){0x12345}, NULL), TCPX_ERR_STALE_HANDLE, "tcpx_transfer_test");

    /* Descriptors: too small a buffer, garbage, revoke twice. */
    uint8_t desc[TCPX_DESCRIPTOR_BYTES];
    EXPECT(tcpx_region_advertise(r, desc, 3), TCPX_ERR_BUFFER_TOO_SMALL, "tcpx_region_advertise");
    CHECK(tcpx_region_advertise(r, desc, sizeof desc));
    uint8_t garbage[TCPX_DESCRIPTOR_BYTES] = {0xff, 0xee};
    EXPECT(tcpx_endpoint_revoke(ep, garbage, sizeof garbage, NULL), TCPX_ERR_INVALID_ARGUMENT,
           "tcpx_endpoint_revoke");
    EXPECT(tcpx_endpoint_revoke(ep, desc, 5, NULL), TCPX_ERR_INVALID_ARGUMENT, "tcpx_endpoint_revoke");
    bool was = false;
    CHECK(tcpx_endpoint_revoke(ep, desc, sizeof desc, &was));
    ASSERT(was, "the advertised descriptor was not revoked");
    CHECK(tcpx_endpoint_revoke(ep, desc, sizeof desc, &was));
    ASSERT(!was, "a revoked descriptor was revoked again");

    /* Stale region: destroyed twice, then used. */
    CHECK(tcpx_region_destroy(r));
    EXPECT(tcpx_region_destroy(r), TCPX_ERR_STALE_HANDLE, "tcpx_region_destroy");
    EXPECT(tcpx_region_info(r, &base, NULL, NULL), TCPX_ERR_STALE_HANDLE, "tcpx_region_info");
    free(mem);

    /* Connecting: garbage metadata, bad and unreachable addresses, an accept nobody answers. */
    tcpx_connection c;
    uint8_t junk[40] = {1, 2, 3};
    EXPECT(tcpx_endpoint_connect(ep, junk, sizeof junk, &c), TCPX_ERR_INVALID_ARGUMENT,
           "tcpx_endpoint_connect");
    EXPECT(tcpx_endpoint_connect_addr(ep, "nowhere", &c), TCPX_ERR_INVALID_ARGUMENT,
           "tcpx_endpoint_connect_addr");
    EXPECT(tcpx_endpoint_connect_addr(ep, "127.0.0.1:1", &c), TCPX_ERR_CONNECT,
           "tcpx_endpoint_connect_addr");
    double t0 = now_s();
    EXPECT(tcpx_endpoint_accept(ep, 100, &c, NULL), TCPX_ERR_TIMEOUT, "tcpx_endpoint_accept");
    ASSERT(now_s() - t0 < 5.0, "accept(100 ms) took %.1f s", now_s() - t0);

    /* Notifications: none yet, null info, zero capacity with a NULL buffer. */
    tcpx_notification n;
    EXPECT(tcpx_endpoint_notification(ep, 0, &n, NULL, 0), TCPX_PENDING, "");
    EXPECT(tcpx_endpoint_notification(ep, 0, NULL, NULL, 0), TCPX_ERR_NULL_POINTER,
           "tcpx_endpoint_notification");
    uint64_t refusals = 99;
    CHECK(tcpx_endpoint_access_refusals(ep, &refusals));
    ASSERT(refusals == 0, "refusals %llu", (unsigned long long)refusals);

    /* A destroyed endpoint: its handle and its regions' handles are stale. */
    CHECK(tcpx_endpoint_alloc_host(ep, 4096, &r));
    CHECK(tcpx_endpoint_destroy(ep));
    EXPECT(tcpx_endpoint_destroy(ep), TCPX_ERR_STALE_HANDLE, "tcpx_endpoint_destroy");
    EXPECT(tcpx_endpoint_get_info(ep, &info), TCPX_ERR_STALE_HANDLE, "tcpx_endpoint_get_info");
    EXPECT(tcpx_region_info(r, NULL, NULL, NULL), TCPX_ERR_STALE_HANDLE, "tcpx_region_info");
    EXPECT(tcpx_endpoint_alloc_host(ep, 4096, &r), TCPX_ERR_STALE_HANDLE, "tcpx_endpoint_alloc_host");

    /* The NIXL plugin's formats (tcpx-proto's, through tcpx_nixl_*): round trips, the size
     * protocol, refusals of bytes that are not one. */
    {
        uint8_t meta[40], local[20], buf[512];
        memset(meta, 7, sizeof meta);
        memset(local, 9, sizeof local);
        size_t len = 0;
        EXPECT(tcpx_nixl_conn_info_encode(meta, sizeof meta, local, sizeof local, NULL, &len),
               TCPX_ERR_BUFFER_TOO_SMALL, "tcpx_nixl_conn_info_encode");
        ASSERT(len == 8 + 40 + 8 + 20, "conn info size %zu", len);
        len = sizeof buf;
        CHECK(tcpx_nixl_conn_info_encode(meta, sizeof meta, local, sizeof local, buf, &len));
        tcpx_nixl_conn_info ci;
        CHECK(tcpx_nixl_conn_info_decode(buf, len, &ci));
        ASSERT(ci.metadata_len == 40 && memcmp(buf + ci.metadata_offset, meta, 40) == 0,
               "conn info metadata");
        ASSERT(ci.local_len == 20 && memcmp(buf + ci.local_offset, local, 20) == 0,
               "conn info local");
        EXPECT(tcpx_nixl_conn_info_decode(buf, len, NULL), TCPX_ERR_NULL_POINTER,
               "tcpx_nixl_conn_info_decode");
        buf[0] = 'X';
        EXPECT(tcpx_nixl_conn_info_decode(buf, len, &ci), TCPX_ERR_PROTOCOL,
               "tcpx_nixl_conn_info_decode");

        tcpx_nixl_public_mem pm, back;
        memset(&pm, 0, sizeof pm);
        pm.mem_type = 1;
        pm.base = 0x1000;
        pm.len = 4096;
        memset(pm.descriptor, 3, sizeof pm.descriptor);
        pm.has_ipc = true;
        memset(pm.ipc_descriptor, 5, sizeof pm.ipc_descriptor);
        len = sizeof buf;
        CHECK(tcpx_nixl_public_mem_encode(&pm, buf, &len));
        ASSERT(len == TCPX_NIXL_PUBLIC_MEM_MAX_BYTES, "public mem size %zu", len);
        CHECK(tcpx_nixl_public_mem_decode(buf, len, &back));
        ASSERT(back.base == pm.base && back.len == pm.len && back.has_ipc &&
                   memcmp(back.ipc_descriptor, pm.ipc_descriptor, sizeof pm.ipc_descriptor) == 0,
               "public mem round trip");
        EXPECT(tcpx_nixl_public_mem_decode(buf, len - 1, &back), TCPX_ERR_PROTOCOL,
               "tcpx_nixl_public_mem_decode");

        len = sizeof buf;
        CHECK(tcpx_nixl_notif_encode(TCPX_NIXL_NOTIF_USER, (const uint8_t *)"agent", 5,
                                     (const uint8_t *)"hi", 2, buf, &len));
        tcpx_nixl_notif n;
        CHECK(tcpx_nixl_notif_decode(buf, len, &n));
        ASSERT(n.kind == TCPX_NIXL_NOTIF_USER && n.agent_len == 5 &&
                   memcmp(buf + n.agent_offset, "agent", 5) == 0 && n.msg_len == 2 &&
                   memcmp(buf + n.msg_offset, "hi", 2) == 0,
               "notif round trip");
        len = sizeof buf;
        EXPECT(tcpx_nixl_notif_encode(9, (const uint8_t *)"a", 1, NULL, 0, buf, &len),
               TCPX_ERR_INVALID_ARGUMENT, "tcpx_nixl_notif_encode");
        const uint8_t junk[4] = {1, 0, 0, 'a'};
        EXPECT(tcpx_nixl_notif_decode(junk, sizeof junk, &n), TCPX_ERR_PROTOCOL,
               "tcpx_nixl_notif_decode");
    }
}

/* ---------------------------------------------------------------- scenario: stop accepting */

struct blocked_accept {
    tcpx_endpoint ep;
    int local; /* same-host accept, else network */
    tcpx_status status;
    double took;
};

static void *blocked_accept_run(void *arg) {
    struct blocked_accept *b = arg;
    double t0 = now_s();
    if (b->local) {
        tcpx_local_connection c;
        b->status = tcpx_endpoint_accept_local(b->ep, wait_ms(), &c, NULL);
    } else {
        tcpx_connection c;
        b->status = tcpx_endpoint_accept(b->ep, wait_ms(), &c, NULL);
    }
    b->took = now_s() - t0;
    return NULL;
}

/* Accepts blocked in other threads (network and same-host, each waiting 30 s) end at once with
 * TCPX_ERR_CLOSED when the endpoint stops accepting, or when it is destroyed. */
static void scenario_stop_accepting(link_t unused) {
    (void)unused;
    for (int by_destroy = 0; by_destroy < 2; by_destroy++) {
        tcpx_endpoint ep = make_endpoint(wait_ms(), -1);
        struct blocked_accept b[2] = {{ep, 0, TCPX_OK, 0}, {ep, 1, TCPX_OK, 0}};
        pthread_t th[2];
        for (int i = 0; i < 2; i++)
            ASSERT(pthread_create(&th[i], NULL, blocked_accept_run, &b[i]) == 0, "pthread_create");
        usleep(200 * 1000); /* both are waiting by now (or start stopped: the same result) */
        if (by_destroy) CHECK(tcpx_endpoint_destroy(ep));
        else CHECK(tcpx_endpoint_stop_accepting(ep));
        for (int i = 0; i < 2; i++) {
            pthread_join(th[i], NULL);
            ASSERT(b[i].status == TCPX_ERR_CLOSED, "%s accept after %s: %s",
                   b[i].local ? "same-host" : "network", by_destroy ? "destroy" : "stop",
                   tcpx_status_str(b[i].status));
            ASSERT(b[i].took < 10.0, "a stopped accept took %.1f s", b[i].took);
        }
        if (!by_destroy) {
            /* Later accepts fail at once too; stopping again is harmless. */
            tcpx_connection c;
            double t0 = now_s();
            EXPECT(tcpx_endpoint_accept(ep, wait_ms(), &c, NULL), TCPX_ERR_CLOSED,
                   "tcpx_endpoint_accept");
            ASSERT(strstr(tcpx_last_error(), "stopped accepting") != NULL, "error: %s",
                   tcpx_last_error());
            ASSERT(now_s() - t0 < 10.0, "a stopped accept took %.1f s", now_s() - t0);
            CHECK(tcpx_endpoint_stop_accepting(ep));
            CHECK(tcpx_endpoint_destroy(ep));
            EXPECT(tcpx_endpoint_stop_accepting(ep), TCPX_ERR_STALE_HANDLE,
                   "tcpx_endpoint_stop_accepting");
        }
    }
}

/* ---------------------------------------------------------------- scenario: secret */

/* Set by the connecting side once its refused connect returned. */
static int g_refused_connect_done;

static void *accept_refused(void *arg) {
    tcpx_endpoint *ep = arg;
    tcpx_connection c;
    /* The address-only peer is turned away without ending the wait (a stranger must not take
     * accept down): each accept slice runs out of time, and the error of the slice the refusal
     * fell in names the refused peer and the missing secret. Slices until the connecting side
     * is done, then one more: a loaded machine (or valgrind) may take seconds to connect. */
    int named = 0;
    for (;;) {
        int done = __atomic_load_n(&g_refused_connect_done, __ATOMIC_ACQUIRE);
        tcpx_status st = tcpx_endpoint_accept(*ep, 1000, &c, NULL);
        if (st != TCPX_ERR_TIMEOUT) {
            fprintf(stderr, "[%s] accept: %s: %s\n", g_role, tcpx_status_str(st),
                    tcpx_last_error());
            return (void *)1;
        }
        if (strstr(tcpx_last_error(), "secret") != NULL) named = 1;
        if (done) break;
    }
    if (!named) {
        fprintf(stderr, "[%s] no accept slice named the refused peer (last: %s)\n", g_role,
                tcpx_last_error());
        return (void *)1;
    }
    return NULL;
}

struct accept_job {
    tcpx_endpoint ep;
    tcpx_connection conn;
    tcpx_status status;
};

static void *accept_job_run(void *arg) {
    struct accept_job *j = arg;
    j->status = tcpx_endpoint_accept(j->ep, wait_ms(), &j->conn, NULL);
    if (j->status != TCPX_OK) fprintf(stderr, "[%s] accept: %s\n", g_role, tcpx_last_error());
    return NULL;
}

/* An endpoint that requires its secret refuses address-only connects, and takes a connect with
 * its metadata. */
static void scenario_secret(link_t unused) {
    (void)unused;
    tcpx_endpoint_options o;
    CHECK(tcpx_endpoint_options_init(&o));
    o.backend = "builtin";
    o.control_addr = "127.0.0.1:0";
    o.channels = 2;
    o.chunk_bytes = 256 * 1024;
    o.require_secret = 1;
    tcpx_endpoint guarded;
    CHECK(tcpx_endpoint_create(&o, &guarded));
    tcpx_endpoint client = make_endpoint(10000, -1);
    tcpx_endpoint_info info;
    CHECK(tcpx_endpoint_get_info(guarded, &info));

    pthread_t th;
    ASSERT(pthread_create(&th, NULL, accept_refused, &guarded) == 0, "pthread_create");
    tcpx_connection c;
    tcpx_status st = tcpx_endpoint_connect_addr(client, info.control_addr, &c);
    if (st == TCPX_OK) {
        /* Say who took the connection before failing: it must not be the guarded endpoint. */
        tcpx_peer_info who;
        CHECK(tcpx_connection_peer(c, &who));
        FAIL("connect_addr to %s was accepted (peer %s, GPU %d)", info.control_addr, who.address,
             who.gpu_index);
    }
    EXPECT(st, TCPX_ERR_INCOMPATIBLE, "tcpx_endpoint_connect_addr");
    ASSERT(strstr(tcpx_last_error(), "secret") != NULL, "%s", tcpx_last_error());
    __atomic_store_n(&g_refused_connect_done, 1, __ATOMIC_RELEASE);
    void *refused;
    pthread_join(th, &refused);
    ASSERT(refused == NULL, "the guarded endpoint did not refuse the address-only peer");

    /* With the metadata (which carries the secret) it works. */
    uint8_t meta[TCPX_METADATA_MAX_BYTES];
    size_t len = sizeof meta;
    CHECK(tcpx_endpoint_metadata(guarded, meta, &len));
    struct accept_job job = {guarded, {0}, TCPX_ERR_INTERNAL};
    ASSERT(pthread_create(&th, NULL, accept_job_run, &job) == 0, "pthread_create");
    CHECK(tcpx_endpoint_connect(client, meta, len, &c));
    pthread_join(th, NULL);
    CHECK(job.status);
    CHECK(tcpx_connection_destroy(c));
    CHECK(tcpx_connection_destroy(job.conn));
    CHECK(tcpx_endpoint_destroy(client));
    CHECK(tcpx_endpoint_destroy(guarded));
}

/* ---------------------------------------------------------------- scenario: two-sided */

#define THREADS 4
#define PER_THREAD 8

struct poster {
    tcpx_connection conn;
    tcpx_region region;
    size_t msg;
    int index;
    int failed;
};

/* Posts PER_THREAD sends on the shared connection; each message names its thread and number
 * in its first bytes, so the receiver can check what arrived whatever the interleaving. */
static void *post_sends(void *arg) {
    struct poster *p = arg;
    tcpx_transfer ts[PER_THREAD];
    for (int k = 0; k < PER_THREAD; k++) {
        uint64_t off = (uint64_t)(p->index * PER_THREAD + k) * p->msg;
        if (tcpx_connection_send(p->conn, p->region, off, p->msg, &ts[k]) != TCPX_OK) {
            fprintf(stderr, "[%s] thread %d send %d: %s\n", g_role, p->index, k, tcpx_last_error());
            p->failed = 1;
            return NULL;
        }
    }
    for (int k = 0; k < PER_THREAD; k++) {
        uint64_t got = 0;
        if (tcpx_transfer_wait(ts[k], wait_ms(), &got) != TCPX_OK || got != p->msg) p->failed = 1;
        tcpx_transfer_release(ts[k]);
    }
    return NULL;
}

static void two_sided_server(link_t l) {
    tcpx_endpoint ep = make_endpoint(20000, 0);
    tcpx_peer_info peer;
    tcpx_connection c = accept_peer(ep, l, &peer);
    ASSERT(peer.gpu_index == 5, "the client announced GPU 5, accept says %d", peer.gpu_index);
    ASSERT(peer.channels == 2, "channels %u", peer.channels);
    ASSERT(strncmp(peer.address, "127.0.0.1:", 10) == 0, "peer %s", peer.address);
    tcpx_peer_info again;
    CHECK(tcpx_connection_peer(c, &again));
    ASSERT(strcmp(again.address, peer.address) == 0 && again.gpu_index == 5, "peer info differs");

    size_t big = g_valgrind ? (256u << 10) : (8u << 20);
    tcpx_region dst;
    CHECK(tcpx_endpoint_alloc_host(ep, 2 * big, &dst));
    size_t dlen;
    uint8_t *d = region_ptr(dst, &dlen);
    ASSERT(dlen == 2 * big, "allocated %zu", dlen);
    CHECK(tcpx_connection_register(c, dst));

    /* 1. Contiguous. */
    tcpx_transfer t;
    CHECK(tcpx_connection_recv(c, dst, 0, big, &t));
    finish(t, big, "contiguous recv");
    verify(d, big, 1, 0, "contiguous");

    /* 2. Vectored, cut differently on each side: 3 pieces sent, 2 received. */
    size_t a = big / 3 + 17;
    tcpx_segment rs[2] = {{dst, big, a}, {dst, 0, big - a}};
    CHECK(tcpx_connection_recv_vectored(c, rs, 2, &t));
    finish(t, big, "vectored recv");
    verify(d + big, a, 2, 0, "vectored piece 0");
    verify(d, big - a, 2, a, "vectored piece 1");

    /* 3. Many threads posting on one connection (the client): 32 messages, any order. */
    size_t msg = g_valgrind ? 4096 : (64u << 10);
    tcpx_transfer ts[THREADS * PER_THREAD];
    for (int k = 0; k < THREADS * PER_THREAD; k++)
        CHECK(tcpx_connection_recv(c, dst, (uint64_t)k * msg, msg, &ts[k]));
    for (int k = 0; k < THREADS * PER_THREAD; k++) finish(ts[k], msg, "threaded recv");
    int seen[THREADS * PER_THREAD] = {0};
    for (int k = 0; k < THREADS * PER_THREAD; k++) {
        const uint8_t *m = d + (size_t)k * msg;
        int id = m[0];
        ASSERT(id < THREADS * PER_THREAD && !seen[id], "message %d: id %d repeated or wrong", k, id);
        seen[id] = 1;
        verify(m + 1, msg - 1, 100 + (uint64_t)id, 1, "threaded message");
    }

    /* 4. The client tests a pending receive, then this side sends into it (filled through
     * tcpx_region_write, read back through tcpx_region_read). */
    await_peer(l, "posted");
    tcpx_region src;
    CHECK(tcpx_endpoint_alloc_host(ep, 4096, &src));
    uint8_t staging[4096], back[4096];
    fill(staging, sizeof staging, 7, 0);
    CHECK(tcpx_region_write(src, 0, staging, sizeof staging));
    CHECK(tcpx_region_read(src, 0, back, sizeof back));
    ASSERT(memcmp(back, staging, sizeof back) == 0, "region read-back differs");
    EXPECT(tcpx_region_read(src, 4000, back, 200), TCPX_ERR_INVALID_ARGUMENT, "tcpx_region_read");
    EXPECT(tcpx_region_read(src, 0, NULL, 10), TCPX_ERR_NULL_POINTER, "tcpx_region_read");
    CHECK(tcpx_connection_send(c, src, 0, 4096, &t));
    finish(t, 4096, "send into the pending recv");

    /* A small send rides an eager frame: it finishes once copied into the frame and is
     * counted when the frame goes to the plugin, a moment later, so the count may trail it. */
    tcpx_connection_stats st;
    uint64_t want = 2 * big + THREADS * PER_THREAD * msg;
    double t0 = now_s();
    do {
        CHECK(tcpx_connection_get_stats(c, &st));
    } while (st.bytes_sent < 4096 && now_s() - t0 < 10.0 && usleep(1000) == 0);
    ASSERT(st.bytes_received >= want && st.channels == 2 && st.bytes_sent >= 4096,
           "stats: received %llu of %llu, sent %llu", (unsigned long long)st.bytes_received,
           (unsigned long long)want, (unsigned long long)st.bytes_sent);

    await_peer(l, "closing");
    CHECK(tcpx_connection_close(c));
    EXPECT(tcpx_connection_status(c), TCPX_ERR_STALE_HANDLE, "tcpx_connection_status");
    CHECK(tcpx_region_destroy(src));
    CHECK(tcpx_region_destroy(dst));
    CHECK(tcpx_endpoint_destroy(ep));
}

static void two_sided_client(link_t l) {
    tcpx_endpoint ep = make_endpoint(20000, 5);
    tcpx_connection c = connect_peer(ep, l);
    CHECK(tcpx_connection_status(c));

    size_t big = g_valgrind ? (256u << 10) : (8u << 20);
    /* Caller-owned memory, registered. */
    uint8_t *mem = alloc_aligned(2 * big);
    tcpx_region src;
    CHECK(tcpx_endpoint_register(ep, mem, 2 * big, &src));

    /* 1. Contiguous. */
    fill(mem, big, 1, 0);
    tcpx_transfer t;
    CHECK(tcpx_connection_send(c, src, 0, big, &t));
    finish(t, big, "contiguous send");

    /* Out of range and foreign regions are refused before anything is sent. */
    EXPECT(tcpx_connection_send(c, src, 2 * big - 10, 11, &t), TCPX_ERR_INVALID_ARGUMENT,
           "tcpx_connection_send");
    ASSERT(strstr(tcpx_last_error(), "outside") != NULL, "%s", tcpx_last_error());
    EXPECT(tcpx_connection_send(c, src, UINT64_MAX, 2, &t), TCPX_ERR_INVALID_ARGUMENT,
           "tcpx_connection_send");
    tcpx_endpoint other = make_endpoint(5000, -1);
    tcpx_region foreign;
    CHECK(tcpx_endpoint_alloc_host(other, 4096, &foreign));
    EXPECT(tcpx_connection_send(c, foreign, 0, 4096, &t), TCPX_ERR_INVALID_ARGUMENT,
           "tcpx_connection_send");
    ASSERT(strstr(tcpx_last_error(), "another endpoint") != NULL, "%s", tcpx_last_error());
    /* A foreign region after a run of this endpoint's is caught at its own index. */
    tcpx_segment run_foreign[3] = {{src, 0, 4096}, {src, 4096, 4096}, {foreign, 0, 4096}};
    EXPECT(tcpx_connection_send_vectored(c, run_foreign, 3, &t), TCPX_ERR_INVALID_ARGUMENT,
           "tcpx_connection_send_vectored");
    ASSERT(strstr(tcpx_last_error(), "segment 2") != NULL &&
               strstr(tcpx_last_error(), "another endpoint") != NULL,
           "%s", tcpx_last_error());
    CHECK(tcpx_endpoint_destroy(other));
    EXPECT(tcpx_connection_send(c, foreign, 0, 4096, &t), TCPX_ERR_STALE_HANDLE, "tcpx_connection_send");
    EXPECT(tcpx_connection_send_vectored(c, (tcpx_segment[]){{src, 0, 1}}, 0, &t),
           TCPX_ERR_INVALID_ARGUMENT, "tcpx_connection_send_vectored");
    /* A run of segments on one region is looked up once, yet every segment's range is
     * checked: the third, past the end, is refused by its index, and nothing is sent. */
    tcpx_segment run_bad[3] = {{src, 0, 4096}, {src, 8192, 4096}, {src, 2 * big - 10, 11}};
    EXPECT(tcpx_connection_send_vectored(c, run_bad, 3, &t), TCPX_ERR_INVALID_ARGUMENT,
           "tcpx_connection_send_vectored");
    ASSERT(strstr(tcpx_last_error(), "segment 2") != NULL && strstr(tcpx_last_error(), "outside"),
           "%s", tcpx_last_error());

    /* 2. Vectored: three pieces from scattered offsets. */
    size_t p0 = big / 4, p1 = big / 2, p2 = big - p0 - p1;
    fill(mem + big, p0, 2, 0);
    fill(mem, p1, 2, p0);
    fill(mem + big + p0 + 4096, p2, 2, p0 + p1);
    tcpx_segment ss[3] = {{src, big, p0}, {src, 0, p1}, {src, big + p0 + 4096, p2}};
    CHECK(tcpx_connection_send_vectored(c, ss, 3, &t));
    finish(t, big, "vectored send");

    /* 3. Four threads posting on this one connection. */
    size_t msg = g_valgrind ? 4096 : (64u << 10);
    uint8_t *tm = alloc_aligned(THREADS * PER_THREAD * msg);
    for (int id = 0; id < THREADS * PER_THREAD; id++) {
        uint8_t *m = tm + (size_t)id * msg;
        m[0] = (uint8_t)id;
        fill(m + 1, msg - 1, 100 + (uint64_t)id, 1);
    }
    tcpx_region treg;
    CHECK(tcpx_endpoint_register(ep, tm, THREADS * PER_THREAD * msg, &treg));
    pthread_t th[THREADS];
    struct poster ps[THREADS];
    for (int i = 0; i < THREADS; i++) {
        ps[i] = (struct poster){c, treg, msg, i, 0};
        ASSERT(pthread_create(&th[i], NULL, post_sends, &ps[i]) == 0, "pthread_create");
    }
    for (int i = 0; i < THREADS; i++) {
        pthread_join(th[i], NULL);
        ASSERT(!ps[i].failed, "poster thread %d failed", i);
    }
    CHECK(tcpx_region_destroy(treg));
    free(tm);

    /* 4. A pending receive: test and a short wait say PENDING, destroying its region is
     * refused while it runs, releasing and re-testing the handle is refused afterwards. */
    CHECK(tcpx_connection_recv(c, src, 0, 4096, &t));
    EXPECT(tcpx_transfer_test(t, NULL), TCPX_PENDING, "");
    EXPECT(tcpx_transfer_wait(t, 10, NULL), TCPX_PENDING, "");
    EXPECT(tcpx_region_destroy(src), TCPX_ERR_BUSY, "tcpx_region_destroy");
    signal_peer(l, "posted");
    finish(t, 4096, "pending recv");
    verify(mem, 4096, 7, 0, "pending recv");
    EXPECT(tcpx_transfer_test(t, NULL), TCPX_ERR_STALE_HANDLE, "tcpx_transfer_test");
    EXPECT(tcpx_transfer_release(t), TCPX_ERR_STALE_HANDLE, "tcpx_transfer_release");

    /* Counters settle just after the completions they follow. */
    tcpx_connection_stats st;
    double t0 = now_s();
    do {
        CHECK(tcpx_connection_get_stats(c, &st));
    } while (st.in_flight > 0 && now_s() - t0 < 10.0 && usleep(1000) == 0);
    ASSERT(st.bytes_sent >= 2 * big && st.sends > 0 && st.in_flight == 0,
           "client stats: sent %llu of %zu, %llu sends, %llu in flight",
           (unsigned long long)st.bytes_sent, 2 * big, (unsigned long long)st.sends,
           (unsigned long long)st.in_flight);

    signal_peer(l, "closing");
    CHECK(tcpx_connection_close(c));
    EXPECT(tcpx_connection_send(c, src, 0, 1, &t), TCPX_ERR_STALE_HANDLE, "tcpx_connection_send");
    CHECK(tcpx_region_destroy(src));
    free(mem);
    CHECK(tcpx_endpoint_destroy(ep));
}

/* ---------------------------------------------------------------- scenario: one-sided */

#define KV_BYTES (1u << 20)

static void one_sided_target(link_t l) {
    tcpx_endpoint ep = make_endpoint(20000, -1);
    tcpx_endpoint_info info;
    CHECK(tcpx_endpoint_get_info(ep, &info));
    /* Two regions: one allocated, one caller-owned; both advertised. */
    tcpx_region kv;
    CHECK(tcpx_endpoint_alloc_host(ep, KV_BYTES, &kv));
    uint8_t *k = region_ptr(kv, NULL);
    fill(k, KV_BYTES, 40, 0);
    uint8_t *own = alloc_aligned(64 << 10);
    memset(own, 0, 64 << 10);
    tcpx_region ownr;
    CHECK(tcpx_endpoint_register(ep, own, 64 << 10, &ownr));
    uint8_t d1[TCPX_DESCRIPTOR_BYTES], d2[TCPX_DESCRIPTOR_BYTES];
    CHECK(tcpx_region_advertise(kv, d1, sizeof d1));
    CHECK(tcpx_region_advertise(ownr, d2, sizeof d2));
    send_msg(l, info.control_addr, (uint32_t)strlen(info.control_addr) + 1);
    send_msg(l, d1, sizeof d1);
    send_msg(l, d2, sizeof d2);

    tcpx_peer_info peer;
    tcpx_connection c;
    CHECK(tcpx_endpoint_accept(ep, wait_ms(), &c, &peer));
    ASSERT(peer.gpu_index == -1, "gpu index %d", peer.gpu_index);

    /* 1. A write with a notification: the notification arrives after the data. */
    tcpx_notification n;
    uint8_t note[128];
    CHECK(tcpx_endpoint_notification(ep, wait_ms(), &n, note, sizeof note));
    ASSERT(n.len == 7 && memcmp(note, "layer 0", 7) == 0, "notification (%llu bytes)",
           (unsigned long long)n.len);
    ASSERT(strcmp(n.peer, peer.address) == 0, "notification from %s, peer is %s", n.peer, peer.address);
    verify(k + 4096, 8192, 41, 0, "written block 0");
    verify(k + 65536, 4096, 41, 8192, "written block 1");
    verify(k + 200000, 12288, 41, 12288, "written block 2");
    verify(own + 100, 1000, 42, 0, "written caller-owned block");
    verify(k, 4096, 40, 0, "untouched bytes before block 0");

    /* 2. A standalone notification, first into a buffer that is too small. */
    EXPECT(tcpx_endpoint_notification(ep, wait_ms(), &n, NULL, 0), TCPX_ERR_BUFFER_TOO_SMALL,
           "tcpx_endpoint_notification");
    ASSERT(n.len == 100, "needed %llu", (unsigned long long)n.len);
    EXPECT(tcpx_endpoint_notification(ep, 0, &n, note, 10), TCPX_ERR_BUFFER_TOO_SMALL,
           "tcpx_endpoint_notification");
    CHECK(tcpx_endpoint_notification(ep, 0, &n, note, sizeof note));
    ASSERT(n.len == 100 && note[0] == 'N' && note[99] == 'n', "standalone notification");
    EXPECT(tcpx_endpoint_notification(ep, 0, &n, note, sizeof note), TCPX_PENDING, "");

    /* 3. Revoke the caller-owned region's descriptor; the initiator's write must be refused. */
    bool was = false;
    CHECK(tcpx_endpoint_revoke(ep, d2, sizeof d2, &was));
    ASSERT(was, "revoke");
    signal_peer(l, "revoked");
    await_peer(l, "refused");
    uint64_t refusals = 0;
    CHECK(tcpx_endpoint_access_refusals(ep, &refusals));
    ASSERT(refusals == 3, "refusals %llu, expected 3", (unsigned long long)refusals);
    verify(k + 4096, 8192, 41, 0, "a refused write with a wrong key changed nothing");
    verify(own + 100, 1000, 42, 0, "a refused write changed nothing");
    EXPECT(tcpx_endpoint_notification(ep, 0, &n, note, sizeof note), TCPX_PENDING, "");

    await_peer(l, "closing");
    CHECK(tcpx_connection_destroy(c));
    /* Destroying revokes the region's descriptor and releases it. */
    CHECK(tcpx_region_destroy(kv));
    CHECK(tcpx_region_destroy(ownr));
    free(own);
    CHECK(tcpx_endpoint_destroy(ep));
}

static void one_sided_initiator(link_t l) {
    tcpx_endpoint ep = make_endpoint(20000, -1);
    char addr[TCPX_ADDRESS_MAX];
    recv_msg(l, addr, sizeof addr);
    tcpx_remote_segment rem[3];
    uint8_t d1[TCPX_DESCRIPTOR_BYTES], d2[TCPX_DESCRIPTOR_BYTES];
    recv_msg(l, d1, sizeof d1);
    recv_msg(l, d2, sizeof d2);
    /* Connect by address alone this time. */
    tcpx_connection c;
    CHECK(tcpx_endpoint_connect_addr(ep, addr, &c));

    tcpx_region loc;
    CHECK(tcpx_endpoint_alloc_host(ep, 256 << 10, &loc));
    /* Registration on the one-sided comms ahead of the first write (twice is harmless). */
    CHECK(tcpx_connection_warmup(c, &loc, 1));
    CHECK(tcpx_connection_warmup(c, &loc, 1));
    CHECK(tcpx_connection_warmup(c, NULL, 0));
    EXPECT(tcpx_connection_warmup(c, NULL, 1), TCPX_ERR_NULL_POINTER, "tcpx_connection_warmup");
    uint8_t *p = region_ptr(loc, NULL);
    fill(p, 24576, 41, 0);
    fill(p + 100000, 1000, 42, 0);

    /* 1. Write 2 local pieces into 3 remote blocks, with a notification; then one more block
     * into the caller-owned region. */
    tcpx_segment local[2] = {{loc, 0, 10000}, {loc, 10000, 14576}};
    memcpy(rem[0].descriptor, d1, sizeof d1);
    rem[0].offset = 4096;
    rem[0].len = 8192;
    memcpy(rem[1].descriptor, d1, sizeof d1);
    rem[1].offset = 65536;
    rem[1].len = 4096;
    memcpy(rem[2].descriptor, d1, sizeof d1);
    rem[2].offset = 200000;
    rem[2].len = 12288;
    tcpx_transfer t, t2;
    tcpx_segment own_local = {loc, 100000, 1000};
    tcpx_remote_segment own_rem;
    memcpy(own_rem.descriptor, d2, sizeof d2);
    own_rem.offset = 100;
    own_rem.len = 1000;
    CHECK(tcpx_connection_write(c, &own_local, 1, &own_rem, 1, NULL, 0, &t2));
    CHECK(tcpx_connection_write(c, local, 2, rem, 3, (const uint8_t *)"layer 0", 7, &t));
    finish(t2, 1000, "write into the caller-owned region");
    finish(t, 24576, "write with notification");

    /* 2. Read the target's pattern back from two blocks. */
    tcpx_segment into = {loc, 131072, 8192};
    tcpx_remote_segment from[2];
    memcpy(from[0].descriptor, d1, sizeof d1);
    from[0].offset = 500000;
    from[0].len = 4096;
    memcpy(from[1].descriptor, d1, sizeof d1);
    from[1].offset = 0;
    from[1].len = 4096;
    CHECK(tcpx_connection_read(c, &into, 1, from, 2, &t));
    finish(t, 8192, "read");
    verify(p + 131072, 4096, 40, 500000, "read block 0");
    verify(p + 131072 + 4096, 4096, 40, 0, "read block 1");

    /* 3. A standalone notification of 100 bytes. */
    uint8_t note[100];
    memset(note, 'x', sizeof note);
    note[0] = 'N';
    note[99] = 'n';
    CHECK(tcpx_connection_notify(c, note, sizeof note));
    EXPECT(tcpx_connection_notify(c, NULL, 5), TCPX_ERR_NULL_POINTER, "tcpx_connection_notify");

    /* Local errors: out-of-range local piece, garbage descriptor, empty remote list. */
    tcpx_segment bad_local = {loc, (256 << 10) - 10, 1000};
    EXPECT(tcpx_connection_write(c, &bad_local, 1, &own_rem, 1, NULL, 0, &t), TCPX_ERR_INVALID_ARGUMENT,
           "tcpx_connection_write");
    tcpx_remote_segment junk = own_rem;
    junk.descriptor[0] ^= 0xff;
    EXPECT(tcpx_connection_write(c, &own_local, 1, &junk, 1, NULL, 0, &t), TCPX_ERR_INVALID_ARGUMENT,
           "tcpx_connection_write");
    EXPECT(tcpx_connection_read(c, &own_local, 1, rem, 0, &t), TCPX_ERR_INVALID_ARGUMENT,
           "tcpx_connection_read");

    /* 4. Refused: the revoked descriptor, and a block beyond the end of a region. */
    await_peer(l, "revoked");
    /* The source differs from what the target holds, so a write that slipped through shows. */
    tcpx_segment other_local = {loc, 0, 1000};
    CHECK(tcpx_connection_write(c, &other_local, 1, &own_rem, 1, (const uint8_t *)"never", 5, &t));
    EXPECT(tcpx_transfer_wait(t, wait_ms(), NULL), TCPX_ERR_ACCESS, "tcpx_transfer_wait");
    ASSERT(strstr(tcpx_last_error(), "refused") != NULL, "%s", tcpx_last_error());
    CHECK(tcpx_transfer_release(t));
    /* A block beyond the region's end is caught here (the descriptor carries the length)... */
    tcpx_remote_segment beyond = rem[0];
    beyond.offset = KV_BYTES - 100;
    beyond.len = 1000;
    EXPECT(tcpx_connection_read(c, &own_local, 1, &beyond, 1, &t), TCPX_ERR_INVALID_ARGUMENT,
           "tcpx_connection_read");
    /* ...and by the target when the descriptor lies about it (length field, bytes 9..17). */
    uint64_t forged_len = 2 * (uint64_t)KV_BYTES;
    memcpy(beyond.descriptor + 9, &forged_len, sizeof forged_len);
    beyond.offset = KV_BYTES + 4096;
    CHECK(tcpx_connection_read(c, &own_local, 1, &beyond, 1, &t));
    EXPECT(tcpx_transfer_wait(t, wait_ms(), NULL), TCPX_ERR_ACCESS, "tcpx_transfer_wait");
    CHECK(tcpx_transfer_release(t));
    /* A wrong access key (bytes 18..26) is refused. */
    tcpx_remote_segment wrong_key = rem[0];
    wrong_key.descriptor[20] ^= 0x5a;
    wrong_key.len = 1000;
    CHECK(tcpx_connection_write(c, &own_local, 1, &wrong_key, 1, NULL, 0, &t));
    EXPECT(tcpx_transfer_wait(t, wait_ms(), NULL), TCPX_ERR_ACCESS, "tcpx_transfer_wait");
    CHECK(tcpx_transfer_release(t));
    /* Refusals fail the operation, not the connection. */
    CHECK(tcpx_connection_status(c));
    signal_peer(l, "refused");

    tcpx_connection_stats st;
    CHECK(tcpx_connection_get_stats(c, &st));
    ASSERT(st.one_sided_bytes_sent >= 25576 && st.one_sided_bytes_received >= 8192,
           "one-sided stats: sent %llu received %llu", (unsigned long long)st.one_sided_bytes_sent,
           (unsigned long long)st.one_sided_bytes_received);

    signal_peer(l, "closing");
    CHECK(tcpx_connection_close(c));
    CHECK(tcpx_region_destroy(loc));
    CHECK(tcpx_endpoint_destroy(ep));
}

/* ---------------------------------------------------------------- scenario: CUDA */

/* GPU memory both ways: an allocated CUDA region, and a caller-owned CUDA pointer registered
 * with tcpx_endpoint_register (recognised through the driver). Without a CUDA device both
 * sides say so and pass; on a GPU machine this moves verified bytes GPU to GPU (staged through
 * pinned host memory by the built-in plugin). */
static void cuda_receiver(link_t l) {
    tcpx_endpoint ep = make_endpoint(20000, 0);
    size_t n = g_valgrind ? (1u << 20) : (8u << 20);
    tcpx_region dst;
    if (g_valgrind) {
        printf("[%s] skipped under valgrind (the CUDA driver is not valgrind-clean)\n", g_role);
        signal_peer(l, "skip");
        CHECK(tcpx_endpoint_destroy(ep));
        return;
    }
    tcpx_status st = tcpx_endpoint_alloc_cuda(ep, n, &dst);
    if (st == TCPX_ERR_UNSUPPORTED) {
        printf("[%s] skipped: %s\n", g_role, tcpx_last_error());
        signal_peer(l, "skip");
        CHECK(tcpx_endpoint_destroy(ep));
        return;
    }
    CHECK(st);
    signal_peer(l, "go");
    tcpx_connection c = accept_peer(ep, l, NULL);
    uint8_t *host = alloc_aligned(n);
    tcpx_transfer t;
    CHECK(tcpx_connection_recv(c, dst, 0, n, &t));
    finish(t, n, "recv into an allocated CUDA region");
    CHECK(tcpx_region_read(dst, 0, host, n));
    verify(host, n, 11, 0, "CUDA region");

    /* The same device memory, registered as a caller-owned CUDA pointer. */
    void *dptr;
    CHECK(tcpx_region_info(dst, &dptr, NULL, NULL));
    tcpx_region alias;
    CHECK(tcpx_endpoint_register(ep, dptr, n, &alias));
    tcpx_memory_kind kind;
    CHECK(tcpx_region_info(alias, NULL, NULL, &kind));
    ASSERT(kind == TCPX_MEMORY_CUDA, "a device pointer registered as kind %d", (int)kind);
    CHECK(tcpx_connection_recv(c, alias, 0, n, &t));
    finish(t, n, "recv into a caller-owned CUDA pointer");
    CHECK(tcpx_region_read(alias, 0, host, n));
    verify(host, n, 12, 0, "caller-owned CUDA memory");
    printf("[%s] %zu bytes GPU to GPU twice, verified\n", g_role, n);
    await_peer(l, "closing");
    CHECK(tcpx_connection_close(c));
    CHECK(tcpx_region_destroy(alias));
    CHECK(tcpx_region_destroy(dst));
    free(host);
    CHECK(tcpx_endpoint_destroy(ep));
}

static void cuda_sender(link_t l) {
    char word[8] = {0};
    recv_msg(l, word, sizeof word - 1);
    if (strcmp(word, "skip") == 0) return;
    tcpx_endpoint ep = make_endpoint(20000, 0);
    size_t n = g_valgrind ? (1u << 20) : (8u << 20);
    tcpx_region src;
    CHECK(tcpx_endpoint_alloc_cuda(ep, n, &src));
    uint8_t *host = alloc_aligned(n);
    fill(host, n, 11, 0);
    CHECK(tcpx_region_write(src, 0, host, n));
    EXPECT(tcpx_region_write(src, n - 1, host, 2), TCPX_ERR_INVALID_ARGUMENT, "tcpx_region_write");
    tcpx_connection c = connect_peer(ep, l);
    tcpx_transfer t;
    CHECK(tcpx_connection_send(c, src, 0, n, &t));
    finish(t, n, "send from CUDA");
    fill(host, n, 12, 0);
    CHECK(tcpx_region_write(src, 0, host, n));
    CHECK(tcpx_connection_send(c, src, 0, n, &t));
    finish(t, n, "second send from CUDA");
    signal_peer(l, "closing");
    CHECK(tcpx_connection_close(c));
    CHECK(tcpx_region_destroy(src));
    free(host);
    CHECK(tcpx_endpoint_destroy(ep));
}

/* ---------------------------------------------------------------- scenario: same host */

/* Two processes of one host: the local rendezvous (no GPU needed), refusals that come before
 * any copy (an unknown key, bad descriptor bytes, a range outside), a departed peer noticed;
 * and with a GPU, CUDA IPC both ways with verified bytes and a revocation honoured. Under
 * valgrind, or without a CUDA device, the GPU part says so and is skipped. */

#define IPC_BYTES (4u << 20)

/* A well-formed descriptor of the endpoint whose local info is `info`, with a key it never
 * issued: the owner must refuse it. The instance id sits at bytes 29..37 of the info. */
static void forge_descriptor(const uint8_t *info, uint8_t desc[TCPX_IPC_DESCRIPTOR_BYTES]) {
    memset(desc, 0, TCPX_IPC_DESCRIPTOR_BYTES);
    memcpy(desc, "TXIP", 4);
    desc[4] = 1;
    memset(desc + 8, 0x42, 64);
    memcpy(desc + 72, info + 29, 8);
    uint64_t alloc = 8u << 20, len = 1u << 20, key = 0x5eed;
    memcpy(desc + 96, &alloc, 8);
    memcpy(desc + 112, &len, 8);
    memcpy(desc + 120, &key, 8);
}

static tcpx_ipc_segment ipc_segment(tcpx_region r, const uint8_t *desc, uint64_t remote_offset,
                                    uint64_t len) {
    tcpx_ipc_segment s;
    memset(&s, 0, sizeof s);
    s.region = r;
    s.offset = 0;
    memcpy(s.descriptor, desc, TCPX_IPC_DESCRIPTOR_BYTES);
    s.remote_offset = remote_offset;
    s.len = len;
    return s;
}

static void ipc_owner(link_t l) {
    tcpx_endpoint ep = make_endpoint(20000, -1);
    uint8_t info[TCPX_LOCAL_INFO_MAX_BYTES];
    size_t len = sizeof info;
    EXPECT(tcpx_endpoint_local_info(ep, NULL, &len), TCPX_ERR_BUFFER_TOO_SMALL,
           "tcpx_endpoint_local_info");
    ASSERT(len > 0 && len <= sizeof info, "local info of %zu bytes", len);
    CHECK(tcpx_endpoint_local_info(ep, info, &len));
    send_msg(l, info, (uint32_t)len);
    pid_t initiator;
    recv_msg(l, &initiator, sizeof initiator);
    tcpx_local_connection c;
    tcpx_local_peer_info peer;
    CHECK(tcpx_endpoint_accept_local(ep, wait_ms(), &c, &peer));
    ASSERT(peer.pid == (uint32_t)initiator, "accepted pid %u, expected %d", peer.pid, (int)initiator);

    /* The GPU part: advertise, let the initiator write, check; fill, let it read; revoke. */
    tcpx_region dev = {0};
    tcpx_status st = g_valgrind ? TCPX_ERR_UNSUPPORTED : tcpx_endpoint_alloc_cuda(ep, IPC_BYTES, &dev);
    if (st == TCPX_ERR_UNSUPPORTED) {
        printf("[%s] CUDA IPC part skipped: %s\n", g_role,
               g_valgrind ? "under valgrind (the CUDA driver is not valgrind-clean)" : tcpx_last_error());
        signal_peer(l, "skip");
    } else {
        CHECK(st);
        uint8_t desc[TCPX_IPC_DESCRIPTOR_BYTES];
        EXPECT(tcpx_region_advertise_ipc(dev, 0, IPC_BYTES, desc, 10), TCPX_ERR_BUFFER_TOO_SMALL,
               "tcpx_region_advertise_ipc");
        EXPECT(tcpx_region_advertise_ipc(dev, 1, IPC_BYTES, desc, sizeof desc),
               TCPX_ERR_INVALID_ARGUMENT, "tcpx_region_advertise_ipc");
        CHECK(tcpx_region_advertise_ipc(dev, 0, IPC_BYTES, desc, sizeof desc));
        send_msg(l, desc, sizeof desc);
        uint8_t *host = alloc_aligned(IPC_BYTES);
        await_peer(l, "written");
        CHECK(tcpx_region_read(dev, 0, host, IPC_BYTES));
        verify(host, IPC_BYTES, 21, 0, "bytes written through CUDA IPC");
        fill(host, IPC_BYTES, 22, 0);
        CHECK(tcpx_region_write(dev, 0, host, IPC_BYTES));
        signal_peer(l, "filled");
        await_peer(l, "read");
        bool was = false;
        CHECK(tcpx_endpoint_revoke_ipc(ep, desc, sizeof desc, &was));
        ASSERT(was, "the descriptor was advertised");
        CHECK(tcpx_endpoint_revoke_ipc(ep, desc, sizeof desc, &was));
        ASSERT(!was, "revoked twice");
        signal_peer(l, "revoked");
        free(host);
        printf("[%s] %u bytes each way through CUDA IPC, verified\n", g_role, IPC_BYTES);
    }
    await_peer(l, "closing");
    CHECK(tcpx_local_connection_destroy(c));
    EXPECT(tcpx_local_connection_status(c), TCPX_ERR_STALE_HANDLE, "tcpx_local_connection_status");
    signal_peer(l, "closed");
    if (dev.id != 0) CHECK(tcpx_region_destroy(dev));
    CHECK(tcpx_endpoint_destroy(ep));
}

static void ipc_initiator(link_t l) {
    tcpx_endpoint ep = make_endpoint(20000, -1);
    uint8_t info[TCPX_LOCAL_INFO_MAX_BYTES];
    uint32_t info_len = recv_msg(l, info, sizeof info);
    pid_t me = getpid();
    send_msg(l, &me, sizeof me);
    if (!g_valgrind) {
        bool use_ipc = false;
        char why[256] = {0};
        CHECK(tcpx_endpoint_local_route(ep, info, info_len, &use_ipc, why, sizeof why));
        printf("[%s] route to the owner: %s%s\n", g_role, use_ipc ? "CUDA IPC" : "network: ", why);
    }
    EXPECT(tcpx_endpoint_connect_local(ep, info, 3, NULL), TCPX_ERR_NULL_POINTER,
           "tcpx_endpoint_connect_local");
    tcpx_local_connection c;
    EXPECT(tcpx_endpoint_connect_local(ep, info, 3, &c), TCPX_ERR_INVALID_ARGUMENT,
           "tcpx_endpoint_connect_local");
    EXPECT(tcpx_endpoint_connect_local_gpu(ep, "not a bus id", &c), TCPX_ERR_INVALID_ARGUMENT,
           "tcpx_endpoint_connect_local_gpu");
    CHECK(tcpx_endpoint_connect_local(ep, info, info_len, &c));
    tcpx_local_peer_info peer;
    CHECK(tcpx_local_connection_peer(c, &peer));
    CHECK(tcpx_local_connection_status(c));

    /* Refused before any copy: a key the owner never issued, bytes that are no descriptor, a
     * range outside the descriptor, an empty list. */
    tcpx_region host;
    CHECK(tcpx_endpoint_alloc_host(ep, 1 << 16, &host));
    uint8_t forged[TCPX_IPC_DESCRIPTOR_BYTES];
    forge_descriptor(info, forged);
    tcpx_ipc_segment seg = ipc_segment(host, forged, 0, 4096);
    tcpx_transfer t;
    EXPECT(tcpx_local_connection_write_ipc(c, &seg, 1, &t), TCPX_ERR_ACCESS,
           "tcpx_local_connection_write_ipc");
    ASSERT(strstr(tcpx_last_error(), "unknown key") != NULL, "%s", tcpx_last_error());
    EXPECT(tcpx_local_connection_read_ipc(c, &seg, 1, &t), TCPX_ERR_ACCESS,
           "tcpx_local_connection_read_ipc");
    EXPECT(tcpx_local_connection_prepare_ipc(c, forged, sizeof forged, -1), TCPX_ERR_ACCESS,
           "tcpx_local_connection_prepare_ipc");
    EXPECT(tcpx_local_connection_prepare_ipc(c, NULL, sizeof forged, -1),
           TCPX_ERR_NULL_POINTER, "tcpx_local_connection_prepare_ipc");
    EXPECT(tcpx_local_connection_prepare_ipc(c, forged, 3, -1), TCPX_ERR_INVALID_ARGUMENT,
           "tcpx_local_connection_prepare_ipc");
    seg.descriptor[0] = 'X';
    EXPECT(tcpx_local_connection_write_ipc(c, &seg, 1, &t), TCPX_ERR_INVALID_ARGUMENT,
           "tcpx_local_connection_write_ipc");
    seg = ipc_segment(host, forged, (1u << 20) - 10, 4096);
    EXPECT(tcpx_local_connection_write_ipc(c, &seg, 1, &t), TCPX_ERR_INVALID_ARGUMENT,
           "tcpx_local_connection_write_ipc");
    EXPECT(tcpx_local_connection_write_ipc(c, &seg, 0, &t), TCPX_ERR_INVALID_ARGUMENT,
           "tcpx_local_connection_write_ipc");
    CHECK(tcpx_local_connection_status(c));

    uint8_t desc[TCPX_IPC_DESCRIPTOR_BYTES];
    uint32_t n = recv_msg(l, desc, sizeof desc);
    if (n == TCPX_IPC_DESCRIPTOR_BYTES) {
        tcpx_region src, dst;
        CHECK(tcpx_endpoint_alloc_cuda(ep, IPC_BYTES, &src));
        CHECK(tcpx_endpoint_alloc_cuda(ep, IPC_BYTES, &dst));
        uint8_t *buf = alloc_aligned(IPC_BYTES);
        fill(buf, IPC_BYTES, 21, 0);
        CHECK(tcpx_region_write(src, 0, buf, IPC_BYTES));
        /* Confirmed and mapped ahead of the first write. */
        CHECK(tcpx_local_connection_prepare_ipc(c, desc, sizeof desc, -1));
        /* Two segments: the halves, written in one operation. */
        tcpx_ipc_segment two[2] = {ipc_segment(src, desc, 0, IPC_BYTES / 2),
                                   ipc_segment(src, desc, IPC_BYTES / 2, IPC_BYTES / 2)};
        two[1].offset = IPC_BYTES / 2;
        CHECK(tcpx_local_connection_write_ipc(c, two, 2, &t));
        finish(t, IPC_BYTES, "write_ipc");
        signal_peer(l, "written");
        await_peer(l, "filled");
        seg = ipc_segment(dst, desc, 0, IPC_BYTES);
        CHECK(tcpx_local_connection_read_ipc(c, &seg, 1, &t));
        finish(t, IPC_BYTES, "read_ipc");
        CHECK(tcpx_region_read(dst, 0, buf, IPC_BYTES));
        verify(buf, IPC_BYTES, 22, 0, "bytes read through CUDA IPC");
        signal_peer(l, "read");
        await_peer(l, "revoked");
        seg = ipc_segment(src, desc, 0, 4096);
        EXPECT(tcpx_local_connection_write_ipc(c, &seg, 1, &t), TCPX_ERR_ACCESS,
               "tcpx_local_connection_write_ipc");
        ASSERT(strstr(tcpx_last_error(), "revoked") != NULL, "%s", tcpx_last_error());
        CHECK(tcpx_region_destroy(src));
        CHECK(tcpx_region_destroy(dst));
        free(buf);
    }
    signal_peer(l, "closing");
    await_peer(l, "closed");
    /* The owner's goodbye arrived before its destroy returned. */
    EXPECT(tcpx_local_connection_status(c), TCPX_ERR_PEER_CLOSED, "tcpx_local_connection_status");
    CHECK(tcpx_local_connection_destroy(c));
    CHECK(tcpx_region_destroy(host));
    CHECK(tcpx_endpoint_destroy(ep));
}

/* ---------------------------------------------------------------- scenario: peer killed */

#define KILL_TIMEOUT_MS 3000

static void killed_survivor(link_t l) {
    tcpx_endpoint ep = make_endpoint(KILL_TIMEOUT_MS, -1);
    tcpx_connection c = accept_peer(ep, l, NULL);
    pid_t victim;
    recv_msg(l, &victim, sizeof victim);
    size_t n = g_valgrind ? (4u << 20) : (64u << 20);
    uint8_t *mem = alloc_aligned(n);
    tcpx_region r;
    CHECK(tcpx_endpoint_register(ep, mem, n, &r));
    /* The peer sends the first half and never the second: the second receive is pending for
     * sure when the peer dies; the first is in progress or done. */
    tcpx_transfer first, second;
    CHECK(tcpx_connection_recv(c, r, 0, n / 2, &first));
    CHECK(tcpx_connection_recv(c, r, n / 2, n / 2, &second));
    signal_peer(l, "posted");
    tcpx_connection_stats st = {0};
    double t0 = now_s();
    while (st.bytes_received == 0 && tcpx_transfer_test(first, NULL) == TCPX_PENDING &&
           now_s() - t0 < 30.0) {
        CHECK(tcpx_connection_get_stats(c, &st));
        usleep(200);
    }
    int mid = tcpx_transfer_test(first, NULL) == TCPX_PENDING;
    ASSERT(kill(victim, SIGKILL) == 0, "kill: %s", strerror(errno));
    double killed = now_s();
    tcpx_status s2 = tcpx_transfer_wait(second, KILL_TIMEOUT_MS + (g_valgrind ? 60000 : 5000), NULL);
    double took = now_s() - killed;
    ASSERT(s2 != TCPX_OK && s2 != TCPX_PENDING,
           "the pending receive did not fail after the peer died (%s, %.1f s)", tcpx_status_str(s2), took);
    printf("[%s] peer killed %s: pending receive failed after %.2f s with %s: %s\n", g_role,
           mid ? "mid-transfer" : "after the first transfer", took, tcpx_status_str(s2), tcpx_last_error());
    tcpx_status s1 = tcpx_transfer_wait(first, wait_ms(), NULL);
    ASSERT(s1 != TCPX_PENDING, "the first receive still pending");
    tcpx_status sc = tcpx_connection_status(c);
    ASSERT(sc != TCPX_OK && sc != TCPX_PENDING, "the connection still reports OK");
    CHECK(tcpx_transfer_release(first));
    CHECK(tcpx_transfer_release(second));
    CHECK(tcpx_connection_destroy(c));
    CHECK(tcpx_region_destroy(r));
    free(mem);
    CHECK(tcpx_endpoint_destroy(ep));
}

static void killed_victim(link_t l) {
    tcpx_endpoint ep = make_endpoint(KILL_TIMEOUT_MS, -1);
    tcpx_connection c = connect_peer(ep, l);
    pid_t me = getpid();
    send_msg(l, &me, sizeof me);
    size_t n = g_valgrind ? (4u << 20) : (64u << 20);
    tcpx_region r;
    CHECK(tcpx_endpoint_alloc_host(ep, n / 2, &r));
    await_peer(l, "posted");
    tcpx_transfer t;
    CHECK(tcpx_connection_send(c, r, 0, n / 2, &t));
    /* Wait to be killed; SIGKILL is the expected end of this process. */
    for (;;) pause();
}

/* ---------------------------------------------------------------- scenario: rendezvous by name */

/* The etcd store the harness (`cargo xtask capi --test`) started on 127.0.0.1 for this run,
 * as a store URL; NULL (the scenario skips) when it found no etcd binary. */
static const char *etcd_url(void) {
    const char *url = getenv("TCPX_TEST_ETCD");
    if (url == NULL || url[0] == 0) {
        printf("[%s] skipped: TCPX_TEST_ETCD is not set (no etcd binary: apt-get install "
               "etcd-server)\n", g_role);
        return NULL;
    }
    return url;
}

#define RDV_NAME "capi-server"
#define RDV_LEN ((size_t)(3u << 20) + 5)

static void rdv_server(link_t l) {
    const char *url = etcd_url();
    if (url == NULL) return;
    tcpx_endpoint ep = make_endpoint(wait_ms(), -1);
    /* Arguments first: a malformed URL, an empty name. */
    EXPECT(tcpx_endpoint_publish(ep, "redis://127.0.0.1:1/x", RDV_NAME), TCPX_ERR_INVALID_ARGUMENT,
           "tcpx_endpoint_publish");
    EXPECT(tcpx_endpoint_publish(ep, url, ""), TCPX_ERR_INVALID_ARGUMENT, "tcpx_endpoint_publish");
    EXPECT(tcpx_endpoint_publish(ep, NULL, RDV_NAME), TCPX_ERR_NULL_POINTER, "tcpx_endpoint_publish");
    EXPECT(tcpx_endpoint_unpublish(ep, url, RDV_NAME), TCPX_ERR_INVALID_ARGUMENT,
           "tcpx_endpoint_unpublish");
    /* The client is already looking for the name (it waits for it to appear). */
    await_peer(l, "looking");
    CHECK(tcpx_endpoint_publish(ep, url, RDV_NAME));
    tcpx_connection c;
    CHECK(tcpx_endpoint_accept(ep, wait_ms(), &c, NULL));
    tcpx_region r;
    CHECK(tcpx_endpoint_alloc_host(ep, RDV_LEN, &r));
    size_t len = 0;
    uint8_t *p = region_ptr(r, &len);
    memset(p, 0, RDV_LEN);
    tcpx_transfer t;
    CHECK(tcpx_connection_recv(c, r, 0, RDV_LEN, &t));
    finish(t, RDV_LEN, "recv from the peer found by name");
    verify(p, RDV_LEN, 23, 0, "bytes from the peer found by name");
    /* Gone from the store at once; a second unpublish is refused. */
    CHECK(tcpx_endpoint_unpublish(ep, url, RDV_NAME));
    EXPECT(tcpx_endpoint_unpublish(ep, url, RDV_NAME), TCPX_ERR_INVALID_ARGUMENT,
           "tcpx_endpoint_unpublish");
    signal_peer(l, "unpublished");
    await_peer(l, "checked");
    CHECK(tcpx_connection_destroy(c));
    CHECK(tcpx_region_destroy(r));
    CHECK(tcpx_endpoint_destroy(ep));
}

static void rdv_client(link_t l) {
    const char *url = etcd_url();
    if (url == NULL) return;
    tcpx_endpoint ep = make_endpoint(wait_ms(), -1);
    tcpx_connection c;
    EXPECT(tcpx_endpoint_connect_by_name(ep, url, RDV_NAME, 0, NULL), TCPX_ERR_NULL_POINTER,
           "tcpx_endpoint_connect_by_name");
    signal_peer(l, "looking");
    CHECK(tcpx_endpoint_connect_by_name(ep, url, RDV_NAME, wait_ms(), &c));
    tcpx_region r;
    CHECK(tcpx_endpoint_alloc_host(ep, RDV_LEN, &r));
    size_t len = 0;
    fill(region_ptr(r, &len), RDV_LEN, 23, 0);
    tcpx_transfer t;
    CHECK(tcpx_connection_send(c, r, 0, RDV_LEN, &t));
    finish(t, RDV_LEN, "send to the peer found by name");
    /* Once unpublished, the name is not found: the wait runs out. */
    await_peer(l, "unpublished");
    tcpx_connection none;
    EXPECT(tcpx_endpoint_connect_by_name(ep, url, RDV_NAME, 300, &none), TCPX_ERR_TIMEOUT,
           "tcpx_endpoint_connect_by_name");
    ASSERT(strstr(tcpx_last_error(), RDV_NAME) != NULL, "%s", tcpx_last_error());
    signal_peer(l, "checked");
    CHECK(tcpx_connection_destroy(c));
    CHECK(tcpx_region_destroy(r));
    CHECK(tcpx_endpoint_destroy(ep));
}

/* ---------------------------------------------------------------- scenario: destroy in flight */

static void inflight_receiver(link_t l) {
    tcpx_endpoint ep = make_endpoint(5000, -1);
    tcpx_connection c = accept_peer(ep, l, NULL);
    size_t n = 1u << 20;
    uint8_t *mem = alloc_aligned(4 * n);
    tcpx_region r;
    CHECK(tcpx_endpoint_register(ep, mem, 4 * n, &r));
    tcpx_transfer ts[4];
    for (int k = 0; k < 4; k++) CHECK(tcpx_connection_recv(c, r, (uint64_t)k * n, n, &ts[k]));
    signal_peer(l, "posted");
    await_peer(l, "destroyed");
    /* Destroy the whole endpoint with receives in flight (some may have finished). */
    double t0 = now_s();
    CHECK(tcpx_endpoint_destroy(ep));
    double took = now_s() - t0;
    ASSERT(took < 5.0 + 2.0, "endpoint destroy took %.1f s", took);
    int failed = 0;
    for (int k = 0; k < 4; k++) {
        tcpx_status s = tcpx_transfer_test(ts[k], NULL);
        ASSERT(s != TCPX_PENDING, "receive %d still pending after its endpoint was destroyed", k);
        failed += s != TCPX_OK;
        CHECK(tcpx_transfer_release(ts[k]));
    }
    ASSERT(failed >= 2, "only %d receives failed; the sender sent at most 2", failed);
    EXPECT(tcpx_region_destroy(r), TCPX_ERR_STALE_HANDLE, "tcpx_region_destroy");
    EXPECT(tcpx_connection_close(c), TCPX_ERR_STALE_HANDLE, "tcpx_connection_close");
    /* Nothing touches the memory any more: valgrind would see a write into freed memory. */
    free(mem);
}

static void inflight_sender(link_t l) {
    tcpx_endpoint ep = make_endpoint(5000, -1);
    tcpx_connection c = connect_peer(ep, l);
    size_t n = 1u << 20;
    uint8_t *mem = alloc_aligned(2 * n);
    fill(mem, 2 * n, 9, 0);
    tcpx_region r;
    CHECK(tcpx_endpoint_register(ep, mem, 2 * n, &r));
    await_peer(l, "posted");
    tcpx_transfer ts[2];
    CHECK(tcpx_connection_send(c, r, 0, n, &ts[0]));
    CHECK(tcpx_connection_send(c, r, n, n, &ts[1]));
    /* Destroy the connection at once, sends probably in flight. */
    CHECK(tcpx_connection_destroy(c));
    for (int k = 0; k < 2; k++) {
        tcpx_status s = tcpx_transfer_test(ts[k], NULL);
        ASSERT(s == TCPX_OK || s == TCPX_ERR_CLOSED, "send %d after destroy: %s", k, tcpx_status_str(s));
        CHECK(tcpx_transfer_release(ts[k]));
    }
    /* Nothing in flight any more: the region can go, and its memory. */
    CHECK(tcpx_region_destroy(r));
    free(mem);
    signal_peer(l, "destroyed");
    CHECK(tcpx_endpoint_destroy(ep));
}

/* ---------------------------------------------------------------- scenario: batches */

/* Messages of a batch: message k is batch_len(k) bytes (uneven sizes), at k * stride in its
 * side's memory (the sender's and the receiver's strides differ: both lists are scattered). */
#define BATCH_SEND_STRIDE 3000u
#define BATCH_RECV_STRIDE 2048u
static size_t batch_count(void) { return g_valgrind ? 48 : 300; }
static size_t batch_len(size_t k) { return 64 + (k * 37) % 1500; }

static void batch_receiver(link_t l) {
    tcpx_endpoint ep = make_endpoint(10000, -1);
    tcpx_connection c = accept_peer(ep, l, NULL);
    size_t n = batch_count();

    /* Pack buffers up front: a NULL count is allowed, the count is the pool's size. */
    CHECK(tcpx_connection_reserve_batches(c, 1, NULL));
    size_t reserved = 0;
    CHECK(tcpx_connection_reserve_batches(c, 2, &reserved));
    ASSERT(reserved == 2, "reserved %zu pack buffers, expected 2", reserved);
    EXPECT(tcpx_connection_reserve_batches((tcpx_connection){0}, 1, NULL), TCPX_ERR_NULL_POINTER,
           "tcpx_connection_reserve_batches");

    tcpx_region dst;
    CHECK(tcpx_endpoint_alloc_host(ep, n * BATCH_RECV_STRIDE, &dst));
    size_t dlen;
    uint8_t *d = region_ptr(dst, &dlen);
    memset(d, 0xEE, dlen);
    tcpx_transfer t;
    EXPECT(tcpx_connection_recv_batch(c, (tcpx_segment[]){{dst, 0, 1}}, 0, &t),
           TCPX_ERR_INVALID_ARGUMENT, "tcpx_connection_recv_batch");

    /* 1. Many small messages, each into its own slot, in order. */
    tcpx_segment *rs = calloc(n, sizeof *rs);
    ASSERT(rs != NULL, "calloc");
    uint64_t total = 0;
    for (size_t k = 0; k < n; k++) {
        rs[k] = (tcpx_segment){dst, (uint64_t)k * BATCH_RECV_STRIDE, batch_len(k)};
        total += batch_len(k);
    }
    CHECK(tcpx_connection_recv_batch(c, rs, n, &t));
    free(rs);
    finish(t, total, "batch recv");
    for (size_t k = 0; k < n; k++) {
        const uint8_t *m = d + k * BATCH_RECV_STRIDE;
        verify(m, batch_len(k), 300 + (uint64_t)k, 0, "batch message");
        /* Nothing past the message: the slot's tail is untouched. */
        ASSERT(m[batch_len(k)] == 0xEE,
               "message %zu overran its slot", k);
    }

    /* 2. The peer sends one run cut in three; this side receives it over two regions. */
    size_t whole = g_valgrind ? 20000 : 300001;
    size_t cut = whole / 2 + 3;
    tcpx_region d1, d2;
    CHECK(tcpx_endpoint_alloc_host(ep, cut + 10, &d1));
    CHECK(tcpx_endpoint_alloc_host(ep, whole - cut + 3, &d2));
    uint8_t *p1 = region_ptr(d1, &dlen);
    uint8_t *p2 = region_ptr(d2, &dlen);
    CHECK(tcpx_connection_recv_batch(c, (tcpx_segment[]){{d1, 10, cut}, {d2, 3, whole - cut}}, 2, &t));
    finish(t, whole, "batch recv over two regions");
    verify(p1 + 10, cut, 31, 0, "batch stream, first region");
    verify(p2 + 3, whole - cut, 31, cut, "batch stream, second region");

    /* 3. Totals that differ (this side expects more than the peer's batch holds): the receive
     * fails within the wait; it does not hang. */
    CHECK(tcpx_connection_recv_batch(c, (tcpx_segment[]){{dst, 0, 4096}, {dst, 8192, 4096}}, 2, &t));
    tcpx_status st = tcpx_transfer_wait(t, wait_ms(), NULL);
    ASSERT(st != TCPX_OK && st != TCPX_PENDING, "mismatched batch receive -> %s", tcpx_status_str(st));
    printf("[%s] mismatched batch: %s: %s\n", g_role, tcpx_status_str(st), tcpx_last_error());
    CHECK(tcpx_transfer_release(t));
    signal_peer(l, "checked");

    await_peer(l, "closing");
    CHECK(tcpx_connection_destroy(c));
    CHECK(tcpx_region_destroy(d2));
    CHECK(tcpx_region_destroy(d1));
    CHECK(tcpx_region_destroy(dst));
    CHECK(tcpx_endpoint_destroy(ep));
}

static void batch_sender(link_t l) {
    tcpx_endpoint ep = make_endpoint(10000, -1);
    tcpx_connection c = connect_peer(ep, l);
    size_t n = batch_count();
    /* Caller-owned memory, registered; messages scattered through it. */
    size_t bytes = n * BATCH_SEND_STRIDE;
    uint8_t *mem = alloc_aligned(bytes);
    tcpx_region src;
    CHECK(tcpx_endpoint_register(ep, mem, bytes, &src));
    CHECK(tcpx_connection_reserve_batches(c, 2, NULL));

    /* Refused at once, nothing sent: NULL list, empty list, a range outside its region, a
     * total over TCPX_BATCH_MAX_BYTES, a NULL output. */
    tcpx_transfer t;
    EXPECT(tcpx_connection_send_batch(c, NULL, 1, &t), TCPX_ERR_NULL_POINTER,
           "tcpx_connection_send_batch");
    EXPECT(tcpx_connection_send_batch(c, (tcpx_segment[]){{src, 0, 1}}, 0, &t),
           TCPX_ERR_INVALID_ARGUMENT, "tcpx_connection_send_batch");
    EXPECT(tcpx_connection_send_batch(c, (tcpx_segment[]){{src, bytes - 10, 11}}, 1, &t),
           TCPX_ERR_INVALID_ARGUMENT, "tcpx_connection_send_batch");
    tcpx_region big;
    uint64_t half = TCPX_BATCH_MAX_BYTES / 2;
    CHECK(tcpx_endpoint_alloc_host(ep, TCPX_BATCH_MAX_BYTES + 4096, &big));
    EXPECT(tcpx_connection_send_batch(c, (tcpx_segment[]){{big, 0, half}, {big, half, half + 1}}, 2, &t),
           TCPX_ERR_INVALID_ARGUMENT, "tcpx_connection_send_batch");
    ASSERT(strstr(tcpx_last_error(), "split it") != NULL, "%s", tcpx_last_error());
    CHECK(tcpx_region_destroy(big));
    EXPECT(tcpx_connection_send_batch(c, (tcpx_segment[]){{src, 0, 1}}, 1, NULL),
           TCPX_ERR_NULL_POINTER, "tcpx_connection_send_batch");
    EXPECT(tcpx_connection_send_batch((tcpx_connection){0}, (tcpx_segment[]){{src, 0, 1}}, 1, &t),
           TCPX_ERR_NULL_POINTER, "tcpx_connection_send_batch");

    /* 1. Many small messages of uneven sizes in one batch (through a pack buffer). */
    tcpx_segment *ss = calloc(n, sizeof *ss);
    ASSERT(ss != NULL, "calloc");
    uint64_t total = 0;
    for (size_t k = 0; k < n; k++) {
        fill(mem + k * BATCH_SEND_STRIDE, batch_len(k), 300 + (uint64_t)k, 0);
        ss[k] = (tcpx_segment){src, (uint64_t)k * BATCH_SEND_STRIDE, batch_len(k)};
        total += batch_len(k);
    }
    ASSERT(total <= TCPX_BATCH_MAX_BYTES, "batch of %llu bytes", (unsigned long long)total);
    CHECK(tcpx_connection_send_batch(c, ss, n, &t));
    free(ss);
    finish(t, total, "batch send");

    /* 2. One run cut in three uneven pieces (sent in place). */
    size_t whole = g_valgrind ? 20000 : 300001;
    fill(mem, whole, 31, 0);
    CHECK(tcpx_connection_send_batch(
        c, (tcpx_segment[]){{src, 0, 1}, {src, 1, whole / 3}, {src, 1 + whole / 3, whole - 1 - whole / 3}},
        3, &t));
    finish(t, whole, "batch send, one run");

    /* 3. A batch smaller than the peer's receive: whatever this side sees, it finishes. */
    CHECK(tcpx_connection_send_batch(c, (tcpx_segment[]){{src, 0, 3000}, {src, 4096, 3000}}, 2, &t));
    tcpx_status st = tcpx_transfer_wait(t, wait_ms(), NULL);
    ASSERT(st != TCPX_PENDING, "the smaller batch's send did not finish");
    CHECK(tcpx_transfer_release(t));
    await_peer(l, "checked");

    signal_peer(l, "closing");
    CHECK(tcpx_connection_destroy(c));
    CHECK(tcpx_region_destroy(src));
    free(mem);
    CHECK(tcpx_endpoint_destroy(ep));
}

/* ---------------------------------------------------------------- coordinator */

typedef void (*role_fn)(link_t);

static pid_t spawn(const char *role, role_fn fn, link_t l, int close_a, int close_b) {
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) FAIL("fork: %s", strerror(errno));
    if (pid == 0) {
        g_role = role;
        if (close_a >= 0) close(close_a);
        if (close_b >= 0) close(close_b);
        fn(l);
        printf("[%s] ok\n", role);
        fflush(NULL);
        exit(0);
    }
    return pid;
}

/* Waits for `pid` until `deadline`; returns its wait status, or kills it and fails. */
static int reap(pid_t pid, const char *role, double deadline) {
    int status;
    for (;;) {
        pid_t r = waitpid(pid, &status, WNOHANG);
        if (r == pid) return status;
        if (r < 0) FAIL("waitpid: %s", strerror(errno));
        if (now_s() > deadline) {
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            FAIL("%s did not finish in time; killed", role);
        }
        usleep(10000);
    }
}

static const char *g_only; /* run only scenarios whose name contains this */

static int run_scenario(const char *name, const char *ra, role_fn a, const char *rb, role_fn b,
                        int b_is_killed) {
    if (g_only && !strstr(name, g_only)) return -1;
    printf("== %s\n", name);
    fflush(NULL);
    double deadline = now_s() + (g_valgrind ? 1200.0 : 240.0);
    int ab[2], ba[2];
    if (pipe(ab) != 0 || pipe(ba) != 0) FAIL("pipe: %s", strerror(errno));
    pid_t pa = spawn(ra, a, (link_t){ba[0], ab[1]}, ab[0], ba[1]);
    pid_t pb = -1;
    if (b) pb = spawn(rb, b, (link_t){ab[0], ba[1]}, ba[0], ab[1]);
    close(ab[0]);
    close(ab[1]);
    close(ba[0]);
    close(ba[1]);
    int ok = 1;
    int sa = reap(pa, ra, deadline);
    if (!WIFEXITED(sa) || WEXITSTATUS(sa) != 0) {
        fprintf(stderr, "== %s: %s failed (status %d)\n", name, ra, sa);
        ok = 0;
    }
    if (b) {
        int sb = reap(pb, rb, deadline);
        int good = b_is_killed ? (WIFSIGNALED(sb) && WTERMSIG(sb) == SIGKILL)
                               : (WIFEXITED(sb) && WEXITSTATUS(sb) == 0);
        if (!good) {
            fprintf(stderr, "== %s: %s failed (status %d)\n", name, rb, sb);
            ok = 0;
        }
    }
    printf("== %s: %s\n", name, ok ? "passed" : "FAILED");
    return ok;
}

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--valgrind") == 0) g_valgrind = 1;
        else if (argv[i][0] != '-' && !g_only) g_only = argv[i];
        else {
            fprintf(stderr, "usage: %s [--valgrind] [SCENARIO_NAME_PART]\n", argv[0]);
            return 2;
        }
    }
    /* Keep the plugin and every control listener on loopback whatever the caller set. */
    setenv("TCPX_SOCKET_IFNAME", "lo", 1);
    setenv("NCCL_SOCKET_IFNAME", "lo", 1);
    int passed = 0, failed = 0;
#define RUN(...)                                  \
    do {                                          \
        int r_ = run_scenario(__VA_ARGS__);       \
        if (r_ > 0) passed++;                     \
        else if (r_ == 0) failed++;               \
    } while (0)
    RUN("arguments, handles and errors", "args", scenario_arguments, NULL, NULL, 0);
    RUN("stop accepting: blocked accepts end at once (stop, destroy)", "stop", scenario_stop_accepting,
        NULL, NULL, 0);
    RUN("connect by address refused by an endpoint that requires its secret", "secret",
        scenario_secret, NULL, NULL, 0);
    RUN("two-sided: contiguous, vectored, threaded, pending", "server", two_sided_server, "client",
        two_sided_client, 0);
    RUN("one-sided: write, read, notifications, refusals", "target", one_sided_target, "initiator",
        one_sided_initiator, 0);
    RUN("CUDA memory: allocated and caller-owned (skips without a GPU)", "cuda-receiver",
        cuda_receiver, "cuda-sender", cuda_sender, 0);
    RUN("same host: local rendezvous, refusals, CUDA IPC (GPU part skips without a GPU)",
        "ipc-owner", ipc_owner, "ipc-initiator", ipc_initiator, 0);
    RUN("peer killed mid-transfer", "survivor", killed_survivor, "victim", killed_victim, 1);
    RUN("rendezvous by name through etcd (skips without TCPX_TEST_ETCD)", "rdv-server", rdv_server,
        "rdv-client", rdv_client, 0);
    RUN("destroy with transfers in flight", "receiver", inflight_receiver, "sender", inflight_sender, 0);
    RUN("batches of small messages: in order, reserved, refusals, mismatched totals",
        "batch-receiver", batch_receiver, "batch-sender", batch_sender, 0);
    printf("%d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
