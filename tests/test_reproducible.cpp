// test_reproducible.cpp: reproducible mode (Reduction::Reproducible). The same 12
// micro-batch gradients, spread over the launched ranks in two different assignments, with
// several bucket sizes, stages 0-3 and both MPI communicators (plain and shared memory),
// give bit for bit the step of one process that receives all 12: norm, clip and skip
// decisions, loss scale, master, moments and replica. Checkpoints saved at W ranks resume at 1
// and the other way round. Also the exact-sum primitives against long-double references.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <bit>
#include <functional>
#include <memory>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backend.hpp"
#include "buffer_plan.hpp"
#include "exact_sum.hpp"
#include "shardopt/checkpoint.hpp"
#include "shardopt/mpi_comm.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/planner.hpp"
#include "support/ckpt_model.hpp"  // test::SharedDir
#include "support/forwarding_comm.hpp"
#include "support/world.hpp"

using namespace shardopt;
namespace fs = std::filesystem;

namespace {

constexpr int kMicroBatches = 12;  // divisible by 1, 2, 3 and 4 ranks
constexpr std::size_t kSizes[] = {1000, 37, 4099, 64, 513, 2};

// Micro-batch k's gradient of parameter i, element j: heavy-tailed magnitudes over 2^-40 ..
// 2^12, exact zeros, subnormals, and (step `nan_step`) one NaN.
float grad_value(int step, int k, std::size_t i, std::size_t j, int nan_step) {
  std::uint64_t h = 0x9E3779B97F4A7C15ull * (static_cast<std::uint64_t>(step) * 1000003u +
                                             static_cast<std::uint64_t>(k) * 7919u + i * 104729u + j);
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  if (step == nan_step && k == 5 && i == 2 && j == 17) return std::numeric_limits<float>::quiet_NaN();
  switch (h % 16) {
    case 0: return 0.0f;
    case 1: return std::ldexp(static_cast<float>((h >> 8) % 1000), -149);  // subnormal
    default: break;
  }
  const int e = static_cast<int>((h >> 8) % 53) - 40;
  const float m = 1.0f + static_cast<float>((h >> 20) & 0xffffff) * 0x1p-24f;
  const float v = std::ldexp(m, e);
  return (h >> 60) & 1 ? -v : v;
}

enum class Assign { Blocked, RoundRobin };

int owner(int k, int world, Assign a) {
  return a == Assign::Blocked ? k / (kMicroBatches / world) : k % world;
}

struct Trained {
  std::vector<StepResult> results;
  std::vector<std::vector<float>> master, m, v;
  std::vector<std::vector<std::uint16_t>> replica;
  std::size_t grads_bytes = 0;  ///< the optimizer's Grads memory after the last step
};

OptimizerOptions options(Stage stage, std::size_t bucket, bool debug = false) {
  OptimizerOptions o;
  o.debug_collectives = debug;  // the checked communicator forwards the integer reductions
  o.stage = stage;
  o.bucket_elems = bucket;
  o.reduction = Reduction::Reproducible;
  o.adam.lr = 1e-2;
  o.adam.max_grad_norm = 5.0;  // clips: the norms below are far larger
  o.loss_scaling.enabled = true;
  o.loss_scaling.initial_scale = 1.0;
  o.loss_scaling.min_scale = 1.0 / 1024;
  o.loss_scaling.growth_interval = 2;
  return o;
}

void build(ShardedOptimizer& opt) {
  const int g = opt.add_group(GroupOptions{0.5, false});
  for (std::size_t i = 0; i < std::size(kSizes); ++i) {
    if (i % 2 == 0) opt.begin_unit();
    opt.add_param("p" + std::to_string(i), kSizes[i], i == 3 ? g : 0);
  }
  opt.finalize();
  for (std::size_t i = 0; i < std::size(kSizes); ++i) {
    std::vector<float> init(kSizes[i]);
    for (std::size_t j = 0; j < init.size(); ++j)
      init[j] = 0.01f * static_cast<float>((i * 31 + j * 7) % 201) - 1.0f;
    opt.set_param(i, init);
  }
}

// One step: this rank's micro-batches of the global 12 (in descending order on odd steps, to
// vary the local accumulation order too). Parameters 0 and 4 use accumulate_grad in two
// halves (the micro-batch gradient is then their fp32 sum, the same on every run).
StepResult train_step(ShardedOptimizer& opt, int step, Assign assign, int nan_step) {
  const int world = opt.comm().size();
  const int rank = opt.comm().rank();
  std::vector<int> mine;
  for (int k = 0; k < kMicroBatches; ++k)
    if (owner(k, world, assign) == rank) mine.push_back(k);
  if (step % 2 == 1) std::reverse(mine.begin(), mine.end());
  for (int k : mine) {
    opt.begin_backward(false);
    for (std::size_t i = std::size(kSizes); i-- > 0;) {
      std::vector<float> g(kSizes[i]);
      for (std::size_t j = 0; j < g.size(); ++j) g[j] = grad_value(step, k, i, j, nan_step);
      if (i == 0 || i == 4) {
        std::vector<float> half(g.size());
        for (std::size_t j = 0; j < g.size(); ++j) half[j] = g[j] * 0.25f;
        opt.accumulate_grad(i, half);
        for (std::size_t j = 0; j < g.size(); ++j) half[j] = g[j] * 0.75f;
        opt.accumulate_grad(i, half);
      } else {
        std::span<float> dst = opt.grad(i);
        std::copy(g.begin(), g.end(), dst.begin());
      }
      opt.grad_ready(i);
    }
  }
  return opt.step();
}

Trained snapshot(ShardedOptimizer& opt, std::vector<StepResult> results) {
  Trained r;
  r.results = std::move(results);
  r.grads_bytes = opt.memory_report()[MemCategory::Grads];
  const std::size_t n = std::size(kSizes);
  r.master.resize(n);
  r.m.resize(n);
  r.v.resize(n);
  r.replica.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    r.master[i].resize(kSizes[i]);
    r.m[i].resize(kSizes[i]);
    r.v[i].resize(kSizes[i]);
    opt.get_master(i, r.master[i]);
    opt.get_state(StateArray::ExpAvg, i, r.m[i]);
    opt.get_state(StateArray::ExpAvgSq, i, r.v[i]);
  }
  const FlatLayout& l = opt.layout();
  const bool zero3 = opt.options().stage == Stage::Zero3;
  for (std::size_t u = 0; u < l.num_units(); ++u) {
    if (zero3) opt.acquire(u);
    for (std::size_t i = l.unit(u).params.begin; i < l.unit(u).params.end; ++i)
      for (bf16 x : opt.param<bf16>(i)) r.replica[i].push_back(x.bits);
    if (zero3) opt.release(u);
  }
  return r;
}

Trained train(std::shared_ptr<Communicator> comm, Stage stage, std::size_t bucket, Assign assign,
          int steps, int nan_step = 1, bool debug = false) {
  ShardedOptimizer opt(std::move(comm), options(stage, bucket, debug));
  build(opt);
  std::vector<StepResult> results;
  for (int s = 0; s < steps; ++s) results.push_back(train_step(opt, s, assign, nan_step));
  return snapshot(opt, results);
}

void expect_same_bits(const std::vector<float>& a, const std::vector<float>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (std::size_t j = 0; j < a.size(); ++j)
    ASSERT_EQ(std::bit_cast<std::uint32_t>(a[j]), std::bit_cast<std::uint32_t>(b[j]))
        << what << "[" << j << "]: " << a[j] << " vs " << b[j];
}

void expect_same(const Trained& got, const Trained& want, const std::string& what) {
  ASSERT_EQ(got.results.size(), want.results.size());
  for (std::size_t s = 0; s < got.results.size(); ++s) {
    const StepResult& a = got.results[s];
    const StepResult& b = want.results[s];
    const std::string at = what + ", step " + std::to_string(s);
    EXPECT_EQ(std::bit_cast<std::uint64_t>(a.grad_norm), std::bit_cast<std::uint64_t>(b.grad_norm))
        << at << ": norm " << a.grad_norm << " vs " << b.grad_norm;
    EXPECT_EQ(a.clipped, b.clipped) << at;
    EXPECT_EQ(a.clip_coef, b.clip_coef) << at;
    EXPECT_EQ(a.skipped, b.skipped) << at;
    EXPECT_EQ(a.step, b.step) << at;
    EXPECT_EQ(a.loss_scale, b.loss_scale) << at;
  }
  for (std::size_t i = 0; i < std::size(kSizes); ++i) {
    const std::string p = what + ", p" + std::to_string(i);
    expect_same_bits(got.master[i], want.master[i], p + " master");
    expect_same_bits(got.m[i], want.m[i], p + " m");
    expect_same_bits(got.v[i], want.v[i], p + " v");
    ASSERT_EQ(got.replica[i], want.replica[i]) << p << " replica";
  }
}

// One process receiving all 12 micro-batches, one bucket: the reference.
const Trained& reference() {
  static const Trained r = train(make_single_process_communicator(), Stage::Zero1,
                             std::size_t{1} << 20, Assign::Blocked, 4);
  return r;
}

std::shared_ptr<Communicator> mpi(MpiCommKind kind) {
  return make_mpi_communicator(MPI_COMM_WORLD, MpiCommOptions{kind, 0, 0});
}

}  // namespace

// The reference itself exercises what the guarantee covers: clipping, a skipped step.
TEST(Reproducible, ReferenceClipsAndSkips) {
  const Trained& r = reference();
  ASSERT_EQ(r.results.size(), 4u);
  EXPECT_TRUE(r.results[0].clipped);
  EXPECT_TRUE(r.results[1].skipped);  // the NaN in micro-batch 5
  EXPECT_FALSE(r.results[2].skipped);
  EXPECT_EQ(r.results[3].step, 3);
  EXPECT_EQ(r.results[1].loss_scale, 0.5);  // backed off at the skip
}

TEST(Reproducible, SameBitsAtAnyRankCountStageBucketAndCommunicator) {
  const Trained& want = reference();
  for (MpiCommKind kind : {MpiCommKind::Plain, MpiCommKind::SharedMemory})
    for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2, Stage::Zero3})
      for (std::size_t bucket : {std::size_t{1024}, std::size_t{4096}})
        for (Assign a : {Assign::Blocked, Assign::RoundRobin}) {
          // Shared memory (slow when oversubscribed): one bucket size, one assignment.
          if (kind == MpiCommKind::SharedMemory && (bucket != 1024 || a != Assign::RoundRobin))
            continue;
          const std::string what = std::string(kind == MpiCommKind::Plain ? "mpi" : "shm") + " " +
                                   stage_name(stage) + " bucket " + std::to_string(bucket) +
                                   (a == Assign::Blocked ? " blocked" : " round-robin");
          // One of them through the debug_collectives wrapper.
          const bool debug = kind == MpiCommKind::Plain && stage == Stage::Zero2 &&
                             bucket == 1024 && a == Assign::Blocked;
          expect_same(train(mpi(kind), stage, bucket, a, 4, 1, debug), want, what);
          if (HasFatalFailure()) return;
        }
  // The hierarchical shared-memory communicator (two simulated nodes).
  if (mpi(MpiCommKind::Plain)->size() >= 2)
    expect_same(train(make_mpi_communicator(MPI_COMM_WORLD,
                                            MpiCommOptions{MpiCommKind::SharedMemory, 2, 0}),
                      Stage::Zero2, 1024, Assign::Blocked, 4),
                want, "shm hierarchical zero-2");
}

// One micro-batch per rank (packed straight from the fp32 gradients, no bins) against one
// process that deposits all W of them into its bins.
TEST(Reproducible, OneMicroBatchPerRankMatchesOneProcess) {
  auto w = mpi(MpiCommKind::Plain);
  const int world = w->size();
  auto run = [&](std::shared_ptr<Communicator> comm, int per_rank) {
    ShardedOptimizer opt(comm, options(Stage::Zero2, 1024));
    build(opt);
    std::vector<StepResult> rs;
    for (int step = 0; step < 2; ++step) {
      for (int q = 0; q < per_rank; ++q) {
        const int k = per_rank == 1 ? comm->rank() : q;
        opt.begin_backward(false);
        for (std::size_t i = std::size(kSizes); i-- > 0;) {
          std::span<float> g = opt.grad(i);
          for (std::size_t j = 0; j < g.size(); ++j) g[j] = grad_value(step, k, i, j, -1);
          opt.grad_ready(i);
        }
      }
      rs.push_back(opt.step());
    }
    return snapshot(opt, rs);
  };
  const Trained one = run(make_single_process_communicator(), world);
  expect_same(run(w, 1), one, "one micro-batch per rank");
}

namespace {

// Counts the payload bytes of the gradient reductions (per rank, as MemoryPlan::reduce_bytes
// counts them): the direct exchange's raw fp32 values (combine_bytes) and the two-phase
// method's integer collectives (int_bytes).
using test::CountingComm;

// Sets an environment variable for one scope (the same on every rank); restores the value
// it had (scopes nest).
struct EnvScope {
  std::string name;
  bool had = false;
  std::string old;
  EnvScope(const char* n, const char* value) : name(n) {
    if (const char* v = std::getenv(n)) {
      had = true;
      old = v;
    }
    setenv(n, value, 1);
  }
  ~EnvScope() {
    if (had) setenv(name.c_str(), old.c_str(), 1);
    else unsetenv(name.c_str());
  }
};

// A split's micro-batches in all, on the busiest rank, and its name in messages.
struct SplitSummary {
  int total = 0;
  int most = 0;
  std::string what = "split";
};
SplitSummary summarize(const std::vector<int>& split) {
  SplitSummary s;
  for (int c : split) {
    s.total += c;
    s.most = std::max(s.most, c);
    s.what += " " + std::to_string(c);
  }
  return s;
}

// Trains one step per entry of `steps`, in which rank r runs the micro-batches counts[r] ..
// of the global list 0, 1, ..., sum(counts) - 1 (some ranks may have none; one count: this
// process runs them all): what one process depositing all of them gives, at every stage and
// on both communicators. after_step(opt, s) runs after step s.
// How the trainer begins its micro-batches: begin_backward(false) every time (sync only at the
// step), begin_backward(true) for the last of each step only (as documented), or
// begin_backward() every time (the default argument, true).
enum class Begin { NoSync, LastSynced, AlwaysSync };
Trained train_steps(std::shared_ptr<Communicator> comm, Stage stage, const std::vector<std::vector<int>>& steps,
                    MemoryPlan* plan = nullptr,
                    const std::function<void(ShardedOptimizer&, int)>& after_step = nullptr,
                    Begin begin = Begin::NoSync) {
  ShardedOptimizer opt(comm, options(stage, 1024));
  build(opt);
  if (plan != nullptr) *plan = plan_memory(opt.layout(), plan_config(opt.options(), comm->size()));
  const int rank = comm->rank();
  std::vector<StepResult> rs;
  for (int step = 0; step < static_cast<int>(steps.size()); ++step) {
    const std::vector<int>& counts = steps[static_cast<std::size_t>(step)];
    int first = 0;
    for (int r = 0; r < rank; ++r) first += counts[static_cast<std::size_t>(r)];
    const int mine = counts.size() == 1 ? counts[0] : counts[static_cast<std::size_t>(rank)];
    for (int q = 0; q < mine; ++q) {
      if (begin == Begin::AlwaysSync) opt.begin_backward();
      else opt.begin_backward(begin == Begin::LastSynced && q + 1 == mine);
      for (std::size_t i = std::size(kSizes); i-- > 0;) {
        std::span<float> g = opt.grad(i);
        for (std::size_t j = 0; j < g.size(); ++j) g[j] = grad_value(step, first + q, i, j, -1);
        opt.grad_ready(i);
      }
    }
    rs.push_back(opt.step());
    if (after_step) after_step(opt, step);
  }
  return snapshot(opt, rs);
}

// Two steps of the same split.
Trained train_split(std::shared_ptr<Communicator> comm, Stage stage, const std::vector<int>& counts,
                    MemoryPlan* plan = nullptr) {
  return train_steps(std::move(comm), stage, {counts, counts}, plan);
}

// Two steps of the packed exchange: the first through the wire buffer (8 bytes per element);
// on shared memory the words then move into a window and the second step's owners read every
// rank's words and last micro-batch in place (12 bytes per element, one
// reduce_scatter_combine_pair per bucket); plain MPI keeps the wire buffer.
void expect_packed_bytes(const CountingComm& counting, const MemoryPlan& plan, MpiCommKind kind,
                         const std::string& what, int most = 2) {
  const bool shm = kind == MpiCommKind::SharedMemory && counting.size() > 1;
  ExactStep first;
  first.most_micro_batches = most;
  first.fastest = ExactPath::Packed;
  ExactStep second = first;
  second.words_shared = shm;
  const ExactStepPlan a = plan_exact_step(plan, first), b = plan_exact_step(plan, second);
  EXPECT_EQ(a.path, ExactPath::Packed) << what;
  EXPECT_EQ(b.path, shm ? ExactPath::PackedInPlace : ExactPath::Packed) << what;
  EXPECT_EQ(counting.combine_bytes, a.wire_bytes + b.wire_bytes) << what;
  EXPECT_EQ(a.wire_bytes, plan.reduce_bytes_accumulated) << what;
  EXPECT_EQ(b.wire_bytes, shm ? plan.reduce_bytes_in_place : plan.reduce_bytes_accumulated) << what;
  EXPECT_EQ(counting.combine_pairs, shm ? static_cast<int>(plan.num_buckets) : 0) << what;
}

// The planner's step of `most` micro-batches on the busiest rank (plan_exact_step), against
// what two such steps moved through `counting` and what the optimizer holds after them
// (`grads`: its Grads bytes): the path's wire bytes through the exchanges or the integer
// reductions, and the accumulator on top of the plan (`busiest`: this rank ran `most`).
void expect_planned_step(const CountingComm& counting, const MemoryPlan& plan, MpiCommKind kind, int most,
                         ExactPath fastest, std::size_t grads, const std::string& what, bool busiest = true) {
  ExactStep st;
  st.most_micro_batches = most;
  st.fastest = fastest;
  st.exchanges = !counting.refuse_combine;
  const ExactStepPlan p = plan_exact_step(plan, st);
  if (p.path == ExactPath::TwoPhase) {
    EXPECT_EQ(counting.combine_bytes, 0u) << what;
    EXPECT_EQ(counting.int_bytes, 2 * p.wire_bytes) << what;
    EXPECT_EQ(p.wire_bytes, plan.reduce_bytes_two_phase) << what;
  } else {
    EXPECT_EQ(counting.int_bytes, 0u) << what;
  }
  if (p.path == ExactPath::Direct) EXPECT_EQ(counting.combine_bytes, 2 * p.wire_bytes) << what;
  if (p.path == ExactPath::Packed) expect_packed_bytes(counting, plan, kind, what, most);
  // After the first packed step the words are shared (shared memory, several ranks). The
  // busiest rank holds the larger planned accumulator of the two steps; another at most that.
  ExactStep second = st;
  second.words_shared = kind == MpiCommKind::SharedMemory && counting.size() > 1 && p.path == ExactPath::Packed;
  const std::size_t held = std::max(p.accumulator_bytes, plan_exact_step(plan, second).accumulator_bytes);
  if (busiest) EXPECT_EQ(grads, plan[MemCategory::Grads] + held) << what << " (" << exact_path_name(p.path) << ")";
  else EXPECT_LE(grads, plan[MemCategory::Grads] + held) << what << " (" << exact_path_name(p.path) << ")";
}

}  // namespace

// The direct exchange (one micro-batch per rank) and the two-phase method
// (SHARDOPT_REPRO_EXCHANGE=two-phase) give the same bits as one process that deposits every
// micro-batch into its bins, at every stage, on plain MPI and shared memory; each moves the
// bytes the planner says (4 and 9 per element), and the direct one no integer reductions.
TEST(Reproducible, DirectExchangeAndTwoPhaseGiveTheSameBitsAndTheirBytes) {
  auto w = mpi(MpiCommKind::Plain);
  const int world = w->size();
  const Trained one = train_split(make_single_process_communicator(), Stage::Zero1, {world});
  for (MpiCommKind kind : {MpiCommKind::Plain, MpiCommKind::SharedMemory})
    for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2, Stage::Zero3})
      for (const char* method : {"direct", "packed", "two-phase"}) {
        const std::string what = std::string(kind == MpiCommKind::Plain ? "mpi " : "shm ") +
                                 stage_name(stage) + " " + method;
        const EnvScope env("SHARDOPT_REPRO_EXCHANGE", method);
        const bool two_phase = std::string(method) == "two-phase";
        const bool packed = std::string(method) == "packed";
        auto counting = std::make_shared<CountingComm>(mpi(kind));
        MemoryPlan plan;
        const Trained got =
            train_split(counting, stage, std::vector<int>(static_cast<std::size_t>(world), 1), &plan);
        expect_same(got, one, what);
        if (HasFatalFailure()) return;
        // Two steps; data-parallel ranks get the whole bucket: the combine's blocks, then the
        // all-gather of the results (not counted here) where the two-phase method all-reduces.
        expect_planned_step(*counting, plan, kind, 1,
                            two_phase ? ExactPath::TwoPhase : packed ? ExactPath::Packed : ExactPath::Direct,
                            got.grads_bytes, what);
        if (!two_phase && !packed) EXPECT_EQ(counting->combine_bytes, 2 * plan.reduce_bytes) << what;
      }
  // A communicator that cannot exchange raw values: the two-phase method, the same bits.
  {
    auto counting = std::make_shared<CountingComm>(mpi(MpiCommKind::SharedMemory));
    counting->refuse_combine = true;
    MemoryPlan plan;
    const Trained got = train_split(counting, Stage::Zero1, std::vector<int>(static_cast<std::size_t>(world), 1), &plan);
    expect_same(got, one, "shm zero-1, no direct exchange");
    expect_planned_step(*counting, plan, MpiCommKind::SharedMemory, 1, ExactPath::Direct, got.grads_bytes,
                        "shm zero-1, no direct exchange");
    EXPECT_EQ(counting->int_bytes, 2 * 9 * plan.padded_elems);
  }
  // Two simulated nodes (the hierarchical communicator hands the exchange to plain MPI).
  if (world >= 2) {
    auto counting = std::make_shared<CountingComm>(
        make_mpi_communicator(MPI_COMM_WORLD, MpiCommOptions{MpiCommKind::SharedMemory, 2, 0}));
    expect_same(train_split(counting, Stage::Zero2, std::vector<int>(static_cast<std::size_t>(world), 1)),
                one, "shm hierarchical zero-2 direct");
    EXPECT_EQ(counting->int_bytes, 0u);
    EXPECT_GT(counting->combine_bytes, 0u);
  }
}

// Uneven micro-batch counts, including ranks with none: the same bits as one process. With
// at most one per rank the direct exchange runs (an idle rank contributes zeros); with more
// on some rank, the two-phase method.
TEST(Reproducible, UnevenMicroBatchCountsIncludingNone) {
  auto w = mpi(MpiCommKind::Plain);
  const int world = w->size();
  std::vector<std::vector<int>> splits;
  if (world == 1) splits = {{0}, {3}};
  if (world == 2) splits = {{1, 0}, {0, 1}, {3, 0}, {2, 5}};
  if (world == 3) splits = {{1, 0, 1}, {0, 4, 1}, {2, 0, 0}};
  if (world == 4) splits = {{0, 1, 1, 1}, {1, 0, 0, 0}, {3, 0, 2, 1}, {0, 0, 0, 0}};
  for (const std::vector<int>& split : splits) {
    const auto [total, most, what] = summarize(split);
    const Trained one = train_split(make_single_process_communicator(), Stage::Zero1, {total});
    for (MpiCommKind kind : {MpiCommKind::Plain, MpiCommKind::SharedMemory})
      for (Stage stage : {Stage::Zero1, Stage::Zero3}) {
        expect_same(train_split(mpi(kind), stage, split), one,
                    what + (kind == MpiCommKind::Plain ? " mpi " : " shm ") + stage_name(stage));
        if (HasFatalFailure()) return;
      }
  }
}

// The compact accumulation (issue 30 item 3: the packed words are the accumulator) and its
// limit: up to 63 micro-batches on every rank stay in the packed words and take the packed
// exchange (8 bytes per element on the wire, no integer reductions); 64 or more on some rank
// widen that rank's words into the bins and every rank takes the two-phase method (9 bytes).
// Uneven counts, ranks with none, every stage, both communicators: the bits of one process
// that deposits all of them (itself packed up to 63, widened past).
TEST(Reproducible, CompactAccumulationUpToAndPastTheLimit) {
  auto w = mpi(MpiCommKind::Plain);
  const int world = w->size();
  std::vector<std::vector<int>> splits;
  if (world == 1) splits = {{2}, {63}, {64}, {65}};
  if (world == 2) splits = {{63, 0}, {63, 64}, {2, 3}, {1, 65}};
  if (world == 3) splits = {{63, 1, 0}, {64, 2, 63}, {0, 2, 5}};
  if (world == 4) splits = {{2, 0, 63, 1}, {1, 64, 0, 2}, {3, 3, 3, 3}};
  for (const std::vector<int>& split : splits) {
    const auto [total, most, what] = summarize(split);
    const Trained one = train_split(make_single_process_communicator(), Stage::Zero1, {total});
    for (MpiCommKind kind : {MpiCommKind::Plain, MpiCommKind::SharedMemory})
      for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2, Stage::Zero3}) {
        const std::string at = what + (kind == MpiCommKind::Plain ? " mpi " : " shm ") + stage_name(stage);
        auto counting = std::make_shared<CountingComm>(mpi(kind));
        MemoryPlan plan;
        const Trained got = train_split(counting, stage, split, &plan);
        expect_same(got, one, at);
        if (HasFatalFailure()) return;
        // Two steps of the path the counts call for, its bytes and its accumulator.
        const int mine = split.size() == 1 ? split[0] : split[static_cast<std::size_t>(w->rank())];
        expect_planned_step(*counting, plan, kind, most, ExactPath::Direct, got.grads_bytes, at, mine == most);
        EXPECT_EQ(plan_exact_step(plan, ExactStep{most}).path,
                  most > cpu::kPackedMaxMicroBatches ? ExactPath::TwoPhase : ExactPath::Packed) << at;
      }
  }
}

// The owners' in-place deposit of the last micro-batch (ExactGrads::reduce_packed with
// shared words): after the first packed step the words move into a window (shared memory,
// more than one rank), and every later packed step reads every rank's words and last
// micro-batch in place. Steps that change what each rank holds: a rank with none after
// depositing in the step before (its stale words must count as empty), a rank past 63 (every rank widens; the window goes on every
// rank together and the memory is the bins' again), packed again (a new window), the direct
// exchange, and ranks with one micro-batch next to one with two. The bits of one process
// every step, the planner's bytes and memory, and none of it on plain MPI or with
// SHARDOPT_REPRO_EXCHANGE=packed-wire.
TEST(Reproducible, OwnersDepositTheLastMicroBatchInPlace) {
  auto w = mpi(MpiCommKind::Plain);
  const int world = w->size();
  const auto all = [&](int c) { return std::vector<int>(static_cast<std::size_t>(world), c); };
  std::vector<int> none_first = all(3), past = all(1), two_first = all(1);
  none_first[0] = 0;
  past[static_cast<std::size_t>(world - 1)] = 64;
  two_first[0] = 2;
  const std::vector<std::vector<int>> steps = {all(2), all(3), none_first, past, all(2), all(1), two_first};
  // In which steps the owners deposit in place (shared memory): after a packed step, while
  // no rank widened. Rank 0's words hold step 1's state in step 2.
  const std::vector<bool> in_place = {false, true, true, false, false, false, true};
  std::vector<std::vector<int>> totals;
  for (const std::vector<int>& st : steps) totals.push_back({summarize(st).total});
  const Trained one = train_steps(make_single_process_communicator(), Stage::Zero1, totals);
  for (MpiCommKind kind : {MpiCommKind::Plain, MpiCommKind::SharedMemory})
    for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2, Stage::Zero3})
      for (bool wire_only : {false, true}) {
        if (wire_only && (kind == MpiCommKind::Plain || stage != Stage::Zero1)) continue;
        const std::string at = std::string(kind == MpiCommKind::Plain ? "mpi " : "shm ") +
                               stage_name(stage) + (wire_only ? " packed-wire" : "");
        const EnvScope env("SHARDOPT_REPRO_EXCHANGE", wire_only ? "packed-wire" : "auto");
        const bool shares = kind == MpiCommKind::SharedMemory && world > 1 && !wire_only;
        auto counting = std::make_shared<CountingComm>(mpi(kind));
        MemoryPlan plan;
        int pairs = 0, windows = counting->windows;
        const auto check = [&](ShardedOptimizer& opt, int s) {
          const std::string where = at + ", step " + std::to_string(s);
          const int new_windows = counting->windows - windows;  // (step 0: finalize's too)
          windows = counting->windows;
          EXPECT_EQ(counting->combine_pairs - pairs,
                    shares && in_place[static_cast<std::size_t>(s)] ? static_cast<int>(plan.num_buckets) : 0)
              << where;
          pairs = counting->combine_pairs;
          // A window for the words after a packed step through the wire buffer (step 4 is one).
          if (s > 0) EXPECT_EQ(new_windows, shares && s == 4 ? 1 : 0) << where;
          // Memory: the fp32 buffer and the words (every rank, once shared), or the bins.
          const std::size_t grads = opt.memory_report()[MemCategory::Grads];
          const std::size_t fp32 = plan[MemCategory::Grads];
          const std::size_t words = fp32 + exact::packed_bytes(plan.padded_elems);
          const std::size_t bins = fp32 + exact::grads_bytes(plan.padded_elems, plan.bucket_elems);
          // (Without a window the bins stay from step 3 on; a new window replaces them.)
          EXPECT_EQ(grads, s == 3 || (s > 3 && !shares) ? bins : words) << where;
        };
        expect_same(train_steps(counting, stage, steps, &plan, check), one, at);
        if (HasFatalFailure()) return;
      }
}

// Two micro-batches with shared words (shared memory, several ranks, from the step after the
// first packed exchange): a trainer that begins the last micro-batch with sync (as documented)
// has its first held raw in the words' window, and the owners combine both raw values of
// every rank in place (ExactPath::RawPairInPlace: 8 bytes per element, one
// reduce_scatter_combine_pair per bucket, no memory beyond the words' window). Steps that
// change what the ranks hold: every rank two; ranks with one or none next to ranks with two
// (they offer zeros); a rank with three (it deposits: the held values of the others join
// their words and the packed exchange reads them in place); none on a rank; one everywhere
// (the direct exchange); a rank past 63 (every rank widens, the window goes); two again
// (through the wire buffer, then a new window, then held again). The bits of one process,
// each step's path as plan_exact_step predicts it and its bytes, at every stage, with the
// documented calls and with begin_backward() every time (a held micro-batch then settles into
// the words when a third begins); plain MPI never holds (no window). A shared-memory
// communicator whose owners cannot read in place (several nodes: the pair exchange refused)
// settles the held values and takes the packed exchange through the wire buffer.
TEST(Reproducible, TwoMicroBatchesHeldRawMatchOneProcess) {
  auto w = mpi(MpiCommKind::Plain);
  const int world = w->size();
  const auto all = [&](int c) { return std::vector<int>(static_cast<std::size_t>(world), c); };
  std::vector<int> uneven = all(2), three = all(2), none = all(2), past = all(2);
  for (int r = 1; r < world; ++r) uneven[static_cast<std::size_t>(r)] = r % 3 == 1 ? 1 : r % 3 == 2 ? 0 : 2;
  three[0] = 3;
  if (world > 1) none[static_cast<std::size_t>(world - 1)] = 0;
  past[static_cast<std::size_t>(world - 1)] = 64;
  const std::vector<std::vector<int>> steps = {all(2), all(2), uneven, three, all(2),
                                               none,   all(1), past,   all(2), all(2)};
  std::vector<std::vector<int>> totals;
  for (const std::vector<int>& st : steps) totals.push_back({summarize(st).total});
  const Trained one = train_steps(make_single_process_communicator(), Stage::Zero1, totals);
  for (MpiCommKind kind : {MpiCommKind::Plain, MpiCommKind::SharedMemory})
    for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2, Stage::Zero3})
      for (Begin begin : {Begin::LastSynced, Begin::AlwaysSync})
        for (bool refuse : {false, true}) {
          if (refuse && (kind == MpiCommKind::Plain || begin == Begin::AlwaysSync)) continue;
          const std::string at = std::string(kind == MpiCommKind::Plain ? "mpi " : "shm ") + stage_name(stage) +
                                 (begin == Begin::LastSynced ? ", last synced" : ", always synced") +
                                 (refuse ? ", pairs refused" : "");
          const bool shares = kind == MpiCommKind::SharedMemory && world > 1;
          // Each step's path: the words are shared after a packed step, until a rank widens.
          const std::vector<ExactPath> path =
              shares ? std::vector<ExactPath>{ExactPath::Packed, ExactPath::RawPairInPlace, ExactPath::RawPairInPlace,
                                              ExactPath::PackedInPlace, ExactPath::RawPairInPlace,
                                              ExactPath::RawPairInPlace, ExactPath::Direct, ExactPath::TwoPhase,
                                              ExactPath::Packed, ExactPath::RawPairInPlace}
                     : std::vector<ExactPath>{ExactPath::Packed, ExactPath::Packed, ExactPath::Packed,
                                              ExactPath::Packed, ExactPath::Packed, ExactPath::Packed,
                                              ExactPath::Direct, ExactPath::TwoPhase, ExactPath::Packed,
                                              ExactPath::Packed};
          const EnvScope env("SHARDOPT_REPRO_EXCHANGE", "auto");
          auto counting = std::make_shared<CountingComm>(mpi(kind));
          counting->refuse_pairs = refuse;
          MemoryPlan plan;
          int pairs = 0;
          std::size_t bytes = 0;
          const auto check = [&](ShardedOptimizer& opt, int s) {
            const std::string where = at + ", step " + std::to_string(s);
            const ExactPath planned = path[static_cast<std::size_t>(s)];
            const std::vector<int>& split = steps[static_cast<std::size_t>(s)];
            ExactStep st;
            st.most_micro_batches = summarize(split).most;
            st.words_shared = planned == ExactPath::RawPairInPlace || planned == ExactPath::PackedInPlace;
            EXPECT_EQ(plan_exact_step(plan, st).path, planned)
                << where << ": planned " << exact_path_name(plan_exact_step(plan, st).path);
            // Refused in place: the packed exchange through the wire buffer (not planned).
            const bool in_place = planned == ExactPath::RawPairInPlace || planned == ExactPath::PackedInPlace;
            const ExactPath want = refuse && in_place ? ExactPath::Packed : planned;
            if (refuse && in_place) st.words_shared = false;
            const ExactStepPlan p = plan_exact_step(plan, st);
            ASSERT_EQ(p.path, want) << where;
            EXPECT_EQ(counting->combine_pairs - pairs, in_place && !refuse ? static_cast<int>(plan.num_buckets) : 0)
                << where;
            if (want != ExactPath::TwoPhase)
              EXPECT_EQ(counting->combine_bytes - bytes, p.wire_bytes) << where << " (" << exact_path_name(want) << ")";
            if (want == ExactPath::RawPairInPlace) EXPECT_EQ(p.wire_bytes, 8 * plan.padded_elems) << where;
            pairs = counting->combine_pairs;
            bytes = counting->combine_bytes;
            // Memory: the fp32 buffer and the words (their window holds the held values), or
            // the bins from the step past 63 until a new window replaces them.
            // (Every rank deposits or holds in step 0, which allocates its words.)
            const std::size_t grads = opt.memory_report()[MemCategory::Grads];
            const std::size_t fp32 = plan[MemCategory::Grads];
            const bool bins = s == 7 || (s > 7 && !shares);
            EXPECT_EQ(grads, fp32 + (bins ? exact::grads_bytes(plan.padded_elems, plan.bucket_elems)
                                          : exact::packed_bytes(plan.padded_elems)))
                << where;
          };
          const std::vector<std::vector<int>>& run = world == 1 ? totals : steps;
          expect_same(train_steps(counting, stage, run, &plan, check, begin), one, at);
          if (HasFatalFailure()) return;
        }
}

// Stage 2's sharded exact accumulation (BufferPlan::exact_sharded: the staged scheme, each
// micro-batch's buckets exchanged raw to their owners, which deposit into packed words of
// their slice only, widened into bins past 63 values per element): 1, 2 and 4 micro-batches
// per rank, uneven counts (ranks with none send zeros in every round), and rounds up to and
// past the words' limit (ranks times rounds 63, 64 and more: 2 ranks 31 and 32 rounds, 3
// ranks 21 and 22, 4 ranks 15 and 16) give the bits of one process, on plain MPI and shared
// memory, with 4 bytes per element per round (one round per micro-batch of the rank with the
// most), no integer reductions, and the Grads memory of the plan (the bins past the limit).
TEST(Reproducible, Stage2ShardedEachMicroBatchMatchesOneProcess) {
  const EnvScope opt_in("SHARDOPT_REPRO_EXCHANGE", "sharded");
  auto w = mpi(MpiCommKind::Plain);
  const int world = w->size();
  std::vector<std::vector<int>> splits;
  for (int per : {1, 2, 4}) splits.push_back(std::vector<int>(static_cast<std::size_t>(world), per));
  if (world == 2) splits.insert(splits.end(), {{1, 0}, {0, 3}, {2, 5}, {31, 0}, {3, 32}, {40, 33}});
  if (world == 3) splits.insert(splits.end(), {{1, 0, 1}, {0, 4, 1}, {2, 0, 0}, {21, 0, 2}, {1, 22, 0}});
  if (world == 4) splits.insert(splits.end(), {{0, 1, 1, 1}, {3, 0, 2, 1}, {0, 0, 0, 0}, {15, 1, 0, 15}, {0, 16, 2, 1}});
  for (const std::vector<int>& split : splits) {
    const auto [total, most, what] = summarize(split);
    const Trained one = train_split(make_single_process_communicator(), Stage::Zero1, {total});
    for (MpiCommKind kind : {MpiCommKind::Plain, MpiCommKind::SharedMemory})
     for (Stage stage : {Stage::Zero2, Stage::Zero3}) {
      const std::string at = what + (kind == MpiCommKind::Plain ? " mpi " : " shm ") + stage_name(stage);
      auto counting = std::make_shared<CountingComm>(mpi(kind));
      MemoryPlan plan;
      const Trained got = train_split(counting, stage, split, &plan);
      expect_same(got, one, at);
      if (HasFatalFailure()) return;
      if (world == 1) continue;  // one rank keeps the full buffer: the full-buffer path
      EXPECT_TRUE(plan.staged) << at << ": the sharded path must run";
      EXPECT_EQ(counting->int_bytes, 0u) << at;
      EXPECT_EQ(counting->combine_bytes,
                2 * static_cast<std::size_t>(std::max(most, 1)) * plan.reduce_bytes) << at;
      // The owned elements' words (in the plan), replaced by their bins past 63 values each.
      const std::size_t wide = plan_exact_step(plan, ExactStep{most}).accumulator_bytes;
      EXPECT_EQ(wide, std::max(most, 1) * world > cpu::kPackedMaxMicroBatches
                          ? exact::grads_bytes(plan.owned_elems, 0) - exact::packed_bytes(plan.owned_elems)
                          : 0u) << at;
      EXPECT_EQ(got.grads_bytes, plan[MemCategory::Grads] + wide) << at;
    }
  }
}

// A communicator that cannot exchange raw values: the sharded stage 2 refuses with the same
// error on every rank (none hangs); SHARDOPT_REPRO_EXCHANGE=two-phase selects the
// full-buffer path, which gives the bits of one process.
TEST(Reproducible, Stage2ShardedRefusesWithoutTheRawExchange) {
  const EnvScope opt_in("SHARDOPT_REPRO_EXCHANGE", "sharded");
  auto w = mpi(MpiCommKind::Plain);
  const int world = w->size();
  if (world == 1) GTEST_SKIP() << "one rank keeps the full buffer";
  auto counting = std::make_shared<CountingComm>(mpi(MpiCommKind::Plain));
  counting->refuse_combine = true;
  const std::vector<int> split(static_cast<std::size_t>(world), 2);
  try {
    train_split(counting, Stage::Zero2, split);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::Unsupported) << e.what();
  }
  const EnvScope env("SHARDOPT_REPRO_EXCHANGE", "two-phase");
  auto again = std::make_shared<CountingComm>(mpi(MpiCommKind::Plain));
  again->refuse_combine = true;
  expect_same(train_split(again, Stage::Zero2, split),
              train_split(make_single_process_communicator(), Stage::Zero1, {2 * world}),
              "two-phase, no raw exchange");
}

// The sharded stage 2 stages its gradients: forward order is refused like the default's
// staged stage 2 (the same error on every rank; backward order: the other tests).
TEST(Reproducible, Stage2ShardedFollowsTheBackwardOrderContract) {
  const EnvScope opt_in("SHARDOPT_REPRO_EXCHANGE", "sharded");
  auto w = mpi(MpiCommKind::Plain);
  if (w->size() == 1) GTEST_SKIP() << "one rank keeps the full buffer";
  ShardedOptimizer opt(w, options(Stage::Zero2, 1024));
  build(opt);
  ASSERT_TRUE(plan_memory(opt.layout(), plan_config(opt.options(), w->size())).staged);
  opt.begin_backward(true);
  const std::size_t last = std::size(kSizes) - 1;
  // The last parameter lies in the first bucket (buckets follow backward order).
  ASSERT_GT(opt.layout().param(0).buckets.begin, opt.layout().param(last).buckets.end - 1);
  opt.grad(0)[0] = 1.0f;  // forward order: every earlier bucket is exchanged now
  try {
    opt.grad(last)[0] = 1.0f;  // its bucket was exchanged when parameter 0's was written
    ADD_FAILURE() << "forward order accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::InvalidState) << e.what();
  }
}

// The sharded stage 2 is opt-in: without SHARDOPT_REPRO_EXCHANGE=sharded stage 2 keeps the
// full buffer (not staged, forward order accepted: test_overlap's GradientOrderReproducible);
// one rank opting in alone is finalize's error on every rank, not a hang.
TEST(Reproducible, Stage2ShardedIsOptInAndAgreed) {
  auto w = mpi(MpiCommKind::Plain);
  {
    ShardedOptimizer opt(w, options(Stage::Zero2, 1024));
    build(opt);
    EXPECT_EQ(plan_memory(opt.layout(), plan_config(opt.options(), w->size())).staged, false);
  }
  if (w->size() == 1) return;
  const EnvScope one(w->rank() == 0 ? "SHARDOPT_REPRO_EXCHANGE" : "SHARDOPT_UNUSED_FOR_THIS_TEST",
                     "sharded");
  ShardedOptimizer opt(w, options(Stage::Zero2, 1024));
  try {
    build(opt);
    ADD_FAILURE() << "ranks disagreeing on SHARDOPT_REPRO_EXCHANGE=sharded were accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("finalize"), std::string::npos) << e.what();
  }
}

// The sharded exact accumulation's gradient memory is the staged default's plus 8 bytes per
// owned element (the packed words), from finalize, equal to the plan before and after steps of several
// micro-batches, and below the full-buffer path's (SHARDOPT_REPRO_EXCHANGE=two-phase) with
// its accumulator.
TEST(Reproducible, Stage2ShardedMemoryEqualsThePlanAndIsBelowTheFullBuffer) {
  const EnvScope opt_in("SHARDOPT_REPRO_EXCHANGE", "sharded");
  auto w = mpi(MpiCommKind::SharedMemory);
  const int world = w->size();
  if (world == 1) GTEST_SKIP() << "one rank keeps the full buffer";
  for (Stage stage : {Stage::Zero2, Stage::Zero3}) {
  SCOPED_TRACE(stage_name(stage));
    const auto make = [&](Reduction reduction) {
    OptimizerOptions o = options(stage, 1024);
    o.reduction = reduction;
    auto opt = std::make_unique<ShardedOptimizer>(w, o);
    build(*opt);
    return opt;
  };
  std::unique_ptr<ShardedOptimizer> sharded = make(Reduction::Reproducible);
  std::unique_ptr<ShardedOptimizer> def = make(Reduction::Default);
  const MemoryPlan ps = plan_memory(sharded->layout(), plan_config(sharded->options(), world));
  const MemoryPlan pd = plan_memory(def->layout(), plan_config(def->options(), world));
  ASSERT_TRUE(ps.staged);
  EXPECT_EQ(ps[MemCategory::Grads], pd[MemCategory::Grads] + 8 * ps.owned_elems);
  EXPECT_EQ(ps[MemCategory::Scratch], pd[MemCategory::Scratch]);  // the staging slots
  for (MemCategory c : {MemCategory::Grads, MemCategory::Scratch})
    EXPECT_EQ(sharded->memory_report()[c], ps[c]);
  // Steps of three micro-batches (accumulated without sync) allocate nothing more than the
  // planner adds for the spill buffer (grad() views of parameter 2, across buckets).
  for (int step = 0; step < 2; ++step) {
    for (int k = 0; k < 3; ++k) {
      sharded->begin_backward(false);
      for (std::size_t i = std::size(kSizes); i-- > 0;) {
        std::span<float> g = sharded->grad(i);
        for (std::size_t j = 0; j < g.size(); ++j) g[j] = grad_value(step, k, i, j, -1);
        sharded->grad_ready(i);
      }
    }
    sharded->step();
  }
  PlanConfig ca = plan_config(sharded->options(), world);
  ca.accumulate_without_sync = true;  // the sharded path never accumulates locally
  ca.grad_views_across_buckets = true;
  const MemoryPlan psa = plan_memory(sharded->layout(), ca);
  EXPECT_EQ(psa[MemCategory::Grads], ps[MemCategory::Grads]);
  EXPECT_GT(psa[MemCategory::Scratch], ps[MemCategory::Scratch]);
  for (MemCategory c : {MemCategory::Grads, MemCategory::Scratch})
    EXPECT_EQ(sharded->memory_report()[c], psa[c]);
  // The full-buffer path, selected explicitly: the fp32 buffer and the 17-byte accumulator.
  const EnvScope env("SHARDOPT_REPRO_EXCHANGE", "two-phase");
  std::unique_ptr<ShardedOptimizer> full = make(Reduction::Reproducible);
  PlanConfig cf = plan_config(full->options(), world);
  cf.accumulate_without_sync = true;
  const MemoryPlan pf = plan_memory(full->layout(), cf);
  EXPECT_FALSE(pf.staged);
  EXPECT_EQ(full->memory_report()[MemCategory::Grads], plan_memory(full->layout(), plan_config(full->options(), world))[MemCategory::Grads]);
  EXPECT_LT(ps[MemCategory::Grads] + ps[MemCategory::Scratch], pf[MemCategory::Grads] + pf[MemCategory::Scratch]);
  EXPECT_LT(ps[MemCategory::Grads], pf[MemCategory::Grads]);
  }
}

// The default reduction is not reproducible across rank counts on these gradients: the check
// above would catch a reproducible mode that quietly used fp32 sums (one rank: nothing to
// compare, the launch at 1 rank skips).
TEST(Reproducible, DefaultReductionDiffersAcrossRankCounts) {
  auto w = mpi(MpiCommKind::Plain);
  if (w->size() == 1) GTEST_SKIP() << "needs 2 or more ranks";
  auto run_default = [&](std::shared_ptr<Communicator> comm) {
    OptimizerOptions o = options(Stage::Zero1, 1024);
    o.reduction = Reduction::Default;
    ShardedOptimizer opt(std::move(comm), o);
    build(opt);
    std::vector<StepResult> rs{train_step(opt, 0, Assign::Blocked, -1)};
    return snapshot(opt, rs);
  };
  const Trained one = run_default(make_single_process_communicator());
  const Trained many = run_default(w);
  std::size_t differ = 0;
  for (std::size_t i = 0; i < std::size(kSizes); ++i)
    for (std::size_t j = 0; j < kSizes[i]; ++j)
      differ += one.master[i][j] != many.master[i][j] || one.m[i][j] != many.m[i][j];
  EXPECT_GT(differ, 0u) << "fp32 sums over different groupings agreed everywhere";
}

// Saved at W ranks (stage 2) after two steps, resumed on one process (stage 1) for two more,
// and saved on one process, resumed at W ranks (stage 3): both equal the 4-step reference.
TEST(Reproducible, CheckpointsResumeAtAnotherRankCount) {
  const Trained& want = reference();
  auto w = mpi(MpiCommKind::Plain);
  const test::SharedDir shared(*w);  // removed at the end (collective)
  const fs::path& dir = shared.path();
  std::vector<StepResult> results;
  {
    ShardedOptimizer opt(w, options(Stage::Zero2, 1024));
    build(opt);
    for (int s = 0; s < 2; ++s) results.push_back(train_step(opt, s, Assign::RoundRobin, 1));
    save_checkpoint(opt, dir / "w");
  }
  {
    ShardedOptimizer one(make_single_process_communicator(), options(Stage::Zero1, 4096));
    build(one);
    load_checkpoint(one, dir / "w");
    std::vector<StepResult> rs = results;
    for (int s = 2; s < 4; ++s) rs.push_back(train_step(one, s, Assign::Blocked, 1));
    expect_same(snapshot(one, rs), want, "saved at W, resumed at 1");
    if (w->rank() == 0) {  // the single process saves alone
      ShardedOptimizer again(make_single_process_communicator(), options(Stage::Zero1, 4096));
      build(again);
      load_checkpoint(again, dir / "w");
      save_checkpoint(again, dir / "one");
    }
  }
  w->barrier();
  {
    ShardedOptimizer opt(w, options(Stage::Zero3, 1024));
    build(opt);
    load_checkpoint(opt, dir / "one");
    std::vector<StepResult> rs = results;
    for (int s = 2; s < 4; ++s) rs.push_back(train_step(opt, s, Assign::Blocked, 1));
    expect_same(snapshot(opt, rs), want, "saved at 1, resumed at W (stage 3)");
  }
}

TEST(Reproducible, BadOptionsAreTheSameErrorOnEveryRank) {
  auto w = mpi(MpiCommKind::Plain);
  OptimizerOptions o = options(Stage::Zero2, 1024);
  o.reduce_dtype = DType::BF16;
  try {
    ShardedOptimizer opt(w, o);
    FAIL() << "a bf16 wire was accepted in reproducible mode";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::InvalidArgument);
    EXPECT_NE(std::string(e.what()).find("reduce_dtype F32"), std::string::npos) << e.what();
  }
  // One rank asks for reproducible mode, the others do not: finalize's layout check.
  OptimizerOptions mixed = options(Stage::Zero1, 1024);
  if (w->rank() != 0) mixed.reduction = Reduction::Default;
  if (w->size() > 1) {
    ShardedOptimizer opt(w, mixed);
    opt.add_param("p", 100);
    EXPECT_THROW(opt.finalize(), Error);
  }
}

// More micro-batches than the int64 sum holds: every rank gets the same error at the step,
// nothing is updated, and zero_grad() recovers.
TEST(Reproducible, TooManyMicroBatchesIsAnError) {
  auto w = mpi(MpiCommKind::Plain);
  ShardedOptimizer opt(w, options(Stage::Zero1, 1024));
  opt.add_param("p", 64);
  opt.finalize();
  const int per_rank = static_cast<int>(exact::kMaxContributions / w->size()) + 1;
  for (int k = 0; k < per_rank; ++k) opt.begin_backward(false);
  try {
    opt.step();
    FAIL() << "the step went ahead";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::InvalidArgument);
    EXPECT_NE(std::string(e.what()).find("micro-batches"), std::string::npos) << e.what();
  }
  EXPECT_EQ(opt.step_count(), 0);
  opt.zero_grad();
  opt.begin_backward(false);
  opt.grad(0)[0] = 1.0f;
  EXPECT_EQ(opt.step().step, 1);
}

TEST(Reproducible, PlannerCountsTheAccumulatorAndTheWire) {
  FlatLayout l;
  l.add("a", 10000, 0, 0);
  l.add("b", 3000, 0, 0);
  PlanConfig c;
  c.stage = Stage::Zero2;
  c.world_size = 2;
  c.bucket_elems = 4096;
  const MemoryPlan d = plan_memory(l, c);
  c.reduction = Reduction::Reproducible;
  const MemoryPlan r = plan_memory(l, c);
  EXPECT_EQ(d.reduce_bytes, d.padded_elems * 4);
  EXPECT_EQ(r.reduce_bytes, r.padded_elems * 4);  // one micro-batch per rank: raw fp32 values
  EXPECT_EQ(r.reduce_bytes_accumulated, r.padded_elems * 8);  // the packed exchange
  EXPECT_EQ(d.reduce_bytes_accumulated, d.reduce_bytes);
  EXPECT_FALSE(r.staged);  // the full fp32 buffer stays
  // One micro-batch per rank needs only the fp32 buffer; the accumulator comes with several.
  EXPECT_EQ(r[MemCategory::Grads], r.padded_elems * 4);
  c.accumulate_without_sync = true;
  const MemoryPlan ra = plan_memory(l, c);
  // The compact accumulator: the packed words, 8 bytes per element.
  EXPECT_EQ(ra[MemCategory::Grads], ra.padded_elems * (4 + 8));
  // What finalize allocates is what the planner says.
  auto w = make_single_process_communicator();
  OptimizerOptions o = options(Stage::Zero2, 4096);
  ShardedOptimizer opt(w, o);
  opt.add_param("a", 10000);
  opt.add_param("b", 3000);
  opt.finalize();
  const MemoryPlan p1 = plan_memory(opt.layout(), plan_config(o, 1));
  EXPECT_EQ(opt.memory_report()[MemCategory::Grads], p1[MemCategory::Grads]);
  // A step of one micro-batch allocates nothing more; the first step of two allocates the
  // accumulator, which is what the planner adds for accumulate_without_sync.
  opt.begin_backward(false);
  opt.grad(0)[0] = 1.0f;
  opt.step();
  EXPECT_EQ(opt.memory_report()[MemCategory::Grads], p1[MemCategory::Grads]);
  for (int k = 0; k < 2; ++k) {
    opt.begin_backward(false);
    opt.grad(0)[0] = 1.0f;
  }
  opt.step();
  PlanConfig ca = plan_config(o, 1);
  ca.accumulate_without_sync = true;
  const MemoryPlan pa = plan_memory(opt.layout(), ca);
  EXPECT_EQ(opt.memory_report()[MemCategory::Grads], pa[MemCategory::Grads]);
  EXPECT_EQ(pa[MemCategory::Grads], p1[MemCategory::Grads] + exact::packed_bytes(pa.padded_elems));
  // Up to 63 micro-batches the words suffice; the 64th widens them into the bins
  // (BufferPlan::exact_wide), and the words are released: exactly the bins' bytes remain.
  for (int m : {63, 64}) {
    for (int k = 0; k < m; ++k) {
      opt.begin_backward(false);
      opt.grad(0)[0] = 1.0f;
    }
    opt.step();
    const std::size_t accumulator =
        m <= cpu::kPackedMaxMicroBatches ? exact::packed_bytes(pa.padded_elems)
                                         : exact::grads_bytes(pa.padded_elems, pa.bucket_elems);
    EXPECT_EQ(opt.memory_report()[MemCategory::Grads], p1[MemCategory::Grads] + accumulator) << m;
    const BufferPlan bp = plan_buffers(opt.layout(), o.stage, o.param_dtype, o.buckets_in_flight,
                                       o.units_in_flight, o.reduction);
    EXPECT_TRUE(bp.exact_compact);
    EXPECT_EQ(bp.exact.bytes, exact::packed_bytes(pa.padded_elems));
    EXPECT_EQ(bp.exact_wide.bytes, exact::grads_bytes(pa.padded_elems, pa.bucket_elems));
  }
}

// ---- the primitives --------------------------------------------------------------------

TEST(ExactSum, ToFloatRoundsOnceToNearestEven) {
  // long double holds n exactly (64-bit significand) and scales exactly; one rounding.
  auto want_of = [](std::int64_t n, int e) { return static_cast<float>(std::ldexp(static_cast<long double>(n), e)); };
  std::mt19937_64 rng(7);
  for (int t = 0; t < 200000; ++t) {
    std::int64_t n = static_cast<std::int64_t>(rng() >> (1 + rng() % 63));
    if (rng() & 1) n = -n;
    const int e = static_cast<int>(rng() % 400) - 250;  // subnormal, normal and overflow
    const float got = cpu::exact_to_float(n, e);
    ASSERT_EQ(std::bit_cast<std::uint32_t>(got), std::bit_cast<std::uint32_t>(want_of(n, e)))
        << n << " * 2^" << e;
  }
  // Wide integers on, just above and just below a tie of the rounding to 24 bits: the bits
  // below 2^50 that a plain conversion to double would drop decide them.
  for (int p = 40; p <= 62; ++p)
    for (std::int64_t d : {std::int64_t{-1}, std::int64_t{0}, std::int64_t{1}, std::int64_t{4097}})
      for (std::int64_t sign : {std::int64_t{1}, std::int64_t{-1}})
        for (int e : {-150, -140, 0, 60}) {
          const std::int64_t n = sign * ((std::int64_t{1} << p) + (std::int64_t{1} << (p - 24)) + d);
          ASSERT_EQ(std::bit_cast<std::uint32_t>(cpu::exact_to_float(n, e)),
                    std::bit_cast<std::uint32_t>(want_of(n, e)))
              << n << " * 2^" << e;
        }
  EXPECT_EQ(cpu::exact_to_float(1, -150), 0.0f);  // a tie to even: 0
  EXPECT_EQ(cpu::exact_to_float(3, -150), std::ldexp(1.0f, -148));
  EXPECT_EQ(cpu::exact_to_float(std::numeric_limits<std::int64_t>::min(), 0), -0x1p63f);
  EXPECT_TRUE(std::isinf(cpu::exact_to_float(1, 128)));
}

TEST(ExactSum, LevelsHoldTheirValues) {
  for (float v : {std::ldexp(1.0f, -149), 1e-30f, 1.0f, 3e38f, std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::min()}) {
    const int l = exact::level_of(v);
    ASSERT_GE(l, 1);
    ASSERT_LE(l, exact::kMaxLevel);
    EXPECT_LT(std::fabs(static_cast<double>(v)), std::ldexp(1.0, exact::bin_exponent(l) + exact::kBinBits - 1)) << v;
    if (l > 1) EXPECT_GE(std::fabs(static_cast<double>(v)), std::ldexp(1.0, exact::bin_exponent(l - 1) + exact::kBinBits - 1)) << v;
  }
}

// The accumulator against an exact long-double sum: any order, any grouping, the same bits;
// error within the bound of exact_sum.hpp, and no worse than fp32 summation on average.
TEST(ExactSum, OrderFreeAndWithinTheBound) {
  constexpr std::size_t kN = 4096;
  constexpr int kValues = 16;
  std::mt19937_64 rng(11);
  // Element j's values span 2^(base_j - 20) .. 2^(base_j + 10): 30 bits plus 24 of
  // significand fit long double's 64 exactly, with room for the 16-term sum.
  std::vector<std::vector<float>> vals(kValues, std::vector<float>(kN));
  for (std::size_t j = 0; j < kN; ++j) {
    const int base = static_cast<int>(rng() % 200) - 100;
    for (int k = 0; k < kValues; ++k) {
      const float m = 1.0f + static_cast<float>(rng() & 0xffffff) * 0x1p-24f;
      const float v = std::ldexp(m, base - 20 + static_cast<int>(rng() % 31));
      vals[static_cast<std::size_t>(k)][j] = (rng() & 1) ? -v : v;
    }
  }
  auto comm = make_single_process_communicator();
  const std::unique_ptr<Backend> cpu = make_cpu_backend();
  Bucket bk;
  bk.flat = Range{0, kN};
  bk.slice_elems = kN;
  auto run = [&](const std::vector<int>& order) {
    const std::size_t bytes = exact::grads_bytes(kN, kN);
    auto mem = std::make_shared<std::vector<std::int64_t>>(bytes / 8 + 1);
    exact::ExactGrads acc(*cpu, Allocation(mem->data(), bytes, mem, nullptr, MemCategory::Grads), kN, kN);
    for (int k : order) acc.deposit(vals[static_cast<std::size_t>(k)].data(), kN);
    std::vector<float> out(kN);
    acc.reduce(*comm, bk, false, out.data());
    return out;
  };
  std::vector<int> order(kValues);
  for (int k = 0; k < kValues; ++k) order[static_cast<std::size_t>(k)] = k;
  const std::vector<float> first = run(order);
  for (int t = 0; t < 5; ++t) {
    std::shuffle(order.begin(), order.end(), rng);
    const std::vector<float> again = run(order);
    for (std::size_t j = 0; j < kN; ++j)
      ASSERT_EQ(std::bit_cast<std::uint32_t>(again[j]), std::bit_cast<std::uint32_t>(first[j])) << j;
  }
  // One micro-batch packed straight from the fp32 values (no deposit) equals the bins' path.
  {
    const std::size_t bytes = exact::grads_bytes(kN, kN);
    auto mem = std::make_shared<std::vector<std::int64_t>>(bytes / 8 + 1);
    exact::ExactGrads fast(*cpu, Allocation(mem->data(), bytes, mem, nullptr, MemCategory::Grads), kN, kN);
    std::vector<float> g = vals[3];
    fast.reduce(*comm, bk, false, g.data());
    auto mem2 = std::make_shared<std::vector<std::int64_t>>(bytes / 8 + 1);
    exact::ExactGrads binned(*cpu, Allocation(mem2->data(), bytes, mem2, nullptr, MemCategory::Grads), kN, kN);
    binned.deposit(vals[3].data(), kN);
    std::vector<float> zeros(kN, 0.0f);
    binned.reduce(*comm, bk, false, zeros.data());
    for (std::size_t j = 0; j < kN; ++j)
      ASSERT_EQ(std::bit_cast<std::uint32_t>(g[j]), std::bit_cast<std::uint32_t>(zeros[j])) << j;
  }
  double exact_ulps = 0, fp32_ulps = 0;
  for (std::size_t j = 0; j < kN; ++j) {
    long double sum = 0;
    float naive = 0;
    float largest = 0;
    for (int k = 0; k < kValues; ++k) {
      const float v = vals[static_cast<std::size_t>(k)][j];
      sum += v;
      naive += v;
      largest = std::max(largest, std::fabs(v));
    }
    const float want = static_cast<float>(sum);
    const double ulp = std::ldexp(1.0, std::ilogb(std::max(std::fabs(want), std::numeric_limits<float>::min())) - 23);
    // Bound: kValues halves of the low bin (<= 2^-24 * largest each), then half an ulp.
    const double bound = kValues * std::ldexp(static_cast<double>(largest), -exact::kBinBits) + 0.5 * ulp;
    ASSERT_LE(std::fabs(static_cast<double>(first[j]) - static_cast<double>(sum)), bound * (1 + 1e-12)) << j;
    exact_ulps += std::fabs(static_cast<double>(first[j]) - static_cast<double>(want)) / ulp;
    fp32_ulps += std::fabs(static_cast<double>(naive) - static_cast<double>(want)) / ulp;
  }
  EXPECT_LE(exact_ulps, fp32_ulps) << "mean error (ulps) exact " << exact_ulps / kN << ", fp32 "
                                   << fp32_ulps / kN;
}

TEST(ExactSum, SquareSumIsExactAndSplitFree) {
  std::mt19937_64 rng(3);
  std::vector<float> x(10000);
  for (float& v : x) v = std::ldexp(1.0f + static_cast<float>(rng() & 0xffff) * 0x1p-16f, static_cast<int>(rng() % 20) - 10);
  exact::SquareSum whole;
  whole.add(x.data(), x.size());
  long double want = 0;  // squares have 34 significant bits here, over 20 binades: exact
  for (float v : x) want += static_cast<long double>(v) * v;
  EXPECT_EQ(whole.value(), static_cast<double>(want));
  for (std::size_t cut : {std::size_t{1}, std::size_t{4999}, std::size_t{9999}}) {
    exact::SquareSum a, b;
    a.add(x.data(), cut);
    b.add(x.data() + cut, x.size() - cut);
    exact::SquareSum c = a;
    auto comm = make_single_process_communicator();
    c.sum_over_ranks(*comm);  // one rank: unchanged
    EXPECT_EQ(c.value(), a.value());
    a.merge(b);
    EXPECT_EQ(a.value(), whole.value()) << cut;
  }
  const float tiny = std::ldexp(1.0f, -149), huge = std::numeric_limits<float>::max();
  exact::SquareSum s;
  s.add(&tiny, 1);
  s.add(&huge, 1);
  EXPECT_EQ(s.value(), static_cast<double>(huge) * huge);  // tiny^2 is far below half an ulp
  const float nan = std::numeric_limits<float>::quiet_NaN();
  s.add(&nan, 1);
  EXPECT_TRUE(std::isnan(s.value()));
}
