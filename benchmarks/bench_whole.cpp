// bench_whole.cpp: whole-tensor ownership's balance, measured (issue 32). A small Llama-shaped
// model (src/tools/model_shapes.hpp: Muon on the blocks' projection matrices, AdamW on the
// embedding, the norms and the head) runs a few steps with Ownership::Whole under mpiexec; per
// rank it records the update's CPU seconds (StepTimings::update_cpu: every thread of the
// process, so more ranks than cores do not blur it) and wall seconds, and prints every rank
// and the max/mean over ranks next to what the owner plan predicts (Newton-Schulz flops and
// state bytes, plan_ownership). In a synchronous step every rank waits for the slowest, so the
// update's max/mean is the step time lost to imbalance.
//
//   OMP_NUM_THREADS=1 mpiexec -n 4 bench_whole [--layers 4] [--dim 512] [--ffn 1376]
//        [--kv 256] [--vocab 8192] [--steps 5] [--stages 1,2] [--bucket-elems auto]
//   SHARDOPT_COMM=mpi selects plain MPI instead of shared memory.
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cli.hpp"
#include "model_shapes.hpp"
#include "shardopt/error.hpp"
#include "shardopt/mpi_comm.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/ownership.hpp"
#include "shardopt/planner.hpp"

using namespace shardopt;

namespace {

struct Args {
  tools::LlamaShape shape{4, 512, 1376, 256, 8192, false};
  int steps = 5;
  std::vector<Stage> stages{Stage::Zero1, Stage::Zero2};
  std::size_t bucket_elems = 0;  // automatic (raised to the largest matrix)
};

int parse(int argc, char** argv, bool print, Args& a) {
  CLI::App app{"Whole-tensor ownership with Muon + AdamW on a small Llama-shaped model: each "
               "rank's update time (CPU and wall) and its max/mean over ranks, against the "
               "owner plan's prediction; run under mpiexec (SHARDOPT_COMM=mpi for plain MPI)."};
  cli::init(app, "bench_whole");
  app.add_option("--layers", a.shape.n_layer, "transformer blocks")
      ->check(CLI::Range(1, 1024))->capture_default_str();
  app.add_option("--dim", a.shape.d_model, "model width")
      ->check(CLI::Range(1, 1 << 16))->capture_default_str();
  app.add_option("--ffn", a.shape.d_ffn, "SwiGLU hidden width")
      ->check(CLI::Range(1, 1 << 18))->capture_default_str();
  app.add_option("--kv", a.shape.d_kv, "width of the K and V projections (grouped heads)")
      ->check(CLI::Range(1, 1 << 16))->capture_default_str();
  app.add_option("--vocab", a.shape.vocab, "vocabulary (embedding and head rows)")
      ->check(CLI::Range(1, 1 << 20))->capture_default_str();
  app.add_option("--steps", a.steps, "timed steps per stage (after one warm-up step)")
      ->check(CLI::Range(1, 1 << 20))->capture_default_str();
  app.add_option("--stages", a.stages, "stages, comma separated: dp (or 0), 1, 2")
      ->delimiter(',')
      ->transform(cli::choice<Stage>({{"dp", Stage::DataParallel}, {"0", Stage::DataParallel},
                                      {"1", Stage::Zero1}, {"2", Stage::Zero2}}))
      ->default_str("1,2");
  app.add_option("--bucket-elems", a.bucket_elems, "bucket size in elements (default: automatic)")
      ->transform(cli::size())->default_str("auto");
  return cli::parse(app, argc, argv, print);
}

// A deterministic gradient value: different per parameter, element and step.
float value(std::size_t param, std::size_t k, int step) {
  const std::uint32_t h = static_cast<std::uint32_t>(param * 2654435761u + k * 40503u +
                                                     static_cast<std::size_t>(step) * 97u);
  return static_cast<float>(static_cast<int>(h % 2001u) - 1000) * 1e-3f;
}

struct Spread {
  double max = 0, mean = 0;
  double ratio() const { return mean > 0 ? max / mean : 0; }
};
Spread spread(double mine, int ranks) {
  Spread s;
  MPI_Allreduce(&mine, &s.max, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  MPI_Allreduce(&mine, &s.mean, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  s.mean /= ranks;
  return s;
}
std::vector<double> gather(double mine, int ranks) {
  std::vector<double> all(static_cast<std::size_t>(ranks));
  MPI_Gather(&mine, 1, MPI_DOUBLE, all.data(), 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  return all;
}

void run_stage(const Args& a, Stage stage, int rank, int ranks) {
  const tools::ModelParams model = tools::llama_model(a.shape);
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  OptimizerOptions o;
  o.stage = stage;
  o.ownership = Ownership::Whole;
  o.bucket_elems = a.bucket_elems;
  o.adam.lr = 1e-3;
  ShardedOptimizer opt(comm, o);
  GroupOptions muon;
  muon.rule = Rule::Muon;
  const int muon_group = opt.add_group(muon);
  for (std::size_t i = 0; i < model.layout.num_params(); ++i) {
    const ParamInfo& p = model.layout.param(i);
    if (model.matrix[i]) opt.add_param(p.name, Shape2D{p.rows, p.cols}, muon_group);
    else opt.add_param(p.name, p.numel, 0);
  }
  opt.finalize();

  // The plan the optimizer's cut follows: the same layout and groups.
  PlanConfig plan = plan_config(o, ranks);
  plan.groups = {GroupOptions{}, muon};
  plan.matrix = model.matrix;
  plan.bucket_elems = opt.layout().bucket_elems();
  const OwnershipReport predicted = plan_ownership(model.layout, plan);

  const std::size_t n = opt.layout().num_params();
  double cpu = 0, wall = 0;
  for (int s = 0; s <= a.steps; ++s) {  // step 0 warms up
    opt.begin_backward(true);
    for (std::size_t i = n; i-- > 0;) {
      const std::span<float> g = opt.grad(i);
      for (std::size_t k = 0; k < g.size(); ++k) g[k] = value(i, k, s);
      opt.grad_ready(i);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    const StepTimings t = opt.step().timings;
    for (std::size_t i = 0; i < n; ++i) opt.wait_param(i);
    if (s == 0) continue;
    cpu += t.update_cpu;
    wall += t.update;
  }
  cpu /= a.steps;
  wall /= a.steps;
  const Spread c = spread(cpu, ranks), w = spread(wall, ranks);
  const std::vector<double> cpus = gather(cpu, ranks), walls = gather(wall, ranks);
  if (rank != 0) return;
  const OwnerPlan& p = predicted.plan;
  std::printf("\nstage %s, %s, %d ranks, %zu buckets of up to %zu elements, %zu matrices\n",
              stage_name(stage), comm->name().c_str(), ranks, opt.layout().num_buckets(),
              opt.layout().bucket_elems(), predicted.matrices);
  std::printf("%6s %12s %12s %14s %10s %12s\n", "rank", "update cpu s", "update wall s",
              "NS Gflop plan", "mats plan", "state MiB plan");
  for (int r = 0; r < ranks; ++r) {
    const RankLoad& l = p.ranks[static_cast<std::size_t>(r)];
    std::printf("%6d %12.4f %12.4f %14.2f %10zu %12.1f\n", r, cpus[static_cast<std::size_t>(r)],
                walls[static_cast<std::size_t>(r)], static_cast<double>(l.ns_flops) * 1e-9,
                l.matrices, static_cast<double>(l.state_bytes) / (1024.0 * 1024.0));
  }
  std::printf("max/mean: update cpu %.4f, update wall %.4f; plan: NS flops %.4f, state %.4f\n",
              c.ratio(), w.ratio(), p.ns_flops.max_over_mean(), p.state_bytes.max_over_mean());
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, ranks = 1, rc = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  try {
    Args a;
    if (const int exit_code = parse(argc, argv, rank == 0, a); exit_code >= 0) {
      MPI_Finalize();
      return exit_code;
    }
    if (rank == 0) {
      const char* threads = std::getenv("OMP_NUM_THREADS");
      std::printf("bench_whole: Llama-shaped, %zu layers, d %zu, ffn %zu, kv %zu, vocab %zu; "
                  "Muon on the block matrices, AdamW elsewhere; %d ranks, OMP_NUM_THREADS=%s, "
                  "%d timed steps\n",
                  a.shape.n_layer, a.shape.d_model, a.shape.d_ffn, a.shape.d_kv, a.shape.vocab,
                  ranks, threads ? threads : "unset", a.steps);
    }
    for (Stage s : a.stages) run_stage(a, s, rank, ranks);
  } catch (const Error& e) {
    std::fprintf(stderr, "bench_whole: rank %d: %s\n", rank, e.what());
    rc = 1;
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  MPI_Finalize();
  return rc;
}
