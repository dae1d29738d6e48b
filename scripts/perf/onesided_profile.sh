#!/usr/bin/env bash
# Where pipelined one-sided operations go: `tcpx-bench onesided` (initiator and target in one
# process, over loopback) in the steady state, `perf record -g` attached after the set-up, then
# samples per thread and, for each thread kind (application `tcpx-bench`, control loops
# `tcpx-ctl-*`, engines `tcpx-eng-<device>.<index>`), its symbols by own time and by inclusive time.
#
#   scripts/perf/onesided_profile.sh [BENCH] [OP] [LAYOUT] [BLOCK] [BATCH] [OUT]
#   e.g. scripts/perf/onesided_profile.sh target/release/tcpx-bench write scattered 4KiB 32
#
# DEPTH (default 32) operations in flight, CHANNELS (default 8), CPUS (a taskset list; unset:
# the whole machine), PERF_EVENT (default cpu-clock: also where a VM exposes no hardware
# counters), SECONDS_RECORDED (default 2). Needs `perf` on PATH (or PERF=...) and
# perf_event_paranoid low enough (root). Loopback only. Symbols need a binary with its symbol
# table (`objcopy --strip-debug` keeps it).
set -euo pipefail
bench="${1:-target/release/tcpx-bench}"
op="${2:-write}"
layout="${3:-scattered}"
block="${4:-4KiB}"
batch="${5:-32}"
out="${6:-/tmp/onesided_profile}"
perf="${PERF:-perf}"
mkdir -p "$out"
export TCPX_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo
# Far more operations than the recording needs: the run is killed once it is recorded.
args=(onesided --op "$op" --layout "$layout" --block "$block" --batch "$batch"
  --channels "${CHANNELS:-8}" --depth "${DEPTH:-32}" --bytes 64GiB --reps 1000 --latency-iters 10)
on_cpus() { if [ -n "${CPUS:-}" ]; then exec taskset -c "$CPUS" "$@"; else exec "$@"; fi; }
on_cpus "$bench" "${args[@]}" >"$out/bench.log" 2>&1 &
pid=$!
trap 'kill "$pid" 2>/dev/null || true' EXIT
sleep 2
kill -0 "$pid" 2>/dev/null || { echo "tcpx-bench exited during set-up:" >&2; cat "$out/bench.log" >&2; exit 1; }
"$perf" record -e "${PERF_EVENT:-cpu-clock}" -F 4999 -g -p "$pid" -o "$out/perf.data" \
  -- sleep "${SECONDS_RECORDED:-2}" >"$out/perf.err" 2>&1 || { cat "$out/perf.err" >&2; exit 1; }
kill "$pid" 2>/dev/null || true
wait "$pid" 2>/dev/null || true
report() { "$perf" report -i "$out/perf.data" --stdio "$@" 2>/dev/null | grep -vE '^#|^$'; }
echo "=== samples by thread ($op, $layout, $block x $batch, depth ${DEPTH:-32})"
report --no-children --sort comm -n -g none | head -12
for comm in $(report --no-children --sort comm -g none | grep -oE 'tcpx-(ctl-[0-9]+|eng-[0-9]+\.[0-9]+)|tcpx-bench' | sort -u); do
  echo "=== $comm: own time"
  report --no-children --comm "$comm" --sort sym -n -g none | head -20
  echo "=== $comm: inclusive (user-space symbols)"
  report --children --comm "$comm" --sort sym -n -g none | grep -v '\[k\]' | head -14
done
echo "perf data: $out/perf.data"
