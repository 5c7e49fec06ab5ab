// step_check.cpp: the step's folded agreement (see step_check.hpp).
#include "step_check.hpp"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>

#include "comm/describe.hpp"
#include "comm/same_value.hpp"

namespace shardopt {
namespace {

// What is compared, in a fixed record for the rare all-gather (zeroed, so padding hashes and
// compares alike). -0.0 is stored as 0.0: it steps the same.
struct Wire {
  double lr, beta1, beta2, eps, weight_decay, max_grad_norm;
  std::int32_t mode, micro_batches;
  std::int64_t step;
  double scale;
  std::int64_t good_steps, skipped_steps;
  std::int32_t ls_enabled, ls_growth_interval;
  double ls_growth_factor, ls_backoff_factor, ls_min_scale, ls_max_scale;
  std::uint64_t num_groups;
};

double canonical(double x) { return x == 0.0 ? 0.0 : x; }

Wire wire_of(const StepSettings& s) {
  Wire w;
  std::memset(&w, 0, sizeof w);
  w.lr = canonical(s.adam.lr);
  w.beta1 = canonical(s.adam.beta1);
  w.beta2 = canonical(s.adam.beta2);
  w.eps = canonical(s.adam.eps);
  w.weight_decay = canonical(s.adam.weight_decay);
  w.max_grad_norm = canonical(s.adam.max_grad_norm);
  w.mode = static_cast<std::int32_t>(s.adam.mode);
  w.micro_batches = s.micro_batches;
  w.step = s.step;
  w.scale = canonical(s.loss_scale.scale);
  w.good_steps = s.loss_scale.good_steps;
  w.skipped_steps = s.loss_scale.skipped_steps;
  const LossScaling& ls = s.loss_scaling;
  w.ls_enabled = ls.enabled ? 1 : 0;
  w.ls_growth_interval = ls.growth_interval;
  w.ls_growth_factor = canonical(ls.growth_factor);
  w.ls_backoff_factor = canonical(ls.backoff_factor);
  w.ls_min_scale = canonical(ls.min_scale);
  w.ls_max_scale = canonical(ls.max_scale);
  w.num_groups = s.groups.size();
  return w;
}

// Per group: lr_scale, the weight-decay flag, the rule, Lion's betas, Muon's and Adafactor's
// settings.
constexpr std::size_t kGroupFields = 18;
std::vector<double> groups_of(const StepSettings& s) {
  std::vector<double> g;
  for (const GroupOptions& o : s.groups) {
    g.push_back(canonical(o.lr_scale));
    g.push_back(o.weight_decay ? 1.0 : 0.0);
    g.push_back(static_cast<double>(o.rule));
    g.push_back(canonical(o.lion.beta1));
    g.push_back(canonical(o.lion.beta2));
    g.push_back(canonical(o.muon.momentum));
    g.push_back(o.muon.nesterov ? 1.0 : 0.0);
    g.push_back(static_cast<double>(o.muon.ns_steps));
    g.push_back(canonical(o.muon.ns_a));
    g.push_back(canonical(o.muon.ns_b));
    g.push_back(canonical(o.muon.ns_c));
    g.push_back(canonical(o.muon.eps));
    g.push_back(static_cast<double>(o.muon.lr_adjust));
    g.push_back(canonical(o.adafactor.beta2_decay));
    g.push_back(canonical(o.adafactor.eps1));
    g.push_back(canonical(o.adafactor.eps2));
    g.push_back(canonical(o.adafactor.d));
    g.push_back(o.adafactor.maximize ? 1.0 : 0.0);
  }
  return g;
}

std::uint64_t fingerprint(const StepSettings& s) {
  const Wire w = wire_of(s);
  const std::vector<double> g = groups_of(s);
  return fnv1a64(g.data(), g.size() * sizeof(double), fnv1a64(&w, sizeof w));
}

// The shortest of %.15g and %.17g that reads back as v.
std::string text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.15g", v);
  if (std::strtod(buf, nullptr) != v) std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}
std::string text(std::int64_t v) { return std::to_string(v); }

// Appends "name differs: V1 on ranks ...; V2 on rank ..." when the ranks' values differ.
void describe(std::string& out, const std::string& name, int ranks,
              const std::function<std::string(int)>& value_of) {
  std::vector<std::string> values;
  for (int r = 0; r < ranks; ++r) values.push_back(value_of(r));
  const std::string d = values_by_rank(values);
  if (d.empty()) return;
  out += (out.empty() ? " " : ". ") + name + " differs: " + d;
}

[[noreturn]] void throw_mismatch(Communicator& comm, const StepSettings& mine) {
  const int n = comm.size();
  const Wire w = wire_of(mine);
  std::vector<Wire> all(static_cast<std::size_t>(n));
  comm.all_gather_bytes(&w, all.data(), sizeof w);
  auto at = [&](int r) -> const Wire& { return all[static_cast<std::size_t>(r)]; };
  std::string diff;
  auto real = [&](const char* name, double Wire::*f) {
    describe(diff, name, n, [&](int r) { return text(at(r).*f); });
  };
  auto integer = [&](const char* name, auto Wire::*f) {
    describe(diff, name, n, [&](int r) { return text(static_cast<std::int64_t>(at(r).*f)); });
  };
  real("lr", &Wire::lr);
  real("beta1", &Wire::beta1);
  real("beta2", &Wire::beta2);
  real("eps", &Wire::eps);
  real("weight_decay", &Wire::weight_decay);
  real("max_grad_norm", &Wire::max_grad_norm);
  describe(diff, "Adam mode", n, [&](int r) {
    return std::string(at(r).mode == static_cast<int>(AdamMode::AdamW) ? "AdamW" : "AdamL2");
  });
  integer("micro-batch count", &Wire::micro_batches);
  integer("step count", &Wire::step);
  real("loss scale", &Wire::scale);
  integer("loss scaling good steps", &Wire::good_steps);
  integer("skipped steps", &Wire::skipped_steps);
  integer("loss_scaling.enabled", &Wire::ls_enabled);
  integer("loss_scaling.growth_interval", &Wire::ls_growth_interval);
  real("loss_scaling.growth_factor", &Wire::ls_growth_factor);
  real("loss_scaling.backoff_factor", &Wire::ls_backoff_factor);
  real("loss_scaling.min_scale", &Wire::ls_min_scale);
  real("loss_scaling.max_scale", &Wire::ls_max_scale);
  integer("number of groups", &Wire::num_groups);
  // Group counts are fixed at finalize(); compare the groups only when they agree (every rank
  // sees the same counts, so all of them take the same path).
  bool same_count = true;
  for (int r = 0; r < n; ++r) same_count = same_count && at(r).num_groups == w.num_groups;
  if (same_count && w.num_groups > 0) {
    const std::vector<double> g = groups_of(mine);
    std::vector<double> gs(g.size() * static_cast<std::size_t>(n));
    comm.all_gather_bytes(g.data(), gs.data(), g.size() * sizeof(double));
    for (std::size_t k = 0; k < w.num_groups; ++k) {
      auto field = [&](std::size_t j) {
        return [&, j](int r) {
          return text(gs[static_cast<std::size_t>(r) * g.size() + kGroupFields * k + j]);
        };
      };
      const std::string group = "group " + std::to_string(k);
      describe(diff, group + " lr_scale", n, field(0));
      describe(diff, group + " weight_decay", n, field(1));
      describe(diff, group + " rule", n, [&](int r) {
        return std::string(rule_name(static_cast<Rule>(
            static_cast<int>(gs[static_cast<std::size_t>(r) * g.size() + kGroupFields * k + 2]))));
      });
      describe(diff, group + " lion.beta1", n, field(3));
      describe(diff, group + " lion.beta2", n, field(4));
      describe(diff, group + " muon.momentum", n, field(5));
      describe(diff, group + " muon.nesterov", n, field(6));
      describe(diff, group + " muon.ns_steps", n, field(7));
      describe(diff, group + " muon.ns_a", n, field(8));
      describe(diff, group + " muon.ns_b", n, field(9));
      describe(diff, group + " muon.ns_c", n, field(10));
      describe(diff, group + " muon.eps", n, field(11));
      describe(diff, group + " muon.lr_adjust", n, field(12));
      describe(diff, group + " adafactor.beta2_decay", n, field(13));
      describe(diff, group + " adafactor.eps1", n, field(14));
      describe(diff, group + " adafactor.eps2", n, field(15));
      describe(diff, group + " adafactor.d", n, field(16));
      describe(diff, group + " adafactor.maximize", n, field(17));
    }
  }
  if (diff.empty()) diff = " (the settings hash differently but compare equal)";
  throw Error(Status::InvalidArgument,
              "step: the ranks step with different settings; no update was applied and the "
              "reduced gradients are kept:" + diff);
}

}  // namespace

double sum_over_ranks_checked(Communicator& comm, double sumsq, const LocalOutcome& local,
                              const StepSettings& mine) {
  double v[2 + same_value::kDoubles];
  v[0] = local.ok() ? sumsq : 0.0;
  v[1] = local.ok() ? 0.0 : 1.0;
  same_value::encode(fingerprint(mine), v + 2);
  comm.all_reduce_sum_host(v, std::size(v));
  if (v[1] != 0.0) throw_agreed_error(comm, local.status, local.message);
  if (!same_value::same(v + 2, comm.size())) throw_mismatch(comm, mine);
  return v[0];
}

}  // namespace shardopt
