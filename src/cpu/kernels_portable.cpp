// kernels_portable.cpp: the range kernels in plain C++, for any CPU. They define the
// arithmetic with the functions the GPU runs too (adam_element() and the element_ops
// functors); the SIMD files mirror them.
#include <cstring>

#include "shardopt/element_ops.hpp"

#include "kernel_table.hpp"
#include "kernels.hpp"

namespace shardopt::cpu::portable {

void adam(const StepScalars& s, const SegmentScalars& g, float* p, const float* grad, float* m,
          float* v, bf16* out_bf16, float* out_f32, std::size_t n, bool /*stream*/) {
  for (std::size_t i = 0; i < n; ++i) {
    float pi = p[i], mi = m[i], vi = v[i];
    adam_element(s, g, pi, grad[i], mi, vi);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    if (out_bf16) out_bf16[i] = to_bf16(pi);
    if (out_f32) out_f32[i] = pi;
  }
}

void lion(const LionScalars& s, float* p, const float* grad, float* m, bf16* out_bf16,
          float* out_f32, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    float pi = p[i], mi = m[i];
    lion_element(s, pi, grad[i], mi);
    p[i] = pi;
    m[i] = mi;
    if (out_bf16) out_bf16[i] = to_bf16(pi);
    if (out_f32) out_f32[i] = pi;
  }
}

void cast_f32_to_bf16(const float* src, bf16* dst, std::size_t n, bool /*stream*/) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = ops::ToBf16{}(src[i]);
}

void cast_bf16_to_f32(const bf16* src, float* dst, std::size_t n, bool /*stream*/) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = ops::Bf16ToF32{}(src[i]);
}

void accumulate_f32(float* dst, const float* src, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = ops::Accumulate{}(dst[i], src[i]);
}

void accumulate_bf16(float* dst, const bf16* src, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = ops::Accumulate{}(dst[i], src[i]);
}

bool any_nonfinite(const float* x, std::size_t n) {
  int bad = 0;
  for (std::size_t i = 0; i < n; ++i) bad |= ops::NonFinite{}(x[i]);
  return bad != 0;
}

void scale(float* x, std::size_t n, float factor) {
  for (std::size_t i = 0; i < n; ++i) x[i] *= factor;
}

void fill_zero(float* x, std::size_t n, bool /*stream*/) { std::memset(x, 0, n * sizeof(float)); }

double finish_sum_lanes(double* lanes, const float* tail, std::size_t tail_n) {
  for (std::size_t k = 0; k < tail_n; ++k) lanes[k] += ops::SquareF64{}(tail[k]);
  for (std::size_t w = kSumLanes / 2; w >= 1; w /= 2)
    for (std::size_t j = 0; j < w; ++j) lanes[j] += lanes[j + w];
  return lanes[0];
}

namespace {

double sum_squares_block(const float* x, std::size_t n) {
  double lanes[kSumLanes] = {};
  std::size_t i = 0;
  for (; i + kSumLanes <= n; i += kSumLanes) {
    // The square is exact in double: fused or not, one rounding per addition.
    for (std::size_t j = 0; j < kSumLanes; ++j) lanes[j] += ops::SquareF64{}(x[i + j]);
  }
  return finish_sum_lanes(lanes, x + i, n - i);
}

void sum_squares_blocks(const float* x, std::size_t blocks, double* out) {
  for (std::size_t b = 0; b < blocks; ++b) out[b] = sum_squares_block(x + b * kSumBlock, kSumBlock);
}

}  // namespace
}  // namespace shardopt::cpu::portable

namespace shardopt::cpu {

const RangeKernels kPortableKernels = {
    "portable",
    portable::adam,
    portable::lion,
    portable::cast_f32_to_bf16,
    portable::cast_bf16_to_f32,
    portable::accumulate_f32,
    portable::accumulate_bf16,
    portable::sum_squares_block,
    portable::sum_squares_blocks,
    portable::any_nonfinite,
    portable::scale,
    portable::fill_zero,
    portable::exact_combine,
    portable::exact_square_add,
    portable::exact_combine_packed,
    portable::exact_deposit,
    nullptr,
    nullptr,
    portable::exact_deposit_pack,
    portable::exact_levels,
    portable::exact_round_to_levels,
    portable::exact_lift,
    portable::exact_sums_to_float,
    portable::exact_deposit_packed,
    portable::exact_combine_packed_raw,
    nullptr,
};

}  // namespace shardopt::cpu
