// gpu_test.hpp: GPU tests skip, with the reason, where no CUDA device can be used.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <string>

namespace shardopt::test {

/// Empty when at least `needed` CUDA devices are usable, else why not.
inline std::string gpu_problem(int needed = 1) {
  int n = 0;
  const cudaError_t rc = cudaGetDeviceCount(&n);
  if (rc != cudaSuccess) {
    (void)cudaGetLastError();
    return std::string("no CUDA device (cudaGetDeviceCount: ") + cudaGetErrorString(rc) + ")";
  }
  if (n < needed)
    return "needs " + std::to_string(needed) + " CUDA device(s), found " + std::to_string(n);
  return {};
}

}  // namespace shardopt::test

/// First statement of a GPU test.
#define SHARDOPT_REQUIRE_GPUS(n)                                                   \
  do {                                                                             \
    const std::string gpu_problem_ = ::shardopt::test::gpu_problem(n);             \
    if (!gpu_problem_.empty()) GTEST_SKIP() << "GPU test skipped: " << gpu_problem_; \
  } while (0)
