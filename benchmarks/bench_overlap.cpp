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
//
// --stage 3 measures prefetch instead: every tensor is a unit and a forward pass visits the
// units in order, each acquired (gathered), "computed" (the same two models) and released.
// First the gathers alone are timed (acquire + release of every unit, no compute, no
// prefetch), then each compute/gather ratio: the compute alone (no unit calls), the forward
// without prefetch, and the forward that prefetches unit u + 1 right after acquiring unit u.
// hidden = (T_no_prefetch - T_prefetch) / T_gather: the fraction of the gather time that
// prefetch takes off the forward. The gathers alone are also timed in turns against a second
// optimizer finalized with SHARDOPT_COMM_BATCH=1 (every bucket's gather alone), for the
// batched collectives' A/B in one run.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "cli.hpp"
#include "shardopt/error.hpp"
#include "shardopt/mpi_comm.hpp"
#include "shardopt/optimizer.hpp"
#include "support/timing.hpp"

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
  app.add_option("--stage", a.stage, "dp, 1 or 2 (overlapped gradient reduction), or 3 "
                                     "(prefetch of the next unit in a forward pass)")
      ->transform(cli::choice<Stage>({{"dp", Stage::DataParallel}, {"0", Stage::DataParallel},
                                      {"1", Stage::Zero1}, {"2", Stage::Zero2},
                                      {"3", Stage::Zero3}}))
      ->default_str("2");
  app.add_option("--params", a.params, "tensors in the model (stage 3: units)")
      ->transform(cli::size())->check(CLI::PositiveNumber)->capture_default_str();
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

// One tensor's (or unit's) synthetic compute of `s` seconds, in the chosen model.
void compute(ShardedOptimizer& opt, const Args& a, double s) {
  if (s <= 0) return;
  if (a.compute == "cpu") {
    spin(s);
    return;
  }
  // Device compute: the host is idle; poll communication in 10 slices.
  const Clock::time_point c0 = Clock::now();
  for (int slice = 1; slice <= 10; ++slice) {
    std::this_thread::sleep_until(c0 + std::chrono::duration<double>(s * slice / 10));
    opt.progress();
  }
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
      compute(opt, a, compute_per_param);
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

// Stage 3: what a forward pass over the units does around each unit's compute.
enum class Forward { ComputeOnly, NoPrefetch, Prefetch };

// One forward pass over the units.
void forward(ShardedOptimizer& opt, const Args& a, double compute_per_unit, Forward mode) {
  const std::size_t units = opt.layout().num_units();
  for (std::size_t u = 0; u < units; ++u) {
    if (mode != Forward::ComputeOnly) opt.acquire(u);
    if (mode == Forward::Prefetch && u + 1 < units) opt.prefetch(u + 1);
    compute(opt, a, compute_per_unit);
    if (mode != Forward::ComputeOnly) opt.release(u);
  }
}

std::unique_ptr<ShardedOptimizer> make(const Args& a, bool overlap) {
  OptimizerOptions o;
  o.stage = a.stage;
  o.overlap = overlap;
  o.bucket_elems = a.bucket_elems;
  o.param_dtype = DType::BF16;
  auto opt = std::make_unique<ShardedOptimizer>(make_mpi_communicator(MPI_COMM_WORLD), o);
  for (std::size_t i = 0; i < a.params; ++i) {
    if (a.stage == Stage::Zero3) opt->begin_unit();  // every tensor a unit
    opt->add_param("p" + std::to_string(i), a.tensor_elems);
  }
  opt->finalize();
  return opt;
}

constexpr double kRatios[] = {0.0, 0.5, 1.0, 2.0, 4.0};

// --stage 3: prefetch against the gathers it hides (see the header).
void prefetch_table(const Args& a, int rank, int world) {
  auto opt = make(a, true);
  // Median of the slowest rank's time over the iterations; the variants of one ratio take
  // turns within each iteration, so that they see the same machine load.
  auto time_forwards = [&](double per_unit, std::vector<Forward> modes) {
    std::vector<bench::Op> ops;
    for (Forward m : modes)
      ops.push_back({[] {}, [&opt, &a, per_unit, m] { forward(*opt, a, per_unit, m); }});
    return bench::time_ops(ops, a.iterations);
  };
  const double gather = time_forwards(0.0, {Forward::NoPrefetch})[0];
  // The same gathers with every bucket alone (SHARDOPT_COMM_BATCH=1, issue 29), the two
  // optimizers taking turns within each iteration.
  const char* env = std::getenv("SHARDOPT_COMM_BATCH");
  const std::string batch = env != nullptr && *env != '\0' ? env : "default";
  std::vector<double> turns;
  {
    setenv("SHARDOPT_COMM_BATCH", "1", 1);
    const auto alone = make(a, true);
    if (batch == "default") unsetenv("SHARDOPT_COMM_BATCH");
    else setenv("SHARDOPT_COMM_BATCH", batch.c_str(), 1);
    turns = bench::time_ops(
        {{[] {}, [&] { forward(*opt, a, 0.0, Forward::NoPrefetch); }},
         {[] {}, [&] { forward(*alone, a, 0.0, Forward::NoPrefetch); }}},
        a.iterations);
  }
  const double units = static_cast<double>(opt->layout().num_units());
  if (rank == 0) {
    std::printf("# %d ranks, %s, %zu units x %zu bf16 params, %zu buckets, compute=%s\n", world,
                stage_name(a.stage), opt->layout().num_units(), a.tensor_elems,
                opt->layout().num_buckets(), a.compute.c_str());
    std::printf("# gathers alone (acquire + release of every unit, no prefetch): %.2f ms per "
                "forward\n", gather * 1e3);
    std::printf("# the same in turns: SHARDOPT_COMM_BATCH=%s %.2f ms, =1 (every bucket alone) "
                "%.2f ms, ratio %.2f\n", batch.c_str(), turns[0] * 1e3, turns[1] * 1e3,
                turns[1] / turns[0]);
    std::printf("%-14s %12s %14s %14s %12s %10s\n", "compute/gather", "compute ms",
                "alone ms", "no prefetch ms", "prefetch ms", "hidden");
  }
  for (double ratio : kRatios) {
    const double compute_total = ratio * gather;
    const std::vector<double> t = time_forwards(
        compute_total / units, {Forward::ComputeOnly, Forward::NoPrefetch, Forward::Prefetch});
    const double hidden = (t[1] - t[2]) / gather;
    if (rank == 0)
      std::printf("%-14.1f %12.2f %14.2f %14.2f %12.2f %9.0f%%\n", ratio, compute_total * 1e3,
                  t[0] * 1e3, t[1] * 1e3, t[2] * 1e3, hidden * 100);
  }
}

// --stage dp, 1 or 2: overlapped gradient reduction against the communication it hides.
void overlap_table(const Args& a, int rank, int world) {
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
  for (double ratio : kRatios) {
    const double compute_total = ratio * comm;
    const double per_param = compute_total / static_cast<double>(a.params);
    const Run r_off = run(*off, a, per_param);
    const Run r_on = run(*on, a, per_param);
    const double hidden = (r_off.step_seconds - r_on.step_seconds) / comm;
    if (rank == 0)
      std::printf("%-14.1f %12.2f %12.2f %12.2f %9.0f%%\n", ratio, compute_total * 1e3,
                  r_off.step_seconds * 1e3, r_on.step_seconds * 1e3, hidden * 100);
  }
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
    if (a.stage == Stage::Zero3)
      prefetch_table(a, rank, world);
    else
      overlap_table(a, rank, world);
  } catch (const Error& e) {
    std::fprintf(stderr, "bench_overlap: %s\n", e.what());
    rc = 1;
  }
  MPI_Finalize();
  return rc;
}
