#!/usr/bin/env bash
# Installs the Debian packages the workspace needs (the same list as `cargo xtask sysdeps`).
set -euo pipefail
packages=(pkg-config libhwloc-dev libudev-dev hwloc-nox libclang-dev iproute2 valgrind python3-venv etcd-server protobuf-compiler libprotobuf-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "system packages present: ${packages[*]}"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "missing packages: ${missing[*]}; run: sudo apt-get update && sudo apt-get install -y ${missing[*]}" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends "${missing[@]}"
