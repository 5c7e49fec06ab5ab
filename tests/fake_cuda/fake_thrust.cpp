// fake_thrust.cpp: see fake_thrust.hpp. Built with THRUST_DEVICE_SYSTEM_OMP and the
// FMA-contraction setting of cuda/ (SHARDOPT_CUDA_FMAD).
#include "fake_thrust.hpp"

#include <thrust/system/omp/execution_policy.h>

#include "device_algorithms.hpp"

namespace fakecuda::omp {
namespace dv = shardopt::dev;
namespace {
const auto exec = thrust::omp::par;
}

void adam_update(const dv::AdamChunkOp& op) { dv::adam_update(exec, op); }
void lion_update(const dv::LionOp& op, std::size_t n) { dv::lion_update(exec, op, n); }
void muon_pass(const dv::MuonPassOp& op, std::size_t n) { dv::muon_pass(exec, op, n); }
void adafactor_pass(const dv::AdafactorOp& op) { dv::adafactor_pass(exec, op); }
void adamw8bit_update(const dv::AdamW8bitOp& op, std::size_t blocks) {
  dv::adamw8bit_update(exec, op, blocks);
}
void cast_f32_to_bf16(const float* src, shardopt::bf16* dst, std::size_t n) {
  dv::cast_f32_to_bf16(exec, src, dst, n);
}
void cast_bf16_to_f32(const shardopt::bf16* src, float* dst, std::size_t n) {
  dv::cast_bf16_to_f32(exec, src, dst, n);
}
void round_through_bf16(float* buf, std::size_t n) { dv::round_through_bf16(exec, buf, n); }
void accumulate(float* dst, const float* src, std::size_t n) { dv::accumulate(exec, dst, src, n); }
void accumulate(float* dst, const shardopt::bf16* src, std::size_t n) {
  dv::accumulate(exec, dst, src, n);
}
void sum_squares_partials(const float* x, std::size_t n, double* scratch) {
  dv::sum_squares_partials(exec, x, n, scratch);
}
void sum_squares_slices(const dv::NormLevelEntry* entries, std::span<const dv::NormLevelLaunch> levels,
                        const dv::NormSliceLast* last, std::size_t slices, double* results) {
  dv::sum_squares_slices(exec, entries, levels, last, slices, results);
}
bool all_finite(const float* x, std::size_t n) { return dv::all_finite(exec, x, n); }
void exact_pass(const dv::ExactOp& op, std::size_t n) { dv::exact_pass(exec, op, n); }
dv::ExactDigits exact_square_digits(const float* x, std::size_t n) {
  return dv::exact_square_digits(exec, x, n);
}

}  // namespace fakecuda::omp
