// memory_scaling.cpp: one point of the memory-scaling sweep, run under mpiexec. Builds a
// model of --psi parameters, runs a few steps of the chosen stage, and appends one CSV row
// per rank: the library's accounting by category (checked against the planner), what the
// process holds before the optimizer exists and after the steps (RSS, PSS, anonymous and
// shared memory) and at peak (VmHWM), and the mean time of the step's phases. One process per point, so each peak belongs to one configuration.
// benchmarks/run_memory_scaling.sh runs the sweep and draws the plots (docs/memory.md).
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cli.hpp"
#include "shardopt/error.hpp"
#include "shardopt/mpi_comm.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/planner.hpp"
#include "support/proc_memory.hpp"

using namespace shardopt;

namespace {

struct Args {
  Stage stage = Stage::Zero1;
  std::size_t psi = 0;
  std::size_t tensor_elems = std::size_t{1} << 20;
  std::size_t bucket_elems = std::size_t{1} << 20;
  int steps = 3;
  int warmup = 1;
  std::string csv;
};

// The command line: the exit code after --help, --version or bad input, or -1 to run.
int parse(int argc, char** argv, bool print, Args& a) {
  CLI::App app{"One point of the memory-scaling sweep, under mpiexec: per rank, the library's "
               "accounting (checked against the planner), what the process really holds (RSS, "
               "PSS, anonymous and shared memory, from /proc/self/smaps_rollup and status) and "
               "the step's phase times. benchmarks/run_memory_scaling.sh runs the sweep."};
  cli::init(app, "memory_scaling");
  app.add_option("--stage", a.stage, "dp, 1, 2 or 3 (stage 3: one unit per tensor, forward "
                                     "acquires each with the next prefetched)")
      ->transform(cli::choice<Stage>({{"dp", Stage::DataParallel}, {"0", Stage::DataParallel},
                                      {"1", Stage::Zero1}, {"2", Stage::Zero2},
                                      {"3", Stage::Zero3}}))
      ->default_str("1");
  app.add_option("--psi", a.psi, "parameters")->transform(cli::size())->check(CLI::PositiveNumber)
      ->required();
  app.add_option("--tensor-elems", a.tensor_elems, "elements per tensor")->transform(cli::size())
      ->check(CLI::PositiveNumber)->default_str("1Mi");
  app.add_option("--bucket-elems", a.bucket_elems, "stage-2 bucket size in elements")
      ->transform(cli::size())->check(CLI::PositiveNumber)->default_str("1Mi");
  app.add_option("--steps", a.steps, "timed steps")->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--warmup", a.warmup, "untimed steps first")->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  app.add_option("--csv", a.csv, "append the rows to this file (header when it is new)");
  return cli::parse(app, argc, argv, print);
}

// Synthetic but varied values; the numbers do not matter, the traffic and passes do.
float value(std::size_t param, std::size_t k, int salt) {
  return static_cast<float>(static_cast<int>((param * 7919 + k * 104729 + salt * 31) % 2001) - 1000) *
         1e-4f;
}

constexpr const char* kHeader =
    "ranks,rank,mode,psi,padded_elems,tensor_elems,bucket_elems,params_bytes,grads_bytes,"
    "master_bytes,moments_bytes,scratch_bytes,accounted_bytes,planned_bytes,formula_bytes,"
    "rss_base_bytes,rss_end_bytes,hwm_bytes,reduce_s,norm_s,update_s,gather_s,step_s,steps,"
    "pss_base_bytes,pss_end_bytes,anon_base_bytes,anon_end_bytes,shmem_base_bytes,"
    "shmem_end_bytes,pss_anon_end_bytes,pss_shmem_end_bytes";

int run(const Args& a) {
  MPI_Barrier(MPI_COMM_WORLD);  // every rank's baseline after MPI_Init, before any buffer
  const bench::ProcMemory base = bench::measure_process_memory();
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  const int rank = comm->rank();
  const int ranks = comm->size();

  OptimizerOptions o;
  o.stage = a.stage;
  o.param_dtype = DType::BF16;
  o.bucket_elems = a.bucket_elems;
  ShardedOptimizer opt(comm, o);
  // Stage 3 gathers one tensor (unit) at a time.
  const bool zero3 = a.stage == Stage::Zero3;
  FlatLayout model = uniform_layout(a.psi, a.tensor_elems);
  if (zero3) model = unit_per_tensor(model);
  for (const ParamInfo& p : model.params()) {
    if (zero3) opt.begin_unit();
    opt.add_param(p.name, p.numel, p.group);
  }
  opt.finalize();
  const std::size_t n_params = opt.layout().num_params();
  {
    std::vector<float> init(a.tensor_elems);
    for (std::size_t i = 0; i < n_params; ++i) {
      const std::size_t n = opt.layout().param(i).numel;
      for (std::size_t k = 0; k < n; ++k) init[k] = value(i, k, 0);
      opt.set_param(i, {init.data(), n});
    }
  }

  StepTimings sum;
  for (int s = 0; s < a.warmup + a.steps; ++s) {
    if (zero3) {  // a forward pass: each unit acquired with the next prefetched, then released
      const std::size_t units = opt.layout().num_units();
      for (std::size_t u = 0; u < units; ++u) {
        opt.acquire(u);
        if (u + 1 < units) opt.prefetch(u + 1);
        opt.release(u);
      }
    }
    for (std::size_t i = n_params; i-- > 0;) {  // backward order, as stage 2 requires
      const std::span<float> g = opt.grad(i);
      for (std::size_t k = 0; k < g.size(); ++k) g[k] = value(i, k, s + rank);
      opt.grad_ready(i);
    }
    const StepTimings t = opt.step().timings;
    if (s < a.warmup) continue;
    sum.reduce += t.reduce;
    sum.norm += t.norm;
    sum.update += t.update;
    sum.gather += t.gather;
    sum.total += t.total;
  }

  const MemoryReport rep = opt.memory_report();
  const MemoryPlan plan = plan_memory(model, plan_config(opt.options(), ranks));
  const double formula =
      zero_formula_bytes(a.stage, static_cast<double>(a.psi), ranks, DType::BF16);
  // All ranks alive and mapping what they share when PSS is read.
  MPI_Barrier(MPI_COMM_WORLD);
  const bench::ProcMemory end = bench::measure_process_memory();
  MPI_Barrier(MPI_COMM_WORLD);
  const std::size_t rss_base = base.rss, rss_end = end.rss, hwm = end.hwm;
  const double k = 1.0 / a.steps;

  char line[1024];
  std::snprintf(line, sizeof line,
                "%d,%d,%s,%zu,%zu,%zu,%zu,%zu,%zu,%zu,%zu,%zu,%zu,%zu,%.0f,%zu,%zu,%zu,%.6g,%.6g,"
                "%.6g,%.6g,%.6g,%d,%zu,%zu,%zu,%zu,%zu,%zu,%zu,%zu",
                ranks, rank, stage_name(a.stage), a.psi, opt.layout().padded_size(),
                a.tensor_elems, a.bucket_elems, rep[MemCategory::Params], rep[MemCategory::Grads],
                rep[MemCategory::Master], rep[MemCategory::Moments], rep[MemCategory::Scratch],
                rep.total(), plan.total(), formula, rss_base, rss_end, hwm, sum.reduce * k,
                sum.norm * k, sum.update * k, sum.gather * k, sum.total * k, a.steps, base.pss,
                end.pss, base.rss_anon, end.rss_anon, base.rss_shmem, end.rss_shmem, end.pss_anon,
                end.pss_shmem);
  std::vector<char> all(rank == 0 ? sizeof line * static_cast<std::size_t>(ranks) : 1);
  MPI_Gather(line, sizeof line, MPI_CHAR, all.data(), sizeof line, MPI_CHAR, 0, MPI_COMM_WORLD);

  const bool planned_ok = plan.bytes == rep.bytes;
  if (!planned_ok)
    std::fprintf(stderr, "rank %d: planner (%zu bytes) differs from accounting (%zu bytes)\n",
                 rank, plan.total(), rep.total());
  if (rank == 0) {
    std::FILE* f = a.csv.empty() ? stdout : std::fopen(a.csv.c_str(), "a");
    require(f != nullptr, Status::Io, "cannot open " + a.csv);
    if (f != stdout) std::fseek(f, 0, SEEK_END);  // a header only for a new, empty file
    if (f == stdout || std::ftell(f) == 0) std::fprintf(f, "%s\n", kHeader);
    for (int r = 0; r < ranks; ++r) std::fprintf(f, "%s\n", &all[sizeof line * r]);
    if (f != stdout) std::fclose(f);
    std::printf("%-13s ranks %d psi %zu: rank 0 %.1f MiB accounted (%.1f formula); PSS growth "
                "%.1f MiB, RSS growth %.1f MiB, peak RSS growth %.1f MiB; step %.3f s\n",
                stage_name(a.stage), ranks, a.psi, rep.total() / 1048576.0, formula / 1048576.0,
                (static_cast<double>(end.pss) - base.pss) / 1048576.0,
                (static_cast<double>(rss_end) - rss_base) / 1048576.0,
                (static_cast<double>(hwm) - rss_base) / 1048576.0, sum.total * k);
  }
  return planned_ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, rc = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  try {
    Args a;
    rc = parse(argc, argv, rank == 0, a);
    if (rc < 0) rc = run(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "memory_scaling: %s\n", e.what());
    rc = 2;
  }
  int any = 0;
  MPI_Allreduce(&rc, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any;
}
