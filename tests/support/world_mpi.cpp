// world_mpi.cpp: world() for test binaries launched by mpiexec.
#include <mpi.h>

#include "shardopt/mpi_comm.hpp"
#include "world.hpp"

namespace shardopt::test {
std::shared_ptr<Communicator> world() { return make_mpi_communicator(MPI_COMM_WORLD); }
int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}
}  // namespace shardopt::test
