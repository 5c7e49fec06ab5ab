// gpu_world.hpp: the group a GPU test binary runs on: one process, or MPI_COMM_WORLD over
// NCCL (one device per rank) in binaries launched by mpiexec.
#pragma once

#include <memory>

#include "shardopt/comm.hpp"

namespace shardopt::test {
/// Ranks in the group (known without touching a GPU, so tests can skip first).
int gpu_world_size();
/// The communicator; call only after the test has checked for gpu_world_size() devices.
std::shared_ptr<Communicator> gpu_world();
}  // namespace shardopt::test
