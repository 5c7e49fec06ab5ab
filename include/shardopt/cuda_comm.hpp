// cuda_comm.hpp: the communicator of a one-process CUDA optimizer. Only available when
// shardopt was built with CUDA (SHARDOPT_WITH_CUDA); includes the CUDA runtime header.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>

#include "shardopt/comm.hpp"

namespace shardopt {

/// A group of one for Device::Cuda: data collectives take device buffers and run on
/// `compute_stream` (nullptr: the legacy default stream), which is also the stream the
/// optimizer computes on (device_stream()). They move no data; the bf16 wire rounds the
/// values through bf16 on the device, as a larger group would. The host collectives are
/// those of make_single_process_communicator(). A host communicator is refused by a CUDA
/// optimizer, even at one rank: it would run host code on device memory.
std::shared_ptr<Communicator> make_cuda_single_process_communicator(
    cudaStream_t compute_stream = nullptr);

}  // namespace shardopt
