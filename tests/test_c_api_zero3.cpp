// test_c_api_zero3.cpp: stage 3 through the C ABI (one process): units, acquire / prefetch /
// release, the gathered views, and the errors as status codes.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "shardopt/shardopt.h"

namespace {

TEST(CApiZero3, UnitsAcquirePrefetchRelease) {
  shardopt_config_t c;
  ASSERT_EQ(shardopt_config_init(&c), SHARDOPT_SUCCESS);
  c.stage = SHARDOPT_STAGE_ZERO3;
  c.bucket_elems = 256;
  shardopt_optimizer_t opt = nullptr;
  ASSERT_EQ(shardopt_create(&opt, &c), SHARDOPT_SUCCESS) << shardopt_last_error(nullptr);
  int unit = -1;
  const std::size_t sizes[3] = {300, 70, 500};
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(shardopt_begin_unit(opt, &unit), SHARDOPT_SUCCESS);
    EXPECT_EQ(unit, i);
    ASSERT_EQ(shardopt_add_param(opt, i == 0 ? "a" : i == 1 ? "b" : "c", sizes[i], 0, nullptr),
              SHARDOPT_SUCCESS);
  }
  std::size_t units = 0;
  EXPECT_EQ(shardopt_num_units(opt, &units), SHARDOPT_ERROR_INVALID_STATE);
  ASSERT_EQ(shardopt_finalize(opt), SHARDOPT_SUCCESS);
  ASSERT_EQ(shardopt_num_units(opt, &units), SHARDOPT_SUCCESS);
  EXPECT_EQ(units, 3u);
  std::vector<float> v(sizes[1]);
  for (std::size_t k = 0; k < v.size(); ++k) v[k] = 0.5f + static_cast<float>(k);
  ASSERT_EQ(shardopt_set_param(opt, 1, v.data(), v.size()), SHARDOPT_SUCCESS);

  const std::uint16_t* data = nullptr;
  std::size_t numel = 0;
  EXPECT_EQ(shardopt_param_bf16(opt, 1, &data, &numel), SHARDOPT_ERROR_INVALID_STATE);
  EXPECT_EQ(shardopt_release(opt, 1), SHARDOPT_ERROR_INVALID_STATE);
  ASSERT_EQ(shardopt_acquire(opt, 0), SHARDOPT_SUCCESS);
  ASSERT_EQ(shardopt_prefetch(opt, 1), SHARDOPT_SUCCESS);
  EXPECT_EQ(shardopt_acquire(opt, 2), SHARDOPT_ERROR_INVALID_STATE);  // both buffers held
  EXPECT_EQ(shardopt_step(opt, nullptr), SHARDOPT_ERROR_INVALID_STATE);
  EXPECT_EQ(shardopt_release(opt, 0), SHARDOPT_SUCCESS);
  ASSERT_EQ(shardopt_acquire(opt, 1), SHARDOPT_SUCCESS);
  EXPECT_EQ(shardopt_acquire(opt, 1), SHARDOPT_ERROR_INVALID_STATE);  // twice
  ASSERT_EQ(shardopt_param_bf16(opt, 1, &data, &numel), SHARDOPT_SUCCESS);
  ASSERT_EQ(numel, v.size());
  for (std::size_t k = 0; k < numel; ++k) EXPECT_EQ(data[k], shardopt_float_to_bf16(v[k]));
  EXPECT_EQ(shardopt_release(opt, 1), SHARDOPT_SUCCESS);
  EXPECT_EQ(shardopt_acquire(opt, 7), SHARDOPT_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(shardopt_step(opt, nullptr), SHARDOPT_SUCCESS) << shardopt_last_error(opt);
  EXPECT_EQ(shardopt_begin_unit(opt, nullptr), SHARDOPT_ERROR_INVALID_STATE);  // finalized
  EXPECT_EQ(shardopt_destroy(opt), SHARDOPT_SUCCESS);

  // At stage 1 the calls are errors.
  c.stage = SHARDOPT_STAGE_ZERO1;
  ASSERT_EQ(shardopt_create(&opt, &c), SHARDOPT_SUCCESS);
  ASSERT_EQ(shardopt_add_param(opt, "a", 10, 0, nullptr), SHARDOPT_SUCCESS);
  ASSERT_EQ(shardopt_finalize(opt), SHARDOPT_SUCCESS);
  EXPECT_EQ(shardopt_acquire(opt, 0), SHARDOPT_ERROR_INVALID_STATE);
  EXPECT_EQ(shardopt_prefetch(opt, 0), SHARDOPT_ERROR_INVALID_STATE);
  EXPECT_EQ(shardopt_release(opt, 0), SHARDOPT_ERROR_INVALID_STATE);
  EXPECT_EQ(shardopt_destroy(opt), SHARDOPT_SUCCESS);
}

}  // namespace
