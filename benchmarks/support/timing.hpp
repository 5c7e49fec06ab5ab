// timing.hpp: what the MPI benchmarks share: timing of collective operations across ranks
// and the node's in-place memory bandwidth measured in the same run.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <cstddef>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "shardopt/memory.hpp"

namespace shardopt::bench {

struct Op {
  std::function<void()> prepare, run;
};

/// Median over `iters` iterations of the slowest rank's time, in seconds, per op. The ops
/// take turns within each iteration, so that they see the same machine load (it is shared
/// and noisy); one extra first round warms up pages and caches.
inline std::vector<double> time_ops(const std::vector<Op>& ops, int iters = 7) {
  std::vector<std::vector<double>> t(ops.size());
  for (int it = 0; it <= iters; ++it) {
    for (std::size_t o = 0; o < ops.size(); ++o) {
      ops[o].prepare();
      MPI_Barrier(MPI_COMM_WORLD);
      const double t0 = MPI_Wtime();
      ops[o].run();
      double dt = MPI_Wtime() - t0;
      MPI_Allreduce(MPI_IN_PLACE, &dt, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      if (it > 0) t[o].push_back(dt);
    }
  }
  std::vector<double> med;
  for (auto& v : t) {
    std::sort(v.begin(), v.end());
    med.push_back(v[v.size() / 2]);
  }
  return med;
}

/// Per-rank in-place bandwidth in bytes/s: every rank runs a += s * b over its own arrays of
/// `per_rank` floats at the same time; 12 bytes per element (read a, read b, write a).
inline double inplace_bandwidth_per_rank(std::size_t per_rank) {
  Allocation a = allocate_host(nullptr, MemCategory::Scratch, per_rank * sizeof(float));
  Allocation b = allocate_host(nullptr, MemCategory::Scratch, per_rank * sizeof(float));
  float* pa = a.as<float>();
  const float* pb = b.as<float>();
  std::fill(b.as<float>(), b.as<float>() + per_rank, 1e-7f);
  const double t = time_ops({{[] {},
                              [&] {
                                for (std::size_t i = 0; i < per_rank; ++i) pa[i] += 0.5f * pb[i];
                              }}})[0];
  return 12.0 * static_cast<double>(per_rank) / t;
}

/// The CPU model from /proc/cpuinfo, for benchmark headers (figures are only comparable
/// within one run on one machine).
inline std::string cpu_model_name() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown";
}

}  // namespace shardopt::bench
