#!/usr/bin/env bash
# The CI job: system packages, formatting, generated-bindings drift, lints, the README's test
# command (`cargo xtask test`), then the two-namespace benchmark (`cargo xtask bench --netns`).
# Runs as root on a fresh Debian machine with no GPU.
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

# Peers killed and plugin faults injected at random under verified traffic: nothing may be lost.
section "fault soak (cargo xtask soak --seconds 60)"
cargo xtask soak --seconds 60

# Two "nodes" as network namespaces with four veth data NICs each: the benchmark's data must
# verify and every NIC must carry traffic (xtask fails otherwise). All traffic stays between the
# two namespaces it creates, and removes, itself.
section "multi-NIC striping between two network namespaces (cargo xtask bench --netns)"
cargo xtask bench --netns --sizes 1MiB,8MiB --iters 20 --verify
