// mpi_world.hpp: this process's rank and the size of MPI_COMM_WORLD, for MPI test binaries.
#pragma once

#include <mpi.h>

namespace shardopt::test {

inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

inline int world_size() {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

}  // namespace shardopt::test
