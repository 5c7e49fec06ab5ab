// test_muon.cpp: Muon's CPU math (src/rules/muon.*) against a double-precision model of
// torch.optim.Muon written here with plain loops (ten steps on 96x64, 64x96 and 128x128;
// Newton-Schulz alone at 64x64 and 384x1024), bit for bit against an fp32 re-implementation
// of the same arithmetic in naive loops (so the blocked GEMM sums in the documented order), at
// 1, 2 and 3 threads and on every instruction set, NS(U^T) = NS(U)^T, the element math
// (PyTorch's lerp, Nesterov or not, each lr adjustment, weight decay, the replica), zero
// gradients, 1 x N and N x 1 matrices, and the argument checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include <omp.h>

#include "cpu/kernels.hpp"
#include "rules/muon.hpp"
#include "shardopt/bf16.hpp"
#include "shardopt/error.hpp"
#include "support/muon_model.hpp"
#include "support/omp_threads.hpp"

namespace shardopt::rules::muon {
namespace {

using test::ns_double;
using test::rel_frobenius;

// ---- inputs ---------------------------------------------------------------------------------

/// Seeded values in [-scale, scale): splitmix64, the same on every platform.
std::vector<float> random_matrix(std::size_t n, std::uint64_t seed, float scale = 1.0f) {
  std::vector<float> v(n);
  std::uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (float& x : v) {
    s += 0x9E3779B97F4A7C15ull;
    std::uint64_t z = s;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    x = scale * (static_cast<float>(z >> 40) / 8388608.0f - 1.0f);
  }
  return v;
}

bool same_bits(const std::vector<float>& x, const std::vector<float>& y) {
  return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
}

// ---- the double model of torch.optim.Muon (tests/support/muon_model.hpp) -------------------

/// One torch.optim.Muon step in double under `cfg`.
void model_step(const Config& cfg, std::size_t rows, std::size_t cols, std::vector<double>& p,
                std::vector<double>& buf, const std::vector<float>& g) {
  const double r = static_cast<double>(rows), c = static_cast<double>(cols);
  const double ratio = cfg.adjust == LrAdjust::Original        ? std::sqrt(std::max(1.0, r / c))
                       : cfg.adjust == LrAdjust::MatchRmsAdamW ? 0.2 * std::sqrt(std::max(r, c))
                                                               : 1.0;
  test::muon_step_double({cfg.momentum, cfg.a, cfg.b, cfg.c, cfg.eps, cfg.ns_steps, cfg.nesterov,
                          cfg.lr, cfg.weight_decay, ratio},
                         rows, cols, p, buf, g);
}

// ---- an fp32 re-implementation in naive loops: the order muon.hpp documents -----------------

float torch_lerp(float self, float end, float w) {  // aten/src/ATen/native/Lerp.h, scalar
  return std::fabs(w) < 0.5f ? self + w * (end - self) : end - (end - self) * (1.0f - w);
}

std::vector<float> ns_naive_f32(std::size_t rows, std::size_t cols, const std::vector<float>& u,
                                float a, float b, float c, double eps, int steps) {
  const bool tr = rows > cols;
  const std::size_t m = tr ? cols : rows, n = tr ? rows : cols;
  std::vector<float> x(m * n), s(m * m), t(m * m), y(m * n);
  for (std::size_t i = 0; i < m; ++i)
    for (std::size_t j = 0; j < n; ++j) x[i * n + j] = tr ? u[j * m + i] : u[i * n + j];
  double sum = 0;
  for (float v : x) sum += static_cast<double>(v) * v;
  const float d = static_cast<float>(std::max(std::sqrt(sum), eps));
  for (float& v : x) v = v / d;
  for (int it = 0; it < steps; ++it) {
    for (std::size_t i = 0; i < m; ++i)
      for (std::size_t j = 0; j < m; ++j) {
        float acc = 0.0f;
        for (std::size_t k = 0; k < n; ++k) acc += x[i * n + k] * x[j * n + k];
        s[i * m + j] = acc;
      }
    for (std::size_t i = 0; i < m; ++i)
      for (std::size_t j = 0; j < m; ++j) {
        float acc = 0.0f;
        for (std::size_t k = 0; k < m; ++k) acc += s[i * m + k] * s[k * m + j];
        t[i * m + j] = b * s[i * m + j] + c * acc;
      }
    for (std::size_t i = 0; i < m; ++i)
      for (std::size_t j = 0; j < n; ++j) {
        float acc = 0.0f;
        for (std::size_t k = 0; k < m; ++k) acc += t[i * m + k] * x[k * n + j];
        y[i * n + j] = a * x[i * n + j] + acc;
      }
    std::swap(x, y);
  }
  std::vector<float> out(rows * cols);
  for (std::size_t i = 0; i < m; ++i)
    for (std::size_t j = 0; j < n; ++j) (tr ? out[j * m + i] : out[i * n + j]) = x[i * n + j];
  return out;
}

std::vector<float> ns(std::size_t rows, std::size_t cols, const std::vector<float>& u,
                      int steps = kDefaultNsSteps) {
  Workspace ws;
  std::vector<float> out(rows * cols);
  newton_schulz(rows, cols, u.data(), out.data(), static_cast<float>(kDefaultA),
                static_cast<float>(kDefaultB), static_cast<float>(kDefaultC), 1e-7, steps, ws);
  return out;
}

/// Runs f at `threads` OpenMP threads, then restores the count before.
template <class F>
auto with_threads(int threads, F f) {
  const test::OmpThreads scope(threads);
  return f();
}

// ---- against the double model ---------------------------------------------------------------

struct Golden {
  std::size_t rows, cols;
  Config cfg;
  double tolerance;  ///< relative Frobenius error of the master weights (measured, see below)
};

void run_golden(const Golden& gc, double* err_master, double* err_change) {
  const std::size_t n = gc.rows * gc.cols;
  std::vector<float> p = random_matrix(n, 11 + n, 0.1f), buf(n, 0.0f), g;
  std::vector<double> pd(p.begin(), p.end()), bd(n, 0.0);
  const std::vector<double> p0 = pd;
  Workspace ws;
  for (int t = 0; t < 10; ++t) {
    g = random_matrix(n, 1000 * t + gc.rows + 7 * gc.cols);
    step(gc.cfg, gc.rows, gc.cols, p.data(), g.data(), buf.data(), nullptr, nullptr, ws);
    model_step(gc.cfg, gc.rows, gc.cols, pd, bd, g);
  }
  *err_master = rel_frobenius(p, pd);
  std::vector<float> dp(n);
  std::vector<double> dd(n);
  for (std::size_t e = 0; e < n; ++e) {
    dp[e] = static_cast<float>(static_cast<double>(p[e]) - p0[e]);
    dd[e] = pd[e] - p0[e];
  }
  *err_change = rel_frobenius(dp, dd);
}

TEST(Muon, TenStepsMatchTheDoubleModel) {
  Config original;
  original.lr = 0.02;
  Config rms = original;
  rms.adjust = LrAdjust::MatchRmsAdamW;
  rms.lr = 0.01;
  Config plain = original;
  plain.nesterov = false;
  plain.weight_decay = 0.01;
  // Measured (GCC 12, x86-64, fp32 against double): master weights 2.1e-7 .. 3.2e-7, mostly
  // the fp32 rounding of the weights themselves; their total change over the ten steps
  // 1.1e-6 .. 1.6e-6 (Newton-Schulz's ~1e-6). Limits 5e-7 and 3e-6.
  for (const Golden& gc : {Golden{96, 64, original, 5e-7}, Golden{64, 96, rms, 5e-7},
                           Golden{128, 128, plain, 5e-7}}) {
    double err_master = 0, err_change = 0;
    run_golden(gc, &err_master, &err_change);
    std::printf("  %zux%zu: master weights rel. Frobenius error %.3g, their change %.3g\n",
                gc.rows, gc.cols, err_master, err_change);
    EXPECT_LT(err_master, gc.tolerance) << gc.rows << "x" << gc.cols;
    EXPECT_LT(err_change, 3e-6) << gc.rows << "x" << gc.cols;
  }
}

TEST(Muon, NewtonSchulzMatchesTheDoubleModel) {
  // The issue expects ~1e-6 at 64x64 and ~8e-5 at 384x1024; this build measures 1.14e-6 and
  // 2.74e-6 (printed): the limits sit just above.
  for (const auto& [rows, cols, tolerance] :
       {std::tuple<std::size_t, std::size_t, double>{64, 64, 1.5e-6},
        std::tuple<std::size_t, std::size_t, double>{384, 1024, 4e-6}}) {
    const std::vector<float> u = random_matrix(rows * cols, rows + cols);
    const std::vector<double> ud(u.begin(), u.end());
    const double err = rel_frobenius(
        ns(rows, cols, u), ns_double(rows, cols, ud, kDefaultA, kDefaultB, kDefaultC, 1e-7, 5));
    std::printf("  NS %zux%zu: rel. Frobenius error %.3g (limit %.3g)\n", rows, cols, err,
                tolerance);
    EXPECT_LT(err, tolerance) << rows << "x" << cols;
  }
}

// ---- bit for bit ----------------------------------------------------------------------------

TEST(Muon, BlockedGemmSumsInTheDocumentedOrder) {
  // Bit for bit against naive loops with the same per-element order (k ascending from 0):
  // tile edges, register blocks, the symmetric halves and the transposed orientation.
  for (const auto& [rows, cols] : {std::pair<std::size_t, std::size_t>{67, 131}, {131, 67},
                                   {200, 203}, {1, 37}, {37, 1}}) {
    const std::vector<float> u = random_matrix(rows * cols, 5 * rows + cols);
    const std::vector<float> want =
        ns_naive_f32(rows, cols, u, static_cast<float>(kDefaultA), static_cast<float>(kDefaultB),
                     static_cast<float>(kDefaultC), 1e-7, 2);
    EXPECT_TRUE(same_bits(ns(rows, cols, u, 2), want)) << rows << "x" << cols;
  }
}

std::vector<float> three_steps(std::size_t rows, std::size_t cols) {
  const std::size_t n = rows * cols;
  std::vector<float> p = random_matrix(n, 3, 0.1f), buf(n, 0.0f);
  std::vector<bf16> replica(n);
  Config cfg;
  cfg.lr = 0.02;
  Workspace ws;
  for (int t = 0; t < 3; ++t) {
    const std::vector<float> g = random_matrix(n, 77 + t);
    step(cfg, rows, cols, p.data(), g.data(), buf.data(), replica.data(), nullptr, ws);
  }
  p.insert(p.end(), buf.begin(), buf.end());
  for (bf16 h : replica) p.push_back(to_float(h));
  return p;
}

TEST(Muon, SameBitsAtAnyThreadCountAndInstructionSet) {
  for (const auto& [rows, cols] : {std::pair<std::size_t, std::size_t>{67, 131}, {131, 67},
                                   {192, 96}, {300, 250}}) {
    const std::vector<float> one = with_threads(1, [&] { return three_steps(rows, cols); });
    for (int threads : {2, 3, 5})
      EXPECT_TRUE(same_bits(with_threads(threads, [&] { return three_steps(rows, cols); }), one))
          << rows << "x" << cols << " at " << threads << " threads";
    const cpu::Isa initial = cpu::active_isa();
    for (cpu::Isa isa : {cpu::Isa::Portable, cpu::Isa::Avx2, cpu::Isa::Avx512}) {
      if (!cpu::isa_supported(isa)) continue;
      cpu::set_isa(isa);
      EXPECT_TRUE(same_bits(with_threads(3, [&] { return three_steps(rows, cols); }), one))
          << rows << "x" << cols << " on " << cpu::isa_name(isa);
    }
    cpu::set_isa(initial);
  }
}

TEST(Muon, TransposedInputGivesTheTransposedResult) {
  for (const auto& [rows, cols] :
       {std::pair<std::size_t, std::size_t>{67, 131}, {100, 300}, {1, 50}}) {
    const std::vector<float> u = random_matrix(rows * cols, 9);
    std::vector<float> ut(u.size());
    for (std::size_t i = 0; i < rows; ++i)
      for (std::size_t j = 0; j < cols; ++j) ut[j * rows + i] = u[i * cols + j];
    const std::vector<float> o = ns(rows, cols, u), ot = ns(cols, rows, ut);
    std::vector<float> back(o.size());
    for (std::size_t i = 0; i < cols; ++i)
      for (std::size_t j = 0; j < rows; ++j) back[j * cols + i] = ot[i * rows + j];
    EXPECT_TRUE(same_bits(back, o)) << rows << "x" << cols;
  }
}

// ---- the element math -----------------------------------------------------------------------

/// One step checked bit for bit: the momentum as torch's lerp, U (Nesterov or not) fed to the
/// module's own newton_schulz, the decay and the adjusted lr as fp32 scalars rounded once.
void check_elements(const Config& cfg, std::size_t rows, std::size_t cols, double ratio) {
  const std::size_t n = rows * cols;
  const std::vector<float> p0 = random_matrix(n, 21, 0.5f), g = random_matrix(n, 22);
  const std::vector<float> m0 = random_matrix(n, 23, 0.3f);
  std::vector<float> p = p0, m = m0, f32(n);
  std::vector<bf16> replica(n);
  Workspace ws;
  step(cfg, rows, cols, p.data(), g.data(), m.data(), replica.data(), f32.data(), ws);

  const float w_buf = static_cast<float>(1.0 - cfg.momentum);
  const float w_nes = static_cast<float>(cfg.momentum);
  std::vector<float> m_want(n), u(n);
  for (std::size_t e = 0; e < n; ++e) {
    m_want[e] = torch_lerp(m0[e], g[e], w_buf);
    u[e] = cfg.nesterov ? torch_lerp(g[e], m_want[e], w_nes) : m_want[e];
  }
  EXPECT_TRUE(same_bits(m, m_want)) << "momentum buffer";
  std::vector<float> o(n);
  newton_schulz(rows, cols, u.data(), o.data(), static_cast<float>(cfg.a),
                static_cast<float>(cfg.b), static_cast<float>(cfg.c), cfg.eps, cfg.ns_steps, ws);
  const float decay = static_cast<float>(1.0 - cfg.lr * cfg.weight_decay);
  const float alr = static_cast<float>(cfg.lr * ratio);
  std::vector<float> p_want(n);
  for (std::size_t e = 0; e < n; ++e) p_want[e] = p0[e] * decay - alr * o[e];
  EXPECT_TRUE(same_bits(p, p_want)) << "master weights";
  EXPECT_TRUE(same_bits(f32, p)) << "fp32 replica";
  std::size_t bad = 0;
  for (std::size_t e = 0; e < n; ++e) {
    // Round to nearest even, from the bits: the replica is the rounded master.
    std::uint32_t u32;
    std::memcpy(&u32, &p[e], 4);
    const std::uint32_t lower = u32 & 0xFFFFu, up = u32 >> 16;
    const std::uint32_t want = lower > 0x8000u || (lower == 0x8000u && (up & 1u)) ? up + 1 : up;
    bad += replica[e].bits != want;
  }
  EXPECT_EQ(bad, 0u) << "bf16 replica";
}

TEST(Muon, ElementMathIsTorchsBitForBit) {
  Config cfg;  // momentum 0.95: buf's weight 0.05 (small-weight branch), Nesterov's 0.95
  cfg.lr = 0.02;
  cfg.weight_decay = 0.1;
  check_elements(cfg, 40, 24, std::sqrt(40.0 / 24.0));
  cfg.momentum = 0.3;  // the other branch of each lerp
  check_elements(cfg, 24, 40, 1.0);
  cfg.nesterov = false;
  check_elements(cfg, 40, 24, std::sqrt(40.0 / 24.0));
  cfg.adjust = LrAdjust::MatchRmsAdamW;
  check_elements(cfg, 40, 24, 0.2 * std::sqrt(40.0));
  cfg.adjust = LrAdjust::None;
  check_elements(cfg, 40, 24, 1.0);
  cfg.weight_decay = 0.0;
  check_elements(cfg, 24, 40, 1.0);
}

TEST(Muon, LerpBranchesAndScalars) {
  // The branch at |w| < 0.5 and its complement give different bits for some inputs; the
  // module's lerp must take torch's branch for each weight.
  std::size_t differ = 0;
  const std::vector<float> s = random_matrix(4096, 31), e = random_matrix(4096, 32);
  for (float w : {0.05f, 0.3f, 0.5f, 0.7f, 0.95f}) {
    for (std::size_t i = 0; i < s.size(); ++i) {
      const float want = torch_lerp(s[i], e[i], w);
      const float got = lerp(s[i], e[i], w);
      EXPECT_EQ(std::memcmp(&want, &got, 4), 0) << s[i] << " " << e[i] << " " << w;
      const float other = std::fabs(w) < 0.5f ? e[i] - (e[i] - s[i]) * (1.0f - w)
                                              : s[i] + w * (e[i] - s[i]);
      differ += std::memcmp(&want, &other, 4) != 0;
    }
  }
  EXPECT_GT(differ, 0u) << "the inputs do not tell the branches apart";
  Config cfg;
  cfg.lr = 0.1;
  const Scalars sc = make_scalars(cfg, 300, 100);
  EXPECT_EQ(sc.adjusted_lr, static_cast<float>(0.1 * std::sqrt(3.0)));
  EXPECT_EQ(sc.decay_factor, static_cast<float>(1.0 - 0.1 * 0.1));
  EXPECT_EQ(sc.buf_weight, static_cast<float>(1.0 - 0.95));
  EXPECT_EQ(adjust_ratio(LrAdjust::Original, 100, 300), 1.0);
  EXPECT_EQ(adjust_ratio(LrAdjust::MatchRmsAdamW, 100, 400), 0.2 * 20.0);
  EXPECT_EQ(adjust_ratio(LrAdjust::None, 400, 100), 1.0);
}

// ---- edge cases -----------------------------------------------------------------------------

TEST(Muon, ZeroGradientOnlyDecays) {
  const std::size_t rows = 30, cols = 20, n = rows * cols;
  const std::vector<float> p0 = random_matrix(n, 41);
  std::vector<float> p = p0, buf(n, 0.0f), g(n, 0.0f);
  Config cfg;
  cfg.lr = 0.05;
  Workspace ws;
  step(cfg, rows, cols, p.data(), g.data(), buf.data(), nullptr, nullptr, ws);
  const float decay = static_cast<float>(1.0 - 0.05 * 0.1);
  for (std::size_t e = 0; e < n; ++e) {
    ASSERT_TRUE(std::isfinite(p[e])) << e;
    ASSERT_EQ(p[e], p0[e] * decay) << e;
    ASSERT_EQ(buf[e], 0.0f) << e;
  }
  const std::vector<float> o = ns(rows, cols, g);
  for (float v : o) ASSERT_EQ(v, 0.0f);
}

TEST(Muon, RowAndColumnVectors) {
  for (const auto& [rows, cols] : {std::pair<std::size_t, std::size_t>{1, 300}, {300, 1}}) {
    Config cfg;
    // An update well above the weights' own fp32 rounding. Measured: master 2.7e-7 (1x300),
    // 5.6e-7 (300x1, adjusted lr 0.35: larger updates, more rounding); change 2.6e-6, 6.4e-7.
    cfg.lr = 0.02;
    const Golden gc{rows, cols, cfg, 8e-7};
    double err_master = 0, err_change = 0;
    run_golden(gc, &err_master, &err_change);
    std::printf("  %zux%zu: master %.3g, change %.3g\n", rows, cols, err_master, err_change);
    EXPECT_LT(err_master, gc.tolerance);
    EXPECT_LT(err_change, 4e-6);
  }
}

TEST(Muon, FlopCountIsTheGemmsWork) {
  // One tile: S and S S whole (m^2 n and m^3), T X m^2 n; two multiply-adds -> flops.
  EXPECT_EQ(newton_schulz_flops(64, 96, 1), 2.0 * (64.0 * 64 * 96 + 64.0 * 64 * 64 + 64.0 * 64 * 96));
  EXPECT_EQ(newton_schulz_flops(96, 64, 5), 5 * newton_schulz_flops(64, 96, 1));
  // 192 = two tiles: the symmetric products skip the lower tile (3 of 4 tiles).
  const double m = 192, n = 500;
  EXPECT_EQ(newton_schulz_flops(192, 500, 1), 2.0 * (0.75 * m * m * n + 0.75 * m * m * m + m * m * n));
}

template <class F>
void expect_invalid(F f, const char* what) {
  try {
    f();
    ADD_FAILURE() << what << ": no exception";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::InvalidArgument) << what << ": " << e.what();
  }
}

TEST(Muon, InvalidArgumentsAreRefused) {
  std::vector<float> p(12, 1.0f), g(12, 1.0f), m(12, 0.0f);
  Workspace ws;
  auto run = [&](Config cfg, std::size_t rows, std::size_t cols) {
    return [&, cfg, rows, cols] {
      step(cfg, rows, cols, p.data(), g.data(), m.data(), nullptr, nullptr, ws);
    };
  };
  expect_invalid(run(Config{}, 0, 12), "zero rows");
  expect_invalid(run(Config{}, 12, 0), "zero columns");
  Config c;
  c.ns_steps = -1;
  expect_invalid(run(c, 3, 4), "ns_steps -1");
  c.ns_steps = kMaxNsSteps + 1;
  expect_invalid(run(c, 3, 4), "ns_steps 100");
  c = Config{};
  c.lr = -1e-3;
  expect_invalid(run(c, 3, 4), "negative lr");
  c = Config{};
  c.momentum = std::nan("");
  expect_invalid(run(c, 3, 4), "NaN momentum");
  c = Config{};
  c.weight_decay = -0.1;
  expect_invalid(run(c, 3, 4), "negative weight decay");
  c = Config{};
  c.eps = -1.0;
  expect_invalid(run(c, 3, 4), "negative eps");
  expect_invalid([&] { step(Config{}, 3, 4, nullptr, g.data(), m.data(), nullptr, nullptr, ws); },
                 "null master");
  expect_invalid([&] { step(Config{}, 3, 4, p.data(), g.data(), nullptr, nullptr, nullptr, ws); },
                 "null momentum");
  expect_invalid([&] { newton_schulz(3, 4, g.data(), p.data(), 1, 1, 1, 1e-7, 100, ws); },
                 "newton_schulz ns_steps 100");
  expect_invalid([&] { newton_schulz(0, 4, g.data(), p.data(), 1, 1, 1, 1e-7, 5, ws); },
                 "newton_schulz zero rows");
  const std::size_t one_d[] = {12}, three_d[] = {2, 3, 2}, empty[] = {0, 5};
  expect_invalid([&] { matrix_of(one_d); }, "1-D shape");
  expect_invalid([&] { matrix_of(three_d); }, "3-D shape");
  expect_invalid([&] { matrix_of(empty); }, "0 x 5 shape");
  const std::size_t ok[] = {3, 4};
  EXPECT_EQ(matrix_of(ok).rows, 3u);
  EXPECT_EQ(matrix_of(ok).cols, 4u);
  // The limits themselves are accepted.
  c = Config{};
  c.ns_steps = kMaxNsSteps;
  step(c, 3, 4, p.data(), g.data(), m.data(), nullptr, nullptr, ws);
  c.ns_steps = 0;
  step(c, 3, 4, p.data(), g.data(), m.data(), nullptr, nullptr, ws);
}

}  // namespace
}  // namespace shardopt::rules::muon
