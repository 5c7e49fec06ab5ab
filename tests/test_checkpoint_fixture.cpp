// test_checkpoint_fixture.cpp: checkpoints users already have still load. The committed
// format-1 to -6 checkpoints (tests/data/ckpt_v1 to v6, all saved at 2 ranks
// from the same state) load at this run's world size (1 without MPI, 1-4 under mpiexec) in
// every stage, bit for bit equal to the state they were saved from, with their
// hyperparameters and loss-scaling state; saved again (current format) they load again
// unchanged; shardopt-export reads them; a corrupted copy is refused.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "checkpoint/files.hpp"
#include "checkpoint/format.hpp"
#include "checkpoint/reader.hpp"
#include "shardopt/bf16.hpp"
#include "shardopt/checkpoint.hpp"
#include "support/ckpt_model.hpp"
#include "support/world.hpp"

using namespace shardopt;
namespace fs = std::filesystem;

namespace {

const fs::path kFixture = fs::path(SHARDOPT_TEST_DATA) / "ckpt_v1";
// Every committed fixture: a checkpoint of each older format version.
const std::vector<fs::path> kFixtures = {kFixture, fs::path(SHARDOPT_TEST_DATA) / "ckpt_v2",
                                         fs::path(SHARDOPT_TEST_DATA) / "ckpt_v3",
                                         fs::path(SHARDOPT_TEST_DATA) / "ckpt_v4",
                                         fs::path(SHARDOPT_TEST_DATA) / "ckpt_v5",
                                         fs::path(SHARDOPT_TEST_DATA) / "ckpt_v6"};

// expected.bin: master, exp_avg, exp_avg_sq per parameter, unpadded (see tests/data/README.md).
test::FullState expected_state(const fs::path& fixture = kFixture) {
  const std::vector<unsigned char> raw = ckpt::read_whole_file(fixture / "expected.bin", 1 << 20);
  std::size_t total = 0;
  for (std::size_t n : test::fixture_sizes()) total += n;
  EXPECT_EQ(raw.size(), 3 * total * sizeof(float));
  test::FullState st;
  st.step = 3;
  for (int a = 0; a < 3; ++a) {
    st.arrays[a].resize(total);
    std::memcpy(st.arrays[a].data(), raw.data() + a * total * sizeof(float), total * sizeof(float));
  }
  return st;
}

void expect_fixture_restored(ShardedOptimizer& opt, const test::FullState& want) {
  EXPECT_TRUE(test::gather_state(opt) == want);
  EXPECT_EQ(opt.step_count(), 3);
  EXPECT_EQ(opt.lr(), 3e-3);
  EXPECT_EQ(opt.options().adam.weight_decay, 0.05);
  EXPECT_EQ(opt.groups()[1].lr_scale, 0.25);
  EXPECT_FALSE(opt.groups()[1].weight_decay);
  EXPECT_EQ(opt.loss_scale_state().scale, 8192.0);
  EXPECT_EQ(opt.loss_scale_state().good_steps, 1);
  EXPECT_EQ(opt.loss_scale_state().skipped_steps, 4);
  // The replica was rebuilt from the loaded master.
  std::size_t at = 0;
  for (std::size_t i = 0; i < opt.layout().num_params(); ++i) {
    const std::span<bf16> p = opt.param<bf16>(i);
    for (std::size_t k = 0; k < p.size(); ++k)
      ASSERT_EQ(p[k].bits, float_to_bf16_bits(want.arrays[0][at + k])) << "parameter " << i << " element " << k;
    at += p.size();
  }
}

class Fixture : public testing::TestWithParam<Stage> {};

}  // namespace

TEST(FixtureFiles, AreFormatOneSavedAtTwoRanks) {
  const ckpt::Metadata m = ckpt::read_metadata(kFixture / "save" / "ckpt-00000001");
  EXPECT_EQ(m.version, 1u);
  EXPECT_EQ(m.world_size, 2u);
  ASSERT_EQ(m.params.size(), test::fixture_sizes().size());
  // Parameter 2 straddles the two shards: a real reshard, not a per-shard copy.
  const ckpt::MetaParam& p2 = m.params[2];
  EXPECT_LT(p2.offset, m.shards[0].flat_end);
  EXPECT_GT(p2.offset + p2.numel, m.shards[1].flat_begin);
}

TEST(FixtureFiles, FormatTwoIsSavedAtTwoRanksWithoutASequenceNumber) {
  const ckpt::Metadata m = ckpt::read_metadata(kFixtures[1] / "save" / "ckpt-00000001");
  EXPECT_EQ(m.version, 2u);
  EXPECT_EQ(m.world_size, 2u);
  EXPECT_EQ(m.sequence, 0u);  // format 3 added it; a format-2 checkpoint loads without
}

TEST(FixtureFiles, FormatThreeHasASequenceNumberAndAdamWGroups) {
  const ckpt::Metadata m = ckpt::read_metadata(kFixtures[2] / "save" / "ckpt-00000001");
  EXPECT_EQ(m.version, 3u);
  EXPECT_EQ(m.world_size, 2u);
  EXPECT_EQ(m.sequence, 1u);
  ASSERT_EQ(m.groups.size(), 2u);
  for (const GroupOptions& g : m.groups) EXPECT_EQ(g.rule, Rule::AdamW);  // format 4 added rules
  EXPECT_EQ(m.groups[1].lr_scale, 0.25);
}

TEST(FixtureFiles, FormatFourHasRulesButNoQuantizationFields) {
  const ckpt::Metadata m = ckpt::read_metadata(kFixtures[3] / "save" / "ckpt-00000001");
  EXPECT_EQ(m.version, 4u);
  EXPECT_EQ(m.world_size, 2u);
  ASSERT_EQ(m.groups.size(), 2u);
  for (const GroupOptions& g : m.groups) {
    EXPECT_EQ(g.rule, Rule::AdamW);
    EXPECT_EQ(g.adamw8bit.min_8bit_numel, AdamW8bitConfig{}.min_8bit_numel);  // format 5 added it
  }
  EXPECT_FALSE(m.has_qmap_checksums);  // format 5 added them
  // Format 4 stored three fp32 arrays for every element (12 bytes each).
  for (const ckpt::MetaShard& s : m.shards) {
    std::uint64_t n = 0;
    for (const ckpt::Block& b : s.blocks) n += b.count;
    EXPECT_EQ(s.file_bytes, ckpt::kShardHeaderBytes + 12 * n);
  }
}

TEST(FixtureFiles, FormatFiveHasQuantizationFieldsButNoShapes) {
  const ckpt::Metadata m = ckpt::read_metadata(kFixtures[4] / "save" / "ckpt-00000001");
  EXPECT_EQ(m.version, 5u);
  EXPECT_EQ(m.world_size, 2u);
  EXPECT_TRUE(m.has_qmap_checksums);
  for (const ckpt::MetaParam& p : m.params) EXPECT_EQ(p.rows, 0u);  // format 6 added shapes
  // AdamW groups only: 12 bytes per element, as in format 4.
  for (const ckpt::MetaShard& s : m.shards) {
    std::uint64_t n = 0;
    for (const ckpt::Block& b : s.blocks) n += b.count;
    EXPECT_EQ(s.file_bytes, ckpt::kShardHeaderBytes + 12 * n);
  }
}

TEST(FixtureFiles, FormatSixHasShapesAndSevenArrayShardHeaders) {
  const fs::path dir = kFixtures[5] / "save" / "ckpt-00000001";
  const ckpt::Metadata m = ckpt::read_metadata(dir);
  EXPECT_EQ(m.version, 6u);
  EXPECT_EQ(m.world_size, 2u);
  for (const ckpt::MetaParam& p : m.params) EXPECT_EQ(p.rows, 1u);  // 1-D: 1 x numel
  // A format-6 shard header counts 7 arrays (format 7 added the factors).
  const std::vector<unsigned char> shard = ckpt::read_whole_file(dir / ckpt::shard_file_name(0), 1 << 20);
  std::uint32_t arrays = 0;
  std::memcpy(&arrays, shard.data() + 40, 4);
  EXPECT_EQ(arrays, 7u);
  EXPECT_EQ(ckpt::decode_shard_header(shard).version, 6u);
  for (const ckpt::MetaShard& s : m.shards) {  // AdamW groups only: 12 bytes per element
    std::uint64_t n = 0;
    for (const ckpt::Block& b : s.blocks) n += b.count;
    EXPECT_EQ(s.file_bytes, ckpt::kShardHeaderBytes + 12 * n);
  }
}

TEST_P(Fixture, OlderFormatsLoadBitForBitAndSurviveASaveInTheCurrentFormat) {
  auto comm = test::world();
  for (const fs::path& fixture : kFixtures) {
    SCOPED_TRACE(fixture.filename().string());
    const test::FullState want = expected_state(fixture);
    auto opt = test::make_fixture_optimizer(comm, GetParam());
    load_checkpoint(*opt, fixture / "save");
    expect_fixture_restored(*opt, want);

    // Saved in the current format and loaded into another stage: nothing is lost.
    test::SharedDir dir(*comm);
    const fs::path saved = save_checkpoint(*opt, dir.path());
    EXPECT_EQ(ckpt::read_metadata(saved).version, ckpt::kFormatVersion);
    const Stage other = GetParam() == Stage::Zero2 ? Stage::DataParallel : Stage::Zero2;
    auto again = test::make_fixture_optimizer(comm, other);
    load_checkpoint(*again, dir.path());
    expect_fixture_restored(*again, want);
  }
}

INSTANTIATE_TEST_SUITE_P(Stages, Fixture,
                         testing::Values(Stage::DataParallel, Stage::Zero1, Stage::Zero2),
                         [](const testing::TestParamInfo<Stage>& i) {
                           return std::string(i.param == Stage::DataParallel ? "dp"
                                              : i.param == Stage::Zero1      ? "zero1"
                                                                             : "zero2");
                         });

TEST(FixtureExport, WritesTheSavedMasterWeights) {
  auto comm = test::world();
  test::SharedDir dir(*comm);
  if (comm->rank() != 0) return;
  for (const fs::path& fixture : kFixtures) {
    const fs::path out = dir.path() / "fixture.safetensors";
    const std::string cmd = std::string(SHARDOPT_EXPORT_EXE) + " '" + (fixture / "save").string() +
                            "' '" + out.string() + "' > /dev/null";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    const std::vector<unsigned char> file = ckpt::read_whole_file(out, 1 << 20);
    std::uint64_t header = 0;
    std::memcpy(&header, file.data(), 8);
    const test::FullState want = expected_state(fixture);
    ASSERT_EQ(file.size(), 8 + header + want.arrays[0].size() * 4);
    EXPECT_EQ(std::memcmp(file.data() + 8 + header, want.arrays[0].data(), want.arrays[0].size() * 4), 0)
        << fixture;
  }
}

TEST(FixtureCorrupted, IsRefusedEverywhereAndChangesNothing) {
  auto comm = test::world();
  test::SharedDir dir(*comm);
  const fs::path copy = dir.path() / "save";
  comm->barrier();
  if (comm->rank() == 0) {
    fs::copy(kFixture / "save", copy, fs::copy_options::recursive);
    // One bit of shard 1's payload: only its whole-file checksum can tell.
    std::fstream f(copy / "ckpt-00000001" / ckpt::shard_file_name(1),
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(5000);
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x01);
    f.seekp(5000);
    f.write(&c, 1);
  }
  comm->barrier();
  auto opt = test::make_fixture_optimizer(comm, Stage::Zero1);
  const test::FullState before = test::gather_state(*opt);
  try {
    load_checkpoint(*opt, copy);
    ADD_FAILURE() << "a corrupted format-1 checkpoint loaded";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::CorruptData) << e.what();
  }
  EXPECT_TRUE(test::gather_state(*opt) == before);
  EXPECT_EQ(opt->step_count(), 0);
}

TEST(FixtureDirectory, NewSavesJoinAFormatOneSaveDirectory) {
  auto comm = test::world();
  test::SharedDir dir(*comm);
  const fs::path copy = dir.path() / "save";
  comm->barrier();
  if (comm->rank() == 0) fs::copy(kFixture / "save", copy, fs::copy_options::recursive);
  comm->barrier();
  const test::FullState want = expected_state();
  auto opt = test::make_fixture_optimizer(comm, Stage::Zero1);
  load_checkpoint(*opt, copy);
  test::ckpt_train_step(*opt, 4);
  const test::FullState newer = test::gather_state(*opt);
  SaveOptions keep2;
  keep2.keep = 2;
  EXPECT_EQ(save_checkpoint(*opt, copy, keep2).filename(), "ckpt-00000002");
  comm->barrier();
  EXPECT_TRUE(fs::exists(copy / "ckpt-00000001")) << "the format-1 checkpoint was removed";
  auto b = test::make_fixture_optimizer(comm, Stage::Zero2);
  load_checkpoint(*b, copy);  // LATEST (now with a checksum): the format-2 checkpoint
  EXPECT_TRUE(test::gather_state(*b) == newer);
  load_checkpoint(*b, copy / "ckpt-00000001");  // the format-1 one, named
  EXPECT_TRUE(test::gather_state(*b) == want);
}
