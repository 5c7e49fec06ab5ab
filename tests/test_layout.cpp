// test_layout.cpp: flat layout, padding, buckets, slices and local coordinates.
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

// Checks every invariant of a built layout (see layout.hpp).
void check_layout(const FlatLayout& l) {
  const std::size_t n = static_cast<std::size_t>(l.world_size());
  const std::size_t q = FlatLayout::bucket_quantum(l.world_size());
  std::size_t sum = 0;
  for (std::size_t i = 0; i < l.num_params(); ++i) {
    const ParamInfo& p = l.param(i);
    EXPECT_EQ(p.flat.begin % FlatLayout::kAlignElems, 0u) << p.name;
    EXPECT_EQ(p.flat.size(), p.numel);
    if (i > 0) EXPECT_GE(p.flat.begin, l.param(i - 1).flat.end);
    // Its buckets are exactly those it has elements in.
    for (std::size_t b = 0; b < l.num_buckets(); ++b) {
      const bool touches = !p.flat.intersect(l.bucket(b).flat).empty();
      EXPECT_EQ(touches, p.buckets.contains(b)) << p.name << " bucket " << b;
    }
    sum += p.numel;
  }
  EXPECT_EQ(sum, l.unpadded_size());
  // Buckets tile the buffer in backward order; each is a multiple of N x 64 and at most the
  // capacity; slices are equal and aligned; local offsets are flat / N.
  std::size_t end = l.padded_size();
  for (std::size_t b = 0; b < l.num_buckets(); ++b) {
    const Bucket& bk = l.bucket(b);
    EXPECT_EQ(bk.flat.end, end);
    end = bk.flat.begin;
    EXPECT_EQ(bk.flat.begin % q, 0u);
    EXPECT_EQ(bk.flat.size() % q, 0u);
    EXPECT_GT(bk.flat.size(), 0u);
    EXPECT_LE(bk.flat.size(), l.bucket_capacity());
    EXPECT_EQ(bk.slice_elems * n, bk.flat.size());
    EXPECT_EQ(bk.slice_elems % FlatLayout::kAlignElems, 0u);
    EXPECT_EQ(bk.local_begin, bk.flat.begin / n);
    for (int r = 0; r < l.world_size(); ++r) EXPECT_EQ(bk.slice(r).size(), bk.slice_elems);
    for (std::size_t i = bk.first_param; i < bk.end_param; ++i)
      EXPECT_TRUE(l.param(i).buckets.contains(b));
  }
  EXPECT_EQ(end, 0u);
  EXPECT_EQ(l.padded_size(), l.shard_size() * n);
  // Owned pieces: every element of every parameter owned exactly once, local ranges inside
  // the rank's local arrays and in the slice's place.
  std::vector<std::size_t> seen(l.num_params(), 0);
  for (int r = 0; r < l.world_size(); ++r) {
    std::size_t last_local = 0;
    for (const ShardPiece& pc : l.owned_pieces(r)) {
      const Bucket& bk = l.bucket(l.bucket_at(pc.flat.begin));
      EXPECT_EQ(l.owner_of(pc.flat.begin), r);
      EXPECT_EQ(l.owner_of(pc.flat.end - 1), r);
      EXPECT_EQ(pc.local.begin, bk.local_begin + (pc.flat.begin - bk.slice(r).begin));
      EXPECT_EQ(pc.local.size(), pc.flat.size());
      EXPECT_GE(pc.local.begin, last_local);
      EXPECT_LE(pc.local.end, l.shard_size());
      last_local = pc.local.end;
      EXPECT_EQ(pc.in_param.begin + l.param(pc.param).flat.begin, pc.flat.begin);
      seen[pc.param] += pc.flat.size();
    }
  }
  for (std::size_t i = 0; i < l.num_params(); ++i) EXPECT_EQ(seen[i], l.param(i).numel);
}

TEST(Layout, InvariantsAtOneToFiveRanksAndManyBucketSizes) {
  const std::size_t sizes[] = {1, 1000, 65, 7, 3, 500, 64, 1, 129, 2048, 17, 5000, 10};
  for (int world = 1; world <= 5; ++world)
    for (std::size_t bucket : {std::size_t{1}, std::size_t{100}, std::size_t{700},
                               std::size_t{1000}, std::size_t{4096}, std::size_t{1} << 20}) {
      FlatLayout l;
      for (std::size_t i = 0; i < std::size(sizes); ++i)
        l.add("p" + std::to_string(i), sizes[i], static_cast<int>(i % 2));
      l.build(world, bucket);
      SCOPED_TRACE("world " + std::to_string(world) + ", bucket " + std::to_string(bucket));
      check_layout(l);
    }
}

TEST(Layout, ExactGeometryOfASmallCase) {
  // 3 ranks (quantum 192), buckets of 500 -> capacity 576.
  FlatLayout l;
  l.add("a", 100, 0);   // [0, 100)
  l.add("b", 300, 0);   // [128, 428): fits the first bucket
  l.add("c", 200, 0);   // would end at 648 > 576: closes the bucket at 576, c = [576, 776)
  l.add("d", 1300, 0);  // [832, 2132): larger than a bucket, cut at 576 + 576 = 1152, 1728
  l.build(3, 500);
  ASSERT_EQ(l.num_buckets(), 4u);
  EXPECT_EQ(l.param(2).flat, (Range{576, 776}));
  EXPECT_EQ(l.param(3).flat, (Range{832, 2132}));
  EXPECT_EQ(l.bucket(3).flat, (Range{0, 576}));       // a, b
  EXPECT_EQ(l.bucket(2).flat, (Range{576, 1152}));    // c, d's head
  EXPECT_EQ(l.bucket(1).flat, (Range{1152, 1728}));   // d's middle
  EXPECT_EQ(l.bucket(0).flat, (Range{1728, 2304}));   // d's tail, padded to 192
  EXPECT_EQ(l.padded_size(), 2304u);
  EXPECT_EQ(l.param(3).buckets, (Range{0, 3}));
  EXPECT_EQ(l.bucket(2).first_param, 2u);
  EXPECT_EQ(l.bucket(2).end_param, 4u);
  EXPECT_EQ(l.bucket(0).slice(2), (Range{2112, 2304}));
  EXPECT_EQ(l.owner_of(2131), 2);
  EXPECT_EQ(l.owner_of(1727), 2);
  EXPECT_EQ(l.owner_of(1152), 0);
  check_layout(l);
}

TEST(Layout, RanksWhoseSlicesAreAllPadding) {
  // Two tiny parameters in one bucket of 256 at 4 ranks (slices of 64): x [0, 10) is rank 0's,
  // y [64, 74) rank 1's, and ranks 2 and 3 own only padding.
  FlatLayout l;
  l.add("x", 10, 0);
  l.add("y", 10, 0);
  l.build(4, 200);
  ASSERT_EQ(l.num_buckets(), 1u);
  EXPECT_EQ(l.padded_size(), 256u);
  ASSERT_EQ(l.owned_pieces(0).size(), 1u);
  EXPECT_EQ(l.owned_pieces(0)[0].param, 0u);
  ASSERT_EQ(l.owned_pieces(1).size(), 1u);
  EXPECT_EQ(l.owned_pieces(1)[0].param, 1u);
  EXPECT_EQ(l.owned_pieces(1)[0].local, (Range{0, 10}));
  for (int r = 2; r < 4; ++r) EXPECT_TRUE(l.owned_pieces(r).empty()) << r;
  check_layout(l);
}

TEST(Layout, FingerprintSeesWorldSizeAndBucketSize) {
  auto make = [](int world, std::size_t bucket) {
    FlatLayout l;
    l.add("w", 1000, 0);
    l.build(world, bucket);
    return l.fingerprint();
  };
  EXPECT_EQ(make(2, 100), make(2, 100));
  EXPECT_NE(make(2, 100), make(3, 100));
  EXPECT_NE(make(2, 100), make(2, 200));
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
  EXPECT_THROW(empty.build(2, 100), Error);
  FlatLayout one;
  one.add("w", 4, 0);
  EXPECT_THROW(one.build(0, 100), Error);
  one.build(2, 0);  // 0: the automatic bucket size
  EXPECT_EQ(one.bucket_elems(), FlatLayout::auto_bucket_elems(4));
}

TEST(Layout, FingerprintSeesNamesSizesOrderAndGroups) {
  auto make = [](const char* a, std::size_t na, const char* b, std::size_t nb, int gb) {
    FlatLayout l;
    l.add(a, na, 0);
    l.add(b, nb, gb);
    l.build(2, 1000);
    return l.fingerprint();
  };
  const auto base = make("w", 10, "b", 3, 0);
  EXPECT_EQ(base, make("w", 10, "b", 3, 0));
  EXPECT_NE(base, make("w", 10, "c", 3, 0));
  EXPECT_NE(base, make("w", 11, "b", 3, 0));
  EXPECT_NE(base, make("b", 3, "w", 10, 0));
  EXPECT_NE(base, make("w", 10, "b", 3, 1));
}
