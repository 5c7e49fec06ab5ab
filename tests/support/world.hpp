// world.hpp: the communicator a test binary runs on: MPI_COMM_WORLD in binaries launched by
// mpiexec, a single-process group otherwise. Tests written against it run in both.
#pragma once

#include <memory>

#include "shardopt/comm.hpp"

namespace shardopt::test {
/// A communicator over every process of the test (collective; MPI builds make a new one per
/// call, as an application would).
std::shared_ptr<Communicator> world();
/// world()'s rank and size, without making a communicator (local).
int world_rank();
int world_size();
}
