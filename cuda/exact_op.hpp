// exact_op.hpp: reproducible mode's exact sums (src/exact_sum.hpp) on the device: one work
// item per element for each pass (the deposit, the exchanges' pack and combines, the
// two-phase method's passes), and the exact sum of squares as an integer reduction.
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

/// Rank r's element at `at` in blocks `stride` elements apart (an exchange's received blocks).
template <class T>
struct StridedValue {
  const T* at;
  std::size_t stride;
  SHARDOPT_HD T operator()(int r) const { return at[static_cast<std::size_t>(r) * stride]; }
};

/// One pass over elements [0, n) of the pointers (Backend::exact_*): the two-phase method's,
/// and the exchanges' (the packed state with the last micro-batch deposited, the combines of
/// nsrc received blocks at src, src + stride, ...).
struct ExactOp {
  enum Pass : int {
    Deposit,        ///< elem::deposit(g[i], top[i], low[i], level[i])
    Levels,         ///< level[i] = elem::level_of(g[i])
    RoundToLevels,  ///< top[i] = elem::round_to_level(g[i], level[i])
    Lift,           ///< top[i] = elem::lift(mine[i], level[i], top[i], low[i])
    SumsToFloat,    ///< dst[i] = elem::sum_to_float(top[i], level[i])
    DepositPack,    ///< words[i] = elem::pack of the state (level, top, low; none: empty) with g[i]
    CombineRaw,     ///< dst[i] = elem::combine_raw of src's fp32 values
    CombinePacked,  ///< dst[i] = elem::combine_packed of src's packed words
  };
  Pass pass = Deposit;
  const float* g = nullptr;
  float* dst = nullptr;
  std::int64_t* top = nullptr;
  std::int64_t* low = nullptr;
  std::uint8_t* level = nullptr;
  const std::uint8_t* mine = nullptr;
  std::uint64_t* words = nullptr;
  const void* src = nullptr;
  std::size_t stride = 0;
  int nsrc = 0;

  SHARDOPT_HD void operator()(std::size_t i) const {
    switch (pass) {
      case Deposit: exact::elem::deposit(g[i], top[i], low[i], level[i]); break;
      case Levels: level[i] = exact::elem::level_of(g[i]); break;
      case RoundToLevels: top[i] = exact::elem::round_to_level(g[i], level[i]); break;
      case Lift: top[i] = exact::elem::lift(mine[i], level[i], top[i], low[i]); break;
      case SumsToFloat: dst[i] = exact::elem::sum_to_float(top[i], level[i]); break;
      case DepositPack: {
        // The state stays as it was: the deposit goes into copies.
        std::uint8_t l = level != nullptr ? level[i] : std::uint8_t{0};
        std::int64_t t = level != nullptr ? top[i] : 0;
        std::int64_t lo = level != nullptr ? low[i] : 0;
        exact::elem::deposit(g[i], t, lo, l);
        words[i] = exact::elem::pack(l, t, lo);
        break;
      }
      case CombineRaw:
        dst[i] = exact::elem::combine_raw(StridedValue<float>{static_cast<const float*>(src) + i, stride}, nsrc);
        break;
      case CombinePacked:
        dst[i] = exact::elem::combine_packed(
            StridedValue<std::uint64_t>{static_cast<const std::uint64_t*>(src) + i, stride}, nsrc);
        break;
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
