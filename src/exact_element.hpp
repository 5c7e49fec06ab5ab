// exact_element.hpp: reproducible mode's exact arithmetic on one element (exact_sum.hpp
// defines the method), as __host__ __device__ functions: the CPU's portable kernels
// (cpu/exact_kernels.cpp) and the CUDA backend's passes (cuda/exact_op.hpp) call these, so
// both compute the same bits from the same source. Every double operation here is exact by
// construction, except the one conversion to fp32 in to_float(); no FMA contraction can
// change them (-ffp-contract=off, nvcc --fmad=false).
#pragma once

#include <cstdint>

#include "shardopt/bf16.hpp"
#include "shardopt/host_device.hpp"

namespace shardopt::exact::elem {

inline constexpr std::uint8_t kNonFiniteLevel = 127;  ///< exact::kNonFinite
inline constexpr std::uint32_t kQuietNan = 0x7fc00000u;

SHARDOPT_HD double double_from_bits(std::uint64_t u) {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(u));
#else
  double d;
  std::memcpy(&d, &u, sizeof d);
  return d;
#endif
}

SHARDOPT_HD std::uint64_t double_bits(double d) {
#if defined(__CUDA_ARCH__)
  return static_cast<std::uint64_t>(__double_as_longlong(d));
#else
  std::uint64_t u;
  std::memcpy(&u, &d, sizeof u);
  return u;
#endif
}

/// x rounded to the nearest integer, ties to even (|x| <= 2^51; the default rounding mode):
/// adding 1.5 * 2^52 leaves no fraction bits. Exact; never -0.
SHARDOPT_HD double round_to_integer(double x) {
  constexpr double kShift = 6755399441055744.0;  // 1.5 * 2^52
  return (x + kShift) - kShift;
}

/// 2^e for -1022 <= e <= 1023.
SHARDOPT_HD double pow2(int e) { return double_from_bits(static_cast<std::uint64_t>(1023 + e) << 52); }

/// n * 2^e rounded once to fp32 (cpu::exact_to_float). Below 2^50 in magnitude n is exact in
/// a double, and so is n * 2^e; the conversion to fp32 rounds once. Above, n is first rounded
/// to odd at 2^13 (floor plus a sticky bit), which keeps that one rounding to 24 bits correct
/// (the double then holds 37 to 50 bits).
SHARDOPT_HD float to_float(std::int64_t n, int e) {
  const bool wide = n >= (std::int64_t{1} << 50) || n < -(std::int64_t{1} << 50);
  if (wide) {
    const std::int64_t t = (n >> 13) | ((n & 0x1fff) != 0 ? 1 : 0);
    return static_cast<float>(static_cast<double>(t) * pow2(13 + e));
  }
  return static_cast<float>(static_cast<double>(n) * pow2(e));
}

/// The level of one value (0: zero, 127: NaN or Inf, else 1..11).
SHARDOPT_HD std::uint8_t level_of(float v) {
  const std::uint32_t u = float_bits(v) & 0x7fffffffu;
  const std::uint32_t e = u >> 23;
  return u == 0 ? 0 : e == 0xffu ? kNonFiniteLevel : static_cast<std::uint8_t>((e + 24) / 24);
}

/// v rounded to the low bin of level l (its grid 2^(24 l - 174)); 0 for levels 0 and 127.
SHARDOPT_HD std::int64_t round_to_level(float v, std::uint8_t l) {
  return l == 0 || l == kNonFiniteLevel
             ? 0
             : static_cast<std::int64_t>(round_to_integer(static_cast<double>(v) * pow2(174 - 24 * l)));
}

/// One value joins an element's level and bins (cpu::exact_deposit).
SHARDOPT_HD void deposit(float v, std::int64_t& top, std::int64_t& low, std::uint8_t& level) {
  if (v == 0.0f) return;
  std::uint8_t l = level;
  if (l == kNonFiniteLevel) return;  // non-finite already
  const std::uint32_t e = (float_bits(v) >> 23) & 0xffu;
  if (e == 0xffu) {
    level = kNonFiniteLevel;
    return;
  }
  const std::uint8_t want = static_cast<std::uint8_t>((e + 24) / 24);
  if (want > l) {
    if (l == 0 || want - l >= 2) {
      top = 0;
      low = 0;
    } else {
      low = top;
      top = 0;
    }
    l = want;
    level = l;
  }
  const int b = 24 * l - 150;  // b(l); the low bin's is b - 24
  const double d = v;
  const double hi = round_to_integer(d * pow2(-b));         // |hi| <= 2^23
  const double rest = d - hi * pow2(b);                     // exact: |rest| <= 2^(b-1)
  const double lo = round_to_integer(rest * pow2(24 - b));  // |lo| <= 2^23; below is dropped
  top += static_cast<std::int64_t>(hi);
  low += static_cast<std::int64_t>(lo);
}

/// The bins of an element at its own level `local` lifted to the group's level `global` and
/// packed into one int64 (cpu::exact_lift).
SHARDOPT_HD std::int64_t lift(std::uint8_t local, std::uint8_t global, std::int64_t top,
                              std::int64_t low) {
  if (local == 0 || global == kNonFiniteLevel) return 0;
  const int by = global - local;
  return by == 0 ? top * (std::int64_t{1} << 24) + low : by == 1 ? top : 0;
}

/// An element's exact sum at level l rounded once to fp32 (cpu::exact_sums_to_float): +0
/// for level 0, the quiet NaN for 127.
SHARDOPT_HD float sum_to_float(std::int64_t sum, std::uint8_t l) {
  return l == 0                 ? 0.0f
         : l == kNonFiniteLevel ? bits_float(kQuietNan)
                                : to_float(sum, 24 * static_cast<int>(l) - 174);
}

/// The grid of the exchanges' one-pass combines (cpu::exact_grid_exponent): the low bin of
/// the level of biased exponent field e, 2^(24 L - 174).
SHARDOPT_HD constexpr int grid_exponent(std::uint32_t e) { return 24 * static_cast<int>((e + 24) / 24) - 174; }

/// The direct exchange's combine of one element (cpu::exact_combine): value(r) is rank r's
/// raw fp32 value, r < ranks. Each value rounded to the grid of the largest exponent among
/// them (an integer below 2^47 in magnitude), the integers summed exactly in int64, the sum
/// rounded once to fp32; the quiet NaN if any value is NaN or Inf. The same bits as the
/// two-phase method on those values (exact_sum.hpp).
template <class Value>
SHARDOPT_HD float combine_raw(const Value& value, int ranks) {
  std::uint32_t e = 0;
  for (int r = 0; r < ranks; ++r) {
    const std::uint32_t f = (float_bits(value(r)) >> 23) & 0xffu;
    e = f > e ? f : e;
  }
  if (e == 0xffu) return bits_float(kQuietNan);
  const int g = grid_exponent(e);
  const double down = pow2(-g);
  std::int64_t sum = 0;
  for (int r = 0; r < ranks; ++r)
    sum += static_cast<std::int64_t>(round_to_integer(static_cast<double>(value(r)) * down));
  return to_float(sum, g);
}

/// The packed word of one element's state (cpu::exact_pack): bits 0-3 the level (0 empty,
/// 1-11, kPackedNonFinite), bits 4-33 the top bin and 34-63 the low bin (two's complement).
inline constexpr std::uint64_t kPackedNonFinite = 15;
SHARDOPT_HD std::uint64_t pack(std::uint8_t l, std::int64_t top, std::int64_t low) {
  // An empty element's bins are stale (reset on first use); a non-finite one's unused.
  return l == 0                 ? 0
         : l == kNonFiniteLevel ? kPackedNonFinite
                                : l | ((static_cast<std::uint64_t>(top) & 0x3fffffffu) << 4) |
                                      (static_cast<std::uint64_t>(low) << 34);
}
/// The bins a packed word holds (0 for empty and non-finite elements' bins).
SHARDOPT_HD void unpack(std::uint64_t w, std::uint8_t& l, std::int64_t& top, std::int64_t& low) {
  const std::uint64_t f = w & 15u;
  l = f == kPackedNonFinite ? kNonFiniteLevel : static_cast<std::uint8_t>(f);
  top = static_cast<std::int64_t>(w << 30) >> 34;
  low = static_cast<std::int64_t>(w) >> 34;
}

/// A packed word's state lifted to level g >= its own and summed as one int64 on the grid
/// b(g - 1): top * 2^24 + low at g, top at g - 1, nothing below.
SHARDOPT_HD std::int64_t packed_lifted(std::uint64_t w, std::uint64_t g) {
  const std::int64_t top = static_cast<std::int64_t>(w << 30) >> 34;
  const std::int64_t low = static_cast<std::int64_t>(w) >> 34;
  const std::uint64_t l = w & 15u;
  return l == g ? top * (std::int64_t{1} << 24) + low : l + 1 == g ? top : 0;
}

/// The packed exchange's combine of one element (cpu::exact_combine_packed): word(r) is rank
/// r's packed state, r < ranks. Each rank's bins lifted to the highest level G among them
/// and summed in int64 on the grid b(G - 1), rounded once to fp32; +0 when all are empty,
/// the quiet NaN when one is non-finite.
template <class Word>
SHARDOPT_HD float combine_packed(const Word& word, int ranks) {
  std::uint64_t g = 0;
  for (int r = 0; r < ranks; ++r) {
    const std::uint64_t l = word(r) & 15u;
    g = l > g ? l : g;
  }
  if (g == kPackedNonFinite) return bits_float(kQuietNan);
  if (g == 0) return 0.0f;
  std::int64_t sum = 0;
  for (int r = 0; r < ranks; ++r) sum += packed_lifted(word(r), g);
  return to_float(sum, 24 * static_cast<int>(g) - 174);  // the grid b(G - 1)
}

/// The packed exchange with each rank's last micro-batch still raw
/// (cpu::exact_deposit_combine_packed): word(r) is rank r's packed state, value(r) its last
/// fp32 value. G is the highest level among the states and the values' own levels; each state
/// is lifted to G and each value rounded straight to G's low grid, b(G - 1), the integers
/// summed in int64 and rounded once to fp32. The same bits as depositing value(r) into word(r)
/// and combine_packed: the deposit at a level l <= G leaves hi * 2^24 + lo =
/// RNE(v / 2^b(l - 1)) (hi * 2^24 is even, so the split moves no tie); lifted by one that is hi
/// = RNE(v / 2^b(l)); by two or more both give 0 (|v| is below half of G's grid). A rise of the
/// word's level by the deposit is a lift too. Needs no headroom in the words' 30-bit bins.
template <class Word, class Value>
SHARDOPT_HD float combine_packed_raw(const Word& word, const Value& value, int ranks) {
  std::uint64_t g = 0;
  for (int r = 0; r < ranks; ++r) {
    const std::uint64_t lw = word(r) & 15u;
    const std::uint32_t u = float_bits(value(r)) & 0x7fffffffu;
    const std::uint64_t lv = u == 0 ? 0 : u >= 0x7f800000u ? kPackedNonFinite : ((u >> 23) + 24) / 24;
    g = lw > g ? lw : g;
    g = lv > g ? lv : g;
  }
  if (g == kPackedNonFinite) return bits_float(kQuietNan);
  if (g == 0) return 0.0f;
  const double down = pow2(174 - 24 * static_cast<int>(g));
  std::int64_t sum = 0;
  for (int r = 0; r < ranks; ++r)
    sum += packed_lifted(word(r), g) +
           static_cast<std::int64_t>(round_to_integer(static_cast<double>(value(r)) * down));
  return to_float(sum, 24 * static_cast<int>(g) - 174);
}

/// The exact square of one fp32 value as 32-bit digits of v^2 / 2^kDigitBase
/// (cpu::SquareDigits): what add() must add to digit[at], digit[at + 1], digit[at + 2] (each
/// below 2^33). Returns 0 for a zero (nothing to add), 1 for a finite value, 2 for +-Inf, 3
/// for NaN.
inline constexpr int kDigitBase = -352;  ///< cpu::SquareDigits::kBase
struct SquareParts {
  unsigned at;
  std::uint64_t d0, d1, d2;
};
SHARDOPT_HD int square_parts(float v, SquareParts& out) {
  const std::uint32_t vb = float_bits(v) & 0x7fffffffu;
  if (vb == 0) return 0;
  if (vb >= 0x7f800000u) return vb == 0x7f800000u ? 2 : 3;
  const double sq = static_cast<double>(v) * static_cast<double>(v);  // exact: 48 bits
  // Squares of fp32 values are normal doubles: sq = m * 2^(E - 1075), m = 1.fraction (53 bits).
  const std::uint64_t bits = double_bits(sq);
  const std::uint64_t m = (bits & ((std::uint64_t{1} << 52) - 1)) | (std::uint64_t{1} << 52);
  const int s = static_cast<int>((bits >> 52) & 0x7ff) - 1075 - kDigitBase;  // m's lowest bit, >= 2
  const int o = s % 32;
  // m * 2^o (up to 84 bits) added as three digits: each addend below 2^33.
  const std::uint64_t lo = (m & 0xffffffffu) << o;  // < 2^63
  const std::uint64_t hi = (m >> 32) << o;           // < 2^53
  out.at = static_cast<unsigned>(s / 32);
  out.d0 = lo & 0xffffffffu;
  out.d1 = (lo >> 32) + (hi & 0xffffffffu);
  out.d2 = hi >> 32;
  return 1;
}

}  // namespace shardopt::exact::elem
