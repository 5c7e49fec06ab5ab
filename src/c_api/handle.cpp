// handle.cpp: handle registry, error recording and collective creation for the C ABI.
#include "handle.hpp"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <iterator>
#include <mutex>
#include <unordered_set>

namespace shardopt::capi {
namespace {

// Live handles. Checking membership before touching a handle means a destroyed or foreign
// pointer is never dereferenced (the magic number is a second line of defence).
std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::unordered_set<const Handle*>& registry() {
  static std::unordered_set<const Handle*> live;
  return live;
}

thread_local std::string thread_last_error;

// The end of each field of a growable struct, in order: the sizes an older caller may pass.
#define SHARDOPT_FIELD_END(S, f) (offsetof(S, f) + sizeof(S::f))
#define SHARDOPT_CONFIG_END(f) SHARDOPT_FIELD_END(shardopt_config_t, f)
constexpr std::size_t kConfigEnds[] = {
    SHARDOPT_CONFIG_END(struct_size), SHARDOPT_CONFIG_END(stage),
    SHARDOPT_CONFIG_END(param_dtype), SHARDOPT_CONFIG_END(device),
    SHARDOPT_CONFIG_END(adam_mode), SHARDOPT_CONFIG_END(lr), SHARDOPT_CONFIG_END(beta1),
    SHARDOPT_CONFIG_END(beta2), SHARDOPT_CONFIG_END(eps), SHARDOPT_CONFIG_END(weight_decay),
    SHARDOPT_CONFIG_END(max_grad_norm), SHARDOPT_CONFIG_END(bucket_elems),
    SHARDOPT_CONFIG_END(overlap), SHARDOPT_CONFIG_END(buckets_in_flight),
    SHARDOPT_CONFIG_END(reduce_dtype), SHARDOPT_CONFIG_END(comm_kind),
    SHARDOPT_CONFIG_END(comm_simulate_nodes), SHARDOPT_CONFIG_END(gather_mode),
    SHARDOPT_CONFIG_END(loss_scaling), SHARDOPT_CONFIG_END(loss_scale_growth_interval),
    SHARDOPT_CONFIG_END(loss_scale_initial), SHARDOPT_CONFIG_END(loss_scale_growth_factor),
    SHARDOPT_CONFIG_END(loss_scale_backoff_factor), SHARDOPT_CONFIG_END(loss_scale_min),
    SHARDOPT_CONFIG_END(loss_scale_max), SHARDOPT_CONFIG_END(units_in_flight),
    SHARDOPT_CONFIG_END(collective_timeout_s), SHARDOPT_CONFIG_END(debug_collectives),
    SHARDOPT_CONFIG_END(comm_mpi_in_flight), SHARDOPT_CONFIG_END(reduction),
    SHARDOPT_CONFIG_END(reserved0), SHARDOPT_CONFIG_END(ownership),
    SHARDOPT_CONFIG_END(reserved1)};
#undef SHARDOPT_CONFIG_END
// No trailing padding: an older struct's sizeof never covers part of a newer field.
static_assert(kConfigEnds[std::size(kConfigEnds) - 1] == sizeof(shardopt_config_t));
// The 0.1.0 config ended with bucket_elems: the smallest size ever published.
constexpr std::size_t kConfigMinSize = SHARDOPT_FIELD_END(shardopt_config_t, bucket_elems);

}  // namespace

shardopt_config_t default_config() {
  const OptimizerOptions d;
  shardopt_config_t c{};
  c.struct_size = sizeof(shardopt_config_t);
  c.stage = static_cast<int>(d.stage);
  c.param_dtype = static_cast<int>(d.param_dtype);
  c.device = static_cast<int>(d.device);
  c.adam_mode = static_cast<int>(d.adam.mode);
  c.lr = d.adam.lr;
  c.beta1 = d.adam.beta1;
  c.beta2 = d.adam.beta2;
  c.eps = d.adam.eps;
  c.weight_decay = d.adam.weight_decay;
  c.max_grad_norm = d.adam.max_grad_norm;
  c.bucket_elems = d.bucket_elems;
  c.overlap = d.overlap ? 1 : 0;
  c.buckets_in_flight = d.buckets_in_flight;
  c.reduce_dtype = static_cast<int>(d.reduce_dtype);
  c.comm_kind = SHARDOPT_COMM_AUTO;
  c.comm_simulate_nodes = 0;
  c.gather_mode = SHARDOPT_GATHER_EAGER;
  c.loss_scaling = d.loss_scaling.enabled ? 1 : 0;
  c.loss_scale_growth_interval = d.loss_scaling.growth_interval;
  c.loss_scale_initial = d.loss_scaling.initial_scale;
  c.loss_scale_growth_factor = d.loss_scaling.growth_factor;
  c.loss_scale_backoff_factor = d.loss_scaling.backoff_factor;
  c.loss_scale_min = d.loss_scaling.min_scale;
  c.loss_scale_max = d.loss_scaling.max_scale;
  c.units_in_flight = static_cast<std::size_t>(d.units_in_flight);
  c.collective_timeout_s = d.collective_timeout_s;
  c.debug_collectives = d.debug_collectives ? 1 : 0;
  c.comm_mpi_in_flight = 0;
  c.reduction = static_cast<int>(d.reduction);
  c.reserved0 = 0;
  c.ownership = static_cast<int>(d.ownership);
  c.reserved1 = 0;
  return c;
}

namespace {

// What is wrong with the enum and flag fields (the values are validated by ShardedOptimizer).
std::string enum_problem(const shardopt_config_t& c) {
  struct Field {
    const char* name;
    int value, lo, hi;
    const char* allowed;
  };
  const Field fields[] = {
      {"stage", c.stage, 0, 3, "0, 1, 2 or 3"},
      {"param_dtype", c.param_dtype, 0, 1, "SHARDOPT_DTYPE_F32 or _BF16"},
      {"device", c.device, 0, 1, "SHARDOPT_DEVICE_CPU or _CUDA"},
      {"adam_mode", c.adam_mode, 0, 1, "SHARDOPT_ADAMW or SHARDOPT_ADAM_L2"},
      {"overlap", c.overlap, 0, 1, "0 or 1"},
      {"reduce_dtype", c.reduce_dtype, 0, 1, "SHARDOPT_DTYPE_F32 or _BF16"},
      {"comm_kind", c.comm_kind, 0, 2, "SHARDOPT_COMM_AUTO, _MPI or _SHM"},
      {"gather_mode", c.gather_mode, 0, 1, "SHARDOPT_GATHER_EAGER or _LAZY"},
      {"loss_scaling", c.loss_scaling, 0, 1, "0 or 1"},
      {"debug_collectives", c.debug_collectives, 0, 1, "0 or 1"},
      {"comm_mpi_in_flight", c.comm_mpi_in_flight, 0, 1 << 20, "0 (the environment) or a count >= 1"},
      {"reduction", c.reduction, 0, 1, "SHARDOPT_REDUCTION_DEFAULT or _REPRODUCIBLE"},
      {"reserved0", c.reserved0, 0, 0, "0"},
      {"ownership", c.ownership, 0, 1, "SHARDOPT_OWNERSHIP_FLAT or _WHOLE"},
      {"reserved1", c.reserved1, 0, 0, "0"},
  };
  for (const Field& f : fields)
    if (f.value < f.lo || f.value > f.hi)
      return std::string("config->") + f.name + " " + std::to_string(f.value) + " is not " +
             f.allowed;
  if (c.comm_simulate_nodes < 0)
    return "config->comm_simulate_nodes " + std::to_string(c.comm_simulate_nodes) + " is negative";
  return {};
}

}  // namespace

std::string struct_size_problem(const char* what, std::size_t given, std::size_t min_size,
                                std::span<const std::size_t> ends, bool accept_larger) {
  const std::size_t full = ends.back();
  const bool ok = given >= min_size &&
                  (given > full ? accept_larger
                                : std::find(ends.begin(), ends.end(), given) != ends.end());
  if (ok) return {};
  return std::string(what) + "->struct_size is " + std::to_string(given) +
         ", which is not the size of any version of the struct (this library's is " +
         std::to_string(full) + ", the smallest accepted " + std::to_string(min_size) + ")";
}

CreateRequest read_config(const shardopt_config_t* in, const shardopt_optimizer_t* out) {
  CreateRequest r;
  shardopt_config_t c = default_config();
  if (in != nullptr) {
    r.problem = struct_size_problem("config", in->struct_size, kConfigMinSize, kConfigEnds,
                                    /*accept_larger=*/false);
    if (!r.problem.empty()) {
      r.problem += " (initialise the config with shardopt_config_init)";
      return r;
    }
    std::memcpy(&c, in, in->struct_size);  // fields beyond the caller's size keep defaults
  }
  r.problem = enum_problem(c);
  if (r.problem.empty() && out == nullptr) r.problem = "the output handle pointer is NULL";
  if (!r.problem.empty()) return r;
  OptimizerOptions& o = r.options;
  o.stage = static_cast<Stage>(c.stage);
  o.param_dtype = static_cast<DType>(c.param_dtype);
  o.device = static_cast<Device>(c.device);
  o.adam.mode = static_cast<AdamMode>(c.adam_mode);
  o.adam.lr = c.lr;
  o.adam.beta1 = c.beta1;
  o.adam.beta2 = c.beta2;
  o.adam.eps = c.eps;
  o.adam.weight_decay = c.weight_decay;
  o.adam.max_grad_norm = c.max_grad_norm;
  o.bucket_elems = c.bucket_elems;
  o.overlap = c.overlap == 1;
  o.buckets_in_flight = c.buckets_in_flight;
  o.reduce_dtype = static_cast<DType>(c.reduce_dtype);
  o.loss_scaling.enabled = c.loss_scaling == 1;
  o.loss_scaling.growth_interval = c.loss_scale_growth_interval;
  o.loss_scaling.initial_scale = c.loss_scale_initial;
  o.loss_scaling.growth_factor = c.loss_scale_growth_factor;
  o.loss_scaling.backoff_factor = c.loss_scale_backoff_factor;
  o.loss_scaling.min_scale = c.loss_scale_min;
  o.loss_scaling.max_scale = c.loss_scale_max;
  o.units_in_flight = static_cast<int>(std::min<std::size_t>(c.units_in_flight, 1 << 20));
  o.collective_timeout_s = c.collective_timeout_s;
  o.debug_collectives = c.debug_collectives == 1;
  o.reduction = static_cast<Reduction>(c.reduction);
  o.ownership = static_cast<Ownership>(c.ownership);
  r.comm_kind = c.comm_kind;
  r.simulate_nodes = c.comm_simulate_nodes;
  r.mpi_in_flight = c.comm_mpi_in_flight;
  r.lazy_gather = c.gather_mode == SHARDOPT_GATHER_LAZY;
  return r;  // the values themselves are validated by ShardedOptimizer on every rank
}

void write_config(const Handle& h, shardopt_config_t* config) {
  const std::string problem = struct_size_problem("config", config->struct_size,
                                                  kConfigMinSize, kConfigEnds, true);
  require(problem.empty(), Status::InvalidArgument, problem);
  const OptimizerOptions& o = h.opt->options();
  shardopt_config_t c = default_config();
  c.stage = static_cast<int>(o.stage);
  c.param_dtype = static_cast<int>(o.param_dtype);
  c.device = static_cast<int>(o.device);
  c.adam_mode = static_cast<int>(o.adam.mode);
  c.lr = o.adam.lr;
  c.beta1 = o.adam.beta1;
  c.beta2 = o.adam.beta2;
  c.eps = o.adam.eps;
  c.weight_decay = o.adam.weight_decay;
  c.max_grad_norm = o.adam.max_grad_norm;
  c.bucket_elems = o.bucket_elems;
  c.overlap = o.overlap ? 1 : 0;
  c.buckets_in_flight = o.buckets_in_flight;
  c.reduce_dtype = static_cast<int>(o.reduce_dtype);
  c.comm_kind = h.comm_kind;
  c.comm_simulate_nodes = h.simulate_nodes;
  c.gather_mode = h.lazy_gather ? SHARDOPT_GATHER_LAZY : SHARDOPT_GATHER_EAGER;
  c.loss_scaling = o.loss_scaling.enabled ? 1 : 0;
  c.loss_scale_growth_interval = o.loss_scaling.growth_interval;
  c.loss_scale_initial = o.loss_scaling.initial_scale;
  c.loss_scale_growth_factor = o.loss_scaling.growth_factor;
  c.loss_scale_backoff_factor = o.loss_scaling.backoff_factor;
  c.loss_scale_min = o.loss_scaling.min_scale;
  c.loss_scale_max = o.loss_scaling.max_scale;
  c.units_in_flight = static_cast<std::size_t>(o.units_in_flight);
  c.collective_timeout_s = o.collective_timeout_s;
  c.debug_collectives = o.debug_collectives ? 1 : 0;
  c.comm_mpi_in_flight = h.mpi_in_flight;
  c.reduction = static_cast<int>(o.reduction);
  c.ownership = static_cast<int>(o.ownership);
  write_prefix(config, c);
}

void agree_on_request(Communicator& comm, const CreateRequest& request) {
  agree_or_throw(comm, request.problem.empty() ? Status::Ok : Status::InvalidArgument,
                 request.problem);
}

Handle* find_live(shardopt_optimizer_t h) noexcept {
  if (h == nullptr) return nullptr;
  std::lock_guard<std::mutex> lock(registry_mutex());
  if (registry().count(h) == 0 || h->magic != Handle::kLiveMagic) return nullptr;
  return h;
}

Handle& require_live(shardopt_optimizer_t h) {
  require(h != nullptr, Status::InvalidArgument, "the optimizer handle is NULL");
  Handle* live = find_live(h);
  require(live != nullptr, Status::InvalidArgument,
          "the optimizer handle is not a live handle (destroyed, or never created)");
  return *live;
}

shardopt_optimizer_t register_handle(std::unique_ptr<ShardedOptimizer> opt, bool lazy_gather) {
  auto h = std::make_unique<Handle>();
  h->opt = std::move(opt);
  h->lazy_gather = lazy_gather;
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry().insert(h.get());
  return h.release();
}

void destroy_handle(Handle& h) noexcept {
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    registry().erase(&h);
  }
  h.magic = 0;
  delete &h;
}

shardopt_status_t record_failure(Handle* h, const char* fn, Status s, const char* what) noexcept {
  try {
    std::string msg = std::string(fn) + ": " + what;
    if (h != nullptr) h->last_error = msg;
    thread_last_error = std::move(msg);
  } catch (...) {
    // Out of memory while recording: the status still says what happened.
  }
  return static_cast<shardopt_status_t>(s);
}

void create_on(std::shared_ptr<Communicator> comm, const CreateRequest& request,
               shardopt_optimizer_t* out) {
  agree_on_request(*comm, request);
  const std::string name = comm->name();
  auto opt = std::make_unique<ShardedOptimizer>(std::move(comm), request.options);
  *out = register_handle(std::move(opt), request.lazy_gather);
  (*out)->comm_name = name;
  (*out)->comm_kind = request.comm_kind;
  (*out)->simulate_nodes = request.simulate_nodes;
  (*out)->mpi_in_flight = request.mpi_in_flight;
}

const char* last_error_of(shardopt_optimizer_t h) noexcept {
  if (Handle* live = find_live(h)) return live->last_error.c_str();
  return thread_last_error.c_str();
}

}  // namespace shardopt::capi
