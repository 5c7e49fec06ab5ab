// test_uneven.cpp: the uneven-count collectives (issue 32: start_reduce_scatter_sum_v,
// start_all_gather_v) on every host communicator at 1-4 ranks (single process, plain MPI with
// either exchange, shared memory on one node and on two simulated nodes, inside and outside
// its windows, the base class's composed default, the checked wrapper) against host references with exact
// sums (small integers, exact in fp32 and through a bf16 wire); mismatched counts under the
// checked communicator are the same Error on every rank.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "shardopt/layout.hpp"  // fnv1a64
#include "shardopt/mpi_comm.hpp"
#include "support/forwarding_comm.hpp"
#include "support/same_error.hpp"
#include "support/world.hpp"

using namespace shardopt;

namespace {

struct Case {
  std::string name;
  std::function<std::shared_ptr<Communicator>()> make;
  bool window;  // buffers from allocate_collective_buffer (the shared-memory path)
};

std::vector<Case> communicators() {
  auto plain = [] { return make_mpi_communicator(MPI_COMM_WORLD, {MpiCommKind::Plain, 0}); };
  auto shm = [](int nodes) {
    return [nodes] {
      return make_mpi_communicator(MPI_COMM_WORLD, {MpiCommKind::SharedMemory, nodes});
    };
  };
  auto plain_collective = [] {  // MPI's collectives instead of the direct exchange
    MpiCommOptions o{MpiCommKind::Plain, 0};
    o.exchange = MpiExchange::Collective;
    return make_mpi_communicator(MPI_COMM_WORLD, o);
  };
  std::vector<Case> cases{
      {"plain", plain, false},
      {"plain-collective", plain_collective, false},
      {"shm", shm(0), true},
      {"shm-foreign-buffer", shm(0), false},
      {"shm-2-nodes", shm(2), true},
      // Forwards everything but the uneven collectives, which run the base class's composed
      // default (what the NCCL communicator and any new one get).
      {"composed-default", [plain] { return std::make_shared<test::ComposedOnlyComm>(plain()); },
       false},
      {"checked-plain", [plain] { return make_checked_communicator(plain()); }, false},
      {"checked-shm", [shm] { return make_checked_communicator(shm(0)()); }, true},
  };
  if (test::world_size() == 1)
    cases.push_back({"single", [] { return make_single_process_communicator(); }, false});
  return cases;
}

// Count patterns for n ranks: zeros, one owner (first, last), not multiples of 64, all zero,
// equal, and a large single owner.
std::vector<std::vector<std::size_t>> patterns(int n) {
  const std::size_t N = static_cast<std::size_t>(n);
  std::vector<std::vector<std::size_t>> p;
  std::vector<std::size_t> c(N);
  for (std::size_t r = 0; r < N; ++r) c[r] = r % 2 == 0 ? 0 : 130 + r;
  p.push_back(c);
  c.assign(N, 0); c[N - 1] = 1000; p.push_back(c);
  c.assign(N, 0); c[0] = 777; p.push_back(c);
  const std::size_t odd[] = {37, 1, 65, 129};
  for (std::size_t r = 0; r < N; ++r) c[r] = odd[r % 4];
  p.push_back(c);
  c.assign(N, 0); p.push_back(c);
  c.assign(N, 64); p.push_back(c);
  c.assign(N, 0); c[N / 2] = 300001; p.push_back(c);
  return p;
}

// Small integers: every sum over up to 4 ranks is exact in fp32 and in bf16.
float value(std::size_t rank, std::size_t k) {
  return static_cast<float>(static_cast<int>((rank * 7 + k * 13) % 17) - 8);
}
std::uint16_t u16_value(std::size_t rank, std::size_t k) {
  return static_cast<std::uint16_t>((rank * 40503 + k * 2654435761u) & 0xFFFF);
}

std::string describe(const std::vector<std::size_t>& counts) {
  std::string s = "{";
  for (std::size_t c : counts) s += std::to_string(c) + ",";
  return s + "}";
}

class Uneven : public testing::TestWithParam<std::size_t> {};

TEST_P(Uneven, ReduceScatterAndAllGatherMatchTheHostReference) {
  const Case cs = communicators()[GetParam()];
  auto comm = cs.make();
  comm->set_collective_timeout(120);
  const std::size_t n = static_cast<std::size_t>(comm->size());
  const std::size_t me = static_cast<std::size_t>(comm->rank());
  for (const std::vector<std::size_t>& counts : patterns(comm->size())) {
    std::vector<std::size_t> off(n + 1, 0);
    for (std::size_t r = 0; r < n; ++r) off[r + 1] = off[r] + counts[r];
    const std::size_t total = off[n];
    Allocation win;
    std::vector<float> local;
    float* buf = nullptr;
    if (cs.window) {
      win = comm->allocate_collective_buffer(nullptr, MemCategory::Scratch,
                                             std::max<std::size_t>(total, 1) * sizeof(float));
      ASSERT_NE(win.data(), nullptr);
      buf = win.as<float>();
    } else {
      local.assign(std::max<std::size_t>(total, 1), 0.0f);
      buf = local.data();
    }
    for (const CommType wire : {CommType::F32, CommType::BF16}) {
      const std::string what = cs.name + " " + describe(counts) +
                               (wire == CommType::BF16 ? " bf16" : " f32");
      for (std::size_t k = 0; k < total; ++k) buf[k] = value(me, k);
      comm->reduce_scatter_sum_v_inplace(buf, counts, wire);
      for (std::size_t k = off[me]; k < off[me + 1]; ++k) {
        float want = 0;
        for (std::size_t q = 0; q < n; ++q) want += value(q, k);
        ASSERT_EQ(buf[k], want) << what << " reduce-scatter element " << k;
      }
      // All-gather fp32: stale values elsewhere must be overwritten.
      for (std::size_t k = 0; k < total; ++k)
        buf[k] = k >= off[me] && k < off[me + 1] ? value(me, k) : -1000.0f;
      comm->all_gather_v_inplace(buf, counts, CommType::F32);
      for (std::size_t r = 0; r < n; ++r)
        for (std::size_t k = off[r]; k < off[r + 1]; ++k)
          ASSERT_EQ(buf[k], value(r, k)) << what << " all-gather block " << r << " element " << k;
    }
    // All-gather of u16 (a bf16 replica) in the first half of the same buffer's bytes.
    auto* u = reinterpret_cast<std::uint16_t*>(buf);
    for (std::size_t k = 0; k < total; ++k)
      u[k] = k >= off[me] && k < off[me + 1] ? u16_value(me, k) : 0xDEAD;
    comm->start_all_gather_v(u, counts, CommType::U16)->wait();
    for (std::size_t r = 0; r < n; ++r)
      for (std::size_t k = off[r]; k < off[r + 1]; ++k)
        ASSERT_EQ(u[k], u16_value(r, k)) << cs.name << " " << describe(counts) << " u16 block " << r;
  }
}

// Started requests complete like the equal ones: several in flight, waited in reverse.
TEST_P(Uneven, SeveralInFlightCompleteWhateverTheWaitOrder) {
  const Case cs = communicators()[GetParam()];
  auto comm = cs.make();
  const std::size_t n = static_cast<std::size_t>(comm->size());
  const std::size_t me = static_cast<std::size_t>(comm->rank());
  std::vector<std::size_t> counts(n, 0);
  for (std::size_t r = 0; r < n; ++r) counts[r] = 100 + 3 * r;
  std::size_t total = 0;
  for (std::size_t c : counts) total += c;
  std::size_t own = 0;
  for (std::size_t r = 0; r < me; ++r) own += counts[r];
  std::vector<Allocation> wins;
  std::vector<std::vector<float>> locals(3, std::vector<float>(total));
  std::vector<float*> bufs;
  for (int i = 0; i < 3; ++i) {
    if (cs.window) {
      wins.push_back(comm->allocate_collective_buffer(nullptr, MemCategory::Scratch, total * 4));
      bufs.push_back(wins.back().as<float>());
    } else {
      bufs.push_back(locals[static_cast<std::size_t>(i)].data());
    }
    for (std::size_t k = 0; k < total; ++k) bufs.back()[k] = value(me, k + static_cast<std::size_t>(i));
  }
  std::vector<std::unique_ptr<CommRequest>> reqs;
  for (float* b : bufs) reqs.push_back(comm->start_reduce_scatter_sum_v(b, counts, CommType::F32));
  for (std::size_t i = reqs.size(); i-- > 0;) reqs[i]->wait();
  for (std::size_t i = 0; i < bufs.size(); ++i)
    for (std::size_t k = own; k < own + counts[me]; ++k) {
      float want = 0;
      for (std::size_t q = 0; q < n; ++q) want += value(q, k + i);
      ASSERT_EQ(bufs[i][k], want) << cs.name << " request " << i;
    }
}

std::string case_name(const testing::TestParamInfo<std::size_t>& info) {
  std::string s = communicators()[info.param].name;
  for (char& c : s)
    if (c == '-') c = '_';
  return s;
}

INSTANTIATE_TEST_SUITE_P(Communicators, Uneven,
                         testing::Range<std::size_t>(0, communicators().size()), case_name);

using test::expect_same_error;

// A rank passing other counts (same total or not, or another number of them) meets the same
// Error(InvalidState) on every rank instead of a hang; the communicator goes on working.
TEST(UnevenChecked, MismatchedCountsAreTheSameErrorOnEveryRank) {
  if (test::world_size() == 1) GTEST_SKIP() << "needs at least 2 ranks";
  for (const int nodes : {-1, 0}) {  // -1: plain MPI
    auto inner = nodes < 0 ? make_mpi_communicator(MPI_COMM_WORLD, {MpiCommKind::Plain, 0})
                           : make_mpi_communicator(MPI_COMM_WORLD, {MpiCommKind::SharedMemory, 0});
    auto c = make_checked_communicator(inner);
    c->set_collective_timeout(60);
    const std::size_t n = static_cast<std::size_t>(c->size());
    const bool last = c->rank() == c->size() - 1;
    std::vector<float> buf(64 * n + 64, 1.0f);
    std::vector<std::size_t> counts(n, 64), moved(n, 64);
    moved[0] = 0;  // the same total, another split
    moved[n - 1] = 128;
    expect_same_error(
        Status::InvalidState,
        [&] { c->reduce_scatter_sum_v_inplace(buf.data(), last ? moved : counts); },
        {"collective #0", "reduce_scatter_sum_v(" + std::to_string(64 * n) + " in all, counts #",
         "differs across ranks"},
        inner->name() + ": same total");
    std::vector<std::size_t> more = counts;
    more[0] = 65;
    expect_same_error(
        Status::InvalidState,
        [&] { c->all_gather_v_inplace(buf.data(), last ? more : counts, CommType::F32); },
        {"collective #1", "all_gather_v(" + std::to_string(64 * n + 1) + " in all"},
        inner->name() + ": other total");
    std::vector<std::size_t> fewer(n - 1, 64);
    expect_same_error(
        Status::InvalidState,
        [&] {
          c->reduce_scatter_sum_v_inplace(buf.data(), last ? std::span<const std::size_t>(fewer)
                                                           : std::span<const std::size_t>(counts));
        },
        {"collective #2", "reduce_scatter_sum_v("}, inner->name() + ": fewer counts");
    // Matching calls go through with the inner communicator's data.
    std::fill(buf.begin(), buf.end(), 1.0f);
    c->reduce_scatter_sum_v_inplace(buf.data(), counts);
    EXPECT_EQ(buf[static_cast<std::size_t>(c->rank()) * 64], static_cast<float>(n));
  }
}

// A wrong number of counts on every rank: the same InvalidArgument everywhere.
TEST(UnevenArguments, WrongNumberOfCountsIsRefused) {
  auto c = make_mpi_communicator(MPI_COMM_WORLD, {MpiCommKind::Plain, 0});
  std::vector<std::size_t> counts(static_cast<std::size_t>(c->size()) + 1, 1);
  std::vector<float> buf(counts.size());
  expect_same_error(Status::InvalidArgument,
                    [&] { c->reduce_scatter_sum_v_inplace(buf.data(), counts); },
                    {"reduce_scatter_sum_v", "counts for"}, "too many counts");
}

// Plain MPI counts are ints: a count (or a total) above INT_MAX is refused with the same
// clear Error on every rank before anything is sent (the buffer is never touched).
TEST(UnevenArguments, CountsAboveTheMpiIntLimitAreRefused) {
  auto c = make_mpi_communicator(MPI_COMM_WORLD, {MpiCommKind::Plain, 0});
  std::vector<std::size_t> counts(static_cast<std::size_t>(c->size()), 0);
  counts[0] = std::size_t{1} << 31;
  float dummy = 0;
  expect_same_error(Status::Unsupported,
                    [&] { c->reduce_scatter_sum_v_inplace(&dummy, counts); },
                    {"MPI_Ireduce_scatter", "exceeds the MPI int limit"}, "reduce-scatter");
  expect_same_error(Status::Unsupported,
                    [&] { c->all_gather_v_inplace(&dummy, counts, CommType::U16); },
                    {"MPI_Iallgatherv", "exceeds the MPI int limit"}, "all-gather");
  // The communicator is still usable.
  counts.assign(counts.size(), 1);
  std::vector<float> buf(counts.size(), 1.0f);
  c->reduce_scatter_sum_v_inplace(buf.data(), counts);
  EXPECT_EQ(buf[static_cast<std::size_t>(c->rank())], static_cast<float>(c->size()));
}

}  // namespace
