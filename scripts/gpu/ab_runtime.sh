#!/usr/bin/env bash
# Side-by-side runtime benchmark of two tcpx-bench binaries in one run (issue 13's "performance
# unchanged" check), interleaved A B A B … so that drift of the machine hits both alike:
#   - tcpx-bench stack, host memory, 8 channels, 1 MiB..256 MiB;
#   - tcpx-bench stack --memory cuda --channels 16 --chunk 1MiB (skipped without a GPU);
#   - tcpx-bench overhead --channels 1 and 4 (an instant plugin: engine cost only).
# Everything runs over loopback (TCPX_SOCKET_IFNAME=lo, control on 127.0.0.1).
#
# Usage: scripts/gpu/ab_runtime.sh DIR [ROUNDS]
#   DIR holds tcpx-bench.before and tcpx-bench.after (any two builds); ROUNDS defaults to 2.
#   Logs go to ${OUT:-DIR}/ab/<round>-<bin>-<case>.log; a summary of every table row is printed.
#   STACK_BYTES (default 512MiB) is the bytes per repetition of the stack runs, STACK_SIZES
#   (default 1MiB..256MiB) their sizes; BINS="before mid after" compares more builds
#   (DIR/tcpx-bench.<name> each); CASES="host8 cuda16 overhead1 overhead4" picks the cases.
set -uo pipefail
dir="${1:?usage: ab_runtime.sh DIR [ROUNDS]}"
rounds="${2:-2}"
bytes="${STACK_BYTES:-512MiB}"
sizes="${STACK_SIZES:-1MiB..256MiB}"
bins="${BINS:-before after}"
cases="${CASES:-host8 cuda16 overhead1 overhead4}"
logs="${OUT:-$dir}/ab"
mkdir -p "$logs"
export TCPX_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo

have_gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    have_gpu=1
fi

run_case() { # round bin case args...
    local round="$1" bin="$2" case="$3"
    shift 3
    case " $cases " in *" $case "*) ;; *) return 0 ;; esac
    local log="$logs/$round-$bin-$case.log"
    echo "== round $round, $bin, $case: tcpx-bench $*"
    timeout 240 "$dir/tcpx-bench.$bin" "$@" >"$log" 2>&1
    local rc=$?
    [ "$rc" -eq 0 ] || echo "   exit $rc (see $log)"
    grep -E '^\s+[0-9]+[KMG]iB|per_sec|per s|/s' "$log" | sed 's/^/   /'
}

for round in $(seq 1 "$rounds"); do
    for bin in $bins; do
        run_case "$round" "$bin" host8 stack --channels 8 --sizes "$sizes" --reps 3 --bytes "$bytes"
        if [ "$have_gpu" -eq 1 ]; then
            run_case "$round" "$bin" cuda16 stack --memory cuda --channels 16 --chunk 1MiB \
                --sizes "$sizes" --reps 3 --bytes "$bytes"
        fi
        run_case "$round" "$bin" overhead1 overhead --channels 1
        run_case "$round" "$bin" overhead4 overhead --channels 4
    done
done
