// launch_config.cpp: the occupancy query behind adam_grid_stride_launch(), once per device.
#include "launch_config.hpp"

#include <cuda_runtime_api.h>

#include <map>
#include <mutex>

#include "cuda_check.hpp"
#include "cuda_ops.hpp"

namespace shardopt::dev {
namespace {

struct DeviceShape {
  int sms = 0;
  int blocks_per_sm = 0;
};

DeviceShape query_shape(int device) {
  DeviceShape s;
  SHARDOPT_CUDA_CHECK(cudaDeviceGetAttribute(&s.sms, cudaDevAttrMultiProcessorCount, device));
  SHARDOPT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &s.blocks_per_sm, adam_grid_stride_kernel_address(), static_cast<int>(kGridStrideThreads),
      0));
  return s;
}

}  // namespace

LaunchConfig adam_grid_stride_launch(std::size_t chunks) {
  static std::mutex mutex;
  static std::map<int, DeviceShape> shapes;
  int device = 0;
  SHARDOPT_CUDA_CHECK(cudaGetDevice(&device));
  DeviceShape shape;
  {
    const std::lock_guard<std::mutex> lock(mutex);
    auto it = shapes.find(device);
    if (it == shapes.end()) it = shapes.emplace(device, query_shape(device)).first;
    shape = it->second;
  }
  return grid_stride_config(chunks, shape.sms, shape.blocks_per_sm);
}

}  // namespace shardopt::dev
