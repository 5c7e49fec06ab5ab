// test_loss_scaling.cpp: dynamic loss scaling (fp16 training): unscaling is exact and free,
// the norm is reported unscaled, a NaN/Inf on any one rank skips the step on every rank,
// backs the scale off and is counted; growth after growth_interval good steps.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "support/ckpt_model.hpp"
#include "support/world.hpp"

using namespace shardopt;

namespace {

LossScaling scaling(double initial, int interval) {
  LossScaling s;
  s.enabled = true;
  s.initial_scale = initial;
  s.growth_interval = interval;
  return s;
}

// Rank-dependent gradients (multiples of 2^-10) times `scale`; `poison_rank` puts an Inf in.
StepResult step_with(ShardedOptimizer& opt, int step, double scale, int poison_rank = -1) {
  const int rank = opt.comm().rank();
  const auto& sizes = test::ckpt_sizes();
  for (std::size_t i = sizes.size(); i-- > 0;) {
    std::span<float> g = opt.grad(i);
    for (std::size_t k = 0; k < g.size(); ++k)
      g[k] = static_cast<float>(std::round(test::synth(static_cast<std::uint64_t>(rank), static_cast<std::uint64_t>(step), i, k) * 1024.0f) / 1024.0f * scale);
    if (rank == poison_rank && i == 2) g[5] = std::numeric_limits<float>::infinity();
    opt.grad_ready(i);
  }
  return opt.step();
}

}  // namespace

TEST(LossScaling, ScaledGradientsGiveTheUnscaledUpdateBitForBit) {
  auto comm = test::world();
  for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2}) {
    test::CkptSetup plain{stage, DType::BF16, {}};
    test::CkptSetup scaled{stage, DType::BF16, scaling(1024.0, 1000)};
    auto a = test::make_ckpt_optimizer(comm, plain);
    auto b = test::make_ckpt_optimizer(comm, scaled);
    EXPECT_EQ(a->loss_scale(), 1.0);
    EXPECT_EQ(b->loss_scale(), 1024.0);
    for (int s = 1; s <= 3; ++s) {
      const StepResult ra = step_with(*a, s, 1.0);
      const StepResult rb = step_with(*b, s, b->loss_scale());
      EXPECT_EQ(ra.grad_norm, rb.grad_norm) << "the norm is reported unscaled";
      EXPECT_EQ(rb.loss_scale, 1024.0);
    }
    EXPECT_TRUE(test::gather_state(*a) == test::gather_state(*b)) << stage_name(stage);
  }
}

TEST(LossScaling, ClippingUsesTheUnscaledNorm) {
  auto comm = test::world();
  test::CkptSetup plain{Stage::Zero1, DType::BF16, {}};
  test::CkptSetup scaled{Stage::Zero1, DType::BF16, scaling(4096.0, 1000)};
  auto a = test::make_ckpt_optimizer(comm, plain);
  auto b = test::make_ckpt_optimizer(comm, scaled);
  for (ShardedOptimizer* o : {a.get(), b.get()}) {
    AdamConfig c = o->options().adam;
    c.max_grad_norm = 0.5;
    o->set_adam_config(c);
  }
  const StepResult ra = step_with(*a, 1, 1.0);
  const StepResult rb = step_with(*b, 1, 4096.0);
  EXPECT_TRUE(ra.clipped);
  EXPECT_TRUE(rb.clipped);
  EXPECT_EQ(ra.clip_coef, rb.clip_coef);
  EXPECT_TRUE(test::gather_state(*a) == test::gather_state(*b));
}

TEST(LossScaling, InfOnOneRankSkipsEverywhereBacksOffAndGrows) {
  auto comm = test::world();
  const int last = comm->size() - 1;
  LossScaling ls = scaling(1024.0, 2);
  ls.min_scale = 256.0;
  auto opt = test::make_ckpt_optimizer(comm, {Stage::Zero2, DType::BF16, ls});
  StepResult r = step_with(*opt, 1, opt->loss_scale());
  EXPECT_FALSE(r.skipped);
  const test::FullState good = test::gather_state(*opt);

  // Only the last rank's gradient overflows; every rank skips and backs off.
  r = step_with(*opt, 2, opt->loss_scale(), last);
  EXPECT_TRUE(r.skipped);
  EXPECT_EQ(r.skipped_steps, 1);
  EXPECT_EQ(r.loss_scale, 512.0);
  EXPECT_EQ(r.step, 1);
  EXPECT_TRUE(test::gather_state(*opt) == good) << "a skipped step changes nothing";
  r = step_with(*opt, 3, opt->loss_scale(), last);
  r = step_with(*opt, 4, opt->loss_scale(), last);
  EXPECT_EQ(r.loss_scale, 256.0) << "never below min_scale";
  EXPECT_EQ(opt->loss_scale_state().skipped_steps, 3);

  // Two good steps in a row: the scale doubles; the good-step counter restarts.
  step_with(*opt, 5, opt->loss_scale());
  EXPECT_EQ(opt->loss_scale(), 256.0);
  r = step_with(*opt, 6, opt->loss_scale());
  EXPECT_EQ(r.loss_scale, 512.0);
  EXPECT_EQ(r.step, 3);
  EXPECT_EQ(opt->loss_scale_state().good_steps, 0);

  // Every rank holds the same scale and counters.
  double mine[2] = {opt->loss_scale(), static_cast<double>(opt->loss_scale_state().skipped_steps)};
  std::vector<double> all(2 * static_cast<std::size_t>(comm->size()));
  comm->all_gather_bytes(mine, all.data(), sizeof mine);
  for (int k = 0; k < comm->size(); ++k) {
    EXPECT_EQ(all[2 * static_cast<std::size_t>(k)], mine[0]);
    EXPECT_EQ(all[2 * static_cast<std::size_t>(k) + 1], mine[1]);
  }
}

TEST(LossScaling, SkippedStepsAreCountedWithoutLossScalingToo) {
  auto opt = test::make_ckpt_optimizer(test::world(), {});
  const StepResult r = step_with(*opt, 1, 1.0, 0);
  EXPECT_TRUE(r.skipped);
  EXPECT_EQ(r.skipped_steps, 1);
  EXPECT_EQ(r.loss_scale, 1.0);
}

TEST(LossScaling, InvalidOptionsFailOnEveryRank) {
  auto comm = test::world();
  const int last = comm->size() - 1;
  auto bad = [](auto mutate) {
    OptimizerOptions o;
    o.loss_scaling.enabled = true;
    mutate(o.loss_scaling);
    return o;
  };
  const OptimizerOptions cases[] = {
      bad([](LossScaling& s) { s.initial_scale = 0; }),
      bad([](LossScaling& s) { s.growth_interval = 0; }),
      bad([](LossScaling& s) { s.backoff_factor = 1.0; }),
      bad([](LossScaling& s) { s.growth_factor = 0.5; }),
      bad([](LossScaling& s) { s.min_scale = 1e9; }),
      bad([](LossScaling& s) { s.max_scale = std::nan(""); })};
  for (OptimizerOptions o : cases) {
    // Only the last rank is misconfigured: everyone throws, nobody hangs; and the options are
    // checked while loss scaling is off too (issue 27), with a message that says so.
    EXPECT_THROW(ShardedOptimizer(comm, comm->rank() == last ? o : OptimizerOptions{}), Error);
    o.loss_scaling.enabled = false;
    try {
      ShardedOptimizer(comm, comm->rank() == last ? o : OptimizerOptions{});
      ADD_FAILURE() << "invalid loss-scaling options accepted while loss scaling is off";
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), comm->rank() == last ? Status::InvalidArgument : e.status());
      EXPECT_NE(std::string(e.what()).find("(checked although loss scaling is off)"),
                std::string::npos) << e.what();
    }
  }
  // The defaults are valid, on and off.
  EXPECT_EQ(validate(LossScaling{}), "");
  LossScaling on;
  on.enabled = true;
  EXPECT_EQ(validate(on), "");
  ShardedOptimizer ok(comm, OptimizerOptions{});
  EXPECT_THROW(ok.set_loss_scale_state(LossScaleState{2.0, 0, 0}), Error);  // scaling is off
}
