// bf16.hpp: bfloat16 <-> float conversion, round-to-nearest-even, shared by CPU and GPU code.
//
// The conversion is done on the bit pattern with integer arithmetic, so it is exact for
// every input class (normals, subnormals, values that overflow to Inf, Inf, NaN) on any
// hardware; AVX-512 BF16's vcvtneps2bf16, for example, flushes subnormals and is not used.
#pragma once

#include <cstdint>
#include <cstring>

#include "shardopt/host_device.hpp"

namespace shardopt {

/// Storage type for one bfloat16 value: the upper 16 bits of an IEEE-754 binary32.
struct bf16 {
  std::uint16_t bits;
};
static_assert(sizeof(bf16) == 2, "bf16 must be two bytes");

SHARDOPT_HD std::uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

SHARDOPT_HD float bits_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

/// float -> bf16 bits, round to nearest, ties to even. NaN keeps its sign and becomes the
/// canonical quiet NaN (0x7FC0 / 0xFFC0); finite values too large for bf16 round to +-Inf.
SHARDOPT_HD std::uint16_t float_to_bf16_bits(float f) {
  const std::uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
    return static_cast<std::uint16_t>(((u >> 16) & 0x8000u) | 0x7FC0u);
  }
  // Adding 0x7FFF plus the lowest kept bit rounds half-way cases to the even neighbour;
  // a carry out of the mantissa correctly bumps the exponent (and reaches Inf at the top).
  const std::uint32_t rounding_bias = 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>((u + rounding_bias) >> 16);
}

/// bf16 bits -> float: exact (bf16 is a prefix of binary32).
SHARDOPT_HD float bf16_bits_to_float(std::uint16_t h) {
  return bits_float(static_cast<std::uint32_t>(h) << 16);
}

SHARDOPT_HD bf16 to_bf16(float f) { return bf16{float_to_bf16_bits(f)}; }
SHARDOPT_HD float to_float(bf16 h) { return bf16_bits_to_float(h.bits); }
SHARDOPT_HD float to_float(float f) { return f; }

}  // namespace shardopt
