// muon.hpp: the Muon rule's CPU math on one whole matrix (issue 32): momentum, Newton-Schulz, update.
//
// Semantics of torch.optim.Muon (PyTorch >= 2.9, torch/optim/_muon.py), for a rows x cols
// row-major fp32 matrix whose every element this rank owns:
//   M <- lerp(M, g, 1 - mu);  U <- nesterov ? lerp(g, M, mu) : M;
//   O <- NS_k(U): X = U (U^T when rows > cols), X /= max(||X||_F, eps), k times
//        S = X X^T, T = b S + c S S, X = a X + T X; transposed back;
//   p <- p * (1 - lr wd);  p <- p - adjusted_lr * O.
// One deliberate difference: torch runs Newton-Schulz in bf16 (grad.bfloat16()); this runs it
// in fp32, as the issue asks. Everything is fp32 arithmetic without FMA contraction (the file
// is built with -ffp-contract=off), and every GEMM sums each output element in one fixed
// order (k ascending), so the result is the same bit for bit at any thread count and on every
// instruction set the GEMM dispatches to (portable, AVX2, AVX-512).
//
// The caller (the whole-tensor ownership of the optimizer, built separately) calls step() on
// each matrix it owns; nothing here knows about shards, buckets or the Rule enumeration.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "shardopt/bf16.hpp"
#include "shardopt/host_device.hpp"

namespace shardopt::rules::muon {

/// torch's defaults (Keller Jordan's quintic coefficients).
inline constexpr double kDefaultA = 3.4445;
inline constexpr double kDefaultB = -4.7750;
inline constexpr double kDefaultC = 2.0315;
inline constexpr int kDefaultNsSteps = 5;
/// torch refuses ns_steps >= 100 ("for computational efficiency"); so do we.
inline constexpr int kMaxNsSteps = 99;

/// The learning-rate adjustment of torch's adjust_lr_fn.
enum class LrAdjust : std::uint8_t {
  Original = 0,       ///< "original" (and torch's None): lr * sqrt(max(1, rows / cols))
  MatchRmsAdamW = 1,  ///< "match_rms_adamw" (Moonshot): lr * 0.2 * sqrt(max(rows, cols))
  None = 2,           ///< lr unchanged (torch's _adjust_lr for any other name; its
                      ///< constructor accepts only the two above)
};

/// Hyperparameters of one group's Muon step, in double as the trainer gives them.
struct Config {
  double lr = 1e-3;
  double momentum = 0.95;
  double weight_decay = 0.1;
  double eps = 1e-7;
  bool nesterov = true;
  int ns_steps = kDefaultNsSteps;
  double a = kDefaultA;
  double b = kDefaultB;
  double c = kDefaultC;
  LrAdjust adjust = LrAdjust::Original;
};

/// The fp32 scalars of one step on one matrix: each computed in double and rounded once, as
/// PyTorch rounds its Python-float hyperparameters (adam_math.hpp's make_step_scalars).
struct Scalars {
  float buf_weight;       ///< 1 - mu: the weight of buf.lerp_(grad, 1 - mu)
  float nesterov_weight;  ///< mu: the weight of grad.lerp(buf, mu)
  float a, b, c;          ///< the Newton-Schulz coefficients
  float decay_factor;     ///< 1 - lr * wd (the unadjusted lr, as torch)
  float adjusted_lr;      ///< lr * adjust_ratio(adjust, rows, cols)
};

/// The ratio torch's _adjust_lr multiplies lr by, in double.
double adjust_ratio(LrAdjust adjust, std::size_t rows, std::size_t cols);
/// The fp32 scalars of `cfg` for a rows x cols matrix.
Scalars make_scalars(const Config& cfg, std::size_t rows, std::size_t cols);

/// PyTorch's lerp of one fp32 element, the scalar formula of aten/src/ATen/native/Lerp.h
/// (lerp()): |w| < 0.5 ? self + w (end - self) : end - (end - self) (1 - w), every operation
/// rounded to fp32. (Its vectorized CPU kernel, cpu/LerpKernel.cpp lerp_vec, evaluates the
/// same expression as one fused multiply-add and may differ from it in the last bit; this
/// library uses no FMA, so it follows the scalar formula.)
SHARDOPT_HD float lerp(float self, float end, float weight) {
  const float w_abs = weight < 0.0f ? -weight : weight;
  return w_abs < 0.5f ? self + weight * (end - self) : end - (end - self) * (1.0f - weight);
}

// The element passes of step(), shared with the CUDA backend (cuda/muon_op.hpp): one
// implementation of each formula for both.

/// The momentum of one element: m <- lerp(m, g, 1 - mu) (buf.lerp_(grad, 1 - mu)); returns
/// U = nesterov ? lerp(g, m, mu) (grad.lerp(buf, mu)) : m.
SHARDOPT_HD float momentum_element(const Scalars& s, bool nesterov, float g, float& m) {
  m = lerp(m, g, s.buf_weight);
  return nesterov ? lerp(g, m, s.nesterov_weight) : m;
}

/// The new weight of one element from the orthogonalized update o:
/// param.mul_(1 - lr wd); param.add_(O, alpha=-adjusted_lr).
SHARDOPT_HD float apply_element(const Scalars& s, float p, float o) {
  p = p * s.decay_factor;
  return p - s.adjusted_lr * o;
}

/// Newton-Schulz's divisor from the sum of squares of X (in double): max(||X||_F, eps) in
/// double, rounded to fp32 once; each element is then divided by it (a true division).
float ns_divisor(double sum_squares, double eps);

/// step()'s argument checks (Error(InvalidArgument)): the matrix, the hyperparameters.
void check_step(const Config& cfg, std::size_t rows, std::size_t cols);

/// The two dimensions of a Muon parameter's shape; Error(InvalidArgument) unless the shape
/// is 2-D with no zero extent (torch's Muon takes 2-D parameters only).
struct Matrix {
  std::size_t rows;
  std::size_t cols;
};
Matrix matrix_of(std::span<const std::size_t> shape);

/// Scratch memory of step() and newton_schulz(); grows on demand, reusable across matrices.
struct Workspace {
  std::vector<float> data;
};
/// The floats step() needs in the workspace for a rows x cols matrix (newton_schulz() needs
/// rows * cols fewer): U, X and a X + T X (rows * cols each), S and T (min(rows, cols)^2 each).
std::size_t workspace_floats(std::size_t rows, std::size_t cols);

/// Newton-Schulz orthogonalization of the rows x cols row-major `in` into `out` (which may be
/// `in`): X = in (in^T when rows > cols), X /= max(||X||_F, eps), `steps` iterations, back.
/// The norm is summed in double over X in its row-major order (the orientation with
/// rows <= cols, so that NS(U^T) is NS(U)^T bit for bit), clamped at eps in double and
/// rounded to fp32 once; every element is then divided by that fp32 divisor, as torch's
/// div_(norm.clamp(min=eps)) divides by its norm tensor (a true division: one rounding per
/// element, where multiplying by a rounded 1/norm would add a second).
void newton_schulz(std::size_t rows, std::size_t cols, const float* in, float* out, float a,
                   float b, float c, double eps, int steps, Workspace& ws);

/// The floating-point operations (2 x the multiply-adds) of newton_schulz()'s GEMMs for a
/// rows x cols matrix and `steps` iterations, exactly as they run: the upper tiles of the two
/// symmetric products (diagonal tiles whole) and the full T X. For load balancing and GFLOP/s.
double newton_schulz_flops(std::size_t rows, std::size_t cols, int steps);

/// One Muon step on a rows x cols row-major matrix: master, grad and momentum (rows * cols
/// each) in fp32; the new weights' replica copy written to out_bf16 (round to nearest even)
/// or out_f32 where not null. Error(InvalidArgument) for a zero extent, a null array, a
/// negative or non-finite lr, momentum, weight_decay or eps, a non-finite a, b or c, or
/// ns_steps outside [0, kMaxNsSteps]. Threaded with
/// OpenMP; the result does not depend on the thread count.
void step(const Config& cfg, std::size_t rows, std::size_t cols, float* master, const float* grad,
          float* momentum, bf16* out_bf16, float* out_f32, Workspace& ws);
/// step() with caller-owned scratch: `workspace` holds workspace_floats(rows, cols) floats
/// (the optimizer's rule scratch, planned and accounted: rules::scratch_floats).
void step(const Config& cfg, std::size_t rows, std::size_t cols, float* master, const float* grad,
          float* momentum, bf16* out_bf16, float* out_f32, float* workspace);

}  // namespace shardopt::rules::muon
