// planner.hpp: per-rank memory of a configuration, predicted without allocating it.
//
// plan_memory() reports the buffer plan that ShardedOptimizer::finalize() allocates from
// (one function, src/buffer_plan.cpp, sizes both), on the same FlatLayout, so its bytes per
// category equal memory_report() of a finalized optimizer exactly. Every rank holds the same
// amount: every rank owns an equal slice of every bucket.
//
// Per rank, with P = padded elements, S = P / N (N ranks), B = largest bucket, k = staging
// slots (buckets_in_flight, at most the number of buckets), U = largest unit, u = unit
// buffers (units_in_flight, at most the number of units), p = sizeof(param):
//   stage          params            grads   master        moments   scratch
//   data-parallel  pP                4P      4P  (0: fp32) 8P        0
//   zero-1         pP                4P      4S  (0: fp32) 8S        0
//   zero-2         pP                4S      4S  (0: fp32) 8S        4kB
//   zero-3         pS + puU          4S      4S  (0: fp32) 8S        4kB (0 at N = 1)
// Stage 3 always stages gradients on more than one rank (on one, its full buffer is S) and
// never allocates an accumulation buffer (every micro-batch is reduced).
// Stage 2 stages gradients only when S + kB < P; otherwise (one rank, or a model of one or
// two buckets) it keeps stage 1's full gradient buffer, so it never plans more than stage 1.
// Stage 2 buffers allocated on first use: a full-size local accumulation buffer (4P) for
// micro-batches that accumulate without synchronising, and a grad() view of a parameter that
// spans several buckets (4 x its size; accumulate_grad() streams through the slots instead).
// An fp32 replica is the master itself, so no separate master is allocated.
//
// Gradient dtype: the library's gradient buffers are fp32 by design (backward writes or
// accumulates fp32 or bf16 into them; a bf16 gradient the caller produces lives in the
// caller's memory). PlanConfig::grad_dtype therefore accepts only F32; other values throw
// Error(Unsupported) instead of predicting a buffer the library never allocates.
#pragma once

#include <array>
#include <cstddef>
#include <vector>

#include "shardopt/dtype.hpp"
#include "shardopt/layout.hpp"
#include "shardopt/memory.hpp"
#include "shardopt/options.hpp"
#include "shardopt/ownership.hpp"

namespace shardopt {

struct PlanConfig {
  Stage stage = Stage::Zero1;
  int world_size = 1;
  DType param_dtype = DType::BF16;
  DType grad_dtype = DType::F32;  ///< only F32 (see above)
  std::size_t bucket_elems = OptimizerOptions{}.bucket_elems;
  int buckets_in_flight = OptimizerOptions{}.buckets_in_flight;  ///< stage-2/3 staging slots
  int units_in_flight = OptimizerOptions{}.units_in_flight;  ///< stage-3 gathered-unit buffers
  /// Stage 2 with micro-batches that accumulate without synchronising (begin_backward(false))
  /// keeps a full-size local fp32 accumulation buffer; reproducible mode with several
  /// micro-batches on a rank in one step keeps its exact accumulator (on the CPU the packed
  /// words, 8 bytes per element; see `reduction`).
  bool accumulate_without_sync = false;
  /// Stage 2 with grad() views of parameters that span several buckets (a buffer of the
  /// largest such parameter); accumulate_grad() needs none.
  bool grad_views_across_buckets = false;
  /// Reduction::Reproducible keeps a full fp32 gradient at every stage (and, with
  /// accumulate_without_sync, an exact accumulator allocated at the first step that needs it:
  /// on the CPU the packed words, 8 bytes per element; on Device::Cuda the bins, 17 bytes per
  /// element and one per element of the largest bucket; the bins always, from finalize, under
  /// Whole ownership at stages 1-3 when some bucket is ragged), and sends 4 bytes per element
  /// (8 with several micro-batches per rank: MemoryPlan::reduce_bytes_accumulated, on the
  /// device too). Not planned here: past 63
  /// micro-batches on a rank, or when the step takes the two-phase method on the CPU, the
  /// packed words are widened into the bins (17 bytes per element and one per element of the
  /// largest bucket, replacing the 8; both for the moment of the widening).
  Reduction reduction = Reduction::Default;
  DType reduce_dtype = DType::F32;  ///< the wire of the default reduction: F32 or BF16
  /// Nodes the ranks run on, world_size / nodes consecutive ranks each (MemoryPlan::
  /// internode_bytes); world_size must be a multiple.
  int nodes = 1;
  /// Where the optimizer's buffers live: sets the automatic bucket size's cap
  /// (auto_bucket_cap); the bytes are the same on either device.
  Device device = Device::Cpu;
  /// The parameter groups (group g of a parameter is ParamInfo::group) for their update
  /// rules; groups beyond the end (all, when empty) are default AdamW groups. Lion keeps 4
  /// bytes of state per element where AdamW keeps 8, AdamW8bit 2 + 8/256 (fp32 below its
  /// min_8bit_numel), and aligns the layout to 256 elements.
  std::vector<GroupOptions> groups;
  /// The rank whose memory is planned: with mixed rules the ranks' state sizes differ (each
  /// owns other pieces); with one rule every rank's are equal.
  int rank = 0;
  /// Flat (equal slices), or Whole (one owner per parameter: plan_memory gives rank `rank`'s
  /// bytes of the cut finalize() makes; plan_ownership the owners and per-rank loads).
  Ownership ownership = Ownership::Flat;
  /// Per parameter: whether it runs the matrix rule (Muon: Newton-Schulz on its 2-D shape,
  /// one fp32 momentum, kMuonStateBytesPerElem). Empty or shorter than the layout: the rest
  /// are element-wise (their group's rule); longer is an error. Read by plan_ownership only.
  std::vector<bool> matrix;
};

/// The largest automatic bucket (bucket_elems 0) on `device` (FlatLayout::auto_bucket_elems).
constexpr std::size_t auto_bucket_cap(Device device) {
  return device == Device::Cuda ? FlatLayout::kMaxAutoBucketElemsDevice
                                : FlatLayout::kMaxAutoBucketElems;
}

/// The planner's view of an optimizer's options on a group of `world_size` ranks.
PlanConfig plan_config(const OptimizerOptions& options, int world_size);

struct MemoryPlan {
  std::array<std::size_t, kNumMemCategories> bytes{};  ///< per rank, per category
  std::size_t unpadded_elems = 0;  ///< Psi: sum of parameter sizes
  std::size_t padded_elems = 0;    ///< length of the flat buffer
  std::size_t owned_elems = 0;     ///< elements whose master and moments one rank holds
  std::size_t bucket_elems = 0;    ///< largest bucket
  std::size_t num_buckets = 0;     ///< buckets (the unit of every collective)
  bool staged = false;             ///< stage 2 or 3 stages gradients in bucket slots
  std::size_t unit_elems = 0;      ///< stage 3: largest unit (one gathered-unit buffer)
  int unit_buffers = 0;            ///< stage 3: gathered-unit buffers
  /// Payload bytes one rank passes to the gradient reductions of one step (every bucket once;
  /// stage 3 without reproducible mode: per micro-batch): 4 per padded element with an fp32
  /// wire, 2 with bf16, and 4 in reproducible mode with one micro-batch per rank (the direct
  /// exchange of raw values). What the transport moves on top of it depends on its algorithm
  /// (a ring reduce-scatter sends (N-1)/N of it).
  std::size_t reduce_bytes = 0;
  /// Reproducible mode when any rank accumulated several micro-batches in the step (at most
  /// 63 per rank): the packed exchange, 8 per padded element (a level and two 30-bit bins).
  /// More micro-batches on a rank, or a communicator that cannot exchange raw values
  /// (Communicator::reduce_scatter_combine), take the two-phase method: 9 (a 1-byte level
  /// maximum and an int64 sum). Otherwise reduce_bytes. The same on Device::Cuda (the NCCL
  /// communicator exchanges by ncclSend/ncclRecv).
  std::size_t reduce_bytes_accumulated = 0;
  /// The same exchange where the owners deposit every rank's last micro-batch as they
  /// combine, reading the words and the fp32 values in place (the shared-memory communicator
  /// on one node, from the step after the first packed exchange): 12 per padded element, and
  /// no pass over the bucket before it. reduce_bytes_accumulated where it does not apply.
  std::size_t reduce_bytes_in_place = 0;
  /// Reproducible mode's two-phase method (past 63 micro-batches on a rank, a communicator
  /// without the exchanges, SHARDOPT_REPRO_EXCHANGE=two-phase): 9 per padded element (a
  /// 1-byte level maximum and an int64 sum). 0 outside reproducible mode and for the sharded
  /// accumulation (exact_sharded).
  std::size_t reduce_bytes_two_phase = 0;
  /// Reproducible mode, elements of buckets that are neither whole nor cut in equal slices
  /// (whole-tensor ownership at stages 1-3): the exchanges deliver equal blocks, so these take
  /// the two-phase method at every step (9 bytes each, whatever the step's path).
  std::size_t exact_ragged_elems = 0;
  /// Reproducible mode's exact accumulator once a rank accumulated several micro-batches (up
  /// to 63): on the CPU the packed words (8 bytes per element), on the device the bins (17
  /// per element and one per element of the largest bucket); exact_wide_bytes: the bins, what
  /// the two-phase method needs (the CPU widens its words into them past 63). Allocated on
  /// demand (not in `bytes`) unless exact_on_demand is false (ragged buckets: the bins from
  /// finalize). 0 outside reproducible mode. The sharded accumulation: the owned elements'
  /// packed words (8 bytes each, in `bytes`, from finalize) and their bins (17 each, on
  /// demand: past 63 values per element in a step, ranks times micro-batches of the busiest).
  std::size_t exact_state_bytes = 0;
  std::size_t exact_wide_bytes = 0;
  bool exact_on_demand = false;
  /// Reproducible mode's sharded accumulation (SHARDOPT_REPRO_EXCHANGE=sharded, stages 2-3):
  /// every micro-batch is exchanged raw (reduce_bytes each); each owner deposits the values
  /// of every rank, exact_sharded_ranks per element and round.
  bool exact_sharded = false;
  int exact_sharded_ranks = 0;
  /// Bytes that cross between nodes for one node in one step (one micro-batch, the default
  /// reduction), as a ring between the `nodes` moves them: per bucket, its gradient
  /// reduce-scatter (data-parallel: all-reduce, twice the bytes) and, at stages 1 and 2, its
  /// replica all-gather, each the bucket's bytes less the node's part (1 / nodes of them).
  /// Stage 3: the reductions only (each gathered unit adds its bytes less the node's part,
  /// per acquire). 0 on one node and in reproducible mode (not modelled). What
  /// Communicator::internode_bytes() counts on a node leader.
  std::size_t internode_bytes = 0;

  std::size_t operator[](MemCategory c) const { return bytes[static_cast<int>(c)]; }
  std::size_t total() const;
};

/// Reproducible mode's path for the gradients of one step (docs/architecture.md,
/// "Reproducible mode"). Every rank takes the same: step() agrees on it in one small
/// all-reduce, each rank stating the path its own micro-batches call for
/// (exact_path_needed) and the slowest winning.
enum class ExactPath {
  Direct,         ///< no rank accumulated: raw fp32 values to the owners, 4 bytes per element
  Packed,         ///< 2-63 micro-batches on some rank: packed states through a wire buffer, 8
  PackedInPlace,  ///< the same, the owners reading words and last micro-batch in place, 12
  TwoPhase,       ///< level maximum and int64 sum, 9: past 63 on a rank, or no exchange
  /// at most 2 micro-batches on every rank, the second begun with sync, `fastest` Direct and
  /// shared words: each rank's first held raw in the words' window, the owners combining
  /// both raw values of every rank in place, 8
  RawPairInPlace,
};
const char* exact_path_name(ExactPath p) noexcept;
/// The path one rank's step calls for: `micro_batches` accumulated since the last step (0-...)
/// and `fastest`, the fastest path allowed (SHARDOPT_REPRO_EXCHANGE; TwoPhase for a
/// communicator without the exchanges). Never PackedInPlace (that is where the packed words
/// lie, not what the state needs).
ExactPath exact_path_needed(int micro_batches, ExactPath fastest = ExactPath::Direct);

/// A step of reproducible mode, as plan_exact_step() takes it.
struct ExactStep {
  int most_micro_batches = 1;  ///< the most micro-batches any rank accumulated in the step
  ExactPath fastest = ExactPath::Direct;  ///< SHARDOPT_REPRO_EXCHANGE's fastest path allowed
  /// Whether the communicator exchanges raw values (Communicator::reduce_scatter_combine);
  /// without, every path is the two-phase method.
  bool exchanges = true;
  /// Whether the packed words lie in a window whose owners read them in place (the
  /// shared-memory communicator on one node, from the step after the first packed exchange;
  /// not with SHARDOPT_REPRO_EXCHANGE=packed-wire). With at most 2 micro-batches,
  /// `fastest` Direct and `last_synced`, the path is then RawPairInPlace.
  bool words_shared = false;
  /// Whether the ranks with two micro-batches began the second with begin_backward(true)
  /// (sync: the last of the step, as documented), which lets them hold the first raw.
  bool last_synced = true;
};
/// What one step of reproducible mode takes, per rank.
struct ExactStepPlan {
  ExactPath path = ExactPath::Direct;
  /// Payload bytes passed to the gradient reductions (as MemoryPlan::reduce_bytes counts
  /// them): the path's bytes per element of the buckets that exchange, 9 per ragged element;
  /// the sharded accumulation: reduce_bytes per micro-batch (at least one).
  std::size_t wire_bytes = 0;
  /// The exact accumulator the step needs on top of MemoryPlan::bytes on the busiest rank
  /// (allocated on demand: none for the direct exchange; exact_state_bytes for the packed
  /// exchange, except the CPU's packed words when no rank accumulated and they are not
  /// shared; exact_wide_bytes for the two-phase method; 0 where the plan holds it from
  /// finalize; the sharded accumulation: past 63 values per owned element, ranks times
  /// rounds, its bins replace the words in `bytes`, exact_wide_bytes - exact_state_bytes more).
  /// A rank that accumulated fewer holds at most that. It stays allocated for later steps.
  std::size_t accumulator_bytes = 0;
};
/// The path and bytes of a step of reproducible mode under `plan` (plan_memory of a
/// configuration with Reduction::Reproducible), as the optimizer takes it. Throws
/// Error(InvalidArgument) for a plan of the default reduction.
ExactStepPlan plan_exact_step(const MemoryPlan& plan, const ExactStep& step);

/// Per-rank bytes of `layout` under `config`. The layout may be unbuilt (a copy is built for
/// config.world_size) or built for exactly that world size. Stage 3 plans the layout's
/// units as they are (one unit if it declares none: see unit_per_tensor()). Throws Error(InvalidArgument)
/// for an invalid configuration or a layout built for another world size, and
/// Error(Unsupported) for a gradient dtype other than F32, and for ownership Whole with what
/// finalize() refuses it with (stage 3, Reduction::Reproducible, Device::Cuda), and for
/// Reduction::Reproducible at stage 3 on Device::Cuda (refused by the optimizer too).
MemoryPlan plan_memory(const FlatLayout& layout, const PlanConfig& config);

/// The owner plan of whole-tensor ownership (ownership.hpp) and the figures shardopt-plan
/// --ownership whole prints.
struct OwnershipReport {
  OwnerPlan plan;                  ///< owners, ragged cuts, per-rank loads and their spread
  std::size_t bucket_elems = 0;    ///< the bucket size the layout was built with
  std::size_t num_buckets = 0;
  std::size_t matrices = 0;        ///< parameters with config.matrix set
  std::size_t largest_matrix = 0;  ///< elements of the largest of them
  std::uint64_t ns_flops = 0;      ///< Newton-Schulz flops of one step, all ranks together
};

/// Whole-tensor ownership of `layout` under `config` (whatever config.ownership says; stage,
/// reduction and staging options do not enter). Every parameter's state bytes per element on
/// its owner: a matrix (config.matrix) kMuonStateBytesPerElem, any other its group's rule
/// (AdamW 8, Lion 4, AdamW8bit 2 + 8/256, fp32 8 below min_8bit_numel), plus 4 for the fp32
/// master of a bf16 replica. An unbuilt layout is copied, marked Whole and built for
/// config.world_size with config.bucket_elems; automatic buckets (0) are
/// FlatLayout::auto_bucket_elems on config.device, raised to the largest matrix so that
/// every matrix fits one bucket. A built layout must be a Whole one for config.world_size.
/// Throws as plan_memory for an invalid configuration, and Error(InvalidArgument) for a
/// matrix without a 2-D shape or one that spans buckets (assign_owners).
OwnershipReport plan_ownership(const FlatLayout& layout, const PlanConfig& config,
                               const OwnerOptions& options = {});

/// The ZeRO paper's per-rank model-state bytes (Rajbhandari et al. 2020, section 5) with
/// shardopt's byte counts: replica p = dtype_size(param_dtype), gradient 4 (fp32; the paper
/// has an fp16 gradient, 2), optimizer state K = 12 (fp32 master, m, v) or 8 when the fp32
/// replica is the master (Lion: 8 or 4, its one momentum array; AdamW8bit: 6.03 or 2.03, every
/// parameter taken as 8-bit):
///   data-parallel (p + 4 + K) Psi;  zero-1 (p + 4) Psi + K Psi / N;  zero-2 p Psi + (4 + K) Psi / N;
///   zero-3 (p + 4 + K) Psi / N.
/// A continuous curve without padding, staging or stage-3 gathered units; plan_memory() is
/// the exact figure.
double zero_formula_bytes(Stage stage, double psi, double ranks, DType param_dtype,
                          Rule rule = Rule::AdamW);

/// Most tensors uniform_layout() builds, so that a bisection over Psi stays fast.
inline constexpr std::size_t kMaxUniformTensors = 4096;

/// A model of `psi` elements made of tensors of `tensor_elems` elements (the last one
/// holding the remainder), all in group 0. Throws Error(InvalidArgument) for psi == 0,
/// tensor_elems == 0 or more than kMaxUniformTensors tensors.
FlatLayout uniform_layout(std::size_t psi, std::size_t tensor_elems);

/// An unbuilt copy of `layout` with every tensor its own unit: how stage 3 gathers a model
/// known only by its tensors (shardopt-plan --stage 3, largest_fitting_psi at stage 3).
FlatLayout unit_per_tensor(const FlatLayout& layout);

/// The tensor size the planner assumes for a model of `psi` elements given only its size:
/// `tensor_elems`, grown to ceil(psi / kMaxUniformTensors) when psi is that large.
std::size_t uniform_tensor_elems(std::size_t psi, std::size_t tensor_elems);

/// The largest psi whose uniform layout (tensors of uniform_tensor_elems(psi, tensor_elems))
/// needs at most `budget_bytes` per rank under `config`; 0 when not even one element fits.
/// Found by bisection with plan_memory(); bytes grow with psi except for stage-2 bucket
/// packing, so the answer always fits and is the largest up to that packing. At stage 3 each
/// tensor is its own unit (unit_per_tensor()).
std::size_t largest_fitting_psi(std::size_t budget_bytes, const PlanConfig& config,
                                std::size_t tensor_elems);

}  // namespace shardopt
