// optimizer.hpp: the sharded AdamW optimizer, the library's C++ entry point.
//
// Life cycle (calls marked "collective" must be made by every rank of the group, in the
// same order):
//   ShardedOptimizer opt(comm, options);
//   opt.add_group({...});  opt.add_param("w1", n1, group);  ...   // local, same on all ranks
//   opt.finalize();                                 // collective: verifies layouts, allocates
//   opt.set_param(i, initial_fp32_values);          // local: replica + master from fp32
//   loop: forward reads opt.param<bf16>(i); backward writes opt.grad(i) (or
//         accumulate_grad); stage 2 also calls grad_ready(i) in backward order;
//         StepResult r = opt.step();                // collective
// Stage 3 (parameters sharded too): register parameters in units (begin_unit(), typically
// one per layer); forward and backward acquire(u) a unit before reading param(i) of its
// parameters and release(u) after, prefetch(u) the next one to overlap its gather.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardopt/bf16.hpp"
#include "shardopt/comm.hpp"
#include "shardopt/layout.hpp"
#include "shardopt/memory.hpp"
#include "shardopt/options.hpp"

namespace shardopt {

/// Wall-clock seconds of the phases of one step on this rank (a few steady-clock reads per
/// step). reduce: time this rank's thread spent in gradient reductions (starting, testing and
/// waiting), both inside step() and during backward since the previous step (what finished in
/// the background, between the library's calls, costs nothing here). norm: the local sum of
/// squares (on the CPU already taken per bucket as its reduction completed, and counted in
/// reduce) + one scalar all-reduce. update: the fused AdamW pass. gather: the all-gather of the
/// updated shards (with overlap only the time to start it; waiting happens in param()).
/// total: step() from entry to return plus the time blocked in reductions during backward.
/// update_cpu: the CPU seconds of this process (every thread: the OpenMP workers too) during
/// the update, the work itself where update's wall time also counts what other processes on
/// the same cores took (more ranks than cores); bench_whole compares it across ranks.
struct StepTimings {
  double reduce = 0.0;
  double norm = 0.0;
  double update = 0.0;
  double update_cpu = 0.0;
  double gather = 0.0;
  double total = 0.0;
};

struct StepResult {
  double grad_norm = 0.0;   ///< global L2 norm of the averaged gradient, before clipping
  double clip_coef = 1.0;   ///< factor applied to the gradient (1 when not clipped)
  bool clipped = false;
  bool skipped = false;     ///< a gradient was NaN/Inf on some rank: no update anywhere
  std::int64_t step = 0;    ///< number of updates applied so far (skipped steps excluded)
  StepTimings timings;      ///< where this step's time went, on this rank
  std::int64_t skipped_steps = 0;  ///< steps skipped so far for non-finite gradients
  double loss_scale = 1.0;  ///< the scale for the next backward (1 without loss scaling)
};

/// Dynamic loss scaling state (identical on every rank; saved in checkpoints).
struct LossScaleState {
  double scale = 1.0;              ///< current loss scale (1 when loss scaling is off)
  std::int64_t good_steps = 0;     ///< finite steps since the last growth or backoff
  std::int64_t skipped_steps = 0;  ///< all skipped steps, with or without loss scaling
};

/// The optimizer state arrays (this rank's local arrays), for host copies (checkpoints).
/// ExpAvg is AdamW's first moment and Lion's and Muon's momentum; ExpAvgSq is AdamW's second
/// moment and the variance of Adafactor's unfactored parameters (a rule without an array
/// reads as zeros in copy_state_to_host, and get_state refuses it).
enum class StateArray : int { Master = 0, ExpAvg = 1, ExpAvgSq = 2 };

class Backend;    // buffers and kernels of one device kind (internal)
class BucketSet;  // per-bucket gradient and parameter synchronisation (internal)
class UnitSet;    // stage 3's gathered units (internal)
namespace rules {
class StateLayout;  // where each rule's state lives (internal)
}
struct BufferPlan;

class ShardedOptimizer {
 public:
  /// Collective. Validates the options (after applying SHARDOPT_DEBUG_COLLECTIVES and
  /// SHARDOPT_COLLECTIVE_TIMEOUT, see options.hpp); an invalid option on any rank is the same
  /// Error(InvalidArgument) on every rank. Sets the collective timeout on `comm` and, with
  /// debug_collectives, wraps it in make_checked_communicator() (comm() is the wrapper).
  ShardedOptimizer(std::shared_ptr<Communicator> comm, OptimizerOptions options);
  ~ShardedOptimizer();
  ShardedOptimizer(const ShardedOptimizer&) = delete;
  ShardedOptimizer& operator=(const ShardedOptimizer&) = delete;

  // ---- registration (local; before finalize) ----------------------------------------------
  /// Adds a parameter group and returns its index (group 0 exists already).
  int add_group(const GroupOptions& group);
  /// Registers a parameter; returns its index. Throws for an empty/duplicate name, zero
  /// size or unknown group.
  std::size_t add_param(std::string_view name, std::size_t numel, int group = 0);
  /// Registers a 2-D parameter of shape.rows x shape.cols elements (row-major, in the
  /// trainer's storage order, e.g. torch's (out_features, in_features)); the layout keeps the
  /// shape (ParamInfo::rows/cols). Rule::Muon needs it: every parameter of a Muon group must
  /// be registered this way with rows > 1 and cols > 1. Throws as above, and for a zero extent.
  std::size_t add_param(std::string_view name, Shape2D shape, int group = 0);
  std::size_t add_param(std::string_view name, std::size_t rows, std::size_t cols, int group) {
    return add_param(name, Shape2D{rows, cols}, group);
  }
  /// Starts a new unit and returns its index: parameters registered from now on belong to it
  /// (until the next begin_unit()). Unit 0 is open from the start, and a unit with no
  /// parameters yet is reused, so the first call returns 0. Buckets never straddle units
  /// (every stage); stage 3 gathers parameters unit by unit (acquire/prefetch/release).
  int begin_unit();

  /// Collective. Builds the padded layout, verifies that every rank registered the same
  /// parameters, groups, dtypes and stage (otherwise every rank throws LayoutMismatch), and
  /// allocates the buffers. Parameters, master weights and moments start at zero.
  void finalize();
  bool finalized() const { return finalized_; }

  // ---- parameters and gradients (local) ------------------------------------------------------
  /// Sets parameter i from fp32 values (numel of them): the replica (rounded to its dtype)
  /// and this rank's part of the fp32 master. Every rank must pass the same values.
  void set_param(std::size_t i, std::span<const float> values);
  /// Copies parameter i's fp32 master values into `out` (numel), bit for bit (-0.0 and NaN
  /// payloads included); collective, because the master is sharded (each rank sends the
  /// pieces it owns).
  void get_master(std::size_t i, std::span<float> out);

  /// The full-replica view of parameter i, as the forward pass reads it. T must be bf16 or
  /// float, matching options().param_dtype. After a step with overlap, this waits until the
  /// bucket holding parameter i has been gathered (other buckets may still be in flight).
  template <class T>
  std::span<T> param(std::size_t i);
  /// Waits until parameter i's replica is complete after the last step (see param()).
  void wait_param(std::size_t i);

  // ---- stage 3: gathered units (collective: same calls, same order on every rank) ---------
  // Each rank keeps only its slice of every bucket of the replica; a unit is gathered into
  // one of options().units_in_flight pool buffers (accounted as MemCategory::Params) and
  // param(i) of its parameters views that buffer until the unit is released. At other stages
  // these calls throw Error(InvalidState). step() throws InvalidState while a unit is held
  // (acquired or prefetched): the update would leave it stale.
  /// Gathers unit u if it is not prefetched already and waits; param(i) of its parameters is
  /// then valid until release(u). Throws InvalidState if u is acquired already, or if every
  /// pool buffer is held.
  void acquire(std::size_t unit);
  /// Starts gathering unit u without waiting (a no-op if it is held already); the next
  /// acquire(u) waits for it. Throws InvalidState if every pool buffer is held.
  void prefetch(std::size_t unit);
  /// Returns unit u's buffer to the pool; its param() views become invalid. Throws
  /// InvalidState if u is not acquired.
  void release(std::size_t unit);

  /// Starts the backward pass of one micro-batch. sync = false for every micro-batch but the
  /// last of a step: gradients then accumulate locally with no communication. step()
  /// averages over the micro-batches begun since the previous step (one if never called).
  /// Reproducible mode's full-buffer path (its default at every stage) accepts more
  /// micro-batches after a sync one, with the same result; with two micro-batches, a sync
  /// second lets the shared-memory step combine both raw (docs/architecture.md, "Two
  /// micro-batches").
  void begin_backward(bool sync = true);

  /// Stage 3 ignores sync = false: every micro-batch's buckets are reduce-scattered and
  /// summed into this rank's gradient slices (no full-size buffer); with exactly summable
  /// gradients the result equals stage 2's local accumulation bit for bit.

  /// The fp32 gradient of parameter i that backward writes or accumulates into. Stage 0/1:
  /// a view of the full gradient buffer. Stage 2: a view into the staging bucket being
  /// filled; buckets are filled in backward order and earlier buckets are reduced first.
  /// grad(i) += src (fp32 or bf16, numel elements), in one fused pass.
  void accumulate_grad(std::size_t i, std::span<const float> src);
  void accumulate_grad(std::size_t i, std::span<const bf16> src);
  std::span<float> grad(std::size_t i);
  /// Parameter i's gradient of this micro-batch is complete. With overlap, a bucket whose
  /// parameters are all ready starts its reduction at once (buckets start in bucket order on
  /// every rank). Optional for stages 0/1 (step() reduces what was not started).
  void grad_ready(std::size_t i);
  /// Drives collectives in flight (MPI progresses non-blocking collectives only inside MPI
  /// calls unless it has a progress thread). A trainer whose backward computes for long
  /// between grad_ready() calls may call it, e.g. once per layer. Local; cheap.
  void progress();
  /// Collective. Reduces every bucket not reduced yet and waits: the gradients of this step
  /// are then final (step() only adds the norm all-reduce). Optional; step() does it too.
  void reduce_gradients();
  /// Zeroes every gradient (local).
  void zero_grad();

  // ---- the step (collective) ---------------------------------------------------------------
  /// Collective. Every rank must step with the same hyperparameters, group settings,
  /// micro-batch count, step count and loss scaling state and options; this is checked in
  /// the norm's all-reduce. If they differ, every rank throws the same Error(InvalidArgument)
  /// naming each setting that differs and its value on each rank; nothing is updated (master,
  /// moments, step count, loss scale), and the reduced gradients are kept: put the setting
  /// back and call step() again (it reuses them), or zero_grad() to drop them.
  StepResult step();

  /// The setters are local: every rank must make the same change before the next step(),
  /// which checks it.
  void set_lr(double lr);  ///< local; takes effect at the next step
  double lr() const { return options_.adam.lr; }
  void set_adam_config(const AdamConfig& c);  ///< validated; local
  void set_group(int group, const GroupOptions& g);  ///< validated; local
  std::int64_t step_count() const { return step_count_; }

  // ---- introspection ---------------------------------------------------------------------
  const OptimizerOptions& options() const { return options_; }
  const FlatLayout& layout() const { return layout_; }
  const std::vector<GroupOptions>& groups() const { return groups_; }
  /// The rule parameter i is updated with: its group's, except that an AdamW8bit parameter
  /// smaller than the group's adamw8bit.min_8bit_numel runs AdamW (fp32 state).
  Rule rule_of(std::size_t i) const;
  Communicator& comm() const { return *comm_; }
  /// Length of this rank's local arrays (master, m, v): padded / N, or padded in
  /// data-parallel mode. See layout.hpp for local coordinates.
  std::size_t local_size() const;
  /// The parameter pieces this rank's local arrays hold, in local order (data-parallel: all
  /// of them, local == flat).
  std::vector<ShardPiece> local_pieces() const;
  /// The pieces this rank writes to a checkpoint: its slice of every bucket (also in
  /// data-parallel mode, where every rank holds everything), local ranges as above.
  std::vector<ShardPiece> saved_pieces() const;
  MemoryReport memory_report() const { return tracker_.report(); }

  void set_step_count(std::int64_t s);
  /// Host copies of `out.size()` elements of a state array starting `offset` elements into
  /// the local arrays (local; works for device memory too).
  void copy_state_to_host(StateArray a, std::size_t offset, std::span<float> out);
  void copy_state_from_host(StateArray a, std::size_t offset, std::span<const float> in);
  /// AdamW8bit's raw state (what checkpoints store) over local range [offset, offset + n),
  /// offset a multiple of 256: the exp_avg and exp_avg_sq codes (n bytes each) and scales
  /// (one per 256 elements from offset: (n + 255) / 256 floats each). Entries outside
  /// AdamW8bit parameters read as 0 and are ignored on write. Local.
  struct Q8State {
    std::uint8_t* code_m = nullptr;
    std::uint8_t* code_v = nullptr;
    float* scale_m = nullptr;
    float* scale_v = nullptr;
  };
  void copy_q8_state_to_host(std::size_t offset, std::size_t n, const Q8State& out);
  void copy_q8_state_from_host(std::size_t offset, std::size_t n, const Q8State& in);
  /// Host copies of Adafactor's factored statistics of 2-D parameter i, row_var then col_var
  /// (rows + cols floats: `out` / `in`), which this rank must hold (its owner; every rank at
  /// stage 0): local, for checkpoints (get_factored_state is the collective view).
  void copy_factors_to_host(std::size_t i, std::span<float> out);
  void copy_factors_from_host(std::size_t i, std::span<const float> in);
  /// Loss scaling: the scale the trainer multiplies its loss by, and the full state.
  double loss_scale() const { return loss_scale_.scale; }
  const LossScaleState& loss_scale_state() const { return loss_scale_; }
  void set_loss_scale_state(const LossScaleState& s);  ///< validated; local
  /// Rewrites the replica's owned part from the master and all-gathers it (collective).
  void refresh_replica();

  // ---- whole-replica view and per-parameter state copies -------------------------------
  /// The flat replica: layout().padded_size() elements of options().param_dtype, parameter i
  /// at element layout().param(i).flat.begin (device memory when the device is CUDA). Waits
  /// for every gather in flight, as param() does for one parameter. Local; after finalize.
  void* replica_data();
  /// Collective: copies parameter i's state array `a` into `out` (numel) on every rank, bit
  /// for bit (a gather of the owners' pieces, not a sum). A wrong size or index on any rank
  /// throws the same Error on every rank.
  void get_state(StateArray a, std::size_t i, std::span<float> out);
  /// Collective: Adafactor's factored statistics of 2-D parameter i (rows > 1, cols > 1 in an
  /// Adafactor group) on every rank: its row_var (rows floats) and col_var (cols floats), bit
  /// for bit (its owner's, gathered). A parameter without them, a wrong size or a null buffer
  /// on any rank throws the same Error(InvalidArgument) on every rank. (Adafactor's other
  /// parameters keep a per-element variance: get_state(StateArray::ExpAvgSq).)
  void get_factored_state(std::size_t i, std::span<float> row_var, std::span<float> col_var);

  /// What save_checkpoint() keeps with the optimizer: the locks of the save directories it
  /// saved into, held until the optimizer is destroyed (checkpoint.hpp). Opaque here.
  std::shared_ptr<void>& checkpoint_state() { return checkpoint_state_; }

 private:
  void require_finalized(const char* what) const;
  void require_registering(const char* what) const;
  void require_zero3(const char* what) const;
  void gather_state(const char* what, StateArray a, std::size_t i, std::span<float> out);
  void wait_gathers_of(StateArray a);
  void all_gather_replica();
  void accumulate_grad_as(std::size_t i, const void* src, std::size_t n, DType dtype);
  void update_and_gather(const StepHyper& h, double grad_scale, bool gather_per_bucket,
                         StepTimings& timings);
  void* replica_ptr(std::size_t elem_offset) const;
  void* replica_at(std::size_t b) const;  // the replica over the bucket's window
  float* master_at(std::size_t b) const;  // master over the bucket's window
  // State array a (ExpAvg or ExpAvgSq) over local range `local` as fp32 values: each rule
  // run's own array (AdamW8bit's dequantized), zeros where the run's rule keeps none.
  void read_state(StateArray a, Range local, float* out) const;
  // The reverse: ignored where the rule keeps none; AdamW8bit runs refuse fp32 values.
  void write_state(StateArray a, Range local, const float* in);
  // Calls f(bucket, offset in the window, local offset, n) for the pieces of local range
  // [offset, offset + n) in each bucket's window.
  template <class F>
  void for_each_local(std::size_t offset, std::size_t n, F&& f) const;

  std::shared_ptr<Communicator> comm_;
  OptimizerOptions options_;
  std::unique_ptr<Backend> backend_;
  std::vector<GroupOptions> groups_;
  FlatLayout layout_;
  int current_unit_ = 0;
  bool finalized_ = false;
  std::int64_t step_count_ = 0;
  LossScaleState loss_scale_;
  void update_loss_scale(bool finite);

  MemoryTracker tracker_;
  struct Buffers;
  std::unique_ptr<Buffers> buf_;
  std::unique_ptr<rules::StateLayout> state_;
  std::unique_ptr<BucketSet> buckets_;
  std::unique_ptr<UnitSet> units_;  // stage 3 only; destroyed first
  std::shared_ptr<void> checkpoint_state_;
};

}  // namespace shardopt
