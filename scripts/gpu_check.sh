#!/usr/bin/env bash
# gpu_check.sh: the whole CUDA path measured on one GPU, in one command, from a bare machine
# (docs/cuda.md, "The GPU check"). Run from the repository root; the kit that
# `scripts/gpu_kit.sh prepare` made on the developer machine must come along (.gpu-kit).
#
#   scripts/gpu_check.sh [--out DIR] [--build DIR] [--budget SECONDS] [--jobs N]
#   scripts/gpu_check.sh --dry-run [--build DIR [--no-build]] [--out DIR]
#
# It builds (all cores) the CUDA library, the GPU tests, bench_cuda_adam and bench_cuda_step,
# runs every item below and writes report.md and report.csv (item, result, command) to --out
# (default: $OUT, else ./gpu-check-out), with its log (gpu_check.log):
#   env.*      device, driver, CUDA and NCCL versions
#   build.*    the kit installed (GoogleTest, MPICH, CLI11), configure, build
#   test.*     every GPU test (test_cuda_backend, test_cuda_optimizer_single/_nccl at one rank,
#              test_cuda_nccl_comm: collectives, asynchronous error, collective timeout)
#   bitwise.*  GPU == CPU bit for bit (master, m, v, replica; AdamW8bit's codes and scales;
#              Ownership::Whole; the uneven collectives; Adafactor's state and weights;
#              Reduction::Reproducible's two-phase exact sums),
#              from the tests above
#   muon.*     Muon with cuBLAS's Newton-Schulz vs the CPU's, to rounding (the tests above)
#   adamw.*    the fused update at 2^24, 2^26, 2^28 elements against a device-to-device copy,
#              and AdamW8bit's block kernel on the same buffers
#   torch.*    torch.optim.AdamW(fused=True) and (foreach=True) at the same sizes
#   step.*     the optimizer step at stages 1-3 (1 Gi parameters, tensors of 16 Mi, bf16
#              replica), phases from device events, against the fused kernel alone
#   sanitizer.*  compute-sanitizer memcheck and racecheck of a short step test
# Goals are figures to report, not thresholds: an item FAILs only when it could not be
# produced or a test failed. Each item has its own time limit, and no item starts after
# --budget seconds (default 420); those left are reported as SKIPPED. The exit status is 0
# when nothing FAILed, 1 otherwise.
#
# --dry-run does the same on the fake device (tests/fake_cuda: the real host code of cuda/
# against a CUDA/NCCL test double) with small sizes, reporting "dry run" in place of every
# timing: the fake twins of the programs, built in --build (default build-gpu-dry: configured
# and built here, outside the time budget; --no-build: use what that build dir has, as the
# ctest test gpu_kit.dry_run does). It also prepares and verifies the kit and, where nvcc is found, configures the GPU
# build against it, so that neither the command nor the kit can rot.
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

dry=0
out="${OUT:-$root/gpu-check-out}"
build=""
no_build=0
budget=420
jobs="$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)"
kit="$root/.gpu-kit"
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --out) out="$2"; shift ;;
    --build) build="$2"; shift ;;
    --no-build) no_build=1 ;;
    --budget) budget="$2"; shift ;;
    --jobs) jobs="$2"; shift ;;
    --kit) kit="$2"; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "gpu_check: unknown argument $1 (--help)" >&2; exit 2 ;;
  esac
  shift
done
if [ -z "$build" ]; then
  if [ $dry = 1 ]; then build="$root/build-gpu-dry"; else build="$root/build-gpu"; fi
fi
build="$(mkdir -p "$build" && cd "$build" && pwd)"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
log="$out/gpu_check.log"
csv="$out/report.csv"
md="$out/report.md"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
: > "$log"
exec > >(tee -a "$log") 2>&1

start=$(date +%s)
deadline=$((start + budget))     # no item starts after this
hard_end=$((deadline + 45))      # every item's limit ends by this

# ---- the report ---------------------------------------------------------------------------------

items=() results=() commands=()
fails=0
csv_field() { local s=${1//\"/\"\"}; printf '"%s"' "$s"; }
record() {  # record ITEM RESULT COMMAND
  items+=("$1") results+=("$2") commands+=("$3")
  case "$2" in FAIL*) fails=$((fails + 1)) ;; esac
  printf '%s,%s,%s\n' "$(csv_field "$1")" "$(csv_field "$2")" "$(csv_field "$3")" >> "$csv"
  printf 'gpu_check: %-48s %s\n' "$1" "$2"
}
printf 'item,result,command\n' > "$csv"

# The command as the report shows it: paths relative to the repository.
show() {
  local s="$*"
  s=${s//"$root/"/}
  echo "$s"
}

# can_start ITEM...: false (and the items recorded as SKIPPED) once the budget is spent.
can_start() {
  [ "$(date +%s)" -lt "$deadline" ] && return 0
  local i
  for i in "$@"; do record "$i" "SKIPPED: time budget of ${budget} s spent" ""; done
  return 1
}
# limit SECONDS: the item's time limit, cut so that it ends by hard_end.
limit() {
  local left=$((hard_end - $(date +%s)))
  [ "$left" -lt 10 ] && left=10
  [ "$1" -lt "$left" ] && echo "$1" || echo "$left"
}
# run_to FILE SECONDS CMD...: runs CMD with a time limit, its output in FILE and the log.
run_to() {
  local file=$1 secs=$2
  shift 2
  echo "gpu_check: \$ $(show "$@")   (limit ${secs} s)"
  timeout -k 10 "$secs" "$@" > "$file" 2>&1
  local rc=$?
  cat "$file"
  [ $rc = 124 ] || [ $rc = 137 ] && echo "gpu_check: timed out after ${secs} s"
  return $rc
}
is_number() { [[ "$1" =~ ^-?[0-9]+([.][0-9]+)?([eE][-+]?[0-9]+)?$ ]]; }
# figure VALUE: the value, or "dry run" in a dry run (after checking it is a number).
figure() {
  if ! is_number "$1"; then echo "FAIL: output not understood (got '$1')"; return; fi
  if [ $dry = 1 ]; then echo "dry run"; else echo "$1"; fi
}

# ---- what runs where ----------------------------------------------------------------------------

if [ $dry = 1 ]; then
  tests_dir="$build/tests/fake_cuda"
  bin_backend="$tests_dir/test_fake_cuda_backend"
  bin_single="$tests_dir/test_fake_cuda_optimizer_single"
  bin_nccl="$tests_dir/test_fake_cuda_optimizer_nccl"
  bin_comm="$tests_dir/test_fake_cuda_nccl_comm"
  bin_adam="$tests_dir/bench_fake_cuda_adam"
  bin_step="$tests_dir/bench_fake_cuda_step"
  adam_shift=12          # 2^12, 2^14, 2^16 elements on the fake device
  step_args=(--params 64Ki --tensor-elems 4Ki --steps 1)
  reps=2
else
  bin_backend="$build/tests/gpu/test_cuda_backend"
  bin_single="$build/tests/gpu/test_cuda_optimizer_single"
  bin_nccl="$build/tests/gpu/test_cuda_optimizer_nccl"
  bin_comm="$build/tests/gpu/test_cuda_nccl_comm"
  bin_adam="$build/benchmarks/bench_cuda_adam"
  bin_step="$build/benchmarks/bench_cuda_step"
  adam_shift=0
  step_args=(--params 1Gi --tensor-elems 16Mi --steps 5)
  reps=20
fi
short_step_test="Stages/CudaStep.MatchesDoubleOracle/stage1_bf16"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
machine_ld_path="${LD_LIBRARY_PATH:-}"

echo "gpu_check: $( [ $dry = 1 ] && echo 'dry run on the fake device' || echo 'GPU check' ), build $(show "$build"), out $out, budget ${budget} s"

# ---- env: device, driver, CUDA, NCCL ------------------------------------------------------------

tool_item() {  # tool_item ITEM TOOL CMD...: the command's last line of output, or why not
  local item=$1 tool=$2 f="$work/tool.out"
  shift 2
  if ! command -v "$tool" >/dev/null 2>&1; then
    if [ $dry = 1 ]; then record "$item" "dry run: $tool not found here" "$(show "$@")"
    else record "$item" "FAIL: $tool not found" "$(show "$@")"; fi
    return
  fi
  if run_to "$f" 60 "$@" && [ -s "$f" ]; then
    record "$item" "$(grep -v '^\s*$' "$f" | tail -1 | tr -s ' ')" "$(show "$@")"
  else
    record "$item" "FAIL: $(tail -1 "$f")" "$(show "$@")"
  fi
}
nvcc_bin="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
[ -x "$nvcc_bin" ] && export PATH="$(dirname "$nvcc_bin"):$PATH"
if [ $dry = 1 ]; then
  record env.device "fake device (tests/fake_cuda): no GPU in a dry run" ""
fi
tool_item env.gpu nvidia-smi nvidia-smi --query-gpu=name,memory.total,compute_cap --format=csv,noheader
tool_item env.driver nvidia-smi nvidia-smi --query-gpu=driver_version --format=csv,noheader
tool_item env.cuda_driver_api nvidia-smi sh -c "nvidia-smi | grep -o 'CUDA Version: [0-9.]*'"
tool_item env.nvcc nvcc sh -c "nvcc --version | grep release"
tool_item env.cmake cmake sh -c "cmake --version | head -1"
record env.cpus "$(getconf _NPROCESSORS_ONLN) cores, build with -j $jobs" "getconf _NPROCESSORS_ONLN"
if [ $dry = 1 ]; then
  record env.torch "dry run: not imported" ""
else
  tool_item env.torch python3 python3 -c "import torch; v = torch.cuda.nccl.version(); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', '.'.join(map(str, v)) if isinstance(v, tuple) else v)"
fi

# find_nccl: "INCLUDE_DIR LIBRARY" of the NCCL to build against: the pip package in python3's
# environment (nvidia-nccl-*, what PyTorch loads; its header, else the kit's), else the CUDA
# toolkit's or the system's.
find_nccl() {
  local d lib inc
  for d in $(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null); do
    lib="$(find "$d" -maxdepth 5 -path '*nvidia*' -name 'libnccl.so*' 2>/dev/null | sort | head -1)"
    [ -n "$lib" ] || continue
    inc="$(dirname "$(dirname "$lib")")/include"
    [ -f "$inc/nccl.h" ] || inc="$kit/nccl/include"
    [ -f "$inc/nccl.h" ] && { echo "$inc $lib"; return; }
  done
  for d in "${CUDA_HOME:-/usr/local/cuda}" /usr; do
    lib="$(ls "$d"/lib64/libnccl.so* "$d"/lib/libnccl.so* "$d"/lib/*-linux-gnu/libnccl.so* 2>/dev/null | head -1)"
    if [ -n "$lib" ] && [ -f "$d/include/nccl.h" ]; then echo "$d/include $lib"; return; fi
  done
}
nccl_version_of() {  # header version of nccl.h in $1
  grep -E '^#define NCCL_(MAJOR|MINOR|PATCH) ' "$1/nccl.h" | awk '{printf "%s%s", sep, $3; sep="."}'
}
read -r nccl_inc nccl_lib <<< "$(find_nccl)"
if [ -n "${nccl_lib:-}" ]; then
  pipver=""
  case "$nccl_lib" in
    */site-packages/*) pipver="$(python3 -m pip list 2>/dev/null | awk '$1 ~ /^nvidia-nccl/ {print $1, $2; exit}')" ;;
  esac
  record env.nccl_library "$(show "$nccl_lib") (header $(show "$nccl_inc") $(nccl_version_of "$nccl_inc")${pipver:+; pip package $pipver})" "find_nccl in scripts/gpu_check.sh"
else
  record env.nccl_library "FAIL: no NCCL (pip package nvidia-nccl or CUDA toolkit)" "find_nccl in scripts/gpu_check.sh"
fi

# ---- kit and build ------------------------------------------------------------------------------

prefix="${SHARDOPT_GPU_KIT_PREFIX:-/tmp/shardopt-gpu-kit}"
[ $dry = 1 ] && prefix="$build/gpu-kit-prefix"
gpu_cmake_args=(-DCMAKE_BUILD_TYPE=Release -DCMAKE_POLICY_VERSION_MINIMUM=3.5 -DSHARDOPT_CUDA=ON -DSHARDOPT_NCCL=ON -DSHARDOPT_MPI=ON
  -DSHARDOPT_BUILD_EXAMPLES=OFF -DSHARDOPT_FORTRAN=OFF -DSHARDOPT_TORCH=OFF -DSHARDOPT_INSTALL=OFF
  "-DCMAKE_PREFIX_PATH=$prefix" "-DMPI_C_COMPILER=$prefix/bin/mpicc"
  "-DMPI_CXX_COMPILER=$prefix/bin/mpicxx" "-DSHARDOPT_NCCL_INCLUDE_DIR=${nccl_inc:-}"
  "-DSHARDOPT_NCCL_LIBRARY=${nccl_lib:-}")
command -v ninja >/dev/null 2>&1 && gpu_cmake_args=(-G Ninja "${gpu_cmake_args[@]}")
gpu_targets=(test_cuda_backend test_cuda_optimizer_single test_cuda_optimizer_nccl
             test_cuda_nccl_comm bench_cuda_adam bench_cuda_step)
fake_targets=(test_fake_cuda_backend test_fake_cuda_optimizer_single test_fake_cuda_optimizer_nccl
              test_fake_cuda_nccl_comm bench_fake_cuda_adam bench_fake_cuda_step)

# install_kit: the carried kit installed into $prefix (GoogleTest built there).
install_kit() {
  local f="$work/kit.out" t0
  t0=$(date +%s)
  if [ -f "$prefix/.installed" ]; then
    record build.kit "PASS (already installed in $prefix)" ""
  elif run_to "$f" "$(limit 180)" bash scripts/gpu_kit.sh install "$kit" "$prefix" "$jobs"; then
    touch "$prefix/.installed"
    record build.kit "PASS ($(( $(date +%s) - t0 )) s)" "bash scripts/gpu_kit.sh install $(show "$kit") $prefix $jobs"
  else
    record build.kit "FAIL: $(tail -1 "$f")" "bash scripts/gpu_kit.sh install $(show "$kit") $prefix $jobs"
    return 1
  fi
}
# configure_gpu DIR: the GPU build's configuration (against the kit and the NCCL found).
configure_gpu() {
  local dir=$1 f="$work/configure.out" arch t0
  arch="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')"
  t0=$(date +%s)
  if run_to "$f" "$(limit 240)" cmake -S "$root" -B "$dir" "${gpu_cmake_args[@]}" \
       "-DCMAKE_CUDA_ARCHITECTURES=${arch:-90}"; then
    if grep -q "NCCL=ON" "$f"; then
      record build.configure "PASS ($(( $(date +%s) - t0 )) s; sm_${arch:-90}; $(grep -o 'MPI=[A-Z]* CUDA=[A-Z]* NCCL=[A-Z]*' "$f"))" \
        "cmake -S . -B $(show "$dir") ${gpu_cmake_args[*]} -DCMAKE_CUDA_ARCHITECTURES=${arch:-90}"
      return 0
    fi
    record build.configure "FAIL: configured without NCCL: $(grep -o 'MPI=.*c10d=[A-Z]*' "$f")" "cmake -S . -B $(show "$dir") ..."
  else
    record build.configure "FAIL: $(grep -m1 -A2 'CMake Error' "$f" | tr '\n' ' ' | cut -c1-300)" \
      "cmake -S . -B $(show "$dir") ${gpu_cmake_args[*]}"
  fi
  return 1
}
build_targets() {  # build_targets DIR TARGET...
  local dir=$1 f="$work/build.out" t0
  shift
  t0=$(date +%s)
  if run_to "$f" "$(limit "$build_limit")" cmake --build "$dir" -j "$jobs" --target "$@"; then
    record build.targets "PASS ($(( $(date +%s) - t0 )) s: $*)" "cmake --build $(show "$dir") -j $jobs --target $*"
  else
    record build.targets "FAIL: $(grep -m1 -E 'error|Error' "$f" | cut -c1-300)" "cmake --build $(show "$dir") -j $jobs --target $*"
    return 1
  fi
}

built=1
build_limit=$budget
if [ $dry = 0 ]; then
  # An MPI singleton needs the kit's MPICH (and the libraries it loads) on the library path;
  # python3 keeps the machine's own (torch_cmd).
  export LD_LIBRARY_PATH="$prefix/lib${machine_ld_path:+:$machine_ld_path}"
  install_kit && configure_gpu "$build" && build_targets "$build" "${gpu_targets[@]}" || built=0
else
  # The kit: prepared and verified here; where nvcc is found, installed and the GPU build
  # configured against it (a build dir of its own; nothing is compiled but GoogleTest).
  f="$work/kit.out"
  kit="$build/gpu-kit"
  if run_to "$f" 120 bash scripts/gpu_kit.sh prepare "$kit" && run_to "$f" 60 bash scripts/gpu_kit.sh verify "$kit"; then
    record build.kit_prepare "PASS ($(tail -1 "$f" | sed 's/^gpu_kit: //'))" "bash scripts/gpu_kit.sh prepare; bash scripts/gpu_kit.sh verify"
    if [ -x "$nvcc_bin" ] && [ -n "${nccl_lib:-}" ]; then
      install_kit && configure_gpu "$build/gpu-configure" || true
    else
      record build.configure "SKIPPED: no nvcc or NCCL here to configure the GPU build against the kit" ""
    fi
  else
    record build.kit_prepare "FAIL: $(tail -1 "$f")" "bash scripts/gpu_kit.sh prepare; bash scripts/gpu_kit.sh verify"
  fi
  if [ $no_build = 1 ]; then
    missing=()
    for b in "$bin_backend" "$bin_single" "$bin_nccl" "$bin_comm" "$bin_adam" "$bin_step"; do
      [ -x "$b" ] || missing+=("$(show "$b")")
    done
    if [ ${#missing[@]} = 0 ]; then record build.targets "PASS (built by the build dir's own build)" ""
    else record build.targets "FAIL: not built: ${missing[*]}" ""; built=0; fi
  else
    # Building the fake targets is this machine's preparation, not part of the check: it gets
    # an hour, and the budget starts again after it.
    build_limit=3600
    hard_end=$(( $(date +%s) + build_limit + 600 ))
    f="$work/configure.out"
    gen=()
    command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
    if run_to "$f" 600 cmake -S "$root" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DSHARDOPT_CUDA=OFF \
         -DSHARDOPT_BUILD_EXAMPLES=OFF -DSHARDOPT_FORTRAN=OFF -DSHARDOPT_TORCH=OFF; then
      record build.configure_fake "PASS" "cmake -S . -B $(show "$build") -DSHARDOPT_CUDA=OFF ..."
      build_targets "$build" "${fake_targets[@]}" || built=0
    else
      record build.configure_fake "FAIL: $(grep -m1 -A2 'CMake Error' "$f" | tr '\n' ' ' | cut -c1-300)" "cmake -S . -B $(show "$build")"
      built=0
    fi
    deadline=$(( $(date +%s) + budget ))
    hard_end=$((deadline + 45))
  fi
fi

# ---- GPU tests ----------------------------------------------------------------------------------

# gtest_results FILE: "name<TAB>PASS|FAIL|SKIPPED<TAB>detail" per test GoogleTest ran.
gtest_results() {
  awk '
    function flush(status) { gsub(/\t/, " ", msg); print cur "\t" status "\t" substr(msg, 1, 300); cur = ""; msg = "" }
    /^\[ RUN      \] / { cur = $4; msg = ""; next }
    /^\[       OK \] / && cur != "" { flush("PASS"); next }
    /^\[  FAILED  \] / && cur != "" { flush("FAIL"); next }
    /^\[  SKIPPED \] / && cur != "" { flush("SKIPPED"); next }
    cur != "" && NF > 0 && !/^\[/ { msg = msg (msg == "" ? "" : " / ") $0 }
    END { if (cur != "") { msg = "no result: the program ended during this test"; flush("FAIL") } }
  ' "$1"
}
declare -A test_status
# gtest_item NAME SECONDS CMD...: one item per test, test.NAME.<test>.
gtest_item() {
  local name=$1 secs=$2 f="$work/$1.out" rc n=0 t status detail
  shift 2
  can_start "test.$name" || return
  run_to "$f" "$(limit "$secs")" "$@"
  rc=$?
  while IFS=$'\t' read -r t status detail; do
    n=$((n + 1))
    # The same test in several programs: FAIL wins over PASS, PASS over SKIPPED.
    case "${test_status[$t]:-}:$status" in
      FAIL:*|PASS:SKIPPED) ;;
      *) test_status[$t]=$status ;;
    esac
    case $status in
      PASS) record "test.$name.$t" PASS "$(show "$@")" ;;
      *) record "test.$name.$t" "$status${detail:+: $detail}" "$(show "$@")" ;;
    esac
  done < <(gtest_results "$f")
  if [ $n = 0 ] || { [ $rc != 0 ] && ! grep -q '^\[  FAILED  \]' "$f"; }; then
    record "test.$name" "FAIL: exit status $rc$( [ $rc = 124 ] && echo ' (time limit)') after $n tests: $(tail -1 "$f" | cut -c1-200)" "$(show "$@")"
  fi
}

gtest=(--gtest_color=no)
if [ $built = 1 ]; then
  gtest_item test_cuda_backend 300 "$bin_backend" "${gtest[@]}"
  gtest_item test_cuda_optimizer_single 300 "$bin_single" "${gtest[@]}"
  # MPI programs run as singletons (one rank, no mpiexec).
  gtest_item test_cuda_optimizer_nccl.np1 300 "$bin_nccl" "${gtest[@]}"
  gtest_item test_cuda_nccl_comm.np1 180 "$bin_comm" "${gtest[@]}"
  nccl_runtime="$(grep -o 'NCCL communicator: nccl [0-9.]*' "$work/test_cuda_nccl_comm.np1.out" 2>/dev/null | head -1)"
  nccl_runtime="${nccl_runtime#NCCL communicator: }"
  if [ -z "$nccl_runtime" ]; then r="FAIL: not reported by test_cuda_nccl_comm"
  elif [ $dry = 1 ]; then r="dry run: the fake NCCL, reporting itself as $nccl_runtime"
  else r="$nccl_runtime (ncclGetVersion)"; fi
  record env.nccl_runtime "$r" "$(show "$bin_comm") (NcclComm.ReduceScatterAllGatherAllReduce)"
else
  for n in test_cuda_backend test_cuda_optimizer_single test_cuda_optimizer_nccl.np1 test_cuda_nccl_comm.np1; do
    record "test.$n" "FAIL: not built (build.* above)" ""
  done
fi

# bitwise: the tests that compare the GPU with the CPU backend bit for bit.
bitwise_item() {  # bitwise_item ITEM WHAT TEST...
  local item=$1 what=$2 t verdict="PASS" missing=""
  shift 2
  for t in "$@"; do
    case "${test_status[$t]:-none}" in
      PASS) ;;
      none) verdict="FAIL"; missing+=" $t (did not run)" ;;
      *) verdict="FAIL"; missing+=" $t (${test_status[$t]})" ;;
    esac
  done
  record "$item" "$verdict${missing:+:$missing}" "$what: $*"
}
bitwise_item bitwise.fused_update "master, m, v and the bf16 copy of the fused update (AdamW, Adam-L2, aligned and not), both kernels" \
  CudaBackend.FusedUpdateMatchesCpuBitwise CudaBackend.GridStrideKernelMatchesThrustTwin
bitwise_item bitwise.casts "bf16 casts and fp32/bf16 accumulation" CudaBackend.CastsAndAccumulateMatchCpuBitwise
bitwise_item bitwise.adamw8bit "master, replica (bf16, fp32, none), codes and scales of AdamW8bit's block kernel (AdamW, Adam-L2, 1 to 4099 blocks, three segments)" \
  CudaBackend.AdamW8bitMatchesCpuBitwise
bitwise_item bitwise.optimizer "master, m, v and replica after 3 steps, stages 0-3, bf16 and fp32 replicas, group 1 under AdamW, Lion and AdamW8bit, CUDA optimizer vs CPU optimizer (one process; and AdamW8bit over NCCL vs MPI at one rank)" \
  CudaStepSingle.MatchesCpuOptimizerBitwise CudaStepWorld.MatchesCpuOptimizerBitwise
bitwise_item bitwise.zero3 "stage 3 on the device vs stage 2: gathered units, master, m, v (AdamW and AdamW8bit)" CudaZero3.MatchesZero2Bitwise
bitwise_item bitwise.whole "Ownership::Whole (ragged buckets, the uneven collectives) on the device vs the CPU's Whole (master, m, v) and Flat (every replica) after 3 steps, stages 0-2, AdamW (bf16 and fp32 replicas), Lion (bf16) and AdamW8bit (fp32) (one process, and NCCL vs MPI at one rank)" \
  CudaWhole.MatchesCpuWholeAndFlatBitwise
bitwise_item bitwise.uneven_collectives "NCCL's uneven reduce-scatter and all-gather (grouped ncclReduce / ncclBroadcast per owner; empty and single owners; fp32 and bf16)" \
  NcclComm.UnevenReduceScatterAndAllGather
bitwise_item bitwise.adafactor "Adafactor on the device (fixed-order fp64 statistics) vs the CPU: master, row_var and col_var or the variance, replica (bf16, fp32) after six steps, factored and unfactored shapes, update clipping, weight decay, maximize; in the optimizer (Whole, stages 0-2) next to AdamW with gradient clipping and a skipped step" \
  CudaBackend.AdafactorMatchesCpuBitwise CudaBackend.AdafactorRefusesBadArguments CudaAdafactor.MatchesCpuOptimizerBitwise
bitwise_item bitwise.reproducible "Reduction::Reproducible on the device: its passes (deposit, levels, rounding to levels, lift, rounding to fp32, exact squares) and the exchanges' kernels (direct combine of 1, 3, 8 ranks, packed state, packed combine) vs the CPU backend's on every level's edges, Inf and NaN; the exchange (ncclSend/ncclRecv groups in chunks: every rank's block, once, in rank order); the optimizer (the direct and packed exchanges, and the two-phase method with the exchanges refused: uint8 level maxima and int64 sums; deposits of several micro-batches, the norm's exact squares, the method's wire bytes) vs the CPU's Reproducible optimizer: master, m, v, every replica and the norm, stages 0-2, bf16 and fp32 replicas, 1 and 3 micro-batches, clipping, a NaN step skipped (one process, and NCCL vs MPI at one rank); stage 3 and Whole refused" \
  CudaBackend.ExactPassesMatchCpuBitwise CudaBackend.ExactExchangeKernelsMatchCpuBitwise NcclComm.ReduceScatterCombineDeliversEveryRanksBlock \
  CudaReproducible.MatchesCpuReproducibleBitwise CudaReproducible.RefusesStage3AndWhole
# Muon: cuBLAS's fp32 GEMMs sum in an order of their own, so these compare to a tolerance
# (the momentum and the AdamW parameters bit for bit); GPU-model and cuBLAS specific.
bitwise_item muon.cublas "Muon on the device (cuBLAS Newton-Schulz) vs the CPU: one step's O within 4e-6 relative Frobenius of the float64 model's and 8e-6 of the CPU's, ten steps' moves within 1e-4, momentum bit for bit; in the optimizer (Whole, stages 0-2) next to AdamW" \
  CudaBackend.MuonMatchesCpuToRounding CudaBackend.MuonRefusesBadArguments CudaMuon.MatchesCpuOptimizerToRounding

# ---- fused AdamW bandwidth, and PyTorch's AdamW ---------------------------------------------------

declare -A ours_ms
adam_sizes=(24 26 28)
for k in "${adam_sizes[@]}"; do
  n=$((1 << (k - adam_shift)))
  cmd=("$bin_adam" "$n" "$reps" --csv)
  can_start "adamw.2^$k" || continue
  f="$work/adam$k.out"
  if [ $built = 1 ] && run_to "$f" "$(limit 120)" "${cmd[@]}" && grep -q '^adamw_thrust,' "$f"; then
    IFS=, read -r _ _ cms cgbs _ < <(grep '^copy,' "$f")
    IFS=, read -r _ _ tms tgbs tfrac < <(grep '^adamw_thrust,' "$f")
    IFS=, read -r _ _ _ _ gfrac < <(grep '^adamw_grid_stride,' "$f")
    IFS=, read -r _ _ nms _ nfrac < <(grep '^norm,' "$f")
    IFS=, read -r _ _ ams _ afrac < <(grep '^adamw8bit,' "$f")
    ours_ms[$k]=$tms
    record "adamw.2^$k.copy_GBps" "$(figure "$cgbs")" "$(show "${cmd[@]}")"
    record "adamw.2^$k.fused_ms" "$(figure "$tms")" "$(show "${cmd[@]}")"
    record "adamw.2^$k.fused_GBps" "$(figure "$tgbs")" "$(show "${cmd[@]}")"
    record "adamw.2^$k.fused_of_copy" "$(figure "$tfrac")" "$(show "${cmd[@]}")"
    record "adamw.2^$k.grid_stride_of_copy" "$(figure "$gfrac")" "$(show "${cmd[@]}")"
    record "adamw.2^$k.norm_of_copy" "$(figure "$nfrac")" "$(show "${cmd[@]}")"
    record "adamw.2^$k.adamw8bit_ms" "$(figure "$ams")" "$(show "${cmd[@]}")"
    record "adamw.2^$k.adamw8bit_of_copy" "$(figure "$afrac")" "$(show "${cmd[@]}")"
    # Its time over the fused fp32 AdamW's (the CPU kernel's goal: at most 1.25x).
    record "adamw.2^$k.adamw8bit_time_vs_fused" \
      "$(figure "$(awk -v a="$ams" -v b="$tms" 'BEGIN { if (a != "" && b > 0) printf "%.3f", a / b }')")" \
      "adamw.2^$k.adamw8bit_ms / adamw.2^$k.fused_ms"
  else
    record "adamw.2^$k" "FAIL: $( [ $built = 1 ] && tail -1 "$f" | cut -c1-200 || echo 'not built')" "$(show "${cmd[@]}")"
  fi
done

torch_cmd=(python3 benchmarks/torch_adamw.py --sizes "$(IFS=,; echo "${adam_sizes[*]}")" --reps "$reps")
if [ $dry = 1 ]; then torch_cmd+=(--dry-run); else torch_cmd=(env "LD_LIBRARY_PATH=$machine_ld_path" "${torch_cmd[@]}"); fi
if can_start torch; then
  f="$work/torch.out"
  if run_to "$f" "$(limit 180)" "${torch_cmd[@]}"; then
    for k in "${adam_sizes[@]}"; do
      for impl in fused foreach; do
        row="$(grep "^$impl,$((1 << k))," "$f")"
        ms="$(echo "$row" | cut -d, -f3)"
        if [ -z "$row" ]; then record "torch.2^$k.${impl}_ms" "FAIL: no row in the output" "$(show "${torch_cmd[@]}")"; continue; fi
        if [ $dry = 1 ]; then
          [ "$ms" = "dry run" ] && r="dry run" || r="FAIL: output not understood ($row)"
          record "torch.2^$k.${impl}_ms" "$r" "$(show "${torch_cmd[@]}")"
          record "adamw.2^$k.speedup_vs_torch_$impl" "$r" "torch.2^$k.${impl}_ms / adamw.2^$k.fused_ms"
          continue
        fi
        record "torch.2^$k.${impl}_ms" "$(figure "$ms")" "$(show "${torch_cmd[@]}")"
        if [ -n "${ours_ms[$k]:-}" ] && is_number "$ms"; then
          record "adamw.2^$k.speedup_vs_torch_$impl" "$(awk -v a="$ms" -v b="${ours_ms[$k]}" 'BEGIN {printf "%.3f", a / b}')" \
            "torch.2^$k.${impl}_ms / adamw.2^$k.fused_ms"
        fi
      done
    done
  else
    record torch "FAIL: $(tail -1 "$f" | cut -c1-200)" "$(show "${torch_cmd[@]}")"
  fi
fi

# ---- the optimizer step on one GPU --------------------------------------------------------------

step_cmd=("$bin_step" "${step_args[@]}" --stages 1,2,3 --csv)
if can_start step; then
  f="$work/step.out"
  if [ $built = 1 ] && run_to "$f" "$(limit 240)" "${step_cmd[@]}" && grep -q '^zero-1,' "$f"; then
    reduced="$(grep '^# model' "$f" | sed 's/^# model //')"
    IFS=, read -r _ params tensor _ < <(grep '^zero-1,' "$f")
    record step.model "$params parameters in tensors of $tensor, bf16 replica, fp32 master${reduced:+ ($reduced)}" "$(show "${step_cmd[@]}")"
    for stage in zero-1 zero-2 zero-3; do
      sms=""
      IFS=, read -r _ _ _ buckets sms rms nms ums hms bms kms cms ratio < <(grep "^$stage," "$f")
      if [ -z "$sms" ]; then record "step.$stage" "FAIL: no row in the output" "$(show "${step_cmd[@]}")"; continue; fi
      record "step.$stage.buckets" "$buckets" "$(show "${step_cmd[@]}")"
      for pair in "step_ms:$sms" "reduce_ms:$rms" "norm_ms:$nms" "update_and_clear_ms:$ums" \
                  "host_step_ms:$hms" "backward_ms:$bms" "step_over_kernel:$ratio"; do
        record "step.$stage.${pair%%:*}" "$(figure "${pair#*:}")" "$(show "${step_cmd[@]}")"
      done
    done
    record step.fused_kernel_alone_ms "$(figure "$kms")" "$(show "${step_cmd[@]}")"
    record step.clear_gradients_alone_ms "$(figure "$cms")" "$(show "${step_cmd[@]}")"
  else
    record step "FAIL: $( [ $built = 1 ] && tail -1 "$f" | cut -c1-200 || echo 'not built')" "$(show "${step_cmd[@]}")"
  fi
fi

# ---- compute-sanitizer --------------------------------------------------------------------------

sanitizer="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
for tool in memcheck racecheck; do
  can_start "sanitizer.$tool" || continue
  f="$work/$tool.out"
  if [ $dry = 1 ]; then
    cmd=("$bin_single" "${gtest[@]}" "--gtest_filter=$short_step_test")
  else
    cmd=("$sanitizer" --tool "$tool" --error-exitcode 99 "$bin_single" "${gtest[@]}" "--gtest_filter=$short_step_test")
  fi
  if [ $built = 0 ]; then record "sanitizer.$tool" "FAIL: not built" "$(show "${cmd[@]}")"; continue; fi
  if [ $dry = 0 ] && [ ! -x "$sanitizer" ]; then
    record "sanitizer.$tool" "FAIL: compute-sanitizer not found (PATH, /usr/local/cuda/bin)" "$(show "${cmd[@]}")"
    continue
  fi
  run_to "$f" "$(limit 240)" "${cmd[@]}"
  rc=$?
  if [ $rc = 0 ] && grep -q '^\[  PASSED  \] 1 test' "$f"; then
    if [ $dry = 1 ]; then record "sanitizer.$tool" "dry run: the test ran without compute-sanitizer (PASS)" "$(show "${cmd[@]}")"
    else record "sanitizer.$tool" "PASS ($(grep -m1 -o 'ERROR SUMMARY: .*' "$f" || echo 'no summary'))" "$(show "${cmd[@]}")"; fi
  else
    record "sanitizer.$tool" "FAIL: exit status $rc: $(grep -m1 -E 'ERROR SUMMARY|=========.*(Invalid|Race|Error)|FAILED|PASSED' "$f" | cut -c1-200)" "$(show "${cmd[@]}")"
  fi
done

# ---- the report ---------------------------------------------------------------------------------

wall=$(( $(date +%s) - start ))
record check.wall_time_s "$wall" "scripts/gpu_check.sh$( [ $dry = 1 ] && echo ' --dry-run')"
pass=0 skipped=0
for r in "${results[@]}"; do
  case "$r" in PASS*) pass=$((pass + 1)) ;; SKIPPED*) skipped=$((skipped + 1)) ;; esac
done
md_cell() { local s=${1//|/\\|}; echo "${s//$'\n'/ }"; }
{
  echo "# GPU check report"
  echo
  if [ $dry = 1 ]; then
    echo "**Dry run on the fake device** (tests/fake_cuda): every step of the GPU check with small"
    echo "sizes; timings read \"dry run\". No figure here is a GPU measurement."
  else
    device="$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)"
    echo "Device: ${device:-unknown (nvidia-smi answered nothing)}."
  fi
  echo
  echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ); commit $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')$(git -C "$root" diff --quiet HEAD 2>/dev/null || echo ' (with local changes)')"
  echo "- wall time: ${wall} s (budget ${budget} s for starting items); $pass PASS, $fails FAIL, $skipped SKIPPED"
  echo "- command: \`scripts/gpu_check.sh$( [ $dry = 1 ] && echo ' --dry-run')\`; the same rows are in report.csv"
  echo
  echo "| item | result | command |"
  echo "|---|---|---|"
  for i in "${!items[@]}"; do
    echo "| $(md_cell "${items[$i]}") | $(md_cell "${results[$i]}") | $( [ -n "${commands[$i]}" ] && echo "\`$(md_cell "${commands[$i]}")\`") |"
  done
} > "$md"
echo "gpu_check: wall time ${wall} s; $pass PASS, $fails FAIL, $skipped SKIPPED; report in $md and $csv"
[ $fails = 0 ]
