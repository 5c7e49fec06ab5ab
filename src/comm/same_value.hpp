// same_value.hpp: whether every rank holds the same 64-bit value (a hash of what must match),
// decided from sums over ranks alone, so the test rides in an all-reduce of doubles that a
// call makes anyway. Internal.
//
// The value is cut into four 16-bit chunks c; each is sent as c and c * c. For N ranks,
// N * sum(c^2) == (sum c)^2 holds exactly when every rank sent the same c (Cauchy-Schwarz).
// Every partial sum is an integer below 2^53 for N < 2^21 ranks, so the sums are exact in any
// order and every rank reaches the same verdict.
#pragma once

#include <cstddef>
#include <cstdint>

namespace shardopt::same_value {

inline constexpr std::size_t kDoubles = 8;
inline constexpr int kMaxRanks = 1 << 21;

inline void encode(std::uint64_t v, double* out) {
  for (std::size_t k = 0; k < 4; ++k) {
    const double c = static_cast<double>((v >> (16 * k)) & 0xFFFFu);
    out[2 * k] = c;
    out[2 * k + 1] = c * c;
  }
}

/// `sums`: the kDoubles values of encode() summed over `ranks` ranks.
inline bool same(const double* sums, int ranks) {
  __extension__ using u128 = unsigned __int128;
  for (std::size_t k = 0; k < 4; ++k) {
    const u128 s1 = static_cast<u128>(static_cast<std::uint64_t>(sums[2 * k]));
    const u128 s2 = static_cast<u128>(static_cast<std::uint64_t>(sums[2 * k + 1]));
    if (static_cast<u128>(ranks) * s2 != s1 * s1) return false;
  }
  return true;
}

}  // namespace shardopt::same_value
