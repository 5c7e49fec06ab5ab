// test_collectives.cpp: every collective entry point with bad input on one rank ends in the
// same error on every rank (no hang); step() refuses ranks that step with different settings
// and leaves the state unchanged; the debug mode names the first diverging collective.
// Registered with SHARDOPT_COLLECTIVE_TIMEOUT set, so a hang would end the job with a message
// instead of the ctest timeout, and the polling waits run under every test here.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "backend.hpp"  // set_allocation_test_hook
#include "shardopt/checkpoint.hpp"
#include "shardopt/optimizer.hpp"
#include "support/harness.hpp"
#include "support/same_error.hpp"
#include "support/world.hpp"
#ifdef SHARDOPT_WITH_MPI
#include "shardopt/mpi_comm.hpp"
#endif

using namespace shardopt;
using shardopt::test::Harness;

namespace {

using test::expect_same_error;

int last_rank() { return test::world_size() - 1; }
bool is_last() { return test::world_rank() == last_rank(); }
std::string last_tag() { return "rank " + std::to_string(last_rank()); }

OptimizerOptions small_options(Stage stage = Stage::Zero1) {
  OptimizerOptions o;
  o.stage = stage;
  o.bucket_elems = 700;
  o.adam.lr = 1e-2;
  o.adam.weight_decay = 0.1;
  return o;
}

// This rank's optimizer state (master, m, v), copied locally: no communication.
std::vector<std::vector<float>> local_state(ShardedOptimizer& opt) {
  std::vector<std::vector<float>> out;
  for (const StateArray a : {StateArray::Master, StateArray::ExpAvg, StateArray::ExpAvgSq}) {
    out.emplace_back(opt.local_size());
    opt.copy_state_to_host(a, 0, out.back());
  }
  return out;
}

bool bitwise_equal(const std::vector<std::vector<float>>& a,
                   const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].size() != b[i].size() ||
        std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)) != 0)
      return false;
  return true;
}

}  // namespace

// ---- the constructor and finalize ----------------------------------------------------------

// The collective timeout is on by default (600 s; 60 s in debug mode), and can be turned off
// explicitly, by option or by SHARDOPT_COLLECTIVE_TIMEOUT. options() holds what was chosen.
TEST(CollectiveTimeoutDefault, IsFiniteAndCanBeTurnedOff) {
  const char* registered = std::getenv("SHARDOPT_COLLECTIVE_TIMEOUT");
  const std::string saved = registered != nullptr ? registered : "";
  unsetenv("SHARDOPT_COLLECTIVE_TIMEOUT");
  auto chosen = [](OptimizerOptions o) {
    ShardedOptimizer opt(test::world(), o);
    return opt.options().collective_timeout_s;
  };
  OptimizerOptions o;
  EXPECT_EQ(chosen(o), 600.0);
  EXPECT_EQ(kDefaultCollectiveTimeoutS, 600.0);
  o.debug_collectives = true;
  EXPECT_EQ(chosen(o), 60.0);
  o = {};
  o.collective_timeout_s = 42.5;
  EXPECT_EQ(chosen(o), 42.5);
  o.collective_timeout_s = kNoCollectiveTimeout;
  EXPECT_EQ(chosen(o), kNoCollectiveTimeout);
  o.collective_timeout_s = -7;  // any negative value
  EXPECT_EQ(chosen(o), kNoCollectiveTimeout);
  o.collective_timeout_s = HUGE_VAL;  // forever
  EXPECT_EQ(chosen(o), kNoCollectiveTimeout);
  for (const char* off : {"0", "off", "none"}) {
    setenv("SHARDOPT_COLLECTIVE_TIMEOUT", off, 1);
    EXPECT_EQ(chosen(OptimizerOptions{}), kNoCollectiveTimeout) << off;
  }
  setenv("SHARDOPT_COLLECTIVE_TIMEOUT", "7", 1);
  EXPECT_EQ(chosen(OptimizerOptions{}), 7.0);
  o = {};
  o.collective_timeout_s = 5;  // the program's own choice wins over the variable
  EXPECT_EQ(chosen(o), 5.0);
  if (registered != nullptr) setenv("SHARDOPT_COLLECTIVE_TIMEOUT", saved.c_str(), 1);
  else unsetenv("SHARDOPT_COLLECTIVE_TIMEOUT");
}

// Every rank's report names the library call it is in: CallScope nests, the outermost wins.
TEST(CallScope, NamesTheOutermostCall) {
  EXPECT_STREQ(CallScope::current(), "");
  {
    const CallScope outer("shardopt_step");
    {
      const CallScope inner("step");
      EXPECT_STREQ(CallScope::current(), "shardopt_step");
    }
    EXPECT_STREQ(CallScope::current(), "shardopt_step");
  }
  EXPECT_STREQ(CallScope::current(), "");
  const CallScope longer(std::string(100, 'x'));
  EXPECT_EQ(std::string(CallScope::current()), std::string(63, 'x'));
}

TEST(OneRankBadInput, Constructor) {
  OptimizerOptions bad;
  bad.collective_timeout_s = std::nan("");
  expect_same_error(
      Status::InvalidArgument,
      [&] { ShardedOptimizer opt(test::world(), is_last() ? bad : OptimizerOptions{}); },
      {last_tag(), "collective_timeout_s"}, "NaN timeout on the last rank");
  OptimizerOptions debug;
  debug.debug_collectives = true;
  if (test::world_size() > 1)
    expect_same_error(
        Status::InvalidArgument,
        [&] { ShardedOptimizer opt(test::world(), is_last() ? debug : OptimizerOptions{}); },
        {"debug_collectives", "ranks " + std::to_string(last_rank()) + " only"},
        "debug mode on the last rank only");
}

TEST(OneRankBadInput, EnvironmentVariables) {
  const char* registered = std::getenv("SHARDOPT_COLLECTIVE_TIMEOUT");
  const std::string timeout = registered != nullptr ? registered : "";
  // A bad value on one rank: an error everywhere, not a rank that goes its own way.
  if (is_last()) setenv("SHARDOPT_COLLECTIVE_TIMEOUT", "soon", 1);
  expect_same_error(
      Status::InvalidArgument, [&] { ShardedOptimizer opt(test::world(), OptimizerOptions{}); },
      {last_tag(), "SHARDOPT_COLLECTIVE_TIMEOUT='soon'"}, "bad timeout variable");
  if (is_last()) setenv("SHARDOPT_COLLECTIVE_TIMEOUT", timeout.c_str(), 1);
  if (is_last()) setenv("SHARDOPT_DEBUG_COLLECTIVES", "yes", 1);
  expect_same_error(
      Status::InvalidArgument, [&] { ShardedOptimizer opt(test::world(), OptimizerOptions{}); },
      {last_tag(), "SHARDOPT_DEBUG_COLLECTIVES='yes'"}, "bad debug variable");
  if (is_last()) setenv("SHARDOPT_DEBUG_COLLECTIVES", "1", 1);
  if (test::world_size() > 1)
    expect_same_error(
        Status::InvalidArgument, [&] { ShardedOptimizer opt(test::world(), OptimizerOptions{}); },
        {"debug_collectives"}, "debug variable on the last rank only");
  unsetenv("SHARDOPT_DEBUG_COLLECTIVES");
#ifdef SHARDOPT_WITH_MPI
  // (The messages are compared on a communicator made after the variable is gone.)
  if (is_last()) setenv("SHARDOPT_MPI_WAIT", "sometimes", 1);
  std::exception_ptr error;
  try {
    test::world();
  } catch (...) {
    error = std::current_exception();
  }
  unsetenv("SHARDOPT_MPI_WAIT");
  expect_same_error(
      Status::InvalidArgument, [&] { if (error) std::rethrow_exception(error); },
      {last_tag(), "SHARDOPT_MPI_WAIT='sometimes'"}, "bad wait variable");
#endif
}

TEST(OneRankBadInput, Finalize) {
  ShardedOptimizer opt(test::world(), small_options());
  if (!is_last()) opt.add_param("w", 100);
  expect_same_error(Status::InvalidState, [&] { opt.finalize(); },
                    {last_tag() + ": finalize: no parameters"}, "no parameters on the last rank");
}

// A rank that skipped finalize() and calls a collective entry point meets the others in
// their finalize(): the same error everywhere, naming the call of each rank.
TEST(OneRankBadInput, CollectiveCallOnARankThatSkippedFinalize) {
  if (test::world_size() == 1) GTEST_SKIP() << "needs at least 2 ranks";
  std::vector<float> out(100);
  const std::vector<std::pair<const char*, std::function<void(ShardedOptimizer&)>>> calls = {
      {"step", [](ShardedOptimizer& o) { o.step(); }},
      {"reduce_gradients", [](ShardedOptimizer& o) { o.reduce_gradients(); }},
      {"refresh_replica", [](ShardedOptimizer& o) { o.refresh_replica(); }},
      {"get_master", [&](ShardedOptimizer& o) { o.get_master(0, out); }},
  };
  for (const auto& [name, call] : calls) {
    ShardedOptimizer opt(test::world(), small_options());
    opt.add_param("w", 100);
    expect_same_error(
        Status::InvalidState, [&] { is_last() ? call(opt) : opt.finalize(); },
        {last_tag() + ": " + name + ": call finalize()", "ranks entered different collective calls",
         "in '" + std::string(name) + "'", "rank 0 in 'finalize'"},
        name);
  }
}

// finalize's allocations: an out-of-memory on one rank (the test hook fails one buffer's
// host allocation there) is the same error on every rank, wherever it strikes, and leaves
// every optimizer as registered: finalize() succeeds once the memory is back. Before the
// collective allocations came first, the stage-3 Params case broke the group: the last rank
// failed its local replica slices while the others entered the shared-memory allocations.
namespace {
MemCategory g_fail_category = MemCategory::Params;
bool g_failed = false;
bool fail_category(MemCategory c, std::size_t) {
  if (c != g_fail_category) return false;
  g_failed = true;
  return true;
}
}  // namespace

TEST(OneRankBadInput, FinalizeOutOfMemoryOnOneRank) {
  for (const Stage stage : {Stage::Zero1, Stage::Zero2, Stage::Zero3})
    for (const MemCategory category : {MemCategory::Params, MemCategory::Grads,
                                       MemCategory::Master, MemCategory::Moments}) {
      const std::string what = std::string(stage_name(stage)) + ", " +
                               mem_category_name(category) + " fails on the last rank";
      ShardedOptimizer opt(test::world(), small_options(stage));
      opt.add_param("w", 1000);
      if (stage == Stage::Zero3) opt.begin_unit();
      opt.add_param("v", 1000);
      g_fail_category = category;
      g_failed = false;
      if (is_last()) set_allocation_test_hook(fail_category);
      std::exception_ptr error;
      try {
        opt.finalize();
      } catch (...) {
        error = std::current_exception();
      }
      set_allocation_test_hook(nullptr);
      // Buffers of the category may all be shared-memory windows (not host allocations):
      // then nothing failed. The moments, and stage 3's replica slices, are always local.
      std::int32_t failed = g_failed ? 1 : 0;
      std::vector<std::int32_t> all(static_cast<std::size_t>(test::world_size()));
      test::world()->all_gather_bytes(&failed, all.data(), sizeof failed);
      if (category == MemCategory::Moments || (stage == Stage::Zero3 && category == MemCategory::Params))
        ASSERT_EQ(all.back(), 1) << what << ": the hook was not consulted";
      if (all.back() != 0) {
        expect_same_error(Status::OutOfMemory, [&] { std::rethrow_exception(error); },
                          {last_tag() + ": cannot allocate"}, what);
        opt.finalize();  // the memory is back: finalize as registered
      } else {
        EXPECT_FALSE(error) << what << ": failed although no allocation failed";
      }
      std::vector<float> w(1000);
      opt.get_master(1, w);
      EXPECT_EQ(w[0], 0.0f) << what;
    }
}

// ---- stage 3: acquire and prefetch agree before they gather ----------------------------------

TEST(OneRankBadInput, AcquireAndPrefetch) {
  OptimizerOptions o = small_options(Stage::Zero3);
  o.units_in_flight = 2;
  test::Model m = test::make_model();
  m.units = {0, 0, 1, 1, 2, 2, 2, 3};
  Harness h(o, m);
  ShardedOptimizer& opt = *h.opt;
  expect_same_error(Status::InvalidArgument, [&] { opt.acquire(is_last() ? 9 : 0); },
                    {last_tag() + ": acquire: unit 9 out of range (have 4)"}, "acquire: bad unit");
  expect_same_error(Status::InvalidArgument, [&] { opt.prefetch(is_last() ? 4 : 1); },
                    {last_tag() + ": prefetch: unit 4 out of range"}, "prefetch: bad unit");
  if (test::world_size() > 1)
    expect_same_error(
        Status::InvalidState, [&] { opt.acquire(is_last() ? 1 : 0); },
        {"ranks entered different collective calls", "rank 0 in 'acquire(unit 0)'",
         last_tag() + " in 'acquire(unit 1)'"},
        "acquire: different units");
  opt.acquire(0);
  expect_same_error(Status::InvalidState, [&] { opt.acquire(0); },
                    {"acquire: unit 0 is already acquired"}, "acquire twice");
  opt.acquire(1);
  if (!is_last()) opt.release(1);  // local: the last rank keeps both pool buffers
  expect_same_error(Status::InvalidState, [&] { opt.prefetch(2); },
                    {last_tag() + ": prefetch/acquire of unit 2: all 2 unit buffers are held"},
                    "prefetch: pool full on the last rank");
  if (is_last()) opt.release(1);
  opt.release(0);
  // Nothing was gathered by the failed calls: every unit still gathers, on every rank alike.
  std::vector<std::vector<float>> seen;
  for (std::size_t u = 0; u < 4; ++u) {
    opt.acquire(u);
    if (u + 1 < 4) opt.prefetch(u + 1);
    for (std::size_t i = 0; i < m.units.size(); ++i)
      if (static_cast<std::size_t>(m.units[i]) == u) {
        const auto v = opt.param<bf16>(i);
        seen.emplace_back(v.size());
        for (std::size_t k = 0; k < v.size(); ++k) seen.back()[k] = to_float(v[k]);
      }
    opt.release(u);
  }
  for (std::size_t i = 0; i < seen.size(); ++i)
    for (std::size_t k = 0; k < seen[i].size(); ++k)
      ASSERT_EQ(seen[i][k], to_float(to_bf16(test::init_value(i, k)))) << "p" << i << "[" << k << "]";
}

// ---- get_master ----------------------------------------------------------------------------

TEST(OneRankBadInput, GetMaster) {
  ShardedOptimizer opt(test::world(), small_options());
  opt.add_param("a", 1000);
  opt.finalize();
  std::vector<float> good(1000), shorter(999);
  expect_same_error(
      Status::InvalidArgument,
      [&] { opt.get_master(0, is_last() ? std::span<float>(shorter) : std::span<float>(good)); },
      {last_tag(), "has 1000 elements, got a buffer of 999"}, "wrong size");
  expect_same_error(Status::InvalidArgument, [&] { opt.get_master(is_last() ? 7 : 0, good); },
                    {last_tag(), "index 7 out of range"}, "bad index");
  expect_same_error(
      Status::InvalidArgument,
      [&] { opt.get_master(0, is_last() ? std::span<float>(static_cast<float*>(nullptr), std::size_t{1000}) : std::span<float>(good)); },
      {last_tag(), "buffer is null"}, "null buffer");
  opt.get_master(0, good);  // and the group still works
}

TEST(OneRankBadInput, GetState) {
  ShardedOptimizer opt(test::world(), small_options());
  opt.add_param("a", 1000);
  opt.finalize();
  std::vector<float> good(1000), shorter(999);
  expect_same_error(
      Status::InvalidArgument,
      [&] {
        opt.get_state(StateArray::ExpAvg, 0,
                      is_last() ? std::span<float>(shorter) : std::span<float>(good));
      },
      {last_tag(), "get_state: parameter 'a' has 1000 elements, got a buffer of 999"},
      "wrong size");
  expect_same_error(Status::InvalidArgument,
                    [&] { opt.get_state(StateArray::ExpAvgSq, is_last() ? 3 : 0, good); },
                    {last_tag(), "get_state: parameter index 3 out of range"}, "bad index");
  opt.get_state(StateArray::ExpAvg, 0, good);  // and the group still works
}

// ---- checkpoints ---------------------------------------------------------------------------

TEST(OneRankBadInput, SaveCheckpoint) {
  ShardedOptimizer opt(test::world(), small_options());
  opt.add_param("a", 1000);
  opt.finalize();
  const std::string dir = ::testing::TempDir() + "shardopt_onerank_save";
  expect_same_error(
      Status::InvalidArgument,
      [&] { save_checkpoint(opt, dir, SaveOptions{is_last() ? 0 : 2}); },
      {last_tag(), "save_checkpoint: keep must be >= 1"}, "keep 0");
}

// ---- step: every rank must step with the same settings -------------------------------------

namespace {

struct Mismatch {
  const char* what;                                // the name the message must contain
  std::function<void(ShardedOptimizer&)> apply;    // on the last rank
  std::function<void(ShardedOptimizer&)> undo;     // on the last rank
};

const std::vector<Mismatch>& mismatches() {
  auto adam = [](auto mutate) {
    return [mutate](ShardedOptimizer& o) {
      AdamConfig c = o.options().adam;
      mutate(c);
      o.set_adam_config(c);
    };
  };
  static const AdamConfig base = small_options().adam;
  static const std::vector<Mismatch> m = {
      {"lr differs", adam([](AdamConfig& c) { c.lr = 2e-2; }), adam([](AdamConfig& c) { c.lr = base.lr; })},
      {"beta1 differs", adam([](AdamConfig& c) { c.beta1 = 0.8; }), adam([](AdamConfig& c) { c.beta1 = base.beta1; })},
      {"beta2 differs", adam([](AdamConfig& c) { c.beta2 = 0.99; }), adam([](AdamConfig& c) { c.beta2 = base.beta2; })},
      {"eps differs", adam([](AdamConfig& c) { c.eps = 1e-6; }), adam([](AdamConfig& c) { c.eps = base.eps; })},
      {"weight_decay differs", adam([](AdamConfig& c) { c.weight_decay = 0; }),
       adam([](AdamConfig& c) { c.weight_decay = base.weight_decay; })},
      {"Adam mode differs", adam([](AdamConfig& c) { c.mode = AdamMode::AdamL2; }),
       adam([](AdamConfig& c) { c.mode = base.mode; })},
      {"max_grad_norm differs", adam([](AdamConfig& c) { c.max_grad_norm = 1.0; }),
       adam([](AdamConfig& c) { c.max_grad_norm = base.max_grad_norm; })},
      {"group 1 lr_scale differs", [](ShardedOptimizer& o) { o.set_group(1, GroupOptions{0.25, false}); },
       [](ShardedOptimizer& o) { o.set_group(1, test::group_table()[1]); }},
      {"group 1 weight_decay differs", [](ShardedOptimizer& o) { o.set_group(1, GroupOptions{0.5, true}); },
       [](ShardedOptimizer& o) { o.set_group(1, test::group_table()[1]); }},
      {"step count differs", [](ShardedOptimizer& o) { o.set_step_count(o.step_count() + 1); },
       [](ShardedOptimizer& o) { o.set_step_count(o.step_count() - 1); }},
  };
  return m;
}

class StepSettings : public testing::TestWithParam<Stage> {};

std::string stage_test_name(const testing::TestParamInfo<Stage>& i) {
  std::string s = stage_name(i.param);
  for (char& c : s)
    if (c == '-') c = '_';
  return s;
}

}  // namespace

// A setting that differs on the last rank: every rank throws the same error naming the
// setting and the rank, nothing is updated, and after the setting is put back step() reuses
// the reduced gradients: the result is bit for bit the one of a run that never differed.
TEST_P(StepSettings, DifferentSettingOnOneRankFailsEverywhereAndChangesNothing) {
  if (test::world_size() == 1) GTEST_SKIP() << "needs at least 2 ranks";
  OptimizerOptions o = small_options(GetParam());
  Harness h(o), ref(o);
  int step = 0;
  for (const Mismatch& m : mismatches()) {
    ++step;
    h.write_grads(step);
    ref.write_grads(step);
    const std::vector<std::vector<float>> before = local_state(*h.opt);
    const std::int64_t count = h.opt->step_count();
    if (is_last()) m.apply(*h.opt);
    expect_same_error(Status::InvalidArgument, [&] { h.opt->step(); },
                      {m.what, last_tag(), "no update was applied"}, m.what);
    EXPECT_TRUE(bitwise_equal(local_state(*h.opt), before)) << m.what << ": the state changed";
    EXPECT_EQ(h.opt->step_count() - (is_last() && std::strcmp(m.what, "step count differs") == 0),
              count)
        << m.what;
    if (is_last()) m.undo(*h.opt);
    const StepResult r = h.opt->step();
    const StepResult want = ref.opt->step();
    EXPECT_EQ(r.grad_norm, want.grad_norm) << m.what;
    EXPECT_TRUE(bitwise_equal(local_state(*h.opt), local_state(*ref.opt))) << m.what;
  }
}

// Different micro-batch counts average differently (the norm of issue 16: 18.2 against
// 9.1): refused; zero_grad() drops the gradients and the next step is the clean one.
TEST_P(StepSettings, DifferentMicroBatchCountOnOneRankFailsEverywhere) {
  if (test::world_size() == 1) GTEST_SKIP() << "needs at least 2 ranks";
  OptimizerOptions o = small_options(GetParam());
  Harness h(o), ref(o);
  if (is_last()) {
    h.opt->begin_backward(false);
    h.write_grads(1);
  }
  h.opt->begin_backward(true);
  h.write_grads(1);
  const std::vector<std::vector<float>> before = local_state(*h.opt);
  expect_same_error(Status::InvalidArgument, [&] { h.opt->step(); },
                    {"micro-batch count differs", "2 on " + last_tag()}, "micro-batches");
  EXPECT_TRUE(bitwise_equal(local_state(*h.opt), before));
  EXPECT_EQ(h.opt->step_count(), 0);
  h.opt->zero_grad();
  h.write_grads(2);
  ref.write_grads(2);
  EXPECT_EQ(h.opt->step().grad_norm, ref.opt->step().grad_norm);
  EXPECT_TRUE(bitwise_equal(local_state(*h.opt), local_state(*ref.opt)));
}

TEST_P(StepSettings, DifferentLossScaleStateOnOneRankFailsEverywhere) {
  if (test::world_size() == 1) GTEST_SKIP() << "needs at least 2 ranks";
  OptimizerOptions o = small_options(GetParam());
  o.loss_scaling.enabled = true;
  o.loss_scaling.initial_scale = 1024;
  Harness h(o);
  h.write_grads(1);
  const LossScaleState st = h.opt->loss_scale_state();
  if (is_last()) h.opt->set_loss_scale_state(LossScaleState{512, 0, 0});
  expect_same_error(Status::InvalidArgument, [&] { h.opt->step(); },
                    {"loss scale differs", "512 on " + last_tag()}, "loss scale");
  EXPECT_EQ(h.opt->loss_scale_state().scale, is_last() ? 512 : st.scale);
  EXPECT_EQ(h.opt->step_count(), 0);
  if (is_last()) h.opt->set_loss_scale_state(st);
  EXPECT_EQ(h.opt->step().step, 1);
}

INSTANTIATE_TEST_SUITE_P(Stages, StepSettings,
                         testing::Values(Stage::DataParallel, Stage::Zero1, Stage::Zero2),
                         stage_test_name);

// ---- the debug mode --------------------------------------------------------------------------

TEST(DebugCollectives, NamesTheFirstDivergingCollective) {
  if (test::world_size() == 1) GTEST_SKIP() << "needs at least 2 ranks";
  auto c = make_checked_communicator(test::world());
  const std::size_t n = static_cast<std::size_t>(c->size());
  std::vector<float> buf(128 * n, 1.0f);
  expect_same_error(
      Status::InvalidState,
      [&] {
        if (is_last())
          c->all_gather_inplace(buf.data(), 64, CommType::F32);
        else
          c->reduce_scatter_sum_inplace(buf.data(), 64);
      },
      {"collective #0", "all_gather(64 per rank, f32) on " + last_tag(),
       "reduce_scatter_sum(64 per rank, f32) on rank"},
      "different operations");
  expect_same_error(
      Status::InvalidState, [&] { c->reduce_scatter_sum_inplace(buf.data(), is_last() ? 128 : 64); },
      {"collective #1", "reduce_scatter_sum(128 per rank, f32) on " + last_tag()},
      "different sizes");
  expect_same_error(
      Status::InvalidState, [&] { c->broadcast_bytes(buf.data(), 8, is_last() ? 1 : 0); },
      {"collective #2", "root 1"}, "different roots");
  // Matching collectives go through, with the data the plain communicator gives.
  std::fill(buf.begin(), buf.end(), 1.0f);
  c->reduce_scatter_sum_inplace(buf.data(), 64);
  EXPECT_EQ(buf[static_cast<std::size_t>(c->rank()) * 64], static_cast<float>(n));
}

TEST(DebugCollectives, CatchesRanksInDifferentOptimizerCalls) {
  if (test::world_size() == 1) GTEST_SKIP() << "needs at least 2 ranks";
  setenv("SHARDOPT_DEBUG_COLLECTIVES", "1", 1);
  ShardedOptimizer opt(test::world(), small_options());
  unsetenv("SHARDOPT_DEBUG_COLLECTIVES");
  EXPECT_TRUE(opt.options().debug_collectives);
  EXPECT_NE(opt.comm().name().find("(checked)"), std::string::npos) << opt.comm().name();
  opt.add_param("w", 1000);
  opt.finalize();
  std::vector<float> out(1000);
  // Without the debug mode, the last rank's reduce-scatter would meet the others' agreement
  // all-reduce: a hang or mixed-up data.
  expect_same_error(
      Status::InvalidState, [&] { is_last() ? (void)opt.step() : opt.get_master(0, out); },
      {"debug_collectives: collective #", "all_reduce_sum_host(9 f64) on rank",
       "reduce_scatter_sum(", "on " + last_tag()},
      "step against get_master");
}

TEST(DebugCollectives, TrainsExactlyAsWithoutIt) {
  OptimizerOptions o = small_options(Stage::Zero2);
  Harness plain(o);
  o.debug_collectives = true;
  Harness debug(o);
  for (int s = 1; s <= 3; ++s) {
    plain.write_grads(s);
    debug.write_grads(s);
    EXPECT_EQ(plain.opt->step().grad_norm, debug.opt->step().grad_norm);
  }
  EXPECT_TRUE(bitwise_equal(local_state(*plain.opt), local_state(*debug.opt)));
}

// ---- the timeout's polling waits -------------------------------------------------------------

#ifdef SHARDOPT_WITH_MPI
// With a timeout every wait polls, and with MpiWait::Yield every wait polls and yields (the
// plain, shared-memory and hierarchical paths); results are bit for bit those of the blocking
// waits.
TEST(CollectiveTimeout, PollingWaitsGiveTheSameResults) {
  // The blocking run must not pick the registered timeout up from the environment.
  const char* registered = std::getenv("SHARDOPT_COLLECTIVE_TIMEOUT");
  const std::string timeout = registered != nullptr ? registered : "";
  unsetenv("SHARDOPT_COLLECTIVE_TIMEOUT");
  for (const int nodes : {0, 2}) {
    MpiCommOptions co;
    co.kind = MpiCommKind::SharedMemory;
    co.simulate_nodes = nodes;
    for (const Stage stage : {Stage::Zero1, Stage::Zero2}) {
      OptimizerOptions o = small_options(stage);
      o.collective_timeout_s = kNoCollectiveTimeout;  // blocking MPI waits
      co.wait = MpiWait::Block;
      test::Harness blocking(o, test::make_model(), make_mpi_communicator(MPI_COMM_WORLD, co));
      co.wait = MpiWait::Yield;  // polls and yields, without a timeout
      test::Harness yielding(o, test::make_model(), make_mpi_communicator(MPI_COMM_WORLD, co));
      o.collective_timeout_s = 300;
      co.wait = MpiWait::Block;
      test::Harness polling(o, test::make_model(), make_mpi_communicator(MPI_COMM_WORLD, co));
      for (int s = 1; s <= 2; ++s) {
        blocking.write_grads(s);
        yielding.write_grads(s);
        polling.write_grads(s);
        const double norm = blocking.opt->step().grad_norm;
        EXPECT_EQ(yielding.opt->step().grad_norm, norm);
        EXPECT_EQ(polling.opt->step().grad_norm, norm);
      }
      EXPECT_TRUE(bitwise_equal(local_state(*blocking.opt), local_state(*yielding.opt)));
      EXPECT_TRUE(bitwise_equal(local_state(*blocking.opt), local_state(*polling.opt)));
    }
  }
  if (registered != nullptr) setenv("SHARDOPT_COLLECTIVE_TIMEOUT", timeout.c_str(), 1);
}
#endif
