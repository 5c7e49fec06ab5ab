// same_error.hpp: the check that a call fails the same way on every rank.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "shardopt/error.hpp"
#include "shardopt/layout.hpp"  // fnv1a64
#include "support/world.hpp"

namespace shardopt::test {

/// Runs f() on every rank (collective). Every rank must throw Error(want) whose message
/// contains each of `needles`, and the message must be the same on every rank (compared by
/// hash over test::world()).
inline void expect_same_error(Status want, const std::function<void()>& f,
                              const std::vector<std::string>& needles, const std::string& what) {
  Status got = Status::Ok;
  std::string message;
  try {
    f();
  } catch (const Error& e) {
    got = e.status();
    message = e.what();
  }
  EXPECT_EQ(got, want) << what << ": " << (message.empty() ? "no error" : message);
  for (const std::string& n : needles)
    EXPECT_NE(message.find(n), std::string::npos) << what << ": '" << n << "' not in: " << message;
  auto w = world();
  const std::uint64_t mine = fnv1a64(message.data(), message.size());
  std::vector<std::uint64_t> all(static_cast<std::size_t>(w->size()));
  w->all_gather_bytes(&mine, all.data(), sizeof mine);
  for (std::size_t r = 0; r < all.size(); ++r)
    EXPECT_EQ(all[r], mine) << what << ": rank " << r << " got a different message than this "
                            << "rank's: " << message;
}

}  // namespace shardopt::test
