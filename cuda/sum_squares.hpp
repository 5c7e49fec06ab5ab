// sum_squares.hpp: a sum of squares in fp64 whose summation order is fixed by n alone.
//
// The order is a fixed tree, evaluated level by level with one work item per node:
//   1. lanes: element block b (kNormBlock elements) is split into kNormLanes strided lanes;
//      lane j sums x[b*B + j], x[b*B + j + L], ... in order (adjacent work items read
//      adjacent elements, so GPU loads coalesce);
//   2. groups: consecutive partials are summed kNormFanIn at a time, in order, level after
//      level, until at most kNormFanIn remain;
//   3. the caller adds those few partials on the host, in order (combine_in_order).
// No atomics and no scheduling-dependent combine, so the result is identical run to run, on
// any GPU and in the Thrust OpenMP build; sum_squares_serial() evaluates the same tree on
// one thread and is the bitwise oracle of the tests.
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "shardopt/element_ops.hpp"
#include "shardopt/host_device.hpp"

namespace shardopt::dev {

inline constexpr std::size_t kNormBlock = 65536;
inline constexpr std::size_t kNormLanes = 256;
inline constexpr std::size_t kNormFanIn = 256;

SHARDOPT_HD constexpr std::size_t ceil_div(std::size_t a, std::size_t b) {
  return (a + b - 1) / b;
}

/// Level-1 partials for n elements.
constexpr std::size_t norm_lane_count(std::size_t n) {
  return ceil_div(n, kNormBlock) * kNormLanes;
}

/// Doubles of scratch the whole tree needs (every level is kept).
constexpr std::size_t norm_scratch_count(std::size_t n) {
  std::size_t count = norm_lane_count(n), total = count;
  while (count > kNormFanIn) {
    count = ceil_div(count, kNormFanIn);
    total += count;
  }
  return total;
}

/// Values a lane loads before it adds them: independent loads in flight per thread, so the
/// kernel is not bound by the latency of one load at a time. The additions stay in element
/// order, so the result is the same as one load per iteration.
inline constexpr std::size_t kNormLoadsInFlight = 8;

/// Level 1: work item t is lane t % kNormLanes of block t / kNormLanes.
struct LaneSquares {
  const float* x;
  std::size_t n;
  SHARDOPT_HD double operator()(std::size_t t) const {
    constexpr std::size_t L = kNormLanes, K = kNormLoadsInFlight;
    const std::size_t first = (t / kNormLanes) * kNormBlock + t % kNormLanes;
    const std::size_t block_end = first - t % kNormLanes + kNormBlock;
    const std::size_t end = block_end < n ? block_end : n;
    double acc = 0.0;
    std::size_t i = first;
    for (; i + (K - 1) * L < end; i += K * L) {
      float v[K];
      for (std::size_t j = 0; j < K; ++j) v[j] = x[i + j * L];
      for (std::size_t j = 0; j < K; ++j) acc += ops::SquareF64{}(v[j]);
    }
    for (; i < end; i += L) acc += ops::SquareF64{}(x[i]);
    return acc;
  }
};

/// Where the last level lies in the scratch (offset in doubles) and how many partials it
/// has (<= kNormFanIn): the caller adds those with combine_in_order().
struct NormLastLevel {
  std::size_t offset;
  std::size_t count;
};
constexpr NormLastLevel norm_last_level(std::size_t n) {
  std::size_t count = norm_lane_count(n), offset = 0;
  while (count > kNormFanIn) {
    offset += count;
    count = ceil_div(count, kNormFanIn);
  }
  return {offset, count};
}

/// Level 2+: work item g sums in[g*F, min((g+1)*F, count)) in order.
struct GroupSum {
  const double* in;
  std::size_t count;
  SHARDOPT_HD double operator()(std::size_t g) const {
    const std::size_t b = g * kNormFanIn;
    const std::size_t e = b + kNormFanIn < count ? b + kNormFanIn : count;
    double acc = 0.0;
    for (std::size_t i = b; i < e; ++i) acc += in[i];
    return acc;
  }
};

/// Step 3: the last partials (host memory), in order.
inline double combine_in_order(const double* partials, std::size_t count) {
  double acc = 0.0;
  for (std::size_t i = 0; i < count; ++i) acc += partials[i];
  return acc;
}

// ---- several slices at once (the step's norm over every bucket) --------------------------
// Each slice gets its own tree, exactly the one above, in its own region of one scratch; the
// trees advance together, one launch per level, and one more launch adds each slice's last
// level in order. Per slice, the same additions in the same order: the same bits as one
// sum_squares per slice.

struct NormSlice {
  const float* x;
  std::size_t n;
};

/// One slice's work at one level: level 1 reads `x` (`n` elements) into lanes, a later level
/// groups `count` partials from `in`; results go to out[0, items). `first` is the slice's
/// first work item in its level's launch (entries of a level are sorted by it).
struct NormLevelEntry {
  const float* x;  // level 1; nullptr at later levels
  std::size_t n;
  const double* in;  // later levels
  std::size_t count;
  double* out;
  std::size_t first;
};

/// A slice's last level: at most kNormFanIn partials, added in order.
struct NormSliceLast {
  const double* in;
  std::size_t count;
};

/// Work item t of one level's launch: the entry whose items hold t.
struct NormLevelItem {
  const NormLevelEntry* entries;
  std::size_t num_entries;
  SHARDOPT_HD void operator()(std::size_t t) const {
    std::size_t lo = 0, hi = num_entries;  // the last entry with first <= t
    while (hi - lo > 1) {
      const std::size_t mid = lo + (hi - lo) / 2;
      if (entries[mid].first <= t) lo = mid;
      else hi = mid;
    }
    const NormLevelEntry& e = entries[lo];
    const std::size_t local = t - e.first;
    e.out[local] = e.x != nullptr ? LaneSquares{e.x, e.n}(local) : GroupSum{e.in, e.count}(local);
  }
};

/// Slice s's sum: combine_in_order's additions, on the device.
struct NormCombine {
  const NormSliceLast* last;
  double* result;
  SHARDOPT_HD void operator()(std::size_t s) const {
    double acc = 0.0;
    for (std::size_t i = 0; i < last[s].count; ++i) acc += last[s].in[i];
    result[s] = acc;
  }
};

/// One level's launch: entries [first_entry, first_entry + num_entries), `items` work items.
struct NormLevelLaunch {
  std::size_t first_entry;
  std::size_t num_entries;
  std::size_t items;
};

/// The host's plan of the batched trees in `scratch` (norm_plan_scratch_count doubles).
struct NormPlan {
  std::vector<NormLevelEntry> entries;  // level 1's, then level 2's, ...
  std::vector<NormLevelLaunch> levels;
  std::vector<NormSliceLast> last;      // one per slice ({nullptr, 0} for an empty one)
};

inline std::size_t norm_plan_scratch_count(std::span<const NormSlice> slices) {
  std::size_t total = 0;
  for (const NormSlice& s : slices) total += norm_scratch_count(s.n);
  return total;
}

inline NormPlan plan_sum_squares(std::span<const NormSlice> slices, double* scratch) {
  NormPlan plan;
  plan.last.assign(slices.size(), NormSliceLast{nullptr, 0});
  // Where each slice's tree stands: the level just written (in, count).
  struct Cursor {
    double* in;
    std::size_t count;
  };
  std::vector<Cursor> at(slices.size(), Cursor{nullptr, 0});
  double* region = scratch;
  NormLevelLaunch level{0, 0, 0};
  for (std::size_t s = 0; s < slices.size(); ++s) {
    const std::size_t lanes = norm_lane_count(slices[s].n);
    if (lanes == 0) continue;
    plan.entries.push_back({slices[s].x, slices[s].n, nullptr, 0, region, level.items});
    at[s] = {region, lanes};
    level.items += lanes;
    region += norm_scratch_count(slices[s].n);
  }
  while (true) {
    level.num_entries = plan.entries.size() - level.first_entry;
    if (level.num_entries == 0) break;
    plan.levels.push_back(level);
    level = {plan.entries.size(), 0, 0};
    for (std::size_t s = 0; s < slices.size(); ++s) {
      if (at[s].count <= kNormFanIn) continue;
      const std::size_t groups = ceil_div(at[s].count, kNormFanIn);
      double* out = at[s].in + at[s].count;
      plan.entries.push_back({nullptr, 0, at[s].in, at[s].count, out, level.items});
      at[s] = {out, groups};
      level.items += groups;
    }
  }
  for (std::size_t s = 0; s < slices.size(); ++s) plan.last[s] = {at[s].in, at[s].count};
  return plan;
}

/// The same tree on one host thread; `scratch` holds norm_scratch_count(n) doubles.
inline double sum_squares_serial(const float* x, std::size_t n, double* scratch) {
  std::size_t count = norm_lane_count(n);
  for (std::size_t t = 0; t < count; ++t) scratch[t] = LaneSquares{x, n}(t);
  double* in = scratch;
  while (count > kNormFanIn) {
    const std::size_t groups = ceil_div(count, kNormFanIn);
    for (std::size_t g = 0; g < groups; ++g) in[count + g] = GroupSum{in, count}(g);
    in += count;
    count = groups;
  }
  return combine_in_order(in, count);
}

}  // namespace shardopt::dev
