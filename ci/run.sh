#!/usr/bin/env bash
# The CI job: system packages, formatting, generated-bindings drift, lints, then the README's
# test command (`cargo xtask test`). Runs as root on a fresh Debian machine with no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."

# Every test pins the plugin and the control plane to loopback; these make doubly sure that no
# CI traffic can leave `lo`.
export TCPX_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo
export CARGO_TERM_COLOR=never

section() { printf '\n==== %s ====\n' "$*"; }

section "system packages"
ci/install-deps.sh

section "rustfmt"
cargo fmt --all -- --check

section "generated bindings are up to date"
cargo xtask bindgen --check

section "clippy"
cargo clippy --workspace --all-targets --quiet -- -D warnings

section "tests (README: cargo xtask test)"
cargo xtask test
