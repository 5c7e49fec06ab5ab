// test_same_value.cpp: the exact "every rank holds the same value" test of same_value.hpp,
// with the sums over ranks formed here as an all-reduce would form them (in double).
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "comm/same_value.hpp"

using namespace shardopt;

namespace {

// Sums encode(value of rank r) over ranks, `count[i]` ranks holding values[i].
bool same_over(const std::vector<std::uint64_t>& values, const std::vector<int>& count) {
  double sums[same_value::kDoubles] = {};
  int ranks = 0;
  for (std::size_t i = 0; i < values.size(); ++i) {
    double enc[same_value::kDoubles];
    same_value::encode(values[i], enc);
    for (std::size_t k = 0; k < same_value::kDoubles; ++k) sums[k] += enc[k] * count[i];
    ranks += count[i];
  }
  return same_value::same(sums, ranks);
}

}  // namespace

TEST(SameValue, AgreesExactlyWhenEveryRankHoldsTheSameValue) {
  const std::uint64_t v = 0xFFFF'FFFF'FFFF'FFFFull;  // every chunk at its largest
  for (const int n : {1, 2, 3, 1000, same_value::kMaxRanks - 1})
    EXPECT_TRUE(same_over({v}, {n})) << n << " ranks";
  EXPECT_TRUE(same_over({0}, {same_value::kMaxRanks - 1}));
}

TEST(SameValue, OneDifferentBitOnOneRankIsSeenAtAnyRankCount) {
  const std::uint64_t v = 0x0123'4567'89AB'CDEFull;
  for (const int n : {2, 3, 4, 1000, same_value::kMaxRanks - 1})
    for (int bit = 0; bit < 64; bit += 7)
      EXPECT_FALSE(same_over({v, v ^ (std::uint64_t{1} << bit)}, {n - 1, 1}))
          << n << " ranks, bit " << bit;
  // Values whose mean one rank holds (1, 2, 3): equal sums are not enough.
  EXPECT_FALSE(same_over({1, 2, 3}, {1, 1, 1}));
  const int half = same_value::kMaxRanks / 2;
  EXPECT_FALSE(same_over({0xFFFF, 0, 0x7FFF}, {half, half - 2, 1}));
}
