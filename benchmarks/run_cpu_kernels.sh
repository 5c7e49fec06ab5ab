#!/usr/bin/env bash
# run_cpu_kernels.sh: the CPU kernel benchmark as reported in docs/performance.md.
#   benchmarks/run_cpu_kernels.sh [build-dir] [bench_cpu_kernels flags...]
# Prints the machine, then per size (one process each, so a size's buffers are allocated
# once) every kernel's parameters/s and bytes/s, and a table of each kernel's bandwidth as a
# fraction of the in-place update measured in the same process. Repetitions are randomly
# interleaved and the median is reported, so load from other processes spreads evenly.
set -euo pipefail
build=${1:-build}
shift || true
bin="$build/benchmarks/bench_cpu_kernels"
[[ -x "$bin" ]] || { echo "build first: cmake --build $build --target bench_cpu_kernels" >&2; exit 1; }
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-)"
echo "cores: $(nproc); SIMD: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(sse4_2|avx|avx2|fma|avx512f|avx512bw)$' | tr '\n' ' ')"
for size in ${SHARDOPT_BENCH_SIZES:-1Mi 16Mi 64Mi 256Mi}; do
  echo "== $size parameters; load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
  "$bin" --sizes="$size" --threads="${SHARDOPT_BENCH_THREADS:-2}" --benchmark_repetitions=3 \
    --benchmark_enable_random_interleaving=true --benchmark_report_aggregates_only=true \
    --benchmark_min_time=0.2 "$@"
done
