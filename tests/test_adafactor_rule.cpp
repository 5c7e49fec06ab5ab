// test_adafactor_rule.cpp: Rule::Adafactor as an optimizer rule (issue 32) at whatever rank
// count the binary runs with (1 without MPI; 1-4 under mpiexec): 2-D matrices (factored) and
// vectors (unfactored) in an Adafactor group, next to AdamW vectors and a Muon matrix in the
// same optimizer, Ownership::Whole at stages 0-3 (stage 3: four units, gathered by a forward).
// Against the double model of
// torch.optim.Adafactor (tests/support/adafactor_model.hpp); the same bits at every rank
// count, stage and bucket size as one process that runs every rank's micro-batches, on both
// MPI communicators, with either reduction (Reproducible: with sums that round too, at stages
// 0-3); micro-batches summed before the update (once per step); clipping and skipped steps;
// the refusals, the same on every rank; memory_report() == plan_memory().
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "rules/adafactor.hpp"
#include "shardopt/bf16.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/planner.hpp"
#include "support/adafactor_model.hpp"
#include "support/rule_data.hpp"
#include "support/same_error.hpp"
#include "support/world.hpp"
#if SHARDOPT_TEST_MPI_KINDS
#include <mpi.h>

#include "shardopt/mpi_comm.hpp"
#endif

using namespace shardopt;

namespace {

constexpr int kAdamW = 0, kAdafactor = 1, kMuon = 2;  // the groups make() adds

struct P {
  const char* name;
  std::size_t rows, cols;  // cols 0: a 1-D parameter of `rows` elements
  int group;
};
// Factored matrices (the golden shapes and an odd one), Adafactor vectors (1-D, and a
// 1 x n shape, which is a vector here), AdamW vectors and a Muon matrix, interleaved.
const std::vector<P> kModel = {{"a0", 96, 64, kAdafactor},  {"b0", 100, 0, kAdamW},
                               {"a1", 64, 96, kAdafactor},  {"v0", 37, 0, kAdafactor},
                               {"a2", 128, 128, kAdafactor}, {"m0", 48, 32, kMuon},
                               {"a3", 33, 17, kAdafactor},  {"r0", 1, 50, kAdafactor},
                               {"b1", 64, 0, kAdamW}};
std::size_t numel(const P& p) { return p.cols ? p.rows * p.cols : p.rows; }
bool factored(const P& p) { return p.group == kAdafactor && p.rows > 1 && p.cols > 1; }

GroupOptions adafactor_group(AdafactorConfig c = {}, double lr_scale = 1.0, bool decay = true) {
  GroupOptions g;
  g.rule = Rule::Adafactor;
  g.adafactor = c;
  g.lr_scale = lr_scale;
  g.weight_decay = decay;
  return g;
}

OptimizerOptions options(std::size_t bucket, DType dtype = DType::BF16,
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
using test::max_rel;
using test::same_bits;
// exact_grad (a multiple of 2^-10 in [-0.5, 0.5]) times a power of two per row, so the
// factored statistics have structure (rows differ by up to 2^6 in magnitude) and every sum of
// a few of them is still exact in fp32.
float grad_value(std::uint64_t mb, std::uint64_t step, std::uint64_t param, std::uint64_t k,
                 std::size_t cols) {
  const std::uint64_t row = k / std::max<std::size_t>(cols, 1);
  const int row_shift = static_cast<int>(test::mix(param * 131 + row) % 7);
  return std::ldexp(test::exact_grad(mb, step, param, k), -row_shift);
}
std::size_t cols_of(const P& p) { return p.cols ? p.cols : p.rows; }

std::unique_ptr<ShardedOptimizer> make(std::shared_ptr<Communicator> comm,
                                       const OptimizerOptions& o, const GroupOptions& ada) {
  auto opt = std::make_unique<ShardedOptimizer>(std::move(comm), o);
  EXPECT_EQ(opt->add_group(ada), kAdafactor);
  GroupOptions muon;
  muon.rule = Rule::Muon;
  EXPECT_EQ(opt->add_group(muon), kMuon);
  for (std::size_t i = 0; i < kModel.size(); ++i) {
    const P& p = kModel[i];
    // Stage 3 gathers four units: {a0 b0 a1} {v0 a2} {m0 a3} {r0 b1}.
    if (o.stage == Stage::Zero3 && (i == 3 || i == 5 || i == 7)) opt->begin_unit();
    if (p.cols) opt->add_param(p.name, Shape2D{p.rows, p.cols}, p.group);
    else opt->add_param(p.name, p.rows, p.group);
  }
  opt->finalize();
  for (std::size_t i = 0; i < kModel.size(); ++i) {
    std::vector<float> v(numel(kModel[i]));
    for (std::size_t k = 0; k < v.size(); ++k) v[k] = init_value(i, k);
    opt->set_param(i, v);
  }
  return opt;
}

// `factor` 1/3 makes the gradients' sums round (reproducible mode's tests).
std::vector<float> gradient(int mb, int step, std::size_t i, float factor = 1.0f) {
  std::vector<float> g(numel(kModel[i]));
  for (std::size_t k = 0; k < g.size(); ++k)
    g[k] = grad_value(static_cast<std::uint64_t>(mb), static_cast<std::uint64_t>(step), i, k,
                      cols_of(kModel[i])) *
           factor;
  return g;
}

// Runs micro-batches [first, last) of step `step`, then steps. `poison`: parameter 0's first
// gradient element of the first micro-batch becomes NaN.
StepResult run_step(ShardedOptimizer& opt, int step, int first, int last, bool poison = false,
                    float factor = 1.0f) {
  return test::run_micro_batches(opt, first, last, [&](int mb, std::size_t i) {
    std::vector<float> g = gradient(mb, step, i, factor);
    if (poison && mb == first && i == 0) g[0] = std::numeric_limits<float>::quiet_NaN();
    return g;
  });
}

struct Snapshot {
  std::vector<std::vector<float>> master, exp_avg, exp_avg_sq, row_var, col_var, replica_f32;
  std::vector<std::vector<std::uint16_t>> replica;  // bf16 bits
};
Snapshot snapshot(ShardedOptimizer& opt) {
  Snapshot s;
  for (std::size_t i = 0; i < kModel.size(); ++i) {
    const P& p = kModel[i];
    const std::size_t n = numel(p);
    std::vector<float> m(n), e, v, r, c;
    opt.get_master(i, m);
    if (p.group != kAdafactor) {  // AdamW's and Muon's exp_avg
      e.resize(n);
      opt.get_state(StateArray::ExpAvg, i, e);
    }
    if (p.group == kAdamW || (p.group == kAdafactor && !factored(p))) {
      v.resize(n);  // AdamW's exp_avg_sq, Adafactor's variance
      opt.get_state(StateArray::ExpAvgSq, i, v);
    }
    if (factored(p)) {
      r.resize(p.rows);
      c.resize(p.cols);
      opt.get_factored_state(i, r, c);
    }
    s.master.push_back(m);
    s.exp_avg.push_back(e);
    s.exp_avg_sq.push_back(v);
    s.row_var.push_back(r);
    s.col_var.push_back(c);
  }
  s.replica.resize(kModel.size());
  s.replica_f32.resize(kModel.size());
  test::forward(opt, [&](std::size_t i) {  // stage 3 gathers its units
    opt.wait_param(i);  // stages 1-2 gather the replica after the step
    if (opt.options().param_dtype == DType::BF16) {
      const std::span<bf16> rep = opt.param<bf16>(i);
      s.replica[i].resize(rep.size());
      for (std::size_t k = 0; k < rep.size(); ++k) s.replica[i][k] = rep[k].bits;
    } else {
      const std::span<float> rep = opt.param<float>(i);
      s.replica_f32[i].assign(rep.begin(), rep.end());
    }
  });
  return s;
}
void expect_same(const Snapshot& a, const Snapshot& b, const std::string& what) {
  for (std::size_t i = 0; i < kModel.size(); ++i) {
    const char* n = kModel[i].name;
    EXPECT_TRUE(same_bits(a.master[i], b.master[i])) << what << ": master of " << n;
    EXPECT_TRUE(same_bits(a.exp_avg[i], b.exp_avg[i])) << what << ": exp_avg of " << n;
    EXPECT_TRUE(same_bits(a.exp_avg_sq[i], b.exp_avg_sq[i])) << what << ": exp_avg_sq of " << n;
    EXPECT_TRUE(same_bits(a.row_var[i], b.row_var[i])) << what << ": row_var of " << n;
    EXPECT_TRUE(same_bits(a.col_var[i], b.col_var[i])) << what << ": col_var of " << n;
    EXPECT_TRUE(same_bits(a.replica[i], b.replica[i])) << what << ": replica of " << n;
    EXPECT_TRUE(same_bits(a.replica_f32[i], b.replica_f32[i])) << what << ": replica of " << n;
  }
}

// The communicators the bit-identity runs on: both MPI kinds in the MPI binary.
std::vector<std::pair<std::string, std::function<std::shared_ptr<Communicator>()>>> comms() {
#if SHARDOPT_TEST_MPI_KINDS
  auto kind = [](MpiCommKind k) {
    return [k] {
      MpiCommOptions c;
      c.kind = k;
      return make_mpi_communicator(MPI_COMM_WORLD, c);
    };
  };
  return {{"mpi", kind(MpiCommKind::Plain)}, {"shm", kind(MpiCommKind::SharedMemory)}};
#else
  return {{"single", [] { return test::world(); }}};
#endif
}

// Micro-batches per step in the bit-identity tests: divisible by 1, 2, 3 and 4 ranks.
constexpr int kMicroBatches = 12;

rules::adafactor::Config model_config(const AdafactorConfig& a, double lr, double wd) {
  rules::adafactor::Config c;
  c.lr = lr;
  c.weight_decay = wd;
  c.beta2_decay = a.beta2_decay;
  c.eps1 = a.eps1;
  c.eps2 = a.eps2;
  c.d = a.d;
  c.maximize = a.maximize;
  return c;
}

// Tolerances: those of test_adafactor (kStateTol, kWeightTol there, measured and justified
// on the bare kernel: state <= 3.1e-7 relative, weights <= 7.4e-7 of max(|p|, RMS(p)) over
// ten steps, bounds about 3x that). Through the optimizer the kernel sees the gradient sum
// times the fp32 grad_scale (1 / ranks rounded once, then one fp32 product: <= 2 ulp, 1.2e-7
// relative, where the model takes the exact average); g^2 doubles it in the statistics (2.4e-7
// at most, the same at every step, so not accumulated), and u = g / sqrt(v) cancels it to
// first order. The sum stays under the bounds. An algorithmic slip (a statistic of one rank's
// part of a matrix, the update per micro-batch, a wrong t, lr or decay) moves the results by
// 1e-3 or more.
constexpr double kStateTol = 1e-6;
constexpr double kWeightTol = 2e-6;

}  // namespace

// (a) Ten steps against the double model, every Adafactor parameter (factored and not), three
// configurations; one micro-batch per rank.
TEST(AdafactorRule, TenStepsMatchTheDoubleModel) {
  const int world = test::world_size(), rank = test::world_rank();
  AdafactorConfig other;
  other.beta2_decay = -0.6;
  other.eps2 = 1e-2;
  other.d = 1.2;
  other.maximize = true;
  struct Case {
    const char* name;
    GroupOptions g;
  };
  const std::vector<Case> cases = {{"defaults", adafactor_group()},
                                   {"beta2_decay -0.6, eps2 1e-2, d 1.2, maximize, lr x 5",
                                    adafactor_group(other, 5.0, true)},
                                   {"no weight decay", adafactor_group({}, 1.0, false)}};
  for (const Case& cs : cases) {
    SCOPED_TRACE(cs.name);
    const OptimizerOptions o = options(20000);
    auto opt = make(test::world(), o, cs.g);
    const double lr = o.adam.lr * cs.g.lr_scale, wd = cs.g.weight_decay ? o.adam.weight_decay : 0.0;
    std::vector<test::AdafactorModel> models;
    for (std::size_t i = 0; i < kModel.size(); ++i) {
      std::vector<float> p0(numel(kModel[i]));
      for (std::size_t k = 0; k < p0.size(); ++k) p0[k] = init_value(i, k);
      models.emplace_back(model_config(cs.g.adafactor, lr, wd),
                          rules::adafactor::Shape{1, kModel[i].rows, kModel[i].cols}, p0,
                          factored(kModel[i]));
    }
    for (int t = 0; t < 10; ++t) {
      run_step(*opt, t, rank, rank + 1);
      for (std::size_t i = 0; i < kModel.size(); ++i) {
        if (kModel[i].group != kAdafactor) continue;
        std::vector<double> avg(numel(kModel[i]), 0.0);
        for (int r = 0; r < world; ++r) {
          const std::vector<float> g = gradient(r, t, i);
          for (std::size_t k = 0; k < avg.size(); ++k) avg[k] += g[k];
        }
        for (double& v : avg) v /= world;
        models[i].step(t + 1, avg);
      }
    }
    for (std::size_t i = 0; i < kModel.size(); ++i) {
      const P& p = kModel[i];
      if (p.group != kAdafactor) continue;
      const std::size_t n = numel(p);
      std::vector<float> m(n);
      opt->get_master(i, m);
      const test::AdafactorModel& md = models[i];
      const double werr = max_rel(m, md.p, test::AdafactorModel::rms(md.p));
      double serr = 0.0;
      if (factored(p)) {
        std::vector<float> r(p.rows), c(p.cols);
        opt->get_factored_state(i, r, c);
        serr = std::max(max_rel(r, md.row, 0.0), max_rel(c, md.col, 0.0));
      } else {
        std::vector<float> v(n);
        opt->get_state(StateArray::ExpAvgSq, i, v);
        serr = max_rel(v, md.var, 0.0);
      }
      if (rank == 0)
        std::printf("  %s %zux%zu (%s): state %.3g, weights %.3g\n", p.name, p.rows, p.cols,
                    cs.name, serr, werr);
      EXPECT_LE(serr, kStateTol) << p.name;
      EXPECT_LE(werr, kWeightTol) << p.name;
      // The model moved the weights by far more than the tolerance.
      double moved = 0.0;
      for (std::size_t k = 0; k < n; ++k)
        moved = std::max(moved, std::fabs(md.p[k] - init_value(i, k)));
      EXPECT_GT(moved, 1e3 * kWeightTol * test::AdafactorModel::rms(md.p)) << p.name;
      // The bf16 replica is the master rounded.
      const std::span<bf16> rep = opt->param<bf16>(i);
      for (std::size_t k = 0; k < n; ++k)
        ASSERT_EQ(rep[k].bits, float_to_bf16_bits(m[k])) << p.name << " " << k;
    }
  }
}

// (b) The same bits at every rank count, stage (0-3: each parameter updated by its owner at
// stages 1-3; stage 3 in four units) and bucket size as one data-parallel process running every rank's micro-batches
// (12 per step, spread evenly), bf16 and fp32 replicas, plain MPI and shared memory; stage 0
// equals stage 1 bit for bit at the same rank count.
TEST(AdafactorRule, SameBitsAsOneProcessAtAnyRankCountStageAndBucketSize) {
  const int world = test::world_size(), rank = test::world_rank();
  const int per_rank = kMicroBatches / world;
  ASSERT_EQ(per_rank * world, kMicroBatches);
  for (DType dtype : {DType::BF16, DType::F32})
    for (std::size_t bucket : {std::size_t{16384}, std::size_t{24000}, std::size_t{70000}}) {
      auto single = make(make_single_process_communicator(), options(bucket, dtype),
                         adafactor_group());
      for (int t = 0; t < 4; ++t) run_step(*single, t, 0, kMicroBatches);
      const Snapshot want = snapshot(*single);
      for (const auto& [comm_name, comm] : comms()) {
        Snapshot stage0;
        for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2, Stage::Zero3}) {
          auto opt = make(comm(), options(bucket, dtype, stage), adafactor_group());
          for (int t = 0; t < 4; ++t) run_step(*opt, t, rank * per_rank, (rank + 1) * per_rank);
          const std::string what = comm_name + ", " + stage_name(stage) + ", " +
                                   dtype_name(dtype) + ", bucket " + std::to_string(bucket);
          const Snapshot got = snapshot(*opt);
          expect_same(got, want, what);
          if (stage == Stage::DataParallel) stage0 = got;
          if (stage == Stage::Zero1) expect_same(got, stage0, what + " against stage 0");
        }
      }
    }
}

// (c) Four micro-batches give the bits of one micro-batch of their average: the update runs
// once per step on the reduced gradient, not per micro-batch.
TEST(AdafactorRule, MicroBatchesAreSummedBeforeTheUpdate) {
  for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2}) {
    const OptimizerOptions o = options(24000, DType::BF16, stage);
    auto four = make(test::world(), o, adafactor_group());
    auto one = make(test::world(), o, adafactor_group());
    for (int t = 0; t < 3; ++t) {
      run_step(*four, t, 0, 4);
      // The average of the four (exact: multiples of 2^-16, summed exactly).
      test::run_average(*one, 4, [&](int mb, std::size_t i) { return gradient(mb, t, i); });
    }
    expect_same(snapshot(*four), snapshot(*one),
                std::string("4 micro-batches against 1, ") + stage_name(stage));
  }
}

// Reproducible mode runs Adafactor at stages 0-3 (stage 3 in four units): the same bits as
// the default mode with exact gradients.
TEST(AdafactorRule, ReproducibleModeMatchesTheDefault) {
  const int world = test::world_size(), rank = test::world_rank();
  const int per_rank = kMicroBatches / world;
  for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2, Stage::Zero3}) {
    OptimizerOptions o = options(24000, DType::BF16, stage);
    auto opt = make(test::world(), o, adafactor_group());
    o.reduction = Reduction::Reproducible;
    auto exact = make(test::world(), o, adafactor_group());
    for (int t = 0; t < 3; ++t) {
      run_step(*opt, t, rank * per_rank, (rank + 1) * per_rank);
      run_step(*exact, t, rank * per_rank, (rank + 1) * per_rank);
    }
    expect_same(snapshot(*opt), snapshot(*exact),
                std::string("reproducible against default, ") + stage_name(stage));
  }
}

// Reproducible mode with gradients whose sums round (thirds): at every stage (0-3; at stages
// 1-3 every bucket of a Whole layout is ragged, so the two-phase method reduces it), bucket
// size, rank count and MPI communicator, the bits of one process (reproducible too) that runs
// every micro-batch: one micro-batch per rank, 12 / N each, uneven counts (a rank with none
// where N > 1), clipped at every step (the exact sum of squares gives every rank the one
// process's coefficient), and a step skipped on a NaN in one rank's gradient, then two more.
TEST(AdafactorRule, ReproducibleSameBitsAsOneProcessWithRoundingSums) {
  const int world = test::world_size(), rank = test::world_rank();
  const int per_rank = kMicroBatches / world;
  constexpr float kThird = 1.0f / 3.0f;
  // Micro-batches per rank at step 2 (uneven; a rank with none).
  const std::vector<std::vector<int>> splits = {{5}, {0, 5}, {3, 0, 2}, {1, 0, 3, 1}};
  ASSERT_LE(world, 4);
  const std::vector<int>& split = splits[static_cast<std::size_t>(world - 1)];
  int uneven_first = 0, uneven_total = 0;
  for (int r = 0; r < world; ++r) {
    if (r < rank) uneven_first += split[static_cast<std::size_t>(r)];
    uneven_total += split[static_cast<std::size_t>(r)];
  }
  const int uneven_last = uneven_first + split[static_cast<std::size_t>(rank)];
  const bool last = rank == world - 1;
  const auto kinds = comms();
  const std::vector<std::size_t> buckets = {16384, 24000, 70000};
  for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2, Stage::Zero3})
    for (std::size_t b = 0; b < buckets.size(); ++b) {
      // Both MPI communicators at every stage (mpi, shm, mpi), bf16 and fp32 replicas.
      const std::size_t bucket = buckets[b];
      const auto& [comm_name, comm] = kinds[b % kinds.size()];
      const DType dtype = b == 1 ? DType::F32 : DType::BF16;
      const std::string what = std::string("reproducible, ") + comm_name + ", " +
                               stage_name(stage) + ", " + dtype_name(dtype) + ", bucket " +
                               std::to_string(bucket);
      SCOPED_TRACE(what);
      OptimizerOptions o = options(bucket, dtype, stage);
      o.reduction = Reduction::Reproducible;
      o.adam.max_grad_norm = 1.0;  // below the averaged gradient's norm: every step clips
      OptimizerOptions one = options(bucket, dtype);
      one.reduction = o.reduction;
      one.adam.max_grad_norm = o.adam.max_grad_norm;
      auto opt = make(comm(), o, adafactor_group());
      auto single = make(make_single_process_communicator(), one, adafactor_group());
      if (stage != Stage::DataParallel) {  // the case the two-phase method must handle
        bool ragged = false;
        for (const Bucket& bk : opt->layout().buckets()) ragged = ragged || !bk.equal_cut;
        ASSERT_TRUE(ragged || world == 1);
      }
      // `nan`: a NaN in the last rank's first micro-batch and in the one process's first.
      auto both = [&](int t, int first, int last_mb, int total, bool nan = false) {
        const StepResult got = run_step(*opt, t, first, last_mb, nan && last, kThird);
        const StepResult want = run_step(*single, t, 0, total, nan, kThird);
        EXPECT_EQ(got.skipped, want.skipped) << "step " << t;
        EXPECT_EQ(got.clipped, want.clipped) << "step " << t;
        EXPECT_EQ(got.clip_coef, want.clip_coef) << "step " << t;
        if (!want.skipped) EXPECT_EQ(got.grad_norm, want.grad_norm) << "step " << t;
        return got;
      };
      EXPECT_TRUE(both(0, rank, rank + 1, world).clipped);
      EXPECT_TRUE(both(1, rank * per_rank, (rank + 1) * per_rank, kMicroBatches).clipped);
      EXPECT_TRUE(both(2, uneven_first, uneven_last, uneven_total).clipped);
      const Snapshot before = snapshot(*opt);
      EXPECT_TRUE(both(3, rank * per_rank, (rank + 1) * per_rank, kMicroBatches, true).skipped);
      expect_same(snapshot(*opt), before, what + ": after the skipped step");
      EXPECT_EQ(opt->step_count(), 3);
      both(4, rank * per_rank, (rank + 1) * per_rank, kMicroBatches);
      both(5, rank, rank + 1, world);
      expect_same(snapshot(*opt), snapshot(*single), what);
    }
}

// (d) Clipping scales the gradient Adafactor sees (its statistics scale by the clip
// coefficient squared), and a step with a non-finite gradient is skipped on every rank: no
// state, weight or step count moves, and the next step is the one a run without it takes.
TEST(AdafactorRule, ClippingAndSkippedSteps) {
  const int world = test::world_size(), rank = test::world_rank();
  for (Stage stage : {Stage::DataParallel, Stage::Zero2}) {
    SCOPED_TRACE(stage_name(stage));
    OptimizerOptions o = options(24000, DType::BF16, stage);
    o.adam.max_grad_norm = 0.1;  // the averaged gradient's norm is about 10-20: clipped
    auto opt = make(test::world(), o, adafactor_group());
    const StepResult r = run_step(*opt, 0, rank, rank + 1);
    ASSERT_TRUE(r.clipped);
    ASSERT_LT(r.clip_coef, 0.05);
    // The model of a2 (128 x 128) on the clipped average.
    const std::size_t i = 4;
    ASSERT_EQ(std::string(kModel[i].name), "a2");
    std::vector<float> p0(numel(kModel[i]));
    for (std::size_t k = 0; k < p0.size(); ++k) p0[k] = init_value(i, k);
    test::AdafactorModel clipped(model_config({}, o.adam.lr, o.adam.weight_decay),
                                 {1, 128, 128}, p0, true);
    test::AdafactorModel unclipped = clipped;
    std::vector<double> avg(p0.size(), 0.0), scaled(p0.size());
    for (int w = 0; w < world; ++w) {
      const std::vector<float> g = gradient(w, 0, i);
      for (std::size_t k = 0; k < avg.size(); ++k) avg[k] += g[k];
    }
    for (std::size_t k = 0; k < avg.size(); ++k) {
      avg[k] /= world;
      scaled[k] = avg[k] * r.clip_coef;
    }
    clipped.step(1, scaled);
    unclipped.step(1, avg);
    std::vector<float> row(128), col(128);
    opt->get_factored_state(i, row, col);
    EXPECT_LE(max_rel(row, clipped.row, 0.0), kStateTol);
    EXPECT_LE(max_rel(col, clipped.col, 0.0), kStateTol);
    EXPECT_GT(max_rel(row, unclipped.row, 0.0), 0.9);  // the unclipped statistics are ~400x

    // A NaN on the last rank: skipped everywhere, nothing moves.
    const Snapshot before = snapshot(*opt);
    const StepResult skipped = run_step(*opt, 1, rank, rank + 1, rank == world - 1);
    EXPECT_TRUE(skipped.skipped);
    EXPECT_EQ(opt->step_count(), 1);
    expect_same(snapshot(*opt), before, "after a skipped step");
    // The next step is step 2 of a run that never saw the NaN (t = 2, not 3).
    auto clean = make(test::world(), o, adafactor_group());
    run_step(*clean, 0, rank, rank + 1);
    run_step(*opt, 2, rank, rank + 1);
    run_step(*clean, 2, rank, rank + 1);
    expect_same(snapshot(*opt), snapshot(*clean), "after the skipped step");
  }
}

// Adafactor's settings are part of what the ranks must agree on: at finalize (the layout
// fingerprint) and at every step (after set_group), with the same error on every rank and
// nothing updated.
TEST(AdafactorRule, RanksThatDisagreeFailTogether) {
  const int world = test::world_size(), rank = test::world_rank();
  if (world == 1) GTEST_SKIP() << "needs at least 2 ranks";
  const bool last = rank == world - 1;
  AdafactorConfig other;
  other.d = 1.5;
  {
    ShardedOptimizer opt(test::world(), options(20000));
    const int ada = opt.add_group(adafactor_group(last ? other : AdafactorConfig{}));
    opt.add_param("w", Shape2D{64, 32}, ada);
    test::expect_same_error(Status::LayoutMismatch, [&] { opt.finalize(); }, {"differ"},
                            "Adafactor settings differ at finalize");
  }
  auto opt = make(test::world(), options(20000), adafactor_group());
  run_step(*opt, 0, rank, rank + 1);
  const Snapshot before = snapshot(*opt);
  other = AdafactorConfig{};
  other.eps2 = 2e-3;
  if (last) opt->set_group(kAdafactor, adafactor_group(other));
  test::expect_same_error(
      Status::InvalidArgument, [&] { run_step(*opt, 1, rank, rank + 1); },
      {"group 1 adafactor.eps2 differs"}, "Adafactor settings differ at step");
  EXPECT_EQ(opt->step_count(), 1);
  expect_same(snapshot(*opt), before, "after the refused step");
}

// (e) The refusals, the same error on every rank.
TEST(AdafactorRule, RefusalsAreTheSameOnEveryRank) {
  auto finalize_with = [](OptimizerOptions o, bool matrix) {
    return [o, matrix] {
      ShardedOptimizer opt(test::world(), o);
      const int ada = opt.add_group(adafactor_group());
      opt.add_param("bias", 64, 0);
      if (matrix) opt.add_param("w", Shape2D{64, 32}, ada);
      else opt.add_param("v", 64, ada);
      opt.finalize();
    };
  };
  const OptimizerOptions ok = options(4096);
  OptimizerOptions flat = ok;
  flat.ownership = Ownership::Flat;
  test::expect_same_error(Status::InvalidArgument, finalize_with(flat, true),
                          {"'w'", "64 x 32", "Adafactor", "Ownership::Whole"},
                          "a 2-D Adafactor parameter on a Flat layout");
  // RMS(p) and RMS(u) are statistics of the whole tensor: a vector needs one owner too.
  test::expect_same_error(Status::InvalidArgument, finalize_with(flat, false),
                          {"'v'", "Adafactor", "Ownership::Whole"},
                          "a 1-D Adafactor parameter on a Flat layout");
  for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2}) {
    OptimizerOptions s = flat;
    s.stage = stage;
    test::expect_same_error(Status::InvalidArgument, finalize_with(s, true), {"'w'", "Adafactor"},
                            std::string("Flat at ") + stage_name(stage));
  }
  OptimizerOptions small = ok;
  small.bucket_elems = 1000;  // the 64 x 32 matrix spans buckets
  test::expect_same_error(Status::InvalidArgument, finalize_with(small, true),
                          {"Adafactor parameter 'w'", "spans", "bucket"},
                          "matrix spanning buckets");
  // Invalid Adafactor settings are refused by add_group on every rank.
  const std::vector<std::pair<std::string, std::function<void(AdafactorConfig&)>>> bad = {
      {"beta2_decay", [](AdafactorConfig& c) { c.beta2_decay = 0.1; }},
      {"eps1", [](AdafactorConfig& c) { c.eps1 = -1.0; }},
      {"eps2", [](AdafactorConfig& c) { c.eps2 = std::numeric_limits<double>::quiet_NaN(); }},
      {"Adafactor d", [](AdafactorConfig& c) { c.d = 0.5; }}};
  for (const auto& [needle, change] : bad) {
    GroupOptions g = adafactor_group();
    change(g.adafactor);
    test::expect_same_error(
        Status::InvalidArgument, [&] { ShardedOptimizer(test::world(), ok).add_group(g); },
        {needle}, needle);
  }
  // State accessors: no factored statistics for a vector, no per-element array for a matrix,
  // a wrong size.
  auto opt = make(test::world(), options(20000), adafactor_group());
  std::vector<float> a(128), b(128), big(128 * 128);
  test::expect_same_error(
      Status::InvalidArgument, [&] { opt->get_factored_state(3, a, b); },
      {"'v0'", "no factored statistics"}, "get_factored_state of a vector");
  test::expect_same_error(
      Status::InvalidArgument, [&] { opt->get_factored_state(4, a, std::span<float>(b).first(5)); },
      {"'a2'", "128 rows and 128 columns"}, "get_factored_state with a wrong size");
  test::expect_same_error(
      Status::InvalidArgument, [&] { opt->get_state(StateArray::ExpAvgSq, 4, big); },
      {"'a2'", "Adafactor", "get_factored_state"}, "get_state of a factored matrix");
}

// (f) The memory each rank holds is the planner's; a factored matrix keeps rows + cols floats.
TEST(AdafactorRule, MemoryReportEqualsThePlan) {
  const int world = test::world_size();
  for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2, Stage::Zero3})
  for (DType dtype : {DType::BF16, DType::F32})
  for (std::size_t bucket : {std::size_t{20000}, std::size_t{0}}) {
    auto opt = make(test::world(), options(bucket, dtype, stage), adafactor_group());
    PlanConfig pc = plan_config(opt->options(), world);
    // Automatic: raised from 4096 to the largest whole-tensor parameter (128 x 128).
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
      EXPECT_EQ(plan[cat], rep[cat]) << mem_category_name(cat) << " " << dtype_name(dtype)
                                     << " " << stage_name(stage) << " rank " << pc.rank;
    // Scratch holds the rule scratch of the largest whole-tensor parameter the rank updates:
    // at stage 0 every rank updates a2 (128 x 128: its scaled gradient and the device
    // reduction's workspace, counted on the CPU too) and Muon's m0 (48 x 32: 48 32 + 3 48 32 +
    // 2 32^2 floats, less).
    if (stage == Stage::DataParallel)
      EXPECT_GE(rep[MemCategory::Scratch],
                (std::size_t{128} * 128 + rules::adafactor::workspace_floats(128, 128, true)) *
                    sizeof(float));
  }
  // Factored matrices alone (sizes multiples of 64: no padding inside a run): every rank's
  // moments are 4 (rows + cols) bytes per matrix it owns, and all ranks' add up to the model's.
  for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2, Stage::Zero3}) {
    ShardedOptimizer opt(test::world(), options(20000, DType::BF16, stage));
    const int ada = opt.add_group(adafactor_group());
    opt.add_param("a", Shape2D{96, 64}, ada);
    opt.add_param("b", Shape2D{64, 96}, ada);
    opt.add_param("c", Shape2D{128, 128}, ada);
    opt.finalize();
    const double mine = static_cast<double>(opt.memory_report()[MemCategory::Moments]);
    const double want = 4.0 * (160 + 160 + 256);
    if (stage == Stage::DataParallel) {
      EXPECT_EQ(mine, want);
    } else {
      double sum = 0.0;
      std::vector<double> all(static_cast<std::size_t>(world));
      opt.comm().all_gather_bytes(&mine, all.data(), sizeof mine);
      for (double x : all) sum += x;
      EXPECT_EQ(sum, want) << stage_name(stage);
    }
  }
}
