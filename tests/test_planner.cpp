// test_planner.cpp: the memory planner against the accounting of real finalized optimizers,
// in one process: at world 1 with the single-process communicator (and a few steps), and at
// 1-8 ranks for every rank through a communicator that stands for N identical ranks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "shardopt/error.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/planner.hpp"

using namespace shardopt;

namespace {

// N ranks that all hold exactly this process's data, seen from rank `rank`: the metadata
// collectives finalize() makes behave as they would on N identical ranks. Enough to finalize
// (which allocates by size and rank); data collectives are not meant to be used.
class ReplicatedWorld final : public Communicator {
 public:
  ReplicatedWorld(int rank, int size) : rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "replicated"; }
  void all_reduce_sum(void* buf, std::size_t count, CommType type) override {
    if (type == CommType::F64)
      for (std::size_t i = 0; i < count; ++i) static_cast<double*>(buf)[i] *= size_;
    else
      for (std::size_t i = 0; i < count; ++i) static_cast<float*>(buf)[i] *= static_cast<float>(size_);
  }
  std::unique_ptr<CommRequest> start_reduce_scatter_sum(float*, std::size_t, CommType) override {
    unused();
  }
  std::unique_ptr<CommRequest> start_all_reduce_sum(float*, std::size_t, CommType) override {
    unused();
  }
  std::unique_ptr<CommRequest> start_all_gather(void*, std::size_t, CommType) override {
    unused();
  }
  void all_gather_bytes(const void* send, void* recv, std::size_t bytes) override {
    for (int r = 0; r < size_; ++r) std::memcpy(static_cast<char*>(recv) + r * bytes, send, bytes);
  }
  void broadcast_bytes(void*, std::size_t, int) override {}
  void barrier() override {}

 private:
  [[noreturn]] static void unused() { throw Error(Status::Internal, "not for data"); }
  int rank_;
  int size_;
};

struct Config {
  std::vector<std::size_t> sizes;
  Stage stage;
  DType dtype;
  std::size_t bucket;
};

std::string describe(const Config& c, int world, int rank) {
  std::string s = std::string(stage_name(c.stage)) + " " + dtype_name(c.dtype) + " bucket " +
                  std::to_string(c.bucket) + " world " + std::to_string(world) + " rank " +
                  std::to_string(rank) + " sizes";
  for (std::size_t n : c.sizes) s += " " + std::to_string(n);
  return s;
}

std::unique_ptr<ShardedOptimizer> finalized(std::shared_ptr<Communicator> comm, const Config& c) {
  OptimizerOptions o;
  o.stage = c.stage;
  o.param_dtype = c.dtype;
  o.bucket_elems = c.bucket;
  auto opt = std::make_unique<ShardedOptimizer>(std::move(comm), o);
  for (std::size_t i = 0; i < c.sizes.size(); ++i) opt->add_param("p" + std::to_string(i), c.sizes[i]);
  opt->finalize();
  return opt;
}

FlatLayout layout_of(const Config& c) {
  FlatLayout l;
  for (std::size_t i = 0; i < c.sizes.size(); ++i) l.add("p" + std::to_string(i), c.sizes[i], 0);
  return l;
}

void expect_plan_matches(const ShardedOptimizer& opt, const Config& c, int world,
                         const std::string& what) {
  const MemoryPlan plan = plan_memory(layout_of(c), plan_config(opt.options(), world));
  const MemoryReport rep = opt.memory_report();
  for (int k = 0; k < kNumMemCategories; ++k)
    EXPECT_EQ(plan.bytes[k], rep.bytes[k])
        << mem_category_name(static_cast<MemCategory>(k)) << " of " << what;
  EXPECT_EQ(plan.total(), rep.total()) << what;
  EXPECT_EQ(plan.owned_elems, opt.local_size()) << what;
  EXPECT_EQ(plan.padded_elems, opt.layout().padded_size()) << what;
}

// Layouts with odd sizes: single elements, sizes around the 64-element alignment, tensors
// larger than buckets and shards, and random mixes.
std::vector<std::vector<std::size_t>> layouts() {
  std::vector<std::vector<std::size_t>> out = {
      {1}, {63}, {64}, {65}, {1, 1, 1}, {4097, 3, 129}, {1, 7, 300, 5000, 65, 129, 3, 1000},
      {100000}, {128, 128, 128, 128}};
  std::mt19937 rng(12345);
  for (int k = 0; k < 6; ++k) {
    std::vector<std::size_t> sizes(1 + rng() % 12);
    for (std::size_t& n : sizes) n = 1 + rng() % (rng() % 2 ? 200 : 9000);
    out.push_back(sizes);
  }
  return out;
}

std::vector<Config> configs() {
  std::vector<Config> out;
  for (const auto& sizes : layouts())
    for (DType dtype : {DType::BF16, DType::F32}) {
      out.push_back({sizes, Stage::DataParallel, dtype, 1});
      out.push_back({sizes, Stage::Zero1, dtype, 1});
      for (std::size_t bucket : {std::size_t{1}, std::size_t{64}, std::size_t{700},
                                 std::size_t{4096}, std::size_t{1} << 20})
        out.push_back({sizes, Stage::Zero2, dtype, bucket});
      for (std::size_t bucket : {std::size_t{64}, std::size_t{700}, std::size_t{1} << 20})
        out.push_back({sizes, Stage::Zero3, dtype, bucket});
    }
  return out;
}

}  // namespace

TEST(Planner, MatchesAccountingAtWorldOne) {
  for (const Config& c : configs()) {
    auto opt = finalized(make_single_process_communicator(), c);
    expect_plan_matches(*opt, c, 1, describe(c, 1, 0));
  }
}

TEST(Planner, MatchesAccountingOnEveryRankOfOneToEightRanks) {
  for (const Config& c : configs())
    for (int world = 1; world <= 8; ++world)
      for (int rank = 0; rank < world; ++rank) {
        auto opt = finalized(std::make_shared<ReplicatedWorld>(rank, world), c);
        expect_plan_matches(*opt, c, world, describe(c, world, rank));
      }
}

// ZeRO-2 never plans more than ZeRO-1 at the same configuration (it keeps stage 1's full
// buffer where staging would not save memory), and stages until it pays off.
TEST(Planner, Zero2NeverPlansMoreThanZero1) {
  for (const auto& sizes : layouts())
    for (int world = 1; world <= 8; ++world)
      for (std::size_t bucket : {std::size_t{1}, std::size_t{64}, std::size_t{700},
                                 std::size_t{4096}, std::size_t{1} << 20})
        for (int slots : {1, 2, 4}) {
          const FlatLayout l = layout_of(Config{sizes, Stage::Zero1, DType::BF16, bucket});
          PlanConfig c{Stage::Zero1, world, DType::BF16, DType::F32, bucket, slots};
          const MemoryPlan z1 = plan_memory(l, c);
          c.stage = Stage::Zero2;
          const MemoryPlan z2 = plan_memory(l, c);
          EXPECT_LE(z2.total(), z1.total()) << describe({sizes, Stage::Zero2, DType::BF16, bucket},
                                                        world, 0);
          if (world == 1) EXPECT_FALSE(z2.staged);
        }
  // A model of many buckets at 4 ranks stages, and saves most of the gradient memory.
  const MemoryPlan z2 = plan_memory(uniform_layout(1 << 20, 1 << 14),
                                    {Stage::Zero2, 4, DType::BF16, DType::F32, 1 << 16, 2});
  EXPECT_TRUE(z2.staged);
  EXPECT_EQ(z2[MemCategory::Grads], (std::size_t{1} << 20));  // 4 bytes x 2^20 / 4
}

TEST(Planner, StepsAllocateNothingBeyondThePlan) {
  for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2, Stage::Zero3}) {
    const Config c{{1, 7, 300, 5000, 65}, stage, DType::BF16, 700};
    auto opt = finalized(make_single_process_communicator(), c);
    for (int s = 0; s < 3; ++s) {
      for (std::size_t i = c.sizes.size(); i-- > 0;) {
        for (float& g : opt->grad(i)) g = 0.25f;
        opt->grad_ready(i);
      }
      opt->step();
    }
    const MemoryPlan plan = plan_memory(layout_of(c), plan_config(opt->options(), 1));
    const MemoryReport rep = opt->memory_report();
    for (int k = 0; k < kNumMemCategories; ++k) EXPECT_EQ(rep.peak[k], plan.bytes[k]) << k;
  }
}

TEST(Planner, ByteCountsPerStage) {
  // 6400 elements in one tensor, 4 ranks: no padding, 1600 owned.
  const FlatLayout l = uniform_layout(6400, 6400);
  const MemoryPlan dp = plan_memory(l, {Stage::DataParallel, 4, DType::BF16, DType::F32, 1000});
  EXPECT_EQ(dp[MemCategory::Params], 12800u);
  EXPECT_EQ(dp[MemCategory::Grads], 25600u);
  EXPECT_EQ(dp[MemCategory::Master], 25600u);
  EXPECT_EQ(dp[MemCategory::Moments], 51200u);
  EXPECT_EQ(dp[MemCategory::Scratch], 0u);
  const MemoryPlan z1 = plan_memory(l, {Stage::Zero1, 4, DType::BF16, DType::F32, 1000});
  EXPECT_EQ(z1[MemCategory::Grads], 25600u);
  EXPECT_EQ(z1[MemCategory::Master], 6400u);
  EXPECT_EQ(z1[MemCategory::Moments], 12800u);
  const MemoryPlan z2 = plan_memory(l, {Stage::Zero2, 4, DType::F32, DType::F32, 1000, 1});
  EXPECT_EQ(z2[MemCategory::Params], 25600u);
  EXPECT_EQ(z2[MemCategory::Grads], 6400u);
  EXPECT_EQ(z2[MemCategory::Master], 0u);  // the fp32 replica is the master
  // The tensor spans 7 buckets of 1024 (1000 rounded up to 4 x 64; the last holds 256):
  // one staging slot of the largest.
  EXPECT_EQ(z2[MemCategory::Scratch], 4096u);
  EXPECT_EQ(z2.num_buckets, 7u);
  EXPECT_TRUE(z2.staged);
}

TEST(Planner, EqualsTheZeroFormulaWithoutPaddingOrScratch) {
  for (int world : {1, 2, 3, 4, 8, 64})
    for (DType dtype : {DType::BF16, DType::F32})
      for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2}) {
        const std::size_t psi = 64 * 7 * static_cast<std::size_t>(world);  // no padding
        const MemoryPlan p = plan_memory(uniform_layout(psi, psi),
                                         {stage, world, dtype, DType::F32, 64});
        const double formula = zero_formula_bytes(stage, static_cast<double>(psi), world, dtype);
        EXPECT_EQ(static_cast<double>(p.total() - p[MemCategory::Scratch]), formula)
            << stage_name(stage) << " " << dtype_name(dtype) << " world " << world;
      }
}

TEST(Planner, BuiltLayoutMustMatchTheWorld) {
  FlatLayout l = uniform_layout(1000, 100);
  l.build(2, 64);
  // Ten tensors of 100, each in a bucket of its own of 128 elements (2 ranks x 64).
  EXPECT_EQ(plan_memory(l, {Stage::Zero1, 2, DType::BF16, DType::F32, 64}).padded_elems, 1280u);
  EXPECT_THROW(plan_memory(l, {Stage::Zero1, 3, DType::BF16, DType::F32, 64}), Error);
  EXPECT_THROW(plan_memory(l, {Stage::Zero1, 2, DType::BF16, DType::F32, 128}), Error);
}

// The automatic bucket size (bucket_elems 0, the default): an eighth of the model between
// 4096 and 2^20 elements. PyTorch's dist-mnist CNN (21,840 parameters) at stage 2 on 2 ranks
// then stages two buckets of 4096 instead of keeping stage 1's full gradient, as a fixed 2^20
// did (the model in one bucket).
TEST(Planner, AutomaticBucketSizeMakesStage2SaveOnSmallModels) {
  EXPECT_EQ(FlatLayout::auto_bucket_elems(1), 4096u);
  EXPECT_EQ(FlatLayout::auto_bucket_elems(8 * 4096), 4096u);
  EXPECT_EQ(FlatLayout::auto_bucket_elems(8 * 4096 + 1), 4097u);
  EXPECT_EQ(FlatLayout::auto_bucket_elems(8 * 100000), 100000u);
  EXPECT_EQ(FlatLayout::auto_bucket_elems(std::size_t{8} << 20), std::size_t{1} << 20);
  EXPECT_EQ(FlatLayout::auto_bucket_elems(std::size_t{1} << 40), std::size_t{1} << 20);
  EXPECT_EQ(OptimizerOptions{}.bucket_elems, 0u);
  // On a GPU the cap is 2^24 (FlatLayout::auto_bucket_elems: the per-bucket cost measured).
  EXPECT_EQ(auto_bucket_cap(Device::Cpu), std::size_t{1} << 20);
  EXPECT_EQ(auto_bucket_cap(Device::Cuda), std::size_t{1} << 24);
  EXPECT_EQ(FlatLayout::auto_bucket_elems(std::size_t{1} << 30, auto_bucket_cap(Device::Cuda)),
            std::size_t{1} << 24);
  EXPECT_EQ(FlatLayout::auto_bucket_elems(8 * 100000, auto_bucket_cap(Device::Cuda)), 100000u);
  {
    FlatLayout big;
    for (int i = 0; i < 4; ++i) big.add("t" + std::to_string(i), std::size_t{1} << 24, 0);
    PlanConfig cpu{Stage::Zero1, 2, DType::BF16, DType::F32, 0, 2}, gpu = cpu;
    gpu.device = Device::Cuda;
    EXPECT_EQ(plan_memory(big, cpu).num_buckets, 64u);
    EXPECT_EQ(plan_memory(big, gpu).num_buckets, 8u);
    OptimizerOptions o;
    o.device = Device::Cuda;
    EXPECT_EQ(plan_config(o, 2).device, Device::Cuda);
  }
  FlatLayout mnist;
  for (std::size_t n : {200, 10, 5000, 20, 16000, 50, 500, 10}) mnist.add("p" + std::to_string(mnist.num_params()), n, 0);
  const PlanConfig auto1{Stage::Zero1, 2, DType::F32, DType::F32, 0, 2};
  PlanConfig auto2 = auto1, fixed1 = auto1, fixed2 = auto1;
  auto2.stage = fixed2.stage = Stage::Zero2;
  fixed1.bucket_elems = fixed2.bucket_elems = std::size_t{1} << 20;
  // Gradient memory: the gradient buffer and stage 2's staging buckets (scratch).
  const auto grad_bytes = [&](const PlanConfig& c) {
    const MemoryPlan p = plan_memory(mnist, c);
    return p[MemCategory::Grads] + p[MemCategory::Scratch];
  };
  EXPECT_GE(grad_bytes(fixed2), grad_bytes(fixed1)) << "fixed 2^20 buckets: stage 2 saves nothing";
  EXPECT_TRUE(plan_memory(mnist, auto2).staged);
  EXPECT_GE(plan_memory(mnist, auto2).num_buckets, 5u);
  // Its slice (half the gradient) plus two staging buckets of 4096: less than stage 1's.
  EXPECT_LT(grad_bytes(auto2), grad_bytes(auto1));
  PlanConfig four2 = auto2, four1 = auto1;  // at 4 ranks: a quarter plus the two buckets
  four2.world_size = four1.world_size = 4;
  EXPECT_LT(3 * grad_bytes(four2), 2 * grad_bytes(four1));
  FlatLayout built = mnist;
  built.build(2, 0);
  EXPECT_EQ(built.bucket_elems(), 4096u);
}

TEST(Planner, RejectsInvalidConfigurations) {
  const FlatLayout l = uniform_layout(1000, 100);
  try {
    plan_memory(l, {Stage::Zero1, 2, DType::BF16, DType::BF16, 64});
    FAIL() << "a bf16 gradient buffer was planned";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::Unsupported);
  }
  EXPECT_THROW(plan_memory(l, {Stage::Zero1, 0, DType::BF16, DType::F32, 64}), Error);
  EXPECT_THROW(plan_memory(l, {static_cast<Stage>(7), 2, DType::BF16, DType::F32, 64}), Error);
  EXPECT_THROW(plan_memory(FlatLayout{}, {Stage::Zero1, 2, DType::BF16, DType::F32, 64}), Error);
}

TEST(Planner, UniformLayout) {
  const FlatLayout l = uniform_layout(1001, 100);
  ASSERT_EQ(l.num_params(), 11u);
  EXPECT_EQ(l.param(9).numel, 100u);
  EXPECT_EQ(l.param(10).numel, 1u);
  EXPECT_EQ(l.unpadded_size(), 1001u);
  EXPECT_EQ(uniform_layout(1000, 100).num_params(), 10u);
  EXPECT_THROW(uniform_layout(0, 100), Error);
  EXPECT_THROW(uniform_layout(100, 0), Error);
  EXPECT_THROW(uniform_layout(kMaxUniformTensors + 1, 1), Error);
  EXPECT_EQ(uniform_tensor_elems(1000, 100), 100u);
  EXPECT_EQ(uniform_tensor_elems(kMaxUniformTensors * 1000 + 1, 100), 1001u);
}

TEST(Planner, LargestFittingModel) {
  const std::size_t tensor = 5000;
  for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2, Stage::Zero3})
    for (int world : {1, 3, 8})
      for (std::size_t budget : {std::size_t{100000}, std::size_t{3000000}}) {
        const PlanConfig c{stage, world, DType::BF16, DType::F32, 4096};
        const std::size_t best = largest_fitting_psi(budget, c, tensor);
        auto bytes = [&](std::size_t psi) {
          FlatLayout l = uniform_layout(psi, uniform_tensor_elems(psi, tensor));
          if (stage == Stage::Zero3) l = unit_per_tensor(l);  // as largest_fitting_psi plans it
          return plan_memory(l, c).total();
        };
        const std::string what = std::string(stage_name(stage)) + " world " +
                                  std::to_string(world) + " budget " + std::to_string(budget);
        ASSERT_GT(best, 0u) << what;
        EXPECT_LE(bytes(best), budget) << what;
        EXPECT_GT(bytes(best + 1), budget) << what;
      }
  // Not even one element (padded to 64) fits in 100 bytes.
  EXPECT_EQ(largest_fitting_psi(100, {Stage::Zero1, 1, DType::BF16, DType::F32, 64}, 64), 0u);
}

TEST(Planner, Stage2AccumulationWithoutSyncAndSlots) {
  for (int slots : {1, 3}) {
    const Config c{{1, 7, 300, 5000, 65, 129, 3, 1000}, Stage::Zero2, DType::BF16, 700};
    OptimizerOptions o;
    o.stage = c.stage;
    o.bucket_elems = c.bucket;
    o.buckets_in_flight = slots;
    ShardedOptimizer opt(std::make_shared<ReplicatedWorld>(1, 4), o);
    for (std::size_t i = 0; i < c.sizes.size(); ++i) opt.add_param("p" + std::to_string(i), c.sizes[i]);
    opt.finalize();
    PlanConfig pc = plan_config(opt.options(), 4);
    EXPECT_EQ(plan_memory(layout_of(c), pc).total(), opt.memory_report().total());
    opt.begin_backward(false);  // allocates the local accumulation buffer
    pc.accumulate_without_sync = true;
    const MemoryPlan plan = plan_memory(layout_of(c), pc);
    for (int k = 0; k < kNumMemCategories; ++k)
      EXPECT_EQ(plan.bytes[k], opt.memory_report().bytes[k])
          << mem_category_name(static_cast<MemCategory>(k)) << " with " << slots << " slots";
  }
}

// Stage 3 with units (one per tensor): accounting == plan on every rank of 1-8 ranks.
TEST(Planner, Zero3UnitsMatchAccounting) {
  for (const auto& sizes : layouts())
    for (int world : {1, 2, 3, 4, 8})
      for (int in_flight : {1, 2, 3}) {
        OptimizerOptions o;
        o.stage = Stage::Zero3;
        o.bucket_elems = 700;
        o.units_in_flight = in_flight;
        ShardedOptimizer opt(std::make_shared<ReplicatedWorld>(world - 1, world), o);
        for (std::size_t i = 0; i < sizes.size(); ++i) {
          opt.begin_unit();
          opt.add_param("p" + std::to_string(i), sizes[i]);
        }
        opt.finalize();
        const Config c{sizes, Stage::Zero3, DType::BF16, 700};
        const MemoryPlan plan = plan_memory(unit_per_tensor(layout_of(c)), plan_config(o, world));
        for (int k = 0; k < kNumMemCategories; ++k)
          EXPECT_EQ(plan.bytes[k], opt.memory_report().bytes[k])
              << mem_category_name(static_cast<MemCategory>(k)) << " " << describe(c, world, 0);
        EXPECT_EQ(plan.unit_buffers,
                  std::min(in_flight, static_cast<int>(opt.layout().num_units())));
        EXPECT_EQ(plan.unit_elems, opt.layout().max_unit_elems());
      }
}

// Stage 3's per-rank bytes fall as 1/N in every category but the gathered units and the
// staging slots (each a fixed number of units or buckets); without padding they equal the
// ZeRO formula (p + 4 + K) Psi / N plus those buffers.
TEST(Planner, Zero3FallsAsOneOverN) {
  const std::size_t tensor = 4096, psi = 16 * tensor;  // tensors divisible by 8 x 64
  const FlatLayout l = unit_per_tensor(uniform_layout(psi, tensor));
  for (DType dtype : {DType::BF16, DType::F32})
    for (std::size_t n : {1, 2, 4, 8}) {
      const MemoryPlan p =
          plan_memory(l, {Stage::Zero3, static_cast<int>(n), dtype, DType::F32, tensor, 2, 2});
      const std::size_t ps = dtype_size(dtype);
      const std::size_t units = 2 * tensor * ps;  // two gathered tensors
      const std::string what = std::string(dtype_name(dtype)) + " at " + std::to_string(n);
      EXPECT_EQ(p.padded_elems, psi) << what;
      EXPECT_EQ(p[MemCategory::Params], ps * psi / n + units) << what;
      EXPECT_EQ(p[MemCategory::Grads], 4 * psi / n) << what;
      EXPECT_EQ(p[MemCategory::Master], dtype == DType::F32 ? 0 : 4 * psi / n) << what;
      EXPECT_EQ(p[MemCategory::Moments], 8 * psi / n) << what;
      EXPECT_EQ(p[MemCategory::Scratch], n == 1 ? 0 : 2 * 4 * tensor) << what;  // 2 slots
      EXPECT_EQ(static_cast<double>(p.total() - units - p[MemCategory::Scratch]),
                zero_formula_bytes(Stage::Zero3, static_cast<double>(psi), static_cast<double>(n),
                                   dtype))
          << what;
    }
  // Without units the whole model is one unit: every rank gathers all of it.
  const MemoryPlan one = plan_memory(uniform_layout(psi, tensor),
                                     {Stage::Zero3, 4, DType::BF16, DType::F32, tensor, 2, 2});
  EXPECT_EQ(one.unit_buffers, 1);
  EXPECT_EQ(one.unit_elems, psi);
}

// The bytes that cross between nodes per node and step, as a ring between the nodes moves
// them (test_shm_comm's InterNode tests check the communicators count the same): per bucket
// the reduction (twice for data-parallel's all-reduce) and, at stages 1-2, the replica's
// gather, each less the node's part.
TEST(Planner, InternodeBytesPerNodeAndStep) {
  FlatLayout layout;
  for (std::size_t n : {5000, 3000, 9000, 100}) layout.add("p" + std::to_string(layout.num_params()), n, 0);
  PlanConfig c{Stage::Zero1, 4, DType::BF16, DType::F32, 4096, 2};
  EXPECT_EQ(plan_memory(layout, c).internode_bytes, 0u) << "one node";
  c.nodes = 2;
  FlatLayout built = layout;
  built.build(4, 4096);
  std::size_t half = 0;  // elements of every bucket less a node's half
  for (const Bucket& bk : built.buckets()) half += bk.flat.size() - bk.flat.size() / 2;
  EXPECT_EQ(plan_memory(layout, c).internode_bytes, half * (4 + 2));
  c.stage = Stage::Zero2;
  EXPECT_EQ(plan_memory(layout, c).internode_bytes, half * (4 + 2));
  c.stage = Stage::DataParallel;
  EXPECT_EQ(plan_memory(layout, c).internode_bytes, half * 2 * 4);
  c.stage = Stage::Zero3;
  EXPECT_EQ(plan_memory(layout, c).internode_bytes, half * 4) << "the reductions only";
  c.stage = Stage::Zero1;
  c.reduce_dtype = DType::BF16;
  c.param_dtype = DType::F32;
  EXPECT_EQ(plan_memory(layout, c).internode_bytes, half * (2 + 4));
  c.reduce_dtype = DType::F32;
  c.reduction = Reduction::Reproducible;
  EXPECT_EQ(plan_memory(layout, c).internode_bytes, 0u) << "not modelled";
  c.reduction = Reduction::Default;
  c.nodes = 4;  // one rank per node: 3/4 of every bucket
  std::size_t three_quarters = 0;
  for (const Bucket& bk : built.buckets()) three_quarters += bk.flat.size() - bk.flat.size() / 4;
  EXPECT_EQ(plan_memory(layout, c).internode_bytes, three_quarters * (4 + 4));
  c.nodes = 3;
  EXPECT_THROW(plan_memory(layout, c), Error) << "3 nodes do not divide 4 ranks";
}

// Reproducible mode on Device::Cuda takes the CPU's exchanges: with one micro-batch per rank
// no accumulator and 4 wire bytes per padded element (the direct exchange), with several the
// bins (17 bytes per element and one per element of the largest bucket, where the CPU
// accumulates in its packed words, 8 bytes per element), planned with accumulate_without_sync
// as the CPU's, and 8 wire bytes (the packed exchange); stage 3 is refused, as the optimizer
// refuses it.
TEST(Planner, ReproducibleOnTheDevice) {
  FlatLayout layout;
  layout.add("a", 1000, 0);
  layout.add("b", 3001, 0);
  PlanConfig c;
  c.world_size = 2;
  c.bucket_elems = 1024;
  c.stage = Stage::Zero1;
  c.reduction = Reduction::Reproducible;
  const MemoryPlan cpu = plan_memory(layout, c);
  c.accumulate_without_sync = true;
  const MemoryPlan cpu_accumulating = plan_memory(layout, c);
  c.device = Device::Cuda;
  const MemoryPlan gpu_accumulating = plan_memory(layout, c);
  c.accumulate_without_sync = false;
  const MemoryPlan gpu = plan_memory(layout, c);
  EXPECT_EQ(gpu[MemCategory::Grads], cpu[MemCategory::Grads]);
  EXPECT_EQ(cpu_accumulating[MemCategory::Grads], cpu[MemCategory::Grads] + 8 * cpu.padded_elems);
  EXPECT_EQ(gpu_accumulating[MemCategory::Grads], cpu[MemCategory::Grads] + 17 * gpu.padded_elems + gpu.bucket_elems);
  EXPECT_EQ(cpu.reduce_bytes, 4 * gpu.padded_elems);
  EXPECT_EQ(gpu.reduce_bytes, 4 * gpu.padded_elems);
  EXPECT_EQ(gpu.reduce_bytes_accumulated, 8 * gpu.padded_elems);
  EXPECT_EQ(gpu.reduce_bytes_in_place, gpu.reduce_bytes_accumulated) << "the in-place deposit is shared memory's";
  c.stage = Stage::Zero3;
  EXPECT_THROW(plan_memory(layout, c), Error);
  c.device = Device::Cpu;
  EXPECT_NO_THROW(plan_memory(layout, c));
}

// Reproducible mode's path per step (plan_exact_step; the optimizer takes the same, and
// test_reproducible compares the bytes it moves and holds with these): the path the busiest
// rank's micro-batches call for (exact_path_needed: 0 or 1 direct, 2-63 packed, 64 on
// two-phase; SHARDOPT_REPRO_EXCHANGE's fastest path and a communicator without the
// exchanges make it slower, never faster), the in-place deposit where the CPU's words are
// shared, each path's wire bytes per element (4, 8, 12, 9) and the accumulator on top of the
// plan (none; the packed words, 8 per element, only where some rank deposited or they are
// shared; the bins, 17 per element and one per element of the largest bucket). On the
// device the bins are the state (no in-place deposit); ragged buckets of whole-tensor
// ownership take 9 bytes whatever the path and their bins are planned from finalize. A plan
// of the default reduction is refused.
TEST(Planner, ReproducibleStepPaths) {
  EXPECT_EQ(exact_path_needed(0), ExactPath::Direct);
  EXPECT_EQ(exact_path_needed(1), ExactPath::Direct);
  EXPECT_EQ(exact_path_needed(2), ExactPath::Packed);
  EXPECT_EQ(exact_path_needed(63), ExactPath::Packed);
  EXPECT_EQ(exact_path_needed(64), ExactPath::TwoPhase);
  EXPECT_EQ(exact_path_needed(1, ExactPath::Packed), ExactPath::Packed);
  EXPECT_EQ(exact_path_needed(2, ExactPath::TwoPhase), ExactPath::TwoPhase);
  EXPECT_EQ(exact_path_needed(64, ExactPath::Packed), ExactPath::TwoPhase);
  EXPECT_STREQ(exact_path_name(ExactPath::PackedInPlace), "packed in place");
  EXPECT_STREQ(exact_path_name(ExactPath::RawPairInPlace), "raw pair in place");

  FlatLayout layout;
  layout.add("a", 1000, 0);
  layout.add("b", 3001, 0);
  layout.add("c", 77, 0);
  PlanConfig c;
  c.world_size = 3;
  c.bucket_elems = 1024;
  c.stage = Stage::Zero2;
  EXPECT_THROW(plan_exact_step(plan_memory(layout, c), ExactStep{}), Error) << "the default reduction";
  c.reduction = Reduction::Reproducible;
  const MemoryPlan cpu = plan_memory(layout, c);
  const std::size_t n = cpu.padded_elems;
  const std::size_t bins = 17 * n + cpu.bucket_elems;
  EXPECT_EQ(cpu.exact_state_bytes, 8 * n);
  EXPECT_EQ(cpu.exact_wide_bytes, bins);
  EXPECT_EQ(cpu.reduce_bytes_two_phase, 9 * n);
  EXPECT_EQ(cpu.exact_ragged_elems, 0u);
  struct Case {
    int most;
    ExactPath fastest;
    bool exchanges, shared;
    ExactPath path;
    std::size_t wire, accumulator;
  };
  for (const Case& k : {Case{0, ExactPath::Direct, true, false, ExactPath::Direct, 4 * n, 0},
                        Case{1, ExactPath::Direct, true, true, ExactPath::Direct, 4 * n, 0},
                        Case{1, ExactPath::Packed, true, false, ExactPath::Packed, 8 * n, 0},
                        Case{1, ExactPath::Packed, true, true, ExactPath::PackedInPlace, 12 * n, 8 * n},
                        Case{2, ExactPath::Direct, true, false, ExactPath::Packed, 8 * n, 8 * n},
                        Case{2, ExactPath::Direct, true, true, ExactPath::RawPairInPlace, 8 * n, 8 * n},
                        Case{2, ExactPath::Packed, true, true, ExactPath::PackedInPlace, 12 * n, 8 * n},
                        Case{3, ExactPath::Direct, true, true, ExactPath::PackedInPlace, 12 * n, 8 * n},
                        Case{63, ExactPath::Direct, true, true, ExactPath::PackedInPlace, 12 * n, 8 * n},
                        Case{64, ExactPath::Direct, true, true, ExactPath::TwoPhase, 9 * n, bins},
                        Case{1, ExactPath::Direct, false, false, ExactPath::TwoPhase, 9 * n, bins},
                        Case{5, ExactPath::TwoPhase, true, false, ExactPath::TwoPhase, 9 * n, bins}}) {
    SCOPED_TRACE("most " + std::to_string(k.most) + ", fastest " + exact_path_name(k.fastest) +
                 (k.exchanges ? "" : ", no exchange") + (k.shared ? ", shared words" : ""));
    ExactStep st;
    st.most_micro_batches = k.most;
    st.fastest = k.fastest;
    st.exchanges = k.exchanges;
    st.words_shared = k.shared;
    const ExactStepPlan p = plan_exact_step(cpu, st);
    EXPECT_EQ(p.path, k.path);
    EXPECT_EQ(p.wire_bytes, k.wire);
    EXPECT_EQ(p.accumulator_bytes, k.accumulator);
  }
  // Two micro-batches whose last did not begin with sync: the first was deposited.
  {
    ExactStep st;
    st.most_micro_batches = 2;
    st.words_shared = true;
    st.last_synced = false;
    const ExactStepPlan p = plan_exact_step(cpu, st);
    EXPECT_EQ(p.path, ExactPath::PackedInPlace);
    EXPECT_EQ(p.wire_bytes, 12 * n);
  }
  // The device: the bins are the state, on every rank, and nothing is read in place.
  c.device = Device::Cuda;
  const MemoryPlan gpu = plan_memory(layout, c);
  ExactStep st;
  st.most_micro_batches = 1;
  st.fastest = ExactPath::Packed;
  st.words_shared = true;
  const ExactStepPlan p = plan_exact_step(gpu, st);
  EXPECT_EQ(p.path, ExactPath::Packed);
  EXPECT_EQ(p.wire_bytes, 8 * n);
  EXPECT_EQ(p.accumulator_bytes, bins);
  EXPECT_EQ(plan_exact_step(gpu, ExactStep{1}).accumulator_bytes, 0u);
  // Whole-tensor ownership: ragged buckets take 9 bytes per element at every step; their bins
  // are planned from finalize (nothing on top).
  c.device = Device::Cpu;
  c.ownership = Ownership::Whole;
  c.stage = Stage::Zero1;
  const MemoryPlan whole = plan_memory(layout, c);
  ASSERT_GT(whole.exact_ragged_elems, 0u);
  EXPECT_FALSE(whole.exact_on_demand);
  const std::size_t even = whole.padded_elems - whole.exact_ragged_elems;
  const ExactStepPlan w1 = plan_exact_step(whole, ExactStep{1});
  EXPECT_EQ(w1.path, ExactPath::Direct);
  EXPECT_EQ(w1.wire_bytes, 4 * even + 9 * whole.exact_ragged_elems);
  EXPECT_EQ(w1.accumulator_bytes, 0u);
  EXPECT_EQ(plan_exact_step(whole, ExactStep{3}).wire_bytes, 8 * even + 9 * whole.exact_ragged_elems);
}
