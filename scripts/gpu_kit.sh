#!/usr/bin/env bash
# gpu_kit.sh: what a bare GPU machine lacks for scripts/gpu_check.sh (it has nvcc, CMake, ninja,
# compute-sanitizer and python3 with PyTorch and NCCL, but no GoogleTest, no MPI, no CLI11, and
# no network), packed here from Debian's packages into one ignored folder that travels with
# the working tree (the device tool's `carry`).
#
#   scripts/gpu_kit.sh prepare [KIT]            on the developer machine (default KIT: .gpu-kit)
#   scripts/gpu_kit.sh verify [KIT]             here: the kit's MPICH runs a one-rank MPI program
#                                               with nothing but the kit on its library path
#   scripts/gpu_kit.sh install KIT PREFIX [JOBS] on the GPU machine (gpu_check.sh calls it)
#
# The kit (about 20 MB):
#   googletest/     Debian's GoogleTest sources (/usr/src/googletest), built there by `install`
#   cli11/          CLI11's headers and CMake package (header-only)
#   mpich.tar.gz    MPICH's headers, libmpich and libmpichcxx with the shared libraries they load
#                   (UCX, hwloc, numa, udev; not glibc or libstdc++), and relocatable mpicc and
#                   mpicxx wrappers: the NCCL communicator's bootstrap at one rank (an MPI
#                   singleton, no mpiexec)
#   nccl/include/   nccl.h of this machine's CUDA toolkit, used there only when the pip NCCL
#                   package has no header
#   MANIFEST        where each part came from, with versions
# Needs (scripts/setup.sh installs them): libgtest-dev, libmpich-dev, libcli11-dev.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
die() { echo "gpu_kit: $*" >&2; exit 1; }

multiarch="$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)"

prepare() {
  local kit="${1:-$root/.gpu-kit}"
  local gtest_src=/usr/src/googletest cli_inc=/usr/include/CLI cli_cmake=/usr/share/cmake/CLI11
  local mpi_inc="/usr/include/$multiarch/mpich" mpi_lib="/usr/lib/$multiarch"
  [ -f "$gtest_src/CMakeLists.txt" ] || die "no $gtest_src (Debian: libgtest-dev)"
  [ -f "$cli_inc/CLI.hpp" ] && [ -d "$cli_cmake" ] || die "no CLI11 (Debian: libcli11-dev)"
  [ -f "$mpi_inc/mpi.h" ] && [ -e "$mpi_lib/libmpich.so.12" ] || die "no MPICH (Debian: libmpich-dev)"
  rm -rf "$kit"
  mkdir -p "$kit"
  # GoogleTest: sources only (its docs and samples stay behind).
  mkdir -p "$kit/googletest"
  cp -a "$gtest_src/CMakeLists.txt" "$kit/googletest/"
  for d in googletest googlemock; do
    mkdir -p "$kit/googletest/$d"
    (cd "$gtest_src/$d" && cp -a CMakeLists.txt cmake include src "$kit/googletest/$d/")
  done
  # CLI11: an install prefix of its own (its package config finds the headers relative to it).
  mkdir -p "$kit/cli11/include" "$kit/cli11/share/cmake"
  cp -a "$cli_inc" "$kit/cli11/include/"
  cp -a "$cli_cmake" "$kit/cli11/share/cmake/"
  # MPICH: headers, the two libraries and every shared library they load but glibc's and
  # the C++ runtime's (the GPU machine has its own, newer ones).
  local stage
  stage="$(mktemp -d)"
  mkdir -p "$stage/include" "$stage/lib" "$stage/bin"
  cp -a "$mpi_inc"/*.h "$stage/include/"
  local libs=(libmpich.so.12 libmpichcxx.so.12) name path
  cp -L "$mpi_lib/libmpich.so.12" "$mpi_lib/libmpichcxx.so.12" "$stage/lib/"
  while read -r name path; do
    cp -L "$path" "$stage/lib/$name"
    libs+=("$name")
  done < <(ldd "$mpi_lib/libmpich.so.12" "$mpi_lib/libmpichcxx.so.12" |
             awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u |
             grep -vE '^(libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|ld-linux[^ ]*|libmpich|libmpichcxx)\.so')
  ln -s libmpich.so.12 "$stage/lib/libmpich.so"
  ln -s libmpichcxx.so.12 "$stage/lib/libmpichcxx.so"
  write_wrapper "$stage/bin/mpicc" cc "-lmpich"
  write_wrapper "$stage/bin/mpicxx" c++ "-lmpichcxx -lmpich"
  tar -C "$stage" -czf "$kit/mpich.tar.gz" include lib bin
  rm -rf "$stage"
  # nccl.h of this machine's CUDA toolkit, as a fallback.
  local nccl_h=""
  for c in /usr/local/cuda/include/nccl.h /usr/include/nccl.h; do [ -f "$c" ] && { nccl_h=$c; break; }; done
  if [ -n "$nccl_h" ]; then
    mkdir -p "$kit/nccl/include"
    cp "$nccl_h" "$kit/nccl/include/"
  fi
  {
    echo "gpu kit prepared $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(. /etc/os-release && echo "$PRETTY_NAME")"
    echo "googletest $(dpkg-query -W -f='${Version}' googletest 2>/dev/null || echo '?') from $gtest_src"
    echo "cli11 $(dpkg-query -W -f='${Version}' libcli11-dev 2>/dev/null || echo '?') from $cli_inc"
    echo "mpich $(dpkg-query -W -f='${Version}' libmpich-dev 2>/dev/null || echo '?'): ${libs[*]}"
    echo "nccl.h ${nccl_h:-none}$( [ -n "$nccl_h" ] && grep -E '^#define NCCL_(MAJOR|MINOR|PATCH) ' "$nccl_h" | awk '{printf " %s", $3}')"
  } > "$kit/MANIFEST"
  echo "gpu_kit: prepared $kit ($(du -sh "$kit" | cut -f1)); pass it to the device tool as carry: [\"${kit#"$root"/}\"]"
}

# write_wrapper PATH COMPILER LIBS: a relocatable MPICH compiler wrapper; `-show` prints the
# command as MPICH's wrappers do (CMake's FindMPI reads it); other queries fail.
write_wrapper() {
  cat > "$1" <<EOF
#!/bin/sh
# MPICH compiler wrapper of the GPU kit (scripts/gpu_kit.sh), relative to its own folder.
kit=\$(cd "\$(dirname "\$0")/.." && pwd)
case "\$1" in
  -show) echo "$2 -I\$kit/include -L\$kit/lib -Wl,-rpath,\$kit/lib $3"; exit 0 ;;
  -showme*|-compile*info|-link*info) exit 1 ;;
esac
exec $2 -I"\$kit/include" "\$@" -L"\$kit/lib" -Wl,-rpath,"\$kit/lib" $3
EOF
  chmod +x "$1"
}

# install KIT PREFIX [JOBS]: GoogleTest built and installed into PREFIX, MPICH unpacked into
# PREFIX, CLI11 copied there. Then CMAKE_PREFIX_PATH=PREFIX finds GTest and CLI11, and
# PREFIX/bin/mpicc and mpicxx are the MPI compilers.
install_kit() {
  local kit="$1" prefix="$2" jobs="${3:-$(nproc 2>/dev/null || echo 2)}"
  [ -f "$kit/MANIFEST" ] || die "no kit at $kit (run scripts/gpu_kit.sh prepare on the developer machine and carry it)"
  mkdir -p "$prefix"
  tar -C "$prefix" -xzf "$kit/mpich.tar.gz"
  cp -a "$kit/cli11/." "$prefix/"
  local gen=()
  command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
  cmake -S "$kit/googletest" -B "$prefix/gtest-build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_GMOCK=OFF -DINSTALL_GTEST=ON -DCMAKE_INSTALL_PREFIX="$prefix" \
    -DCMAKE_POLICY_VERSION_MINIMUM=3.5 >/dev/null
  cmake --build "$prefix/gtest-build" -j "$jobs" >/dev/null
  cmake --install "$prefix/gtest-build" >/dev/null
  echo "gpu_kit: installed $kit into $prefix"
}

verify() {
  local kit="${1:-$root/.gpu-kit}" work
  [ -f "$kit/MANIFEST" ] || die "no kit at $kit"
  work="$(mktemp -d)"
  tar -C "$work" -xzf "$kit/mpich.tar.gz"
  cat > "$work/hello.cpp" <<'EOF'
#include <mpi.h>
#include <cstdio>
int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = -1, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm dup;
  MPI_Comm_dup(MPI_COMM_WORLD, &dup);
  double x = 1.5;
  MPI_Allreduce(MPI_IN_PLACE, &x, 1, MPI_DOUBLE, MPI_SUM, dup);
  MPI_Comm_free(&dup);
  MPI_Finalize();
  std::printf("rank %d of %d: %g\n", rank, size, x);
  return rank == 0 && size == 1 && x == 1.5 ? 0 : 1;
}
EOF
  "$work/bin/mpicxx" -o "$work/hello" "$work/hello.cpp"
  # Only the kit on the library path, and no UCX modules from this machine's folders.
  local missing
  missing="$(env -i LD_LIBRARY_PATH="$work/lib" ldd "$work/hello" | grep -c 'not found' || true)"
  [ "$missing" = 0 ] || die "the kit's MPICH misses libraries: $(env -i LD_LIBRARY_PATH="$work/lib" ldd "$work/hello" | grep 'not found')"
  local out
  out="$(env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH="$work/lib" UCX_MODULE_DIR=/nonexistent "$work/hello")" ||
    die "the kit's MPICH failed to run a one-rank program: $out"
  [ -f "$kit/googletest/googletest/src/gtest-all.cc" ] || die "the kit has no GoogleTest sources"
  [ -f "$kit/cli11/include/CLI/CLI.hpp" ] || die "the kit has no CLI11"
  rm -rf "$work"
  echo "gpu_kit: verified $kit: one-rank MPI program ran ($out); GoogleTest and CLI11 present"
}

case "${1:-}" in
  prepare) prepare "${2:-}" ;;
  verify) verify "${2:-}" ;;
  install) [ $# -ge 3 ] || die "usage: gpu_kit.sh install KIT PREFIX [JOBS]"; install_kit "$2" "$3" "${4:-}" ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d' >&2; exit 2 ;;
esac
