// test_overlap.cpp: bucketed, overlapped reduction and gathering, gradient accumulation and
// the bf16 wire, at whatever rank count the binary runs with.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "shardopt/optimizer.hpp"
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
