// state_layout.hpp: where each rule's state lives in a rank's local arrays.
//
// The local arrays (layout.hpp: master, the reduced gradient, in local order) are cut into
// runs of one rule: each parameter piece takes its group's rule, padding joins the run
// before it (leading padding the first piece's). A slot (rules.hpp) holds one element per
// local element of the runs whose rule keeps it, run after run in local order, so a
// run's slot elements are contiguous and start at RuleRun::slot_begin. A model under one
// rule is one run per rank, and its slots are as long as the local arrays.
//
// Runs depend on the rank (which pieces it owns): with mixed rules the ranks' state
// sizes differ (the planner takes the rank: PlanConfig::rank).
#pragma once

#include <array>
#include <cstddef>
#include <span>
#include <vector>

#include "rules/rules.hpp"
#include "shardopt/layout.hpp"
#include "shardopt/options.hpp"

namespace shardopt::rules {

struct RuleRun {
  Range local;  ///< in the local arrays
  Rule rule = Rule::AdamW;
  /// Where the run's first element sits in each slot the rule keeps (undefined otherwise).
  std::array<std::size_t, kNumSlots> slot_begin{};
  /// The slot index of local element x of this run.
  std::size_t slot_index(Slot s, std::size_t x) const {
    return slot_begin[static_cast<int>(s)] + (x - local.begin);
  }
};

/// The rule of each group.
std::vector<Rule> rules_of(std::span<const GroupOptions> groups);

class StateLayout {
 public:
  StateLayout() = default;
  /// The runs of `rank`'s local arrays under `stage` (data-parallel: every rank holds the
  /// whole flat buffer). `group_rules[g]` is group g's rule; groups beyond its end (or all,
  /// when it is empty) are AdamW. `layout` must be built.
  StateLayout(const FlatLayout& layout, std::span<const Rule> group_rules, Stage stage, int rank);

  std::size_t local_size() const { return local_size_; }
  std::size_t slot_elems(Slot s) const { return slot_elems_[static_cast<int>(s)]; }
  const std::vector<RuleRun>& runs() const { return runs_; }
  /// Whether some run keeps rule r.
  bool uses(Rule r) const;
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
  std::array<std::size_t, kNumSlots> slot_elems_{};
  std::size_t local_size_ = 0;
};

}  // namespace shardopt::rules
