#!/usr/bin/env bash
# run_step_scaling.sh [BUILD_DIR]: the optimizer step at 1, 2, 3 and 4 ranks on this machine
# in one command (bench_step per rank count, one thread per rank, the default communicator).
# Prints one table: per rank count and stage the step, its floor (bytes per rank over the
# in-place bandwidth that run measured with that many ranks), and the update phase, the
# per-rank work that should fall as 1/N: "update x N / update at 1" stays near 1 while the
# ranks have cores and memory bandwidth of their own, and grows once they share them (ranks
# beyond the core count take turns on a core; ranks on one socket share its bandwidth).
# Data-parallel ranks each update every parameter: their update does not fall with N.
# Environment: PSI (parameters, default 64M), RANKS (default "1 2 3 4"), STAGES (dp,1,2),
#              SHARDOPT_COMM=mpi for plain MPI.
set -euo pipefail
build=${1:-build}
psi=${PSI:-64M}
ranks=${RANKS:-"1 2 3 4"}
stages=${STAGES:-dp,1,2}
launcher=$(sed -n 's/^MPIEXEC_EXECUTABLE:FILEPATH=//p' "$build/CMakeCache.txt")
flags=$(sed -n 's/^SHARDOPT_MPIEXEC_FLAGS_CACHED:INTERNAL=//p' "$build/CMakeCache.txt")
cores=$(getconf _NPROCESSORS_ONLN)
echo "cpu: $(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -1); $cores cores; psi $psi"
echo
echo "| ranks | stage | comm | bandwidth GB/s per rank | step s | floor s | step/floor | update s | update x N / update at 1 |"
echo "|---|---|---|---|---|---|---|---|---|"
declare -A base
for np in $ranks; do
  out=$(OMP_NUM_THREADS=1 "${launcher:-mpiexec}" -n "$np" $flags "$build/benchmarks/bench_step" \
          --psi "$psi" --stages "$stages")
  bw=$(sed -n 's/.*bandwidth per rank.*: \([0-9.]*\) GB\/s.*/\1/p' <<<"$out" | head -1)
  # The first table's rows: | stage | reduction | comm | reduce | norm | update | gather | step | floor | step/floor | ...
  while IFS='|' read -r _ stage _ comm _ _ update _ step floor ratio _; do
    stage=$(xargs <<<"$stage"); comm=$(xargs <<<"$comm"); update=$(xargs <<<"$update")
    [ -z "${base[$stage]:-}" ] && base[$stage]=$update
    rel=$(awk -v u="$update" -v n="$np" -v b="${base[$stage]}" 'BEGIN { printf "%.2f", u * n / b }')
    [ "$stage" = data-parallel ] && rel="- (every rank updates all)"
    echo "| $np | $stage | $comm | $bw | $(xargs <<<"$step") | $(xargs <<<"$floor") | $(xargs <<<"$ratio") | $update | $rel |"
  done < <(awk '/^\| stage \| reduction/ { t++; next } t == 1 && /^\| [a-z]/ { print } t == 1 && /^$/ && n++ { exit }' <<<"$out")
done
echo
echo "With $cores cores, rank counts above $cores are oversubscribed: their ranks take turns on a core,"
echo "so their per-rank work cannot fall as 1/N."
