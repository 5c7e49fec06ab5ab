// layout.cpp: flat-buffer layout, shard ranges and buckets.
#include "shardopt/layout.hpp"

#include <algorithm>
#include <limits>
#include <sstream>

#include "shardopt/error.hpp"

namespace shardopt {

std::uint64_t fnv1a64(const void* data, std::size_t bytes, std::uint64_t seed) {
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint64_t h = seed;
  for (std::size_t i = 0; i < bytes; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

std::size_t FlatLayout::add(std::string_view name, std::size_t numel, int group, int unit,
                            Shape2D shape) {
  require(!built(), Status::InvalidState, "add_param: the layout is already finalized");
  require(!name.empty(), Status::InvalidArgument, "add_param: the parameter name is empty");
  require(numel > 0, Status::InvalidArgument,
          "add_param: parameter '" + std::string(name) + "' has zero elements");
  require(numel < (std::numeric_limits<std::size_t>::max() >> 8), Status::InvalidArgument,
          "add_param: parameter '" + std::string(name) + "' is too large (negative size?)");
  require(group >= 0, Status::InvalidArgument,
          "add_param: parameter '" + std::string(name) + "' has a negative group");
  require(find(name) == params_.size(), Status::InvalidArgument,
          "add_param: duplicate parameter name '" + std::string(name) + "'");
  const int last_unit = params_.empty() ? 0 : params_.back().unit;
  require(unit == last_unit || (unit == last_unit + 1 && !params_.empty()),
          Status::InvalidArgument,
          "add_param: parameter '" + std::string(name) + "' is in unit " + std::to_string(unit) +
              ", but units are contiguous: the previous parameter is in unit " +
              std::to_string(last_unit));
  const bool shaped = shape.rows != 0 || shape.cols != 0;
  require(!shaped || (shape.rows > 0 && numel % shape.rows == 0 &&
                      numel / shape.rows == shape.cols),
          Status::InvalidArgument,
          "add_param: parameter '" + std::string(name) + "' has " + std::to_string(numel) +
              " elements, but its shape is " + std::to_string(shape.rows) + " x " +
              std::to_string(shape.cols));
  index_.emplace(std::string(name), params_.size());
  params_.push_back(ParamInfo{std::string(name), numel, group, unit, Range{}, Range{},
                              shaped ? shape.rows : 1, shaped ? shape.cols : numel});
  unpadded_ += numel;
  return params_.size() - 1;
}

void FlatLayout::set_ownership(Ownership ownership) {
  require(!built(), Status::InvalidState, "set_ownership: the layout is already built");
  require(ownership == Ownership::Flat || ownership == Ownership::Whole, Status::InvalidArgument,
          "set_ownership: invalid ownership " + std::to_string(static_cast<int>(ownership)));
  ownership_ = ownership;
}

void FlatLayout::build(int world_size, std::size_t bucket_elems, std::size_t max_auto_elems,
                       std::size_t align) {
  require(!built(), Status::InvalidState, "the layout is already built");
  require(world_size > 0, Status::InvalidArgument, "world size must be positive");
  require(!params_.empty(), Status::InvalidState, "finalize: no parameters were registered");
  require(align == kAlignElems || align == kQuantBlockElems, Status::InvalidArgument,
          "layout alignment must be " + std::to_string(kAlignElems) + " or " +
              std::to_string(kQuantBlockElems) + " elements");
  if (bucket_elems == 0) bucket_elems = auto_bucket_elems(unpadded_, max_auto_elems);
  const std::size_t quantum = bucket_quantum(world_size, align);
  const std::size_t cap = bucket_capacity(bucket_elems, world_size, align);
  align_ = align;

  const bool whole = ownership_ == Ownership::Whole;
  // Forward pass: place parameters, close buckets (in flat order) as they fill.
  std::vector<Range> cuts;
  std::size_t open = 0;  // start of the bucket being filled
  std::size_t end = 0;   // end of the last parameter placed
  int unit = 0;
  for (ParamInfo& p : params_) {
    std::size_t start = param_start(end, align);
    if (p.unit != unit && end > open) {
      // A new unit: buckets never straddle units.
      const std::size_t close = round_up(end, quantum);
      cuts.push_back(Range{open, close});
      open = close;
      start = open;
    }
    unit = p.unit;
    // Whole ownership: a parameter larger than a bucket (element-wise: matrices are refused)
    // gets buckets of its own, so that each of its pieces is cut in equal slices and no
    // ragged bucket holds a piece of it (its pieces would be pinned to one rank).
    const bool alone = whole && p.numel > cap;
    if (start + p.numel - open > cap && (p.numel <= cap || alone) && start > open) {
      // It fits a bucket of its own but not the rest of this one (or must be alone): close
      // at its boundary.
      const std::size_t close = round_up(end, quantum);
      cuts.push_back(Range{open, close});
      open = close;
      start = open;
    }
    p.flat = Range{start, start + p.numel};
    // A parameter larger than the room left spans buckets, cut at multiples of the quantum.
    while (p.flat.end - open > cap) {
      cuts.push_back(Range{open, open + cap});
      open += cap;
    }
    end = p.flat.end;
    if (alone && end > open) {  // its last piece closes its own bucket
      const std::size_t close = round_up(end, quantum);
      cuts.push_back(Range{open, close});
      open = close;
      end = close;
    }
  }
  if (end > open) cuts.push_back(Range{open, round_up(end, quantum)});

  // Number the buckets in backward order and find the parameters touching each.
  buckets_.clear();
  for (std::size_t k = cuts.size(); k-- > 0;) {
    Bucket b;
    b.flat = cuts[k];
    b.slice_elems = b.flat.size() / static_cast<std::size_t>(world_size);
    b.local_begin = b.flat.begin / static_cast<std::size_t>(world_size);
    buckets_.push_back(b);
  }
  world_size_ = world_size;
  padded_ = cuts.back().end;
  bucket_elems_ = bucket_elems;
  capacity_ = cap;
  for (Bucket& b : buckets_) {
    b.first_param = params_.size();
    b.end_param = 0;
  }
  for (std::size_t i = 0; i < params_.size(); ++i) {
    ParamInfo& p = params_[i];
    const std::size_t lo = bucket_at(p.flat.end - 1), hi = bucket_at(p.flat.begin) + 1;
    p.buckets = Range{lo, hi};
    for (std::size_t b = lo; b < hi; ++b) {
      buckets_[b].first_param = std::min(buckets_[b].first_param, i);
      buckets_[b].end_param = std::max(buckets_[b].end_param, i + 1);
    }
  }
  units_.assign(static_cast<std::size_t>(params_.back().unit) + 1, Unit{});
  for (std::size_t i = params_.size(); i-- > 0;) {
    Unit& u = units_[static_cast<std::size_t>(params_[i].unit)];
    if (u.params.empty()) {  // the unit's last parameter: its lowest bucket
      u.params = Range{i, i + 1};
      u.buckets = params_[i].buckets;
    }
    u.params.begin = i;
    u.buckets.end = params_[i].buckets.end;
  }
  for (Unit& u : units_)
    u.flat = Range{buckets_[u.buckets.end - 1].flat.begin, buckets_[u.buckets.begin].flat.end};
}

std::size_t FlatLayout::max_unit_elems() const {
  std::size_t m = 0;
  for (const Unit& u : units_) m = std::max(m, u.flat.size());
  return m;
}

const ParamInfo& FlatLayout::param(std::size_t i) const {
  require(i < params_.size(), Status::InvalidArgument,
          "parameter index " + std::to_string(i) + " out of range (have " +
              std::to_string(params_.size()) + ")");
  return params_[i];
}

std::size_t FlatLayout::find(std::string_view name) const {
  const auto it = index_.find(std::string(name));
  return it == index_.end() ? params_.size() : it->second;
}

std::size_t FlatLayout::bucket_at(std::size_t flat) const {
  // Buckets are in decreasing flat order: the first whose begin is <= flat.
  const auto it = std::partition_point(buckets_.begin(), buckets_.end(),
                                       [flat](const Bucket& b) { return b.flat.begin > flat; });
  return static_cast<std::size_t>(it - buckets_.begin());
}

std::size_t Bucket::max_slice() const {
  if (!ragged()) return slice_elems;
  return *std::max_element(counts.begin(), counts.end());
}

int FlatLayout::owner_of(std::size_t flat) const {
  const Bucket& b = buckets_[bucket_at(flat)];
  if (b.ragged()) {
    for (int r = world_size_; r-- > 0;)  // the last rank whose range starts at or before it
      if (b.counts[static_cast<std::size_t>(r)] > 0 && b.slice(r).begin <= flat) return r;
    return 0;
  }
  return static_cast<int>((flat - b.flat.begin) / b.slice_elems);
}

std::vector<ShardPiece> FlatLayout::pieces_in(Range window) const {
  std::vector<ShardPiece> out;
  if (!by_flat_.empty()) {  // Whole, applied: parameters in flat order through by_flat_
    auto it = std::upper_bound(by_flat_.begin(), by_flat_.end(), window.begin,
                               [&](std::size_t pos, std::size_t i) { return pos < params_[i].flat.end; });
    for (; it != by_flat_.end() && params_[*it].flat.begin < window.end; ++it) {
      const ParamInfo& p = params_[*it];
      const Range f = p.flat.intersect(window);
      if (f.empty()) continue;
      out.push_back(ShardPiece{*it, f, f.shifted_down(window.begin), f.shifted_down(p.flat.begin)});
    }
    return out;
  }
  // Parameters are sorted by offset: binary search for the first one ending after window.begin.
  auto it = std::upper_bound(params_.begin(), params_.end(), window.begin,
                             [](std::size_t pos, const ParamInfo& p) { return pos < p.flat.end; });
  for (; it != params_.end() && it->flat.begin < window.end; ++it) {
    const Range f = it->flat.intersect(window);
    if (f.empty()) continue;
    out.push_back(ShardPiece{static_cast<std::size_t>(it - params_.begin()), f,
                             f.shifted_down(window.begin), f.shifted_down(it->flat.begin)});
  }
  return out;
}

void FlatLayout::apply_owners(const OwnerPlan& plan) {
  require(built() && ownership_ == Ownership::Whole, Status::InvalidState,
          "apply_owners: the layout is not built with Whole ownership");
  require(!owners_applied(), Status::InvalidState, "apply_owners: owners are already applied");
  const std::size_t n = static_cast<std::size_t>(world_size_);
  require(plan.world_size == world_size_ && plan.owner.size() == params_.size() &&
              plan.flat.size() == params_.size() && plan.buckets.size() == buckets_.size(),
          Status::InvalidArgument, "apply_owners: the plan is for another layout");
  for (std::size_t i = 0; i < params_.size(); ++i) {
    require(plan.flat[i].size() == params_[i].numel, Status::InvalidArgument,
            "apply_owners: the plan is for another layout");
    params_[i].flat = plan.flat[i];
  }
  owners_ = plan.owner;
  shard_sizes_.assign(n, 0);
  for (std::size_t b = buckets_.size(); b-- > 0;) {  // flat order: local order
    Bucket& bk = buckets_[b];
    const OwnedBucket& ob = plan.buckets[b];
    require(ob.flat == bk.flat && ob.counts.size() == n && ob.offsets.size() == n,
            Status::InvalidArgument, "apply_owners: the plan is for another layout");
    bk.counts = ob.counts;
    bk.offsets = ob.offsets;
    bk.local_begins = shard_sizes_;
    bk.equal_cut = true;
    for (std::size_t r = 0; r < n; ++r) {
      bk.equal_cut = bk.equal_cut && ob.counts[r] == bk.slice_elems;
      shard_sizes_[r] += ob.counts[r];
    }
  }
  by_flat_.resize(params_.size());
  for (std::size_t i = 0; i < params_.size(); ++i) by_flat_[i] = i;
  std::sort(by_flat_.begin(), by_flat_.end(),
            [&](std::size_t x, std::size_t y) { return params_[x].flat.begin < params_[y].flat.begin; });
}

std::vector<ShardPiece> FlatLayout::owned_pieces(int rank) const {
  require(built(), Status::InvalidState, "the layout is not built");
  require(rank >= 0 && rank < world_size_, Status::InvalidArgument, "rank out of range");
  std::vector<ShardPiece> out;
  for (std::size_t b = buckets_.size(); b-- > 0;) {
    const Bucket& bk = buckets_[b];
    const std::size_t lb = bk.local_begin_of(rank);
    for (ShardPiece pc : pieces_in(bk.slice(rank))) {
      pc.local = Range{pc.local.begin + lb, pc.local.end + lb};
      out.push_back(pc);
    }
  }
  return out;
}

std::uint64_t FlatLayout::fingerprint() const {
  std::uint64_t h = fnv1a64(&world_size_, sizeof world_size_);
  const std::uint64_t be = bucket_elems_;
  h = fnv1a64(&be, sizeof be, h);
  if (align_ != kAlignElems) {
    const std::uint64_t a = align_;
    h = fnv1a64(&a, sizeof a, h);
  }
  for (const ParamInfo& p : params_) {
    h = fnv1a64(p.name.data(), p.name.size() + 0, h);
    const std::uint64_t rec[4] = {p.name.size(), p.numel, static_cast<std::uint64_t>(p.group),
                                  static_cast<std::uint64_t>(p.unit)};
    h = fnv1a64(rec, sizeof rec, h);
  }
  if (ownership_ == Ownership::Whole) {  // Flat layouts hash as they always have
    const std::uint64_t mark[2] = {0x57484f4c45ull /* "WHOLE" */,
                                   static_cast<std::uint64_t>(ownership_)};
    h = fnv1a64(mark, sizeof mark, h);
    for (const ParamInfo& p : params_) {
      const std::uint64_t shape[2] = {p.rows, p.cols};
      h = fnv1a64(shape, sizeof shape, h);
    }
  }
  return h;
}

std::string FlatLayout::describe(std::size_t max_lines) const {
  std::ostringstream os;
  os << params_.size() << " parameters, " << unpadded_ << " elements (" << padded_
     << " padded)";
  for (std::size_t i = 0; i < params_.size() && i < max_lines; ++i)
    os << "\n  [" << i << "] " << params_[i].name << ": " << params_[i].numel << " (group "
       << params_[i].group << ")";
  if (params_.size() > max_lines) os << "\n  ...";
  return os.str();
}

}  // namespace shardopt
