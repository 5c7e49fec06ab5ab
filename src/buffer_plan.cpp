// buffer_plan.cpp: the single computation of every buffer's size.
#include "buffer_plan.hpp"

#include <algorithm>

#include "exact_sum.hpp"
#include "rules/rules.hpp"
#include "rules/state_layout.hpp"

namespace shardopt {

BufferPlan plan_buffers(const FlatLayout& layout, Stage stage, DType param_dtype,
                        int buckets_in_flight, int units_in_flight, Reduction reduction,
                        DType reduce_dtype, std::span<const GroupOptions> groups, int rank,
                        Device device) {
  constexpr std::size_t f32 = sizeof(float);
  const std::size_t padded = layout.padded_size();
  BufferPlan p;
  p.local_elems = stage == Stage::DataParallel ? padded : layout.shard_size(rank);
  const std::size_t psize = dtype_size(param_dtype);
  const bool zero3 = stage == Stage::Zero3;
  p.replica = {MemCategory::Params, (zero3 ? p.local_elems : padded) * psize, false};
  if (zero3) {
    p.unit_elems = layout.max_unit_elems();
    p.unit_buffers = static_cast<int>(
        std::min(layout.num_units(), static_cast<std::size_t>(std::max(1, units_in_flight))));
    p.units = {MemCategory::Params,
               static_cast<std::size_t>(p.unit_buffers) * p.unit_elems * psize, false};
  }

  const bool reproducible = reduction == Reduction::Reproducible;
  const bool sharded = reproducible && exact::sharded_stage2(layout, stage, device);
  if ((stage == Stage::Zero2 || zero3) && (!reproducible || sharded)) {
    // Slots hold the largest buckets that can be in flight at once; at most as many as there
    // are buckets.
    std::vector<std::size_t> sizes;
    for (const Bucket& b : layout.buckets()) sizes.push_back(b.flat.size());
    std::sort(sizes.begin(), sizes.end(), std::greater<>());
    const std::size_t slots =
        std::min(sizes.size(), static_cast<std::size_t>(std::max(1, buckets_in_flight)));
    const std::size_t staging = slots * sizes.front();
    // Staging pays off only if shard + staging stays below the full buffer; otherwise (one
    // rank, or a model of one or two buckets) stage 2 keeps stage 1's full buffer, so it
    // never needs more memory than stage 1. Stage 3 keeps no full-size buffer on more than
    // one rank (on one, the full buffer is the shard).
    // (The largest rank's shard: with Whole ownership shards differ, the scheme must not.)
    const std::size_t largest_shard = layout.shard_size();
    if (layout.world_size() > 1 && (zero3 || largest_shard + staging < padded)) {
      p.grads_scheme = GradScheme::Staged;
      p.slots = static_cast<int>(slots);
      p.slot_elems = sizes.front();
      p.staging = {MemCategory::Scratch, staging * f32, false};
      // (The sharded exact accumulation exchanges every micro-batch: it never accumulates.)
      if (!zero3 && !sharded) p.accumulate = {MemCategory::Grads, padded * f32, true};
      std::size_t spill = 0;
      for (const ParamInfo& q : layout.params())
        if (q.buckets.size() > 1) spill = std::max(spill, q.numel);
      p.spill = {MemCategory::Scratch, spill * f32, true};
    }
  }
  p.grads = {MemCategory::Grads,
             (p.grads_scheme == GradScheme::Staged ? p.local_elems : padded) * f32, false};
  if (reproducible && p.grads_scheme == GradScheme::Staged) {
    // The sharded exact accumulation: packed words of the owned elements, from finalize
    // (every step deposits into them), widened on demand into their bins past 63 values per
    // element; no wire buffer; 4 bytes per element and micro-batch on the wire.
    p.exact_sharded = true;
    p.exact = {MemCategory::Grads, exact::packed_bytes(p.local_elems), false};
    p.exact_wide = {MemCategory::Grads, exact::grads_bytes(p.local_elems, 0), true};
  } else if (reproducible) {
    std::size_t max_bucket = 0;
    for (const Bucket& b : layout.buckets()) max_bucket = std::max(max_bucket, b.flat.size());
    // On demand, unless ragged buckets (whole-tensor ownership, stages 1-3) take the
    // two-phase method at every step: then finalize allocates the bins. The CPU otherwise
    // accumulates in the packed words, widened into the bins when needed.
    const bool ragged = exact::ragged_buckets(layout, stage == Stage::DataParallel);
    p.exact_compact = device == Device::Cpu && !ragged;
    if (p.exact_compact) {
      p.exact = {MemCategory::Grads, exact::packed_bytes(padded), true};
      p.exact_wide = {MemCategory::Grads, exact::grads_bytes(padded, max_bucket), true};
    } else {
      p.exact = {MemCategory::Grads, exact::grads_bytes(padded, max_bucket), !ragged};
    }
    p.exact_wire = {MemCategory::Scratch, max_bucket * sizeof(std::uint64_t), false};
  }
  p.reduce_bytes = padded * (reduce_dtype == DType::BF16 && !reproducible ? 2 : 4);
  p.reduce_bytes_accumulated = reproducible && !p.exact_sharded ? padded * 8 : p.reduce_bytes;
  p.reduce_bytes_in_place = reproducible && p.exact_compact && !p.exact_sharded
                                ? padded * (sizeof(std::uint64_t) + sizeof(float))
                                : p.reduce_bytes_accumulated;
  if (param_dtype != DType::F32) p.master = {MemCategory::Master, p.local_elems * f32, false};
  p.rule_scratch = {MemCategory::Scratch,
                    rules::rules_scratch_floats(layout, groups, stage, rank) * f32, false};
  const rules::StateLayout state(layout, groups, stage, rank);
  static_assert(rules::kNumSlots == std::tuple_size_v<decltype(p.state)>);
  for (int s = 0; s < rules::kNumSlots; ++s)
    p.state[static_cast<std::size_t>(s)] = {MemCategory::Moments,
                                            state.slot_bytes(static_cast<rules::Slot>(s)), false};
  return p;
}

}  // namespace shardopt
