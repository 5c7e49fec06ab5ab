// shm_kernels.cpp: fixed-order fp32 sums over peer buffers, written so that the compiler
// vectorises them (-O3): one L1-resident accumulator chunk per pass over the sources, so
// each source is read from memory once and the destination written once.
#include "shm_kernels.hpp"

#include <algorithm>

namespace shardopt::shm {

void sum_rows(float* dst, const float* const* src, int nsrc, std::size_t n) {
  if (nsrc == 1) {
    if (dst != src[0]) std::copy(src[0], src[0] + n, dst);
    return;
  }
  constexpr std::size_t kChunk = 2048;  // 8 KiB: stays in L1 across the passes
  alignas(64) float acc[kChunk];
  for (std::size_t base = 0; base < n; base += kChunk) {
    const std::size_t m = std::min(kChunk, n - base);
    // acc never escapes, so the compiler knows it aliases nothing and vectorises freely;
    // dst may be a source, but is only written after every source chunk was read.
    float* a = acc;
    const float* s0 = src[0] + base;
    const float* s1 = src[1] + base;
    for (std::size_t i = 0; i < m; ++i) a[i] = s0[i] + s1[i];
    for (int p = 2; p < nsrc; ++p) {
      const float* sp = src[p] + base;
      for (std::size_t i = 0; i < m; ++i) a[i] += sp[i];
    }
    float* d = dst + base;
    for (std::size_t i = 0; i < m; ++i) d[i] = a[i];
  }
}

Range split_part(std::size_t n, int parts, int part) {
  constexpr std::size_t kAlign = 16;
  const auto cut = [&](int k) {
    if (k >= parts) return n;
    const std::size_t c = n / static_cast<std::size_t>(parts) * static_cast<std::size_t>(k) +
                          n % static_cast<std::size_t>(parts) * static_cast<std::size_t>(k) /
                              static_cast<std::size_t>(parts);
    return std::min(n, c / kAlign * kAlign);
  };
  return Range{cut(part), cut(part + 1)};
}

}  // namespace shardopt::shm
