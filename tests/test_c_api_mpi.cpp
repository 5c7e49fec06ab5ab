// test_c_api_mpi.cpp: the C ABI's collective calls under mpiexec: creation from a C or a
// Fortran communicator, errors on one rank reported on every rank (no hang), and training
// that equals the C++ API's on the same ranks.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstring>
#include <string>
#include <vector>

#include "shardopt/mpi_comm.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/shardopt.h"
#include "support/mpi_world.hpp"
#include "support/reference.hpp"

namespace {

// A result struct ready for shardopt_step (struct_size set).
shardopt_step_result_t step_result() {
  shardopt_step_result_t r;
  EXPECT_EQ(shardopt_step_result_init(&r), SHARDOPT_SUCCESS);
  return r;
}

using shardopt::test::world_rank;
using shardopt::test::world_size;

TEST(CApiMpi, CreateFromCAndFortranCommunicators) {
  shardopt_optimizer_t a = nullptr, b = nullptr;
  ASSERT_EQ(shardopt_create_mpi(&a, MPI_COMM_WORLD, nullptr), SHARDOPT_SUCCESS) << shardopt_last_error(nullptr);
  ASSERT_EQ(shardopt_create_mpi_f(&b, static_cast<int>(MPI_Comm_c2f(MPI_COMM_WORLD)), nullptr),
            SHARDOPT_SUCCESS) << shardopt_last_error(nullptr);
  for (shardopt_optimizer_t opt : {a, b}) {
    int rank = -1, size = -1;
    EXPECT_EQ(shardopt_comm_rank(opt, &rank), SHARDOPT_SUCCESS);
    EXPECT_EQ(shardopt_comm_size(opt, &size), SHARDOPT_SUCCESS);
    EXPECT_EQ(rank, world_rank());
    EXPECT_EQ(size, world_size());
  }
  EXPECT_EQ(shardopt_destroy(a), SHARDOPT_SUCCESS);
  EXPECT_EQ(shardopt_destroy(b), SHARDOPT_SUCCESS);
}

TEST(CApiMpi, BadConfigOnOneRankFailsEverywhere) {
  shardopt_config_t c;
  ASSERT_EQ(shardopt_config_init(&c), SHARDOPT_SUCCESS);
  if (world_rank() == world_size() - 1) c.struct_size = 1;
  shardopt_optimizer_t opt = nullptr;
  EXPECT_EQ(shardopt_create_mpi(&opt, MPI_COMM_WORLD, &c), SHARDOPT_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(opt, nullptr);
  const std::string msg = shardopt_last_error(nullptr);
  EXPECT_NE(msg.find("shardopt_create_mpi"), std::string::npos) << msg;
  EXPECT_NE(msg.find("struct_size"), std::string::npos) << msg;  // every rank learns why
}

TEST(CApiMpi, DifferentParametersAreALayoutMismatchOnEveryRank) {
  if (world_size() == 1) GTEST_SKIP() << "needs two ranks";
  shardopt_optimizer_t opt = nullptr;
  ASSERT_EQ(shardopt_create_mpi(&opt, MPI_COMM_WORLD, nullptr), SHARDOPT_SUCCESS);
  ASSERT_EQ(shardopt_add_param(opt, "w", world_rank() == 0 ? 10 : 11, 0, nullptr), SHARDOPT_SUCCESS);
  EXPECT_EQ(shardopt_finalize(opt), SHARDOPT_ERROR_LAYOUT_MISMATCH);
  EXPECT_NE(std::string(shardopt_last_error(opt)).find("shardopt_finalize"), std::string::npos);
  EXPECT_EQ(shardopt_destroy(opt), SHARDOPT_SUCCESS);
}

// The same training through the ABI and through the C++ API, on all ranks: equal weights.
void train_both(int stage, int dtype) {
  SCOPED_TRACE(testing::Message() << "stage " << stage << " dtype " << dtype);
  const int rank = world_rank();
  const std::size_t sizes[2] = {333, 70};
  shardopt_config_t c;
  ASSERT_EQ(shardopt_config_init(&c), SHARDOPT_SUCCESS);
  c.stage = stage;
  c.param_dtype = dtype;
  c.bucket_elems = 100;
  shardopt_optimizer_t opt = nullptr;
  ASSERT_EQ(shardopt_create_mpi(&opt, MPI_COMM_WORLD, &c), SHARDOPT_SUCCESS);
  shardopt::OptimizerOptions o;
  o.stage = static_cast<shardopt::Stage>(stage);
  o.param_dtype = static_cast<shardopt::DType>(dtype);
  o.bucket_elems = c.bucket_elems;
  shardopt::ShardedOptimizer ref(shardopt::make_mpi_communicator(MPI_COMM_WORLD), o);
  for (std::size_t p = 0; p < 2; ++p) {
    const std::string name = "p" + std::to_string(p);
    ASSERT_EQ(shardopt_add_param(opt, name.c_str(), sizes[p], 0, nullptr), SHARDOPT_SUCCESS);
    ref.add_param(name, sizes[p]);
  }
  ASSERT_EQ(shardopt_finalize(opt), SHARDOPT_SUCCESS);
  ref.finalize();
  for (std::size_t p = 0; p < 2; ++p) {
    std::vector<float> v(sizes[p]);
    for (std::size_t k = 0; k < v.size(); ++k) v[k] = shardopt::test::synth(0, 0, p, k);
    ASSERT_EQ(shardopt_set_param(opt, p, v.data(), v.size()), SHARDOPT_SUCCESS);
    ref.set_param(p, v);
  }
  for (int step = 0; step < 3; ++step) {
    for (std::size_t q = 2; q-- > 0;) {
      std::vector<float> g(sizes[q]);
      for (std::size_t k = 0; k < g.size(); ++k) g[k] = shardopt::test::synth(rank + 1, step, q, k);
      ASSERT_EQ(shardopt_accumulate_grad_f32(opt, q, g.data(), g.size()), SHARDOPT_SUCCESS);
      ref.accumulate_grad(q, std::span<const float>(g));
      ASSERT_EQ(shardopt_grad_ready(opt, q), SHARDOPT_SUCCESS);
      ref.grad_ready(q);
    }
    shardopt_step_result_t r = step_result();
    ASSERT_EQ(shardopt_step(opt, &r), SHARDOPT_SUCCESS);
    EXPECT_EQ(r.grad_norm, ref.step().grad_norm);
  }
  for (std::size_t p = 0; p < 2; ++p) {
    std::vector<float> a(sizes[p]), b(sizes[p]);
    ASSERT_EQ(shardopt_get_master(opt, p, a.data(), a.size()), SHARDOPT_SUCCESS);
    ref.get_master(p, b);
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << "param " << p;
  }
  ASSERT_EQ(shardopt_destroy(opt), SHARDOPT_SUCCESS);
}

TEST(CApiMpi, TrainingEqualsCppApi) {
  train_both(SHARDOPT_STAGE_ZERO1, SHARDOPT_DTYPE_BF16);
  train_both(SHARDOPT_STAGE_ZERO2, SHARDOPT_DTYPE_F32);
}

}  // namespace
