// launch_config.hpp: grid sizing of the hand-written grid-stride kernels (host arithmetic,
// unit-tested without a GPU).
#pragma once

#include <algorithm>
#include <cstddef>

#include "shardopt/host_device.hpp"

namespace shardopt::dev {

struct LaunchConfig {
  unsigned blocks;
  unsigned threads;
};

/// Enough blocks to give every thread one work item, capped at `blocks_per_sm` resident
/// blocks per SM: beyond that a grid-stride loop reuses threads instead of launching blocks
/// that only wait. Always at least one block.
inline LaunchConfig grid_stride_config(std::size_t work_items, int sm_count,
                                       unsigned threads = 256, unsigned blocks_per_sm = 8) {
  const std::size_t wanted = (work_items + threads - 1) / threads;
  const std::size_t cap = static_cast<std::size_t>(std::max(sm_count, 1)) * blocks_per_sm;
  return {static_cast<unsigned>(std::clamp<std::size_t>(wanted, 1, cap)), threads};
}

/// The work items a thread visits in a grid-stride loop: first, first + stride, ...
SHARDOPT_HD constexpr std::size_t grid_stride_first(unsigned block, unsigned threads, unsigned thread) {
  return static_cast<std::size_t>(block) * threads + thread;
}
constexpr std::size_t grid_stride_stride(const LaunchConfig& c) {
  return static_cast<std::size_t>(c.blocks) * c.threads;
}

}  // namespace shardopt::dev
