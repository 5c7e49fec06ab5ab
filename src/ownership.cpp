// ownership.cpp: the owner rule of whole-tensor ownership and the ragged cut of every bucket
// (see ownership.hpp).
#include "shardopt/ownership.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <tuple>

#include "shardopt/error.hpp"
#include "shardopt/layout.hpp"

namespace shardopt {

const char* ownership_name(Ownership o) noexcept {
  switch (o) {
    case Ownership::Flat: return "flat";
    case Ownership::Whole: return "whole";
  }
  return "invalid";
}

std::uint64_t newton_schulz_flops(std::size_t rows, std::size_t cols, int iterations) {
  const std::uint64_t m = std::min(rows, cols), n = std::max(rows, cols);
  const std::uint64_t per_iteration = 4 * m * m * n + 2 * m * m * m;
  return per_iteration * static_cast<std::uint64_t>(iterations < 0 ? 0 : iterations);
}

ParamCost param_cost(const ParamInfo& p, bool matrix, double state_bytes_per_elem) {
  require(std::isfinite(state_bytes_per_elem) && state_bytes_per_elem >= 0,
          Status::InvalidArgument,
          "param_cost: parameter '" + p.name + "' has invalid state bytes per element");
  require(!matrix || (p.rows > 1 && p.cols > 1), Status::InvalidArgument,
          "param_cost: parameter '" + p.name + "' is a matrix but has no 2-D shape (" +
              std::to_string(p.rows) + " x " + std::to_string(p.cols) +
              "; give it one in add_param)");
  ParamCost c;
  c.matrix = matrix;
  c.ns_flops = matrix ? newton_schulz_flops(p.rows, p.cols) : 0;
  c.state_bytes_per_elem = state_bytes_per_elem;
  return c;
}

namespace {

std::uint64_t state_of(const ParamCost& c, std::size_t elems) {
  return static_cast<std::uint64_t>(std::llround(static_cast<double>(elems) * c.state_bytes_per_elem));
}

Spread spread_of(const std::vector<RankLoad>& ranks, double (*get)(const RankLoad&)) {
  Spread s;
  for (const RankLoad& r : ranks) {
    const double v = get(r);
    s.max = std::max(s.max, v);
    s.mean += v;
  }
  s.mean /= static_cast<double>(ranks.size());
  return s;
}

}  // namespace

OwnerPlan assign_owners(const FlatLayout& layout, const std::vector<ParamCost>& costs,
                        const OwnerOptions& options) {
  require(layout.built(), Status::InvalidState, "assign_owners: the layout is not built");
  require(layout.ownership() == Ownership::Whole, Status::InvalidState,
          "assign_owners: the layout is not a Whole layout (set_ownership before build: it "
          "gives parameters larger than a bucket buckets of their own)");
  require(costs.size() == layout.num_params(), Status::InvalidArgument,
          "assign_owners: " + std::to_string(costs.size()) + " costs for " +
              std::to_string(layout.num_params()) + " parameters");
  const int world = layout.world_size();
  const std::size_t n = static_cast<std::size_t>(world);
  const std::size_t align = layout.align_elems();
  const std::vector<ParamInfo>& params = layout.params();

  OwnerPlan plan;
  plan.world_size = world;
  plan.owner.assign(params.size(), kAllRanks);
  plan.flat.resize(params.size());
  plan.ranks.assign(n, RankLoad{});
  std::vector<RankLoad>& load = plan.ranks;

  const auto spanning = [&](std::size_t i) { return params[i].buckets.size() > 1; };
  for (std::size_t i = 0; i < params.size(); ++i) {
    plan.flat[i] = params[i].flat;
    if (!spanning(i)) continue;
    ++plan.spanning_params;
    require(!costs[i].matrix, Status::InvalidArgument,
            "assign_owners: matrix parameter '" + params[i].name + "' (" +
                std::to_string(params[i].numel) + " elements) spans " +
                std::to_string(params[i].buckets.size()) + " buckets of " +
                std::to_string(layout.bucket_capacity()) +
                " elements; whole-tensor ownership needs every matrix inside one bucket "
                "(raise bucket_elems to at least its size)");
  }

  // 1. What is fixed before the rule: the equal slices of the spanning parameters' buckets.
  plan.buckets.resize(layout.num_buckets());
  for (std::size_t b = 0; b < layout.num_buckets(); ++b) {
    const Bucket& bk = layout.bucket(b);
    OwnedBucket& ob = plan.buckets[b];
    ob.flat = bk.flat;
    std::size_t spanning_here = 0;
    for (std::size_t i = bk.first_param; i < bk.end_param; ++i) spanning_here += spanning(i);
    ob.equal = spanning_here > 0;
    require(!ob.equal || bk.num_params() == 1, Status::Internal,
            "assign_owners: internal error: bucket " + std::to_string(b) + " holds a piece of '" +
                params[bk.first_param].name + "' and other parameters");
    if (!ob.equal) continue;
    ++plan.equal_buckets;
    for (int r = 0; r < world; ++r)
      for (const ShardPiece& pc : layout.pieces_in(bk.slice(r)))
        load[static_cast<std::size_t>(r)].state_bytes += state_of(costs[pc.param], pc.flat.size());
  }

  // 2. The rule: longest processing time first over the whole parameters.
  std::vector<std::size_t> items;
  for (std::size_t i = 0; i < params.size(); ++i)
    if (!spanning(i)) items.push_back(i);
  std::vector<std::uint64_t> state(params.size());
  for (std::size_t i = 0; i < params.size(); ++i) state[i] = state_of(costs[i], params[i].numel);
  std::sort(items.begin(), items.end(), [&](std::size_t x, std::size_t y) {
    return std::make_tuple(costs[y].ns_flops, state[y], x) <
           std::make_tuple(costs[x].ns_flops, state[x], y);
  });
  for (const std::size_t i : items) {
    const bool by_state = options.elementwise_by_state && costs[i].ns_flops == 0;
    const auto key = [&](std::size_t r) {
      return by_state ? std::make_tuple(load[r].state_bytes, load[r].ns_flops, r)
                      : std::make_tuple(load[r].ns_flops, load[r].state_bytes, r);
    };
    std::size_t best = 0;
    for (std::size_t r = 1; r < n; ++r)
      if (key(r) < key(best)) best = r;
    plan.owner[i] = static_cast<int>(best);
    load[best].ns_flops += costs[i].ns_flops;
    load[best].state_bytes += state[i];
    load[best].matrices += costs[i].matrix ? 1 : 0;
  }

  // 3. The cut: in each ragged bucket, its parameters by owner.
  for (std::size_t b = 0; b < layout.num_buckets(); ++b) {
    const Bucket& bk = layout.bucket(b);
    OwnedBucket& ob = plan.buckets[b];
    ob.counts.assign(n, 0);
    ob.offsets.assign(n, 0);
    if (ob.equal) {
      ob.order.push_back(bk.first_param);
      for (std::size_t r = 0; r < n; ++r) {
        ob.counts[r] = bk.slice_elems;
        ob.offsets[r] = r * bk.slice_elems;
      }
    } else {
      std::vector<std::size_t> whole;
      for (std::size_t i = bk.first_param; i < bk.end_param; ++i) whole.push_back(i);
      std::stable_sort(whole.begin(), whole.end(),
                       [&](std::size_t x, std::size_t y) { return plan.owner[x] < plan.owner[y]; });
      std::vector<Range> ranges(n);
      std::size_t cursor = bk.flat.begin;
      std::size_t k = 0;
      for (std::size_t r = 0; r < n; ++r) {
        ranges[r].begin = cursor;
        for (; k < whole.size() && plan.owner[whole[k]] == static_cast<int>(r); ++k) {
          const std::size_t i = whole[k];
          ob.order.push_back(i);
          plan.flat[i] = Range{cursor, cursor + params[i].numel};
          cursor = FlatLayout::round_up(cursor + params[i].numel, align);
        }
        ranges[r].end = cursor;
      }
      // The padding goes to the last rank with elements here (there is one: the bucket
      // holds a whole parameter).
      std::size_t last = n - 1;
      while (last > 0 && ranges[last].empty()) --last;
      ranges[last].end = bk.flat.end;
      for (std::size_t r = last + 1; r < n; ++r) ranges[r] = Range{bk.flat.end, bk.flat.end};
      for (std::size_t r = 0; r < n; ++r) {
        ob.counts[r] = ranges[r].size();
        ob.offsets[r] = ranges[r].begin - bk.flat.begin;
      }
    }
    for (std::size_t r = 0; r < n; ++r) load[r].elems += ob.counts[r];
  }

  plan.elems = spread_of(load, [](const RankLoad& r) { return static_cast<double>(r.elems); });
  plan.state_bytes =
      spread_of(load, [](const RankLoad& r) { return static_cast<double>(r.state_bytes); });
  plan.ns_flops = spread_of(load, [](const RankLoad& r) { return static_cast<double>(r.ns_flops); });
  return plan;
}

}  // namespace shardopt
