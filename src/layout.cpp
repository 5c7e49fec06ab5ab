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

std::size_t FlatLayout::add(std::string_view name, std::size_t numel, int group) {
  require(!built(), Status::InvalidState, "add_param: the layout is already finalized");
  require(!name.empty(), Status::InvalidArgument, "add_param: the parameter name is empty");
  require(numel > 0, Status::InvalidArgument,
          "add_param: parameter '" + std::string(name) + "' has zero elements");
  require(numel < (std::numeric_limits<std::size_t>::max() >> 4), Status::InvalidArgument,
          "add_param: parameter '" + std::string(name) + "' is too large (negative size?)");
  require(group >= 0, Status::InvalidArgument,
          "add_param: parameter '" + std::string(name) + "' has a negative group");
  require(find(name) == params_.size(), Status::InvalidArgument,
          "add_param: duplicate parameter name '" + std::string(name) + "'");
  const std::size_t offset = round_up(end_, kAlignElems);
  index_.emplace(std::string(name), params_.size());
  params_.push_back(ParamInfo{std::string(name), numel, group, Range{offset, offset + numel}});
  end_ = offset + numel;
  unpadded_ += numel;
  return params_.size() - 1;
}

void FlatLayout::build(int world_size) {
  require(!built(), Status::InvalidState, "the layout is already built");
  require(world_size > 0, Status::InvalidArgument, "world size must be positive");
  require(!params_.empty(), Status::InvalidState, "finalize: no parameters were registered");
  world_size_ = world_size;
  padded_ = round_up(end_, kAlignElems * static_cast<std::size_t>(world_size));
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

Range FlatLayout::shard_range(int rank) const {
  require(built(), Status::InvalidState, "the layout is not built");
  require(rank >= 0 && rank < world_size_, Status::InvalidArgument, "rank out of range");
  const std::size_t s = shard_size();
  return Range{s * static_cast<std::size_t>(rank), s * (static_cast<std::size_t>(rank) + 1)};
}

std::vector<ShardPiece> FlatLayout::pieces_in(Range window) const {
  std::vector<ShardPiece> out;
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

std::vector<Bucket> FlatLayout::make_buckets(std::size_t bucket_elems) const {
  require(built(), Status::InvalidState, "the layout is not built");
  require(bucket_elems > 0, Status::InvalidArgument, "bucket size must be positive");
  std::vector<Bucket> buckets;
  std::size_t end_param = params_.size();
  std::size_t end_flat = padded_;
  while (end_param > 0) {
    std::size_t first = end_param - 1;
    // Grow downwards while the bucket (from its first parameter's start) stays in budget.
    while (first > 0 && end_flat - params_[first - 1].flat.begin <= bucket_elems) --first;
    const std::size_t begin_flat = first == 0 ? 0 : params_[first].flat.begin;
    buckets.push_back(Bucket{Range{begin_flat, end_flat}, first, end_param});
    end_param = first;
    end_flat = begin_flat;
  }
  return buckets;
}

std::uint64_t FlatLayout::fingerprint() const {
  std::uint64_t h = fnv1a64(&world_size_, sizeof world_size_);
  for (const ParamInfo& p : params_) {
    h = fnv1a64(p.name.data(), p.name.size() + 0, h);
    const std::uint64_t rec[3] = {p.name.size(), p.numel, static_cast<std::uint64_t>(p.group)};
    h = fnv1a64(rec, sizeof rec, h);
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
