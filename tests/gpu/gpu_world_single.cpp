// gpu_world_single.cpp: gpu_world() of single-process GPU test binaries: the one-process
// communicator of device buffers.
#include "gpu_world.hpp"
#include "shardopt/cuda_comm.hpp"

namespace shardopt::test {
int gpu_world_size() { return 1; }
std::shared_ptr<Communicator> gpu_world() { return make_cuda_single_process_communicator(); }
}  // namespace shardopt::test
