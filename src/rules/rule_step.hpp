// rule_step.hpp: the update of one bucket window under the rule layer.
//
// The step (optimizer.cpp) calls update_window() for this rank's window of each bucket; it
// cuts the window into the runs of the state layout and hands each run to its rule's
// backend kernel with that run's slot arrays and per-group scalars. A model under one rule
// is one kernel call per window, as before the layer existed.
#pragma once

#include <array>
#include <cstddef>
#include <vector>

#include "backend.hpp"
#include "rules/state_layout.hpp"
#include "shardopt/adam_math.hpp"
#include "shardopt/layout.hpp"

namespace shardopt::rules {

/// What every rule of one step shares.
struct StepInputs {
  const std::vector<GroupOptions>* groups = nullptr;
  StepHyper hyper{};          ///< lr, betas, eps, weight decay, mode, step (AdamConfig's)
  double grad_scale = 1.0;    ///< averaging x clipping x 1 / loss scale
  /// The whole-tensor rules' scratch (BufferPlan::rule_scratch: rules_scratch_floats floats;
  /// null when no parameter this rank updates needs it).
  float* scratch = nullptr;
};

/// One bucket window: `flat` (this rank's slice, or the whole bucket in data-parallel mode)
/// at local position `local`; the pointers are at the window's first element.
struct Window {
  Range flat;
  std::size_t local = 0;
  float* master = nullptr;
  const float* grad = nullptr;
  void* replica = nullptr;  ///< a copy of the new weights to write (null: the master is it)
  DType replica_dtype = DType::F32;
};

/// The parameter groups over `flat` (a part of a window) as segments tiling [0, size):
/// each piece extended over the padding after it, neighbours of one group merged, leading
/// padding in the first piece's group (group 0 where there is no piece).
struct GroupSegment {
  std::size_t begin;
  std::size_t end;
  int group;
};
std::vector<GroupSegment> group_segments(const FlatLayout& layout, Range flat);

/// Updates the window: each run's part with its rule's kernel. `slots[s]` is slot s's array
/// (null when no run keeps it).
void update_window(Backend& backend, const FlatLayout& layout, const StateLayout& state,
                   const std::array<void*, kNumSlots>& slots, const StepInputs& in,
                   const Window& w);

}  // namespace shardopt::rules
