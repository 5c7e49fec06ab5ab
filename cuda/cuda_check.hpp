// cuda_check.hpp: CUDA runtime errors as shardopt::Error naming the failed call.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "shardopt/error.hpp"

namespace shardopt::dev {

/// Throws Error(Cuda, "<call> failed: <name>: <description>"); out-of-memory becomes
/// Status::OutOfMemory. Clears the runtime's sticky last error for non-sticky failures.
inline void check_cuda(cudaError_t rc, const char* call) {
  if (rc == cudaSuccess) return;
  (void)cudaGetLastError();
  const Status status = rc == cudaErrorMemoryAllocation ? Status::OutOfMemory : Status::Cuda;
  throw Error(status, std::string(call) + " failed: " + cudaGetErrorName(rc) + ": " +
                          cudaGetErrorString(rc));
}

}  // namespace shardopt::dev

#define SHARDOPT_CUDA_CHECK(call) ::shardopt::dev::check_cuda((call), #call)
