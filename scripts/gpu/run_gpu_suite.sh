#!/usr/bin/env bash
# GPU suite: the GPU test binaries (crates/tcpx/tests/gpu_*.rs and the runtime's staged-path
# tests crates/tcpx-runtime/tests/gpu_staged.rs and gpu_unpack_path.rs), the unpack benchmark
# (crates/tcpx/examples/gpu_unpack_bench.rs), GPU→GPU through the whole stack
# (tcpx-bench stack --memory cuda, 16 channels of 1 MiB chunks, 1 MiB..256 MiB, verified) and, with two or more
# GPUs, NCCL's Socket transport as the P2 baseline (scripts/gpu/nccl_socket_baseline.py), run
# from a folder of prebuilt binaries on a machine with a GPU, with a summary table at the end
# (about 2-4 minutes on an H100/H200).
#
# Build here (no GPU, no CUDA toolkit needed: CUDA is loaded at run time), then send:
#   scripts/gpu/run_gpu_suite.sh build [DIR]          # DIR defaults to .device-cuda
#     - cargo test --release --no-run for the gpu_* tests and cargo build --release for the
#       benchmarks (honours CARGO_TARGET_DIR), then copies them, stripped, to DIR as
#       DIR/gpu_buffers, DIR/gpu_unpack, DIR/gpu_staged, DIR/gpu_unpack_path (the runtime's receive lanes unpacking in devmem mode), DIR/gpu_devmem (tcpx-socket's devmem
#       emulation end to end: TCPX_SOCKET_DEVMEM=1, bounce buffer, unpack kernel,
#       irecvConsumed), DIR/gpu_devmem_no_driver (the same mode's no-driver failure path),
#       DIR/gpu_unpack_bench, DIR/tcpx-bench.
#   echo /.device-cuda/ >> .git/info/exclude          # once: DIR travels as a carried path
#   device tool (the working tree travels, this script with it):
#     run(command="scripts/gpu/run_gpu_suite.sh run .device-cuda", carry=[".device-cuda"],
#         kind="nvidia-h100-x1")
#
# Run on the GPU machine:
#   scripts/gpu/run_gpu_suite.sh run [DIR] [BENCH ARGS...]
#     - runs every DIR/gpu_* test binary (--test-threads=1 --nocapture), then
#       DIR/gpu_unpack_bench with BENCH ARGS (default: --mib 256 --frag 4096 --mixed), then
#       DIR/tcpx-bench stack --memory cuda (16 channels, 1 MiB chunks, 1MiB..256MiB, --verify; loopback only),
#       then the NCCL Socket baseline when there are >= 2 GPUs (needs python3 + PyTorch);
#       logs to ${OUT:-DIR}/logs/, prints a table; exits non-zero if anything failed.
#     - SKIP_NCCL=1 skips the NCCL baseline; STACK_ARGS="..." replaces the stack arguments.
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
    tests_json+=$'\n'"$(cargo test --release -p tcpx-runtime --no-run --test gpu_staged --test gpu_unpack_path \
        --message-format=json)" || exit 1
    cargo build --release -p tcpx --example gpu_unpack_bench || exit 1
    cargo build --release -p tcpx-tools --bin tcpx-bench || exit 1
    # devmem_no_driver is copied as gpu_devmem_no_driver so `run` picks it up (it hides the
    # driver with TCPX_CUDA_DISABLE=1 itself and must pass on the GPU machine too).
    for name in gpu_buffers gpu_unpack gpu_staged gpu_unpack_path gpu_devmem devmem_no_driver; do
        exe="$(printf '%s\n' "$tests_json" | grep -o "\"executable\":\"[^\"]*/deps/${name}-[^\"]*\"" \
            | tail -1 | cut -d'"' -f4)"
        [ -n "$exe" ] || { echo "no test binary for $name" >&2; exit 1; }
        case "$name" in
        gpu_*) cp "$exe" "$dir/$name" ;;
        *) cp "$exe" "$dir/gpu_$name" ;;
        esac
    done
    cp "$target/release/examples/gpu_unpack_bench" "$dir/gpu_unpack_bench"
    cp "$target/release/tcpx-bench" "$dir/tcpx-bench"
    strip --strip-debug "$dir"/gpu_* "$dir/tcpx-bench" 2>/dev/null || true
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
        case "$name" in *.log) continue ;; esac
        [ -x "$bin" ] || continue
        log="$logs/$name.log"
        start=$(date +%s%N)
        TCPX_SOCKET_IFNAME=lo "$bin" --test-threads=1 --nocapture >"$log" 2>&1
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
    # GPU→GPU through the whole stack (two endpoints in this process, loopback only).
    slog="$logs/tcpx-bench-stack-cuda.log"
    read -r -a stack_args <<<"${STACK_ARGS:---channels 16 --chunk 1MiB --sizes 1MiB..256MiB --reps 3 --bytes 1GiB --verify}"
    if [ -x "$dir/tcpx-bench" ]; then
        echo "== tcpx-bench stack --memory cuda ${stack_args[*]}"
        TCPX_SOCKET_IFNAME=lo timeout 240 "$dir/tcpx-bench" stack --memory cuda "${stack_args[@]}" 2>&1 | tee "$slog"
        src=${PIPESTATUS[0]}
        [ "$src" -eq 0 ] && sstatus=ok || { sstatus="FAILED (rc $src)"; failed=1; }
    else
        sstatus=missing
        failed=1
    fi
    # NCCL's Socket transport, GPU0→GPU1, default and tuned (needs two GPUs and PyTorch).
    nlog="$logs/nccl_socket_baseline.log"
    ngpus=0
    command -v nvidia-smi >/dev/null && ngpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')"
    if [ "${SKIP_NCCL:-0}" != 0 ]; then
        nstatus="skipped (SKIP_NCCL)"
    elif [ "$ngpus" -ge 2 ]; then
        echo "== NCCL Socket baseline ($ngpus GPUs)"
        timeout 150 python3 "$here/nccl_socket_baseline.py" 2>&1 | tee "$nlog"
        nrc=${PIPESTATUS[0]}
        [ "$nrc" -eq 0 ] && nstatus=ok || { nstatus="FAILED (rc $nrc)"; failed=1; }
    else
        nstatus="skipped ($ngpus GPU: needs two)"
    fi
    echo
    echo "| binary | result | passed | failed | skipped (no driver) | ms |"
    echo "|---|---|---|---|---|---|"
    printf '%s\n' "${rows[@]}"
    echo "| gpu_unpack_bench ${bench_args[*]} | $bstatus | | | | |"
    echo "| tcpx-bench stack --memory cuda | $sstatus | | | | |"
    echo "| nccl_socket_baseline.py | $nstatus | | | | |"
    grep '^RESULT' "$blog" 2>/dev/null
    echo
    echo "GPU→GPU, whole stack (staged), as run above, vs raw TCP; GB/s = 10^9 B/s:"
    grep -E '^ *[0-9]+(KiB|MiB|GiB) ' "$slog" 2>/dev/null
    ours="$(grep -E '^ *256MiB ' "$slog" 2>/dev/null | awk '{print $2}')"
    tuned="$(grep -o 'nccl_socket_tuned_gbps=[0-9.]*' "$nlog" 2>/dev/null | cut -d= -f2)"
    default="$(grep -o 'nccl_socket_default_gbps=[0-9.]*' "$nlog" 2>/dev/null | cut -d= -f2)"
    echo "RESULT stack_cuda_256MiB_gbps=${ours:-n/a} nccl_socket_default_gbps=${default:-n/a} nccl_socket_tuned_gbps=${tuned:-n/a}"
    if [ -n "$ours" ] && [ -n "$tuned" ]; then
        awk -v o="$ours" -v t="$tuned" 'BEGIN {
            r = (t > 0) ? o / t : 0
            printf "P2: %.2f GB/s = %.2f x NCCL Socket tuned (target >= 3x: %s; >= 25 GB/s: %s)\n",
                o, r, (r >= 3 ? "met" : "NOT met"), (o >= 25 ? "met" : "NOT met")
        }'
    fi
    exit $failed
    ;;
*)
    echo "usage: $0 build [DIR] | run [DIR] [BENCH ARGS...] | ptx [OUTFILE]" >&2
    exit 2
    ;;
esac
