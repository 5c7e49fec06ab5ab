// test_optimizer.cpp: the sharded step against the double-precision reference, at whatever
// rank count the binary runs with (1 without MPI; 1-4 under mpiexec).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <ostream>
#include <limits>
#include <string>
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

struct Config {
  Stage stage;
  DType dtype;
  AdamMode mode;
  double max_norm;
};

std::string config_name(const testing::TestParamInfo<Config>& info) {
  const Config& c = info.param;
  std::string s = std::string(stage_name(c.stage)) + "_" + dtype_name(c.dtype) + "_" +
                  (c.mode == AdamMode::AdamW ? "adamw" : "adaml2") +
                  (c.max_norm > 0 ? "_clip" : "");
  for (char& ch : s)
    if (ch == '-') ch = '_';
  return s;
}

class StepVsReference : public testing::TestWithParam<Config> {};

void PrintTo(const Config& c, std::ostream* os) {
  *os << stage_name(c.stage) << "/" << dtype_name(c.dtype);
}

}  // namespace

TEST_P(StepVsReference, SeveralStepsMatchDoublePrecision) {
  const Config c = GetParam();
  AdamConfig a;
  a.lr = 1e-2;
  a.weight_decay = 0.1;
  a.mode = c.mode;
  a.max_grad_norm = c.max_norm;
  Harness h(c.stage, c.dtype, a);
  for (int step = 1; step <= 4; ++step) {
    if (step == 3) {  // the learning rate may change between steps
      h.opt->set_lr(3e-3);
      h.cfg.lr = 3e-3;
    }
    h.step_and_check(step);
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllStages, StepVsReference,
    testing::Values(Config{Stage::DataParallel, DType::BF16, AdamMode::AdamW, 0},
                    Config{Stage::Zero1, DType::BF16, AdamMode::AdamW, 0},
                    Config{Stage::Zero2, DType::BF16, AdamMode::AdamW, 0},
                    Config{Stage::Zero1, DType::F32, AdamMode::AdamW, 0},
                    Config{Stage::Zero2, DType::F32, AdamMode::AdamL2, 0},
                    Config{Stage::DataParallel, DType::F32, AdamMode::AdamL2, 0},
                    Config{Stage::Zero1, DType::BF16, AdamMode::AdamL2, 5.0},
                    Config{Stage::Zero2, DType::BF16, AdamMode::AdamW, 5.0}),
    config_name);

TEST(Optimizer, StagesGiveTheSameParameters) {
  AdamConfig a;
  a.lr = 5e-3;
  Harness dp(Stage::DataParallel, DType::F32, a), z1(Stage::Zero1, DType::F32, a),
      z2(Stage::Zero2, DType::F32, a, 256);
  // At 2+ ranks stage 2 really stages: its parameters span buckets, so both the streamed
  // accumulate_grad() and the grad() view of a parameter across buckets are exercised.
  if (z2.opt->comm().size() > 1)
    EXPECT_GT(z2.opt->memory_report()[MemCategory::Scratch], 0u);
  for (int step = 1; step <= 3; ++step) {
    for (Harness* h : {&dp, &z1, &z2}) {
      h->write_grads(step);
      h->opt->step();
    }
  }
  for (std::size_t i = 0; i < kSizes.size(); ++i) {
    std::vector<float> a0(kSizes[i]), a1(kSizes[i]), a2(kSizes[i]);
    dp.opt->get_master(i, a0);
    z1.opt->get_master(i, a1);
    z2.opt->get_master(i, a2);
    for (std::size_t k = 0; k < kSizes[i]; ++k) {
      // Exact gradient sums and the same update arithmetic: identical bits.
      ASSERT_EQ(a0[k], a1[k]) << "p" << i << "[" << k << "]";
      ASSERT_EQ(a1[k], a2[k]) << "p" << i << "[" << k << "]";
    }
  }
}

// The norm is the documented sum: each bucket's sum of squares of this rank's reduced slice
// in the kernels' order (blocks of 8192, 16 lanes folded pairwise, blocks in order), the
// buckets last first. On the CPU those sums are taken as each reduction completes (during
// backward with overlap, when the slice is still in cache); this pins that they are the
// step's sums bit for bit, at every stage, with overlap on and off and two micro-batches.
// One rank: its reduced slice is its own gradient (data-parallel: the whole bucket).
TEST(Optimizer, GradNormIsTheDocumentedSumOverTheBuckets) {
  if (test::world_size() != 1) GTEST_SKIP() << "the expected sum is one rank's";
  auto documented = [](const float* x, std::size_t n) {
    double total = 0;
    for (std::size_t b = 0; b < n; b += 8192) {
      double lanes[16] = {};
      for (std::size_t i = b; i < std::min(n, b + 8192); ++i)
        lanes[(i - b) % 16] += static_cast<double>(x[i]) * x[i];
      for (std::size_t w = 8; w >= 1; w /= 2)
        for (std::size_t j = 0; j < w; ++j) lanes[j] += lanes[j + w];
      total += lanes[0];
    }
    return total;
  };
  // Many buckets; the last parameter's (summed first) are 2^27 times larger, so that each
  // other bucket's sum is under half an ulp of the running total and is lost in the documented
  // order, but not in another one (the norm would differ by several ulps).
  const std::vector<std::size_t> sizes{70000, 5, 20000, 9000, 33, 12000, 7, 15000, 3000, 40000};
  for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2})
    for (bool overlap : {true, false})
      for (int micro : {1, 2}) {
        OptimizerOptions o;
        o.stage = stage;
        o.overlap = overlap;
        o.bucket_elems = 8192;
        ShardedOptimizer opt(test::world(), o);
        for (std::size_t i = 0; i < sizes.size(); ++i)
          opt.add_param("p" + std::to_string(i), sizes[i]);
        opt.finalize();
        const FlatLayout& layout = opt.layout();
        std::vector<float> flat(layout.padded_size(), 0.0f);  // the summed gradient
        for (int mb = 0; mb < micro; ++mb) {
          opt.begin_backward(mb + 1 == micro);
          for (std::size_t i = sizes.size(); i-- > 0;) {
            const std::span<float> g = opt.grad(i);
            const std::size_t at = layout.param(i).flat.begin;
            for (std::size_t k = 0; k < g.size(); ++k) {
              const float v = test::synth(i, 5, static_cast<std::uint64_t>(mb), k) *
                              (i + 1 == sizes.size() ? 0x1p30f : 8.0f);
              g[k] += v;
              flat[at + k] += v;
            }
            opt.grad_ready(i);
          }
        }
        double want = 0;
        for (std::size_t b = layout.num_buckets(); b-- > 0;) {
          const Bucket& bk = layout.bucket(b);
          want += documented(flat.data() + bk.flat.begin, bk.flat.size());
        }
        const StepResult r = opt.step();
        const double norm = std::sqrt(want) / micro;
        EXPECT_EQ(r.grad_norm, norm) << stage_name(stage) << (overlap ? " overlap" : "")
                                     << " micro-batches " << micro;
      }
}

// get_master gathers: every bit of the master comes back, -0.0 and NaN payloads included
// (a sum over ranks would turn -0.0 into +0.0 and quiet signalling NaNs).
TEST(Optimizer, GetMasterReturnsTheMasterBitForBit) {
  for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2})
    for (DType dtype : {DType::BF16, DType::F32}) {
      OptimizerOptions o;
      o.stage = stage;
      o.param_dtype = dtype;
      o.bucket_elems = 300;
      ShardedOptimizer opt(test::world(), o);
      opt.add_param("a", 1000);
      opt.add_param("b", 77);
      opt.finalize();
      for (std::size_t i = 0; i < 2; ++i) {
        const std::size_t n = opt.layout().param(i).numel;
        std::vector<std::uint32_t> bits(n);
        for (std::size_t k = 0; k < n; ++k) {
          switch (k % 5) {
            case 0: bits[k] = 0x80000000u; break;                              // -0.0
            case 1: bits[k] = 0x7f800001u + static_cast<std::uint32_t>(k); break;  // sNaN
            case 2: bits[k] = 0xffc00000u | static_cast<std::uint32_t>(k); break;  // qNaN payload
            case 3: bits[k] = 0x00000001u + static_cast<std::uint32_t>(k); break;  // subnormal
            default: bits[k] = 0x3f800000u + static_cast<std::uint32_t>(k); break;
          }
        }
        std::vector<float> v(n), back(n);
        std::memcpy(v.data(), bits.data(), n * 4);
        opt.set_param(i, v);
        opt.get_master(i, back);
        ASSERT_EQ(std::memcmp(back.data(), v.data(), n * 4), 0)
            << stage_name(stage) << " " << dtype_name(dtype) << " param " << i;
      }
    }
}

TEST(Optimizer, NonFiniteGradientOnOneRankSkipsEverywhere) {
  AdamConfig a;
  for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2}) {
    Harness h(stage, DType::BF16, a);
    h.write_grads(1);
    h.opt->step();
    h.reference(1);
    const int last = h.opt->comm().size() - 1;
    h.write_grads(2, last);
    const StepResult r = h.opt->step();
    EXPECT_TRUE(r.skipped) << stage_name(stage);
    EXPECT_FALSE(std::isfinite(r.grad_norm));
    EXPECT_EQ(r.step, 1);
    EXPECT_EQ(h.opt->step_count(), 1);
    h.expect_matches_reference("after skipped step");  // state untouched
    // The gradients were cleared; training continues normally.
    h.write_grads(3);
    const StepResult r3 = h.opt->step();
    EXPECT_FALSE(r3.skipped);
    EXPECT_EQ(r3.step, 2);
    h.reference(3);
    h.expect_matches_reference("after recovery");
  }
}

TEST(Optimizer, MemoryAccountingFollowsTheStage) {
  AdamConfig a;
  for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2}) {
    Harness h(stage, DType::BF16, a, 700);
    const FlatLayout& l = h.opt->layout();
    const std::size_t P = l.padded_size();
    const std::size_t owned = stage == Stage::DataParallel ? P : l.shard_size();
    const MemoryReport m = h.opt->memory_report();
    EXPECT_EQ(m[MemCategory::Params], 2 * P);
    EXPECT_EQ(m[MemCategory::Master], 4 * owned);
    EXPECT_EQ(m[MemCategory::Moments], 8 * owned);
    std::size_t largest = 0;
    for (const Bucket& b : l.buckets()) largest = std::max(largest, b.flat.size());
    const std::size_t slots = std::min(
        l.num_buckets(), static_cast<std::size_t>(h.opt->options().buckets_in_flight));
    // Stage 2 stages gradients where that saves memory, else keeps stage 1's buffer.
    const bool staged = l.world_size() > 1 && owned + slots * largest < P;
    if (stage == Stage::Zero2 && staged) {
      EXPECT_EQ(m[MemCategory::Grads], 4 * owned);
      EXPECT_EQ(m[MemCategory::Scratch], 4 * largest * slots);
    } else {
      EXPECT_EQ(m[MemCategory::Grads], 4 * P);
      EXPECT_EQ(m[MemCategory::Scratch], 0u);
    }
  }
}

TEST(Optimizer, Fp32ReplicaIsTheMaster) {
  AdamConfig a;
  Harness h(Stage::Zero1, DType::F32, a);
  EXPECT_EQ(h.opt->memory_report()[MemCategory::Master], 0u);
  EXPECT_EQ(h.opt->memory_report()[MemCategory::Params], 4 * h.opt->layout().padded_size());
}

// ---- bad input -------------------------------------------------------------------------------

namespace {

void expect_status(Status want, const std::function<void()>& f, const char* what) {
  try {
    f();
    ADD_FAILURE() << what << ": no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), want) << what << ": " << e.what();
    EXPECT_GT(std::string(e.what()).size(), 10u) << what;
  }
}

}  // namespace

TEST(BadInput, InvalidHyperparametersFailOnEveryRank) {
  const int last = test::world_size() - 1;
  auto with = [](auto mutate) {
    OptimizerOptions o;
    mutate(o.adam);
    return o;
  };
  const OptimizerOptions bad[] = {
      with([](AdamConfig& c) { c.lr = -1e-3; }), with([](AdamConfig& c) { c.beta1 = 1.0; }),
      with([](AdamConfig& c) { c.beta2 = -0.1; }), with([](AdamConfig& c) { c.eps = 0; }),
      with([](AdamConfig& c) { c.weight_decay = -1; }),
      with([](AdamConfig& c) { c.lr = std::nan(""); }),
      with([](AdamConfig& c) { c.max_grad_norm = -1; })};
  for (const OptimizerOptions& o : bad) {
    // Everyone passes the bad value.
    expect_status(Status::InvalidArgument, [&] { ShardedOptimizer opt(test::world(), o); },
                  "all ranks");
    // Only the last rank passes it: every rank still gets the error (no hang).
    const int rank = test::world_rank();
    expect_status(Status::InvalidArgument,
                  [&] { ShardedOptimizer opt(test::world(), rank == last ? o : OptimizerOptions{}); },
                  "last rank only");
  }
  ShardedOptimizer ok(test::world(), OptimizerOptions{});
  expect_status(Status::InvalidArgument, [&] { ok.set_lr(-1); }, "set_lr");
  expect_status(Status::InvalidArgument, [&] { ok.add_group(GroupOptions{-2, true}); },
                "add_group");
}

TEST(BadInput, MismatchedLayoutsFailOnEveryRank) {
  const auto w = test::world();
  if (w->size() == 1) GTEST_SKIP() << "needs at least 2 ranks";
  const bool odd = w->rank() == w->size() - 1;
  struct Variant {
    const char* what;
    std::function<void(ShardedOptimizer&)> reg;
  };
  const Variant variants[] = {
      {"size", [&](ShardedOptimizer& o) { o.add_param("a", 10); o.add_param("b", odd ? 21 : 20); }},
      {"name", [&](ShardedOptimizer& o) { o.add_param("a", 10); o.add_param(odd ? "c" : "b", 20); }},
      {"order", [&](ShardedOptimizer& o) {
         if (odd) { o.add_param("b", 20); o.add_param("a", 10); }
         else { o.add_param("a", 10); o.add_param("b", 20); } }},
      {"count", [&](ShardedOptimizer& o) { o.add_param("a", 10); if (!odd) o.add_param("b", 20); }},
      {"group", [&](ShardedOptimizer& o) { o.add_group({}); o.add_param("a", 10, odd ? 1 : 0); }},
  };
  for (const Variant& v : variants) {
    ShardedOptimizer opt(w, OptimizerOptions{});
    v.reg(opt);
    expect_status(Status::LayoutMismatch, [&] { opt.finalize(); }, v.what);
  }
  OptimizerOptions o;
  o.param_dtype = odd ? DType::F32 : DType::BF16;
  ShardedOptimizer dt(w, o);
  dt.add_param("a", 10);
  expect_status(Status::LayoutMismatch, [&] { dt.finalize(); }, "dtype");
}

TEST(BadInput, WrongSizesIndicesAndCallOrder) {
  ShardedOptimizer opt(test::world(), OptimizerOptions{});
  expect_status(Status::InvalidState, [&] { opt.step(); }, "step before finalize");
  expect_status(Status::InvalidState, [&] { opt.grad(0); }, "grad before finalize");
  expect_status(Status::InvalidArgument, [&] { opt.add_param("x", 0); }, "zero size");
  expect_status(Status::InvalidArgument, [&] { opt.add_param("x", 4, 3); }, "unknown group");
  opt.add_param("w", 100);
  expect_status(Status::InvalidArgument, [&] { opt.add_param("w", 5); }, "duplicate name");
  opt.finalize();
  expect_status(Status::InvalidState, [&] { opt.add_param("late", 5); }, "add after finalize");
  std::vector<float> wrong(99);
  expect_status(Status::InvalidArgument, [&] { opt.set_param(0, wrong); }, "set_param size");
  expect_status(Status::InvalidArgument,
                [&] { opt.accumulate_grad(0, std::span<const float>(wrong)); }, "accumulate size");
  expect_status(Status::InvalidArgument, [&] { opt.grad(1); }, "index");
  expect_status(Status::InvalidArgument, [&] { opt.param<float>(0); }, "dtype of view");
  EXPECT_EQ(opt.param<bf16>(0).size(), 100u);
}

TEST(BadInput, Stage2GradientsOutOfBackwardOrder) {
  OptimizerOptions o;
  o.stage = Stage::Zero2;
  o.bucket_elems = 64;
  ShardedOptimizer opt(test::world(), o);
  opt.add_param("first", 64);
  opt.add_param("second", 64);
  opt.finalize();
  opt.grad(1)[0] = 1.0f;  // backward order: the last parameter first
  opt.grad_ready(1);
  opt.grad(0)[0] = 1.0f;
  opt.grad_ready(0);
  expect_status(Status::InvalidState, [&] { opt.grad(1); }, "bucket already reduced");
  expect_status(Status::InvalidState, [&] { opt.grad_ready(0); }, "ready twice");
  opt.step();
  opt.grad(1);  // a new pass may start after the step
}

TEST(BadInput, GetMasterWithBadInputOnOneRankFailsEverywhere) {
  OptimizerOptions o;
  o.bucket_elems = 256;
  ShardedOptimizer opt(test::world(), o);
  opt.add_param("a", 1000);
  opt.finalize();
  const int last = opt.comm().size() - 1;
  const bool bad = opt.comm().rank() == last;
  std::vector<float> good(1000), shorter(999);
  expect_status(Status::InvalidArgument,
                [&] { opt.get_master(0, bad ? std::span<float>(shorter) : std::span<float>(good)); },
                "wrong size on the last rank");
  expect_status(Status::InvalidArgument, [&] { opt.get_master(bad ? 7 : 0, good); },
                "bad index on the last rank");
  expect_status(Status::InvalidArgument,
                [&] { opt.get_master(0, bad ? std::span<float>() : std::span<float>(good)); },
                "null buffer on the last rank");
  opt.get_master(0, good);  // and the group still works
}
