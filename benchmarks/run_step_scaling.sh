#!/usr/bin/env bash
# run_step_scaling.sh [BUILD_DIR] [OUT_DIR]: the optimizer step at 1, 2, 3 and 4 ranks on this machine
# in one command (bench_step per rank count, one thread per rank, the default communicator).
# Prints one table: per rank count and stage the step, its floor (bytes per rank over the
# in-place bandwidth that run measured with that many ranks), and the update phase, the
# per-rank work that should fall as 1/N: "update x N / update at 1" stays near 1 while the
# ranks have cores and memory bandwidth of their own, and grows once they share them (ranks
# beyond the core count take turns on a core; ranks on one socket share its bandwidth).
# Data-parallel ranks each update every parameter: their update does not fall with N.
# With OUT_DIR: OUT_DIR/step_scaling.dat (per rank count and stage: the phases, the rest of
# the step, the floor, in seconds) and, where gnuplot is installed (Debian: gnuplot-nox),
# OUT_DIR/step_phases.png, the phases stacked against the floor (plot_step_scaling.gp).
# Environment: PSI (parameters, default 64M), RANKS (default "1 2 3 4"), STAGES (dp,1,2),
#              SHARDOPT_COMM=mpi for plain MPI.
set -euo pipefail
build=${1:-build}
out_dir=${2:-}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
dat=""
if [ -n "$out_dir" ]; then
  mkdir -p "$out_dir"
  dat="$out_dir/step_scaling.dat"
  echo "# label reduce norm update gather rest floor (seconds; rest = step - the four phases)" > "$dat"
fi
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
  while IFS='|' read -r _ stage _ comm reduce norm update gather step floor ratio _; do
    stage=$(xargs <<<"$stage"); comm=$(xargs <<<"$comm"); update=$(xargs <<<"$update")
    if [ -n "$dat" ]; then
      awk -v l="N=$np,$stage" -v r="$reduce" -v n="$norm" -v u="$update" -v g="$gather" \
          -v s="$step" -v f="$floor" \
          'BEGIN { printf "\"%s\" %s %s %s %s %.4f %s\n", l, r, n, u, g, s - r - n - u - g, f }' >> "$dat"
    fi
    [ -z "${base[$stage]:-}" ] && base[$stage]=$update
    rel=$(awk -v u="$update" -v n="$np" -v b="${base[$stage]}" 'BEGIN { printf "%.2f", u * n / b }')
    [ "$stage" = data-parallel ] && rel="- (every rank updates all)"
    echo "| $np | $stage | $comm | $bw | $(xargs <<<"$step") | $(xargs <<<"$floor") | $(xargs <<<"$ratio") | $update | $rel |"
  done < <(awk '/^\| stage \| reduction/ { t++; next } t == 1 && /^\| [a-z]/ { print } t == 1 && /^$/ && n++ { exit }' <<<"$out")
done
echo
echo "With $cores cores, rank counts above $cores are oversubscribed: their ranks take turns on a core,"
echo "so their per-rank work cannot fall as 1/N."
if [ -n "$dat" ]; then
  if command -v gnuplot >/dev/null; then
    gnuplot -e "dat='$dat'; out='$out_dir/step_phases.png'; cores=$cores; psi='$psi'" \
      "$here/plot_step_scaling.gp"
    echo "wrote $dat and $out_dir/step_phases.png"
  else
    echo "wrote $dat; no gnuplot for the plot (Debian: apt-get install gnuplot-nox)"
  fi
fi
