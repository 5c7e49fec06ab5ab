// world_c10d.cpp: world() for test binaries whose processes talk through LibTorch's c10d gloo
// group (no MPI; mpiexec only launches them): one communicator per process, made on first use
// from the environment (c10d_main.cpp sets the rendezvous file).
#include "shardopt/torch/c10d_comm.hpp"
#include "support/world.hpp"

namespace shardopt::test {
std::shared_ptr<Communicator> world() {
  static const std::shared_ptr<Communicator> comm = libtorch::make_gloo_communicator_from_env();
  return comm;
}
int world_rank() { return world()->rank(); }
int world_size() { return world()->size(); }
}  // namespace shardopt::test
