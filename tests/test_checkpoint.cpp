// test_checkpoint.cpp: save and load at the same world size (1 without MPI, 1-4 under
// mpiexec): bit-identical state, training continues identically, and every kind of bad
// checkpoint is refused on every rank with the optimizer left unchanged.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <system_error>
#include <vector>

#include "checkpoint/crc32c.hpp"
#include "checkpoint/files.hpp"
#include "checkpoint/format.hpp"
#include "shardopt/checkpoint.hpp"
#include "support/ckpt_model.hpp"
#include "support/world.hpp"

using namespace shardopt;
namespace fs = std::filesystem;

namespace {

using test::SharedDir;

std::vector<unsigned char> replica_bytes(ShardedOptimizer& opt) {
  std::vector<unsigned char> out;
  for (std::size_t i = 0; i < opt.layout().num_params(); ++i) {
    const auto* p = opt.options().param_dtype == DType::BF16
                        ? reinterpret_cast<const unsigned char*>(opt.param<bf16>(i).data())
                        : reinterpret_cast<const unsigned char*>(opt.param<float>(i).data());
    out.insert(out.end(), p, p + opt.layout().param(i).numel * dtype_size(opt.options().param_dtype));
  }
  return out;
}

void expect_status(Status want, const std::function<void()>& f, const std::string& what) {
  try {
    f();
    ADD_FAILURE() << what << ": no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), want) << what << ": " << e.what();
  }
}

// Runs `mutate` on rank 0 (the others wait), so that a file edit is seen by everyone.
void on_rank0(Communicator& comm, const std::function<void()>& mutate) {
  comm.barrier();
  if (comm.rank() == 0) mutate();
  comm.barrier();
}

void overwrite_byte(const fs::path& p, std::uint64_t at, unsigned char flip) {
  std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(at));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(static_cast<unsigned char>(c) ^ flip);
  f.seekp(static_cast<std::streamoff>(at));
  f.write(&c, 1);
}

struct StageDtype {
  Stage stage;
  DType dtype;
};

void PrintTo(const StageDtype& c, std::ostream* os) {
  *os << stage_name(c.stage) << "/" << dtype_name(c.dtype);
}

class SameWorld : public testing::TestWithParam<StageDtype> {};

}  // namespace

TEST_P(SameWorld, RoundTripIsBitIdenticalAndTrainingContinuesIdentically) {
  auto comm = test::world();
  SharedDir dir(*comm);
  test::CkptSetup s{GetParam().stage, GetParam().dtype, {}};
  auto a = test::make_ckpt_optimizer(comm, s);
  for (int step = 1; step <= 3; ++step) test::ckpt_train_step(*a, step);
  const fs::path saved = save_checkpoint(*a, dir.path());
  EXPECT_EQ(saved.filename(), "ckpt-00000001");
  const test::FullState before = test::gather_state(*a);

  // A fresh optimizer (other hyperparameters, which the checkpoint restores) loads it.
  auto b = test::make_ckpt_optimizer(comm, s);
  b->set_lr(0.5);
  load_checkpoint(*b, dir.path());
  EXPECT_TRUE(test::gather_state(*b) == before);
  EXPECT_EQ(replica_bytes(*b), replica_bytes(*a));
  EXPECT_EQ(b->lr(), a->lr());
  EXPECT_EQ(b->step_count(), 3);

  for (int step = 4; step <= 5; ++step) {
    const StepResult ra = test::ckpt_train_step(*a, step);
    const StepResult rb = test::ckpt_train_step(*b, step);
    EXPECT_EQ(ra.grad_norm, rb.grad_norm);
    EXPECT_EQ(ra.step, rb.step);
  }
  EXPECT_TRUE(test::gather_state(*a) == test::gather_state(*b));
  EXPECT_EQ(replica_bytes(*a), replica_bytes(*b));
}

INSTANTIATE_TEST_SUITE_P(Stages, SameWorld,
                         testing::Values(StageDtype{Stage::DataParallel, DType::BF16},
                                         StageDtype{Stage::Zero1, DType::BF16},
                                         StageDtype{Stage::Zero2, DType::BF16},
                                         StageDtype{Stage::Zero1, DType::F32}),
                         [](const testing::TestParamInfo<StageDtype>& i) {
                           return std::string(i.param.stage == Stage::DataParallel ? "dp"
                                              : i.param.stage == Stage::Zero1      ? "zero1"
                                                                                   : "zero2") +
                                  "_" + dtype_name(i.param.dtype);
                         });

TEST(Checkpoint, LatestPointsToTheNewestAndOldOnesArePruned) {
  auto comm = test::world();
  SharedDir dir(*comm);
  auto opt = test::make_ckpt_optimizer(comm, {});
  SaveOptions keep2;
  keep2.keep = 2;
  std::vector<test::FullState> states;
  for (int k = 1; k <= 3; ++k) {
    test::ckpt_train_step(*opt, k);
    save_checkpoint(*opt, dir.path(), keep2);
    states.push_back(test::gather_state(*opt));
  }
  comm->barrier();
  EXPECT_FALSE(fs::exists(dir.path() / "ckpt-00000001"));
  EXPECT_TRUE(fs::exists(dir.path() / "ckpt-00000002"));
  auto b = test::make_ckpt_optimizer(comm, {});
  load_checkpoint(*b, dir.path());
  EXPECT_TRUE(test::gather_state(*b) == states[2]);
  load_checkpoint(*b, dir.path() / "ckpt-00000002");  // a specific checkpoint
  EXPECT_TRUE(test::gather_state(*b) == states[1]);
}

TEST(Checkpoint, BadCheckpointsAreRefusedEverywhereAndChangeNothing) {
  auto comm = test::world();
  SharedDir dir(*comm);
  auto opt = test::make_ckpt_optimizer(comm, {});
  test::ckpt_train_step(*opt, 1);
  const fs::path ck = save_checkpoint(*opt, dir.path());
  const fs::path shard0 = ck / ckpt::shard_file_name(0);
  const fs::path meta = ck / ckpt::kMetadataFile;

  auto victim = test::make_ckpt_optimizer(comm, {});
  test::ckpt_train_step(*victim, 7);
  const test::FullState untouched = test::gather_state(*victim);
  const auto replica = replica_bytes(*victim);
  const double lr = victim->lr();
  auto refused = [&](Status want, const fs::path& path, const std::string& what) {
    expect_status(want, [&] { load_checkpoint(*victim, path); }, what);
    EXPECT_TRUE(test::gather_state(*victim) == untouched) << what;
    EXPECT_EQ(replica_bytes(*victim), replica) << what;
    EXPECT_EQ(victim->lr(), lr) << what;
  };

  refused(Status::Io, dir.path() / "nothing-here", "missing directory");

  const fs::path backup = dir.path() / "shard0.bak";
  on_rank0(*comm, [&] { fs::copy_file(shard0, backup); fs::resize_file(shard0, fs::file_size(shard0) - 4); });
  refused(Status::CorruptData, dir.path(), "truncated shard");
  on_rank0(*comm, [&] { fs::copy_file(backup, shard0, fs::copy_options::overwrite_existing); overwrite_byte(shard0, 100, 0x10); });
  refused(Status::CorruptData, dir.path(), "corrupted shard payload");
  on_rank0(*comm, [&] { overwrite_byte(shard0, 100, 0x10); overwrite_byte(shard0, 20, 0x01); });
  refused(Status::CorruptData, dir.path(), "corrupted shard header");
  on_rank0(*comm, [&] { overwrite_byte(shard0, 20, 0x01); });

  const fs::path meta_backup = dir.path() / "meta.bak";
  on_rank0(*comm, [&] { fs::copy_file(meta, meta_backup); fs::resize_file(meta, fs::file_size(meta) - 1); });
  refused(Status::CorruptData, dir.path(), "truncated metadata");
  on_rank0(*comm, [&] { fs::copy_file(meta_backup, meta, fs::copy_options::overwrite_existing); overwrite_byte(meta, 60, 0x80); });
  refused(Status::CorruptData, dir.path(), "corrupted metadata");

  // A future format version, with consistent checksums: refused as unsupported.
  on_rank0(*comm, [&] {
    std::vector<unsigned char> bytes = ckpt::read_whole_file(meta_backup, 1 << 20);
    bytes[8] = ckpt::kFormatVersion + 1;  // version field
    const std::uint32_t crc = ckpt::crc32c(bytes.data(), 28);
    std::memcpy(bytes.data() + 28, &crc, 4);
    std::ofstream(meta, std::ios::binary | std::ios::trunc)
        .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  });
  refused(Status::Unsupported, dir.path(), "future version");
  on_rank0(*comm, [&] { fs::copy_file(meta_backup, meta, fs::copy_options::overwrite_existing); });

  // A FIFO in place of a file: refused at once (opening it for reading would wait for a
  // writer forever). The alarm turns a hang into a failure.
  alarm(120);
  on_rank0(*comm, [&] { fs::remove(shard0); ASSERT_EQ(mkfifo(shard0.c_str(), 0644), 0); });
  refused(Status::Io, dir.path(), "a FIFO in place of a shard file");
  on_rank0(*comm, [&] { fs::remove(shard0); fs::copy_file(backup, shard0); fs::remove(meta);
                        ASSERT_EQ(mkfifo(meta.c_str(), 0644), 0); });
  refused(Status::Io, dir.path(), "a FIFO in place of the metadata");
  refused(Status::Io, ck, "a FIFO in place of the metadata, checkpoint named");
  on_rank0(*comm, [&] { fs::remove(meta); fs::copy_file(meta_backup, meta); });
  alarm(0);
  load_checkpoint(*victim, dir.path());  // repaired: loads

  // Another layout and another dtype.
  {
    OptimizerOptions o;
    auto other = std::make_unique<ShardedOptimizer>(comm, o);
    other->add_group(GroupOptions{0.5, false});
    const auto& sizes = test::ckpt_sizes();
    for (std::size_t i = 0; i < sizes.size(); ++i)
      other->add_param("layer" + std::to_string(i) + ".weight", sizes[i] + (i == 3 ? 1 : 0),
                       static_cast<int>(i % 2));
    other->finalize();
    expect_status(Status::LayoutMismatch, [&] { load_checkpoint(*other, dir.path()); }, "layout");
  }
  {
    test::CkptSetup f32;
    f32.dtype = DType::F32;
    auto other = test::make_ckpt_optimizer(comm, f32);
    expect_status(Status::LayoutMismatch, [&] { load_checkpoint(*other, dir.path()); }, "dtype");
  }
}

// ---- a failed write on one rank is an error on every rank ---------------------------------

namespace {
fs::path g_block_path;  // the shard path the hook blocks, on the rank that sets it
void block_shard(const char* point) {
  if (std::string(point) == "prepared" && !g_block_path.empty())
    std::ofstream(g_block_path) << "in the way";  // makes the exclusive create fail
}
}  // namespace

TEST(Checkpoint, FailedWriteOnOneRankFailsTheSaveOnEveryRank) {
  auto comm = test::world();
  SharedDir dir(*comm);
  auto opt = test::make_ckpt_optimizer(comm, {});
  test::ckpt_train_step(*opt, 1);
  save_checkpoint(*opt, dir.path());
  const test::FullState first = test::gather_state(*opt);
  test::ckpt_train_step(*opt, 2);

  const int last = comm->size() - 1;
  if (comm->rank() == last)
    g_block_path = dir.path() / ".tmp-ckpt-00000002" / ckpt::shard_file_name(static_cast<std::size_t>(last));
  ckpt::set_test_hook(&block_shard);
  try {
    save_checkpoint(*opt, dir.path());
    ADD_FAILURE() << "the save succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::Io) << e.what();
    EXPECT_NE(std::string(e.what()).find("rank " + std::to_string(last)), std::string::npos) << e.what();
  }
  ckpt::set_test_hook(nullptr);
  g_block_path.clear();

  // The previous checkpoint is still the latest; the next save cleans the temporary.
  auto b = test::make_ckpt_optimizer(comm, {});
  load_checkpoint(*b, dir.path());
  EXPECT_TRUE(test::gather_state(*b) == first);
  save_checkpoint(*opt, dir.path());
  comm->barrier();
  EXPECT_FALSE(fs::exists(dir.path() / ".tmp-ckpt-00000002"));
  EXPECT_TRUE(fs::exists(dir.path() / "ckpt-00000002"));
}

TEST(Checkpoint, LossScaleStateIsRestored) {
  auto comm = test::world();
  SharedDir dir(*comm);
  test::CkptSetup s;
  s.loss_scaling.enabled = true;
  s.loss_scaling.initial_scale = 4096.0;
  s.loss_scaling.growth_interval = 2;
  auto a = test::make_ckpt_optimizer(comm, s);
  for (int step = 1; step <= 3; ++step) test::ckpt_train_step(*a, step);
  a->set_loss_scale_state(LossScaleState{8192.0, 1, 4});
  save_checkpoint(*a, dir.path());
  auto b = test::make_ckpt_optimizer(comm, s);
  load_checkpoint(*b, dir.path());
  EXPECT_EQ(b->loss_scale(), 8192.0);
  EXPECT_EQ(b->loss_scale_state().good_steps, 1);
  EXPECT_EQ(b->loss_scale_state().skipped_steps, 4);
  // Loaded without loss scaling: the scale is 1, the skip count is kept.
  auto c = test::make_ckpt_optimizer(comm, {});
  load_checkpoint(*c, dir.path());
  EXPECT_EQ(c->loss_scale(), 1.0);
  EXPECT_EQ(c->loss_scale_state().skipped_steps, 4);
}

// ---- LATEST: a corrupted LATEST never loads another checkpoint ---------------------------

namespace {
void write_text(const fs::path& p, const std::string& text) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << text;
}
std::string read_text(const fs::path& p) {
  const std::vector<unsigned char> b = ckpt::read_whole_file(p, 1 << 10);
  return std::string(b.begin(), b.end());
}
// Steps 1, 2, 3, each saved into `dir` (all three kept): the state after each.
std::vector<test::FullState> train_and_save_three(ShardedOptimizer& opt, const fs::path& dir) {
  SaveOptions keep3;
  keep3.keep = 3;
  std::vector<test::FullState> states;
  for (int k = 1; k <= 3; ++k) {
    test::ckpt_train_step(opt, k);
    save_checkpoint(opt, dir, keep3);
    states.push_back(test::gather_state(opt));
  }
  return states;
}
}  // namespace

TEST(Checkpoint, EveryBitFlipInLatestLoadsTheNewestOrIsRefused) {
  auto comm = test::world();
  SharedDir dir(*comm);
  auto opt = test::make_ckpt_optimizer(comm, {});
  const std::vector<test::FullState> states = train_and_save_three(*opt, dir.path());
  const fs::path latest = dir.path() / ckpt::kLatestFile;
  const std::string good = read_text(latest);
  ASSERT_EQ(good.rfind("ckpt-00000003", 0), 0u) << good;

  auto victim = test::make_ckpt_optimizer(comm, {});
  // The flip of the issue: '3' -> '2' names the previous checkpoint, which is complete.
  on_rank0(*comm, [&] { std::string t = good; t[12] = '2'; write_text(latest, t); });
  expect_status(Status::CorruptData, [&] { load_checkpoint(*victim, dir.path()); }, "'3' -> '2'");
  EXPECT_EQ(victim->step_count(), 0);

  // Every single-bit flip (exhaustively in the one-rank run; a flip in the checksum and one
  // in the separator under MPI, where each load is slow on an oversubscribed machine).
  std::vector<std::pair<std::size_t, int>> flips;
  if (comm->size() == 1) {
    for (std::size_t i = 0; i < good.size(); ++i)
      for (int bit = 0; bit < 8; ++bit) flips.emplace_back(i, bit);
  } else {
    flips = {{15, 0}, {13, 1}};
  }
  test::FullState current = test::gather_state(*victim);
  int refused = 0;
  for (auto [i, bit] : flips) {
    on_rank0(*comm, [&, i = i, bit = bit] {
      std::string t = good;
      t[i] = static_cast<char>(t[i] ^ (1 << bit));
      write_text(latest, t);
    });
    try {
      load_checkpoint(*victim, dir.path());
      current = test::gather_state(*victim);
      EXPECT_TRUE(current == states[2]) << "byte " << i << " bit " << bit;
    } catch (const Error& e) {
      ++refused;
      EXPECT_TRUE(e.status() == Status::CorruptData || e.status() == Status::Io)
          << "byte " << i << " bit " << bit << ": " << e.what();
      EXPECT_TRUE(test::gather_state(*victim) == current) << "byte " << i << " bit " << bit;
    }
  }
  EXPECT_GT(refused, 0);

  // A format-1 LATEST (a bare name) is trusted only when it names the newest checkpoint.
  auto legacy = test::make_ckpt_optimizer(comm, {});
  on_rank0(*comm, [&] { write_text(latest, "ckpt-00000003\n"); });
  load_checkpoint(*legacy, dir.path());
  EXPECT_TRUE(test::gather_state(*legacy) == states[2]);
  on_rank0(*comm, [&] { write_text(latest, "ckpt-00000002\n"); });
  auto other = test::make_ckpt_optimizer(comm, {});
  expect_status(Status::CorruptData, [&] { load_checkpoint(*other, dir.path()); }, "format-1 LATEST, older");
  EXPECT_EQ(other->step_count(), 0);
  on_rank0(*comm, [&] { write_text(latest, good); });
  load_checkpoint(*other, dir.path());
  EXPECT_TRUE(test::gather_state(*other) == states[2]);
}

// ---- removing old checkpoints: after the save is agreed, and a failure is a warning -------

namespace {
void fail_pruning(const char* point) {
  if (std::string(point) == "pruning")
    throw fs::filesystem_error("injected removal failure", std::make_error_code(std::errc::permission_denied));
}
}  // namespace

TEST(Checkpoint, AnOldCheckpointThatCannotBeRemovedIsAWarningNotAFailedSave) {
  auto comm = test::world();
  SharedDir dir(*comm);
  auto opt = test::make_ckpt_optimizer(comm, {});
  SaveOptions keep1;
  keep1.keep = 1;
  test::ckpt_train_step(*opt, 1);
  save_checkpoint(*opt, dir.path(), keep1);

  ckpt::set_test_hook(&fail_pruning);
  for (int k = 2; k <= 3; ++k) {  // the old one stays undeletable: every save still succeeds
    test::ckpt_train_step(*opt, k);
    if (comm->rank() == 0) testing::internal::CaptureStderr();
    try {
      EXPECT_EQ(save_checkpoint(*opt, dir.path(), keep1).filename(), "ckpt-0000000" + std::to_string(k));
    } catch (const Error& e) {
      ADD_FAILURE() << "save " << k << " failed: " << e.what();
    }
    if (comm->rank() == 0) {
      const std::string err = testing::internal::GetCapturedStderr();
      EXPECT_NE(err.find("warning"), std::string::npos) << err;
      EXPECT_NE(err.find("injected removal failure"), std::string::npos) << err;
    }
  }
  ckpt::set_test_hook(nullptr);
  const test::FullState third = test::gather_state(*opt);
  comm->barrier();
  EXPECT_TRUE(fs::exists(dir.path() / "ckpt-00000001"));
  EXPECT_EQ(read_text(dir.path() / ckpt::kLatestFile), ckpt::encode_latest("ckpt-00000003"));
  auto b = test::make_ckpt_optimizer(comm, {});
  load_checkpoint(*b, dir.path());
  EXPECT_TRUE(test::gather_state(*b) == third);

  // Once removal works again, the next save removes every old checkpoint beyond `keep`.
  save_checkpoint(*opt, dir.path(), keep1);
  comm->barrier();
  for (const char* old : {"ckpt-00000001", "ckpt-00000002", "ckpt-00000003"})
    EXPECT_FALSE(fs::exists(dir.path() / old)) << old;
  EXPECT_TRUE(fs::exists(dir.path() / "ckpt-00000004"));
}

// ---- durability: every directory a save creates or renames into is fsynced ----------------

namespace {
std::vector<std::string> g_points;
void record_point(const char* point) { g_points.emplace_back(point); }
std::ptrdiff_t position(const std::string& point) {
  const auto it = std::find(g_points.begin(), g_points.end(), point);
  return it == g_points.end() ? -1 : it - g_points.begin();
}
}  // namespace

TEST(Checkpoint, TheParentOfEveryNewDirectoryIsFsynced) {
  auto comm = test::world();
  SharedDir dir(*comm);
  auto opt = test::make_ckpt_optimizer(comm, {});
  test::ckpt_train_step(*opt, 1);
  const fs::path save_dir = dir.path() / "new" / "deeper" / "ckpt";
  g_points.clear();
  ckpt::set_test_hook(&record_point);
  save_checkpoint(*opt, save_dir);
  ckpt::set_test_hook(nullptr);
  if (comm->rank() != 0) return;  // rank 0 creates and publishes
  const std::ptrdiff_t prepared = position("prepared");
  ASSERT_GE(prepared, 0);
  // The save directory and its missing parents: each one's parent, before the save goes on.
  for (const fs::path& parent : {dir.path(), dir.path() / "new", dir.path() / "new" / "deeper"}) {
    const std::ptrdiff_t at = position("fsync-dir " + parent.string());
    EXPECT_GE(at, 0) << parent;
    EXPECT_LT(at, prepared) << parent;
  }
  // The new checkpoint's parent after the rename, before LATEST names it.
  const std::ptrdiff_t renamed = position("renamed");
  const std::ptrdiff_t synced = position("fsync-dir " + save_dir.string());
  EXPECT_GT(synced, position("metadata-written"));
  EXPECT_LT(synced, renamed);
  EXPECT_LT(renamed, position("published"));
}

// ---- intact files in the wrong place: what a checksum cannot catch (issue 27) ---------------

// Three mutations that keep every file intact, so every checksum passes: a LATEST with a
// valid checksum naming an older checkpoint, two checkpoint directories swapped, and a
// checkpoint directory replaced by a symlink to an older one. Each loaded the older state
// silently; each is refused now (the metadata carries the sequence number its directory
// name and LATEST carry, and a published checkpoint is marked so), on every rank, and
// changes nothing. Undone, the save directory loads again.
TEST(Checkpoint, IntactCheckpointsInTheWrongPlaceAreRefused) {
  auto comm = test::world();
  SharedDir dir(*comm);
  auto opt = test::make_ckpt_optimizer(comm, {});
  const std::vector<test::FullState> states = train_and_save_three(*opt, dir.path());
  const fs::path latest = dir.path() / ckpt::kLatestFile;
  const fs::path c2 = dir.path() / "ckpt-00000002", c3 = dir.path() / "ckpt-00000003";
  const fs::path aside = dir.path() / "aside";
  const std::string good = read_text(latest);

  auto victim = test::make_ckpt_optimizer(comm, {});
  test::ckpt_train_step(*victim, 9);
  const test::FullState untouched = test::gather_state(*victim);
  auto refused = [&](const fs::path& path, const std::string& fragment, const char* what) {
    try {
      load_checkpoint(*victim, path);
      ADD_FAILURE() << what << ": loaded";
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::CorruptData) << what << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << what << ": " << e.what();
    }
    EXPECT_TRUE(test::gather_state(*victim) == untouched) << what;
  };

  // 1. LATEST with a valid checksum that names the previous checkpoint.
  on_rank0(*comm, [&] { write_text(latest, ckpt::encode_latest("ckpt-00000002")); });
  refused(dir.path(), "names 'ckpt-00000002', but ckpt-00000003 was published after it",
          "LATEST naming an older checkpoint");
  auto older = test::make_ckpt_optimizer(comm, {});
  load_checkpoint(*older, c2);  // the older checkpoint, named explicitly, loads
  EXPECT_TRUE(test::gather_state(*older) == states[1]);
  on_rank0(*comm, [&] { write_text(latest, good); });

  // 2. Two checkpoint directories swapped.
  on_rank0(*comm, [&] { fs::rename(c3, aside); fs::rename(c2, c3); fs::rename(aside, c2); });
  const std::string swapped = "holds checkpoint ckpt-00000002 (its metadata says so), not ckpt-00000003";
  refused(dir.path(), swapped, "swapped directories, through LATEST");
  refused(c3, swapped, "swapped directories, named");
  on_rank0(*comm, [&] { fs::rename(c3, aside); fs::rename(c2, c3); fs::rename(aside, c2); });

  // 3. A checkpoint directory replaced by a symlink to an older one.
  on_rank0(*comm, [&] { fs::rename(c3, aside); fs::create_directory_symlink("ckpt-00000002", c3); });
  refused(dir.path(), swapped, "a symlink to an older checkpoint");
  on_rank0(*comm, [&] { fs::remove(c3); fs::rename(aside, c3); });

  load_checkpoint(*victim, dir.path());  // repaired: the newest loads
  EXPECT_TRUE(test::gather_state(*victim) == states[2]);
}

// Error messages quote what LATEST holds with control characters escaped and long content
// cut, never its raw bytes.
TEST(Checkpoint, MessagesQuoteLatestEscapedAndCut) {
  auto comm = test::world();
  SharedDir dir(*comm);
  auto opt = test::make_ckpt_optimizer(comm, {});
  save_checkpoint(*opt, dir.path());
  const fs::path latest = dir.path() / ckpt::kLatestFile;
  auto message = [&](const std::string& text) {
    on_rank0(*comm, [&] { write_text(latest, text); });
    try {
      load_checkpoint(*opt, dir.path());
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::CorruptData) << e.what();
      return std::string(e.what());
    }
    ADD_FAILURE() << "loaded";
    return std::string();
  };
  // A format-1 LATEST (no space, so no checksum) with a carriage return, a bell and an
  // escape sequence in the name.
  std::string m = message("ckpt-0\r\a\x1b[2J\n");
  EXPECT_NE(m.find("names 'ckpt-0\\x0D\\x07\\x1B[2J'"), std::string::npos) << m;
  // With a checksum that does not match, and 200 bytes of junk: cut.
  m = message("ckpt-00000001\x01 deadbeef" + std::string(200, 'x'));
  EXPECT_NE(m.find("LATEST holds 'ckpt-00000001\\x01 deadbeef"), std::string::npos) << m;
  EXPECT_NE(m.find("... (223 bytes)', which fails its checksum"), std::string::npos) << m;
  for (char c : m) EXPECT_TRUE(c >= 0x20 && c != 0x7F) << "a raw control character in: " << m;
}

// ---- two jobs, one save directory (issue 27) -------------------------------------------------

namespace {
// Rank 0's pid on every rank (rank 0 holds the save directory's lock).
long rank0_pid(Communicator& comm) {
  long pid = static_cast<long>(getpid());
  comm.broadcast_bytes(&pid, sizeof pid, 0);
  return pid;
}
std::vector<std::string> sorted_entries(const fs::path& dir) {
  std::vector<std::string> names;
  for (const fs::directory_entry& e : fs::directory_iterator(dir)) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  return names;
}
}  // namespace

// A second optimizer (standing for a second job) saving into the directory a first one saves
// into is refused at once, on every rank, naming the directory and the holder, and changes
// nothing; the first goes on saving; once it is destroyed the directory is the second's.
TEST(Checkpoint, ASecondJobSavingIntoTheSameDirectoryIsRefusedUntilTheFirstIsDone) {
  auto comm = test::world();
  SharedDir dir(*comm);
  auto first = test::make_ckpt_optimizer(comm, {});
  test::ckpt_train_step(*first, 1);
  save_checkpoint(*first, dir.path());
  auto second = test::make_ckpt_optimizer(comm, {});
  test::ckpt_train_step(*second, 2);
  const long pid = rank0_pid(*comm);
  comm->barrier();
  const std::vector<std::string> before = sorted_entries(dir.path());
  try {
    save_checkpoint(*second, dir.path());
    ADD_FAILURE() << "two jobs saved into one directory";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::Io) << e.what();
    const std::string what = e.what();
    EXPECT_NE(what.find("'" + dir.path().string() + "' is in use: another job saves into it (host "),
              std::string::npos) << what;
    EXPECT_NE(what.find(" pid " + std::to_string(pid) + ", holding the lock " +
                        (dir.path() / ckpt::kLockFile).string()),
              std::string::npos) << what;
  }
  comm->barrier();
  EXPECT_EQ(sorted_entries(dir.path()), before) << "the refused save changed the directory";
  save_checkpoint(*first, dir.path());  // the holder goes on
  first.reset();                        // done: its lock is released
  save_checkpoint(*second, dir.path());
  auto check = test::make_ckpt_optimizer(comm, {});
  load_checkpoint(*check, dir.path());
  EXPECT_TRUE(test::gather_state(*check) == test::gather_state(*second));
}

// A lock file left by a job that is gone (killed: its lock died with it) blocks nothing.
TEST(Checkpoint, ALockFileAloneIsNotALock) {
  auto comm = test::world();
  SharedDir dir(*comm);
  on_rank0(*comm, [&] { write_text(dir.path() / ckpt::kLockFile, "host elsewhere pid 1\n"); });
  auto opt = test::make_ckpt_optimizer(comm, {});
  EXPECT_NO_THROW(save_checkpoint(*opt, dir.path()));
  on_rank0(*comm, [&] {
    EXPECT_EQ(read_text(dir.path() / ckpt::kLockFile).find("host elsewhere"), std::string::npos);
  });
}
