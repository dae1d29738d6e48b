#!/usr/bin/env bash
# Same-host GPU suite (CUDA IPC between processes, crates/tcpx-runtime/src/ipc): the tests and
# the benchmark, from a folder of prebuilt binaries on a machine with a GPU (CUDA is loaded at
# run time: nothing here needs a CUDA toolkit or cargo on that machine).
#
# Build here:
#   scripts/gpu/ipc_suite.sh build [DIR]          # DIR defaults to .device/ipc
#     - cargo test --release --no-run: the runtime's `ipc` test and the tcpx library's unit
#       tests (cuda::ipc: export, open, pooled copies); cargo build --release: the
#       `ipc_bench` example; `cargo xtask capi`: libtcpx.so and the C test program. Copies them,
#       stripped, to DIR (ipc, tcpx_lib, ipc_bench, capi_test, libtcpx.so).
#   device tool: run(command="scripts/gpu/ipc_suite.sh run .device/ipc", carry=[".device/ipc"])
#     (kind nvidia-h200-x2 for the GPU 0 <-> GPU 1 figures as well)
#
# Run there:
#   scripts/gpu/ipc_suite.sh run [DIR] [BENCH ARGS...]
#     1. tcpx_lib cuda::ipc (one process: export, a forged handle refused, 12 MiB over 4 streams)
#     2. ipc (two processes): every test with parent and child on GPU 0, then the gpu_* tests
#        with the child on GPU 1 when there are two GPUs (TCPX_IPC_TEST_GPUS=0,1)
#     3. capi_test "same host" (the C API: rendezvous, refusals, 4 MiB each way through IPC)
#     4. ipc_bench BENCH ARGS (default --json): write_ipc / read_ipc of 256 MiB vs an in-process
#        device-to-device cuMemcpyAsync (ratio; target write/memcpy >= 0.8), 4 KiB write_ipc
#        p50 / p99 in µs; pairs 0:0 and, with two GPUs, 0:1
#     Logs go to ${OUT:-DIR}/logs/; exits non-zero if anything failed.
set -uo pipefail

mode="${1:-run}"
shift || true

case "$mode" in
build)
    dir="${1:-.device/ipc}"
    target="${CARGO_TARGET_DIR:-target}"
    mkdir -p "$dir"
    json="$(cargo test --release -p tcpx-runtime --no-run --test ipc --message-format=json)" || exit 1
    json+=$'\n'"$(cargo test --release -p tcpx --no-run --lib --message-format=json)" || exit 1
    cargo build --release -p tcpx-runtime --example ipc_bench || exit 1
    cargo xtask capi || exit 1
    pick() { printf '%s\n' "$json" | grep -o "\"executable\":\"[^\"]*/deps/$1-[^\"]*\"" | tail -1 | cut -d'"' -f4; }
    ipc="$(pick ipc)"
    lib="$(pick tcpx)"
    [ -n "$ipc" ] && [ -n "$lib" ] || { echo "test binaries not found" >&2; exit 1; }
    cp "$ipc" "$dir/ipc"
    cp "$lib" "$dir/tcpx_lib"
    cp "$target/release/examples/ipc_bench" "$dir/ipc_bench"
    cp target/capi/capi_test "$dir/capi_test"
    cp target/capi/lib/libtcpx.so "$dir/libtcpx.so"
    strip --strip-debug "$dir"/* 2>/dev/null || true
    ls -l "$dir"
    ;;
run)
    dir="${1:-.device/ipc}"
    shift || true
    bench=("$@")
    [ ${#bench[@]} -gt 0 ] || bench=(--json)
    logs="${OUT:-$dir}/logs"
    mkdir -p "$logs"
    export TCPX_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo
    gpus="$(nvidia-smi -L 2>/dev/null | wc -l)"
    echo "GPUs: $gpus"
    failed=0
    step() { # name, command...
        local name="$1"
        shift
        echo "== $name"
        if "$@" >"$logs/$name.log" 2>&1; then
            echo "== $name: ok"
        else
            echo "== $name: FAILED (exit $?); last lines:"
            failed=$((failed + 1))
        fi
        tail -25 "$logs/$name.log"
    }
    step tcpx_lib_ipc "$dir/tcpx_lib" cuda:: --test-threads=1 --nocapture
    step ipc_same_gpu env TCPX_IPC_TEST_GPUS=0,0 "$dir/ipc" --test-threads=1 --nocapture
    if [ "$gpus" -ge 2 ]; then
        step ipc_two_gpus env TCPX_IPC_TEST_GPUS=0,1 "$dir/ipc" gpu_ --test-threads=1 --nocapture
    fi
    step capi_same_host env LD_LIBRARY_PATH="$dir" "$dir/capi_test" "same host"
    step ipc_bench "$dir/ipc_bench" "${bench[@]}"
    echo "logs: $logs; $failed step(s) failed"
    [ "$failed" -eq 0 ]
    ;;
*)
    echo "usage: $0 build [DIR] | run [DIR] [BENCH ARGS...]" >&2
    exit 2
    ;;
esac
