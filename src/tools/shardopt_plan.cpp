// shardopt_plan.cpp: shardopt-plan, the memory planner on the command line. Prints the
// per-rank bytes of a model for each stage and rank count (a table, or CSV), and with
// --budget the largest model that fits. See docs/memory.md.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "model_shapes.hpp"
#include "shardopt/error.hpp"
#include "shardopt/planner.hpp"

using namespace shardopt;

namespace {

constexpr const char* kUsage = R"(usage: shardopt-plan (--psi N | --model NAME | --layout FILE) [options]
Per-rank memory of shardopt's sharded AdamW, predicted without allocating it.

model (one of):
  --psi N              N parameters, as tensors of --tensor-elems (e.g. 7.5B, 1.3e9, 350M)
  --model NAME         a known transformer shape with its real tensors (--list-models)
  --layout FILE        one tensor per line: "name numel" ('#' starts a comment)
options:
  --ranks LIST         rank counts, comma separated (default 1,2,4,8,64,1024)
  --stage LIST         dp, 1, 2, 3, comma separated (default dp,1,2; stage 3 gathers one
                       tensor at a time)
  --param-dtype T      bf16 (default) or fp32: the replica the forward pass reads
  --grad-dtype T       fp32 only: shardopt's gradients are fp32 (see docs/memory.md)
  --bucket-elems N     stage-2 bucket size in elements (default 1Mi)
  --tensor-elems N     tensor size assumed with --psi and --budget (default 16Mi)
  --budget BYTES       also print the largest model that fits (e.g. 80GiB, 40GB)
  --csv                CSV instead of tables
  --list-models        print the known model names
Counts take k M B G T (powers of 1000) or Ki Mi Gi Ti (powers of 1024); byte sizes take
KB MB GB TB or KiB MiB GiB TiB.
)";

[[noreturn]] void usage_error(const std::string& what) {
  throw Error(Status::InvalidArgument, what + " (see --help)");
}

// "7.5B", "16Mi", "80GiB", "1e9": a number with an optional decimal or binary suffix.
std::size_t parse_quantity(const std::string& text, bool bytes) {
  std::size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    usage_error("not a number: '" + text + "'");
  }
  std::string suffix = text.substr(used);
  if (bytes && suffix.size() > 1 && suffix.back() == 'B') suffix.pop_back();
  double scale = 1;
  if (suffix.empty() || (bytes && suffix == "B")) scale = 1;
  else if (suffix == "k" || suffix == "K") scale = 1e3;
  else if (suffix == "M") scale = 1e6;
  else if (suffix == "G" || (!bytes && suffix == "B")) scale = 1e9;
  else if (suffix == "T") scale = 1e12;
  else if (suffix == "Ki") scale = 0x1p10;
  else if (suffix == "Mi") scale = 0x1p20;
  else if (suffix == "Gi") scale = 0x1p30;
  else if (suffix == "Ti") scale = 0x1p40;
  else usage_error("unknown suffix in '" + text + "'");
  const double n = std::round(value * scale);
  if (!(n >= 0) || n > 0x1p62) usage_error("out of range: '" + text + "'");
  return static_cast<std::size_t>(n);
}

std::vector<std::string> split(const std::string& list) {
  std::vector<std::string> out;
  std::stringstream ss(list);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

DType parse_dtype(const std::string& s) {
  if (s == "bf16") return DType::BF16;
  if (s == "fp32" || s == "f32") return DType::F32;
  usage_error("unknown dtype '" + s + "' (bf16 or fp32)");
}

Stage parse_stage(const std::string& s) {
  if (s == "dp" || s == "0" || s == "data-parallel") return Stage::DataParallel;
  if (s == "1" || s == "zero-1") return Stage::Zero1;
  if (s == "2" || s == "zero-2") return Stage::Zero2;
  if (s == "3" || s == "zero-3") return Stage::Zero3;
  usage_error("unknown stage '" + s + "' (dp, 1, 2 or 3)");
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
    layout.add(name, parse_quantity(numel, false), 0);
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
  const char* units[] = {"", "K", "M", "B", "T"};
  int u = 0;
  while (n >= 1000 && u < 4) {
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
  bool have_model = false;
  std::vector<int> ranks{1, 2, 4, 8, 64, 1024};
  std::vector<Stage> stages{Stage::DataParallel, Stage::Zero1, Stage::Zero2};
  DType param_dtype = DType::BF16;
  DType grad_dtype = DType::F32;
  std::size_t bucket_elems = PlanConfig{}.bucket_elems;
  std::size_t tensor_elems = std::size_t{1} << 24;
  std::optional<std::size_t> budget;
  std::optional<std::size_t> psi;
  bool csv = false;
};

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string opt = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage_error(opt + " needs a value");
      return argv[++i];
    };
    auto set_model = [&](std::string name, FlatLayout l) {
      if (a.have_model) usage_error("give one of --psi, --model, --layout");
      a.model_name = std::move(name);
      a.layout = std::move(l);
      a.have_model = true;
    };
    if (opt == "--help" || opt == "-h") {
      std::cout << kUsage;
      std::exit(0);
    } else if (opt == "--list-models") {
      for (const tools::NamedModel& m : tools::known_models())
        std::cout << m.name << "\t" << m.description << "\n";
      std::exit(0);
    } else if (opt == "--psi") {
      const std::string v = value();
      a.psi = parse_quantity(v, false);
      set_model("psi=" + v, FlatLayout{});  // built below, once --tensor-elems is known
    } else if (opt == "--model") {
      const std::string v = value();
      set_model(v, tools::model_layout(v));
    } else if (opt == "--layout") {
      const std::string v = value();
      set_model(v, read_layout_file(v));
    } else if (opt == "--ranks") {
      a.ranks.clear();
      for (const std::string& r : split(value())) {
        const std::size_t n = parse_quantity(r, false);
        if (n == 0 || n > (1u << 30)) usage_error("bad rank count '" + r + "'");
        a.ranks.push_back(static_cast<int>(n));
      }
    } else if (opt == "--stage") {
      a.stages.clear();
      for (const std::string& s : split(value())) a.stages.push_back(parse_stage(s));
    } else if (opt == "--param-dtype") {
      a.param_dtype = parse_dtype(value());
    } else if (opt == "--grad-dtype") {
      a.grad_dtype = parse_dtype(value());
    } else if (opt == "--bucket-elems") {
      a.bucket_elems = parse_quantity(value(), false);
    } else if (opt == "--tensor-elems") {
      a.tensor_elems = parse_quantity(value(), false);
    } else if (opt == "--budget") {
      a.budget = parse_quantity(value(), true);
    } else if (opt == "--csv") {
      a.csv = true;
    } else {
      usage_error("unknown option '" + opt + "'");
    }
  }
  if (!a.have_model) usage_error("give the model: --psi, --model or --layout");
  if (a.ranks.empty() || a.stages.empty()) usage_error("empty --ranks or --stage list");
  if (a.tensor_elems == 0) usage_error("--tensor-elems must be positive");
  if (a.psi) a.layout = uniform_layout(*a.psi, uniform_tensor_elems(*a.psi, a.tensor_elems));
  // The planner validates dtypes and sizes: fail before printing anything.
  plan_memory(a.layout, PlanConfig{a.stages[0], a.ranks[0], a.param_dtype, a.grad_dtype,
                                   a.bucket_elems});
  return a;
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

void print_tables(const Args& a) {
  FlatLayout probe = a.layout;
  probe.build(1, OptimizerOptions{}.bucket_elems);
  const double psi = static_cast<double>(probe.unpadded_size());
  std::printf("model %s: Psi = %s parameters (%zu) in %zu tensors, largest %s\n",
              a.model_name.c_str(), human_count(psi).c_str(), probe.unpadded_size(),
              probe.num_params(), human_count(static_cast<double>(largest_tensor(probe))).c_str());
  std::printf("replica %s, gradients %s, stage-2 buckets of %zu elements; bytes per rank\n\n",
              dtype_name(a.param_dtype), dtype_name(a.grad_dtype), a.bucket_elems);
  std::printf("%-14s %6s %11s %11s %11s %11s %11s %11s %8s %11s\n", "stage", "ranks", "params",
              "grads", "master", "moments", "scratch", "total", "B/param", "ZeRO formula");
  for (Stage s : a.stages) {
    for (int n : a.ranks) {
      const PlanConfig c{s, n, a.param_dtype, a.grad_dtype, a.bucket_elems};
      const MemoryPlan p = plan_memory(layout_for(a, s), c);
      std::printf("%-14s %6d", stage_name(s), n);
      for (std::size_t b : p.bytes) std::printf(" %11s", human_bytes(static_cast<double>(b)).c_str());
      std::printf(" %11s %8.3f %11s\n", human_bytes(static_cast<double>(p.total())).c_str(),
                  static_cast<double>(p.total()) / psi,
                  human_bytes(zero_formula_bytes(s, psi, n, a.param_dtype)).c_str());
    }
  }
  if (!a.budget) return;
  std::printf("\nlargest model within %s per rank (tensors of up to %s elements):\n",
              human_bytes(static_cast<double>(*a.budget)).c_str(),
              human_count(static_cast<double>(a.tensor_elems)).c_str());
  std::printf("%-14s %6s %16s\n", "stage", "ranks", "Psi");
  for (Stage s : a.stages)
    for (int n : a.ranks) {
      const std::size_t best = largest_fitting_psi(
          *a.budget, PlanConfig{s, n, a.param_dtype, a.grad_dtype, a.bucket_elems},
          a.tensor_elems);
      std::printf("%-14s %6d %16s\n", stage_name(s), n,
                  human_count(static_cast<double>(best)).c_str());
    }
}

void print_csv(const Args& a) {
  std::printf("model,psi,padded_elems,stage,ranks,param_dtype,grad_dtype,bucket_elems,"
              "params_bytes,grads_bytes,master_bytes,moments_bytes,scratch_bytes,total_bytes,"
              "formula_bytes%s\n",
              a.budget ? ",budget_bytes,largest_psi" : "");
  for (Stage s : a.stages)
    for (int n : a.ranks) {
      const PlanConfig c{s, n, a.param_dtype, a.grad_dtype, a.bucket_elems};
      const MemoryPlan p = plan_memory(layout_for(a, s), c);
      std::printf("%s,%zu,%zu,%s,%d,%s,%s,%zu", a.model_name.c_str(), p.unpadded_elems,
                  p.padded_elems, stage_name(s), n, dtype_name(a.param_dtype),
                  dtype_name(a.grad_dtype), a.bucket_elems);
      for (std::size_t b : p.bytes) std::printf(",%zu", b);
      std::printf(",%zu,%.0f", p.total(),
                  zero_formula_bytes(s, static_cast<double>(p.unpadded_elems), n, a.param_dtype));
      if (a.budget)
        std::printf(",%zu,%zu", *a.budget, largest_fitting_psi(*a.budget, c, a.tensor_elems));
      std::printf("\n");
    }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args a = parse_args(argc, argv);
    if (a.csv) {
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
