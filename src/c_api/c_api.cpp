// c_api.cpp: the entry points of shardopt.h. Each one is a thin shell: validate the handle
// and pointers, call the C++ API, and let guarded() turn exceptions into status codes.
#include <cmath>
#include <span>
#include <utility>

#include "handle.hpp"
#if SHARDOPT_WITH_CUDA
#include "shardopt/cuda_comm.hpp"
#endif
#include "shardopt/bf16.hpp"

using namespace shardopt;
using capi::guarded;
using capi::non_null;
using capi::on_handle;

// The C codes are the C++ Status values; keep the two lists in step.
static_assert(SHARDOPT_SUCCESS == static_cast<int>(Status::Ok));
static_assert(SHARDOPT_ERROR_INVALID_ARGUMENT == static_cast<int>(Status::InvalidArgument));
static_assert(SHARDOPT_ERROR_INVALID_STATE == static_cast<int>(Status::InvalidState));
static_assert(SHARDOPT_ERROR_LAYOUT_MISMATCH == static_cast<int>(Status::LayoutMismatch));
static_assert(SHARDOPT_ERROR_REMOTE == static_cast<int>(Status::RemoteError));
static_assert(SHARDOPT_ERROR_COMMUNICATION == static_cast<int>(Status::Communication));
static_assert(SHARDOPT_ERROR_OUT_OF_MEMORY == static_cast<int>(Status::OutOfMemory));
static_assert(SHARDOPT_ERROR_IO == static_cast<int>(Status::Io));
static_assert(SHARDOPT_ERROR_CORRUPT_DATA == static_cast<int>(Status::CorruptData));
static_assert(SHARDOPT_ERROR_UNSUPPORTED == static_cast<int>(Status::Unsupported));
static_assert(SHARDOPT_ERROR_CUDA == static_cast<int>(Status::Cuda));
static_assert(SHARDOPT_ERROR_INTERNAL == static_cast<int>(Status::Internal));
static_assert(SHARDOPT_STAGE_ZERO2 == static_cast<int>(Stage::Zero2));
static_assert(SHARDOPT_DTYPE_BF16 == static_cast<int>(DType::BF16));
static_assert(SHARDOPT_DEVICE_CUDA == static_cast<int>(Device::Cuda));
static_assert(SHARDOPT_ADAM_L2 == static_cast<int>(AdamMode::AdamL2));
static_assert(SHARDOPT_MEM_SCRATCH == static_cast<int>(MemCategory::Scratch));
static_assert(SHARDOPT_MEM_TOTAL == kNumMemCategories);
static_assert(sizeof(bf16) == sizeof(std::uint16_t));

namespace {

// A caller's buffer of n elements: may be NULL only when n == 0.
template <class T>
std::span<T> buffer(T* p, std::size_t n, const char* what) {
  require(p != nullptr || n == 0, Status::InvalidArgument,
          std::string(what) + " is NULL but the element count is " + std::to_string(n));
  return {p, n};
}

const char* require_name(const char* name) {
  non_null(name, "name");
  return name;
}

double& hyper_field(AdamConfig& c, shardopt_hyper_t key) {
  switch (key) {
    case SHARDOPT_HYPER_LR: return c.lr;
    case SHARDOPT_HYPER_BETA1: return c.beta1;
    case SHARDOPT_HYPER_BETA2: return c.beta2;
    case SHARDOPT_HYPER_EPS: return c.eps;
    case SHARDOPT_HYPER_WEIGHT_DECAY: return c.weight_decay;
    case SHARDOPT_HYPER_MAX_GRAD_NORM: return c.max_grad_norm;
    case SHARDOPT_HYPER_ADAM_MODE:
    case SHARDOPT_HYPER_MIN_ENUM:
    case SHARDOPT_HYPER_MAX_ENUM: break;
  }
  throw Error(Status::InvalidArgument, "unknown hyperparameter key " + std::to_string(static_cast<int>(key)));
}

}  // namespace

extern "C" {

// ---- version and errors -----------------------------------------------------------------

int shardopt_version(void) { return SHARDOPT_VERSION_CODE; }
const char* shardopt_version_string(void) { return SHARDOPT_VERSION_STRING; }

const char* shardopt_status_string(shardopt_status_t status) {
  if (status < SHARDOPT_SUCCESS || status > SHARDOPT_ERROR_INTERNAL) return "unknown status";
  return status_name(static_cast<Status>(status));
}

const char* shardopt_last_error(shardopt_optimizer_t opt) { return capi::last_error_of(opt); }

float shardopt_bf16_to_float(uint16_t bits) { return bf16_bits_to_float(bits); }
uint16_t shardopt_float_to_bf16(float value) { return float_to_bf16_bits(value); }

// ---- lifecycle ----------------------------------------------------------------------------

shardopt_status_t shardopt_config_init(shardopt_config_t* config) {
  return guarded("shardopt_config_init", nullptr, [&] {
    non_null(config, "config");
    const OptimizerOptions d;
    *config = shardopt_config_t{};
    config->struct_size = sizeof(shardopt_config_t);
    config->stage = static_cast<int>(d.stage);
    config->param_dtype = static_cast<int>(d.param_dtype);
    config->device = static_cast<int>(d.device);
    config->adam_mode = static_cast<int>(d.adam.mode);
    config->lr = d.adam.lr;
    config->beta1 = d.adam.beta1;
    config->beta2 = d.adam.beta2;
    config->eps = d.adam.eps;
    config->weight_decay = d.adam.weight_decay;
    config->max_grad_norm = d.adam.max_grad_norm;
    config->bucket_elems = d.bucket_elems;
  });
}

shardopt_status_t shardopt_create(shardopt_optimizer_t* opt, const shardopt_config_t* config) {
  if (opt != nullptr) *opt = nullptr;
  return guarded("shardopt_create", nullptr,
                 [&] {
                   std::shared_ptr<Communicator> comm = make_single_process_communicator();
#if SHARDOPT_WITH_CUDA  // Device::Cuda needs a communicator of device buffers
                   if (config != nullptr && config->device == SHARDOPT_DEVICE_CUDA)
                     comm = make_cuda_single_process_communicator();
#endif
                   capi::create_on(std::move(comm), opt, config);
                 });
}

shardopt_status_t shardopt_add_group(shardopt_optimizer_t opt, double lr_scale, int weight_decay,
                                     int* group) {
  return on_handle("shardopt_add_group", opt, [&](ShardedOptimizer& o) {
    require(weight_decay == 0 || weight_decay == 1, Status::InvalidArgument,
            "weight_decay must be 0 or 1, got " + std::to_string(weight_decay));
    const int g = o.add_group(GroupOptions{lr_scale, weight_decay == 1});
    if (group != nullptr) *group = g;
  });
}

shardopt_status_t shardopt_add_param(shardopt_optimizer_t opt, const char* name, size_t numel,
                                     int group, size_t* index) {
  return on_handle("shardopt_add_param", opt, [&](ShardedOptimizer& o) {
    const std::size_t i = o.add_param(require_name(name), numel, group);
    if (index != nullptr) *index = i;
  });
}

shardopt_status_t shardopt_finalize(shardopt_optimizer_t opt) {
  return on_handle("shardopt_finalize", opt, [&](ShardedOptimizer& o) { o.finalize(); });
}

shardopt_status_t shardopt_destroy(shardopt_optimizer_t opt) {
  if (opt == nullptr) return SHARDOPT_SUCCESS;
  return guarded("shardopt_destroy", nullptr,
                 [&] { capi::destroy_handle(capi::require_live(opt)); });
}

// ---- queries --------------------------------------------------------------------------------

shardopt_status_t shardopt_comm_rank(shardopt_optimizer_t opt, int* rank) {
  return on_handle("shardopt_comm_rank", opt,
                   [&](ShardedOptimizer& o) { *non_null(rank, "rank") = o.comm().rank(); });
}

shardopt_status_t shardopt_comm_size(shardopt_optimizer_t opt, int* size) {
  return on_handle("shardopt_comm_size", opt,
                   [&](ShardedOptimizer& o) { *non_null(size, "size") = o.comm().size(); });
}

shardopt_status_t shardopt_num_params(shardopt_optimizer_t opt, size_t* count) {
  return on_handle("shardopt_num_params", opt, [&](ShardedOptimizer& o) {
    *non_null(count, "count") = o.layout().num_params();
  });
}

shardopt_status_t shardopt_param_numel(shardopt_optimizer_t opt, size_t index, size_t* numel) {
  return on_handle("shardopt_param_numel", opt, [&](ShardedOptimizer& o) {
    non_null(numel, "numel");
    *numel = o.layout().param(index).numel;
  });
}

shardopt_status_t shardopt_param_index(shardopt_optimizer_t opt, const char* name, size_t* index) {
  return on_handle("shardopt_param_index", opt, [&](ShardedOptimizer& o) {
    non_null(index, "index");
    const std::size_t i = o.layout().find(require_name(name));
    require(i < o.layout().num_params(), Status::InvalidArgument,
            std::string("no parameter is called '") + name + "'");
    *index = i;
  });
}

shardopt_status_t shardopt_step_count(shardopt_optimizer_t opt, int64_t* step) {
  return on_handle("shardopt_step_count", opt,
                   [&](ShardedOptimizer& o) { *non_null(step, "step") = o.step_count(); });
}

// ---- parameters and gradients ---------------------------------------------------------------

shardopt_status_t shardopt_set_param(shardopt_optimizer_t opt, size_t index, const float* values,
                                     size_t numel) {
  return on_handle("shardopt_set_param", opt, [&](ShardedOptimizer& o) {
    o.set_param(index, buffer(values, numel, "values"));
  });
}

shardopt_status_t shardopt_get_master(shardopt_optimizer_t opt, size_t index, float* out,
                                      size_t numel) {
  return on_handle("shardopt_get_master", opt, [&](ShardedOptimizer& o) {
    o.get_master(index, buffer(out, numel, "out"));
  });
}

shardopt_status_t shardopt_param_f32(shardopt_optimizer_t opt, size_t index, const float** data,
                                     size_t* numel) {
  return on_handle("shardopt_param_f32", opt, [&](ShardedOptimizer& o) {
    non_null(data, "data");
    const std::span<float> v = o.param<float>(index);
    *data = v.data();
    if (numel != nullptr) *numel = v.size();
  });
}

shardopt_status_t shardopt_param_bf16(shardopt_optimizer_t opt, size_t index,
                                      const uint16_t** data, size_t* numel) {
  return on_handle("shardopt_param_bf16", opt, [&](ShardedOptimizer& o) {
    non_null(data, "data");
    const std::span<bf16> v = o.param<bf16>(index);
    *data = reinterpret_cast<const std::uint16_t*>(v.data());
    if (numel != nullptr) *numel = v.size();
  });
}

shardopt_status_t shardopt_grad(shardopt_optimizer_t opt, size_t index, float** data,
                                size_t* numel) {
  return on_handle("shardopt_grad", opt, [&](ShardedOptimizer& o) {
    non_null(data, "data");
    const std::span<float> g = o.grad(index);
    *data = g.data();
    if (numel != nullptr) *numel = g.size();
  });
}

shardopt_status_t shardopt_accumulate_grad_f32(shardopt_optimizer_t opt, size_t index,
                                               const float* src, size_t numel) {
  return on_handle("shardopt_accumulate_grad_f32", opt, [&](ShardedOptimizer& o) {
    o.accumulate_grad(index, std::span<const float>(buffer(src, numel, "src")));
  });
}

shardopt_status_t shardopt_accumulate_grad_bf16(shardopt_optimizer_t opt, size_t index,
                                                const uint16_t* src, size_t numel) {
  return on_handle("shardopt_accumulate_grad_bf16", opt, [&](ShardedOptimizer& o) {
    const std::span<const std::uint16_t> s = buffer(src, numel, "src");
    o.accumulate_grad(index, std::span<const bf16>(reinterpret_cast<const bf16*>(s.data()), s.size()));
  });
}

shardopt_status_t shardopt_grad_ready(shardopt_optimizer_t opt, size_t index) {
  return on_handle("shardopt_grad_ready", opt, [&](ShardedOptimizer& o) { o.grad_ready(index); });
}

shardopt_status_t shardopt_begin_backward(shardopt_optimizer_t opt, int sync) {
  return on_handle("shardopt_begin_backward", opt,
                   [&](ShardedOptimizer& o) { o.begin_backward(sync != 0); });
}

shardopt_status_t shardopt_reduce_gradients(shardopt_optimizer_t opt) {
  return on_handle("shardopt_reduce_gradients", opt,
                   [&](ShardedOptimizer& o) { o.reduce_gradients(); });
}

shardopt_status_t shardopt_zero_grad(shardopt_optimizer_t opt) {
  return on_handle("shardopt_zero_grad", opt, [&](ShardedOptimizer& o) { o.zero_grad(); });
}

// ---- the step and hyperparameters -------------------------------------------------------------

shardopt_status_t shardopt_step(shardopt_optimizer_t opt, shardopt_step_result_t* result) {
  return on_handle("shardopt_step", opt, [&](ShardedOptimizer& o) {
    const StepResult r = o.step();
    if (result != nullptr)
      *result = shardopt_step_result_t{r.grad_norm, r.clip_coef, r.clipped ? 1 : 0,
                                       r.skipped ? 1 : 0, r.step};
  });
}

shardopt_status_t shardopt_set_lr(shardopt_optimizer_t opt, double lr) {
  return on_handle("shardopt_set_lr", opt, [&](ShardedOptimizer& o) { o.set_lr(lr); });
}

shardopt_status_t shardopt_get_lr(shardopt_optimizer_t opt, double* lr) {
  return on_handle("shardopt_get_lr", opt, [&](ShardedOptimizer& o) { *non_null(lr, "lr") = o.lr(); });
}

shardopt_status_t shardopt_set_hyper(shardopt_optimizer_t opt, shardopt_hyper_t key, double value) {
  return on_handle("shardopt_set_hyper", opt, [&](ShardedOptimizer& o) {
    AdamConfig c = o.options().adam;
    if (key == SHARDOPT_HYPER_ADAM_MODE) {
      require(value == 0.0 || value == 1.0, Status::InvalidArgument,
              "SHARDOPT_HYPER_ADAM_MODE must be 0 (AdamW) or 1 (Adam-L2)");
      c.mode = static_cast<AdamMode>(static_cast<int>(value));
    } else {
      hyper_field(c, key) = value;
    }
    o.set_adam_config(c);
  });
}

shardopt_status_t shardopt_get_hyper(shardopt_optimizer_t opt, shardopt_hyper_t key, double* value) {
  return on_handle("shardopt_get_hyper", opt, [&](ShardedOptimizer& o) {
    non_null(value, "value");
    AdamConfig c = o.options().adam;
    *value = key == SHARDOPT_HYPER_ADAM_MODE ? static_cast<double>(c.mode) : hyper_field(c, key);
  });
}

shardopt_status_t shardopt_set_group(shardopt_optimizer_t opt, int group, double lr_scale,
                                     int weight_decay) {
  return on_handle("shardopt_set_group", opt, [&](ShardedOptimizer& o) {
    require(weight_decay == 0 || weight_decay == 1, Status::InvalidArgument,
            "weight_decay must be 0 or 1, got " + std::to_string(weight_decay));
    o.set_group(group, GroupOptions{lr_scale, weight_decay == 1});
  });
}

// ---- memory report ----------------------------------------------------------------------------

shardopt_status_t shardopt_memory_usage(shardopt_optimizer_t opt, shardopt_mem_category_t category,
                                        size_t* bytes, size_t* peak) {
  return on_handle("shardopt_memory_usage", opt, [&](ShardedOptimizer& o) {
    require(category >= SHARDOPT_MEM_PARAMS && category <= SHARDOPT_MEM_TOTAL,
            Status::InvalidArgument, "unknown memory category " + std::to_string(static_cast<int>(category)));
    const MemoryReport m = o.memory_report();
    std::size_t b = 0, p = 0;
    for (int c = 0; c < kNumMemCategories; ++c) {
      if (category != SHARDOPT_MEM_TOTAL && c != static_cast<int>(category)) continue;
      b += m.bytes[static_cast<std::size_t>(c)];
      p += m.peak[static_cast<std::size_t>(c)];
    }
    if (bytes != nullptr) *bytes = b;
    if (peak != nullptr) *peak = p;
  });
}

const char* shardopt_mem_category_name(shardopt_mem_category_t category) {
  if (category == SHARDOPT_MEM_TOTAL) return "total";
  if (category < SHARDOPT_MEM_PARAMS || category > SHARDOPT_MEM_TOTAL) return "?";
  return mem_category_name(static_cast<MemCategory>(category));
}

}  // extern "C"
