// test_c_api.cpp: the C ABI (shardopt.h) called from C++: every misuse returns a status with a
// message naming the call and never crashes; training through it equals the C++ API's.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "shardopt/checkpoint.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/shardopt.h"
#include "support/reference.hpp"

namespace {

using shardopt::test::synth;

std::string last(shardopt_optimizer_t opt) { return shardopt_last_error(opt); }

// A result struct ready for shardopt_step (struct_size set).
shardopt_step_result_t step_result() {
  shardopt_step_result_t r;
  EXPECT_EQ(shardopt_step_result_init(&r), SHARDOPT_SUCCESS);
  return r;
}


shardopt_config_t config(int stage, int dtype) {
  shardopt_config_t c;
  EXPECT_EQ(shardopt_config_init(&c), SHARDOPT_SUCCESS);
  c.stage = stage;
  c.param_dtype = dtype;
  c.lr = 1e-2;
  c.max_grad_norm = 1.0;
  c.bucket_elems = 128;
  return c;
}

// An optimizer with params "a" (100 elements) and "b" (7, in a no-decay group), finalized or not.
struct Fixture {
  shardopt_optimizer_t opt = nullptr;
  explicit Fixture(bool finalize = true, int stage = SHARDOPT_STAGE_ZERO1,
                   int dtype = SHARDOPT_DTYPE_F32) {
    const shardopt_config_t c = config(stage, dtype);
    EXPECT_EQ(shardopt_create(&opt, &c), SHARDOPT_SUCCESS);
    int g = -1;
    EXPECT_EQ(shardopt_add_group(opt, 1.0, 0, &g), SHARDOPT_SUCCESS);
    EXPECT_EQ(g, 1);
    EXPECT_EQ(shardopt_add_param(opt, "a", 100, 0, nullptr), SHARDOPT_SUCCESS);
    EXPECT_EQ(shardopt_add_param(opt, "b", 7, g, nullptr), SHARDOPT_SUCCESS);
    if (finalize) EXPECT_EQ(shardopt_finalize(opt), SHARDOPT_SUCCESS);
  }
  ~Fixture() { EXPECT_EQ(shardopt_destroy(opt), SHARDOPT_SUCCESS); }
};

// Expects `status` and a last-error message that names `fn` and contains `reason`.
#define EXPECT_FAILS(call, status, fn, reason)                                    \
  do {                                                                            \
    EXPECT_EQ((call), (status));                                                  \
    const std::string msg_ = shardopt_last_error(nullptr);                        \
    EXPECT_NE(msg_.find(fn), std::string::npos) << msg_;                          \
    EXPECT_NE(msg_.find(reason), std::string::npos) << msg_;                      \
  } while (0)

TEST(CApi, VersionMatchesHeader) {
  EXPECT_EQ(shardopt_version(), SHARDOPT_VERSION_CODE);
  EXPECT_STREQ(shardopt_version_string(), SHARDOPT_VERSION_STRING);
  EXPECT_EQ(SHARDOPT_VERSION_CODE,
            SHARDOPT_VERSION_MAJOR * 10000 + SHARDOPT_VERSION_MINOR * 100 + SHARDOPT_VERSION_PATCH);
}

TEST(CApi, StatusStringsAndCategoryNames) {
  EXPECT_STREQ(shardopt_status_string(SHARDOPT_SUCCESS), "ok");
  EXPECT_STREQ(shardopt_status_string(SHARDOPT_ERROR_INVALID_STATE), "invalid state");
  for (int s = 0; s <= SHARDOPT_ERROR_INTERNAL; ++s)
    EXPECT_STRNE(shardopt_status_string(static_cast<shardopt_status_t>(s)), "unknown status");
  EXPECT_STREQ(shardopt_status_string(static_cast<shardopt_status_t>(12)), "unknown status");
  EXPECT_STREQ(shardopt_status_string(static_cast<shardopt_status_t>(-1)), "unknown status");
  EXPECT_STREQ(shardopt_mem_category_name(SHARDOPT_MEM_MOMENTS), "moments");
  EXPECT_STREQ(shardopt_mem_category_name(SHARDOPT_MEM_TOTAL), "total");
  EXPECT_STREQ(shardopt_mem_category_name(static_cast<shardopt_mem_category_t>(42)), "?");
}

TEST(CApi, Bf16Helpers) {
  EXPECT_EQ(shardopt_float_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(shardopt_bf16_to_float(0xC040), -3.0f);
  // 1 + 2^-8 lies half-way between two bf16 values: ties go to the even one (1.0).
  EXPECT_EQ(shardopt_float_to_bf16(1.00390625f), 0x3F80);
  EXPECT_TRUE(std::isnan(shardopt_bf16_to_float(shardopt_float_to_bf16(NAN))));
}

TEST(CApi, NullHandleIsAnErrorEverywhere) {
  float f = 0;
  float* fp = nullptr;
  const float* cfp = nullptr;
  const std::uint16_t* hp = nullptr;
  std::size_t n = 0;
  int i = 0;
  double d = 0;
  std::int64_t s = 0;
  shardopt_step_result_t r;
  const auto bad = SHARDOPT_ERROR_INVALID_ARGUMENT;
  EXPECT_FAILS(shardopt_add_group(nullptr, 1, 1, &i), bad, "shardopt_add_group", "handle is NULL");
  EXPECT_FAILS(shardopt_add_param(nullptr, "x", 1, 0, &n), bad, "shardopt_add_param", "NULL");
  EXPECT_FAILS(shardopt_finalize(nullptr), bad, "shardopt_finalize", "NULL");
  EXPECT_FAILS(shardopt_comm_rank(nullptr, &i), bad, "shardopt_comm_rank", "NULL");
  EXPECT_FAILS(shardopt_comm_size(nullptr, &i), bad, "shardopt_comm_size", "NULL");
  EXPECT_FAILS(shardopt_num_params(nullptr, &n), bad, "shardopt_num_params", "NULL");
  EXPECT_FAILS(shardopt_param_numel(nullptr, 0, &n), bad, "shardopt_param_numel", "NULL");
  EXPECT_FAILS(shardopt_param_index(nullptr, "x", &n), bad, "shardopt_param_index", "NULL");
  EXPECT_FAILS(shardopt_step_count(nullptr, &s), bad, "shardopt_step_count", "NULL");
  EXPECT_FAILS(shardopt_set_param(nullptr, 0, &f, 1), bad, "shardopt_set_param", "NULL");
  EXPECT_FAILS(shardopt_get_master(nullptr, 0, &f, 1), bad, "shardopt_get_master", "NULL");
  EXPECT_FAILS(shardopt_param_f32(nullptr, 0, &cfp, &n), bad, "shardopt_param_f32", "NULL");
  EXPECT_FAILS(shardopt_param_bf16(nullptr, 0, &hp, &n), bad, "shardopt_param_bf16", "NULL");
  EXPECT_FAILS(shardopt_grad(nullptr, 0, &fp, &n), bad, "shardopt_grad", "NULL");
  EXPECT_FAILS(shardopt_accumulate_grad_f32(nullptr, 0, &f, 1), bad, "accumulate_grad_f32", "NULL");
  EXPECT_FAILS(shardopt_accumulate_grad_bf16(nullptr, 0, nullptr, 0), bad, "accumulate_grad_bf16", "NULL");
  EXPECT_FAILS(shardopt_grad_ready(nullptr, 0), bad, "shardopt_grad_ready", "NULL");
  EXPECT_FAILS(shardopt_reduce_gradients(nullptr), bad, "shardopt_reduce_gradients", "NULL");
  EXPECT_FAILS(shardopt_begin_backward(nullptr, 1), bad, "shardopt_begin_backward", "NULL");
  EXPECT_FAILS(shardopt_zero_grad(nullptr), bad, "shardopt_zero_grad", "NULL");
  EXPECT_FAILS(shardopt_step(nullptr, &r), bad, "shardopt_step", "NULL");
  EXPECT_FAILS(shardopt_set_lr(nullptr, 1), bad, "shardopt_set_lr", "NULL");
  EXPECT_FAILS(shardopt_get_lr(nullptr, &d), bad, "shardopt_get_lr", "NULL");
  EXPECT_FAILS(shardopt_set_hyper(nullptr, SHARDOPT_HYPER_EPS, 1), bad, "shardopt_set_hyper", "NULL");
  EXPECT_FAILS(shardopt_get_hyper(nullptr, SHARDOPT_HYPER_EPS, &d), bad, "shardopt_get_hyper", "NULL");
  EXPECT_FAILS(shardopt_set_group(nullptr, 0, 1, 1), bad, "shardopt_set_group", "NULL");
  EXPECT_FAILS(shardopt_memory_usage(nullptr, SHARDOPT_MEM_TOTAL, &n, &n), bad, "shardopt_memory_usage", "NULL");
  const char* name = nullptr;
  const void* base = nullptr;
  shardopt_config_t cfg;
  ASSERT_EQ(shardopt_config_init(&cfg), SHARDOPT_SUCCESS);
  EXPECT_FAILS(shardopt_comm_name(nullptr, &name), bad, "shardopt_comm_name", "NULL");
  EXPECT_FAILS(shardopt_get_config(nullptr, &cfg), bad, "shardopt_get_config", "NULL");
  EXPECT_FAILS(shardopt_num_groups(nullptr, &i), bad, "shardopt_num_groups", "NULL");
  EXPECT_FAILS(shardopt_get_group(nullptr, 0, &d, &i), bad, "shardopt_get_group", "NULL");
  EXPECT_FAILS(shardopt_get_exp_avg(nullptr, 0, &f, 1), bad, "shardopt_get_exp_avg", "NULL");
  EXPECT_FAILS(shardopt_get_exp_avg_sq(nullptr, 0, &f, 1), bad, "shardopt_get_exp_avg_sq", "NULL");
  EXPECT_FAILS(shardopt_replica(nullptr, &base, &n), bad, "shardopt_replica", "NULL");
  EXPECT_FAILS(shardopt_param_offset(nullptr, 0, &n), bad, "shardopt_param_offset", "NULL");
  EXPECT_FAILS(shardopt_wait_param(nullptr, 0), bad, "shardopt_wait_param", "NULL");
  EXPECT_FAILS(shardopt_wait_all(nullptr), bad, "shardopt_wait_all", "NULL");
  EXPECT_FAILS(shardopt_progress(nullptr), bad, "shardopt_progress", "NULL");
  EXPECT_FAILS(shardopt_get_loss_scale(nullptr, &d, &s, &s), bad, "shardopt_get_loss_scale", "NULL");
  EXPECT_FAILS(shardopt_set_loss_scale(nullptr, 1, 0, 0), bad, "shardopt_set_loss_scale", "NULL");
  EXPECT_FAILS(shardopt_save_checkpoint(nullptr, "x", 1, nullptr), bad, "shardopt_save_checkpoint", "NULL");
  EXPECT_FAILS(shardopt_load_checkpoint(nullptr, "x"), bad, "shardopt_load_checkpoint", "NULL");
  EXPECT_EQ(shardopt_step_result_init(nullptr), bad);
  EXPECT_EQ(shardopt_destroy(nullptr), SHARDOPT_SUCCESS);  // like free(NULL)
  EXPECT_EQ(shardopt_config_init(nullptr), bad);
}

TEST(CApi, DestroyedOrForeignHandleIsRejected) {
  shardopt_optimizer_t opt = nullptr;
  ASSERT_EQ(shardopt_create(&opt, nullptr), SHARDOPT_SUCCESS);
  ASSERT_NE(opt, nullptr);
  ASSERT_EQ(shardopt_destroy(opt), SHARDOPT_SUCCESS);
  EXPECT_FAILS(shardopt_finalize(opt), SHARDOPT_ERROR_INVALID_ARGUMENT, "shardopt_finalize",
               "not a live handle");
  EXPECT_FAILS(shardopt_destroy(opt), SHARDOPT_ERROR_INVALID_ARGUMENT, "shardopt_destroy",
               "not a live handle");
  // Any pointer that did not come from shardopt_create is refused without being read.
  int not_a_handle = 7;
  EXPECT_EQ(shardopt_step(reinterpret_cast<shardopt_optimizer_t>(&not_a_handle), nullptr),
            SHARDOPT_ERROR_INVALID_ARGUMENT);
}

TEST(CApi, CreateRejectsBadConfigAndNullOutput) {
  shardopt_optimizer_t opt = reinterpret_cast<shardopt_optimizer_t>(0x1);
  shardopt_config_t c = config(SHARDOPT_STAGE_ZERO1, SHARDOPT_DTYPE_BF16);
  c.struct_size = 3;  // not initialised by shardopt_config_init
  EXPECT_FAILS(shardopt_create(&opt, &c), SHARDOPT_ERROR_INVALID_ARGUMENT, "shardopt_create",
               "shardopt_config_init");
  EXPECT_EQ(opt, nullptr);  // set to NULL on failure
  for (auto [field, value] : {std::pair{&shardopt_config_t::stage, 4},
                              std::pair{&shardopt_config_t::param_dtype, 2},
                              std::pair{&shardopt_config_t::device, -1},
                              std::pair{&shardopt_config_t::adam_mode, 5}}) {
    c = config(SHARDOPT_STAGE_ZERO1, SHARDOPT_DTYPE_BF16);
    c.*field = value;
    EXPECT_FAILS(shardopt_create(&opt, &c), SHARDOPT_ERROR_INVALID_ARGUMENT, "shardopt_create", "config->");
  }
  c = config(SHARDOPT_STAGE_ZERO1, SHARDOPT_DTYPE_BF16);
  c.beta1 = 1.0;  // validated by the C++ layer
  EXPECT_FAILS(shardopt_create(&opt, &c), SHARDOPT_ERROR_INVALID_ARGUMENT, "shardopt_create", "beta1");
  c = config(SHARDOPT_STAGE_ZERO1, SHARDOPT_DTYPE_BF16);
  EXPECT_FAILS(shardopt_create(nullptr, &c), SHARDOPT_ERROR_INVALID_ARGUMENT, "shardopt_create",
               "output handle pointer is NULL");
}

TEST(CApi, CallsInTheWrongOrder) {
  Fixture f(/*finalize=*/false);
  float v[100] = {};
  float* g = nullptr;
  const float* p = nullptr;
  const auto state = SHARDOPT_ERROR_INVALID_STATE;
  EXPECT_FAILS(shardopt_step(f.opt, nullptr), state, "shardopt_step", "finalize");
  EXPECT_FAILS(shardopt_set_param(f.opt, 0, v, 100), state, "shardopt_set_param", "finalize");
  EXPECT_FAILS(shardopt_get_master(f.opt, 0, v, 100), state, "shardopt_get_master", "finalize");
  EXPECT_FAILS(shardopt_param_f32(f.opt, 0, &p, nullptr), state, "shardopt_param_f32", "finalize");
  EXPECT_FAILS(shardopt_grad(f.opt, 0, &g, nullptr), state, "shardopt_grad", "finalize");
  EXPECT_FAILS(shardopt_zero_grad(f.opt), state, "shardopt_zero_grad", "finalize");
  EXPECT_FAILS(shardopt_grad_ready(f.opt, 0), state, "shardopt_grad_ready", "finalize");
  ASSERT_EQ(shardopt_finalize(f.opt), SHARDOPT_SUCCESS);
  EXPECT_FAILS(shardopt_finalize(f.opt), state, "shardopt_finalize", "already finalized");
  EXPECT_FAILS(shardopt_add_param(f.opt, "c", 3, 0, nullptr), state, "shardopt_add_param", "already");
  EXPECT_FAILS(shardopt_add_group(f.opt, 1, 1, nullptr), state, "shardopt_add_group", "already");
  // The handle's own message is the same; it survives later successful calls.
  EXPECT_NE(last(f.opt).find("shardopt_add_group"), std::string::npos);
  EXPECT_EQ(shardopt_zero_grad(f.opt), SHARDOPT_SUCCESS);
  EXPECT_NE(last(f.opt).find("shardopt_add_group"), std::string::npos);
}

TEST(CApi, BadIndicesNamesAndGroups) {
  Fixture f;
  float v[100] = {};
  float* g = nullptr;
  const float* p = nullptr;
  std::size_t n = 0;
  const auto bad = SHARDOPT_ERROR_INVALID_ARGUMENT;
  EXPECT_FAILS(shardopt_set_param(f.opt, 2, v, 7), bad, "shardopt_set_param", "index");
  EXPECT_FAILS(shardopt_get_master(f.opt, 99, v, 7), bad, "shardopt_get_master", "index");
  EXPECT_FAILS(shardopt_param_f32(f.opt, SIZE_MAX, &p, &n), bad, "shardopt_param_f32", "index");
  EXPECT_FAILS(shardopt_grad(f.opt, 2, &g, &n), bad, "shardopt_grad", "index");
  EXPECT_FAILS(shardopt_accumulate_grad_f32(f.opt, 5, v, 7), bad, "accumulate_grad_f32", "index");
  EXPECT_FAILS(shardopt_grad_ready(f.opt, 2), bad, "shardopt_grad_ready", "index");
  EXPECT_FAILS(shardopt_param_numel(f.opt, 2, &n), bad, "shardopt_param_numel", "index");
  EXPECT_FAILS(shardopt_param_index(f.opt, "zz", &n), bad, "shardopt_param_index", "'zz'");
  EXPECT_FAILS(shardopt_param_index(f.opt, nullptr, &n), bad, "shardopt_param_index", "name is NULL");
  EXPECT_FAILS(shardopt_set_group(f.opt, 2, 1.0, 1), bad, "shardopt_set_group", "no group 2");
  EXPECT_FAILS(shardopt_set_group(f.opt, -1, 1.0, 1), bad, "shardopt_set_group", "no group");
  EXPECT_FAILS(shardopt_set_group(f.opt, 1, -1.0, 1), bad, "shardopt_set_group", "lr_scale");
  EXPECT_FAILS(shardopt_set_group(f.opt, 1, 1.0, 2), bad, "shardopt_set_group", "weight_decay");
  EXPECT_FAILS(shardopt_memory_usage(f.opt, static_cast<shardopt_mem_category_t>(6), &n, nullptr),
               bad, "shardopt_memory_usage", "category");
  EXPECT_EQ(shardopt_param_index(f.opt, "b", &n), SHARDOPT_SUCCESS);
  EXPECT_EQ(n, 1u);
}

TEST(CApi, RegistrationErrors) {
  Fixture f(/*finalize=*/false);
  const auto bad = SHARDOPT_ERROR_INVALID_ARGUMENT;
  EXPECT_FAILS(shardopt_add_param(f.opt, nullptr, 3, 0, nullptr), bad, "shardopt_add_param", "name is NULL");
  EXPECT_FAILS(shardopt_add_param(f.opt, "", 3, 0, nullptr), bad, "shardopt_add_param", "empty");
  EXPECT_FAILS(shardopt_add_param(f.opt, "a", 3, 0, nullptr), bad, "shardopt_add_param", "a");
  EXPECT_FAILS(shardopt_add_param(f.opt, "z", 0, 0, nullptr), bad, "shardopt_add_param", "z");
  EXPECT_FAILS(shardopt_add_param(f.opt, "z", 3, 7, nullptr), bad, "shardopt_add_param", "group 7");
  EXPECT_FAILS(shardopt_add_group(f.opt, -2.0, 1, nullptr), bad, "shardopt_add_group", "lr_scale");
  EXPECT_FAILS(shardopt_add_group(f.opt, 1.0, 3, nullptr), bad, "shardopt_add_group", "weight_decay");
  std::size_t n = 0;
  EXPECT_EQ(shardopt_num_params(f.opt, &n), SHARDOPT_SUCCESS);
  EXPECT_EQ(n, 2u);  // failed registrations left nothing behind
}

TEST(CApi, WrongSizesAndNullBuffers) {
  Fixture f;
  std::vector<float> v(101);
  std::vector<std::uint16_t> h(101);
  const auto bad = SHARDOPT_ERROR_INVALID_ARGUMENT;
  EXPECT_FAILS(shardopt_set_param(f.opt, 0, v.data(), 99), bad, "shardopt_set_param", "100 elements");
  EXPECT_FAILS(shardopt_set_param(f.opt, 0, nullptr, 100), bad, "shardopt_set_param", "values is NULL");
  EXPECT_FAILS(shardopt_get_master(f.opt, 1, v.data(), 101), bad, "shardopt_get_master", "7 elements");
  EXPECT_FAILS(shardopt_get_master(f.opt, 1, nullptr, 7), bad, "shardopt_get_master", "out is NULL");
  EXPECT_FAILS(shardopt_accumulate_grad_f32(f.opt, 0, v.data(), 101), bad, "accumulate_grad_f32", "100");
  EXPECT_FAILS(shardopt_accumulate_grad_bf16(f.opt, 0, h.data(), 1), bad, "accumulate_grad_bf16", "100");
  EXPECT_FAILS(shardopt_accumulate_grad_f32(f.opt, 0, nullptr, 100), bad, "accumulate_grad_f32", "src is NULL");
  EXPECT_FAILS(shardopt_grad(f.opt, 0, nullptr, nullptr), bad, "shardopt_grad", "data is NULL");
  EXPECT_FAILS(shardopt_comm_rank(f.opt, nullptr), bad, "shardopt_comm_rank", "rank is NULL");
  EXPECT_FAILS(shardopt_get_lr(f.opt, nullptr), bad, "shardopt_get_lr", "lr is NULL");
  // The replica's dtype is fp32 here: the bf16 view is refused.
  const std::uint16_t* hp = nullptr;
  EXPECT_FAILS(shardopt_param_bf16(f.opt, 0, &hp, nullptr), bad, "shardopt_param_bf16", "fp32");
  EXPECT_EQ(hp, nullptr);  // outputs untouched on failure
}

TEST(CApi, HyperparametersAndLearningRate) {
  Fixture f;
  double v = 0;
  EXPECT_EQ(shardopt_set_lr(f.opt, 0.25), SHARDOPT_SUCCESS);
  EXPECT_EQ(shardopt_get_lr(f.opt, &v), SHARDOPT_SUCCESS);
  EXPECT_EQ(v, 0.25);
  EXPECT_FAILS(shardopt_set_lr(f.opt, -1.0), SHARDOPT_ERROR_INVALID_ARGUMENT, "shardopt_set_lr", "learning rate");
  EXPECT_FAILS(shardopt_set_lr(f.opt, NAN), SHARDOPT_ERROR_INVALID_ARGUMENT, "shardopt_set_lr", "learning rate");
  EXPECT_EQ(shardopt_get_lr(f.opt, &v), SHARDOPT_SUCCESS);
  EXPECT_EQ(v, 0.25);  // unchanged by the refused values
  const std::pair<shardopt_hyper_t, double> ok[] = {
      {SHARDOPT_HYPER_BETA1, 0.8}, {SHARDOPT_HYPER_BETA2, 0.95}, {SHARDOPT_HYPER_EPS, 1e-6},
      {SHARDOPT_HYPER_WEIGHT_DECAY, 0.1}, {SHARDOPT_HYPER_MAX_GRAD_NORM, 2.0},
      {SHARDOPT_HYPER_ADAM_MODE, 1.0}, {SHARDOPT_HYPER_LR, 0.5}};
  for (auto [key, value] : ok) {
    EXPECT_EQ(shardopt_set_hyper(f.opt, key, value), SHARDOPT_SUCCESS) << key;
    EXPECT_EQ(shardopt_get_hyper(f.opt, key, &v), SHARDOPT_SUCCESS);
    EXPECT_EQ(v, value) << key;
  }
  const std::pair<shardopt_hyper_t, double> refused[] = {
      {SHARDOPT_HYPER_BETA1, 1.0}, {SHARDOPT_HYPER_BETA2, -0.1}, {SHARDOPT_HYPER_EPS, 0.0},
      {SHARDOPT_HYPER_WEIGHT_DECAY, -1.0}, {SHARDOPT_HYPER_MAX_GRAD_NORM, INFINITY},
      {SHARDOPT_HYPER_ADAM_MODE, 0.5}, {static_cast<shardopt_hyper_t>(17), 1.0}};
  for (auto [key, value] : refused)
    EXPECT_FAILS(shardopt_set_hyper(f.opt, key, value), SHARDOPT_ERROR_INVALID_ARGUMENT, "shardopt_set_hyper", "");
  EXPECT_FAILS(shardopt_get_hyper(f.opt, static_cast<shardopt_hyper_t>(-3), &v),
               SHARDOPT_ERROR_INVALID_ARGUMENT, "shardopt_get_hyper", "unknown hyperparameter");
  EXPECT_EQ(shardopt_get_hyper(f.opt, SHARDOPT_HYPER_BETA1, &v), SHARDOPT_SUCCESS);
  EXPECT_EQ(v, 0.8);
}

TEST(CApi, MemoryReportMatchesCategories) {
  Fixture f(true, SHARDOPT_STAGE_ZERO2, SHARDOPT_DTYPE_BF16);
  std::size_t total = 0, peak = 0, sum = 0;
  for (int c = SHARDOPT_MEM_PARAMS; c < SHARDOPT_MEM_TOTAL; ++c) {
    std::size_t b = 0;
    ASSERT_EQ(shardopt_memory_usage(f.opt, static_cast<shardopt_mem_category_t>(c), &b, nullptr), SHARDOPT_SUCCESS);
    // One rank: stage 2 keeps stage 1's full gradient buffer (no staging slots to save).
    if (c == SHARDOPT_MEM_SCRATCH)
      EXPECT_EQ(b, 0u);
    else
      EXPECT_GT(b, 0u) << shardopt_mem_category_name(static_cast<shardopt_mem_category_t>(c));
    sum += b;
  }
  ASSERT_EQ(shardopt_memory_usage(f.opt, SHARDOPT_MEM_TOTAL, &total, &peak), SHARDOPT_SUCCESS);
  EXPECT_EQ(total, sum);
  EXPECT_GE(peak, total);
  std::size_t params = 0;
  ASSERT_EQ(shardopt_memory_usage(f.opt, SHARDOPT_MEM_PARAMS, &params, nullptr), SHARDOPT_SUCCESS);
  EXPECT_EQ(params, 192u * 2);  // a: 100 -> 128 aligned, b: 7 -> padded to 192 bf16 elements
}

TEST(CApi, LastErrorIsPerHandleAndPerThread) {
  Fixture a, b;
  EXPECT_EQ(shardopt_set_lr(a.opt, -1), SHARDOPT_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(shardopt_grad_ready(b.opt, 9), SHARDOPT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last(a.opt).find("shardopt_set_lr"), std::string::npos);
  EXPECT_NE(last(b.opt).find("shardopt_grad_ready"), std::string::npos);
  EXPECT_NE(last(nullptr).find("shardopt_grad_ready"), std::string::npos);
  std::string other_thread;
  std::thread([&] {
    other_thread = shardopt_last_error(nullptr);
    EXPECT_EQ(shardopt_finalize(nullptr), SHARDOPT_ERROR_INVALID_ARGUMENT);
  }).join();
  EXPECT_EQ(other_thread, "");  // a fresh thread has no error yet
  EXPECT_NE(last(nullptr).find("shardopt_grad_ready"), std::string::npos);  // not overwritten
}

TEST(CApi, MpiCreationWithoutMpiFailsCleanly) {
  shardopt_optimizer_t opt = nullptr;
  const shardopt_status_t s = shardopt_create_mpi_f(&opt, 0, nullptr);
  // This binary never initialises MPI: an error (or "not built in"), never a crash.
  EXPECT_TRUE(s == SHARDOPT_ERROR_INVALID_STATE || s == SHARDOPT_ERROR_UNSUPPORTED) << s;
  EXPECT_EQ(opt, nullptr);
  EXPECT_NE(last(nullptr).find("shardopt_create_mpi_f"), std::string::npos);
}

TEST(CApi, StepReportsClippingAndSkipping) {
  Fixture f;
  shardopt_step_result_t r = step_result();
  float* g = nullptr;
  std::size_t n = 0;
  ASSERT_EQ(shardopt_grad(f.opt, 0, &g, &n), SHARDOPT_SUCCESS);
  for (std::size_t k = 0; k < n; ++k) g[k] = 1.0f;  // norm 10 > max_grad_norm 1
  ASSERT_EQ(shardopt_step(f.opt, &r), SHARDOPT_SUCCESS);
  EXPECT_EQ(r.clipped, 1);
  EXPECT_EQ(r.skipped, 0);
  EXPECT_NEAR(r.grad_norm, 10.0, 1e-9);
  EXPECT_NEAR(r.clip_coef, 1.0 / (10.0 + 1e-6), 1e-12);
  EXPECT_EQ(r.step, 1);
  ASSERT_EQ(shardopt_grad(f.opt, 1, &g, &n), SHARDOPT_SUCCESS);
  g[3] = NAN;
  ASSERT_EQ(shardopt_step(f.opt, &r), SHARDOPT_SUCCESS);
  EXPECT_EQ(r.skipped, 1);
  EXPECT_FALSE(std::isfinite(r.grad_norm)) << r.grad_norm;  // documented: NaN or +Inf
  EXPECT_EQ(r.clip_coef, 1.0);
  EXPECT_EQ(r.skipped_steps, 1);
  std::int64_t steps = -1;
  EXPECT_EQ(shardopt_step_count(f.opt, &steps), SHARDOPT_SUCCESS);
  EXPECT_EQ(steps, 1);
}

// Sets every parameter of both optimizers to scale * synth(seed, 0, p, k).
template <std::size_t N>
void set_params_alike(shardopt_optimizer_t opt, shardopt::ShardedOptimizer& ref,
                      const std::size_t (&sizes)[N], int seed, float scale) {
  for (std::size_t p = 0; p < N; ++p) {
    std::vector<float> v(sizes[p]);
    for (std::size_t k = 0; k < v.size(); ++k) v[k] = scale * synth(seed, 0, p, k);
    ASSERT_EQ(shardopt_set_param(opt, p, v.data(), v.size()), SHARDOPT_SUCCESS);
    ref.set_param(p, v);
  }
}

// Training through the C ABI (replica pointers, gradient pointers and accumulate, groups, lr
// changes) gives exactly the C++ API's weights: the ABI adds no arithmetic of its own.
void train_both(int stage, int dtype) {
  SCOPED_TRACE(testing::Message() << "stage " << stage << " dtype " << dtype);
  const std::size_t sizes[3] = {300, 65, 9};
  const shardopt_config_t c = config(stage, dtype);
  shardopt_optimizer_t opt = nullptr;
  ASSERT_EQ(shardopt_create(&opt, &c), SHARDOPT_SUCCESS);
  int half = 0;
  ASSERT_EQ(shardopt_add_group(opt, 0.5, 0, &half), SHARDOPT_SUCCESS);

  shardopt::OptimizerOptions o;
  o.stage = static_cast<shardopt::Stage>(stage);
  o.param_dtype = static_cast<shardopt::DType>(dtype);
  o.adam.lr = c.lr;
  o.adam.max_grad_norm = c.max_grad_norm;
  o.bucket_elems = c.bucket_elems;
  shardopt::ShardedOptimizer ref(shardopt::make_single_process_communicator(), o);
  ref.add_group(shardopt::GroupOptions{0.5, false});
  for (std::size_t p = 0; p < 3; ++p) {
    const std::string name = "p" + std::to_string(p);
    ASSERT_EQ(shardopt_add_param(opt, name.c_str(), sizes[p], p == 1 ? half : 0, nullptr), SHARDOPT_SUCCESS);
    ref.add_param(name, sizes[p], p == 1 ? 1 : 0);
  }
  ASSERT_EQ(shardopt_finalize(opt), SHARDOPT_SUCCESS);
  ref.finalize();
  set_params_alike(opt, ref, sizes, 0, 1.0f);
  for (int step = 0; step < 4; ++step) {
    const double lr = 1e-2 * (step + 1);
    ASSERT_EQ(shardopt_set_lr(opt, lr), SHARDOPT_SUCCESS);
    ref.set_lr(lr);
    for (std::size_t q = 3; q-- > 0;) {  // backward order
      std::vector<float> g(sizes[q]);
      for (std::size_t k = 0; k < g.size(); ++k) g[k] = synth(1, step, q, k);
      if (q == 1) {  // through the gradient pointer, written in place
        float* dst = nullptr;
        std::size_t n = 0;
        ASSERT_EQ(shardopt_grad(opt, q, &dst, &n), SHARDOPT_SUCCESS);
        ASSERT_EQ(n, g.size());
        for (std::size_t k = 0; k < n; ++k) dst[k] += g[k];
      } else if (q == 2) {  // as bf16
        std::vector<std::uint16_t> h(g.size());
        std::vector<shardopt::bf16> hb(g.size());
        for (std::size_t k = 0; k < g.size(); ++k) {
          h[k] = shardopt_float_to_bf16(g[k]);
          hb[k] = shardopt::to_bf16(g[k]);
        }
        ASSERT_EQ(shardopt_accumulate_grad_bf16(opt, q, h.data(), h.size()), SHARDOPT_SUCCESS);
        ref.accumulate_grad(q, std::span<const shardopt::bf16>(hb));
        g.assign(g.size(), 0.0f);  // already given to ref
      } else {
        ASSERT_EQ(shardopt_accumulate_grad_f32(opt, q, g.data(), g.size()), SHARDOPT_SUCCESS);
      }
      if (q != 2) ref.accumulate_grad(q, std::span<const float>(g));
      ASSERT_EQ(shardopt_grad_ready(opt, q), SHARDOPT_SUCCESS);
      ref.grad_ready(q);
    }
    shardopt_step_result_t r = step_result();
    ASSERT_EQ(shardopt_step(opt, &r), SHARDOPT_SUCCESS);
    const shardopt::StepResult rr = ref.step();
    EXPECT_EQ(r.grad_norm, rr.grad_norm);
    EXPECT_EQ(r.clipped, rr.clipped ? 1 : 0);
  }
  for (std::size_t p = 0; p < 3; ++p) {
    std::vector<float> a(sizes[p]), b(sizes[p]);
    ASSERT_EQ(shardopt_get_master(opt, p, a.data(), a.size()), SHARDOPT_SUCCESS);
    ref.get_master(p, b);
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << "param " << p;
    // The replica view holds the same values as the C++ one.
    std::size_t n = 0;
    if (dtype == SHARDOPT_DTYPE_BF16) {
      const std::uint16_t* h = nullptr;
      ASSERT_EQ(shardopt_param_bf16(opt, p, &h, &n), SHARDOPT_SUCCESS);
      const auto hb = ref.param<shardopt::bf16>(p);
      ASSERT_EQ(n, hb.size());
      for (std::size_t k = 0; k < n; ++k) ASSERT_EQ(h[k], hb[k].bits);
    } else {
      const float* v = nullptr;
      ASSERT_EQ(shardopt_param_f32(opt, p, &v, &n), SHARDOPT_SUCCESS);
      EXPECT_EQ(std::memcmp(v, ref.param<float>(p).data(), n * sizeof(float)), 0);
    }
  }
  ASSERT_EQ(shardopt_destroy(opt), SHARDOPT_SUCCESS);
}

TEST(CApi, TrainingEqualsCppApi) {
  for (int stage = 0; stage <= 2; ++stage)
    for (int dtype : {SHARDOPT_DTYPE_F32, SHARDOPT_DTYPE_BF16}) train_both(stage, dtype);
}

// `steps` steps through the C ABI and the C++ API side by side: the same synthetic fp32
// gradients (seed `seed`) accumulated in backward order; the norms must agree bit for bit.
template <std::size_t N>
void train_c_and_cpp(shardopt_optimizer_t opt, shardopt::ShardedOptimizer& ref,
                     const std::size_t (&sizes)[N], int seed, int steps) {
  for (int step = 0; step < steps; ++step) {
    for (std::size_t q = N; q-- > 0;) {
      std::vector<float> gr(sizes[q]);
      for (std::size_t k = 0; k < gr.size(); ++k) gr[k] = synth(seed, step, q, k);
      ASSERT_EQ(shardopt_accumulate_grad_f32(opt, q, gr.data(), gr.size()), SHARDOPT_SUCCESS);
      ref.accumulate_grad(q, std::span<const float>(gr));
      ASSERT_EQ(shardopt_grad_ready(opt, q), SHARDOPT_SUCCESS);
      ref.grad_ready(q);
    }
    shardopt_step_result_t r = step_result();
    ASSERT_EQ(shardopt_step(opt, &r), SHARDOPT_SUCCESS);
    EXPECT_EQ(r.grad_norm, ref.step().grad_norm);
  }
}

// Adds group `g` through the ABI and returns its index; shardopt_get_group_ex gives back the
// same bytes.
int add_group_read_back(shardopt_optimizer_t opt, const shardopt_group_t& g) {
  int index = -1;
  EXPECT_EQ(shardopt_add_group_ex(opt, &g, &index), SHARDOPT_SUCCESS) << last(opt);
  shardopt_group_t back;
  back.struct_size = sizeof back;
  EXPECT_EQ(shardopt_get_group_ex(opt, index, &back), SHARDOPT_SUCCESS);
  EXPECT_EQ(std::memcmp(&back, &g, sizeof g), 0);
  return index;
}

// The C++ API's options for the C config `c` (the fields these tests change).
shardopt::OptimizerOptions cpp_options(const shardopt_config_t& c) {
  shardopt::OptimizerOptions o;
  o.stage = static_cast<shardopt::Stage>(c.stage);
  o.param_dtype = static_cast<shardopt::DType>(c.param_dtype);
  o.adam.lr = c.lr;
  o.adam.weight_decay = c.weight_decay;
  o.adam.max_grad_norm = c.max_grad_norm;
  o.bucket_elems = c.bucket_elems;
  o.ownership = static_cast<shardopt::Ownership>(c.ownership);
  return o;
}

// A checkpoint through the C ABI (save, train on, load), loaded by the C++ API from the same
// files too: `expect_equal` holds after the load and after two more steps.
template <std::size_t N>
void checkpoint_round_trip(shardopt_optimizer_t opt, shardopt::ShardedOptimizer& ref,
                           const std::size_t (&sizes)[N], const std::string& tag,
                           const std::function<void()>& expect_equal) {
  const std::string dir = "/tmp/shardopt-capi-" + tag + "-" + std::to_string(::getpid());
  ASSERT_EQ(shardopt_save_checkpoint(opt, dir.c_str(), 1, nullptr), SHARDOPT_SUCCESS) << last(opt);
  train_c_and_cpp(opt, ref, sizes, 1, 6);  // move away from the saved state
  ASSERT_EQ(shardopt_load_checkpoint(opt, dir.c_str()), SHARDOPT_SUCCESS) << last(opt);
  shardopt::load_checkpoint(ref, dir);  // the same state
  expect_equal();
  train_c_and_cpp(opt, ref, sizes, 7, 2);  // and the same training after it
  expect_equal();
  std::filesystem::remove_all(dir);
}

// Every parameter's master weights and exp_avg (Lion's and Muon's momentum) through the C ABI
// equal the C++ API's bit for bit.
template <std::size_t N>
void expect_master_and_exp_avg_equal(shardopt_optimizer_t opt, shardopt::ShardedOptimizer& ref,
                                     const std::size_t (&sizes)[N]) {
  for (std::size_t p = 0; p < N; ++p) {
    std::vector<float> a(sizes[p]), b(sizes[p]);
    ASSERT_EQ(shardopt_get_master(opt, p, a.data(), a.size()), SHARDOPT_SUCCESS);
    ref.get_master(p, b);
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << "param " << p;
    ASSERT_EQ(shardopt_get_exp_avg(opt, p, a.data(), a.size()), SHARDOPT_SUCCESS);
    ref.get_state(shardopt::StateArray::ExpAvg, p, b);
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << "param " << p;
  }
}

// shardopt_group_t: defaults, a Lion group trained through the C ABI equals the C++ API bit
// for bit (weights and momentum), the AdamW-era calls keep a group's rule, and bad structs,
// rules and rule changes are clear errors.
TEST(CApi, LionGroupThroughTheGroupStructEqualsCppApi) {
  shardopt_group_t d;
  shardopt_group_init(&d);
  EXPECT_EQ(d.struct_size, sizeof(shardopt_group_t));
  EXPECT_EQ(d.lr_scale, 1.0);
  EXPECT_EQ(d.weight_decay, 1);
  EXPECT_EQ(d.rule, SHARDOPT_RULE_ADAMW);
  EXPECT_EQ(d.lion_beta1, 0.9);
  EXPECT_EQ(d.lion_beta2, 0.99);

  const shardopt_config_t c = config(SHARDOPT_STAGE_ZERO2, SHARDOPT_DTYPE_BF16);
  shardopt_optimizer_t opt = nullptr;
  ASSERT_EQ(shardopt_create(&opt, &c), SHARDOPT_SUCCESS);
  shardopt_group_t lion = d;
  lion.rule = SHARDOPT_RULE_LION;
  lion.lr_scale = 0.3;
  lion.lion_beta2 = 0.95;
  int g = -1;
  ASSERT_EQ(shardopt_add_group_ex(opt, &lion, &g), SHARDOPT_SUCCESS);
  EXPECT_EQ(g, 1);
  shardopt_group_t bad = lion;
  bad.rule = 5;
  EXPECT_EQ(shardopt_add_group_ex(opt, &bad, nullptr), SHARDOPT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(shardopt_last_error(opt)).find("is not a shardopt_rule_t"), std::string::npos);
  bad = lion;
  bad.struct_size = 12;
  EXPECT_EQ(shardopt_add_group_ex(opt, &bad, nullptr), SHARDOPT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(shardopt_last_error(opt)).find("shardopt_group_init"), std::string::npos);
  bad = lion;
  bad.lion_beta1 = 1.5;
  EXPECT_EQ(shardopt_add_group_ex(opt, &bad, nullptr), SHARDOPT_ERROR_INVALID_ARGUMENT);

  shardopt::OptimizerOptions o;
  o.stage = shardopt::Stage::Zero2;
  o.adam.lr = c.lr;
  o.adam.max_grad_norm = c.max_grad_norm;
  o.bucket_elems = c.bucket_elems;
  shardopt::ShardedOptimizer ref(shardopt::make_single_process_communicator(), o);
  shardopt::GroupOptions rg;
  rg.lr_scale = 0.3;
  rg.rule = shardopt::Rule::Lion;
  rg.lion.beta2 = 0.95;
  ref.add_group(rg);
  const std::size_t sizes[3] = {300, 65, 9};
  for (std::size_t p = 0; p < 3; ++p) {
    const std::string name = "p" + std::to_string(p);
    const int group = p == 2 ? 0 : 1;
    ASSERT_EQ(shardopt_add_param(opt, name.c_str(), sizes[p], group, nullptr), SHARDOPT_SUCCESS);
    ref.add_param(name, sizes[p], group);
  }
  ASSERT_EQ(shardopt_finalize(opt), SHARDOPT_SUCCESS);
  ref.finalize();
  set_params_alike(opt, ref, sizes, 0, 1.0f);
  // The AdamW-era setter changes lr_scale and keeps the rule; changing the rule is refused.
  ASSERT_EQ(shardopt_set_group(opt, 1, 0.6, 1), SHARDOPT_SUCCESS);
  rg.lr_scale = 0.6;
  ref.set_group(1, rg);
  shardopt_group_t now;
  now.struct_size = sizeof now;
  ASSERT_EQ(shardopt_get_group_ex(opt, 1, &now), SHARDOPT_SUCCESS);
  EXPECT_EQ(now.rule, SHARDOPT_RULE_LION);
  EXPECT_EQ(now.lr_scale, 0.6);
  EXPECT_EQ(now.lion_beta2, 0.95);
  now.rule = SHARDOPT_RULE_ADAMW;
  EXPECT_EQ(shardopt_set_group_ex(opt, 1, &now), SHARDOPT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(shardopt_last_error(opt)).find("rule is Lion"), std::string::npos);

  train_c_and_cpp(opt, ref, sizes, 1, 4);
  expect_master_and_exp_avg_equal(opt, ref, sizes);
  std::vector<float> sq(sizes[0]);
  EXPECT_EQ(shardopt_get_exp_avg_sq(opt, 0, sq.data(), sq.size()), SHARDOPT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(shardopt_last_error(opt)).find("keeps no exp_avg_sq"), std::string::npos);
  EXPECT_EQ(shardopt_get_exp_avg_sq(opt, 2, sq.data(), sizes[2]), SHARDOPT_SUCCESS);
  EXPECT_EQ(shardopt_destroy(opt), SHARDOPT_SUCCESS);
}

// AdamW8bit through shardopt_group_t: a group whose threshold puts one parameter in 8-bit
// state trains exactly as the C++ API does; its checkpoint loads into another optimizer.
TEST(CApi, AdamW8bitGroupEqualsCppApiAndItsCheckpointLoads) {
  const shardopt_config_t c = config(SHARDOPT_STAGE_ZERO1, SHARDOPT_DTYPE_BF16);
  shardopt_optimizer_t opt = nullptr;
  ASSERT_EQ(shardopt_create(&opt, &c), SHARDOPT_SUCCESS);
  shardopt_group_t g8;
  shardopt_group_init(&g8);
  EXPECT_EQ(g8.adamw8bit_min_numel, 4096u);
  g8.rule = SHARDOPT_RULE_ADAMW8BIT;
  g8.adamw8bit_min_numel = 512;
  ASSERT_EQ(shardopt_add_group_ex(opt, &g8, nullptr), SHARDOPT_SUCCESS);
  shardopt::OptimizerOptions o;
  o.adam.lr = c.lr;
  o.adam.max_grad_norm = c.max_grad_norm;
  o.bucket_elems = c.bucket_elems;
  shardopt::ShardedOptimizer ref(shardopt::make_single_process_communicator(), o);
  shardopt::GroupOptions rg;
  rg.rule = shardopt::Rule::AdamW8bit;
  rg.adamw8bit.min_8bit_numel = 512;
  ref.add_group(rg);
  const std::size_t sizes[2] = {1000, 300};  // 8-bit, fp32 (below 512)
  for (std::size_t p = 0; p < 2; ++p) {
    const std::string name = "q" + std::to_string(p);
    ASSERT_EQ(shardopt_add_param(opt, name.c_str(), sizes[p], 1, nullptr), SHARDOPT_SUCCESS);
    ref.add_param(name, sizes[p], 1);
  }
  ASSERT_EQ(shardopt_finalize(opt), SHARDOPT_SUCCESS);
  ref.finalize();
  EXPECT_EQ(ref.rule_of(0), shardopt::Rule::AdamW8bit);
  EXPECT_EQ(ref.rule_of(1), shardopt::Rule::AdamW);
  train_c_and_cpp(opt, ref, sizes, 3, 4);
  for (std::size_t p = 0; p < 2; ++p) {
    std::vector<float> a(sizes[p]), b(sizes[p]);
    ASSERT_EQ(shardopt_get_master(opt, p, a.data(), a.size()), SHARDOPT_SUCCESS);
    ref.get_master(p, b);
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << "param " << p;
    ASSERT_EQ(shardopt_get_exp_avg_sq(opt, p, a.data(), a.size()), SHARDOPT_SUCCESS);
    ref.get_state(shardopt::StateArray::ExpAvgSq, p, b);
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << "param " << p;
  }
  // The checkpoint holds the 8-bit state: a second optimizer that loads it reads the same
  // moments back (dequantized from the same codes and scales).
  const std::string dir = "/tmp/shardopt-capi-8bit-" + std::to_string(getpid());
  ASSERT_EQ(shardopt_save_checkpoint(opt, dir.c_str(), 2, nullptr), SHARDOPT_SUCCESS)
      << shardopt_last_error(opt);
  shardopt_optimizer_t back = nullptr;
  ASSERT_EQ(shardopt_create(&back, &c), SHARDOPT_SUCCESS);
  ASSERT_EQ(shardopt_add_group_ex(back, &g8, nullptr), SHARDOPT_SUCCESS);
  for (std::size_t p = 0; p < 2; ++p)
    ASSERT_EQ(shardopt_add_param(back, ("q" + std::to_string(p)).c_str(), sizes[p], 1, nullptr),
              SHARDOPT_SUCCESS);
  ASSERT_EQ(shardopt_finalize(back), SHARDOPT_SUCCESS);
  ASSERT_EQ(shardopt_load_checkpoint(back, dir.c_str()), SHARDOPT_SUCCESS) << shardopt_last_error(back);
  for (std::size_t p = 0; p < 2; ++p) {
    std::vector<float> a(sizes[p]), b(sizes[p]);
    ASSERT_EQ(shardopt_get_exp_avg(opt, p, a.data(), a.size()), SHARDOPT_SUCCESS);
    ASSERT_EQ(shardopt_get_exp_avg(back, p, b.data(), b.size()), SHARDOPT_SUCCESS);
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << "param " << p;
  }
  EXPECT_EQ(shardopt_destroy(back), SHARDOPT_SUCCESS);
  std::filesystem::remove_all(dir);
  EXPECT_EQ(shardopt_destroy(opt), SHARDOPT_SUCCESS);
}

// Muon through the C ABI (issue 32): SHARDOPT_OWNERSHIP_WHOLE in the config, a Muon group
// with every option off its default (shardopt_group_t's muon_* fields), two matrices
// registered with shardopt_add_param_2d (rows > cols: transposed Newton-Schulz; rows < cols)
// and an AdamW bias: the weights and the momentum equal the C++ API's bit for bit.
TEST(CApi, MuonGroupAndMatricesEqualCppApi) {
  for (int stage : {SHARDOPT_STAGE_DATA_PARALLEL, SHARDOPT_STAGE_ZERO1, SHARDOPT_STAGE_ZERO2}) {
    SCOPED_TRACE(stage);
    shardopt_config_t c = config(stage, SHARDOPT_DTYPE_BF16);
    EXPECT_EQ(c.ownership, SHARDOPT_OWNERSHIP_FLAT);
    c.ownership = SHARDOPT_OWNERSHIP_WHOLE;
    c.bucket_elems = 0;  // automatic: raised to the largest Muon matrix
    shardopt_optimizer_t opt = nullptr;
    ASSERT_EQ(shardopt_create(&opt, &c), SHARDOPT_SUCCESS) << last(nullptr);
    shardopt_group_t mg;
    shardopt_group_init(&mg);
    EXPECT_EQ(mg.muon_momentum, 0.95);
    EXPECT_EQ(mg.muon_nesterov, 1);
    EXPECT_EQ(mg.muon_ns_steps, 5);
    EXPECT_EQ(mg.muon_ns_a, 3.4445);
    EXPECT_EQ(mg.muon_ns_b, -4.7750);
    EXPECT_EQ(mg.muon_ns_c, 2.0315);
    EXPECT_EQ(mg.muon_eps, 1e-7);
    EXPECT_EQ(mg.muon_lr_adjust, SHARDOPT_MUON_LR_ORIGINAL);
    mg.rule = SHARDOPT_RULE_MUON;
    mg.lr_scale = 2.0;
    mg.muon_momentum = 0.9;
    mg.muon_nesterov = 0;
    mg.muon_ns_steps = 4;
    mg.muon_eps = 1e-6;
    mg.muon_lr_adjust = SHARDOPT_MUON_LR_MATCH_RMS_ADAMW;
    const int g = add_group_read_back(opt, mg);

    shardopt::ShardedOptimizer ref(shardopt::make_single_process_communicator(), cpp_options(c));
    shardopt::GroupOptions rg;
    rg.rule = shardopt::Rule::Muon;
    rg.lr_scale = 2.0;
    rg.muon.momentum = 0.9;
    rg.muon.nesterov = false;
    rg.muon.ns_steps = 4;
    rg.muon.eps = 1e-6;
    rg.muon.lr_adjust = shardopt::MuonLrAdjust::MatchRmsAdamW;
    ASSERT_EQ(ref.add_group(rg), g);
    const std::size_t sizes[3] = {24 * 16, 24, 8 * 40};
    std::size_t index = 99;
    ASSERT_EQ(shardopt_add_param_2d(opt, "w1", 24, 16, g, &index), SHARDOPT_SUCCESS) << last(opt);
    EXPECT_EQ(index, 0u);
    ASSERT_EQ(shardopt_add_param(opt, "b1", 24, 0, &index), SHARDOPT_SUCCESS);
    ASSERT_EQ(shardopt_add_param_2d(opt, "w2", 8, 40, g, &index), SHARDOPT_SUCCESS);
    EXPECT_EQ(index, 2u);
    ref.add_param("w1", shardopt::Shape2D{24, 16}, g);
    ref.add_param("b1", 24, 0);
    ref.add_param("w2", shardopt::Shape2D{8, 40}, g);
    ASSERT_EQ(shardopt_finalize(opt), SHARDOPT_SUCCESS) << last(opt);
    ref.finalize();
    EXPECT_EQ(ref.rule_of(0), shardopt::Rule::Muon);
    EXPECT_EQ(ref.rule_of(1), shardopt::Rule::AdamW);
    std::size_t rows = 0, cols = 0, numel = 0;
    ASSERT_EQ(shardopt_param_shape(opt, 0, &rows, &cols), SHARDOPT_SUCCESS);
    EXPECT_EQ(rows, 24u);
    EXPECT_EQ(cols, 16u);
    ASSERT_EQ(shardopt_param_numel(opt, 2, &numel), SHARDOPT_SUCCESS);
    EXPECT_EQ(numel, 320u);
    ASSERT_EQ(shardopt_param_shape(opt, 1, &rows, &cols), SHARDOPT_SUCCESS);
    EXPECT_EQ(rows, 1u);  // 1 x numel without a shape
    EXPECT_EQ(cols, 24u);
    EXPECT_EQ(shardopt_param_shape(opt, 3, &rows, nullptr), SHARDOPT_ERROR_INVALID_ARGUMENT);
    shardopt_config_t got;
    ASSERT_EQ(shardopt_config_init(&got), SHARDOPT_SUCCESS);
    ASSERT_EQ(shardopt_get_config(opt, &got), SHARDOPT_SUCCESS);
    EXPECT_EQ(got.ownership, SHARDOPT_OWNERSHIP_WHOLE);
    EXPECT_GE(got.bucket_elems, 24u * 16u);
    set_params_alike(opt, ref, sizes, 2, 0.2f);
    train_c_and_cpp(opt, ref, sizes, 5, 4);
    expect_master_and_exp_avg_equal(opt, ref, sizes);
    // Whole ownership and Muon's momentum round-trip through a checkpoint (format 6).
    checkpoint_round_trip(opt, ref, sizes, "whole",
                          [&] { expect_master_and_exp_avg_equal(opt, ref, sizes); });
    EXPECT_EQ(shardopt_destroy(opt), SHARDOPT_SUCCESS);
  }
}

// A 12 x 8 matrix in group `g` (whole ownership, stage 1, fp32), from init_scale * synth (or
// zero when init_scale is 0), after two steps of synthetic gradients: its master weights.
std::vector<float> train_matrix_of(const shardopt_group_t& g, float init_scale) {
  shardopt_config_t c = config(SHARDOPT_STAGE_ZERO1, SHARDOPT_DTYPE_F32);
  c.ownership = SHARDOPT_OWNERSHIP_WHOLE;
  c.bucket_elems = 0;
  shardopt_optimizer_t opt = nullptr;
  EXPECT_EQ(shardopt_create(&opt, &c), SHARDOPT_SUCCESS);
  int index = -1;
  EXPECT_EQ(shardopt_add_group_ex(opt, &g, &index), SHARDOPT_SUCCESS) << last(opt);
  EXPECT_EQ(shardopt_add_param_2d(opt, "w", 12, 8, index, nullptr), SHARDOPT_SUCCESS);
  EXPECT_EQ(shardopt_finalize(opt), SHARDOPT_SUCCESS) << last(opt);
  std::vector<float> v(96);
  if (init_scale != 0.0f) {
    for (std::size_t k = 0; k < v.size(); ++k) v[k] = init_scale * synth(5, 0, 0, k);
    EXPECT_EQ(shardopt_set_param(opt, 0, v.data(), v.size()), SHARDOPT_SUCCESS);
  }
  for (int step = 0; step < 2; ++step) {
    for (std::size_t k = 0; k < v.size(); ++k) v[k] = synth(7, step, 0, k);
    EXPECT_EQ(shardopt_accumulate_grad_f32(opt, 0, v.data(), v.size()), SHARDOPT_SUCCESS);
    EXPECT_EQ(shardopt_step(opt, nullptr), SHARDOPT_SUCCESS);
  }
  EXPECT_EQ(shardopt_get_master(opt, 0, v.data(), v.size()), SHARDOPT_SUCCESS);
  EXPECT_EQ(shardopt_destroy(opt), SHARDOPT_SUCCESS);
  return v;
}

// The options and shapes reach the optimizer: changing a Muon option through the C ABI changes
// the result (so the test above would see one lost on the way).
TEST(CApi, MuonOptionsChangeTheResult) {
  auto train = [](int lr_adjust, int nesterov) {
    shardopt_group_t mg;
    shardopt_group_init(&mg);
    mg.rule = SHARDOPT_RULE_MUON;
    mg.muon_lr_adjust = lr_adjust;
    mg.muon_nesterov = nesterov;
    return train_matrix_of(mg, 0.0f);
  };
  const std::vector<float> base = train(SHARDOPT_MUON_LR_ORIGINAL, 1);
  EXPECT_NE(base, train(SHARDOPT_MUON_LR_NONE, 1));
  EXPECT_NE(base, train(SHARDOPT_MUON_LR_ORIGINAL, 0));
  EXPECT_EQ(base, train(SHARDOPT_MUON_LR_ORIGINAL, 1));
}

// Shape and Muon mistakes are SHARDOPT_ERROR_INVALID_ARGUMENT with a message naming the
// parameter; a group struct from 0.4 (no muon_* fields) gets Muon's defaults.
TEST(CApi, MuonAndShapeMistakesAreClearErrors) {
  shardopt_config_t c = config(SHARDOPT_STAGE_ZERO1, SHARDOPT_DTYPE_F32);
  c.bucket_elems = 0;
  shardopt_optimizer_t opt = nullptr;
  ASSERT_EQ(shardopt_create(&opt, &c), SHARDOPT_SUCCESS);
  EXPECT_FAILS(shardopt_add_param_2d(opt, "w", 0, 5, 0, nullptr), SHARDOPT_ERROR_INVALID_ARGUMENT,
               "shardopt_add_param_2d", "'w' has shape 0 x 5");
  EXPECT_FAILS(shardopt_add_param_2d(opt, "w", SIZE_MAX / 2, 3, 0, nullptr),
               SHARDOPT_ERROR_INVALID_ARGUMENT, "shardopt_add_param_2d", "'w' has shape");
  EXPECT_FAILS(shardopt_add_param_2d(opt, nullptr, 2, 3, 0, nullptr),
               SHARDOPT_ERROR_INVALID_ARGUMENT, "shardopt_add_param_2d", "name is NULL");
  EXPECT_FAILS(shardopt_add_param_2d(opt, "w", 2, 3, 4, nullptr), SHARDOPT_ERROR_INVALID_ARGUMENT,
               "shardopt_add_param_2d", "names group 4");
  shardopt_group_t mg;
  shardopt_group_init(&mg);
  mg.rule = SHARDOPT_RULE_MUON;
  shardopt_group_t bad = mg;
  bad.muon_lr_adjust = 3;
  EXPECT_FAILS(shardopt_add_group_ex(opt, &bad, nullptr), SHARDOPT_ERROR_INVALID_ARGUMENT,
               "shardopt_add_group_ex", "muon_lr_adjust 3");
  bad = mg;
  bad.muon_nesterov = 2;
  EXPECT_FAILS(shardopt_add_group_ex(opt, &bad, nullptr), SHARDOPT_ERROR_INVALID_ARGUMENT,
               "shardopt_add_group_ex", "muon_nesterov must be 0 or 1");
  bad = mg;
  bad.reserved0 = 1;
  EXPECT_FAILS(shardopt_add_group_ex(opt, &bad, nullptr), SHARDOPT_ERROR_INVALID_ARGUMENT,
               "shardopt_add_group_ex", "reserved0");
  bad = mg;
  bad.muon_momentum = 1.0;
  EXPECT_EQ(shardopt_add_group_ex(opt, &bad, nullptr), SHARDOPT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last(nullptr).find("momentum"), std::string::npos) << last(nullptr);
  // A caller built against 0.4's shardopt_group_t (it ends with adamw8bit_min_numel).
  shardopt_group_t old = mg;
  old.struct_size = offsetof(shardopt_group_t, muon_momentum);
  old.muon_momentum = 7.0;  // beyond the caller's struct: never read
  int g = -1;
  ASSERT_EQ(shardopt_add_group_ex(opt, &old, &g), SHARDOPT_SUCCESS) << last(opt);
  shardopt_group_t back;
  back.struct_size = sizeof back;
  ASSERT_EQ(shardopt_get_group_ex(opt, g, &back), SHARDOPT_SUCCESS);
  EXPECT_EQ(back.rule, SHARDOPT_RULE_MUON);
  EXPECT_EQ(back.muon_momentum, 0.95);
  // A 1-D parameter in a Muon group, and Muon without whole ownership: refused at finalize.
  ASSERT_EQ(shardopt_add_param(opt, "flat", 48, g, nullptr), SHARDOPT_SUCCESS);
  EXPECT_FAILS(shardopt_finalize(opt), SHARDOPT_ERROR_INVALID_ARGUMENT, "shardopt_finalize",
               "parameter 'flat' is in a Muon group");
  EXPECT_EQ(shardopt_destroy(opt), SHARDOPT_SUCCESS);
  ASSERT_EQ(shardopt_create(&opt, &c), SHARDOPT_SUCCESS);
  ASSERT_EQ(shardopt_add_group_ex(opt, &mg, &g), SHARDOPT_SUCCESS);
  ASSERT_EQ(shardopt_add_param_2d(opt, "m", 6, 8, g, nullptr), SHARDOPT_SUCCESS);
  EXPECT_FAILS(shardopt_finalize(opt), SHARDOPT_ERROR_INVALID_ARGUMENT, "shardopt_finalize",
               "Ownership::Whole");
  EXPECT_EQ(shardopt_destroy(opt), SHARDOPT_SUCCESS);
  // Whole ownership runs stage 3 too (on the CPU): a Muon group finalizes there.
  c.stage = SHARDOPT_STAGE_ZERO3;
  c.ownership = SHARDOPT_OWNERSHIP_WHOLE;
  ASSERT_EQ(shardopt_create(&opt, &c), SHARDOPT_SUCCESS);
  ASSERT_EQ(shardopt_add_group_ex(opt, &mg, &g), SHARDOPT_SUCCESS);
  ASSERT_EQ(shardopt_add_param_2d(opt, "m", 6, 8, g, nullptr), SHARDOPT_SUCCESS);
  EXPECT_EQ(shardopt_finalize(opt), SHARDOPT_SUCCESS) << last(opt);
  EXPECT_EQ(shardopt_destroy(opt), SHARDOPT_SUCCESS);
}

// Adafactor through the C ABI (issue 32): a group with every adafactor_* option off its
// default and a weight decay, a factored matrix (shardopt_add_param_2d) and a vector in it,
// and an AdamW matrix beside them: the weights, the vector's variance (exp_avg_sq) and the
// matrix's row_var/col_var (shardopt_get_factored_state) equal the C++ API's bit for bit at
// stages 0-2, and again after a checkpoint round trip (format 7).
TEST(CApi, AdafactorGroupEqualsCppApi) {
  for (int stage : {SHARDOPT_STAGE_DATA_PARALLEL, SHARDOPT_STAGE_ZERO1, SHARDOPT_STAGE_ZERO2}) {
    SCOPED_TRACE(stage);
    shardopt_config_t c = config(stage, SHARDOPT_DTYPE_BF16);
    c.ownership = SHARDOPT_OWNERSHIP_WHOLE;
    c.bucket_elems = 0;  // automatic: raised to the largest Adafactor parameter
    c.weight_decay = 0.05;
    shardopt_optimizer_t opt = nullptr;
    ASSERT_EQ(shardopt_create(&opt, &c), SHARDOPT_SUCCESS) << last(nullptr);
    shardopt_group_t ag;
    shardopt_group_init(&ag);
    EXPECT_EQ(ag.adafactor_beta2_decay, -0.8);  // torch.optim.Adafactor's defaults
    EXPECT_EQ(ag.adafactor_eps1, 1.1920928955078125e-07);
    EXPECT_EQ(ag.adafactor_eps2, 1e-3);
    EXPECT_EQ(ag.adafactor_d, 1.0);
    EXPECT_EQ(ag.adafactor_maximize, 0);
    EXPECT_EQ(ag.reserved1, 0);
    ag.rule = SHARDOPT_RULE_ADAFACTOR;
    ag.lr_scale = 0.5;
    ag.adafactor_beta2_decay = -0.6;
    ag.adafactor_eps1 = 1e-6;
    ag.adafactor_eps2 = 2e-3;
    ag.adafactor_d = 1.25;
    ag.adafactor_maximize = 1;
    const int g = add_group_read_back(opt, ag);

    shardopt::ShardedOptimizer ref(shardopt::make_single_process_communicator(), cpp_options(c));
    shardopt::GroupOptions rg;
    rg.rule = shardopt::Rule::Adafactor;
    rg.lr_scale = 0.5;
    rg.adafactor.beta2_decay = -0.6;
    rg.adafactor.eps1 = 1e-6;
    rg.adafactor.eps2 = 2e-3;
    rg.adafactor.d = 1.25;
    rg.adafactor.maximize = true;
    ASSERT_EQ(ref.add_group(rg), g);
    const std::size_t sizes[3] = {24 * 16, 24, 8 * 40};
    ASSERT_EQ(shardopt_add_param_2d(opt, "w1", 24, 16, g, nullptr), SHARDOPT_SUCCESS) << last(opt);
    ASSERT_EQ(shardopt_add_param(opt, "b1", 24, g, nullptr), SHARDOPT_SUCCESS);
    ASSERT_EQ(shardopt_add_param_2d(opt, "w2", 8, 40, 0, nullptr), SHARDOPT_SUCCESS);
    ref.add_param("w1", shardopt::Shape2D{24, 16}, g);
    ref.add_param("b1", 24, g);
    ref.add_param("w2", shardopt::Shape2D{8, 40}, 0);
    ASSERT_EQ(shardopt_finalize(opt), SHARDOPT_SUCCESS) << last(opt);
    ref.finalize();
    EXPECT_EQ(ref.rule_of(1), shardopt::Rule::Adafactor);
    EXPECT_EQ(ref.rule_of(2), shardopt::Rule::AdamW);
    set_params_alike(opt, ref, sizes, 3, 0.2f);
    // Master weights, the vector's variance and the AdamW matrix's v, the factored statistics.
    auto expect_equal = [&] {
      for (std::size_t p = 0; p < 3; ++p) {
        std::vector<float> a(sizes[p]), b(sizes[p]);
        ASSERT_EQ(shardopt_get_master(opt, p, a.data(), a.size()), SHARDOPT_SUCCESS);
        ref.get_master(p, b);
        EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << "param " << p;
        if (p == 0) continue;  // factored: no per-element variance
        ASSERT_EQ(shardopt_get_exp_avg_sq(opt, p, a.data(), a.size()), SHARDOPT_SUCCESS);
        ref.get_state(shardopt::StateArray::ExpAvgSq, p, b);
        EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << "param " << p;
      }
      std::vector<float> row(24), col(16), rref(24), cref(16);
      ASSERT_EQ(shardopt_get_factored_state(opt, 0, row.data(), 24, col.data(), 16),
                SHARDOPT_SUCCESS) << last(opt);
      ref.get_factored_state(0, rref, cref);
      EXPECT_EQ(std::memcmp(row.data(), rref.data(), row.size() * sizeof(float)), 0);
      EXPECT_EQ(std::memcmp(col.data(), cref.data(), col.size() * sizeof(float)), 0);
      EXPECT_GT(row[0], 0.0f);  // the statistics moved off their zero start
    };
    train_c_and_cpp(opt, ref, sizes, 6, 5);
    expect_equal();
    checkpoint_round_trip(opt, ref, sizes, "adafactor", expect_equal);  // format 7
    EXPECT_EQ(shardopt_destroy(opt), SHARDOPT_SUCCESS);
  }
}

// Each adafactor_* field reaches the optimizer: changing it through the C ABI changes the
// weights after two steps (so the test above would see one lost on the way).
TEST(CApi, AdafactorOptionsChangeTheResult) {
  auto train = [](void (*change)(shardopt_group_t&)) {
    shardopt_group_t ag;
    shardopt_group_init(&ag);
    ag.rule = SHARDOPT_RULE_ADAFACTOR;
    change(ag);
    return train_matrix_of(ag, 1e-4f);  // RMS(p) below eps2 at first
  };
  const std::vector<float> base = train([](shardopt_group_t&) {});
  EXPECT_EQ(base, train([](shardopt_group_t&) {}));
  EXPECT_NE(base, train([](shardopt_group_t& g) { g.adafactor_beta2_decay = -0.5; }));
  EXPECT_NE(base, train([](shardopt_group_t& g) { g.adafactor_eps1 = 1.0; }));
  EXPECT_NE(base, train([](shardopt_group_t& g) { g.adafactor_eps2 = 2e-3; }));
  EXPECT_NE(base, train([](shardopt_group_t& g) { g.adafactor_d = 1e6; }));
  EXPECT_NE(base, train([](shardopt_group_t& g) { g.adafactor_maximize = 1; }));
}

// Adafactor mistakes are SHARDOPT_ERROR_INVALID_ARGUMENT with a message naming the field;
// group structs from 0.4 and 0.5 (no adafactor_* fields) get Adafactor's defaults; Adafactor
// without whole ownership is refused at finalize; shardopt_get_factored_state's misuse.
TEST(CApi, AdafactorMistakesAreClearErrors) {
  shardopt_config_t c = config(SHARDOPT_STAGE_ZERO1, SHARDOPT_DTYPE_F32);
  c.bucket_elems = 0;
  shardopt_optimizer_t opt = nullptr;
  ASSERT_EQ(shardopt_create(&opt, &c), SHARDOPT_SUCCESS);
  shardopt_group_t ag;
  shardopt_group_init(&ag);
  ag.rule = SHARDOPT_RULE_ADAFACTOR;
  // Each mistake alone in an otherwise valid Adafactor group: the ABI's own checks, then the
  // optimizer's validation of the values (torch.optim.Adafactor's constructor checks).
  const struct {
    void (*spoil)(shardopt_group_t&);
    const char* reason;
  } mistakes[] = {
      {[](shardopt_group_t& g) { g.rule = 5; }, "SHARDOPT_RULE_ADAFACTOR 4"},
      {[](shardopt_group_t& g) { g.adafactor_maximize = 2; }, "adafactor_maximize must be 0 or 1"},
      {[](shardopt_group_t& g) { g.reserved1 = 1; }, "reserved1"},
      {[](shardopt_group_t& g) { g.adafactor_beta2_decay = 0.5; }, "invalid Adafactor beta2_decay"},
      {[](shardopt_group_t& g) { g.adafactor_eps1 = -1.0; }, "invalid Adafactor eps1"},
      {[](shardopt_group_t& g) { g.adafactor_eps2 = NAN; }, "invalid Adafactor eps2"},
      {[](shardopt_group_t& g) { g.adafactor_d = 0.5; }, "invalid Adafactor d"},
  };
  for (const auto& m : mistakes) {
    shardopt_group_t bad = ag;
    m.spoil(bad);
    EXPECT_FAILS(shardopt_add_group_ex(opt, &bad, nullptr), SHARDOPT_ERROR_INVALID_ARGUMENT,
                 "shardopt_add_group_ex", m.reason);
  }
  // Callers built against 0.4's (ends with adamw8bit_min_numel) and 0.5's (ends with
  // reserved0) shardopt_group_t: the fields beyond their struct are never read.
  for (std::size_t size : {offsetof(shardopt_group_t, muon_momentum),
                           offsetof(shardopt_group_t, adafactor_beta2_decay)}) {
    SCOPED_TRACE(size);
    shardopt_group_t old = ag;
    old.struct_size = size;
    old.adafactor_beta2_decay = 7.0;  // invalid, but beyond the caller's struct
    old.reserved1 = 3;
    int g = -1;
    ASSERT_EQ(shardopt_add_group_ex(opt, &old, &g), SHARDOPT_SUCCESS) << last(opt);
    shardopt_group_t back;
    back.struct_size = sizeof back;
    ASSERT_EQ(shardopt_get_group_ex(opt, g, &back), SHARDOPT_SUCCESS);
    EXPECT_EQ(back.rule, SHARDOPT_RULE_ADAFACTOR);
    EXPECT_EQ(back.adafactor_beta2_decay, -0.8);
    EXPECT_EQ(back.reserved1, 0);
    // An older caller reads back only its own fields.
    shardopt_group_t part = ag;
    part.struct_size = size;
    part.adafactor_d = 9.0;
    ASSERT_EQ(shardopt_get_group_ex(opt, g, &part), SHARDOPT_SUCCESS);
    EXPECT_EQ(part.adafactor_d, 9.0);
  }
  // Adafactor without whole ownership: refused at finalize, naming the parameter.
  int g = -1;
  ASSERT_EQ(shardopt_add_group_ex(opt, &ag, &g), SHARDOPT_SUCCESS);
  ASSERT_EQ(shardopt_add_param_2d(opt, "m", 6, 8, g, nullptr), SHARDOPT_SUCCESS);
  EXPECT_FAILS(shardopt_finalize(opt), SHARDOPT_ERROR_INVALID_ARGUMENT, "shardopt_finalize",
               "parameter 'm' (6 x 8, group 3) is in an Adafactor group");
  EXPECT_NE(last(nullptr).find("Ownership::Whole"), std::string::npos) << last(nullptr);
  EXPECT_EQ(shardopt_destroy(opt), SHARDOPT_SUCCESS);
  // shardopt_get_factored_state: before finalize, then a vector, a wrong shape, NULL.
  c.ownership = SHARDOPT_OWNERSHIP_WHOLE;
  ASSERT_EQ(shardopt_create(&opt, &c), SHARDOPT_SUCCESS);
  ASSERT_EQ(shardopt_add_group_ex(opt, &ag, &g), SHARDOPT_SUCCESS);
  ASSERT_EQ(shardopt_add_param_2d(opt, "m", 6, 8, g, nullptr), SHARDOPT_SUCCESS);
  ASSERT_EQ(shardopt_add_param(opt, "v", 8, g, nullptr), SHARDOPT_SUCCESS);
  ASSERT_EQ(shardopt_add_param_2d(opt, "a", 6, 8, 0, nullptr), SHARDOPT_SUCCESS);
  float row[6], col[8];
  EXPECT_EQ(shardopt_get_factored_state(opt, 0, row, 6, col, 8), SHARDOPT_ERROR_INVALID_STATE);
  ASSERT_EQ(shardopt_finalize(opt), SHARDOPT_SUCCESS) << last(opt);
  EXPECT_EQ(shardopt_get_factored_state(opt, 0, row, 6, col, 8), SHARDOPT_SUCCESS) << last(opt);
  EXPECT_FAILS(shardopt_get_factored_state(opt, 1, row, 1, col, 8),
               SHARDOPT_ERROR_INVALID_ARGUMENT, "shardopt_get_factored_state",
               "'v' (1 x 8, Adafactor) keeps no factored statistics");
  EXPECT_FAILS(shardopt_get_factored_state(opt, 2, row, 6, col, 8),
               SHARDOPT_ERROR_INVALID_ARGUMENT, "shardopt_get_factored_state",
               "'a' (6 x 8, AdamW) keeps no factored statistics");
  EXPECT_FAILS(shardopt_get_factored_state(opt, 0, row, 8, col, 6),
               SHARDOPT_ERROR_INVALID_ARGUMENT, "shardopt_get_factored_state",
               "'m' has 6 rows and 8 columns, got buffers of 8 and 6");
  EXPECT_FAILS(shardopt_get_factored_state(opt, 0, nullptr, 6, col, 8),
               SHARDOPT_ERROR_INVALID_ARGUMENT, "shardopt_get_factored_state",
               "row_var or col_var is NULL");
  EXPECT_FAILS(shardopt_get_factored_state(opt, 3, row, 6, col, 8),
               SHARDOPT_ERROR_INVALID_ARGUMENT, "shardopt_get_factored_state", "out of range");
  EXPECT_EQ(shardopt_destroy(opt), SHARDOPT_SUCCESS);
}

}  // namespace
