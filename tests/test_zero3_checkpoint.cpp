// test_zero3_checkpoint.cpp: stage-3 checkpoints through the public save/load API. A stage-3
// optimizer's local arrays (master, m, v) are the same as stages 1 and 2, so a checkpoint
// saved at stage 3 loads at stages 1, 2 and 3, at the launched world size W and at 1 rank
// (W -> 1), and one saved at 1 rank in stage 2 loads at stage 3 on W ranks (1 -> W), with the
// state bit-identical; a stage-3 optimizer restored from it gathers the master rounded to
// bf16, and training continues exactly as at stage 2.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "shardopt/checkpoint.hpp"
#include "support/ckpt_model.hpp"
#include "support/world.hpp"

using namespace shardopt;
namespace fs = std::filesystem;

namespace {

// A directory every rank of `comm` names alike (rank 0 creates it). Collective.
fs::path shared_dir(Communicator& comm, const char* tag) {
  char name[256] = {};
  if (comm.rank() == 0) {
    std::string tmpl = (fs::temp_directory_path() / (std::string("shardopt-z3-") + tag + "-XXXXXX")).string();
    if (!mkdtemp(tmpl.data())) std::abort();
    std::snprintf(name, sizeof name, "%s", tmpl.c_str());
  }
  comm.broadcast_bytes(name, sizeof name, 0);
  return name;
}

test::CkptSetup setup(Stage s) {
  test::CkptSetup c;
  c.stage = s;
  return c;
}

// The stage-3 replica, gathered unit by unit, is the master rounded to bf16.
void expect_replica_is_master(ShardedOptimizer& opt) {
  const FlatLayout& l = opt.layout();
  for (std::size_t u = 0; u < l.num_units(); ++u) {
    opt.acquire(u);
    for (std::size_t i = l.unit(u).params.begin; i < l.unit(u).params.end; ++i) {
      std::vector<float> master(l.param(i).numel);
      opt.get_master(i, master);
      const std::span<bf16> p = opt.param<bf16>(i);
      for (std::size_t k = 0; k < master.size(); ++k)
        ASSERT_EQ(p[k].bits, to_bf16(master[k]).bits) << "p" << i << "[" << k << "]";
    }
    opt.release(u);
  }
}

TEST(Zero3Checkpoint, LoadsAcrossStagesAndRankCounts) {
  auto w = test::world();
  const fs::path dir = shared_dir(*w, "save");
  auto z3 = test::make_ckpt_optimizer(w, setup(Stage::Zero3));
  for (int s = 1; s <= 3; ++s) test::ckpt_train_step(*z3, s);
  save_checkpoint(*z3, dir);
  const test::FullState saved = test::gather_state(*z3);

  // W -> W, every stage; training then continues identically at stages 2 and 3.
  std::vector<std::unique_ptr<ShardedOptimizer>> loaded;
  for (Stage stage : {Stage::Zero1, Stage::Zero2, Stage::Zero3}) {
    auto opt = test::make_ckpt_optimizer(w, setup(stage));
    load_checkpoint(*opt, dir);
    EXPECT_TRUE(test::gather_state(*opt) == saved) << stage_name(stage);
    loaded.push_back(std::move(opt));
  }
  expect_replica_is_master(*loaded[2]);
  for (int s = 4; s <= 5; ++s) {
    test::ckpt_train_step(*loaded[1], s);
    test::ckpt_train_step(*loaded[2], s);
    test::ckpt_train_step(*z3, s);
  }
  const test::FullState z2_after = test::gather_state(*loaded[1]);
  EXPECT_TRUE(test::gather_state(*loaded[2]) == z2_after);
  EXPECT_TRUE(test::gather_state(*z3) == z2_after);

  // W -> 1 (rank 0 alone), stages 1 and 3.
  if (w->rank() == 0) {
    for (Stage stage : {Stage::Zero1, Stage::Zero3}) {
      auto one = test::make_ckpt_optimizer(make_single_process_communicator(), setup(stage));
      load_checkpoint(*one, dir);
      EXPECT_TRUE(test::gather_state(*one) == saved) << "1 rank, " << stage_name(stage);
      if (stage == Stage::Zero3) expect_replica_is_master(*one);
    }
  }
  w->barrier();
  if (w->rank() == 0) fs::remove_all(dir);
}

TEST(Zero3Checkpoint, OneRankStage2LoadsAtStage3) {
  auto w = test::world();
  const fs::path dir = shared_dir(*w, "one");
  test::FullState saved;
  if (w->rank() == 0) {
    auto one = test::make_ckpt_optimizer(make_single_process_communicator(), setup(Stage::Zero2));
    for (int s = 1; s <= 2; ++s) test::ckpt_train_step(*one, s);
    save_checkpoint(*one, dir);
    saved = test::gather_state(*one);
  }
  for (auto& a : saved.arrays) {  // rank 0's state to everyone
    std::uint64_t n = a.size();
    w->broadcast_bytes(&n, sizeof n, 0);
    a.resize(n);
    w->broadcast_bytes(a.data(), n * sizeof(float), 0);
  }
  w->broadcast_bytes(&saved.step, sizeof saved.step, 0);
  auto z3 = test::make_ckpt_optimizer(w, setup(Stage::Zero3));
  load_checkpoint(*z3, dir);
  EXPECT_TRUE(test::gather_state(*z3) == saved);
  expect_replica_is_master(*z3);
  w->barrier();
  if (w->rank() == 0) fs::remove_all(dir);
}

}  // namespace
