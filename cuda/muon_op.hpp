// muon_op.hpp: Muon's element passes on the device (the GEMMs of Newton-Schulz are cuBLAS's).
//
// Plain C++ with __host__ __device__ members, like lion_op.hpp: the CUDA kernel, the Thrust
// OpenMP build and the fake device run this same code. The arithmetic is src/rules/muon.hpp's
// (momentum_element, apply_element, the division by the norm), which the CPU step runs too.
#pragma once

#include <cstddef>

#include "rules/muon.hpp"
#include "shardopt/bf16.hpp"
#include "shardopt/host_device.hpp"

namespace shardopt::dev {

/// One pass over the n elements of one matrix (row-major, rows x cols).
struct MuonPassOp {
  enum Pass : int {
    Momentum = 0,  ///< g = grad * grad_scale; m, u <- momentum_element(g, m)
    Divide = 1,    ///< x = u / divisor (Newton-Schulz's normalisation)
    Apply = 2,     ///< master <- apply_element(master, x); the replica
  };
  Pass pass = Momentum;
  rules::muon::Scalars s{};
  bool nesterov = true;
  float grad_scale = 1.0f;
  float divisor = 1.0f;
  const float* grad = nullptr;  ///< Momentum
  float* m = nullptr;           ///< Momentum
  float* u = nullptr;           ///< Momentum (written), Divide (read)
  float* x = nullptr;           ///< Divide (written), Apply (read)
  float* master = nullptr;      ///< Apply
  bf16* out_bf16 = nullptr;     ///< Apply: the bf16 replica, or null
  float* out_f32 = nullptr;     ///< Apply: an fp32 replica that is not the master, or null

  SHARDOPT_HD void operator()(std::size_t i) const {
    if (pass == Momentum) {
      // One fp32 multiply, as adam_element's `grad * s.grad_scale` (and the CPU backend's).
      float mi = m[i];
      u[i] = rules::muon::momentum_element(s, nesterov, grad[i] * grad_scale, mi);
      m[i] = mi;
    } else if (pass == Divide) {
      x[i] = u[i] / divisor;
    } else {
      const float p = rules::muon::apply_element(s, master[i], x[i]);
      master[i] = p;
      if (out_bf16) out_bf16[i] = to_bf16(p);
      if (out_f32) out_f32[i] = p;
    }
  }
};

}  // namespace shardopt::dev
