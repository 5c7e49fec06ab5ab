#!/usr/bin/env bash
# build.sh: configure and build shardopt in ./build (or $SHARDOPT_BUILD_DIR). CUDA is built
# when nvcc is found (/usr/local/cuda or PATH); MPI when found (MPICH preferred).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${SHARDOPT_BUILD_DIR:-build}
jobs=$(nproc 2>/dev/null || echo 2)
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release ${SHARDOPT_CMAKE_ARGS:-}
cmake --build "$build" -j "$jobs"
