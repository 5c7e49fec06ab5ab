// kernels.cpp: threading of the CPU kernels: static OpenMP chunks over the range kernels of
// the active ISA (dispatch.cpp). Chunks are fixed by n, never by the thread count.
#include "kernels.hpp"

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernel_table.hpp"

namespace shardopt::cpu {
namespace {

// Elements per OpenMP work item: large enough to amortise scheduling, small enough to
// balance. A static schedule gives each thread one contiguous run of chunks, so a buffer
// first touched by one kernel is reused by the same thread (and NUMA node) in the next.
constexpr std::size_t kGrain = 1 << 16;

template <class Body>
void parallel_chunks(std::size_t n, Body body) {
  const std::ptrdiff_t chunks = static_cast<std::ptrdiff_t>((n + kGrain - 1) / kGrain);
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (std::ptrdiff_t c = 0; c < chunks; ++c) {
    const std::size_t b = static_cast<std::size_t>(c) * kGrain;
    const std::size_t e = std::min(b + kGrain, n);
    body(b, e);
  }
}

}  // namespace

void adam_update(const StepScalars& s, std::span<const UpdateSegment> segments, float* master,
                 const float* grad, float* m, float* v, bf16* out_bf16, float* out_f32) {
  if (segments.empty()) return;
  const RangeKernels& k = active_kernels();
  const std::size_t begin = segments.front().begin, end = segments.back().end;
  const std::size_t bytes_per = 28 + (out_bf16 ? 2 : 0) + (out_f32 ? 4 : 0);
  const bool stream = use_streaming_stores((end - begin) * bytes_per);
  // One parallel region for the whole shard: each chunk walks the segments it overlaps.
  parallel_chunks(end - begin, [&](std::size_t cb, std::size_t ce) {
    cb += begin;
    ce += begin;
    auto seg = std::upper_bound(segments.begin(), segments.end(), cb,
                                [](std::size_t i, const UpdateSegment& sg) { return i < sg.end; });
    for (; seg != segments.end() && seg->begin < ce; ++seg) {
      const std::size_t b = std::max(cb, seg->begin), e = std::min(ce, seg->end);
      if (b >= e) continue;
      k.adam(s, seg->scalars, master + b, grad + b, m + b, v + b,
             out_bf16 ? out_bf16 + b : nullptr, out_f32 ? out_f32 + b : nullptr, e - b, stream);
    }
  });
}

void lion_update(std::span<const LionSegment> segments, float* master, const float* grad,
                 float* m, bf16* out_bf16, float* out_f32) {
  if (segments.empty()) return;
  const RangeKernels& k = active_kernels();
  const std::size_t begin = segments.front().begin, end = segments.back().end;
  parallel_chunks(end - begin, [&](std::size_t cb, std::size_t ce) {
    cb += begin;
    ce += begin;
    auto seg = std::upper_bound(segments.begin(), segments.end(), cb,
                                [](std::size_t i, const LionSegment& sg) { return i < sg.end; });
    for (; seg != segments.end() && seg->begin < ce; ++seg) {
      const std::size_t b = std::max(cb, seg->begin), e = std::min(ce, seg->end);
      if (b >= e) continue;
      k.lion(seg->scalars, master + b, grad + b, m + b, out_bf16 ? out_bf16 + b : nullptr,
             out_f32 ? out_f32 + b : nullptr, e - b);
    }
  });
}

void cast_f32_to_bf16(const float* src, bf16* dst, std::size_t n) {
  const RangeKernels& k = active_kernels();
  const bool stream = use_streaming_stores(n * 6);
  parallel_chunks(n, [&](std::size_t b, std::size_t e) {
    k.cast_f32_to_bf16(src + b, dst + b, e - b, stream);
  });
}

void cast_bf16_to_f32(const bf16* src, float* dst, std::size_t n) {
  const RangeKernels& k = active_kernels();
  const bool stream = use_streaming_stores(n * 6);
  parallel_chunks(n, [&](std::size_t b, std::size_t e) {
    k.cast_bf16_to_f32(src + b, dst + b, e - b, stream);
  });
}

void accumulate(float* dst, const float* src, std::size_t n) {
  const RangeKernels& k = active_kernels();
  parallel_chunks(n, [&](std::size_t b, std::size_t e) { k.accumulate_f32(dst + b, src + b, e - b); });
}

void accumulate(float* dst, const bf16* src, std::size_t n) {
  const RangeKernels& k = active_kernels();
  parallel_chunks(n, [&](std::size_t b, std::size_t e) { k.accumulate_bf16(dst + b, src + b, e - b); });
}

double sum_squares(const float* x, std::size_t n) {
  const RangeKernels& k = active_kernels();
  const std::size_t full = n / kSumBlock;
  const std::size_t blocks = (n + kSumBlock - 1) / kSumBlock;
  std::vector<double> partial(blocks);
  // Every block's partial is the same whoever computes it; threads take groups of blocks.
  const std::size_t groups = (full + kSumGroup - 1) / kSumGroup;
#pragma omp parallel for schedule(static) if (groups > 1)
  for (std::ptrdiff_t gi = 0; gi < static_cast<std::ptrdiff_t>(groups); ++gi) {
    const std::size_t b = static_cast<std::size_t>(gi) * kSumGroup;
    k.sum_squares_blocks(x + b * kSumBlock, std::min(kSumGroup, full - b), partial.data() + b);
  }
  if (full < blocks) partial[full] = k.sum_squares_block(x + full * kSumBlock, n - full * kSumBlock);
  double total = 0.0;
  for (double p : partial) total += p;  // in block order
  return total;
}

bool all_finite(const float* x, std::size_t n) {
  const RangeKernels& k = active_kernels();
  const std::ptrdiff_t chunks = static_cast<std::ptrdiff_t>((n + kGrain - 1) / kGrain);
  int bad = 0;
#pragma omp parallel for schedule(static) reduction(| : bad) if (chunks > 1)
  for (std::ptrdiff_t c = 0; c < chunks; ++c) {
    const std::size_t b = static_cast<std::size_t>(c) * kGrain;
    bad |= k.any_nonfinite(x + b, std::min(kGrain, n - b)) ? 1 : 0;
  }
  return bad == 0;
}

void scale(float* x, std::size_t n, float factor) {
  const RangeKernels& k = active_kernels();
  parallel_chunks(n, [&](std::size_t b, std::size_t e) { k.scale(x + b, e - b, factor); });
}

void fill_zero(float* x, std::size_t n) {
  const RangeKernels& k = active_kernels();
  const bool stream = use_streaming_stores(n * sizeof(float));
  parallel_chunks(n, [&](std::size_t b, std::size_t e) { k.fill_zero(x + b, e - b, stream); });
}

}  // namespace shardopt::cpu
