// shm_node.hpp: which ranks share a node, and the communicators of the hierarchical
// collectives (one per node, one of the node leaders). Internal.
#pragma once

#include <mpi.h>

#include <memory>
#include <string>
#include <vector>

namespace shardopt::shm {

struct NodeTopology {
  MPI_Comm node = MPI_COMM_NULL;     ///< the ranks of this node, ordered by world rank
  MPI_Comm leaders = MPI_COMM_NULL;  ///< node rank 0 of every node (MPI_COMM_NULL elsewhere)
  int world_rank = 0;
  int world_size = 1;
  int node_rank = 0;
  int node_size = 1;
  int node_index = 0;  ///< nodes are numbered by their lowest world rank
  int num_nodes = 1;
  int max_node_size = 1;
  /// Per node (by node_index): first world rank and number of ranks.
  std::vector<int> node_first, node_ranks;
  /// Per world rank: its node (node_index) and the host it runs on (MPI_Get_processor_name),
  /// for messages that name where a rank was.
  std::vector<int> node_of;
  std::vector<std::string> host_of;
  /// Every node holds consecutive world ranks (true for mpiexec's default block placement);
  /// the hierarchical collectives need it.
  bool contiguous = true;

  NodeTopology() = default;
  NodeTopology(const NodeTopology&) = delete;
  NodeTopology& operator=(const NodeTopology&) = delete;
  ~NodeTopology();

  /// Collective over `world`. simulate_nodes > 0 splits each real node further into that
  /// many groups of consecutive world ranks (rank * simulate_nodes / size).
  static std::shared_ptr<NodeTopology> create(MPI_Comm world, int simulate_nodes);
};

}  // namespace shardopt::shm
