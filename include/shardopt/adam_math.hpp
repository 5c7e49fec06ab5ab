// adam_math.hpp: the per-element AdamW / Adam-L2 update, shared by the CPU and CUDA kernels.
//
// Every kernel (scalar, SIMD, OpenMP, Thrust, CUDA) calls or mirrors adam_element(), so the
// CPU tests check the arithmetic the GPU runs. Scalars that depend on the step (bias
// corrections, 1 - beta, the decay factor) are computed once per step in double and rounded
// to float by make_step_scalars(), as PyTorch does for its Python-float hyperparameters.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "shardopt/host_device.hpp"

namespace shardopt {

enum class AdamMode : std::uint8_t {
  AdamW = 0,   ///< decoupled weight decay (Loshchilov & Hutter; torch.optim.AdamW)
  AdamL2 = 1,  ///< classic Adam: weight decay added to the gradient (torch.optim.Adam)
};

/// Per-step scalars common to all parameters.
struct StepScalars {
  float beta1;
  float beta2;
  float one_minus_beta1;
  float one_minus_beta2;
  float eps;
  float bias_correction2_sqrt;  ///< sqrt(1 - beta2^t)
  float grad_scale;             ///< 1/world (averaging) times the clipping coefficient
  AdamMode mode;
};

/// Per-segment scalars: they differ between parameter groups (lr multiplier, decay on/off).
struct SegmentScalars {
  float step_size;     ///< lr / (1 - beta1^t)
  float decay_factor;  ///< AdamW: 1 - lr * wd (applied to the weight before the step)
  float l2_decay;      ///< Adam-L2: wd (added to the gradient as wd * p)
};

/// A contiguous run of the local shard that shares one parameter group's scalars. Offsets
/// are element indices relative to the start of the shard.
struct UpdateSegment {
  std::size_t begin;
  std::size_t end;
  SegmentScalars scalars;
};

/// Hyperparameters of one step, in double, as the trainer gives them.
struct StepHyper {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  AdamMode mode;
  std::int64_t step;  ///< 1-based step number used for bias correction
};

inline StepScalars make_step_scalars(const StepHyper& h, double grad_scale) {
  StepScalars s{};
  s.beta1 = static_cast<float>(h.beta1);
  s.beta2 = static_cast<float>(h.beta2);
  s.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  s.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  s.eps = static_cast<float>(h.eps);
  s.bias_correction2_sqrt =
      static_cast<float>(std::sqrt(1.0 - std::pow(h.beta2, static_cast<double>(h.step))));
  s.grad_scale = static_cast<float>(grad_scale);
  s.mode = h.mode;
  return s;
}

/// lr_scale and decay_enabled come from the parameter's group.
inline SegmentScalars make_segment_scalars(const StepHyper& h, double lr_scale,
                                           bool decay_enabled) {
  const double lr = h.lr * lr_scale;
  const double wd = decay_enabled ? h.weight_decay : 0.0;
  const double bias_correction1 = 1.0 - std::pow(h.beta1, static_cast<double>(h.step));
  SegmentScalars g{};
  g.step_size = static_cast<float>(lr / bias_correction1);
  g.decay_factor = h.mode == AdamMode::AdamW ? static_cast<float>(1.0 - lr * wd) : 1.0f;
  g.l2_decay = h.mode == AdamMode::AdamL2 ? static_cast<float>(wd) : 0.0f;
  return g;
}

/// One element of the update, in the order torch.optim.AdamW applies it:
/// decay the weight, update the moments, p -= step_size * m / (sqrt(v)/sqrt(bc2) + eps).
SHARDOPT_HD void adam_element(const StepScalars& s, const SegmentScalars& g, float& p, float grad,
                              float& m, float& v) {
  float gr = grad * s.grad_scale;
  if (s.mode == AdamMode::AdamL2) gr = gr + g.l2_decay * p;
  p = p * g.decay_factor;
  m = s.beta1 * m + s.one_minus_beta1 * gr;
  v = s.beta2 * v + s.one_minus_beta2 * (gr * gr);
  const float denom = sqrtf(v) / s.bias_correction2_sqrt + s.eps;
  p = p - g.step_size * (m / denom);
}

}  // namespace shardopt
