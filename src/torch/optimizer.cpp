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
#include <unordered_set>
#include <utility>

#include "shardopt/error.hpp"

namespace shardopt::libtorch {
namespace {

using torch::optim::AdamWOptions;

const AdamWOptions& adamw_options(const torch::optim::OptimizerParamGroup& g) {
  return static_cast<const AdamWOptions&>(g.options());
}

std::vector<std::string> default_names(const ShardedAdamW::ParamGroups& groups) {
  std::vector<std::string> names;
  for (std::size_t g = 0; g < groups.size(); ++g)
    for (std::size_t j = 0; j < groups[g].params().size(); ++j)
      // Appended piecewise: "g" + std::to_string(g) trips GCC 12's false -Wrestrict.
      names.push_back(std::string("g").append(std::to_string(g)).append(".").append(std::to_string(j)));
  return names;
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

// The tensor over `numel` elements at `data`, shaped like `like` (no copy, no ownership).
torch::Tensor view_of(void* data, const torch::Tensor& like, torch::ScalarType dtype) {
  return torch::from_blob(data, like.sizes(), torch::TensorOptions().dtype(dtype));
}

}  // namespace

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
    : torch::optim::Optimizer(std::move(groups), std::make_unique<AdamWOptions>(defaults)) {
  build(default_names(param_groups_), std::move(comm), options);
}

ShardedAdamW::ShardedAdamW(std::vector<torch::Tensor> params, const AdamWOptions& defaults,
                           std::shared_ptr<Communicator> comm, OptimizerOptions options)
    : ShardedAdamW(one_group(std::move(params)), defaults, std::move(comm), options) {}

ShardedAdamW::ShardedAdamW(const torch::OrderedDict<std::string, torch::Tensor>& named_params,
                           const AdamWOptions& defaults, std::shared_ptr<Communicator> comm,
                           OptimizerOptions options)
    : torch::optim::Optimizer(one_group(values_of(named_params)),
                              std::make_unique<AdamWOptions>(defaults)) {
  build(named_params.keys(), std::move(comm), options);
}

void ShardedAdamW::build(const std::vector<std::string>& names,
                         std::shared_ptr<Communicator> comm, OptimizerOptions options) {
  require(comm != nullptr, Status::InvalidArgument, "ShardedAdamW: no communicator");
  // Local checks first, agreed on by every rank: a bad tensor on one rank is the same error
  // everywhere, never a hang in the collectives of finalize().
  collective(*comm, "ShardedAdamW", [&] {
    require(options.stage != Stage::Zero3, Status::Unsupported,
            "ShardedAdamW: stage 3 is not supported by the LibTorch adapter (a C++ module has "
            "no forward hooks to gather each layer's parameters before it runs); use stage 2 "
            "or the shardopt API's acquire()/release()");
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
  });

  options.param_dtype = dtype_ == torch::kFloat ? DType::F32 : DType::BF16;
  core_ = std::make_unique<ShardedOptimizer>(comm, options);
  for (std::size_t g = 1; g < param_groups_.size(); ++g) core_->add_group({});
  apply_group_settings();
  for (std::size_t i = 0; i < params_.size(); ++i)
    core_->add_param(names_[i], static_cast<std::size_t>(params_[i].numel()), group_of_[i]);
  core_->finalize();  // collective: every rank registered the same parameters

  grad_views_ = dtype_ == torch::kFloat &&
                (options.stage == Stage::DataParallel || options.stage == Stage::Zero1);
  ordered_ = options.stage == Stage::Zero2;
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
    void* replica = dtype_ == torch::kFloat
                        ? static_cast<void*>(core_->param<float>(i).data())
                        : static_cast<void*>(core_->param<bf16>(i).data());
    p.set_data(view_of(replica, p, dtype_));
    if (grad_views_) p.mutable_grad() = grad_view(i);
    else p.mutable_grad().reset();
  }
  for (std::size_t i = 0; i < params_.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params_[i]);
    require(acc != nullptr, Status::Internal, "ShardedAdamW: no gradient accumulator");
    hook_keys_.push_back(acc->add_post_hook(std::make_unique<Hook>(this, i)));
    accumulators_.push_back(std::move(acc));
  }
}

ShardedAdamW::~ShardedAdamW() {
  // The hooks point at this object and the tensors at its buffers: remove the first, and give
  // every tensor its own copy of its values.
  for (std::size_t i = 0; i < accumulators_.size(); ++i)
    accumulators_[i]->del_post_hook(hook_keys_[i]);
  if (!core_) return;
  try {
    torch::NoGradGuard no_grad;
    for (torch::Tensor& p : params_) {
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

// Reads param_groups() (an LR scheduler may have changed them) into shardopt's settings.
void ShardedAdamW::apply_group_settings() {
  check_groups();
  std::size_t n = 0;
  for (const auto& g : param_groups_) n += g.params().size();
  require(param_groups_.size() == core_->groups().size() && n == params_.size(),
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
    core_->set_group(static_cast<int>(g),
                     GroupOptions{.lr_scale = base == 0.0 ? 1.0 : o.lr() / base,
                                  .weight_decay = o.weight_decay() != 0.0});
  }
}

// ---- backward: the gradient hooks ---------------------------------------------------------------

void ShardedAdamW::begin_pass() {
  in_pass_ = true;
  if (!fresh_) {  // the previous step consumed the gradients (see the header)
    core_->zero_grad();
    fresh_ = true;
  }
  core_->begin_backward(sync_);
  cursor_ = 0;
  std::fill(arrived_.begin(), arrived_.end(), 0);
  // Runs when the engine has finished this backward pass.
  torch::autograd::Engine::get_default_engine().queue_callback([this] { end_pass(); });
}

void ShardedAdamW::on_grad(std::size_t i) {
  if (!in_pass_) begin_pass();
  if (arrived_[i])
    throw Error(Status::InvalidState, "ShardedAdamW: parameter '" + names_[i] +
                                          "' received two gradients in one backward pass");
  arrived_[i] = 1;
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
  torch::Tensor loss;
  if (closure) {
    torch::AutoGradMode grad_mode(true);
    loss = closure();
  }
  // The local part (group settings, replaced .grad() tensors) is agreed on by every rank.
  collective(core_->comm(), "ShardedAdamW::step", [&] {
    require(!in_pass_, Status::InvalidState, "ShardedAdamW::step: called during backward");
    apply_group_settings();
    if (!fresh_) {  // a second step with no backward in between: the gradients are consumed
      zero_grad();
      return;
    }
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
  last_ = core_->step();
  core_->replica_data();  // every bucket gathered: the tensors hold the new values
  fresh_ = false;
  std::fill(arrived_.begin(), arrived_.end(), 0);
  return loss;
}

void ShardedAdamW::zero_grad() {
  require(!in_pass_, Status::InvalidState, "ShardedAdamW::zero_grad: called during backward");
  core_->zero_grad();
  fresh_ = true;
  if (grad_views_)
    for (std::size_t i = 0; i < params_.size(); ++i) adopt_grad(i);
}

// ---- checkpoints --------------------------------------------------------------------------------

std::filesystem::path ShardedAdamW::save(const std::filesystem::path& dir, const SaveOptions& o) {
  apply_group_settings();  // the hyperparameters saved are the groups' current ones
  return save_checkpoint(*core_, dir, o);
}

void ShardedAdamW::load(const std::filesystem::path& path) {
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
