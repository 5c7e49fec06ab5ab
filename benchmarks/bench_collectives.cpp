// bench_collectives.cpp: intra-node reduce-scatter, all-gather and the optimizer step on the
// shared-memory communicator vs plain MPI collectives (and MPI_Allreduce), with the node's
// in-place memory bandwidth (a += s * b on every rank at once) measured in the same run.
//
//   mpiexec -n 2 bench_collectives [elements ...]      (default: 16M and 64M fp32)
//
// Bus bandwidth follows nccl-tests: algbw = buffer bytes / time; reduce-scatter and
// all-gather busbw = algbw * (n-1)/n, all-reduce busbw = algbw * 2(n-1)/n. Times are the
// median over iterations of the slowest rank.
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "shardopt/memory.hpp"
#include "shardopt/mpi_comm.hpp"
#include "shardopt/optimizer.hpp"

using namespace shardopt;

namespace {

constexpr int kIters = 7;

int g_rank = 0, g_size = 1;

struct Op {
  std::function<void()> prepare, run;
};

// Median over iterations of the slowest rank's time, in seconds, per op. The ops take turns
// within each iteration, so that they see the same machine load (it is shared and noisy).
std::vector<double> time_ops(const std::vector<Op>& ops) {
  std::vector<std::vector<double>> t(ops.size());
  for (int it = 0; it <= kIters; ++it) {
    for (std::size_t o = 0; o < ops.size(); ++o) {
      ops[o].prepare();
      MPI_Barrier(MPI_COMM_WORLD);
      const double t0 = MPI_Wtime();
      ops[o].run();
      double dt = MPI_Wtime() - t0;
      MPI_Allreduce(MPI_IN_PLACE, &dt, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      if (it > 0) t[o].push_back(dt);  // the first round warms up pages and caches
    }
  }
  std::vector<double> med;
  for (auto& v : t) {
    std::sort(v.begin(), v.end());
    med.push_back(v[v.size() / 2]);
  }
  return med;
}

// Node in-place bandwidth: every rank runs a += s * b over its own arrays at the same time;
// bytes = 12 per element (read a, read b, write a) over all ranks.
double inplace_bandwidth(std::size_t per_rank) {
  Allocation a = allocate_host(nullptr, MemCategory::Scratch, per_rank * sizeof(float));
  Allocation b = allocate_host(nullptr, MemCategory::Scratch, per_rank * sizeof(float));
  float* pa = a.as<float>();
  const float* pb = b.as<float>();
  std::fill(b.as<float>(), b.as<float>() + per_rank, 1e-7f);
  const double t = time_ops({{[] {},
                              [&] {
                                for (std::size_t i = 0; i < per_rank; ++i) pa[i] += 0.5f * pb[i];
                              }}})[0];
  return 12.0 * static_cast<double>(per_rank) * g_size / t;
}

struct Row {
  std::string op, path;
  double seconds, busbw;
};

void print(const Row& r, std::size_t n, double bw, double plain_busbw) {
  if (g_rank != 0) return;
  std::printf(
      "| %-14s | %-12s | %2d | %5zuM | %9.2f | %7.2f | %6.3f | %s |\n", r.op.c_str(),
      r.path.c_str(), g_size, n >> 20, r.seconds * 1e3, r.busbw / 1e9, r.busbw / bw,
      plain_busbw > 0 ? (std::to_string(r.busbw / plain_busbw).substr(0, 5) + "x").c_str() : "");
}

void fill(float* p, std::size_t n, float v) { std::fill(p, p + n, v); }

void run_size(std::size_t n, Communicator& plain, Communicator& shm) {
  const double frac = static_cast<double>(g_size - 1) / g_size;
  const double bytes = 4.0 * static_cast<double>(n);
  // Measured again for every size (the load changes); arrays of at least 2 x 64 MiB per rank,
  // far larger than the last-level cache.
  const double bw = inplace_bandwidth(
      std::max<std::size_t>(n / static_cast<std::size_t>(g_size), std::size_t{16} << 20));
  if (g_rank == 0)
    std::printf("| in-place a+=s*b | all ranks   | %2d | %5zuM |           | %7.2f | 1.000 |  |\n",
                g_size, n >> 20, bw / 1e9);

  MemoryTracker tracker;
  Allocation local = allocate_host(&tracker, MemCategory::Scratch, n * sizeof(float));
  Allocation window =
      shm.allocate_collective_buffer(&tracker, MemCategory::Scratch, n * sizeof(float));
  float* pl = local.as<float>();
  float* pw = window.data() ? window.as<float>() : pl;
  const std::size_t per = n / static_cast<std::size_t>(g_size);

  // Reduce-scatter. Inputs refilled before each iteration (outside the timing).
  const std::vector<double> rs = time_ops(
      {{[&] { fill(pl, n, 1e-3f); }, [&] { plain.reduce_scatter_sum_inplace(pl, per); }},
       {[&] { fill(pw, n, 1e-3f); }, [&] { shm.reduce_scatter_sum_inplace(pw, per); }}});
  const double rs_plain = rs[0], rs_shm = rs[1];
  const Row rsp{"reduce-scatter", "plain MPI", rs_plain, bytes / rs_plain * frac};
  const Row rss{"reduce-scatter", shm.name(), rs_shm, bytes / rs_shm * frac};
  print(rsp, n, bw, 0);
  print(rss, n, bw, rsp.busbw);

  const std::vector<double> ag =
      time_ops({{[] {}, [&] { plain.all_gather_inplace(pl, per, CommType::F32); }},
                {[] {}, [&] { shm.all_gather_inplace(pw, per, CommType::F32); }}});
  const double ag_plain = ag[0], ag_shm = ag[1];
  const Row agp{"all-gather", "plain MPI", ag_plain, bytes / ag_plain * frac};
  const Row ags{"all-gather", shm.name(), ag_shm, bytes / ag_shm * frac};
  print(agp, n, bw, 0);
  print(ags, n, bw, agp.busbw);

  const double ar = time_ops(
      {{[&] { fill(pl, n, 1e-3f); }, [&] { plain.all_reduce_sum(pl, n, CommType::F32); }}})[0];
  print(Row{"all-reduce", "MPI_Allreduce", ar, bytes / ar * 2 * frac}, n, bw, 0);
}

// The whole step (stage 1, bf16 replica, one parameter of n elements): reduce-scatter,
// norm, AdamW on the shard, all-gather, zero_grad; plain MPI and shared memory in turns.
std::vector<double> step_times(std::shared_ptr<Communicator> plain,
                               std::shared_ptr<Communicator> shm, std::size_t n) {
  OptimizerOptions o;
  o.stage = Stage::Zero1;
  o.param_dtype = DType::BF16;
  std::vector<std::unique_ptr<ShardedOptimizer>> opts;
  std::vector<Op> ops;
  for (auto& comm : {plain, shm}) {
    opts.push_back(std::make_unique<ShardedOptimizer>(comm, o));
    ShardedOptimizer* opt = opts.back().get();
    opt->add_param("w", n);
    opt->finalize();
    ops.push_back({[opt, n] { fill(opt->grad(0).data(), n, 1e-3f); }, [opt] { opt->step(); }});
  }
  return time_ops(ops);
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  std::vector<std::size_t> sizes;
  for (int i = 1; i < argc; ++i) sizes.push_back(std::strtoull(argv[i], nullptr, 10));
  if (sizes.empty()) sizes = {std::size_t{16} << 20, std::size_t{64} << 20};
  int status = 0;
  try {
    auto plain = make_mpi_communicator(MPI_COMM_WORLD, {MpiCommKind::Plain, 0});
    auto shm = make_mpi_communicator(MPI_COMM_WORLD, {MpiCommKind::SharedMemory, 0});
    auto fallback = make_mpi_communicator(MPI_COMM_WORLD);  // what the optimizer gets
    if (g_rank == 0) {
      std::printf("default communicator: %s; %d ranks\n\n", fallback->name().c_str(), g_size);
      std::printf(
          "| op             | path         | np | elems  | time (ms) | busbw GB/s | "
          "/ in-place bw | vs plain |\n|---|---|---|---|---|---|---|---|\n");
    }
    for (std::size_t n : sizes) {
      n = n / (64 * static_cast<std::size_t>(g_size)) * 64 * static_cast<std::size_t>(g_size);
      run_size(n, *plain, *shm);
      const std::vector<double> st = step_times(plain, shm, n);
      const double sp = st[0], ss = st[1];
      if (g_rank == 0)
        std::printf(
            "| step (zero1, bf16) | plain MPI | %2d | %5zuM | %9.2f | | | |\n"
            "| step (zero1, bf16) | %s | %2d | %5zuM | %9.2f | | | %.2fx |\n",
            g_size, n >> 20, sp * 1e3, shm->name().c_str(), g_size, n >> 20, ss * 1e3, sp / ss);
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "rank %d: %s\n", g_rank, e.what());
    status = 1;
  }
  MPI_Finalize();
  return status;
}
