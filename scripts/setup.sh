#!/usr/bin/env bash
# setup.sh: install what shardopt needs on Debian/Ubuntu, only what is missing; safe to re-run.
# Uses sudo only when not root (containers have no sudo).
set -euo pipefail

packages=(build-essential cmake gfortran pkg-config mpich libmpich-dev
          libgtest-dev libgmock-dev libbenchmark-dev libcli11-dev
          libthrust-dev)  # Thrust/CUB headers: the OpenMP device tests and the fake device
packages+=("$@")  # extra packages a caller needs (e.g. clang for the fuzzer)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  as_root=()
  [ "$(id -u)" -eq 0 ] || as_root=(sudo)
  echo "setup: installing ${missing[*]}"
  "${as_root[@]}" apt-get update -q
  DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
