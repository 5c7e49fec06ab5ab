// memory_scaling.cpp: one point of the memory-scaling sweep, run under mpiexec. Builds a
// model of --psi parameters, runs a few steps of the chosen stage, and appends one CSV row
// per rank: the library's accounting by category (checked against the planner), the
// process's resident memory (baseline before the optimizer, and peak), and the mean time of
// the step's phases. One process per point, so each peak belongs to one configuration.
// benchmarks/run_memory_scaling.sh runs the sweep and draws the plots (docs/memory.md).
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "shardopt/error.hpp"
#include "shardopt/mpi_comm.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/planner.hpp"

using namespace shardopt;

namespace {

constexpr const char* kUsage =
    "usage: mpiexec -n N memory_scaling --stage dp|1|2|3 --psi ELEMS [--tensor-elems ELEMS]\n"
    "       [--bucket-elems ELEMS] [--steps N] [--warmup N] [--csv FILE]\n";

struct Args {
  Stage stage = Stage::Zero1;
  std::size_t psi = 0;
  std::size_t tensor_elems = std::size_t{1} << 20;
  std::size_t bucket_elems = std::size_t{1} << 20;
  int steps = 3;
  int warmup = 1;
  std::string csv;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string opt = argv[i];
    require(i + 1 < argc, Status::InvalidArgument, opt + " needs a value\n" + kUsage);
    const std::string v = argv[++i];
    if (opt == "--stage") {
      if (v == "dp") a.stage = Stage::DataParallel;
      else if (v == "1") a.stage = Stage::Zero1;
      else if (v == "2") a.stage = Stage::Zero2;
      else if (v == "3") a.stage = Stage::Zero3;
      else throw Error(Status::InvalidArgument, "--stage is dp, 1, 2 or 3");
    } else if (opt == "--psi") a.psi = std::stoull(v);
    else if (opt == "--tensor-elems") a.tensor_elems = std::stoull(v);
    else if (opt == "--bucket-elems") a.bucket_elems = std::stoull(v);
    else if (opt == "--steps") a.steps = std::stoi(v);
    else if (opt == "--warmup") a.warmup = std::stoi(v);
    else if (opt == "--csv") a.csv = v;
    else throw Error(Status::InvalidArgument, "unknown option " + opt + "\n" + kUsage);
  }
  require(a.psi > 0 && a.steps > 0 && a.warmup >= 0, Status::InvalidArgument, kUsage);
  return a;
}

// A field of /proc/self/status in bytes (VmRSS: resident now, VmHWM: peak resident).
std::size_t proc_status_bytes(const char* field) {
  std::ifstream in("/proc/self/status");
  const std::string key = std::string(field) + ":";
  for (std::string line; std::getline(in, line);)
    if (line.compare(0, key.size(), key) == 0) return std::stoull(line.substr(key.size())) * 1024;
  throw Error(Status::Io, std::string("no ") + field + " in /proc/self/status");
}

// Synthetic but varied values; the numbers do not matter, the traffic and passes do.
float value(std::size_t param, std::size_t k, int salt) {
  return static_cast<float>(static_cast<int>((param * 7919 + k * 104729 + salt * 31) % 2001) - 1000) *
         1e-4f;
}

constexpr const char* kHeader =
    "ranks,rank,mode,psi,padded_elems,tensor_elems,bucket_elems,params_bytes,grads_bytes,"
    "master_bytes,moments_bytes,scratch_bytes,accounted_bytes,planned_bytes,formula_bytes,"
    "rss_base_bytes,rss_end_bytes,hwm_bytes,reduce_s,norm_s,update_s,gather_s,step_s,steps";

int run(const Args& a) {
  const std::size_t rss_base = proc_status_bytes("VmRSS");
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
  const std::size_t hwm = proc_status_bytes("VmHWM");
  const std::size_t rss_end = proc_status_bytes("VmRSS");
  const double k = 1.0 / a.steps;

  char line[1024];
  std::snprintf(line, sizeof line,
                "%d,%d,%s,%zu,%zu,%zu,%zu,%zu,%zu,%zu,%zu,%zu,%zu,%zu,%.0f,%zu,%zu,%zu,%.6g,%.6g,"
                "%.6g,%.6g,%.6g,%d",
                ranks, rank, stage_name(a.stage), a.psi, opt.layout().padded_size(),
                a.tensor_elems, a.bucket_elems, rep[MemCategory::Params], rep[MemCategory::Grads],
                rep[MemCategory::Master], rep[MemCategory::Moments], rep[MemCategory::Scratch],
                rep.total(), plan.total(), formula, rss_base, rss_end, hwm, sum.reduce * k,
                sum.norm * k, sum.update * k, sum.gather * k, sum.total * k, a.steps);
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
    std::printf("%-13s ranks %d psi %zu: %.1f MiB/rank accounted (%.1f formula), peak RSS %.1f MiB "
                "(%.1f before), step %.3f s\n",
                stage_name(a.stage), ranks, a.psi, rep.total() / 1048576.0, formula / 1048576.0,
                hwm / 1048576.0, rss_base / 1048576.0, sum.total * k);
  }
  return planned_ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rc = 0;
  try {
    rc = run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "memory_scaling: %s\n", e.what());
    rc = 2;
  }
  int any = 0;
  MPI_Allreduce(&rc, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any;
}
