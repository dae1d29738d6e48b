#!/usr/bin/env bash
# Instructions per send+recv request pair of the progress engine, counted by callgrind on
# `tcpx-bench overhead` (the instant plugin: every request completes at its first test, so
# what is counted is the engine's own cost plus the plugin's few calls).
#
#   scripts/perf/callgrind_overhead.sh BIN [--channels C[,C...]] [--small N1] [--large N2] [ARGS...]
#
# BIN is a tcpx-bench binary (release build). For each channel count it runs `BIN overhead`
# twice under callgrind, with N1 and N2 transfers per side per repetition, and prints
# (Ir(N2) - Ir(N1)) / (pairs(N2) - pairs(N1)): the setup (process start, connection,
# registration) cancels out. A pair is one send and one receive request; the bench runs
# its repetitions plus one warm-up, all counted (OVERHEAD_PASSES, default 6 = the bench's
# 5 repetitions + 1 warm-up).
#
# Callgrind runs one thread at a time, so an idle engine that spins would have its empty
# passes counted (several times the real cost, and varying from run to run). Where BIN's
# `overhead` takes `--backoff`, the script asks for `park` (an idle engine blocks); where it
# does not, it says so and the figure includes spinning.
#
# Everything stays on loopback: the instant plugin makes no connection, and the control
# listeners bind 127.0.0.1.
set -euo pipefail

usage() {
    sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
}

[[ $# -ge 1 ]] || usage
BIN=$1
shift
CHANNELS=1
N1=1
N2=3
EXTRA=()
while [[ $# -gt 0 ]]; do
    case $1 in
        --channels) CHANNELS=$2; shift 2 ;;
        --small) N1=$2; shift 2 ;;
        --large) N2=$2; shift 2 ;;
        -h|--help) usage ;;
        *) EXTRA+=("$1"); shift ;;
    esac
done
[[ -x $BIN ]] || { echo "callgrind_overhead: $BIN is not an executable" >&2; exit 2; }
command -v valgrind >/dev/null || { echo "callgrind_overhead: valgrind not found" >&2; exit 2; }
(( N2 > N1 && N1 >= 1 )) || { echo "callgrind_overhead: need 1 <= --small < --large" >&2; exit 2; }
PASSES=${OVERHEAD_PASSES:-6}

export TCPX_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo
BACKOFF=()
if "$BIN" overhead --help 2>/dev/null | grep -q -- '--backoff'; then
    BACKOFF=(--backoff park)
else
    echo "callgrind_overhead: $BIN overhead has no --backoff: idle engines spin, and their" \
        "empty passes are counted (figures inflated and noisy)" >&2
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# Prints "IR REQUESTS" of one run: total instructions and requests per side per repetition.
run() {
    local channels=$1 transfers=$2 out="$WORK/cg.$1.$2"
    timeout 1800 valgrind --tool=callgrind --callgrind-out-file="$out" \
        "$BIN" overhead --channels "$channels" --transfers "$transfers" \
        "${BACKOFF[@]}" "${EXTRA[@]}" >"$out.stdout" 2>"$out.stderr" || {
        echo "callgrind_overhead: run failed ($channels channels, $transfers transfers):" >&2
        tail -20 "$out.stderr" >&2
        exit 1
    }
    local ir requests
    ir=$(awk '/^(summary|totals):/ { print $2; exit }' "$out")
    requests=$(awk -F'[:,]' '/requests:/ { gsub(/ /, "", $2); print $2; exit }' "$out.stdout")
    [[ -n $ir && -n $requests ]] || { echo "callgrind_overhead: no figures in $out" >&2; exit 1; }
    echo "$ir $requests"
}

echo "binary: $BIN ${BACKOFF[*]} ${EXTRA[*]}"
IFS=, read -r -a LIST <<<"$CHANNELS"
for c in "${LIST[@]}"; do
    read -r ir1 req1 < <(run "$c" "$N1")
    read -r ir2 req2 < <(run "$c" "$N2")
    pairs=$(( (req2 - req1) * PASSES ))
    awk -v c="$c" -v ir1="$ir1" -v ir2="$ir2" -v n1="$N1" -v n2="$N2" -v p="$pairs" 'BEGIN {
        printf "channels %s: Ir(%d transfers) = %d, Ir(%d) = %d, %d more pairs: %.0f instructions per send+recv pair\n",
            c, n1, ir1, n2, ir2, p, (ir2 - ir1) / p
    }'
done
