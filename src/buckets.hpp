// buckets.hpp: the buckets as the unit of communication. BucketSet owns, for every bucket of
// the layout, its gradient synchronisation (start: reduce-scatter, or all-reduce in
// data-parallel mode; finish: wait and, in stage 2, add this rank's slice into the owned
// gradient), its parameter synchronisation (start: all-gather of the updated slices;
// finish: wait), its stage-2 staging slot, and the rule that a bucket has at most one
// collective outstanding. The geometry itself belongs to FlatLayout.
//
// Gradients. Backward writes (grad) or adds (accumulate_grad) each parameter's gradient and
// marks it ready (grad_ready). Buckets start in bucket order on every rank: with overlap, a
// bucket starts as soon as all of its parameters are ready; without, at the step. In stage 2
// (GradScheme::Staged) gradients are written into bucket-sized staging slots, so a bucket is
// also started when backward moves past it (the backward-order contract), and
// accumulate_grad streams a parameter that spans buckets through their slots; a grad() view
// of such a parameter is a separate buffer of its size ("spill"), handed to the slots at
// grad_ready, at the next spill view, or at the step.
#pragma once

#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "backend.hpp"
#include "buffer_plan.hpp"
#include "exact_sum.hpp"
#include "shardopt/comm.hpp"
#include "shardopt/layout.hpp"
#include "shardopt/planner.hpp"
#include "shardopt/options.hpp"

namespace shardopt {

/// The in-place all-gather of bucket `bk` in `data` (the bucket's elements, `type` F32 or
/// U16): equal slices, or (Whole ownership) its ragged per-rank ranges. Stages 1-2 gather
/// into the replica (BucketSet::start_param_syncs), stage 3 into a unit buffer (UnitSet::prefetch),
/// both in batches of Config::batch buckets.
BatchedCollective bucket_gather(const Bucket& bk, void* data, CommType type);

class BucketSet {
 public:
  struct Config {
    Stage stage;
    CommType wire;        ///< gradient reduction: F32 or BF16
    CommType param_type;  ///< replica: F32 or U16 (bf16 bits)
    bool overlap;
    /// Reduction::Reproducible: micro-batches are deposited into exact bins (exact_sum.hpp)
    /// and every bucket is reduced exactly inside finish_grad_sync(), none during backward;
    /// except on the sharded stage-2 path (BufferPlan::exact_sharded), where each
    /// micro-batch's buckets are exchanged to their owners' bins during backward.
    bool reproducible = false;
    /// Host memory: each bucket's sum of squares (the norm's part) is taken as soon as its
    /// reduction completes, while the reduced slice is still in cache (norm_sums()).
    bool eager_norm = false;
    /// The most buckets one batched start covers (Communicator::start_batch; 1: every bucket
    /// alone). Batched: the step's reductions when nothing can have started them during
    /// backward (no overlap, unstaged), and the parameter gathers (start_param_syncs; stage
    /// 3's unit gathers take the same size, UnitSet).
    std::size_t batch = 1;
  };
  /// The gradient buffers, allocated by the caller (the constructor allocates nothing, so
  /// that the caller can make the collective allocations first on every rank): plan.grads,
  /// and plan.staging when the plan is staged. Whichever goes through the collectives
  /// (staging when staged, else grads) is allocated collectively.
  struct Storage {
    Allocation grads;
    Allocation staging;
    Allocation exact_wire;  ///< reproducible: plan.exact_wire (collective)
    /// reproducible with ragged buckets (plan.exact not on demand): the exact accumulator
    /// (local); otherwise empty, allocated when first needed.
    Allocation exact;
  };
  BucketSet(Communicator& comm, Backend& backend, MemoryTracker& tracker,
            const FlatLayout& layout, const BufferPlan& plan, Config config, Storage storage,
            void* replica);
  ~BucketSet();  // completes collectives still in flight (they are collective)
  BucketSet(const BucketSet&) = delete;
  BucketSet& operator=(const BucketSet&) = delete;

  // ---- gradients ------------------------------------------------------------------------
  /// Starts one micro-batch's backward; sync = false accumulates locally, no communication.
  /// Stage 3 ignores sync: the previous micro-batch's buckets are reduced first and every
  /// micro-batch is reduced (no full-size accumulation buffer).
  void begin_backward(bool sync);
  /// Where backward writes (or adds) parameter i's gradient now.
  std::span<float> grad(std::size_t i);
  /// grad(i) += src (numel elements of `dtype`, F32 or BF16), streamed bucket by bucket.
  void accumulate_grad(std::size_t i, const void* src, DType dtype);
  /// Parameter i's gradient of this micro-batch is complete.
  void grad_ready(std::size_t i);
  /// Starts every bucket not started yet and finishes every gradient sync.
  void finish_grad_sync();
  /// The flat range of bucket b that this rank updates: its slice, or the whole bucket in
  /// data-parallel mode; and where that range starts in the local arrays.
  Range window(std::size_t b) const;
  std::size_t window_local(std::size_t b) const;
  /// After finish_grad_sync(): the reduced gradient over window(b).
  const float* reduced_grad(std::size_t b) const;
  /// The part of bucket b's reduced gradient that this rank adds to the global norm: its
  /// slice (data-parallel ranks hold the whole bucket and take their own slice of it).
  Backend::Slice norm_slice(std::size_t b) const;
  /// After finish_grad_sync() with eager_norm: Backend::sum_squares of every norm_slice(b),
  /// taken when each bucket's last reduction completed; empty when eager_norm is off.
  std::span<const double> norm_sums() const;
  /// Reproducible mode, after finish_grad_sync(): this rank's part of the exact sum of
  /// squares of the reduced gradient (summed over ranks: every element once), taken by the
  /// reduction itself (the direct exchange combines and squares in one pass; the two-phase
  /// method adds norm_slice(b) of each bucket).
  const exact::SquareSum& exact_squares() const { return exact_squares_; }
  /// Micro-batches accumulated since the last zero_grads() (at least 1).
  int micro_batches() const { return micro_batches_ > 0 ? micro_batches_ : 1; }
  /// Reproducible mode, after finish_grad_sync(): the micro-batches of this step summed over
  /// every rank (counts may differ between ranks, a rank may have none; at least 1).
  std::int64_t total_micro_batches() const { return total_micro_batches_ > 0 ? total_micro_batches_ : 1; }
  /// Waits for gradient syncs in flight and clears every gradient and the pass state.
  void zero_grads();
  /// Seconds this rank's thread spent in gradient communication since the last zero_grads():
  /// starting, testing and waiting for reductions (during backward too).
  double blocked_seconds() const { return blocked_seconds_; }

  // ---- parameters ------------------------------------------------------------------------
  /// Starts the all-gather of bucket b's updated slices into the replica.
  void start_param_sync(std::size_t b);
  /// start_param_sync of every bucket listed, in that order, in batches of at most
  /// Config::batch buckets (every rank must list the same buckets).
  void start_param_syncs(std::span<const std::size_t> buckets);
  /// Config::batch.
  std::size_t batch() const { return cfg_.batch; }
  /// Finishes the parameter syncs of the buckets holding parameter i.
  void wait_param(std::size_t i);
  /// Finishes every parameter sync.
  void wait_params();

  /// Tests collectives in flight so that MPI makes progress while the trainer computes.
  void progress();
  /// The sharded exact accumulation (plan_.exact_sharded): every micro-batch is exchanged in
  /// rounds that a rank with fewer micro-batches joins from finish_grad_sync().
  bool exchanges_each_micro_batch() const { return sharded(); }

 private:
  enum class Op : unsigned char { None, GradSync, ParamSync };
  /// Reproducible mode's reduction of a step (docs/architecture.md, "Reproducible mode").
  struct State {
    Op op = Op::None;
    std::unique_ptr<CommRequest> request;
    int slot = -1;          ///< Staged: the staging slot, -1 when none
    bool slot_cleared = false;  ///< Staged: the reduction zeroes the slot but this rank's block
    std::size_t ready = 0;  ///< parameters ready in this micro-batch
  };
  void begin_op(std::size_t b, Op op, std::unique_ptr<CommRequest> request);
  void finish_op(std::size_t b);  // waits and completes bucket b's outstanding collective
  void start_through(std::size_t end);  // starts gradient syncs [next_start_, end) in order
  void start_grad_sync(std::size_t b);
  void start_grad_syncs_batched(std::size_t end);  // finish_grad_sync without overlap, unstaged
  BatchedCollective grad_sync_op(std::size_t b);   // bucket b's reduction (finished before)
  void complete_oldest_grad_sync();
  float* slot_for(std::size_t b);  // Staged: the bucket's staging slot, acquired if needed
  float* slot_data(int slot) const;
  void flush_spill();
  void require_open(std::size_t i, bool writing) const;
  bool staged() const { return plan_.grads_scheme == GradScheme::Staged; }
  void reduce_exactly();  // reproducible: deposits the last micro-batch, reduces every bucket
  /// Sharded exact accumulation (plan_.exact_sharded): the direct exchange of bucket b's
  /// slot, deposited by the owners, then the slot is cleared and released.
  void exchange_deposit(std::size_t b);
  /// Sharded exact accumulation: exchanges every bucket not exchanged yet in this round (a
  /// rank without a micro-batch sends zeros), then every rank states whether it has more
  /// micro-batches; returns whether some rank has. One round per micro-batch of the rank
  /// with the most.
  bool exchange_round(bool more);
  bool sharded() const { return plan_.exact_sharded; }
  void ensure_exact();    // reproducible: allocates the exact accumulator (plan_.exact) once
  /// Reproducible: the bins form of the accumulator (the two-phase method, or past the packed
  /// words' limit): allocates plan_.exact (bins) or widens the compact form (plan_.exact_wide).
  void ensure_bins();
  /// Reproducible, collective: ensure_bins() on every rank, and the shared words it retired
  /// released together (a window's release is collective).
  void widen_everywhere();
  /// Reproducible, collective, after a packed exchange: the compact words move into a
  /// communicator window (every rank, once), so that the owners deposit the last micro-batch
  /// in the combining pass from the next step on (ExactGrads::reduce_packed).
  void share_words();
  std::size_t max_bucket() const;  // the largest bucket's elements
  void retire_completed_grad_syncs();  // finishes (not releases) those test() completes, in order

  Communicator& comm_;
  Backend& backend_;
  MemoryTracker& tracker_;
  const FlatLayout& layout_;
  BufferPlan plan_;
  Config cfg_;
  char* replica_;

  std::vector<State> state_;
  std::vector<unsigned char> param_ready_;
  Allocation grads_;       ///< Full: the full fp32 gradient; Staged: the owned shard
  Allocation staging_;     ///< Staged: plan_.slots slots of plan_.slot_elems floats
  Allocation accumulate_;  ///< Staged, on demand: full-size accumulation without sync
  Allocation spill_;       ///< Staged, on demand: grad() view of a parameter across buckets
  exact::ExactGrads exact_;  ///< reproducible: the exact sums of the micro-batches (on demand)
  bool exact_allocated_ = false;
  bool exact_share_tried_ = false;  ///< share_words() ran (its window stays until widened)
  bool exact_no_share_ = false;     ///< SHARDOPT_REPRO_EXCHANGE=packed-wire on this rank
  exact::SquareSum exact_squares_;  ///< reproducible: the norm's part, by the reduction
  Allocation exact_wire_;              ///< reproducible: the packed exchange's buffer
  ExactPath exact_floor_ = ExactPath::Direct;  ///< SHARDOPT_REPRO_EXCHANGE: the fastest allowed
  ExactPath exact_method_ = ExactPath::Direct;  ///< this step's (agreed in reduce_exactly)
  std::int64_t total_micro_batches_ = 0;  ///< reproducible: over all ranks, at the reduction
  bool reduced_ = false;  ///< sharded exact accumulation: finish_grad_sync ran in this step
  std::size_t spill_param_;
  std::vector<int> free_slots_;

  std::vector<double> norm_sums_;           ///< eager_norm: per bucket, after its reduction
  std::deque<std::size_t> grad_in_flight_;  ///< buckets whose gradient sync is outstanding
  std::size_t next_start_ = 0;              ///< buckets before it were started in this step
  int micro_batches_ = 0;
  bool sync_ = true;
  double blocked_seconds_ = 0.0;
};

}  // namespace shardopt
