#!/usr/bin/env bash
# UCCL's own p2p benchmark (p2p/benchmarks/benchmark_uccl.py from UCCL's repository, unmodified)
# over tcpx.p2p: a two-line package `uccl` whose `p2p` is `tcpx.p2p`, two ranks under
# torch.distributed.run, loopback only.
#
# Build here:
#   (cd crates/tcpx-py && ../../target/py-venv/bin/maturin build --release -o ../../.device/whl)
#   and copy benchmark_uccl.py from a checkout of uccl-project/uccl (fetch it here: the GPU
#   machine has no network) to .device/benchmark_uccl.py
# Run there (device tool, carry .device/whl and .device/benchmark_uccl.py):
#   scripts/gpu/uccl_bench.sh [WHEEL_DIR] [BENCH] -- [benchmark_uccl.py options]
#   e.g. scripts/gpu/uccl_bench.sh .device/whl .device/benchmark_uccl.py -- --device gpu \
#        --sizes 4096,65536,1048576,16777216 --float-type none --iters 100 [--num-iovs 16]
# Prints the benchmark's "[Client]" lines (size, Gbps, GB/s, µs per transfer).
set -euo pipefail
wheels="${1:-.device/whl}"
bench="${2:-.device/benchmark_uccl.py}"
shift 2 || true
[ "${1:-}" = "--" ] && shift
site="$(mktemp -d)"
trap 'rm -rf "$site"' EXIT
python3 -m pip install -q --no-deps --target "$site" "$wheels"/tcpx-*.whl
mkdir -p "$site/uccl"
echo "from tcpx import p2p" > "$site/uccl/__init__.py"
# Loopback only (README, "Network rule"): the data plane, the control plane and gloo.
export PYTHONPATH="$site" TCPX_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo \
    TCPX_CONTROL_ADDR=127.0.0.1:0 GLOO_SOCKET_IFNAME=lo
python3 -m torch.distributed.run --nproc_per_node=2 --master_addr=127.0.0.1 \
    --master_port="${MASTER_PORT:-29511}" "$bench" "$@" 2>&1 |
    grep -E "\[Client\] +[0-9]|Error|Traceback" || true
