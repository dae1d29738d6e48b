/*
 * A stand-in CUDA driver for tests/devmem_fake_driver.rs: the handful of driver entry points
 * tcpx-socket's devmem emulation calls, implemented on host memory, so that mode's whole plugin
 * path (driver loading, per-comm allocations, bounce-page scatter, metadata, frees) runs in CI,
 * where there is no GPU. "Device" memory is host memory the fake tracks; every call checks what
 * a real driver would refuse (no current context, copies outside a device allocation, frees of
 * unknown pointers) and aborts loudly, so a plugin bug fails the test.
 * Built by the test with the system C compiler; never shipped.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef unsigned long long DP;
#define MAXA 4096
static struct { uintptr_t p; size_t n; int dev; } A[MAXA];
static int na;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static __thread int depth; /* contexts pushed on this thread */
#define CTX ((void *)0x1)

static void die(const char *what) { fprintf(stderr, "FAKE libcuda: %s\n", what); abort(); }
static void need(void) { if (depth <= 0) die("driver call without a current context"); }
static void rec(void *p, size_t n, int dev) {
    pthread_mutex_lock(&mu);
    if (na == MAXA) die("too many allocations");
    A[na].p = (uintptr_t)p; A[na].n = n; A[na].dev = dev; na++;
    pthread_mutex_unlock(&mu);
}
static void unrec(void *p, int dev) {
    pthread_mutex_lock(&mu);
    for (int i = 0; i < na; i++)
        if (A[i].p == (uintptr_t)p && A[i].dev == dev) { A[i] = A[--na]; pthread_mutex_unlock(&mu); return; }
    die("free of an unknown pointer");
}
static int isdev(DP p, size_t n) {
    int hit = 0;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < na; i++)
        if (A[i].dev && p >= A[i].p && p + n <= A[i].p + A[i].n) hit = 1;
    pthread_mutex_unlock(&mu);
    return hit;
}
static void *page_alloc(size_t n) {
    void *q = aligned_alloc(4096, (n + 4095) / 4096 * 4096 + 4096);
    if (!q) die("out of memory");
    memset(q, 0xAB, n); /* not zero: the plugin must not rely on fresh memory being zeroed */
    return q;
}

int cuInit(unsigned f) { return f == 0 ? 0 : 1; }
int cuGetErrorName(int rc, const char **s) { (void)rc; *s = "CUDA_ERROR_FAKE"; return 0; }
int cuDeviceGet(int *d, int o) { *d = o; return 0; }
int cuDeviceGetCount(int *n) { *n = 1; return 0; }
int cuDevicePrimaryCtxRetain(void **c, int d) { (void)d; *c = CTX; return 0; }
int cuCtxPushCurrent_v2(void *c) { if (c != CTX) die("push of an unknown context"); depth++; return 0; }
int cuCtxPopCurrent_v2(void **c) { if (depth <= 0) die("pop without push"); depth--; *c = CTX; return 0; }
int cuMemAlloc_v2(DP *p, size_t n) { need(); void *q = page_alloc(n); rec(q, n, 1); *p = (DP)(uintptr_t)q; return 0; }
int cuMemFree_v2(DP p) { need(); unrec((void *)(uintptr_t)p, 1); free((void *)(uintptr_t)p); return 0; }
int cuMemHostAlloc(void **p, size_t n, unsigned f) {
    need();
    if (f != 3) die("cuMemHostAlloc without PORTABLE|DEVICEMAP");
    *p = page_alloc(n); rec(*p, n, 0); return 0;
}
int cuMemFreeHost(void *p) { need(); unrec(p, 0); free(p); return 0; }
int cuMemHostGetDevicePointer_v2(DP *d, void *p, unsigned f) { need(); (void)f; *d = (DP)(uintptr_t)p; return 0; }
int cuMemcpyHtoDAsync_v2(DP d, const void *s, size_t n, void *st) {
    need(); (void)st;
    if (!isdev(d, n)) die("host-to-device copy outside a device allocation");
    memcpy((void *)(uintptr_t)d, s, n); return 0;
}
int cuMemcpyDtoHAsync_v2(void *d, DP s, size_t n, void *st) {
    need(); (void)st;
    if (!isdev(s, n)) die("device-to-host copy outside a device allocation");
    memcpy(d, (void *)(uintptr_t)s, n); return 0;
}
int cuStreamCreate(void **s, unsigned f) { need(); (void)f; *s = (void *)0x2; return 0; }
int cuStreamDestroy_v2(void *s) { need(); (void)s; return 0; }
int cuStreamSynchronize(void *s) { need(); (void)s; return 0; }
int cuPointerGetAttribute(void *out, int attr, DP p) {
    need();
    if (!isdev(p, 1)) return 1; /* CUDA_ERROR_INVALID_VALUE: not device memory */
    if (attr == 2) { *(unsigned *)out = 2; return 0; } /* MEMORY_TYPE: DEVICE */
    if (attr == 9) { *(int *)out = 0; return 0; }      /* DEVICE_ORDINAL */
    return 1;
}

/* Test helpers (not driver API). */
DP fake_device_alloc(size_t n) { void *q = page_alloc(n); memset(q, 0, n); rec(q, n, 1); return (DP)(uintptr_t)q; }
int fake_live_allocs(void) { pthread_mutex_lock(&mu); int n = na; pthread_mutex_unlock(&mu); return n; }
