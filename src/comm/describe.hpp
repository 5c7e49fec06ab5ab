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

/// The ranks of `ranks` grouped by node, for a job of several nodes: "node 1 (host h1):
/// ranks 2, 3 (every rank of the node); node 0 (host h0): rank 1 (1 of its 2 ranks)", nodes in
/// order of first appearance; node_of[r] and host_of[r] for every rank r of the job.
std::string ranks_by_node(const std::vector<int>& ranks, const std::vector<int>& node_of,
                          const std::vector<std::string>& host_of);

}  // namespace shardopt
