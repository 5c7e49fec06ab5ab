// handle.cpp: handle registry, error recording and collective creation for the C ABI.
#include "handle.hpp"

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

// What a config says, or why it cannot be used. The config is only read.
struct ConfigCheck {
  OptimizerOptions options;
  std::string problem;
};

ConfigCheck read_config(const shardopt_config_t* c) {
  ConfigCheck r;
  if (c == nullptr) return r;  // the defaults
  if (c->struct_size != sizeof(shardopt_config_t)) {
    r.problem = "config->struct_size is " + std::to_string(c->struct_size) + ", expected " +
                std::to_string(sizeof(shardopt_config_t)) +
                " (initialise the config with shardopt_config_init)";
    return r;
  }
  auto in = [](int v, int lo, int hi) { return v >= lo && v <= hi; };
  if (!in(c->stage, 0, 3)) r.problem = "config->stage " + std::to_string(c->stage) + " is not 0, 1, 2 or 3";
  else if (!in(c->param_dtype, 0, 1)) r.problem = "config->param_dtype " + std::to_string(c->param_dtype) + " is not SHARDOPT_DTYPE_F32 or _BF16";
  else if (!in(c->device, 0, 1)) r.problem = "config->device " + std::to_string(c->device) + " is not SHARDOPT_DEVICE_CPU or _CUDA";
  else if (!in(c->adam_mode, 0, 1)) r.problem = "config->adam_mode " + std::to_string(c->adam_mode) + " is not SHARDOPT_ADAMW or SHARDOPT_ADAM_L2";
  if (!r.problem.empty()) return r;
  OptimizerOptions& o = r.options;
  o.stage = static_cast<Stage>(c->stage);
  o.param_dtype = static_cast<DType>(c->param_dtype);
  o.device = static_cast<Device>(c->device);
  o.adam.mode = static_cast<AdamMode>(c->adam_mode);
  o.adam.lr = c->lr;
  o.adam.beta1 = c->beta1;
  o.adam.beta2 = c->beta2;
  o.adam.eps = c->eps;
  o.adam.weight_decay = c->weight_decay;
  o.adam.max_grad_norm = c->max_grad_norm;
  o.bucket_elems = c->bucket_elems;
  return r;  // the values themselves are validated by ShardedOptimizer on every rank
}

}  // namespace

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

shardopt_optimizer_t register_handle(std::unique_ptr<ShardedOptimizer> opt) {
  auto h = std::make_unique<Handle>();
  h->opt = std::move(opt);
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

void create_on(std::shared_ptr<Communicator> comm, shardopt_optimizer_t* out,
               const shardopt_config_t* config) {
  ConfigCheck cfg = read_config(config);
  if (out == nullptr && cfg.problem.empty()) cfg.problem = "the output handle pointer is NULL";
  agree_or_throw(*comm, cfg.problem.empty() ? Status::Ok : Status::InvalidArgument, cfg.problem);
  *out = register_handle(std::make_unique<ShardedOptimizer>(std::move(comm), cfg.options));
}

const char* last_error_of(shardopt_optimizer_t h) noexcept {
  if (Handle* live = find_live(h)) return live->last_error.c_str();
  return thread_last_error.c_str();
}

}  // namespace shardopt::capi
