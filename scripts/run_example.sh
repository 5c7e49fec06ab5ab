#!/usr/bin/env bash
# run_example.sh: the main job. Installs what is missing, configures, builds only the example
# trainer and the library it needs (the full build is for scripts/test.sh), and trains the
# example MLP on 2 MPI ranks with the sharded optimizer; prints the loss and each rank's
# optimizer memory. Arguments go to the trainer (--help lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
build=${SHARDOPT_BUILD_DIR:-build}
jobs=$(nproc 2>/dev/null || echo 2)
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release ${SHARDOPT_CMAKE_ARGS:-}
cmake --build "$build" -j "$jobs" --target train_mlp
launcher=$(sed -n 's/^MPIEXEC_EXECUTABLE:FILEPATH=//p' "$build/CMakeCache.txt")
flags=$(sed -n 's/^SHARDOPT_MPIEXEC_FLAGS_CACHED:INTERNAL=//p' "$build/CMakeCache.txt")
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
"${launcher:-mpiexec}" -n 2 $flags "$build/examples/train_mlp" "$@"
