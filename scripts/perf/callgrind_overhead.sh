#!/usr/bin/env bash
# Instructions per send+recv request pair of the progress engine, counted by callgrind on
# `tcpx-bench overhead` (the instant plugin: every request completes at its first test, so
# what is counted is the engine's own cost plus the plugin's few calls).
#
#   scripts/perf/callgrind_overhead.sh BIN [--channels C[,C...]] [--small N1] [--large N2]
#                                          [--allow-spin] [ARGS...]
#
# BIN is a tcpx-bench binary (release build). For each channel count it runs `BIN overhead`
# twice under callgrind, with N1 and N2 transfers per side per repetition, and prints
# (Ir(N2) - Ir(N1)) / (pairs(N2) - pairs(N1)): the setup (process start, connection,
# registration) cancels out. A pair is one send and one receive request; the pairs are
# counted by callgrind too (calls of the safe layer's `SendComm::isend`), so the bench's
# repetitions and warm-up need not be known here.
#
# Callgrind runs one thread at a time, so an idle engine that spins has its empty passes
# counted: the figure then measures scheduling, not the engine (one run gave 203 per pair,
# another 9,800). The script asks BIN's `overhead` for `--backoff park` (an idle engine
# blocks) and refuses a BIN without that flag unless given --allow-spin.
#
# Everything stays on loopback: the instant plugin makes no connection, and the control
# listeners bind 127.0.0.1.
set -euo pipefail

usage() {
    sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
}

[[ $# -ge 1 ]] || usage
BIN=$1
shift
CHANNELS=1
N1=1
N2=3
ALLOW_SPIN=0
EXTRA=()
while [[ $# -gt 0 ]]; do
    case $1 in
        --channels) CHANNELS=$2; shift 2 ;;
        --small) N1=$2; shift 2 ;;
        --large) N2=$2; shift 2 ;;
        --allow-spin) ALLOW_SPIN=1; shift ;;
        -h|--help) usage ;;
        *) EXTRA+=("$1"); shift ;;
    esac
done
[[ -x $BIN ]] || { echo "callgrind_overhead: $BIN is not an executable" >&2; exit 2; }
command -v valgrind >/dev/null || { echo "callgrind_overhead: valgrind not found" >&2; exit 2; }
(( N2 > N1 && N1 >= 1 )) || { echo "callgrind_overhead: need 1 <= --small < --large" >&2; exit 2; }

export TCPX_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo
BACKOFF=()
if "$BIN" overhead --help 2>/dev/null | grep -q -- '--backoff'; then
    BACKOFF=(--backoff park)
elif (( ALLOW_SPIN )); then
    echo "callgrind_overhead: $BIN overhead has no --backoff: idle engines spin, and their" \
        "empty passes are counted (the figure is not the engine's cost)" >&2
else
    echo "callgrind_overhead: $BIN overhead has no --backoff (idle engines would spin and" \
        "their empty passes be counted); give --allow-spin to measure anyway" >&2
    exit 2
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# Prints "IR SENDS" of one run: total instructions and send requests posted.
run() {
    local channels=$1 transfers=$2 out="$WORK/cg.$1.$2"
    timeout 1800 valgrind --tool=callgrind --callgrind-out-file="$out" \
        "$BIN" overhead --channels "$channels" --transfers "$transfers" \
        "${BACKOFF[@]}" "${EXTRA[@]}" >"$out.stdout" 2>"$out.stderr" || {
        echo "callgrind_overhead: run failed ($channels channels, $transfers transfers):" >&2
        tail -20 "$out.stderr" >&2
        exit 1
    }
    local ir sends
    ir=$(awk '/^(summary|totals):/ { print $2; exit }' "$out")
    # Calls to SendComm::isend: a callee is named in full the first time its id appears
    # ("cfn=(id) name"), by id alone afterwards.
    sends=$(awk '
        /^c?fn=\([0-9]+\) / { id = $1; sub(/^c?fn=/, "", id); name[id] = substr($0, index($0, " ") + 1) }
        /^cfn=/ { id = $1; sub(/^cfn=/, "", id); callee = name[id] }
        /^calls=/ { if (callee ~ /SendComm::isend$/) { split($1, c, "="); n += c[2] } }
        END { print n + 0 }' "$out")
    [[ -n $ir && $sends -gt 0 ]] || { echo "callgrind_overhead: no figures in $out" >&2; exit 1; }
    echo "$ir $sends"
}

echo "binary: $BIN ${BACKOFF[*]} ${EXTRA[*]}"
IFS=, read -r -a LIST <<<"$CHANNELS"
for c in "${LIST[@]}"; do
    read -r ir1 sends1 < <(run "$c" "$N1")
    read -r ir2 sends2 < <(run "$c" "$N2")
    pairs=$(( sends2 - sends1 ))
    awk -v c="$c" -v ir1="$ir1" -v ir2="$ir2" -v n1="$N1" -v n2="$N2" -v p="$pairs" 'BEGIN {
        printf "channels %s: Ir(%d transfers) = %d, Ir(%d) = %d, %d more pairs: %.0f instructions per send+recv pair\n",
            c, n1, ir1, n2, ir2, p, (ir2 - ir1) / p
    }'
done
