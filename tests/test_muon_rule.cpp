// test_muon_rule.cpp: Rule::Muon as an optimizer rule (issue 32) at whatever rank count the
// binary runs with (1 without MPI; 1-4 under mpiexec): 2-D matrices in a Muon group next to
// 1-D parameters in an AdamW group, Ownership::Whole at stages 0-3 (stage 3: four units,
// gathered before every step). Against a double model of torch.optim.Muon; the same bits at
// every rank count, stage and bucket size as one process that runs every rank's
// micro-batches (plain MPI and shared memory; in reproducible mode with gradients whose sums
// round); micro-batches summed before Newton-Schulz (once per step); the refusals, the same
// on every rank; memory_report() == plan_memory().
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "shardopt/bf16.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/planner.hpp"
#include "support/muon_model.hpp"
#include "support/rule_data.hpp"
#include "support/same_error.hpp"
#include "support/world.hpp"

using namespace shardopt;
using shardopt::test::rel_frobenius;

namespace {

struct P {
  const char* name;
  std::size_t rows, cols;  // cols 0: a 1-D parameter of `rows` elements (AdamW group)
};
// Matrices in group 1 (Muon), vectors in group 0 (AdamW), interleaved; "e0" (40000 elements)
// spans the buckets of 16384 and 24000 elements (equal slices, pieces pinned next to matrices).
const std::vector<P> kModel = {{"m0", 96, 64},  {"b0", 100, 0},   {"m1", 64, 96},
                               {"e0", 40000, 0}, {"b1", 37, 0},    {"m2", 128, 128},
                               {"m3", 33, 17},  {"b2", 64, 0}};
std::size_t numel(const P& p) { return p.cols ? p.rows * p.cols : p.rows; }

GroupOptions muon_group(bool nesterov = true, MuonLrAdjust adjust = MuonLrAdjust::Original) {
  GroupOptions g;
  g.rule = Rule::Muon;
  g.lr_scale = 1.0;
  g.weight_decay = true;
  g.muon.nesterov = nesterov;
  g.muon.lr_adjust = adjust;
  return g;
}

OptimizerOptions muon_options(std::size_t bucket, DType dtype = DType::BF16,
                              Stage stage = Stage::DataParallel) {
  OptimizerOptions o;
  o.stage = stage;
  o.ownership = Ownership::Whole;
  o.param_dtype = dtype;
  o.adam.lr = 0.02;
  o.adam.weight_decay = 0.1;
  o.bucket_elems = bucket;
  return o;
}

using test::init_value;
using test::same_bits;
float grad_value(std::uint64_t mb, std::uint64_t step, std::uint64_t param, std::uint64_t k) {
  return test::exact_grad(mb, step, param, k);
}

std::unique_ptr<ShardedOptimizer> make(std::shared_ptr<Communicator> comm,
                                       const OptimizerOptions& o, const GroupOptions& g) {
  auto opt = std::make_unique<ShardedOptimizer>(std::move(comm), o);
  const int muon = opt->add_group(g);
  for (std::size_t i = 0; i < kModel.size(); ++i) {
    const P& p = kModel[i];
    // Stage 3 gathers four units: {m0 b0} {m1 e0} {b1 m2} {m3 b2}.
    if (o.stage == Stage::Zero3 && i > 0 && i % 2 == 0) opt->begin_unit();
    if (p.cols) opt->add_param(p.name, Shape2D{p.rows, p.cols}, muon);
    else opt->add_param(p.name, p.rows, 0);
  }
  opt->finalize();
  for (std::size_t i = 0; i < kModel.size(); ++i) {
    std::vector<float> v(numel(kModel[i]));
    for (std::size_t k = 0; k < v.size(); ++k) v[k] = init_value(i, k);
    opt->set_param(i, v);
  }
  return opt;
}

// Parameter i's gradient in micro-batch mb of step `step`, times `factor`.
std::vector<float> gradient(int mb, int step, std::size_t i, float factor = 1.0f) {
  std::vector<float> g(numel(kModel[i]));
  for (std::size_t k = 0; k < g.size(); ++k)
    g[k] = grad_value(static_cast<std::uint64_t>(mb), static_cast<std::uint64_t>(step), i, k) *
           factor;
  return g;
}
// Runs micro-batches [first, last) of step `step` (stage 3: after a forward), then steps.
void run_step(ShardedOptimizer& opt, int step, int first, int last, float factor = 1.0f) {
  test::run_micro_batches(opt, first, last,
                          [&](int mb, std::size_t i) { return gradient(mb, step, i, factor); });
}

struct Snapshot {
  std::vector<std::vector<float>> master, exp_avg;
  std::vector<std::vector<std::uint16_t>> replica;  // raw bits (bf16 or the low half of f32)
  std::vector<std::vector<float>> replica_f32;
};
Snapshot snapshot(ShardedOptimizer& opt) {
  Snapshot s;
  for (std::size_t i = 0; i < kModel.size(); ++i) {
    const std::size_t n = numel(kModel[i]);
    std::vector<float> m(n), e(n);
    opt.get_master(i, m);
    opt.get_state(StateArray::ExpAvg, i, e);
    s.master.push_back(m);
    s.exp_avg.push_back(e);
  }
  s.replica.resize(kModel.size());
  s.replica_f32.resize(kModel.size());
  test::forward(opt, [&](std::size_t i) {  // stage 3 gathers its units
    const std::size_t n = numel(kModel[i]);
    opt.wait_param(i);  // stages 1-2 gather the replica after the step
    if (opt.options().param_dtype == DType::BF16) {
      const std::span<bf16> r = opt.param<bf16>(i);
      std::vector<std::uint16_t> bits(n);
      std::memcpy(bits.data(), r.data(), n * sizeof(std::uint16_t));
      s.replica[i] = bits;
    } else {
      const std::span<float> r = opt.param<float>(i);
      s.replica_f32[i].assign(r.begin(), r.end());
    }
  });
  return s;
}

// A communicator of the kind SHARDOPT_COMM names ("mpi": plain MPI, "shm": shared memory;
// make_mpi_communicator reads it), or the single process of the binary without MPI.
std::shared_ptr<Communicator> world_of(const char* kind) {
  ::setenv("SHARDOPT_COMM", kind, 1);
  std::shared_ptr<Communicator> c = test::world();
  ::unsetenv("SHARDOPT_COMM");
  return c;
}
void expect_same(const Snapshot& a, const Snapshot& b, const std::string& what) {
  for (std::size_t i = 0; i < kModel.size(); ++i) {
    EXPECT_TRUE(same_bits(a.master[i], b.master[i])) << what << ": master of " << kModel[i].name;
    EXPECT_TRUE(same_bits(a.exp_avg[i], b.exp_avg[i])) << what << ": exp_avg of " << kModel[i].name;
    EXPECT_TRUE(same_bits(a.replica[i], b.replica[i])) << what << ": replica of " << kModel[i].name;
    EXPECT_TRUE(same_bits(a.replica_f32[i], b.replica_f32[i]))
        << what << ": replica of " << kModel[i].name;
  }
}

// ---- the double model of torch.optim.Muon (tests/support/muon_model.hpp) -------------------

void model_step(const MuonConfig& mc, double lr, double wd, std::size_t rows, std::size_t cols,
                std::vector<double>& p, std::vector<double>& buf, const std::vector<double>& g) {
  const double r = static_cast<double>(rows), c = static_cast<double>(cols);
  const double ratio = mc.lr_adjust == MuonLrAdjust::Original        ? std::sqrt(std::max(1.0, r / c))
                       : mc.lr_adjust == MuonLrAdjust::MatchRmsAdamW ? 0.2 * std::sqrt(std::max(r, c))
                                                                     : 1.0;
  test::muon_step_double({mc.momentum, mc.ns_a, mc.ns_b, mc.ns_c, mc.eps, mc.ns_steps, mc.nesterov,
                          lr, wd, ratio},
                         rows, cols, p, buf, g);
}

// Micro-batches per step in the bit-identity tests: divisible by 1, 2, 3 and 4 ranks.
constexpr int kMicroBatches = 12;

}  // namespace

// (a) Ten steps against the double model, every matrix; the three lr adjustments and
// nesterov off once each. One micro-batch per rank.
TEST(MuonRule, TenStepsMatchTheDoubleModel) {
  const int world = test::world_size(), rank = test::world_rank();
  struct Case {
    GroupOptions g;
    double lr_scale;
    bool decay;
  };
  const std::vector<Case> cases = {{muon_group(true, MuonLrAdjust::Original), 1.0, true},
                                   {muon_group(false, MuonLrAdjust::MatchRmsAdamW), 0.5, true},
                                   {muon_group(true, MuonLrAdjust::None), 1.0, false}};
  for (const Case& c : cases) {
    GroupOptions g = c.g;
    g.lr_scale = c.lr_scale;
    g.weight_decay = c.decay;
    const OptimizerOptions o = muon_options(20000);
    auto opt = make(test::world(), o, g);
    const double lr = o.adam.lr * c.lr_scale, wd = c.decay ? o.adam.weight_decay : 0.0;
    std::vector<std::vector<double>> pd, bd;
    for (std::size_t i = 0; i < kModel.size(); ++i) {
      std::vector<double> p(numel(kModel[i]));
      for (std::size_t k = 0; k < p.size(); ++k) p[k] = init_value(i, k);
      pd.push_back(p);
      bd.emplace_back(p.size(), 0.0);
    }
    const std::vector<std::vector<double>> p0 = pd;
    for (int t = 0; t < 10; ++t) {
      run_step(*opt, t, rank, rank + 1);
      for (std::size_t i = 0; i < kModel.size(); ++i) {
        if (!kModel[i].cols) continue;
        std::vector<double> gsum(pd[i].size(), 0.0);
        for (int r = 0; r < world; ++r)
          for (std::size_t k = 0; k < gsum.size(); ++k)
            gsum[k] += grad_value(static_cast<std::uint64_t>(r), static_cast<std::uint64_t>(t), i, k);
        for (double& v : gsum) v /= world;
        model_step(g.muon, lr, wd, kModel[i].rows, kModel[i].cols, pd[i], bd[i], gsum);
      }
    }
    for (std::size_t i = 0; i < kModel.size(); ++i) {
      const std::size_t n = numel(kModel[i]);
      std::vector<float> m(n), e(n);
      opt->get_master(i, m);
      opt->get_state(StateArray::ExpAvg, i, e);
      if (!kModel[i].cols) {  // AdamW moved it
        std::vector<float> init(n);
        for (std::size_t k = 0; k < n; ++k) init[k] = init_value(i, k);
        EXPECT_FALSE(same_bits(m, init)) << kModel[i].name;
        continue;
      }
      std::vector<float> dp(n);
      std::vector<double> dd(n);
      for (std::size_t k = 0; k < n; ++k) {
        dp[k] = static_cast<float>(static_cast<double>(m[k]) - p0[i][k]);
        dd[k] = pd[i][k] - p0[i][k];
      }
      const double err = rel_frobenius(m, pd[i]), err_change = rel_frobenius(dp, dd),
                   err_m = rel_frobenius(e, bd[i]);
      if (rank == 0)
        std::printf("  %s %zux%zu (%s): master %.3g, change %.3g, momentum %.3g\n", kModel[i].name,
                    kModel[i].rows, kModel[i].cols, muon_lr_adjust_name(g.muon.lr_adjust), err,
                    err_change, err_m);
      // test_muon measures ~3e-7 (master) and ~1.5e-6 (change) on the bare math.
      EXPECT_LT(err, 1e-6) << kModel[i].name;
      EXPECT_LT(err_change, 5e-6) << kModel[i].name;
      EXPECT_LT(err_m, 1e-6) << kModel[i].name;
      // The bf16 replica is the master rounded.
      const std::span<bf16> r = opt->param<bf16>(i);
      for (std::size_t k = 0; k < n; ++k)
        ASSERT_EQ(r[k].bits, float_to_bf16_bits(m[k])) << kModel[i].name << " " << k;
    }
  }
}

// (b) The same bits at every rank count, stage (0-3: each matrix updated by its owner at
// stages 1-3) and bucket size as one data-parallel process running every rank's micro-batches
// (12 per step, spread evenly), bf16 and fp32 replicas, plain MPI and shared memory.
TEST(MuonRule, SameBitsAsOneProcessAtAnyRankCountStageAndBucketSize) {
  const int world = test::world_size(), rank = test::world_rank();
  const int per_rank = kMicroBatches / world;
  ASSERT_EQ(per_rank * world, kMicroBatches);
  for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2, Stage::Zero3})
  for (DType dtype : {DType::BF16, DType::F32})
    for (std::size_t bucket : {std::size_t{16384}, std::size_t{24000}, std::size_t{70000}}) {
      const char* kind = (bucket + static_cast<std::size_t>(dtype)) % 2 ? "mpi" : "shm";
      auto opt = make(world_of(kind), muon_options(bucket, dtype, stage), muon_group());
      auto single = make(make_single_process_communicator(), muon_options(bucket, dtype),
                         muon_group());
      for (int t = 0; t < 4; ++t) {
        run_step(*opt, t, rank * per_rank, (rank + 1) * per_rank);
        run_step(*single, t, 0, kMicroBatches);
      }
      expect_same(snapshot(*opt), snapshot(*single),
                  std::string(stage_name(stage)) + ", " + dtype_name(dtype) + ", bucket " +
                      std::to_string(bucket) + ", " + kind);
    }
}

// (c) Four micro-batches give the bits of one micro-batch of their average: Newton-Schulz
// runs once per step on the reduced gradient, not per micro-batch.
TEST(MuonRule, MicroBatchesAreSummedBeforeNewtonSchulz) {
  for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2, Stage::Zero3}) {
  const OptimizerOptions o = muon_options(24000, DType::BF16, stage);
  auto four = make(test::world(), o, muon_group());
  auto one = make(test::world(), o, muon_group());
  for (int t = 0; t < 3; ++t) {
    run_step(*four, t, 0, 4);
    // The average of the four (exact: multiples of 2^-12, summed exactly).
    test::run_average(*one, 4, [&](int mb, std::size_t i) { return gradient(mb, t, i); });
  }
  expect_same(snapshot(*four), snapshot(*one),
              std::string("4 micro-batches against 1, ") + stage_name(stage));
  }
}

// Reproducible mode runs Muon too: the same bits as the default mode with exact gradients,
// at stages 0-3.
TEST(MuonRule, ReproducibleModeMatchesTheDefault) {
  const int world = test::world_size(), rank = test::world_rank();
  const int per_rank = kMicroBatches / world;
  for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2, Stage::Zero3}) {
    OptimizerOptions o = muon_options(24000, DType::BF16, stage);
    auto opt = make(test::world(), o, muon_group());
    o.reduction = Reduction::Reproducible;
    auto exact = make(test::world(), o, muon_group());
    for (int t = 0; t < 3; ++t) {
      run_step(*opt, t, rank * per_rank, (rank + 1) * per_rank);
      run_step(*exact, t, rank * per_rank, (rank + 1) * per_rank);
    }
    expect_same(snapshot(*opt), snapshot(*exact),
                std::string("reproducible against default, ") + stage_name(stage));
  }
}

// Reproducible mode with gradients whose sums round (thirds): every stage, bucket size and
// rank count gives the bits of one process that runs all 12 micro-batches, with 1 micro-batch
// per rank (12 / world: the direct exchange at one rank each) or all of a rank's share.
TEST(MuonRule, ReproducibleSameBitsAsOneProcessWithRoundingSums) {
  const int world = test::world_size(), rank = test::world_rank();
  const int per_rank = kMicroBatches / world;
  constexpr float kThird = 1.0f / 3.0f;
  for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2, Stage::Zero3})
    for (std::size_t bucket : {std::size_t{16384}, std::size_t{70000}}) {
      OptimizerOptions o = muon_options(bucket, DType::F32, stage);
      o.reduction = Reduction::Reproducible;
      OptimizerOptions one = muon_options(bucket, DType::F32);
      one.reduction = Reduction::Reproducible;
      // World micro-batches per step, one per rank; then per_rank each.
      auto opt = make(world_of(bucket == 16384 ? "mpi" : "shm"), o, muon_group());
      auto single = make(make_single_process_communicator(), one, muon_group());
      for (int t = 0; t < 2; ++t) {
        run_step(*opt, t, rank, rank + 1, kThird);
        run_step(*single, t, 0, world, kThird);
      }
      for (int t = 2; t < 4; ++t) {
        run_step(*opt, t, rank * per_rank, (rank + 1) * per_rank, kThird);
        run_step(*single, t, 0, kMicroBatches, kThird);
      }
      expect_same(snapshot(*opt), snapshot(*single),
                  std::string("reproducible, ") + stage_name(stage) + ", bucket " +
                      std::to_string(bucket));
    }
}

// (d) The refusals, the same error on every rank.
TEST(MuonRule, RefusalsAreTheSameOnEveryRank) {
  auto finalize_with = [](OptimizerOptions o, bool vector_in_muon) {
    return [o, vector_in_muon] {
      ShardedOptimizer opt(test::world(), o);
      const int muon = opt.add_group(muon_group());
      opt.add_param("w", Shape2D{64, 32}, muon);
      opt.add_param("bias", 64, vector_in_muon ? muon : 0);
      opt.finalize();
    };
  };
  const OptimizerOptions ok = muon_options(4096);
  test::expect_same_error(Status::InvalidArgument, finalize_with(ok, true),
                          {"'bias'", "Muon", "not a 2-D matrix"}, "1-D parameter in a Muon group");
  test::expect_same_error(
      Status::InvalidArgument,
      [&] {
        ShardedOptimizer opt(test::world(), ok);
        const int muon = opt.add_group(muon_group());
        opt.add_param("row", Shape2D{1, 64}, muon);
        opt.finalize();
      },
      {"'row'", "not a 2-D matrix"}, "1 x n parameter in a Muon group");
  OptimizerOptions flat = ok;
  flat.ownership = Ownership::Flat;
  test::expect_same_error(Status::InvalidArgument, finalize_with(flat, false),
                          {"Muon needs whole matrices", "Ownership::Whole"}, "Flat layout");
  OptimizerOptions small = ok;
  small.bucket_elems = 1000;  // the 64 x 32 matrix spans buckets
  test::expect_same_error(Status::InvalidArgument, finalize_with(small, false),
                          {"'w'", "spans", "bucket"}, "matrix spanning buckets");
  // Invalid Muon settings are refused by add_group on every rank.
  GroupOptions bad = muon_group();
  bad.muon.ns_steps = 100;
  test::expect_same_error(
      Status::InvalidArgument, [&] { ShardedOptimizer(test::world(), ok).add_group(bad); },
      {"ns_steps"}, "ns_steps 100");
  bad = muon_group();
  bad.muon.momentum = 1.0;
  test::expect_same_error(
      Status::InvalidArgument, [&] { ShardedOptimizer(test::world(), ok).add_group(bad); },
      {"momentum"}, "momentum 1");
}

// (e) The memory each rank holds is the planner's: 4 bytes of state per Muon element.
TEST(MuonRule, MemoryReportEqualsThePlan) {
  const int world = test::world_size();
  for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2, Stage::Zero3})
  for (DType dtype : {DType::BF16, DType::F32})
  for (std::size_t bucket : {std::size_t{20000}, std::size_t{0}}) {
    auto opt = make(test::world(), muon_options(bucket, dtype, stage), muon_group());
    PlanConfig pc = plan_config(opt->options(), world);
    // Automatic: raised from 4096 to the largest matrix (128 x 128), in the planner too.
    if (bucket == 0) EXPECT_EQ(opt->options().bucket_elems, 128u * 128u);
    pc.bucket_elems = bucket;
    pc.groups = opt->groups();
    pc.rank = test::world_rank();
    FlatLayout unbuilt;
    for (const ParamInfo& p : opt->layout().params())
      unbuilt.add(p.name, p.numel, p.group, p.unit, p.rows > 1 ? Shape2D{p.rows, p.cols} : Shape2D{});
    const MemoryPlan plan = plan_memory(unbuilt, pc);
    const MemoryReport rep = opt->memory_report();
    for (MemCategory cat : {MemCategory::Params, MemCategory::Grads, MemCategory::Master,
                            MemCategory::Moments, MemCategory::Scratch})
      EXPECT_EQ(plan[cat], rep[cat]) << mem_category_name(cat) << " " << dtype_name(dtype);
    // Scratch holds Muon's (the scaled gradient and Newton-Schulz's workspace, 3 rows cols +
    // 2 min(rows, cols)^2 floats, of the largest matrix the rank updates): at stage 0 every
    // rank updates the 128 x 128 matrix, 6 x 128^2 floats.
    if (stage == Stage::DataParallel)
      EXPECT_GE(rep[MemCategory::Scratch], 6u * 128 * 128 * sizeof(float));
    // Moments: 4 bytes per Muon element, 8 per AdamW element (and their padding); at stages
    // 1-3 each rank holds its owned parameters' (plan == report above, rank by rank).
    std::size_t muon = 0, adamw = 0;
    for (const P& p : kModel) (p.cols ? muon : adamw) += numel(p);
    if (stage == Stage::DataParallel) {  // every rank holds every state
      EXPECT_GE(rep[MemCategory::Moments], 4 * muon + 8 * adamw);
      EXPECT_LT(rep[MemCategory::Moments], 8 * (muon + adamw));
    }
  }
}
