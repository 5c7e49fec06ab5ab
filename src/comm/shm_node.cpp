// shm_node.cpp: node discovery (MPI_COMM_TYPE_SHARED, optionally split further to simulate
// several nodes on one machine) and the leader communicator.
#include "shm_node.hpp"

#include <algorithm>
#include <cstring>

#include "mpi_util.hpp"

namespace shardopt::shm {

NodeTopology::~NodeTopology() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  if (leaders != MPI_COMM_NULL) MPI_Comm_free(&leaders);
  if (node != MPI_COMM_NULL) MPI_Comm_free(&node);
}

std::shared_ptr<NodeTopology> NodeTopology::create(MPI_Comm world, int simulate_nodes) {
  auto t = std::make_shared<NodeTopology>();
  SHARDOPT_MPI(MPI_Comm_rank(world, &t->world_rank));
  SHARDOPT_MPI(MPI_Comm_size(world, &t->world_size));

  MPI_Comm shared = MPI_COMM_NULL;
  SHARDOPT_MPI(
      MPI_Comm_split_type(world, MPI_COMM_TYPE_SHARED, t->world_rank, MPI_INFO_NULL, &shared));
  if (simulate_nodes > 0) {
    const int color =
        static_cast<int>(static_cast<long long>(t->world_rank) * simulate_nodes / t->world_size);
    const int rc = MPI_Comm_split(shared, color, t->world_rank, &t->node);
    MPI_Comm_free(&shared);
    SHARDOPT_MPI(rc);
  } else {
    t->node = shared;
  }
  SHARDOPT_MPI(MPI_Comm_set_errhandler(t->node, MPI_ERRORS_RETURN));
  SHARDOPT_MPI(MPI_Comm_rank(t->node, &t->node_rank));
  SHARDOPT_MPI(MPI_Comm_size(t->node, &t->node_size));

  // Every rank learns the world rank of its node's leader; nodes are the distinct leaders.
  int leader = t->world_rank;
  SHARDOPT_MPI(MPI_Bcast(&leader, 1, MPI_INT, 0, t->node));
  std::vector<int> leader_of(static_cast<std::size_t>(t->world_size));
  SHARDOPT_MPI(MPI_Allgather(&leader, 1, MPI_INT, leader_of.data(), 1, MPI_INT, world));
  std::vector<int> firsts = leader_of;
  std::sort(firsts.begin(), firsts.end());
  firsts.erase(std::unique(firsts.begin(), firsts.end()), firsts.end());
  t->num_nodes = static_cast<int>(firsts.size());
  t->node_first = firsts;
  t->node_ranks.assign(firsts.size(), 0);
  for (int w = 0; w < t->world_size; ++w) {
    const auto n = std::lower_bound(firsts.begin(), firsts.end(), leader_of[w]) - firsts.begin();
    ++t->node_ranks[static_cast<std::size_t>(n)];
  }
  // Consecutive placement: every node's ranks are first .. first + size - 1.
  for (std::size_t n = 0; n < firsts.size(); ++n)
    for (int k = 0; k < t->node_ranks[n]; ++k) {
      const int w = firsts[n] + k;
      if (w >= t->world_size || leader_of[w] != firsts[n]) t->contiguous = false;
    }
  t->node_of.resize(static_cast<std::size_t>(t->world_size));
  for (int w = 0; w < t->world_size; ++w)
    t->node_of[static_cast<std::size_t>(w)] = static_cast<int>(
        std::lower_bound(firsts.begin(), firsts.end(), leader_of[w]) - firsts.begin());
  // The hosts: one all-gather of fixed-size names (at set-up only).
  char host[MPI_MAX_PROCESSOR_NAME] = {};
  int length = 0;
  SHARDOPT_MPI(MPI_Get_processor_name(host, &length));
  std::vector<char> hosts(static_cast<std::size_t>(t->world_size) * MPI_MAX_PROCESSOR_NAME);
  SHARDOPT_MPI(MPI_Allgather(host, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, hosts.data(),
                             MPI_MAX_PROCESSOR_NAME, MPI_CHAR, world));
  for (int w = 0; w < t->world_size; ++w) {
    const char* h = hosts.data() + static_cast<std::size_t>(w) * MPI_MAX_PROCESSOR_NAME;
    t->host_of.emplace_back(h, strnlen(h, MPI_MAX_PROCESSOR_NAME));
  }
  t->node_index =
      static_cast<int>(std::lower_bound(firsts.begin(), firsts.end(), leader) - firsts.begin());
  t->max_node_size = *std::max_element(t->node_ranks.begin(), t->node_ranks.end());

  SHARDOPT_MPI(
      MPI_Comm_split(world, t->node_rank == 0 ? 0 : MPI_UNDEFINED, t->world_rank, &t->leaders));
  if (t->leaders != MPI_COMM_NULL)
    SHARDOPT_MPI(MPI_Comm_set_errhandler(t->leaders, MPI_ERRORS_RETURN));
  return t;
}

}  // namespace shardopt::shm
