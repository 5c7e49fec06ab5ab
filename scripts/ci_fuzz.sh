#!/usr/bin/env bash
# ci_fuzz.sh: fuzzes the checkpoint reader (metadata and shard-header parsers) with
# libFuzzer + AddressSanitizer + UndefinedBehaviorSanitizer for a bounded time.
#
#   scripts/ci_fuzz.sh [SECONDS]        (default 60; build dir: $SHARDOPT_FUZZ_BUILD_DIR or build-fuzz)
#
# Installs clang and the libFuzzer runtime from Debian's packages when missing (apt-get; sudo
# only when not root). Seeds come from real checkpoints (fuzz_make_corpus). Any crash, UB,
# leak, timeout, or single allocation over 64 MiB fails the run (exit status != 0); the input
# that caused it is left in the build dir as fuzz-artifacts/crash-* etc.
set -euo pipefail

seconds="${1:-60}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${SHARDOPT_FUZZ_BUILD_DIR:-$root/build-fuzz}"
jobs="$(nproc 2>/dev/null || echo 2)"

have_libfuzzer() {
  command -v clang++ >/dev/null 2>&1 || return 1
  local probe
  probe="$(mktemp -d)"
  echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' \
    > "$probe/probe.cpp"
  clang++ -fsanitize=fuzzer,address,undefined "$probe/probe.cpp" -o "$probe/probe" >/dev/null 2>&1
  local rc=$?
  rm -rf "$probe"
  return $rc
}

if ! have_libfuzzer; then
  echo "ci_fuzz: installing clang and libclang-rt-dev (libFuzzer runtime)"
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  $sudo apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang libclang-rt-dev
  have_libfuzzer || { echo "ci_fuzz: clang cannot link -fsanitize=fuzzer" >&2; exit 1; }
fi

cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_CXX_FLAGS="-fsanitize=address,undefined,fuzzer-no-link -fno-sanitize-recover=undefined -fno-omit-frame-pointer" \
  -DSHARDOPT_MPI=OFF -DSHARDOPT_CUDA=OFF -DSHARDOPT_NCCL=OFF -DSHARDOPT_FORTRAN=OFF -DSHARDOPT_TORCH=OFF \
  -DSHARDOPT_BUILD_TESTS=OFF -DSHARDOPT_BUILD_BENCHMARKS=OFF -DSHARDOPT_BUILD_EXAMPLES=OFF \
  -DSHARDOPT_BUILD_FUZZERS=ON >/dev/null
cmake --build "$build" -j "$jobs" --target fuzz_checkpoint_reader fuzz_make_corpus

seeds="$build/fuzz-seeds"
work="$build/fuzz-corpus"
artifacts="$build/fuzz-artifacts"
rm -rf "$seeds" && mkdir -p "$seeds" "$work" "$artifacts"
ASAN_OPTIONS=detect_leaks=0 "$build/tests/fuzz/fuzz_make_corpus" "$seeds"

export ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:allocator_may_return_null=0"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
echo "ci_fuzz: running fuzz_checkpoint_reader for ${seconds}s"
"$build/tests/fuzz/fuzz_checkpoint_reader" "$work" "$seeds" \
  -max_total_time="$seconds" -max_len=65536 -timeout=10 -rss_limit_mb=2048 \
  -malloc_limit_mb=64 -artifact_prefix="$artifacts/" -print_final_stats=1
echo "ci_fuzz: no crash in ${seconds}s"
