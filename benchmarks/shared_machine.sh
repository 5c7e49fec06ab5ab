#!/usr/bin/env bash
# shared_machine.sh: the step time of a small trainer on 2 ranks on a quiet machine and with a
# CPU hog beside it, under the wait policies a user can choose (docs/performance.md, "Waits on
# a shared machine"). The trainer is the Fortran example (examples/fortran/train_mlp.f90: a
# 16-64-4 MLP, 1,348 parameters, a step of about 0.16 ms on a quiet 2-core Xeon); the step time is
# (time of LONG steps - time of SHORT steps) / (LONG - SHORT), so start-up cancels.
#
#   benchmarks/shared_machine.sh [BUILD_DIR] [REPEATS]
#
# Policies (environment of every rank):
#   before   SHARDOPT_COLLECTIVE_TIMEOUT=off SHARDOPT_MPI_WAIT=block  (earlier releases' default
#            on a machine with a CPU per rank: MPICH's own spinning waits, no timeout)
#   spin     SHARDOPT_MPI_WAIT=block, default timeout (poll without yielding, then sleep)
#   default  nothing set (this release: the 600 s timeout, polls that yield, then sleep)
# The hogs: one or two busy processes (`yes > /dev/null`), other programs on the same machine.
set -euo pipefail
build=${1:-build}
repeats=${2:-5}
trainer="$build/examples/train_mlp_f"
[ -x "$trainer" ] || { echo "no $trainer (build with Fortran and MPI)" >&2; exit 2; }
mpiexec=$(grep -m1 '^MPIEXEC_EXECUTABLE:' "$build/CMakeCache.txt" | cut -d= -f2)
short=${SHARDOPT_SHORT_STEPS:-100}
long=${SHARDOPT_LONG_STEPS:-1100}

echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'), $(nproc) CPUs"
run_steps() {  # policy-env... -- steps: wall seconds of one run
  local steps=$1; shift
  local t0 t1
  t0=$(date +%s.%N)
  env "$@" "$mpiexec" -n 2 "$trainer" --steps "$steps" --stage 1 > /dev/null
  t1=$(date +%s.%N)
  awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.6f", b - a}'
}
per_step_ms() {  # policy-env...: median over $repeats of the per-step time in ms
  local values=()
  for ((k = 0; k < repeats; ++k)); do
    local a b
    a=$(run_steps $short "$@")
    b=$(run_steps $long "$@")
    values+=("$(awk -v a="$a" -v b="$b" -v n=$((long - short)) 'BEGIN {printf "%.6f", (b - a) * 1000 / n}')")
  done
  printf '%s\n' "${values[@]}" | sort -g | awk '{v[NR]=$1} END {printf "%.3f (min %.3f, max %.3f)", v[int((NR+1)/2)], v[1], v[NR]}'
}

declare -A env_of=(
  [before]="SHARDOPT_COLLECTIVE_TIMEOUT=off SHARDOPT_MPI_WAIT=block"
  [spin]="SHARDOPT_MPI_WAIT=block"
  [default]="SHARDOPT_UNUSED=1"
)
loaded() {  # hogs policy-env...: per-step ms with that many busy processes beside the job
  local n=$1; shift
  local pids=()
  for ((h = 0; h < n; ++h)); do
    yes > /dev/null &
    pids+=($!)
  done
  per_step_ms "$@"
  kill "${pids[@]}"
  wait "${pids[@]}" 2>/dev/null || true
}
printf '%-8s %-32s %-32s %-32s\n' policy "quiet: ms/step" "1 CPU hog: ms/step" "2 CPU hogs: ms/step"
for policy in before spin default; do
  # shellcheck disable=SC2086
  printf '%-8s %-32s %-32s %-32s\n' "$policy" "$(per_step_ms ${env_of[$policy]})" \
    "$(loaded 1 ${env_of[$policy]})" "$(loaded 2 ${env_of[$policy]})"
done
