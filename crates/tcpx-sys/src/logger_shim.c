/*
 * The logger handed to a plugin's init: NCCL's ncclDebugLogger_t is variadic (printf-style),
 * which stable Rust cannot define. This shim formats the message and forwards a plain,
 * NUL-terminated string to a sink installed from Rust. Messages longer than the buffer are
 * truncated (never overflowed); a NULL format or a missing sink drops the message.
 */
#include <stdarg.h>
#include <stdio.h>

typedef void (*tcpx_log_sink_t)(int level, unsigned long flags, const char *file, int line,
                                const char *msg);

static tcpx_log_sink_t tcpx_log_sink;

void tcpx_sys_set_log_sink(tcpx_log_sink_t sink) {
    __atomic_store_n(&tcpx_log_sink, sink, __ATOMIC_RELEASE);
}

void tcpx_sys_log_shim(int level, unsigned long flags, const char *file, int line,
                       const char *fmt, ...) {
    tcpx_log_sink_t sink = __atomic_load_n(&tcpx_log_sink, __ATOMIC_ACQUIRE);
    if (sink == NULL || fmt == NULL) {
        return;
    }
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (n < 0) {
        return;
    }
    sink(level, flags, file, line, msg);
}
