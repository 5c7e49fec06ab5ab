// gpu_world_nccl.cpp: gpu_world() of GPU test binaries launched by mpiexec: NCCL over
// MPI_COMM_WORLD, rank r on device r (NCCL allows one rank per device).
#include <cuda_runtime_api.h>
#include <mpi.h>

#include "gpu_world.hpp"
#include "shardopt/nccl_comm.hpp"

namespace shardopt::test {
int gpu_world_size() {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}
std::shared_ptr<Communicator> gpu_world() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (cudaSetDevice(rank) != cudaSuccess) (void)cudaGetLastError();  // reported by the comm
  return make_nccl_communicator(MPI_COMM_WORLD);
}
}  // namespace shardopt::test
