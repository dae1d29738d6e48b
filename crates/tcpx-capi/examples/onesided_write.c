/*
 * One-sided write with a notification over the tcpx C API (the KV-cache pattern: an initiator
 * writes blocks into a target's advertised memory, and the target learns from the notification
 * that they landed, without posting anything).
 *
 *   onesided_write target RENDEZVOUS_FILE
 *   onesided_write initiator RENDEZVOUS_FILE
 *
 * The target advertises a region and writes its control address and the region's descriptor
 * to RENDEZVOUS_FILE; the initiator connects by address alone, writes four 16 KiB blocks to
 * scattered offsets of the target's region in one call with a notification, and waits for the
 * acknowledgement. The target waits for the notification and checks the blocks.
 *
 * Configuration comes from the environment (TCPX_CONTROL_ADDR=127.0.0.1:0 for a local run).
 * Build: cc -O2 onesided_write.c $(pkg-config --cflags --libs tcpx) -o onesided_write
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

#define WAIT_MS 60000
#define REGION_BYTES (1u << 20)
#define BLOCK 16384
#define BLOCKS 4
/* Where the initiator's blocks land in the target's region. */
static const uint64_t offsets[BLOCKS] = {0, 262144, 65536, 917504};

static uint8_t pattern(size_t block, size_t i) { return (uint8_t)(block * 61 + i * 3 + (i >> 8)); }

static int target(const char *file) {
    tcpx_endpoint ep;
    TRY(tcpx_endpoint_create(NULL, &ep));
    tcpx_region kv;
    TRY(tcpx_endpoint_alloc_host(ep, REGION_BYTES, &kv));
    uint8_t *p;
    TRY(tcpx_region_info(kv, (void **)&p, NULL, NULL));
    uint8_t desc[TCPX_DESCRIPTOR_BYTES];
    TRY(tcpx_region_advertise(kv, desc, sizeof desc));
    tcpx_endpoint_info info;
    TRY(tcpx_endpoint_get_info(ep, &info));

    /* Rendezvous: "address\n" then the descriptor's bytes; written, then renamed. */
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", file);
    FILE *f = fopen(tmp, "wb");
    if (!f || fprintf(f, "%s\n", info.control_addr) < 0 || fwrite(desc, 1, sizeof desc, f) != sizeof desc ||
        fclose(f) != 0 || rename(tmp, file) != 0) {
        perror(file);
        return 1;
    }

    tcpx_connection conn;
    tcpx_peer_info peer;
    TRY(tcpx_endpoint_accept(ep, WAIT_MS, &conn, &peer));

    /* No receive is posted: the notification says the data is there. */
    tcpx_notification note;
    char text[128] = {0};
    TRY(tcpx_endpoint_notification(ep, WAIT_MS, &note, (uint8_t *)text, sizeof text - 1));
    printf("target: notification from %s: \"%s\"\n", note.peer, text);
    for (size_t b = 0; b < BLOCKS; b++)
        for (size_t i = 0; i < BLOCK; i++)
            if (p[offsets[b] + i] != pattern(b, i)) {
                fprintf(stderr, "target: block %zu byte %zu is wrong\n", b, i);
                return 1;
            }
    printf("target: %d blocks of %d bytes verified\n", BLOCKS, BLOCK);

    /* Wait for the initiator to close, then tear down. */
    tcpx_connection_stats st;
    do {
        usleep(1000);
    } while (tcpx_connection_status(conn) == TCPX_OK && tcpx_connection_get_stats(conn, &st) == TCPX_OK &&
             st.in_flight > 0);
    TRY(tcpx_connection_destroy(conn));
    TRY(tcpx_region_destroy(kv)); /* revokes the descriptor too */
    TRY(tcpx_endpoint_destroy(ep));
    unlink(file);
    return 0;
}

static int initiator(const char *file) {
    char addr[TCPX_ADDRESS_MAX];
    uint8_t desc[TCPX_DESCRIPTOR_BYTES];
    FILE *f = fopen(file, "rb");
    if (!f || !fgets(addr, sizeof addr, f) || fread(desc, 1, sizeof desc, f) != sizeof desc) {
        perror(file);
        return 1;
    }
    fclose(f);
    addr[strcspn(addr, "\n")] = 0;

    tcpx_endpoint ep;
    TRY(tcpx_endpoint_create(NULL, &ep));
    tcpx_connection conn;
    TRY(tcpx_endpoint_connect_addr(ep, addr, &conn));

    /* Local blocks, contiguous here; remote blocks scattered. */
    tcpx_region local;
    TRY(tcpx_endpoint_alloc_host(ep, BLOCKS * BLOCK, &local));
    uint8_t *p;
    TRY(tcpx_region_info(local, (void **)&p, NULL, NULL));
    for (size_t b = 0; b < BLOCKS; b++)
        for (size_t i = 0; i < BLOCK; i++) p[b * BLOCK + i] = pattern(b, i);
    tcpx_segment src = {local, 0, BLOCKS * BLOCK};
    tcpx_remote_segment dst[BLOCKS];
    for (size_t b = 0; b < BLOCKS; b++) {
        memcpy(dst[b].descriptor, desc, sizeof desc);
        dst[b].offset = offsets[b];
        dst[b].len = BLOCK;
    }
    const char *note = "kv blocks 0-3 ready";
    tcpx_transfer t;
    TRY(tcpx_connection_write(conn, &src, 1, dst, BLOCKS, (const uint8_t *)note, strlen(note), &t));
    uint64_t bytes = 0;
    TRY(tcpx_transfer_wait(t, WAIT_MS, &bytes));
    TRY(tcpx_transfer_release(t));
    printf("initiator: wrote %llu bytes in %d blocks to %s, acknowledged\n",
           (unsigned long long)bytes, BLOCKS, addr);
    TRY(tcpx_connection_close(conn));
    TRY(tcpx_region_destroy(local));
    TRY(tcpx_endpoint_destroy(ep));
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s target|initiator RENDEZVOUS_FILE\n", argv[0]);
        return 2;
    }
    TRY(TCPX_ABI_CHECK());
    if (strcmp(argv[1], "target") == 0) return target(argv[2]);
    if (strcmp(argv[1], "initiator") == 0) return initiator(argv[2]);
    fprintf(stderr, "usage: %s target|initiator RENDEZVOUS_FILE\n", argv[0]);
    return 2;
}
