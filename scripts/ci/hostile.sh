#!/usr/bin/env bash
# Hostile peers against a waiting `tcpx-bench server` (issue 14 item 2), on 127.0.0.1 only.
#
# Starts a server, sends COUNT hostile connections to every port it listens on (the control
# port and the baseline port = control + 1): random bytes, all 0xff, a slow drip, an instant
# close, `TXCP` + junk, and silent connections held open. After SETTLE seconds the server must
# still be alive; once every stranger has ended, its open fds (/proc/PID/fd) and threads
# (/proc/PID/task) must be what they were before; then a real client runs the sweep with
# --verify and both ends must exit 0.
#
# Environment: TCPX_BENCH (binary; default target/release/tcpx-bench, built if missing),
# HOSTILE_PORT (control port, default 47700), HOSTILE_COUNT (per port, default 200),
# HOSTILE_TARGETS ("control baseline" by default; "baseline" alone skips the control port),
# HOSTILE_SETTLE (seconds, default 6).
set -euo pipefail
cd "$(dirname "$0")/../.."

export TCPX_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo TCPX_LOG=warn
BIN=${TCPX_BENCH:-target/release/tcpx-bench}
PORT=${HOSTILE_PORT:-47700}
COUNT=${HOSTILE_COUNT:-200}
TARGETS=${HOSTILE_TARGETS:-control baseline}
SETTLE=${HOSTILE_SETTLE:-6}
ARGS=(--sizes 1MiB,4MiB --iters 8 --min-bytes 8MiB --verify --timeout 60)

if [[ -z ${TCPX_BENCH:-} && ! -x $BIN ]]; then
    cargo build --release -p tcpx-tools --bin tcpx-bench
fi

work=$(mktemp -d)
pids=()
server=
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    [[ -n $server ]] && kill "$server" 2>/dev/null || true
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

"$BIN" server --bind "127.0.0.1:$PORT" "${ARGS[@]}" >"$work/server.out" 2>"$work/server.err" &
server=$!
for _ in $(seq 300); do
    grep -q '^TCPX-BENCH-METADATA ' "$work/server.out" 2>/dev/null && break
    kill -0 "$server" 2>/dev/null || { cat "$work/server.err"; echo "hostile: server died"; exit 1; }
    sleep 0.1
done
peer=$(awk '/^TCPX-BENCH-METADATA /{print $2; exit}' "$work/server.out")
[[ -n $peer ]] || { echo "hostile: no metadata line"; exit 1; }

counts() { echo "$(ls /proc/"$server"/fd | wc -l) fds, $(ls /proc/"$server"/task | wc -l) threads"; }
before=$(counts)

# One hostile connection of kind $2 to port $1 (each bounded, so none can outlive the test).
hostile() {
    local port=$1 kind=$2
    timeout 20 bash -c '
        exec 3<>/dev/tcp/127.0.0.1/'"$port"' || exit 0
        case '"$kind"' in
            0) head -c 512 /dev/urandom >&3 ;;
            1) head -c 512 /dev/zero | tr "\0" "\377" >&3 ;;
            2) for _ in 1 2 3 4 5 6 7 8; do printf "\x01" >&3; sleep 0.5; done ;;
            3) ;;  # instant close
            4) printf "TXCP" >&3; head -c 256 /dev/urandom >&3 ;;
            5) sleep 15 ;;  # silent, held open
        esac
        exec 3>&-
    ' 2>/dev/null || true
}

ports=()
for t in $TARGETS; do
    case $t in
        control) ports+=("$PORT") ;;
        baseline) ports+=("$((PORT + 1))") ;;
        *) echo "hostile: unknown target $t"; exit 2 ;;
    esac
done
for port in "${ports[@]}"; do
    for i in $(seq 0 $((COUNT - 1))); do
        hostile "$port" $((i % 6)) &
        pids+=($!)
    done
done
sleep "$SETTLE"
kill -0 "$server" 2>/dev/null || { cat "$work/server.err"; echo "hostile: the server died under hostile connections"; exit 1; }
echo "hostile: under attack: $(counts)"
# Every stranger ends by itself (the silent ones after 15 s); once they have, and the server has
# seen them go, nothing of theirs may be left in the server.
for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
pids=()
sleep 3
after=$(counts)
echo "hostile: server before: $before; after $COUNT hostile connections per port on ${ports[*]}: $after"
if [[ $before != "$after" ]]; then
    echo "hostile: FAIL: the server's fd or thread count changed"
    exit 1
fi

"$BIN" client --peer "$peer" "${ARGS[@]}"
wait "$server"
code=$?
server=
if [[ $code != 0 ]]; then
    cat "$work/server.err"
    echo "hostile: FAIL: server exited $code"
    exit 1
fi
echo "hostile: strangers dropped by the server: $(grep -c 'dropped' "$work/server.err" || true)"
echo "hostile: OK"
