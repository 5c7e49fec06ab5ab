// test_comm_batch.cpp: batched collectives (issue 29). Communicator::start_batch against the
// same collectives started one by one, bit for bit, on plain MPI and shared memory (one node,
// two simulated nodes), buffers in one window, in two, and outside the windows; on one node
// the shared-memory batch is one request with one round of node barriers per phase (node
// barriers counted by the shared-memory window). Then the optimizer with
// SHARDOPT_COMM_BATCH=1 (every bucket alone) against batches of 3 and the default, bit for
// bit: stages 0-3 (stage 3 acquiring each unit and prefetching the next), Flat and Whole
// ownership (ragged buckets: the uneven collectives), overlap on and off, 1 and 3
// micro-batches, both communicators, buckets of uneven sizes, and with rank 0 never marking a
// parameter ready (the reductions left for the step differ between ranks and stay single);
// stage 3's unit gathers, one round of node barriers per batch of a unit's buckets; and the
// variable's refusals (a bad value, or values that differ between ranks: the same error on
// every rank). Reduce-scatters started with clear_inputs (stage 2's staging slots) against the
// same without, and stages 2-3 with their slots cleared by the sums against cleared whole.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <cmath>
#include <string>
#include <vector>

#include "shardopt/mpi_comm.hpp"
#include "shardopt/optimizer.hpp"
#include "support/reference.hpp"
#include "support/same_error.hpp"
#include "support/world.hpp"
#include "comm/shm_window.hpp"

using namespace shardopt;

// Node barriers started by the library so far: the shared-memory windows' own (no MPI call),
// counted by ShmWindow; reads as a long.
namespace {
const struct {
  operator long() const { return static_cast<long>(shm::ShmWindow::barriers_started()); }
} ibarriers;
}

// MPI-3 shared windows created so far by this process (each creation is several node-wide
// rounds inside MPI).
namespace {
long windows_created = 0;
}
extern "C" int MPI_Win_allocate_shared(MPI_Aint size, int disp_unit, MPI_Info info, MPI_Comm comm,
                                       void* base, MPI_Win* win) {
  ++windows_created;
  return PMPI_Win_allocate_shared(size, disp_unit, info, comm, base, win);
}

namespace {

using Op = BatchedCollective::Op;

std::shared_ptr<Communicator> comm_of(MpiCommKind kind, int simulated_nodes = 0) {
  return make_mpi_communicator(MPI_COMM_WORLD, {kind, simulated_nodes});
}

// One collective of the test batch, placed at `offset` bytes of buffer `which`.
struct Item {
  Op op;
  std::size_t count;                 // per rank, or in all (all-reduce)
  std::vector<std::size_t> counts;   // uneven forms
  CommType type;
  int which = 0;
  std::size_t offset = 0;
  std::size_t bytes = 0;
};

std::size_t elem_bytes(const Item& it) {
  return it.type == CommType::U16 ? 2 : 4;  // the reductions: fp32 values whatever the wire
}

std::size_t elements(const Item& it, int n) {
  if (it.op == Op::AllReduceSum) return it.count;
  if (!it.counts.empty()) {
    std::size_t t = 0;
    for (std::size_t c : it.counts) t += c;
    return t;
  }
  return it.count * static_cast<std::size_t>(n);
}

// Every kind of collective, uneven counts with empty blocks; the last ones in buffer 1 when
// `two_buffers`.
std::vector<Item> items(int n, bool two_buffers) {
  std::vector<std::size_t> ragged(static_cast<std::size_t>(n)), ragged2(ragged.size());
  for (int r = 0; r < n; ++r) {
    ragged[static_cast<std::size_t>(r)] = r == 1 ? 0 : 13 + 7 * static_cast<std::size_t>(r);
    ragged2[static_cast<std::size_t>(r)] = r == 0 ? 0 : 9 * static_cast<std::size_t>(r) + 1;
  }
  if (n == 1) ragged2[0] = 5;
  std::vector<Item> v = {
      {Op::ReduceScatterSum, 37, {}, CommType::F32},
      {Op::AllGather, 5, {}, CommType::F32},
      {Op::ReduceScatterSumV, 0, ragged, CommType::F32},
      {Op::AllGatherV, 0, ragged2, CommType::U16},
      {Op::AllReduceSum, 8 * static_cast<std::size_t>(n), {}, CommType::F32},
      {Op::AllGather, 300, {}, CommType::U16},
      {Op::ReduceScatterSum, 1001, {}, CommType::F32},
  };
  std::size_t at[2] = {0, 0};
  for (std::size_t k = 0; k < v.size(); ++k) {
    Item& it = v[k];
    it.which = two_buffers && k >= 4 ? 1 : 0;
    it.bytes = elements(it, n) * elem_bytes(it);
    it.offset = at[it.which];
    at[it.which] += (it.bytes + 63) / 64 * 64;
  }
  return v;
}

std::size_t buffer_bytes(const std::vector<Item>& v, int which) {
  std::size_t end = 64;
  for (const Item& it : v)
    if (it.which == which) end = std::max(end, it.offset + (it.bytes + 63) / 64 * 64);
  return end;
}

// This rank's input: fp32 values whose sums round (the order shows), or 16-bit patterns.
void fill(const std::vector<Item>& v, char* const* buf, int rank, int salt) {
  for (std::size_t k = 0; k < v.size(); ++k) {
    const Item& it = v[k];
    char* p = buf[it.which] + it.offset;
    const std::size_t n = it.bytes / elem_bytes(it);
    for (std::size_t e = 0; e < n; ++e) {
      const float x = test::synth(static_cast<std::uint64_t>(rank), 31 + k,
                                  static_cast<std::uint64_t>(salt), e) * 3.3f;
      if (it.type == CommType::U16) {
        std::uint16_t u;
        std::memcpy(&u, &x, sizeof u);
        std::memcpy(p + e * 2, &u, 2);
      } else {
        std::memcpy(p + e * 4, &x, 4);
      }
    }
  }
}

// The bytes of the item the collective defines on this rank: its own block (reduce-scatters)
// or everything.
Range defined_bytes(const Item& it, int rank, int n) {
  const std::size_t r = static_cast<std::size_t>(rank);
  if (it.op == Op::ReduceScatterSum) return {it.count * 4 * r, it.count * 4 * (r + 1)};
  if (it.op == Op::ReduceScatterSumV) {
    const std::vector<std::size_t> off = uneven_offsets(it.counts, n, "test");
    return {off[r] * 4, off[r + 1] * 4};
  }
  return {0, it.bytes};
}

std::vector<char> defined(const Item& it, const char* const* buf, int rank, int n) {
  const char* p = buf[it.which] + it.offset;
  const Range d = defined_bytes(it, rank, n);
  return {p + d.begin, p + d.end};
}

struct Buffers {
  Allocation win[2];
  std::vector<char> local[2];
  char* ptr[2] = {nullptr, nullptr};
};

// `in_windows`: the communicator's collective buffers (windows on shared memory).
Buffers buffers(Communicator& c, const std::vector<Item>& v, bool in_windows) {
  Buffers b;
  for (int w = 0; w < 2; ++w) {
    const std::size_t bytes = buffer_bytes(v, w);
    if (in_windows) b.win[w] = c.allocate_collective_buffer(nullptr, MemCategory::Grads, bytes);
    if (b.win[w].data() != nullptr) {
      b.ptr[w] = b.win[w].as<char>();
    } else {
      b.local[w].assign(bytes, 0);
      b.ptr[w] = b.local[w].data();
    }
  }
  return b;
}

std::vector<BatchedCollective> batch_of(const std::vector<Item>& v, char* const* buf) {
  std::vector<BatchedCollective> out;
  for (const Item& it : v)
    out.push_back({it.op, buf[it.which] + it.offset, it.count, it.counts, it.type});
  return out;
}

struct BatchCase {
  MpiCommKind kind;
  int nodes;         // simulated
  bool in_windows;
  bool two_buffers;
};

std::string name_of(const BatchCase& c) {
  return std::string(c.kind == MpiCommKind::Plain ? "mpi" : "shm") +
         (c.nodes > 0 ? " two simulated nodes" : "") + (c.in_windows ? " windows" : " local") +
         (c.two_buffers ? " two buffers" : " one buffer");
}

}  // namespace

// The batch gives every collective's result bit for bit as starting it alone does, whatever
// order the requests are waited in.
TEST(StartBatch, EqualsOneByOneBitForBit) {
  for (const BatchCase& c :
       {BatchCase{MpiCommKind::Plain, 0, true, false}, BatchCase{MpiCommKind::SharedMemory, 0, true, false},
        BatchCase{MpiCommKind::SharedMemory, 0, true, true},
        BatchCase{MpiCommKind::SharedMemory, 0, false, true},
        BatchCase{MpiCommKind::SharedMemory, 2, true, true}}) {
    auto comm = comm_of(c.kind, c.nodes);
    const int n = comm->size(), me = comm->rank();
    const std::vector<Item> v = items(n, c.two_buffers);
    Buffers one = buffers(*comm, v, c.in_windows), all = buffers(*comm, v, c.in_windows);
    for (int salt = 0; salt < 2; ++salt) {
      fill(v, one.ptr, me, salt);
      fill(v, all.ptr, me, salt);
      std::vector<std::unique_ptr<CommRequest>> singles;
      for (const BatchedCollective& bc : batch_of(v, one.ptr)) singles.push_back(comm->start_collective(bc));
      for (auto& r : singles) r->wait();
      const std::vector<BatchedCollective> b = batch_of(v, all.ptr);
      std::vector<std::unique_ptr<CommRequest>> batched = comm->start_batch(b);
      ASSERT_EQ(batched.size(), v.size());
      for (std::size_t k = batched.size(); k-- > 0;) batched[k]->wait();  // last first
      for (std::size_t k = 0; k < v.size(); ++k)
        ASSERT_EQ(defined(v[k], one.ptr, me, n), defined(v[k], all.ptr, me, n))
            << name_of(c) << ": collective " << k << ", salt " << salt;
    }
  }
}

// On one node, a batch in the windows is one request: one node barrier before its sums or
// copies and one after (an all-reduce in it adds the one between its two phases), where the
// same collectives one by one start two each; waiting for any request of the batch completes
// all of them.
TEST(StartBatch, SharedMemoryBatchIsOneBarrierRound) {
  auto comm = comm_of(MpiCommKind::SharedMemory);
  if (comm->name() != "mpi-shm") GTEST_SKIP() << comm->name();
  const int n = comm->size(), me = comm->rank();
  std::vector<Item> v = items(n, true);
  Buffers b = buffers(*comm, v, true);
  ASSERT_NE(b.win[0].data(), nullptr);
  fill(v, b.ptr, me, 0);
  long before = ibarriers;
  for (const BatchedCollective& bc : batch_of(v, b.ptr)) comm->start_collective(bc)->wait();
  EXPECT_EQ(ibarriers - before, 2 * static_cast<long>(v.size()) + 1);  // + the all-reduce's middle
  before = ibarriers;
  std::vector<std::unique_ptr<CommRequest>> r = comm->start_batch(batch_of(v, b.ptr));
  r[2]->wait();
  for (auto& q : r) EXPECT_TRUE(q->test());
  EXPECT_EQ(ibarriers - before, 3);
  // Without the all-reduce: two.
  std::erase_if(v, [](const Item& it) { return it.op == Op::AllReduceSum; });
  before = ibarriers;
  for (auto& q : comm->start_batch(batch_of(v, b.ptr))) q->wait();
  EXPECT_EQ(ibarriers - before, 2);
}

// ---- reduce-scatters that clear their inputs (stage 2's staging slots) -------------------------

// A reduce-scatter started with clear_inputs gives the same block bit for bit, singly and in a
// batch; where clears_inputs() says so (shared memory on one node, buffer in a window, fp32
// wire), every element of its buffer outside this rank's block is zero afterwards; elsewhere
// clears_inputs() is false and the caller clears. Other collectives and the flag off: false.
TEST(ClearInputs, SameSumsAndTheRestZero) {
  for (const BatchCase& c :
       {BatchCase{MpiCommKind::Plain, 0, true, false}, BatchCase{MpiCommKind::SharedMemory, 0, true, false},
        BatchCase{MpiCommKind::SharedMemory, 0, true, true},
        BatchCase{MpiCommKind::SharedMemory, 0, false, true},
        BatchCase{MpiCommKind::SharedMemory, 2, true, true}})
    for (bool batched : {false, true}) {
      auto comm = comm_of(c.kind, c.nodes);
      const int n = comm->size(), me = comm->rank();
      const std::string what = name_of(c) + (batched ? " batched" : " one by one");
      const std::vector<Item> v = items(n, c.two_buffers);
      Buffers kept = buffers(*comm, v, c.in_windows), cleared = buffers(*comm, v, c.in_windows);
      fill(v, kept.ptr, me, 1);
      fill(v, cleared.ptr, me, 1);
      std::vector<BatchedCollective> plain_ops = batch_of(v, kept.ptr);
      std::vector<BatchedCollective> clear_ops = batch_of(v, cleared.ptr);
      for (BatchedCollective& o : clear_ops) o.clear_inputs = true;
      for (const std::vector<BatchedCollective>* ops : {&plain_ops, &clear_ops}) {
        std::vector<std::unique_ptr<CommRequest>> r;
        if (batched) r = comm->start_batch(*ops);
        else
          for (const BatchedCollective& o : *ops) r.push_back(comm->start_collective(o));
        for (auto& q : r) q->wait();
      }
      const bool one_node_windows = comm->name() == "mpi-shm" && c.in_windows;
      for (std::size_t k = 0; k < v.size(); ++k) {
        const Item& it = v[k];
        ASSERT_EQ(defined(it, kept.ptr, me, n), defined(it, cleared.ptr, me, n))
            << what << ": collective " << k;
        EXPECT_FALSE(comm->clears_inputs(plain_ops[k])) << what << ": collective " << k;
        const bool scatter = it.op == Op::ReduceScatterSum || it.op == Op::ReduceScatterSumV;
        const bool clears = comm->clears_inputs(clear_ops[k]);
        EXPECT_EQ(clears, scatter && one_node_windows) << what << ": collective " << k;
        if (!clears) continue;
        const Range mine = defined_bytes(it, me, n);
        const char* all = cleared.ptr[it.which] + it.offset;
        std::size_t nonzero = 0;
        for (std::size_t b = 0; b < it.bytes; ++b)
          if ((b < mine.begin || b >= mine.end) && all[b] != 0) ++nonzero;
        EXPECT_EQ(nonzero, 0u) << what << ": collective " << k << " left bytes outside the block";
      }
      // A bf16 wire takes plain MPI's form: nothing cleared.
      BatchedCollective bf = clear_ops[0];
      bf.type = CommType::BF16;
      EXPECT_FALSE(comm->clears_inputs(bf)) << what;
    }
  // Turned off for A/B runs.
  setenv("SHARDOPT_SHM_CLEAR_INPUTS", "0", 1);
  auto off = comm_of(MpiCommKind::SharedMemory);
  unsetenv("SHARDOPT_SHM_CLEAR_INPUTS");
  const std::vector<Item> v = items(off->size(), false);
  Buffers b = buffers(*off, v, true);
  std::vector<BatchedCollective> ops = batch_of(v, b.ptr);
  ops[0].clear_inputs = true;
  EXPECT_FALSE(off->clears_inputs(ops[0]));
}

// SHARDOPT_SHM_CLEAR_INPUTS must be the same on every rank (a rank whose sums do not clear would
// leave stale values in a peer's slot that the peer counts on being zero): a bad value, or a
// value on one rank only, is the same error on every rank when the communicator is made.
TEST(ClearInputs, EnvironmentRefusals) {
  const auto make_with = [](const char* value, bool rank0_only) {
    return [=] {
      int rank = 0;
      MPI_Comm_rank(MPI_COMM_WORLD, &rank);
      if (!rank0_only || rank == 0) setenv("SHARDOPT_SHM_CLEAR_INPUTS", value, 1);
      try {
        comm_of(MpiCommKind::SharedMemory);
      } catch (...) {
        unsetenv("SHARDOPT_SHM_CLEAR_INPUTS");
        throw;
      }
      unsetenv("SHARDOPT_SHM_CLEAR_INPUTS");
    };
  };
  for (const char* bad : {"2", "off", "yes"})
    test::expect_same_error(Status::InvalidArgument, make_with(bad, false),
                            {"SHARDOPT_SHM_CLEAR_INPUTS='" + std::string(bad) + "'"}, bad);
  if (test::world_size() > 1)
    test::expect_same_error(Status::InvalidArgument, make_with("0", true),
                            {"SHARDOPT_SHM_CLEAR_INPUTS"}, "rank 0 alone");
}

// ---- the optimizer: batched against every bucket alone ----------------------------------------

namespace {

// Uneven sizes: some below a bucket, one across several buckets of 300.
const std::vector<std::size_t> kSizes = {1, 7, 300, 5000, 65, 129, 3, 1000, 600, 2048, 40};

struct RunSpec {
  Stage stage;
  Ownership ownership;
  bool overlap;
  int micro;
  MpiCommKind kind;
  /// Rank 0 never marks parameter kSkipped ready: with overlap its bucket and every later one
  /// are left for the step on rank 0 while the other ranks start them during backward.
  bool skip_ready = false;
};

constexpr std::size_t kSkipped = 5;

std::string describe(const RunSpec& r) {
  return std::string(stage_name(r.stage)) +
         (r.ownership == Ownership::Whole ? " whole" : " flat") +
         (r.overlap ? " overlap" : " no overlap") + " micro " + std::to_string(r.micro) +
         (r.kind == MpiCommKind::Plain ? " mpi" : " shm") +
         (r.skip_ready ? " rank 0 skips a grad_ready" : "");
}

struct Trained {
  std::vector<std::vector<float>> master, replica, m, v;
  std::vector<double> norms;
  long barriers = 0;  ///< node barriers the steps started
};

// Three steps with SHARDOPT_COMM_BATCH = `batch` ("" : unset, the default).
Trained train(const RunSpec& r, std::shared_ptr<Communicator> comm, const char* batch) {
  if (*batch != '\0') setenv("SHARDOPT_COMM_BATCH", batch, 1);
  else unsetenv("SHARDOPT_COMM_BATCH");
  OptimizerOptions o;
  o.stage = r.stage;
  o.ownership = r.ownership;
  o.overlap = r.overlap;
  o.bucket_elems = 300;
  o.adam.lr = 1e-2;
  o.adam.weight_decay = 0.1;
  o.adam.max_grad_norm = 1.0;
  ShardedOptimizer opt(std::move(comm), o);
  for (std::size_t i = 0; i < kSizes.size(); ++i) {
    if (r.stage == Stage::Zero3 && i > 0 && i % 4 == 0) opt.begin_unit();
    opt.add_param("p" + std::to_string(i), kSizes[i]);
  }
  opt.finalize();
  unsetenv("SHARDOPT_COMM_BATCH");
  for (std::size_t i = 0; i < kSizes.size(); ++i) {
    std::vector<float> init(kSizes[i]);
    for (std::size_t k = 0; k < init.size(); ++k) init[k] = test::synth(5, 0, i, k);
    opt.set_param(i, init);
  }
  const int me = opt.comm().rank();
  const bool zero3 = r.stage == Stage::Zero3;
  Trained t;
  t.replica.resize(kSizes.size());
  const auto forward = [&] {
    const FlatLayout& l = opt.layout();
    for (std::size_t u = 0; u < l.num_units(); ++u) {
      if (zero3) opt.acquire(u);
      // The next unit's gather runs while this one is read (units_in_flight 2).
      if (zero3 && u + 1 < l.num_units()) opt.prefetch(u + 1);
      for (std::size_t i = l.unit(u).params.begin; i < l.unit(u).params.end; ++i) {
        const std::span<bf16> p = opt.param<bf16>(i);
        t.replica[i].resize(p.size());
        for (std::size_t k = 0; k < p.size(); ++k) t.replica[i][k] = to_float(p[k]);
      }
      if (zero3) opt.release(u);
    }
  };
  const long barriers_before = ibarriers;
  for (int s = 0; s < 3; ++s) {
    forward();
    for (int mb = 0; mb < r.micro; ++mb) {
      opt.begin_backward(mb + 1 == r.micro);
      for (std::size_t i = kSizes.size(); i-- > 0;) {  // backward order
        const std::span<float> g = opt.grad(i);
        for (std::size_t k = 0; k < g.size(); ++k)  // sums that round: the order shows
          g[k] += test::synth(static_cast<std::uint64_t>(me) + 11,
                              static_cast<std::uint64_t>(s * 8 + mb), i, k) * 1.7f;
        if (!r.skip_ready || me != 0 || i != kSkipped) opt.grad_ready(i);
      }
    }
    t.norms.push_back(opt.step().grad_norm);
  }
  forward();
  t.barriers = ibarriers - barriers_before;
  for (std::size_t i = 0; i < kSizes.size(); ++i) {
    std::vector<float> x(kSizes[i]);
    opt.get_master(i, x);
    t.master.push_back(x);
    opt.get_state(StateArray::ExpAvg, i, x);
    t.m.push_back(x);
    opt.get_state(StateArray::ExpAvgSq, i, x);
    t.v.push_back(x);
  }
  return t;
}

bool same_bits(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].size() != b[i].size() ||
        (!a[i].empty() && std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)) != 0))
      return false;
  return true;
}

// Norms, master, replica and both moments bit for bit.
void expect_same_training(const Trained& a, const Trained& b, const std::string& what) {
  ASSERT_EQ(a.norms.size(), b.norms.size()) << what;
  ASSERT_EQ(std::memcmp(a.norms.data(), b.norms.data(), a.norms.size() * sizeof(double)), 0)
      << what << ": grad norms";
  EXPECT_TRUE(same_bits(a.master, b.master)) << what << ": master";
  EXPECT_TRUE(same_bits(a.replica, b.replica)) << what << ": replica";
  EXPECT_TRUE(same_bits(a.m, b.m)) << what << ": exp_avg";
  EXPECT_TRUE(same_bits(a.v, b.v)) << what << ": exp_avg_sq";
}

class BatchedStep : public testing::TestWithParam<Stage> {};

}  // namespace

TEST_P(BatchedStep, EqualsEveryBucketAloneBitForBit) {
  const std::shared_ptr<Communicator> comms[2] = {comm_of(MpiCommKind::Plain),
                                                  comm_of(MpiCommKind::SharedMemory)};
  std::vector<RunSpec> runs;
  for (Ownership own : {Ownership::Flat, Ownership::Whole})
    for (bool overlap : {false, true})
      for (int micro : {1, 3})
        for (MpiCommKind kind : {MpiCommKind::Plain, MpiCommKind::SharedMemory})
          runs.push_back({GetParam(), own, overlap, micro, kind});
  // The reductions left for the step differ between ranks: they start one by one, the same
  // sequence on every rank (docs/performance.md, "Batched collectives").
  for (MpiCommKind kind : {MpiCommKind::Plain, MpiCommKind::SharedMemory})
    runs.push_back({GetParam(), Ownership::Flat, true, 1, kind, true});
  for (const RunSpec& r : runs) {
    const int c = r.kind == MpiCommKind::Plain ? 0 : 1;
    const bool overlap = r.overlap;
    const Trained alone = train(r, comms[c], "1");
    for (const char* batch : {"3", ""}) {
      const Trained b = train(r, comms[c], batch);
      const std::string what = describe(r) + ", SHARDOPT_COMM_BATCH='" + batch + "'";
      ASSERT_NO_FATAL_FAILURE(expect_same_training(alone, b, what));
      // Batches start fewer node barriers where several buckets start together: the
      // gathers of stages 1-2 after the update, stage 3's unit gathers (a unit holds
      // several buckets of 300 here), the reductions without overlap (unstaged).
      const bool shm = comms[c]->name() == "mpi-shm" && comms[c]->size() > 1;
      const bool gathers = r.stage != Stage::DataParallel;
      const bool reductions = !overlap && (r.stage == Stage::DataParallel || r.stage == Stage::Zero1);
      if (shm && (gathers || reductions)) EXPECT_LT(b.barriers, alone.barriers) << what;
      else if (shm) EXPECT_EQ(b.barriers, alone.barriers) << what;
    }
  }
}

std::string stage_case(const testing::TestParamInfo<Stage>& i) {
  return "Stage" + std::to_string(static_cast<int>(i.param));
}

INSTANTIATE_TEST_SUITE_P(Stages, BatchedStep,
                         testing::Values(Stage::DataParallel, Stage::Zero1, Stage::Zero2,
                                         Stage::Zero3),
                         stage_case);

// Stages 2 and 3 whose staging slots the shared-memory sums clear (clears_inputs(): the slot's
// owner then clears only its own block) against the same steps with the slot cleared whole
// after each reduction (SHARDOPT_SHM_CLEAR_INPUTS=0) and against plain MPI, bit for bit: a slot
// left with a stale element would add it into the next micro-batch or step. Flat and Whole
// (ragged buckets: the uneven reduce-scatter), overlap on and off, 1 and 3 micro-batches, rank
// 0 leaving a parameter unmarked.
class ClearedSlots : public testing::TestWithParam<Stage> {};

TEST_P(ClearedSlots, EqualSlotsClearedWholeBitForBit) {
  setenv("SHARDOPT_SHM_CLEAR_INPUTS", "0", 1);
  const std::shared_ptr<Communicator> whole_clear = comm_of(MpiCommKind::SharedMemory);
  unsetenv("SHARDOPT_SHM_CLEAR_INPUTS");
  const std::shared_ptr<Communicator> comms[3] = {comm_of(MpiCommKind::SharedMemory), whole_clear,
                                                  comm_of(MpiCommKind::Plain)};
  std::vector<RunSpec> runs;
  for (Ownership own : {Ownership::Flat, Ownership::Whole})
    for (bool overlap : {false, true})
      for (int micro : {1, 3}) runs.push_back({GetParam(), own, overlap, micro, MpiCommKind::SharedMemory});
  runs.push_back({GetParam(), Ownership::Flat, true, 1, MpiCommKind::SharedMemory, true});
  for (const RunSpec& r : runs) {
    const Trained fused = train(r, comms[0], "");
    for (int c = 1; c < 3; ++c) {
      const Trained t = train(r, comms[c], "");
      const std::string what = describe(r) + (c == 1 ? " against slots cleared whole" : " against plain MPI");
      ASSERT_NO_FATAL_FAILURE(expect_same_training(fused, t, what));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Stages, ClearedSlots, testing::Values(Stage::Zero2, Stage::Zero3),
                         stage_case);

// Stage 3: acquiring a unit of K buckets starts ceil(K / batch) batches of gathers, each one
// round of two node barriers on one node's shared memory (2 K barriers one by one), and
// gives the same parameters bit for bit; prefetch likewise, and its gathers complete at the
// acquire that follows. Flat and Whole ownership.
TEST(BatchedUnits, AUnitGathersInBatchesOfItsBuckets) {
  auto comm = comm_of(MpiCommKind::SharedMemory);
  const bool shm = comm->name() == "mpi-shm" && comm->size() > 1;
  for (Ownership own : {Ownership::Flat, Ownership::Whole}) {
    struct Seen {
      std::vector<std::vector<float>> params;
      std::vector<long> barriers;  // acquire(0), prefetch(1) + acquire(1)
      std::size_t buckets[2] = {0, 0};
    };
    const auto run = [&](const char* batch) {
      setenv("SHARDOPT_COMM_BATCH", batch, 1);
      OptimizerOptions o;
      o.stage = Stage::Zero3;
      o.ownership = own;
      o.param_dtype = DType::F32;
      o.bucket_elems = 256;
      ShardedOptimizer opt(comm, o);
      for (std::size_t i = 0; i < 6; ++i) {  // two units of 3 parameters, many buckets each
        if (i == 3) opt.begin_unit();
        opt.add_param("p" + std::to_string(i), 700 + 333 * i);
      }
      opt.finalize();
      unsetenv("SHARDOPT_COMM_BATCH");
      for (std::size_t i = 0; i < 6; ++i) {
        std::vector<float> init(700 + 333 * i);
        for (std::size_t k = 0; k < init.size(); ++k) init[k] = test::synth(9, 1, i, k);
        opt.set_param(i, init);
      }
      Seen seen;
      for (std::size_t u = 0; u < 2; ++u) seen.buckets[u] = opt.layout().unit(u).buckets.size();
      long before = ibarriers;
      opt.acquire(0);
      seen.barriers.push_back(ibarriers - before);
      before = ibarriers;
      opt.prefetch(1);
      for (std::size_t i = 0; i < 3; ++i) {
        const std::span<float> p = opt.param<float>(i);
        seen.params.emplace_back(p.begin(), p.end());
      }
      opt.acquire(1);
      seen.barriers.push_back(ibarriers - before);
      for (std::size_t i = 3; i < 6; ++i) {
        const std::span<float> p = opt.param<float>(i);
        seen.params.emplace_back(p.begin(), p.end());
      }
      opt.release(0);
      opt.release(1);
      return seen;
    };
    const Seen alone = run("1"), batched = run("4");
    const std::string what = own == Ownership::Whole ? "whole" : "flat";
    EXPECT_TRUE(same_bits(alone.params, batched.params)) << what;
    ASSERT_GT(alone.buckets[0], 4u) << what;  // several batches of 4
    ASSERT_GT(alone.buckets[1], 4u) << what;
    if (!shm) continue;
    for (std::size_t u = 0; u < 2; ++u) {
      const long k = static_cast<long>(alone.buckets[u]);
      EXPECT_EQ(alone.barriers[u], 2 * k) << what << ": unit " << u << " bucket by bucket";
      EXPECT_EQ(batched.barriers[u], 2 * ((k + 3) / 4)) << what << ": unit " << u << " in batches of 4";
    }
  }
}

// A bad value, and values that differ between ranks, fail finalize() on every rank alike.
TEST(BatchedStep, EnvironmentRefusals) {
  const auto finalize_with = [](const char* value, bool rank0_only) {
    return [=] {
      auto comm = test::world();
      if (!rank0_only || comm->rank() == 0) setenv("SHARDOPT_COMM_BATCH", value, 1);
      ShardedOptimizer opt(comm, OptimizerOptions{});
      opt.add_param("w", 1000);
      try {
        opt.finalize();
      } catch (...) {
        unsetenv("SHARDOPT_COMM_BATCH");
        throw;
      }
      unsetenv("SHARDOPT_COMM_BATCH");
    };
  };
  for (const char* bad : {"0", "-2", "4x", "many"})
    test::expect_same_error(Status::InvalidArgument, finalize_with(bad, false),
                            {"SHARDOPT_COMM_BATCH='" + std::string(bad) + "'"}, bad);
  if (test::world_size() > 1)
    test::expect_same_error(Status::LayoutMismatch, finalize_with("1", true),
                            {"SHARDOPT_COMM_BATCH"}, "rank 0 alone");
}

// finalize() allocates every buffer that goes through the collectives (replica, gradients or
// staging, stage 3's units, the reproducible wire) in one call: on the shared-memory
// communicator one window for all of them, and the step works on them.
TEST(CollectiveBuffers, OneWindowPerOptimizer) {
  auto comm = comm_of(MpiCommKind::SharedMemory);
  const bool shm = comm->name() == "mpi-shm";  // windows at any rank count
  struct Config {
    Stage stage;
    Reduction reduction;
    int micro_batches;
  };
  for (const Config c : {Config{Stage::DataParallel, Reduction::Default, 1},
                         Config{Stage::Zero1, Reduction::Default, 1},
                         Config{Stage::Zero2, Reduction::Default, 1},
                         Config{Stage::Zero3, Reduction::Default, 1},
                         Config{Stage::Zero1, Reduction::Reproducible, 2}}) {
    OptimizerOptions o;
    o.stage = c.stage;
    o.reduction = c.reduction;
    o.bucket_elems = 512;
    ShardedOptimizer opt(comm, o);
    for (std::size_t i = 0; i < 4; ++i) opt.add_param("p" + std::to_string(i), 300 + 211 * i);
    const long before = windows_created;
    opt.finalize();
    const long made = windows_created - before;
    const std::string what = std::string(stage_name(c.stage)) +
                             (c.reduction == Reduction::Reproducible ? " reproducible" : "");
    if (shm) EXPECT_EQ(made, 1) << what;
    else EXPECT_EQ(made, 0) << what;
    // Two steps on those buffers, every rank the same gradients: finite and changed.
    const std::size_t n = opt.layout().num_params();
    std::vector<float> first;
    for (int s = 0; s < 2; ++s) {
      for (int mb = 0; mb < c.micro_batches; ++mb) {
        if (c.stage == Stage::Zero3) opt.acquire(0);
        opt.begin_backward(mb + 1 == c.micro_batches);
        for (std::size_t i = n; i-- > 0;) {
          const std::span<float> g = opt.grad(i);
          for (std::size_t k = 0; k < g.size(); ++k) g[k] = test::synth(5, s + mb, i, k);
          opt.grad_ready(i);
        }
        if (c.stage == Stage::Zero3) opt.release(0);
      }
      opt.step();
      std::vector<float> m;
      for (std::size_t i = 0; i < n; ++i) {
        std::vector<float> p(300 + 211 * i);
        opt.get_master(i, p);
        m.insert(m.end(), p.begin(), p.end());
      }
      for (float v : m) ASSERT_TRUE(std::isfinite(v)) << what;
      if (s == 0) first = m;
      else EXPECT_NE(first, m) << what;
    }
  }
}
