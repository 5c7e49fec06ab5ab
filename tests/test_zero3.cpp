// test_zero3.cpp: stage 3 (parameters sharded, gathered per unit) against stage 2 on the same
// layout, bit for bit with exactly summable gradients (also with accumulation, clipping,
// loss scaling, a bf16 reduction wire and a NaN on one rank); the unit pool's errors; and
// memory accounting against the planner. Runs at 1 rank without MPI and at 1-4 under mpiexec.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "shardopt/optimizer.hpp"
#include "shardopt/planner.hpp"
#include "support/harness.hpp"
#include "support/zero3.hpp"
#include "support/world.hpp"

using namespace shardopt;
using shardopt::test::Harness;
using shardopt::test::Model;
using shardopt::test::backward_units;
using shardopt::test::expect_same_state;

namespace {

// The harness model in four units: {p0 p1} {p2 p3} {p4 p5 p6} {p7}. p3 (5000 elements)
// spans several buckets, so its grad() view goes through stage 3's spill buffer.
Model unit_model() {
  Model m = test::make_model();
  m.units = {0, 0, 1, 1, 2, 2, 2, 3};
  return m;
}

void expect_status(Status want, const std::function<void()>& f, const char* what) {
  try {
    f();
    ADD_FAILURE() << what << ": no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), want) << what << ": " << e.what();
  }
}

struct Case {
  const char* name;
  DType dtype = DType::BF16;
  bool overlap = true;
  int micro_batches = 1;
  double max_grad_norm = 0.0;
  bool nan_at_step_2 = false;
  DType wire = DType::F32;
  bool loss_scaling = false;
};

OptimizerOptions options_for(const Case& c, Stage stage) {
  OptimizerOptions o;
  o.stage = stage;
  o.param_dtype = c.dtype;
  o.overlap = c.overlap;
  o.adam.lr = 5e-3;
  o.adam.max_grad_norm = c.max_grad_norm;
  o.bucket_elems = 700;
  o.reduce_dtype = c.wire;
  o.loss_scaling.enabled = c.loss_scaling;
  o.loss_scaling.initial_scale = 1024.0;
  o.loss_scaling.growth_interval = 2;
  return o;
}

// Forward over the stage-3 optimizer as a trainer runs it: acquire unit u, prefetch u + 1,
// read u's parameters, release u. Every view equals stage 2's replica bit for bit.
void forward_matches(ShardedOptimizer& z2, ShardedOptimizer& z3, const char* where) {
  const FlatLayout& l = z3.layout();
  const std::size_t units = l.num_units();
  const std::size_t elem = dtype_size(z3.options().param_dtype);
  z3.acquire(0);
  for (std::size_t u = 0; u < units; ++u) {
    if (u + 1 < units) z3.prefetch(u + 1);
    for (std::size_t i = l.unit(u).params.begin; i < l.unit(u).params.end; ++i) {
      const void* a = nullptr;
      const void* b = nullptr;
      if (z3.options().param_dtype == DType::BF16) {
        a = z2.param<bf16>(i).data();
        b = z3.param<bf16>(i).data();
      } else {
        a = z2.param<float>(i).data();
        b = z3.param<float>(i).data();
      }
      ASSERT_EQ(std::memcmp(a, b, l.param(i).numel * elem), 0) << where << ": p" << i;
    }
    z3.release(u);
    if (u + 1 < units) z3.acquire(u + 1);
  }
}

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class Zero3VsZero2 : public testing::TestWithParam<Case> {};

TEST_P(Zero3VsZero2, SameBits) {
  const Case& c = GetParam();
  Harness z2(options_for(c, Stage::Zero2), unit_model());
  Harness z3(options_for(c, Stage::Zero3), unit_model());
  ASSERT_EQ(z2.opt->layout().fingerprint(), z3.opt->layout().fingerprint());
  const int world = z3.opt->comm().size();
  bool clipped = false, skipped = false;
  for (int step = 1; step <= 4; ++step) {
    forward_matches(*z2.opt, *z3.opt, "forward");
    const int poison = c.nan_at_step_2 && step == 2 ? world - 1 : -1;
    for (int mb = 0; mb < c.micro_batches; ++mb) {
      const bool last = mb + 1 == c.micro_batches;
      z2.opt->begin_backward(last);
      z3.opt->begin_backward(last);
      z2.write_grads(step * 10 + mb, poison);
      z3.write_grads(step * 10 + mb, poison, test::grad_value, backward_units(*z3.opt));
    }
    const StepResult r2 = z2.opt->step();
    const StepResult r3 = z3.opt->step();
    EXPECT_EQ(std::memcmp(&r2.grad_norm, &r3.grad_norm, sizeof(double)), 0)
        << "step " << step << ": " << r2.grad_norm << " vs " << r3.grad_norm;
    EXPECT_EQ(r2.skipped, r3.skipped) << "step " << step;
    EXPECT_EQ(r2.clipped, r3.clipped) << "step " << step;
    EXPECT_EQ(r2.loss_scale, r3.loss_scale) << "step " << step;
    clipped = clipped || r3.clipped;
    skipped = skipped || r3.skipped;
    expect_same_state(*z2.opt, *z3.opt, "after step");
  }
  forward_matches(*z2.opt, *z3.opt, "final");
  EXPECT_EQ(clipped, c.max_grad_norm > 0);
  EXPECT_EQ(skipped, c.nan_at_step_2);
  // Stage 3 never allocates a full-size gradient: accounting (peak included) is the plan's.
  const MemoryPlan plan = plan_memory(z3.opt->layout(), plan_config(z3.opt->options(), world));
  const MemoryReport m = z3.opt->memory_report();
  for (int k = 0; k < kNumMemCategories; ++k) {
    if (static_cast<MemCategory>(k) == MemCategory::Scratch && world > 1) {
      // Plus the spill buffer of p3's grad() view (on demand, as in stage 2).
      PlanConfig with_spill = plan_config(z3.opt->options(), world);
      with_spill.grad_views_across_buckets = true;
      EXPECT_EQ(m.peak[k], plan_memory(z3.opt->layout(), with_spill).bytes[k]);
    } else {
      EXPECT_EQ(m.peak[k], plan.bytes[k]) << mem_category_name(static_cast<MemCategory>(k));
    }
  }
}

std::string case_name(const testing::TestParamInfo<Case>& info) { return info.param.name; }

INSTANTIATE_TEST_SUITE_P(
    Stages, Zero3VsZero2,
    testing::Values(Case{"bf16"}, Case{"fp32", DType::F32},
                    Case{"no_overlap", DType::BF16, false},
                    Case{"accumulate", DType::BF16, true, 3},
                    Case{"accumulate_fp32_no_overlap", DType::F32, false, 2},
                    Case{"clip", DType::BF16, true, 1, 0.05},
                    Case{"clip_accumulate", DType::F32, true, 2, 0.05},
                    Case{"nan_on_last_rank", DType::BF16, true, 1, 0.0, true},
                    Case{"nan_accumulate", DType::BF16, true, 2, 0.0, true},
                    Case{"bf16_wire", DType::BF16, true, 1, 0.0, false, DType::BF16},
                    Case{"loss_scaling", DType::BF16, true, 2, 0.0, true, DType::F32, true}),
    case_name);

TEST(Zero3, UnitPoolErrorsAreClearAndLoseNothing) {
  OptimizerOptions o = options_for(Case{"errors"}, Stage::Zero3);
  o.units_in_flight = 2;
  Harness h(o, unit_model());
  ShardedOptimizer& opt = *h.opt;
  expect_status(Status::InvalidState, [&] { opt.begin_unit(); }, "begin_unit after finalize");
  expect_status(Status::InvalidState, [&] { opt.param<bf16>(0); }, "param of unacquired unit");
  expect_status(Status::InvalidState, [&] { opt.release(0); }, "release unacquired");
  expect_status(Status::InvalidArgument, [&] { opt.acquire(4); }, "unit out of range");
  opt.acquire(0);
  expect_status(Status::InvalidState, [&] { opt.acquire(0); }, "acquire twice");
  opt.prefetch(0);  // held already: nothing to do
  opt.prefetch(1);
  expect_status(Status::InvalidState, [&] { opt.release(1); }, "release prefetched only");
  expect_status(Status::InvalidState, [&] { opt.acquire(2); }, "pool exhausted");
  expect_status(Status::InvalidState, [&] { opt.prefetch(3); }, "pool exhausted (prefetch)");
  expect_status(Status::InvalidState, [&] { opt.param<bf16>(2); }, "param while prefetched");
  expect_status(Status::InvalidState, [&] { opt.step(); }, "step with units held");
  // Nothing was lost: the views are intact and the pool works on.
  std::vector<float> master(h.model.sizes[0]);
  opt.get_master(0, master);
  for (std::size_t k = 0; k < master.size(); ++k)
    ASSERT_EQ(opt.param<bf16>(0)[k].bits, to_bf16(master[k]).bits);
  opt.acquire(1);
  opt.release(0);
  opt.release(1);
  expect_status(Status::InvalidState, [&] { opt.release(1); }, "release twice");
  h.write_grads(1);
  EXPECT_FALSE(opt.step().skipped);
  EXPECT_EQ(opt.step_count(), 1);

  Harness z2(options_for(Case{"stage2"}, Stage::Zero2), unit_model());
  expect_status(Status::InvalidState, [&] { z2.opt->acquire(0); }, "acquire at stage 2");
  expect_status(Status::InvalidState, [&] { z2.opt->prefetch(0); }, "prefetch at stage 2");
  expect_status(Status::InvalidState, [&] { z2.opt->release(0); }, "release at stage 2");
}

TEST(Zero3, UnitsCloseBuckets) {
  Harness h(options_for(Case{"layout"}, Stage::Zero3), unit_model());
  const FlatLayout& l = h.opt->layout();
  ASSERT_EQ(l.num_units(), 4u);
  std::size_t covered = 0;
  for (std::size_t u = 0; u < l.num_units(); ++u) {
    const Unit& unit = l.unit(u);
    EXPECT_EQ(l.bucket(unit.buckets.end - 1).flat.begin, unit.flat.begin);
    EXPECT_EQ(l.bucket(unit.buckets.begin).flat.end, unit.flat.end);
    for (std::size_t b = unit.buckets.begin; b < unit.buckets.end; ++b)
      for (std::size_t i = l.bucket(b).first_param; i < l.bucket(b).end_param; ++i)
        EXPECT_EQ(l.param(i).unit, static_cast<int>(u)) << "bucket " << b;
    covered += unit.flat.size();
  }
  EXPECT_EQ(covered, l.padded_size());
  // Units are part of the layout fingerprint: ranks must agree on them.
  FlatLayout a, b;
  a.add("x", 10, 0, 0);
  a.add("y", 10, 0, 0);
  b.add("x", 10, 0, 0);
  b.add("y", 10, 0, 1);
  a.build(1, 700);
  b.build(1, 700);
  EXPECT_NE(a.fingerprint(), b.fingerprint());
  EXPECT_EQ(a.num_buckets(), 1u);
  EXPECT_EQ(b.num_buckets(), 2u);
}

TEST(Zero3, BeginUnitReusesAnEmptyUnit) {
  ShardedOptimizer opt(test::world(), options_for(Case{"units"}, Stage::Zero3));
  EXPECT_EQ(opt.begin_unit(), 0);
  opt.add_param("a", 100);
  EXPECT_EQ(opt.begin_unit(), 1);
  EXPECT_EQ(opt.begin_unit(), 1);
  opt.add_param("b", 100);
  opt.finalize();
  EXPECT_EQ(opt.layout().num_units(), 2u);
  EXPECT_EQ(opt.layout().param(1).unit, 1);
}

TEST(Zero3, AccountingEqualsPlannerAndParamsFallAsOneOverN) {
  Harness h(options_for(Case{"memory"}, Stage::Zero3), unit_model());
  const int world = h.opt->comm().size();
  const FlatLayout& l = h.opt->layout();
  const MemoryPlan plan = plan_memory(l, plan_config(h.opt->options(), world));
  const MemoryReport m = h.opt->memory_report();
  for (int k = 0; k < kNumMemCategories; ++k)
    EXPECT_EQ(m.bytes[k], plan.bytes[k]) << mem_category_name(static_cast<MemCategory>(k));
  // Params: this rank's slices plus units_in_flight buffers of the largest unit.
  EXPECT_EQ(m[MemCategory::Params],
            2 * l.shard_size() + 2 * l.max_unit_elems() * h.opt->options().units_in_flight);
  EXPECT_EQ(m[MemCategory::Grads], 4 * l.shard_size());
  EXPECT_EQ(m[MemCategory::Master], 4 * l.shard_size());
  EXPECT_EQ(m[MemCategory::Moments], 8 * l.shard_size());
}

}  // namespace
