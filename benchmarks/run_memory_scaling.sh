#!/usr/bin/env bash
# run_memory_scaling.sh: the memory-scaling sweep of docs/memory.md in one command.
#   benchmarks/run_memory_scaling.sh [BUILD_DIR] [OUT_DIR]     (defaults: build, docs/memory)
# Runs build/benchmarks/memory_scaling under mpiexec for 1, 2, 4, 8 ranks x model sizes x
# (data-parallel, zero-1, zero-2), one process group per point, and writes
#   OUT_DIR/memory_scaling.csv        one row per rank and point
#   OUT_DIR/memory_per_rank.png       bytes per parameter per rank vs ranks, with the formula
#   OUT_DIR/step_phases.png           step time split by phase (largest model)
# Tensors and stage-2 buckets are 256Ki elements (1 MiB of staging). Ranks beyond the core count are oversubscribed: the memory figures are unaffected, the
# times then mostly measure oversubscription. Installs gnuplot (Debian) if missing.
# Environment: SIZES (elements, default "2000000 8000000 16000000"), RANKS, STEPS.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
build=$(realpath -m "${1:-$root/build}")
out=$(realpath -m "${2:-$root/docs/memory}")
sizes=${SIZES:-"2000000 8000000 16000000"}
ranks=${RANKS:-"1 2 4 8"}
steps=${STEPS:-3}

if ! command -v gnuplot >/dev/null; then
  sudo=""; [ "$(id -u)" -ne 0 ] && sudo=sudo
  $sudo apt-get install -y gnuplot-nox >/dev/null
fi
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$root" -B "$build" -DSHARDOPT_CUDA=OFF >/dev/null
fi
cmake --build "$build" --target memory_scaling -j2 >/dev/null
mpiexec=$(sed -n 's/^MPIEXEC_EXECUTABLE:FILEPATH=//p' "$build/CMakeCache.txt")
mpiexec=${mpiexec:-mpiexec}
bench="$build/benchmarks/memory_scaling"

mkdir -p "$out"
csv="$out/memory_scaling.csv"
rm -f "$csv"
for np in $ranks; do
  for psi in $sizes; do
    for stage in dp 1 2; do
      OMP_NUM_THREADS=1 "$mpiexec" -n "$np" "$bench" --stage "$stage" --psi "$psi" \
        --steps "$steps" --warmup 1 --bucket-elems 262144 --tensor-elems 262144 --csv "$csv"
    done
  done
done

# Per (mode, ranks, psi): accounted and peak-RSS growth per parameter (mean over ranks);
# per (mode, ranks) of the largest model: mean phase times.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
largest=$(for s in $sizes; do echo "$s"; done | sort -n | tail -1)
awk -F, -v dir="$tmp" -v largest="$largest" 'NR > 1 {
  key = $3 "," $1 "," $4
  acc[key] = $13 / $4; rss[key] += ($18 - $16) / $4; n[key]++
  if ($4 == largest) {
    t = $3 "," $1; cnt[t]++
    red[t] += $19; nrm[t] += $20; upd[t] += $21; gat[t] += $22; tot[t] += $23
  }
}
END {
  for (k in acc) {
    split(k, f, ","); print f[2], f[3], acc[k], rss[k] / n[k] > (dir "/mem_" f[1] ".dat")
  }
  for (t in cnt) {
    split(t, f, ","); c = cnt[t]
    other = (tot[t] - red[t] - nrm[t] - upd[t] - gat[t]) / c
    print f[2], red[t] / c, nrm[t] / c, upd[t] / c, gat[t] / c, other > (dir "/time_" f[1] ".dat")
  }
}' "$csv"
for f in "$tmp"/*.dat; do sort -n -k1,1 -k2,2 "$f" -o "$f"; done

gnuplot -e "dir='$tmp'; out='$out/memory_per_rank.png'; sizes='$sizes'" "$here/plot_memory_per_rank.gp"
gnuplot -e "dir='$tmp'; out='$out/step_phases.png'; psi='$largest'" "$here/plot_step_phases.gp"
echo "wrote $csv, $out/memory_per_rank.png, $out/step_phases.png"
