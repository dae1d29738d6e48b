/*
 * tcpx_net.h — the ncclNet plugin ABI (tables v6, v7, v8), as this project uses it.
 *
 * Written from the layout facts in docs/NCCL_NET_ABI.md (x86-64 Linux); no third-party header
 * was copied. This file is the single source of truth for `src/bindings.rs`, which bindgen
 * generates from it (`cargo xtask bindgen`; CI runs `cargo xtask bindgen --check`).
 *
 * Integers that a plugin returns (result codes, device types) are declared as plain typedefs,
 * never C enums: a plugin may return any value, and Rust must not assume a closed set.
 */
#ifndef TCPX_NET_H
#define TCPX_NET_H

#include <stddef.h>
#include <stdint.h>

/* ---- constants ------------------------------------------------------------------------ */

/** Size of the opaque connect handle exchanged out of band (NCCL_NET_HANDLE_MAXSIZE). */
#define NCCL_NET_HANDLE_MAXSIZE 128

/** Pointer kinds accepted by regMr / advertised in ptrSupport. */
#define NCCL_PTR_HOST 0x1
#define NCCL_PTR_CUDA 0x2
#define NCCL_PTR_DMABUF 0x4

/** Requests in flight per comm in GPUDirect-TCPX (MAX_REQUESTS); our socket plugin matches. */
#define NCCL_NET_MAX_REQUESTS 16

/** Net device types and the unpack offload version used by TCPX. */
#define NCCL_NET_DEVICE_HOST 0
#define NCCL_NET_DEVICE_UNPACK 1
#define NCCL_NET_DEVICE_UNPACK_VERSION 0x7

/** Unpack metadata geometry (TCPX receive-datapath). */
#define NET_UNPACK_MAX_SLICE_PAGES 2048
#define NET_UNPACK_MAX_QUEUE_DEPTH 16

/** Result codes (ncclResult_t). */
#define NCCL_SUCCESS 0
#define NCCL_UNHANDLED_CUDA_ERROR 1
#define NCCL_SYSTEM_ERROR 2
#define NCCL_INTERNAL_ERROR 3
#define NCCL_INVALID_ARGUMENT 4
#define NCCL_INVALID_USAGE 5
#define NCCL_REMOTE_ERROR 6
#define NCCL_IN_PROGRESS 7

/** Logger levels (ncclDebugLogLevel). */
#define NCCL_LOG_NONE 0
#define NCCL_LOG_VERSION 1
#define NCCL_LOG_WARN 2
#define NCCL_LOG_INFO 3
#define NCCL_LOG_ABORT 4
#define NCCL_LOG_TRACE 5

/** Logger subsystem flags used by net plugins. */
#define NCCL_LOG_FLAG_INIT 0x1
#define NCCL_LOG_FLAG_NET 0x10

/* ---- scalar types --------------------------------------------------------------------- */

/** A plugin's return code: an integer, never a closed enum. */
typedef int32_t ncclResult_t;
/** A logger level. */
typedef int32_t ncclDebugLogLevel;
/** A net device type (NCCL_NET_DEVICE_*). */
typedef int32_t ncclNetDeviceType;

/** The logger NCCL hands to init: printf-style and variadic. */
typedef void (*ncclDebugLogger_t)(ncclDebugLogLevel level, unsigned long flags, const char *file,
                                  int line, const char *fmt, ...);

/* ---- properties ----------------------------------------------------------------------- */

/** v6 properties (48 bytes). */
typedef struct {
    char *name;
    char *pciPath;
    uint64_t guid;
    int32_t ptrSupport;
    int32_t speed; /* Mbps */
    int32_t port;
    float latency; /* microseconds */
    int32_t maxComms;
    int32_t maxRecvs;
} ncclNetProperties_v6_t;

/** v7 properties (56 bytes). */
typedef struct {
    char *name;
    char *pciPath;
    uint64_t guid;
    int32_t ptrSupport;
    int32_t speed; /* Mbps */
    int32_t port;
    float latency; /* microseconds */
    int32_t maxComms;
    int32_t maxRecvs;
    ncclNetDeviceType netDeviceType;
    int32_t netDeviceVersion;
} ncclNetProperties_v7_t;

/** v8 properties (64 bytes): v7 with regIsGlobal inserted after ptrSupport. */
typedef struct {
    char *name;
    char *pciPath;
    uint64_t guid;
    int32_t ptrSupport;
    int32_t regIsGlobal;
    int32_t speed; /* Mbps */
    int32_t port;
    float latency; /* microseconds */
    int32_t maxComms;
    int32_t maxRecvs;
    ncclNetDeviceType netDeviceType;
    int32_t netDeviceVersion;
} ncclNetProperties_v8_t;

/* ---- device handle and unpack metadata ----------------------------------------------- */

/** Net device handle (v7 and v8, 32 bytes); the caller presets type and version. */
typedef struct {
    ncclNetDeviceType netDeviceType;
    int32_t netDeviceVersion;
    void *handle; /* device pointer to a tcpxUnpackDeviceHandle for UNPACK */
    size_t size;
    int32_t needsProxyProgress;
} ncclNetDeviceHandle_v7_t;

/** v8 keeps the v7 layout. */
typedef ncclNetDeviceHandle_v7_t ncclNetDeviceHandle_v8_t;

/** One fragment of a received message in the bounce buffer (16 bytes, 16-aligned). */
typedef struct __attribute__((aligned(16))) {
    uint32_t src_off; /* offset into bounce_buf */
    uint32_t len;     /* fragment length in bytes */
    uint64_t dst_off; /* offset into the irecv destination */
} tcpxLoadMeta;

/** Per-comm unpack metadata in host memory mapped into the GPU (524416 bytes). */
typedef struct {
    tcpxLoadMeta mem[NET_UNPACK_MAX_QUEUE_DEPTH][NET_UNPACK_MAX_SLICE_PAGES];
    uint64_t cnt[NET_UNPACK_MAX_QUEUE_DEPTH];
} tcpxUnpackMeta;

/** The struct that ncclNetDeviceHandle.handle points at for UNPACK devices (24 bytes). */
typedef struct {
    tcpxUnpackMeta *meta; /* host-mapped metadata */
    void *bounce_buf;     /* device pointer */
    uint64_t head;        /* starts at UINT64_MAX */
} tcpxUnpackDeviceHandle;

/* ---- function tables ------------------------------------------------------------------ */

/** ncclNet_v6_t: 17 pointer-sized fields, no device handles. */
typedef struct {
    const char *name;
    ncclResult_t (*init)(ncclDebugLogger_t logFunction);
    ncclResult_t (*devices)(int *ndev);
    ncclResult_t (*getProperties)(int dev, ncclNetProperties_v6_t *props);
    ncclResult_t (*listen)(int dev, void *handle, void **listenComm);
    ncclResult_t (*connect)(int dev, void *handle, void **sendComm);
    ncclResult_t (*accept)(void *listenComm, void **recvComm);
    ncclResult_t (*regMr)(void *comm, void *data, int size, int type, void **mhandle);
    ncclResult_t (*regMrDmaBuf)(void *comm, void *data, size_t size, int type, uint64_t offset,
                                int fd, void **mhandle);
    ncclResult_t (*deregMr)(void *comm, void *mhandle);
    ncclResult_t (*isend)(void *sendComm, void *data, int size, int tag, void *mhandle,
                          void **request);
    ncclResult_t (*irecv)(void *recvComm, int n, void **data, int *sizes, int *tags,
                          void **mhandles, void **request);
    ncclResult_t (*iflush)(void *recvComm, int n, void **data, int *sizes, void **mhandles,
                           void **request);
    ncclResult_t (*test)(void *request, int *done, int *sizes);
    ncclResult_t (*closeSend)(void *sendComm);
    ncclResult_t (*closeRecv)(void *recvComm);
    ncclResult_t (*closeListen)(void *listenComm);
} ncclNet_v6_t;

/** ncclNet_v7_t: 19 pointer-sized fields (152 bytes); regMr takes an int size. */
typedef struct {
    const char *name;
    ncclResult_t (*init)(ncclDebugLogger_t logFunction);
    ncclResult_t (*devices)(int *ndev);
    ncclResult_t (*getProperties)(int dev, ncclNetProperties_v7_t *props);
    ncclResult_t (*listen)(int dev, void *handle, void **listenComm);
    ncclResult_t (*connect)(int dev, void *handle, void **sendComm,
                            ncclNetDeviceHandle_v7_t **sendDevComm);
    ncclResult_t (*accept)(void *listenComm, void **recvComm,
                           ncclNetDeviceHandle_v7_t **recvDevComm);
    ncclResult_t (*regMr)(void *comm, void *data, int size, int type, void **mhandle);
    ncclResult_t (*regMrDmaBuf)(void *comm, void *data, size_t size, int type, uint64_t offset,
                                int fd, void **mhandle);
    ncclResult_t (*deregMr)(void *comm, void *mhandle);
    ncclResult_t (*isend)(void *sendComm, void *data, int size, int tag, void *mhandle,
                          void **request);
    ncclResult_t (*irecv)(void *recvComm, int n, void **data, int *sizes, int *tags,
                          void **mhandles, void **request);
    ncclResult_t (*iflush)(void *recvComm, int n, void **data, int *sizes, void **mhandles,
                           void **request);
    ncclResult_t (*test)(void *request, int *done, int *sizes);
    ncclResult_t (*closeSend)(void *sendComm);
    ncclResult_t (*closeRecv)(void *recvComm);
    ncclResult_t (*closeListen)(void *listenComm);
    ncclResult_t (*getDeviceMr)(void *comm, void *mhandle, void **dptr_mhandle);
    ncclResult_t (*irecvConsumed)(void *recvComm, int n, void *request);
} ncclNet_v7_t;

/** ncclNet_v8_t: the v7 layout with v8 properties and a size_t regMr size. */
typedef struct {
    const char *name;
    ncclResult_t (*init)(ncclDebugLogger_t logFunction);
    ncclResult_t (*devices)(int *ndev);
    ncclResult_t (*getProperties)(int dev, ncclNetProperties_v8_t *props);
    ncclResult_t (*listen)(int dev, void *handle, void **listenComm);
    ncclResult_t (*connect)(int dev, void *handle, void **sendComm,
                            ncclNetDeviceHandle_v8_t **sendDevComm);
    ncclResult_t (*accept)(void *listenComm, void **recvComm,
                           ncclNetDeviceHandle_v8_t **recvDevComm);
    ncclResult_t (*regMr)(void *comm, void *data, size_t size, int type, void **mhandle);
    ncclResult_t (*regMrDmaBuf)(void *comm, void *data, size_t size, int type, uint64_t offset,
                                int fd, void **mhandle);
    ncclResult_t (*deregMr)(void *comm, void *mhandle);
    ncclResult_t (*isend)(void *sendComm, void *data, int size, int tag, void *mhandle,
                          void **request);
    ncclResult_t (*irecv)(void *recvComm, int n, void **data, int *sizes, int *tags,
                          void **mhandles, void **request);
    ncclResult_t (*iflush)(void *recvComm, int n, void **data, int *sizes, void **mhandles,
                           void **request);
    ncclResult_t (*test)(void *request, int *done, int *sizes);
    ncclResult_t (*closeSend)(void *sendComm);
    ncclResult_t (*closeRecv)(void *recvComm);
    ncclResult_t (*closeListen)(void *listenComm);
    ncclResult_t (*getDeviceMr)(void *comm, void *mhandle, void **dptr_mhandle);
    ncclResult_t (*irecvConsumed)(void *recvComm, int n, void *request);
} ncclNet_v8_t;

#endif /* TCPX_NET_H */
