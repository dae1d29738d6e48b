#!/usr/bin/env bash
# Where one call per message goes at a small size: `tcpx-bench server/client` over loopback in
# the steady state, `perf record` attached to both processes after the set-up (so the profile
# holds only the stream), then per thread and, for the application threads, per symbol and
# per hot instruction (symbol+offset: map them to source lines with `addr2line -i -e BENCH`
# at the symbol's address plus the offset, on an unstripped build of the same binary).
#
#   scripts/perf/small_profile.sh [BENCH] [SIZE] [CHANNELS] [OUT]
#   e.g. scripts/perf/small_profile.sh target/release/tcpx-bench 4KiB 8 /tmp/prof
#
# PERF_EVENT (default cpu-clock: also where a VM exposes no hardware counters).
# ROUNDS (default 40) keeps the stream going past the 3 s of set-up and recording.
# EXTRA_ARGS (e.g. "--memory cuda") is added to both peers' arguments.
# SERVER_CPUS / CLIENT_CPUS (taskset lists, e.g. 0-15 and 16-31) put each peer on cores of its
# own, as on two nodes; unset, both share the machine.
# Needs `perf` on PATH (or PERF=...) and perf_event_paranoid low enough (root). Loopback only.
# Each engine thread is named tcpx-eng-<device>.<index>; the application
# thread carries the binary's name.
set -euo pipefail
bench="${1:-target/release/tcpx-bench}"
size="${2:-4KiB}"
channels="${3:-8}"
out="${4:-/tmp/small_profile}"
perf="${PERF:-perf}"
mkdir -p "$out"
export TCPX_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo
args=(--channels "$channels" --sizes "$size" --min-bytes 1GiB --rounds "${ROUNDS:-40}" --baseline none)
# shellcheck disable=SC2206 # EXTRA_ARGS is a list of words on purpose
args+=(${EXTRA_ARGS:-})
# `exec`: run in the background, the function is a subshell, and `$!` must be the bench itself.
on_cpus() { local cpus=$1; shift; if [ -n "$cpus" ]; then exec taskset -c "$cpus" "$@"; else exec "$@"; fi; }
on_cpus "${SERVER_CPUS:-}" "$bench" server --bind 127.0.0.1:0 "${args[@]}" >"$out/server.log" 2>&1 &
server=$!
for _ in $(seq 300); do grep -q TCPX-BENCH-METADATA "$out/server.log" && break; sleep 0.1; done
meta=$(grep -o 'TCPX-BENCH-METADATA [0-9a-fA-F]*' "$out/server.log" | awk '{print $2}')
[ -n "$meta" ] || { echo "the server did not start:" >&2; cat "$out/server.log" >&2; exit 1; }
on_cpus "${CLIENT_CPUS:-}" "$bench" client --peer "$meta" "${args[@]}" >"$out/client.log" 2>&1 &
client=$!
sleep 1.5
"$perf" record -e "${PERF_EVENT:-cpu-clock}" -F 9999 -p "$server" -o "$out/server.data" -- sleep 1.5 >"$out/perf-server.err" 2>&1 &
"$perf" record -e "${PERF_EVENT:-cpu-clock}" -F 9999 -p "$client" -o "$out/client.data" -- sleep 1.5 >"$out/perf-client.err" 2>&1 || { cat "$out/perf-client.err"; exit 1; }
wait "$client" "$server"
grep -E '^ +[0-9]+[KMG]?i?B' "$out/client.log" | tail -1
app=$(basename "$bench")
for side in server client; do
  echo "=== $side: samples by thread"
  "$perf" report -i "$out/$side.data" --sort comm -n --stdio 2>/dev/null | grep -vE '^#|^$' | head -20
  echo "=== $side: application thread by symbol"
  "$perf" report -i "$out/$side.data" --comm "$app" --sort dso,sym --stdio 2>/dev/null |
    grep -vE '^#|^$' | head -20
  "$perf" script -i "$out/$side.data" --comm "$app" -F ip,sym,symoff 2>/dev/null |
    awk '{print $2}' | sort | uniq -c | sort -rn | head -300 >"$out/$side-hot.txt"
done
echo "hot instructions: $out/server-hot.txt, $out/client-hot.txt"
