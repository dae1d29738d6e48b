#!/usr/bin/env bash
# Small two-sided messages with eager frames (the default) against the previous path
# (TCPX_EAGER_BYTES=0), in one run on one machine: tcpx-bench server/client over loopback,
# against raw TCP with as many streams, ROUNDS rounds each way.
#
#   scripts/perf/eager_compare.sh [BENCH] [CHANNELS] [SIZES] [ROUNDS]
#   e.g. scripts/perf/eager_compare.sh target/release/tcpx-bench 8 4KiB,16KiB,64KiB,1MiB 2
#
# Prints one table per run (size, GB/s, p50 µs, p99 µs, raw-TCP GB/s, ratio). Loopback only.
set -euo pipefail
bench="${1:-target/release/tcpx-bench}"
channels="${2:-8}"
sizes="${3:-4KiB,16KiB,64KiB,1MiB,16MiB,256MiB}"
rounds="${4:-2}"
export TCPX_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo
port=9700
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
run() { # label, then environment assignments
  local label=$1
  shift
  port=$((port + 10))
  env "$@" timeout 300 "$bench" server --bind "127.0.0.1:$port" --channels "$channels" \
    --sizes "$sizes" >"$log" 2>&1 &
  local server=$!
  for _ in $(seq 300); do grep -q TCPX-BENCH-METADATA "$log" && break; sleep 0.1; done
  local meta
  meta=$(grep -o 'TCPX-BENCH-METADATA [0-9a-fA-F]*' "$log" | awk '{print $2}')
  echo "== $label"
  env "$@" timeout 300 "$bench" client --peer "$meta" --channels "$channels" --sizes "$sizes" \
    2>&1 | grep -E '^ +size|^ +[0-9]+[KMG]?i?B|rror' || true
  wait "$server" || echo "server exited with $?"
}
for r in $(seq "$rounds"); do
  run "round $r: eager frames (default)"
  run "round $r: previous path (TCPX_EAGER_BYTES=0)" TCPX_EAGER_BYTES=0
done
