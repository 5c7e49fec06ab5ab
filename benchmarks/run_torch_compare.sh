#!/usr/bin/env bash
# run_torch_compare.sh [BUILD_DIR]: shardopt's optimizer step against PyTorch's on this machine,
# back to back in the same minutes, and the ratio (PyTorch / shardopt; above 1: shardopt faster).
#
#   shardopt  OMP_NUM_THREADS=1 mpiexec.mpich -n RANKS BUILD_DIR/benchmarks/bench_step
#               --psi PSI --tensor-elems TENSOR_ELEMS --stages dp,1
#             (data-parallel and zero-1 over the default communicator; bf16 replica)
#   PyTorch   python3 benchmarks/torch_step.py --ranks RANKS --psi PSI --tensor-elems TENSOR_ELEMS
#             (gloo, one thread per rank: DDP + AdamW, and DDP + ZeroRedundancyOptimizer(AdamW))
#
# Pairs: shardopt data-parallel vs DDP + AdamW; shardopt zero-1 vs ZeroRedundancyOptimizer.
# bench_step's step: gradient reduction, norm, update, all-gather (zero-1) and clearing of the
# gradients, no backward (mean of its steps, slowest rank). torch_step.py's step: clearing +
# backward with DDP's all-reduce + optimizer.step(), minus the same backward without DDP
# (median of its steps, slowest rank); see its header.
# Environment: PSI (default 64M), TENSOR_ELEMS (default 1M), RANKS (default 2),
#              PYTHON (a python3 with torch; default: python3 if it imports torch, else
#              /usr/bin/python3), MPIEXEC (default mpiexec.mpich).
# Exit 2 when bench_step or torch (with gloo) is missing.
set -euo pipefail
build=${1:-build}
psi=${PSI:-64M}
elems=${TENSOR_ELEMS:-1M}
ranks=${RANKS:-2}
mpiexec=${MPIEXEC:-mpiexec.mpich}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
bench="$build/benchmarks/bench_step"
[ -x "$bench" ] || { echo "run_torch_compare: no $bench (build the benchmarks first)" >&2; exit 2; }

has_torch() { "$1" -c 'import torch.distributed as d; assert d.is_gloo_available()' >/dev/null 2>&1; }
python=${PYTHON:-}
if [ -z "$python" ]; then
  for p in python3 /usr/bin/python3; do
    if command -v "$p" >/dev/null && has_torch "$p"; then python=$p; break; fi
  done
fi
if [ -z "$python" ] || ! has_torch "$python"; then
  echo "run_torch_compare: no python3 with torch and gloo found." >&2
  echo "  On Debian 12: apt-get install python3-torch (torch 1.13, with gloo), then rerun" >&2
  echo "  (or set PYTHON=/usr/bin/python3 when another python3 comes first on PATH)." >&2
  exit 2
fi

echo "cpu: $(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -1); $(getconf _NPROCESSORS_ONLN) cores"
echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC'); ranks $ranks; psi $psi; tensors of $elems"
echo "python: $python, torch $("$python" -c 'import torch; print(torch.__version__)')"
echo

echo "## shardopt: OMP_NUM_THREADS=1 $mpiexec -n $ranks $bench --psi $psi --tensor-elems $elems --stages dp,1"
shard=$(OMP_NUM_THREADS=1 "$mpiexec" -n "$ranks" "$bench" --psi "$psi" --tensor-elems "$elems" --stages dp,1)
echo "$shard"
echo
echo "## PyTorch: $python $here/torch_step.py --ranks $ranks --psi $psi --tensor-elems $elems"
torch_out=$(OMP_NUM_THREADS=1 "$python" "$here/torch_step.py" --ranks "$ranks" --psi "$psi" \
              --tensor-elems "$elems" --modes ddp,zero)
echo "$torch_out"
echo

# bench_step's first table: | stage | reduction | comm | reduce | norm | update | gather | step | ...
step_of() {  # stage name -> step seconds
  awk -F'|' -v s="$1" '/^\| stage \| reduction/ { t++; next }
    t == 1 && /^\| [a-z]/ { n = $2; gsub(/ /, "", n); if (n == s) { v = $9; gsub(/ /, "", v); print v; exit } }' <<<"$shard"
}
# torch_step.py's table: | mode | optimizer | ranks | psi | with DDP | without DDP | step |
torch_of() {  # mode -> step seconds
  awk -F'|' -v m="$1" '/^\| [a-z]/ { n = $2; gsub(/ /, "", n); if (n == m) { v = $8; gsub(/ /, "", v); print v; exit } }' <<<"$torch_out"
}
row() {  # label shardopt-seconds pytorch-label pytorch-seconds
  local ratio
  ratio=$(awk -v a="$2" -v b="$4" 'BEGIN { if (a > 0 && b != "") printf "%.2f", b / a; else print "-" }')
  echo "| $1 | ${2:--} | $3 | ${4:--} | $ratio |"
}
echo "## Step seconds, ratio = PyTorch / shardopt (above 1: shardopt faster)"
echo
echo "| shardopt | s | PyTorch (gloo) | s | ratio |"
echo "|---|---|---|---|---|"
row "data-parallel" "$(step_of data-parallel)" "DDP + AdamW" "$(torch_of ddp)"
row "zero-1" "$(step_of zero-1)" "DDP + ZeroRedundancyOptimizer(AdamW)" "$(torch_of zero)"
