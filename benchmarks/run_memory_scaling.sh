#!/usr/bin/env bash
# run_memory_scaling.sh: the memory-scaling sweep of docs/memory.md in one command.
#   benchmarks/run_memory_scaling.sh [BUILD_DIR] [OUT_DIR]   (defaults: build, BUILD_DIR/memory_scaling)
# Runs BUILD_DIR/benchmarks/memory_scaling under mpiexec for each rank count x model size x
# (data-parallel, zero-1, zero-2, zero-3), one process group per point, and writes into OUT_DIR
#   memory_scaling.csv     one row per rank and point (accounting, RSS, PSS, anonymous and
#                          shared memory, peak RSS, phase times)
#   memory_table.md        the table of docs/memory.md (largest model, mean over ranks)
#   memory_per_rank.png    bytes per parameter per rank vs ranks, one panel per stage, against
#                          the stage's formula (needs gnuplot)
#   step_phases.png        step time split by phase, largest model (needs gnuplot)
# It never writes under docs/ unless asked to (OUT_DIR=docs/memory) and installs nothing:
# without gnuplot (Debian: apt-get install gnuplot-nox) it skips the plots and says so.
# Tensors and stage-2 buckets are 256Ki elements (1 MiB of staging); at zero-3 every tensor is
# a unit. Ranks beyond the core count are oversubscribed: the memory figures are unaffected,
# the times are not.
# Environment: SIZES (elements, default "2M 8M 16M"), RANKS (default "1 2 3 4 8"), STEPS (3).
# The sweep of docs/memory.md: SIZES="2M 8M 16M" RANKS="1 2 3 4 8", OUT_DIR docs/memory.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
build=$(realpath -m "${1:-$root/build}")
out=$(realpath -m "${2:-$build/memory_scaling}")
sizes=${SIZES:-"2M 8M 16M"}
ranks=${RANKS:-"1 2 3 4 8"}
steps=${STEPS:-3}

if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DSHARDOPT_CUDA=OFF >/dev/null
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
    for stage in dp 1 2 3; do
      OMP_NUM_THREADS=1 "$mpiexec" -n "$np" "$bench" --stage "$stage" --psi "$psi" \
        --steps "$steps" --warmup 1 --bucket-elems 256Ki --tensor-elems 256Ki --csv "$csv"
    done
  done
done

# CSV columns: 1 ranks 2 rank 3 mode 4 psi 13 accounted 16 rss_base 17 rss_end 18 hwm
# 19-23 reduce norm update gather step (s) 25 pss_base 26 pss_end 27 anon_base 28 anon_end
# 29 shmem_base 30 shmem_end 31 pss_anon_end 32 pss_shmem_end.
largest=$(awk -F, 'NR > 1 && $4 > m { m = $4 } END { print m }' "$csv")
awk -F, -v largest="$largest" 'NR > 1 && $4 == largest {
  k = $3 "," $1; n[k]++
  acc[k] += $13; pss[k] += $26 - $25; anon[k] += $28 - $27; shm[k] += $32
  rss[k] += $17 - $16; peak[k] += $18 - $16; trans[k] += $18 - $17; step[k] += $23
}
END {
  M = 1048576
  printf "Psi = %d, mean over the ranks of each run; MiB per rank\n\n", largest
  print "| mode | N_d | accounted | PSS growth | anonymous growth | shared (PSS) | RSS growth | peak RSS growth | transient (peak - end RSS) | step s |"
  print "|---|---|---|---|---|---|---|---|---|---|"
  split("data-parallel zero-1 zero-2 zero-3", modes, " ")
  for (r = 1; r <= 1024; r++) for (m = 1; m <= 4; m++) {
    k = modes[m] "," r; if (!(k in n)) continue; c = n[k]
    printf "| %s | %d | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.2f |\n", modes[m], r,
      acc[k]/c/M, pss[k]/c/M, anon[k]/c/M, shm[k]/c/M, rss[k]/c/M, peak[k]/c/M, trans[k]/c/M, step[k]/c
  }
}' "$csv" > "$out/memory_table.md"
cat "$out/memory_table.md"

if ! command -v gnuplot >/dev/null; then
  echo "gnuplot not found: plots not drawn (Debian: apt-get install gnuplot-nox). Wrote $csv" >&2
  exit 0
fi
# Per (mode, ranks, psi): accounted, PSS growth and peak-RSS growth per parameter (mean over
# ranks); per (mode, ranks) of the largest model: mean phase times.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
awk -F, -v dir="$tmp" -v largest="$largest" 'NR > 1 {
  key = $3 "," $1 "," $4
  acc[key] += $13 / $4; pss[key] += ($26 - $25) / $4; peak[key] += ($18 - $16) / $4; n[key]++
  if ($4 == largest) {
    t = $3 "," $1; cnt[t]++
    red[t] += $19; nrm[t] += $20; upd[t] += $21; gat[t] += $22; tot[t] += $23
  }
}
END {
  for (k in n) {
    split(k, f, ","); print f[2], f[3], acc[k] / n[k], pss[k] / n[k], peak[k] / n[k] > (dir "/mem_" f[1] ".dat")
  }
  for (t in cnt) {
    split(t, f, ","); c = cnt[t]
    other = (tot[t] - red[t] - nrm[t] - upd[t] - gat[t]) / c
    print f[2], red[t] / c, nrm[t] / c, upd[t] / c, gat[t] / c, other > (dir "/time_" f[1] ".dat")
  }
}' "$csv"
for f in "$tmp"/*.dat; do sort -n -k1,1 -k2,2 "$f" -o "$f"; done
psis=$(awk -F, 'NR > 1 { print $4 }' "$csv" | sort -n -u | tr '\n' ' ')
cores=$(nproc 2>/dev/null || echo 0)
rank_list=$(awk -F, 'NR > 1 { print $1 }' "$csv" | sort -n -u | tr '\n' ' ')
gnuplot -e "dir='$tmp'; out='$out/memory_per_rank.png'; sizes='$psis'; ranks='$rank_list'" \
  "$here/plot_memory_per_rank.gp"
gnuplot -e "dir='$tmp'; out='$out/step_phases.png'; psi='$largest'; cores=$cores" "$here/plot_step_phases.gp"
echo "wrote $csv, $out/memory_table.md, $out/memory_per_rank.png, $out/step_phases.png"
