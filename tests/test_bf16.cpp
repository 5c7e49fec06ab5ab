// test_bf16.cpp: bit-exact bf16 rounding on edge values, against an independent reference.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "shardopt/bf16.hpp"
#include "support/bf16_reference.hpp"

using shardopt::bf16_bits_to_float;
using shardopt::bits_float;
using shardopt::float_bits;
using shardopt::float_to_bf16_bits;

using shardopt::test::reference_bf16;

TEST(Bf16, EdgeValuesBitExact) {
  struct Case {
    std::uint32_t in;
    std::uint16_t out;
  };
  const Case cases[] = {
      {0x00000000u, 0x0000},  // +0
      {0x80000000u, 0x8000},  // -0
      {0x3F800000u, 0x3F80},  // 1
      {0x3F808000u, 0x3F80},  // 1 + half ulp: tie, even stays
      {0x3F818000u, 0x3F82},  // tie, odd rounds up to even
      {0x3F808001u, 0x3F81},  // just above tie
      {0x3F807FFFu, 0x3F80},  // just below tie
      {0x7F800000u, 0x7F80},  // +Inf
      {0xFF800000u, 0xFF80},  // -Inf
      {0x7F7FFFFFu, 0x7F80},  // FLT_MAX rounds to Inf
      {0x7F7F7FFFu, 0x7F7F},  // largest value that stays finite
      {0x7F7F8000u, 0x7F80},  // tie at the top: odd mantissa rounds up into Inf
      {0x00000001u, 0x0000},  // smallest subnormal rounds to 0
      {0x00008000u, 0x0000},  // subnormal tie, even: down
      {0x00018000u, 0x0002},  // subnormal tie, odd: up
      {0x00010000u, 0x0001},  // exact bf16 subnormal
      {0x007FFFFFu, 0x0080},  // largest subnormal rounds up to the smallest normal
      {0x807FFFFFu, 0x8080},
      {0x7FC00000u, 0x7FC0},  // quiet NaN
      {0xFFC00001u, 0xFFC0},  // negative NaN keeps its sign
      {0x7F800001u, 0x7FC0},  // signalling NaN whose payload is only in the low bits
      {0x7FFFFFFFu, 0x7FC0},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(float_to_bf16_bits(bits_float(c.in)), c.out) << std::hex << "input 0x" << c.in;
    EXPECT_EQ(reference_bf16(bits_float(c.in)), c.out) << std::hex << "reference 0x" << c.in;
  }
}

TEST(Bf16, MatchesReferenceOnStridedSweepOfAllFloats) {
  // Every 4099th bit pattern (a prime stride touches all residues of the low 16 bits).
  for (std::uint64_t u = 0; u <= 0xFFFFFFFFull; u += 4099) {
    const float f = bits_float(static_cast<std::uint32_t>(u));
    ASSERT_EQ(float_to_bf16_bits(f), reference_bf16(f)) << std::hex << "0x" << u;
  }
}

TEST(Bf16, RoundTripIsExactForBf16Values) {
  for (std::uint32_t h = 0; h <= 0xFFFF; ++h) {
    const float f = bf16_bits_to_float(static_cast<std::uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(float_to_bf16_bits(f), h);
  }
}
