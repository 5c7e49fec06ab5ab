// launch_config.hpp: grid sizing of the hand-written grid-stride kernels.
#pragma once

#include <algorithm>
#include <cstddef>

#include "shardopt/host_device.hpp"

namespace shardopt::dev {

struct LaunchConfig {
  unsigned blocks;
  unsigned threads;
};

/// Threads per block of the grid-stride kernels.
inline constexpr unsigned kGridStrideThreads = 256;

/// Enough blocks to give every thread one work item, capped at the blocks that can be
/// resident at once (`blocks_per_sm` per SM, from the occupancy calculator): beyond that a
/// grid-stride loop reuses threads instead of launching blocks that only wait. Always at
/// least one block.
inline LaunchConfig grid_stride_config(std::size_t work_items, int sm_count, int blocks_per_sm,
                                       unsigned threads = kGridStrideThreads) {
  const std::size_t wanted = (work_items + threads - 1) / threads;
  const std::size_t cap = static_cast<std::size_t>(std::max(sm_count, 1)) *
                          static_cast<std::size_t>(std::max(blocks_per_sm, 1));
  return {static_cast<unsigned>(std::clamp<std::size_t>(wanted, 1, cap)), threads};
}

/// The grid of the fused update's grid-stride kernel for `chunks` work items on the current
/// device: cudaOccupancyMaxActiveBlocksPerMultiprocessor and the SM count are queried once
/// per device and process (launch_config.cpp).
LaunchConfig adam_grid_stride_launch(std::size_t chunks);

/// The work items a thread visits in a grid-stride loop: first, first + stride, ...
SHARDOPT_HD constexpr std::size_t grid_stride_first(unsigned block, unsigned threads, unsigned thread) {
  return static_cast<std::size_t>(block) * threads + thread;
}
constexpr std::size_t grid_stride_stride(const LaunchConfig& c) {
  return static_cast<std::size_t>(c.blocks) * c.threads;
}

}  // namespace shardopt::dev
