// bench_step.cpp: the optimizer step against its memory-traffic floor, per stage, under
// mpiexec. For every stage it runs a few steps of a model of --psi parameters (bf16 replica,
// tensors of --tensor-elems) and reports the mean time of each phase (slowest rank), the
// bytes each phase must move per rank, and the floor: those bytes over the in-place
// bandwidth of a += s*b measured by this run with the same rank count.
//
//   OMP_NUM_THREADS=1 mpiexec -n 2 bench_step [--psi 64M] [--tensor-elems 1M]
//        [--bucket-elems 1M] [--steps 5] [--warmup 2] [--stages dp,1,2] [--no-overlap]
//        [--reductions default,reproducible] [--micro-batches K] [--buckets-in-flight K]
// Reproducible mode (--reductions reproducible) adds its exact accumulation and 9 wire bytes
// per element instead of 4; its floor column is the default's, so step/floor shows its cost.
// With --micro-batches K every micro-batch writes every gradient, and the default's later
// micro-batches accumulate into it (+=, as a trainer's backward does); reproducible mode
// needs fresh buffers (its begin_backward deposits the previous micro-batch into its
// accumulator and clears them). The step columns time step() (and the last gathers); the time
// spent in begin_backward is the last column, "between s" (it was counted in the reduce
// phase and the step from 2026-11-27 12:10 to 2026-11-28, when the default's accumulation
// was in no column: the benchmark overwrote each gradient), and both are in "iteration s".
//   SHARDOPT_COMM=mpi selects plain MPI instead of shared memory.
// --interleave builds every reduction's optimizer of a stage at once (their memory together)
// and steps them in turns (each timed step: the first reduction, then the second; every other
// turn the other way round), so that both see the same machine minute by minute; the tables
// then show each phase's median over the timed steps (not the mean), and a last table
// gives, per later reduction, its step and iteration over the first's in the same turn (min,
// median, max over the timed steps). On a VM whose bandwidth drifts by tens of percent between
// minutes, the median of these ratios is the figure to quote.
//
// Floor bytes per rank (P padded elements, N ranks, bf16 replica):
//   reduce-scatter  4P read + 4P/N written      (every rank sums its 1/N over N inputs)
//   norm            4P/N read
//   update          30 B x P/N                  (master, m, v read+written, grad read, bf16 out)
//   all-gather      2P (N-1)/N read + written   (stages 1/2; data-parallel needs none)
//   data-parallel   all-reduce = 4P read + 4P/N + 2 x 4P (N-1)/N, update 30 B x P
// One rank (N = 1) reduces nothing: its reduce floor is 0.
// The gradient buffers' clearing for the next step is reported apart (4P or 4P/N written).
// Last columns: the nodes as MPI sees them and the bytes that crossed between nodes per step,
// rank 0's count (Communicator::internode_bytes; rank 0 is a node leader) and the planner's
// (MemoryPlan::internode_bytes); on pretend nodes: scripts/mpiexec_nodes.sh 2 1 -- bench_step.
// The very last: the whole iteration (the benchmark's backward, writing every gradient, through
// the step and the last gather; slowest rank), where work the library moves into or out of
// backward (stage 2's slot clearing) shows; not compared with the floor. Then "between s":
// begin_backward's time per step, slowest rank (several micro-batches). Last, "warm-up steps
// s": the step time of each untimed step (--warmup), slowest rank, where one-time costs show.
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shardopt/error.hpp"
#include "shardopt/mpi_comm.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/planner.hpp"
#include "support/timing.hpp"
#include "cli.hpp"

using namespace shardopt;

namespace {

struct Args {
  std::size_t psi = std::size_t{64} << 20;
  std::size_t tensor_elems = std::size_t{1} << 20;
  std::size_t bucket_elems = std::size_t{1} << 20;
  int steps = 5;
  /// Untimed steps first. Two: reproducible mode with several micro-batches moves its
  /// accumulator into a shared window at the end of the first step, and the next step is the
  /// first to touch those pages from every rank (about 0.5 s at 64 Mi elements on a VM whose
  /// page faults are slow): a one-time cost, not the step's.
  int warmup = 2;
  bool overlap = true;
  std::vector<Stage> stages{Stage::DataParallel, Stage::Zero1, Stage::Zero2};
  std::vector<Reduction> reductions{Reduction::Default};
  int micro_batches = 1;
  int buckets_in_flight = OptimizerOptions{}.buckets_in_flight;  ///< stage-2 staging slots
  /// Every reduction's optimizer of a stage at once, stepping in turns (robust ratios on a
  /// machine whose bandwidth drifts).
  bool interleave = false;
};

// The command line: the exit code after --help, --version or bad input, or -1 to run.
int parse(int argc, char** argv, bool print, Args& a) {
  CLI::App app{"The optimizer step of every stage against its memory-traffic floor; run "
               "under mpiexec (SHARDOPT_COMM=mpi for plain MPI)."};
  cli::init(app, "bench_step");
  app.add_option("--psi", a.psi, "parameters")->transform(cli::size())
      ->check(CLI::PositiveNumber)->default_str("64Mi");
  app.add_option("--tensor-elems", a.tensor_elems, "elements per tensor")
      ->transform(cli::size())->check(CLI::PositiveNumber)->default_str("1Mi");
  app.add_option("--bucket-elems", a.bucket_elems, "bucket size in elements")
      ->transform(cli::size())->check(CLI::PositiveNumber)->default_str("1Mi");
  app.add_option("--steps", a.steps, "timed steps per stage (after the --warmup steps)")
      ->check(CLI::Range(1, 1 << 20))->capture_default_str();
  app.add_option("--stages", a.stages, "stages, comma separated: dp (or 0), 1, 2")
      ->delimiter(',')
      ->transform(cli::choice<Stage>({{"dp", Stage::DataParallel}, {"0", Stage::DataParallel},
                                      {"1", Stage::Zero1}, {"2", Stage::Zero2}}))
      ->default_str("dp,1,2");
  app.add_option("--reductions", a.reductions, "default, reproducible, or both (comma separated)")
      ->delimiter(',')
      ->transform(cli::choice<Reduction>({{"default", Reduction::Default},
                                          {"reproducible", Reduction::Reproducible}}))
      ->default_str("default");
  app.add_option("--warmup", a.warmup,
                 "untimed steps before the timed ones (the second is the first in reproducible "
                 "mode's shared accumulator window)")
      ->check(CLI::Range(1, 1 << 10))->capture_default_str();
  app.add_option("--micro-batches", a.micro_batches,
                 "micro-batches per step (each writes every gradient; all but the last "
                 "without synchronisation)")
      ->check(CLI::Range(1, 1 << 10))->capture_default_str();
  app.add_option("--buckets-in-flight", a.buckets_in_flight,
                 "stage-2 staging slots (OptimizerOptions::buckets_in_flight)")
      ->check(CLI::Range(1, 1 << 16))->capture_default_str();
  bool no_overlap = false;
  app.add_flag("--no-overlap", no_overlap, "issue every collective inside step()");
  app.add_flag("--interleave", a.interleave,
               "build every reduction's optimizer of a stage at once and step them in turns "
               "(memory of all of them); prints each one's step and iteration over the first's, "
               "turn by turn");
  const int rc = cli::parse(app, argc, argv, print);
  a.overlap = !no_overlap;
  return rc;
}

float value(std::size_t param, std::size_t k, int salt) {
  return static_cast<float>(static_cast<int>((param * 7919 + k * 104729 + salt * 31) % 2001) - 1000) *
         1e-4f;
}

double max_over_ranks(double x) {
  MPI_Allreduce(MPI_IN_PLACE, &x, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return x;
}

struct Phases {
  double reduce = 0, norm = 0, update = 0, gather = 0, total = 0;
  double iteration = 0;  ///< backward (the benchmark's gradient writes) through the last gather
  double between = 0;    ///< begin_backward (reproducible mode's deposits), in iteration only
};

struct Extra {
  std::size_t reduce_bytes = 0;  ///< the planner's payload bytes of one step's reduction
  std::size_t grads_bytes = 0;   ///< this rank's gradient memory (tracker)
  int nodes = 1;                      ///< as MPI sees them (MPI_COMM_TYPE_SHARED)
  std::size_t internode_planned = 0;  ///< MemoryPlan::internode_bytes, per node and step
  std::string warmup;                 ///< each untimed step's step time (slowest rank), "a+b"
};

// The nodes as MPI sees them: how many ranks are node rank 0 of MPI_COMM_TYPE_SHARED.
int count_nodes() {
  int rank = 0, node_rank = 0, nodes = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm node;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
  MPI_Comm_rank(node, &node_rank);
  MPI_Comm_free(&node);
  const int leader = node_rank == 0 ? 1 : 0;
  MPI_Allreduce(&leader, &nodes, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  return nodes;
}

// One optimizer of one stage and reduction, stepped one step at a time (so that two can
// take turns: --interleave).
class Run {
 public:
  Run(const Args& a, Stage stage, Reduction reduction) : a_(a) {
    comm_ = make_mpi_communicator(MPI_COMM_WORLD);
    comm_name = comm_->name();
    OptimizerOptions o;
    o.stage = stage;
    o.bucket_elems = a.bucket_elems;
    o.overlap = a.overlap;
    o.reduction = reduction;
    o.buckets_in_flight = a.buckets_in_flight;
    opt_ = std::make_unique<ShardedOptimizer>(comm_, o);
    const FlatLayout model = uniform_layout(a.psi, a.tensor_elems);
    for (const ParamInfo& p : model.params()) opt_->add_param(p.name, p.numel, p.group);
    opt_->finalize();
    padded = opt_->layout().padded_size();
    PlanConfig plan = plan_config(o, comm_->size());
    extra.nodes = count_nodes();
    if (comm_->size() % extra.nodes == 0) plan.nodes = extra.nodes;  // else: unequal nodes, 0
    const MemoryPlan planned = plan_memory(opt_->layout(), plan);
    // Several micro-batches: reproducible mode exchanges its packed state (8 bytes per element);
    // on one node's shared memory the timed steps (after the warm-up) read the words and the
    // last micro-batch in place (12); the planner says which (plan_exact_step).
    const char* exchange = std::getenv("SHARDOPT_REPRO_EXCHANGE");
    const bool in_place = comm_->name() == "mpi-shm" && comm_->size() > 1 &&
                          (exchange == nullptr || std::string(exchange) != "packed-wire");
    if (o.reduction == Reduction::Reproducible) {
      // The planner's path for these micro-batches (plan_exact_step), as the optimizer takes it.
      const std::string e = exchange == nullptr ? "" : exchange;
      ExactStep st;
      st.most_micro_batches = a.micro_batches;
      st.fastest = e == "packed" || e == "packed-wire" ? ExactPath::Packed
                   : e == "two-phase"                  ? ExactPath::TwoPhase
                                                       : ExactPath::Direct;
      st.words_shared = in_place;
      extra.reduce_bytes = plan_exact_step(planned, st).wire_bytes;
    } else {
      extra.reduce_bytes = a.micro_batches <= 1 ? planned.reduce_bytes : planned.reduce_bytes_accumulated;
    }
    extra.internode_planned = plan.nodes > 1 ? planned.internode_bytes : 0;
  }

  // Step s (0-based; the first a.warmup are untimed and return nothing): the micro-batches'
  // gradient writes, step() and the last gathers; each phase the slowest rank's.
  std::optional<Phases> step(int s) {
    // Library work between micro-batches (reproducible mode deposits the previous
    // micro-batch into its accumulator in begin_backward): its own column, in the iteration,
    // where the default's accumulation (+=) is too.
    const std::size_t n = opt_->layout().num_params();
    double between = 0;
    const double iteration_start = MPI_Wtime();
    for (int mb = 0; mb < a_.micro_batches; ++mb) {
      const double b0 = MPI_Wtime();
      opt_->begin_backward(mb + 1 == a_.micro_batches);
      between += MPI_Wtime() - b0;
      for (std::size_t i = n; i-- > 0;) {  // backward order
        const std::span<float> g = opt_->grad(i);
        if (mb == 0) {
          for (std::size_t k = 0; k < g.size(); ++k) g[k] = value(i, k, s + mb);
        } else {
          for (std::size_t k = 0; k < g.size(); ++k) g[k] += value(i, k, s + mb);
        }
        opt_->grad_ready(i);
      }
    }
    MPI_Barrier(MPI_COMM_WORLD);
    const StepTimings t = opt_->step().timings;
    // The step ends when the replica is complete: with overlap the last gathers finish here.
    // Its time: step() (which counts the time blocked in reductions during backward too),
    // plus these waits.
    const double t0 = MPI_Wtime();
    for (std::size_t i = 0; i < n; ++i) opt_->wait_param(i);
    const double wall = t.total + (MPI_Wtime() - t0);
    const double iteration = MPI_Wtime() - iteration_start;
    if (s < a_.warmup) {
      // Shown apart: one-time costs (first touch of what the first steps allocate).
      char w[32];
      std::snprintf(w, sizeof w, "%s%.3f", s == 0 ? "" : "+", max_over_ranks(wall));
      extra.warmup += w;
      internode_start_ = comm_->internode_bytes();
      // After a step: what is allocated on demand (reproducible mode's accumulator) counts.
      extra.grads_bytes = opt_->memory_report()[MemCategory::Grads];
      return std::nullopt;
    }
    ++timed_;
    return Phases{max_over_ranks(t.reduce), max_over_ranks(t.norm), max_over_ranks(t.update),
                  max_over_ranks(t.gather), max_over_ranks(wall), max_over_ranks(iteration),
                  max_over_ranks(between)};
  }

  // Rank 0's count of inter-node bytes per timed step.
  double internode_per_step() const {
    return timed_ == 0 ? 0.0
                       : static_cast<double>(comm_->internode_bytes() - internode_start_) / timed_;
  }

  std::string comm_name;
  std::size_t padded = 0;
  Extra extra;

 private:
  const Args& a_;
  std::shared_ptr<Communicator> comm_;
  std::unique_ptr<ShardedOptimizer> opt_;
  std::uint64_t internode_start_ = 0;
  int timed_ = 0;
};

Phases mean(const std::vector<Phases>& v) {
  Phases m;
  for (const Phases& p : v) {
    m.reduce += p.reduce;
    m.norm += p.norm;
    m.update += p.update;
    m.gather += p.gather;
    m.total += p.total;
    m.iteration += p.iteration;
    m.between += p.between;
  }
  const double k = v.empty() ? 0.0 : 1.0 / static_cast<double>(v.size());
  return {m.reduce * k, m.norm * k, m.update * k, m.gather * k, m.total * k, m.iteration * k,
          m.between * k};
}

double median_of(std::vector<double> x) {
  if (x.empty()) return 0.0;
  std::sort(x.begin(), x.end());
  const std::size_t h = x.size() / 2;
  return x.size() % 2 == 1 ? x[h] : 0.5 * (x[h - 1] + x[h]);
}

// Each phase's median over the steps (each phase on its own: the columns need not add up).
Phases median(const std::vector<Phases>& v) {
  auto of = [&](double Phases::*f) {
    std::vector<double> x;
    for (const Phases& p : v) x.push_back(p.*f);
    return median_of(std::move(x));
  };
  return {of(&Phases::reduce), of(&Phases::norm),      of(&Phases::update), of(&Phases::gather),
          of(&Phases::total),  of(&Phases::iteration), of(&Phases::between)};
}

// "min / median / max" of x.
std::string spread(std::vector<double> x) {
  if (x.empty()) return "-";
  std::sort(x.begin(), x.end());
  char c[96];
  std::snprintf(c, sizeof c, "%.2f / **%.2f** / %.2f", x.front(), median_of(x), x.back());
  return c;
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
    const double N = ranks;
    // Arrays of at least 2 x 64 MiB per rank, far larger than the last-level cache.
    const double bw = bench::inplace_bandwidth_per_rank(
        std::max<std::size_t>(a.psi / static_cast<std::size_t>(ranks), std::size_t{16} << 20));
    if (rank == 0) {
      const char* threads = std::getenv("OMP_NUM_THREADS");
      std::printf("cpu: %s; ranks %d; OMP_NUM_THREADS=%s; psi %zu, tensors of %zu, buckets of "
                  "%zu, overlap %s, %d micro-batch(es)%s\n",
                  bench::cpu_model_name().c_str(), ranks, threads ? threads : "(unset)", a.psi,
                  a.tensor_elems, a.bucket_elems, a.overlap ? "on" : "off", a.micro_batches,
                  a.interleave ? "; interleaved: each time is its median over the timed steps" : "");
      std::printf("in-place a+=s*b bandwidth per rank (all ranks at once): %.2f GB/s\n\n", bw / 1e9);
      std::printf("| stage | reduction | comm | reduce s | norm s | update s | gather s | step s "
                  "| floor s | step/floor | clear s (not in floor) | reduce MiB/rank | grads MiB "
                  "| nodes | inter-node MiB/step counted | planned | iteration s | between s "
                  "| warm-up steps s |\n"
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    }
    // Each phase against its own floor (the bytes above, phase by phase, over the same
    // bandwidth), printed after the main table.
    std::string phases =
        "\neach phase over its own floor (bytes per rank / in-place bandwidth):\n\n"
        "| stage | reduction | comm | reduce | norm | update | gather |\n|---|---|---|---|---|---|---|\n";
    // One row of each table for a run's mean phases.
    auto report = [&](Stage stage, Reduction reduction, Run& run, const Phases& ph) {
      const double P = static_cast<double>(run.padded);
      const bool dp = stage == Stage::DataParallel;
      // Per phase: data-parallel's all-reduce and full update (its norm reads 4P/N, which the
      // step's floor leaves out); stages 1-2 as in the header. One rank reduces nothing.
      const double f_reduce =
          N == 1 ? 0.0 : (dp ? 4 * P + 4 * P / N + 2 * 4 * P * (N - 1) / N : 4 * P + 4 * P / N) / bw;
      const double f_norm = 4 * P / N / bw;
      const double f_update = (dp ? 30 * P : 30 * P / N) / bw;
      const double f_gather = dp ? 0.0 : 2 * 2 * P * (N - 1) / N / bw;
      const double floor = f_reduce + (dp ? 0.0 : f_norm) + f_update + f_gather;
      // stage 1 and data-parallel: the full buffer; stage 2: the slots once each + 4P/N
      const double clear = 4 * P;
      auto over = [](double t, double f) {
        char c[32] = "-";
        if (f > 0) std::snprintf(c, sizeof c, "%.2f", t / f);
        return std::string(c);
      };
      char row[256];
      std::snprintf(row, sizeof row, "| %s | %s | %s | %s | %s | %s | %s |\n",
                    stage_name(stage), reduction_name(reduction), run.comm_name.c_str(),
                    over(ph.reduce, f_reduce).c_str(), over(ph.norm, f_norm).c_str(),
                    over(ph.update, f_update).c_str(), over(ph.gather, f_gather).c_str());
      phases += row;
      if (rank == 0)
        std::printf("| %s | %s | %s | %.4f | %.4f | %.4f | %.4f | %.4f | %.4f | %.2f | %.4f | %.1f "
                    "| %.1f | %d | %.2f | %.2f | %.4f | %.4f | %s |\n",
                    stage_name(stage), reduction_name(reduction), run.comm_name.c_str(), ph.reduce,
                    ph.norm, ph.update, ph.gather, ph.total, floor, ph.total / floor, clear / bw,
                    static_cast<double>(run.extra.reduce_bytes) / (1 << 20),
                    static_cast<double>(run.extra.grads_bytes) / (1 << 20), run.extra.nodes,
                    run.internode_per_step() / (1 << 20),
                    static_cast<double>(run.extra.internode_planned) / (1 << 20), ph.iteration, ph.between,
                    run.extra.warmup.c_str());
    };
    // Per stage: each reduction's steps in turn, or with --interleave every reduction's
    // optimizer at once, taking turns step by step (and the per-step ratios to the first).
    std::string ratios =
        "\nstep by step, over the first reduction's step of the same turn (--interleave; min / "
        "median / max over the timed steps):\n\n"
        "| stage | reduction | step s ratio | iteration s ratio |\n|---|---|---|---|\n";
    for (Stage stage : a.stages) {
      if (!a.interleave) {
        for (Reduction reduction : a.reductions) {
          Run run(a, stage, reduction);
          std::vector<Phases> timed;
          for (int s = 0; s < a.warmup + a.steps; ++s)
            if (const auto ph = run.step(s)) timed.push_back(*ph);
          report(stage, reduction, run, mean(timed));
        }
        continue;
      }
      std::vector<std::unique_ptr<Run>> runs;
      for (Reduction reduction : a.reductions) runs.push_back(std::make_unique<Run>(a, stage, reduction));
      std::vector<std::vector<Phases>> timed(runs.size());
      for (std::unique_ptr<Run>& run : runs)
        for (int s = 0; s < a.warmup; ++s) run->step(s);
      for (int s = a.warmup; s < a.warmup + a.steps; ++s)
        for (std::size_t k = 0; k < runs.size(); ++k) {
          // Odd turns in reverse order, so that neither goes first every time.
          const std::size_t r = (s - a.warmup) % 2 == 0 ? k : runs.size() - 1 - k;
          timed[r].push_back(*runs[r]->step(s));
        }
      for (std::size_t r = 0; r < runs.size(); ++r) {
        report(stage, a.reductions[r], *runs[r], median(timed[r]));
        if (r == 0) continue;
        std::vector<double> step_ratio, iteration_ratio;
        for (std::size_t s = 0; s < timed[r].size(); ++s) {
          step_ratio.push_back(timed[r][s].total / timed[0][s].total);
          iteration_ratio.push_back(timed[r][s].iteration / timed[0][s].iteration);
        }
        ratios += std::string("| ") + stage_name(stage) + " | " + reduction_name(a.reductions[r]) +
                  " | " + spread(step_ratio) + " | " + spread(iteration_ratio) + " |\n";
      }
    }
    if (rank == 0) std::fputs(phases.c_str(), stdout);
    if (rank == 0 && a.interleave) std::fputs(ratios.c_str(), stdout);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_step: %s\n", e.what());
    rc = 2;
  }
  MPI_Finalize();
  return rc;
}
