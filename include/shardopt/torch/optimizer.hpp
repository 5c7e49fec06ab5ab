// shardopt/torch/optimizer.hpp: the LibTorch adapter. A LibTorch trainer swaps
// torch::optim::AdamW for ShardedAdamW and keeps its loop:
//
//   auto comm = shardopt::make_mpi_communicator(MPI_COMM_WORLD);   // or a c10d gloo one
//   shardopt::libtorch::ShardedAdamW opt(model->parameters(),
//                                        torch::optim::AdamWOptions(3e-4).weight_decay(0.1),
//                                        comm, {.stage = shardopt::Stage::Zero2});
//   for (...) { opt.zero_grad(); loss = loss_fn(model->forward(x_local), y_local);
//               loss.backward(); opt.step(); }
//
// What it does to the model (zero copy):
// - Every parameter's storage becomes a view into shardopt's flat replica (fp32, or bf16 for a
//   bf16 model): the forward pass reads what the step's all-gather wrote. Rank 0's initial
//   values are broadcast to every rank at construction (as DDP does).
// - fp32 model at stages 0 and 1: each parameter's .grad() is a view into shardopt's flat fp32
//   gradient buffer, so autograd accumulates in place; nothing is copied.
// - Stage 2, and any bf16 model: a hook on each parameter's gradient accumulator hands the
//   gradient to shardopt as backward produces it (accumulated in fp32) and drops the tensor;
//   .grad() stays undefined. Gradients are handed over in backward order (the reverse of
//   registration order); one that arrives early is held until its turn.
// - Every stage: the hook marks the parameter ready, so each bucket's reduction starts while
//   backward is still running (no trainer code). A backward() call is one micro-batch; inside
//   a no_sync() scope micro-batches accumulate without communication (DDP's convention), and
//   the step averages over the micro-batches since the previous step.
//
// Contract (checked where it can be, otherwise documented):
// - Update rules: a group's options (or the defaults) may be a RuleOptions, an AdamWOptions
//   that also names the group's shardopt::Rule (AdamW, Lion, AdamW8bit, Muon, Adafactor) and
//   the rule's
//   options; plain AdamWOptions mean AdamW. The rule is fixed at construction.
// - Muon (issue 32): in a group flagged RuleOptions().rule(Rule::Muon), every 2-D parameter
//   with both extents > 1 gets Muon, its shape (size(0), size(1)) taken from the tensor
//   (row-major, as torch stores an (out_features, in_features) weight); the group's other
//   parameters (biases, norms) get AdamW with the group's lr and decay. Put embeddings and the
//   head in an unflagged group (AdamW), as is usual for Muon. With any group flagged the
//   optimizer uses Ownership::Whole (each matrix updated whole by one rank), which runs
//   stages 0-3 on the CPU; its checkpoints are the library's (format 6, Muon's momentum
//   included).
// - Adafactor (issue 32): in a group flagged RuleOptions().rule(Rule::Adafactor), every
//   parameter gets Adafactor (RuleOptions::adafactor's options; lr and weight decay the
//   group's, so set torch's Adafactor defaults, lr 1e-2 and weight_decay 0, yourself): a 2-D
//   tensor with both extents > 1 keeps factored row and column statistics, its shape taken
//   from the tensor as for Muon; any other (biases, norms, and tensors of 3 or more
//   dimensions, which torch would factor over their last two) a per-element variance. A
//   flagged group turns Ownership::Whole on as Muon's does (CPU, stages 0-3; checkpoints of
//   format 7 hold the statistics).
// - Parameters: CPU, dense, leaf tensors that require grad, all fp32 or all bf16, each in one
//   group. Group options are torch::optim::AdamWOptions; betas and eps must be the same in
//   every group, weight_decay either 0 or one common value (shardopt's groups have an lr
//   scale and a decay on/off switch); amsgrad is not supported. Group lr changes (LR
//   schedulers, param_groups()) take effect at the next step.
// - step() consumes the gradients and leaves shardopt's buffers zero (the reduce-scatter
//   works in place), so the next step's gradient is the sum of the backward passes since the
//   previous step (a second step() with no backward in between is an error on every rank,
//   where torch::optim::AdamW would apply the same gradient again) whichever way the trainer
//   zeroes: optimizer.zero_grad() (or torch::optim::Optimizer::zero_grad() through a base
//   class reference), module->zero_grad()
//   (either set_to_none), p.grad().zero_(), a new tensor assigned to p.mutable_grad(), or not
//   at all (plain LibTorch would then add the old gradient; here it is gone). Whatever the
//   trainer writes into .grad() before backward is part of the gradient. A backward pass
//   opens on the pre-hook of the first gradient accumulator autograd runs, before that
//   gradient lands. Tested: AdapterZeroing.* (every idiom, stages 0-3, fp32/bf16; every
//   rule, Muon and Adafactor at stages 0-3). Clip with
//   OptimizerOptions::adam.max_grad_norm (global norm over all ranks), not with
//   torch::nn::utils::clip_grad_norm_ on local gradients.
// - Stage 3 (parameters sharded too): construct from Units (each typically one layer's
//   parameters, in forward order) and run each unit's forward through unit_forward(u, f). A
//   LibTorch C++ module has no forward pre-hooks, so this one call per unit is the trainer
//   code stage 3 needs. unit_forward gathers the unit (its parameters' storage then points
//   into the gathered buffer), prefetches the next one, runs f and releases the unit; a hook
//   on f's output gathers the unit again when backward reaches it (prefetching the unit
//   before it) and releases it once all its parameters have their gradients. Outside
//   unit_forward (and its backward) a stage-3 parameter has no data: its storage is null.
//   At other stages unit_forward(u, f) is f(): one trainer runs at every stage. The hook
//   refers to the optimizer: run backward on such a graph only while the optimizer lives.
// - Collective (every rank, same order): the constructor, step(), save(), load(), and at
//   stage 3 unit_forward() and the backward passes through it.
// - Destroying the optimizer gives every parameter (and .grad()) its own storage back, with
//   the current values, so the model outlives it. At stage 3 no rank holds the whole model
//   and a destructor cannot communicate: the parameters get storage filled with NaN (save a
//   checkpoint first; shardopt-export writes the consolidated weights).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "shardopt/checkpoint.hpp"
#include "shardopt/comm.hpp"
#include "shardopt/optimizer.hpp"

namespace shardopt::libtorch {

/// A param group's options with its update rule:
///   RuleOptions(torch::optim::AdamWOptions(3e-4).weight_decay(0.1)).rule(Rule::AdamW8bit)
/// lr, weight_decay (on or off per group, as for AdamW), betas and eps are AdamWOptions';
/// Lion takes its betas from lion_betas(), AdamW8bit its threshold from min_8bit_numel().
class RuleOptions : public torch::optim::AdamWOptions {
 public:
  explicit RuleOptions(double lr = 1e-3) : torch::optim::AdamWOptions(lr) {}
  RuleOptions(const torch::optim::AdamWOptions& o) : torch::optim::AdamWOptions(o) {}  // NOLINT
  RuleOptions& rule(Rule r) {
    rule_ = r;
    return *this;
  }
  Rule rule() const { return rule_; }
  RuleOptions& lion_betas(double beta1, double beta2) {
    lion_ = LionConfig{beta1, beta2};
    return *this;
  }
  const LionConfig& lion() const { return lion_; }
  /// AdamW8bit: parameters with fewer elements keep fp32 state (GroupOptions::adamw8bit).
  RuleOptions& min_8bit_numel(std::size_t n) {
    adamw8bit_.min_8bit_numel = n;
    return *this;
  }
  std::size_t min_8bit_numel() const { return adamw8bit_.min_8bit_numel; }
  /// Muon's own options (momentum, nesterov, Newton-Schulz steps and coefficients, eps, lr
  /// adjustment), used by rule(Rule::Muon); lr and weight decay are the group's, as for AdamW.
  RuleOptions& muon(const MuonConfig& m) {
    muon_ = m;
    return *this;
  }
  const MuonConfig& muon() const { return muon_; }
  /// Adafactor's own options (beta2_decay, eps1, eps2, d, maximize), used by
  /// rule(Rule::Adafactor); lr and weight decay are the group's.
  RuleOptions& adafactor(const AdafactorConfig& a) {
    adafactor_ = a;
    return *this;
  }
  const AdafactorConfig& adafactor() const { return adafactor_; }
  std::unique_ptr<torch::optim::OptimizerOptions> clone() const override {
    return std::make_unique<RuleOptions>(*this);
  }

 private:
  Rule rule_ = Rule::AdamW;
  LionConfig lion_;
  AdamW8bitConfig adamw8bit_;
  MuonConfig muon_;
  AdafactorConfig adafactor_;
};

class ShardedAdamW : public torch::optim::Optimizer {
 public:
  using ParamGroups = std::vector<torch::optim::OptimizerParamGroup>;

  /// Collective. `defaults` fills every group that has no options of its own; `options`
  /// chooses the stage, buckets, overlap, clipping (adam.max_grad_norm), loss scaling... Its
  /// adam.lr/beta1/beta2/eps/weight_decay and param_dtype are taken from the groups and the
  /// tensors. Parameter names are "<group>.<index>" (g0.0, g0.1, ...). Every rank must pass
  /// the same groups; throws shardopt::Error on every rank otherwise (see finalize()).
  ShardedAdamW(ParamGroups groups, const torch::optim::AdamWOptions& defaults,
               std::shared_ptr<Communicator> comm, OptimizerOptions options = {});
  ShardedAdamW(std::vector<torch::Tensor> params, const torch::optim::AdamWOptions& defaults,
               std::shared_ptr<Communicator> comm, OptimizerOptions options = {});
  /// The same from module->named_parameters(): checkpoints and error messages use the names.
  ShardedAdamW(const torch::OrderedDict<std::string, torch::Tensor>& named_params,
               const torch::optim::AdamWOptions& defaults, std::shared_ptr<Communicator> comm,
               OptimizerOptions options = {});
  /// Units: lists of parameters (typically module->parameters() of one layer), in forward
  /// order; every parameter in exactly one unit. Registration follows the units (buckets
  /// never straddle a unit). Required at stage 3, accepted at every stage.
  using Units = std::vector<std::vector<torch::Tensor>>;
  /// Each module's parameters() as one unit.
  static Units units_of(const std::vector<std::shared_ptr<torch::nn::Module>>& modules);
  /// Units with parameter names (checkpoints and errors use them).
  using NamedUnits = std::vector<torch::OrderedDict<std::string, torch::Tensor>>;
  /// Each named module's named_parameters() as one unit, named "<module>.<parameter>": from
  /// model->named_children() these are the names model->named_parameters() gives, so a
  /// checkpoint saved by an optimizer built from named_parameters() loads at stage 3.
  static NamedUnits units_of(
      const torch::OrderedDict<std::string, std::shared_ptr<torch::nn::Module>>& modules);
  /// Collective. As above, with the parameters registered unit by unit; `groups` give the
  /// options and must hold the same parameters as `units`.
  ShardedAdamW(ParamGroups groups, const Units& units, const torch::optim::AdamWOptions& defaults,
               std::shared_ptr<Communicator> comm, OptimizerOptions options = {});
  ShardedAdamW(const Units& units, const torch::optim::AdamWOptions& defaults,
               std::shared_ptr<Communicator> comm, OptimizerOptions options = {});
  ShardedAdamW(const NamedUnits& units, const torch::optim::AdamWOptions& defaults,
               std::shared_ptr<Communicator> comm, OptimizerOptions options = {});
  ~ShardedAdamW() override;
  ShardedAdamW(const ShardedAdamW&) = delete;
  ShardedAdamW& operator=(const ShardedAdamW&) = delete;

  /// Collective. Runs `closure` (with grad mode on) if given, then reduces the gradients,
  /// clips, updates every rank's shard and all-gathers the parameters; returns the closure's
  /// loss (undefined without one). When it returns, the parameter tensors hold the new values.
  torch::Tensor step(LossClosure closure = nullptr) override;
  /// Zeroes every gradient (shardopt's buffers and the .grad() views). Local.
  void zero_grad();

  /// Runs f, the forward of unit u (which reads only unit u's parameters), and returns its
  /// output. Stage 3: collective; gathers unit u around f and arranges its gathering in
  /// backward (see the header comment). Other stages: f().
  torch::Tensor unit_forward(std::size_t u, const std::function<torch::Tensor()>& f);
  std::size_t num_units() const { return unit_first_.size() - 1; }

  /// RAII scope: backward passes inside it accumulate locally with no communication (all but
  /// the last micro-batch of a step). Local; must be used the same way on every rank.
  class NoSync {
   public:
    explicit NoSync(ShardedAdamW& o) : o_(o), previous_(o.sync_) { o_.sync_ = false; }
    ~NoSync() { o_.sync_ = previous_; }
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    ShardedAdamW& o_;
    bool previous_;
  };
  [[nodiscard]] NoSync no_sync() { return NoSync(*this); }

  /// The last step's result: global gradient norm (before clipping), clip coefficient,
  /// whether it was skipped for a non-finite gradient, timings.
  const StepResult& last_result() const { return last_; }
  /// Optimizer memory on this rank, per category (shardopt's accounting).
  MemoryReport memory_report() const { return core_->memory_report(); }
  /// The shardopt optimizer underneath (layout, options, get_master, ...).
  ShardedOptimizer& core() { return *core_; }
  const std::vector<std::string>& names() const { return names_; }

  /// Collective: shardopt's checkpoint (crash-safe, loadable at another rank count or
  /// stage). Returns the published checkpoint directory.
  std::filesystem::path save(const std::filesystem::path& dir, const SaveOptions& o = {});
  /// Collective: restores master weights, moments, step count and hyperparameters (written
  /// back into param_groups()), and the parameter tensors.
  void load(const std::filesystem::path& path);
  /// torch::serialize archives cannot hold a sharded state: Error(Unsupported); use
  /// save(dir)/load(dir).
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 private:
  struct Hook;
  struct PassHook;
  void build(const std::vector<std::string>& names, const Units* units,
             std::shared_ptr<Communicator> comm, OptimizerOptions options);
  void order_by_units(const Units& units);
  enum class Hold : unsigned char { None, Prefetched, Acquired };
  void gather_unit(std::size_t u);     // stage 3: acquire u, point its tensors at it
  void prefetch_unit(std::size_t u);   // stage 3: start gathering u if a buffer is free
  void release_unit(std::size_t u);    // stage 3: release u, its tensors point at nothing
  void release_units();                // stage 3: no unit held (collective)
  void backward_gather(std::size_t u); // stage 3: the hook on unit u's output
  void check_groups() const;
  void apply_group_settings();
  void on_grad(std::size_t i);       // gradient accumulator post-hook of parameter i
  void begin_pass();                 // first hook of a backward pass
  void end_pass();                   // the engine's callback at the end of backward
  void deliver(std::size_t i);       // hand parameter i's gradient to shardopt, mark ready
  void adopt_grad(std::size_t i);    // make .grad() the view again, keeping its values
  torch::Tensor grad_view(std::size_t i);
  bool views_grads() const { return grad_views_; }

  std::unique_ptr<ShardedOptimizer> core_;
  std::vector<torch::Tensor> params_;  // registration order
  std::vector<std::string> names_;
  std::vector<int> group_of_;
  // Per torch group: the core group of its non-matrix parameters when the group is flagged
  // Muon (an AdamW group with the same lr and decay), else -1. Core groups 0..G-1 are the
  // torch groups; these companions come after them.
  std::vector<int> companion_;
  torch::ScalarType dtype_ = torch::kFloat;
  bool grad_views_ = false;  // fp32 model at stage 0/1: .grad() views the flat buffer
  bool ordered_ = false;     // stages 2/3: gradients must reach shardopt in backward order
  bool zero3_ = false;
  std::vector<std::size_t> unit_first_{0};  // first parameter of each unit, then the count
  std::vector<std::size_t> unit_of_;        // each parameter's unit
  std::vector<Hold> hold_;                  // stage 3: each unit's state in shardopt
  std::vector<std::size_t> missing_;        // stage 3: its parameters without a gradient yet
  std::size_t held_ = 0;                    // stage 3: units prefetched or acquired
  bool sync_ = true;
  bool in_pass_ = false;
  bool consumed_ = false;  // a step ran and no backward or zero_grad since
  std::vector<float*> grad_data_;       // grad_views_: each parameter's gradient in the buffer
  std::vector<torch::Tensor> pending_;  // gradients that arrived before their turn
  std::vector<std::uint8_t> arrived_;
  std::size_t cursor_ = 0;  // backward-order position of the next gradient to deliver
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<std::uintptr_t> hook_keys_;
  std::vector<const torch::autograd::FunctionPreHook*> pre_hook_keys_;
  StepResult last_;
};

}  // namespace shardopt::libtorch
