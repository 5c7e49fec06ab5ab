#!/usr/bin/env bash
# run_overlap.sh [build-dir]: the overlap benchmark at 2 ranks, stages 1 and 2 (gradient
# reduction hidden behind backward) and stage 3 (gathers hidden by prefetching the next unit
# in a forward pass), both compute models (see bench_overlap.cpp). Prints one table per
# configuration.
set -euo pipefail
build=${1:-build}
launcher=$(sed -n 's/^MPIEXEC_EXECUTABLE:FILEPATH=//p' "$build/CMakeCache.txt")
flags=$(sed -n 's/^SHARDOPT_MPIEXEC_FLAGS_CACHED:INTERNAL=//p' "$build/CMakeCache.txt")
export OMP_NUM_THREADS=1
# Plain MPI's non-blocking collectives are what overlap hides; the shared-memory collectives
# (the default on one node) are non-blocking on one node since 2026-11-26: SHARDOPT_COMM=shm
# measures them (docs/performance.md, "The default communicator").
export SHARDOPT_COMM=${SHARDOPT_COMM:-mpi}
for compute in device cpu; do
  for stage in 1 2 3; do
    "${launcher:-mpiexec}" -n 2 $flags "$build/benchmarks/bench_overlap" --stage "$stage" \
      --compute "$compute" --params 32 --tensor-elems 524288 --bucket-elems 1048576 \
      --iterations 9
    echo
  done
done
