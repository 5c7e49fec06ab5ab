// lion_math.hpp: the per-element Lion update, shared by the CPU and CUDA kernels.
//
// As adam_math.hpp: every kernel (portable, AVX2, AVX-512, Thrust) computes lion_element()'s
// arithmetic, in the same order, with no contraction into FMA, so all of them give the same
// bits. The scalars are computed once per step and group in double and rounded to float once
// (make_lion_scalars), as PyTorch does for Python-float hyperparameters.
#pragma once

#include <cstddef>

#include "shardopt/host_device.hpp"

namespace shardopt {

/// The scalars of one group's Lion update in one step.
struct LionScalars {
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float grad_scale;    ///< averaging, clipping and loss-scale factor of the gradient
  float lr;            ///< the group's learning rate
  float decay_factor;  ///< 1 - lr * wd (1 without decay)
};

/// A contiguous run of a Lion-ruled range with one group's scalars; offsets relative to the
/// range the kernel is given.
struct LionSegment {
  std::size_t begin;
  std::size_t end;
  LionScalars scalars;
};

/// lr is the group's (lr * lr_scale), wd its weight decay (0 where the group has none).
inline LionScalars make_lion_scalars(double beta1, double beta2, double lr, double wd,
                                     double grad_scale) {
  LionScalars s{};
  s.beta1 = static_cast<float>(beta1);
  s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.grad_scale = static_cast<float>(grad_scale);
  s.lr = static_cast<float>(lr);
  s.decay_factor = static_cast<float>(1.0 - lr * wd);
  return s;
}

/// One element, in the order lion-pytorch applies it: decay the weight, take the sign of the
/// interpolation c = beta1 m + (1 - beta1) g (sign(0) = 0), step, then update the momentum.
SHARDOPT_HD void lion_element(const LionScalars& s, float& p, float grad, float& m) {
  const float g = grad * s.grad_scale;
  p = p * s.decay_factor;
  const float c = s.beta1 * m + s.one_minus_beta1 * g;
  const float sign = c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : 0.0f);
  p = p - s.lr * sign;
  m = s.beta2 * m + s.one_minus_beta2 * g;
}

}  // namespace shardopt
