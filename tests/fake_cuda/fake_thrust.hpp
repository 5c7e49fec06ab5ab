// fake_thrust.hpp: the device algorithms of cuda/device_algorithms.hpp under Thrust's
// OpenMP system, on plain (already translated) pointers. fake_thrust.cpp is compiled
// without the fake CUDA headers: CCCL takes a visible cuda_runtime_api.h for a CUDA toolkit.
#pragma once

#include <cstddef>
#include <span>

#include "adafactor_op.hpp"
#include "adam_chunk.hpp"
#include "adamw8bit_op.hpp"
#include "exact_op.hpp"
#include "lion_op.hpp"
#include "muon_op.hpp"
#include "shardopt/bf16.hpp"
#include "sum_squares.hpp"

namespace fakecuda::omp {
void adam_update(const shardopt::dev::AdamChunkOp& op);
void lion_update(const shardopt::dev::LionOp& op, std::size_t n);
void adamw8bit_update(const shardopt::dev::AdamW8bitOp& op, std::size_t blocks);
void muon_pass(const shardopt::dev::MuonPassOp& op, std::size_t n);
void adafactor_pass(const shardopt::dev::AdafactorOp& op);
void cast_f32_to_bf16(const float* src, shardopt::bf16* dst, std::size_t n);
void cast_bf16_to_f32(const shardopt::bf16* src, float* dst, std::size_t n);
void round_through_bf16(float* buf, std::size_t n);
void accumulate(float* dst, const float* src, std::size_t n);
void accumulate(float* dst, const shardopt::bf16* src, std::size_t n);
void sum_squares_partials(const float* x, std::size_t n, double* scratch);
void sum_squares_slices(const shardopt::dev::NormLevelEntry* entries,
                        std::span<const shardopt::dev::NormLevelLaunch> levels,
                        const shardopt::dev::NormSliceLast* last, std::size_t slices,
                        double* results);
bool all_finite(const float* x, std::size_t n);
void exact_pass(const shardopt::dev::ExactOp& op, std::size_t n);
shardopt::dev::ExactDigits exact_square_digits(const float* x, std::size_t n);
}  // namespace fakecuda::omp
