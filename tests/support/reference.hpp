// reference.hpp: the test oracle: AdamW / Adam-L2 and Lion in double precision over averaged
// gradients, and deterministic synthetic gradients per (rank, step, parameter, element).
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "shardopt/options.hpp"

namespace shardopt::test {

/// Uniform in [-1, 1), a pure function of its arguments (splitmix64).
inline float synth(std::uint64_t a, std::uint64_t b, std::uint64_t c, std::uint64_t d) {
  std::uint64_t z = a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull) * 0xBF58476D1CE4E5B9ull ^
                    (c + 0x94D049BB133111EBull) * 0x2545F4914F6CDD1Dull ^ (d + 1) * 0xD6E8FEB86659FD93ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(static_cast<double>(z >> 11) * 0x1.0p-53 * 2.0 - 1.0);
}

struct RefParam {
  std::vector<double> p, m, v;
  int group = 0;
};

struct RefResult {
  double grad_norm = 0;
  bool clipped = false;
  bool skipped = false;
};

/// One step over gradients already averaged over ranks (double).
inline RefResult reference_step(std::vector<RefParam>& params,
                                const std::vector<std::vector<double>>& grads,
                                const AdamConfig& c, const std::vector<GroupOptions>& groups,
                                std::int64_t step) {
  RefResult r;
  double sumsq = 0;
  for (const auto& g : grads)
    for (double x : g) sumsq += x * x;
  r.grad_norm = std::sqrt(sumsq);
  if (!std::isfinite(sumsq)) {
    r.skipped = true;
    return r;
  }
  double clip = 1.0;
  if (c.max_grad_norm > 0 && c.max_grad_norm / (r.grad_norm + 1e-6) < 1.0) {
    clip = c.max_grad_norm / (r.grad_norm + 1e-6);
    r.clipped = true;
  }
  const double bc1 = 1 - std::pow(c.beta1, static_cast<double>(step));
  const double bc2 = 1 - std::pow(c.beta2, static_cast<double>(step));
  for (std::size_t i = 0; i < params.size(); ++i) {
    RefParam& rp = params[i];
    const GroupOptions& g = groups[static_cast<std::size_t>(rp.group)];
    const double lr = c.lr * g.lr_scale;
    const double wd = g.weight_decay ? c.weight_decay : 0.0;
    if (g.rule == Rule::Lion) {  // lion-pytorch's order; decay always decoupled
      for (std::size_t k = 0; k < rp.p.size(); ++k) {
        const double gr = grads[i][k] * clip;
        rp.p[k] *= 1 - lr * wd;
        const double u = g.lion.beta1 * rp.m[k] + (1 - g.lion.beta1) * gr;
        rp.p[k] -= lr * (u > 0 ? 1.0 : u < 0 ? -1.0 : 0.0);
        rp.m[k] = g.lion.beta2 * rp.m[k] + (1 - g.lion.beta2) * gr;
      }
      continue;
    }
    for (std::size_t k = 0; k < rp.p.size(); ++k) {
      double gr = grads[i][k] * clip;
      if (c.mode == AdamMode::AdamL2) gr += wd * rp.p[k];
      if (c.mode == AdamMode::AdamW) rp.p[k] *= 1 - lr * wd;
      rp.m[k] = c.beta1 * rp.m[k] + (1 - c.beta1) * gr;
      rp.v[k] = c.beta2 * rp.v[k] + (1 - c.beta2) * gr * gr;
      rp.p[k] -= lr / bc1 * rp.m[k] / (std::sqrt(rp.v[k]) / std::sqrt(bc2) + c.eps);
    }
  }
  return r;
}

}  // namespace shardopt::test
