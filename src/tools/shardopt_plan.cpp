// shardopt_plan.cpp: shardopt-plan, the memory planner on the command line. Prints the
// per-rank bytes of a model for each stage and rank count (a table, or CSV), and with
// --budget the largest model that fits; with --ownership whole, the owner plan of whole-tensor
// ownership instead (per-rank elements, state bytes and Newton-Schulz flops). See
// docs/memory.md.
#include <cmath>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "cli.hpp"
#include "model_shapes.hpp"
#include "shardopt/error.hpp"
#include "shardopt/planner.hpp"

using namespace shardopt;

namespace {

[[noreturn]] void usage_error(const std::string& what) {
  throw Error(Status::InvalidArgument, what + " (see --help)");
}

FlatLayout read_layout_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw Error(Status::Io, "cannot read layout file '" + path + "'");
  FlatLayout layout;
  std::string line;
  for (int lineno = 1; std::getline(in, line); ++lineno) {
    line = line.substr(0, line.find('#'));
    std::istringstream ls(line);
    std::string name, numel;
    if (!(ls >> name)) continue;
    if (!(ls >> numel))
      usage_error(path + ":" + std::to_string(lineno) + ": expected 'name numel'");
    std::string error;
    const std::optional<std::size_t> n = cli::parse_size(numel, cli::Unit::Count, &error);
    if (!n) usage_error(path + ":" + std::to_string(lineno) + ": " + error);
    layout.add(name, *n, 0);
  }
  if (layout.num_params() == 0) usage_error("layout file '" + path + "' lists no tensors");
  return layout;
}

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  while (b >= 1024 && u < 5) {
    b /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", b, units[u]);
  return buf;
}

std::string human_count(double n) {
  const char* units[] = {"", "K", "M", "B", "T", "P", "E"};
  int u = 0;
  while (n >= 1000 && u < 6) {
    n /= 1000;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f%s" : "%.3g%s", n, units[u]);
  return buf;
}

struct Args {
  std::string model_name;
  FlatLayout layout;
  std::vector<int> ranks{1, 2, 4, 8, 64, 1024};
  std::vector<Stage> stages{Stage::DataParallel, Stage::Zero1, Stage::Zero2};
  DType param_dtype = DType::BF16;
  DType grad_dtype = DType::F32;
  std::size_t bucket_elems = PlanConfig{}.bucket_elems;
  Device device = Device::Cpu;
  int ranks_per_node = 0;  // 0: no inter-node column
  int buckets_in_flight = PlanConfig{}.buckets_in_flight;
  bool accumulate_without_sync = false;
  bool reproducible = false;
  Rule rule = Rule::AdamW;  // every parameter's update rule
  std::size_t tensor_elems = std::size_t{1} << 24;
  std::optional<std::size_t> budget;
  bool csv = false;
  Ownership ownership = Ownership::Flat;
  std::vector<bool> matrix;  // per parameter: a Muon matrix (presets only)
  bool per_rank = false;

  // Nodes of ranks_per_node ranks for n ranks (one node when n is smaller); 0 when they do
  // not divide n (the planner models equal nodes only).
  int nodes(int n) const {
    if (ranks_per_node <= 0 || n <= ranks_per_node) return 1;
    return n % ranks_per_node == 0 ? n / ranks_per_node : 0;
  }

  PlanConfig config(Stage s, int n) const {
    PlanConfig c;
    c.stage = s;
    c.world_size = n;
    c.param_dtype = param_dtype;
    c.grad_dtype = grad_dtype;
    c.bucket_elems = bucket_elems;
    c.device = device;
    c.nodes = std::max(1, nodes(n));  // rows whose nodes do not divide are not printed
    c.buckets_in_flight = buckets_in_flight;
    c.accumulate_without_sync = accumulate_without_sync;
    c.reduction = reproducible ? Reduction::Reproducible : Reduction::Default;
    GroupOptions g;
    g.rule = rule;
    c.groups = {g};
    return c;
  }

  // Whole-tensor ownership at n ranks (stages do not enter).
  PlanConfig ownership_config(int n) const {
    PlanConfig c = config(Stage::Zero1, n);
    c.nodes = 1;
    c.ownership = Ownership::Whole;
    c.matrix = matrix;
    return c;
  }
};

// The ZeRO paper's Figure 1 arithmetic (Rajbhandari et al. 2020, section 3.1): 16-bit
// parameters and gradients (2 + 2 bytes) and K = 12 bytes of optimizer state per parameter;
// ZeRO-1 shards K, ZeRO-2 shards the gradients too. Psi = 7.5B, N_d = 64 gives 120 / 31.4 /
// 16.6 GB. shardopt keeps fp32 gradients, so its own figures (zero_formula_bytes, and the
// planner's exact totals) are larger; this column is for comparing with the paper.
double paper_formula_bytes(Stage stage, double psi, double ranks) {
  constexpr double kParam = 2, kGrad = 2, kState = 12;
  switch (stage) {
    case Stage::DataParallel: return (kParam + kGrad + kState) * psi;
    case Stage::Zero1: return (kParam + kGrad) * psi + kState * psi / ranks;
    case Stage::Zero2: return kParam * psi + (kGrad + kState) * psi / ranks;
    case Stage::Zero3: return (kParam + kGrad + kState) * psi / ranks;
  }
  return 0;
}

// --help, --version, or bad input: returns the exit code; std::nullopt to go on.
std::optional<int> parse_args(int argc, char** argv, Args& a) {
  CLI::App app{"Per-rank memory of shardopt's sharded optimizer, predicted without allocating it "
               "(see docs/memory.md)."};
  cli::init(app, "shardopt-plan");
  std::size_t psi = 0;
  std::string model, layout_file;
  auto* model_opts = app.add_option_group("model", "the model (give exactly one)");
  auto* o_psi = model_opts->add_option("--psi", psi, "Psi parameters, as tensors of --tensor-elems (e.g. 7.5B, 70B, 1.3e9, 350M)")
                    ->transform(cli::size())->check(CLI::PositiveNumber);
  model_opts->add_option("--model", model, "a known transformer shape with its real tensors (--list-models)");
  model_opts->add_option("--layout", layout_file, "a file with one tensor per line: \"name numel\" ('#' starts a comment)")
      ->check(CLI::ExistingFile);
  bool list_models = false;
  model_opts->add_flag("--list-models", list_models, "print the known model names and exit");
  model_opts->require_option(1);

  app.add_option("--ranks", a.ranks, "rank counts N_d, comma separated")
      ->delimiter(',')->transform(cli::size())->check(CLI::Range(1, 1 << 30))
      ->default_str("1,2,4,8,64,1024");
  app.add_option("--stage", a.stages,
                 "stages, comma separated: dp (or 0), 1, 2, 3 (stage 3 gathers one tensor at a time)")
      ->delimiter(',')
      ->transform(cli::choice<Stage>({{"dp", Stage::DataParallel}, {"0", Stage::DataParallel},
                                      {"1", Stage::Zero1}, {"2", Stage::Zero2},
                                      {"3", Stage::Zero3}}))
      ->default_str("dp,1,2");
  const auto dtypes = cli::choice<DType>({{"bf16", DType::BF16}, {"fp32", DType::F32}});
  app.add_option("--param-dtype", a.param_dtype, "the replica the forward pass reads")
      ->transform(dtypes)->default_str("bf16");
  app.add_option("--grad-dtype", a.grad_dtype,
                 "fp32 only: shardopt's gradient buffers are fp32 (the paper column assumes 16-bit)")
      ->transform(dtypes)->default_str("fp32");
  app.add_option("--bucket-elems", a.bucket_elems,
                 "bucket size in elements (default: automatic, as OptimizerOptions' 0: an "
                 "eighth of the model, 4Ki to 1Mi; to 16Mi with --device cuda)")
      ->transform(cli::size())->check(CLI::PositiveNumber)->default_str("auto");
  app.add_option("--ranks-per-node", a.ranks_per_node,
                 "ranks per node: adds the bytes that cross between nodes per node per step "
                 "(MemoryPlan::internode_bytes; rank counts it does not divide are left out)")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--device", a.device,
                 "where the optimizer's buffers live (OptimizerOptions::device): sets the "
                 "automatic bucket size's cap")
      ->transform(cli::choice<Device>({{"cpu", Device::Cpu}, {"cuda", Device::Cuda}}))
      ->default_str("cpu");
  app.add_option("--buckets-in-flight", a.buckets_in_flight,
                 "stage-2 staging slots (OptimizerOptions::buckets_in_flight)")
      ->check(CLI::Range(1, 1 << 20))->capture_default_str();
  app.add_flag("--accumulate-without-sync", a.accumulate_without_sync,
               "several micro-batches per step that accumulate without synchronising "
               "(begin_backward(false)): stage 2 keeps a full fp32 accumulation buffer per "
               "rank, reproducible mode its exact accumulator and the 8-byte packed exchange");
  app.add_flag("--reproducible", a.reproducible,
               "reduction Reproducible: exact sums (a full fp32 gradient at every stage; 4 wire "
               "bytes per element with one micro-batch per rank)");
  app.add_option("--rule", a.rule,
                 "the update rule of every parameter: adamw (exp_avg and exp_avg_sq, 8 bytes of "
                 "state per element), lion (one momentum, 4 bytes), adamw8bit (8-bit codes and "
                 "block scales, 2.03 bytes; fp32 below 4096 elements) or muon (one momentum, 4 "
                 "bytes; 2-D matrices under whole ownership)")
      ->transform(CLI::CheckedTransformer(
          std::map<std::string, Rule>{
              {"adamw", Rule::AdamW}, {"lion", Rule::Lion}, {"adamw8bit", Rule::AdamW8bit},
              {"muon", Rule::Muon}},
          CLI::ignore_case))
      ->default_str("adamw");
  app.add_option("--tensor-elems", a.tensor_elems, "tensor size assumed with --psi and --budget")
      ->transform(cli::size())->check(CLI::PositiveNumber)->default_str("16Mi");
  app.add_option("--budget", a.budget, "also print the largest model that fits in BYTES per rank (e.g. 80GiB, 40GB)")
      ->transform(cli::size(cli::Unit::Bytes))->check(CLI::PositiveNumber);
  app.add_flag("--csv", a.csv, "CSV instead of tables");
  app.add_option("--ownership", a.ownership,
                 "flat (equal slices: the memory tables) or whole (every parameter on one rank: "
                 "the owner plan's per-rank elements, state bytes and Newton-Schulz flops; the "
                 "presets' projection matrices are Muon matrices, everything else element-wise)")
      ->transform(cli::choice<Ownership>({{"flat", Ownership::Flat}, {"whole", Ownership::Whole}}))
      ->default_str("flat");
  app.add_flag("--per-rank", a.per_rank, "with --ownership whole: also every rank's figures");
  if (const int rc = cli::parse(app, argc, argv); rc >= 0) return rc;

  if (list_models) {
    for (const tools::NamedModel& m : tools::known_models())
      std::cout << m.name << "\t" << m.description << "\n";
    return 0;
  }
  if (*o_psi) {
    a.model_name = "psi=" + o_psi->as<std::string>();
    a.layout = uniform_layout(psi, uniform_tensor_elems(psi, a.tensor_elems));
  } else if (!model.empty()) {
    a.model_name = model;
    tools::ModelParams m = tools::model_params(model);
    a.layout = std::move(m.layout);
    a.matrix = std::move(m.matrix);
  } else {
    a.model_name = layout_file;
    a.layout = read_layout_file(layout_file);
  }
  // The planner validates dtypes and sizes: fail before printing anything.
  if (a.ownership == Ownership::Whole) {
    plan_ownership(a.layout, a.ownership_config(a.ranks[0]));
    return std::nullopt;
  }
  for (Stage s : a.stages)
    plan_memory(s == Stage::Zero3 ? unit_per_tensor(a.layout) : a.layout, a.config(s, a.ranks[0]));
  return std::nullopt;
}

std::size_t largest_tensor(const FlatLayout& l) {
  std::size_t m = 0;
  for (const ParamInfo& p : l.params()) m = std::max(m, p.numel);
  return m;
}

// Stage 3 gathers a model given by its tensors one tensor (unit) at a time.
FlatLayout layout_for(const Args& a, Stage s) {
  return s == Stage::Zero3 ? unit_per_tensor(a.layout) : a.layout;
}

// The reduction's payload bytes of one step: with several micro-batches per rank,
// reproducible mode exchanges its packed state (8 bytes per element).
std::size_t reduce_per_step(const Args& a, const MemoryPlan& p) {
  return a.accumulate_without_sync ? p.reduce_bytes_accumulated : p.reduce_bytes;
}

// The optimizer state (master + moments) of the plan against AdamW's in the same configuration.
double state_vs_adamw(const Args& a, Stage s, int n, const MemoryPlan& p) {
  Args adamw = a;
  adamw.rule = Rule::AdamW;
  const MemoryPlan base = plan_memory(layout_for(a, s), adamw.config(s, n));
  const auto state = [](const MemoryPlan& m) {
    return static_cast<double>(m[MemCategory::Master] + m[MemCategory::Moments]);
  };
  return state(p) / state(base);
}

void print_tables(const Args& a) {
  FlatLayout probe = a.layout;
  probe.build(1, OptimizerOptions{}.bucket_elems);
  const double psi = static_cast<double>(probe.unpadded_size());
  std::printf("model %s: Psi = %s parameters (%zu) in %zu tensors, largest %s\n",
              a.model_name.c_str(), human_count(psi).c_str(), probe.unpadded_size(),
              probe.num_params(), human_count(static_cast<double>(largest_tensor(probe))).c_str());
  std::printf("rule %s, replica %s, gradients %s, stage-2 buckets of %zu elements, %d in flight%s%s\n",
              rule_name(a.rule), dtype_name(a.param_dtype), dtype_name(a.grad_dtype),
              a.bucket_elems, a.buckets_in_flight,
              a.accumulate_without_sync ? ", accumulation without sync" : "",
              a.reproducible ? ", reproducible reduction" : "");
  std::printf("bytes per rank. params..total: what shardopt allocates (planner, exact); "
              "formula: the ZeRO\nformula with shardopt's buffers (fp32 gradients, no padding "
              "or staging); paper: the ZeRO\npaper's formula, 16-bit parameters and gradients, "
              "K = 12, in decimal GB (its Figure 1)\n\n");
  std::printf("%-14s %6s %11s %11s %11s %11s %11s %11s %8s %11s %10s %11s%s\n", "stage", "ranks",
              "params", "grads", "master", "moments", "scratch", "total", "B/param", "formula",
              "paper", "reduce/step", a.ranks_per_node ? "  inter-node/step" : "");
  for (Stage s : a.stages) {
    for (int n : a.ranks) {
      if (a.nodes(n) == 0) {
        std::printf("%-14s %6d  (%d ranks per node do not divide %d ranks)\n", stage_name(s), n,
                    a.ranks_per_node, n);
        continue;
      }
      const MemoryPlan p = plan_memory(layout_for(a, s), a.config(s, n));
      std::printf("%-14s %6d", stage_name(s), n);
      for (std::size_t b : p.bytes) std::printf(" %11s", human_bytes(static_cast<double>(b)).c_str());
      std::printf(" %11s %8.3f %11s %7.1f GB %11s",
                  human_bytes(static_cast<double>(p.total())).c_str(),
                  static_cast<double>(p.total()) / psi,
                  human_bytes(zero_formula_bytes(s, psi, n, a.param_dtype, a.rule)).c_str(),
                  paper_formula_bytes(s, psi, n) / 1e9,
                  human_bytes(static_cast<double>(reduce_per_step(a, p))).c_str());
      if (a.ranks_per_node)
        std::printf("  %15s", human_bytes(static_cast<double>(p.internode_bytes)).c_str());
      if (a.rule != Rule::AdamW)
        std::printf("  state %.3fx AdamW's", state_vs_adamw(a, s, n, p));
      std::printf("\n");
    }
  }
  if (a.rule != Rule::AdamW)
    std::printf("\nstate: the optimizer state per rank (fp32 master + the rule's moments) "
                "against AdamW's in the same configuration\n");
  if (!a.budget) return;
  std::printf("\nlargest model within %s per rank (tensors of up to %s elements):\n",
              human_bytes(static_cast<double>(*a.budget)).c_str(),
              human_count(static_cast<double>(a.tensor_elems)).c_str());
  std::printf("%-14s %6s %16s\n", "stage", "ranks", "Psi");
  for (Stage s : a.stages)
    for (int n : a.ranks) {
      const std::size_t best = largest_fitting_psi(*a.budget, a.config(s, n), a.tensor_elems);
      std::printf("%-14s %6d %16s\n", stage_name(s), n,
                  human_count(static_cast<double>(best)).c_str());
    }
}

// One rank's optimizer state (fp32 master + moments) with AdamW on every parameter, flat
// ownership, stage 1 at n ranks: what the whole-tensor plan is compared with.
double adamw_state_bytes(const Args& a, int n) {
  Args adamw = a;
  adamw.rule = Rule::AdamW;
  adamw.bucket_elems =  // automatic, as finalize() picks it for this model
      FlatLayout::auto_bucket_elems(a.layout.unpadded_size(), auto_bucket_cap(a.device));
  const MemoryPlan m = plan_memory(a.layout, adamw.config(Stage::Zero1, n));
  return static_cast<double>(m[MemCategory::Master] + m[MemCategory::Moments]);
}

// Whole-tensor ownership: per rank count, the spread of the per-rank loads.
void print_ownership(const Args& a) {
  FlatLayout probe = a.layout;
  probe.build(1, OptimizerOptions{}.bucket_elems);
  const double psi = static_cast<double>(probe.unpadded_size());
  if (a.csv) {
    std::printf("model,psi,ranks,bucket_elems,buckets,equal_buckets,matrices,elems_max,elems_mean,"
                "state_bytes_max,state_bytes_mean,ns_flops_max,ns_flops_mean,adamw_state_bytes\n");
  } else {
    std::printf("model %s: Psi = %s parameters (%zu) in %zu tensors\n", a.model_name.c_str(),
                human_count(psi).c_str(), probe.unpadded_size(), probe.num_params());
    std::printf("whole-tensor ownership: Muon matrices (Newton-Schulz, %d iterations, %.0f B of "
                "state per element + the master) and element-wise %s; replica %s\n",
                kNewtonSchulzIterations, kMuonStateBytesPerElem, rule_name(a.rule),
                dtype_name(a.param_dtype));
    std::printf("per rank: elements of its ranges (padding included), optimizer state bytes "
                "(master included), Newton-Schulz flops per step; max and max/mean over ranks\n\n");
    std::printf("%6s %9s %8s %6s %9s %10s %8s %11s %8s %11s %8s %8s %8s\n", "ranks", "buckets",
                "equal", "mats", "bucket", "elems", "max/mean", "state", "max/mean", "NS flops",
                "max/mean", "vs AdamW", "mean vs");
  }
  for (int n : a.ranks) {
    const OwnershipReport r = plan_ownership(a.layout, a.ownership_config(n));
    const OwnerPlan& p = r.plan;
    const double adamw = adamw_state_bytes(a, n);
    if (a.csv) {
      std::printf("%s,%zu,%d,%zu,%zu,%zu,%zu,%.0f,%.1f,%.0f,%.1f,%.0f,%.1f,%.0f\n",
                  a.model_name.c_str(), probe.unpadded_size(), n, r.bucket_elems, r.num_buckets,
                  p.equal_buckets, r.matrices, p.elems.max, p.elems.mean, p.state_bytes.max,
                  p.state_bytes.mean, p.ns_flops.max, p.ns_flops.mean, adamw);
      continue;
    }
    std::printf("%6d %9zu %8zu %6zu %9s %10s %8.4f %11s %8.4f %11s %8.4f %7.3fx %7.3fx\n", n,
                r.num_buckets, p.equal_buckets, r.matrices,
                human_count(static_cast<double>(r.bucket_elems)).c_str(),
                human_count(p.elems.max).c_str(), p.elems.max_over_mean(),
                human_bytes(p.state_bytes.max).c_str(), p.state_bytes.max_over_mean(),
                human_count(p.ns_flops.max).c_str(), p.ns_flops.max_over_mean(),
                p.state_bytes.max / adamw, p.state_bytes.mean / adamw);
    if (!a.per_rank) continue;
    for (std::size_t k = 0; k < p.ranks.size(); ++k) {
      const RankLoad& l = p.ranks[k];
      std::printf("%6s rank %-4zu %22s %10s %8s %11s %8s %11s  %zu matrices\n", "", k, "",
                  human_count(static_cast<double>(l.elems)).c_str(), "",
                  human_bytes(static_cast<double>(l.state_bytes)).c_str(), "",
                  human_count(static_cast<double>(l.ns_flops)).c_str(), l.matrices);
    }
  }
  if (!a.csv)
    std::printf("\nbuckets: automatic buckets are raised to the largest matrix (every matrix "
                "inside one bucket); equal: buckets that hold only pieces of tensors larger than a "
                "bucket (element-wise), cut in equal slices; the others are cut into ragged "
                "per-rank ranges (docs/architecture.md)\n"
                "vs AdamW: the largest rank's state (fp32 master + moments) against one rank's "
                "under AdamW alone with flat ownership (stage 1, equal slices, same ranks and "
                "replica); mean vs: the mean rank's\n");
}

void print_csv(const Args& a) {
  std::printf("model,psi,padded_elems,stage,ranks,param_dtype,grad_dtype,bucket_elems,"
              "buckets_in_flight,accumulate_without_sync,params_bytes,grads_bytes,master_bytes,"
              "moments_bytes,scratch_bytes,total_bytes,formula_bytes,paper_bytes,reproducible,"
              "reduce_bytes,rule,state_vs_adamw%s%s\n",
              a.ranks_per_node ? ",ranks_per_node,internode_bytes" : "",
              a.budget ? ",budget_bytes,largest_psi" : "");
  for (Stage s : a.stages)
    for (int n : a.ranks) {
      if (a.nodes(n) == 0) continue;  // the table says why
      const PlanConfig c = a.config(s, n);
      const MemoryPlan p = plan_memory(layout_for(a, s), c);
      const double psi = static_cast<double>(p.unpadded_elems);
      std::printf("%s,%zu,%zu,%s,%d,%s,%s,%zu,%d,%d", a.model_name.c_str(), p.unpadded_elems,
                  p.padded_elems, stage_name(s), n, dtype_name(a.param_dtype),
                  dtype_name(a.grad_dtype), a.bucket_elems, a.buckets_in_flight,
                  a.accumulate_without_sync ? 1 : 0);
      for (std::size_t b : p.bytes) std::printf(",%zu", b);
      std::printf(",%zu,%.0f,%.0f,%d,%zu", p.total(), zero_formula_bytes(s, psi, n, a.param_dtype, a.rule),
                  paper_formula_bytes(s, psi, n), a.reproducible ? 1 : 0, reduce_per_step(a, p));
      std::printf(",%s,%.4f", rule_name(a.rule), state_vs_adamw(a, s, n, p));
      if (a.ranks_per_node) std::printf(",%d,%zu", a.ranks_per_node, p.internode_bytes);
      if (a.budget)
        std::printf(",%zu,%zu", *a.budget, largest_fitting_psi(*a.budget, c, a.tensor_elems));
      std::printf("\n");
    }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Args a;
    if (const std::optional<int> rc = parse_args(argc, argv, a)) return *rc;
    // Automatic, as finalize() chooses it for this model (whole ownership: plan_ownership
    // chooses, raising it to the largest matrix).
    if (a.bucket_elems == 0 && a.ownership == Ownership::Flat)
      a.bucket_elems = FlatLayout::auto_bucket_elems(a.layout.unpadded_size(), auto_bucket_cap(a.device));
    if (a.ownership == Ownership::Whole) {
      print_ownership(a);
    } else if (a.csv) {
      print_csv(a);
    } else {
      print_tables(a);
    }
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "shardopt-plan: %s: %s\n", status_name(e.status()), e.what());
    return e.status() == Status::InvalidArgument ? 2 : 1;
  }
}
