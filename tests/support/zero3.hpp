// zero3.hpp: how a stage-3 trainer drives backward (units acquired around their gradients)
// and a bitwise comparison of two optimizers' local state arrays.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <vector>

#include "shardopt/optimizer.hpp"

namespace shardopt::test {

// Backward over stage 3 with each unit acquired while its gradients are produced (and the
// previous unit prefetched), as a trainer that recomputes activations would.
inline std::function<void(std::size_t, bool)> backward_units(ShardedOptimizer& z3) {
  return [&z3](std::size_t i, bool before) {
    const FlatLayout& l = z3.layout();
    const std::size_t u = static_cast<std::size_t>(l.param(i).unit);
    const Unit& unit = l.unit(u);
    if (before && i + 1 == unit.params.end) {
      z3.acquire(u);
      if (u > 0) z3.prefetch(u - 1);
    }
    if (!before && i == unit.params.begin) z3.release(u);
  };
}

// The local arrays (master, m, v) of two optimizers on the same layout, bit for bit.
inline void expect_same_state(ShardedOptimizer& a, ShardedOptimizer& b, const char* where) {
  ASSERT_EQ(a.local_size(), b.local_size());
  for (StateArray s : {StateArray::Master, StateArray::ExpAvg, StateArray::ExpAvgSq}) {
    std::vector<float> x(a.local_size()), y(b.local_size());
    a.copy_state_to_host(s, 0, x);
    b.copy_state_to_host(s, 0, y);
    ASSERT_EQ(std::memcmp(x.data(), y.data(), x.size() * sizeof(float)), 0)
        << where << ": state array " << static_cast<int>(s);
  }
}

}  // namespace shardopt::test
