// cuda_backend.hpp: the CUDA Backend with a chosen fused-update kernel (tests, benchmarks).
#pragma once

#include <memory>

#include "../src/backend.hpp"
#include "cuda_ops.hpp"

namespace shardopt {

/// make_cuda_backend() uses AdamKernel::Thrust. Computes on `stream` (nullptr: the legacy
/// default stream). Throws Error(Cuda) when no device is usable.
std::unique_ptr<Backend> make_cuda_backend_with(dev::AdamKernel kernel,
                                                cudaStream_t stream = nullptr);

}  // namespace shardopt
