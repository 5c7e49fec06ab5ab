// bench_overlap.cpp: how much gradient communication the overlapped path hides behind a
// synthetic backward. Run under mpiexec (benchmarks/run_overlap.sh); prints a table.
//
// The model is `--params` tensors of `--tensor-elems` fp32 elements. Backward visits them in
// reverse order; before each tensor's gradient is ready it "computes" for a fixed time. Two
// models of that compute:
//   device: the host waits (as it does while an accelerator runs the layer), calling
//           progress() every slice — MPI's non-blocking collectives advance only inside MPI
//           calls unless MPI runs a progress thread;
//   cpu:    the host spins on arithmetic on the same cores MPI needs for its copies.
// First the communication alone is timed (zero compute, overlap off: step()'s reduce phase),
// then each compute/communication ratio with overlap off and on. hidden = (T_off - T_on) /
// T_comm: the fraction of the communication time that no longer adds to the step.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "cli.hpp"
#include "shardopt/error.hpp"
#include "shardopt/mpi_comm.hpp"
#include "shardopt/optimizer.hpp"

using namespace shardopt;
using Clock = std::chrono::steady_clock;

namespace {

struct Args {
  Stage stage = Stage::Zero2;
  std::size_t params = 32;
  std::size_t tensor_elems = std::size_t{1} << 19;
  std::size_t bucket_elems = std::size_t{1} << 20;
  int iterations = 9;
  std::string compute = "device";
};

// The command line: the exit code after --help, --version or bad input, or -1 to run.
int parse(int argc, char** argv, bool print, Args& a) {
  CLI::App app{"How much gradient communication the overlapped path hides behind a synthetic "
               "backward; run under mpiexec (benchmarks/run_overlap.sh)."};
  cli::init(app, "bench_overlap");
  app.add_option("--stage", a.stage, "dp, 1 or 2")
      ->transform(cli::choice<Stage>({{"dp", Stage::DataParallel}, {"0", Stage::DataParallel},
                                      {"1", Stage::Zero1}, {"2", Stage::Zero2}}))
      ->default_str("2");
  app.add_option("--params", a.params, "tensors in the model")->transform(cli::size())
      ->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--tensor-elems", a.tensor_elems, "fp32 elements per tensor")
      ->transform(cli::size())->check(CLI::PositiveNumber)->default_str("512Ki");
  app.add_option("--bucket-elems", a.bucket_elems, "stage-2 bucket size in elements")
      ->transform(cli::size())->check(CLI::PositiveNumber)->default_str("1Mi");
  app.add_option("--iterations", a.iterations, "timed iterations per point")
      ->check(CLI::Range(1, 1 << 20))->capture_default_str();
  app.add_option("--compute", a.compute, "what backward's compute does: device (the host waits) "
                 "or cpu (the host spins)")
      ->check(CLI::IsMember({"device", "cpu"}))->capture_default_str();
  return cli::parse(app, argc, argv, print);
}

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Spins on dependent floating-point work for `s` seconds (no memory traffic).
void spin(double s) {
  const Clock::time_point t0 = Clock::now();
  volatile double x = 1.0;
  while (seconds_since(t0) < s)
    for (int k = 0; k < 1000; ++k) x = x * 1.0000001 + 1e-9;
}

struct Run {
  double step_seconds;    // backward + step, slowest rank
  double reduce_seconds;  // step()'s reported reduce time, slowest rank
};

Run run(ShardedOptimizer& opt, const Args& a, double compute_per_param) {
  std::vector<double> times, reduces;
  for (int it = 0; it < a.iterations + 1; ++it) {
    MPI_Barrier(MPI_COMM_WORLD);
    const Clock::time_point t0 = Clock::now();
    for (std::size_t i = a.params; i-- > 0;) {
      if (compute_per_param > 0) {
        if (a.compute == "cpu") {
          spin(compute_per_param);
        } else {
          // Device compute: the host is idle; poll communication in 10 slices.
          const Clock::time_point c0 = Clock::now();
          for (int slice = 1; slice <= 10; ++slice) {
            std::this_thread::sleep_until(c0 + std::chrono::duration<double>(compute_per_param * slice / 10));
            opt.progress();
          }
        }
      }
      std::span<float> g = opt.grad(i);
      std::fill(g.begin(), g.end(), 1e-3f);
      opt.grad_ready(i);
    }
    const StepResult r = opt.step();
    double local[2] = {seconds_since(t0), r.timings.reduce}, slowest[2];
    MPI_Allreduce(local, slowest, 2, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (it > 0) {  // the first iteration warms up
      times.push_back(slowest[0]);
      reduces.push_back(slowest[1]);
    }
  }
  std::sort(times.begin(), times.end());
  std::sort(reduces.begin(), reduces.end());
  return {times[times.size() / 2], reduces[reduces.size() / 2]};
}

std::unique_ptr<ShardedOptimizer> make(const Args& a, bool overlap) {
  OptimizerOptions o;
  o.stage = a.stage;
  o.overlap = overlap;
  o.bucket_elems = a.bucket_elems;
  o.param_dtype = DType::BF16;
  auto opt = std::make_unique<ShardedOptimizer>(make_mpi_communicator(MPI_COMM_WORLD), o);
  for (std::size_t i = 0; i < a.params; ++i) opt->add_param("p" + std::to_string(i), a.tensor_elems);
  opt->finalize();
  return opt;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, world = 1, rc = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  try {
    Args a;
    if (const int exit_code = parse(argc, argv, rank == 0, a); exit_code >= 0) {
      MPI_Finalize();
      return exit_code;
    }
    auto off = make(a, false), on = make(a, true);
    // Communication alone: overlap off, no compute; the reduce phase of step().
    const Run bare = run(*off, a, 0.0);
    const double comm = bare.reduce_seconds;
    if (rank == 0) {
      std::printf("# %d ranks, %s, %zu x %zu fp32 params, %zu buckets of <= %zu elems, compute=%s\n",
                  world, stage_name(a.stage), a.params, a.tensor_elems,
                  (a.params * a.tensor_elems + a.bucket_elems - 1) / a.bucket_elems,
                  a.bucket_elems, a.compute.c_str());
      std::printf("# communication alone (reduce phase, overlap off): %.2f ms per step\n", comm * 1e3);
      std::printf("%-14s %12s %12s %12s %10s\n", "compute/comm", "compute ms", "off ms", "on ms",
                  "hidden");
    }
    for (double ratio : {0.0, 0.5, 1.0, 2.0, 4.0}) {
      const double compute_total = ratio * comm;
      const double per_param = compute_total / static_cast<double>(a.params);
      const Run r_off = run(*off, a, per_param);
      const Run r_on = run(*on, a, per_param);
      const double hidden = (r_off.step_seconds - r_on.step_seconds) / comm;
      if (rank == 0)
        std::printf("%-14.1f %12.2f %12.2f %12.2f %9.0f%%\n", ratio, compute_total * 1e3,
                    r_off.step_seconds * 1e3, r_on.step_seconds * 1e3, hidden * 100);
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "bench_overlap: %s\n", e.what());
    rc = 1;
  }
  MPI_Finalize();
  return rc;
}
