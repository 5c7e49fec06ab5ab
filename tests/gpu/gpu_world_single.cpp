// gpu_world_single.cpp: gpu_world() of single-process GPU test binaries.
#include "gpu_world.hpp"

namespace shardopt::test {
int gpu_world_size() { return 1; }
std::shared_ptr<Communicator> gpu_world() { return make_single_process_communicator(); }
}  // namespace shardopt::test
