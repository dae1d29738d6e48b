/*
 * Two-process send / receive over the tcpx C API, and its throughput.
 *
 *   send_recv server META_FILE [--size BYTES] [--reps N] [--bytes-per-rep BYTES]
 *   send_recv client META_FILE [same options]
 *
 * The server writes its endpoint metadata to META_FILE and accepts; the client reads it and
 * connects. Per repetition the server posts enough receives of --size bytes to move about
 * --bytes-per-rep (all at once), tells the client with a notification, and the client posts as
 * many sends and times them until the last completes; the median over --reps repetitions is
 * printed (the same method as `tcpx-bench stack`). The first and last messages are verified.
 *
 * Everything else comes from the environment: TCPX_NUM_CHANNELS, TCPX_CHUNK_BYTES,
 * TCPX_PLUGIN_PATH or TCPX_BACKEND, TCPX_CONTROL_ADDR (use 127.0.0.1:0 for a local run), ...
 *
 * Build: cc -O2 send_recv.c $(pkg-config --cflags --libs tcpx) -o send_recv
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "tcpx.h"

#define TRY(call)                                                                       \
    do {                                                                                \
        tcpx_status st_ = (call);                                                       \
        if (st_ != TCPX_OK) {                                                           \
            fprintf(stderr, "%s failed: %s: %s\n", #call, tcpx_status_str(st_),        \
                    tcpx_last_error());                                                 \
            exit(1);                                                                    \
        }                                                                               \
    } while (0)

#define MAX_MESSAGES 4096
#define WAIT_MS 60000

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static uint8_t pattern(size_t i) { return (uint8_t)(i * 7 + (i >> 12)); }

/* Waits for every transfer to move `size` bytes, then releases them. */
static void wait_all(tcpx_transfer *ts, size_t n, size_t size) {
    for (size_t k = 0; k < n; k++) {
        uint64_t bytes = 0;
        TRY(tcpx_transfer_wait(ts[k], WAIT_MS, &bytes));
        if (bytes != size) {
            fprintf(stderr, "transfer %zu moved %llu bytes, not %zu\n", k,
                    (unsigned long long)bytes, size);
            exit(1);
        }
        TRY(tcpx_transfer_release(ts[k]));
    }
}

int main(int argc, char **argv) {
    if (argc < 3 || (strcmp(argv[1], "server") != 0 && strcmp(argv[1], "client") != 0)) {
        fprintf(stderr, "usage: %s server|client META_FILE [--size B] [--reps N] "
                        "[--bytes-per-rep B]\n", argv[0]);
        return 2;
    }
    int server = strcmp(argv[1], "server") == 0;
    const char *meta_file = argv[2];
    size_t size = 8u << 20, per_rep = 64u << 20;
    int reps = 2;
    for (int i = 3; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--size") == 0) size = strtoull(argv[i + 1], NULL, 0);
        else if (strcmp(argv[i], "--reps") == 0) reps = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--bytes-per-rep") == 0) per_rep = strtoull(argv[i + 1], NULL, 0);
    }
    size_t messages = (per_rep + size - 1) / size;
    if (size == 0 || reps < 1 || reps > 1000 || messages > MAX_MESSAGES) {
        fprintf(stderr, "bad sizes\n");
        return 2;
    }

    TRY(TCPX_ABI_CHECK());
    tcpx_endpoint ep;
    TRY(tcpx_endpoint_create(NULL, &ep)); /* everything from the environment */
    tcpx_endpoint_info info;
    TRY(tcpx_endpoint_get_info(ep, &info));

    tcpx_connection conn;
    if (server) {
        /* Publish the metadata (written then renamed, so the client never reads half). */
        uint8_t meta[TCPX_METADATA_MAX_BYTES];
        size_t len = sizeof meta;
        TRY(tcpx_endpoint_metadata(ep, meta, &len));
        char tmp[4096];
        snprintf(tmp, sizeof tmp, "%s.tmp", meta_file);
        FILE *f = fopen(tmp, "wb");
        if (!f || fwrite(meta, 1, len, f) != len || fclose(f) != 0 || rename(tmp, meta_file) != 0) {
            perror(meta_file);
            return 1;
        }
        tcpx_peer_info peer;
        TRY(tcpx_endpoint_accept(ep, WAIT_MS, &conn, &peer));
        printf("server: %s (%s, %u channels) accepted %s\n", info.control_addr, info.plugin,
               info.channels, peer.address);
    } else {
        uint8_t meta[TCPX_METADATA_MAX_BYTES];
        FILE *f = fopen(meta_file, "rb");
        if (!f) {
            perror(meta_file);
            return 1;
        }
        size_t len = fread(meta, 1, sizeof meta, f);
        fclose(f);
        TRY(tcpx_endpoint_connect(ep, meta, len, &conn));
    }

    /* One buffer of `size` bytes; every message of a repetition uses it. */
    tcpx_region buf;
    TRY(tcpx_endpoint_alloc_host(ep, size, &buf));
    uint8_t *p;
    TRY(tcpx_region_info(buf, (void **)&p, NULL, NULL));
    if (!server)
        for (size_t i = 0; i < size; i++) p[i] = pattern(i);
    TRY(tcpx_connection_register(conn, buf));

    static tcpx_transfer ts[MAX_MESSAGES];
    double secs[1001];
    for (int r = 0; r <= reps; r++) { /* repetition 0 warms up */
        double t0 = 0;
        if (server) {
            if (r > 0) memset(p, 0, size);
            for (size_t k = 0; k < messages; k++) TRY(tcpx_connection_recv(conn, buf, 0, size, &ts[k]));
            t0 = now_s();
            TRY(tcpx_connection_notify(conn, (const uint8_t *)"ready", 5));
        } else {
            tcpx_notification n;
            uint8_t word[8];
            TRY(tcpx_endpoint_notification(ep, WAIT_MS, &n, word, sizeof word));
            t0 = now_s();
            for (size_t k = 0; k < messages; k++) TRY(tcpx_connection_send(conn, buf, 0, size, &ts[k]));
        }
        wait_all(ts, messages, size);
        secs[r] = now_s() - t0;
        if (server) {
            for (size_t i = 0; i < size; i++)
                if (p[i] != pattern(i)) {
                    fprintf(stderr, "server: byte %zu is %u, expected %u\n", i, p[i], pattern(i));
                    return 1;
                }
        }
    }
    qsort(secs + 1, (size_t)reps, sizeof secs[0], cmp_double);
    double median = secs[1 + reps / 2];
    printf("%s: %zu x %zu bytes per repetition, median of %d: %.2f GB/s (verified)\n",
           server ? "server" : "client", messages, size, reps,
           (double)(messages * size) / median / 1e9);

    tcpx_connection_stats st;
    TRY(tcpx_connection_get_stats(conn, &st));
    printf("%s: %llu bytes sent, %llu received over %u channels\n", server ? "server" : "client",
           (unsigned long long)st.bytes_sent, (unsigned long long)st.bytes_received, st.channels);
    TRY(tcpx_connection_close(conn));
    TRY(tcpx_region_destroy(buf));
    TRY(tcpx_endpoint_destroy(ep));
    if (server) unlink(meta_file);
    return 0;
}
