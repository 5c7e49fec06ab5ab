// kernels.cpp: portable OpenMP implementations of the CPU kernels.
#include "kernels.hpp"

#include <cmath>
#include <cstring>
#include <vector>

#include "shardopt/bf16.hpp"
#include "shardopt/element_ops.hpp"

namespace shardopt::cpu {
namespace {

// Elements per OpenMP work item for streaming kernels: large enough to amortise scheduling,
// small enough to balance. Results never depend on it (all kernels are elementwise).
constexpr std::size_t kGrain = 1 << 16;

template <class Body>
void parallel_chunks(std::size_t n, Body body) {
  const std::ptrdiff_t chunks = static_cast<std::ptrdiff_t>((n + kGrain - 1) / kGrain);
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (std::ptrdiff_t c = 0; c < chunks; ++c) {
    const std::size_t b = static_cast<std::size_t>(c) * kGrain;
    const std::size_t e = b + kGrain < n ? b + kGrain : n;
    body(b, e);
  }
}

}  // namespace

void adam_update(const StepScalars& s, std::span<const UpdateSegment> segments, float* master,
                 const float* grad, float* m, float* v, bf16* out_bf16, float* out_f32) {
  for (const UpdateSegment& seg : segments) {
    const SegmentScalars g = seg.scalars;
    parallel_chunks(seg.end - seg.begin, [&](std::size_t b, std::size_t e) {
      for (std::size_t i = seg.begin + b; i < seg.begin + e; ++i) {
        float p = master[i], mi = m[i], vi = v[i];
        adam_element(s, g, p, grad[i], mi, vi);
        master[i] = p;
        m[i] = mi;
        v[i] = vi;
        if (out_bf16) out_bf16[i] = to_bf16(p);
        if (out_f32) out_f32[i] = p;
      }
    });
  }
}

void cast_f32_to_bf16(const float* src, bf16* dst, std::size_t n) {
  parallel_chunks(n, [&](std::size_t b, std::size_t e) {
    for (std::size_t i = b; i < e; ++i) dst[i] = ops::ToBf16{}(src[i]);
  });
}

void cast_bf16_to_f32(const bf16* src, float* dst, std::size_t n) {
  parallel_chunks(n, [&](std::size_t b, std::size_t e) {
    for (std::size_t i = b; i < e; ++i) dst[i] = ops::Bf16ToF32{}(src[i]);
  });
}

void accumulate(float* dst, const float* src, std::size_t n) {
  parallel_chunks(n, [&](std::size_t b, std::size_t e) {
    for (std::size_t i = b; i < e; ++i) dst[i] = ops::Accumulate{}(dst[i], src[i]);
  });
}

void accumulate(float* dst, const bf16* src, std::size_t n) {
  parallel_chunks(n, [&](std::size_t b, std::size_t e) {
    for (std::size_t i = b; i < e; ++i) dst[i] = ops::Accumulate{}(dst[i], src[i]);
  });
}

double sum_squares(const float* x, std::size_t n) {
  const std::size_t blocks = (n + kSumBlock - 1) / kSumBlock;
  std::vector<double> partial(blocks);
#pragma omp parallel for schedule(static) if (blocks > 1)
  for (std::ptrdiff_t blk = 0; blk < static_cast<std::ptrdiff_t>(blocks); ++blk) {
    const std::size_t b = static_cast<std::size_t>(blk) * kSumBlock;
    const std::size_t e = b + kSumBlock < n ? b + kSumBlock : n;
    double acc = 0.0;
    for (std::size_t i = b; i < e; ++i) acc += ops::SquareF64{}(x[i]);
    partial[static_cast<std::size_t>(blk)] = acc;
  }
  double total = 0.0;
  for (double p : partial) total += p;
  return total;
}

bool all_finite(const float* x, std::size_t n) {
  int bad = 0;
#pragma omp parallel for reduction(| : bad) schedule(static) if (n > kGrain)
  for (std::ptrdiff_t i = 0; i < static_cast<std::ptrdiff_t>(n); ++i)
    bad |= ops::NonFinite{}(x[i]);
  return bad == 0;
}

void scale(float* x, std::size_t n, float factor) {
  parallel_chunks(n, [&](std::size_t b, std::size_t e) {
    for (std::size_t i = b; i < e; ++i) x[i] *= factor;
  });
}

void fill_zero(float* x, std::size_t n) {
  parallel_chunks(n, [&](std::size_t b, std::size_t e) {
    std::memset(x + b, 0, (e - b) * sizeof(float));
  });
}

}  // namespace shardopt::cpu
