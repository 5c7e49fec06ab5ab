// cuda_ops.hpp: the device algorithms instantiated for CUDA (device_algorithms.cu), callable
// from plain C++. Every function enqueues on `stream` and returns without waiting, except
// all_finite (which returns a host value). Pointers are device memory.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "adafactor_op.hpp"
#include "adam_chunk.hpp"
#include "adamw8bit_op.hpp"
#include "exact_op.hpp"
#include "lion_op.hpp"
#include "muon_op.hpp"
#include "shardopt/bf16.hpp"
#include "sum_squares.hpp"

namespace shardopt::dev {

/// Which kernel runs the fused update: thrust::for_each (cub::DeviceFor) or the hand-written
/// grid-stride kernel; both run AdamChunkOp, so their results are bitwise equal.
enum class AdamKernel { Thrust, GridStride };

void adam_update(cudaStream_t stream, AdamKernel kernel, const AdamChunkOp& op);
/// The grid-stride kernel, for the occupancy query (launch_config.cpp).
const void* adam_grid_stride_kernel_address();
/// Lion on one segment of n elements (op's pointers at the segment's start).
void lion_update(cudaStream_t stream, const LionOp& op, std::size_t n);
/// One of Muon's element passes over the n elements of one matrix (muon_op.hpp).
void muon_pass(cudaStream_t stream, const MuonPassOp& op, std::size_t n);
/// One of Adafactor's passes over one parameter (adafactor_op.hpp: op.items() work items).
void adafactor_pass(cudaStream_t stream, const AdafactorOp& op);
/// AdamW8bit on one segment of `blocks` whole 256-element blocks (op's pointers at the
/// segment's start, its maps in device memory): one 256-thread CUDA block per quantization
/// block.
void adamw8bit_update(cudaStream_t stream, const AdamW8bitOp& op, std::size_t blocks);
void cast_f32_to_bf16(cudaStream_t stream, const float* src, bf16* dst, std::size_t n);
void cast_bf16_to_f32(cudaStream_t stream, const bf16* src, float* dst, std::size_t n);
/// buf[i] = to_float(to_bf16(buf[i])): the bf16 wire of a one-rank group.
void round_through_bf16(cudaStream_t stream, float* buf, std::size_t n);
void accumulate(cudaStream_t stream, float* dst, const float* src, std::size_t n);
void accumulate(cudaStream_t stream, float* dst, const bf16* src, std::size_t n);

/// Levels 1 and 2+ of the fixed sum-of-squares tree (sum_squares.hpp) into `scratch`
/// (norm_scratch_count(n) doubles); returns the device address and count (<= kNormFanIn)
/// of the last level.
struct DevicePartials {
  const double* data;
  std::size_t count;
};
DevicePartials sum_squares_partials(cudaStream_t stream, const float* x, std::size_t n,
                                    double* scratch);

/// The batched trees of `plan` (plan_sum_squares): its tables were copied to device memory
/// at `entries` and `last` (stream-ordered before this call); each slice's sum goes to
/// results[s] (device memory). The plan itself is read on the host only for the launch
/// sizes (and, by the fake device, for what the kernels read and write).
void sum_squares_slices(cudaStream_t stream, const NormPlan& plan, const NormLevelEntry* entries,
                        const NormSliceLast* last, double* results);

/// One of reproducible mode's passes over n elements (exact_op.hpp).
void exact_pass(cudaStream_t stream, const ExactOp& op, std::size_t n);
/// Waits for the stream; the exact squares of x[0, n) (n <= ExactDigits::kMaxValues).
ExactDigits exact_square_digits(cudaStream_t stream, const float* x, std::size_t n);

/// Waits for the stream; true when no element is NaN or Inf.
bool all_finite(cudaStream_t stream, const float* x, std::size_t n);

}  // namespace shardopt::dev
