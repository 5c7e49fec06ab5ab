// state_layout.cpp: the rule runs of a rank's local arrays and their slot offsets.
#include "rules/state_layout.hpp"

#include "rules/adafactor.hpp"
#include "rules/muon.hpp"

#include <algorithm>
#include <string>

#include "shardopt/error.hpp"

namespace shardopt::rules {

const char* state_array_name(StateArray a) noexcept {
  switch (a) {
    case StateArray::Master: return "master";
    case StateArray::ExpAvg: return "exp_avg";
    case StateArray::ExpAvgSq: return "exp_avg_sq";
  }
  return "unknown state array";
}

std::vector<Rule> param_rules(const FlatLayout& layout, std::span<const GroupOptions> groups) {
  std::vector<Rule> out;
  out.reserve(layout.num_params());
  for (const ParamInfo& p : layout.params()) {
    const std::size_t g = static_cast<std::size_t>(p.group);
    out.push_back(g < groups.size() ? param_rule(groups[g], p.numel) : Rule::AdamW);
  }
  return out;
}

double state_bytes_per_elem(Rule rule, DType param_dtype, const ParamInfo& p) {
  double bytes = param_dtype == DType::F32 ? 0.0 : 4.0;  // the fp32 master
  const bool f = factored(rule, p.rows, p.cols);
  for (int s = 0; s < kNumSlots; ++s)
    if (keeps(rule, static_cast<Slot>(s), f)) {
      const SlotInfo info = slot_info(static_cast<Slot>(s));
      const double entry = static_cast<double>(info.bytes);
      switch (info.extent) {
        case Extent::Element: bytes += entry; break;
        case Extent::Block: bytes += entry / FlatLayout::kQuantBlockElems; break;
        case Extent::Matrix:
          bytes += entry * static_cast<double>(p.rows + p.cols) / static_cast<double>(p.numel);
          break;
      }
    }
  return bytes;
}

std::vector<ParamCost> owner_costs(const FlatLayout& layout, std::span<const GroupOptions> groups,
                                   DType param_dtype) {
  const std::vector<Rule> rules = param_rules(layout, groups);
  std::vector<ParamCost> out;
  out.reserve(rules.size());
  for (std::size_t i = 0; i < rules.size(); ++i) {
    const ParamInfo& p = layout.param(i);
    const bool matrix = needs_whole(rules[i]) && p.rows > 1 && p.cols > 1;
    ParamCost c = param_cost(p, matrix, state_bytes_per_elem(rules[i], param_dtype, p));
    if (!runs_newton_schulz(rules[i])) c.ns_flops = 0;  // Adafactor: linear work, priced by state
    out.push_back(c);
  }
  return out;
}

std::size_t scratch_floats(Rule rule, const ParamInfo& p) {
  switch (rule) {
    case Rule::Muon: return p.numel + muon::workspace_floats(p.rows, p.cols);
    case Rule::Adafactor:
      return p.numel + adafactor::workspace_floats(p.rows, p.cols,
                                                   factored(Rule::Adafactor, p.rows, p.cols));
    default: return 0;
  }
}

std::size_t rules_scratch_floats(const FlatLayout& layout, std::span<const GroupOptions> groups,
                                 Stage stage, int rank) {
  const std::vector<Rule> rules = param_rules(layout, groups);
  std::size_t largest = 0;
  for (std::size_t i = 0; i < rules.size(); ++i)
    if (needs_whole(rules[i]) &&
        (stage == Stage::DataParallel || layout.param_owner(i) == rank))
      largest = std::max(largest, scratch_floats(rules[i], layout.param(i)));
  return largest;
}

std::size_t layout_align(const FlatLayout& layout, std::span<const GroupOptions> groups) {
  for (const Rule r : param_rules(layout, groups))
    if (r == Rule::AdamW8bit) return FlatLayout::kQuantBlockElems;
  return FlatLayout::kAlignElems;
}

std::size_t layout_bucket_elems(const FlatLayout& layout, std::span<const GroupOptions> groups,
                                std::size_t requested, std::size_t max_auto_elems) {
  if (requested != 0) return requested;
  std::size_t largest = 0;
  const std::vector<Rule> rules = param_rules(layout, groups);
  for (std::size_t i = 0; i < rules.size(); ++i)
    if (needs_whole(rules[i])) largest = std::max(largest, layout.param(i).numel);
  const std::size_t automatic = FlatLayout::auto_bucket_elems(layout.unpadded_size(), max_auto_elems);
  return largest > automatic ? largest : 0;  // 0: build() picks the automatic size itself
}

StateLayout::StateLayout(const FlatLayout& layout, std::span<const GroupOptions> groups,
                         Stage stage, int rank) {
  const std::vector<Rule> rules = param_rules(layout, groups);
  const bool dp = stage == Stage::DataParallel;
  local_size_ = dp ? layout.padded_size() : layout.shard_size(rank);
  std::vector<ShardPiece> pieces =
      dp ? layout.pieces_in(Range{0, layout.padded_size()}) : layout.owned_pieces(rank);
  if (dp)
    for (ShardPiece& p : pieces) p.local = p.flat;
  auto rule_of = [&](const ShardPiece& p) { return rules[p.param]; };
  auto factored_of = [&](const ShardPiece& p) {
    const ParamInfo& q = layout.param(p.param);
    return factored(rules[p.param], q.rows, q.cols);
  };
  // Each piece opens a run unless it continues the rule (and form) of the run before;
  // padding (the gaps between pieces) belongs to the run before it, leading padding to the
  // first run. Factored pieces are listed (local begin, parameter) in local order.
  std::vector<std::pair<std::size_t, std::size_t>> matrices;
  for (const ShardPiece& p : pieces) {
    const Rule r = rule_of(p);
    const bool f = factored_of(p);
    if (f) {
      const ParamInfo& q = layout.param(p.param);
      require(p.in_param.begin == 0 && p.in_param.end == q.numel, Status::InvalidArgument,
              "parameter '" + q.name + "' (" + rule_name(r) + ", " + std::to_string(q.rows) +
                  " x " + std::to_string(q.cols) + ") is cut: rank " + std::to_string(rank) +
                  " holds elements [" + std::to_string(p.in_param.begin) + ", " +
                  std::to_string(p.in_param.end) + ") of it; its factored statistics need the "
                  "whole matrix on one rank (Ownership::Whole, inside one bucket)");
      matrices.emplace_back(p.local.begin, p.param);
    }
    if (runs_.empty()) {
      runs_.push_back(RuleRun{Range{0, p.local.end}, r, f, {}});
    } else if (runs_.back().rule == r && runs_.back().factored == f) {
      runs_.back().local.end = p.local.end;
    } else {
      runs_.back().local.end = p.local.begin;
      runs_.push_back(RuleRun{p.local, r, f, {}});
    }
  }
  if (runs_.empty() && local_size_ > 0)
    runs_.push_back(RuleRun{Range{0, 0}, Rule::AdamW, false, {}});
  if (!runs_.empty()) runs_.back().local.end = local_size_;
  constexpr std::size_t kBlock = FlatLayout::kQuantBlockElems;
  std::size_t matrix_entries = 0, next = 0;  // rows + cols of the matrices so far
  for (RuleRun& run : runs_) {
    require(run.rule != Rule::AdamW8bit ||
                (run.local.begin % kBlock == 0 && run.local.end % kBlock == 0),
            Status::Internal, "StateLayout: an 8-bit run off the quantization blocks (layout "
                              "not aligned to 256?)");
    const std::size_t before = matrix_entries;
    if (run.factored)
      for (; next < matrices.size() && matrices[next].first < run.local.end; ++next) {
        const ParamInfo& q = layout.param(matrices[next].second);
        matrices_.emplace_back(matrices[next].second, matrix_entries);
        matrix_entries += q.rows + q.cols;
      }
    for (int s = 0; s < kNumSlots; ++s)
      if (keeps(run.rule, static_cast<Slot>(s), run.factored)) {
        const std::size_t k = static_cast<std::size_t>(s);
        switch (slot_info(static_cast<Slot>(s)).extent) {
          case Extent::Element:
            run.slot_begin[k] = slot_elems_[k];
            slot_elems_[k] += run.local.size();
            break;
          case Extent::Block:
            run.slot_begin[k] = slot_elems_[k];
            slot_elems_[k] += run.local.size() / kBlock;
            break;
          case Extent::Matrix:  // every Matrix slot has the same rows + cols per matrix
            run.slot_begin[k] = before;
            slot_elems_[k] += matrix_entries - before;
            break;
        }
      }
  }
  std::sort(matrices_.begin(), matrices_.end());
}

std::size_t StateLayout::matrix_slot_begin(std::size_t param) const {
  const auto it = std::lower_bound(matrices_.begin(), matrices_.end(),
                                   std::make_pair(param, std::size_t{0}));
  require(it != matrices_.end() && it->first == param, Status::Internal,
          "StateLayout: parameter " + std::to_string(param) +
              " is no factored matrix of this rank");
  return it->second;
}

bool StateLayout::uses(Rule r) const {
  return std::any_of(runs_.begin(), runs_.end(), [r](const RuleRun& run) { return run.rule == r; });
}

std::size_t StateLayout::first_run(std::size_t x) const {
  const auto it = std::upper_bound(runs_.begin(), runs_.end(), x,
                                   [](std::size_t v, const RuleRun& r) { return v < r.local.end; });
  return static_cast<std::size_t>(it - runs_.begin());
}

}  // namespace shardopt::rules
