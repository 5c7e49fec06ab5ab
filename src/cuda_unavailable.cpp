// cuda_unavailable.cpp: the CUDA entry points of a build without CUDA.
#include "backend.hpp"
#include "shardopt/error.hpp"

namespace shardopt {

std::unique_ptr<Backend> make_cuda_backend(void*) {
  throw Error(Status::Unsupported,
              "Device::Cuda requested, but shardopt was built without CUDA (SHARDOPT_CUDA=OFF "
              "or no nvcc found at configure time)");
}

}  // namespace shardopt
