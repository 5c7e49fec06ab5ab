// muon_model.hpp: torch.optim.Muon in double, the reference of test_muon (the kernel) and
// test_muon_rule (the rule in the optimizer). Plain loops, no shortcuts: the model the fp32
// code is measured against.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

namespace shardopt::test {

/// Newton-Schulz in double: X = U (U^T if rows > cols), X /= max(||X||, eps), `steps` of
/// S = X X^T, T = b S + c S S, X = a X + T X; transposed back.
inline std::vector<double> ns_double(std::size_t rows, std::size_t cols,
                                     const std::vector<double>& u, double a, double b, double c,
                                     double eps, int steps) {
  const bool tr = rows > cols;
  const std::size_t m = tr ? cols : rows, n = tr ? rows : cols;
  std::vector<double> x(m * n), s(m * m), ss(m * m), y(m * n);
  for (std::size_t i = 0; i < m; ++i)
    for (std::size_t j = 0; j < n; ++j) x[i * n + j] = tr ? u[j * m + i] : u[i * n + j];
  double norm = 0;
  for (double v : x) norm += v * v;
  norm = std::max(std::sqrt(norm), eps);
  for (double& v : x) v /= norm;
  for (int it = 0; it < steps; ++it) {
    for (std::size_t i = 0; i < m; ++i)
      for (std::size_t j = 0; j < m; ++j) {
        double acc = 0;
        for (std::size_t k = 0; k < n; ++k) acc += x[i * n + k] * x[j * n + k];
        s[i * m + j] = acc;
      }
    std::fill(ss.begin(), ss.end(), 0.0);
    for (std::size_t i = 0; i < m; ++i)
      for (std::size_t k = 0; k < m; ++k)
        for (std::size_t j = 0; j < m; ++j) ss[i * m + j] += s[i * m + k] * s[k * m + j];
    for (std::size_t e = 0; e < m * m; ++e) ss[e] = b * s[e] + c * ss[e];
    for (std::size_t e = 0; e < m * n; ++e) y[e] = a * x[e];
    for (std::size_t i = 0; i < m; ++i)
      for (std::size_t k = 0; k < m; ++k)
        for (std::size_t j = 0; j < n; ++j) y[i * n + j] += ss[i * m + k] * x[k * n + j];
    std::swap(x, y);
  }
  std::vector<double> out(rows * cols);
  for (std::size_t i = 0; i < m; ++i)
    for (std::size_t j = 0; j < n; ++j) (tr ? out[j * m + i] : out[i * n + j]) = x[i * n + j];
  return out;
}

/// Muon's settings as the model needs them; `ratio` is the lr adjustment's factor.
struct MuonModel {
  double momentum, a, b, c, eps;
  int ns_steps;
  bool nesterov;
  double lr, weight_decay, ratio;
};

/// One torch.optim.Muon step in double (buf.lerp_ and grad.lerp as exact interpolations).
template <class G>
void muon_step_double(const MuonModel& m, std::size_t rows, std::size_t cols,
                      std::vector<double>& p, std::vector<double>& buf, const std::vector<G>& g) {
  const double mu = m.momentum;
  std::vector<double> u(p.size());
  for (std::size_t e = 0; e < p.size(); ++e) {
    buf[e] = buf[e] + (1 - mu) * (g[e] - buf[e]);
    u[e] = m.nesterov ? g[e] + mu * (buf[e] - g[e]) : buf[e];
  }
  const std::vector<double> o = ns_double(rows, cols, u, m.a, m.b, m.c, m.eps, m.ns_steps);
  for (std::size_t e = 0; e < p.size(); ++e)
    p[e] = p[e] * (1 - m.lr * m.weight_decay) - m.lr * m.ratio * o[e];
}

/// ||x - ref||_F / ||ref||_F.
inline double rel_frobenius(const std::vector<float>& x, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    num += (x[i] - ref[i]) * (x[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / den);
}

}  // namespace shardopt::test
