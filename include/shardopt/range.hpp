// range.hpp: half-open index ranges [begin, end) for shard arithmetic.
#pragma once

#include <algorithm>
#include <cstddef>

namespace shardopt {

struct Range {
  std::size_t begin = 0;
  std::size_t end = 0;

  constexpr std::size_t size() const { return end > begin ? end - begin : 0; }
  constexpr bool empty() const { return end <= begin; }
  constexpr bool contains(std::size_t i) const { return i >= begin && i < end; }
  /// The overlap of two ranges; empty (begin == end) when they do not meet.
  constexpr Range intersect(Range o) const {
    const std::size_t b = std::max(begin, o.begin);
    const std::size_t e = std::min(end, o.end);
    return e > b ? Range{b, e} : Range{b, b};
  }
  /// This range expressed relative to `origin`.
  constexpr Range shifted_down(std::size_t origin) const { return {begin - origin, end - origin}; }
  friend constexpr bool operator==(Range, Range) = default;
};

}  // namespace shardopt
