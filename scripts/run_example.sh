#!/usr/bin/env bash
# run_example.sh: the main job. Installs what is missing, builds, and trains the example MLP on
# 2 MPI ranks with the sharded optimizer; prints the loss and each rank's optimizer memory.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
build=${SHARDOPT_BUILD_DIR:-build}
launcher=$(sed -n 's/^MPIEXEC_EXECUTABLE:FILEPATH=//p' "$build/CMakeCache.txt")
flags=$(sed -n 's/^SHARDOPT_MPIEXEC_FLAGS_CACHED:INTERNAL=//p' "$build/CMakeCache.txt")
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
"${launcher:-mpiexec}" -n 2 $flags "$build/examples/train_mlp" "$@"
