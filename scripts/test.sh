#!/usr/bin/env bash
# test.sh: the whole test suite. Installs what is missing, builds, runs every ctest test (MPI
# tests at 1-4 ranks, examples, and the GPU suite: on a GPU when present, else its Thrust
# OpenMP build, and the LibTorch adapter: Debian's libtorch-dev and gloo's headers are
# installed for it; MPICH stays the MPI of the build). Ends with ctest's summary line.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
bash scripts/setup.sh libtorch-dev libgloo-dev
echo "test.sh: set-up took $((SECONDS - start)) s"
start=$SECONDS
bash scripts/build.sh
echo "test.sh: build took $((SECONDS - start)) s"
build=${SHARDOPT_BUILD_DIR:-build}
cd "$build"
ctest --output-on-failure -j "$(nproc 2>/dev/null || echo 2)" "$@"
