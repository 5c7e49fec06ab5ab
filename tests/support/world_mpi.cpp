// world_mpi.cpp: world() for test binaries launched by mpiexec.
#include <mpi.h>

#include "shardopt/mpi_comm.hpp"
#include "world.hpp"

namespace shardopt::test {
std::shared_ptr<Communicator> world() { return make_mpi_communicator(MPI_COMM_WORLD); }
}  // namespace shardopt::test
