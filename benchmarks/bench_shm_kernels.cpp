// bench_shm_kernels.cpp: the shared-memory reduce-scatter's summation kernel alone, in one
// process, against the in-place update a += s * b and memcpy on the same arrays:
//   bench_shm_kernels [ELEMENTS]      (default 32Mi fp32; 4 rounds; --help)
// Bytes counted: 12 per element for a += s*b and both sums (two reads, one write), 8 for
// memcpy. The in-place sum is the reduce-scatter's block 0; the streaming one writes a third
// array, as its other blocks do.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cli.hpp"
#include "comm/shm_kernels.hpp"
#include "shardopt/memory.hpp"

using namespace shardopt;

int main(int argc, char** argv) {
  CLI::App app{"The shared-memory reduce-scatter's summation kernel alone, in one process, "
               "against a += s * b and memcpy on the same arrays (GB/s, 4 rounds)."};
  cli::init(app, "bench_shm_kernels");
  std::size_t n = std::size_t{32} << 20;
  app.add_option("ELEMENTS", n, "fp32 elements per array")->transform(cli::size())
      ->check(CLI::PositiveNumber)->default_str("32Mi");
  if (const int rc = cli::parse(app, argc, argv); rc >= 0) return rc;
  Allocation A = allocate_host(nullptr, MemCategory::Scratch, n * 4);
  Allocation B = allocate_host(nullptr, MemCategory::Scratch, n * 4);
  Allocation C = allocate_host(nullptr, MemCategory::Scratch, n * 4);
  float* a = A.as<float>();
  float* b = B.as<float>();
  float* c = C.as<float>();
  using clock = std::chrono::steady_clock;
  const auto gbs = [](clock::time_point t0, clock::time_point t1, double bytes) {
    return bytes / std::chrono::duration<double>(t1 - t0).count() / 1e9;
  };
  std::printf("| in-place a+=s*b | sum in place | sum to new array (streaming) | memcpy |  (GB/s)\n");
  for (int round = 0; round < 4; ++round) {
    const float* src[2] = {a, b};
    const auto t0 = clock::now();
    for (std::size_t i = 0; i < n; ++i) a[i] += 0.5f * b[i];
    const auto t1 = clock::now();
    shm::sum_rows(a, src, 2, n);
    const auto t2 = clock::now();
    shm::sum_rows(c, src, 2, n);
    const auto t3 = clock::now();
    std::memcpy(c, b, n * 4);
    const auto t4 = clock::now();
    const double e = static_cast<double>(n);
    std::printf("| %.1f | %.1f | %.1f | %.1f |\n", gbs(t0, t1, 12 * e), gbs(t1, t2, 12 * e),
                gbs(t2, t3, 12 * e), gbs(t3, t4, 8 * e));
  }
  return 0;
}
