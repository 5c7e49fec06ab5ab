// test_checkpoint_reshard.cpp: a checkpoint saved at N ranks loads at M ranks, for every
// N, M in 1..4 over the runs at 1-4 ranks (N -> W and W -> M for the launched world size W),
// with the state bit-identical in every stage it is loaded into (saved in one stage, loaded
// in all three), training continues bit for bit as without the restart, and shardopt-export
// writes the consolidated master weights. Sub-communicators of MPI_COMM_WORLD play the runs
// of different sizes.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "shardopt/checkpoint.hpp"
#include "shardopt/mpi_comm.hpp"
#include "checkpoint/files.hpp"
#include "checkpoint/format.hpp"
#include "rules/qmap.hpp"
#include "support/ckpt_model.hpp"
#include "support/mpi_sub.hpp"
#include "support/world.hpp"

using namespace shardopt;
namespace fs = std::filesystem;

namespace {

fs::path shared_temp_dir(Communicator& world) {
  char name[256] = {};
  if (world.rank() == 0) {
    std::string tmpl = (fs::temp_directory_path() / "shardopt-reshard-XXXXXX").string();
    if (!mkdtemp(tmpl.data())) std::abort();
    std::snprintf(name, sizeof name, "%s", tmpl.c_str());
  }
  world.broadcast_bytes(name, sizeof name, 0);
  return name;
}

// The safetensors file shardopt-export wrote: header JSON and fp32 data.
struct SafeTensors {
  std::string header;
  std::vector<float> data;
};
SafeTensors read_safetensors(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::uint64_t n = 0;
  f.read(reinterpret_cast<char*>(&n), 8);
  SafeTensors s;
  s.header.resize(n);
  f.read(s.header.data(), static_cast<std::streamsize>(n));
  std::vector<char> rest((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  s.data.resize(rest.size() / 4);
  std::memcpy(s.data.data(), rest.data(), s.data.size() * 4);
  return s;
}

void check_export(const fs::path& dir, const test::FullState& expect, int saved_at) {
  const fs::path out = dir / "consolidated.safetensors";
  const std::string cmd = std::string(SHARDOPT_EXPORT_EXE) + " '" + dir.string() + "' '" +
                          out.string() + "' > /dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const SafeTensors st = read_safetensors(out);
  ASSERT_EQ(st.data.size(), expect.arrays[0].size());
  EXPECT_EQ(std::memcmp(st.data.data(), expect.arrays[0].data(), st.data.size() * 4), 0)
      << "exported weights differ from the master (saved at " << saved_at << " ranks)";
  EXPECT_NE(st.header.find("\"layer2.weight\":{\"dtype\":\"F32\",\"shape\":[4097]"),
            std::string::npos) << st.header;
  EXPECT_EQ(st.header.size() % 8, 0u);
  fs::remove(out);
}

struct Case {
  Stage stage;
  DType dtype;
  Rule rule1 = Rule::AdamW;  // group 1's rule
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << stage_name(c.stage) << "/" << dtype_name(c.dtype) << "/" << rule_name(c.rule1);
}

class Reshard : public testing::TestWithParam<Case> {};

}  // namespace

TEST_P(Reshard, StateIsBitIdenticalAtAnyWorldSize) {
  auto world = test::world();
  const int W = world->size();
  const Case c = GetParam();
  test::CkptSetup setup{c.stage, c.dtype, {}, c.rule1};
  std::vector<std::pair<int, int>> pairs;
  for (int n = 1; n <= W; ++n)
    for (int m = 1; m <= W; ++m)
      if (n == W || m == W) pairs.emplace_back(n, m);
  for (auto [n, m] : pairs) {
    SCOPED_TRACE("saved at " + std::to_string(n) + " ranks, loaded at " + std::to_string(m));
    const fs::path dir = shared_temp_dir(*world);
    auto at_n = test::first_world_ranks(n);
    auto at_m = test::first_world_ranks(m);

    // Run A at n ranks: 3 steps, save, then 2 more steps without a restart.
    test::FullState saved, continued;
    std::unique_ptr<ShardedOptimizer> a;
    if (at_n) {
      a = test::make_ckpt_optimizer(at_n, setup);
      for (int s = 1; s <= 3; ++s) test::ckpt_train_step(*a, s);
      save_checkpoint(*a, dir);
      saved = test::gather_state(*a);
      for (int s = 4; s <= 5; ++s) test::ckpt_train_step(*a, s);
      continued = test::gather_state(*a);
    }
    test::broadcast_state(*world, saved);
    test::broadcast_state(*world, continued);
    if (world->rank() == 0 && n == W) check_export(dir, saved, n);

    // Run B at m ranks: load, compare, continue the same 2 steps.
    if (at_m) {
      auto b = test::make_ckpt_optimizer(at_m, setup);
      load_checkpoint(*b, dir);
      EXPECT_TRUE(test::gather_state(*b) == saved);
      if (c.rule1 == Rule::AdamW8bit) {  // the raw 8-bit state came back, byte for byte
        EXPECT_EQ(b->rule_of(1), Rule::AdamW8bit);
        EXPECT_EQ(b->rule_of(5), Rule::AdamW);
        EXPECT_EQ(saved.scales[0].size(), 3u);  // 300 (a partial block) and 64 elements
        EXPECT_NE(saved.codes[0], std::vector<std::uint8_t>(saved.codes[0].size(), 0));
      }
      for (int s = 4; s <= 5; ++s) test::ckpt_train_step(*b, s);
      const test::FullState after = test::gather_state(*b);
      // Averages over 1 to 4 identical gradients are exact (at 3 ranks too: ckpt_model.hpp,
      // ckpt_train_step): the same bits.
      EXPECT_TRUE(after == continued);
      EXPECT_EQ(after.step, 5);
      // Loaded into the other stages: the same bits.
      for (Stage other : {Stage::DataParallel, Stage::Zero1, Stage::Zero2}) {
        if (other == c.stage) continue;
        test::CkptSetup s2 = setup;
        s2.stage = other;
        auto o = test::make_ckpt_optimizer(at_m, s2);
        load_checkpoint(*o, dir);
        EXPECT_TRUE(test::gather_state(*o) == saved) << "loaded in stage " << stage_name(other);
      }
    }
    world->barrier();
    if (world->rank() == 0) fs::remove_all(dir);
  }
}

INSTANTIATE_TEST_SUITE_P(Stages, Reshard,
                         testing::Values(Case{Stage::Zero1, DType::BF16},
                                         Case{Stage::Zero2, DType::BF16},
                                         Case{Stage::DataParallel, DType::BF16},
                                         Case{Stage::Zero1, DType::F32},
                                         Case{Stage::Zero2, DType::BF16, Rule::Lion},
                                         Case{Stage::Zero1, DType::BF16, Rule::AdamW8bit},
                                         Case{Stage::Zero2, DType::F32, Rule::AdamW8bit}),
                         [](const testing::TestParamInfo<Case>& i) {
                           const char* stage = i.param.stage == Stage::DataParallel ? "dp"
                                               : i.param.stage == Stage::Zero1      ? "zero1"
                                                                                    : "zero2";
                           return std::string(stage) + "_" + dtype_name(i.param.dtype) +
                                  (i.param.rule1 == Rule::Lion        ? "_lion"
                                   : i.param.rule1 == Rule::AdamW8bit ? "_adamw8bit"
                                                                      : "");
                         });

TEST(Export, CorruptCheckpointFailsWithoutOutput) {
  auto world = test::world();
  if (world->rank() != 0) return;
  const fs::path dir = fs::temp_directory_path() / ("shardopt-export-bad-" + std::to_string(getpid()));
  fs::create_directories(dir / "ckpt-00000001");
  std::ofstream(dir / "ckpt-00000001" / "metadata.bin") << "not a checkpoint";
  std::ofstream(dir / "LATEST") << "ckpt-00000001\n";
  const fs::path out = dir / "out.safetensors";
  const std::string cmd = std::string(SHARDOPT_EXPORT_EXE) + " '" + dir.string() + "' '" +
                          out.string() + "' 2> /dev/null";
  EXPECT_NE(std::system(cmd.c_str()), 0);
  EXPECT_FALSE(fs::exists(out));
  fs::remove_all(dir);
}

// A parameter whose rule changed cannot take the saved state: every rank gets the same
// error naming it, and the optimizer keeps its own state.
TEST(Reshard, ChangedRuleIsAClearErrorNamingTheParameter) {
  auto world = test::world();
  const fs::path dir = shared_temp_dir(*world);
  test::CkptSetup lion{Stage::Zero1, DType::BF16, {}, Rule::Lion};
  auto a = test::make_ckpt_optimizer(world, lion);
  test::ckpt_train_step(*a, 1);
  save_checkpoint(*a, dir);
  test::CkptSetup adamw = lion;
  adamw.rule1 = Rule::AdamW;
  auto b = test::make_ckpt_optimizer(world, adamw);
  test::ckpt_train_step(*b, 1);
  const test::FullState before = test::gather_state(*b);
  try {
    load_checkpoint(*b, dir);
    ADD_FAILURE() << "loaded a Lion checkpoint into AdamW groups";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::LayoutMismatch) << e.what();
    EXPECT_NE(std::string(e.what()).find("parameter 'layer1.weight' (group 1) was saved under "
                                         "rule Lion, the optimizer updates it with AdamW"),
              std::string::npos) << e.what();
  }
  EXPECT_TRUE(test::gather_state(*b) == before);
  world->barrier();
  if (world->rank() == 0) fs::remove_all(dir);
}

// min_8bit_numel decides which parameters keep 8-bit state: a checkpoint whose parameter kept
// 8-bit state does not load where that parameter is fp32, and the message names it.
TEST(Reshard, ChangedEightBitThresholdIsAClearErrorNamingTheParameter) {
  auto world = test::world();
  const fs::path dir = shared_temp_dir(*world);
  test::CkptSetup q8{Stage::Zero1, DType::BF16, {}, Rule::AdamW8bit};
  auto a = test::make_ckpt_optimizer(world, q8);
  test::ckpt_train_step(*a, 1);
  save_checkpoint(*a, dir);
  test::CkptSetup fewer = q8;
  fewer.min_8bit_numel = 100;  // parameter 3 (64 elements) becomes fp32
  auto b = test::make_ckpt_optimizer(world, fewer);
  const test::FullState before = test::gather_state(*b);
  try {
    load_checkpoint(*b, dir);
    ADD_FAILURE() << "loaded 8-bit state into an fp32 parameter";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::LayoutMismatch) << e.what();
    EXPECT_NE(std::string(e.what()).find("parameter 'layer3.weight' (group 1) was saved under "
                                         "rule AdamW8bit, the optimizer updates it with AdamW"),
              std::string::npos) << e.what();
  }
  EXPECT_TRUE(test::gather_state(*b) == before);
  world->barrier();
  if (world->rank() == 0) fs::remove_all(dir);
}

// 8-bit codes index the quantization maps: a checkpoint that names other maps (by their
// checksums) is refused on every rank, and the optimizer keeps its state.
TEST(Reshard, OtherQuantizationMapsAreRefused) {
  auto world = test::world();
  const fs::path dir = shared_temp_dir(*world);
  test::CkptSetup q8{Stage::Zero2, DType::BF16, {}, Rule::AdamW8bit};
  auto a = test::make_ckpt_optimizer(world, q8);
  test::ckpt_train_step(*a, 1);
  const fs::path ck = save_checkpoint(*a, dir);
  if (world->rank() == 0) {  // the same checkpoint, its metadata naming other maps
    const auto bytes = ckpt::read_whole_file(ck / ckpt::kMetadataFile, 1 << 24);
    ckpt::Metadata m = ckpt::decode_metadata(bytes);
    EXPECT_TRUE(m.has_qmap_checksums);
    EXPECT_EQ(m.qmap_checksum[0], rules::q8::kSignedChecksum);
    EXPECT_EQ(m.qmap_checksum[1], rules::q8::kUnsignedChecksum);
    m.qmap_checksum[1] ^= 1;
    const auto out = ckpt::encode_metadata(m);
    std::ofstream(ck / ckpt::kMetadataFile, std::ios::binary | std::ios::trunc)
        .write(reinterpret_cast<const char*>(out.data()), static_cast<std::streamsize>(out.size()));
  }
  world->barrier();
  auto b = test::make_ckpt_optimizer(world, q8);
  const test::FullState before = test::gather_state(*b);
  try {
    load_checkpoint(*b, ck);
    ADD_FAILURE() << "loaded codes of other maps";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::LayoutMismatch) << e.what();
    EXPECT_NE(std::string(e.what()).find("quantization maps with checksums"), std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(test::gather_state(*b) == before);
  world->barrier();
  if (world->rank() == 0) fs::remove_all(dir);
}
