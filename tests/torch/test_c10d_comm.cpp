// test_c10d_comm.cpp: the Communicator over LibTorch's c10d gloo group, at 1-4 ranks with no
// MPI in the processes. Every collective against a result computed locally from every
// rank's (reproducible) input: the reduce-scatter sums in rank order, so its result is
// compared bit for bit; sizes that do and do not divide; started requests completed out of
// order; the integer reductions of reproducible mode; the environment's errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "shardopt/bf16.hpp"
#include "shardopt/torch/c10d_comm.hpp"
#include "support/world.hpp"

using namespace shardopt;

namespace {

int rank() { return test::world()->rank(); }
int ranks() { return test::world()->size(); }

// Element k of rank r's buffer: varied signs and magnitudes, so that the order of a sum
// matters in fp32.
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

const std::size_t kCounts[] = {1, 7, 1000, 4099};

}  // namespace

TEST(C10dComm, NameAndSize) {
  EXPECT_EQ(test::world()->name(), "c10d:gloo");
  const char* size = std::getenv("PMI_SIZE");
  if (size != nullptr) EXPECT_EQ(ranks(), std::atoi(size));
}

TEST(C10dComm, ReduceScatterSumsInRankOrderBitForBit) {
  for (std::size_t count : kCounts) {
    const std::size_t n = count * static_cast<std::size_t>(ranks());
    std::vector<float> buf = buffer_of(rank(), n);
    test::world()->reduce_scatter_sum_inplace(buf.data(), count);
    for (std::size_t k = 0; k < count; ++k) {
      const std::size_t at = static_cast<std::size_t>(rank()) * count + k;
      float expect = value(0, at);
      double exact = value(0, at), magnitude = std::abs(value(0, at));
      for (int r = 1; r < ranks(); ++r) {
        expect += value(r, at);
        exact += value(r, at);
        magnitude += std::abs(value(r, at));
      }
      ASSERT_EQ(std::memcmp(&buf[at], &expect, 4), 0) << "count " << count << " k " << k;
      // fp32 summation of N terms: within N ulps of their magnitude.
      ASSERT_NEAR(buf[at], exact, ranks() * 6e-8 * magnitude);
    }
  }
}

TEST(C10dComm, ReduceScatterBf16WireRoundsEveryPartialSum) {
  for (std::size_t count : kCounts) {
    const std::size_t n = count * static_cast<std::size_t>(ranks());
    std::vector<float> buf = buffer_of(rank(), n);
    test::world()->reduce_scatter_sum_inplace(buf.data(), count, CommType::BF16);
    for (std::size_t k = 0; k < count; ++k) {
      const std::size_t at = static_cast<std::size_t>(rank()) * count + k;
      bf16 acc = to_bf16(value(0, at));
      for (int r = 1; r < ranks(); ++r) acc = to_bf16(to_float(acc) + to_float(to_bf16(value(r, at))));
      ASSERT_EQ(buf[at], to_float(acc)) << "count " << count << " k " << k;
    }
  }
}

TEST(C10dComm, AllGatherInPlaceF32AndU16) {
  for (std::size_t count : kCounts) {
    const std::size_t n = count * static_cast<std::size_t>(ranks());
    std::vector<float> f(n, -1.0f);
    std::vector<std::uint16_t> h(n, 0xFFFF);
    for (std::size_t k = 0; k < count; ++k) {
      f[static_cast<std::size_t>(rank()) * count + k] = value(rank(), k);
      h[static_cast<std::size_t>(rank()) * count + k] = static_cast<std::uint16_t>(rank() * 1000 + k);
    }
    test::world()->all_gather_inplace(f.data(), count, CommType::F32);
    test::world()->all_gather_inplace(h.data(), count, CommType::U16);
    for (int r = 0; r < ranks(); ++r)
      for (std::size_t k = 0; k < count; ++k) {
        ASSERT_EQ(f[static_cast<std::size_t>(r) * count + k], value(r, k));
        ASSERT_EQ(h[static_cast<std::size_t>(r) * count + k], static_cast<std::uint16_t>(r * 1000 + k));
      }
  }
}

TEST(C10dComm, AllReduceF32F64AndBf16Wire) {
  for (std::size_t count : kCounts) {
    std::vector<float> f = buffer_of(rank(), count);
    test::world()->start_all_reduce_sum(f.data(), count, CommType::F32)->wait();
    std::vector<double> d(count);
    for (std::size_t k = 0; k < count; ++k) d[k] = value(rank(), k);
    test::world()->all_reduce_sum(d.data(), count, CommType::F64);
    std::vector<float> b = buffer_of(rank(), count);
    test::world()->start_all_reduce_sum(b.data(), count, CommType::BF16)->wait();
    for (std::size_t k = 0; k < count; ++k) {
      double exact = 0.0, magnitude = 0.0;
      bf16 acc = to_bf16(value(0, k));
      for (int r = 0; r < ranks(); ++r) exact += value(r, k), magnitude += std::abs(value(r, k));
      for (int r = 1; r < ranks(); ++r) acc = to_bf16(to_float(acc) + to_float(to_bf16(value(r, k))));
      ASSERT_NEAR(f[k], exact, ranks() * 6e-8 * magnitude);
      ASSERT_EQ(d[k], exact);  // small integers over powers of two: exact in double
      ASSERT_EQ(b[k], to_float(acc));
    }
  }
}

TEST(C10dComm, StartedRequestsCompleteInAnyOrder) {
  const std::size_t count = 513;
  const std::size_t n = count * static_cast<std::size_t>(ranks());
  std::vector<std::vector<float>> bufs;
  std::vector<std::unique_ptr<CommRequest>> requests;
  for (int i = 0; i < 3; ++i) {
    bufs.push_back(buffer_of(rank() + 10 * i, n));
  }
  for (int i = 0; i < 3; ++i)
    requests.push_back(test::world()->start_reduce_scatter_sum(bufs[static_cast<std::size_t>(i)].data(), count, CommType::F32));
  requests[2]->wait();
  while (!requests[0]->test()) {
  }
  requests[1].reset();  // destroying an unfinished request waits for it
  requests[0]->wait();  // a second wait is a no-op
  for (int i = 0; i < 3; ++i)
    for (std::size_t k = 0; k < count; ++k) {
      const std::size_t at = static_cast<std::size_t>(rank()) * count + k;
      float expect = value(10 * i, at);
      for (int r = 1; r < ranks(); ++r) expect += value(r + 10 * i, at);
      ASSERT_EQ(bufs[static_cast<std::size_t>(i)][at], expect) << i;
    }
}

TEST(C10dComm, IntegerReductions) {
  const std::size_t count = 301;
  const std::size_t n = count * static_cast<std::size_t>(ranks());
  std::vector<std::int64_t> s(n);
  std::vector<std::uint8_t> m(n);
  for (std::size_t k = 0; k < n; ++k) {
    s[k] = (static_cast<std::int64_t>(k) << 33) * (rank() + 1) - rank();
    m[k] = static_cast<std::uint8_t>((k * 37 + static_cast<std::size_t>(rank()) * 101) % 256);
  }
  std::vector<std::int64_t> s_all = s;
  std::vector<std::uint8_t> m_all = m;
  test::world()->reduce_scatter_int(s.data(), count, IntOp::SumI64);
  test::world()->reduce_scatter_int(m.data(), count, IntOp::MaxU8);
  test::world()->all_reduce_int(s_all.data(), n, IntOp::SumI64);
  test::world()->all_reduce_int(m_all.data(), n, IntOp::MaxU8);
  for (std::size_t k = 0; k < n; ++k) {
    std::int64_t sum = 0;
    std::uint8_t mx = 0;
    for (int r = 0; r < ranks(); ++r) {
      sum += (static_cast<std::int64_t>(k) << 33) * (r + 1) - r;
      mx = std::max(mx, static_cast<std::uint8_t>((k * 37 + static_cast<std::size_t>(r) * 101) % 256));
    }
    ASSERT_EQ(s_all[k], sum);
    ASSERT_EQ(m_all[k], mx);
    if (k / count == static_cast<std::size_t>(rank())) {
      ASSERT_EQ(s[k], sum);
      ASSERT_EQ(m[k], mx);
    }
  }
}

TEST(C10dComm, BroadcastFromEveryRootAndGatherBytes) {
  for (int root = 0; root < ranks(); ++root) {
    std::vector<char> b(37, static_cast<char>(rank()));
    test::world()->broadcast_bytes(b.data(), b.size(), root);
    for (char c : b) ASSERT_EQ(c, static_cast<char>(root));
  }
  const std::string mine = "rank" + std::to_string(rank());
  std::vector<char> all(static_cast<std::size_t>(ranks()) * 8, 0);
  char send[8] = {};
  std::memcpy(send, mine.data(), mine.size());
  test::world()->all_gather_bytes(send, all.data(), 8);
  for (int r = 0; r < ranks(); ++r)
    EXPECT_EQ(std::string(all.data() + r * 8), "rank" + std::to_string(r));
  test::world()->barrier();
  EXPECT_THROW(test::world()->broadcast_bytes(send, 8, ranks()), Error);
}

// The environment's mistakes are named (local: no rendezvous is attempted).
TEST(C10dComm, EnvironmentErrorsNameTheVariable) {
  struct Saved {
    std::string name;
    std::optional<std::string> value;
  };
  std::vector<Saved> saved;
  for (const char* v : {"RANK", "WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK",
                        "OMPI_COMM_WORLD_SIZE", "SHARDOPT_GLOO_FILE", "MASTER_ADDR", "MASTER_PORT"}) {
    const char* x = std::getenv(v);
    saved.push_back({v, x ? std::optional<std::string>(x) : std::nullopt});
    unsetenv(v);
  }
  auto expect = [](const std::string& text) {
    try {
      libtorch::make_gloo_communicator_from_env();
      ADD_FAILURE() << "no error, expected " << text;
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::InvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  expect("no rank in the environment");
  setenv("RANK", "0", 1);
  expect("WORLD_SIZE is not set");
  setenv("WORLD_SIZE", "two", 1);
  expect("WORLD_SIZE='two'");
  setenv("WORLD_SIZE", "2", 1);
  setenv("RANK", "2", 1);
  expect("rank 2 is not in [0, 2)");
  setenv("RANK", "0", 1);
  expect("set SHARDOPT_GLOO_FILE, or MASTER_ADDR");
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", "70000", 1);
  expect("MASTER_PORT=70000");
  for (const Saved& s : saved) {
    if (s.value) setenv(s.name.c_str(), s.value->c_str(), 1);
    else unsetenv(s.name.c_str());
  }
}
