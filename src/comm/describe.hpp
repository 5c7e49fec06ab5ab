// describe.hpp: the wording of error messages about several ranks. Internal.
#pragma once

#include <string>
#include <vector>

namespace shardopt {

/// "rank 1", "ranks 0, 2" (the first 8, then "and N more").
std::string rank_list(const std::vector<int>& ranks);

/// Groups ranks by value: "V1 on ranks 0, 2; V2 on rank 1" for value_of_rank[r] of every
/// rank r, in order of first appearance; empty when every rank has the same value.
std::string values_by_rank(const std::vector<std::string>& value_of_rank);

}  // namespace shardopt
