// test_rules.cpp: the optimizer rule layer at whatever rank count the binary runs with (1
// without MPI; 1-4 under mpiexec): a model with AdamW and Lion groups against the
// double-precision reference at every stage, the same bits as one process, the state each
// rule keeps (memory, planner, get_state), and the rule's place in the agreements (finalize,
// step, set_group).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "shardopt/optimizer.hpp"
#include "rules/qmap.hpp"
#include "shardopt/checkpoint.hpp"
#include "shardopt/planner.hpp"
#include "support/ckpt_model.hpp"
#include "support/harness.hpp"
#include "support/reference.hpp"
#include "support/world.hpp"
#include "support/zero3.hpp"

using namespace shardopt;
using shardopt::test::Harness;
using shardopt::test::Model;

namespace {

void expect_status(Status want, const std::function<void()>& f, const std::string& what,
                   const std::string& message_part = "") {
  try {
    f();
    ADD_FAILURE() << what << ": no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), want) << what << ": " << e.what();
    if (!message_part.empty())
      EXPECT_NE(std::string(e.what()).find(message_part), std::string::npos) << e.what();
  }
}

GroupOptions lion_group(double lr_scale = 0.5, double beta1 = 0.9, double beta2 = 0.99) {
  GroupOptions g;
  g.lr_scale = lr_scale;
  g.weight_decay = true;
  g.rule = Rule::Lion;
  g.lion = {beta1, beta2};
  return g;
}

// Group 0 AdamW, group 1 Lion (p1, p4, p7 of the harness model); units for stage 3.
std::vector<GroupOptions> mixed_groups() { return {GroupOptions{}, lion_group()}; }
Model unit_model() {
  Model m = test::make_model();
  m.units = {0, 0, 1, 1, 2, 2, 2, 3};
  return m;
}

struct Config {
  Stage stage;
  DType dtype;
  double max_norm;
};

OptimizerOptions options_of(const Config& c, std::size_t bucket = 700) {
  OptimizerOptions o;
  o.stage = c.stage;
  o.param_dtype = c.dtype;
  o.adam.lr = 1e-2;
  o.adam.weight_decay = 0.1;
  o.adam.max_grad_norm = c.max_norm;
  o.bucket_elems = bucket;
  return o;
}

std::string config_name(const testing::TestParamInfo<Config>& info) {
  std::string s = std::string(stage_name(info.param.stage)) + "_" + dtype_name(info.param.dtype) +
                  (info.param.max_norm > 0 ? "_clip" : "");
  for (char& ch : s)
    if (ch == '-') ch = '_';
  return s;
}

class RulesVsReference : public testing::TestWithParam<Config> {};

// The rank a one-process run plays (single_process_value's gradients).
int g_played_rank = 0;
float played_rank_value(int, int step, std::size_t param, std::size_t k) {
  return test::grad_value(g_played_rank, step, param, k);
}

// `steps` steps of a one-process optimizer that accumulates the gradients of every rank of
// this run as micro-batches: the sums and the 1/N average of the sharded runs, exactly.
void train_as_one_process(Harness& single, int steps) {
  const int world = test::world_size();
  for (int step = 1; step <= steps; ++step) {
    for (int r = 0; r < world; ++r) {
      single.opt->begin_backward(r + 1 == world);
      g_played_rank = r;
      single.write_grads(step, -1, played_rank_value);
    }
    single.opt->step();
  }
}

}  // namespace

// AdamW and Lion groups side by side, every stage, against the double reference: the
// parameters after each step (Lion moves every weight by lr per step, so a wrong sign or a
// missed decay shows at once) and the momentum Lion keeps.
TEST_P(RulesVsReference, MixedAdamWAndLionMatchDoublePrecision) {
  const Config c = GetParam();
  Harness h(options_of(c), unit_model(), test::world(), mixed_groups());
  const bool zero3 = c.stage == Stage::Zero3;
  for (int step = 1; step <= 5; ++step) {
    if (zero3)
      h.write_grads(step, -1, test::grad_value, test::backward_units(*h.opt));
    else
      h.write_grads(step);
    const StepResult r = h.opt->step();
    const test::RefResult rr = h.reference(step);
    EXPECT_NEAR(r.grad_norm, rr.grad_norm, 1e-6 * rr.grad_norm);
    EXPECT_EQ(r.clipped, rr.clipped);
    if (!zero3) {
      h.expect_matches_reference(("step " + std::to_string(step)).c_str());
      continue;
    }
    for (std::size_t i = 0; i < h.model.sizes.size(); ++i) {  // stage 3: the master only
      std::vector<float> master(h.model.sizes[i]);
      h.opt->get_master(i, master);
      for (std::size_t k = 0; k < master.size(); ++k)
        ASSERT_NEAR(master[k], h.ref[i].p[k], 2e-5 * (1e-3 + std::fabs(h.ref[i].p[k])))
            << "step " << step << " p" << i << "[" << k << "]";
    }
  }
  // Lion's momentum is its exp_avg.
  for (std::size_t i = 0; i < h.model.sizes.size(); ++i) {
    if (h.groups[static_cast<std::size_t>(h.model.groups[i])].rule != Rule::Lion) continue;
    std::vector<float> m(h.model.sizes[i]);
    h.opt->get_state(StateArray::ExpAvg, i, m);
    for (std::size_t k = 0; k < m.size(); ++k)
      ASSERT_NEAR(m[k], h.ref[i].m[k], 1e-5 * (1e-3 + std::fabs(h.ref[i].m[k]))) << "p" << i;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Stages, RulesVsReference,
    testing::Values(Config{Stage::DataParallel, DType::BF16, 0.0},
                    Config{Stage::Zero1, DType::BF16, 0.0}, Config{Stage::Zero1, DType::F32, 0.0},
                    Config{Stage::Zero1, DType::BF16, 1.0}, Config{Stage::Zero2, DType::BF16, 0.0},
                    Config{Stage::Zero2, DType::F32, 1.0}, Config{Stage::Zero3, DType::BF16, 0.0},
                    Config{Stage::Zero3, DType::F32, 1.0}),
    config_name);

// Every stage at this rank count gives the bits of one process that accumulates all ranks'
// gradients as micro-batches (exactly summable gradients: the sums are exact in any order, and
// both average by the same 1/N), with two bucket sizes: the rule's state never depends on the
// sharding.
TEST(Rules, EveryStageAndBucketSizeGivesTheBitsOfOneProcess) {
  Harness single(options_of(Config{Stage::Zero1, DType::BF16, 0.0}), unit_model(),
                 make_single_process_communicator(), mixed_groups());
  train_as_one_process(single, 4);
  for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2, Stage::Zero3})
    for (std::size_t bucket : {std::size_t{300}, std::size_t{2000}}) {
      SCOPED_TRACE(std::string(stage_name(stage)) + " bucket " + std::to_string(bucket));
      Harness h(options_of(Config{stage, DType::BF16, 0.0}, bucket), unit_model(), test::world(),
                mixed_groups());
      for (int step = 1; step <= 4; ++step) {
        if (stage == Stage::Zero3)
          h.write_grads(step, -1, test::grad_value, test::backward_units(*h.opt));
        else
          h.write_grads(step);
        h.opt->step();
      }
      for (std::size_t i = 0; i < h.model.sizes.size(); ++i) {
        const bool lion = h.model.groups[i] == 1;
        for (StateArray a : {StateArray::Master, StateArray::ExpAvg, StateArray::ExpAvgSq}) {
          if (lion && a == StateArray::ExpAvgSq) continue;
          std::vector<float> x(h.model.sizes[i]), y(h.model.sizes[i]);
          h.opt->get_state(a, i, x);
          single.opt->get_state(a, i, y);
          ASSERT_EQ(std::memcmp(x.data(), y.data(), x.size() * sizeof(float)), 0)
              << "p" << i << " array " << static_cast<int>(a);
        }
      }
    }
}

// Lion keeps one fp32 array (4 bytes per element), AdamW two: the moments each rank holds
// are the planner's, rank by rank, and an all-Lion model halves them.
TEST(Rules, StateMemoryIsEachRulesAndThePlannersOnEveryRank) {
  const auto comm = test::world();
  for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2, Stage::Zero3}) {
    SCOPED_TRACE(stage_name(stage));
    const OptimizerOptions o = options_of(Config{stage, DType::BF16, 0.0});
    Harness mixed(o, unit_model(), comm, mixed_groups());
    Harness lion(o, unit_model(), comm, {lion_group(1.0), lion_group()});
    Harness adamw(o, unit_model(), comm);
    const std::size_t owned = mixed.opt->local_size();
    EXPECT_EQ(adamw.opt->memory_report()[MemCategory::Moments], 8 * owned);
    EXPECT_EQ(lion.opt->memory_report()[MemCategory::Moments], 4 * owned);
    const std::size_t m = mixed.opt->memory_report()[MemCategory::Moments];
    EXPECT_GT(m, 4 * owned);
    EXPECT_LT(m, 8 * owned);
    // The planner, for this rank (mixed rules: the ranks' pieces differ).
    for (Harness* h : {&mixed, &lion, &adamw}) {
      PlanConfig pc = plan_config(h->opt->options(), comm->size());
      pc.groups = h->opt->groups();
      pc.rank = comm->rank();
      FlatLayout unbuilt;
      for (const ParamInfo& p : h->opt->layout().params()) unbuilt.add(p.name, p.numel, p.group, p.unit);
      const MemoryPlan plan = plan_memory(unbuilt, pc);
      const MemoryReport rep = h->opt->memory_report();
      for (MemCategory cat : {MemCategory::Params, MemCategory::Grads, MemCategory::Master,
                              MemCategory::Moments})
        EXPECT_EQ(plan[cat], rep[cat]) << "category " << static_cast<int>(cat) << " ("
                                        << (h == &mixed ? "mixed" : h == &lion ? "Lion" : "AdamW")
                                        << ")";
    }
  }
}

// Lion has no exp_avg_sq: get_state refuses it on every rank (naming the parameter and the
// rule), the local copy reads zeros there, and exp_avg is the momentum.
TEST(Rules, LionKeepsNoSecondMoment) {
  Harness h(options_of(Config{Stage::Zero1, DType::BF16, 0.0}), unit_model(), test::world(),
            mixed_groups());
  h.write_grads(1);
  h.opt->step();
  std::vector<float> out(h.model.sizes[1]);
  expect_status(Status::InvalidArgument,
                [&] { h.opt->get_state(StateArray::ExpAvgSq, 1, out); }, "exp_avg_sq of Lion",
                "'p1' is updated by Lion, which keeps no exp_avg_sq");
  EXPECT_NO_THROW(h.opt->get_state(StateArray::ExpAvg, 1, out));
  bool nonzero = false;
  for (float x : out) nonzero = nonzero || x != 0.0f;
  EXPECT_TRUE(nonzero);
  std::vector<float> local(h.opt->local_size());
  h.opt->copy_state_to_host(StateArray::ExpAvgSq, 0, local);
  for (const ShardPiece& p : h.opt->local_pieces())
    if (h.model.groups[p.param] == 1)
      for (std::size_t k = p.local.begin; k < p.local.end; ++k) ASSERT_EQ(local[k], 0.0f);
}

// A group's rule is fixed at finalize (its state is laid out for it); other options change.
TEST(Rules, RuleIsFixedAtFinalize) {
  ShardedOptimizer opt(test::world(), options_of(Config{Stage::Zero1, DType::BF16, 0.0}));
  const int g = opt.add_group(GroupOptions{});
  opt.set_group(g, lion_group());  // before finalize: allowed
  opt.add_param("w", 1000, g);
  opt.finalize();
  GroupOptions back = opt.groups()[1];
  EXPECT_EQ(back.rule, Rule::Lion);
  back.rule = Rule::AdamW;
  expect_status(Status::InvalidArgument, [&] { opt.set_group(g, back); }, "rule change",
                "group 1's rule is Lion");
  GroupOptions lr = opt.groups()[1];
  lr.lr_scale = 0.25;
  lr.lion.beta2 = 0.9;
  EXPECT_NO_THROW(opt.set_group(g, lr));
  GroupOptions bad = lion_group(1.0, 1.0);
  EXPECT_NE(validate(bad).find("invalid Lion betas"), std::string::npos) << validate(bad);
  expect_status(Status::InvalidArgument, [&] { opt.set_group(g, bad); }, "beta1 = 1");
  bad = lion_group();
  bad.rule = static_cast<Rule>(7);
  expect_status(Status::InvalidArgument, [&] { opt.set_group(g, bad); }, "unknown rule");
}

// Ranks that disagree on a rule fail together at finalize; on Lion's betas, at the step,
// which names the setting.
TEST(Rules, RanksThatDisagreeFailTogether) {
  auto comm = test::world();
  if (comm->size() == 1) GTEST_SKIP() << "needs at least 2 ranks";
  const bool last = comm->rank() == comm->size() - 1;
  {
    ShardedOptimizer opt(comm, options_of(Config{Stage::Zero1, DType::BF16, 0.0}));
    opt.add_group(last ? lion_group() : GroupOptions{});
    opt.add_param("w", 1000, 1);
    expect_status(Status::LayoutMismatch, [&] { opt.finalize(); }, "rules differ");
  }
  Harness h(options_of(Config{Stage::Zero1, DType::BF16, 0.0}), unit_model(), comm,
            mixed_groups());
  if (last) h.opt->set_group(1, lion_group(0.5, 0.8));
  h.write_grads(1);
  expect_status(Status::InvalidArgument, [&] { h.opt->step(); }, "betas differ",
                "group 1 lion.beta1 differs");
}

// ---- AdamW8bit -----------------------------------------------------------------------------------

namespace {

// The shapes: (6, 1024) and 5000 (a partial last block) keep 8-bit state, (3, 1024) and
// 300 fp32; 4096 sits exactly at the threshold (8-bit), 4095 just below it; 1000 in a second
// AdamW8bit group (lr 0.5x, no decay) is small too, and 9000 in it is 8-bit.
Model adamw8bit_model() {
  Model m;
  m.sizes = {6 * 1024, 3 * 1024, 5000, 300, 4096, 4095, 1000, 9000};
  m.groups = {0, 0, 0, 0, 0, 0, 1, 1};
  m.units = {0, 0, 1, 1, 2, 2, 3, 3};
  return m;
}
std::vector<GroupOptions> adamw8bit_groups() {
  GroupOptions a, b;
  a.rule = b.rule = Rule::AdamW8bit;
  b.lr_scale = 0.5;
  b.weight_decay = false;
  return {a, b};
}
bool is_8bit(std::size_t numel) { return numel >= 4096; }

// AdamW8bit in double precision, from the definition: dequantize (q[code] * scale),
// AdamW in double, the weight from the unquantized m and v, then requantize each block
// (scale = max |x|, floored at 1e-12; nearest code of x / scale, ties up). The maps are the
// shipped ones; everything else is double. Small parameters: AdamW in double.
struct RefAdamW8bit {
  std::vector<std::vector<double>> p, m, v;  // m, v: the dequantized state (8-bit) or fp32 state
  explicit RefAdamW8bit(const Harness& h) : p(h.ref.size()), m(h.ref.size()), v(h.ref.size()) {
    for (std::size_t i = 0; i < h.ref.size(); ++i) {
      p[i] = h.ref[i].p;
      m[i].assign(p[i].size(), 0.0);
      v[i].assign(p[i].size(), 0.0);
    }
  }
  static double requantize(const float* q, double x) {
    int best = 0;
    for (int c = 1; c < 256; ++c)  // nearest in double, ties to the larger code
      if (std::fabs(q[c] - x) <= std::fabs(q[best] - x)) best = c;
    return q[best];
  }
  void step(const Harness& h, const std::vector<std::vector<double>>& grads, std::int64_t t) {
    const AdamConfig& c = h.cfg;
    const double bc1 = 1 - std::pow(c.beta1, static_cast<double>(t));
    const double bc2 = 1 - std::pow(c.beta2, static_cast<double>(t));
    for (std::size_t i = 0; i < p.size(); ++i) {
      const GroupOptions& g = h.groups[static_cast<std::size_t>(h.model.groups[i])];
      const double lr = c.lr * g.lr_scale, wd = g.weight_decay ? c.weight_decay : 0.0;
      for (std::size_t k = 0; k < p[i].size(); ++k) {
        const double gr = grads[i][k];
        p[i][k] *= 1 - lr * wd;
        m[i][k] = c.beta1 * m[i][k] + (1 - c.beta1) * gr;
        v[i][k] = c.beta2 * v[i][k] + (1 - c.beta2) * gr * gr;
        p[i][k] -= lr / bc1 * m[i][k] / (std::sqrt(v[i][k]) / std::sqrt(bc2) + c.eps);
      }
      if (!is_8bit(p[i].size())) continue;
      for (std::size_t b = 0; b < p[i].size(); b += 256) {
        const std::size_t e = std::min(p[i].size(), b + 256);
        double sm = 0, sv = 0;
        for (std::size_t k = b; k < e; ++k) {
          sm = std::max(sm, std::fabs(m[i][k]));
          sv = std::max(sv, v[i][k]);
        }
        sm = std::max(sm, 1e-12);
        sv = std::max(sv, 1e-12);
        for (std::size_t k = b; k < e; ++k) {
          m[i][k] = requantize(rules::q8::signed_map().value, m[i][k] / sm) * sm;
          v[i][k] = requantize(rules::q8::unsigned_map().value, v[i][k] / sv) * sv;
        }
      }
    }
  }
};

// The average of every rank's grad_value gradients of one step (exactly summable).
std::vector<std::vector<double>> average_grads(const Harness& h, int step) {
  const int world = h.opt->comm().size();
  std::vector<std::vector<double>> avg(h.model.sizes.size());
  for (std::size_t i = 0; i < avg.size(); ++i) {
    avg[i].assign(h.model.sizes[i], 0.0);
    for (std::size_t k = 0; k < avg[i].size(); ++k) {
      for (int r = 0; r < world; ++r) avg[i][k] += test::grad_value(r, step, i, k);
      avg[i][k] /= world;
    }
  }
  return avg;
}

}  // namespace

// Ten steps against the double-precision model: the weights follow it within the
// quantization's effect, and the 8-bit moments are its dequantized moments up to a code step.
TEST(AdamW8bit, FollowsTheDoublePrecisionModel) {
  Harness h(options_of(Config{Stage::Zero2, DType::F32, 0.0}), adamw8bit_model(), test::world(),
            adamw8bit_groups());
  RefAdamW8bit ref(h);
  for (int step = 1; step <= 10; ++step) {
    h.write_grads(step);
    h.opt->step();
    ref.step(h, average_grads(h, step), step);
  }
  for (std::size_t i = 0; i < h.model.sizes.size(); ++i) {
    SCOPED_TRACE("p" + std::to_string(i) + " (" + std::to_string(h.model.sizes[i]) + ")");
    EXPECT_EQ(h.opt->rule_of(i), is_8bit(h.model.sizes[i]) ? Rule::AdamW8bit : Rule::AdamW);
    std::vector<float> p(h.model.sizes[i]), m(p.size());
    h.opt->get_master(i, p);
    h.opt->get_state(StateArray::ExpAvg, i, m);
    // Errors of m relative to its block's scale (the largest |m| of the 256 elements).
    double worst_p = 0, worst_m = 0, sum_p = 0;
    for (std::size_t b = 0; b < p.size(); b += 256) {
      const std::size_t e = std::min(p.size(), b + 256);
      double scale = 1e-12;
      for (std::size_t k = b; k < e; ++k) scale = std::max(scale, std::fabs(ref.m[i][k]));
      for (std::size_t k = b; k < e; ++k) {
        const double ep = std::fabs(p[k] - ref.p[i][k]);
        worst_p = std::max(worst_p, ep);
        sum_p += ep;
        worst_m = std::max(worst_m, std::fabs(m[k] - ref.m[i][k]) / scale);
      }
    }
    if (is_8bit(p.size())) {
      // Neighbouring codes of the signed map are at most 0.9 / 64 of the scale apart: the fp32
      // and double paths may land an element one code apart (0.014), rarely two. An element
      // one code apart changes its update by a fraction of lr: ten steps of lr 1e-2 stay
      // below 1e-2 per element and far below on average.
      EXPECT_LT(worst_m, 0.03);
      EXPECT_LT(worst_p, 1e-2);
      EXPECT_LT(sum_p / static_cast<double>(p.size()), 2e-4);
    } else {
      EXPECT_LT(worst_m, 1e-5);
      EXPECT_LT(worst_p, 1e-5);
    }
  }
}

// 20 steps at every stage and two bucket sizes give the bits of one process that accumulates
// all ranks' gradients: the 8-bit state (codes and scales, read back dequantized) never
// depends on the number of ranks, the stage or the bucket size, nor does the choice of 8-bit
// or fp32 (the global size decides it).
TEST(AdamW8bit, StateIsTheSameBitsAtEveryRankCountStageAndBucketSize) {
  const int world = test::world_size();
  Harness single(options_of(Config{Stage::Zero1, DType::BF16, 0.0}), adamw8bit_model(),
                 make_single_process_communicator(), adamw8bit_groups());
  train_as_one_process(single, 20);
  for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2, Stage::Zero3})
    for (std::size_t bucket : {std::size_t{300}, std::size_t{7000}}) {
      SCOPED_TRACE(std::string(stage_name(stage)) + " bucket " + std::to_string(bucket));
      Harness h(options_of(Config{stage, DType::BF16, 0.0}, bucket), adamw8bit_model(),
                test::world(), adamw8bit_groups());
      EXPECT_EQ(h.opt->layout().align_elems(), FlatLayout::kQuantBlockElems);
      for (const ParamInfo& p : h.opt->layout().params()) EXPECT_EQ(p.flat.begin % 256, 0u);
      for (const Bucket& b : h.opt->layout().buckets()) EXPECT_EQ(b.slice_elems % 256, 0u);
      for (int step = 1; step <= 20; ++step) {
        if (stage == Stage::Zero3)
          h.write_grads(step, -1, test::grad_value, test::backward_units(*h.opt));
        else
          h.write_grads(step);
        h.opt->step();
      }
      for (std::size_t i = 0; i < h.model.sizes.size(); ++i) {
        EXPECT_EQ(h.opt->rule_of(i), single.opt->rule_of(i));
        for (StateArray a : {StateArray::Master, StateArray::ExpAvg, StateArray::ExpAvgSq}) {
          std::vector<float> x(h.model.sizes[i]), y(h.model.sizes[i]);
          h.opt->get_state(a, i, x);
          single.opt->get_state(a, i, y);
          ASSERT_EQ(std::memcmp(x.data(), y.data(), x.size() * sizeof(float)), 0)
              << "p" << i << " array " << static_cast<int>(a);
        }
      }
      // The memory each rank holds is the planner's for this rank.
      PlanConfig pc = plan_config(h.opt->options(), world);
      pc.groups = h.opt->groups();
      pc.rank = h.opt->comm().rank();
      FlatLayout unbuilt;
      for (const ParamInfo& p : h.opt->layout().params()) unbuilt.add(p.name, p.numel, p.group, p.unit);
      const MemoryPlan plan = plan_memory(unbuilt, pc);
      for (MemCategory cat : {MemCategory::Params, MemCategory::Master, MemCategory::Moments})
        EXPECT_EQ(plan[cat], h.opt->memory_report()[cat]) << "category " << static_cast<int>(cat);
    }
}

// Reproducible reduction: gradients that are not exactly summable (their sum depends on the
// order in floating point) still give the same 8-bit state at every rank count, stage and
// bucket size: the raw codes and scales of a one-process run that computes every rank's
// micro-batch itself.
float inexact_value(int rank, int step, std::size_t param, std::size_t k) {
  return test::synth(static_cast<std::uint64_t>(rank) + 101, static_cast<std::uint64_t>(step), param, k) *
             0.3f + 1e-7f * static_cast<float>(k % 13);
}

// One micro-batch of the rank `played`: each gradient written (a fresh micro-batch's buffer),
// in backward order.
void micro_batch(ShardedOptimizer& opt, int played, int step) {
  opt.begin_backward(false);
  for (std::size_t i = opt.layout().num_params(); i-- > 0;) {
    std::span<float> g = opt.grad(i);
    for (std::size_t k = 0; k < g.size(); ++k) g[k] = inexact_value(played, step, i, k);
    opt.grad_ready(i);
  }
}

TEST(AdamW8bit, ReproducibleModeGivesTheSameBitsForAnyGradients) {
  const int world = test::world_size();
  auto reproducible = [](Stage stage, std::size_t bucket) {
    OptimizerOptions o = options_of(Config{stage, DType::BF16, 1.0}, bucket);
    o.reduction = Reduction::Reproducible;
    return o;
  };
  Harness single(reproducible(Stage::Zero1, 7000), adamw8bit_model(),
                 make_single_process_communicator(), adamw8bit_groups());
  for (int step = 1; step <= 20; ++step) {
    for (int r = 0; r < world; ++r) micro_batch(*single.opt, r, step);
    single.opt->step();
  }
  const test::FullState want = test::gather_state(*single.opt);
  ASSERT_FALSE(want.codes[0].empty());
  for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2})
    for (std::size_t bucket : {std::size_t{300}, std::size_t{7000}}) {
      SCOPED_TRACE(std::string(stage_name(stage)) + " bucket " + std::to_string(bucket));
      Harness h(reproducible(stage, bucket), adamw8bit_model(), test::world(), adamw8bit_groups());
      for (int step = 1; step <= 20; ++step) {
        micro_batch(*h.opt, h.opt->comm().rank(), step);
        h.opt->step();
      }
      EXPECT_TRUE(test::gather_state(*h.opt) == want);
    }
}

// A checkpoint holds the 8-bit state itself (codes and block scales): training saved after 10
// steps and resumed in another stage with other buckets gives the bits of training that never
// stopped (raw codes and scales compared), at every rank count.
TEST(AdamW8bit, CheckpointResumesOnTheSameBits) {
  auto run = [](Stage stage, std::size_t bucket) {
    return Harness(options_of(Config{stage, DType::BF16, 0.0}, bucket), adamw8bit_model(),
                   test::world(), adamw8bit_groups());
  };
  auto world = test::world();
  const test::SharedDir dir(*world);
  Harness a = run(Stage::Zero1, 7000);
  for (int step = 1; step <= 10; ++step) {
    a.write_grads(step);
    a.opt->step();
  }
  save_checkpoint(*a.opt, dir.path());
  const test::FullState saved = test::gather_state(*a.opt);
  for (int step = 11; step <= 20; ++step) {
    a.write_grads(step);
    a.opt->step();
  }
  const test::FullState want = test::gather_state(*a.opt);
  ASSERT_FALSE(want.codes[0].empty());
  for (Stage stage : {Stage::DataParallel, Stage::Zero2}) {
    SCOPED_TRACE(stage_name(stage));
    Harness b = run(stage, 300);
    load_checkpoint(*b.opt, dir.path());
    EXPECT_TRUE(test::gather_state(*b.opt) == saved);
    for (int step = 11; step <= 20; ++step) {
      b.write_grads(step);
      b.opt->step();
    }
    // (The padding of a partial block must come back as zeros, or its scale drifts: the
    // 5000-element parameter's last block caught that.)
    const test::FullState got = test::gather_state(*b.opt);
    EXPECT_TRUE(got == want);
  }
}
