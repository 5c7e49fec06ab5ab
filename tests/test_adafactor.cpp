// test_adafactor.cpp: Adafactor's CPU math (src/rules/adafactor.*) against an independent
// double-precision model of torch.optim.Adafactor's single-tensor step (torch/optim/
// _adafactor.py, PyTorch >= 2.5): ten steps on 96x64, 64x96, 128x128, a 3x33x17 batch, 1x100
// and 1000-element vectors; bitwise equality at 1, 2 and 3 OpenMP threads; then one property
// per test: the row / column variance update, the full g^2 at t = 1, the relative-step cap,
// update clipping on and off, the eps2 floor, the order of the weight decay, zero gradients,
// the replicas, and the argument checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "rules/adafactor.hpp"
#include "shardopt/bf16.hpp"
#include "shardopt/error.hpp"
#include "support/adafactor_model.hpp"

namespace shardopt::rules::adafactor {
namespace {

// The model: torch's algorithm in plain double loops (tests/support/adafactor_model.hpp).
using Model = test::AdafactorModel;

// ---- data -------------------------------------------------------------------------------------

/// splitmix64: the same numbers on every platform.
struct Rng {
  std::uint64_t s;
  std::uint64_t next() {
    std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53 * 2.0 - 1.0; }  // [-1, 1)
};

std::vector<float> random_floats(Rng& rng, std::size_t n, double scale) {
  std::vector<float> x(n);
  for (float& v : x) v = static_cast<float>(scale * rng.uniform());
  return x;
}

/// Gradients with rows and columns of different magnitudes (over four decades), so the
/// factored estimate has structure to get right.
std::vector<float> gradient(Rng& rng, std::size_t batch, std::size_t rows, std::size_t cols) {
  std::vector<double> rs(batch * rows), cs(batch * cols);
  for (double& s : rs) s = std::pow(10.0, 2.0 * rng.uniform());
  for (double& s : cs) s = std::pow(10.0, rng.uniform());
  std::vector<float> g(batch * rows * cols);
  for (std::size_t b = 0; b < batch; ++b)
    for (std::size_t i = 0; i < rows; ++i)
      for (std::size_t j = 0; j < cols; ++j)
        g[(b * rows + i) * cols + j] =
            static_cast<float>(1e-3 * rs[b * rows + i] * cs[b * cols + j] * rng.uniform());
  return g;
}

using test::max_rel;

// ---- ten steps against the model -------------------------------------------------------------

struct Case {
  const char* name;
  Shape shape;  // rows == 0: a vector of shape.cols elements
  Config cfg;
};

Config with(double lr, double wd, bool maximize, double d = 1.0) {
  Config c;
  c.lr = lr;
  c.weight_decay = wd;
  c.maximize = maximize;
  c.d = d;
  return c;
}

// Tolerances, measured (the test prints them) and justified. The model rounds nothing; the
// kernel sums in double but rounds like torch in fp32: a statistic goes through the norm, its
// square, the division and the lerp (about five roundings of <= 2^-24 each: <= 3e-7; measured
// <= 3.1e-7 relative for row_var, col_var and variance over the ten steps). The estimate v
// inherits that error (a product and a quotient of three such values), u = v^-1/2 g half of
// it, and the step alpha / denom * u a few ulp more; the weight is rounded after every step.
// Weights are compared relative to max(|p|, RMS(p)): an element that the step takes through
// zero keeps the absolute error of the values it came from (an ulp of RMS(p)), which is all
// fp32 can promise. Measured: <= 2.8e-7 at lr = 1e-2, <= 7.4e-7 at lr = 0.5 (steps of half
// RMS(p), ten roundings of p at about 2^-24 each). Bounds: 1e-6 and 2e-6, about 3x the worst
// measured; an algorithmic slip (decay order, lerp weight, clamp, clipping, eps2 floor) moves
// the results by 1e-4 or more.
constexpr double kStateTol = 1e-6;
constexpr double kWeightTol = 2e-6;

TEST(Adafactor, TenStepsMatchTheDoubleModelOfTorch) {
  const Case cases[] = {
      {"96x64", {1, 96, 64}, Config{}},
      {"64x96 lr=0.5 maximize", {1, 64, 96}, with(0.5, 0.0, true)},
      {"128x128 weight_decay=0.5", {1, 128, 128}, with(1e-2, 0.5, false)},
      {"3x33x17 (a 3-D tensor)", {3, 33, 17}, with(0.2, 0.1, false, 1.5)},
      {"1x100 (2-D: factored)", {1, 1, 100}, Config{}},
      {"1000 (1-D)", {1, 0, 1000}, Config{}},
      {"1000 (1-D) weight_decay=1 lr=0.5 d=1.2", {1, 0, 1000}, with(0.5, 1.0, false, 1.2)},
  };
  double worst_state = 0.0, worst_weight = 0.0;
  std::uint64_t seed = 1;
  for (const Case& cs : cases) {
    SCOPED_TRACE(cs.name);
    Rng rng{seed++};
    const bool factored = cs.shape.rows > 0;
    const std::size_t n = factored ? cs.shape.batch * cs.shape.rows * cs.shape.cols : cs.shape.cols;
    std::vector<float> p = random_floats(rng, n, 0.5);
    Model model(cs.cfg, cs.shape, p, factored);
    std::vector<float> row(factored ? cs.shape.batch * cs.shape.rows : 0),
        col(factored ? cs.shape.batch * cs.shape.cols : 0), var(factored ? 0 : n);
    double state_err = 0.0, weight_err = 0.0;
    for (std::int64_t t = 1; t <= 10; ++t) {
      const std::vector<float> g = factored
                                       ? gradient(rng, cs.shape.batch, cs.shape.rows, cs.shape.cols)
                                       : gradient(rng, 1, 1, n);
      if (factored)
        step(cs.cfg, t, cs.shape, p.data(), g.data(), row.data(), col.data(), nullptr, nullptr);
      else
        step_vector(cs.cfg, t, n, p.data(), g.data(), var.data(), nullptr, nullptr);
      model.step(t, g);
      if (factored) {
        state_err =
            std::max({state_err, max_rel(row, model.row, 0.0), max_rel(col, model.col, 0.0)});
      } else {
        state_err = std::max(state_err, max_rel(var, model.var, 0.0));
      }
      weight_err = std::max(weight_err, max_rel(p, model.p, Model::rms(model.p)));
    }
    std::printf("[ adafactor ] %-40s max rel error: state %.3g, weights %.3g\n", cs.name, state_err,
                weight_err);
    EXPECT_LE(state_err, kStateTol);
    EXPECT_LE(weight_err, kWeightTol);
    worst_state = std::max(worst_state, state_err);
    worst_weight = std::max(worst_weight, weight_err);
  }
  std::printf("[ adafactor ] worst: state %.3g, weights %.3g\n", worst_state, worst_weight);
}

// ---- thread counts ----------------------------------------------------------------------------

void set_threads(int t) {
#if defined(_OPENMP)
  static const int initial = omp_get_max_threads();
  omp_set_num_threads(t > 0 ? t : initial);
#else
  (void)t;
#endif
}

struct Result {
  std::vector<float> p, a, b, f32;
  std::vector<bf16> h;
  std::vector<StepStats> stats;
};

/// Three steps of a parameter (factored when shape.rows > 0) at `threads` threads.
Result run_steps(const Shape& shape, std::size_t n, int threads) {
  set_threads(threads);
  const bool factored = shape.rows > 0;
  Rng rng{77};
  Result r;
  r.p = random_floats(rng, n, 0.5);
  r.a.assign(factored ? shape.batch * shape.rows : n, 0.0f);
  r.b.assign(factored ? shape.batch * shape.cols : 0, 0.0f);
  r.f32.assign(n, 0.0f);
  r.h.assign(n, bf16{0});
  const Config c = with(0.3, 0.1, false, 1.0);
  r.stats.resize(3);
  for (std::int64_t t = 1; t <= 3; ++t) {
    const std::vector<float> g =
        factored ? gradient(rng, shape.batch, shape.rows, shape.cols) : gradient(rng, 1, 1, n);
    StepStats* st = &r.stats[static_cast<std::size_t>(t - 1)];
    if (factored)
      step(c, t, shape, r.p.data(), g.data(), r.a.data(), r.b.data(), r.h.data(), r.f32.data(), st);
    else
      step_vector(c, t, n, r.p.data(), g.data(), r.a.data(), r.h.data(), r.f32.data(), st);
  }
  set_threads(0);
  return r;
}

bool same_bits(const std::vector<float>& x, const std::vector<float>& y) {
  if (x.size() != y.size()) return false;
  for (std::size_t k = 0; k < x.size(); ++k)
    if (float_bits(x[k]) != float_bits(y[k])) return false;
  return true;
}

bool same_bits(const std::vector<StepStats>& x, const std::vector<StepStats>& y) {
  for (std::size_t k = 0; k < x.size(); ++k)
    for (auto f : {&StepStats::sum_sq_param, &StepStats::sum_sq_update, &StepStats::alpha,
                   &StepStats::denom})
      if (std::bit_cast<std::uint64_t>(x[k].*f) != std::bit_cast<std::uint64_t>(y[k].*f))
        return false;
  return x.size() == y.size();
}

// Shapes above the kernel's one-thread threshold (4096 elements), none a multiple of the
// lane count, with row counts above and below the 32 row chunks. The fp32 results alone would
// rarely see a change in the order of a double sum of squares (the change, ~n 2^-53 relative,
// moves an fp32 rounding about once in 2^29 / n statistics), so the double sums themselves
// (StepStats) are compared too: with values over eight decades, any other grouping of them
// changes their last bits.
TEST(Adafactor, BitwiseIdenticalAtOneTwoAndThreeThreads) {
#if !defined(_OPENMP)
  GTEST_SKIP() << "built without OpenMP";
#endif
  const struct {
    Shape shape;
    std::size_t n;
  } shapes[] = {{{1, 67, 131}, 67 * 131},   {{1, 1, 4099}, 4099},       {{1, 4099, 1}, 4099},
                {{1, 301, 257}, 301 * 257}, {{3, 67, 41}, 3 * 67 * 41}, {{1, 0, 0}, 10007},
                {{1, 0, 0}, 20000}};
  for (const auto& s : shapes) {
    SCOPED_TRACE(std::to_string(s.shape.batch) + "x" + std::to_string(s.shape.rows) + "x" +
                 std::to_string(s.shape.cols) + " n=" + std::to_string(s.n));
    const Result one = run_steps(s.shape, s.n, 1);
    for (int threads : {2, 3}) {
      const Result r = run_steps(s.shape, s.n, threads);
      EXPECT_TRUE(same_bits(one.stats, r.stats)) << threads << " threads: the double sums";
      EXPECT_TRUE(same_bits(one.p, r.p)) << threads << " threads: weights";
      EXPECT_TRUE(same_bits(one.a, r.a)) << threads << " threads: row_var / variance";
      EXPECT_TRUE(same_bits(one.b, r.b)) << threads << " threads: col_var";
      EXPECT_TRUE(same_bits(one.f32, r.f32)) << threads << " threads: fp32 replica";
      bool h_same = true;
      for (std::size_t k = 0; k < s.n; ++k) h_same = h_same && one.h[k].bits == r.h[k].bits;
      EXPECT_TRUE(h_same) << threads << " threads: bf16 replica";
    }
  }
}

// ---- properties -------------------------------------------------------------------------------

// Row and column factors are the means of g^2 over columns and rows, lerped with weight
// t^-0.8; at t = 1 the weight is exactly 1, so the factors are the means whatever the state
// held (the first step takes the full g^2).
TEST(Adafactor, RowAndColumnVarianceUpdate) {
  EXPECT_EQ(make_scalars(Config{}, 1).weight, 1.0f);
  EXPECT_EQ(make_scalars(Config{}, 2).weight, static_cast<float>(std::pow(2.0, -0.8)));
  EXPECT_EQ(make_scalars(Config{}, 100).weight, static_cast<float>(std::pow(100.0, -0.8)));
  const std::size_t R = 5, C = 7;
  std::vector<float> g(R * C), p(R * C, 0.25f);
  for (std::size_t i = 0; i < R; ++i)
    for (std::size_t j = 0; j < C; ++j) g[i * C + j] = 0.01f * float(i + 1) - 0.003f * float(j);
  auto row_mean = [&](std::size_t i) {
    double s = 0;
    for (std::size_t j = 0; j < C; ++j) s += double(g[i * C + j]) * g[i * C + j];
    return s / C;
  };
  auto col_mean = [&](std::size_t j) {
    double s = 0;
    for (std::size_t i = 0; i < R; ++i) s += double(g[i * C + j]) * g[i * C + j];
    return s / R;
  };
  // t = 1 from garbage state, and from torch's zero state: the same bits.
  std::vector<float> row(R, 123.0f), col(C, -7.0f), row0(R, 0.0f), col0(C, 0.0f);
  std::vector<float> p0 = p;
  step(Config{}, 1, R, C, p.data(), g.data(), row.data(), col.data(), nullptr, nullptr);
  step(Config{}, 1, R, C, p0.data(), g.data(), row0.data(), col0.data(), nullptr, nullptr);
  EXPECT_TRUE(same_bits(row, row0));
  EXPECT_TRUE(same_bits(col, col0));
  for (std::size_t i = 0; i < R; ++i) EXPECT_NEAR(row[i], row_mean(i), 1e-6 * row_mean(i)) << i;
  for (std::size_t j = 0; j < C; ++j) EXPECT_NEAR(col[j], col_mean(j), 1e-6 * col_mean(j)) << j;
  // t = 2 with the same gradient scaled by 2: factor = (1 - w) f + w 4 f.
  std::vector<float> g2(g);
  for (float& x : g2) x *= 2.0f;
  step(Config{}, 2, R, C, p.data(), g2.data(), row.data(), col.data(), nullptr, nullptr);
  const double w = std::pow(2.0, -0.8);
  for (std::size_t i = 0; i < R; ++i)
    EXPECT_NEAR(row[i], (1 + 3 * w) * row_mean(i), 2e-6 * row_mean(i)) << i;
  for (std::size_t j = 0; j < C; ++j)
    EXPECT_NEAR(col[j], (1 + 3 * w) * col_mean(j), 2e-6 * col_mean(j)) << j;
}

// A 1-D parameter with a constant gradient c: at t = 1 the variance is c^2, u = sign(c),
// RMS(u) = 1 (no clipping), so p -= max(eps2, RMS(p)) * rho. p = 1: p becomes 1 - rho.
float one_vector_step(const Config& c, std::int64_t t, float p0, float grad, float var0,
                      std::size_t n = 16) {
  std::vector<float> p(n, p0), g(n, grad), v(n, var0);
  step_vector(c, t, n, p.data(), g.data(), v.data(), nullptr, nullptr);
  for (std::size_t k = 1; k < n; ++k) EXPECT_EQ(p[k], p[0]);
  return p[0];
}

TEST(Adafactor, RelativeStepIsCappedByLr) {
  // rho = min(lr, 1/sqrt(t)); the variance state is c^2 already, so u = 1 at every t.
  const float c2 = 0.09f;
  EXPECT_FLOAT_EQ(one_vector_step(with(1e-2, 0, false), 1, 1.0f, 0.3f, 0.0f), 1.0f - 0.01f);
  EXPECT_FLOAT_EQ(one_vector_step(with(1e-2, 0, false), 400, 1.0f, 0.3f, c2), 1.0f - 0.01f);
  EXPECT_FLOAT_EQ(one_vector_step(with(1.0, 0, false), 1, 1.0f, 0.3f, 0.0f), 0.0f);
  EXPECT_FLOAT_EQ(one_vector_step(with(1.0, 0, false), 4, 1.0f, 0.3f, c2), 0.5f);
  EXPECT_FLOAT_EQ(one_vector_step(with(1.0, 0, false), 100, 1.0f, 0.3f, c2), 0.9f);
  EXPECT_FLOAT_EQ(one_vector_step(with(0.05, 0, false), 100, 1.0f, 0.3f, c2), 0.95f);
  // maximize: the step goes the other way.
  EXPECT_FLOAT_EQ(one_vector_step(with(1.0, 0, true), 4, 1.0f, 0.3f, c2), 1.5f);
}

TEST(Adafactor, UpdateClippingTriggersOnlyAboveD) {
  // 1-D, t = 2 from zero state: v = w c^2, u = 1/sqrt(w) = 1.32 > 1 = d: clipped to RMS 1.
  const double w = std::pow(2.0, -0.8), big = 1.0 / std::sqrt(w);
  ASSERT_GT(big, 1.3);
  EXPECT_NEAR(one_vector_step(with(1e-2, 0, false), 2, 1.0f, 0.3f, 0.0f), 1.0 - 0.01, 1e-7);
  // d = 2 > RMS(u): not clipped, the step is 1.32 alpha.
  EXPECT_NEAR(one_vector_step(with(1e-2, 0, false, 2.0), 2, 1.0f, 0.3f, 0.0f), 1.0 - 0.01 * big,
              1e-7);
  // Factored, a rank-1 gradient a_i b_j: the estimate is w g^2 at t = 2 from zero state, so
  // again |u| = 1.32 everywhere: clipped at d = 1, not at d = 2.
  const std::size_t R = 6, C = 9;
  std::vector<float> g(R * C);
  for (std::size_t i = 0; i < R; ++i)
    for (std::size_t j = 0; j < C; ++j)
      g[i * C + j] = 0.5f * float(i + 1) * (j % 2 ? 1.0f : -0.25f);
  for (double d : {1.0, 2.0}) {
    std::vector<float> p(R * C, 1.0f), row(R, 0.0f), col(C, 0.0f);
    StepStats st{};
    step(with(1e-2, 0, false, d), 2, R, C, p.data(), g.data(), row.data(), col.data(), nullptr,
         nullptr, &st);
    EXPECT_NEAR(st.sum_sq_update / double(R * C), 1.0 / w, 1e-5);
    if (d == 1.0)
      EXPECT_NEAR(st.denom, big, 1e-6);
    else
      EXPECT_EQ(st.denom, 1.0);
    const double stride = d == 1.0 ? 0.01 : 0.01 * big;
    for (std::size_t k = 0; k < R * C; ++k)
      EXPECT_NEAR(p[k], 1.0 - stride * (g[k] > 0 ? 1 : -1), 2e-7) << "d=" << d << " k=" << k;
  }
  // t = 1, a rank-1 gradient: the estimate is g^2 in the math, RMS(u) = 1 = d: the boundary,
  // where clipping or not changes the step by an ulp at most.
  std::vector<float> p(R * C, 1.0f), row(R, 0.0f), col(C, 0.0f);
  StepStats st{};
  step(Config{}, 1, R, C, p.data(), g.data(), row.data(), col.data(), nullptr, nullptr, &st);
  EXPECT_NEAR(st.denom, 1.0, 1e-6);
  for (std::size_t k = 0; k < R * C; ++k) EXPECT_NEAR(p[k], 1.0 - 0.01 * (g[k] > 0 ? 1 : -1), 2e-7);
}

TEST(Adafactor, Eps2FloorsAlphaForAZeroParameter) {
  // RMS(p) = 0: alpha = eps2 * rho = 1e-3 * 1e-2.
  EXPECT_FLOAT_EQ(one_vector_step(Config{}, 1, 0.0f, 0.3f, 0.0f), -1e-5f);
  EXPECT_FLOAT_EQ(one_vector_step(Config{}, 1, 0.0f, -0.3f, 0.0f), 1e-5f);
  Config c;
  c.eps2 = 0.1;
  EXPECT_FLOAT_EQ(one_vector_step(c, 1, 0.0f, 0.3f, 0.0f), -1e-3f);
  // Factored too, and a tiny parameter (RMS below eps2) steps by eps2 * rho as well.
  std::vector<float> p(12, 0.0f), g(12, 0.5f), row(3, 0.0f), col(4, 0.0f);
  step(Config{}, 1, 3, 4, p.data(), g.data(), row.data(), col.data(), nullptr, nullptr);
  for (float x : p) EXPECT_FLOAT_EQ(x, -1e-5f);
  EXPECT_FLOAT_EQ(one_vector_step(Config{}, 1, 1e-4f, 0.3f, 0.0f), 1e-4f - 1e-5f);
}

TEST(Adafactor, WeightDecayIsDecoupledAndAlphaUsesTheWeightsBeforeIt) {
  // p = 1, lr = 0.01, wd = 10: p = 1 * (1 - 0.1) - 0.01 * RMS(1) = 0.89 (0.891 if alpha
  // took the decayed weights; 0.8911 if the decay came after the step).
  EXPECT_FLOAT_EQ(one_vector_step(with(1e-2, 10.0, false), 1, 1.0f, 0.3f, 0.0f), 0.89f);
  std::vector<float> p(12, 1.0f), g(12, 0.5f), row(3, 0.0f), col(4, 0.0f);
  step(with(1e-2, 10.0, false), 1, 3, 4, p.data(), g.data(), row.data(), col.data(), nullptr,
       nullptr);
  for (float x : p) EXPECT_FLOAT_EQ(x, 0.89f);
}

TEST(Adafactor, ZeroGradientLeavesTheWeightsAndHasNoNaN) {
  Rng rng{5};
  std::vector<float> p = random_floats(rng, 40 * 30, 1.0), p0 = p, g(40 * 30, 0.0f);
  std::vector<float> row(40, 0.0f), col(30, 0.0f), var(40 * 30, 0.0f);
  for (std::int64_t t = 1; t <= 3; ++t)
    step(Config{}, t, 40, 30, p.data(), g.data(), row.data(), col.data(), nullptr, nullptr);
  EXPECT_TRUE(same_bits(p, p0));
  for (float x : row) EXPECT_EQ(x, 0.0f);
  for (float x : col) EXPECT_EQ(x, 0.0f);
  std::vector<float> q = p0;
  step_vector(Config{}, 1, q.size(), q.data(), g.data(), var.data(), nullptr, nullptr);
  EXPECT_TRUE(same_bits(q, p0));
  // With decay, only the decay.
  const Config c = with(0.1, 0.5, false);
  step(c, 1, 40, 30, p.data(), g.data(), row.data(), col.data(), nullptr, nullptr);
  for (std::size_t k = 0; k < p.size(); ++k) {
    ASSERT_FALSE(std::isnan(p[k]));
    EXPECT_EQ(p[k], p0[k] * static_cast<float>(1.0 - 0.1 * 0.5));
  }
  // A zero parameter and a zero gradient: still no NaN.
  std::vector<float> z(40 * 30, 0.0f);
  step(Config{}, 1, 40, 30, z.data(), g.data(), row.data(), col.data(), nullptr, nullptr);
  for (float x : z) EXPECT_EQ(x, 0.0f);
}

TEST(Adafactor, ReplicasAreTheNewMasterRounded) {
  Rng rng{9};
  const std::size_t R = 37, C = 53;
  std::vector<float> p = random_floats(rng, R * C, 1.0), g = gradient(rng, 1, R, C);
  std::vector<float> row(R, 0.0f), col(C, 0.0f), f32(R * C, -1.0f);
  std::vector<bf16> h(R * C, bf16{0xFFFF});
  step(Config{}, 1, R, C, p.data(), g.data(), row.data(), col.data(), h.data(), f32.data());
  std::size_t inexact = 0;
  for (std::size_t k = 0; k < R * C; ++k) {
    ASSERT_EQ(h[k].bits, to_bf16(p[k]).bits) << k;
    ASSERT_EQ(float_bits(f32[k]), float_bits(p[k])) << k;
    inexact += to_float(h[k]) != p[k];
  }
  EXPECT_GT(inexact, R * C / 2);  // the copy is rounded, not truncated by accident of the data
  // One of the two, and the vector path.
  std::vector<float> v(100, 0.0f), q = random_floats(rng, 100, 1.0), gv = gradient(rng, 1, 1, 100);
  std::vector<bf16> hv(100, bf16{0});
  step_vector(Config{}, 1, 100, q.data(), gv.data(), v.data(), hv.data(), nullptr);
  for (std::size_t k = 0; k < 100; ++k) ASSERT_EQ(hv[k].bits, to_bf16(q[k]).bits) << k;
}

TEST(Adafactor, StateFloats) {
  EXPECT_EQ(state_floats(96, 64, true), 160u);
  EXPECT_EQ(state_floats(1, 100, true), 101u);
  EXPECT_EQ(state_floats(1, 1000, false), 1000u);
  EXPECT_EQ(state_floats(Shape{3, 33, 17}), 150u);
}

void expect_invalid(const std::function<void()>& f, const char* what) {
  try {
    f();
    ADD_FAILURE() << what << ": no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::InvalidArgument) << what;
    EXPECT_NE(std::string(e.what()).find("adafactor"), std::string::npos) << e.what();
  }
}

TEST(Adafactor, InvalidArgumentsThrow) {
  std::vector<float> p(12, 1.0f), g(12, 1.0f), row(3, 0.0f), col(4, 0.0f), var(12, 0.0f);
  const std::vector<float> p0 = p;
  auto factored = [&](const Config& c, std::int64_t t, std::size_t r, std::size_t cc) {
    return [&, c, t, r, cc] {
      step(c, t, r, cc, p.data(), g.data(), row.data(), col.data(), nullptr, nullptr);
    };
  };
  const double nan = std::numeric_limits<double>::quiet_NaN();
  Config bad;
  expect_invalid(factored(Config{}, 0, 3, 4), "t = 0");
  expect_invalid(factored(Config{}, -1, 3, 4), "t < 0");
  expect_invalid(factored(Config{}, 1, 0, 4), "rows = 0");
  expect_invalid(factored(Config{}, 1, 3, 0), "cols = 0");
  bad = Config{}, bad.lr = -1e-3;
  expect_invalid(factored(bad, 1, 3, 4), "lr < 0");
  bad = Config{}, bad.lr = nan;
  expect_invalid(factored(bad, 1, 3, 4), "lr NaN");
  bad = Config{}, bad.beta2_decay = 0.1;
  expect_invalid(factored(bad, 1, 3, 4), "beta2_decay > 0");
  bad = Config{}, bad.eps1 = -1.0;
  expect_invalid(factored(bad, 1, 3, 4), "eps1 < 0");
  bad = Config{}, bad.eps2 = -1.0;
  expect_invalid(factored(bad, 1, 3, 4), "eps2 < 0");
  bad = Config{}, bad.d = 0.5;
  expect_invalid(factored(bad, 1, 3, 4), "d < 1");
  bad = Config{}, bad.weight_decay = -0.1;
  expect_invalid(factored(bad, 1, 3, 4), "weight_decay < 0");
  expect_invalid(
      [&] { step(Config{}, 1, 3, 4, nullptr, g.data(), row.data(), col.data(), nullptr, nullptr); },
      "null master");
  expect_invalid(
      [&] { step(Config{}, 1, 3, 4, p.data(), g.data(), row.data(), nullptr, nullptr, nullptr); },
      "null col_var");
  expect_invalid(
      [&] {
        step(Config{}, 1, Shape{0, 3, 4}, p.data(), g.data(), row.data(), col.data(), nullptr,
             nullptr);
      },
      "batch = 0");
  const std::size_t huge = std::size_t{1} << 40;
  expect_invalid(
      [&] {
        step(Config{}, 1, Shape{1, huge, huge}, p.data(), g.data(), row.data(), col.data(), nullptr,
             nullptr);
      },
      "size overflow");
  expect_invalid(
      [&] { step_vector(Config{}, 1, 0, p.data(), g.data(), var.data(), nullptr, nullptr); },
      "n = 0");
  expect_invalid(
      [&] { step_vector(Config{}, 0, 12, p.data(), g.data(), var.data(), nullptr, nullptr); },
      "vector t = 0");
  expect_invalid(
      [&] { step_vector(Config{}, 1, 12, p.data(), nullptr, var.data(), nullptr, nullptr); },
      "null grad");
  expect_invalid(
      [&] { step_vector(Config{}, 1, 12, p.data(), g.data(), nullptr, nullptr, nullptr); },
      "null variance");
  EXPECT_TRUE(same_bits(p, p0));  // nothing was written
}

}  // namespace
}  // namespace shardopt::rules::adafactor
