// exact_op.hpp: reproducible mode's two-phase exact sums (src/exact_sum.hpp) on the device:
// one work item per element for each pass, and the exact sum of squares as an integer
// reduction.
//
// Plain C++ with __host__ __device__ members, like lion_op.hpp: the CUDA kernels, the Thrust
// OpenMP build and the fake device run this same code. The element math is
// src/exact_element.hpp's, which the CPU's portable kernels call too.
#pragma once

#include <cstddef>
#include <cstdint>

#include "exact_element.hpp"
#include "shardopt/host_device.hpp"

namespace shardopt::dev {

/// One pass of the two-phase method over elements [0, n) of the pointers (Backend::exact_*).
struct ExactOp {
  enum Pass : int {
    Deposit,        ///< elem::deposit(g[i], top[i], low[i], level[i])
    Levels,         ///< level[i] = elem::level_of(g[i])
    RoundToLevels,  ///< top[i] = elem::round_to_level(g[i], level[i])
    Lift,           ///< top[i] = elem::lift(mine[i], level[i], top[i], low[i])
    SumsToFloat,    ///< dst[i] = elem::sum_to_float(top[i], level[i])
  };
  Pass pass = Deposit;
  const float* g = nullptr;
  float* dst = nullptr;
  std::int64_t* top = nullptr;
  std::int64_t* low = nullptr;
  std::uint8_t* level = nullptr;
  const std::uint8_t* mine = nullptr;

  SHARDOPT_HD void operator()(std::size_t i) const {
    switch (pass) {
      case Deposit: exact::elem::deposit(g[i], top[i], low[i], level[i]); break;
      case Levels: level[i] = exact::elem::level_of(g[i]); break;
      case RoundToLevels: top[i] = exact::elem::round_to_level(g[i], level[i]); break;
      case Lift: top[i] = exact::elem::lift(mine[i], level[i], top[i], low[i]); break;
      case SumsToFloat: dst[i] = exact::elem::sum_to_float(top[i], level[i]); break;
    }
  }
};

/// The exact sum of squares of some fp32 values as unnormalised 32-bit digits of
/// v^2 / 2^kDigitBase (cpu::SquareDigits), with counts of NaN and Inf. Adding two is integer
/// addition, so a reduction in any order gives the same digits; each value adds below 2^33
/// to at most three digits, so up to kMaxValues values cannot overflow a digit.
struct ExactDigits {
  static constexpr int kDigits = 22;  ///< cpu::SquareDigits::kDigits
  static constexpr std::size_t kMaxValues = std::size_t{1} << 29;
  std::uint64_t digit[kDigits];
  std::uint64_t nans;
  std::uint64_t infs;
};

/// One value's digits (elem::square_parts).
struct SquareToDigits {
  SHARDOPT_HD ExactDigits operator()(float v) const {
    ExactDigits r{};
    exact::elem::SquareParts p{};
    switch (exact::elem::square_parts(v, p)) {
      case 1:
        r.digit[p.at] = p.d0;
        r.digit[p.at + 1] = p.d1;
        r.digit[p.at + 2] = p.d2;
        break;
      case 2: r.infs = 1; break;
      case 3: r.nans = 1; break;
      default: break;
    }
    return r;
  }
};

struct AddDigits {
  SHARDOPT_HD ExactDigits operator()(const ExactDigits& a, const ExactDigits& b) const {
    ExactDigits r;
    for (int k = 0; k < ExactDigits::kDigits; ++k) r.digit[k] = a.digit[k] + b.digit[k];
    r.nans = a.nans + b.nans;
    r.infs = a.infs + b.infs;
    return r;
  }
};

}  // namespace shardopt::dev
