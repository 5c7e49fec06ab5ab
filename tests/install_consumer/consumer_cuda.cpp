// consumer_cuda.cpp: a program linked with shardopt::cuda gets the CUDA backend from the
// core (registered by libshardopt_cuda, static or shared): Device::Cuda either works or
// fails for want of a GPU (Status::Cuda), never with "not built / not loaded"
// (Status::Unsupported).
#include <cstdio>

#include <shardopt/cuda_comm.hpp>
#include <shardopt/optimizer.hpp>

int main() {
  try {
    shardopt::OptimizerOptions o;
    o.device = shardopt::Device::Cuda;
    // Device::Cuda needs a communicator of device buffers (a host one is refused).
    shardopt::ShardedOptimizer opt(shardopt::make_cuda_single_process_communicator(), o);
    opt.add_param("w", 2);
    opt.finalize();
    std::printf("consumer_cuda: CUDA backend works\n");
  } catch (const shardopt::Error& e) {
    if (e.status() == shardopt::Status::Unsupported) {
      std::fprintf(stderr, "consumer_cuda: %s\n", e.what());
      return 1;
    }
    std::printf("consumer_cuda: CUDA backend loaded, no usable GPU: %s\n", e.what());
  }
  return 0;
}
