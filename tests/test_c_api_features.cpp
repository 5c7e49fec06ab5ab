// test_c_api_features.cpp: the C ABI entry points and struct contracts added for parity with
// the C++ API (issue 13), in one process: growable structs (a caller built against an older,
// smaller struct), every config field reaching the optimizer and coming back, groups, the flat
// replica and offsets, m and v, loss scaling, timings, waits, and checkpoints with their IO
// and CORRUPT_DATA codes; what a program written for 0.1 meets (docs/c_api.md).
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "shardopt/shardopt.h"
#include "support/reference.hpp"

namespace {

namespace fs = std::filesystem;
using shardopt::test::synth;

// The config as shardopt 0.1.0 published it (no overlap, loss scaling, ... fields): a
// caller compiled against that header passes sizeof of this.
struct config_v0_1 {
  size_t struct_size;
  int stage, param_dtype, device, adam_mode;
  double lr, beta1, beta2, eps, weight_decay, max_grad_norm;
  size_t bucket_elems;
};
// The smallest step result: the fields before skipped_steps.
struct step_result_v0_1 {
  size_t struct_size;
  double grad_norm, clip_coef;
  int clipped, skipped;
  int64_t step;
};
static_assert(sizeof(config_v0_1) == offsetof(shardopt_config_t, overlap));
static_assert(sizeof(step_result_v0_1) == offsetof(shardopt_step_result_t, skipped_steps));

shardopt_config_t base_config() {
  shardopt_config_t c;
  EXPECT_EQ(shardopt_config_init(&c), SHARDOPT_SUCCESS);
  c.param_dtype = SHARDOPT_DTYPE_F32;
  c.lr = 1e-2;
  c.bucket_elems = 128;
  return c;
}

shardopt_step_result_t step_result() {
  shardopt_step_result_t r;
  EXPECT_EQ(shardopt_step_result_init(&r), SHARDOPT_SUCCESS);
  return r;
}

// An optimizer with "a" (100), "b" (7, group 1: lr_scale 0.5, no decay) and "c" (300).
struct Opt {
  shardopt_optimizer_t h = nullptr;
  std::vector<std::size_t> sizes{100, 7, 300};
  explicit Opt(const shardopt_config_t& c) {
    EXPECT_EQ(shardopt_create(&h, &c), SHARDOPT_SUCCESS) << shardopt_last_error(nullptr);
    int g = -1;
    EXPECT_EQ(shardopt_add_group(h, 0.5, 0, &g), SHARDOPT_SUCCESS);
    const char* names[3] = {"a", "b", "c"};
    for (std::size_t p = 0; p < 3; ++p)
      EXPECT_EQ(shardopt_add_param(h, names[p], sizes[p], p == 1 ? g : 0, nullptr), SHARDOPT_SUCCESS);
    EXPECT_EQ(shardopt_finalize(h), SHARDOPT_SUCCESS) << shardopt_last_error(h);
    for (std::size_t p = 0; p < 3; ++p) {
      std::vector<float> v(sizes[p]);
      for (std::size_t k = 0; k < v.size(); ++k) v[k] = synth(0, 0, p, k);
      EXPECT_EQ(shardopt_set_param(h, p, v.data(), v.size()), SHARDOPT_SUCCESS);
    }
  }
  ~Opt() { EXPECT_EQ(shardopt_destroy(h), SHARDOPT_SUCCESS); }
  // One step with gradients synth(1, step, p, k) * scale (in backward order).
  shardopt_status_t step(int step, shardopt_step_result_t* r, float scale = 1.0f) {
    for (std::size_t p = sizes.size(); p-- > 0;) {
      std::vector<float> g(sizes[p]);
      for (std::size_t k = 0; k < g.size(); ++k) g[k] = scale * synth(1, step, p, k);
      EXPECT_EQ(shardopt_accumulate_grad_f32(h, p, g.data(), g.size()), SHARDOPT_SUCCESS);
      EXPECT_EQ(shardopt_grad_ready(h, p), SHARDOPT_SUCCESS);
    }
    return shardopt_step(h, r);
  }
  std::vector<float> master(std::size_t p) const {
    std::vector<float> v(sizes[p]);
    EXPECT_EQ(shardopt_get_master(h, p, v.data(), v.size()), SHARDOPT_SUCCESS);
    return v;
  }
};

std::string last(shardopt_optimizer_t h) { return shardopt_last_error(h); }

// ---- growable structs ------------------------------------------------------------------------

TEST(CApiStructs, ConfigFromAnOlderSmallerHeaderTakesDefaultsForNewFields) {
  config_v0_1 old;
  std::memset(&old, 0, sizeof old);
  old.struct_size = sizeof old;
  old.stage = SHARDOPT_STAGE_ZERO2;
  old.param_dtype = SHARDOPT_DTYPE_F32;
  old.device = SHARDOPT_DEVICE_CPU;
  old.adam_mode = SHARDOPT_ADAM_L2;
  old.lr = 0.25;
  old.beta1 = 0.8;
  old.beta2 = 0.95;
  old.eps = 1e-6;
  old.weight_decay = 0.5;
  old.max_grad_norm = 3.0;
  old.bucket_elems = 4096;
  shardopt_optimizer_t opt = nullptr;
  ASSERT_EQ(shardopt_create(&opt, reinterpret_cast<const shardopt_config_t*>(&old)), SHARDOPT_SUCCESS)
      << shardopt_last_error(nullptr);
  shardopt_config_t now, defaults;
  ASSERT_EQ(shardopt_config_init(&now), SHARDOPT_SUCCESS);
  ASSERT_EQ(shardopt_config_init(&defaults), SHARDOPT_SUCCESS);
  ASSERT_EQ(shardopt_get_config(opt, &now), SHARDOPT_SUCCESS);
  // The old fields arrived...
  EXPECT_EQ(now.stage, SHARDOPT_STAGE_ZERO2);
  EXPECT_EQ(now.adam_mode, SHARDOPT_ADAM_L2);
  EXPECT_EQ(now.lr, 0.25);
  EXPECT_EQ(now.beta1, 0.8);
  EXPECT_EQ(now.beta2, 0.95);
  EXPECT_EQ(now.eps, 1e-6);
  EXPECT_EQ(now.weight_decay, 0.5);
  EXPECT_EQ(now.max_grad_norm, 3.0);
  EXPECT_EQ(now.bucket_elems, 4096u);
  // ...and every field the old header does not have is at its default (the collective
  // timeout reads back as the value the optimizer chose for its default 0).
  EXPECT_NE(now.collective_timeout_s, 0.0);
  defaults.collective_timeout_s = now.collective_timeout_s;
  const std::size_t from = offsetof(shardopt_config_t, overlap);
  EXPECT_EQ(std::memcmp(reinterpret_cast<const char*>(&now) + from,
                        reinterpret_cast<const char*>(&defaults) + from, sizeof now - from), 0);
  EXPECT_EQ(now.overlap, 1);
  EXPECT_EQ(now.gather_mode, SHARDOPT_GATHER_EAGER);

  // get_config into the old, smaller struct writes nothing beyond it.
  struct {
    config_v0_1 cfg;
    unsigned char guard[64];
  } out;
  std::memset(&out, 0xA5, sizeof out);
  out.cfg.struct_size = sizeof(config_v0_1);
  ASSERT_EQ(shardopt_get_config(opt, reinterpret_cast<shardopt_config_t*>(&out.cfg)), SHARDOPT_SUCCESS);
  EXPECT_EQ(out.cfg.struct_size, sizeof(config_v0_1));
  EXPECT_EQ(out.cfg.lr, 0.25);
  EXPECT_EQ(out.cfg.bucket_elems, 4096u);
  for (unsigned char b : out.guard) ASSERT_EQ(b, 0xA5);
  ASSERT_EQ(shardopt_destroy(opt), SHARDOPT_SUCCESS);
}

TEST(CApiStructs, ConfigSizesThatAreNoVersionAreRefused) {
  shardopt_config_t c = base_config();
  shardopt_optimizer_t opt = nullptr;
  const std::size_t bad[] = {0, 8, sizeof(config_v0_1) - 8, sizeof(config_v0_1) + 2,
                             offsetof(shardopt_config_t, loss_scale_initial) + 4,
                             sizeof(shardopt_config_t) + 8};
  for (std::size_t size : bad) {
    c.struct_size = size;
    EXPECT_EQ(shardopt_create(&opt, &c), SHARDOPT_ERROR_INVALID_ARGUMENT) << size;
    EXPECT_NE(last(nullptr).find("struct_size is " + std::to_string(size)), std::string::npos) << last(nullptr);
    EXPECT_EQ(opt, nullptr);
  }
  // Every field boundary from the 0.1.0 size up is a valid size.
  for (std::size_t size = sizeof(config_v0_1); size <= sizeof(shardopt_config_t); size += 4) {
    c.struct_size = size;
    const shardopt_status_t st = shardopt_create(&opt, &c);
    if (st == SHARDOPT_SUCCESS) EXPECT_EQ(shardopt_destroy(opt), SHARDOPT_SUCCESS);
    else EXPECT_NE(last(nullptr).find("struct_size"), std::string::npos) << size;
  }
  c.struct_size = offsetof(shardopt_config_t, gather_mode) + sizeof(int);
  c.gather_mode = SHARDOPT_GATHER_LAZY;
  c.loss_scaling = 7;  // beyond the caller's size: never read
  ASSERT_EQ(shardopt_create(&opt, &c), SHARDOPT_SUCCESS) << last(nullptr);
  shardopt_config_t got;
  ASSERT_EQ(shardopt_config_init(&got), SHARDOPT_SUCCESS);
  ASSERT_EQ(shardopt_get_config(opt, &got), SHARDOPT_SUCCESS);
  EXPECT_EQ(got.gather_mode, SHARDOPT_GATHER_LAZY);
  EXPECT_EQ(got.loss_scaling, 0);
  ASSERT_EQ(shardopt_destroy(opt), SHARDOPT_SUCCESS);
}

TEST(CApiStructs, StepResultOfAnOlderSizeGetsOnlyItsFields) {
  Opt o(base_config());
  struct {
    step_result_v0_1 r;
    unsigned char guard[64];
  } out;
  std::memset(&out, 0x5A, sizeof out);
  out.r.struct_size = sizeof(step_result_v0_1);
  ASSERT_EQ(o.step(0, reinterpret_cast<shardopt_step_result_t*>(&out.r)), SHARDOPT_SUCCESS) << last(o.h);
  EXPECT_EQ(out.r.struct_size, sizeof(step_result_v0_1));
  EXPECT_EQ(out.r.step, 1);
  EXPECT_EQ(out.r.skipped, 0);
  EXPECT_GT(out.r.grad_norm, 0.0);
  for (unsigned char b : out.guard) ASSERT_EQ(b, 0x5A);

  // A size that is no version: the step is still applied (it is collective), the result is
  // left alone and the call says so.
  shardopt_step_result_t r = step_result();
  r.struct_size = 20;
  const shardopt_step_result_t before = r;
  EXPECT_EQ(o.step(1, &r), SHARDOPT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last(o.h).find("the step itself was applied"), std::string::npos) << last(o.h);
  EXPECT_EQ(std::memcmp(&r, &before, sizeof r), 0);
  int64_t steps = 0;
  ASSERT_EQ(shardopt_step_count(o.h, &steps), SHARDOPT_SUCCESS);
  EXPECT_EQ(steps, 2);
  // A newer caller's larger struct: every field this library knows is written.
  struct {
    shardopt_step_result_t r;
    double newer_field;
  } big;
  big.r = step_result();
  big.r.struct_size = sizeof big;
  big.newer_field = 42.0;
  ASSERT_EQ(o.step(2, &big.r), SHARDOPT_SUCCESS);
  EXPECT_EQ(big.r.step, 3);
  EXPECT_EQ(big.newer_field, 42.0);
}

// ---- every config field reaches the optimizer and comes back ---------------------------------

TEST(CApiConfig, EveryFieldRoundTrips) {
  shardopt_config_t c;
  ASSERT_EQ(shardopt_config_init(&c), SHARDOPT_SUCCESS);
  EXPECT_EQ(c.struct_size, sizeof c);
  c.stage = SHARDOPT_STAGE_DATA_PARALLEL;
  c.param_dtype = SHARDOPT_DTYPE_F32;
  c.device = SHARDOPT_DEVICE_CPU;
  c.adam_mode = SHARDOPT_ADAM_L2;
  c.lr = 0.125;
  c.beta1 = 0.5;
  c.beta2 = 0.75;
  c.eps = 1e-5;
  c.weight_decay = 0.0625;
  c.max_grad_norm = 2.5;
  c.bucket_elems = 333;
  c.overlap = 0;
  c.buckets_in_flight = 3;
  c.reduce_dtype = SHARDOPT_DTYPE_BF16;
  c.comm_kind = SHARDOPT_COMM_SHM;  // kept as requested; one process needs no communicator
  c.comm_simulate_nodes = 2;
  c.gather_mode = SHARDOPT_GATHER_LAZY;
  c.loss_scaling = 1;
  c.loss_scale_growth_interval = 9;
  c.loss_scale_initial = 512;
  c.loss_scale_growth_factor = 4;
  c.loss_scale_backoff_factor = 0.25;
  c.loss_scale_min = 2;
  c.loss_scale_max = 8192;
  c.units_in_flight = 3;
  c.collective_timeout_s = 90.5;
  c.debug_collectives = 1;
  c.comm_mpi_in_flight = 4;
  c.reduction = SHARDOPT_REDUCTION_DEFAULT;  // reproducible needs an F32 wire: tested below
  c.ownership = SHARDOPT_OWNERSHIP_WHOLE;
  shardopt_optimizer_t opt = nullptr;
  ASSERT_EQ(shardopt_create(&opt, &c), SHARDOPT_SUCCESS) << last(nullptr);
  shardopt_config_t got;
  ASSERT_EQ(shardopt_config_init(&got), SHARDOPT_SUCCESS);
  ASSERT_EQ(shardopt_get_config(opt, &got), SHARDOPT_SUCCESS);
  EXPECT_EQ(std::memcmp(&got, &c, sizeof c), 0);
  const char* name = nullptr;
  ASSERT_EQ(shardopt_comm_name(opt, &name), SHARDOPT_SUCCESS);
  EXPECT_STREQ(name, "single-process");
  double scale = 0;
  ASSERT_EQ(shardopt_get_loss_scale(opt, &scale, nullptr, nullptr), SHARDOPT_SUCCESS);
  EXPECT_EQ(scale, 512.0);
  // Hyperparameters changed later are what get_config reports.
  ASSERT_EQ(shardopt_set_hyper(opt, SHARDOPT_HYPER_BETA2, 0.9), SHARDOPT_SUCCESS);
  ASSERT_EQ(shardopt_get_config(opt, &got), SHARDOPT_SUCCESS);
  EXPECT_EQ(got.beta2, 0.9);
  ASSERT_EQ(shardopt_destroy(opt), SHARDOPT_SUCCESS);
}

TEST(CApiConfig, BadValuesOfTheNewFieldsAreRefused) {
  struct Case {
    int shardopt_config_t::*field;
    int value;
    const char* fragment;
  };
  const Case cases[] = {
      {&shardopt_config_t::overlap, 2, "config->overlap"},
      {&shardopt_config_t::reduce_dtype, 3, "config->reduce_dtype"},
      {&shardopt_config_t::comm_kind, 5, "config->comm_kind"},
      {&shardopt_config_t::comm_simulate_nodes, -1, "comm_simulate_nodes"},
      {&shardopt_config_t::gather_mode, 2, "config->gather_mode"},
      {&shardopt_config_t::loss_scaling, -1, "config->loss_scaling"},
      {&shardopt_config_t::buckets_in_flight, 0, "buckets_in_flight"},
      {&shardopt_config_t::debug_collectives, 2, "config->debug_collectives"},
      {&shardopt_config_t::comm_mpi_in_flight, -1, "config->comm_mpi_in_flight"},
      {&shardopt_config_t::reduction, 2, "config->reduction"},
      {&shardopt_config_t::reserved0, 1, "config->reserved0"},
      {&shardopt_config_t::ownership, 2, "config->ownership 2 is not SHARDOPT_OWNERSHIP_FLAT"},
      {&shardopt_config_t::reserved1, 1, "config->reserved1"},
  };
  for (const Case& k : cases) {
    shardopt_config_t c = base_config();
    c.*k.field = k.value;
    shardopt_optimizer_t opt = nullptr;
    EXPECT_EQ(shardopt_create(&opt, &c), SHARDOPT_ERROR_INVALID_ARGUMENT) << k.fragment;
    EXPECT_NE(last(nullptr).find(k.fragment), std::string::npos) << last(nullptr);
  }
  shardopt_config_t c = base_config();
  c.loss_scaling = 1;
  c.loss_scale_min = 10;
  c.loss_scale_max = 5;
  shardopt_optimizer_t opt = nullptr;
  EXPECT_EQ(shardopt_create(&opt, &c), SHARDOPT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last(nullptr).find("loss scaling"), std::string::npos) << last(nullptr);
  c.loss_scaling = 0;  // checked while loss scaling is off too (issue 27)
  EXPECT_EQ(shardopt_create(&opt, &c), SHARDOPT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last(nullptr).find("min_scale 10"), std::string::npos) << last(nullptr);
  EXPECT_NE(last(nullptr).find("checked although loss scaling is off"), std::string::npos) << last(nullptr);
  c = base_config();
  c.loss_scale_growth_interval = 0;
  EXPECT_EQ(shardopt_create(&opt, &c), SHARDOPT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last(nullptr).find("growth_interval must be >= 1, got 0"), std::string::npos) << last(nullptr);
  c = base_config();  // the defaults create, loss scaling off and on
  ASSERT_EQ(shardopt_create(&opt, &c), SHARDOPT_SUCCESS) << last(nullptr);
  EXPECT_EQ(shardopt_destroy(opt), SHARDOPT_SUCCESS);
  c.loss_scaling = 1;
  ASSERT_EQ(shardopt_create(&opt, &c), SHARDOPT_SUCCESS) << last(nullptr);
  EXPECT_EQ(shardopt_destroy(opt), SHARDOPT_SUCCESS);
  c = base_config();
  c.collective_timeout_s = std::nan("");
  EXPECT_EQ(shardopt_create(&opt, &c), SHARDOPT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last(nullptr).find("collective_timeout_s"), std::string::npos) << last(nullptr);
}

// Reproducible mode through the C ABI: reported back, and refused with a bf16 wire.
TEST(CApiConfig, ReproducibleReduction) {
  shardopt_config_t c = base_config();
  c.reduction = SHARDOPT_REDUCTION_REPRODUCIBLE;
  {
    Opt o(c);
    shardopt_config_t got;
    ASSERT_EQ(shardopt_config_init(&got), SHARDOPT_SUCCESS);
    ASSERT_EQ(shardopt_get_config(o.h, &got), SHARDOPT_SUCCESS);
    EXPECT_EQ(got.reduction, SHARDOPT_REDUCTION_REPRODUCIBLE);
    shardopt_step_result_t r = step_result();
    EXPECT_EQ(o.step(0, &r), SHARDOPT_SUCCESS);
  }
  c.reduce_dtype = SHARDOPT_DTYPE_BF16;
  shardopt_optimizer_t opt = nullptr;
  EXPECT_EQ(shardopt_create(&opt, &c), SHARDOPT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last(nullptr).find("reduce_dtype F32"), std::string::npos) << last(nullptr);
}

// The options change results: a bf16 reduction wire is not the fp32 one, overlap is not.
TEST(CApiConfig, OptionsReachTheOptimizer) {
  auto train = [](int reduce_dtype, int overlap) {
    shardopt_config_t c = base_config();
    c.reduce_dtype = reduce_dtype;
    c.overlap = overlap;
    Opt o(c);
    for (int s = 0; s < 3; ++s) {
      shardopt_step_result_t r = step_result();
      EXPECT_EQ(o.step(s, &r), SHARDOPT_SUCCESS);
    }
    return o.master(2);
  };
  const std::vector<float> base = train(SHARDOPT_DTYPE_F32, 1);
  EXPECT_EQ(train(SHARDOPT_DTYPE_F32, 0), base);  // overlap changes timing only
  // One process: the bf16 wire still rounds the gradient to bf16 before the update.
  EXPECT_NE(train(SHARDOPT_DTYPE_BF16, 1), base);
}

// ---- groups, replica, offsets, waits ---------------------------------------------------------

TEST(CApiQueries, GroupsAreReadable) {
  Opt o(base_config());
  int n = 0, wd = -1;
  double scale = 0;
  ASSERT_EQ(shardopt_num_groups(o.h, &n), SHARDOPT_SUCCESS);
  EXPECT_EQ(n, 2);
  ASSERT_EQ(shardopt_get_group(o.h, 1, &scale, &wd), SHARDOPT_SUCCESS);
  EXPECT_EQ(scale, 0.5);
  EXPECT_EQ(wd, 0);
  ASSERT_EQ(shardopt_set_group(o.h, 1, 0.25, 1), SHARDOPT_SUCCESS);
  ASSERT_EQ(shardopt_get_group(o.h, 1, &scale, nullptr), SHARDOPT_SUCCESS);
  EXPECT_EQ(scale, 0.25);
  ASSERT_EQ(shardopt_get_group(o.h, 0, nullptr, &wd), SHARDOPT_SUCCESS);
  EXPECT_EQ(wd, 1);
  EXPECT_EQ(shardopt_get_group(o.h, 2, &scale, &wd), SHARDOPT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last(o.h).find("no group 2"), std::string::npos);
}

template <class T>
void check_replica(int dtype) {
  shardopt_config_t c = base_config();
  c.param_dtype = dtype;
  Opt o(c);
  const void* base = nullptr;
  std::size_t elems = 0;
  ASSERT_EQ(shardopt_replica(o.h, &base, &elems), SHARDOPT_SUCCESS);
  std::size_t end = 0;
  for (std::size_t p = 0; p < o.sizes.size(); ++p) {
    std::size_t off = 0, n = 0;
    ASSERT_EQ(shardopt_param_offset(o.h, p, &off), SHARDOPT_SUCCESS);
    EXPECT_EQ(off % 64, 0u);
    EXPECT_GE(off, end);  // in registration order, not overlapping
    const void* view = nullptr;
    if constexpr (sizeof(T) == 4)
      ASSERT_EQ(shardopt_param_f32(o.h, p, reinterpret_cast<const float**>(&view), &n), SHARDOPT_SUCCESS);
    else
      ASSERT_EQ(shardopt_param_bf16(o.h, p, reinterpret_cast<const uint16_t**>(&view), &n), SHARDOPT_SUCCESS);
    EXPECT_EQ(view, static_cast<const T*>(base) + off);  // the same memory, one base pointer
    for (std::size_t k = end; k < off; ++k) EXPECT_EQ(static_cast<const T*>(base)[k], T{0}) << "padding";
    end = off + n;
  }
  EXPECT_GE(elems, end);
  EXPECT_EQ(shardopt_param_offset(o.h, 3, &end), SHARDOPT_ERROR_INVALID_ARGUMENT);
  // The base pointer is stable across steps and reads the new values after each.
  shardopt_step_result_t r = step_result();
  ASSERT_EQ(o.step(0, &r), SHARDOPT_SUCCESS);
  const void* again = nullptr;
  ASSERT_EQ(shardopt_replica(o.h, &again, nullptr), SHARDOPT_SUCCESS);
  EXPECT_EQ(again, base);
  std::size_t off = 0;
  ASSERT_EQ(shardopt_param_offset(o.h, 2, &off), SHARDOPT_SUCCESS);
  const std::vector<float> m = o.master(2);
  for (std::size_t k = 0; k < m.size(); ++k) {
    const T v = static_cast<const T*>(base)[off + k];
    if constexpr (sizeof(T) == 4) ASSERT_EQ(v, m[k]);
    else ASSERT_EQ(v, shardopt_float_to_bf16(m[k]));
  }
}

TEST(CApiQueries, FlatReplicaAndOffsets) {
  check_replica<float>(SHARDOPT_DTYPE_F32);
  check_replica<std::uint16_t>(SHARDOPT_DTYPE_BF16);
}

TEST(CApiQueries, WaitsAndProgressFollowTheCallOrder) {
  shardopt_config_t c = base_config();
  shardopt_optimizer_t opt = nullptr;
  ASSERT_EQ(shardopt_create(&opt, &c), SHARDOPT_SUCCESS);
  ASSERT_EQ(shardopt_add_param(opt, "w", 10, 0, nullptr), SHARDOPT_SUCCESS);
  EXPECT_EQ(shardopt_wait_all(opt), SHARDOPT_ERROR_INVALID_STATE);
  EXPECT_EQ(shardopt_wait_param(opt, 0), SHARDOPT_ERROR_INVALID_STATE);
  EXPECT_EQ(shardopt_progress(opt), SHARDOPT_ERROR_INVALID_STATE);
  const void* base = nullptr;
  std::size_t off = 0;
  EXPECT_EQ(shardopt_replica(opt, &base, nullptr), SHARDOPT_ERROR_INVALID_STATE);
  EXPECT_EQ(shardopt_param_offset(opt, 0, &off), SHARDOPT_ERROR_INVALID_STATE);
  ASSERT_EQ(shardopt_finalize(opt), SHARDOPT_SUCCESS);
  EXPECT_EQ(shardopt_wait_all(opt), SHARDOPT_SUCCESS);
  EXPECT_EQ(shardopt_wait_param(opt, 0), SHARDOPT_SUCCESS);
  EXPECT_EQ(shardopt_wait_param(opt, 1), SHARDOPT_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(shardopt_progress(opt), SHARDOPT_SUCCESS);
  EXPECT_EQ(shardopt_replica(opt, nullptr, nullptr), SHARDOPT_ERROR_INVALID_ARGUMENT);
  ASSERT_EQ(shardopt_destroy(opt), SHARDOPT_SUCCESS);
}

// grad_ready is optional at stages 0/1 and marks a parameter once per micro-batch.
TEST(CApiQueries, GradReadyTwiceIsAnError) {
  for (int stage = 0; stage <= 2; ++stage) {
    shardopt_config_t c = base_config();
    c.stage = stage;
    Opt o(c);
    ASSERT_EQ(shardopt_grad_ready(o.h, 2), SHARDOPT_SUCCESS);
    EXPECT_EQ(shardopt_grad_ready(o.h, 2), SHARDOPT_ERROR_INVALID_STATE) << stage;
    EXPECT_NE(last(o.h).find("already marked ready"), std::string::npos) << last(o.h);
    shardopt_step_result_t r = step_result();
    EXPECT_EQ(shardopt_step(o.h, &r), SHARDOPT_SUCCESS);  // others not marked: the step reduces them
  }
}

// ---- optimizer state, loss scaling, timings ---------------------------------------------------

TEST(CApiState, FirstMomentsAfterOneStep) {
  shardopt_config_t c = base_config();
  c.stage = SHARDOPT_STAGE_ZERO2;
  Opt o(c);
  shardopt_step_result_t r = step_result();
  ASSERT_EQ(o.step(0, &r), SHARDOPT_SUCCESS);
  for (std::size_t p = 0; p < o.sizes.size(); ++p) {
    std::vector<float> m(o.sizes[p]), v(o.sizes[p]);
    ASSERT_EQ(shardopt_get_exp_avg(o.h, p, m.data(), m.size()), SHARDOPT_SUCCESS);
    ASSERT_EQ(shardopt_get_exp_avg_sq(o.h, p, v.data(), v.size()), SHARDOPT_SUCCESS);
    for (std::size_t k = 0; k < m.size(); ++k) {
      const double g = synth(1, 0, p, k);  // one rank, one micro-batch: the gradient itself
      ASSERT_NEAR(m[k], 0.1 * g, 1e-6 * std::fabs(g) + 1e-30) << p << "," << k;
      ASSERT_NEAR(v[k], 0.001 * g * g, 1e-6 * g * g + 1e-30) << p << "," << k;
    }
  }
  std::vector<float> small(3);
  EXPECT_EQ(shardopt_get_exp_avg(o.h, 0, small.data(), small.size()), SHARDOPT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last(o.h).find("has 100 elements, got 3"), std::string::npos) << last(o.h);
  EXPECT_EQ(shardopt_get_exp_avg_sq(o.h, 0, nullptr, 100), SHARDOPT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last(o.h).find("out is NULL"), std::string::npos) << last(o.h);
  EXPECT_EQ(shardopt_get_exp_avg(o.h, 9, small.data(), 3), SHARDOPT_ERROR_INVALID_ARGUMENT);
}

TEST(CApiState, LossScalingThroughTheResult) {
  shardopt_config_t c = base_config();
  c.loss_scaling = 1;
  c.loss_scale_initial = 1024;
  c.loss_scale_growth_interval = 2;
  Opt o(c);
  shardopt_step_result_t r = step_result();
  ASSERT_EQ(o.step(0, &r, 1024.0f), SHARDOPT_SUCCESS);
  EXPECT_EQ(r.loss_scale, 1024.0);
  ASSERT_EQ(o.step(1, &r, 1024.0f), SHARDOPT_SUCCESS);
  EXPECT_EQ(r.loss_scale, 2048.0);  // grew after two finite steps
  float* g = nullptr;
  ASSERT_EQ(shardopt_grad(o.h, 0, &g, nullptr), SHARDOPT_SUCCESS);
  g[0] = INFINITY;
  ASSERT_EQ(shardopt_step(o.h, &r), SHARDOPT_SUCCESS);
  EXPECT_EQ(r.skipped, 1);
  EXPECT_EQ(r.loss_scale, 1024.0);  // backed off
  EXPECT_EQ(r.skipped_steps, 1);
  double scale = 0;
  int64_t good = -1, skipped = -1;
  ASSERT_EQ(shardopt_get_loss_scale(o.h, &scale, &good, &skipped), SHARDOPT_SUCCESS);
  EXPECT_EQ(scale, 1024.0);
  EXPECT_EQ(good, 0);
  EXPECT_EQ(skipped, 1);
  ASSERT_EQ(shardopt_set_loss_scale(o.h, 4096.0, 1, 5), SHARDOPT_SUCCESS);
  ASSERT_EQ(shardopt_get_loss_scale(o.h, &scale, &good, &skipped), SHARDOPT_SUCCESS);
  EXPECT_EQ(scale, 4096.0);
  EXPECT_EQ(good, 1);
  EXPECT_EQ(skipped, 5);
  EXPECT_EQ(shardopt_set_loss_scale(o.h, NAN, 0, 0), SHARDOPT_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(shardopt_set_loss_scale(o.h, 8.0, -1, 0), SHARDOPT_ERROR_INVALID_ARGUMENT);
  ASSERT_EQ(shardopt_get_loss_scale(o.h, &scale, nullptr, nullptr), SHARDOPT_SUCCESS);
  EXPECT_EQ(scale, 4096.0);  // unchanged by the refused values
}

TEST(CApiState, TimingsAreReported) {
  for (int lazy = 0; lazy <= 1; ++lazy) {
    shardopt_config_t c = base_config();
    c.gather_mode = lazy;
    Opt o(c);
    shardopt_step_result_t r = step_result();
    r.time_total = -1;
    ASSERT_EQ(o.step(0, &r), SHARDOPT_SUCCESS);
    for (double t : {r.time_reduce, r.time_norm, r.time_update, r.time_gather}) {
      EXPECT_GE(t, 0.0);
      EXPECT_LE(t, r.time_total);
    }
    EXPECT_GT(r.time_total, 0.0);
  }
}

// ---- checkpoints ------------------------------------------------------------------------------

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / ("shardopt_c_api_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

TEST(CApiCheckpoint, SaveLoadRestoresEverything) {
  TempDir dir;
  shardopt_config_t c = base_config();
  c.param_dtype = SHARDOPT_DTYPE_BF16;
  Opt a(c);
  shardopt_step_result_t r = step_result();
  for (int s = 0; s < 3; ++s) ASSERT_EQ(a.step(s, &r), SHARDOPT_SUCCESS);
  ASSERT_EQ(shardopt_set_hyper(a.h, SHARDOPT_HYPER_BETA1, 0.7), SHARDOPT_SUCCESS);
  const char* published = nullptr;
  ASSERT_EQ(shardopt_save_checkpoint(a.h, dir.path.c_str(), 2, &published), SHARDOPT_SUCCESS) << last(a.h);
  ASSERT_NE(published, nullptr);
  EXPECT_EQ(fs::path(published).parent_path(), dir.path);
  EXPECT_TRUE(fs::is_directory(published));
  std::vector<std::vector<float>> master, m, v;
  for (std::size_t p = 0; p < a.sizes.size(); ++p) {
    master.push_back(a.master(p));
    m.emplace_back(a.sizes[p]);
    v.emplace_back(a.sizes[p]);
    ASSERT_EQ(shardopt_get_exp_avg(a.h, p, m.back().data(), a.sizes[p]), SHARDOPT_SUCCESS);
    ASSERT_EQ(shardopt_get_exp_avg_sq(a.h, p, v.back().data(), a.sizes[p]), SHARDOPT_SUCCESS);
  }
  // Another optimizer of the same parameters, at another stage, loads it bit for bit.
  c.stage = SHARDOPT_STAGE_ZERO2;
  Opt b(c);
  ASSERT_EQ(shardopt_load_checkpoint(b.h, dir.path.c_str()), SHARDOPT_SUCCESS) << last(b.h);
  int64_t steps = 0;
  double beta1 = 0;
  ASSERT_EQ(shardopt_step_count(b.h, &steps), SHARDOPT_SUCCESS);
  EXPECT_EQ(steps, 3);
  ASSERT_EQ(shardopt_get_hyper(b.h, SHARDOPT_HYPER_BETA1, &beta1), SHARDOPT_SUCCESS);
  EXPECT_EQ(beta1, 0.7);
  for (std::size_t p = 0; p < b.sizes.size(); ++p) {
    std::vector<float> mm(b.sizes[p]), vv(b.sizes[p]);
    ASSERT_EQ(shardopt_get_exp_avg(b.h, p, mm.data(), mm.size()), SHARDOPT_SUCCESS);
    ASSERT_EQ(shardopt_get_exp_avg_sq(b.h, p, vv.data(), vv.size()), SHARDOPT_SUCCESS);
    EXPECT_EQ(b.master(p), master[p]);
    EXPECT_EQ(mm, m[p]);
    EXPECT_EQ(vv, v[p]);
    const uint16_t* bits = nullptr;
    ASSERT_EQ(shardopt_param_bf16(b.h, p, &bits, nullptr), SHARDOPT_SUCCESS);
    for (std::size_t k = 0; k < b.sizes[p]; ++k)
      ASSERT_EQ(bits[k], shardopt_float_to_bf16(master[p][k]));  // the replica was rebuilt
  }
  // keep = 1 prunes the older checkpoint.
  const std::string first = published;
  ASSERT_EQ(a.step(3, &r), SHARDOPT_SUCCESS);
  const char* second = nullptr;
  ASSERT_EQ(shardopt_save_checkpoint(a.h, dir.path.c_str(), 1, &second), SHARDOPT_SUCCESS);
  EXPECT_NE(std::string(second), first);
  EXPECT_TRUE(fs::is_directory(second));
  EXPECT_FALSE(fs::exists(first));
  std::size_t published_count = 0;
  for (const auto& e : fs::directory_iterator(dir.path))
    if (e.path().filename().string().rfind("ckpt-", 0) == 0) ++published_count;
  EXPECT_EQ(published_count, 1u);
}

TEST(CApiCheckpoint, IoAndCorruptDataAreReportedAndChangeNothing) {
  TempDir dir;
  Opt a(base_config());
  shardopt_step_result_t r = step_result();
  ASSERT_EQ(a.step(0, &r), SHARDOPT_SUCCESS);
  const char* published = nullptr;
  ASSERT_EQ(shardopt_save_checkpoint(a.h, dir.path.c_str(), 2, &published), SHARDOPT_SUCCESS);
  const fs::path ck = published;

  Opt victim(base_config());
  ASSERT_EQ(victim.step(5, &r), SHARDOPT_SUCCESS);
  const std::vector<float> before = victim.master(2);

  EXPECT_EQ(shardopt_load_checkpoint(victim.h, (dir.path / "missing").c_str()), SHARDOPT_ERROR_IO);
  EXPECT_NE(last(victim.h).find("shardopt_load_checkpoint"), std::string::npos) << last(victim.h);
  // Flip one byte of the first shard's payload: the checksum catches it.
  fs::path shard;
  for (const auto& e : fs::directory_iterator(ck))
    if (e.path().filename() != "metadata.bin") shard = e.path();
  ASSERT_FALSE(shard.empty());
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(100);
    char byte = 0;
    f.read(&byte, 1);
    byte = static_cast<char>(byte ^ 0x10);
    f.seekp(100);
    f.write(&byte, 1);
  }
  EXPECT_EQ(shardopt_load_checkpoint(victim.h, dir.path.c_str()), SHARDOPT_ERROR_CORRUPT_DATA)
      << last(victim.h);
  EXPECT_EQ(victim.master(2), before);
  int64_t steps = 0;
  ASSERT_EQ(shardopt_step_count(victim.h, &steps), SHARDOPT_SUCCESS);
  EXPECT_EQ(steps, 1);

  // Saving where a regular file is in the way is an IO error.
  const fs::path file = dir.path / "a-file";
  std::ofstream(file) << "not a directory";
  EXPECT_EQ(shardopt_save_checkpoint(a.h, file.c_str(), 2, nullptr), SHARDOPT_ERROR_IO) << last(a.h);
  EXPECT_EQ(shardopt_save_checkpoint(a.h, nullptr, 2, nullptr), SHARDOPT_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(shardopt_save_checkpoint(a.h, dir.path.c_str(), 0, nullptr), SHARDOPT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last(a.h).find("keep"), std::string::npos) << last(a.h);
  EXPECT_EQ(shardopt_load_checkpoint(a.h, ""), SHARDOPT_ERROR_INVALID_ARGUMENT);
}

}  // namespace

// The collective timeout is on by default: a default config's 0 reads back as the 600 s the
// optimizer chose; SHARDOPT_NO_COLLECTIVE_TIMEOUT reads back as none.
TEST(CApiConfig, CollectiveTimeoutDefaultIsFinite) {
  const char* registered = std::getenv("SHARDOPT_COLLECTIVE_TIMEOUT");
  const std::string saved = registered != nullptr ? registered : "";
  unsetenv("SHARDOPT_COLLECTIVE_TIMEOUT");
  for (const double asked : {0.0, SHARDOPT_NO_COLLECTIVE_TIMEOUT, 12.0}) {
    shardopt_config_t c = base_config();
    c.collective_timeout_s = asked;
    Opt o(c);
    shardopt_config_t got;
    ASSERT_EQ(shardopt_config_init(&got), SHARDOPT_SUCCESS);
    ASSERT_EQ(shardopt_get_config(o.h, &got), SHARDOPT_SUCCESS);
    EXPECT_EQ(got.collective_timeout_s,
              asked == 0.0 ? SHARDOPT_DEFAULT_COLLECTIVE_TIMEOUT : asked) << asked;
  }
  if (registered != nullptr) setenv("SHARDOPT_COLLECTIVE_TIMEOUT", saved.c_str(), 1);
}

// bucket_elems 0 (the default) is automatic: get_config reports the size finalize chose, an
// eighth of the model at least 4096 (Opt's model: 407 elements, so 4096).
TEST(CApiConfig, AutomaticBucketSize) {
  shardopt_config_t c = base_config();
  c.bucket_elems = 0;
  Opt o(c);
  shardopt_config_t got;
  ASSERT_EQ(shardopt_config_init(&got), SHARDOPT_SUCCESS);
  EXPECT_EQ(got.bucket_elems, 0u);
  ASSERT_EQ(shardopt_get_config(o.h, &got), SHARDOPT_SUCCESS);
  EXPECT_EQ(got.bucket_elems, 4096u);
}

// ---- a program written for 0.1 (docs/c_api.md, "Upgrading from 0.1") ------------------------

// 0.1's step result had no struct_size: grad_norm came first. Such a program, unchanged
// (compiled against 0.1, or recompiled without calling shardopt_step_result_init), passes a
// struct whose first 8 bytes read as struct_size 0: the step is applied on every rank and
// the call fails with a message that says what to do. shardopt_step_result_init fixes it.
TEST(CApiUpgradeFrom01, AStepResultWithoutStructSizeFailsClearly) {
  struct step_result_0_1 {  // shardopt.h of 0.1 (commit ad49b6c)
    double grad_norm, clip_coef;
    int clipped, skipped;
    int64_t step;
  };
  Opt o(base_config());
  step_result_0_1 old = {};  // as a C program writes `shardopt_step_result_t r = {0};`
  EXPECT_EQ(o.step(0, reinterpret_cast<shardopt_step_result_t*>(&old)), SHARDOPT_ERROR_INVALID_ARGUMENT);
  const std::string msg = last(o.h);
  EXPECT_NE(msg.find("result->struct_size is 0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("shardopt_step_result_init"), std::string::npos) << msg;
  EXPECT_NE(msg.find("the step itself was applied"), std::string::npos) << msg;
  int64_t steps = 0;
  ASSERT_EQ(shardopt_step_count(o.h, &steps), SHARDOPT_SUCCESS);
  EXPECT_EQ(steps, 1);
  shardopt_step_result_t r;
  ASSERT_EQ(shardopt_step_result_init(&r), SHARDOPT_SUCCESS);
  ASSERT_EQ(o.step(1, &r), SHARDOPT_SUCCESS) << last(o.h);
  EXPECT_EQ(r.step, 2);
}

// 0.1's shardopt_grad_ready was a no-op at stages 0 and 1. With 0.2's default overlap = 1 it
// starts a complete bucket's reduction at any stage, so a gradient written after its mark is
// refused (INVALID_STATE) where 0.1 took it; overlap = 0 restores 0.1's behaviour.
TEST(CApiUpgradeFrom01, AGradientWrittenAfterGradReadyIsRefusedUnlessOverlapIsOff) {
  for (int overlap : {1, 0}) {
    shardopt_config_t c = base_config();
    c.stage = SHARDOPT_STAGE_ZERO1;
    c.overlap = overlap;
    Opt o(c);
    for (std::size_t p = o.sizes.size(); p-- > 0;) {  // backward order: every bucket completes
      std::vector<float> g(o.sizes[p], 0.5f);
      ASSERT_EQ(shardopt_accumulate_grad_f32(o.h, p, g.data(), g.size()), SHARDOPT_SUCCESS);
      ASSERT_EQ(shardopt_grad_ready(o.h, p), SHARDOPT_SUCCESS);
    }
    std::vector<float> g(o.sizes[0], 0.5f);  // parameter 0 lies in one bucket
    const shardopt_status_t again = shardopt_accumulate_grad_f32(o.h, 0, g.data(), g.size());
    if (overlap == 1) {
      EXPECT_EQ(again, SHARDOPT_ERROR_INVALID_STATE) << last(o.h);
      EXPECT_NE(last(o.h).find("already reduced"), std::string::npos) << last(o.h);
    } else {
      EXPECT_EQ(again, SHARDOPT_SUCCESS) << last(o.h);
    }
    ASSERT_EQ(shardopt_step(o.h, nullptr), SHARDOPT_SUCCESS) << last(o.h);
  }
}
