// state_layout.hpp: where each rule's state lives in a rank's local arrays.
//
// The local arrays (layout.hpp: master, the reduced gradient, in local order) are cut into
// runs of one rule: each parameter piece takes its parameter's rule (param_rule), padding
// joins the run before it (leading padding the first piece's). A slot (rules.hpp) holds one
// entry per local element (per 256-element block for per-block slots) of the runs whose rule
// keeps it, run after run in local order, so a run's slot entries are contiguous and start
// at RuleRun::slot_begin. A model under one rule is one run per rank, and its per-element
// slots are as long as the local arrays. AdamW8bit runs start and end on block boundaries
// (the layout is aligned to 256 then), so their blocks are their parameters' blocks.
//
// A run is also either factored or not (factored(): Adafactor's 2-D parameters, whose state
// is sized by their shape). A factored run holds whole matrices only (whole-tensor
// ownership: finalize() refuses anything else) and keeps, per matrix in local order, rows +
// cols entries of each Extent::Matrix slot (matrix_slot_begin()); its padding keeps none.
//
// Runs depend on the rank (which pieces it owns): with mixed rules the ranks' state
// sizes differ (the planner takes the rank: PlanConfig::rank).
#pragma once

#include <array>
#include <cstddef>
#include <span>
#include <utility>
#include <vector>

#include "rules/rules.hpp"
#include "shardopt/layout.hpp"
#include "shardopt/options.hpp"

namespace shardopt::rules {

struct RuleRun {
  Range local;  ///< in the local arrays
  Rule rule = Rule::AdamW;
  bool factored = false;  ///< its parameters keep factored state (factored())
  /// Where the run's first element sits in each slot the rule keeps (undefined otherwise).
  std::array<std::size_t, kNumSlots> slot_begin{};
  /// The slot index of local element x of this run (per-block slots: of its block). Not for
  /// Extent::Matrix slots (StateLayout::matrix_slot_begin).
  std::size_t slot_index(Slot s, std::size_t x) const {
    const std::size_t off = x - local.begin;
    return slot_begin[static_cast<int>(s)] +
           (slot_info(s).extent == Extent::Block ? off / FlatLayout::kQuantBlockElems : off);
  }
};

class StateLayout {
 public:
  StateLayout() = default;
  /// The runs of `rank`'s local arrays under `stage` (data-parallel: every rank holds the
  /// whole flat buffer); groups beyond `groups` (all, when it is empty) are AdamW. `layout`
  /// must be built (with layout_align()'s alignment).
  StateLayout(const FlatLayout& layout, std::span<const GroupOptions> groups, Stage stage,
              int rank);

  std::size_t local_size() const { return local_size_; }
  /// Entries of slot s, and its bytes.
  std::size_t slot_elems(Slot s) const { return slot_elems_[static_cast<int>(s)]; }
  std::size_t slot_bytes(Slot s) const { return slot_elems(s) * slot_info(s).bytes; }
  const std::vector<RuleRun>& runs() const { return runs_; }
  /// Whether some run keeps rule r.
  bool uses(Rule r) const;
  /// Where factored parameter `param`'s rows + cols entries start in each Extent::Matrix slot
  /// (row_var first, then col_var); Error(Internal) when this rank holds no such matrix.
  std::size_t matrix_slot_begin(std::size_t param) const;
  /// f(run, part) for every run overlapping `local`, in order; part is the overlap.
  template <class F>
  void for_each_run(Range local, F&& f) const {
    for (std::size_t k = first_run(local.begin); k < runs_.size(); ++k) {
      const Range part = runs_[k].local.intersect(local);
      if (runs_[k].local.begin >= local.end) break;
      if (!part.empty()) f(runs_[k], part);
    }
  }

 private:
  std::size_t first_run(std::size_t x) const;  // the run holding x (runs_.size() if none)
  std::vector<RuleRun> runs_;
  /// (parameter, its first entry in the Extent::Matrix slots), sorted by parameter.
  std::vector<std::pair<std::size_t, std::size_t>> matrices_;
  std::array<std::size_t, kNumSlots> slot_elems_{};
  std::size_t local_size_ = 0;
};

}  // namespace shardopt::rules
