// test_same_value.cpp: the exact "every rank holds the same value" test of same_value.hpp,
// with the sums over ranks formed here as an all-reduce would form them (in double); and the
// wording of messages about several ranks (describe.hpp).
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "comm/describe.hpp"
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

// A timeout report's "by node" part: nodes in order of first appearance, whole nodes said so.
TEST(Describe, RanksByNode) {
  const std::vector<int> node_of = {0, 0, 1, 1, 2};
  const std::vector<std::string> host_of = {"a", "a", "b", "b", "c"};
  EXPECT_EQ(ranks_by_node({2, 3, 1}, node_of, host_of),
            "node 1 (host b): ranks 2, 3 (every rank of the node); "
            "node 0 (host a): rank 1 (1 of its 2 ranks)");
  EXPECT_EQ(ranks_by_node({4}, node_of, host_of), "node 2 (host c): rank 4 (every rank of the node)");
  EXPECT_EQ(ranks_by_node({}, node_of, host_of), "");
}
