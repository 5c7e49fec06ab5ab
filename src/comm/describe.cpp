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

std::string ranks_by_node(const std::vector<int>& ranks, const std::vector<int>& node_of,
                          const std::vector<std::string>& host_of) {
  std::vector<int> nodes;
  std::vector<std::vector<int>> members;
  for (const int r : ranks) {
    const int n = node_of[static_cast<std::size_t>(r)];
    std::size_t k = 0;
    while (k < nodes.size() && nodes[k] != n) ++k;
    if (k == nodes.size()) {
      nodes.push_back(n);
      members.emplace_back();
    }
    members[k].push_back(r);
  }
  std::string s;
  for (std::size_t k = 0; k < nodes.size(); ++k) {
    std::size_t on_node = 0;
    std::size_t first = 0;
    for (std::size_t r = 0; r < node_of.size(); ++r)
      if (node_of[r] == nodes[k] && on_node++ == 0) first = r;
    s += (k ? "; node " : "node ") + std::to_string(nodes[k]) + " (host " + host_of[first] +
         "): " + rank_list(members[k]) +
         (members[k].size() == on_node
              ? std::string(" (every rank of the node)")
              : " (" + std::to_string(members[k].size()) + " of its " + std::to_string(on_node) +
                    " ranks)");
  }
  return s;
}

}  // namespace shardopt
