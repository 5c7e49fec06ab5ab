// describe.cpp: the wording of error messages about several ranks.
#include "describe.hpp"

#include <cstddef>

namespace shardopt {

std::string rank_list(const std::vector<int>& ranks) {
  constexpr std::size_t kShown = 8;
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size() && i < kShown; ++i)
    s += (i ? ", " : "") + std::to_string(ranks[i]);
  if (ranks.size() > kShown) s += " and " + std::to_string(ranks.size() - kShown) + " more";
  return s;
}

std::string values_by_rank(const std::vector<std::string>& value_of_rank) {
  std::vector<std::string> values;
  std::vector<std::vector<int>> holders;
  for (std::size_t r = 0; r < value_of_rank.size(); ++r) {
    std::size_t k = 0;
    while (k < values.size() && values[k] != value_of_rank[r]) ++k;
    if (k == values.size()) {
      values.push_back(value_of_rank[r]);
      holders.emplace_back();
    }
    holders[k].push_back(static_cast<int>(r));
  }
  if (values.size() < 2) return {};
  std::string s;
  for (std::size_t k = 0; k < values.size(); ++k)
    s += (k ? "; " : "") + values[k] + " on " + rank_list(holders[k]);
  return s;
}

}  // namespace shardopt
