// bench_collective_checks.cpp: what the collective diagnostics of issue 16 cost per step:
// the debug mode (one all-gather before every collective), the timeout's polling waits, and
// both, against plain blocking waits. Run under mpiexec; prints a table of the median
// backward + step time (slowest rank) with no compute, so communication is all there is.
//   mpiexec -n N bench_collective_checks [--params 32] [--tensor-elems 2^16]
//                                        [--bucket-elems 2^18] [--iterations 21] [--stage 1|2]
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "shardopt/error.hpp"
#include "shardopt/mpi_comm.hpp"
#include "shardopt/optimizer.hpp"

using namespace shardopt;
using Clock = std::chrono::steady_clock;

namespace {

struct Args {
  Stage stage = Stage::Zero2;
  std::size_t params = 32;
  std::size_t tensor_elems = std::size_t{1} << 16;
  std::size_t bucket_elems = std::size_t{1} << 18;
  int iterations = 21;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--stage") a.stage = v == "1" ? Stage::Zero1 : Stage::Zero2;
    else if (k == "--params") a.params = std::stoull(v);
    else if (k == "--tensor-elems") a.tensor_elems = std::stoull(v);
    else if (k == "--bucket-elems") a.bucket_elems = std::stoull(v);
    else if (k == "--iterations") a.iterations = std::stoi(v);
    else throw Error(Status::InvalidArgument, "unknown option " + k);
  }
  return a;
}

double median_step_ms(const Args& a, bool debug, double timeout) {
  OptimizerOptions o;
  o.stage = a.stage;
  o.bucket_elems = a.bucket_elems;
  o.debug_collectives = debug;
  o.collective_timeout_s = timeout;
  ShardedOptimizer opt(make_mpi_communicator(MPI_COMM_WORLD), o);
  for (std::size_t i = 0; i < a.params; ++i) opt.add_param("p" + std::to_string(i), a.tensor_elems);
  opt.finalize();
  std::vector<double> times;
  for (int it = 0; it < a.iterations + 1; ++it) {
    MPI_Barrier(MPI_COMM_WORLD);
    const Clock::time_point t0 = Clock::now();
    for (std::size_t i = a.params; i-- > 0;) {
      std::span<float> g = opt.grad(i);
      std::fill(g.begin(), g.end(), 1e-3f);
      opt.grad_ready(i);
    }
    opt.step();
    double local = std::chrono::duration<double>(Clock::now() - t0).count(), slowest = 0;
    MPI_Allreduce(&local, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (it > 0) times.push_back(slowest);  // the first iteration warms up
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2] * 1e3;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, world = 1, rc = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  try {
    const Args a = parse(argc, argv);
    const std::size_t buckets = (a.params * a.tensor_elems + a.bucket_elems - 1) / a.bucket_elems;
    if (rank == 0)
      std::printf("# %d ranks, %s, %zu x %zu fp32 params, about %zu buckets; median of %d steps\n",
                  world, stage_name(a.stage), a.params, a.tensor_elems, buckets, a.iterations);
    struct Case { const char* name; bool debug; double timeout; };
    const Case cases[] = {{"plain", false, 0}, {"debug_collectives", true, 0},
                          {"timeout 600 s", false, 600}, {"both", true, 600}};
    double base = 0;
    for (const Case& c : cases) {
      const double ms = median_step_ms(a, c.debug, c.timeout);
      if (c.debug == false && c.timeout == 0) base = ms;
      if (rank == 0)
        std::printf("%-20s %10.3f ms/step  %+7.1f%%\n", c.name, ms, (ms / base - 1) * 100);
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "bench_collective_checks: %s\n", e.what());
    rc = 1;
  }
  MPI_Finalize();
  return rc;
}
