// element_ops.hpp: the per-element arithmetic of the casts, the gradient accumulation and
// the norm, as __host__ __device__ functors shared by the CPU kernels (src/cpu/) and the
// device algorithms (cuda/), so a CPU test checks the formula the GPU runs.
#pragma once

#include <cstdint>

#include "shardopt/bf16.hpp"
#include "shardopt/host_device.hpp"

namespace shardopt::ops {

/// fp32 -> bf16, round to nearest even.
struct ToBf16 {
  SHARDOPT_HD bf16 operator()(float x) const { return to_bf16(x); }
};

/// bf16 -> fp32 (exact).
struct Bf16ToF32 {
  SHARDOPT_HD float operator()(bf16 x) const { return to_float(x); }
};

/// Gradient accumulation: dst + src, src fp32 or bf16 (widened exactly first).
struct Accumulate {
  SHARDOPT_HD float operator()(float dst, float src) const { return dst + src; }
  SHARDOPT_HD float operator()(float dst, bf16 src) const { return dst + to_float(src); }
};

/// One term of the gradient norm: x^2 in double (exact: a float's square fits a double).
struct SquareF64 {
  SHARDOPT_HD double operator()(float x) const {
    const double d = static_cast<double>(x);
    return d * d;
  }
};

/// 1 when x is NaN or +-Inf, else 0 (integer, so any summation order gives the same count).
struct NonFinite {
  SHARDOPT_HD int operator()(float x) const {
    // Exponent all ones <=> Inf or NaN; on the bits, so fast-math cannot fold it away.
    return (float_bits(x) & 0x7F800000u) == 0x7F800000u ? 1 : 0;
  }
};

}  // namespace shardopt::ops
