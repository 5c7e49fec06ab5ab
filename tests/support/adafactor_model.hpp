// adafactor_model.hpp: torch.optim.Adafactor's single-tensor step (torch/optim/_adafactor.py,
// PyTorch >= 2.5) in double, the reference of test_adafactor (the kernel) and
// test_adafactor_rule (the rule in the optimizer). Plain loops that round nothing: the model
// the fp32 code is measured against.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "rules/adafactor.hpp"

namespace shardopt::test {

/// One parameter's state and weights: factored (a batch of rows x cols matrices: row and col
/// variances) or a vector of n (the per-element variance).
struct AdafactorModel {
  rules::adafactor::Config c;
  rules::adafactor::Shape shape;  // factored when shape.rows > 0; else a vector of n
  std::size_t n;
  std::vector<double> p, row, col, var;

  AdafactorModel(const rules::adafactor::Config& cfg, rules::adafactor::Shape s,
                 const std::vector<float>& p0, bool factored)
      : c(cfg),
        shape(factored ? s : rules::adafactor::Shape{1, 0, 0}),
        n(p0.size()),
        p(p0.begin(), p0.end()) {
    if (factored) {
      row.assign(s.batch * s.rows, 0.0);
      col.assign(s.batch * s.cols, 0.0);
    } else {
      var.assign(n, 0.0);
    }
  }

  static double rms(const std::vector<double>& x) {
    double s = 0.0;
    for (double v : x) s += v * v;
    return std::sqrt(s / static_cast<double>(x.size()));
  }

  /// One step at t (1-based) on `grad` (fp32 or double).
  template <class G>
  void step(std::int64_t t, const std::vector<G>& grad) {
    const double tf = static_cast<double>(t);
    const double w = std::pow(tf, c.beta2_decay);  // 1 - beta2_t
    const double rho = std::min(c.lr, 1.0 / std::sqrt(tf));
    const double alpha = std::max(c.eps2, rms(p)) * rho;
    if (c.weight_decay != 0.0)
      for (double& x : p) x *= 1.0 - c.lr * c.weight_decay;
    std::vector<double> g(n), v(n);
    for (std::size_t k = 0; k < n; ++k) g[k] = c.maximize ? -double(grad[k]) : double(grad[k]);
    if (shape.rows > 0) {
      const std::size_t R = shape.rows, C = shape.cols;
      for (std::size_t b = 0; b < shape.batch; ++b) {
        const double* gb = g.data() + b * R * C;
        for (std::size_t i = 0; i < R; ++i) {
          double s = 0.0;
          for (std::size_t j = 0; j < C; ++j) s += gb[i * C + j] * gb[i * C + j];
          double& r = row[b * R + i];
          r = (1.0 - w) * r + w * (s / double(C));
        }
        for (std::size_t j = 0; j < C; ++j) {
          double s = 0.0;
          for (std::size_t i = 0; i < R; ++i) s += gb[i * C + j] * gb[i * C + j];
          double& cc = col[b * C + j];
          cc = (1.0 - w) * cc + w * (s / double(R));
        }
        double mean = 0.0;
        for (std::size_t i = 0; i < R; ++i) mean += row[b * R + i];
        mean = std::max(mean / double(R), c.eps1);
        for (std::size_t i = 0; i < R; ++i)
          for (std::size_t j = 0; j < C; ++j)
            v[b * R * C + i * C + j] = row[b * R + i] * col[b * C + j] / mean;
      }
    } else {
      for (std::size_t k = 0; k < n; ++k) {
        var[k] = (1.0 - w) * var[k] + w * (g[k] * g[k]);
        v[k] = var[k];
      }
    }
    std::vector<double> u(n);
    for (std::size_t k = 0; k < n; ++k) u[k] = g[k] / std::sqrt(std::max(v[k], c.eps1 * c.eps1));
    const double denom = std::max(1.0, rms(u) / c.d);
    for (std::size_t k = 0; k < n; ++k) p[k] -= alpha / denom * u[k];
  }
};

/// max |a - b| / max(|b|, floor) over the elements.
inline double max_rel(const std::vector<float>& a, const std::vector<double>& b, double floor) {
  double e = 0.0;
  for (std::size_t k = 0; k < a.size(); ++k)
    e = std::max(e, std::fabs(double(a[k]) - b[k]) / std::max(std::fabs(b[k]), floor));
  return e;
}

}  // namespace shardopt::test
