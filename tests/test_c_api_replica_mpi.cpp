// test_c_api_replica_mpi.cpp: the C ABI under mpiexec (issue 13). Replica pointers fetched
// once and kept read the new weights after every step, with the plain MPI and the
// shared-memory communicators, in eager mode and (after shardopt_wait_*) in lazy mode; the
// communicator kind of the config is the one built; m and v copies are gathered bit for bit;
// checkpoints reload at another rank count; arguments wrong on one rank fail every rank.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "shardopt/shardopt.h"
#include "support/mpi_world.hpp"
#include "support/reference.hpp"

namespace {

namespace fs = std::filesystem;
using shardopt::test::synth;

using shardopt::test::world_rank;
using shardopt::test::world_size;

shardopt_step_result_t step_result() {
  shardopt_step_result_t r;
  EXPECT_EQ(shardopt_step_result_init(&r), SHARDOPT_SUCCESS);
  return r;
}

const std::vector<std::size_t>& sizes() {
  static const std::vector<std::size_t> s{1000, 333, 4107, 65, 700};
  return s;
}

// A value that sums exactly over ranks and micro-batches: a multiple of 2^-12 in [-1, 1].
float exact(int a, int b, std::size_t p, std::size_t k) {
  return std::round(synth(a, b, p, k) * 4096.0f) / 4096.0f;
}

// An optimizer over MPI_COMM_WORLD with the parameters of sizes(), set to synth values.
shardopt_optimizer_t make(const shardopt_config_t& c) {
  shardopt_optimizer_t opt = nullptr;
  EXPECT_EQ(shardopt_create_mpi(&opt, MPI_COMM_WORLD, &c), SHARDOPT_SUCCESS) << shardopt_last_error(nullptr);
  if (opt == nullptr) return nullptr;
  for (std::size_t p = 0; p < sizes().size(); ++p) {
    const std::string name = "p" + std::to_string(p);
    EXPECT_EQ(shardopt_add_param(opt, name.c_str(), sizes()[p], 0, nullptr), SHARDOPT_SUCCESS);
  }
  EXPECT_EQ(shardopt_finalize(opt), SHARDOPT_SUCCESS) << shardopt_last_error(opt);
  for (std::size_t p = 0; p < sizes().size(); ++p) {
    std::vector<float> v(sizes()[p]);
    for (std::size_t k = 0; k < v.size(); ++k) v[k] = synth(0, 0, p, k);
    EXPECT_EQ(shardopt_set_param(opt, p, v.data(), v.size()), SHARDOPT_SUCCESS);
  }
  return opt;
}

// Gradients of one step, in backward order, each parameter marked ready.
void backward(shardopt_optimizer_t opt, int step) {
  for (std::size_t p = sizes().size(); p-- > 0;) {
    std::vector<float> g(sizes()[p]);
    for (std::size_t k = 0; k < g.size(); ++k) g[k] = exact(world_rank() + 1, step, p, k);
    ASSERT_EQ(shardopt_accumulate_grad_f32(opt, p, g.data(), g.size()), SHARDOPT_SUCCESS);
    ASSERT_EQ(shardopt_grad_ready(opt, p), SHARDOPT_SUCCESS);
  }
}

shardopt_config_t config(int stage, int dtype, int comm_kind, int gather_mode) {
  shardopt_config_t c;
  EXPECT_EQ(shardopt_config_init(&c), SHARDOPT_SUCCESS);
  c.stage = stage;
  c.param_dtype = dtype;
  c.comm_kind = comm_kind;
  c.gather_mode = gather_mode;
  c.bucket_elems = 512;  // many buckets: many gathers in flight after a step
  c.lr = 1e-2;
  return c;
}

// ---- kept pointers read the new values --------------------------------------------------------

// What the replica should hold for parameter p: its master rounded to the replica dtype, as
// bit patterns (fp32 bits or bf16 bits widened).
std::vector<std::uint32_t> expected_bits(shardopt_optimizer_t opt, int dtype, std::size_t p) {
  std::vector<float> m(sizes()[p]);
  EXPECT_EQ(shardopt_get_master(opt, p, m.data(), m.size()), SHARDOPT_SUCCESS);
  std::vector<std::uint32_t> out(m.size());
  for (std::size_t k = 0; k < m.size(); ++k) {
    if (dtype == SHARDOPT_DTYPE_BF16) {
      out[k] = shardopt_float_to_bf16(m[k]);
    } else {
      const float v = m[k] == 0.0f ? 0.0f : m[k];  // get_master's sum may turn -0 into +0
      std::memcpy(&out[k], &v, 4);
    }
  }
  return out;
}

// Reads n replica elements at `data` as bit patterns (no MPI call involved).
std::vector<std::uint32_t> read_bits(const void* data, int dtype, std::size_t n) {
  std::vector<std::uint32_t> out(n);
  for (std::size_t k = 0; k < n; ++k) {
    if (dtype == SHARDOPT_DTYPE_BF16) {
      out[k] = static_cast<const std::uint16_t*>(data)[k];
    } else {
      float v = static_cast<const float*>(data)[k];
      if (v == 0.0f) v = 0.0f;
      std::memcpy(&out[k], &v, 4);
    }
  }
  return out;
}

std::size_t mismatches(const std::vector<std::uint32_t>& a, const std::vector<std::uint32_t>& b) {
  std::size_t n = 0;
  for (std::size_t k = 0; k < a.size(); ++k) n += a[k] != b[k];
  return n;
}

void cached_pointers_read_new_values(int comm_kind, int gather_mode, int stage, int dtype) {
  SCOPED_TRACE(testing::Message() << "comm_kind " << comm_kind << " gather_mode " << gather_mode
                                  << " stage " << stage << " dtype " << dtype);
  shardopt_optimizer_t opt = make(config(stage, dtype, comm_kind, gather_mode));
  ASSERT_NE(opt, nullptr);
  const char* name = nullptr;
  ASSERT_EQ(shardopt_comm_name(opt, &name), SHARDOPT_SUCCESS);
  EXPECT_EQ(std::string(name).rfind(comm_kind == SHARDOPT_COMM_MPI ? "mpi" : "mpi-shm", 0), 0u) << name;
  // Fetched once, before training, and kept: as a trainer with pointers into shardopt does.
  std::vector<const void*> view(sizes().size());
  std::vector<std::size_t> offset(sizes().size());
  const void* base = nullptr;
  ASSERT_EQ(shardopt_replica(opt, &base, nullptr), SHARDOPT_SUCCESS);
  for (std::size_t p = 0; p < sizes().size(); ++p) {
    if (dtype == SHARDOPT_DTYPE_BF16)
      ASSERT_EQ(shardopt_param_bf16(opt, p, reinterpret_cast<const std::uint16_t**>(&view[p]), nullptr), SHARDOPT_SUCCESS);
    else
      ASSERT_EQ(shardopt_param_f32(opt, p, reinterpret_cast<const float**>(&view[p]), nullptr), SHARDOPT_SUCCESS);
    ASSERT_EQ(shardopt_param_offset(opt, p, &offset[p]), SHARDOPT_SUCCESS);
  }
  const std::size_t elem = dtype == SHARDOPT_DTYPE_BF16 ? 2 : 4;
  for (int step = 0; step < 4; ++step) {
    backward(opt, step);
    shardopt_step_result_t r = step_result();
    ASSERT_EQ(shardopt_step(opt, &r), SHARDOPT_SUCCESS) << shardopt_last_error(opt);
    ASSERT_EQ(r.skipped, 0);
    if (gather_mode == SHARDOPT_GATHER_LAZY) {
      // The documented wait, alternating the per-parameter and the all form.
      if (step % 2 == 0) {
        for (std::size_t p = 0; p < sizes().size(); ++p) ASSERT_EQ(shardopt_wait_param(opt, p), SHARDOPT_SUCCESS);
      } else {
        ASSERT_EQ(shardopt_wait_all(opt), SHARDOPT_SUCCESS);
      }
    }
    // Read through the kept pointers before any other MPI call could complete a gather.
    std::vector<std::vector<std::uint32_t>> seen, seen_flat;
    for (std::size_t p = 0; p < sizes().size(); ++p) {
      seen.push_back(read_bits(view[p], dtype, sizes()[p]));
      seen_flat.push_back(read_bits(static_cast<const char*>(base) + offset[p] * elem, dtype, sizes()[p]));
    }
    for (std::size_t p = 0; p < sizes().size(); ++p) {
      const std::vector<std::uint32_t> want = expected_bits(opt, dtype, p);
      EXPECT_EQ(mismatches(seen[p], want), 0u) << "stale elements of parameter " << p << " after step " << step;
      EXPECT_EQ(mismatches(seen_flat[p], want), 0u) << "through the flat base, parameter " << p;
    }
  }
  ASSERT_EQ(shardopt_destroy(opt), SHARDOPT_SUCCESS);
}

TEST(CApiReplicaMpi, KeptPointersReadNewValuesPlainMpi) {
  for (int mode : {SHARDOPT_GATHER_EAGER, SHARDOPT_GATHER_LAZY})
    for (int stage : {SHARDOPT_STAGE_ZERO1, SHARDOPT_STAGE_ZERO2})
      for (int dtype : {SHARDOPT_DTYPE_F32, SHARDOPT_DTYPE_BF16})
        cached_pointers_read_new_values(SHARDOPT_COMM_MPI, mode, stage, dtype);
}

TEST(CApiReplicaMpi, KeptPointersReadNewValuesSharedMemory) {
  for (int mode : {SHARDOPT_GATHER_EAGER, SHARDOPT_GATHER_LAZY})
    for (int stage : {SHARDOPT_STAGE_ZERO1, SHARDOPT_STAGE_ZERO2})
      for (int dtype : {SHARDOPT_DTYPE_F32, SHARDOPT_DTYPE_BF16})
        cached_pointers_read_new_values(SHARDOPT_COMM_SHM, mode, stage, dtype);
}

// ---- the config's communicator is the one built -----------------------------------------------

TEST(CApiReplicaMpi, CommKindSelectsTheCommunicator) {
  struct Case {
    int kind, simulate;
    std::string want;
  };
  std::vector<Case> cases{{SHARDOPT_COMM_MPI, 0, "mpi"}, {SHARDOPT_COMM_SHM, 0, "mpi-shm"}};
  if (world_size() >= 2)
    cases.push_back({SHARDOPT_COMM_SHM, 2, "mpi-shm-hierarchical(2 nodes)"});
  if (std::getenv("SHARDOPT_COMM") == nullptr && std::getenv("SHARDOPT_SIMULATE_NODES") == nullptr)
    cases.push_back({SHARDOPT_COMM_AUTO, 0, world_size() == 1 ? "mpi" : "mpi-shm"});
  for (const Case& k : cases) {
    shardopt_config_t c = config(SHARDOPT_STAGE_ZERO1, SHARDOPT_DTYPE_F32, k.kind, SHARDOPT_GATHER_EAGER);
    c.comm_simulate_nodes = k.simulate;
    shardopt_optimizer_t opt = nullptr;
    ASSERT_EQ(shardopt_create_mpi(&opt, MPI_COMM_WORLD, &c), SHARDOPT_SUCCESS) << shardopt_last_error(nullptr);
    const char* name = nullptr;
    ASSERT_EQ(shardopt_comm_name(opt, &name), SHARDOPT_SUCCESS);
    EXPECT_EQ(std::string(name), k.want);
    shardopt_config_t got;
    ASSERT_EQ(shardopt_config_init(&got), SHARDOPT_SUCCESS);
    ASSERT_EQ(shardopt_get_config(opt, &got), SHARDOPT_SUCCESS);
    EXPECT_EQ(got.comm_kind, k.kind);
    EXPECT_EQ(got.comm_simulate_nodes, k.simulate);
    ASSERT_EQ(shardopt_destroy(opt), SHARDOPT_SUCCESS);
  }
}

// ---- arguments that differ on one rank fail every rank ----------------------------------------

TEST(CApiReplicaMpi, OneRanksBadArgumentFailsEveryRank) {
  const bool odd_one = world_rank() == world_size() - 1;
  shardopt_config_t c = config(SHARDOPT_STAGE_ZERO2, SHARDOPT_DTYPE_F32, SHARDOPT_COMM_MPI, SHARDOPT_GATHER_EAGER);
  shardopt_optimizer_t opt = nullptr;
  {
    shardopt_config_t bad = c;
    if (odd_one) bad.gather_mode = 9;
    EXPECT_EQ(shardopt_create_mpi(&opt, MPI_COMM_WORLD, &bad), SHARDOPT_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(shardopt_last_error(nullptr)).find("gather_mode"), std::string::npos);
  }
  if (world_size() > 1) {
    shardopt_config_t other = c;
    if (odd_one) other.comm_kind = SHARDOPT_COMM_SHM;
    EXPECT_EQ(shardopt_create_mpi(&opt, MPI_COMM_WORLD, &other), SHARDOPT_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(shardopt_last_error(nullptr)).find("different communicators"), std::string::npos)
        << shardopt_last_error(nullptr);
  }
  opt = make(c);
  ASSERT_NE(opt, nullptr);
  backward(opt, 0);
  ASSERT_EQ(shardopt_step(opt, nullptr), SHARDOPT_SUCCESS);
  std::vector<float> buf(sizes()[1]);
  EXPECT_EQ(shardopt_get_exp_avg(opt, 1, buf.data(), odd_one ? 3 : buf.size()), SHARDOPT_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(shardopt_get_exp_avg_sq(opt, odd_one ? 99 : 1, buf.data(), buf.size()), SHARDOPT_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(shardopt_get_master(opt, 1, odd_one ? nullptr : buf.data(), buf.size()), SHARDOPT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(shardopt_last_error(opt)).find("out is NULL"), std::string::npos) << shardopt_last_error(opt);
  EXPECT_EQ(shardopt_save_checkpoint(opt, odd_one ? nullptr : "/nonexistent-never-written", 2, nullptr),
            SHARDOPT_ERROR_INVALID_ARGUMENT);
  // Still in step with each other: a collective works.
  EXPECT_EQ(shardopt_get_exp_avg(opt, 1, buf.data(), buf.size()), SHARDOPT_SUCCESS);
  ASSERT_EQ(shardopt_destroy(opt), SHARDOPT_SUCCESS);
}

// ---- m and v: gathered bit for bit ----------------------------------------------------------------

// With exactly summable gradients and no clipping every stage computes the same update, so
// stage 0 (every rank holds all the state: a local copy) is the oracle of the gathered copy
// at stages 1 and 2.
TEST(CApiReplicaMpi, MomentsGatheredEqualTheUnshardedOnes) {
  std::vector<std::vector<std::vector<float>>> state[3];  // [stage][array][param] flattened below
  for (int stage = 0; stage <= 2; ++stage) {
    shardopt_optimizer_t opt = make(config(stage, SHARDOPT_DTYPE_BF16, SHARDOPT_COMM_AUTO, SHARDOPT_GATHER_EAGER));
    ASSERT_NE(opt, nullptr);
    for (int s = 0; s < 3; ++s) {
      backward(opt, s);
      ASSERT_EQ(shardopt_step(opt, nullptr), SHARDOPT_SUCCESS);
    }
    state[stage].resize(2);
    for (std::size_t p = 0; p < sizes().size(); ++p) {
      std::vector<float> m(sizes()[p]), v(sizes()[p]);
      ASSERT_EQ(shardopt_get_exp_avg(opt, p, m.data(), m.size()), SHARDOPT_SUCCESS) << shardopt_last_error(opt);
      ASSERT_EQ(shardopt_get_exp_avg_sq(opt, p, v.data(), v.size()), SHARDOPT_SUCCESS);
      state[stage][0].push_back(m);
      state[stage][1].push_back(v);
    }
    ASSERT_EQ(shardopt_destroy(opt), SHARDOPT_SUCCESS);
  }
  for (int stage = 1; stage <= 2; ++stage)
    for (int a = 0; a < 2; ++a)
      for (std::size_t p = 0; p < sizes().size(); ++p)
        EXPECT_EQ(std::memcmp(state[stage][a][p].data(), state[0][a][p].data(), sizes()[p] * 4), 0)
            << "stage " << stage << (a == 0 ? " exp_avg" : " exp_avg_sq") << " of parameter " << p;
  // Sanity of the oracle: after three steps m is not all zero.
  bool nonzero = false;
  for (float x : state[0][0][2]) nonzero = nonzero || x != 0.0f;
  EXPECT_TRUE(nonzero);
}

// ---- get_master returns the master bit for bit --------------------------------------------------

// get_master gathers the owners' pieces: a sum over ranks would return -0.0 as +0.0 and quiet
// signalling NaNs at 2 or more ranks in stages 1 and 2.
TEST(CApiReplicaMpi, GetMasterRoundTripsSpecialValuesBitForBit) {
  const std::uint32_t specials[] = {
      0x00000000u, 0x80000000u,                             // +0, -0
      0x00000001u, 0x80000001u, 0x007FFFFFu, 0x807FFFFFu,   // subnormals
      0x00800000u, 0x7F7FFFFFu, 0xFF7FFFFFu,                // min normal, +-max
      0x7F800000u, 0xFF800000u,                             // +-inf
      0x7F800001u, 0x7FBFFFFFu, 0xFF800001u, 0xFFA5A5A5u,   // signalling NaNs with payloads
      0x7FC00000u, 0x7FC00001u, 0xFFC12345u, 0x7FFFFFFFu,   // quiet NaNs with payloads
      0x3F800000u, 0xBF800000u};
  const std::size_t n = sizeof specials / sizeof specials[0];
  for (int stage = 0; stage <= 2; ++stage) {
    for (int dtype : {SHARDOPT_DTYPE_F32, SHARDOPT_DTYPE_BF16}) {
      shardopt_optimizer_t opt = make(config(stage, dtype, SHARDOPT_COMM_AUTO, SHARDOPT_GATHER_EAGER));
      ASSERT_NE(opt, nullptr);
      for (std::size_t p = 0; p < sizes().size(); ++p) {
        std::vector<std::uint32_t> bits(sizes()[p]);
        for (std::size_t k = 0; k < bits.size(); ++k) bits[k] = specials[(k * 5 + p) % n];
        std::vector<float> in(bits.size()), out(bits.size());
        std::memcpy(in.data(), bits.data(), bits.size() * 4);
        ASSERT_EQ(shardopt_set_param(opt, p, in.data(), in.size()), SHARDOPT_SUCCESS);
        ASSERT_EQ(shardopt_get_master(opt, p, out.data(), out.size()), SHARDOPT_SUCCESS);
        std::size_t differ = 0;
        char first[96] = "";
        for (std::size_t k = 0; k < bits.size(); ++k) {
          std::uint32_t got = 0;
          std::memcpy(&got, &out[k], 4);
          if (got != bits[k] && differ++ == 0)
            std::snprintf(first, sizeof first, "first: element %zu 0x%08x came back 0x%08x", k,
                          static_cast<unsigned>(bits[k]), static_cast<unsigned>(got));
        }
        EXPECT_EQ(differ, 0u) << "stage " << stage << " dtype " << dtype << " parameter " << p
                              << ": elements whose bits changed; " << first;
      }
      ASSERT_EQ(shardopt_destroy(opt), SHARDOPT_SUCCESS);
    }
  }
}

// ---- checkpoints: save at N ranks, load at fewer ------------------------------------------------

// A directory every rank names the same, removed at the end.
struct SharedDir {
  fs::path path;
  SharedDir() {
    char buf[256] = {};
    if (world_rank() == 0) {
      const std::string p = (fs::temp_directory_path() /
                             ("shardopt_c_api_mpi_" + std::to_string(::getpid()))).string();
      std::strncpy(buf, p.c_str(), sizeof buf - 1);
      fs::remove_all(p);
    }
    MPI_Bcast(buf, sizeof buf, MPI_CHAR, 0, MPI_COMM_WORLD);
    path = buf;
  }
  ~SharedDir() {
    MPI_Barrier(MPI_COMM_WORLD);
    if (world_rank() == 0) fs::remove_all(path);
  }
};

TEST(CApiReplicaMpi, CheckpointReloadsAtAnotherRankCount) {
  SharedDir dir;
  shardopt_optimizer_t opt = make(config(SHARDOPT_STAGE_ZERO2, SHARDOPT_DTYPE_BF16, SHARDOPT_COMM_AUTO, SHARDOPT_GATHER_EAGER));
  ASSERT_NE(opt, nullptr);
  for (int s = 0; s < 2; ++s) {
    backward(opt, s);
    ASSERT_EQ(shardopt_step(opt, nullptr), SHARDOPT_SUCCESS);
  }
  const char* published_c = nullptr;
  ASSERT_EQ(shardopt_save_checkpoint(opt, dir.path.c_str(), 2, &published_c), SHARDOPT_SUCCESS) << shardopt_last_error(opt);
  const std::string published = published_c;  // owned by the handle: copied before destroy
  std::vector<std::vector<float>> saved[3];
  for (std::size_t p = 0; p < sizes().size(); ++p) {
    std::vector<float> buf(sizes()[p]);
    ASSERT_EQ(shardopt_get_master(opt, p, buf.data(), buf.size()), SHARDOPT_SUCCESS);
    saved[0].push_back(buf);
    ASSERT_EQ(shardopt_get_exp_avg(opt, p, buf.data(), buf.size()), SHARDOPT_SUCCESS);
    saved[1].push_back(buf);
    ASSERT_EQ(shardopt_get_exp_avg_sq(opt, p, buf.data(), buf.size()), SHARDOPT_SUCCESS);
    saved[2].push_back(buf);
  }
  ASSERT_EQ(shardopt_destroy(opt), SHARDOPT_SUCCESS);

  // Ranks [0, k) load it at stage 1 over their own communicator, for k = 1 and N - 1.
  for (int k : {1, world_size() - 1}) {
    if (k < 1) continue;
    MPI_Comm sub = MPI_COMM_NULL;
    MPI_Comm_split(MPI_COMM_WORLD, world_rank() < k ? 0 : MPI_UNDEFINED, world_rank(), &sub);
    if (sub != MPI_COMM_NULL) {
      shardopt_config_t c = config(SHARDOPT_STAGE_ZERO1, SHARDOPT_DTYPE_BF16, SHARDOPT_COMM_MPI, SHARDOPT_GATHER_EAGER);
      shardopt_optimizer_t other = nullptr;
      ASSERT_EQ(shardopt_create_mpi(&other, sub, &c), SHARDOPT_SUCCESS);
      for (std::size_t p = 0; p < sizes().size(); ++p)
        ASSERT_EQ(shardopt_add_param(other, ("p" + std::to_string(p)).c_str(), sizes()[p], 0, nullptr), SHARDOPT_SUCCESS);
      ASSERT_EQ(shardopt_finalize(other), SHARDOPT_SUCCESS);
      ASSERT_EQ(shardopt_load_checkpoint(other, dir.path.c_str()), SHARDOPT_SUCCESS) << shardopt_last_error(other);
      int64_t steps = 0;
      ASSERT_EQ(shardopt_step_count(other, &steps), SHARDOPT_SUCCESS);
      EXPECT_EQ(steps, 2);
      for (std::size_t p = 0; p < sizes().size(); ++p) {
        std::vector<float> buf(sizes()[p]);
        ASSERT_EQ(shardopt_get_master(other, p, buf.data(), buf.size()), SHARDOPT_SUCCESS);
        EXPECT_EQ(buf, saved[0][p]) << "master of " << p << " at " << k << " ranks";
        ASSERT_EQ(shardopt_get_exp_avg(other, p, buf.data(), buf.size()), SHARDOPT_SUCCESS);
        EXPECT_EQ(std::memcmp(buf.data(), saved[1][p].data(), buf.size() * 4), 0) << "m of " << p;
        ASSERT_EQ(shardopt_get_exp_avg_sq(other, p, buf.data(), buf.size()), SHARDOPT_SUCCESS);
        EXPECT_EQ(std::memcmp(buf.data(), saved[2][p].data(), buf.size() * 4), 0) << "v of " << p;
      }
      ASSERT_EQ(shardopt_destroy(other), SHARDOPT_SUCCESS);
      MPI_Comm_free(&sub);
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }

  // Missing and corrupted checkpoints fail on every rank with IO / CORRUPT_DATA.
  opt = make(config(SHARDOPT_STAGE_ZERO2, SHARDOPT_DTYPE_BF16, SHARDOPT_COMM_AUTO, SHARDOPT_GATHER_EAGER));
  ASSERT_NE(opt, nullptr);
  EXPECT_EQ(shardopt_load_checkpoint(opt, (dir.path / "missing").c_str()), SHARDOPT_ERROR_IO);
  if (world_rank() == 0) {
    const fs::path meta = fs::path(dir.path) / fs::path(published).filename() / "metadata.bin";
    fs::resize_file(meta, fs::file_size(meta) - 1);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  EXPECT_EQ(shardopt_load_checkpoint(opt, dir.path.c_str()), SHARDOPT_ERROR_CORRUPT_DATA)
      << shardopt_last_error(opt);
  int64_t steps = -1;
  ASSERT_EQ(shardopt_step_count(opt, &steps), SHARDOPT_SUCCESS);
  EXPECT_EQ(steps, 0);  // unchanged
  ASSERT_EQ(shardopt_destroy(opt), SHARDOPT_SUCCESS);
}

}  // namespace
