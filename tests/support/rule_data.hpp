// rule_data.hpp: the data and steps of the rule tests that run a model through the optimizer
// (test_muon_rule, test_adafactor_rule): pure functions of their arguments, so every rank and
// the one-process reference compute the same numbers; gradients whose sums are exact in fp32,
// so every reduction order gives the same bits; a step of micro-batches, and of their
// average; the bitwise comparison.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "shardopt/optimizer.hpp"

namespace shardopt::test {

/// splitmix64's finaliser: [0, 2^64).
inline std::uint64_t mix(std::uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
/// Element k of parameter `param`'s gradient in micro-batch `mb` of step `step`: a multiple of
/// 2^-10 in [-0.5, 0.5], so any sum of a few of them is exact in fp32.
inline float exact_grad(std::uint64_t mb, std::uint64_t step, std::uint64_t param,
                        std::uint64_t k) {
  const std::uint64_t h = mix(mix(mix(mix(mb) ^ step) ^ param) ^ k);
  return static_cast<float>(static_cast<int>(h % 1025) - 512) / 1024.0f;
}
/// Element k of parameter `param`'s initial value: a multiple of 1e-4 in [-0.1, 0.1].
inline float init_value(std::uint64_t param, std::uint64_t k) {
  return static_cast<float>(static_cast<int>(mix(param * 7919 + k) % 2001) - 1000) * 1e-4f;
}
/// Whether x and y hold the same bits (no memcmp of an empty vector's null data(): UBSan).
template <class T>
bool same_bits(const std::vector<T>& x, const std::vector<T>& y) {
  return x.size() == y.size() &&
         (x.empty() || std::memcmp(x.data(), y.data(), x.size() * sizeof(T)) == 0);
}

/// A forward pass as a trainer runs it before its backward: at stage 3 every unit gathered
/// (the next one prefetched) and f(i) called for each parameter i while its unit is acquired;
/// at stages 0-2 f(i) for every parameter.
template <class F>
void forward(ShardedOptimizer& opt, F&& f) {
  const FlatLayout& l = opt.layout();
  const bool zero3 = opt.options().stage == Stage::Zero3;
  for (std::size_t u = 0; u < l.num_units(); ++u) {
    if (zero3) {
      opt.acquire(u);
      if (u + 1 < l.num_units()) opt.prefetch(u + 1);
    }
    for (std::size_t i = l.unit(u).params.begin; i < l.unit(u).params.end; ++i) f(i);
    if (zero3) opt.release(u);
  }
}

/// Runs a forward (forward(): gathers stage 3's units), then micro-batches [first, last) of
/// one step on `opt`, then steps: grad(mb, i) is
/// parameter i's gradient (numel floats) in micro-batch mb, accumulated in backward order
/// (the last parameter first), each parameter grad_ready at once.
template <class Grad>
StepResult run_micro_batches(ShardedOptimizer& opt, int first, int last, Grad&& grad) {
  forward(opt, [](std::size_t) {});
  for (int mb = first; mb < last; ++mb) {
    opt.begin_backward(mb + 1 == last);
    for (std::size_t i = opt.layout().num_params(); i-- > 0;) {
      const std::vector<float> g = grad(mb, i);
      opt.accumulate_grad(i, g);
      opt.grad_ready(i);
    }
  }
  return opt.step();
}
/// One micro-batch holding the average of micro-batches [0, count) (summed in order, times
/// 1 / count in fp32: exact for exactly summable gradients and a power-of-two count), then a
/// step: what run_micro_batches(opt, 0, count, grad) must equal bit for bit when the update
/// runs once per step on the reduced gradient.
template <class Grad>
StepResult run_average(ShardedOptimizer& opt, int count, Grad&& grad) {
  return run_micro_batches(opt, 0, 1, [&](int, std::size_t i) {
    std::vector<float> g = grad(0, i);
    for (int mb = 1; mb < count; ++mb) {
      const std::vector<float> h = grad(mb, i);
      for (std::size_t k = 0; k < g.size(); ++k) g[k] += h[k];
    }
    const float inv = 1.0f / static_cast<float>(count);
    for (float& v : g) v *= inv;
    return g;
  });
}

}  // namespace shardopt::test
