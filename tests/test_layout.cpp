// test_layout.cpp: flat layout, padding, shard ranges, pieces and buckets.
#include <gtest/gtest.h>

#include "shardopt/error.hpp"
#include "shardopt/layout.hpp"

using namespace shardopt;

TEST(Range, IntersectAndShift) {
  EXPECT_EQ((Range{2, 10}.intersect(Range{5, 20})), (Range{5, 10}));
  EXPECT_TRUE((Range{2, 4}.intersect(Range{4, 8})).empty());
  EXPECT_EQ((Range{5, 9}.shifted_down(5)), (Range{0, 4}));
  EXPECT_EQ((Range{3, 3}.size()), 0u);
}

TEST(Layout, AlignedStartsAndEqualShards) {
  for (int world = 1; world <= 5; ++world) {
    FlatLayout l;
    l.add("a", 1, 0);
    l.add("b", 1000, 0);
    l.add("c", 65, 1);
    l.add("d", 7, 0);
    l.build(world);
    for (const ParamInfo& p : l.params()) EXPECT_EQ(p.flat.begin % FlatLayout::kAlignElems, 0u);
    EXPECT_EQ(l.unpadded_size(), 1073u);
    EXPECT_EQ(l.padded_size() % (FlatLayout::kAlignElems * static_cast<std::size_t>(world)), 0u);
    EXPECT_GE(l.padded_size(), l.params().back().flat.end);
    EXPECT_LT(l.padded_size() - l.params().back().flat.end,
              FlatLayout::kAlignElems * static_cast<std::size_t>(world));
    // Shards tile the buffer, each aligned.
    std::size_t covered = 0;
    for (int r = 0; r < world; ++r) {
      const Range s = l.shard_range(r);
      EXPECT_EQ(s.begin, covered);
      EXPECT_EQ(s.size(), l.shard_size());
      EXPECT_EQ(s.begin % FlatLayout::kAlignElems, 0u);
      covered = s.end;
    }
    EXPECT_EQ(covered, l.padded_size());
  }
}

TEST(Layout, PiecesCoverEveryParameterExactlyOnce) {
  FlatLayout l;
  const std::size_t sizes[] = {3, 500, 64, 1, 129, 2048, 17};
  for (std::size_t i = 0; i < std::size(sizes); ++i) l.add("p" + std::to_string(i), sizes[i], 0);
  l.build(3);
  std::vector<std::size_t> seen(l.num_params(), 0);
  bool straddles = false;
  for (int r = 0; r < 3; ++r) {
    const Range shard = l.shard_range(r);
    for (const ShardPiece& pc : l.pieces_in(shard)) {
      EXPECT_EQ(pc.local.begin + shard.begin, pc.flat.begin);
      EXPECT_EQ(pc.in_param.begin + l.param(pc.param).flat.begin, pc.flat.begin);
      seen[pc.param] += pc.flat.size();
      straddles = straddles || pc.flat.size() < l.param(pc.param).numel;
    }
  }
  for (std::size_t i = 0; i < l.num_params(); ++i) EXPECT_EQ(seen[i], sizes[i]);
  EXPECT_TRUE(straddles) << "the test layout should have a parameter across shards";
}

TEST(Layout, BucketsTileTheBufferInBackwardOrder) {
  FlatLayout l;
  for (int i = 0; i < 10; ++i) l.add("p" + std::to_string(i), 100 + 37 * i, 0);
  l.add("huge", 5000, 0);
  l.add("tail", 10, 0);
  l.build(2);
  const auto buckets = l.make_buckets(1000);
  ASSERT_FALSE(buckets.empty());
  EXPECT_EQ(buckets.front().flat.end, l.padded_size());
  EXPECT_EQ(buckets.back().flat.begin, 0u);
  EXPECT_EQ(buckets.front().end_param, l.num_params());
  for (std::size_t k = 0; k + 1 < buckets.size(); ++k) {
    EXPECT_EQ(buckets[k + 1].flat.end, buckets[k].flat.begin);
    EXPECT_EQ(buckets[k + 1].end_param, buckets[k].first_param);
  }
  for (const Bucket& b : buckets)
    if (b.end_param - b.first_param > 1) EXPECT_LE(b.flat.size(), 1000u);
}

TEST(Layout, RejectsBadRegistrations) {
  FlatLayout l;
  l.add("w", 4, 0);
  EXPECT_THROW(l.add("w", 4, 0), Error);     // duplicate
  EXPECT_THROW(l.add("", 4, 0), Error);      // empty name
  EXPECT_THROW(l.add("z", 0, 0), Error);     // zero size
  EXPECT_THROW(l.add("n", static_cast<std::size_t>(-5), 0), Error);  // negative size cast
  try {
    l.add("w", 4, 0);
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::InvalidArgument);
    EXPECT_NE(std::string(e.what()).find("duplicate"), std::string::npos);
  }
  FlatLayout empty;
  EXPECT_THROW(empty.build(2), Error);
}

TEST(Layout, FingerprintSeesNamesSizesOrderAndGroups) {
  auto make = [](const char* a, std::size_t na, const char* b, std::size_t nb, int gb) {
    FlatLayout l;
    l.add(a, na, 0);
    l.add(b, nb, gb);
    l.build(2);
    return l.fingerprint();
  };
  const auto base = make("w", 10, "b", 3, 0);
  EXPECT_EQ(base, make("w", 10, "b", 3, 0));
  EXPECT_NE(base, make("w", 10, "c", 3, 0));
  EXPECT_NE(base, make("w", 11, "b", 3, 0));
  EXPECT_NE(base, make("b", 3, "w", 10, 0));
  EXPECT_NE(base, make("w", 10, "b", 3, 1));
}
