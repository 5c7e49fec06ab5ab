// optimizer.cpp: the step of the sharded optimizer, written once over Backend and
// Communicator: reduce(-scatter), global norm and clipping, fused update, all-gather.
#include "shardopt/optimizer.hpp"

#include <cmath>
#include <cstring>
#include <sstream>

#include "backend.hpp"

namespace shardopt {

struct ShardedOptimizer::Buffers {
  Allocation replica;     ///< full parameter replica (param dtype)
  Allocation grad_full;   ///< full fp32 gradient (data-parallel, stage 1)
  Allocation grad_shard;  ///< owned fp32 gradient (stage 2)
  Allocation staging;     ///< one bucket of fp32 gradient (stage 2)
  Allocation master;      ///< owned fp32 master (absent when the replica is fp32)
  Allocation exp_avg;
  Allocation exp_avg_sq;
  float* master_ptr = nullptr;
};

namespace {

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
  return {};
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
  const std::string problem = options_problem(o);
  agree_or_throw(*comm, problem.empty() ? Status::Ok : Status::InvalidArgument, problem);
  return comm;
}

}  // namespace

ShardedOptimizer::ShardedOptimizer(std::shared_ptr<Communicator> comm, OptimizerOptions options)
    : comm_(checked(std::move(comm), options)),
      options_(options),
      backend_(make_backend(options.device)),
      groups_{GroupOptions{}},
      buf_(std::make_unique<Buffers>()) {}

ShardedOptimizer::~ShardedOptimizer() = default;

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
  const std::int64_t ints[4] = {static_cast<int>(o.stage), static_cast<int>(o.param_dtype),
                                static_cast<int>(o.adam.mode),
                                static_cast<std::int64_t>(o.bucket_elems)};
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
    if (options_.stage == Stage::Zero2) {
      buckets_ = layout_.make_buckets(options_.bucket_elems);
      std::size_t capacity = 0;
      bucket_of_param_.assign(layout_.num_params(), 0);
      for (std::size_t k = 0; k < buckets_.size(); ++k) {
        capacity = std::max(capacity, buckets_[k].flat.size());
        for (std::size_t p = buckets_[k].first_param; p < buckets_[k].end_param; ++p)
          bucket_of_param_[p] = k;
      }
      ready_in_bucket_.assign(buckets_.size(), 0);
      param_ready_.assign(layout_.num_params(), 0);
      open_bucket_ = buckets_.size();
      b.staging = collective_buffer(*comm_, be, options_.device, &tracker_, MemCategory::Scratch,
                                    capacity * sizeof(float));
      b.grad_shard = be.allocate(&tracker_, MemCategory::Grads, owned * sizeof(float));
    } else {
      b.grad_full = collective_buffer(*comm_, be, options_.device, &tracker_, MemCategory::Grads,
                                      padded * sizeof(float));
    }
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
  return {static_cast<T*>(replica_ptr(p.flat.begin)), p.numel};
}
template std::span<float> ShardedOptimizer::param<float>(std::size_t);
template std::span<bf16> ShardedOptimizer::param<bf16>(std::size_t);

std::span<float> ShardedOptimizer::grad(std::size_t i) {
  require_finalized("grad");
  const ParamInfo& p = layout_.param(i);
  if (options_.stage != Stage::Zero2) return {buf_->grad_full.as<float>() + p.flat.begin, p.numel};
  open_bucket_for(i);
  const Bucket& bk = buckets_[open_bucket_];
  return {buf_->staging.as<float>() + (p.flat.begin - bk.flat.begin), p.numel};
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

// ---- stage 2 buckets ----------------------------------------------------------------------

void ShardedOptimizer::open_bucket_for(std::size_t i) {
  const std::size_t b = bucket_of_param_[i];
  if (b == open_bucket_) return;
  require(b >= next_bucket_, Status::InvalidState,
          "grad: the bucket of parameter '" + layout_.param(i).name +
              "' was already reduced; in stage 2 gradients are produced in backward order "
              "(reverse registration order), each bucket once per reduce_gradients()/step()");
  // Earlier buckets are complete by the backward-order contract: reduce them now, in order,
  // so every rank issues the same sequence of collectives.
  while (next_bucket_ < b) reduce_bucket(next_bucket_);
  open_bucket_ = b;
}

void ShardedOptimizer::grad_ready(std::size_t i) {
  require_finalized("grad_ready");
  layout_.param(i);  // index check
  if (options_.stage != Stage::Zero2) return;
  require(param_ready_[i] == 0, Status::InvalidState,
          "grad_ready: parameter '" + layout_.param(i).name +
              "' was already marked ready in this backward pass");
  open_bucket_for(i);
  param_ready_[i] = 1;
  const std::size_t b = bucket_of_param_[i];
  const Bucket& bk = buckets_[b];
  if (++ready_in_bucket_[b] == bk.end_param - bk.first_param) reduce_bucket(b);
}

void ShardedOptimizer::reduce_bucket(std::size_t b) {
  const Bucket& bk = buckets_[b];
  const int n = comm_->size();
  std::vector<std::size_t> counts(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r)
    counts[static_cast<std::size_t>(r)] = bk.flat.intersect(layout_.shard_range(r)).size();
  float* staging = buf_->staging.as<float>();
  comm_->reduce_scatter_sum_inplace(staging, counts);
  const Range mine = bk.flat.intersect(owned_);
  if (!mine.empty())
    backend_->accumulate(buf_->grad_shard.as<float>() + (mine.begin - owned_.begin), staging,
                         DType::F32, mine.size());
  backend_->fill_zero(staging, bk.flat.size() * sizeof(float));
  next_bucket_ = b + 1;
  open_bucket_ = buckets_.size();
}

void ShardedOptimizer::reduce_gradients() {
  require_finalized("reduce_gradients");
  if (options_.stage != Stage::Zero2) return;
  while (next_bucket_ < buckets_.size()) reduce_bucket(next_bucket_);
  next_bucket_ = 0;
  std::fill(ready_in_bucket_.begin(), ready_in_bucket_.end(), 0);
  std::fill(param_ready_.begin(), param_ready_.end(), 0);
}

void ShardedOptimizer::zero_grad() {
  require_finalized("zero_grad");
  Buffers& b = *buf_;
  if (options_.stage == Stage::Zero2) {
    backend_->fill_zero(b.grad_shard.data(), b.grad_shard.bytes());
    if (open_bucket_ < buckets_.size())
      backend_->fill_zero(b.staging.data(), buckets_[open_bucket_].flat.size() * sizeof(float));
    open_bucket_ = buckets_.size();
    next_bucket_ = 0;
    std::fill(ready_in_bucket_.begin(), ready_in_bucket_.end(), 0);
    std::fill(param_ready_.begin(), param_ready_.end(), 0);
  } else {
    backend_->fill_zero(b.grad_full.data(), b.grad_full.bytes());
  }
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

std::vector<UpdateSegment> ShardedOptimizer::make_segments(const StepHyper& h) const {
  std::vector<SegmentScalars> per_group;
  for (const GroupOptions& g : groups_)
    per_group.push_back(make_segment_scalars(h, g.lr_scale, g.weight_decay));
  // Each piece is extended over the padding that follows it (always zero, so any scalars
  // keep it zero); neighbours of the same group merge into one segment.
  std::vector<UpdateSegment> segs;
  int last_group = -1;
  for (const ShardPiece& piece : layout_.pieces_in(owned_)) {
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
  segs.back().end = owned_.size();
  return segs;
}

float* ShardedOptimizer::grad_shard_ptr() {
  // Stage 1 reduce-scatters in place: the owned sum lands at the front of the full buffer.
  return options_.stage == Stage::Zero2 ? buf_->grad_shard.as<float>()
                                        : buf_->grad_full.as<float>();
}

void ShardedOptimizer::all_gather_replica() {
  if (options_.stage == Stage::DataParallel || comm_->size() == 1) return;
  comm_->all_gather_inplace(buf_->replica.data(), layout_.shard_size(),
                            options_.param_dtype == DType::F32 ? CommType::F32 : CommType::U16);
}

StepResult ShardedOptimizer::step() {
  require_finalized("step");
  Buffers& b = *buf_;
  const int world = comm_->size();

  // 1. Reduce the gradients: sum over ranks, the owned part lands in grad_shard_ptr().
  switch (options_.stage) {
    case Stage::DataParallel:
      comm_->all_reduce_sum(b.grad_full.data(), layout_.padded_size(), CommType::F32);
      break;
    case Stage::Zero1: {
      const std::vector<std::size_t> counts(static_cast<std::size_t>(world),
                                            layout_.shard_size());
      comm_->reduce_scatter_sum_inplace(b.grad_full.as<float>(), counts);
      break;
    }
    case Stage::Zero2:
      reduce_gradients();
      break;
  }
  float* grads = grad_shard_ptr();

  // 2. Global norm: one all-reduce of the shard's sum of squares (fp64). Data-parallel
  // ranks all hold the whole reduced gradient, so only rank 0 contributes.
  double sumsq = backend_->sum_squares(grads, owned_.size());
  if (options_.stage == Stage::DataParallel && comm_->rank() != 0) sumsq = 0.0;
  comm_->all_reduce_sum_host(&sumsq, 1);

  StepResult r;
  const double average = 1.0 / world;
  r.grad_norm = std::sqrt(sumsq) * average;
  // 3. A NaN or Inf anywhere makes the global sum non-finite on every rank alike.
  if (!std::isfinite(sumsq)) {
    r.skipped = true;
    r.step = step_count_;
    zero_grad();
    return r;
  }
  if (options_.adam.max_grad_norm > 0) {
    const double coef = options_.adam.max_grad_norm / (r.grad_norm + 1e-6);
    if (coef < 1.0) {
      r.clip_coef = coef;
      r.clipped = true;
    }
  }

  // 4. Fused update of the owned shard: master, m, v and the replica's owned part.
  ++step_count_;
  const AdamConfig& a = options_.adam;
  const StepHyper h{a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, a.mode, step_count_};
  const StepScalars scalars = make_step_scalars(h, average * r.clip_coef);
  const std::vector<UpdateSegment> segments = make_segments(h);
  void* replica_out = options_.param_dtype == DType::F32 ? nullptr : replica_ptr(owned_.begin);
  backend_->adam_update(scalars, segments, b.master_ptr, grads, b.exp_avg.as<float>(),
                        b.exp_avg_sq.as<float>(), replica_out, options_.param_dtype);

  // 5. All-gather the updated shards into the replica, then clear the gradients.
  all_gather_replica();
  zero_grad();
  r.step = step_count_;
  return r;
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

void ShardedOptimizer::refresh_replica() {
  require_finalized("refresh_replica");
  if (options_.param_dtype == DType::BF16)
    backend_->cast_from_f32(buf_->master_ptr, replica_ptr(owned_.begin), DType::BF16,
                            owned_.size());
  all_gather_replica();
}

}  // namespace shardopt
