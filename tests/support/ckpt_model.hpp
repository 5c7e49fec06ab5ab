// ckpt_model.hpp: a small deterministic training setup for checkpoint tests: an optimizer
// over odd-sized parameters (optionally Whole ownership, 2-D shapes, a Muon group and
// Adafactor in group 1),
// gradients that do not depend on the rank (so the averaged gradient is exact at world sizes
// 1, 2 and 4, and at 3: see ckpt_train_step), the full state gathered for bitwise
// comparisons, and the model of the committed format-1 fixture.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "shardopt/optimizer.hpp"
#include "support/reference.hpp"
// Which state a rank holds, from the one function the checkpoint code asks too (internal
// header, by path: not every user of this file has src/ on its include path).
#include "../../src/checkpoint/pieces.hpp"
#include "../../src/rules/rules.hpp"

namespace shardopt::test {

inline const std::vector<std::size_t>& ckpt_sizes() {
  static const std::vector<std::size_t> s = {5, 300, 4097, 64, 129, 1, 777};
  return s;
}

struct CkptSetup {
  Stage stage = Stage::Zero1;
  DType dtype = DType::BF16;
  LossScaling loss_scaling{};
  Rule rule1 = Rule::AdamW;  ///< group 1's rule (parameters 1, 3, 5)
  /// Group 1's options when rule1 is Adafactor (needs Ownership::Whole; with `shapes`,
  /// parameters 1 and 3 keep factored statistics and 5 a per-element variance).
  AdafactorConfig adafactor_config{};
  /// Group 1's adamw8bit.min_8bit_numel (64: parameters 1 and 3 keep 8-bit state, 5 fp32).
  std::size_t min_8bit_numel = 64;
  /// Flat, or Whole (every parameter inside a bucket on one rank: ownership.hpp).
  Ownership ownership = Ownership::Flat;
  /// Parameter 1 registered as a 20 x 15 matrix and parameter 3 as 8 x 8 (else 1-D).
  bool shapes = false;
  /// Adds group 2, Rule::Muon with `muon`, and its matrices ckpt_muon_shapes() as parameters
  /// 7 and 8 (needs Ownership::Whole).
  bool muon = false;
  MuonConfig muon_config{};
  bool muon_transposed = false;  ///< registers the Muon matrices as cols x rows instead
};

/// Whole ownership with the Muon group and 2-D shapes (stage 1, bf16 replica): the crash test's
/// Whole layout.
inline CkptSetup whole_muon_setup() {
  CkptSetup s;
  s.ownership = Ownership::Whole;
  s.shapes = true;
  s.muon = true;
  return s;
}

/// Whole ownership with Adafactor in group 1 and 2-D shapes (stage 1, bf16 replica): two
/// factored matrices and a 1-D Adafactor parameter next to AdamW (the fuzz corpus's seed).
inline CkptSetup whole_adafactor_setup() {
  CkptSetup s;
  s.ownership = Ownership::Whole;
  s.shapes = true;
  s.rule1 = Rule::Adafactor;
  return s;
}

/// The Muon matrices of CkptSetup::muon (rows x cols): each fits a bucket of 1000 elements.
inline const std::vector<Shape2D>& ckpt_muon_shapes() {
  static const std::vector<Shape2D> s = {{24, 40}, {33, 17}};
  return s;
}

inline std::unique_ptr<ShardedOptimizer> make_ckpt_optimizer(std::shared_ptr<Communicator> comm,
                                                             const CkptSetup& s) {
  OptimizerOptions o;
  o.stage = s.stage;
  o.param_dtype = s.dtype;
  o.adam.lr = 1e-2;
  o.adam.weight_decay = 0.05;
  o.bucket_elems = 1000;
  o.loss_scaling = s.loss_scaling;
  o.ownership = s.ownership;
  auto opt = std::make_unique<ShardedOptimizer>(std::move(comm), o);
  GroupOptions g1;
  g1.lr_scale = 0.5;
  g1.weight_decay = false;
  g1.rule = s.rule1;
  g1.adamw8bit.min_8bit_numel = s.min_8bit_numel;
  g1.adafactor = s.adafactor_config;
  opt->add_group(g1);
  const auto& sizes = ckpt_sizes();
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const std::string name = "layer" + std::to_string(i) + ".weight";
    const int group = static_cast<int>(i % 2);
    if (s.shapes && i == 1) opt->add_param(name, Shape2D{20, 15}, group);
    else if (s.shapes && i == 3) opt->add_param(name, Shape2D{8, 8}, group);
    else opt->add_param(name, sizes[i], group);
  }
  if (s.muon) {
    GroupOptions g2;
    g2.rule = Rule::Muon;
    g2.muon = s.muon_config;
    const int muon = opt->add_group(g2);
    for (std::size_t j = 0; j < ckpt_muon_shapes().size(); ++j) {
      const Shape2D m = ckpt_muon_shapes()[j];
      opt->add_param("mat" + std::to_string(j) + ".weight",
                     s.muon_transposed ? Shape2D{m.cols, m.rows} : m, muon);
    }
  }
  opt->finalize();
  for (std::size_t i = 0; i < opt->layout().num_params(); ++i) {
    std::vector<float> init(opt->layout().param(i).numel);
    for (std::size_t k = 0; k < init.size(); ++k) init[k] = synth(7, 0, i, k);
    opt->set_param(i, init);
  }
  return opt;
}

/// One training step with rank-independent gradients (multiples of 2^-10), given in
/// backward order so that stage 2 works too. N ranks sum N equal values exactly (a few bits
/// each) and the step scales the sum by fp32(1/N): at N = 3 that is 3g(1 + 2^-25), which
/// rounds back to g, so the averaged gradient is g at every world size.
inline StepResult ckpt_train_step(ShardedOptimizer& opt, int step) {
  for (std::size_t i = opt.layout().num_params(); i-- > 0;) {
    std::span<float> g = opt.grad(i);
    for (std::size_t k = 0; k < g.size(); ++k)
      g[k] = std::round(synth(11, static_cast<std::uint64_t>(step), i, k) * 1024.0f) / 1024.0f;
    opt.grad_ready(i);
  }
  return opt.step();
}

/// The model of the committed format-1 fixture (tests/data/ckpt_v1, written by
/// tests/data/make_ckpt_fixture.cpp): its parameters must never change. Parameter 2 straddles
/// the boundary of the two shards the fixture was saved with.
inline const std::vector<std::size_t>& fixture_sizes() {
  static const std::vector<std::size_t> s = {5, 300, 1000, 64, 129, 1, 77};
  return s;
}

inline std::unique_ptr<ShardedOptimizer> make_fixture_optimizer(std::shared_ptr<Communicator> comm,
                                                                Stage stage) {
  OptimizerOptions o;
  o.stage = stage;
  o.param_dtype = DType::BF16;
  o.adam.lr = 1e-2;
  o.adam.weight_decay = 0.05;
  o.bucket_elems = 500;
  o.loss_scaling.enabled = true;
  o.loss_scaling.initial_scale = 4096.0;
  auto opt = std::make_unique<ShardedOptimizer>(std::move(comm), o);
  opt->add_group(GroupOptions{0.5, false});
  const auto& sizes = fixture_sizes();
  for (std::size_t i = 0; i < sizes.size(); ++i)
    opt->add_param("fixture.p" + std::to_string(i), sizes[i], static_cast<int>(i % 2));
  opt->finalize();
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    std::vector<float> init(sizes[i]);
    for (std::size_t k = 0; k < init.size(); ++k) init[k] = synth(5, 0, i, k);
    opt->set_param(i, init);
  }
  return opt;
}

/// A fresh directory every rank sees at the same path, removed at the end (collective).
class SharedDir {
 public:
  explicit SharedDir(Communicator& comm) : comm_(comm) {
    char name[256] = {};
    if (comm.rank() == 0) {
      std::string tmpl = (std::filesystem::temp_directory_path() / "shardopt-ckpt-XXXXXX").string();
      if (!mkdtemp(tmpl.data())) std::abort();
      std::snprintf(name, sizeof name, "%s", tmpl.c_str());
    }
    comm.broadcast_bytes(name, sizeof name, 0);
    path_ = name;
  }
  ~SharedDir() {
    comm_.barrier();
    if (comm_.rank() == 0) std::filesystem::remove_all(path_);
  }
  SharedDir(const SharedDir&) = delete;
  SharedDir& operator=(const SharedDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  Communicator& comm_;
  std::filesystem::path path_;
};

/// The full state (master, exp_avg, exp_avg_sq, each per parameter, concatenated in
/// parameter order; AdamW8bit parameters' exp_avg and exp_avg_sq dequantized) on every rank,
/// and AdamW8bit's raw state: codes per element (0 elsewhere), scales per quantization block
/// of the 8-bit parameters in order, and Adafactor's factored statistics: row_var then
/// col_var of each factored matrix in parameter order. Collective.
struct FullState {
  std::vector<float> arrays[3];
  std::vector<std::uint8_t> codes[2];
  std::vector<float> scales[2];
  std::vector<float> factors;
  std::int64_t step = 0;
  bool operator==(const FullState& o) const {
    for (int a = 0; a < 3; ++a)
      if (arrays[a].size() != o.arrays[a].size() ||
          std::memcmp(arrays[a].data(), o.arrays[a].data(), arrays[a].size() * 4) != 0)
        return false;
    if (factors.size() != o.factors.size() ||
        (!factors.empty() && std::memcmp(factors.data(), o.factors.data(), factors.size() * 4) != 0))
      return false;
    for (int x = 0; x < 2; ++x)  // (no 8-bit state: empty vectors, whose data() may be null)
      if (codes[x] != o.codes[x] || scales[x].size() != o.scales[x].size() ||
          (!scales[x].empty() &&
           std::memcmp(scales[x].data(), o.scales[x].data(), scales[x].size() * 4) != 0))
        return false;
    return step == o.step;
  }
};

inline FullState gather_state(ShardedOptimizer& opt) {
  constexpr std::size_t kQ = 256;
  const FlatLayout& l = opt.layout();
  std::vector<std::size_t> out_offset, block_offset;
  std::size_t total = 0, blocks = 0;
  bool any8 = false;
  for (std::size_t i = 0; i < l.num_params(); ++i) {
    out_offset.push_back(total);
    block_offset.push_back(blocks);
    total += l.param(i).numel;
    if (opt.rule_of(i) == Rule::AdamW8bit) {
      blocks += (l.param(i).numel + kQ - 1) / kQ;
      any8 = true;
    }
  }
  FullState st;
  st.step = opt.step_count();
  const bool everyone_owns_all = opt.options().stage == Stage::DataParallel;
  const std::size_t local = ckpt::owned_state_elems(opt);
  const auto pieces = ckpt::owned_pieces(opt, ckpt::PieceSet::Held);
  // One owner per element: the sum is exact (data-parallel ranks all hold everything).
  const auto reduce = [&](std::vector<double>& v) {
    if (!everyone_owns_all) opt.comm().all_reduce_sum_host(v.data(), v.size());
  };
  for (int a = 0; a < 3; ++a) {
    std::vector<float> mine(local);
    opt.copy_state_to_host(static_cast<StateArray>(a), 0, mine);
    std::vector<double> full(total, 0.0);
    for (const ShardPiece& p : pieces)
      for (std::size_t k = 0; k < p.in_param.size(); ++k)
        full[out_offset[p.param] + p.in_param.begin + k] = mine[p.local.begin + k];
    reduce(full);
    st.arrays[a].assign(full.begin(), full.end());
  }
  for (std::size_t i = 0; i < l.num_params(); ++i) {
    const ParamInfo& p = l.param(i);
    if (!rules::factored(opt.rule_of(i), p.rows, p.cols)) continue;
    std::vector<float> f(p.rows + p.cols);
    opt.get_factored_state(i, std::span<float>(f).first(p.rows), std::span<float>(f).last(p.cols));
    st.factors.insert(st.factors.end(), f.begin(), f.end());
  }
  if (!any8) return st;
  std::vector<std::uint8_t> codes[2];
  std::vector<float> scales[2];
  for (int x = 0; x < 2; ++x) {
    codes[x].resize(local);
    scales[x].resize((local + kQ - 1) / kQ);
  }
  opt.copy_q8_state_to_host(0, local, {codes[0].data(), codes[1].data(), scales[0].data(),
                                       scales[1].data()});
  for (int x = 0; x < 2; ++x) {
    std::vector<double> c(total, 0.0), s(blocks, 0.0);
    for (const ShardPiece& p : pieces) {
      if (opt.rule_of(p.param) != Rule::AdamW8bit) continue;
      for (std::size_t k = 0; k < p.in_param.size(); ++k)
        c[out_offset[p.param] + p.in_param.begin + k] = codes[x][p.local.begin + k];
      for (std::size_t j = 0; j < (p.in_param.size() + kQ - 1) / kQ; ++j)
        s[block_offset[p.param] + p.in_param.begin / kQ + j] = scales[x][p.local.begin / kQ + j];
    }
    reduce(c);
    reduce(s);
    st.codes[x].assign(c.begin(), c.end());
    st.scales[x].assign(s.begin(), s.end());
  }
  return st;
}

/// Sends rank 0's state to every rank of comm (collective).
inline void broadcast_state(Communicator& comm, FullState& s) {
  const auto send = [&](auto& v) {
    std::uint64_t n = v.size();
    comm.broadcast_bytes(&n, sizeof n, 0);
    v.resize(n);
    if (n > 0) comm.broadcast_bytes(v.data(), n * sizeof(v[0]), 0);
  };
  for (auto& a : s.arrays) send(a);
  for (auto& c : s.codes) send(c);
  for (auto& x : s.scales) send(x);
  send(s.factors);
  comm.broadcast_bytes(&s.step, sizeof s.step, 0);
}

}  // namespace shardopt::test
