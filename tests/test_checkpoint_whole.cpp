// test_checkpoint_whole.cpp: checkpoints of Whole-ownership layouts, of Muon's momentum and of
// Adafactor's variance and factored statistics (issue 32, point 6), in runs of 1 to 4 ranks (sub-communicators of the launched world W: every
// N -> M with N or M = W, so N != M and 3 ranks are covered across the np1-np4 runs). A
// checkpoint saved at N ranks in Flat or Whole ownership loads at M ranks in either, in every
// stage, with the master, the state (AdamW's moments, Lion's, AdamW8bit's codes and scales,
// Muon's momentum, Adafactor's per-element variance and factored row_var and col_var) and the
// replica bit-identical, and training continues bit for bit as the run that never stopped
// (the averaged gradient is exact at every world size: ckpt_model.hpp). Muon's and
// Adafactor's options come back from the checkpoint; a Muon matrix registered
// with another shape is refused; shardopt-export writes the same file from a Whole
// checkpoint as from a Flat one. A checkpoint saved at W ranks also loads into every other
// stage and ownership, stage 3 under Whole included.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "checkpoint/files.hpp"
#include "checkpoint/format.hpp"
#include "shardopt/bf16.hpp"
#include "shardopt/checkpoint.hpp"
#include "support/ckpt_model.hpp"
#include "support/mpi_sub.hpp"
#include "support/same_error.hpp"
#include "support/world.hpp"

using namespace shardopt;
namespace fs = std::filesystem;

namespace {

// The state and the replica's raw bits (bf16, or fp32) of every parameter, on every rank.
struct Snapshot {
  test::FullState state;
  std::vector<std::uint32_t> replica;
  bool operator==(const Snapshot& o) const { return state == o.state && replica == o.replica; }
};

// Collective. Stage 3 gathers the (single) unit to read the replica.
Snapshot snapshot(ShardedOptimizer& opt) {
  Snapshot s;
  s.state = test::gather_state(opt);
  const bool zero3 = opt.options().stage == Stage::Zero3;
  if (zero3) opt.acquire(0);
  for (std::size_t i = 0; i < opt.layout().num_params(); ++i) {
    if (opt.options().param_dtype == DType::BF16) {
      for (bf16 x : opt.param<bf16>(i)) s.replica.push_back(x.bits);
    } else {
      for (float x : opt.param<float>(i)) {
        std::uint32_t bits = 0;
        std::memcpy(&bits, &x, 4);
        s.replica.push_back(bits);
      }
    }
  }
  if (zero3) opt.release(0);
  return s;
}

// Sends rank 0's snapshot to every rank of comm (collective).
void broadcast(Communicator& comm, Snapshot& s) {
  test::broadcast_state(comm, s.state);
  std::uint64_t n = s.replica.size();
  comm.broadcast_bytes(&n, sizeof n, 0);
  s.replica.resize(n);
  if (n > 0) comm.broadcast_bytes(s.replica.data(), n * 4, 0);
}

// Muon options other than the defaults: a load must bring them back.
MuonConfig saved_muon_config() {
  MuonConfig c;
  c.momentum = 0.8;
  c.nesterov = false;
  c.ns_steps = 4;
  c.lr_adjust = MuonLrAdjust::MatchRmsAdamW;
  return c;
}

// Adafactor options other than the defaults.
AdafactorConfig saved_adafactor_config() {
  AdafactorConfig c;
  c.beta2_decay = -0.7;
  c.eps1 = 1e-20;
  c.eps2 = 2e-3;
  c.d = 1.5;
  return c;
}

bool same(const AdafactorConfig& a, const AdafactorConfig& b) {
  return a.beta2_decay == b.beta2_decay && a.eps1 == b.eps1 && a.eps2 == b.eps2 && a.d == b.d &&
         a.maximize == b.maximize;
}

bool same(const MuonConfig& a, const MuonConfig& b) {
  return a.momentum == b.momentum && a.nesterov == b.nesterov && a.ns_steps == b.ns_steps &&
         a.ns_a == b.ns_a && a.ns_b == b.ns_b && a.ns_c == b.ns_c && a.eps == b.eps &&
         a.lr_adjust == b.lr_adjust;
}

struct Case {
  Ownership save_own;
  Stage save_stage;
  Ownership load_own;
  Stage load_stage;
  Rule rule1 = Rule::AdamW;  // group 1's rule
  bool muon = false;         // group 2: Muon matrices (Whole only)
  DType dtype = DType::BF16;
};

std::string case_name(const testing::TestParamInfo<Case>& i) {
  const auto own = [](Ownership o) { return o == Ownership::Whole ? "whole" : "flat"; };
  const auto stage = [](Stage s) { return "s" + std::to_string(static_cast<int>(s)); };
  const Case& c = i.param;
  return std::string(own(c.save_own)) + stage(c.save_stage) + "_to_" + own(c.load_own) +
         stage(c.load_stage) + "_" + rule_name(c.rule1) + (c.muon ? "_muon" : "") + "_" +
         dtype_name(c.dtype);
}

void PrintTo(const Case& c, std::ostream* os) {
  *os << ownership_name(c.save_own) << "/" << stage_name(c.save_stage) << " -> "
      << ownership_name(c.load_own) << "/" << stage_name(c.load_stage) << " "
      << rule_name(c.rule1) << (c.muon ? "+Muon" : "") << " " << dtype_name(c.dtype);
}

test::CkptSetup setup_of(const Case& c, Ownership own, Stage stage) {
  test::CkptSetup s;
  s.stage = stage;
  s.dtype = c.dtype;
  s.rule1 = c.rule1;
  s.ownership = own;
  s.shapes = true;
  s.muon = c.muon;
  return s;
}

class WholeCheckpoint : public testing::TestWithParam<Case> {};

}  // namespace

TEST_P(WholeCheckpoint, SavedAtNRanksLoadsAtMInEitherOwnershipAndContinuesBitForBit) {
  auto world = test::world();
  const int W = world->size();
  const Case c = GetParam();
  test::CkptSetup save = setup_of(c, c.save_own, c.save_stage);
  save.muon_config = saved_muon_config();
  save.adafactor_config = saved_adafactor_config();
  const test::CkptSetup load = setup_of(c, c.load_own, c.load_stage);  // default Muon options
  for (int n = 1; n <= W; ++n)
    for (int m = 1; m <= W; ++m) {
      if (n != W && m != W) continue;
      SCOPED_TRACE("saved at " + std::to_string(n) + " ranks, loaded at " + std::to_string(m));
      const test::SharedDir shared(*world);
      const fs::path& dir = shared.path();
      auto at_n = test::first_world_ranks(n);
      auto at_m = test::first_world_ranks(m);

      // Run A at n ranks: 3 steps, save, 2 more steps without a restart.
      Snapshot saved, continued;
      if (at_n) {
        auto a = test::make_ckpt_optimizer(at_n, save);
        for (int s = 1; s <= 3; ++s) test::ckpt_train_step(*a, s);
        save_checkpoint(*a, dir);
        saved = snapshot(*a);
        for (int s = 4; s <= 5; ++s) test::ckpt_train_step(*a, s);
        continued = snapshot(*a);
      }
      broadcast(*world, saved);
      broadcast(*world, continued);
      ASSERT_FALSE(saved == continued);  // the steps after the save changed something

      // Run B at m ranks: load, compare, continue the same 2 steps.
      if (at_m) {
        auto b = test::make_ckpt_optimizer(at_m, load);
        load_checkpoint(*b, dir);
        EXPECT_TRUE(snapshot(*b) == saved);
        if (c.muon) {
          EXPECT_TRUE(same(b->groups()[2].muon, saved_muon_config()));
          EXPECT_EQ(b->rule_of(7), Rule::Muon);
          // The momentum came back (it is not zero after 3 steps).
          const std::size_t at = saved.state.arrays[1].size() - 24 * 40 - 33 * 17;
          EXPECT_NE(saved.state.arrays[1][at], 0.0f);
        }
        if (c.rule1 == Rule::Adafactor) {
          EXPECT_TRUE(same(b->groups()[1].adafactor, saved_adafactor_config()));
          EXPECT_EQ(b->rule_of(1), Rule::Adafactor);
          // The factored statistics (matrices 1 and 3) and parameter 5's variance came back.
          ASSERT_EQ(saved.state.factors.size(), 20u + 15u + 8u + 8u);
          EXPECT_NE(saved.state.factors[0], 0.0f);
          EXPECT_NE(saved.state.factors.back(), 0.0f);
          std::size_t at5 = 0;
          for (std::size_t i = 0; i < 5; ++i) at5 += b->layout().param(i).numel;
          EXPECT_NE(saved.state.arrays[2][at5], 0.0f);
        }
        for (int s = 4; s <= 5; ++s) test::ckpt_train_step(*b, s);
        EXPECT_TRUE(snapshot(*b) == continued);

        // Saved at W ranks, loaded in every other stage and ownership: the same bits. Muon
        // and Adafactor run in Whole only.
        const bool whole_only = c.muon || c.rule1 == Rule::Adafactor;
        if (n == W)
          for (Ownership own : {Ownership::Flat, Ownership::Whole})
            for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2, Stage::Zero3}) {
              if ((own == c.load_own && stage == c.load_stage) ||
                  (whole_only && own == Ownership::Flat))
                continue;
              auto o = test::make_ckpt_optimizer(at_m, setup_of(c, own, stage));
              load_checkpoint(*o, dir);
              EXPECT_TRUE(snapshot(*o) == saved)
                  << "loaded as " << ownership_name(own) << " " << stage_name(stage);
            }
      }
    }
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, WholeCheckpoint,
    testing::Values(
        // AdamW groups, both ways between the ownerships.
        Case{Ownership::Flat, Stage::Zero1, Ownership::Whole, Stage::Zero2},
        Case{Ownership::Whole, Stage::Zero2, Ownership::Flat, Stage::Zero1},
        Case{Ownership::Whole, Stage::DataParallel, Ownership::Whole, Stage::Zero1, Rule::AdamW,
             false, DType::F32},
        // Lion's momentum and AdamW8bit's codes and scales from a Whole layout.
        Case{Ownership::Whole, Stage::Zero1, Ownership::Flat, Stage::Zero2, Rule::Lion},
        Case{Ownership::Flat, Stage::Zero2, Ownership::Whole, Stage::Zero1, Rule::AdamW8bit},
        // Muon + AdamW in Whole, stages 0, 1 and 2 on both sides.
        Case{Ownership::Whole, Stage::Zero1, Ownership::Whole, Stage::Zero2, Rule::AdamW, true},
        Case{Ownership::Whole, Stage::Zero2, Ownership::Whole, Stage::DataParallel, Rule::AdamW,
             true, DType::F32},
        Case{Ownership::Whole, Stage::DataParallel, Ownership::Whole, Stage::Zero1, Rule::Lion,
             true},
        // Adafactor (factored matrices and a 1-D variance) + AdamW + Muon in Whole, stages 0,
        // 1 and 2 on both sides.
        Case{Ownership::Whole, Stage::Zero1, Ownership::Whole, Stage::Zero2, Rule::Adafactor},
        Case{Ownership::Whole, Stage::Zero2, Ownership::Whole, Stage::DataParallel,
             Rule::Adafactor, false, DType::F32},
        Case{Ownership::Whole, Stage::DataParallel, Ownership::Whole, Stage::Zero1,
             Rule::Adafactor, true}),
    case_name);

// A Muon matrix's momentum is laid out by its shape: the same parameter registered transposed
// is refused on every rank, naming it and both shapes, and the optimizer keeps its state.
TEST(WholeCheckpointRefusals, AMuonMatrixOfAnotherShapeIsRefused) {
  auto world = test::world();
  const test::SharedDir shared(*world);
  const fs::path& dir = shared.path();
  test::CkptSetup s;
  s.ownership = Ownership::Whole;
  s.muon = true;
  auto a = test::make_ckpt_optimizer(world, s);
  test::ckpt_train_step(*a, 1);
  save_checkpoint(*a, dir);
  test::CkptSetup t = s;
  t.muon_transposed = true;
  auto b = test::make_ckpt_optimizer(world, t);
  test::ckpt_train_step(*b, 1);
  const test::FullState before = test::gather_state(*b);
  test::expect_same_error(Status::LayoutMismatch, [&] { load_checkpoint(*b, dir); },
                          {"parameter 'mat0.weight' (rule Muon) was saved as a 24 x 40 matrix, "
                           "the optimizer registers it as 40 x 24"},
                          "transposed Muon matrix");
  EXPECT_TRUE(test::gather_state(*b) == before);
}

// shardopt-export reads files only: a Whole checkpoint gives the very file a Flat checkpoint of
// the same training gives (same names, 2-D shapes, values); a Muon checkpoint's matrices are
// exported with their shapes and master values.
TEST(WholeCheckpointExport, WritesTheSameFileAsFromAFlatCheckpoint) {
  auto world = test::world();
  const test::SharedDir shared(*world);
  const fs::path& dir = shared.path();
  const auto save = [&](const test::CkptSetup& s, const char* name) {
    auto opt = test::make_ckpt_optimizer(world, s);
    for (int k = 1; k <= 3; ++k) test::ckpt_train_step(*opt, k);
    save_checkpoint(*opt, dir / name);
    return test::gather_state(*opt);
  };
  test::CkptSetup flat;
  flat.shapes = true;
  test::CkptSetup whole = flat;
  whole.ownership = Ownership::Whole;
  whole.stage = Stage::Zero2;
  test::CkptSetup muon = whole;
  muon.muon = true;
  save(flat, "flat");
  save(whole, "whole");
  const test::FullState muon_state = save(muon, "muon");
  if (world->rank() == 0) {
    const auto export_to = [&](const char* name) {
      const fs::path out = dir / (std::string(name) + ".safetensors");
      const std::string cmd = std::string(SHARDOPT_EXPORT_EXE) + " '" + (dir / name).string() +
                              "' '" + out.string() + "' > /dev/null";
      EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
      return ckpt::read_whole_file(out, 1 << 24);
    };
    const std::vector<unsigned char> from_flat = export_to("flat");
    EXPECT_EQ(export_to("whole"), from_flat);
    const std::string text(from_flat.begin(), from_flat.end());
    EXPECT_NE(text.find("\"layer1.weight\":{\"dtype\":\"F32\",\"shape\":[20,15]"),
              std::string::npos);
    EXPECT_NE(text.find("\"layer2.weight\":{\"dtype\":\"F32\",\"shape\":[4097]"),
              std::string::npos);
    const std::vector<unsigned char> m = export_to("muon");
    std::uint64_t header = 0;
    std::memcpy(&header, m.data(), 8);
    const std::string head(m.begin() + 8, m.begin() + 8 + static_cast<std::ptrdiff_t>(header));
    EXPECT_NE(head.find("\"mat0.weight\":{\"dtype\":\"F32\",\"shape\":[24,40]"), std::string::npos)
        << head;
    EXPECT_NE(head.find("\"mat1.weight\":{\"dtype\":\"F32\",\"shape\":[33,17]"), std::string::npos);
    const std::vector<float>& master = muon_state.arrays[0];
    ASSERT_EQ(m.size(), 8 + header + master.size() * 4);
    EXPECT_EQ(std::memcmp(m.data() + 8 + header, master.data(), master.size() * 4), 0);
  }
}
