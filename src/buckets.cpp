// buckets.cpp: per-bucket gradient and parameter synchronisation.
#include "buckets.hpp"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <limits>
#include <string>

namespace shardopt {
namespace {

constexpr std::size_t kNone = std::numeric_limits<std::size_t>::max();

// Adds the wall time of its scope to a counter.
class ScopedSeconds {
 public:
  explicit ScopedSeconds(double& sink) : sink_(sink) {}
  ~ScopedSeconds() {
    sink_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  double& sink_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

// Reproducible mode: the values summed per element (every micro-batch of every rank, at least
// one per rank) must fit the exact int64 sum. Called with agreed figures, so every rank
// throws the same error or none does.
void require_exact_headroom(std::int64_t micro_batches, int ranks) {
  const std::int64_t values = std::max<std::int64_t>(micro_batches, ranks);
  require(values <= exact::kMaxContributions, Status::InvalidArgument,
          "reproducible reduction: " + std::to_string(micro_batches) + " micro-batches on " +
              std::to_string(ranks) + " ranks make " + std::to_string(values) +
              " gradients per element; the exact int64 sum holds at most " +
              std::to_string(exact::kMaxContributions));
}

}  // namespace

BucketSet::BucketSet(Communicator& comm, Backend& backend, MemoryTracker& tracker,
                     const FlatLayout& layout, const BufferPlan& plan, Config config,
                     Storage storage, void* replica)
    : comm_(comm), backend_(backend), tracker_(tracker), layout_(layout), plan_(plan),
      cfg_(config), replica_(static_cast<char*>(replica)), grads_(std::move(storage.grads)),
      staging_(std::move(storage.staging)), exact_wire_(std::move(storage.exact_wire)),
      spill_param_(kNone) {
  if (storage.exact.data() != nullptr && sharded()) {  // the owned elements' packed words
    exact_ = exact::ExactGrads::compact(backend_, std::move(storage.exact), plan_.local_elems);
    exact_allocated_ = true;
  } else if (storage.exact.data() != nullptr) {  // ragged buckets: every step needs it
    exact_ = exact::ExactGrads(backend_, std::move(storage.exact), layout_.padded_size(), max_bucket());
    exact_allocated_ = true;
  }
  require(!sharded() || exact_allocated_, Status::Internal,
          "BucketSet: the sharded exact accumulation needs its words from finalize");
  state_.resize(layout_.num_buckets());
  if (cfg_.eager_norm) norm_sums_.assign(layout_.num_buckets(), 0.0);
  param_ready_.assign(layout_.num_params(), 0);
  if (staged())
    for (int s = plan_.slots - 1; s >= 0; --s) free_slots_.push_back(s);
  if (cfg_.reproducible) {
    // The method switch, for A/B measurements and tests: the fastest method allowed ("auto"
    // or "direct": any; "packed": the packed exchange or two-phase; "packed-wire": as
    // "packed", without the owners' in-place deposit (share_words); "two-phase": only it;
    // "sharded": as "auto", and stage 2 takes the sharded accumulation, exact::sharded_stage2).
    // The slowest any rank allows is what every rank uses (reduce_exactly agrees).
    if (const char* env = std::getenv("SHARDOPT_REPRO_EXCHANGE")) {
      const std::string m = env;
      require(m == "auto" || m == "direct" || m == "packed" || m == "packed-wire" ||
                  m == "two-phase" || m == "sharded",
              Status::InvalidArgument,
              "SHARDOPT_REPRO_EXCHANGE: '" + m +
                  "' is none of auto, direct, packed, packed-wire, two-phase, sharded");
      exact_floor_ = m == "packed" || m == "packed-wire" ? ExactPath::Packed
                     : m == "two-phase"                 ? ExactPath::TwoPhase
                                                        : ExactPath::Direct;
      exact_no_share_ = m == "packed-wire";
    }
  }
}

BucketSet::~BucketSet() {
  for (State& s : state_) {
    if (!s.request) continue;
    try {
      s.request->wait();
    } catch (...) {  // nothing to report to from a destructor
    }
  }
}

// ---- one bucket's collective ----------------------------------------------------------------

void BucketSet::begin_op(std::size_t b, Op op, std::unique_ptr<CommRequest> request) {
  State& s = state_[b];
  require(s.op == Op::None, Status::Internal,
          "bucket " + std::to_string(b) + ": a collective is already outstanding");
  s.op = op;
  s.request = std::move(request);
}

void BucketSet::finish_op(std::size_t b) {
  State& s = state_[b];
  if (s.op == Op::None) return;
  s.request->wait();
  s.request.reset();
  const Op op = s.op;
  s.op = Op::None;
  if (op != Op::GradSync) return;
  if (staged()) {
    // This rank's reduced slice joins the owned gradient and the slot is cleared (only that
    // slice where the communicator's sums zeroed the rest, clears_inputs()); it stays
    // the bucket's until release_slot() (complete_oldest_grad_sync), so that every rank hands
    // slots out in the same order: the shared-memory collectives read a peer's slot at this
    // rank's offset, and when a reduction completes differs between ranks.
    const Bucket& bk = layout_.bucket(b);
    float* slot = slot_data(s.slot);
    const int me = comm_.rank();
    backend_.accumulate(grads_.as<float>() + bk.local_begin_of(me),
                        slot + (bk.slice(me).begin - bk.flat.begin), DType::F32,
                        bk.slice_size(me));
    if (s.slot_cleared)  // the blocks cover the bucket (Whole gives its padding to a rank)
      backend_.fill_zero(slot + (bk.slice(me).begin - bk.flat.begin), bk.slice_size(me) * sizeof(float));
    else
      backend_.fill_zero(slot, bk.flat.size() * sizeof(float));
    s.slot_cleared = false;
  }
  // The norm's part now, while the slice just written is in cache; a later reduction of the
  // same bucket (stage 2's next synchronised micro-batch) takes it again.
  if (cfg_.eager_norm) {
    const Backend::Slice slice = norm_slice(b);
    norm_sums_[b] = backend_.sum_squares(slice.data, slice.n);
  }
}

// ---- gradients ------------------------------------------------------------------------------

void BucketSet::begin_backward(bool sync) {
  if (sharded()) {
    // Every micro-batch is exchanged (sync is ignored: accumulating locally would need the
    // full-size buffer this path avoids); the previous one's remaining buckets go now.
    require(!reduced_, Status::InvalidState,
            "begin_backward: gradients of this step were already reduced; call step() first");
    if (micro_batches_ > 0) exchange_round(true);
    ++micro_batches_;
    sync_ = true;
    for (State& s : state_) s.ready = 0;
    std::fill(param_ready_.begin(), param_ready_.end(), 0);
    return;
  }
  if (cfg_.reproducible) {
    // The previous micro-batch's gradients join the exact sums; the buffer starts empty.
    require(next_start_ == 0, Status::InvalidState,
            "begin_backward: gradients of this step were already reduced; call step() first");
    if (micro_batches_ > 0) {
      ensure_exact();  // local: an OutOfMemory here is this rank's, before any collective
      if (exact_.full()) ensure_bins();  // past the packed words' limit: local as well
      require(grads_.bytes() == layout_.padded_size() * sizeof(float), Status::Internal,
              "begin_backward: the gradient buffer is not the padded layout");
      // With shared words, the first of two micro-batches (this one is the last: sync) is
      // held raw instead (the owners then combine both raw values; ExactGrads::reduce_held).
      exact_.deposit_and_clear(grads_.as<float>(), layout_.padded_size(),
                               sync && exact_floor_ == ExactPath::Direct);
    }
    ++micro_batches_;
    sync_ = sync;
    std::fill(param_ready_.begin(), param_ready_.end(), 0);
    return;
  }
  if (cfg_.stage == Stage::Zero3) {
    // Stage 3 keeps no full-size gradient: every micro-batch is reduced, and its slice
    // summed into the owned gradient (Staged) or the reduction is a no-op (one rank). The
    // first micro-batch of a step has nothing to reduce yet.
    if (micro_batches_ > 0) finish_grad_sync();
    next_start_ = 0;
    sync = true;
  }
  require(next_start_ == 0, Status::InvalidState,
          "begin_backward: gradients of this step were already reduced (a micro-batch with "
          "sync ran, or buckets were flushed); call step() first");
  if (!sync && staged() && accumulate_.data() == nullptr)
    accumulate_ = backend_.allocate(&tracker_, plan_.accumulate.category, plan_.accumulate.bytes);
  if (spill_param_ != kNone) flush_spill();
  ++micro_batches_;
  sync_ = sync;
  for (State& s : state_) s.ready = 0;
  std::fill(param_ready_.begin(), param_ready_.end(), 0);
}

void BucketSet::require_open(std::size_t i, bool writing) const {
  const ParamInfo& p = layout_.param(i);
  // Buckets start in index order. A write needs every bucket of the parameter unstarted (a
  // spanning parameter's first buckets can be in flight while its last waits for another
  // parameter); marking it ready needs its last one only (at staged stages its own
  // accumulation starts its earlier buckets, complete by the backward-order contract).
  const std::size_t first_needed = writing ? p.buckets.begin : p.buckets.end - 1;
  require(first_needed >= next_start_, Status::InvalidState,
          "gradient of parameter '" + p.name +
              "': its bucket was already reduced in this step; gradients must be produced in "
              "backward order (reverse registration order), each bucket once per step");
}

float* BucketSet::slot_data(int slot) const {
  return staging_.as<float>() + static_cast<std::size_t>(slot) * plan_.slot_elems;
}

std::span<float> BucketSet::grad(std::size_t i) {
  const ParamInfo& p = layout_.param(i);
  progress();
  // Writing into a bucket whose reduction has started would race with it.
  if (sync_) require_open(i, true);
  if (!staged()) return {grads_.as<float>() + p.flat.begin, p.numel};
  if (!sync_) return {accumulate_.as<float>() + p.flat.begin, p.numel};
  if (p.buckets.size() > 1) {  // a view across buckets: the spill buffer
    if (spill_param_ != i) {
      if (spill_param_ != kNone) flush_spill();
      start_through(p.buckets.begin);
      if (spill_.data() == nullptr)
        spill_ = backend_.allocate(&tracker_, plan_.spill.category, plan_.spill.bytes);
      spill_param_ = i;
    }
    return {spill_.as<float>(), p.numel};
  }
  const std::size_t b = p.buckets.begin;
  start_through(b);  // earlier buckets are complete by the backward-order contract
  return {slot_for(b) + (p.flat.begin - layout_.bucket(b).flat.begin), p.numel};
}

void BucketSet::accumulate_grad(std::size_t i, const void* src, DType dtype) {
  const ParamInfo& p = layout_.param(i);
  if (!staged() || !sync_ || spill_param_ == i) {
    backend_.accumulate(grad(i).data(), src, dtype, p.numel);
    return;
  }
  require_open(i, true);
  const std::size_t elem = dtype_size(dtype);
  for (std::size_t b = p.buckets.begin; b < p.buckets.end; ++b) {
    start_through(b);
    const Range bucket = layout_.bucket(b).flat;
    const Range piece = p.flat.intersect(bucket);
    backend_.accumulate(slot_for(b) + (piece.begin - bucket.begin),
                        static_cast<const char*>(src) + (piece.begin - p.flat.begin) * elem,
                        dtype, piece.size());
  }
  progress();
}

void BucketSet::flush_spill() {
  const ParamInfo& p = layout_.param(spill_param_);
  spill_param_ = kNone;
  for (std::size_t b = p.buckets.begin; b < p.buckets.end; ++b) {
    start_through(b);
    const Range bucket = layout_.bucket(b).flat;
    const Range piece = p.flat.intersect(bucket);
    backend_.accumulate(slot_for(b) + (piece.begin - bucket.begin),
                        spill_.as<float>() + (piece.begin - p.flat.begin), DType::F32,
                        piece.size());
  }
  backend_.fill_zero(spill_.data(), p.numel * sizeof(float));
}

void BucketSet::grad_ready(std::size_t i) {
  const ParamInfo& p = layout_.param(i);
  require(param_ready_[i] == 0, Status::InvalidState,
          "grad_ready: parameter '" + p.name + "' was already marked ready in this micro-batch");
  if (!sync_ || (cfg_.reproducible && !sharded())) {  // nothing starts before the step
    param_ready_[i] = 1;
    return;
  }
  require_open(i, false);
  param_ready_[i] = 1;
  if (spill_param_ == i) flush_spill();
  for (std::size_t b = std::max(p.buckets.begin, next_start_); b < p.buckets.end; ++b)
    ++state_[b].ready;
  if (cfg_.overlap || staged()) {
    // Start complete buckets in bucket order only, so that every rank issues the same
    // sequence of collectives whatever order its parameters became ready in.
    std::size_t end = next_start_;
    while (end < state_.size() && state_[end].ready == layout_.bucket(end).num_params()) ++end;
    start_through(end);
  }
  progress();
}

void BucketSet::start_through(std::size_t end) {
  if (spill_param_ != kNone && end > layout_.param(spill_param_).buckets.begin) flush_spill();
  while (next_start_ < end) start_grad_sync(next_start_);
}

BatchedCollective BucketSet::grad_sync_op(std::size_t b) {
  using C = BatchedCollective::Op;
  const Bucket& bk = layout_.bucket(b);
  finish_op(b);  // the previous step's gather of this bucket, if still outstanding
  float* data = staged() ? slot_for(b) : grads_.as<float>() + bk.flat.begin;
  if (cfg_.stage == Stage::DataParallel)
    return {C::AllReduceSum, data, bk.flat.size(), {}, cfg_.wire};
  // A staging slot is cleared after its reduction anyway: the communicator may do it as it sums.
  if (bk.equal_cut) return {C::ReduceScatterSum, data, bk.slice_elems, {}, cfg_.wire, staged()};
  return {C::ReduceScatterSumV, data, 0, bk.counts, cfg_.wire, staged()};  // Whole: ragged ranges
}

void BucketSet::start_grad_sync(std::size_t b) {
  if (sharded()) {
    exchange_deposit(b);
    return;
  }
  const BatchedCollective op = grad_sync_op(b);
  {
    const ScopedSeconds timed(blocked_seconds_);
    begin_op(b, Op::GradSync, comm_.start_collective(op));
  }
  state_[b].slot_cleared = staged() && comm_.clears_inputs(op);
  grad_in_flight_.push_back(b);
  next_start_ = b + 1;
  if (!cfg_.overlap) {
    while (!grad_in_flight_.empty()) complete_oldest_grad_sync();
  }
}

// Without overlap and unstaged, no bucket starts before the step on any rank (grad() and
// grad_ready() start nothing), so every rank starts the same buckets here and may batch them
// alike. With overlap, or staged, which buckets are left for the step depends on each rank's
// calls (a parameter one rank never marks ready): those start one by one, as the same
// sequence of single collectives on every rank.
void BucketSet::start_grad_syncs_batched(std::size_t end) {
  while (next_start_ < end) {
    const std::size_t first = next_start_;
    const std::size_t last = std::min(end, first + cfg_.batch);
    std::vector<BatchedCollective> ops;
    for (std::size_t b = first; b < last; ++b) ops.push_back(grad_sync_op(b));
    std::vector<std::unique_ptr<CommRequest>> requests;
    {
      const ScopedSeconds timed(blocked_seconds_);
      requests = comm_.start_batch(ops);
    }
    for (std::size_t b = first; b < last; ++b) {
      begin_op(b, Op::GradSync, std::move(requests[b - first]));
      grad_in_flight_.push_back(b);
    }
    next_start_ = last;
    while (!grad_in_flight_.empty()) complete_oldest_grad_sync();
  }
}

// Completed reductions at the front are finished now, not at the step: a staging slot frees
// sooner, and the norm's sum of squares reads a slice that was just written.
void BucketSet::retire_completed_grad_syncs() {
  if (grad_in_flight_.empty()) return;
  // A test may do the collective's work (MPI progresses inside its calls): that is time the
  // trainer's thread spends on gradient communication too.
  const ScopedSeconds timed(blocked_seconds_);
  for (std::size_t b : grad_in_flight_) {
    if (state_[b].op == Op::None) continue;  // finished here already, slot not released
    if (!state_[b].request->test()) break;
    finish_op(b);
  }
}

// In start order, at points every rank reaches alike (a slot is needed, or the step).
void BucketSet::complete_oldest_grad_sync() {
  const ScopedSeconds timed(blocked_seconds_);
  const std::size_t b = grad_in_flight_.front();
  grad_in_flight_.pop_front();
  finish_op(b);
  State& s = state_[b];
  if (staged() && s.slot >= 0) {
    free_slots_.push_back(s.slot);
    s.slot = -1;
  }
}

float* BucketSet::slot_for(std::size_t b) {
  State& s = state_[b];
  if (s.slot < 0) {
    while (free_slots_.empty()) complete_oldest_grad_sync();
    s.slot = free_slots_.back();
    free_slots_.pop_back();
    if (accumulate_.data() != nullptr) {
      // Earlier micro-batches accumulated this bucket locally: it joins the reduction.
      const Range r = layout_.bucket(b).flat;
      backend_.accumulate(slot_data(s.slot), accumulate_.as<float>() + r.begin, DType::F32,
                          r.size());
      backend_.fill_zero(accumulate_.as<float>() + r.begin, r.size() * sizeof(float));
    }
  }
  return slot_data(s.slot);
}

void BucketSet::exchange_deposit(std::size_t b) {
  finish_op(b);  // the previous step's gather of this bucket, if still outstanding
  float* slot = slot_for(b);
  const Bucket& bk = layout_.bucket(b);
  // Past the packed words' limit (63 values per element: ranks times rounds) the owned
  // elements' bins take over, on every rank in the same round (local memory: no collective).
  if (exact_.round_full(comm_.size())) ensure_bins();
  {
    const ScopedSeconds timed(blocked_seconds_);
    require(exact_.exchange_deposit(comm_, bk, slot, bk.local_begin_of(comm_.rank())),
            Status::Unsupported,
            "reproducible mode at stage 2: this communicator cannot exchange raw values "
            "(reduce_scatter_combine); set SHARDOPT_REPRO_EXCHANGE=two-phase for the "
            "full-buffer path");
  }
  // Exchanged synchronously: the slot is free again at once, on every rank in the same
  // order (one slot in use at a time), so the shared-memory exchange finds every rank's
  // bucket at the same offset.
  State& s = state_[b];
  backend_.fill_zero(slot, bk.flat.size() * sizeof(float));
  free_slots_.push_back(s.slot);
  s.slot = -1;
  next_start_ = b + 1;
}

bool BucketSet::exchange_round(bool more) {
  if (spill_param_ != kNone) flush_spill();
  start_through(state_.size());
  exact_.next_round();
  next_start_ = 0;
  double flags[2] = {more ? 1.0 : 0.0, static_cast<double>(micro_batches_)};
  comm_.all_reduce_sum_host(flags, 2);
  if (flags[0] == 0) total_micro_batches_ = static_cast<std::int64_t>(flags[1]);
  return flags[0] > 0;
}

void BucketSet::finish_grad_sync() {
  if (sharded()) {
    if (reduced_) return;  // reduced already in this step
    // (No agreement that every rank is here: a rank with more micro-batches meets this one in
    // begin_backward's round, which is the same sequence of collectives.)
    // This rank's last micro-batch (or, with none, zeros), then empty rounds while another
    // rank still has micro-batches: every rank takes part in every exchange, none hangs.
    while (exchange_round(false)) {
    }
    require_exact_headroom(total_micro_batches_, comm_.size());
    // The owner rounds its slices once; their exact squares are the norm's part.
    const ScopedSeconds timed(blocked_seconds_);
    exact_squares_ = exact::SquareSum();
    const int me = comm_.rank();
    for (std::size_t b = 0; b < state_.size(); ++b) {
      const Bucket& bk = layout_.bucket(b);
      const std::size_t at = bk.local_begin_of(me);
      exact_.round_to(at, bk.slice_size(me), grads_.as<float>() + at);
      const Backend::Slice slice = norm_slice(b);
      backend_.exact_square_add(slice.data, slice.n, exact_squares_.digits());
    }
    next_start_ = state_.size();
    reduced_ = true;
    return;
  }
  if (cfg_.reproducible) {
    reduce_exactly();
    return;
  }
  if (spill_param_ != kNone) flush_spill();
  if (!cfg_.overlap && !staged() && cfg_.batch > 1) start_grad_syncs_batched(state_.size());
  start_through(state_.size());
  while (!grad_in_flight_.empty()) complete_oldest_grad_sync();
}

std::size_t BucketSet::max_bucket() const {
  std::size_t n = 0;
  for (const Bucket& b : layout_.buckets()) n = std::max(n, b.flat.size());
  return n;
}

void BucketSet::ensure_exact() {
  if (exact_allocated_) return;
  Allocation storage = backend_.allocate(&tracker_, plan_.exact.category, plan_.exact.bytes);
  exact_ = plan_.exact_compact
               ? exact::ExactGrads::compact(backend_, std::move(storage), layout_.padded_size())
               : exact::ExactGrads(backend_, std::move(storage), layout_.padded_size(), max_bucket());
  exact_allocated_ = true;
}

void BucketSet::ensure_bins() {
  if (exact_allocated_ && !exact_.is_compact()) return;
  // The compact form's bins are plan_.exact_wide; allocated before the words go (widen).
  // The sharded accumulation's cover the owned elements only.
  const BufferSpec& spec = plan_.exact_compact || sharded() ? plan_.exact_wide : plan_.exact;
  Allocation storage = backend_.allocate(&tracker_, spec.category, spec.bytes);
  if (exact_allocated_) {
    exact_.widen(std::move(storage), sharded() ? 0 : max_bucket());
  } else {
    exact_ = exact::ExactGrads(backend_, std::move(storage), layout_.padded_size(), max_bucket());
    exact_allocated_ = true;
  }
}

void BucketSet::widen_everywhere() {
  collective(comm_, "reduce_gradients (reproducible)", [&] { ensure_bins(); });
  exact_.release_retired();  // every rank widened: the shared words' window goes together
  exact_share_tried_ = false;
}

void BucketSet::share_words() {
  exact_share_tried_ = true;
  collective(comm_, "reduce_gradients (reproducible)", [&] {
    // A communicator without windows (plain MPI) hands out nothing and the accumulator stays.
    // Otherwise the window replaces this rank's words or bins (the step is reduced: their
    // state is spent), which exist next to it for that moment only.
    Allocation words = comm_.allocate_collective_buffer(&tracker_, plan_.exact.category, plan_.exact.bytes);
    if (words.data() == nullptr) return;
    exact_ = exact::ExactGrads::compact(backend_, std::move(words), layout_.padded_size(), true);
    exact_allocated_ = true;
  });
}

void BucketSet::reduce_exactly() {
  if (next_start_ == state_.size()) return;  // reduced already in this step
  collective(comm_, "reduce_gradients (reproducible)", [] {});  // every rank is here
  // The method (docs/architecture.md, "Reproducible mode"; plan_exact_step predicts it, from
  // the same exact_path_needed): the direct exchange of raw values
  // when no rank deposited anything (at most one micro-batch each; an idle rank contributes
  // zeros), the packed exchange when every rank's bins fit the packed word (at most 63
  // micro-batches), else the two-phase method. One small all-reduce agrees on it: each rank
  // states the slowest method it needs, and counts its micro-batches (the average divides
  // by the step's total: counts may differ between ranks).
  // Two micro-batches with shared words: the first is held raw (ExactGrads::holds_raw), and
  // when no rank deposited into its words the owners combine every rank's two raw values in
  // place (RawPairInPlace); otherwise the held values join the words first.
  const ExactPath need = exact_path_needed(micro_batches_, exact_floor_);
  const bool holds = exact_allocated_ && exact_.holds_raw();
  const bool deposited = exact_allocated_ && exact_.deposited();
  double agreed[6] = {need != ExactPath::Direct ? 1.0 : 0.0, need == ExactPath::TwoPhase ? 1.0 : 0.0,
                      static_cast<double>(micro_batches_), exact_no_share_ ? 1.0 : 0.0,
                      holds ? 1.0 : 0.0, deposited ? 1.0 : 0.0};
  comm_.all_reduce_sum_host(agreed, 6);
  const bool may_share = agreed[3] == 0;
  exact_method_ = agreed[1] > 0                     ? ExactPath::TwoPhase
                  : agreed[4] > 0 && agreed[5] == 0 ? ExactPath::RawPairInPlace
                  : agreed[0] > 0                   ? ExactPath::Packed
                                                    : ExactPath::Direct;
  total_micro_batches_ = static_cast<std::int64_t>(agreed[2]);
  // The same figures on every rank: the same error on every rank.
  require_exact_headroom(total_micro_batches_, comm_.size());
  // Whole-tensor ownership's ragged buckets (not whole, not equal slices) take the two-phase
  // method whatever this step's method is: the exchanges deliver equal blocks.
  const bool whole = cfg_.stage == Stage::DataParallel;
  // The two-phase method needs the bins on every rank (this rank may have none yet, or the
  // compact form's words: widened); so does the packed exchange of the bins. The compact
  // form's packed exchange needs nothing on a rank that deposited nothing (all empty). With
  // ragged buckets the bins were allocated at finalize.
  if (exact_method_ == ExactPath::TwoPhase)
    widen_everywhere();
  else if (exact_method_ == ExactPath::Packed && !plan_.exact_compact)
    collective(comm_, "reduce_gradients (reproducible)", [&] { ensure_exact(); });
  const ScopedSeconds timed(blocked_seconds_);
  exact_squares_ = exact::SquareSum();
  float* grads = grads_.as<float>();
  for (std::size_t b = 0; b < state_.size(); ++b) {
    const Bucket& bk = layout_.bucket(b);
    // A communicator that cannot exchange raw values says so on every rank alike; the
    // remaining buckets then take the two-phase method.
    if (!exact::exchanges(bk, whole)) {
      // the two-phase method below, for this bucket only
    } else if (exact_method_ == ExactPath::Direct) {
      if (exact_.reduce_direct(comm_, backend_, bk, whole, grads, exact_squares_)) continue;
      widen_everywhere();
      exact_method_ = ExactPath::TwoPhase;
    } else if (exact_method_ == ExactPath::RawPairInPlace) {
      if (exact_.reduce_held(comm_, backend_, bk, whole, grads, exact_squares_)) continue;
      // Not readable in place (the same on every rank): the held values join the words and
      // this bucket and the rest take the packed exchange.
      exact_.settle();
      exact_method_ = ExactPath::Packed;
      if (exact_.reduce_packed(comm_, backend_, bk, whole, grads, exact_wire_.as<std::uint64_t>(),
                                exact_squares_))
        continue;
      widen_everywhere();
      exact_method_ = ExactPath::TwoPhase;
    } else if (exact_method_ == ExactPath::Packed) {
      if (exact_.reduce_packed(comm_, backend_, bk, whole, grads, exact_wire_.as<std::uint64_t>(),
                                exact_squares_))
        continue;
      widen_everywhere();
      exact_method_ = ExactPath::TwoPhase;
    }
    exact_.reduce(comm_, bk, whole, grads);
    const Backend::Slice slice = norm_slice(b);
    backend_.exact_square_add(slice.data, slice.n, exact_squares_.digits());
  }
  next_start_ = state_.size();
  // Every bucket went by the packed exchange (the same on every rank): from the next step
  // the words can be read in place.
  if (exact_method_ == ExactPath::Packed && plan_.exact_compact && may_share && !exact_.shared() &&
      !exact_share_tried_ && comm_.size() > 1)
    share_words();
}

Range BucketSet::window(std::size_t b) const {
  const Bucket& bk = layout_.bucket(b);
  return cfg_.stage == Stage::DataParallel ? bk.flat : bk.slice(comm_.rank());
}

std::size_t BucketSet::window_local(std::size_t b) const {
  const Bucket& bk = layout_.bucket(b);
  return cfg_.stage == Stage::DataParallel ? bk.flat.begin : bk.local_begin_of(comm_.rank());
}

const float* BucketSet::reduced_grad(std::size_t b) const {
  if (staged()) return grads_.as<float>() + layout_.bucket(b).local_begin_of(comm_.rank());
  return grads_.as<float>() + window(b).begin;
}

Backend::Slice BucketSet::norm_slice(std::size_t b) const {
  const Bucket& bk = layout_.bucket(b);
  const int me = comm_.rank();
  const std::size_t skip =
      cfg_.stage == Stage::DataParallel ? bk.slice(me).begin - bk.flat.begin : 0;
  return {reduced_grad(b) + skip, bk.slice_size(me)};
}

std::span<const double> BucketSet::norm_sums() const { return norm_sums_; }

void BucketSet::zero_grads() {
  while (!grad_in_flight_.empty()) complete_oldest_grad_sync();
  backend_.fill_zero(grads_.data(), grads_.bytes());
  if (exact_allocated_) exact_.clear();
  if (staged()) {
    for (std::size_t b = 0; b < state_.size(); ++b) {
      State& s = state_[b];
      if (s.slot < 0) continue;
      backend_.fill_zero(slot_data(s.slot), layout_.bucket(b).flat.size() * sizeof(float));
      free_slots_.push_back(s.slot);
      s.slot = -1;
    }
    if (accumulate_.data() != nullptr) backend_.fill_zero(accumulate_.data(), accumulate_.bytes());
    if (spill_.data() != nullptr) backend_.fill_zero(spill_.data(), spill_.bytes());
    spill_param_ = kNone;
  }
  next_start_ = 0;
  reduced_ = false;
  micro_batches_ = 0;
  total_micro_batches_ = 0;
  sync_ = true;
  blocked_seconds_ = 0.0;
  for (State& s : state_) s.ready = 0;
  std::fill(param_ready_.begin(), param_ready_.end(), 0);
}

// ---- parameters -------------------------------------------------------------------------------

void BucketSet::start_param_sync(std::size_t b) {
  const std::size_t one[1] = {b};
  start_param_syncs(one);
}

void BucketSet::start_param_syncs(std::span<const std::size_t> buckets) {
  const std::size_t elem = cfg_.param_type == CommType::F32 ? 4 : 2;
  for (std::size_t at = 0; at < buckets.size(); at += cfg_.batch) {
    const std::span<const std::size_t> group =
        buckets.subspan(at, std::min(cfg_.batch, buckets.size() - at));
    std::vector<BatchedCollective> ops;
    for (std::size_t b : group) {
      const Bucket& bk = layout_.bucket(b);
      ops.push_back(bucket_gather(bk, replica_ + bk.flat.begin * elem, cfg_.param_type));
    }
    std::vector<std::unique_ptr<CommRequest>> requests = comm_.start_batch(ops);
    for (std::size_t k = 0; k < group.size(); ++k)
      begin_op(group[k], Op::ParamSync, std::move(requests[k]));
  }
}

BatchedCollective bucket_gather(const Bucket& bk, void* data, CommType type) {
  if (bk.equal_cut) return {BatchedCollective::Op::AllGather, data, bk.slice_elems, {}, type};
  // Whole ownership: the bucket's ragged per-rank ranges
  return {BatchedCollective::Op::AllGatherV, data, 0, bk.counts, type};
}

void BucketSet::wait_param(std::size_t i) {
  const Range bs = layout_.param(i).buckets;
  for (std::size_t b = bs.begin; b < bs.end; ++b)
    if (state_[b].op == Op::ParamSync) finish_op(b);
}

void BucketSet::wait_params() {
  for (std::size_t b = 0; b < state_.size(); ++b)
    if (state_[b].op == Op::ParamSync) finish_op(b);
}

void BucketSet::progress() {
  retire_completed_grad_syncs();
  for (std::size_t b = 0; b < state_.size(); ++b)
    if (state_[b].op == Op::ParamSync && state_[b].request->test()) finish_op(b);
}

}  // namespace shardopt
