// lion_op.hpp: the Lion update of one segment as one work item per element.
//
// Plain C++ with __host__ __device__ members, like adam_chunk.hpp: the CUDA kernel, the
// Thrust OpenMP test build and the fake device run this same code. The arithmetic is
// lion_element() from lion_math.hpp.
#pragma once

#include <cstddef>

#include "shardopt/bf16.hpp"
#include "shardopt/host_device.hpp"
#include "shardopt/lion_math.hpp"

namespace shardopt::dev {

/// One segment: elements [0, n) of the pointers (already offset to the segment's start).
struct LionOp {
  LionScalars s{};
  float* master = nullptr;
  const float* grad = nullptr;
  float* m = nullptr;
  bf16* out_bf16 = nullptr;  ///< the bf16 replica, or null
  float* out_f32 = nullptr;  ///< an fp32 replica that is not the master, or null

  SHARDOPT_HD void operator()(std::size_t i) const {
    float p = master[i], mi = m[i];
    lion_element(s, p, grad[i], mi);
    master[i] = p;
    m[i] = mi;
    if (out_bf16) out_bf16[i] = to_bf16(p);
    if (out_f32) out_f32[i] = p;
  }
};

}  // namespace shardopt::dev
