// device_algorithms.hpp: the device side of the CUDA backend as Thrust algorithms over the
// shared functors, templated on the Thrust execution policy.
//
// nvcc instantiates them with thrust::cuda::par_nosync.on(stream) (thrust::for_each and
// transform dispatch to cub::DeviceFor / cub::DeviceTransform); the test build compiles the
// very same templates with g++ and THRUST_DEVICE_SYSTEM_OMP, so the CPU checks the indexing
// and arithmetic the GPU runs. Pointers are device memory for the policy's system. No
// function allocates: scratch is the caller's.
#pragma once

#include <thrust/execution_policy.h>
#include <thrust/functional.h>
#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/transform.h>
#include <thrust/transform_reduce.h>

#include <cstddef>
#include <span>

#include "adafactor_op.hpp"
#include "adam_chunk.hpp"
#include "adamw8bit_op.hpp"
#include "exact_op.hpp"
#include "lion_op.hpp"
#include "muon_op.hpp"
#include "shardopt/element_ops.hpp"
#include "sum_squares.hpp"

namespace shardopt::dev {

using Index = thrust::counting_iterator<std::size_t>;

/// The fused update: one launch over every chunk of the shard.
template <class Policy>
void adam_update(Policy&& exec, const AdamChunkOp& op) {
  const std::size_t chunks = adam_chunk_count(op.n);
  if (chunks) thrust::for_each_n(exec, Index(0), chunks, op);
}

/// Lion on one segment of n elements.
template <class Policy>
void lion_update(Policy&& exec, const LionOp& op, std::size_t n) {
  if (n) thrust::for_each_n(exec, Index(0), n, op);
}

/// One of Muon's element passes over the n elements of one matrix.
template <class Policy>
void muon_pass(Policy&& exec, const MuonPassOp& op, std::size_t n) {
  if (n) thrust::for_each_n(exec, Index(0), n, op);
}

/// One of Adafactor's passes over one parameter: op.items() work items (adafactor_op.hpp).
template <class Policy>
void adafactor_pass(Policy&& exec, const AdafactorOp& op) {
  const std::size_t items = op.items();
  if (items) thrust::for_each_n(exec, Index(0), items, op);
}

/// AdamW8bit on one segment of `blocks` whole 256-element blocks: one work item per block
/// (AdamW8bitOp::operator(), the block's elements in a loop). The OpenMP build and the fake
/// device run this; on the GPU, adamw8bit_update (device_algorithms.cu) runs the same pieces
/// with a thread per element.
template <class Policy>
void adamw8bit_update(Policy&& exec, const AdamW8bitOp& op, std::size_t blocks) {
  if (blocks) thrust::for_each_n(exec, Index(0), blocks, op);
}

template <class Policy>
void cast_f32_to_bf16(Policy&& exec, const float* src, bf16* dst, std::size_t n) {
  if (n) thrust::transform(exec, src, src + n, dst, ops::ToBf16{});
}

template <class Policy>
void cast_bf16_to_f32(Policy&& exec, const bf16* src, float* dst, std::size_t n) {
  if (n) thrust::transform(exec, src, src + n, dst, ops::Bf16ToF32{});
}

/// x rounded to bf16 and widened back (the bf16 wire of a group of one).
struct RoundThroughBf16 {
  SHARDOPT_HD float operator()(float x) const { return to_float(to_bf16(x)); }
};

template <class Policy>
void round_through_bf16(Policy&& exec, float* buf, std::size_t n) {
  if (n) thrust::transform(exec, buf, buf + n, buf, RoundThroughBf16{});
}

/// dst[i] += src[i]; Src is float or bf16.
template <class Policy, class Src>
void accumulate(Policy&& exec, float* dst, const Src* src, std::size_t n) {
  if (n) thrust::transform(exec, dst, dst + n, src, dst, ops::Accumulate{});
}

/// Where the last level of a sum-of-squares tree lies (device memory): at most kNormFanIn
/// doubles for the caller to add with combine_in_order().
struct Partials {
  const double* data;
  std::size_t count;
};

/// Levels 1 and 2+ of the fixed tree of sum_squares.hpp; scratch holds
/// norm_scratch_count(n) doubles.
template <class Policy>
Partials sum_squares_partials(Policy&& exec, const float* x, std::size_t n, double* scratch) {
  std::size_t count = norm_lane_count(n);
  if (count) thrust::transform(exec, Index(0), Index(count), scratch, LaneSquares{x, n});
  double* in = scratch;
  while (count > kNormFanIn) {
    const std::size_t groups = ceil_div(count, kNormFanIn);
    thrust::transform(exec, Index(0), Index(groups), in + count, GroupSum{in, count});
    in += count;
    count = groups;
  }
  return {in, count};  // == scratch + norm_last_level(n).offset, norm_last_level(n).count
}

/// Several slices' trees (plan_sum_squares; `entries` and `last` are the plan's tables in
/// memory of the policy's system): one launch per level, then each slice's sum into
/// results[s].
template <class Policy>
void sum_squares_slices(Policy&& exec, const NormLevelEntry* entries,
                        std::span<const NormLevelLaunch> levels, const NormSliceLast* last,
                        std::size_t slices, double* results) {
  for (const NormLevelLaunch& l : levels)
    if (l.items) thrust::for_each_n(exec, Index(0), l.items, NormLevelItem{entries + l.first_entry, l.num_entries});
  if (slices) thrust::for_each_n(exec, Index(0), slices, NormCombine{last, results});
}

/// One of reproducible mode's passes over n elements (exact_op.hpp).
template <class Policy>
void exact_pass(Policy&& exec, const ExactOp& op, std::size_t n) {
  if (n) thrust::for_each_n(exec, Index(0), n, op);
}

/// The exact squares of x[0, n) as digits (n <= ExactDigits::kMaxValues): an integer
/// reduction, the same digits in any order.
template <class Policy>
ExactDigits exact_square_digits(Policy&& exec, const float* x, std::size_t n) {
  if (n == 0) return ExactDigits{};
  return thrust::transform_reduce(exec, x, x + n, SquareToDigits{}, ExactDigits{}, AddDigits{});
}

/// True when no element is NaN or Inf (an integer max, so exact in any order).
template <class Policy>
bool all_finite(Policy&& exec, const float* x, std::size_t n) {
  if (n == 0) return true;
  return thrust::transform_reduce(exec, x, x + n, ops::NonFinite{}, 0, thrust::maximum<int>{}) == 0;
}

}  // namespace shardopt::dev
