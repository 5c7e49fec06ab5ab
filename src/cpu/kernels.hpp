// kernels.hpp: the CPU kernels of the step: one pass each, threaded with OpenMP.
//
// Every kernel is elementwise or reduces with a fixed order, so results do not depend on
// the number of threads.
#pragma once

#include <cstddef>
#include <span>

#include "shardopt/adam_math.hpp"
#include "shardopt/bf16.hpp"

namespace shardopt::cpu {

/// Fused AdamW / Adam-L2 over segments tiling [0, n): reads master, grad, m, v once, writes
/// master, m, v and (if not null) the bf16 or fp32 replica copy.
void adam_update(const StepScalars& s, std::span<const UpdateSegment> segments, float* master,
                 const float* grad, float* m, float* v, bf16* out_bf16, float* out_f32);

void cast_f32_to_bf16(const float* src, bf16* dst, std::size_t n);
void cast_bf16_to_f32(const bf16* src, float* dst, std::size_t n);
void accumulate(float* dst, const float* src, std::size_t n);
void accumulate(float* dst, const bf16* src, std::size_t n);
/// Sum of squares in double: fixed blocks of kSumBlock elements, partials combined in order.
inline constexpr std::size_t kSumBlock = 8192;
double sum_squares(const float* x, std::size_t n);
bool all_finite(const float* x, std::size_t n);
void scale(float* x, std::size_t n, float factor);
void fill_zero(float* x, std::size_t n);

}  // namespace shardopt::cpu
