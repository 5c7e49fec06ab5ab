// bf16_reference.hpp: an independent oracle for float -> bf16 rounding (test_bf16,
// test_cpu_kernels).
#pragma once

#include <cmath>
#include <cstdint>

#include "shardopt/bf16.hpp"

namespace shardopt::test {

// Pick the nearer of the two bf16 neighbours in double arithmetic, ties to the even mantissa.
inline std::uint16_t reference_bf16(float f) {
  if (std::isnan(f)) return std::signbit(f) ? 0xFFC0 : 0x7FC0;
  const std::uint32_t u = float_bits(f);
  const std::uint16_t down = static_cast<std::uint16_t>(u >> 16);
  if ((u & 0xFFFFu) == 0) return down;
  const std::uint16_t up = static_cast<std::uint16_t>(down + 1);
  const double x = f;
  const double lo = bf16_bits_to_float(down);
  const double hi = (up & 0x7FFF) == 0x7F80 ? std::copysign(std::ldexp(1.0, 128), x)
                                            : static_cast<double>(bf16_bits_to_float(up));
  const double dlo = std::fabs(x - lo), dhi = std::fabs(hi - x);
  if (dlo < dhi) return down;
  if (dhi < dlo) return up;
  return (down & 1) ? up : down;
}

}  // namespace shardopt::test
