// buffer_plan.hpp: every buffer the optimizer allocates, sized once from the layout and the
// options. ShardedOptimizer::finalize() allocates from it and plan_memory() reports it, so
// the planner and the real accounting cannot drift apart.
#pragma once

#include <array>
#include <cstddef>
#include <span>
#include <vector>

#include "shardopt/layout.hpp"
#include "shardopt/memory.hpp"
#include "shardopt/options.hpp"

namespace shardopt {

/// Where the gradients of a step live.
enum class GradScheme {
  /// One full fp32 buffer (flat layout); each bucket is reduced in place and this rank's
  /// slices of it are the reduced gradient. Data-parallel, stage 1, and stage 2 where the
  /// staging would not save memory (one rank, or one bucket holding most of the model).
  Full,
  /// Stage 2 (and stage 3 on more than one rank): backward writes into bucket-sized staging
  /// slots; each slot is reduce-scattered and this rank's slice added into the owned
  /// gradient shard (padded / N elements).
  Staged,
};

struct BufferSpec {
  MemCategory category = MemCategory::Scratch;
  std::size_t bytes = 0;
  /// Allocated only when first needed (see BufferPlan); not part of finalize()'s memory.
  bool on_demand = false;
};

struct BufferPlan {
  GradScheme grads_scheme = GradScheme::Full;
  /// Reduction::Reproducible at stage 2 on the CPU with equal slices (exact::sharded_stage2):
  /// the staged scheme; every micro-batch's bucket goes by the direct exchange to its owners,
  /// which deposit every rank's raw values into bins of their owned elements only (`exact`:
  /// exact::grads_bytes(local_elems, 0)), rounded once at the step. No full-size buffer.
  bool exact_sharded = false;
  std::size_t local_elems = 0;      ///< length of the local arrays (master, m, v)
  std::size_t slot_elems = 0;       ///< Staged: one staging slot (the largest bucket)
  int slots = 0;                    ///< Staged: staging slots
  BufferSpec replica;               ///< the full replica (stage 3: this rank's slices), param dtype
  std::size_t unit_elems = 0;       ///< stage 3: one gathered unit (the largest unit)
  int unit_buffers = 0;             ///< stage 3: units_in_flight, at most the number of units
  BufferSpec units;                 ///< stage 3: unit_buffers x unit_elems, param dtype
  BufferSpec grads;                 ///< Full: the full gradient; Staged: the owned shard
  BufferSpec staging;               ///< Staged: slots x slot_elems fp32
  BufferSpec master;                ///< absent (0 bytes) when the fp32 replica is the master
  /// The rules' state slots (rules/rules.hpp, in Slot order; rules/state_layout.hpp): exp_avg
  /// for the elements under AdamW or Lion, exp_avg_sq for those under AdamW (fp32 each),
  /// AdamW8bit's codes (a byte per element each) and block scales, Adafactor's row and column
  /// variances (rows + cols fp32 per factored matrix). Moments, allocated only when some local
  /// element keeps them.
  std::array<BufferSpec, 7> state;
  /// The whole-tensor rules' scratch (rules::rules_scratch_floats fp32: Muon's scaled
  /// gradient and Newton-Schulz workspace, Adafactor's scaled gradient) of the largest
  /// parameter this rank updates; 0 without Muon or Adafactor.
  BufferSpec rule_scratch;
  /// Stage 2 staged, on demand: micro-batches that accumulate without synchronising (full
  /// size). Stage 3 never needs it: every micro-batch is reduce-scattered into the shard.
  BufferSpec accumulate;
  /// Staged, on demand: a grad(i) view of a parameter that spans several buckets (its size).
  BufferSpec spill;
  /// Reduction::Reproducible, on demand: the exact accumulator, accounted as Grads, allocated
  /// (local memory) by the first micro-batch or step that needs it. On the CPU without ragged
  /// buckets (exact_compact) it is the compact form (exact::packed_bytes: 8 bytes per flat
  /// element), needed by a second micro-batch on this rank; otherwise the bins
  /// (exact::grads_bytes: 17 bytes per flat element and one byte per element of the largest
  /// bucket), needed by a second micro-batch or a step that takes the two-phase method; with
  /// ragged buckets (whole-tensor ownership at stages 1-3, exact::ragged_buckets) every step
  /// takes it for them, and finalize() allocates it (not on demand). The mode keeps the
  /// full fp32 gradient buffer (GradScheme::Full), except on the sharded stage-2 path
  /// (exact_sharded: packed words of the owned elements only, from finalize).
  BufferSpec exact;
  /// exact is the compact form (ExactGrads::compact): the CPU, no ragged bucket, not sharded.
  bool exact_compact = false;
  /// exact_compact, on demand: the bins (exact::grads_bytes) that the compact form widens into
  /// past cpu::kPackedMaxMicroBatches micro-batches on this rank, or for a step that takes
  /// the two-phase method; the words are then released and the bins kept. exact_sharded:
  /// the owned elements' bins (grads_bytes(owned, 0)), past cpu::kPackedMaxMicroBatches
  /// values per element in a step (ranks times rounds).
  BufferSpec exact_wide;
  /// Reduction::Reproducible: the packed exchange's wire buffer (8 bytes per element of the
  /// largest bucket), allocated collectively at finalize (a shared-memory window on one node).
  BufferSpec exact_wire;
  /// Payload bytes of one reduction of every bucket (per rank): 4 per element with an fp32
  /// wire, 2 with bf16; in reproducible mode 4 as well (the direct exchange of raw fp32
  /// values, one micro-batch per rank). Stage 3 without reproducible mode pays it for every
  /// micro-batch.
  std::size_t reduce_bytes = 0;
  /// Reproducible mode when some rank accumulated several micro-batches (at most 63): the
  /// packed exchange's 8 bytes per element. reduce_bytes otherwise.
  std::size_t reduce_bytes_accumulated = 0;
  /// The packed exchange with the owners depositing every rank's last micro-batch, read in
  /// place (the shared-memory communicator on one node, from the step after the first packed
  /// one: ExactGrads::reduce_packed): 12 bytes per element (the words and the fp32 values).
  /// reduce_bytes_accumulated where that exchange does not apply.
  std::size_t reduce_bytes_in_place = 0;

  /// Every buffer with its bytes, allocated ones first.
  std::vector<BufferSpec> all() const {
    std::vector<BufferSpec> out = {replica, units, grads, staging, master};
    out.insert(out.end(), state.begin(), state.end());
    out.push_back(rule_scratch);
    for (const BufferSpec& b : {accumulate, spill, exact, exact_wide, exact_wire}) out.push_back(b);
    return out;
  }
};

/// The plan for `layout` (built for the group's size) under these options.
/// `groups` are the parameter groups (their rules; empty: every group AdamW) and `rank` the
/// rank whose state is planned (with mixed rules the ranks' state sizes differ). `layout`
/// must be built with rules::layout_align(layout, groups).
BufferPlan plan_buffers(const FlatLayout& layout, Stage stage, DType param_dtype,
                        int buckets_in_flight, int units_in_flight,
                        Reduction reduction = Reduction::Default,
                        DType reduce_dtype = DType::F32,
                        std::span<const GroupOptions> groups = {}, int rank = 0,
                        Device device = Device::Cpu);

}  // namespace shardopt
