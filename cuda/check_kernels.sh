#!/usr/bin/env bash
# check_kernels.sh NVCC SOURCE_DIR ARCH [NVCC FLAGS...]: compiles cuda/device_algorithms.cu
# to PTX for compute_ARCH with the library's flags, assembles it with ptxas -v for sm_ARCH,
# and fails (exit 1, naming what) when
#   - any fma.rn.f32 / fma.rn.f64 is in the PTX: a contracted multiply-add rounds differently
#     from the CPU kernels (built with -ffp-contract=off), so the bitwise tests would fail;
#   - an update kernel (a kernel over AdamChunkOp) has a contractable mul/add/sub.f32 (no .rn):
#     ptxas may fuse those even when the PTX has no fma;
#   - the AdamW8bit kernel (over AdamW8bitOp) or the Adafactor kernel (over AdafactorOp) is
#     missing or has a contractable mul/add/sub of f32 or f64 (Adafactor's fp64 sums must round
#     as the CPU's) or an approximate operation (approx, rsqrt, div.full: the CPU's division
#     and square roots are correctly rounded); likewise reproducible mode's kernels (over
#     ExactOp, and the reduction over SquareToDigits);
#   - an update kernel lacks 128-bit global loads (4: master, grad, m, v) or stores (3:
#     master, m, v) of fp32;
#   - ptxas reports spill stores or loads in any kernel.
# SASS is not inspected (this toolkit install has no cuobjdump/nvdisasm): ptxas keeps the
# .rn operations of the PTX unfused, so the PTX checks cover it.
set -euo pipefail
nvcc=$1 src=$2 arch=$3
shift 3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$nvcc" -ptx -arch="compute_$arch" -std=c++20 -O3 -I"$src/include" -I"$src/cuda" -I"$src/src" "$@" \
  "$src/cuda/device_algorithms.cu" -o "$tmp/k.ptx"
ptxas_fmad=--fmad=true
for f in "$@"; do [ "$f" = --fmad=false ] && ptxas_fmad=--fmad=false; done
"$(dirname "$nvcc")/ptxas" -arch="sm_$arch" -v "$ptxas_fmad" "$tmp/k.ptx" -o "$tmp/k.cubin" \
  > "$tmp/ptxas.log" 2>&1

status=0
fail() { echo "FAIL: $*"; status=1; }

fmas=$(grep -c -E 'fma\.rn\.f(32|64)' "$tmp/k.ptx" || true)
[ "$fmas" -eq 0 ] || fail "$fmas contracted multiply-adds (fma.rn.f32/f64) in the PTX"

# Per kernel: name, contractable fp32 arithmetic, v4 fp32 loads and stores, contractable fp64
# arithmetic, approximate operations.
awk '
  /^(\.visible |\.weak )*\.entry / { name = $0; sub(/\(.*/, "", name); sub(/.*\.entry /, "", name); body = 1 }
  body && /^\}/ { print name, loose + 0, loads + 0, stores + 0, loose64 + 0, approx + 0
                  body = 0; loose = loads = stores = loose64 = approx = 0 }
  body && /(mul|add|sub)\.f32/ { loose++ }
  body && /(mul|add|sub)\.f64/ { loose64++ }
  body && /(approx|rsqrt|div\.full)/ { approx++ }
  body && /ld\.global(\.nc)?\.v4\.f32/ { loads++ }
  body && /st\.global\.v4\.f32/ { stores++ }
' "$tmp/k.ptx" > "$tmp/kernels.txt"
updates=0
while read -r name loose loads stores _; do
  case "$name" in *AdamChunkOp*) ;; *) continue ;; esac
  updates=$((updates + 1))
  [ "$loose" -eq 0 ] || fail "$loose contractable mul/add/sub.f32 (no .rn) in update kernel $name"
  [ "$loads" -ge 4 ] || fail "update kernel $name has $loads 128-bit fp32 loads (want >= 4)"
  [ "$stores" -ge 3 ] || fail "update kernel $name has $stores 128-bit fp32 stores (want >= 3)"
  echo "update kernel $name: $loads ld.global.v4.f32, $stores st.global.v4.f32, $loose contractable fp32 ops"
done < "$tmp/kernels.txt"
# rule_kernels OP LABEL: the kernels over OP must exist and have no contractable fp32 or fp64
# arithmetic, and no approximate division, square root or reciprocal (the CPU's are IEEE's).
rule_kernels() {
  local op=$1 label=$2 found=0 name loose loads stores loose64 approx
  while read -r name loose loads stores loose64 approx; do
    case "$name" in *"$op"*) ;; *) continue ;; esac
    found=$((found + 1))
    [ "$loose" -eq 0 ] || fail "$loose contractable mul/add/sub.f32 (no .rn) in $label kernel $name"
    [ "$loose64" -eq 0 ] || fail "$loose64 contractable mul/add/sub.f64 (no .rn) in $label kernel $name"
    [ "$approx" -eq 0 ] || fail "$approx approximate operations (approx, rsqrt, div.full) in $label kernel $name"
    echo "$label kernel $name: $loose contractable fp32 ops, $loose64 contractable fp64 ops, $approx approximate ops"
  done < "$tmp/kernels.txt"
  [ "$found" -ge 1 ] || fail "found no $label kernel (over $op) in the PTX"
}
rule_kernels AdamW8bitOp AdamW8bit
rule_kernels AdafactorOp Adafactor
# Reproducible mode's exact passes and squares (exact_op.hpp): their fp64 products and sums are
# exact only as written (round_to_integer's shift, the split into bins).
rule_kernels ExactOp "reproducible exact pass"
rule_kernels SquareToDigits "exact squares"
[ "$updates" -ge 2 ] || fail "found $updates update kernels in the PTX (want the Thrust one and the grid-stride one)"

spills=$(grep -E '[1-9][0-9]* bytes spill (stores|loads)' "$tmp/ptxas.log" || true)
[ -z "$spills" ] || fail "register spills reported by ptxas: $spills"
echo "ptxas -v: $(grep -c 'Used [0-9]* registers' "$tmp/ptxas.log" || true) kernels assembled"
[ "$status" -eq 0 ] && echo "PASS: kernels of device_algorithms.cu for sm_$arch"
exit "$status"
