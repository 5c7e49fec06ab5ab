// c_api.cpp: the entry points of shardopt.h. Each one is a thin shell: validate the handle
// and pointers, call the C++ API, and let guarded() turn exceptions into status codes.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <cmath>
#include <iterator>
#include <span>

#include "../backend.hpp"  // make_cuda_single_process_communicator_from_core
#include "handle.hpp"
#include "shardopt/bf16.hpp"
#include "shardopt/checkpoint.hpp"

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
static_assert(SHARDOPT_OWNERSHIP_WHOLE == static_cast<int>(Ownership::Whole));
static_assert(SHARDOPT_RULE_MUON == static_cast<int>(Rule::Muon));
static_assert(SHARDOPT_RULE_ADAFACTOR == static_cast<int>(Rule::Adafactor));
static_assert(SHARDOPT_MUON_LR_NONE == static_cast<int>(MuonLrAdjust::None));
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

// The end of each field of shardopt_step_result_t: the sizes a caller may pass.
#define SHARDOPT_RESULT_END(f) (offsetof(shardopt_step_result_t, f) + sizeof(shardopt_step_result_t::f))
constexpr std::size_t kResultEnds[] = {
    SHARDOPT_RESULT_END(struct_size), SHARDOPT_RESULT_END(grad_norm),
    SHARDOPT_RESULT_END(clip_coef), SHARDOPT_RESULT_END(clipped),
    SHARDOPT_RESULT_END(skipped), SHARDOPT_RESULT_END(step),
    SHARDOPT_RESULT_END(skipped_steps), SHARDOPT_RESULT_END(loss_scale),
    SHARDOPT_RESULT_END(time_reduce), SHARDOPT_RESULT_END(time_norm),
    SHARDOPT_RESULT_END(time_update), SHARDOPT_RESULT_END(time_gather),
    SHARDOPT_RESULT_END(time_total)};
// The smallest result: the fields of 0.1.0 (grad_norm ... step).
constexpr std::size_t kResultMinSize = SHARDOPT_RESULT_END(step);
#undef SHARDOPT_RESULT_END
static_assert(kResultEnds[std::size(kResultEnds) - 1] == sizeof(shardopt_step_result_t));

// Collective: arguments of a collective call checked on every rank together, so that a bad
// argument on one rank fails the call everywhere instead of leaving the others waiting.
void agree_args(ShardedOptimizer& o, Status s, const std::string& problem) {
  agree_or_throw(o.comm(), problem.empty() ? Status::Ok : s, problem);
}

// The problem with a (index, out, numel) copy-out request, or "".
std::string copy_out_problem(const ShardedOptimizer& o, std::size_t index, const float* out,
                             std::size_t numel) {
  if (!o.finalized()) return "call shardopt_finalize first";
  if (index >= o.layout().num_params())
    return "no parameter index " + std::to_string(index) + " (there are " +
           std::to_string(o.layout().num_params()) + ")";
  const ParamInfo& p = o.layout().param(index);
  if (numel != p.numel)
    return "parameter '" + p.name + "' has " + std::to_string(p.numel) + " elements, got " +
           std::to_string(numel);
  if (out == nullptr) return "out is NULL";
  return {};
}

// Collective: copies state array `a` of parameter `index` (every check agreed first).
void copy_state_out(ShardedOptimizer& o, StateArray a, std::size_t index, float* out,
                    std::size_t numel) {
  const std::string problem = copy_out_problem(o, index, out, numel);
  agree_args(o, o.finalized() ? Status::InvalidArgument : Status::InvalidState, problem);
  if (a == StateArray::Master)
    o.get_master(index, {out, numel});
  else
    o.get_state(a, index, {out, numel});
}

// Completes every all-gather of the last step (SHARDOPT_GATHER_EAGER, shardopt_wait_all).
void wait_all_params(ShardedOptimizer& o) {
  for (std::size_t i = 0; i < o.layout().num_params(); ++i) o.wait_param(i);
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
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
  return guarded("shardopt_config_init", nullptr,
                 [&] { *non_null(config, "config") = capi::default_config(); });
}

shardopt_status_t shardopt_step_result_init(shardopt_step_result_t* result) {
  return guarded("shardopt_step_result_init", nullptr, [&] {
    *non_null(result, "result") = shardopt_step_result_t{};
    result->struct_size = sizeof(shardopt_step_result_t);
  });
}

shardopt_status_t shardopt_create(shardopt_optimizer_t* opt, const shardopt_config_t* config) {
  if (opt != nullptr) *opt = nullptr;
  return guarded("shardopt_create", nullptr, [&] {
    const capi::CreateRequest r = capi::read_config(config, opt);
    // Device::Cuda needs a communicator of device buffers (libshardopt_cuda's).
    capi::create_on(r.problem.empty() && r.options.device == Device::Cuda
                        ? make_cuda_single_process_communicator_from_core()
                        : make_single_process_communicator(),
                    r, opt);
  });
}

shardopt_status_t shardopt_add_group(shardopt_optimizer_t opt, double lr_scale, int weight_decay,
                                     int* group) {
  return on_handle("shardopt_add_group", opt, [&](ShardedOptimizer& o) {
    require(weight_decay == 0 || weight_decay == 1, Status::InvalidArgument,
            "weight_decay must be 0 or 1, got " + std::to_string(weight_decay));
    GroupOptions g;
    g.lr_scale = lr_scale;
    g.weight_decay = weight_decay == 1;
    const int index = o.add_group(g);
    if (group != nullptr) *group = index;
  });
}

// ---- shardopt_group_t ---------------------------------------------------------------------

namespace {

#define SHARDOPT_GROUP_END(f) (offsetof(shardopt_group_t, f) + sizeof(shardopt_group_t::f))
constexpr std::size_t kGroupEnds[] = {
    SHARDOPT_GROUP_END(struct_size), SHARDOPT_GROUP_END(lr_scale),
    SHARDOPT_GROUP_END(weight_decay), SHARDOPT_GROUP_END(rule),
    SHARDOPT_GROUP_END(lion_beta1), SHARDOPT_GROUP_END(lion_beta2),
    SHARDOPT_GROUP_END(adamw8bit_min_numel), SHARDOPT_GROUP_END(muon_momentum),
    SHARDOPT_GROUP_END(muon_nesterov), SHARDOPT_GROUP_END(muon_ns_steps),
    SHARDOPT_GROUP_END(muon_ns_a), SHARDOPT_GROUP_END(muon_ns_b), SHARDOPT_GROUP_END(muon_ns_c),
    SHARDOPT_GROUP_END(muon_eps), SHARDOPT_GROUP_END(muon_lr_adjust),
    SHARDOPT_GROUP_END(reserved0), SHARDOPT_GROUP_END(adafactor_beta2_decay),
    SHARDOPT_GROUP_END(adafactor_eps1), SHARDOPT_GROUP_END(adafactor_eps2),
    SHARDOPT_GROUP_END(adafactor_d), SHARDOPT_GROUP_END(adafactor_maximize),
    SHARDOPT_GROUP_END(reserved1)};
static_assert(kGroupEnds[std::size(kGroupEnds) - 1] == sizeof(shardopt_group_t));
// The first version ended with lion_beta2.
constexpr std::size_t kGroupMinSize = SHARDOPT_GROUP_END(lion_beta2);
#undef SHARDOPT_GROUP_END

shardopt_group_t c_group(const GroupOptions& g) {
  shardopt_group_t c{};
  c.struct_size = sizeof(shardopt_group_t);
  c.lr_scale = g.lr_scale;
  c.weight_decay = g.weight_decay ? 1 : 0;
  c.rule = static_cast<int>(g.rule);
  c.lion_beta1 = g.lion.beta1;
  c.lion_beta2 = g.lion.beta2;
  c.adamw8bit_min_numel = g.adamw8bit.min_8bit_numel;
  c.muon_momentum = g.muon.momentum;
  c.muon_nesterov = g.muon.nesterov ? 1 : 0;
  c.muon_ns_steps = g.muon.ns_steps;
  c.muon_ns_a = g.muon.ns_a;
  c.muon_ns_b = g.muon.ns_b;
  c.muon_ns_c = g.muon.ns_c;
  c.muon_eps = g.muon.eps;
  c.muon_lr_adjust = static_cast<int>(g.muon.lr_adjust);
  c.reserved0 = 0;
  c.adafactor_beta2_decay = g.adafactor.beta2_decay;
  c.adafactor_eps1 = g.adafactor.eps1;
  c.adafactor_eps2 = g.adafactor.eps2;
  c.adafactor_d = g.adafactor.d;
  c.adafactor_maximize = g.adafactor.maximize ? 1 : 0;
  c.reserved1 = 0;
  return c;
}

GroupOptions read_group(const shardopt_group_t* in) {
  non_null(in, "group");
  const std::string problem = capi::struct_size_problem("group", in->struct_size, kGroupMinSize,
                                                        kGroupEnds, /*accept_larger=*/false);
  require(problem.empty(), Status::InvalidArgument,
          problem + " (initialise the group with shardopt_group_init)");
  shardopt_group_t c = c_group(GroupOptions{});
  std::memcpy(&c, in, in->struct_size);
  require(c.weight_decay == 0 || c.weight_decay == 1, Status::InvalidArgument,
          "group->weight_decay must be 0 or 1, got " + std::to_string(c.weight_decay));
  require(c.rule == SHARDOPT_RULE_ADAMW || c.rule == SHARDOPT_RULE_LION ||
              c.rule == SHARDOPT_RULE_ADAMW8BIT || c.rule == SHARDOPT_RULE_MUON ||
              c.rule == SHARDOPT_RULE_ADAFACTOR,
          Status::InvalidArgument,
          "group->rule " + std::to_string(c.rule) +
              " is not a shardopt_rule_t (SHARDOPT_RULE_ADAMW 0, SHARDOPT_RULE_LION 1, "
              "SHARDOPT_RULE_ADAMW8BIT 2, SHARDOPT_RULE_MUON 3, SHARDOPT_RULE_ADAFACTOR 4)");
  require(c.muon_nesterov == 0 || c.muon_nesterov == 1, Status::InvalidArgument,
          "group->muon_nesterov must be 0 or 1, got " + std::to_string(c.muon_nesterov));
  require(c.muon_lr_adjust >= SHARDOPT_MUON_LR_ORIGINAL &&
              c.muon_lr_adjust <= SHARDOPT_MUON_LR_NONE,
          Status::InvalidArgument,
          "group->muon_lr_adjust " + std::to_string(c.muon_lr_adjust) +
              " is not a shardopt_muon_lr_adjust_t (SHARDOPT_MUON_LR_ORIGINAL 0, "
              "_MATCH_RMS_ADAMW 1, _NONE 2)");
  require(c.reserved0 == 0, Status::InvalidArgument,
          "group->reserved0 must be 0, got " + std::to_string(c.reserved0));
  require(c.adafactor_maximize == 0 || c.adafactor_maximize == 1, Status::InvalidArgument,
          "group->adafactor_maximize must be 0 or 1, got " +
              std::to_string(c.adafactor_maximize));
  require(c.reserved1 == 0, Status::InvalidArgument,
          "group->reserved1 must be 0, got " + std::to_string(c.reserved1));
  GroupOptions g;
  g.lr_scale = c.lr_scale;
  g.weight_decay = c.weight_decay == 1;
  g.rule = static_cast<Rule>(c.rule);
  g.lion.beta1 = c.lion_beta1;
  g.lion.beta2 = c.lion_beta2;
  g.adamw8bit.min_8bit_numel = c.adamw8bit_min_numel;
  g.muon.momentum = c.muon_momentum;  // the values are validated by the optimizer
  g.muon.nesterov = c.muon_nesterov == 1;
  g.muon.ns_steps = c.muon_ns_steps;
  g.muon.ns_a = c.muon_ns_a;
  g.muon.ns_b = c.muon_ns_b;
  g.muon.ns_c = c.muon_ns_c;
  g.muon.eps = c.muon_eps;
  g.muon.lr_adjust = static_cast<MuonLrAdjust>(c.muon_lr_adjust);
  g.adafactor.beta2_decay = c.adafactor_beta2_decay;  // validated by the optimizer too
  g.adafactor.eps1 = c.adafactor_eps1;
  g.adafactor.eps2 = c.adafactor_eps2;
  g.adafactor.d = c.adafactor_d;
  g.adafactor.maximize = c.adafactor_maximize == 1;
  return g;
}

const GroupOptions& group_at(const ShardedOptimizer& o, int index) {
  require(index >= 0 && static_cast<std::size_t>(index) < o.groups().size(),
          Status::InvalidArgument, "no group " + std::to_string(index));
  return o.groups()[static_cast<std::size_t>(index)];
}

}  // namespace

void shardopt_group_init(shardopt_group_t* group) {
  if (group != nullptr) *group = c_group(GroupOptions{});
}

shardopt_status_t shardopt_add_group_ex(shardopt_optimizer_t opt, const shardopt_group_t* group,
                                        int* index) {
  return on_handle("shardopt_add_group_ex", opt, [&](ShardedOptimizer& o) {
    const int g = o.add_group(read_group(group));
    if (index != nullptr) *index = g;
  });
}

shardopt_status_t shardopt_set_group_ex(shardopt_optimizer_t opt, int index,
                                        const shardopt_group_t* group) {
  return on_handle("shardopt_set_group_ex", opt,
                   [&](ShardedOptimizer& o) { o.set_group(index, read_group(group)); });
}

shardopt_status_t shardopt_get_group_ex(shardopt_optimizer_t opt, int index,
                                        shardopt_group_t* group) {
  return on_handle("shardopt_get_group_ex", opt, [&](ShardedOptimizer& o) {
    non_null(group, "group");
    const std::string problem = capi::struct_size_problem(
        "group", group->struct_size, kGroupMinSize, kGroupEnds, /*accept_larger=*/true);
    require(problem.empty(), Status::InvalidArgument, problem);
    const shardopt_group_t full = c_group(group_at(o, index));
    const std::size_t n = std::min(group->struct_size, sizeof full) - sizeof(std::size_t);
    std::memcpy(reinterpret_cast<char*>(group) + sizeof(std::size_t),
                reinterpret_cast<const char*>(&full) + sizeof(std::size_t), n);
  });
}

shardopt_status_t shardopt_add_param(shardopt_optimizer_t opt, const char* name, size_t numel,
                                     int group, size_t* index) {
  return on_handle("shardopt_add_param", opt, [&](ShardedOptimizer& o) {
    const std::size_t i = o.add_param(require_name(name), numel, group);
    if (index != nullptr) *index = i;
  });
}

shardopt_status_t shardopt_add_param_2d(shardopt_optimizer_t opt, const char* name, size_t rows,
                                        size_t cols, int group, size_t* index) {
  return on_handle("shardopt_add_param_2d", opt, [&](ShardedOptimizer& o) {
    const std::size_t i = o.add_param(require_name(name), Shape2D{rows, cols}, group);
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

shardopt_status_t shardopt_comm_name(shardopt_optimizer_t opt, const char** name) {
  return guarded("shardopt_comm_name", capi::find_live(opt), [&] {
    const capi::Handle& h = capi::require_live(opt);
    *non_null(name, "name") = h.comm_name.c_str();
  });
}

shardopt_status_t shardopt_get_config(shardopt_optimizer_t opt, shardopt_config_t* config) {
  return guarded("shardopt_get_config", capi::find_live(opt), [&] {
    capi::write_config(capi::require_live(opt), non_null(config, "config"));
  });
}

shardopt_status_t shardopt_num_groups(shardopt_optimizer_t opt, int* count) {
  return on_handle("shardopt_num_groups", opt, [&](ShardedOptimizer& o) {
    *non_null(count, "count") = static_cast<int>(o.groups().size());
  });
}

shardopt_status_t shardopt_get_group(shardopt_optimizer_t opt, int group, double* lr_scale,
                                     int* weight_decay) {
  return on_handle("shardopt_get_group", opt, [&](ShardedOptimizer& o) {
    const int n = static_cast<int>(o.groups().size());
    require(group >= 0 && group < n, Status::InvalidArgument,
            "no group " + std::to_string(group) + " (there are " + std::to_string(n) + ")");
    const GroupOptions& g = o.groups()[static_cast<std::size_t>(group)];
    if (lr_scale != nullptr) *lr_scale = g.lr_scale;
    if (weight_decay != nullptr) *weight_decay = g.weight_decay ? 1 : 0;
  });
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

shardopt_status_t shardopt_param_shape(shardopt_optimizer_t opt, size_t index, size_t* rows,
                                       size_t* cols) {
  return on_handle("shardopt_param_shape", opt, [&](ShardedOptimizer& o) {
    const ParamInfo& p = o.layout().param(index);
    if (rows != nullptr) *rows = p.rows;
    if (cols != nullptr) *cols = p.cols;
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
    copy_state_out(o, StateArray::Master, index, out, numel);
  });
}

shardopt_status_t shardopt_get_exp_avg(shardopt_optimizer_t opt, size_t index, float* out,
                                       size_t numel) {
  return on_handle("shardopt_get_exp_avg", opt, [&](ShardedOptimizer& o) {
    copy_state_out(o, StateArray::ExpAvg, index, out, numel);
  });
}

shardopt_status_t shardopt_get_exp_avg_sq(shardopt_optimizer_t opt, size_t index, float* out,
                                          size_t numel) {
  return on_handle("shardopt_get_exp_avg_sq", opt, [&](ShardedOptimizer& o) {
    copy_state_out(o, StateArray::ExpAvgSq, index, out, numel);
  });
}

shardopt_status_t shardopt_get_factored_state(shardopt_optimizer_t opt, size_t index,
                                              float* row_var, size_t rows, float* col_var,
                                              size_t cols) {
  return on_handle("shardopt_get_factored_state", opt, [&](ShardedOptimizer& o) {
    // NULL buffers agreed here (a span is never made from one); the rest, the parameter's
    // rule and shape included, the optimizer checks on every rank together.
    agree_args(o, Status::InvalidArgument,
               row_var == nullptr || col_var == nullptr ? "row_var or col_var is NULL" : "");
    o.get_factored_state(index, {row_var, rows}, {col_var, cols});
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

shardopt_status_t shardopt_replica(shardopt_optimizer_t opt, const void** data, size_t* elems) {
  return on_handle("shardopt_replica", opt, [&](ShardedOptimizer& o) {
    non_null(data, "data");
    const void* base = o.replica_data();
    *data = base;
    if (elems != nullptr) *elems = o.layout().padded_size();
  });
}

shardopt_status_t shardopt_param_offset(shardopt_optimizer_t opt, size_t index, size_t* offset) {
  return on_handle("shardopt_param_offset", opt, [&](ShardedOptimizer& o) {
    non_null(offset, "offset");
    require(o.finalized(), Status::InvalidState,
            "param_offset: offsets are fixed by shardopt_finalize; call it first");
    *offset = o.layout().param(index).flat.begin;
  });
}

shardopt_status_t shardopt_wait_param(shardopt_optimizer_t opt, size_t index) {
  return on_handle("shardopt_wait_param", opt, [&](ShardedOptimizer& o) { o.wait_param(index); });
}

shardopt_status_t shardopt_wait_all(shardopt_optimizer_t opt) {
  return on_handle("shardopt_wait_all", opt, [&](ShardedOptimizer& o) {
    require(o.finalized(), Status::InvalidState, "wait_all: call shardopt_finalize first");
    wait_all_params(o);
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

shardopt_status_t shardopt_progress(shardopt_optimizer_t opt) {
  return on_handle("shardopt_progress", opt, [&](ShardedOptimizer& o) { o.progress(); });
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
    const capi::Handle& h = capi::require_live(opt);
    // Checked first, reported after the step: the step is collective, and a rank that
    // skipped it would leave the others waiting.
    const std::string result_problem =
        result == nullptr ? std::string()
                          : capi::struct_size_problem("result", result->struct_size,
                                                      kResultMinSize, kResultEnds, true);
    StepResult r = o.step();
    if (!h.lazy_gather) {  // every replica pointer reads the new values on return
      const auto start = std::chrono::steady_clock::now();
      wait_all_params(o);
      const double waited = seconds_since(start);
      r.timings.gather += waited;
      r.timings.total += waited;
    }
    require(result_problem.empty(), Status::InvalidArgument,
            result_problem + " (set it with shardopt_step_result_init); the step itself was "
                             "applied, the result was not written");
    if (result == nullptr) return;
    shardopt_step_result_t c{};
    c.grad_norm = r.grad_norm;
    c.clip_coef = r.clip_coef;
    c.clipped = r.clipped ? 1 : 0;
    c.skipped = r.skipped ? 1 : 0;
    c.step = r.step;
    c.skipped_steps = r.skipped_steps;
    c.loss_scale = r.loss_scale;
    c.time_reduce = r.timings.reduce;
    c.time_norm = r.timings.norm;
    c.time_update = r.timings.update;
    c.time_gather = r.timings.gather;
    c.time_total = r.timings.total;
    capi::write_prefix(result, c);
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
    GroupOptions g = group_at(o, group);  // the rule and its options stay
    g.lr_scale = lr_scale;
    g.weight_decay = weight_decay == 1;
    o.set_group(group, g);
  });
}

shardopt_status_t shardopt_get_loss_scale(shardopt_optimizer_t opt, double* scale,
                                          int64_t* good_steps, int64_t* skipped_steps) {
  return on_handle("shardopt_get_loss_scale", opt, [&](ShardedOptimizer& o) {
    const LossScaleState& st = o.loss_scale_state();
    if (scale != nullptr) *scale = st.scale;
    if (good_steps != nullptr) *good_steps = st.good_steps;
    if (skipped_steps != nullptr) *skipped_steps = st.skipped_steps;
  });
}

shardopt_status_t shardopt_set_loss_scale(shardopt_optimizer_t opt, double scale,
                                          int64_t good_steps, int64_t skipped_steps) {
  return on_handle("shardopt_set_loss_scale", opt, [&](ShardedOptimizer& o) {
    o.set_loss_scale_state(LossScaleState{scale, good_steps, skipped_steps});
  });
}

// ---- checkpoints ------------------------------------------------------------------------------

shardopt_status_t shardopt_save_checkpoint(shardopt_optimizer_t opt, const char* dir, int keep,
                                           const char** published) {
  return on_handle("shardopt_save_checkpoint", opt, [&](ShardedOptimizer& o) {
    capi::Handle& h = capi::require_live(opt);
    agree_args(o, Status::InvalidArgument,
               dir == nullptr ? "dir is NULL" : *dir == '\0' ? "dir is empty" : "");
    const std::filesystem::path path = save_checkpoint(o, dir, SaveOptions{keep});
    h.published = path.string();
    if (published != nullptr) *published = h.published.c_str();
  });
}

shardopt_status_t shardopt_load_checkpoint(shardopt_optimizer_t opt, const char* path) {
  return on_handle("shardopt_load_checkpoint", opt, [&](ShardedOptimizer& o) {
    agree_args(o, Status::InvalidArgument,
               path == nullptr ? "path is NULL" : *path == '\0' ? "path is empty" : "");
    load_checkpoint(o, path);
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

// ---- stage 3: units ----------------------------------------------------------------------

static_assert(SHARDOPT_STAGE_ZERO3 == static_cast<int>(Stage::Zero3));

shardopt_status_t shardopt_begin_unit(shardopt_optimizer_t opt, int* unit) {
  return on_handle("shardopt_begin_unit", opt, [&](ShardedOptimizer& o) {
    const int u = o.begin_unit();
    if (unit != nullptr) *unit = u;
  });
}

shardopt_status_t shardopt_num_units(shardopt_optimizer_t opt, size_t* count) {
  return on_handle("shardopt_num_units", opt, [&](ShardedOptimizer& o) {
    non_null(count, "count");
    require(o.finalized(), Status::InvalidState, "shardopt_num_units: call shardopt_finalize first");
    *count = o.layout().num_units();
  });
}

shardopt_status_t shardopt_acquire(shardopt_optimizer_t opt, size_t unit) {
  return on_handle("shardopt_acquire", opt, [&](ShardedOptimizer& o) { o.acquire(unit); });
}

shardopt_status_t shardopt_prefetch(shardopt_optimizer_t opt, size_t unit) {
  return on_handle("shardopt_prefetch", opt, [&](ShardedOptimizer& o) { o.prefetch(unit); });
}

shardopt_status_t shardopt_release(shardopt_optimizer_t opt, size_t unit) {
  return on_handle("shardopt_release", opt, [&](ShardedOptimizer& o) { o.release(unit); });
}

}  // extern "C"
