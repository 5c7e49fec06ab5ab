// rule_data.hpp: the data of the rule tests that run a model through the optimizer
// (test_muon_rule, test_adafactor_rule): pure functions of their arguments, so every rank and
// the one-process reference compute the same numbers; gradients whose sums are exact in fp32,
// so every reduction order gives the same bits; and the bitwise comparison.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

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

}  // namespace shardopt::test
