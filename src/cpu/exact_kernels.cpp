// exact_kernels.cpp: reproducible mode's exact arithmetic on the CPU (kernels.hpp): the
// integer sum of squares, the portable reference of the direct combine, and the threading of
// both. The SIMD versions live in kernels_avx2.cpp and kernels_avx512.cpp and return the same
// bits (test_cpu_kernels.cpp compares every path with exact_sum.cpp's two-phase method).
#include <algorithm>
#include <bit>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernel_table.hpp"
#include "kernels.hpp"

namespace shardopt::cpu {

static_assert(exact_grid_exponent(0) == -150 && exact_grid_exponent(23) == -150 &&
                  exact_grid_exponent(24) == -126 && exact_grid_exponent(254) == 90,
              "levels of 24 exponents, level 1's grid at 2^-150");

// ---- SquareDigits -------------------------------------------------------------------------

void SquareDigits::add(float v) {
  const std::uint32_t vb = std::bit_cast<std::uint32_t>(v) & 0x7fffffffu;
  if (vb == 0) return;
  if (vb >= 0x7f800000u) {  // Inf or NaN
    (vb == 0x7f800000u ? infs : nans) += 1;
    return;
  }
  const double sq = static_cast<double>(v) * static_cast<double>(v);  // exact: 48 bits
  // Squares of fp32 values are normal doubles: sq = m * 2^(E - 1075), m = 1.fraction (53 bits).
  const std::uint64_t bits = std::bit_cast<std::uint64_t>(sq);
  const std::uint64_t m = (bits & ((std::uint64_t{1} << 52) - 1)) | (std::uint64_t{1} << 52);
  const int s = static_cast<int>((bits >> 52) & 0x7ff) - 1075 - kBase;  // m's lowest bit, >= 2
  const auto at = static_cast<std::size_t>(s / 32);
  const int o = s % 32;
  // m * 2^o (up to 84 bits) added as three digits: each addend below 2^33.
  const std::uint64_t lo = (m & 0xffffffffu) << o;  // < 2^63
  const std::uint64_t hi = (m >> 32) << o;           // < 2^53
  digit[at] += lo & 0xffffffffu;
  digit[at + 1] += (lo >> 32) + (hi & 0xffffffffu);
  digit[at + 2] += hi >> 32;
  if (++pending == (std::uint64_t{1} << 29)) normalize();  // digits stay below 2^63
}

void SquareDigits::add_scaled(std::uint64_t value, int exp2) {
  if (value == 0) return;
  const int s = exp2 - kBase;
  const auto at = static_cast<std::size_t>(s / 32);
  const int o = s % 32;
  // value * 2^o (up to 94 bits) as three digits below 2^32 each.
  const std::uint64_t lo = value << o;
  const std::uint64_t hi = o == 0 ? 0 : value >> (64 - o);  // < 2^30
  digit[at] += lo & 0xffffffffu;
  digit[at + 1] += lo >> 32;
  digit[at + 2] += hi;
  if (++pending == (std::uint64_t{1} << 29)) normalize();
}

void SquareDigits::normalize() {
  std::uint64_t carry = 0;
  for (std::uint64_t& d : digit) {
    const std::uint64_t v = d + carry;
    d = v & 0xffffffffu;
    carry = v >> 32;
  }
  digit.back() += carry << 32;  // never reached by fp32 squares
  pending = 0;
}

void SquareDigits::merge(SquareDigits& other) {
  normalize();
  other.normalize();
  for (std::size_t i = 0; i < digit.size(); ++i) digit[i] += other.digit[i];
  nans += other.nans;
  infs += other.infs;
  normalize();
}

// ---- the portable range kernels (the reference) --------------------------------------------

namespace portable {
namespace {

// x rounded to the nearest integer, ties to even (|x| <= 2^51; the default rounding mode):
// adding 1.5 * 2^52 leaves no fraction bits. Exact; never -0.
inline double round_to_integer(double x) {
  constexpr double kShift = 6755399441055744.0;  // 1.5 * 2^52
  return (x + kShift) - kShift;
}

inline double pow2(int e) {  // 2^e for -1022 <= e <= 1023
  return std::bit_cast<double>(static_cast<std::uint64_t>(1023 + e) << 52);
}

}  // namespace

void exact_combine(const float* const* src, int ranks, float* dst, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    std::uint32_t e = 0;
    for (int r = 0; r < ranks; ++r) e = std::max(e, (std::bit_cast<std::uint32_t>(src[r][i]) >> 23) & 0xffu);
    if (e == 0xffu) {
      dst[i] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    const int g = exact_grid_exponent(e);
    const double down = pow2(-g);
    if (ranks <= kExactCombineMaxSimdRanks) {
      // Every term is an integer below 2^47 in magnitude: 64 of them sum exactly in a double,
      // the product with 2^g is exact, and the conversion rounds once (subnormals included).
      double sum = 0.0;
      for (int r = 0; r < ranks; ++r) sum += round_to_integer(static_cast<double>(src[r][i]) * down);
      dst[i] = static_cast<float>(sum * pow2(g));
    } else {
      // More ranks: an int64 sum, converted through long double (64-bit significand on x86,
      // 113 bits elsewhere: exact), then rounded once to fp32.
      std::int64_t sum = 0;
      for (int r = 0; r < ranks; ++r)
        sum += static_cast<std::int64_t>(round_to_integer(static_cast<double>(src[r][i]) * down));
      const long double exact = static_cast<long double>(sum) * static_cast<long double>(pow2(g));
      dst[i] = static_cast<float>(exact);
    }
  }
}

void exact_square_add(const float* x, std::size_t n, SquareDigits& squares) {
  for (std::size_t i = 0; i < n; ++i) squares.add(x[i]);
}

std::uint32_t max_exponent_field(const std::uint32_t* lanes, int nlanes, const float* x, std::size_t n) {
  std::uint32_t e = 0;
  for (int k = 0; k < nlanes; ++k) e = std::max(e, lanes[k]);
  for (std::size_t i = 0; i < n; ++i) e = std::max(e, (std::bit_cast<std::uint32_t>(x[i]) >> 23) & 0xffu);
  return e;
}

}  // namespace portable

// ---- threading -----------------------------------------------------------------------------

namespace {

// Elements per OpenMP work item (a multiple of kExactChunk, so the SIMD windows do not
// depend on the thread count; the digits do not either: they are integers).
constexpr std::size_t kExactGrain = kExactChunk * 16;

}  // namespace

void exact_combine(const float* const* src, int ranks, float* dst, std::size_t n,
                   SquareDigits* squares) {
  const RangeKernels& k = active_kernels();
  const std::ptrdiff_t items = static_cast<std::ptrdiff_t>((n + kExactGrain - 1) / kExactGrain);
#pragma omp parallel if (items > 1)
  {
    SquareDigits part;
    std::vector<const float*> at(static_cast<std::size_t>(ranks));
#pragma omp for schedule(static)
    for (std::ptrdiff_t c = 0; c < items; ++c) {
      const std::size_t b = static_cast<std::size_t>(c) * kExactGrain;
      const std::size_t e = std::min(b + kExactGrain, n);
      // A window at a time: its results are still in cache when their squares are taken.
      for (std::size_t w = b; w < e; w += kExactChunk) {
        const std::size_t len = std::min(kExactChunk, e - w);
        for (int r = 0; r < ranks; ++r) at[static_cast<std::size_t>(r)] = src[r] + w;
        k.exact_combine(at.data(), ranks, dst + w, len);
        if (squares != nullptr) k.exact_square_add(dst + w, len, part);
      }
    }
    if (squares != nullptr) {
#pragma omp critical(shardopt_exact_squares)
      squares->merge(part);
    }
  }
}

void exact_square_add(const float* x, std::size_t n, SquareDigits& squares) {
  const RangeKernels& k = active_kernels();
  const std::ptrdiff_t items = static_cast<std::ptrdiff_t>((n + kExactGrain - 1) / kExactGrain);
#pragma omp parallel if (items > 1)
  {
    SquareDigits part;
#pragma omp for schedule(static)
    for (std::ptrdiff_t c = 0; c < items; ++c) {
      const std::size_t b = static_cast<std::size_t>(c) * kExactGrain;
      k.exact_square_add(x + b, std::min(kExactGrain, n - b), part);
    }
#pragma omp critical(shardopt_exact_squares)
    squares.merge(part);
  }
}

}  // namespace shardopt::cpu
