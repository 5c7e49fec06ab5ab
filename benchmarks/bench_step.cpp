// bench_step.cpp: the optimizer step against its memory-traffic floor, per stage, under
// mpiexec. For every stage it runs a few steps of a model of --psi parameters (bf16 replica,
// tensors of --tensor-elems) and reports the mean time of each phase (slowest rank), the
// bytes each phase must move per rank, and the floor: those bytes over the in-place
// bandwidth of a += s*b measured by this run with the same rank count.
//
//   OMP_NUM_THREADS=1 mpiexec -n 2 bench_step [--psi 64M] [--tensor-elems 1M]
//        [--bucket-elems 1M] [--steps 5] [--stages dp,1,2] [--no-overlap]
//   SHARDOPT_COMM=mpi selects plain MPI instead of shared memory.
//
// Floor bytes per rank (P padded elements, N ranks, bf16 replica):
//   reduce-scatter  4P read + 4P/N written      (every rank sums its 1/N over N inputs)
//   norm            4P/N read
//   update          30 B x P/N                  (master, m, v read+written, grad read, bf16 out)
//   all-gather      2P (N-1)/N read + written   (stages 1/2; data-parallel needs none)
//   data-parallel   all-reduce = 4P read + 4P/N + 2 x 4P (N-1)/N, update 30 B x P
// The gradient buffers' clearing for the next step is reported apart (4P or 4P/N written).
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "shardopt/error.hpp"
#include "shardopt/mpi_comm.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/planner.hpp"
#include "support/timing.hpp"

using namespace shardopt;

namespace {

struct Args {
  std::size_t psi = std::size_t{64} << 20;
  std::size_t tensor_elems = std::size_t{1} << 20;
  std::size_t bucket_elems = std::size_t{1} << 20;
  int steps = 5;
  bool overlap = true;
  std::vector<Stage> stages{Stage::DataParallel, Stage::Zero1, Stage::Zero2};
};

std::size_t parse_size(const std::string& v) {
  std::size_t used = 0;
  const unsigned long long n = std::stoull(v, &used);
  const std::string suffix = v.substr(used);
  const std::size_t mult = suffix.empty() ? 1 : suffix == "K" ? 1000 : suffix == "M" ? 1000000
                         : suffix == "G" ? 1000000000 : suffix == "Ki" ? 1024
                         : suffix == "Mi" ? 1048576 : suffix == "Gi" ? 1073741824 : 0;
  require(mult != 0 && n > 0, Status::InvalidArgument, "bad size '" + v + "'");
  return static_cast<std::size_t>(n) * mult;
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string opt = argv[i];
    if (opt == "--no-overlap") {
      a.overlap = false;
      continue;
    }
    require(i + 1 < argc, Status::InvalidArgument, opt + " needs a value");
    const std::string v = argv[++i];
    if (opt == "--psi") a.psi = parse_size(v);
    else if (opt == "--tensor-elems") a.tensor_elems = parse_size(v);
    else if (opt == "--bucket-elems") a.bucket_elems = parse_size(v);
    else if (opt == "--steps") a.steps = static_cast<int>(parse_size(v));
    else if (opt == "--stages") {
      a.stages.clear();
      for (std::size_t p = 0; p < v.size();) {
        const std::size_t q = std::min(v.find(',', p), v.size());
        const std::string s = v.substr(p, q - p);
        if (s == "dp") a.stages.push_back(Stage::DataParallel);
        else if (s == "1") a.stages.push_back(Stage::Zero1);
        else if (s == "2") a.stages.push_back(Stage::Zero2);
        else throw Error(Status::InvalidArgument, "--stages: dp, 1 or 2, got '" + s + "'");
        p = q + 1;
      }
    } else {
      throw Error(Status::InvalidArgument, "unknown option " + opt);
    }
  }
  return a;
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
};

Phases run_stage(const Args& a, Stage stage, std::string& comm_name, std::size_t& padded) {
  auto comm = make_mpi_communicator(MPI_COMM_WORLD);
  comm_name = comm->name();
  OptimizerOptions o;
  o.stage = stage;
  o.bucket_elems = a.bucket_elems;
  o.overlap = a.overlap;
  ShardedOptimizer opt(comm, o);
  const FlatLayout model = uniform_layout(a.psi, a.tensor_elems);
  for (const ParamInfo& p : model.params()) opt.add_param(p.name, p.numel, p.group);
  opt.finalize();
  padded = opt.layout().padded_size();
  const std::size_t n = opt.layout().num_params();
  Phases sum;
  for (int s = 0; s <= a.steps; ++s) {  // step 0 warms up
    for (std::size_t i = n; i-- > 0;) {  // backward order
      const std::span<float> g = opt.grad(i);
      for (std::size_t k = 0; k < g.size(); ++k) g[k] = value(i, k, s);
      opt.grad_ready(i);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    const StepTimings t = opt.step().timings;
    // The step ends when the replica is complete: with overlap the last gathers finish here.
    // Its time: step() (which counts the time blocked in reductions during backward too),
    // plus these waits.
    const double t0 = MPI_Wtime();
    for (std::size_t i = 0; i < n; ++i) opt.wait_param(i);
    const double wall = t.total + (MPI_Wtime() - t0);
    if (s == 0) continue;
    sum.reduce += max_over_ranks(t.reduce);
    sum.norm += max_over_ranks(t.norm);
    sum.update += max_over_ranks(t.update);
    sum.gather += max_over_ranks(t.gather);
    sum.total += max_over_ranks(wall);
  }
  const double k = 1.0 / a.steps;
  return {sum.reduce * k, sum.norm * k, sum.update * k, sum.gather * k, sum.total * k};
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, ranks = 1, rc = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  try {
    const Args a = parse(argc, argv);
    const double N = ranks;
    // Arrays of at least 2 x 64 MiB per rank, far larger than the last-level cache.
    const double bw = bench::inplace_bandwidth_per_rank(
        std::max<std::size_t>(a.psi / static_cast<std::size_t>(ranks), std::size_t{16} << 20));
    if (rank == 0) {
      const char* threads = std::getenv("OMP_NUM_THREADS");
      std::printf("cpu: %s; ranks %d; OMP_NUM_THREADS=%s; psi %zu, tensors of %zu, buckets of "
                  "%zu, overlap %s\n",
                  bench::cpu_model_name().c_str(), ranks, threads ? threads : "(unset)", a.psi,
                  a.tensor_elems, a.bucket_elems, a.overlap ? "on" : "off");
      std::printf("in-place a+=s*b bandwidth per rank (all ranks at once): %.2f GB/s\n\n", bw / 1e9);
      std::printf("| stage | comm | reduce s | norm s | update s | gather s | step s | floor s "
                  "| step/floor | clear s (not in floor) |\n|---|---|---|---|---|---|---|---|---|---|\n");
    }
    for (Stage stage : a.stages) {
      std::string comm_name;
      std::size_t padded = 0;
      const Phases ph = run_stage(a, stage, comm_name, padded);
      const double P = static_cast<double>(padded);
      double bytes = 0, clear = 0;
      if (stage == Stage::DataParallel) {
        bytes = 4 * P + 4 * P / N + 2 * 4 * P * (N - 1) / N + 30 * P;
        clear = 4 * P;
      } else {
        bytes = 4 * P + 4 * P / N + 4 * P / N + 30 * P / N + 2 * 2 * P * (N - 1) / N;
        clear = 4 * P;  // stage 1: the full buffer; stage 2: the slots once each + 4P/N
      }
      const double floor = bytes / bw;
      if (rank == 0)
        std::printf("| %s | %s | %.4f | %.4f | %.4f | %.4f | %.4f | %.4f | %.2f | %.4f |\n",
                    stage_name(stage), comm_name.c_str(), ph.reduce, ph.norm, ph.update,
                    ph.gather, ph.total, floor, ph.total / floor, clear / bw);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_step: %s\n", e.what());
    rc = 2;
  }
  MPI_Finalize();
  return rc;
}
