#!/usr/bin/env bash
# GPU suite of the tcpx crate: the GPU test binaries (crates/tcpx/tests/gpu_*.rs) and the
# unpack benchmark (crates/tcpx/examples/gpu_unpack_bench.rs), run from a folder of prebuilt
# binaries on a machine with a GPU, with a summary table at the end.
#
# Build here (no GPU, no CUDA toolkit needed: CUDA is loaded at run time), then send:
#   scripts/gpu/run_gpu_suite.sh build [DIR]          # DIR defaults to .device-cuda
#     - cargo test --release --no-run for the gpu_* tests and cargo build --release for the
#       benchmark (honours CARGO_TARGET_DIR), then copies them, stripped, to DIR as
#       DIR/gpu_buffers, DIR/gpu_unpack, DIR/gpu_devmem (tcpx-socket's devmem emulation end to
#       end: TCPX_SOCKET_DEVMEM=1, bounce buffer, unpack kernel, irecvConsumed),
#       DIR/gpu_devmem_no_driver (the same mode's no-driver failure path), DIR/gpu_unpack_bench.
#   echo /.device-cuda/ >> .git/info/exclude          # once: DIR travels as a carried path
#   device tool (the working tree travels, this script with it):
#     run(command="scripts/gpu/run_gpu_suite.sh run .device-cuda", carry=[".device-cuda"],
#         kind="nvidia-h100-x1")
#
# Run on the GPU machine:
#   scripts/gpu/run_gpu_suite.sh run [DIR] [BENCH ARGS...]
#     - runs every DIR/gpu_* test binary (--test-threads=1 --nocapture), then
#       DIR/gpu_unpack_bench with BENCH ARGS (default: --mib 256 --frag 4096 --mixed), logs to
#       ${OUT:-DIR}/logs/, prints a table; exits non-zero if anything failed.
#     - TCPX_UNPACK_KERNEL=ptx|ptx-compat|nvrtc|FILE.ptx forces how the kernel loads;
#       TCPX_CUDA_DISABLE=1 exercises the no-driver skip paths.
#
# Regenerate the checked-in PTX (on a machine with nvcc, e.g. the GPU machine):
#   scripts/gpu/run_gpu_suite.sh ptx [OUTFILE]         # default crates/tcpx/kernels/unpack.ptx
#     = nvcc -ptx -arch=compute_80 -o OUTFILE crates/tcpx/kernels/unpack.cu
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mode="${1:-run}"
shift || true

case "$mode" in
build)
    dir="${1:-.device-cuda}"
    target="${CARGO_TARGET_DIR:-target}"
    mkdir -p "$dir"
    tests_json="$(cargo test --release -p tcpx --no-run --test gpu_buffers --test gpu_unpack \
        --test gpu_devmem --test devmem_no_driver --message-format=json)" || exit 1
    cargo build --release -p tcpx --example gpu_unpack_bench || exit 1
    # devmem_no_driver is copied as gpu_devmem_no_driver so `run` picks it up (it hides the
    # driver with TCPX_CUDA_DISABLE=1 itself and must pass on the GPU machine too).
    for name in gpu_buffers gpu_unpack gpu_devmem devmem_no_driver; do
        exe="$(printf '%s\n' "$tests_json" | grep -o "\"executable\":\"[^\"]*/deps/${name}-[^\"]*\"" \
            | tail -1 | cut -d'"' -f4)"
        [ -n "$exe" ] || { echo "no test binary for $name" >&2; exit 1; }
        case "$name" in
        gpu_*) cp "$exe" "$dir/$name" ;;
        *) cp "$exe" "$dir/gpu_$name" ;;
        esac
    done
    cp "$target/release/examples/gpu_unpack_bench" "$dir/gpu_unpack_bench"
    strip --strip-debug "$dir"/gpu_* 2>/dev/null || true
    ls -l "$dir"
    ;;
ptx)
    out="${1:-crates/tcpx/kernels/unpack.ptx}"
    src="$here/../../crates/tcpx/kernels/unpack.cu"
    nvcc --version | tail -2
    nvcc -ptx -arch=compute_80 -o "$out" "$src" && echo "wrote $out ($(wc -c <"$out") bytes)"
    ;;
run)
    dir="${1:-.device-cuda}"
    shift || true
    bench_args=("$@")
    [ ${#bench_args[@]} -gt 0 ] || bench_args=(--mib 256 --frag 4096 --mixed)
    logs="${OUT:-$dir}/logs"
    mkdir -p "$logs"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,pci.bus_id,driver_version,memory.total --format=csv,noheader
    fi
    rows=()
    failed=0
    for bin in "$dir"/gpu_*; do
        name="$(basename "$bin")"
        [ "$name" = gpu_unpack_bench ] && continue
        [ -x "$bin" ] || continue
        log="$logs/$name.log"
        start=$(date +%s%N)
        "$bin" --test-threads=1 --nocapture >"$log" 2>&1
        rc=$?
        ms=$((($(date +%s%N) - start) / 1000000))
        summary="$(grep -E '^test result:' "$log" | tail -1)"
        passed="$(echo "$summary" | grep -oE '[0-9]+ passed' | cut -d' ' -f1)"
        nfail="$(echo "$summary" | grep -oE '[0-9]+ failed' | cut -d' ' -f1)"
        skipped="$(grep -c '^skipped: no CUDA driver' "$log")"
        [ $rc -eq 0 ] && status=ok || { status=FAILED; failed=1; }
        rows+=("| $name | $status | ${passed:-0} | ${nfail:-?} | $skipped | $ms |")
        echo "== $name: $status (log $log)"
        grep -E '^(test .* FAILED|---- |thread .* panicked)' "$log" | head -20
    done
    blog="$logs/gpu_unpack_bench.log"
    if [ -x "$dir/gpu_unpack_bench" ]; then
        "$dir/gpu_unpack_bench" "${bench_args[@]}" 2>&1 | tee "$blog"
        brc=${PIPESTATUS[0]}
        [ "$brc" -eq 0 ] && bstatus=ok || { bstatus=FAILED; failed=1; }
    else
        bstatus=missing
        failed=1
    fi
    echo
    echo "| binary | result | passed | failed | skipped (no driver) | ms |"
    echo "|---|---|---|---|---|---|"
    printf '%s\n' "${rows[@]}"
    echo "| gpu_unpack_bench ${bench_args[*]} | $bstatus | | | | |"
    grep '^RESULT' "$blog" 2>/dev/null
    exit $failed
    ;;
*)
    echo "usage: $0 build [DIR] | run [DIR] [BENCH ARGS...] | ptx [OUTFILE]" >&2
    exit 2
    ;;
esac
