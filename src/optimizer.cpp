// optimizer.cpp: the step of the sharded optimizer, written once over Backend and
// Communicator: reduce(-scatter), global norm and clipping, fused update, all-gather.
#include "shardopt/optimizer.hpp"

#include <array>
#include <chrono>
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <limits>
#include <sstream>
#include <utility>

#include "backend.hpp"
#include "buckets.hpp"
#include "buffer_plan.hpp"
#include "exact_sum.hpp"
#include "rules/qmap.hpp"
#include "rules/rule_step.hpp"
#include "rules/state_layout.hpp"
#include "shardopt/planner.hpp"
#include "step_check.hpp"
#include "units.hpp"

namespace shardopt {

struct ShardedOptimizer::Buffers {
  Allocation replica;     ///< full parameter replica (stage 3: this rank's slices), param dtype
  Allocation master;      ///< local fp32 master (absent when the replica is fp32)
  /// The rules' state slots (rules/rules.hpp), packed per rule (rules/state_layout.hpp).
  std::array<Allocation, rules::kNumSlots> slots;
  Allocation rule_scratch;  ///< Muon's / Adafactor's scratch (BufferPlan::rule_scratch)
  std::array<void*, rules::kNumSlots> slot_data() const {
    std::array<void*, rules::kNumSlots> out{};
    for (std::size_t k = 0; k < out.size(); ++k) out[k] = slots[k].data();
    return out;
  }
};

namespace {

using Clock = std::chrono::steady_clock;

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
// CPU seconds of every thread of this process.
double process_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

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

std::unique_ptr<Backend> make_backend(Device d, const Communicator& comm) {
  return d == Device::Cuda ? make_cuda_backend(comm.device_stream()) : make_cpu_backend();
}

std::string options_problem(const OptimizerOptions& o) {
  std::string p = validate(o.adam);
  if (!p.empty()) return p;
  if (o.stage != Stage::DataParallel && o.stage != Stage::Zero1 && o.stage != Stage::Zero2 &&
      o.stage != Stage::Zero3)
    return "invalid stage " + std::to_string(static_cast<int>(o.stage));
  if (o.param_dtype != DType::F32 && o.param_dtype != DType::BF16) return "invalid param dtype";
  if (o.device != Device::Cpu && o.device != Device::Cuda) return "invalid device";
  if (o.buckets_in_flight < 1) return "buckets_in_flight must be at least 1";
  if (o.units_in_flight < 1) return "units_in_flight must be at least 1";
  if (o.reduce_dtype != DType::F32 && o.reduce_dtype != DType::BF16) return "invalid reduce dtype";
  if (o.reduction != Reduction::Default && o.reduction != Reduction::Reproducible)
    return "invalid reduction " + std::to_string(static_cast<int>(o.reduction));
  if (o.reduction == Reduction::Reproducible && o.reduce_dtype != DType::F32)
    return "reduction Reproducible sums exactly and needs reduce_dtype F32 (a bf16 wire "
           "rounds every partial sum)";
  if (o.reduction == Reduction::Reproducible && o.device != Device::Cpu &&
      (o.stage == Stage::Zero3 || o.ownership != Ownership::Flat))
    return "reduction Reproducible on Device::Cuda runs at stages 0-2 with ownership Flat "
           "only (stage 3 and ownership Whole are not written for the device; use the CPU)";
  if (o.ownership != Ownership::Flat && o.ownership != Ownership::Whole)
    return "invalid ownership " + std::to_string(static_cast<int>(o.ownership));
  if (std::isnan(o.collective_timeout_s))
    return "collective_timeout_s is NaN (need seconds > 0, 0 for the default, or "
           "kNoCollectiveTimeout (< 0) for none)";
  return validate(o.loss_scaling);
}

// The buffers that go through collectives (replica, full gradient, stage-2 staging) come from
// the communicator when it has faster memory for them (a shared-memory window), else from
// the backend. Collective: every rank calls it for the same buffers in the same order.
// Several of them in one call (the shared-memory communicator: one window for all).
std::vector<Allocation> collective_buffers(Communicator& comm, Backend& be, Device device,
                                           MemoryTracker* tracker,
                                           std::span<const BufferSpec* const> specs) {
  std::vector<Allocation> out(specs.size());
  if (device == Device::Cpu) {
    std::vector<Communicator::BufferRequest> requests;
    for (const BufferSpec* s : specs) requests.push_back({s->category, s->bytes});
    out = comm.allocate_collective_buffers(tracker, requests);
  }
  for (std::size_t k = 0; k < specs.size(); ++k)
    if (out[k].data() == nullptr) out[k] = be.allocate(tracker, specs[k]->category, specs[k]->bytes);
  return out;
}

// Collective constructor check: throws the same error on every rank if any rank's options
// are invalid, before anything else is communicated. Applies the environment overrides to
// `o`, the collective timeout to the communicator, and returns the communicator the
// optimizer uses (wrapped by the debug checks when they are on).
std::shared_ptr<Communicator> checked(std::shared_ptr<Communicator> comm, OptimizerOptions& o) {
  const CallScope call("ShardedOptimizer (constructor)");
  require(comm != nullptr, Status::InvalidArgument, "communicator is null");
  collective(*comm, "ShardedOptimizer", [&] {
    std::string problem = apply_environment(o);
    if (problem.empty()) problem = options_problem(o);
    // The communicator must accept the buffers where the device puts them, at any size: even
    // a one-rank host communicator runs host code on the data (the bf16 wire's rounding).
    const bool cuda = o.device == Device::Cuda;
    if (problem.empty() && comm->device_buffers() && !cuda)
      problem = "Device::Cpu needs a communicator of host buffers, not " + comm->name();
    if (problem.empty() && !comm->device_buffers() && cuda)
      problem = "Device::Cuda needs a communicator of device buffers (make_nccl_communicator, "
                "or make_cuda_single_process_communicator for one process), not " + comm->name();
    require(problem.empty(), Status::InvalidArgument, problem);
  });
  // The debug checks add collectives, so every rank must make the same choice.
  const std::int32_t debug = o.debug_collectives ? 1 : 0;
  std::vector<std::int32_t> all(static_cast<std::size_t>(comm->size()));
  comm->all_gather_bytes(&debug, all.data(), sizeof debug);
  if (std::count(all.begin(), all.end(), debug) != comm->size()) {
    std::string on;
    for (std::size_t r = 0; r < all.size(); ++r)
      if (all[r] != 0) on += (on.empty() ? "" : ", ") + std::to_string(r);
    throw Error(Status::InvalidArgument,
                "ShardedOptimizer: debug_collectives (or SHARDOPT_DEBUG_COLLECTIVES=1) is on for "
                "ranks " + on + " only; it must be the same on every rank");
  }
  comm->set_collective_timeout(o.collective_timeout_s > 0 ? o.collective_timeout_s : 0.0);
  return o.debug_collectives ? make_checked_communicator(std::move(comm)) : comm;
}

}  // namespace

// comm_ is initialised first: checked() applies the environment to `options` before options_
// copies it.
ShardedOptimizer::ShardedOptimizer(std::shared_ptr<Communicator> comm, OptimizerOptions options)
    : comm_(checked(std::move(comm), options)),
      options_(options),
      backend_(make_backend(options.device, *comm_)),
      groups_{GroupOptions{}},
      buf_(std::make_unique<Buffers>()) {
  if (options_.loss_scaling.enabled) loss_scale_.scale = options_.loss_scaling.initial_scale;
}

// Members are destroyed in reverse order: buckets_ (which completes collectives in flight)
// goes before the buffers they use.
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
  const GroupOptions& old = groups_[static_cast<std::size_t>(group)];
  require(!finalized_ || g.rule == old.rule, Status::InvalidArgument,
          "set_group: group " + std::to_string(group) + "'s rule is " + rule_name(old.rule) +
              " since finalize() (its state is laid out for it); it cannot become " +
              rule_name(g.rule));
  require(!finalized_ || g.adamw8bit.min_8bit_numel == old.adamw8bit.min_8bit_numel,
          Status::InvalidArgument,
          "set_group: group " + std::to_string(group) + "'s adamw8bit.min_8bit_numel is fixed "
          "at finalize() (it decides which parameters keep 8-bit state)");
  groups_[static_cast<std::size_t>(group)] = g;
}

// The group check of both add_param forms.
namespace {
void require_group(std::string_view name, int group, std::size_t groups) {
  require(group >= 0 && static_cast<std::size_t>(group) < groups, Status::InvalidArgument,
          "add_param: parameter '" + std::string(name) + "' names group " +
              std::to_string(group) + ", but only " + std::to_string(groups) + " groups exist");
}
}  // namespace

std::size_t ShardedOptimizer::add_param(std::string_view name, std::size_t numel, int group) {
  require_registering("add_param");
  require_group(name, group, groups_.size());
  return layout_.add(name, numel, group, current_unit_);
}

std::size_t ShardedOptimizer::add_param(std::string_view name, Shape2D shape, int group) {
  require_registering("add_param");
  require(shape.rows > 0 && shape.cols > 0 &&
              shape.rows <= std::numeric_limits<std::size_t>::max() / shape.cols,
          Status::InvalidArgument,
          "add_param: parameter '" + std::string(name) + "' has shape " +
              std::to_string(shape.rows) + " x " + std::to_string(shape.cols) +
              " (need rows > 0, cols > 0)");
  require_group(name, group, groups_.size());
  return layout_.add(name, shape.rows * shape.cols, group, current_unit_, shape);
}

int ShardedOptimizer::begin_unit() {
  require_registering("begin_unit");
  const bool empty = layout_.num_params() == 0 || layout_.params().back().unit < current_unit_;
  if (!empty) ++current_unit_;
  return current_unit_;
}

// ---- finalize ---------------------------------------------------------------------------

namespace {

// Everything that must be identical on every rank, hashed.
std::uint64_t configuration_fingerprint(const FlatLayout& layout, const OptimizerOptions& o,
                                        const std::vector<GroupOptions>& groups) {
  std::uint64_t h = layout.fingerprint();
  const std::int64_t ints[9] = {static_cast<int>(o.stage), static_cast<int>(o.param_dtype),
                                static_cast<int>(o.adam.mode),
                                static_cast<std::int64_t>(o.bucket_elems), o.overlap ? 1 : 0,
                                o.buckets_in_flight, static_cast<int>(o.reduce_dtype),
                                o.units_in_flight, static_cast<int>(o.reduction)};
  h = fnv1a64(ints, sizeof ints, h);
  const double reals[6] = {o.adam.lr, o.adam.beta1, o.adam.beta2, o.adam.eps,
                           o.adam.weight_decay, o.adam.max_grad_norm};
  h = fnv1a64(reals, sizeof reals, h);
  for (const GroupOptions& g : groups) {
    const double rec[6] = {g.lr_scale, g.weight_decay ? 1.0 : 0.0, static_cast<double>(g.rule),
                           g.lion.beta1, g.lion.beta2,
                           static_cast<double>(g.adamw8bit.min_8bit_numel)};
    h = fnv1a64(rec, sizeof rec, h);
    if (g.rule == Rule::Muon) {  // other rules' fingerprints stay as they were
      const double muon[8] = {g.muon.momentum, g.muon.nesterov ? 1.0 : 0.0,
                              static_cast<double>(g.muon.ns_steps), g.muon.ns_a, g.muon.ns_b,
                              g.muon.ns_c, g.muon.eps, static_cast<double>(g.muon.lr_adjust)};
      h = fnv1a64(muon, sizeof muon, h);
    }
    if (g.rule == Rule::Adafactor) {
      const double ada[5] = {g.adafactor.beta2_decay, g.adafactor.eps1, g.adafactor.eps2,
                             g.adafactor.d, g.adafactor.maximize ? 1.0 : 0.0};
      h = fnv1a64(ada, sizeof ada, h);
    }
  }
  if (o.ownership != Ownership::Flat) {
    const std::int64_t own = static_cast<int>(o.ownership);
    h = fnv1a64(&own, sizeof own, h);
  }
  return h;
}

// The rule of p's group (AdamW for a group beyond `groups`).
Rule group_rule(const ParamInfo& p, const std::vector<GroupOptions>& groups) {
  const std::size_t g = static_cast<std::size_t>(p.group);
  return g < groups.size() ? groups[g].rule : Rule::AdamW;
}

// The requirements of the whole-tensor rules (Muon, Adafactor: rules::needs_whole) before the
// layout is built (the same verdict on every rank: they depend on the registration and the
// options only).
void check_whole_rule_params(const FlatLayout& layout, const std::vector<GroupOptions>& groups,
                             const OptimizerOptions& o) {
  const ParamInfo* muon = nullptr;
  const ParamInfo* adafactor = nullptr;
  for (const ParamInfo& p : layout.params()) {
    const Rule r = group_rule(p, groups);
    if (r == Rule::Adafactor && !adafactor) adafactor = &p;
    if (r != Rule::Muon) continue;
    if (!muon) muon = &p;
    require(p.rows > 1 && p.cols > 1, Status::InvalidArgument,
            "finalize: parameter '" + p.name + "' is in a Muon group (group " +
                std::to_string(p.group) + ") but is not a 2-D matrix (shape " +
                std::to_string(p.rows) + " x " + std::to_string(p.cols) +
                "; Muon needs rows > 1 and cols > 1: register it with add_param(name, Shape2D, "
                "group), or put it in an AdamW group)");
  }
  if (muon)
    require(o.ownership == Ownership::Whole, Status::InvalidArgument,
            "finalize: Muon needs whole matrices: set OptimizerOptions::ownership = "
            "Ownership::Whole");
  if (adafactor) {
    require(o.ownership == Ownership::Whole, Status::InvalidArgument,
            "finalize: parameter '" + adafactor->name + "' (" + std::to_string(adafactor->rows) +
                " x " + std::to_string(adafactor->cols) + ", group " +
                std::to_string(adafactor->group) + ") is in an Adafactor group: Adafactor "
                "needs whole tensors (row and column statistics, RMS of the parameter and of "
                "the update): set OptimizerOptions::ownership = Ownership::Whole");
  }
}

// After build(): every parameter of a whole-tensor rule must lie inside one bucket, so that
// the rank updating that bucket (data-parallel: every rank; Whole stages 1-3: its owner)
// holds all of it.
void check_whole_rule_buckets(const FlatLayout& layout, const std::vector<GroupOptions>& groups) {
  for (const ParamInfo& p : layout.params()) {
    const Rule r = group_rule(p, groups);
    require(!rules::needs_whole(r) || p.buckets.size() == 1, Status::InvalidArgument,
            std::string("finalize: ") + rule_name(r) + " parameter '" + p.name + "' (" +
                std::to_string(p.rows) + " x " + std::to_string(p.cols) + " = " +
                std::to_string(p.numel) + " elements) spans " +
                std::to_string(p.buckets.size()) + " buckets of " +
                std::to_string(layout.bucket_elems()) +
                " elements; a whole-tensor rule's parameter must fit one bucket: raise "
                "OptimizerOptions::bucket_elems to at least its size");
  }
}

// The most buckets one batched start covers (BucketSet::Config::batch): 16 buckets make one
// shared-memory barrier round instead of 16, and the overlapped gathers still start as the
// updates go, 16 buckets at a time.
constexpr std::size_t kDefaultCommBatch = 16;

// SHARDOPT_COMM_BATCH: the batch size in buckets (1: every bucket's collective alone, as
// before batching; for A/B measurements and the tests). Read inside finalize's agreement, so
// a bad value is an error on every rank.
std::size_t comm_batch_from_environment() {
  const char* env = std::getenv("SHARDOPT_COMM_BATCH");
  if (env == nullptr || *env == '\0') return kDefaultCommBatch;
  char* end = nullptr;
  const long n = std::strtol(env, &end, 10);
  require(*end == '\0' && n >= 1 && n <= 1 << 20, Status::InvalidArgument,
          std::string("SHARDOPT_COMM_BATCH='") + env + "': expected a count of buckets >= 1");
  return static_cast<std::size_t>(n);
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
  const CallScope call("finalize");
  FlatLayout layout = layout_;
  std::size_t batch = kDefaultCommBatch;
  collective(*comm_, "finalize", [&] {
    require_registering("finalize");
    batch = comm_batch_from_environment();
    check_whole_rule_params(layout, groups_, options_);
    // Whole-tensor ownership (ownership.hpp) runs every stage and reduction on the CPU (the
    // collectives, unit gathers and exact sums take each bucket's ragged per-rank ranges) and
    // stages 0-2 on CUDA (NCCL's uneven collectives; reproducible mode under Whole is
    // CPU-only: the constructor refuses it on the device).
    if (options_.ownership == Ownership::Whole) {
      require(options_.device == Device::Cpu || options_.stage != Stage::Zero3,
              Status::Unsupported,
              "ownership Whole on Device::Cuda: stage 3 is not supported yet; use stages 0-2, "
              "or the CPU");
      layout.set_ownership(Ownership::Whole);
    }
    const std::size_t cap = auto_bucket_cap(options_.device);
    layout.build(comm_->size(), rules::layout_bucket_elems(layout, groups_, options_.bucket_elems, cap),
                 cap, rules::layout_align(layout, groups_));
    check_whole_rule_buckets(layout, groups_);
    if (options_.ownership == Ownership::Whole)
      layout.apply_owners(
          assign_owners(layout, rules::owner_costs(layout, groups_, options_.param_dtype)));
  });

  // Every rank compares everyone's fingerprint, so all of them detect a mismatch.
  // The batches must be the same on every rank (a shared-memory batch is one barrier round).
  const std::uint64_t batch64 = batch;
  std::uint64_t fingerprint =
      fnv1a64(&batch64, sizeof batch64, configuration_fingerprint(layout, options_, groups_));
  // So must reproducible mode's opt-in sharded stage 2 (SHARDOPT_REPRO_EXCHANGE=sharded): it
  // stages the gradients on the ranks that take it. Hashed only when taken, so the other
  // configurations' fingerprints stay as they were.
  if (options_.reduction == Reduction::Reproducible &&
      exact::sharded_stage2(layout, options_.stage, options_.device)) {
    const char tag[] = "repro-sharded-stage2";
    fingerprint = fnv1a64(tag, sizeof tag, fingerprint);
  }
  const RankSummary mine{fingerprint,
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
          "groups, dtype, stage, hyperparameters and SHARDOPT_COMM_BATCH must match):";
    for (std::size_t r = 0; r < all.size(); ++r)
      os << " rank " << r << ": " << all[r].num_params << " params, " << all[r].elements
         << " elements, " << stage_name(static_cast<Stage>(all[r].stage)) << ", "
         << dtype_name(static_cast<DType>(all[r].dtype)) << ", hash " << std::hex
         << all[r].fingerprint << std::dec << ";";
    throw Error(Status::LayoutMismatch, os.str());
  }

  // The allocations. Those that go through collectives come first, in one call and one
  // agreement (the shared-memory communicator: one window for all): the
  // communicator's allocation is itself collective (shared-memory windows: the room check and
  // the window allocation fail on every rank of a node or on none) and its fallback to local
  // memory is local, so a rank that fails it must not skip the next collective allocation
  // while the others make it. The local allocations follow in one agreed part. Every rank
  // then holds the same shared buffers, so on an error they are freed (MPI_Win_free is
  // collective) in the same order everywhere; nothing is kept unless every rank has every
  // buffer.
  const BufferPlan plan =
      plan_buffers(layout, options_.stage, options_.param_dtype, options_.buckets_in_flight,
                   options_.units_in_flight, options_.reduction, options_.reduce_dtype,
                   groups_, comm_->rank(), options_.device);
  Backend& be = *backend_;
  const auto local_buffer = [&](const BufferSpec& spec) {
    return be.allocate(&tracker_, spec.category, spec.bytes);
  };
  const bool zero3 = options_.stage == Stage::Zero3;  // its replica slices stay local
  const bool staged = plan.grads_scheme == GradScheme::Staged;
  Buffers b;
  BucketSet::Storage grads;
  Allocation unit_pool;
  {
    // The buffers that go through collectives, in one agreed allocation.
    std::vector<const BufferSpec*> specs;
    std::vector<Allocation*> into;
    const auto shared = [&](const BufferSpec& spec, Allocation& a) {
      specs.push_back(&spec);
      into.push_back(&a);
    };
    if (!zero3) shared(plan.replica, b.replica);
    if (staged) shared(plan.staging, grads.staging);
    else shared(plan.grads, grads.grads);
    if (zero3) shared(plan.units, unit_pool);
    if (plan.exact_wire.bytes > 0) shared(plan.exact_wire, grads.exact_wire);
    std::vector<Allocation> got = collective(*comm_, "finalize", [&] {
      return collective_buffers(*comm_, be, options_.device, &tracker_, specs);
    });
    for (std::size_t k = 0; k < got.size(); ++k) *into[k] = std::move(got[k]);
  }
  collective(*comm_, "finalize", [&] {
    if (zero3) b.replica = local_buffer(plan.replica);
    if (staged) grads.grads = local_buffer(plan.grads);
    // Reproducible mode's accumulator: here when ragged buckets need it at every step (the
    // planner counts it), else on demand (the first deposit, or the two-phase method).
    if (plan.exact.bytes > 0 && !plan.exact.on_demand)
      grads.exact = local_buffer(plan.exact);
    if (plan.master.bytes > 0) b.master = local_buffer(plan.master);
    for (std::size_t k = 0; k < b.slots.size(); ++k) b.slots[k] = local_buffer(plan.state[k]);
    if (plan.rule_scratch.bytes > 0) b.rule_scratch = local_buffer(plan.rule_scratch);
  });

  layout_ = std::move(layout);  // BucketSet and UnitSet keep a reference to it
  state_ = std::make_unique<rules::StateLayout>(layout_, groups_, options_.stage,
                                                comm_->rank());
  options_.bucket_elems = layout_.bucket_elems();  // the size chosen when it was 0 (auto)
  const bool f32 = options_.param_dtype == DType::F32;
  buckets_ = std::make_unique<BucketSet>(
      *comm_, be, tracker_, layout_, plan,
      BucketSet::Config{options_.stage,
                        options_.reduce_dtype == DType::BF16 ? CommType::BF16 : CommType::F32,
                        f32 ? CommType::F32 : CommType::U16, options_.overlap,
                        options_.reduction == Reduction::Reproducible,
                        options_.device == Device::Cpu &&
                            options_.reduction != Reduction::Reproducible,
                        batch},
      std::move(grads), b.replica.data());
  if (zero3)
    units_ = std::make_unique<UnitSet>(*comm_, be, layout_, plan, options_.param_dtype,
                                       std::move(unit_pool), b.replica.data(), batch);
  *buf_ = std::move(b);
  finalized_ = true;
}

// ---- local arrays -------------------------------------------------------------------------

void* ShardedOptimizer::replica_ptr(std::size_t elem_offset) const {
  return buf_->replica.as<char>() + elem_offset * dtype_size(options_.param_dtype);
}

void* ShardedOptimizer::replica_at(std::size_t b) const {
  if (options_.stage == Stage::Zero3)  // only this rank's slices, in local coordinates
    return buf_->replica.as<char>() +
           buckets_->window_local(b) * dtype_size(options_.param_dtype);
  return replica_ptr(buckets_->window(b).begin);
}

float* ShardedOptimizer::master_at(std::size_t b) const {
  if (options_.param_dtype == DType::F32)  // the fp32 replica is the master
    return static_cast<float*>(replica_at(b));
  return buf_->master.as<float>() + buckets_->window_local(b);
}

void ShardedOptimizer::read_state(StateArray a, Range local, float* out) const {
  state_->for_each_run(local, [&](const rules::RuleRun& run, Range part) {
    float* dst = out + (part.begin - local.begin);
    if (!rules::has(run.rule, a, run.factored)) {
      std::fill(dst, dst + part.size(), 0.0f);
      return;
    }
    const rules::Slot slot = rules::slot_of(a, run.rule);
    const auto* base = buf_->slots[static_cast<std::size_t>(slot)].as<unsigned char>();
    if (run.rule != Rule::AdamW8bit) {
      backend_->copy_to_host(dst, base + run.slot_index(slot, part.begin) * sizeof(float),
                             part.size() * sizeof(float));
      return;
    }
    // Codes and their blocks' scales to the host, dequantized there (q[code] * scale).
    const bool sq = a == StateArray::ExpAvgSq;
    const rules::Slot scale_slot = sq ? rules::Slot::ScaleV : rules::Slot::ScaleM;
    const rules::q8::Qmap& q = sq ? rules::q8::unsigned_map() : rules::q8::signed_map();
    constexpr std::size_t kBlock = rules::q8::kBlock;
    const std::size_t first = run.slot_index(scale_slot, part.begin);
    const std::size_t last = run.slot_index(scale_slot, part.end - 1);
    std::vector<std::uint8_t> codes(part.size());
    std::vector<float> scales(last - first + 1);
    backend_->copy_to_host(codes.data(), base + run.slot_index(slot, part.begin), codes.size());
    backend_->copy_to_host(scales.data(),
                           buf_->slots[static_cast<std::size_t>(scale_slot)].as<float>() + first,
                           scales.size() * sizeof(float));
    const std::size_t block0 = (part.begin - run.local.begin) / kBlock;
    for (std::size_t k = 0; k < part.size(); ++k) {
      const std::size_t block = (part.begin - run.local.begin + k) / kBlock - block0;
      dst[k] = q.value[codes[k]] * scales[block];
    }
  });
}

void ShardedOptimizer::write_state(StateArray a, Range local, const float* in) {
  state_->for_each_run(local, [&](const rules::RuleRun& run, Range part) {
    if (!rules::has(run.rule, a, run.factored)) return;  // this rule keeps no such array
    require(run.rule != Rule::AdamW8bit, Status::Unsupported,
            std::string("AdamW8bit's ") + rules::state_array_name(a) +
                " is 8-bit codes and block scales; it is not set from fp32 values");
    const rules::Slot slot = rules::slot_of(a, run.rule);
    backend_->copy_from_host(buf_->slots[static_cast<std::size_t>(slot)].as<float>() +
                                 run.slot_index(slot, part.begin),
                             in + (part.begin - local.begin), part.size() * sizeof(float));
  });
}

template <class F>
void ShardedOptimizer::for_each_local(std::size_t offset, std::size_t n, F&& f) const {
  const Range want{offset, offset + n};
  for (std::size_t b = layout_.num_buckets(); b-- > 0;) {  // local order = flat order
    const std::size_t lb = buckets_->window_local(b);
    const Range got = want.intersect(Range{lb, lb + buckets_->window(b).size()});
    if (!got.empty()) f(b, got.begin - lb, got.begin, got.size());
  }
}

Rule ShardedOptimizer::rule_of(std::size_t i) const {
  const ParamInfo& p = layout_.param(i);
  return rules::param_rule(groups_[static_cast<std::size_t>(p.group)], p.numel);
}

std::size_t ShardedOptimizer::local_size() const {
  require_finalized("local_size");
  return options_.stage == Stage::DataParallel ? layout_.padded_size()
                                               : layout_.shard_size(comm_->rank());
}

std::vector<ShardPiece> ShardedOptimizer::local_pieces() const {
  require_finalized("local_pieces");
  if (options_.stage != Stage::DataParallel) return layout_.owned_pieces(comm_->rank());
  return layout_.pieces_in(Range{0, layout_.padded_size()});
}

std::vector<ShardPiece> ShardedOptimizer::saved_pieces() const {
  require_finalized("saved_pieces");
  if (options_.stage != Stage::DataParallel) return layout_.owned_pieces(comm_->rank());
  std::vector<ShardPiece> out;  // local == flat in data-parallel mode
  for (std::size_t b = layout_.num_buckets(); b-- > 0;)
    for (ShardPiece pc : layout_.pieces_in(layout_.bucket(b).slice(comm_->rank()))) {
      pc.local = pc.flat;
      out.push_back(pc);
    }
  return out;
}

// ---- parameters and gradients -----------------------------------------------------------

void ShardedOptimizer::set_param(std::size_t i, std::span<const float> values) {
  const CallScope call("set_param");
  require_finalized("set_param");
  const ParamInfo& p = layout_.param(i);
  require(values.size() == p.numel, Status::InvalidArgument,
          "set_param: parameter '" + p.name + "' has " + std::to_string(p.numel) +
              " elements, got " + std::to_string(values.size()));
  buckets_->wait_params();
  // Host-side cast, then one copy: set_param is not on the hot path.
  const bool bf = options_.param_dtype == DType::BF16;
  std::vector<bf16> low(bf ? p.numel : 0);
  for (std::size_t k = 0; k < low.size(); ++k) low[k] = to_bf16(values[k]);
  const char* src = bf ? reinterpret_cast<const char*>(low.data())
                       : reinterpret_cast<const char*>(values.data());
  const std::size_t elem = dtype_size(options_.param_dtype);
  const bool zero3 = options_.stage == Stage::Zero3;  // the replica holds this rank's slices
  if (!zero3) backend_->copy_from_host(replica_ptr(p.flat.begin), src, p.numel * elem);
  for (std::size_t b = p.buckets.begin; b < p.buckets.end; ++b) {
    const Range w = buckets_->window(b);
    const Range mine = p.flat.intersect(w);
    if (mine.empty()) continue;
    if (zero3)
      backend_->copy_from_host(static_cast<char*>(replica_at(b)) + (mine.begin - w.begin) * elem,
                               src + (mine.begin - p.flat.begin) * elem, mine.size() * elem);
    if (bf)  // (an fp32 replica is the master)
      backend_->copy_from_host(master_at(b) + (mine.begin - w.begin),
                               values.data() + (mine.begin - p.flat.begin),
                               mine.size() * sizeof(float));
  }
}

void ShardedOptimizer::get_master(std::size_t i, std::span<float> out) {
  gather_state("get_master", StateArray::Master, i, out);
}

void ShardedOptimizer::get_state(StateArray a, std::size_t i, std::span<float> out) {
  gather_state("get_state", a, i, out);
}

void ShardedOptimizer::gather_state(const char* what, StateArray a, std::size_t i,
                                    std::span<float> out) {
  const CallScope call(what);
  const std::string w = what;
  // Checked on every rank and agreed before any data moves, so that a bad call on one rank
  // is the same error everywhere instead of a hang.
  collective(*comm_, what, [&] {
    require_finalized(what);
    require(i < layout_.num_params(), Status::InvalidArgument,
            w + ": parameter index " + std::to_string(i) + " out of range (have " +
                std::to_string(layout_.num_params()) + ")");
    require(out.size() == layout_.param(i).numel, Status::InvalidArgument,
            w + ": parameter '" + layout_.param(i).name + "' has " +
                std::to_string(layout_.param(i).numel) + " elements, got a buffer of " +
                std::to_string(out.size()));
    require(out.data() != nullptr, Status::InvalidArgument, w + ": the output buffer is null");
    const ParamInfo& pi = layout_.param(i);
    const Rule rule = rules::param_rule(groups_[static_cast<std::size_t>(pi.group)], pi.numel);
    const bool factored = rules::factored(rule, pi.rows, pi.cols);
    require(rules::has(rule, a, factored), Status::InvalidArgument,
            w + ": parameter '" + pi.name + "' is updated by " + rule_name(rule) +
                ", which keeps no " + rules::state_array_name(a) +
                (factored ? " for a 2-D parameter (its row_var and col_var: "
                            "get_factored_state)" : ""));
  });
  const ParamInfo& p = layout_.param(i);
  buckets_->wait_params();
  // This rank's pieces of [lo, hi) of the parameter into dst (indexed from lo).
  auto copy_mine = [&](std::size_t lo, std::size_t hi, float* dst) {
    const Range want{p.flat.begin + lo, p.flat.begin + hi};
    for (std::size_t b = p.buckets.begin; b < p.buckets.end; ++b) {
      const Range w = buckets_->window(b);
      const Range mine = want.intersect(w);
      if (mine.empty()) continue;
      float* out = dst + (mine.begin - want.begin);
      if (a == StateArray::Master) {
        backend_->copy_to_host(out, master_at(b) + (mine.begin - w.begin),
                               mine.size() * sizeof(float));
        continue;
      }
      const std::size_t lb = buckets_->window_local(b) + (mine.begin - w.begin);
      read_state(a, Range{lb, lb + mine.size()}, out);
    }
  };
  const int world = comm_->size();
  if (options_.stage == Stage::DataParallel || world == 1) {
    copy_mine(0, p.numel, out.data());
    return;
  }
  // Gathered, not summed: every rank sends its pieces of a chunk, and each element is taken
  // from the rank that owns it, so every bit (-0.0, NaN payloads) survives.
  constexpr std::size_t kChunk = std::size_t{1} << 18;
  std::vector<float> mine(std::min(kChunk, p.numel));
  std::vector<float> all(mine.size() * static_cast<std::size_t>(world));
  for (std::size_t lo = 0; lo < p.numel; lo += kChunk) {
    const std::size_t hi = std::min(p.numel, lo + kChunk);
    std::fill(mine.begin(), mine.end(), 0.0f);
    copy_mine(lo, hi, mine.data());
    comm_->all_gather_bytes(mine.data(), all.data(), mine.size() * sizeof(float));
    const Range want{p.flat.begin + lo, p.flat.begin + hi};
    for (std::size_t b = p.buckets.begin; b < p.buckets.end; ++b)
      for (int r = 0; r < world; ++r) {
        const Range got = want.intersect(layout_.bucket(b).slice(r));
        if (got.empty()) continue;
        const float* src = all.data() + static_cast<std::size_t>(r) * mine.size() + (got.begin - want.begin);
        std::copy(src, src + got.size(), out.data() + lo + (got.begin - want.begin));
      }
  }
}

void ShardedOptimizer::get_factored_state(std::size_t i, std::span<float> row_var,
                                          std::span<float> col_var) {
  const CallScope call("get_factored_state");
  collective(*comm_, "get_factored_state", [&] {
    require_finalized("get_factored_state");
    require(i < layout_.num_params(), Status::InvalidArgument,
            "get_factored_state: parameter index " + std::to_string(i) + " out of range (have " +
                std::to_string(layout_.num_params()) + ")");
    const ParamInfo& p = layout_.param(i);
    require(rules::factored(rule_of(i), p.rows, p.cols), Status::InvalidArgument,
            "get_factored_state: parameter '" + p.name + "' (" + std::to_string(p.rows) + " x " +
                std::to_string(p.cols) + ", " + rule_name(rule_of(i)) +
                ") keeps no factored statistics (Adafactor's 2-D parameters do)");
    require(row_var.size() == p.rows && col_var.size() == p.cols, Status::InvalidArgument,
            "get_factored_state: parameter '" + p.name + "' has " + std::to_string(p.rows) +
                " rows and " + std::to_string(p.cols) + " columns, got buffers of " +
                std::to_string(row_var.size()) + " and " + std::to_string(col_var.size()));
    require(row_var.data() != nullptr && col_var.data() != nullptr, Status::InvalidArgument,
            "get_factored_state: an output buffer is null");
  });
  const ParamInfo& p = layout_.param(i);
  const std::size_t n = p.rows + p.cols;
  std::vector<float> mine(n, 0.0f);
  const auto read_own = [&] { copy_factors_to_host(i, mine); };
  const int world = comm_->size();
  std::vector<float> all;
  const float* src = mine.data();
  if (options_.stage == Stage::DataParallel || world == 1) {
    read_own();  // every rank holds every matrix
  } else {
    // The matrix lies whole in one rank's range of its bucket: that rank's entries.
    const Bucket& b = layout_.bucket(p.buckets.begin);
    int owner = 0;
    while (owner + 1 < world && b.slice(owner).intersect(p.flat).empty()) ++owner;
    if (comm_->rank() == owner) read_own();
    all.resize(n * static_cast<std::size_t>(world));
    comm_->all_gather_bytes(mine.data(), all.data(), n * sizeof(float));
    src = all.data() + static_cast<std::size_t>(owner) * n;
  }
  std::copy(src, src + p.rows, row_var.begin());
  std::copy(src + p.rows, src + n, col_var.begin());
}

// Parameter i's entries of the factored slot (matrix_slot_begin: Error(Internal) unless this
// rank holds the matrix).
void ShardedOptimizer::copy_factors_to_host(std::size_t i, std::span<float> out) {
  const ParamInfo& p = layout_.param(i);
  require(out.size() == p.rows + p.cols, Status::Internal, "copy_factors_to_host: wrong size");
  const auto* factors = buf_->slots[static_cast<std::size_t>(rules::Slot::Factors)].as<float>();
  backend_->copy_to_host(out.data(), factors + state_->matrix_slot_begin(i), out.size() * sizeof(float));
}

void ShardedOptimizer::copy_factors_from_host(std::size_t i, std::span<const float> in) {
  const ParamInfo& p = layout_.param(i);
  require(in.size() == p.rows + p.cols, Status::Internal, "copy_factors_from_host: wrong size");
  auto* factors = buf_->slots[static_cast<std::size_t>(rules::Slot::Factors)].as<float>();
  backend_->copy_from_host(factors + state_->matrix_slot_begin(i), in.data(),
                           in.size() * sizeof(float));
}

template <class T>
std::span<T> ShardedOptimizer::param(std::size_t i) {
  require_finalized("param");
  constexpr DType want = std::is_same_v<T, float> ? DType::F32 : DType::BF16;
  require(want == options_.param_dtype, Status::InvalidArgument,
          std::string("param: the replica is ") + dtype_name(options_.param_dtype) +
              ", not " + dtype_name(want));
  const ParamInfo& p = layout_.param(i);
  if (units_) return {static_cast<T*>(units_->param_data(i)), p.numel};
  wait_param(i);
  return {static_cast<T*>(replica_ptr(p.flat.begin)), p.numel};
}

void ShardedOptimizer::wait_param(std::size_t i) {
  const CallScope call("wait_param");
  require_finalized("wait_param");
  layout_.param(i);  // index check
  buckets_->wait_param(i);
}

// acquire and prefetch agree before they gather (the unit index is part of the call's name,
// so ranks that ask for different units fail too): one small all-reduce per call.
void ShardedOptimizer::acquire(std::size_t unit) {
  const CallScope call("acquire(unit " + std::to_string(unit) + ")");
  collective(*comm_, "acquire(unit " + std::to_string(unit) + ")", [&] {
    require_finalized("acquire");
    require_zero3("acquire");
    units_->check_acquire(unit);
  });
  units_->acquire(unit);
}

void ShardedOptimizer::prefetch(std::size_t unit) {
  const CallScope call("prefetch(unit " + std::to_string(unit) + ")");
  collective(*comm_, "prefetch(unit " + std::to_string(unit) + ")", [&] {
    require_finalized("prefetch");
    require_zero3("prefetch");
    units_->check_prefetch(unit);
  });
  units_->prefetch(unit);
}

void ShardedOptimizer::release(std::size_t unit) {
  require_finalized("release");
  require_zero3("release");
  units_->release(unit);
}

void ShardedOptimizer::require_zero3(const char* what) const {
  require(units_ != nullptr, Status::InvalidState,
          std::string(what) + ": units are gathered only at stage 3 (this optimizer is " +
              stage_name(options_.stage) + "; param() reads the full replica)");
}

void ShardedOptimizer::begin_backward(bool sync) {
  const CallScope call("begin_backward");
  require_finalized("begin_backward");
  buckets_->begin_backward(sync);
}
template std::span<float> ShardedOptimizer::param<float>(std::size_t);
template std::span<bf16> ShardedOptimizer::param<bf16>(std::size_t);

std::span<float> ShardedOptimizer::grad(std::size_t i) {
  require_finalized("grad");
  return buckets_->grad(i);
}

void ShardedOptimizer::accumulate_grad(std::size_t i, std::span<const float> src) {
  accumulate_grad_as(i, src.data(), src.size(), DType::F32);
}

void ShardedOptimizer::accumulate_grad(std::size_t i, std::span<const bf16> src) {
  accumulate_grad_as(i, src.data(), src.size(), DType::BF16);
}

void ShardedOptimizer::accumulate_grad_as(std::size_t i, const void* src, std::size_t n,
                                          DType dtype) {
  const CallScope call("accumulate_grad");
  require_finalized("accumulate_grad");
  const ParamInfo& p = layout_.param(i);
  require(n == p.numel, Status::InvalidArgument,
          "accumulate_grad: parameter '" + p.name + "' has " + std::to_string(p.numel) +
              " elements, got " + std::to_string(n));
  buckets_->accumulate_grad(i, src, dtype);
}

void ShardedOptimizer::grad_ready(std::size_t i) {
  const CallScope call("grad_ready");
  require_finalized("grad_ready");
  buckets_->grad_ready(i);
}

void ShardedOptimizer::progress() {
  require_finalized("progress");
  buckets_->progress();
  if (units_) units_->progress();
}

void ShardedOptimizer::reduce_gradients() {
  const CallScope call("reduce_gradients");
  collective(*comm_, "reduce_gradients", [&] { require_finalized("reduce_gradients"); });
  buckets_->finish_grad_sync();
}

void ShardedOptimizer::zero_grad() {
  const CallScope call("zero_grad");
  require_finalized("zero_grad");
  buckets_->zero_grads();
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

// Gathers every bucket's updated slices into the replica and waits (blocking form).
void ShardedOptimizer::all_gather_replica() {
  if (options_.stage == Stage::DataParallel || options_.stage == Stage::Zero3 ||
      comm_->size() == 1)
    return;  // stage 3: the next acquires gather
  std::vector<std::size_t> order;
  for (std::size_t b = layout_.num_buckets(); b-- > 0;) order.push_back(b);
  buckets_->start_param_syncs(order);
  buckets_->wait_params();
}

// Updates this rank's window of every bucket, in forward (flat) order, and gathers the
// replica; sets the seconds (wall and process CPU) spent updating. With gather_per_bucket
// the all-gathers start as the updates go, in batches of BucketSet::batch() buckets (each
// batch once its last bucket is updated), and the next forward waits only for the batches
// holding the buckets it reads (param()).
void ShardedOptimizer::update_and_gather(const StepHyper& h, double grad_scale,
                                         bool gather_per_bucket, StepTimings& timings) {
  Buffers& b = *buf_;
  const bool low_precision_copy = options_.param_dtype != DType::F32;
  const bool gathers = options_.stage != Stage::DataParallel &&
                       options_.stage != Stage::Zero3 && comm_->size() > 1;
  double update_seconds = 0.0, update_cpu = 0.0;
  const std::array<void*, rules::kNumSlots> slots = b.slot_data();
  const rules::StepInputs in{&groups_, h, grad_scale, b.rule_scratch.as<float>()};
  std::vector<std::size_t> updated;  // gather_per_bucket: updated, gather not started
  for (std::size_t k = layout_.num_buckets(); k-- > 0;) {
    const double cpu_start = process_cpu_seconds();
    const Clock::time_point start = Clock::now();
    rules::update_window(*backend_, layout_, *state_, slots, in,
                         rules::Window{buckets_->window(k), buckets_->window_local(k),
                                       master_at(k), buckets_->reduced_grad(k),
                                       low_precision_copy ? replica_at(k) : nullptr,
                                       options_.param_dtype});
    update_seconds += seconds(Clock::now() - start);
    update_cpu += process_cpu_seconds() - cpu_start;
    if (gathers && gather_per_bucket) {
      updated.push_back(k);
      if (updated.size() == buckets_->batch() || k == 0) {
        buckets_->start_param_syncs(updated);
        updated.clear();
      }
    }
  }
  if (!gather_per_bucket) all_gather_replica();
  timings.update = update_seconds;
  timings.update_cpu = update_cpu;
}

StepResult ShardedOptimizer::step() {
  const CallScope call("step");
  // finalize() is collective, so either every rank is finalized or none: a rank that is not
  // fails here, together with the others (in this check or in their own finalize()). Stage 3
  // agrees on its units too: a rank still holding one would otherwise fail alone, before the
  // reductions its peers wait in (one small all-reduce per stage-3 step). With the sharded
  // exact accumulation (reproducible mode, SHARDOPT_REPRO_EXCHANGE=sharded) peers with more
  // micro-batches are still in their exchange rounds: a rank joins those first, so there the
  // agreement comes after the reduction.
  const bool rounds_first = finalized_ && units_ && buckets_->exchanges_each_micro_batch();
  const double blocked_before = rounds_first ? buckets_->blocked_seconds() : 0.0;
  LapTimer early;
  if (rounds_first) buckets_->finish_grad_sync();
  const double reduced_first = rounds_first ? early.lap() : 0.0;
  if (!finalized_ || units_)
    collective(*comm_, "step", [&] {
      require_finalized("step");
      // Stage 3: a unit gathered before the update would keep stale parameters.
      require(!units_ || units_->held() == 0, Status::InvalidState,
              "step: " + std::to_string(units_ ? units_->held() : 0) +
                  " units are still acquired or prefetched; release them before the step");
    });
  buckets_->wait_params();
  const int world = comm_->size();
  StepResult r;
  LapTimer timer;
  // Time blocked in reductions during backward (stage 2 slots, overlap off) counts too.
  const double reduced_in_backward = rounds_first ? blocked_before : buckets_->blocked_seconds();

  // 1. Finish the gradient sync of every bucket: buckets not started during backward start
  // now; this rank's window of each bucket then holds the sum over ranks and micro-batches.
  buckets_->finish_grad_sync();
  r.timings.reduce = reduced_in_backward + reduced_first + timer.lap();

  // 2. Global norm: one all-reduce of the sum of squares (fp64) of every rank's slices.
  // Data-parallel ranks hold every bucket reduced, and each sums its own slices, so the
  // partial sums (and the norm) are the same as in the sharded stages. The same all-reduce
  // checks that every rank steps with the same settings (step_check.hpp); if not, every rank
  // throws before anything is updated, and the reduced gradients stay for a retry.
  // Reproducible mode sums the squares exactly (exact::SquareSum): the slices' boundaries
  // move with the number of ranks.
  const bool reproducible = options_.reduction == Reduction::Reproducible;
  // Every rank must step after the same number of micro-batches, except in reproducible
  // mode, which averages over the step's micro-batches of all ranks, however they are spread
  // (the check then compares that total).
  const int micro_batches = reproducible ? static_cast<int>(buckets_->total_micro_batches())
                                         : buckets_->micro_batches();
  double sumsq = 0.0;
  const LocalOutcome local = capture("step", [&] {
    if (reproducible) return;  // the reduction took the exact squares (exact_squares())
    // Last bucket first, as the buckets' sums always were: the order pins the bits. On the
    // CPU each bucket's sum was taken when its reduction completed (BucketSet::norm_sums,
    // the same sum_squares of the same slice); a device backend sums every slice here.
    const std::span<const double> eager = buckets_->norm_sums();
    std::vector<Backend::Slice> slices;
    slices.reserve(layout_.num_buckets());
    for (std::size_t k = layout_.num_buckets(); k-- > 0;) {
      const Backend::Slice slice = buckets_->norm_slice(k);
      if (!eager.empty()) sumsq += eager[k];
      else slices.push_back(slice);
    }
    if (eager.empty()) sumsq = backend_->sum_squares_in_order(slices);
  });
  sumsq = sum_over_ranks_checked(
      *comm_, sumsq, local,
      StepSettings{options_.adam, groups_, options_.loss_scaling, micro_batches,
                   step_count_, loss_scale_});
  if (reproducible) {
    exact::SquareSum exact_sumsq = buckets_->exact_squares();  // a retried step sums it again
    exact_sumsq.sum_over_ranks(*comm_);
    sumsq = exact_sumsq.value();
  }
  r.timings.norm = timer.lap();

  const double average = 1.0 / (reproducible ? static_cast<double>(micro_batches)
                                             : static_cast<double>(world) * micro_batches);
  const double unscale = 1.0 / loss_scale_.scale;  // 1 without loss scaling
  r.grad_norm = std::sqrt(sumsq) * average * unscale;
  // 3. A NaN or Inf anywhere makes the global sum non-finite on every rank alike.
  if (!std::isfinite(sumsq)) {
    r.skipped = true;
    update_loss_scale(false);
    r.step = step_count_;
    r.skipped_steps = loss_scale_.skipped_steps;
    r.loss_scale = loss_scale_.scale;
    buckets_->zero_grads();
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

  // 4-5. Fused update of this rank's slice of every bucket (master, m, v and the replica's
  // slice), each bucket's all-gather started after its update.
  ++step_count_;
  const AdamConfig& a = options_.adam;
  const StepHyper h{a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, a.mode, step_count_};
  update_and_gather(h, average * r.clip_coef * unscale, options_.overlap, r.timings);
  r.timings.gather = timer.lap() - r.timings.update;

  // 6. Clear the gradients for the next step.
  buckets_->zero_grads();
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

void ShardedOptimizer::set_step_count(std::int64_t s) {
  require(s >= 0, Status::InvalidArgument, "set_step_count: negative step");
  step_count_ = s;
}

// An fp32 replica is the master: the replica's all-gathers still in flight after a step read
// (and, in NCCL's in-place form, may write) this rank's slices of it. Device backends: a
// stream wait, no host wait.
void ShardedOptimizer::wait_gathers_of(StateArray a) {
  if (a == StateArray::Master && options_.param_dtype == DType::F32 && buckets_)
    buckets_->wait_params();
}

void ShardedOptimizer::copy_state_to_host(StateArray a, std::size_t offset,
                                          std::span<float> out) {
  require_finalized("copy_state_to_host");
  require(offset <= local_size() && out.size() <= local_size() - offset,
          Status::InvalidArgument, "copy_state_to_host: range outside the local arrays");
  wait_gathers_of(a);
  if (a != StateArray::Master) {  // a rule without this array reads as zeros
    read_state(a, Range{offset, offset + out.size()}, out.data());
    return;
  }
  for_each_local(offset, out.size(), [&](std::size_t b, std::size_t in_window, std::size_t local, std::size_t n) {
    backend_->copy_to_host(out.data() + (local - offset), master_at(b) + in_window, n * sizeof(float));
  });
}

void ShardedOptimizer::copy_state_from_host(StateArray a, std::size_t offset,
                                            std::span<const float> in) {
  require_finalized("copy_state_from_host");
  require(offset <= local_size() && in.size() <= local_size() - offset,
          Status::InvalidArgument, "copy_state_from_host: range outside the local arrays");
  wait_gathers_of(a);
  if (a != StateArray::Master) {  // a rule without this array ignores it
    write_state(a, Range{offset, offset + in.size()}, in.data());
    return;
  }
  for_each_local(offset, in.size(), [&](std::size_t b, std::size_t in_window, std::size_t local, std::size_t n) {
    backend_->copy_from_host(master_at(b) + in_window, in.data() + (local - offset), n * sizeof(float));
  });
}

void ShardedOptimizer::copy_q8_state_to_host(std::size_t offset, std::size_t n,
                                             const Q8State& out) {
  constexpr std::size_t kBlock = rules::q8::kBlock;
  require_finalized("copy_q8_state_to_host");
  require(offset % kBlock == 0 && offset <= local_size() && n <= local_size() - offset,
          Status::InvalidArgument, "copy_q8_state_to_host: not a block-aligned local range");
  const std::size_t blocks = (n + kBlock - 1) / kBlock;
  std::fill(out.code_m, out.code_m + n, std::uint8_t{0});
  std::fill(out.code_v, out.code_v + n, std::uint8_t{0});
  std::fill(out.scale_m, out.scale_m + blocks, 0.0f);
  std::fill(out.scale_v, out.scale_v + blocks, 0.0f);
  const auto slot = [&](rules::Slot s) { return buf_->slots[static_cast<std::size_t>(s)].as<unsigned char>(); };
  state_->for_each_run(Range{offset, offset + n}, [&](const rules::RuleRun& run, Range part) {
    if (run.rule != Rule::AdamW8bit) return;
    const std::size_t at = part.begin - offset, nb = (part.size() + kBlock - 1) / kBlock;
    using rules::Slot;
    backend_->copy_to_host(out.code_m + at, slot(Slot::CodeM) + run.slot_index(Slot::CodeM, part.begin), part.size());
    backend_->copy_to_host(out.code_v + at, slot(Slot::CodeV) + run.slot_index(Slot::CodeV, part.begin), part.size());
    backend_->copy_to_host(out.scale_m + at / kBlock,
                           slot(Slot::ScaleM) + run.slot_index(Slot::ScaleM, part.begin) * sizeof(float),
                           nb * sizeof(float));
    backend_->copy_to_host(out.scale_v + at / kBlock,
                           slot(Slot::ScaleV) + run.slot_index(Slot::ScaleV, part.begin) * sizeof(float),
                           nb * sizeof(float));
  });
}

void ShardedOptimizer::copy_q8_state_from_host(std::size_t offset, std::size_t n,
                                               const Q8State& in) {
  constexpr std::size_t kBlock = rules::q8::kBlock;
  require_finalized("copy_q8_state_from_host");
  require(offset % kBlock == 0 && offset <= local_size() && n <= local_size() - offset,
          Status::InvalidArgument, "copy_q8_state_from_host: not a block-aligned local range");
  const auto slot = [&](rules::Slot s) { return buf_->slots[static_cast<std::size_t>(s)].as<unsigned char>(); };
  state_->for_each_run(Range{offset, offset + n}, [&](const rules::RuleRun& run, Range part) {
    if (run.rule != Rule::AdamW8bit) return;
    const std::size_t at = part.begin - offset, nb = (part.size() + kBlock - 1) / kBlock;
    using rules::Slot;
    backend_->copy_from_host(slot(Slot::CodeM) + run.slot_index(Slot::CodeM, part.begin), in.code_m + at, part.size());
    backend_->copy_from_host(slot(Slot::CodeV) + run.slot_index(Slot::CodeV, part.begin), in.code_v + at, part.size());
    backend_->copy_from_host(slot(Slot::ScaleM) + run.slot_index(Slot::ScaleM, part.begin) * sizeof(float),
                             in.scale_m + at / kBlock, nb * sizeof(float));
    backend_->copy_from_host(slot(Slot::ScaleV) + run.slot_index(Slot::ScaleV, part.begin) * sizeof(float),
                             in.scale_v + at / kBlock, nb * sizeof(float));
  });
}

void ShardedOptimizer::refresh_replica() {
  const CallScope call("refresh_replica");
  collective(*comm_, "refresh_replica", [&] { require_finalized("refresh_replica"); });
  buckets_->wait_params();
  if (options_.param_dtype == DType::BF16)
    for (std::size_t k = 0; k < layout_.num_buckets(); ++k) {
      const Range w = buckets_->window(k);
      backend_->cast_from_f32(master_at(k), replica_at(k), DType::BF16, w.size());
    }
  all_gather_replica();
}

// ---- for the C ABI (issue 13) ---------------------------------------------------------------

void* ShardedOptimizer::replica_data() {
  const CallScope call("replica_data");
  require_finalized("replica_data");
  buckets_->wait_params();
  return replica_ptr(0);
}

}  // namespace shardopt
