// adafactor.cpp: the Adafactor CPU kernels (adafactor.hpp).
//
// Factored: three passes over g. (1) Statistics: per fixed chunk of rows, the row sums of g^2
// (each row's lerp done at once), the chunk's column sums and its sum of p^2; the chunks'
// column sums are then added in chunk order. (2) RMS(u), per chunk. (3) The update. The
// chunks depend on the shape only, and a run's sum goes through kLanes interleaved partial
// sums added in one tree, so every sum has one order whatever the thread count. u is
// recomputed in (3) rather than stored (a 512-column tile at a time, on the stack): the same
// arithmetic gives the same bits, and storing it would cost a parameter-sized buffer in an
// optimizer chosen to save memory. Unfactored: chunks of 4096 elements, two passes.
#include "rules/adafactor.hpp"

#include <algorithm>
#include <string>
#include <vector>

#include "shardopt/error.hpp"

namespace shardopt::rules::adafactor {

namespace {

// The chunks, lanes and sums of the header's "fixed reduction order" (kMaxChunks bounds the
// column sums' scratch to kMaxChunks doubles per column; the lanes are independent chains the
// compiler can vectorise).

/// Below this many elements one thread runs (a parallel region costs more than it saves).
constexpr std::size_t kParallelMin = 4096;

using Lanes = double[kLanes];

/// Columns per tile of the update loops: u of a tile lives on the stack between its loops.
/// A multiple of kLanes, so element j of a row goes to lane j % kLanes, tile or not.
constexpr std::size_t kTile = 512;
static_assert(kTile % kLanes == 0);

/// acc[j % kLanes] += x[j]^2 over a run starting at lane 0 (simple loops the compiler
/// vectorises; the order of each lane's additions is the run's order).
void add_squares(Lanes& acc, const float* __restrict x, std::size_t n) {
  Lanes a;
  for (std::size_t k = 0; k < kLanes; ++k) a[k] = acc[k];
  std::size_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (std::size_t k = 0; k < kLanes; ++k) a[k] += sq(x[j + k]);
  for (std::size_t k = 0; j < n; ++j, ++k) a[k] += sq(x[j]);
  for (std::size_t k = 0; k < kLanes; ++k) acc[k] = a[k];
}

/// col[j] += x[j]^2: a chunk's column sums, one row more.
void add_column_squares(double* __restrict col, const float* __restrict x, std::size_t n) {
  for (std::size_t j = 0; j < n; ++j) col[j] += sq(x[j]);
}

/// u of a run of one row (row factor r, clamped mean m).
void factored_updates(float* __restrict u, const float* __restrict g, const float* __restrict cv,
                      float r, float m, float eps1_sq, std::size_t n) {
  for (std::size_t j = 0; j < n; ++j)
    u[j] = update_element(factored_variance(r, cv[j], m), g[j], eps1_sq);
}

/// Python's min(a, b) on floats (as py_max, adafactor.hpp).
double py_min(double a, double b) { return b < a ? b : a; }

void require_pointers(const float* master, const float* grad, const float* a, const float* b,
                      const char* what) {
  require(master && grad && a && b, Status::InvalidArgument,
          std::string("adafactor::") + what + ": a null master, grad or state pointer");
}

/// An unfactored run: v = lerp(v, g * g, w) (torch's grad * grad, an fp32 product), u from v.
void variance_updates(float* __restrict v, float* __restrict u, const float* __restrict g, float w,
                      float eps1_sq, std::size_t n) {
  for (std::size_t j = 0; j < n; ++j) {
    v[j] = lerp(v[j], g[j] * g[j], w);
    u[j] = update_element(v[j], g[j], eps1_sq);
  }
}

/// The new weights over a run (apply_element: decay, then p + a * u), then its replicas.
void apply_updates(const Scalars& s, float a, float* __restrict p, const float* __restrict u,
                   bf16* __restrict out_bf16, float* __restrict out_f32, std::size_t n) {
  for (std::size_t j = 0; j < n; ++j) p[j] = apply_element(s, a, p[j], u[j]);
  if (out_bf16)
    for (std::size_t j = 0; j < n; ++j) out_bf16[j] = to_bf16(p[j]);
  if (out_f32)
    for (std::size_t j = 0; j < n; ++j) out_f32[j] = p[j];
}

}  // namespace

Scalars make_scalars(const Config& c, std::int64_t t) {
  // torch's constructor checks (each also refuses NaN), and a step count of at least 1.
  require(c.lr >= 0.0, Status::InvalidArgument, "adafactor: lr must be >= 0");
  require(c.beta2_decay <= 0.0, Status::InvalidArgument, "adafactor: beta2_decay must be <= 0");
  require(c.eps1 >= 0.0, Status::InvalidArgument, "adafactor: eps1 must be >= 0");
  require(c.eps2 >= 0.0, Status::InvalidArgument, "adafactor: eps2 must be >= 0");
  require(c.d >= 1.0, Status::InvalidArgument, "adafactor: the clipping threshold d must be >= 1");
  require(c.weight_decay >= 0.0, Status::InvalidArgument, "adafactor: weight_decay must be >= 0");
  require(t >= 1, Status::InvalidArgument, "adafactor: the step count t is 1-based (t >= 1)");
  const double tf = static_cast<double>(t);
  Scalars s{};
  s.weight = static_cast<float>(std::pow(tf, c.beta2_decay));
  s.rho = py_min(c.lr, 1.0 / std::pow(tf, 0.5));
  s.eps2 = c.eps2;
  s.d = c.d;
  s.decay = static_cast<float>(1.0 - c.lr * c.weight_decay);
  s.apply_decay = c.weight_decay != 0.0;
  s.eps1 = static_cast<float>(c.eps1);
  s.eps1_sq = static_cast<float>(c.eps1 * c.eps1);
  s.maximize = c.maximize;
  return s;
}

std::size_t state_floats(std::size_t rows, std::size_t cols, bool factored) {
  return factored ? rows + cols : rows * cols;
}
std::size_t state_floats(const Shape& shape) { return shape.batch * (shape.rows + shape.cols); }

void step(const Config& c, std::int64_t t, std::size_t rows, std::size_t cols, float* master,
          const float* grad, float* row_var, float* col_var, bf16* out_bf16, float* out_f32,
          StepStats* stats) {
  step(c, t, Shape{1, rows, cols}, master, grad, row_var, col_var, out_bf16, out_f32, stats);
}

void step(const Config& c, std::int64_t t, const Shape& shape, float* master, const float* grad,
          float* row_var, float* col_var, bf16* out_bf16, float* out_f32, StepStats* stats) {
  const Scalars s = make_scalars(c, t);
  const std::size_t B = shape.batch, R = shape.rows, C = shape.cols;
  require(B > 0 && R > 0 && C > 0, Status::InvalidArgument,
          "adafactor::step: batch, rows and cols must be >= 1 (torch cannot step an empty "
          "tensor either)");
  constexpr std::size_t kMax = static_cast<std::size_t>(-1);
  require(C <= kMax / R && R * C <= kMax / B, Status::InvalidArgument,
          "adafactor::step: batch * rows * cols overflows size_t");
  require_pointers(master, grad, row_var, col_var, "step");
  const std::size_t mat = R * C, n = B * mat, nc = std::min(R, kMaxChunks);
  const bool par = n >= kParallelMin;
  std::vector<double> col_part(nc * C), p_part(B * nc), u_part(B * nc);
  std::vector<float> mean_r(B);

  // (1) Statistics, matrix by matrix: row sums of g^2 and row_var, column sums per chunk,
  // sums of p^2 per chunk (p before the decay, as torch's alpha).
  for (std::size_t b = 0; b < B; ++b) {
    const float* g = grad + b * mat;
    const float* p = master + b * mat;
    float* rv = row_var + b * R;
    float* cv = col_var + b * C;
#pragma omp parallel for schedule(static) if (par)
    for (std::ptrdiff_t ch = 0; ch < static_cast<std::ptrdiff_t>(nc); ++ch) {
      double* cp = col_part.data() + static_cast<std::size_t>(ch) * C;
      std::fill(cp, cp + C, 0.0);
      Lanes pl = {};
      const std::size_t last = chunk_first(static_cast<std::size_t>(ch) + 1, nc, R);
      for (std::size_t i = chunk_first(static_cast<std::size_t>(ch), nc, R); i < last; ++i) {
        const float* gi = g + i * C;
        const float* pi = p + i * C;
        Lanes rl = {};
        add_squares(rl, gi, C);
        add_column_squares(cp, gi, C);
        add_squares(pl, pi, C);
        rv[i] = lerp(rv[i], mean_square(combine(rl), C), s.weight);
      }
      p_part[b * nc + static_cast<std::size_t>(ch)] = combine(pl);
    }
    // Column sums: the chunks in order.
#pragma omp parallel for schedule(static) if (par)
    for (std::ptrdiff_t jj = 0; jj < static_cast<std::ptrdiff_t>(C); ++jj) {
      const std::size_t j = static_cast<std::size_t>(jj);
      double sum = 0.0;
      for (std::size_t ch = 0; ch < nc; ++ch) sum += col_part[ch * C + j];
      cv[j] = lerp(cv[j], mean_square(sum, R), s.weight);
    }
    // mean(row_var) (an fp32 tensor in torch), clamped at eps1 (NaN stays NaN, as clamp_).
    double sum = 0.0;
    for (std::size_t i = 0; i < R; ++i) sum += rv[i];
    const float m = static_cast<float>(sum / static_cast<double>(R));
    mean_r[b] = m < s.eps1 ? s.eps1 : m;
  }

  // (2) RMS(u): u^2 summed per chunk of every matrix.
#pragma omp parallel for schedule(static) if (par)
  for (std::ptrdiff_t task = 0; task < static_cast<std::ptrdiff_t>(B * nc); ++task) {
    const std::size_t b = static_cast<std::size_t>(task) / nc,
                      ch = static_cast<std::size_t>(task) % nc;
    const float* cv = col_var + b * C;
    const float m = mean_r[b];
    Lanes ul = {};
    float u[kTile];
    const std::size_t last = chunk_first(ch + 1, nc, R);
    for (std::size_t i = chunk_first(ch, nc, R); i < last; ++i) {
      const float* gi = grad + b * mat + i * C;
      const float r = row_var[b * R + i];
      for (std::size_t j = 0; j < C; j += kTile) {
        const std::size_t len = std::min(kTile, C - j);
        factored_updates(u, gi + j, cv + j, r, m, s.eps1_sq, len);
        add_squares(ul, u, len);
      }
    }
    u_part[static_cast<std::size_t>(task)] = combine(ul);
  }
  double sum_p = 0.0, sum_u = 0.0;
  for (std::size_t k = 0; k < B * nc; ++k) {
    sum_p += p_part[k];
    sum_u += u_part[k];
  }
  const float a = step_coefficient(s, sum_p, sum_u, n, stats);

  // (3) The update, row by row (no sums: any split gives the same bits).
#pragma omp parallel for schedule(static) if (par)
  for (std::ptrdiff_t row = 0; row < static_cast<std::ptrdiff_t>(B * R); ++row) {
    const std::size_t b = static_cast<std::size_t>(row) / R;
    const std::size_t at = static_cast<std::size_t>(row) * C;
    const float* cv = col_var + b * C;
    const float r = row_var[row], m = mean_r[b];
    float u[kTile];
    for (std::size_t j = 0; j < C; j += kTile) {
      const std::size_t len = std::min(kTile, C - j), o = at + j;
      factored_updates(u, grad + o, cv + j, r, m, s.eps1_sq, len);
      apply_updates(s, a, master + o, u, out_bf16 ? out_bf16 + o : nullptr,
                    out_f32 ? out_f32 + o : nullptr, len);
    }
  }
}

void step_vector(const Config& c, std::int64_t t, std::size_t n, float* master, const float* grad,
                 float* variance, bf16* out_bf16, float* out_f32, StepStats* stats) {
  const Scalars s = make_scalars(c, t);
  require(n > 0, Status::InvalidArgument,
          "adafactor::step_vector: n must be >= 1 (torch cannot step an empty tensor either)");
  require_pointers(master, grad, variance, variance, "step_vector");
  const std::size_t nc = (n + kVectorChunk - 1) / kVectorChunk;
  const bool par = n >= kParallelMin;
  std::vector<double> p_part(nc), u_part(nc);

  // (1) Per chunk: p^2 (before the decay), the variance's lerp towards g * g (fp32, as torch's
  // grad * grad), and u^2 from the new variance.
#pragma omp parallel for schedule(static) if (par)
  for (std::ptrdiff_t ch = 0; ch < static_cast<std::ptrdiff_t>(nc); ++ch) {
    const std::size_t first = static_cast<std::size_t>(ch) * kVectorChunk;
    const std::size_t len = std::min(kVectorChunk, n - first);
    const float* g = grad + first;
    const float* p = master + first;
    float* v = variance + first;
    Lanes pl = {}, ul = {};
    add_squares(pl, p, len);
    float u[kTile];
    for (std::size_t j = 0; j < len; j += kTile) {
      const std::size_t tl = std::min(kTile, len - j);
      variance_updates(v + j, u, g + j, s.weight, s.eps1_sq, tl);
      add_squares(ul, u, tl);
    }
    p_part[static_cast<std::size_t>(ch)] = combine(pl);
    u_part[static_cast<std::size_t>(ch)] = combine(ul);
  }
  double sum_p = 0.0, sum_u = 0.0;
  for (std::size_t k = 0; k < nc; ++k) {
    sum_p += p_part[k];
    sum_u += u_part[k];
  }
  const float a = step_coefficient(s, sum_p, sum_u, n, stats);

  // (2) The update.
#pragma omp parallel for schedule(static) if (par)
  for (std::ptrdiff_t ch = 0; ch < static_cast<std::ptrdiff_t>(nc); ++ch) {
    const std::size_t first = static_cast<std::size_t>(ch) * kVectorChunk;
    const std::size_t last = std::min(n, first + kVectorChunk);
    float u[kTile];
    for (std::size_t j = first; j < last; j += kTile) {
      const std::size_t len = std::min(kTile, last - j);
      for (std::size_t k = 0; k < len; ++k)
        u[k] = update_element(variance[j + k], grad[j + k], s.eps1_sq);
      apply_updates(s, a, master + j, u, out_bf16 ? out_bf16 + j : nullptr,
                    out_f32 ? out_f32 + j : nullptr, len);
    }
  }
}

}  // namespace shardopt::rules::adafactor
