// test_whole.cpp: whole-tensor ownership (issue 32) through the step. For element-wise rules
// (AdamW, Lion, AdamW8bit) a Whole optimizer at stages 0, 1 and 2 must hold bit for bit the
// master weights, replica and state a Flat one holds after the same steps: gradients are
// multiples of 2^-10 (their sums are exact in any order), and every element's update depends
// only on its own values. Several bucket sizes (a parameter across buckets; ranks with empty
// ranges), fp32 and bf16 replicas, 1-2 micro-batches, overlap on and off, plain MPI and shared
// memory. Also: memory_report() == plan_memory() per rank, the refusals (the same error on
// every rank), and equal wire bytes per step (a byte-counting communicator).
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "shardopt/mpi_comm.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/planner.hpp"
#include "support/same_error.hpp"
#include "support/world.hpp"

using namespace shardopt;

namespace {

// Counts the bytes each rank hands to the data collectives (what goes on the wire).
class CountingComm final : public Communicator {
 public:
  explicit CountingComm(std::shared_ptr<Communicator> in) : in_(std::move(in)) {}
  int rank() const override { return in_->rank(); }
  int size() const override { return in_->size(); }
  std::string name() const override { return in_->name() + " (counting)"; }
  std::unique_ptr<CommRequest> start_reduce_scatter_sum(float* b, std::size_t c,
                                                        CommType w) override {
    bytes += c * static_cast<std::size_t>(size()) * width(w);
    return in_->start_reduce_scatter_sum(b, c, w);
  }
  std::unique_ptr<CommRequest> start_all_gather(void* b, std::size_t c, CommType t) override {
    bytes += c * static_cast<std::size_t>(size()) * width(t);
    return in_->start_all_gather(b, c, t);
  }
  std::unique_ptr<CommRequest> start_reduce_scatter_sum_v(float* b,
                                                          std::span<const std::size_t> c,
                                                          CommType w) override {
    for (std::size_t n : c) bytes += n * width(w);
    return in_->start_reduce_scatter_sum_v(b, c, w);
  }
  std::unique_ptr<CommRequest> start_all_gather_v(void* b, std::span<const std::size_t> c,
                                                  CommType t) override {
    for (std::size_t n : c) bytes += n * width(t);
    return in_->start_all_gather_v(b, c, t);
  }
  std::unique_ptr<CommRequest> start_all_reduce_sum(float* b, std::size_t c,
                                                    CommType w) override {
    bytes += c * width(w);
    return in_->start_all_reduce_sum(b, c, w);
  }
  void all_reduce_sum(void* b, std::size_t c, CommType t) override { in_->all_reduce_sum(b, c, t); }
  void all_gather_bytes(const void* s, void* r, std::size_t n) override {
    in_->all_gather_bytes(s, r, n);
  }
  void broadcast_bytes(void* b, std::size_t n, int root) override {
    in_->broadcast_bytes(b, n, root);
  }
  void barrier() override { in_->barrier(); }
  void set_collective_timeout(double s) override { in_->set_collective_timeout(s); }

  std::size_t bytes = 0;

 private:
  static std::size_t width(CommType t) {
    return t == CommType::F32 ? 4 : t == CommType::F64 ? 8 : 2;
  }
  std::shared_ptr<Communicator> in_;
};

// Sizes: small ones (ranks outnumber parameters in a small bucket), one of 5000 that spans
// buckets of 700, AdamW8bit ones above its min_8bit_numel.
const std::vector<std::size_t> kSizes = {1, 7, 300, 5000, 65, 129, 3, 1000, 600, 2048, 40};
const std::vector<int> kGroups = {0, 1, 2, 2, 0, 1, 0, 1, 2, 0, 2};

std::vector<GroupOptions> groups() {
  GroupOptions adamw;
  GroupOptions lion{0.5, true};
  lion.rule = Rule::Lion;
  GroupOptions q8{1.0, false};
  q8.rule = Rule::AdamW8bit;
  q8.adamw8bit.min_8bit_numel = 512;
  return {adamw, lion, q8};
}

// Some parameters registered with a 2-D shape (rows x cols), the rest without.
Shape2D shape_of(std::size_t i) {
  switch (kSizes[i]) {
    case 300: return {20, 15};
    case 1000: return {40, 25};
    case 2048: return {32, 64};
    default: return {};
  }
}

float grad_value(int rank, int step, std::size_t i, std::size_t k) {
  const std::uint64_t h = fnv1a64(&k, sizeof k, (static_cast<std::uint64_t>(rank) * 131 + step) * 7919 + i);
  return static_cast<float>(static_cast<int>(h % 2001) - 1000) / 1024.0f;  // multiples of 2^-10
}

struct RunSpec {
  OptimizerOptions o;
  std::shared_ptr<Communicator> comm;
  int micro = 1;
  int steps = 3;
};

struct Result {
  std::vector<std::vector<float>> master, replica, m, v;
  std::size_t wire_per_step = 0;
};

std::unique_ptr<ShardedOptimizer> make(const OptimizerOptions& o, std::shared_ptr<Communicator> c) {
  auto opt = std::make_unique<ShardedOptimizer>(std::move(c), o);
  const std::vector<GroupOptions> g = groups();
  opt->set_group(0, g[0]);
  opt->add_group(g[1]);
  opt->add_group(g[2]);
  for (std::size_t i = 0; i < kSizes.size(); ++i)
    if (const Shape2D s = shape_of(i); s.rows * s.cols == kSizes[i])
      opt->add_param("p" + std::to_string(i), s, kGroups[i]);
    else
      opt->add_param("p" + std::to_string(i), kSizes[i], kGroups[i]);
  return opt;
}

Result run(const RunSpec& r, CountingComm* counter = nullptr) {
  auto opt = make(r.o, r.comm);
  opt->finalize();
  for (std::size_t i = 0; i < kSizes.size(); ++i) {
    std::vector<float> init(kSizes[i]);
    for (std::size_t k = 0; k < init.size(); ++k)
      init[k] = static_cast<float>(static_cast<int>((i * 37 + k * 11) % 200) - 100) / 128.0f;
    opt->set_param(i, init);
  }
  const int rank = opt->comm().rank();
  Result res;
  for (int s = 0; s < r.steps; ++s) {
    const std::size_t before = counter ? counter->bytes : 0;
    for (int mb = 0; mb < r.micro; ++mb) {
      opt->begin_backward(mb + 1 == r.micro);
      for (std::size_t i = kSizes.size(); i-- > 0;) {
        std::span<float> g = opt->grad(i);
        for (std::size_t k = 0; k < g.size(); ++k) g[k] += grad_value(rank, s * 4 + mb, i, k);
        opt->grad_ready(i);
      }
    }
    opt->step();
    if (counter) res.wire_per_step = counter->bytes - before;
  }
  const bool f32 = r.o.param_dtype == DType::F32;
  for (std::size_t i = 0; i < kSizes.size(); ++i) {
    std::vector<float> x(kSizes[i]);
    opt->get_master(i, x);
    res.master.push_back(x);
    std::vector<float> rep(kSizes[i]);
    if (f32) {
      const std::span<float> p = opt->param<float>(i);
      std::copy(p.begin(), p.end(), rep.begin());
    } else {
      const std::span<bf16> p = opt->param<bf16>(i);
      for (std::size_t k = 0; k < rep.size(); ++k) rep[k] = to_float(p[k]);
    }
    res.replica.push_back(rep);
    opt->get_state(StateArray::ExpAvg, i, x);
    res.m.push_back(x);
    if (kGroups[i] != 1) {  // Lion keeps no exp_avg_sq
      opt->get_state(StateArray::ExpAvgSq, i, x);
      res.v.push_back(x);
    } else {
      res.v.emplace_back();
    }
  }
  // The planner predicts this rank's bytes.
  PlanConfig pc = plan_config(opt->options(), opt->comm().size());
  pc.rank = rank;
  pc.groups = groups();
  pc.grad_views_across_buckets = true;   // grad() of the parameter across buckets (stage 2)
  pc.accumulate_without_sync = r.micro > 1;
  FlatLayout unbuilt;
  for (std::size_t i = 0; i < kSizes.size(); ++i) unbuilt.add("p" + std::to_string(i), kSizes[i], kGroups[i], 0, shape_of(i));
  EXPECT_EQ(opt->memory_report().bytes, plan_memory(unbuilt, pc).bytes) << "rank " << rank;
  EXPECT_EQ(opt->memory_report().bytes, plan_memory(opt->layout(), pc).bytes) << "rank " << rank;
  return res;
}

bool same_bits(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].size() != b[i].size() ||
        (!a[i].empty() &&  // no memcmp of an empty vector's null data() (UBSan)
         std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)) != 0))
      return false;
  return true;
}

std::shared_ptr<Communicator> comm_of(MpiCommKind kind) {
  MpiCommOptions c;
  c.kind = kind;
  return make_mpi_communicator(MPI_COMM_WORLD, c);
}

struct Case {
  Stage stage;
  DType dtype;
  std::size_t bucket;
  int micro;
  bool overlap;
  MpiCommKind kind;
};

std::string describe(const Case& c) {
  return std::string(stage_name(c.stage)) + " " + dtype_name(c.dtype) + " bucket " +
         std::to_string(c.bucket) + " micro " + std::to_string(c.micro) +
         (c.overlap ? " overlap" : " no overlap") +
         (c.kind == MpiCommKind::Plain ? " mpi" : " shm");
}

}  // namespace

TEST(Whole, LayoutCutsPerRank) {
  const int n = test::world_size();
  OptimizerOptions o;
  o.ownership = Ownership::Whole;
  o.bucket_elems = 700;
  auto opt = make(o, test::world());
  opt->finalize();
  const FlatLayout& l = opt->layout();
  ASSERT_TRUE(l.owners_applied());
  std::size_t total = 0;
  for (int r = 0; r < n; ++r) total += l.shard_size(r);
  EXPECT_EQ(total, l.padded_size());
  EXPECT_EQ(opt->local_size(), l.shard_size(opt->comm().rank()));
  for (int r = 0; r < n; ++r) {
    std::size_t covered = 0;
    for (const ShardPiece& pc : l.owned_pieces(r)) {
      EXPECT_EQ(l.owner_of(pc.flat.begin), r);
      EXPECT_LE(pc.local.end, l.shard_size(r));
      covered += pc.flat.size();
      const int owner = l.param_owner(pc.param);
      if (owner != kAllRanks) EXPECT_EQ(owner, r) << l.param(pc.param).name;
    }
    (void)covered;
  }
  // The cut is ragged (on more than one rank), and small buckets leave some ranks empty.
  bool ragged = false;
  for (const Bucket& bk : l.buckets()) ragged = ragged || !bk.equal_cut;
  EXPECT_EQ(ragged, n > 1);
  {
    OptimizerOptions small = o;
    small.bucket_elems = 64;
    auto s = make(small, test::world());
    s->finalize();
    bool empty_range = false;
    for (const Bucket& bk : s->layout().buckets())
      for (int r = 0; r < n; ++r) empty_range = empty_range || bk.slice_size(r) == 0;
    EXPECT_EQ(empty_range, n > 1);
  }
  // Every whole parameter lies inside its owner's range.
  for (std::size_t i = 0; i < l.num_params(); ++i) {
    const ParamInfo& p = l.param(i);
    if (l.param_owner(i) == kAllRanks) continue;
    const Bucket& bk = l.bucket(p.buckets.begin);
    const Range mine = bk.slice(l.param_owner(i));
    EXPECT_EQ(p.flat.intersect(mine), p.flat) << p.name;
  }
}

TEST(Whole, BitIdenticalToFlat) {
  const std::vector<MpiCommKind> kinds = {MpiCommKind::Plain, MpiCommKind::SharedMemory};
  std::vector<Case> cases;
  for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2})
    for (std::size_t bucket : {std::size_t{700}, std::size_t{64}, std::size_t{1} << 16}) {
      cases.push_back({stage, DType::BF16, bucket, 1, true, kinds[bucket % 2]});
      cases.push_back({stage, DType::F32, bucket, 2, false, kinds[(bucket + 1) % 2]});
    }
  cases.push_back({Stage::Zero2, DType::BF16, 700, 2, true, MpiCommKind::SharedMemory});
  cases.push_back({Stage::Zero1, DType::F32, 64, 1, false, MpiCommKind::Plain});
  for (const Case& c : cases) {
    RunSpec r;
    r.o.stage = c.stage;
    r.o.param_dtype = c.dtype;
    r.o.bucket_elems = c.bucket;
    r.o.overlap = c.overlap;
    r.o.adam.lr = 1e-2;
    r.o.adam.weight_decay = 0.1;
    r.micro = c.micro;
    r.comm = comm_of(c.kind);
    const Result flat = run(r);
    r.o.ownership = Ownership::Whole;
    r.comm = comm_of(c.kind);
    const Result whole = run(r);
    const std::string what = describe(c);
    EXPECT_TRUE(same_bits(flat.master, whole.master)) << what << ": master";
    EXPECT_TRUE(same_bits(flat.replica, whole.replica)) << what << ": replica";
    EXPECT_TRUE(same_bits(flat.m, whole.m)) << what << ": exp_avg";
    EXPECT_TRUE(same_bits(flat.v, whole.v)) << what << ": exp_avg_sq";
  }
}

TEST(Whole, WireBytesEqualFlat) {
  for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2})
    for (std::size_t bucket : {std::size_t{700}, std::size_t{64}}) {
      RunSpec r;
      r.o.stage = stage;
      r.o.bucket_elems = bucket;
      r.steps = 2;
      auto cf = std::make_shared<CountingComm>(test::world());
      r.comm = cf;
      const Result flat = run(r, cf.get());
      r.o.ownership = Ownership::Whole;
      auto cw = std::make_shared<CountingComm>(test::world());
      r.comm = cw;
      const Result whole = run(r, cw.get());
      EXPECT_GT(flat.wire_per_step, 0u);
      EXPECT_EQ(whole.wire_per_step, flat.wire_per_step)
          << stage_name(stage) << " bucket " << bucket;
    }
}

TEST(Whole, Refusals) {
  const auto finalize_with = [](OptimizerOptions o) {
    o.ownership = Ownership::Whole;
    auto opt = make(o, test::world());
    opt->finalize();
  };
  OptimizerOptions z3;
  z3.stage = Stage::Zero3;
  test::expect_same_error(Status::Unsupported, [&] { finalize_with(z3); },
                          {"ownership Whole", "stage 3"}, "stage 3");
  OptimizerOptions repro;
  repro.reduction = Reduction::Reproducible;
  test::expect_same_error(Status::Unsupported, [&] { finalize_with(repro); },
                          {"ownership Whole", "Reproducible"}, "reproducible");
  {
    OptimizerOptions cuda;
    cuda.device = Device::Cuda;
    cuda.ownership = Ownership::Whole;
    bool constructed = true;
    try {
      make(cuda, test::world());
    } catch (const Error&) {
      constructed = false;  // no CUDA backend here: the refusal is finalize()'s, untestable
    }
    if (!constructed && test::world_rank() == 0)
      std::printf("note: no CUDA backend here; Whole's Device::Cuda refusal is not exercised\n");
    if (constructed)
      test::expect_same_error(Status::Unsupported, [&] { finalize_with(cuda); },
                              {"ownership Whole", "Cuda"}, "cuda");
  }
  // The planner refuses what finalize() refuses.
  FlatLayout l;
  l.add("a", 100, 0);
  PlanConfig pc;
  pc.world_size = test::world_size();
  pc.ownership = Ownership::Whole;
  pc.stage = Stage::Zero3;
  EXPECT_THROW(plan_memory(l, pc), Error);
}
