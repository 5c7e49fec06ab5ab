// shm_kernels.cpp: fixed-order fp32 sums over peer buffers, written so that the compiler
// vectorises them (-O3): one L1-resident accumulator chunk per pass over the sources, so
// each source is read from memory once and the destination written once.
#include "shm_kernels.hpp"

#include <algorithm>
#include <cstdint>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace shardopt::shm {

namespace {

// Large results that overwrite data nobody else reads here are written with non-temporal
// stores: no read-for-ownership of the destination lines (a quarter of the traffic at two
// ranks). Small ones (stage-2 buckets) stay in cache for the caller, which reads them next.
constexpr std::size_t kStreamMin = std::size_t{1} << 20;

bool stream_stores(const float* dst, const float* const* src, int nsrc, std::size_t n) {
#if defined(__SSE2__)
  if (n < kStreamMin || reinterpret_cast<std::uintptr_t>(dst) % 16 != 0) return false;
  for (int p = 0; p < nsrc; ++p)
    if (src[p] == dst) return false;  // in place: the line is read anyway
  return true;
#else
  (void)dst, (void)src, (void)nsrc, (void)n;
  return false;
#endif
}

void store(float* d, const float* a, std::size_t m, bool stream) {
#if defined(__SSE2__)
  if (stream) {
    std::size_t i = 0;
    for (; i + 4 <= m; i += 4) _mm_stream_ps(d + i, _mm_load_ps(a + i));
    for (; i < m; ++i) d[i] = a[i];
    return;
  }
#endif
  (void)stream;
  for (std::size_t i = 0; i < m; ++i) d[i] = a[i];
}

}  // namespace

void sum_rows(float* dst, const float* const* src, int nsrc, std::size_t n, bool clear_sources) {
  if (nsrc == 1) {
    if (dst == src[0]) return;
    std::copy(src[0], src[0] + n, dst);
    if (clear_sources) std::fill_n(const_cast<float*>(src[0]), n, 0.0f);
    return;
  }
  const bool stream = stream_stores(dst, src, nsrc, n);
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
    if (clear_sources)  // before dst is written: dst may be one of the sources
      for (int p = 0; p < nsrc; ++p)
        if (src[p] != dst) std::fill_n(const_cast<float*>(src[p]) + base, m, 0.0f);
    store(dst + base, a, m, stream);
  }
#if defined(__SSE2__)
  if (stream) _mm_sfence();  // order the streamed stores before the barrier that publishes them
#endif
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
