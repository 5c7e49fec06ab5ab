// test_overlap.cpp: bucketed, overlapped reduction and gathering, gradient accumulation and
// the bf16 wire, at whatever rank count the binary runs with; and the order gradients may
// arrive in at each stage (docs/c_api.md, "Gradient order").
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <cmath>
#include <string>
#include <vector>

#include "shardopt/optimizer.hpp"
#include "shardopt/planner.hpp"
#include "support/harness.hpp"
#include "support/reference.hpp"
#include "support/world.hpp"

using namespace shardopt;
using shardopt::test::Harness;
using shardopt::test::kSizes;
using shardopt::test::synth;

namespace {

// Generic fp32 gradients whose sums over ranks DO round: equality of two paths then shows
// that they summed in the same order, not merely that the sums were exact.
float rounding_grad(int rank, int step, std::size_t param, std::size_t k) {
  return synth(static_cast<std::uint64_t>(rank) + 7, static_cast<std::uint64_t>(step), param, k) *
         (1.0f + static_cast<float>(k % 7) * 0.3f);
}

// Multiples of 1/16 in [-1, 1]: every partial sum over up to 4 ranks fits bf16 exactly.
float bf16_exact_grad(int rank, int step, std::size_t param, std::size_t k) {
  return std::round(synth(static_cast<std::uint64_t>(rank), static_cast<std::uint64_t>(step), param, k) * 16.0f) / 16.0f;
}

OptimizerOptions options(Stage stage, bool overlap, std::size_t bucket = 300) {
  OptimizerOptions o;
  o.stage = stage;
  o.overlap = overlap;
  o.bucket_elems = bucket;
  o.adam.lr = 1e-2;
  o.adam.max_grad_norm = 4.0;
  return o;
}

std::vector<std::vector<float>> masters(ShardedOptimizer& opt) {
  std::vector<std::vector<float>> out;
  for (std::size_t i = 0; i < opt.layout().num_params(); ++i) {
    out.emplace_back(opt.layout().param(i).numel);
    opt.get_master(i, out.back());
  }
  return out;
}

void expect_identical(ShardedOptimizer& a, ShardedOptimizer& b, const char* what) {
  const auto ma = masters(a), mb = masters(b);
  for (std::size_t i = 0; i < ma.size(); ++i)
    for (std::size_t k = 0; k < ma[i].size(); ++k)
      ASSERT_EQ(ma[i][k], mb[i][k]) << what << ": p" << i << "[" << k << "]";
  for (std::size_t i = 0; i < ma.size(); ++i) {
    auto pa = a.param<bf16>(i), pb = b.param<bf16>(i);
    for (std::size_t k = 0; k < pa.size(); ++k)
      ASSERT_EQ(pa[k].bits, pb[k].bits) << what << ": replica p" << i << "[" << k << "]";
  }
}

class OverlapByStage : public testing::TestWithParam<Stage> {};

}  // namespace

TEST_P(OverlapByStage, OverlappedStepEqualsPlainStepBitForBit) {
  Harness on(options(GetParam(), true)), off(options(GetParam(), false));
  for (int step = 1; step <= 3; ++step) {
    on.write_grads(step, -1, rounding_grad);
    off.write_grads(step, -1, rounding_grad);
    const StepResult a = on.opt->step(), b = off.opt->step();
    EXPECT_EQ(a.grad_norm, b.grad_norm);
    EXPECT_EQ(a.clipped, b.clipped);
  }
  expect_identical(*on.opt, *off.opt, "overlap on vs off");
}

TEST_P(OverlapByStage, AccumulatedMicroBatchesMatchTheReference) {
  for (bool overlap : {true, false}) {
    Harness h(options(GetParam(), overlap));
    for (int step = 1; step <= 2; ++step) {
      // Three micro-batches, only the last one synchronises.
      const std::vector<int> micro = {10 * step, 10 * step + 1, 10 * step + 2};
      for (std::size_t m = 0; m < micro.size(); ++m) {
        h.opt->begin_backward(m + 1 == micro.size());
        h.write_grads(micro[m]);
      }
      const StepResult r = h.opt->step();
      const test::RefResult rr = h.reference(micro);
      EXPECT_NEAR(r.grad_norm, rr.grad_norm, 1e-6 * rr.grad_norm);
      h.expect_matches_reference(overlap ? "accumulated, overlap" : "accumulated, no overlap");
    }
  }
}

TEST_P(OverlapByStage, AccumulationOverlappedEqualsPlain) {
  Harness on(options(GetParam(), true)), off(options(GetParam(), false));
  for (Harness* h : {&on, &off}) {
    for (int m = 0; m < 3; ++m) {
      h->opt->begin_backward(m == 2);
      h->write_grads(m + 1, -1, rounding_grad);
    }
    h->opt->step();
  }
  expect_identical(*on.opt, *off.opt, "accumulation, overlap on vs off");
}

TEST_P(OverlapByStage, Bf16WireIsExactWhenSumsFitBf16) {
  OptimizerOptions wide = options(GetParam(), true), narrow = wide;
  narrow.reduce_dtype = DType::BF16;
  Harness a(wide), b(narrow);
  for (int step = 1; step <= 2; ++step) {
    a.write_grads(step, -1, bf16_exact_grad);
    b.write_grads(step, -1, bf16_exact_grad);
    a.opt->step();
    b.opt->step();
  }
  expect_identical(*a.opt, *b.opt, "bf16 wire vs fp32 wire");
}

TEST_P(OverlapByStage, Bf16WireErrorIsBounded) {
  OptimizerOptions wide = options(GetParam(), true), narrow = wide;
  narrow.reduce_dtype = DType::BF16;
  narrow.adam.max_grad_norm = wide.adam.max_grad_norm = 0;
  Harness a(wide), b(narrow);
  a.write_grads(1, -1, rounding_grad);
  b.write_grads(1, -1, rounding_grad);
  const StepResult ra = a.opt->step(), rb = b.opt->step();
  // Each bf16 partial sum is rounded to 8 significant bits (relative 2^-9 per addition).
  EXPECT_NEAR(ra.grad_norm, rb.grad_norm, 1e-2 * ra.grad_norm);
  const auto ma = masters(*a.opt), mb = masters(*b.opt);
  double differ = 0, total = 0;
  for (std::size_t i = 0; i < ma.size(); ++i)
    for (std::size_t k = 0; k < ma[i].size(); ++k) {
      total += 1;
      differ += ma[i][k] != mb[i][k];
    }
  EXPECT_GT(differ, 0.0) << "rounding gradients must show the bf16 wire";
}

TEST_P(OverlapByStage, ReadyInAnyOrderWithinBackwardStillMatches) {
  if (GetParam() == Stage::Zero2) GTEST_SKIP() << "stage 2 requires backward order by design";
  // Ranks mark parameters ready in different orders; buckets still start in bucket order.
  Harness h(options(GetParam(), true, 200));
  const int rank = h.opt->comm().rank();
  std::vector<std::size_t> order(kSizes.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::rotate(order.begin(), order.begin() + rank % order.size(), order.end());
  for (std::size_t i : order) {
    std::span<float> g = h.opt->grad(i);
    for (std::size_t k = 0; k < g.size(); ++k) g[k] = test::grad_value(rank, 1, i, k);
    h.opt->grad_ready(i);
  }
  h.opt->step();
  h.reference(1);
  h.expect_matches_reference("ready in rotated order");
}

TEST_P(OverlapByStage, BeginBackwardAfterSyncIsRejected) {
  Harness h(options(GetParam(), true));
  h.opt->begin_backward(true);
  h.write_grads(1);
  try {
    h.opt->begin_backward(false);
    ADD_FAILURE() << "begin_backward after a synchronised micro-batch must fail";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::InvalidState);
  }
  h.opt->step();
  h.opt->begin_backward(false);  // a new step may begin
  h.opt->zero_grad();
}

INSTANTIATE_TEST_SUITE_P(AllStages, OverlapByStage,
                         testing::Values(Stage::DataParallel, Stage::Zero1, Stage::Zero2),
                         [](const testing::TestParamInfo<Stage>& i) {
                           return std::string(i.param == Stage::DataParallel ? "dp"
                                              : i.param == Stage::Zero1    ? "zero1"
                                                                           : "zero2");
                         });

// ---- the order gradients arrive in (docs/c_api.md, "Gradient order") --------------------------

namespace {

// Whether `opt` stages its gradients in bucket slots: stage 2 where that saves memory (more
// than one rank and more than a bucket or two), stage 3 on more than one rank.
bool staged(const ShardedOptimizer& opt) {
  return plan_memory(opt.layout(), plan_config(opt.options(), opt.comm().size())).staged;
}

// Harness's model, in the units of test_zero3 at stage 3 ({p0 p1} {p2 p3} {p4 p5 p6} {p7}).
test::Model order_model(Stage stage) {
  test::Model m = test::make_model();
  if (stage == Stage::Zero3) m.units = {0, 0, 1, 1, 2, 2, 2, 3};
  return m;
}

// 32 parameters of 64 elements in 4 units: each lies inside one bucket (buckets are whole
// multiples of N x 64 elements, parameters start 64-aligned), and there are enough buckets
// for stage 2 to stage its gradients at 2-4 ranks.
test::Model one_bucket_params_model() {
  test::Model m;
  m.sizes.assign(32, 64);
  for (std::size_t i = 0; i < m.sizes.size(); ++i) {
    m.groups.push_back(i % 3 == 1 ? 1 : 0);
    m.units.push_back(static_cast<int>(i / 8));
  }
  return m;
}

// Three steps with every gradient written in registration (forward) order on one optimizer
// and in backward order on another: the same masters and norms, bit for bit (rounding
// gradients, so equal means the same sums in the same order).
void expect_forward_equals_backward(const OptimizerOptions& o, const test::Model& m,
                                    const char* what) {
  Harness fwd(o, m), back(o, m);
  for (int step = 1; step <= 3; ++step) {
    for (std::size_t i = 0; i < m.sizes.size(); ++i) fwd.write_grad(i, step, -1, rounding_grad);
    back.write_grads(step, -1, rounding_grad);
    const StepResult a = fwd.opt->step(), b = back.opt->step();
    ASSERT_EQ(a.grad_norm, b.grad_norm) << what << ", step " << step;
  }
  const auto ma = masters(*fwd.opt), mb = masters(*back.opt);
  for (std::size_t i = 0; i < ma.size(); ++i)
    ASSERT_EQ(std::memcmp(ma[i].data(), mb[i].data(), ma[i].size() * sizeof(float)), 0)
        << what << ": p" << i;
}

class GradientOrder : public testing::TestWithParam<Stage> {};

}  // namespace

// Stages 0 and 1 (and stages 2 and 3 where they keep a full gradient buffer: one rank; stage
// 2 also for a model of a bucket or two) accept gradients in any order, forward included, with
// the same result bit for bit; overlap then only starts the buckets later. Where stages 2 and
// 3 stage gradients (more than one rank), forward order is refused at once, on every rank
// alike, with InvalidState naming the parameter and the rule (shown on parameters that each
// lie in one bucket; GradientOrderSpanning shows a parameter spanning buckets).
TEST_P(GradientOrder, ForwardOrderIsEqualUnlessStagedThenRefused) {
  const Stage stage = GetParam();
  const int world = test::world()->size();
  const bool expect_staged = (stage == Stage::Zero2 || stage == Stage::Zero3) && world > 1;
  for (bool overlap : {true, false}) {
    const OptimizerOptions o = options(stage, overlap);
    if (!expect_staged) {
      ASSERT_FALSE(staged(*Harness(o, order_model(stage)).opt));
      expect_forward_equals_backward(o, order_model(stage),
                                     overlap ? "forward order, overlap" : "forward order");
      continue;
    }
    Harness probe(o, one_bucket_params_model());
    ASSERT_TRUE(staged(*probe.opt)) << "the test needs a staged layout";
    std::string refused;
    try {
      for (std::size_t i = 0; i < probe.model.sizes.size(); ++i) probe.write_grad(i, 1);
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::InvalidState);
      refused = e.what();
    }
    EXPECT_NE(refused.find("its bucket was already reduced in this step; gradients must be "
                           "produced in backward order (reverse registration order)"),
              std::string::npos)
        << "forward order at a staged stage must be refused, got: '" << refused << "'";
  }
}

// A parameter spanning three buckets, the last of which it shares with another parameter: once
// it is marked ready its first two buckets are being reduced while the third waits, and
// writing it again is refused (grad() and accumulate_grad), not a write racing the reduction.
// The step then completes normally.
TEST(GradientOrderSpanning, AWriteIntoABucketBeingReducedIsRefused) {
  const std::size_t n = static_cast<std::size_t>(test::world()->size());
  for (Stage stage : {Stage::DataParallel, Stage::Zero1}) {
    ShardedOptimizer opt(test::world(), options(stage, true, 128 * n));
    opt.add_param("r", 32);
    opt.add_param("p", 256 * n);
    opt.finalize();
    const ParamInfo& p = opt.layout().param(1);
    ASSERT_EQ(p.buckets.size(), 3u);
    ASSERT_EQ(opt.layout().param(0).buckets.begin, p.buckets.end - 1);
    for (float& g : opt.grad(1)) g = 0.5f;
    opt.grad_ready(1);  // its first two buckets (backward order) start
    for (int attempt = 0; attempt < 2; ++attempt) {
      try {
        if (attempt == 0) opt.grad(1);
        else opt.accumulate_grad(1, std::vector<float>(p.numel, 1.0f));
        ADD_FAILURE() << "a write into a bucket being reduced was accepted (" << attempt << ")";
      } catch (const Error& e) {
        EXPECT_EQ(e.status(), Status::InvalidState);
        EXPECT_NE(std::string(e.what()).find("already reduced"), std::string::npos) << e.what();
      }
    }
    for (float& g : opt.grad(0)) g = 0.25f;
    opt.grad_ready(0);
    const StepResult r = opt.step();
    EXPECT_FALSE(r.skipped);
    // Every rank wrote 0.5 into p and 0.25 into r: the mean gradient is that.
    const double expect = std::sqrt(32 * 0.0625 + static_cast<double>(p.numel) * 0.25);
    EXPECT_NEAR(r.grad_norm, expect, 1e-6 * expect);
  }
}

// The case issue 27 met: a model that fits in one bucket (the fixed 2^20 elements of earlier
// releases; the automatic size gives small models several) is never staged at stage 2, so
// forward order works there at any rank count, bit for bit.
TEST(GradientOrderOneBucket, Stage2AcceptsForwardOrderBitForBit) {
  const OptimizerOptions o = options(Stage::Zero2, true, std::size_t{1} << 20);
  Harness probe(o);
  ASSERT_EQ(probe.opt->layout().num_buckets(), 1u);
  ASSERT_FALSE(staged(*probe.opt));
  expect_forward_equals_backward(o, test::make_model(), "one bucket, stage 2");
}

// Reproducible reduction keeps a full gradient at every stage and reduces at the step: any
// order at stages 2 and 3 and any rank count, bit for bit.
TEST(GradientOrderReproducible, Stages2And3AcceptForwardOrderBitForBit) {
  for (Stage stage : {Stage::Zero2, Stage::Zero3}) {
    OptimizerOptions o = options(stage, true);
    o.reduction = Reduction::Reproducible;
    ASSERT_FALSE(staged(*Harness(o, order_model(stage)).opt));
    expect_forward_equals_backward(o, order_model(stage), "reproducible");
  }
}

INSTANTIATE_TEST_SUITE_P(AllStages, GradientOrder,
                         testing::Values(Stage::DataParallel, Stage::Zero1, Stage::Zero2,
                                         Stage::Zero3),
                         [](const testing::TestParamInfo<Stage>& i) {
                           return std::string(i.param == Stage::DataParallel ? "dp"
                                              : i.param == Stage::Zero1    ? "zero1"
                                              : i.param == Stage::Zero2    ? "zero2"
                                                                           : "zero3");
                         });
