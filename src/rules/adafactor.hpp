// adafactor.hpp: the Adafactor rule's CPU math (issue 32, point 4), torch.optim.Adafactor's.
//
// The caller owns a parameter whole (the whole-tensor ownership of issue 32) and passes its
// master weights, gradient and state: the CPU backend runs step() / step_vector(); the CUDA
// backend runs the same arithmetic and reduction order as device passes (cuda/adafactor_op.hpp).
//
// Semantics: PyTorch >= 2.5, torch/optim/_adafactor.py, the single-tensor path. One step t:
//   g = maximize ? -grad : grad
//   w = t^beta2_decay (the lerp weight 1 - beta2_t: 1 at t = 1, so step 1 takes the full g^2)
//   rho = min(lr, 1/sqrt(t));  alpha = max(eps2, RMS(p)) * rho   (RMS of p before the decay)
//   p *= 1 - lr * wd                                             (only when wd != 0)
//   factored (dim >= 2; 1 x n and n x 1 included), per matrix of the last two dims:
//     row_var = lerp(row_var, mean_j g^2, w);  col_var = lerp(col_var, mean_i g^2, w)
//     v = row_var_i * col_var_j / max(mean_i row_var, eps1)
//   unfactored (dim <= 1): variance = lerp(variance, g * g, w);  v = variance
//   u = rsqrt(max(v, eps1^2)) * g;  denom = max(1, RMS(u) / d);  p += (-alpha / denom) * u
// A tensor of more than two dims is, as torch factors it, a batch of independent matrices of
// its last two dims (leading dims flattened into `batch`): each matrix keeps its own row_var,
// col_var and mean(row_var); RMS(p) and RMS(u) are over the whole tensor. Flattening the
// leading dims into the rows instead would share one col_var between the matrices: not torch.
//
// Numerics. Statistics (sums of g^2 per row and per column, mean(row_var), RMS(p), RMS(u))
// are summed in double in a fixed order that depends on the shape only (never on the thread
// count), then rounded to fp32 once where torch holds an fp32 tensor: a row's norm
// sqrt(sum g^2), mean(row_var), the norms of p and u. Then torch's fp32 elementwise order:
// the norm squared, divided by the count; lerp as aten/src/ATen/native/Lerp.h writes it;
// r_i * c_j, / mean; clamp; 1 / sqrt; * g; p * decay; p + a * u. Step scalars are computed in
// double as torch's Python floats and rounded to fp32 once where a tensor op takes them.
// Where torch differs: it reduces in its own order and accumulator type (ours: double, in an
// order fixed by the shape), its vectorised CPU lerp_ and add_(alpha) are fused multiply-adds
// (ours are not fused: -ffp-contract=off, as every rule kernel here), CUDA's rsqrt is not
// correctly rounded and its division by a CPU scalar is a multiplication by the reciprocal.
// Results therefore agree with torch to fp32 rounding, not bit for bit (against LibTorch 1.13's
// ATen ops composed as the single-tensor step, ten steps: state within 6e-7 relative, weights
// within 1.5e-6 of max(|p|, RMS(p))); they are bitwise identical for every thread count.
// torch keeps t in an fp32 tensor, so its t stops at 2^24; ours is exact.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "shardopt/bf16.hpp"
#include "shardopt/host_device.hpp"

namespace shardopt::rules::adafactor {

/// torch.optim.Adafactor's hyperparameters and defaults (eps = (eps1, eps2); torch's eps1 =
/// None means the parameter dtype's machine epsilon: fp32's, the master weights' dtype; torch
/// stepping bf16 parameters directly would take bf16's 2^-7).
struct Config {
  double lr = 1e-2;           ///< caps the relative step rho; scales the weight decay
  double beta2_decay = -0.8;  ///< the second moment's weight at step t is t^beta2_decay
  double eps1 = std::numeric_limits<float>::epsilon();  ///< floor of mean(row_var); eps1^2 of v
  double eps2 = 1e-3;                                   ///< floor of RMS(p) in the step size
  double d = 1.0;                                       ///< update clipping threshold on RMS(u)
  double weight_decay = 0.0;                            ///< decoupled: p *= 1 - lr * wd
  bool maximize = false;
};

/// A factored parameter: `batch` row-major matrices of rows x cols, back to back (a 2-D
/// tensor has batch 1; more dims: the product of the leading ones).
struct Shape {
  std::size_t batch = 1;
  std::size_t rows = 0;
  std::size_t cols = 0;
};

/// The scalars of step t that do not depend on the data.
struct Scalars {
  float weight;  ///< lerp weight 1 - beta2_t = t^beta2_decay, rounded once
  double rho;    ///< min(lr, 1/sqrt(t)): alpha = max(eps2, RMS(p)) * rho in double
  double eps2;
  double d;
  float decay;       ///< 1 - lr * wd
  bool apply_decay;  ///< wd != 0 (torch skips the multiply otherwise)
  float eps1;        ///< clamp of mean(row_var)
  float eps1_sq;     ///< clamp of v: eps1 * eps1 in double, rounded once
  bool maximize;
};

/// What a step measured, when the caller asks (diagnostics, tests): the double sums behind
/// RMS(p) and RMS(u), bitwise the same at every thread count, and the step's factors.
struct StepStats {
  double sum_sq_param;   ///< sum of p^2, p before the decay
  double sum_sq_update;  ///< sum of u^2
  double alpha;          ///< max(eps2, RMS(p)) * rho
  double denom;          ///< max(1, RMS(u) / d): above 1 when the update was clipped
};

/// Checks the configuration (torch's constructor checks) and t >= 1; Error(InvalidArgument).
Scalars make_scalars(const Config& c, std::int64_t t);

// ---- the fixed reduction order (the CPU loops and the device passes, cuda/adafactor_op.hpp) --
//
// Factored: the rows of a matrix fall into reduction_chunks() chunks (chunk_first). A row's
// sum of g^2 and a chunk's sums of p^2 and of u^2 go through kLanes partial sums (element j of
// a row into lane j % kLanes, rows in order), added in one tree (combine); a column's sum of
// g^2 is, per chunk, its rows in order from 0, then the chunks' sums in chunk order; mean(row_var)
// is the rows in order; sum(p^2) and sum(u^2) are the chunks' combined lanes in chunk order.
// Unfactored: chunks of kVectorChunk elements, each through kLanes lanes (element j into lane
// j % kLanes), combined, then the chunks in order. Every sum starts at 0.0 and depends on the
// shape only: any thread count, on the CPU or the device, gives the same bits.

/// Row chunks of a matrix (the reduction units): at most kMaxChunks.
inline constexpr std::size_t kMaxChunks = 32;
/// Elements per chunk of an unfactored parameter.
inline constexpr std::size_t kVectorChunk = 4096;
/// Interleaved partial sums of a run, added in one fixed tree (combine).
inline constexpr std::size_t kLanes = 8;
static_assert(kVectorChunk % kLanes == 0);

/// The reduction chunks of a rows x cols parameter (factored: of its rows; else of its
/// rows * cols elements).
constexpr std::size_t reduction_chunks(std::size_t rows, std::size_t cols, bool factored) {
  return factored ? (rows < kMaxChunks ? rows : kMaxChunks)
                  : (rows * cols + kVectorChunk - 1) / kVectorChunk;
}
/// The first row of chunk c of n over `rows` rows (chunk c is [chunk_first(c), chunk_first(c + 1))).
SHARDOPT_HD std::size_t chunk_first(std::size_t c, std::size_t n, std::size_t rows) {
  return c * rows / n;
}
/// x^2 in double: exact (a float's 24-bit significand squared fits in 53 bits).
SHARDOPT_HD double sq(float x) { return static_cast<double>(x) * static_cast<double>(x); }
/// The lanes' sum, in one fixed tree.
SHARDOPT_HD double combine(const double* a) {
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}
static_assert(kLanes == 8, "combine() adds eight lanes");

/// The fp32 workspace the device backend's reduction needs for a rows x cols parameter, at
/// the start of the rule scratch (before the scaled gradient): the lanes of sum(p^2) and
/// sum(u^2) per chunk (2 kLanes reduction_chunks() doubles), then mean(row_var) and the step
/// coefficient (2 floats). rules::scratch_floats counts it on every device (the CPU backend
/// keeps its partial sums in vectors of its own step and leaves it unused).
constexpr std::size_t workspace_floats(std::size_t rows, std::size_t cols, bool factored) {
  return 2 * kLanes * reduction_chunks(rows, cols, factored) * (sizeof(double) / sizeof(float)) + 2;
}

/// State floats of a parameter: factored, rows + cols (row_var, col_var); unfactored, rows *
/// cols (variance). The Shape overload: batch * (rows + cols).
std::size_t state_floats(std::size_t rows, std::size_t cols, bool factored);
std::size_t state_floats(const Shape& shape);

/// One step of a factored parameter (dim >= 2) of `shape`: master and grad (batch*rows*cols),
/// row_var (batch*rows), col_var (batch*cols), all fp32, updated in place; the new weights
/// copied to out_bf16 (round to nearest even) and / or out_f32 when not null. t is the 1-based
/// step count the caller keeps (torch's state["step"] after its increment). Zero state is
/// torch's initial state. Threaded with OpenMP; results do not depend on the thread count.
/// `stats`, when not null, receives the step's measurements.
void step(const Config& c, std::int64_t t, const Shape& shape, float* master, const float* grad,
          float* row_var, float* col_var, bf16* out_bf16, float* out_f32,
          StepStats* stats = nullptr);
/// A 2-D parameter of rows x cols (a 1 x n tensor is factored too, as in torch).
void step(const Config& c, std::int64_t t, std::size_t rows, std::size_t cols, float* master,
          const float* grad, float* row_var, float* col_var, bf16* out_bf16, float* out_f32,
          StepStats* stats = nullptr);
/// One step of an unfactored parameter (dim <= 1) of n elements, variance (n floats).
void step_vector(const Config& c, std::int64_t t, std::size_t n, float* master, const float* grad,
                 float* variance, bf16* out_bf16, float* out_f32, StepStats* stats = nullptr);

// ---- the fp32 elementwise arithmetic, shared by the CPU loops and the device passes ----------

/// Python's max(a, b) on floats: the first argument unless the second compares greater, so a
/// NaN second argument gives the first, as torch's scalars do.
SHARDOPT_HD double py_max(double a, double b) { return b > a ? b : a; }

/// The coefficient a of p + a * u from the sums of p^2 and u^2 over n elements (torch:
/// alpha = max(eps2, ||p|| / sqrt(n)) * rho, denom = max(1, ||u|| / (sqrt(n) d)), the norms
/// fp32 tensors, the rest Python floats; a = -alpha / denom, negated again under maximize).
/// `stats`, when not null, receives the step's measurements.
SHARDOPT_HD float step_coefficient(const Scalars& s, double sum_p, double sum_u, std::size_t n,
                                   StepStats* stats) {
  const double root_n = ::sqrt(static_cast<double>(n));
  const double rms_p = static_cast<double>(static_cast<float>(::sqrt(sum_p))) / root_n;
  const double alpha = py_max(s.eps2, rms_p) * s.rho;
  const double ratio = static_cast<double>(static_cast<float>(::sqrt(sum_u))) / (root_n * s.d);
  const double denom = py_max(1.0, ratio);
  if (stats) *stats = StepStats{sum_p, sum_u, alpha, denom};
  // maximize negates g: g^2 and RMS(u) are unchanged, u and so the step change sign.
  const float a = static_cast<float>(-alpha / denom);
  return s.maximize ? -a : a;
}

/// torch's lerp (aten/src/ATen/native/Lerp.h): the form chosen by the weight keeps the result
/// exact at both ends (weight 1 gives `end` exactly).
SHARDOPT_HD float lerp(float self, float end, float weight) {
  return fabsf(weight) < 0.5f ? self + weight * (end - self) : end - (end - self) * (1.0f - weight);
}

/// A mean of squares from its double sum, as torch computes it: vector_norm (fp32 tensor),
/// squared in fp32, divided by the count (a Python int, so an fp32 division).
SHARDOPT_HD float mean_square(double sum_sq, std::size_t count) {
  const float norm = static_cast<float>(::sqrt(sum_sq));
  return (norm * norm) / static_cast<float>(count);
}

/// The update of one element from its variance estimate v: rsqrt(max(v, eps1^2)) * g, the
/// clamp keeping NaN (as torch's clamp_ does) and rsqrt as 1 / sqrt (torch's CPU kernels).
SHARDOPT_HD float update_element(float v, float g, float eps1_sq) {
  const float vc = v < eps1_sq ? eps1_sq : v;
  return (1.0f / sqrtf(vc)) * g;
}

/// The factored variance estimate r_i * c_j / m, m = max(mean(row_var), eps1) (torch's row_var
/// @ col_var, then div_).
SHARDOPT_HD float factored_variance(float r, float c, float m) { return (r * c) / m; }

/// The new weight: decay (only when wd != 0, as torch's mul_), then p + a * u (torch's
/// add_(u, alpha): two roundings, never fused).
SHARDOPT_HD float apply_element(const Scalars& s, float a, float p, float u) {
  return (s.apply_decay ? p * s.decay : p) + a * u;
}

}  // namespace shardopt::rules::adafactor
