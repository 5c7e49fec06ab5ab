// rules.hpp: the optimizer rule layer's registry: which state arrays each rule keeps.
//
// A rule (options.hpp: Rule) is chosen per parameter group; a parameter's effective rule is
// its group's, except that AdamW8bit parameters below the group's min_8bit_numel run AdamW
// (param_rule). Its state lives in "slots": arrays with one entry per local element (or per
// 256-element quantization block, or rows + cols per factored matrix: Extent) of the
// parameters under a rule that uses the slot, packed
// in local order (StateLayout, state_layout.hpp), so a rule that keeps less state costs less
// memory. The step (rule_step.cpp) calls each rule's kernel on the runs of a bucket's window
// that use it. Adding a rule: its math header and kernels, an entry here and in
// rule_step.cpp, its enumerator in options.hpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "shardopt/layout.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/options.hpp"

namespace shardopt::rules {

/// The state arrays a rule may keep.
enum class Slot : int {
  ExpAvg = 0,    ///< fp32 per element: AdamW's first moment, Lion's and Muon's momentum
  ExpAvgSq = 1,  ///< fp32 per element: AdamW's second moment, Adafactor's unfactored variance
  CodeM = 2,     ///< u8 per element: AdamW8bit's exp_avg codes (signed map)
  CodeV = 3,     ///< u8 per element: AdamW8bit's exp_avg_sq codes (unsigned map)
  ScaleM = 4,    ///< fp32 per 256-element block: AdamW8bit's exp_avg scales
  ScaleV = 5,    ///< fp32 per block: AdamW8bit's exp_avg_sq scales
  /// fp32 per factored matrix, rows + cols entries: Adafactor's row_var (rows floats), then
  /// its col_var (cols floats). Sized by the shape, not the elements.
  Factors = 6,
};
inline constexpr int kNumSlots = 7;

/// What a slot keeps one entry per.
enum class Extent : std::uint8_t {
  Element,  ///< local element (padding included)
  Block,    ///< FlatLayout::kQuantBlockElems local elements
  Matrix,   ///< rows + cols entries per (whole) factored matrix; padding keeps none
};

struct SlotInfo {
  const char* name;
  std::size_t bytes;  ///< per entry
  Extent extent;
};
constexpr SlotInfo slot_info(Slot s) {
  switch (s) {
    case Slot::ExpAvg: return {"exp_avg", 4, Extent::Element};
    case Slot::ExpAvgSq: return {"exp_avg_sq", 4, Extent::Element};
    case Slot::CodeM: return {"exp_avg codes", 1, Extent::Element};
    case Slot::CodeV: return {"exp_avg_sq codes", 1, Extent::Element};
    case Slot::ScaleM: return {"exp_avg scales", 4, Extent::Block};
    case Slot::ScaleV: return {"exp_avg_sq scales", 4, Extent::Block};
    case Slot::Factors: return {"row_var and col_var", 4, Extent::Matrix};
  }
  return {"unknown slot", 0, Extent::Element};
}

/// Bit s set when `rule` keeps slot s for a parameter that is `factored` (factored():
/// Adafactor's 2-D parameters, which keep Factors instead of a per-element variance).
constexpr std::uint32_t slots_of(Rule rule, bool factored = false) {
  switch (rule) {
    case Rule::AdamW: return 0b0000011u;      // exp_avg, exp_avg_sq
    case Rule::Lion: return 0b0000001u;       // exp_avg (the momentum)
    case Rule::AdamW8bit: return 0b0111100u;  // codes and scales of both
    case Rule::Muon: return 0b0000001u;       // exp_avg (the momentum)
    case Rule::Adafactor: return factored ? 0b1000000u : 0b0000010u;  // factors, or variance
  }
  return 0;
}
constexpr bool keeps(Rule rule, Slot s, bool factored = false) {
  return (slots_of(rule, factored) >> static_cast<int>(s)) & 1u;
}
/// Whether a parameter of shape rows x cols under `rule` keeps factored state: Adafactor's
/// 2-D parameters (rows > 1 and cols > 1; a 1 x n parameter is a vector here).
constexpr bool factored(Rule rule, std::size_t rows, std::size_t cols) {
  return rule == Rule::Adafactor && rows > 1 && cols > 1;
}

/// The rule parameter of `numel` elements in group `g` is updated with.
constexpr Rule param_rule(const GroupOptions& g, std::size_t numel) {
  return g.rule == Rule::AdamW8bit && numel < g.adamw8bit.min_8bit_numel ? Rule::AdamW : g.rule;
}
/// The rule of each parameter of `layout` (groups beyond `groups` are default AdamW).
std::vector<Rule> param_rules(const FlatLayout& layout, std::span<const GroupOptions> groups);
/// The alignment the layout needs: FlatLayout::kQuantBlockElems when some parameter keeps
/// 8-bit state, else kAlignElems.
std::size_t layout_align(const FlatLayout& layout, std::span<const GroupOptions> groups);

/// The bucket_elems to build `layout` with: `requested`, except that an automatic size (0)
/// is raised to the largest Muon matrix when FlatLayout::auto_bucket_elems(registered
/// elements, max_auto_elems) is smaller, so that every matrix fits one bucket (a Muon matrix
/// must be whole in one bucket; plan_ownership raises its automatic size the same way), and
/// likewise to the largest Adafactor parameter (each must be whole in one bucket).
std::size_t layout_bucket_elems(const FlatLayout& layout, std::span<const GroupOptions> groups,
                                std::size_t requested, std::size_t max_auto_elems);
/// Whole-tensor ownership (ownership.hpp): whether `rule` needs every element of a parameter
/// on the rank that updates it: Muon (Newton-Schulz of 2-D matrices) and Adafactor (row and
/// column statistics of 2-D parameters; RMS(p) and RMS(u) of every parameter, 1-D included).
/// The hook for matrix rules: owner_costs() then prices their groups' 2-D parameters as
/// matrices so that assign_owners gives each one a single owner and never lets it span
/// buckets, and finalize() refuses them on a Flat layout or across buckets.
constexpr bool needs_whole(Rule rule) { return rule == Rule::Muon || rule == Rule::Adafactor; }
/// Whether `rule` runs Newton-Schulz on its matrices (Muon): owner_costs() prices those in
/// Newton-Schulz flops; other matrix rules' work is linear in the elements (0 flops there).
constexpr bool runs_newton_schulz(Rule rule) { return rule == Rule::Muon; }
/// The fp32 scratch a backend needs to update parameter `p` under `rule` whole: Muon the scaled
/// gradient and Newton-Schulz's workspace (rows cols + muon::workspace_floats), Adafactor the
/// scaled gradient and the device reduction's workspace (numel + adafactor::workspace_floats:
/// the same on every device, so plan_memory needs no device); 0 for the element-wise rules. The optimizer allocates the largest
/// over the parameters a rank updates (rules_scratch_floats) at finalize, in the memory
/// report as Scratch, and passes it to Backend::muon_update / adafactor_update.
std::size_t scratch_floats(Rule rule, const ParamInfo& p);
/// The largest scratch_floats over the parameters rank `rank` updates: every parameter at
/// stage 0 (data-parallel), its owned ones otherwise (a whole-tensor rule needs a Whole layout
/// with owners applied: FlatLayout::param_owner).
std::size_t rules_scratch_floats(const FlatLayout& layout, std::span<const GroupOptions> groups,
                                 Stage stage, int rank);
/// Bytes of state (and fp32 master when the replica is bf16) parameter `p` under `rule`
/// keeps per element on its owner (a factored matrix: 4 (rows + cols) / numel of state).
double state_bytes_per_elem(Rule rule, DType param_dtype, const ParamInfo& p);
/// The costs assign_owners prices the parameters of `layout` with (one per parameter): a
/// parameter is a matrix when needs_whole(its rule) and it has a 2-D shape; its state bytes
/// are its rule's. finalize() and plan_memory() both cut Whole layouts with these.
std::vector<ParamCost> owner_costs(const FlatLayout& layout, std::span<const GroupOptions> groups,
                                   DType param_dtype);

/// The public state arrays: ExpAvg / ExpAvgSq are fp32 values under every rule (AdamW8bit's
/// dequantized); which slot holds them under `rule` (AdamW8bit: its codes).
constexpr Slot slot_of(StateArray a, Rule rule) {
  if (rule == Rule::AdamW8bit) return a == StateArray::ExpAvgSq ? Slot::CodeV : Slot::CodeM;
  return a == StateArray::ExpAvgSq ? Slot::ExpAvgSq : Slot::ExpAvg;
}
/// Whether a parameter under `rule` (`factored`: see factored()) has state array `a`
/// (Master: always; a factored matrix's row_var and col_var are no per-element array:
/// ShardedOptimizer::get_factored_state).
constexpr bool has(Rule rule, StateArray a, bool factored = false) {
  return a == StateArray::Master || keeps(rule, slot_of(a, rule), factored);
}
/// The name a state array has in messages and checkpoints.
const char* state_array_name(StateArray a) noexcept;

}  // namespace shardopt::rules
