// rules.hpp: the optimizer rule layer's registry: which state arrays each rule keeps.
//
// A rule (options.hpp: Rule) is chosen per parameter group. Its state lives in "slots":
// fp32 arrays with one element per local element of the parameters under a rule that uses
// the slot, packed in local order (StateLayout, state_layout.hpp), so a rule that keeps less
// state costs less memory. The step (rule_step.cpp) calls each rule's kernels on the runs of
// a bucket's window that use it. Adding a rule: its math header and kernels (CPU, CUDA), an
// entry here and in rule_step.cpp, its enumerator in options.hpp.
#pragma once

#include <cstdint>

#include "shardopt/optimizer.hpp"
#include "shardopt/options.hpp"

namespace shardopt::rules {

/// The fp32 state arrays a rule may keep, one element per parameter element.
enum class Slot : int { ExpAvg = 0, ExpAvgSq = 1 };
inline constexpr int kNumSlots = 2;

/// Bit s set when `rule` keeps slot s.
constexpr std::uint32_t slots_of(Rule rule) {
  switch (rule) {
    case Rule::AdamW: return 0b11u;  // exp_avg, exp_avg_sq
    case Rule::Lion: return 0b01u;   // exp_avg (the momentum)
  }
  return 0;
}
constexpr bool keeps(Rule rule, Slot s) { return (slots_of(rule) >> static_cast<int>(s)) & 1u; }

/// The slot behind a public state array (StateArray::Master has none).
constexpr Slot slot_of(StateArray a) {
  return a == StateArray::ExpAvgSq ? Slot::ExpAvgSq : Slot::ExpAvg;
}
/// The name a state array has in messages and checkpoints.
const char* state_array_name(StateArray a) noexcept;

}  // namespace shardopt::rules
