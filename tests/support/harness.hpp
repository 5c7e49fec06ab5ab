// harness.hpp: a small model registered with a ShardedOptimizer next to its double-precision
// reference, deterministic per-rank gradients, and comparisons of the two.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "shardopt/optimizer.hpp"
#include "support/reference.hpp"
#include "support/world.hpp"

namespace shardopt::test {

// Odd sizes; with 4 ranks the 5000-element parameter is larger than a shard and several
// parameters straddle shard boundaries.
inline const std::vector<std::size_t> kSizes = {1, 7, 300, 5000, 65, 129, 3, 1000};

struct Model {
  std::vector<std::size_t> sizes = kSizes;
  std::vector<int> groups;  // per parameter
  std::vector<int> units;   // per parameter (contiguous from 0); empty: one unit
};

inline Model make_model() {
  Model m;
  for (std::size_t i = 0; i < m.sizes.size(); ++i) m.groups.push_back(i % 3 == 1 ? 1 : 0);
  return m;
}

inline std::vector<GroupOptions> group_table() { return {GroupOptions{}, GroupOptions{0.5, false}}; }

inline float init_value(std::size_t param, std::size_t k) { return synth(99, 0, param, k); }

// Gradient of rank r at step s; one parameter is given in bf16 to exercise that path.
// Values are multiples of 2^-10 in (-1, 1): fp32 sums over ranks are then exact in any
// order, so the oracle checks the update arithmetic and not MPI's summation order (Adam
// turns a rounding error of a near-zero average gradient into a full lr-sized step).
inline bool grad_in_bf16(std::size_t param) { return param == 2; }
inline float grad_value(int rank, int step, std::size_t param, std::size_t k) {
  const float u = synth(static_cast<std::uint64_t>(rank), static_cast<std::uint64_t>(step), param, k);
  const float g = std::round(u * 1024.0f) / 1024.0f;
  return grad_in_bf16(param) ? to_float(to_bf16(g)) : g;
}

struct Harness {
  std::unique_ptr<ShardedOptimizer> opt;
  std::vector<RefParam> ref;
  std::vector<GroupOptions> groups = group_table();
  AdamConfig cfg;
  Model model = make_model();
  std::int64_t ref_step = 0;

  Harness(Stage stage, DType dtype, AdamConfig c, std::size_t bucket = 700)
      : Harness([&] {
          OptimizerOptions o;
          o.stage = stage;
          o.param_dtype = dtype;
          o.adam = c;
          o.bucket_elems = bucket;
          return o;
        }()) {}

  explicit Harness(const OptimizerOptions& o, Model m = make_model(),
                   std::shared_ptr<Communicator> comm = world(),
                   std::vector<GroupOptions> group_options = group_table())
      : groups(std::move(group_options)), cfg(o.adam), model(std::move(m)) {
    opt = std::make_unique<ShardedOptimizer>(std::move(comm), o);
    opt->set_group(0, groups[0]);
    EXPECT_EQ(opt->add_group(groups[1]), 1);
    for (std::size_t i = 0; i < model.sizes.size(); ++i) {
      if (!model.units.empty() && i > 0 && model.units[i] != model.units[i - 1])
        EXPECT_EQ(opt->begin_unit(), model.units[i]);
      opt->add_param("p" + std::to_string(i), model.sizes[i], model.groups[i]);
    }
    opt->finalize();
    for (std::size_t i = 0; i < model.sizes.size(); ++i) {
      std::vector<float> init(model.sizes[i]);
      RefParam rp;
      rp.group = model.groups[i];
      for (std::size_t k = 0; k < init.size(); ++k) {
        init[k] = init_value(i, k);
        rp.p.push_back(init[k]);
      }
      rp.m.assign(init.size(), 0.0);
      rp.v.assign(init.size(), 0.0);
      ref.push_back(rp);
      opt->set_param(i, init);
    }
  }

  // Backward in reverse registration order, as stage 2 requires. `value` gives each rank's
  // gradient; by default grad_value (exactly summable). `around(i, before)`, if given, runs
  // before parameter i's gradient is written and after it is marked ready (stage 3 acquires
  // and releases units there).
  void write_grads(int step, int poison_rank = -1,
                   float (*value)(int, int, std::size_t, std::size_t) = grad_value,
                   const std::function<void(std::size_t, bool)>& around = {}) {
    for (std::size_t i = model.sizes.size(); i-- > 0;) {
      if (around) around(i, true);
      write_grad(i, step, poison_rank, value);
      if (around) around(i, false);
    }
  }

  // Parameter i's gradient of one step (added, so micro-batches accumulate), marked ready.
  void write_grad(std::size_t i, int step, int poison_rank = -1,
                  float (*value)(int, int, std::size_t, std::size_t) = grad_value) {
    const int rank = opt->comm().rank();
    std::vector<float> g(model.sizes[i]);
    for (std::size_t k = 0; k < g.size(); ++k) g[k] = value(rank, step, i, k);
    if (rank == poison_rank && i == 3) g[17] = std::numeric_limits<float>::quiet_NaN();
    if (grad_in_bf16(i)) {
      std::vector<bf16> low(g.size());
      for (std::size_t k = 0; k < g.size(); ++k) low[k] = to_bf16(g[k]);
      opt->accumulate_grad(i, std::span<const bf16>(low));
    } else {
      std::span<float> dst = opt->grad(i);  // backward adds (micro-batches accumulate)
      for (std::size_t k = 0; k < g.size(); ++k) dst[k] += g[k];
    }
    opt->grad_ready(i);
  }

  // The reference step over the average of steps[] micro-batches' gradients on all ranks.
  RefResult reference(std::vector<int> steps) {
    const int world = opt->comm().size();
    const double n = static_cast<double>(world) * static_cast<double>(steps.size());
    std::vector<std::vector<double>> avg(model.sizes.size());
    for (std::size_t i = 0; i < model.sizes.size(); ++i) {
      avg[i].assign(model.sizes[i], 0.0);
      for (std::size_t k = 0; k < model.sizes[i]; ++k) {
        for (int s : steps)
          for (int r = 0; r < world; ++r) avg[i][k] += grad_value(r, s, i, k);
        avg[i][k] /= n;
      }
    }
    RefResult r = reference_step(ref, avg, cfg, groups, ref_step + 1);
    if (!r.skipped) ++ref_step;
    return r;
  }
  RefResult reference(int step) { return reference(std::vector<int>{step}); }

  // One step on grad_value's gradients, checked against the reference: result fields and
  // the parameters afterwards.
  void step_and_check(int step) {
    write_grads(step);
    const StepResult r = opt->step();
    const RefResult rr = reference(step);
    EXPECT_FALSE(r.skipped);
    EXPECT_EQ(r.step, step);
    EXPECT_NEAR(r.grad_norm, rr.grad_norm, 1e-6 * rr.grad_norm);
    EXPECT_EQ(r.clipped, rr.clipped);
    expect_matches_reference(("step " + std::to_string(step)).c_str());
  }

  void expect_matches_reference(const char* where) {
    for (std::size_t i = 0; i < model.sizes.size(); ++i) {
      std::vector<float> master(model.sizes[i]);
      opt->get_master(i, master);
      double worst = 0;
      for (std::size_t k = 0; k < master.size(); ++k) {
        const double err = std::fabs(master[k] - ref[i].p[k]) / (1e-3 + std::fabs(ref[i].p[k]));
        worst = std::max(worst, err);
      }
      EXPECT_LT(worst, 2e-5) << where << ": parameter " << i;
      // The replica is the master rounded to the parameter dtype, bit for bit.
      for (std::size_t k = 0; k < master.size(); ++k) {
        if (opt->options().param_dtype == DType::BF16) {
          ASSERT_EQ(opt->param<bf16>(i)[k].bits, to_bf16(master[k]).bits) << where << " p" << i;
        } else {
          ASSERT_EQ(opt->param<float>(i)[k], master[k]) << where << " p" << i;
        }
      }
    }
  }
};


}  // namespace shardopt::test
