// test_c10d_comm.cpp: the Communicator over LibTorch's c10d gloo group, at 1-4 ranks with no
// MPI in the processes. Every collective against a result computed locally from every
// rank's (deterministic) input: the reduce-scatter sums in rank order, so its result is
// compared bit for bit, on its owner and, gathered, on every rank; sizes that do and do not
// divide; started requests of different kinds completed in and out of order; the integer
// reductions of reproducible mode; timeouts as errors; the environment's and the arguments'
// errors. Then the optimizer over it: stages 0-2 against the double-precision reference, and
// reproducible mode bit for bit equal to one process that receives every rank's gradient.
#include <gtest/gtest.h>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "shardopt/bf16.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/torch/c10d_comm.hpp"
#include "support/ckpt_model.hpp"  // test::SharedDir
#include "support/harness.hpp"
#include "support/world.hpp"

using namespace shardopt;

namespace {

Communicator& world() { return *test::world(); }
int rank() { return world().rank(); }
int ranks() { return world().size(); }
std::size_t uranks() { return static_cast<std::size_t>(ranks()); }
std::size_t urank() { return static_cast<std::size_t>(rank()); }

// Element k of rank r's buffer: varied signs and magnitudes, so that the order of an fp32 sum
// matters; floats from 2^-6 to 2^12 (multiples of 2^-30), so double sums of a few are exact.
float value(int r, std::size_t k) {
  const std::uint32_t h = static_cast<std::uint32_t>(k * 2654435761u + static_cast<std::uint32_t>(r) * 40503u);
  return static_cast<float>(static_cast<int>(h % 2001u) - 1000) * (1.0f + static_cast<float>(r) / 3.0f) /
         static_cast<float>(1u << (h % 7u));
}

std::vector<float> buffer_of(int r, std::size_t n) {
  std::vector<float> v(n);
  for (std::size_t k = 0; k < n; ++k) v[k] = value(r, k);
  return v;
}

// The fp32 sum over ranks 0..N-1, in that order, of element k of every rank's buffer.
float rank_order_sum(std::size_t k, int seed = 0) {
  float acc = value(seed, k);
  for (int r = 1; r < ranks(); ++r) acc += value(r + seed, k);
  return acc;
}

// The bf16 wire's sum: every input rounded to bf16, every partial sum rounded to bf16.
float bf16_rank_order_sum(std::size_t k) {
  bf16 acc = to_bf16(value(0, k));
  for (int r = 1; r < ranks(); ++r) acc = to_bf16(to_float(acc) + to_float(to_bf16(value(r, k))));
  return to_float(acc);
}

bool same_bits(float a, float b) { return std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b); }

// Per-rank counts that divide nothing (1, 7, 4099) and a round one (1000).
const std::size_t kCounts[] = {1, 7, 1000, 4099};

template <class F>
void expect_error(Status status, const std::string& text, F&& f) {
  try {
    f();
    ADD_FAILURE() << "no error, expected " << status_name(status) << ": " << text;
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), status) << e.what();
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(C10dComm, NameAndSize) {
  EXPECT_EQ(world().name(), "c10d:gloo");
  EXPECT_FALSE(world().device_buffers());
  if (const char* size = std::getenv("PMI_SIZE")) EXPECT_EQ(ranks(), std::atoi(size));
  if (const char* r = std::getenv("PMI_RANK")) EXPECT_EQ(rank(), std::atoi(r));
}

// Block rank() is the rank-order fp32 sum bit for bit, close to the exact sum; gathered, every
// rank sees every block equal to the rank-order sum: the same bits on every rank.
TEST(C10dComm, ReduceScatterSumsInRankOrderBitForBitOnEveryRank) {
  for (std::size_t count : kCounts) {
    const std::size_t n = count * uranks();
    std::vector<float> buf = buffer_of(rank(), n);
    world().reduce_scatter_sum_inplace(buf.data(), count);
    for (std::size_t k = 0; k < count; ++k) {
      const std::size_t at = urank() * count + k;
      double exact = 0.0, magnitude = 0.0;
      for (int r = 0; r < ranks(); ++r) exact += value(r, at), magnitude += std::abs(value(r, at));
      ASSERT_TRUE(same_bits(buf[at], rank_order_sum(at))) << "count " << count << " k " << k;
      // fp32 summation of N terms: within N-1 rounding errors of their magnitude.
      ASSERT_NEAR(buf[at], exact, ranks() * 6e-8 * magnitude);
    }
    world().all_gather_inplace(buf.data(), count, CommType::F32);
    for (std::size_t at = 0; at < n; ++at)
      ASSERT_TRUE(same_bits(buf[at], rank_order_sum(at))) << "count " << count << " at " << at;
  }
}

TEST(C10dComm, ReduceScatterBf16WireRoundsEveryPartialSum) {
  for (std::size_t count : kCounts) {
    const std::size_t n = count * uranks();
    std::vector<float> buf = buffer_of(rank(), n);
    world().reduce_scatter_sum_inplace(buf.data(), count, CommType::BF16);
    for (std::size_t k = 0; k < count; ++k) {
      const std::size_t at = urank() * count + k;
      ASSERT_TRUE(same_bits(buf[at], bf16_rank_order_sum(at))) << "count " << count << " k " << k;
    }
  }
}

TEST(C10dComm, AllGatherInPlaceF32AndU16) {
  for (std::size_t count : kCounts) {
    const std::size_t n = count * uranks();
    std::vector<float> f(n, -1.0f);
    std::vector<std::uint16_t> h(n, 0xFFFF);
    for (std::size_t k = 0; k < count; ++k) {
      f[urank() * count + k] = value(rank(), k);
      h[urank() * count + k] = static_cast<std::uint16_t>(urank() * 1000 + k);
    }
    world().all_gather_inplace(f.data(), count, CommType::F32);
    world().all_gather_inplace(h.data(), count, CommType::U16);
    for (int r = 0; r < ranks(); ++r)
      for (std::size_t k = 0; k < count; ++k) {
        const std::size_t at = static_cast<std::size_t>(r) * count + k;
        ASSERT_TRUE(same_bits(f[at], value(r, k)));
        ASSERT_EQ(h[at], static_cast<std::uint16_t>(static_cast<std::size_t>(r) * 1000 + k));
      }
  }
}

// F32: within fp32 rounding of the exact sum and the same bits on every rank. F64: exact.
// BF16 wire (padded to a multiple of the rank count inside): the rank-order bf16 sum.
TEST(C10dComm, AllReduceF32F64AndBf16Wire) {
  for (std::size_t count : kCounts) {
    std::vector<float> f = buffer_of(rank(), count);
    world().start_all_reduce_sum(f.data(), count, CommType::F32)->wait();
    std::vector<double> d(count);
    for (std::size_t k = 0; k < count; ++k) d[k] = value(rank(), k);
    world().all_reduce_sum(d.data(), count, CommType::F64);
    std::vector<float> f2 = buffer_of(rank(), count);
    world().all_reduce_sum(f2.data(), count, CommType::F32);
    std::vector<float> b = buffer_of(rank(), count);
    world().start_all_reduce_sum(b.data(), count, CommType::BF16)->wait();
    for (std::size_t k = 0; k < count; ++k) {
      double exact = 0.0, magnitude = 0.0;
      for (int r = 0; r < ranks(); ++r) exact += value(r, k), magnitude += std::abs(value(r, k));
      ASSERT_NEAR(f[k], exact, ranks() * 6e-8 * magnitude);
      ASSERT_TRUE(same_bits(f[k], f2[k]));
      ASSERT_EQ(d[k], exact);  // exact in double, in any order
      ASSERT_TRUE(same_bits(b[k], bf16_rank_order_sum(k))) << "count " << count << " k " << k;
    }
    std::vector<float> everyone(count * uranks());
    world().all_gather_bytes(f.data(), everyone.data(), count * sizeof(float));
    for (int r = 0; r < ranks(); ++r)
      ASSERT_EQ(std::memcmp(everyone.data() + static_cast<std::size_t>(r) * count, f.data(),
                            count * sizeof(float)),
                0)
          << "rank " << r << " has other bits, count " << count;
  }
}

TEST(C10dComm, EmptyCollectivesAreNoOps) {
  float f = 1.5f;
  double d = 2.5;
  std::int64_t i = 7;
  world().reduce_scatter_sum_inplace(&f, 0);
  world().reduce_scatter_sum_inplace(&f, 0, CommType::BF16);
  world().all_gather_inplace(&f, 0, CommType::F32);
  world().start_all_reduce_sum(&f, 0, CommType::F32)->wait();
  world().start_all_reduce_sum(&f, 0, CommType::BF16)->wait();
  world().all_reduce_sum(&d, 0, CommType::F64);
  world().reduce_scatter_int(&i, 0, IntOp::SumI64);
  world().all_reduce_int(&i, 0, IntOp::SumI64);
  world().all_gather_bytes(&i, &i, 0);
  world().broadcast_bytes(&i, 0, 0);
  EXPECT_EQ(f, 1.5f);
  EXPECT_EQ(d, 2.5);
  EXPECT_EQ(i, 7);
}

// Reduce-scatters, all-gathers and all-reduces in flight together, completed in another
// order than started, by test() polling, by wait(), and by destroying the request.
TEST(C10dComm, StartedRequestsCompleteInAnyOrder) {
  const std::size_t count = 513;
  const std::size_t n = count * uranks();
  std::vector<std::vector<float>> rs;
  for (int i = 0; i < 3; ++i) rs.push_back(buffer_of(rank() + 10 * i, n));
  std::vector<float> ag(n, -1.0f), ar = buffer_of(rank() + 50, n);
  for (std::size_t k = 0; k < count; ++k) ag[urank() * count + k] = value(rank() + 30, k);
  std::vector<std::unique_ptr<CommRequest>> requests;
  requests.push_back(world().start_reduce_scatter_sum(rs[0].data(), count, CommType::F32));
  requests.push_back(world().start_all_gather(ag.data(), count, CommType::F32));
  requests.push_back(world().start_reduce_scatter_sum(rs[1].data(), count, CommType::BF16));
  requests.push_back(world().start_all_reduce_sum(ar.data(), n, CommType::F32));
  requests.push_back(world().start_reduce_scatter_sum(rs[2].data(), count, CommType::F32));
  requests[4]->wait();
  while (!requests[1]->test()) {
  }
  EXPECT_TRUE(requests[1]->test());  // stays complete
  requests[2].reset();                // destroying an unfinished request waits for it
  requests[3]->wait();
  requests[0]->wait();
  requests[0]->wait();  // a second wait is a no-op
  for (std::size_t k = 0; k < count; ++k) {
    const std::size_t at = urank() * count + k;
    ASSERT_TRUE(same_bits(rs[0][at], rank_order_sum(at, 0))) << k;
    ASSERT_TRUE(same_bits(rs[2][at], rank_order_sum(at, 20))) << k;
    bf16 acc = to_bf16(value(10, at));
    for (int r = 1; r < ranks(); ++r) acc = to_bf16(to_float(acc) + to_float(to_bf16(value(r + 10, at))));
    ASSERT_TRUE(same_bits(rs[1][at], to_float(acc))) << k;
    for (int r = 0; r < ranks(); ++r)
      ASSERT_TRUE(same_bits(ag[static_cast<std::size_t>(r) * count + k], value(r + 30, k)));
  }
  for (std::size_t k = 0; k < n; ++k) {
    double exact = 0.0, magnitude = 0.0;
    for (int r = 0; r < ranks(); ++r) exact += value(r + 50, k), magnitude += std::abs(value(r + 50, k));
    ASSERT_NEAR(ar[k], exact, ranks() * 6e-8 * magnitude);
  }
}

TEST(C10dComm, IntegerReductions) {
  for (std::size_t count : {std::size_t{1}, std::size_t{301}}) {
    const std::size_t n = count * uranks();
    std::vector<std::int64_t> s(n);
    std::vector<std::uint8_t> m(n);
    for (std::size_t k = 0; k < n; ++k) {
      s[k] = (static_cast<std::int64_t>(k) << 33) * (rank() + 1) - rank();
      m[k] = static_cast<std::uint8_t>((k * 37 + urank() * 101) % 256);
    }
    std::vector<std::int64_t> s_all = s;
    std::vector<std::uint8_t> m_all = m;
    world().reduce_scatter_int(s.data(), count, IntOp::SumI64);
    world().reduce_scatter_int(m.data(), count, IntOp::MaxU8);
    world().all_reduce_int(s_all.data(), n, IntOp::SumI64);
    world().all_reduce_int(m_all.data(), n, IntOp::MaxU8);
    for (std::size_t k = 0; k < n; ++k) {
      std::int64_t sum = 0;
      std::uint8_t mx = 0;
      for (int r = 0; r < ranks(); ++r) {
        sum += (static_cast<std::int64_t>(k) << 33) * (r + 1) - r;
        mx = std::max(mx, static_cast<std::uint8_t>((k * 37 + static_cast<std::size_t>(r) * 101) % 256));
      }
      ASSERT_EQ(s_all[k], sum);
      ASSERT_EQ(m_all[k], mx);
      if (k / count == urank()) {
        ASSERT_EQ(s[k], sum);
        ASSERT_EQ(m[k], mx);
      }
    }
  }
}

TEST(C10dComm, BroadcastFromEveryRootGatherBytesAndBarrier) {
  for (int root = 0; root < ranks(); ++root) {
    std::vector<char> b(37, static_cast<char>(rank()));
    world().broadcast_bytes(b.data(), b.size(), root);
    for (char c : b) ASSERT_EQ(c, static_cast<char>(root));
  }
  const std::string mine = "rank" + std::to_string(rank());
  std::vector<char> all(uranks() * 8, 0);
  char send[8] = {};
  std::memcpy(send, mine.data(), mine.size());
  world().all_gather_bytes(send, all.data(), 8);
  for (int r = 0; r < ranks(); ++r)
    EXPECT_EQ(std::string(all.data() + r * 8), "rank" + std::to_string(r));
  // In place: the send buffer is this rank's slot of the receive buffer.
  std::vector<std::int32_t> slots(uranks(), -1);
  slots[urank()] = 100 + rank();
  world().all_gather_bytes(&slots[urank()], slots.data(), sizeof(std::int32_t));
  for (int r = 0; r < ranks(); ++r) EXPECT_EQ(slots[static_cast<std::size_t>(r)], 100 + r);
  for (int i = 0; i < 3; ++i) world().barrier();
}

// Local argument checks: every rank throws before anything is sent.
TEST(C10dComm, InvalidArgumentsAreErrors) {
  float f[8] = {};
  expect_error(Status::InvalidArgument, "root", [&] { world().broadcast_bytes(f, 4, ranks()); });
  expect_error(Status::InvalidArgument, "root", [&] { world().broadcast_bytes(f, 4, -1); });
  expect_error(Status::InvalidArgument, "wire",
               [&] { world().start_reduce_scatter_sum(f, 1, CommType::F64); });
  expect_error(Status::InvalidArgument, "wire",
               [&] { world().start_all_reduce_sum(f, 1, CommType::U16); });
  expect_error(Status::InvalidArgument, "type",
               [&] { world().start_all_gather(f, 1, CommType::BF16); });
  expect_error(Status::InvalidArgument, "type",
               [&] { world().all_reduce_sum(f, 1, CommType::BF16); });
  expect_error(Status::InvalidArgument, "no process group",
               [] { libtorch::make_c10d_communicator({}); });
  expect_error(Status::InvalidArgument, "rank 2 is not in [0, 2)",
               [] { libtorch::make_gloo_communicator(2, 2, "/nonexistent/x"); });
  expect_error(Status::InvalidArgument, "rank -1",
               [] { libtorch::make_gloo_communicator(-1, 2, "/nonexistent/x"); });
  expect_error(Status::InvalidArgument, "empty path",
               [] { libtorch::make_gloo_communicator(0, 1, ""); });
  expect_error(Status::InvalidArgument, "timeout_s",
               [] { libtorch::make_gloo_communicator(0, 1, "/nonexistent/x", 0.0); });
  expect_error(Status::InvalidArgument, "seconds",
               [&] { world().set_collective_timeout(-1.0); });
}

// The environment's mistakes are named (checked before any rendezvous).
TEST(C10dComm, EnvironmentErrorsNameTheVariable) {
  struct Saved {
    std::string name;
    std::optional<std::string> value;
  };
  std::vector<Saved> saved;
  for (const char* v : {"RANK", "WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK",
                        "OMPI_COMM_WORLD_SIZE", "SHARDOPT_GLOO_FILE", "MASTER_ADDR", "MASTER_PORT",
                        "SHARDOPT_GLOO_TIMEOUT"}) {
    const char* x = std::getenv(v);
    saved.push_back({v, x ? std::optional<std::string>(x) : std::nullopt});
    unsetenv(v);
  }
  auto expect = [](const std::string& text) {
    expect_error(Status::InvalidArgument, text, [] { libtorch::make_gloo_communicator_from_env(); });
  };
  expect("no rank in the environment");
  setenv("RANK", "0", 1);
  expect("WORLD_SIZE is not set");
  setenv("WORLD_SIZE", "two", 1);
  expect("WORLD_SIZE='two'");
  setenv("WORLD_SIZE", "2", 1);
  setenv("RANK", "2", 1);
  expect("rank 2 is not in [0, 2)");
  setenv("RANK", "-1", 1);
  expect("RANK='-1'");
  unsetenv("RANK");
  unsetenv("WORLD_SIZE");
  setenv("PMI_SIZE", "3", 1);
  expect("PMI_RANK is not set");
  setenv("PMI_RANK", "0", 1);
  setenv("SHARDOPT_GLOO_TIMEOUT", "soon", 1);
  expect("SHARDOPT_GLOO_TIMEOUT='soon'");
  setenv("SHARDOPT_GLOO_TIMEOUT", "-5", 1);
  expect("SHARDOPT_GLOO_TIMEOUT='-5'");
  unsetenv("SHARDOPT_GLOO_TIMEOUT");
  expect("set SHARDOPT_GLOO_FILE, or MASTER_ADDR");
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  expect("MASTER_PORT is not");
  setenv("MASTER_PORT", "70000", 1);
  expect("MASTER_PORT=70000");
  setenv("MASTER_PORT", "http", 1);
  expect("MASTER_PORT='http'");
  for (const Saved& s : saved) {
    if (s.value) setenv(s.name.c_str(), s.value->c_str(), 1);
    else unsetenv(s.name.c_str());
  }
}

// A group of our own over a FileStore, through make_c10d_communicator: any c10d group works.
TEST(C10dComm, WrapsAProcessGroupMadeByTheCaller) {
  test::SharedDir dir(world());
  auto store = c10::make_intrusive<c10d::FileStore>((dir.path() / "store").string(), ranks());
  auto options = c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(60));
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  auto group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank(), ranks(), options);
  auto comm = libtorch::make_c10d_communicator(group);
  EXPECT_EQ(comm->rank(), rank());
  EXPECT_EQ(comm->size(), ranks());
  EXPECT_EQ(comm->name(), "c10d:gloo");
  std::vector<float> buf = buffer_of(rank(), 5 * uranks());
  comm->reduce_scatter_sum_inplace(buf.data(), 5);
  for (std::size_t k = 0; k < 5; ++k)
    EXPECT_TRUE(same_bits(buf[urank() * 5 + k], rank_order_sum(urank() * 5 + k)));
}

// A collective that some rank never enters: rank 0 gets Error(Communication) in bounded time,
// (a) from its own wait (set_collective_timeout) and (b) from gloo's timeout, the group's
// (make_gloo_communicator's timeout_s) when waits are unbounded. The other ranks keep their
// side of the group open meanwhile (the world's barrier), so that rank 0 really waits.
TEST(C10dComm, ACollectiveNobodyJoinsTimesOutWithAnError) {
  if (ranks() < 2) GTEST_SKIP() << "needs 2 ranks";
  test::SharedDir dir(world());
  struct Case {
    const char* name;
    double group_timeout_s, wait_timeout_s;
  };
  for (const Case& c : {Case{"wait", 30.0, 0.5}, Case{"group", 2.0, 0.0}}) {
    SCOPED_TRACE(c.name);
    world().barrier();  // the ranks start the rendezvous together (its timeout is short)
    auto side = libtorch::make_gloo_communicator(rank(), ranks(), (dir.path() / c.name).string(),
                                                 c.group_timeout_s);
    world().barrier();
    EXPECT_FALSE(std::filesystem::exists(dir.path() / c.name));  // deleted once all joined
    side->set_collective_timeout(c.wait_timeout_s);
    if (rank() == 0) {
      const auto begin = std::chrono::steady_clock::now();
      try {
        const CallScope call("evaluate(rank 0 only)");  // named in the error
        std::vector<double> x(3, 1.0);
        side->all_reduce_sum(x.data(), x.size(), CommType::F64);
        ADD_FAILURE() << "the all-reduce that only rank 0 entered returned";
      } catch (const Error& e) {
        EXPECT_EQ(e.status(), Status::Communication) << e.what();
        EXPECT_NE(std::string(e.what()).find("c10d all_reduce_sum"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find(" in evaluate(rank 0 only)"), std::string::npos)
            << e.what();
      }
      const double waited =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
      EXPECT_LT(waited, 20.0);
      EXPECT_GE(waited, std::min(c.wait_timeout_s > 0 ? c.wait_timeout_s : c.group_timeout_s, 1.0) * 0.9);
    }
    world().barrier();
    // Destroying the groups: the others close their connections, which also ends what rank
    // 0's gloo thread still runs.
  }
}

// ---- the optimizer over the gloo communicator -----------------------------------------------

namespace {

struct OptCase {
  Stage stage;
  DType dtype;
  bool overlap;
};

std::string opt_case_name(const testing::TestParamInfo<OptCase>& info) {
  std::string s = std::string(stage_name(info.param.stage)) + "_" + dtype_name(info.param.dtype) +
                  (info.param.overlap ? "_overlap" : "_in_step");
  for (char& ch : s)
    if (ch == '-') ch = '_';
  return s;
}

class C10dOptimizer : public testing::TestWithParam<OptCase> {};

}  // namespace

// A few steps of the sharded optimizer over gloo against the double-precision reference fed
// the average gradient (exactly summable gradients: the check is the update arithmetic and
// that every collective delivered the right data).
TEST_P(C10dOptimizer, StepsMatchTheDoubleReference) {
  const OptCase c = GetParam();
  OptimizerOptions o;
  o.stage = c.stage;
  o.param_dtype = c.dtype;
  o.overlap = c.overlap;
  o.bucket_elems = 700;
  o.adam.lr = 1e-2;
  o.adam.weight_decay = 0.1;
  o.adam.max_grad_norm = 5.0;
  test::Harness h(o);
  EXPECT_EQ(h.opt->comm().name(), "c10d:gloo");
  for (int step = 1; step <= 3; ++step) h.step_and_check(step);
}

INSTANTIATE_TEST_SUITE_P(Stages012, C10dOptimizer,
                         testing::Values(OptCase{Stage::DataParallel, DType::BF16, true},
                                         OptCase{Stage::DataParallel, DType::F32, false},
                                         OptCase{Stage::Zero1, DType::BF16, true},
                                         OptCase{Stage::Zero1, DType::F32, false},
                                         OptCase{Stage::Zero2, DType::BF16, true},
                                         OptCase{Stage::Zero2, DType::F32, false}),
                         opt_case_name);

namespace {

// Micro-batch r's gradient of parameter i (not exactly summable in fp32: the reproducible
// reduction's exact sums are what makes the two runs agree).
float micro_batch_grad(int r, int step, std::size_t i, std::size_t k) {
  return test::synth(static_cast<std::uint64_t>(r) + 7, static_cast<std::uint64_t>(step), i, k) *
         std::ldexp(1.0f, static_cast<int>((k * 13 + i) % 17) - 8);
}

struct Snapshot {
  std::vector<std::vector<float>> master;
  std::vector<std::vector<std::uint16_t>> replica;
  std::vector<double> norms;
};

// Three steps; `micro_batches` lists the micro-batches this rank computes each step.
Snapshot train_reproducible(std::shared_ptr<Communicator> comm, Stage stage,
                            const std::vector<int>& micro_batches) {
  OptimizerOptions o;
  o.stage = stage;
  o.reduction = Reduction::Reproducible;
  o.bucket_elems = 600;
  o.adam.lr = 1e-2;
  ShardedOptimizer opt(std::move(comm), o);
  const std::vector<std::size_t>& sizes = test::kSizes;
  for (std::size_t i = 0; i < sizes.size(); ++i) opt.add_param("p" + std::to_string(i), sizes[i]);
  opt.finalize();
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    std::vector<float> init(sizes[i]);
    for (std::size_t k = 0; k < init.size(); ++k) init[k] = test::init_value(i, k);
    opt.set_param(i, init);
  }
  Snapshot s;
  for (int step = 1; step <= 3; ++step) {
    for (int mb : micro_batches) {
      opt.begin_backward(false);
      for (std::size_t i = sizes.size(); i-- > 0;) {
        std::span<float> g = opt.grad(i);
        for (std::size_t k = 0; k < g.size(); ++k) g[k] = micro_batch_grad(mb, step, i, k);
        opt.grad_ready(i);
      }
    }
    s.norms.push_back(opt.step().grad_norm);
  }
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    s.master.emplace_back(sizes[i]);
    opt.get_master(i, s.master.back());
    std::vector<std::uint16_t> bits;
    for (bf16 x : opt.param<bf16>(i)) bits.push_back(x.bits);
    s.replica.push_back(std::move(bits));
  }
  return s;
}

}  // namespace

// Reproducible mode over gloo (reduce_scatter_combine's all-to-all): N ranks with one
// micro-batch each (the direct exchange of raw values) and with two each (the packed
// exchange of the bins) give bit for bit the steps of one process that computes all of them
// (the single-process communicator).
TEST(C10dOptimizerReproducible, EqualsOneProcessWithEveryMicroBatchBitForBit) {
  for (int per_rank : {1, 2}) {
    for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2}) {
      SCOPED_TRACE(std::string(stage_name(stage)) + ", " + std::to_string(per_rank) + " per rank");
      std::vector<int> all, mine;
      for (int k = 0; k < per_rank * ranks(); ++k) {
        all.push_back(k);
        if (k % ranks() == rank()) mine.push_back(k);
      }
      const Snapshot one = train_reproducible(make_single_process_communicator(), stage, all);
      const Snapshot got = train_reproducible(test::world(), stage, mine);
      for (std::size_t s = 0; s < one.norms.size(); ++s)
        EXPECT_EQ(std::bit_cast<std::uint64_t>(got.norms[s]), std::bit_cast<std::uint64_t>(one.norms[s]))
            << "step " << s + 1 << ": norm " << got.norms[s] << " vs " << one.norms[s];
      for (std::size_t i = 0; i < one.master.size(); ++i) {
        ASSERT_EQ(std::memcmp(got.master[i].data(), one.master[i].data(), one.master[i].size() * 4), 0)
            << "master of p" << i;
        ASSERT_EQ(got.replica[i], one.replica[i]) << "replica of p" << i;
      }
    }
  }
}
