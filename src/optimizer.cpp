// optimizer.cpp: the step of the sharded optimizer, written once over Backend and
// Communicator: reduce(-scatter), global norm and clipping, fused update, all-gather.
#include "shardopt/optimizer.hpp"

#include <chrono>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>
#include <utility>

#include "backend.hpp"
#include "grad_reducer.hpp"

namespace shardopt {

struct ShardedOptimizer::Buffers {
  Allocation replica;     ///< full parameter replica (param dtype)
  Allocation master;      ///< owned fp32 master (absent when the replica is fp32)
  Allocation exp_avg;
  Allocation exp_avg_sq;
  float* master_ptr = nullptr;
};

namespace {

using Clock = std::chrono::steady_clock;

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// Seconds since the previous lap (or since construction), for StepTimings.
class LapTimer {
 public:
  double lap() {
    const Clock::time_point now = Clock::now();
    const double s = seconds(now - last_);
    last_ = now;
    return s;
  }
  double since_start() const { return seconds(Clock::now() - start_); }

 private:
  Clock::time_point start_ = Clock::now();
  Clock::time_point last_ = start_;
};

std::unique_ptr<Backend> make_backend(Device d) {
  return d == Device::Cuda ? make_cuda_backend() : make_cpu_backend();
}

std::string options_problem(const OptimizerOptions& o) {
  std::string p = validate(o.adam);
  if (!p.empty()) return p;
  if (o.stage != Stage::DataParallel && o.stage != Stage::Zero1 && o.stage != Stage::Zero2)
    return "invalid stage " + std::to_string(static_cast<int>(o.stage));
  if (o.param_dtype != DType::F32 && o.param_dtype != DType::BF16) return "invalid param dtype";
  if (o.device != Device::Cpu && o.device != Device::Cuda) return "invalid device";
  if (o.bucket_elems == 0) return "bucket_elems must be positive";
  if (o.buckets_in_flight < 1) return "buckets_in_flight must be at least 1";
  if (o.reduce_dtype != DType::F32 && o.reduce_dtype != DType::BF16) return "invalid reduce dtype";
  return validate(o.loss_scaling);
}

// The buffers that go through collectives (replica, full gradient, stage-2 staging) come from
// the communicator when it has faster memory for them (a shared-memory window), else from
// the backend. Collective: every rank calls it for the same buffers in the same order.
Allocation collective_buffer(Communicator& comm, Backend& be, Device device,
                             MemoryTracker* tracker, MemCategory category, std::size_t bytes) {
  if (device == Device::Cpu) {
    Allocation a = comm.allocate_collective_buffer(tracker, category, bytes);
    if (a.data() != nullptr) return a;
  }
  return be.allocate(tracker, category, bytes);
}

// Collective constructor check: throws the same error on every rank if any rank's options
// are invalid, before anything else is communicated.
std::shared_ptr<Communicator> checked(std::shared_ptr<Communicator> comm,
                                      const OptimizerOptions& o) {
  require(comm != nullptr, Status::InvalidArgument, "communicator is null");
  std::string problem = options_problem(o);
  // The communicator must accept the buffers where the device puts them. A host
  // communicator of one rank moves no data, so it also serves Device::Cuda.
  const bool cuda = o.device == Device::Cuda;
  if (problem.empty() && comm->device_buffers() && !cuda)
    problem = "Device::Cpu needs a communicator of host buffers, not " + comm->name();
  if (problem.empty() && !comm->device_buffers() && cuda && comm->size() > 1)
    problem = "Device::Cuda needs a communicator of device buffers (NCCL), not " + comm->name();
  agree_or_throw(*comm, problem.empty() ? Status::Ok : Status::InvalidArgument, problem);
  return comm;
}

}  // namespace

ShardedOptimizer::ShardedOptimizer(std::shared_ptr<Communicator> comm, OptimizerOptions options)
    : comm_(checked(std::move(comm), options)),
      options_(options),
      backend_(make_backend(options.device)),
      groups_{GroupOptions{}},
      buf_(std::make_unique<Buffers>()) {
  if (options_.loss_scaling.enabled) loss_scale_.scale = options_.loss_scaling.initial_scale;
}

ShardedOptimizer::~ShardedOptimizer() {
  try {
    wait_gathers();  // collectives in flight must complete before their buffers go away
  } catch (...) {  // a destructor cannot report
  }
}

void ShardedOptimizer::require_finalized(const char* what) const {
  require(finalized_, Status::InvalidState,
          std::string(what) + ": call finalize() after registering parameters first");
}

void ShardedOptimizer::require_registering(const char* what) const {
  require(!finalized_, Status::InvalidState,
          std::string(what) + ": the optimizer is already finalized");
}

int ShardedOptimizer::add_group(const GroupOptions& group) {
  require_registering("add_group");
  const std::string problem = validate(group);
  require(problem.empty(), Status::InvalidArgument, "add_group: " + problem);
  groups_.push_back(group);
  return static_cast<int>(groups_.size() - 1);
}

void ShardedOptimizer::set_group(int group, const GroupOptions& g) {
  require(group >= 0 && static_cast<std::size_t>(group) < groups_.size(),
          Status::InvalidArgument, "set_group: no group " + std::to_string(group));
  const std::string problem = validate(g);
  require(problem.empty(), Status::InvalidArgument, "set_group: " + problem);
  groups_[static_cast<std::size_t>(group)] = g;
}

std::size_t ShardedOptimizer::add_param(std::string_view name, std::size_t numel, int group) {
  require_registering("add_param");
  require(group >= 0 && static_cast<std::size_t>(group) < groups_.size(),
          Status::InvalidArgument,
          "add_param: parameter '" + std::string(name) + "' names group " +
              std::to_string(group) + ", but only " + std::to_string(groups_.size()) +
              " groups exist");
  return layout_.add(name, numel, group);
}

// ---- finalize ---------------------------------------------------------------------------

namespace {

// Everything that must be identical on every rank, hashed.
std::uint64_t configuration_fingerprint(const FlatLayout& layout, const OptimizerOptions& o,
                                        const std::vector<GroupOptions>& groups) {
  std::uint64_t h = layout.fingerprint();
  const std::int64_t ints[7] = {static_cast<int>(o.stage), static_cast<int>(o.param_dtype),
                                static_cast<int>(o.adam.mode),
                                static_cast<std::int64_t>(o.bucket_elems), o.overlap ? 1 : 0,
                                o.buckets_in_flight, static_cast<int>(o.reduce_dtype)};
  h = fnv1a64(ints, sizeof ints, h);
  const double reals[6] = {o.adam.lr, o.adam.beta1, o.adam.beta2, o.adam.eps,
                           o.adam.weight_decay, o.adam.max_grad_norm};
  h = fnv1a64(reals, sizeof reals, h);
  for (const GroupOptions& g : groups) {
    const double rec[2] = {g.lr_scale, g.weight_decay ? 1.0 : 0.0};
    h = fnv1a64(rec, sizeof rec, h);
  }
  return h;
}

struct RankSummary {
  std::uint64_t fingerprint;
  std::uint64_t num_params;
  std::uint64_t elements;
  std::int32_t stage;
  std::int32_t dtype;
};

}  // namespace

void ShardedOptimizer::finalize() {
  require_registering("finalize");
  FlatLayout layout = layout_;
  Status status = Status::Ok;
  std::string problem;
  try {
    layout.build(comm_->size());
  } catch (const Error& e) {
    status = e.status();
    problem = e.what();
  }
  agree_or_throw(*comm_, status, problem);

  // Every rank compares everyone's fingerprint, so all of them detect a mismatch.
  const RankSummary mine{configuration_fingerprint(layout, options_, groups_),
                         layout.num_params(), layout.unpadded_size(),
                         static_cast<std::int32_t>(options_.stage),
                         static_cast<std::int32_t>(options_.param_dtype)};
  std::vector<RankSummary> all(static_cast<std::size_t>(comm_->size()));
  comm_->all_gather_bytes(&mine, all.data(), sizeof(RankSummary));
  bool same = true;
  for (const RankSummary& r : all) same = same && r.fingerprint == all[0].fingerprint;
  if (!same) {
    std::ostringstream os;
    os << "finalize: parameter layout or options differ across ranks (names, sizes, order, "
          "groups, dtype, stage and hyperparameters must match):";
    for (std::size_t r = 0; r < all.size(); ++r)
      os << " rank " << r << ": " << all[r].num_params << " params, " << all[r].elements
         << " elements, " << stage_name(static_cast<Stage>(all[r].stage)) << ", "
         << dtype_name(static_cast<DType>(all[r].dtype)) << ", hash " << std::hex
         << all[r].fingerprint << std::dec << ";";
    throw Error(Status::LayoutMismatch, os.str());
  }

  try {
    layout_ = std::move(layout);
    const bool sharded = options_.stage != Stage::DataParallel;
    owned_ = sharded ? layout_.shard_range(comm_->rank()) : Range{0, layout_.padded_size()};
    const std::size_t padded = layout_.padded_size();
    const std::size_t owned = owned_.size();
    Backend& be = *backend_;
    Buffers& b = *buf_;
    b.replica = collective_buffer(*comm_, be, options_.device, &tracker_, MemCategory::Params,
                                  padded * dtype_size(options_.param_dtype));
    const Device device = options_.device;
    Communicator& comm = *comm_;
    MemoryTracker* tracker = &tracker_;
    reducer_ = std::make_unique<GradReducer>(
        comm, be, tracker_, layout_, owned_,
        GradReducer::Config{options_.stage, options_.bucket_elems, options_.buckets_in_flight,
                            options_.reduce_dtype == DType::BF16 ? CommType::BF16 : CommType::F32,
                            options_.overlap},
        [&comm, &be, device, tracker](MemCategory c, std::size_t bytes) {
          return collective_buffer(comm, be, device, tracker, c, bytes);
        });
    gathers_.resize(reducer_->buckets().size());
    if (options_.param_dtype == DType::F32) {
      b.master_ptr = b.replica.as<float>() + owned_.begin;  // fp32 replica is the master
    } else {
      b.master = be.allocate(&tracker_, MemCategory::Master, owned * sizeof(float));
      b.master_ptr = b.master.as<float>();
    }
    b.exp_avg = be.allocate(&tracker_, MemCategory::Moments, owned * sizeof(float));
    b.exp_avg_sq = be.allocate(&tracker_, MemCategory::Moments, owned * sizeof(float));
    status = Status::Ok;
  } catch (const Error& e) {
    status = e.status();
    problem = e.what();
  }
  agree_or_throw(*comm_, status, problem);
  finalized_ = true;
}

// ---- parameters and gradients -----------------------------------------------------------

void* ShardedOptimizer::replica_ptr(std::size_t elem_offset) const {
  return buf_->replica.as<char>() + elem_offset * dtype_size(options_.param_dtype);
}

void ShardedOptimizer::set_param(std::size_t i, std::span<const float> values) {
  require_finalized("set_param");
  const ParamInfo& p = layout_.param(i);
  require(values.size() == p.numel, Status::InvalidArgument,
          "set_param: parameter '" + p.name + "' has " + std::to_string(p.numel) +
              " elements, got " + std::to_string(values.size()));
  wait_gathers();
  // Host-side cast, then one copy: set_param is not on the hot path.
  if (options_.param_dtype == DType::BF16) {
    std::vector<bf16> low(p.numel);
    for (std::size_t k = 0; k < p.numel; ++k) low[k] = to_bf16(values[k]);
    backend_->copy_from_host(replica_ptr(p.flat.begin), low.data(), p.numel * sizeof(bf16));
  } else {
    backend_->copy_from_host(replica_ptr(p.flat.begin), values.data(), p.numel * sizeof(float));
  }
  const Range mine = p.flat.intersect(owned_);
  if (!mine.empty() && options_.param_dtype == DType::BF16)
    backend_->copy_from_host(buf_->master_ptr + (mine.begin - owned_.begin),
                             values.data() + (mine.begin - p.flat.begin),
                             mine.size() * sizeof(float));
}

void ShardedOptimizer::get_master(std::size_t i, std::span<float> out) {
  require_finalized("get_master");
  const ParamInfo& p = layout_.param(i);
  require(out.size() == p.numel, Status::InvalidArgument,
          "get_master: parameter '" + p.name + "' has " + std::to_string(p.numel) +
              " elements, got a buffer of " + std::to_string(out.size()));
  std::vector<float> mine_vals(p.numel, 0.0f);
  const Range mine = p.flat.intersect(owned_);
  if (!mine.empty())
    backend_->copy_to_host(mine_vals.data() + (mine.begin - p.flat.begin),
                           buf_->master_ptr + (mine.begin - owned_.begin),
                           mine.size() * sizeof(float));
  if (options_.stage == Stage::DataParallel || comm_->size() == 1) {
    std::copy(mine_vals.begin(), mine_vals.end(), out.begin());
    return;
  }
  // Exactly one rank owns each element; the others add zeros, so the sum is exact.
  std::vector<double> sum(mine_vals.begin(), mine_vals.end());
  comm_->all_reduce_sum_host(sum.data(), sum.size());
  for (std::size_t k = 0; k < p.numel; ++k) out[k] = static_cast<float>(sum[k]);
}

template <class T>
std::span<T> ShardedOptimizer::param(std::size_t i) {
  require_finalized("param");
  constexpr DType want = std::is_same_v<T, float> ? DType::F32 : DType::BF16;
  require(want == options_.param_dtype, Status::InvalidArgument,
          std::string("param: the replica is ") + dtype_name(options_.param_dtype) +
              ", not " + dtype_name(want));
  const ParamInfo& p = layout_.param(i);
  wait_param(i);
  return {static_cast<T*>(replica_ptr(p.flat.begin)), p.numel};
}

void ShardedOptimizer::wait_param(std::size_t i) {
  require_finalized("wait_param");
  layout_.param(i);  // index check
  std::unique_ptr<CommRequest>& g = gathers_[reducer_->bucket_of(i)];
  if (g) {
    g->wait();
    g.reset();
  }
}

void ShardedOptimizer::wait_gathers() {
  for (std::unique_ptr<CommRequest>& g : gathers_) {
    if (!g) continue;
    g->wait();
    g.reset();
  }
}

void ShardedOptimizer::begin_backward(bool sync) {
  require_finalized("begin_backward");
  reducer_->begin_backward(sync);
}
template std::span<float> ShardedOptimizer::param<float>(std::size_t);
template std::span<bf16> ShardedOptimizer::param<bf16>(std::size_t);

std::span<float> ShardedOptimizer::grad(std::size_t i) {
  require_finalized("grad");
  return reducer_->grad(i);
}

void ShardedOptimizer::accumulate_grad(std::size_t i, std::span<const float> src) {
  const std::span<float> g = grad(i);
  require(src.size() == g.size(), Status::InvalidArgument,
          "accumulate_grad: parameter '" + layout_.param(i).name + "' has " +
              std::to_string(g.size()) + " elements, got " + std::to_string(src.size()));
  backend_->accumulate(g.data(), src.data(), DType::F32, g.size());
}

void ShardedOptimizer::accumulate_grad(std::size_t i, std::span<const bf16> src) {
  const std::span<float> g = grad(i);
  require(src.size() == g.size(), Status::InvalidArgument,
          "accumulate_grad: parameter '" + layout_.param(i).name + "' has " +
              std::to_string(g.size()) + " elements, got " + std::to_string(src.size()));
  backend_->accumulate(g.data(), src.data(), DType::BF16, g.size());
}

void ShardedOptimizer::grad_ready(std::size_t i) {
  require_finalized("grad_ready");
  reducer_->grad_ready(i);
}

void ShardedOptimizer::progress() {
  require_finalized("progress");
  reducer_->progress();
  for (std::unique_ptr<CommRequest>& g : gathers_)
    if (g && g->test()) g.reset();
}

void ShardedOptimizer::reduce_gradients() {
  require_finalized("reduce_gradients");
  reducer_->finish();
}

void ShardedOptimizer::zero_grad() {
  require_finalized("zero_grad");
  reducer_->zero();
}

// ---- the step -------------------------------------------------------------------------------

void ShardedOptimizer::set_lr(double lr) {
  AdamConfig c = options_.adam;
  c.lr = lr;
  set_adam_config(c);
}

void ShardedOptimizer::set_adam_config(const AdamConfig& c) {
  const std::string problem = validate(c);
  require(problem.empty(), Status::InvalidArgument, "set_adam_config: " + problem);
  options_.adam = c;
}

std::vector<UpdateSegment> ShardedOptimizer::make_segments(const StepHyper& h,
                                                           Range window) const {
  std::vector<SegmentScalars> per_group;
  for (const GroupOptions& g : groups_)
    per_group.push_back(make_segment_scalars(h, g.lr_scale, g.weight_decay));
  // Each piece is extended over the padding that follows it (always zero, so any scalars
  // keep it zero); neighbours of the same group merge into one segment. Offsets are
  // relative to window.begin.
  std::vector<UpdateSegment> segs;
  int last_group = -1;
  for (const ShardPiece& piece : layout_.pieces_in(window)) {
    const int g = layout_.param(piece.param).group;
    if (g == last_group) {
      segs.back().end = piece.local.end;
      continue;
    }
    if (!segs.empty()) segs.back().end = piece.local.begin;
    segs.push_back(UpdateSegment{segs.empty() ? 0 : piece.local.begin, piece.local.end,
                                 per_group[static_cast<std::size_t>(g)]});
    last_group = g;
  }
  if (segs.empty()) segs.push_back(UpdateSegment{0, 0, per_group[0]});
  segs.back().end = window.size();
  return segs;
}

void ShardedOptimizer::all_gather_replica() {
  if (options_.stage == Stage::DataParallel || comm_->size() == 1) return;
  comm_->all_gather_inplace(buf_->replica.data(), layout_.shard_size(),
                            options_.param_dtype == DType::F32 ? CommType::F32 : CommType::U16);
}

// Updates the owned range and gathers the replica; returns the seconds spent updating. With
// overlap (stages 1/2) this goes bucket by bucket in forward order: each bucket's all-gather
// starts right after its part of the update, and the next forward waits only for the
// buckets it reads (param()).
double ShardedOptimizer::update_and_gather(const StepScalars& s, const StepHyper& h,
                                           const float* grads) {
  Buffers& b = *buf_;
  const bool low_precision_copy = options_.param_dtype != DType::F32;
  double update_seconds = 0.0;
  auto update = [&](Range window) {
    const Clock::time_point start = Clock::now();
    const std::size_t off = window.begin - owned_.begin;
    backend_->adam_update(s, make_segments(h, window), b.master_ptr + off, grads + off,
                          b.exp_avg.as<float>() + off, b.exp_avg_sq.as<float>() + off,
                          low_precision_copy ? replica_ptr(window.begin) : nullptr,
                          options_.param_dtype);
    backend_->synchronize();
    update_seconds += seconds(Clock::now() - start);
  };
  const bool bucketed = options_.overlap && options_.stage != Stage::DataParallel;
  if (!bucketed) {
    update(owned_);
    all_gather_replica();
    return update_seconds;
  }
  const CommType type = options_.param_dtype == DType::F32 ? CommType::F32 : CommType::U16;
  const std::vector<Bucket>& buckets = reducer_->buckets();
  for (std::size_t k = buckets.size(); k-- > 0;) {
    const Range window = buckets[k].flat.intersect(owned_);
    if (!window.empty()) update(window);
    gathers_[k] = comm_->start_all_gatherv(replica_ptr(buckets[k].flat.begin),
                                          reducer_->block_counts(k), type);
  }
  return update_seconds;
}

StepResult ShardedOptimizer::step() {
  require_finalized("step");
  wait_gathers();
  const int world = comm_->size();
  StepResult r;
  LapTimer timer;
  // Time blocked in reductions during backward (stage 2 slots, overlap off) counts too.
  const double reduced_in_backward = reducer_->blocked_seconds();

  // 1. Reduce the gradients: buckets not started during backward start now; the sum over
  // ranks and micro-batches of the owned range is then at reducer_->owned_grad().
  reducer_->finish();
  const float* grads = reducer_->owned_grad();
  r.timings.reduce = reduced_in_backward + timer.lap();

  // 2. Global norm: one all-reduce of the shard's sum of squares (fp64). Data-parallel
  // ranks all hold the whole reduced gradient, so only rank 0 contributes.
  double sumsq = backend_->sum_squares(grads, owned_.size());
  if (options_.stage == Stage::DataParallel && comm_->rank() != 0) sumsq = 0.0;
  comm_->all_reduce_sum_host(&sumsq, 1);
  r.timings.norm = timer.lap();

  const double average = 1.0 / (static_cast<double>(world) * reducer_->micro_batches());
  const double unscale = 1.0 / loss_scale_.scale;  // 1 without loss scaling
  r.grad_norm = std::sqrt(sumsq) * average * unscale;
  // 3. A NaN or Inf anywhere makes the global sum non-finite on every rank alike.
  if (!std::isfinite(sumsq)) {
    r.skipped = true;
    update_loss_scale(false);
    r.step = step_count_;
    r.skipped_steps = loss_scale_.skipped_steps;
    r.loss_scale = loss_scale_.scale;
    reducer_->zero();
    r.timings.total = reduced_in_backward + timer.since_start();
    return r;
  }
  if (options_.adam.max_grad_norm > 0) {
    const double coef = options_.adam.max_grad_norm / (r.grad_norm + 1e-6);
    if (coef < 1.0) {
      r.clip_coef = coef;
      r.clipped = true;
    }
  }

  // 4-5. Fused update of the owned shard (master, m, v and the replica's owned part), then
  // the all-gather of the updated shards into the replica.
  ++step_count_;
  const AdamConfig& a = options_.adam;
  const StepHyper h{a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, a.mode, step_count_};
  r.timings.update =
      update_and_gather(make_step_scalars(h, average * r.clip_coef * unscale), h, grads);
  r.timings.gather = timer.lap() - r.timings.update;

  // 6. Clear the gradients for the next step.
  reducer_->zero();
  update_loss_scale(true);
  r.step = step_count_;
  r.skipped_steps = loss_scale_.skipped_steps;
  r.loss_scale = loss_scale_.scale;
  r.timings.total = reduced_in_backward + timer.since_start();
  return r;
}

// Every rank sees the same global norm, so the scale evolves identically everywhere.
void ShardedOptimizer::update_loss_scale(bool finite) {
  LossScaleState& st = loss_scale_;
  const LossScaling& o = options_.loss_scaling;
  if (!finite) {
    ++st.skipped_steps;
    if (!o.enabled) return;
    st.scale = std::max(o.min_scale, st.scale * o.backoff_factor);
    st.good_steps = 0;
    return;
  }
  if (!o.enabled) return;
  if (++st.good_steps >= o.growth_interval) {
    st.scale = std::min(o.max_scale, st.scale * o.growth_factor);
    st.good_steps = 0;
  }
}

void ShardedOptimizer::set_loss_scale_state(const LossScaleState& s) {
  const LossScaling& o = options_.loss_scaling;
  const bool scale_ok = o.enabled ? (s.scale >= o.min_scale && s.scale <= o.max_scale)
                                  : s.scale == 1.0;
  require(std::isfinite(s.scale) && scale_ok && s.good_steps >= 0 && s.skipped_steps >= 0,
          Status::InvalidArgument,
          "set_loss_scale_state: scale " + std::to_string(s.scale) +
              " outside the configured bounds, or negative counters");
  loss_scale_ = s;
}

// ---- state access -------------------------------------------------------------------------

std::span<float> ShardedOptimizer::master_shard() {
  require_finalized("master_shard");
  return {buf_->master_ptr, owned_.size()};
}
std::span<float> ShardedOptimizer::exp_avg_shard() {
  require_finalized("exp_avg_shard");
  return {buf_->exp_avg.as<float>(), owned_.size()};
}
std::span<float> ShardedOptimizer::exp_avg_sq_shard() {
  require_finalized("exp_avg_sq_shard");
  return {buf_->exp_avg_sq.as<float>(), owned_.size()};
}
void ShardedOptimizer::set_step_count(std::int64_t s) {
  require(s >= 0, Status::InvalidArgument, "set_step_count: negative step");
  step_count_ = s;
}

void ShardedOptimizer::copy_state_to_host(StateArray a, std::size_t offset,
                                          std::span<float> out) {
  require_finalized("copy_state_to_host");
  require(offset <= owned_.size() && out.size() <= owned_.size() - offset,
          Status::InvalidArgument, "copy_state_to_host: range outside the owned shard");
  const float* base = a == StateArray::Master   ? buf_->master_ptr
                      : a == StateArray::ExpAvg ? buf_->exp_avg.as<float>()
                                                : buf_->exp_avg_sq.as<float>();
  backend_->copy_to_host(out.data(), base + offset, out.size() * sizeof(float));
}

void ShardedOptimizer::copy_state_from_host(StateArray a, std::size_t offset,
                                            std::span<const float> in) {
  require_finalized("copy_state_from_host");
  require(offset <= owned_.size() && in.size() <= owned_.size() - offset,
          Status::InvalidArgument, "copy_state_from_host: range outside the owned shard");
  float* base = a == StateArray::Master   ? buf_->master_ptr
                : a == StateArray::ExpAvg ? buf_->exp_avg.as<float>()
                                          : buf_->exp_avg_sq.as<float>();
  backend_->copy_from_host(base + offset, in.data(), in.size() * sizeof(float));
}

void ShardedOptimizer::refresh_replica() {
  require_finalized("refresh_replica");
  wait_gathers();
  if (options_.param_dtype == DType::BF16)
    backend_->cast_from_f32(buf_->master_ptr, replica_ptr(owned_.begin), DType::BF16,
                            owned_.size());
  all_gather_replica();
}

// ---- for the C ABI (issue 13) ---------------------------------------------------------------

void* ShardedOptimizer::replica_data() {
  require_finalized("replica_data");
  wait_gathers();
  return replica_ptr(0);
}

void ShardedOptimizer::get_state(StateArray a, std::size_t i, std::span<float> out) {
  std::string problem;
  if (!finalized_) {
    problem = "get_state: call finalize() first";
  } else if (i >= layout_.num_params()) {
    problem = "get_state: no parameter index " + std::to_string(i) + " (there are " +
              std::to_string(layout_.num_params()) + ")";
  } else if (out.size() != layout_.param(i).numel) {
    problem = "get_state: parameter '" + layout_.param(i).name + "' has " +
              std::to_string(layout_.param(i).numel) + " elements, got a buffer of " +
              std::to_string(out.size());
  }
  agree_or_throw(*comm_, problem.empty() ? Status::Ok : (finalized_ ? Status::InvalidArgument
                                                                    : Status::InvalidState),
                 problem);
  const Range flat = layout_.param(i).flat;
  if (options_.stage == Stage::DataParallel || comm_->size() == 1) {
    copy_state_to_host(a, flat.begin - owned_.begin, out);
    return;
  }
  // Every rank's piece of the parameter, each padded to the largest, gathered in rank order.
  const int world = comm_->size();
  std::size_t chunk = 0;
  for (int r = 0; r < world; ++r) chunk = std::max(chunk, flat.intersect(layout_.shard_range(r)).size());
  std::vector<float> mine(chunk), all(chunk * static_cast<std::size_t>(world));
  const Range own = flat.intersect(owned_);
  if (!own.empty())
    copy_state_to_host(a, own.begin - owned_.begin, std::span<float>(mine.data(), own.size()));
  comm_->all_gather_bytes(mine.data(), all.data(), chunk * sizeof(float));
  for (int r = 0; r < world; ++r) {
    const Range piece = flat.intersect(layout_.shard_range(r));
    if (piece.empty()) continue;
    std::copy_n(all.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(r) * chunk),
                piece.size(), out.begin() + static_cast<std::ptrdiff_t>(piece.begin - flat.begin));
  }
}

}  // namespace shardopt
