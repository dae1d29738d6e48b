#!/usr/bin/env bash
# Issue 25, item 2: GPU memory at small and medium sizes on a host-only plugin (the built-in
# socket plugin stages CUDA memory through the engines' pinned rings). Runs two (or more)
# tcpx-bench binaries side by side, interleaved case by case (A B A B ...) so that drift of
# the machine hits both alike, and prints one table of every row:
#
#   os-small   tcpx-bench onesided --op send,write,read --block 4KiB,64KiB,1MiB --batch 1,
#              host and cuda memory: p50 / p99 latency (one op at a time) and GB/s (4 in flight)
#   os-kv      tcpx-bench onesided --op send,write,read --block 16KiB --batch 1024
#              --layout scattered (1024 blocks scattered on both sides, a paged KV cache),
#              host and cuda memory
#   os-kv1     the same 16 MiB as one block (--block 16MiB --batch 1): the contiguous reference
#              the KV list is held against (target: KV list >= 0.8 x contiguous, GPU)
#   stack      tcpx-bench stack --memory cuda --sizes 4KiB..256MiB (two-sided, GB/s vs raw TCP)
#
# Everything runs over loopback (TCPX_SOCKET_IFNAME=lo, control listeners on 127.0.0.1); with
# one GPU both endpoints use GPU 0, with two the initiator / sender uses GPU 0 and the target /
# receiver GPU 1 (override with GPUS=0 or GPUS=0,1).
#
# Build here (no GPU or CUDA toolkit needed), into a folder that travels as a carried path:
#   scripts/gpu/staged_small.sh build DIR NAME [SOURCE_TREE]
#     = (cd SOURCE_TREE && cargo build --release -p tcpx-tools --bin tcpx-bench)
#       and cp SOURCE_TREE/target/release/tcpx-bench DIR/tcpx-bench.NAME (stripped)
#     e.g. scripts/gpu/staged_small.sh build .device-small main /work/main
#          scripts/gpu/staged_small.sh build .device-small gpu   .
#     (CARGO_TARGET_DIR is honoured; echo /.device-small/ >> .git/info/exclude once, so the
#     folder is ignored and can be carried.)
#   device tool:
#     run(command="scripts/gpu/staged_small.sh run .device-small", carry=[".device-small"],
#         kind="nvidia-h100-x1", timeout_s=600)
#
# Run on the GPU machine:
#   scripts/gpu/staged_small.sh run DIR [ROUNDS]
#     - BINS="main gpu" (default) names DIR/tcpx-bench.<name> to compare, in this order;
#     - CASES="os-small os-kv os-kv1 stack" picks the cases; ROUNDS (default 1) repeats them;
#     - OS_BYTES (default 64MiB) bytes per throughput point of os-small, KV_BYTES (default
#       512MiB) of os-kv and os-kv1, OS_REPS (default 3), OS_ITERS (default 100) latency
#       iterations of os-small (20 for os-kv / os-kv1); STACK_BYTES (default 256MiB), STACK_SIZES
#       (default 4KiB..256MiB), STACK_CHANNELS (default 4);
#     - logs and JSON rows go to ${OUT:-DIR}/staged_small/; the summary is printed at the end
#       (and written to summary.txt there). About 6-9 minutes for two binaries, one round, on
#       an H100 machine; without a GPU the cuda rows are skipped (host rows still run).
set -uo pipefail

mode="${1:-run}"
shift || true

case "$mode" in
build)
    dir="${1:?usage: staged_small.sh build DIR NAME [SOURCE_TREE]}"
    name="${2:?usage: staged_small.sh build DIR NAME [SOURCE_TREE]}"
    tree="${3:-.}"
    mkdir -p "$dir"
    dir="$(cd "$dir" && pwd)"
    (cd "$tree" && cargo build --release -p tcpx-tools --bin tcpx-bench) || exit 1
    target="${CARGO_TARGET_DIR:-$tree/target}"
    cp "$target/release/tcpx-bench" "$dir/tcpx-bench.$name" || exit 1
    strip --strip-debug "$dir/tcpx-bench.$name" 2>/dev/null || true
    ls -l "$dir"
    exit 0
    ;;
run) ;;
*)
    sed -n '2,45p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac

dir="${1:?usage: staged_small.sh run DIR [ROUNDS]}"
rounds="${2:-1}"
bins="${BINS:-main gpu}"
cases="${CASES:-os-small os-kv os-kv1 stack}"
os_bytes="${OS_BYTES:-64MiB}"
os_reps="${OS_REPS:-3}"
os_iters="${OS_ITERS:-100}"
kv_bytes="${KV_BYTES:-512MiB}"
stack_bytes="${STACK_BYTES:-256MiB}"
stack_sizes="${STACK_SIZES:-4KiB..256MiB}"
stack_channels="${STACK_CHANNELS:-4}"
logs="${OUT:-$dir}/staged_small"
mkdir -p "$logs"
export TCPX_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo

for bin in $bins; do
    [ -x "$dir/tcpx-bench.$bin" ] || { echo "no executable $dir/tcpx-bench.$bin" >&2; exit 2; }
done

have_gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    have_gpu=1
    nvidia-smi -L | sed 's/^/# /'
fi
gpu_args=()
if [ -n "${GPUS:-}" ]; then
    gpu_args=(--gpu "$GPUS")
fi
memories="host"
[ "$have_gpu" -eq 1 ] && memories="host cuda"

failed=0
# supports BIN MODE TEXT: whether `tcpx-bench.BIN MODE --help` mentions TEXT (a binary built
# before `onesided --memory` / `--layout scattered` existed runs only the rows it can).
supports() {
    "$dir/tcpx-bench.$1" "$2" --help 2>&1 | grep -q -- "$3"
}

# run_case ROUND BIN CASE MEMORY ARGS...: one tcpx-bench run, its log and JSON rows kept.
run_case() {
    local round="$1" bin="$2" case="$3" memory="$4"
    shift 4
    local tag="$round-$bin-$case-$memory"
    local log="$logs/$tag.log"
    local extra=()
    if [ "$memory" = cuda ]; then
        extra=(--memory cuda "${gpu_args[@]}")
    fi
    echo "== round $round, $bin, $case, $memory: tcpx-bench $* ${extra[*]}"
    local json=()
    [ "$1" = onesided ] && json=(--json "$logs/$tag.jsonl")
    timeout 420 "$dir/tcpx-bench.$bin" "$@" "${extra[@]}" "${json[@]}" >"$log" 2>&1
    local rc=$?
    if [ "$rc" -ne 0 ]; then
        echo "   exit $rc (see $log)"
        tail -3 "$log" | sed 's/^/   /'
        failed=1
    fi
    grep -E '^\s*(send|write|read)\s|^\s+[0-9]+[KMG]iB|packing' "$log" | sed 's/^/   /'
}

for round in $(seq 1 "$rounds"); do
    for case in $cases; do
        for memory in $memories; do
            [ "$case" = stack ] && [ "$memory" = host ] && continue
            for bin in $bins; do
                if [ "$case" != stack ] && [ "$memory" = cuda ] && ! supports "$bin" onesided '--memory'; then
                    echo "== round $round, $bin, $case, cuda: skipped (this binary's onesided has no --memory)"
                    continue
                fi
                layout=scattered
                if ! supports "$bin" onesided scattered; then
                    # Older binaries: remote blocks scattered, local ones contiguous.
                    layout=strided
                fi
                case "$case" in
                os-small)
                    run_case "$round" "$bin" "$case" "$memory" onesided --op send,write,read \
                        --block 4KiB,64KiB,1MiB --batch 1 --bytes "$os_bytes" \
                        --reps "$os_reps" --latency-iters "$os_iters"
                    ;;
                os-kv)
                    run_case "$round" "$bin" "$case" "$memory" onesided --op send,write,read \
                        --block 16KiB --batch 1024 --layout "$layout" --bytes "$kv_bytes" \
                        --reps "$os_reps" --latency-iters 20
                    ;;
                os-kv1)
                    run_case "$round" "$bin" "$case" "$memory" onesided --op send,write,read \
                        --block 16MiB --batch 1 --bytes "$kv_bytes" \
                        --reps "$os_reps" --latency-iters 20
                    ;;
                stack)
                    run_case "$round" "$bin" "$case" "$memory" stack --channels "$stack_channels" \
                        --sizes "$stack_sizes" --bytes "$stack_bytes" --reps 3
                    ;;
                *) echo "unknown case $case" >&2; exit 2 ;;
                esac
            done
        done
    done
done

# Summary: every onesided row (median of the rounds where several) and every stack row, one
# line per (case, memory, op, block, batch) with a column per binary.
summary="$logs/summary.txt"
{
    echo "# staged_small summary (bins: $bins; rounds: $rounds); p50 in µs, GB/s = 10^9 B/s"
    if command -v python3 >/dev/null 2>&1; then
        python3 - "$logs" $bins <<'PY'
import json, os, statistics, sys, re
logs, bins = sys.argv[1], sys.argv[2:]
rows = {}
for name in sorted(os.listdir(logs)):
    m = re.match(r"(\d+)-(.+?)-(os-small|os-kv1|os-kv)-(host|cuda)\.jsonl$", name)
    if not m:
        continue
    _, bin_, case, memory = m.groups()
    for line in open(os.path.join(logs, name)):
        r = json.loads(line)
        # A binary without `--layout scattered` ran os-kv strided: same row, see the logs.
        key = (case, memory, r["op"], r["block"], r["batch"])
        rows.setdefault(key, {}).setdefault(bin_, []).append((r["p50_us"], r["gbps"]))
def size(n):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)
head = f"{'case':8} {'mem':4} {'op':5} {'block':>6} {'batch':>5}" + "".join(
    f" {b + ' p50':>12} {b + ' GB/s':>12}" for b in bins)
print(head)
for key in sorted(rows, key=lambda k: (k[0], k[1], k[3], k[4], k[2])):
    case, memory, op, block, batch = key
    line = f"{case:8} {memory:4} {op:5} {size(block):>6} {batch:>5}"
    for b in bins:
        got = rows[key].get(b)
        if got:
            p50 = statistics.median(x for x, _ in got)
            gbps = statistics.median(y for _, y in got)
            line += f" {p50:>12.1f} {gbps:>12.2f}"
        else:
            line += f" {'-':>12} {'-':>12}"
    print(line)
PY
    else
        echo "(python3 missing: raw rows)"
        grep -hE '^\s*(send|write|read)\s' "$logs"/*-os-*.log
    fi
    echo
    echo "# stack --memory cuda (GB/s, raw TCP GB/s, ratio) per binary and round"
    for f in "$logs"/*-stack-cuda.log; do
        [ -e "$f" ] || continue
        echo "## $(basename "$f" .log)"
        grep -E '^\s+[0-9]+[KMG]iB' "$f"
    done
} | tee "$summary"

exit "$failed"
