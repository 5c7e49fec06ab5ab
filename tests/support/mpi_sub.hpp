// mpi_sub.hpp: runs of fewer ranks inside an MPI test binary (checkpoints saved at n ranks and
// loaded at m, in one launch).
#pragma once

#include <mpi.h>

#include <memory>

#include "shardopt/mpi_comm.hpp"

namespace shardopt::test {

/// A communicator over the first n ranks of MPI_COMM_WORLD; null on the other ranks.
/// Collective over MPI_COMM_WORLD.
inline std::shared_ptr<Communicator> first_world_ranks(int n) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm sub = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, rank < n ? 0 : MPI_UNDEFINED, rank, &sub);
  if (sub == MPI_COMM_NULL) return nullptr;
  auto c = make_mpi_communicator(sub);  // keeps its own duplicate
  MPI_Comm_free(&sub);
  return c;
}

}  // namespace shardopt::test
