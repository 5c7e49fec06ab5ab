#!/bin/sh
# run_collectives.sh [BUILD_DIR] [bench_collectives options]: the intra-node collectives
# benchmark (nccl-tests output convention) at 2 and 4 ranks, buffers of 1 MiB to 256 MiB,
# plain MPI and shared memory, one OpenMP thread per rank. Results: docs/performance.md.
set -eu
build=${1:-build}
[ $# -gt 0 ] && shift
mpiexec=$(sed -n 's/^MPIEXEC_EXECUTABLE:FILEPATH=//p' "$build/CMakeCache.txt")
for np in 2 4; do
  OMP_NUM_THREADS=1 "${MPIEXEC:-${mpiexec:-mpiexec}}" -n "$np" "$build/benchmarks/bench_collectives" \
    -b 1MiB -e 256MiB -f 4 "$@"
  echo
done
