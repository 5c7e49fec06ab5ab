// kernels.hpp: the CPU kernels of the step: one pass each, vectorized and threaded.
//
// Each kernel runs the instruction set chosen at run time (see Isa below) on chunks of a
// static OpenMP partition. Every kernel is elementwise or reduces in an order fixed by n
// alone, so results do not depend on the number of threads, and the SIMD paths compute
// bit for bit what the portable path computes (no FMA; see docs/performance.md).
#pragma once

#include <cstddef>
#include <span>

#include "shardopt/adam_math.hpp"
#include "shardopt/bf16.hpp"

namespace shardopt::cpu {

// ---- kernels ---------------------------------------------------------------------------------

/// Fused AdamW / Adam-L2 over segments tiling [0, n): reads master, grad, m, v once, writes
/// master, m, v and (if not null) the bf16 or fp32 replica copy of the new weights.
void adam_update(const StepScalars& s, std::span<const UpdateSegment> segments, float* master,
                 const float* grad, float* m, float* v, bf16* out_bf16, float* out_f32);

/// Round to nearest even, bit-identical to float_to_bf16_bits() (NaN -> sign | 0x7FC0).
void cast_f32_to_bf16(const float* src, bf16* dst, std::size_t n);
void cast_bf16_to_f32(const bf16* src, float* dst, std::size_t n);
/// dst[i] += src[i] (one fp32 rounding).
void accumulate(float* dst, const float* src, std::size_t n);
void accumulate(float* dst, const bf16* src, std::size_t n);

/// Sum of squares in double. The order is fixed: blocks of kSumBlock elements; inside a block
/// element k goes to lane k % kSumLanes, lanes are folded pairwise (lane j += lane j + w for
/// w = 8, 4, 2, 1); block partials are added in block order. Squares of floats are exact in
/// double, so every path (and every thread count) returns the same bits.
inline constexpr std::size_t kSumBlock = 8192;
inline constexpr std::size_t kSumLanes = 16;
double sum_squares(const float* x, std::size_t n);
/// False if any element is NaN or +-Inf.
bool all_finite(const float* x, std::size_t n);
/// x[i] *= factor (e.g. the clipping coefficient).
void scale(float* x, std::size_t n, float factor);
void fill_zero(float* x, std::size_t n);

// ---- instruction set -------------------------------------------------------------------------

enum class Isa { Portable, Avx2, Avx512 };

const char* isa_name(Isa isa);
/// Compiled in and supported by this CPU (and its OS).
bool isa_supported(Isa isa);
/// The widest supported ISA: what runs unless SHARDOPT_CPU_ISA or set_isa() says otherwise.
Isa best_isa();
/// The ISA the kernels use now. The first call reads SHARDOPT_CPU_ISA (portable, avx2,
/// avx512); an unknown name throws Error(InvalidArgument), an unsupported one
/// Error(Unsupported).
Isa active_isa();
/// Forces an ISA for all later calls (tests, benchmarks); throws Error(Unsupported) if the
/// CPU lacks it. Not to be called while kernels run on other threads.
void set_isa(Isa isa);

/// When the write-only outputs (bf16/fp32 copies, cast destinations) use non-temporal
/// stores. Auto streams when a call touches more than kStreamMinBytes, so small arrays stay
/// in cache for the next kernel. The first call reads SHARDOPT_CPU_STREAM (auto, always,
/// never). Results are identical under every policy.
enum class StreamPolicy { Auto, Always, Never };
inline constexpr std::size_t kStreamMinBytes = std::size_t{64} << 20;
StreamPolicy stream_policy();
void set_stream_policy(StreamPolicy p);

}  // namespace shardopt::cpu
