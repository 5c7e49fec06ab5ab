// optimizer.cpp (torch): ShardedAdamW, the LibTorch face of ShardedOptimizer. See the header
// for what it does to the model's tensors; this file is the wiring: group options to
// shardopt's AdamConfig/GroupOptions, tensors to views of the flat buffers, and the autograd
// hooks that feed the bucketed reduction during backward.
#include "shardopt/torch/optimizer.hpp"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <span>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "shardopt/error.hpp"

namespace shardopt::libtorch {
namespace {

using torch::optim::AdamWOptions;

const AdamWOptions& adamw_options(const torch::optim::OptimizerParamGroup& g) {
  return static_cast<const AdamWOptions&>(g.options());
}

// A copy of the defaults as their own type (a RuleOptions keeps its rule): through the base,
// where clone() is public.
std::unique_ptr<torch::optim::OptimizerOptions> clone_options(const AdamWOptions& o) {
  return static_cast<const torch::optim::OptimizerOptions&>(o).clone();
}

std::vector<std::string> default_names(const ShardedAdamW::ParamGroups& groups) {
  std::vector<std::string> names;
  for (std::size_t g = 0; g < groups.size(); ++g)
    for (std::size_t j = 0; j < groups[g].params().size(); ++j)
      // Appended piecewise: "g" + std::to_string(g) trips GCC 12's false -Wrestrict.
      names.push_back(std::string("g").append(std::to_string(g)).append(".").append(std::to_string(j)));
  return names;
}

std::vector<torch::Tensor> concat(const ShardedAdamW::Units& units) {
  std::vector<torch::Tensor> all;
  for (const auto& u : units) all.insert(all.end(), u.begin(), u.end());
  return all;
}

ShardedAdamW::ParamGroups one_group(std::vector<torch::Tensor> params) {
  ShardedAdamW::ParamGroups groups;
  groups.emplace_back(std::move(params));
  return groups;
}

std::vector<torch::Tensor> values_of(const torch::OrderedDict<std::string, torch::Tensor>& d) {
  std::vector<torch::Tensor> v;
  for (const auto& item : d) v.push_back(item.value());
  return v;
}

ShardedAdamW::Units values_of(const ShardedAdamW::NamedUnits& units) {
  ShardedAdamW::Units v;
  for (const auto& u : units) v.push_back(values_of(u));
  return v;
}

// The tensor over `numel` elements at `data`, shaped like `like` (no copy, no ownership).
torch::Tensor view_of(void* data, const torch::Tensor& like, torch::ScalarType dtype) {
  return torch::from_blob(data, like.sizes(), torch::TensorOptions().dtype(dtype));
}

}  // namespace

// The pre-hook of a parameter's gradient accumulator: runs before autograd accumulates the
// parameter's gradient into .grad(). The first one of a backward pass opens the pass, so that
// whatever the pass sets up (begin_backward: a micro-batch boundary, a reproducible-mode
// deposit) happens before any gradient of this pass has landed in shardopt's buffer.
struct ShardedAdamW::PassHook final : torch::autograd::FunctionPreHook {
  explicit PassHook(ShardedAdamW* owner) : owner(owner) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (!owner->in_pass_) owner->begin_pass();
    return grads;
  }
  ShardedAdamW* owner;
};

// The post-hook of a parameter's gradient accumulator: runs after autograd has accumulated
// the parameter's gradient of this backward pass into .grad().
struct ShardedAdamW::Hook final : torch::autograd::FunctionPostHook {
  Hook(ShardedAdamW* owner, std::size_t index) : owner(owner), index(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    owner->on_grad(index);
    return outputs;
  }
  ShardedAdamW* owner;
  std::size_t index;
};

ShardedAdamW::ShardedAdamW(ParamGroups groups, const AdamWOptions& defaults,
                           std::shared_ptr<Communicator> comm, OptimizerOptions options)
    : torch::optim::Optimizer(std::move(groups), clone_options(defaults)) {
  build(default_names(param_groups_), nullptr, std::move(comm), options);
}

ShardedAdamW::ShardedAdamW(ParamGroups groups, const Units& units, const AdamWOptions& defaults,
                           std::shared_ptr<Communicator> comm, OptimizerOptions options)
    : torch::optim::Optimizer(std::move(groups), clone_options(defaults)) {
  build(default_names(param_groups_), &units, std::move(comm), options);
}

ShardedAdamW::ShardedAdamW(const Units& units, const AdamWOptions& defaults,
                           std::shared_ptr<Communicator> comm, OptimizerOptions options)
    : ShardedAdamW(one_group(concat(units)), units, defaults, std::move(comm), options) {}

ShardedAdamW::NamedUnits ShardedAdamW::units_of(
    const torch::OrderedDict<std::string, std::shared_ptr<torch::nn::Module>>& modules) {
  NamedUnits units;
  for (const auto& m : modules) {
    require(m.value() != nullptr, Status::InvalidArgument,
            "ShardedAdamW::units_of: module '" + m.key() + "' is null");
    torch::OrderedDict<std::string, torch::Tensor> named;
    for (const auto& p : m.value()->named_parameters()) named.insert(m.key() + "." + p.key(), p.value());
    units.push_back(std::move(named));
  }
  return units;
}

ShardedAdamW::ShardedAdamW(const NamedUnits& units, const AdamWOptions& defaults,
                           std::shared_ptr<Communicator> comm, OptimizerOptions options)
    : torch::optim::Optimizer(one_group(concat(values_of(units))),
                              clone_options(defaults)) {
  std::vector<std::string> names;
  for (const auto& u : units) {
    const std::vector<std::string> keys = u.keys();
    names.insert(names.end(), keys.begin(), keys.end());
  }
  const Units plain = values_of(units);
  build(names, &plain, std::move(comm), options);
}

ShardedAdamW::Units ShardedAdamW::units_of(
    const std::vector<std::shared_ptr<torch::nn::Module>>& modules) {
  Units units;
  for (const auto& m : modules) {
    require(m != nullptr, Status::InvalidArgument, "ShardedAdamW::units_of: a null module");
    units.push_back(m->parameters());
  }
  return units;
}

ShardedAdamW::ShardedAdamW(std::vector<torch::Tensor> params, const AdamWOptions& defaults,
                           std::shared_ptr<Communicator> comm, OptimizerOptions options)
    : ShardedAdamW(one_group(std::move(params)), defaults, std::move(comm), options) {}

ShardedAdamW::ShardedAdamW(const torch::OrderedDict<std::string, torch::Tensor>& named_params,
                           const AdamWOptions& defaults, std::shared_ptr<Communicator> comm,
                           OptimizerOptions options)
    : torch::optim::Optimizer(one_group(values_of(named_params)),
                              clone_options(defaults)) {
  build(named_params.keys(), nullptr, std::move(comm), options);
}

void ShardedAdamW::build(const std::vector<std::string>& names, const Units* units,
                         std::shared_ptr<Communicator> comm, OptimizerOptions options) {
  const CallScope call("ShardedAdamW (constructor)");
  require(comm != nullptr, Status::InvalidArgument, "ShardedAdamW: no communicator");
  // Local checks first, agreed on by every rank: a bad tensor on one rank is the same error
  // everywhere, never a hang in the collectives of finalize().
  collective(*comm, "ShardedAdamW", [&] {
    require(options.stage != Stage::Zero3 || units != nullptr, Status::InvalidArgument,
            "ShardedAdamW: stage 3 needs the parameters in units (the Units constructor) and "
            "each unit's forward run through unit_forward()");
    require(!param_groups_.empty(), Status::InvalidArgument, "ShardedAdamW: no parameters");
    std::unordered_set<const void*> seen;
    for (std::size_t g = 0; g < param_groups_.size(); ++g) {
      const AdamWOptions& o = adamw_options(param_groups_[g]);
      require(!o.amsgrad(), Status::Unsupported,
              "ShardedAdamW: group " + std::to_string(g) + ": amsgrad is not supported");
      for (const torch::Tensor& p : param_groups_[g].params()) {
        const std::string name = names.at(params_.size());
        const std::string what = "ShardedAdamW: parameter '" + name + "' ";
        require(p.defined() && p.numel() > 0, Status::InvalidArgument, what + "is empty");
        require(p.device().is_cpu() && p.layout() == torch::kStrided, Status::Unsupported,
                what + "is not a dense CPU tensor (" + p.toString() + ")");
        require(p.is_leaf() && p.requires_grad(), Status::InvalidArgument,
                what + "is not a leaf tensor that requires grad");
        require(p.scalar_type() == torch::kFloat || p.scalar_type() == torch::kBFloat16,
                Status::Unsupported,
                what + "has dtype " + std::string(c10::toString(p.scalar_type())) +
                    " (fp32 and bf16 are supported)");
        if (params_.empty()) dtype_ = p.scalar_type();
        require(p.scalar_type() == dtype_, Status::InvalidArgument,
                what + "has dtype " + std::string(c10::toString(p.scalar_type())) +
                    ", the first parameter " + std::string(c10::toString(dtype_)) +
                    ": all parameters share one replica dtype");
        require(seen.insert(p.unsafeGetTensorImpl()).second, Status::InvalidArgument,
                what + "appears twice");
        params_.push_back(p);
        names_.push_back(name);
        group_of_.push_back(static_cast<int>(g));
      }
    }
    check_groups();
    if (units) order_by_units(*units);
    else unit_first_ = {0, params_.size()};
  });

  options.param_dtype = dtype_ == torch::kFloat ? DType::F32 : DType::BF16;
  // Each group's rule (RuleOptions; plain AdamWOptions: AdamW), fixed from here on.
  std::vector<GroupOptions> rules(param_groups_.size());
  for (std::size_t g = 0; g < param_groups_.size(); ++g) {
    if (const auto* r = dynamic_cast<const RuleOptions*>(&param_groups_[g].options())) {
      rules[g].rule = r->rule();
      rules[g].lion = r->lion();
      rules[g].adamw8bit.min_8bit_numel = r->min_8bit_numel();
      rules[g].muon = r->muon();
      rules[g].adafactor = r->adafactor();
    }
    // Muon and Adafactor update whole tensors: each must live on one rank.
    if (rules[g].rule == Rule::Muon || rules[g].rule == Rule::Adafactor)
      options.ownership = Ownership::Whole;
  }
  core_ = std::make_unique<ShardedOptimizer>(comm, options);
  for (std::size_t g = 0; g < param_groups_.size(); ++g) {
    if (g == 0)
      core_->set_group(0, rules[g]);
    else
      core_->add_group(rules[g]);
  }
  companion_.assign(param_groups_.size(), -1);
  for (std::size_t g = 0; g < param_groups_.size(); ++g)
    if (rules[g].rule == Rule::Muon) companion_[g] = core_->add_group(GroupOptions{});
  apply_group_settings();
  for (std::size_t u = 0; u + 1 < unit_first_.size(); ++u) {
    if (u > 0) core_->begin_unit();
    for (std::size_t i = unit_first_[u]; i < unit_first_[u + 1]; ++i) {
      const torch::Tensor& p = params_[i];
      const int g = group_of_[i];
      const std::size_t gi = static_cast<std::size_t>(g);
      const bool matrix = p.dim() == 2 && p.size(0) > 1 && p.size(1) > 1;
      if (matrix && (companion_[gi] >= 0 || rules[gi].rule == Rule::Adafactor))
        // A Muon matrix, or an Adafactor matrix (factored statistics): shaped as torch's.
        core_->add_param(names_[i], Shape2D{static_cast<std::size_t>(p.size(0)),
                                            static_cast<std::size_t>(p.size(1))}, g);
      else if (companion_[gi] >= 0)  // a bias, norm or vector of a Muon group: AdamW
        core_->add_param(names_[i], static_cast<std::size_t>(p.numel()), companion_[gi]);
      else  // any other, Adafactor's non-matrices (a per-element variance) included
        core_->add_param(names_[i], static_cast<std::size_t>(p.numel()), g);
      unit_of_.push_back(u);
    }
  }
  core_->finalize();  // collective: every rank registered the same parameters

  grad_views_ = dtype_ == torch::kFloat &&
                (options.stage == Stage::DataParallel || options.stage == Stage::Zero1);
  zero3_ = options.stage == Stage::Zero3;
  ordered_ = options.stage == Stage::Zero2 || zero3_;
  hold_.assign(num_units(), Hold::None);
  missing_.assign(num_units(), 0);
  if (grad_views_)  // stages 0/1 keep one full gradient buffer: these addresses never change
    for (std::size_t i = 0; i < params_.size(); ++i) grad_data_.push_back(core_->grad(i).data());
  pending_.resize(params_.size());
  arrived_.assign(params_.size(), 0);

  torch::NoGradGuard no_grad;
  std::vector<float> values;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    torch::Tensor& p = params_[i];
    // Rank 0's values, so that every rank starts from the same weights.
    torch::Tensor initial = p.detach().to(torch::kFloat).contiguous();
    values.assign(initial.data_ptr<float>(), initial.data_ptr<float>() + initial.numel());
    core_->comm().broadcast_bytes(values.data(), values.size() * sizeof(float), 0);
    core_->set_param(i, values);
    // Stage 3: no data until the unit is gathered (gather_unit points the storage at it).
    void* replica = zero3_ ? nullptr
                    : dtype_ == torch::kFloat ? static_cast<void*>(core_->param<float>(i).data())
                                              : static_cast<void*>(core_->param<bf16>(i).data());
    p.set_data(view_of(replica, p, dtype_));
    if (grad_views_) p.mutable_grad() = grad_view(i);
    else p.mutable_grad().reset();
  }
  for (std::size_t i = 0; i < params_.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params_[i]);
    require(acc != nullptr, Status::Internal, "ShardedAdamW: no gradient accumulator");
    hook_keys_.push_back(acc->add_post_hook(std::make_unique<Hook>(this, i)));
    acc->add_pre_hook(std::make_unique<PassHook>(this));
    pre_hook_keys_.push_back(acc->pre_hooks().back().get());
    accumulators_.push_back(std::move(acc));
  }
}

ShardedAdamW::~ShardedAdamW() {
  // The hooks point at this object and the tensors at its buffers: remove the first, and give
  // every tensor its own copy of its values.
  for (std::size_t i = 0; i < accumulators_.size(); ++i) {
    accumulators_[i]->del_post_hook(hook_keys_[i]);
    auto& pre = accumulators_[i]->pre_hooks();
    std::erase_if(pre, [&](const auto& h) { return h.get() == pre_hook_keys_[i]; });
  }
  if (!core_) return;
  try {
    torch::NoGradGuard no_grad;
    for (torch::Tensor& p : params_) {
      if (zero3_) {  // no rank holds the values, and a destructor cannot gather them
        p.set_data(torch::full(p.sizes(), std::nan(""), torch::TensorOptions().dtype(dtype_)));
        continue;
      }
      p.set_data(p.detach().clone());
      if (p.grad().defined()) p.mutable_grad() = p.grad().clone();
    }
  } catch (...) {  // never throw from a destructor; out of memory leaves views behind
  }
}

torch::Tensor ShardedAdamW::grad_view(std::size_t i) {
  return view_of(grad_data_[i], params_[i], torch::kFloat);
}

// ---- group options ------------------------------------------------------------------------------

// shardopt has one AdamConfig and per group an lr scale and a decay switch: the torch groups
// must fit that (same betas and eps; decay 0 or one common value).
void ShardedAdamW::check_groups() const {
  const AdamWOptions& first = adamw_options(param_groups_.front());
  double decay = 0.0;
  for (std::size_t g = 0; g < param_groups_.size(); ++g) {
    const AdamWOptions& o = adamw_options(param_groups_[g]);
    const std::string what = "ShardedAdamW: group " + std::to_string(g) + ": ";
    require(o.betas() == first.betas() && o.eps() == first.eps(), Status::InvalidArgument,
            what + "betas and eps must be the same in every group");
    require(o.lr() >= 0.0 && std::isfinite(o.lr()), Status::InvalidArgument,
            what + "lr must be finite and >= 0");
    if (o.weight_decay() == 0.0) continue;
    require(decay == 0.0 || o.weight_decay() == decay, Status::InvalidArgument,
            what + "weight_decay " + std::to_string(o.weight_decay()) + " differs from " +
                std::to_string(decay) + ": groups may only turn decay off (0) or share a value");
    decay = o.weight_decay();
  }
}

// Puts params_ (and their names and groups) in the units' order and records the units.
void ShardedAdamW::order_by_units(const Units& units) {
  std::unordered_map<const void*, std::size_t> index;
  for (std::size_t i = 0; i < params_.size(); ++i) index[params_[i].unsafeGetTensorImpl()] = i;
  std::vector<std::size_t> order;
  std::vector<std::uint8_t> placed(params_.size(), 0);
  unit_first_ = {0};
  for (std::size_t u = 0; u < units.size(); ++u) {
    const std::string what = "ShardedAdamW: unit " + std::to_string(u) + ": ";
    require(!units[u].empty(), Status::InvalidArgument, what + "has no parameters");
    for (const torch::Tensor& t : units[u]) {
      auto it = t.defined() ? index.find(t.unsafeGetTensorImpl()) : index.end();
      require(it != index.end(), Status::InvalidArgument,
              what + "holds a tensor that is in no parameter group");
      require(!placed[it->second], Status::InvalidArgument,
              what + "parameter '" + names_[it->second] + "' is in two units");
      placed[it->second] = 1;
      order.push_back(it->second);
    }
    unit_first_.push_back(order.size());
  }
  for (std::size_t i = 0; i < params_.size(); ++i)
    require(placed[i], Status::InvalidArgument,
            "ShardedAdamW: parameter '" + names_[i] + "' is in no unit");
  std::vector<torch::Tensor> params;
  std::vector<std::string> names;
  std::vector<int> groups;
  for (std::size_t i : order) {
    params.push_back(params_[i]);
    names.push_back(names_[i]);
    groups.push_back(group_of_[i]);
  }
  params_ = std::move(params);
  names_ = std::move(names);
  group_of_ = std::move(groups);
}

// Reads param_groups() (an LR scheduler may have changed them) into shardopt's settings.
void ShardedAdamW::apply_group_settings() {
  check_groups();
  std::size_t n = 0;
  for (const auto& g : param_groups_) n += g.params().size();
  const auto companions = static_cast<std::size_t>(
      std::count_if(companion_.begin(), companion_.end(), [](int c) { return c >= 0; }));
  require(param_groups_.size() == companion_.size() &&
              param_groups_.size() + companions == core_->groups().size() && n == params_.size(),
          Status::InvalidState,
          "ShardedAdamW: parameters or groups were added after construction");
  // The base lr is the first group's (or the largest, if that one is 0); the others scale it.
  double base = adamw_options(param_groups_.front()).lr();
  if (base == 0.0)
    for (const auto& g : param_groups_) base = std::max(base, adamw_options(g).lr());
  AdamConfig c = core_->options().adam;
  const AdamWOptions& first = adamw_options(param_groups_.front());
  c.lr = base;
  c.beta1 = std::get<0>(first.betas());
  c.beta2 = std::get<1>(first.betas());
  c.eps = first.eps();
  c.weight_decay = 0.0;
  c.mode = AdamMode::AdamW;
  for (const auto& g : param_groups_) c.weight_decay = std::max(c.weight_decay, adamw_options(g).weight_decay());
  core_->set_adam_config(c);
  for (std::size_t g = 0; g < param_groups_.size(); ++g) {
    const AdamWOptions& o = adamw_options(param_groups_[g]);
    // The group and, for a Muon group, its AdamW companion: the rules and their options stay.
    for (const int cg : {static_cast<int>(g), companion_[g]}) {
      if (cg < 0) continue;
      GroupOptions go = core_->groups()[static_cast<std::size_t>(cg)];
      go.lr_scale = base == 0.0 ? 1.0 : o.lr() / base;
      go.weight_decay = o.weight_decay() != 0.0;
      core_->set_group(cg, go);
    }
  }
}

// ---- backward: the gradient hooks ---------------------------------------------------------------

// Opened by the first accumulator pre-hook of a backward pass (or, at stage 3, the hook on a
// unit's output), before any gradient of the pass is accumulated. It zeroes nothing: step()
// (and zero_grad()) leave the buffers zero, and whatever the trainer put into .grad() since
// then is part of the gradient.
void ShardedAdamW::begin_pass() {
  in_pass_ = true;
  consumed_ = false;
  core_->begin_backward(sync_);
  cursor_ = 0;
  std::fill(arrived_.begin(), arrived_.end(), 0);
  for (std::size_t u = 0; u < num_units(); ++u) missing_[u] = unit_first_[u + 1] - unit_first_[u];
  // Runs when the engine has finished this backward pass.
  torch::autograd::Engine::get_default_engine().queue_callback([this] { end_pass(); });
}

void ShardedAdamW::on_grad(std::size_t i) {
  const CallScope call("backward (ShardedAdamW's gradient hooks)");
  require(in_pass_, Status::Internal,
          "ShardedAdamW: a gradient arrived outside a backward pass (no pre-hook ran)");
  if (arrived_[i])
    throw Error(Status::InvalidState, "ShardedAdamW: parameter '" + names_[i] +
                                          "' received two gradients in one backward pass");
  arrived_[i] = 1;
  // Stage 3: the unit's buffer is no longer needed once all its gradients exist (they are
  // tensors of their own, handed over below).
  const std::size_t u = unit_of_[i];
  if (zero3_ && missing_[u] > 0 && --missing_[u] == 0 && hold_[u] == Hold::Acquired)
    release_unit(u);
  torch::Tensor& p = params_[i];
  if (grad_views_) {
    adopt_grad(i);  // autograd accumulated into the view, unless .grad() was replaced
  } else {
    pending_[i] = p.grad();  // hand it over below, then let it go
    p.mutable_grad().reset();
  }
  if (!ordered_) {
    deliver(i);
    return;
  }
  // Stage 2: deliver in backward order (the reverse of registration order).
  const std::size_t n = params_.size();
  while (cursor_ < n && arrived_[n - 1 - cursor_]) deliver(n - 1 - cursor_++);
}

void ShardedAdamW::deliver(std::size_t i) {
  torch::Tensor& g = pending_[i];
  if (g.defined()) {
    const torch::Tensor c = g.contiguous();
    if (c.scalar_type() == torch::kFloat)
      core_->accumulate_grad(i, std::span<const float>(c.data_ptr<float>(), c.numel()));
    else if (c.scalar_type() == torch::kBFloat16)
      core_->accumulate_grad(i, std::span<const bf16>(
                                    reinterpret_cast<const bf16*>(c.data_ptr<at::BFloat16>()),
                                    c.numel()));
    else
      throw Error(Status::InvalidArgument, "ShardedAdamW: gradient of '" + names_[i] +
                                               "' has dtype " +
                                               std::string(c10::toString(c.scalar_type())));
    g.reset();
  }
  core_->grad_ready(i);
}

void ShardedAdamW::end_pass() {
  const CallScope call("backward (ShardedAdamW's gradient hooks)");
  // Parameters that took no part in this pass contribute zero; mark them ready (in order).
  const std::size_t n = params_.size();
  for (std::size_t k = ordered_ ? cursor_ : 0; k < n; ++k) {
    const std::size_t i = ordered_ ? n - 1 - k : k;
    if (!ordered_ && arrived_[i]) continue;
    if (!arrived_[i] && grad_views_) adopt_grad(i);
    deliver(i);
  }
  cursor_ = n;
  in_pass_ = false;
  if (zero3_) release_units();  // units whose parameters did not all take part
}

// ---- stage 3: units ---------------------------------------------------------------------------

void ShardedAdamW::gather_unit(std::size_t u) {
  core_->acquire(u);  // waits for the prefetch, or gathers now
  if (hold_[u] != Hold::Prefetched) ++held_;
  hold_[u] = Hold::Acquired;
  for (std::size_t i = unit_first_[u]; i < unit_first_[u + 1]; ++i) {
    void* data = dtype_ == torch::kFloat ? static_cast<void*>(core_->param<float>(i).data())
                                         : static_cast<void*>(core_->param<bf16>(i).data());
    // The storage itself is redirected, so tensors made from the parameter in forward
    // (weight.t() saved for backward) see the buffer of this gathering too.
    params_[i].storage().set_data_ptr_noswap(at::DataPtr(data, params_[i].device()));
  }
}

void ShardedAdamW::prefetch_unit(std::size_t u) {
  if (hold_[u] != Hold::None ||
      held_ >= static_cast<std::size_t>(core_->options().units_in_flight))
    return;
  core_->prefetch(u);
  hold_[u] = Hold::Prefetched;
  ++held_;
}

void ShardedAdamW::release_unit(std::size_t u) {
  core_->release(u);
  for (std::size_t i = unit_first_[u]; i < unit_first_[u + 1]; ++i)
    params_[i].storage().set_data_ptr_noswap(at::DataPtr(nullptr, params_[i].device()));
  hold_[u] = Hold::None;
  --held_;
}

void ShardedAdamW::release_units() {
  for (std::size_t u = 0; u < num_units(); ++u) {
    if (hold_[u] == Hold::Prefetched) gather_unit(u);  // shardopt releases acquired units only
    if (hold_[u] == Hold::Acquired) release_unit(u);
  }
}

torch::Tensor ShardedAdamW::unit_forward(std::size_t u, const std::function<torch::Tensor()>& f) {
  if (!zero3_) return f();
  const CallScope call("ShardedAdamW::unit_forward(unit " + std::to_string(u) + ")");
  require(!in_pass_, Status::InvalidState, "ShardedAdamW::unit_forward: called during backward");
  gather_unit(u);  // shardopt's acquire checks u, agreed on by every rank, before any change
  if (u + 1 < num_units()) prefetch_unit(u + 1);
  torch::Tensor y;
  try {
    y = f();
  } catch (...) {
    release_unit(u);
    throw;
  }
  release_unit(u);
  if (y.defined() && y.requires_grad())
    y.register_hook([this, u](const torch::Tensor&) { backward_gather(u); });
  return y;
}

// The hook on unit u's output: its gradient has arrived, so backward is about to run unit u.
void ShardedAdamW::backward_gather(std::size_t u) {
  const CallScope call("backward through ShardedAdamW::unit_forward(unit " + std::to_string(u) + ")");
  if (!in_pass_) begin_pass();
  // Backward runs the units in reverse: a later unit still held (some of its parameters had
  // no gradient) is done.
  for (std::size_t k = u + 1; k < num_units(); ++k)
    if (hold_[k] == Hold::Acquired) release_unit(k);
  if (hold_[u] != Hold::Acquired) gather_unit(u);
  if (u > 0) prefetch_unit(u - 1);
}

// .grad() of a fp32 model at stages 0/1 should be the view into the flat buffer. If the
// trainer replaced it (module->zero_grad(true) sets it to undefined; an assignment replaces
// it), the buffer takes its values (zero if undefined) and .grad() becomes the view again.
void ShardedAdamW::adopt_grad(std::size_t i) {
  torch::Tensor& p = params_[i];
  const torch::Tensor& g = p.grad();
  if (g.defined() && g.data_ptr() == static_cast<void*>(grad_data_[i])) return;
  torch::NoGradGuard no_grad;
  torch::Tensor view = grad_view(i);
  if (g.defined()) view.copy_(g);
  else view.zero_();
  p.mutable_grad() = view;
}

// ---- the step -----------------------------------------------------------------------------------

torch::Tensor ShardedAdamW::step(LossClosure closure) {
  const CallScope call("ShardedAdamW::step");
  torch::Tensor loss;
  if (closure) {
    torch::AutoGradMode grad_mode(true);
    loss = closure();
  }
  // The local part (group settings, replaced .grad() tensors) is agreed on by every rank.
  collective(core_->comm(), "ShardedAdamW::step", [&] {
    require(!in_pass_, Status::InvalidState, "ShardedAdamW::step: called during backward");
    apply_group_settings();
    // torch::optim::AdamW would apply the same .grad() again; here the previous step
    // consumed the gradients (the reduction works in place), so a step now would be a step
    // with a zero gradient that nobody asked for.
    require(!consumed_, Status::InvalidState,
            "ShardedAdamW::step: no backward pass since the previous step. shardopt's step "
            "consumes the gradients (they are reduced in place), so it cannot apply the same "
            "gradient again as torch::optim::AdamW would; run backward before each step "
            "(zero_grad() then step() steps with a zero gradient, if that is what you want)");
    if (grad_views_)
      for (std::size_t i = 0; i < params_.size(); ++i) {
        const torch::Tensor& g = params_[i].grad();
        if (g.defined() && g.data_ptr() == static_cast<void*>(grad_data_[i])) continue;
        if (arrived_[i])  // its bucket's reduction may already be running
          throw Error(Status::InvalidState,
                      "ShardedAdamW::step: the .grad() of '" + names_[i] +
                          "' was replaced after backward; shardopt reduces its own buffer "
                          "(modify .grad() in place, or clip with adam.max_grad_norm)");
        adopt_grad(i);
      }
  });
  if (zero3_) release_units();  // a prefetched unit that was never used
  last_ = core_->step();
  core_->replica_data();  // every bucket gathered: the tensors hold the new values
  consumed_ = true;  // shardopt's step left its gradient buffers zero
  std::fill(arrived_.begin(), arrived_.end(), 0);
  return loss;
}

void ShardedAdamW::zero_grad() {
  require(!in_pass_, Status::InvalidState, "ShardedAdamW::zero_grad: called during backward");
  core_->zero_grad();
  consumed_ = false;
  if (grad_views_)
    for (std::size_t i = 0; i < params_.size(); ++i) adopt_grad(i);
}

// ---- checkpoints --------------------------------------------------------------------------------

std::filesystem::path ShardedAdamW::save(const std::filesystem::path& dir, const SaveOptions& o) {
  const CallScope call("ShardedAdamW::save");
  apply_group_settings();  // the hyperparameters saved are the groups' current ones
  return save_checkpoint(*core_, dir, o);
}

void ShardedAdamW::load(const std::filesystem::path& path) {
  const CallScope call("ShardedAdamW::load");
  load_checkpoint(*core_, path);
  core_->replica_data();
  // The restored hyperparameters become the groups' options.
  const AdamConfig& c = core_->options().adam;
  for (std::size_t g = 0; g < param_groups_.size(); ++g) {
    auto& o = static_cast<AdamWOptions&>(param_groups_[g].options());
    const GroupOptions& go = core_->groups()[g];
    o.lr(c.lr * go.lr_scale);
    o.betas({c.beta1, c.beta2});
    o.eps(c.eps);
    o.weight_decay(go.weight_decay ? c.weight_decay : 0.0);
  }
}

void ShardedAdamW::save(torch::serialize::OutputArchive&) const {
  throw Error(Status::Unsupported,
              "ShardedAdamW: a torch archive cannot hold a sharded state; use save(dir)");
}

void ShardedAdamW::load(torch::serialize::InputArchive&) {
  throw Error(Status::Unsupported,
              "ShardedAdamW: a torch archive cannot hold a sharded state; use load(dir)");
}

}  // namespace shardopt::libtorch
