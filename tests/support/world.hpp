// world.hpp: the communicator a test binary runs on: MPI_COMM_WORLD in binaries launched by
// mpiexec, a single-process group otherwise. Tests written against it run in both.
#pragma once

#include <memory>

#include "shardopt/comm.hpp"

namespace shardopt::test {
std::shared_ptr<Communicator> world();
}
