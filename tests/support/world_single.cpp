// world_single.cpp: world() for test binaries that run without MPI.
#include "world.hpp"

namespace shardopt::test {
std::shared_ptr<Communicator> world() { return make_single_process_communicator(); }
int world_rank() { return 0; }
int world_size() { return 1; }
}  // namespace shardopt::test
