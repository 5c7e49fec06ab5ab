#!/bin/sh
# run_collectives.sh BUILD_DIR: the intra-node collectives benchmark at 2 and 4 ranks,
# 16M and 64M fp32 elements (one OpenMP thread per rank). Results: docs/performance.md.
set -eu
build=${1:-build}
mpiexec=${MPIEXEC:-mpiexec.mpich}
for np in 2 4; do
  OMP_NUM_THREADS=1 "$mpiexec" -n "$np" "$build/benchmarks/bench_collectives" 16777216 67108864
  echo
done
