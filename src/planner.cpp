// planner.cpp: per-rank bytes of a configuration, mirroring ShardedOptimizer::finalize().
#include "shardopt/planner.hpp"

#include <algorithm>
#include <string>

#include "buffer_plan.hpp"
#include "exact_sum.hpp"
#include "rules/rules.hpp"
#include "shardopt/error.hpp"

namespace shardopt {

PlanConfig plan_config(const OptimizerOptions& options, int world_size) {
  PlanConfig c;
  c.stage = options.stage;
  c.world_size = world_size;
  c.param_dtype = options.param_dtype;
  c.bucket_elems = options.bucket_elems;
  c.device = options.device;
  c.buckets_in_flight = options.buckets_in_flight;
  c.units_in_flight = options.units_in_flight;
  c.reduction = options.reduction;
  c.reduce_dtype = options.reduce_dtype;
  c.ownership = options.ownership;
  return c;
}

std::size_t MemoryPlan::total() const {
  std::size_t t = 0;
  for (std::size_t b : bytes) t += b;
  return t;
}

namespace {

void check(const PlanConfig& c) {
  require(c.stage == Stage::DataParallel || c.stage == Stage::Zero1 || c.stage == Stage::Zero2 ||
              c.stage == Stage::Zero3,
          Status::InvalidArgument,
          "plan_memory: invalid stage " + std::to_string(static_cast<int>(c.stage)));
  require(c.world_size > 0, Status::InvalidArgument,
          "plan_memory: world size must be positive, got " + std::to_string(c.world_size));
  require(c.param_dtype == DType::F32 || c.param_dtype == DType::BF16, Status::InvalidArgument,
          "plan_memory: invalid parameter dtype");
  require(c.grad_dtype == DType::F32, Status::Unsupported,
          std::string("plan_memory: gradient dtype ") + dtype_name(c.grad_dtype) +
              " is not supported: shardopt keeps gradients in fp32 (a bf16 gradient from "
              "backward is accumulated into them with accumulate_grad)");
  require(c.buckets_in_flight >= 1, Status::InvalidArgument,
          "plan_memory: buckets_in_flight must be at least 1");
  require(c.units_in_flight >= 1, Status::InvalidArgument,
          "plan_memory: units_in_flight must be at least 1");
  require(c.nodes >= 1 && c.world_size % c.nodes == 0, Status::InvalidArgument,
          "plan_memory: nodes must be at least 1 and divide the world size (" +
              std::to_string(c.world_size) + " ranks on " + std::to_string(c.nodes) + " nodes)");
  require(c.reduction == Reduction::Default || c.reduction == Reduction::Reproducible,
          Status::InvalidArgument, "plan_memory: invalid reduction");
  require(c.rank >= 0 && c.rank < c.world_size, Status::InvalidArgument,
          "plan_memory: rank " + std::to_string(c.rank) + " outside the " +
              std::to_string(c.world_size) + " ranks");
  for (const GroupOptions& g : c.groups)
    if (const std::string p = validate(g); !p.empty())
      throw Error(Status::InvalidArgument, "plan_memory: " + p);
  require(c.reduce_dtype == DType::F32 ||
              (c.reduce_dtype == DType::BF16 && c.reduction == Reduction::Default),
          Status::InvalidArgument,
          "plan_memory: reduce_dtype must be F32, or BF16 with the default reduction");
  require(c.ownership == Ownership::Flat || c.ownership == Ownership::Whole,
          Status::InvalidArgument, "plan_memory: invalid ownership");
}

// State bytes per element of parameter `p` on its owner under `config` (plan_ownership).
double state_bytes_per_elem(const ParamInfo& p, bool matrix, const PlanConfig& config) {
  const double master = config.param_dtype == DType::F32 ? 0.0 : 4.0;
  if (matrix) return kMuonStateBytesPerElem + master;
  const std::size_t g = static_cast<std::size_t>(p.group);
  const GroupOptions group = g < config.groups.size() ? config.groups[g] : GroupOptions{};
  switch (group.rule) {
    case Rule::Lion:
    case Rule::Muon:
    case Rule::Adafactor: return 4.0 + master;  // (Adafactor's matrices: see owner_costs)
    case Rule::AdamW8bit:
      return (p.numel >= group.adamw8bit.min_8bit_numel ? 2.0 + 8.0 / 256 : 8.0) + master;
    case Rule::AdamW: break;
  }
  return 8.0 + master;
}

}  // namespace

FlatLayout unit_per_tensor(const FlatLayout& layout) {
  FlatLayout out;
  int unit = 0;
  for (const ParamInfo& p : layout.params())
    out.add(p.name, p.numel, p.group, unit++, Shape2D{p.rows, p.cols});
  return out;
}

MemoryPlan plan_memory(const FlatLayout& layout, const PlanConfig& config) {
  check(config);
  const bool whole = config.ownership == Ownership::Whole;
  if (whole) {  // as finalize() refuses them
    require(config.device == Device::Cpu ||
                (config.stage != Stage::Zero3 && config.reduction == Reduction::Default),
            Status::Unsupported,
            "plan_memory: ownership Whole on Device::Cuda: stage 3 and Reduction::Reproducible "
            "are not supported yet");
  }
  require(config.device == Device::Cpu || config.reduction == Reduction::Default ||
              config.stage != Stage::Zero3,
          Status::Unsupported,
          "plan_memory: Reduction::Reproducible on Device::Cuda: stage 3 is not supported yet");
  FlatLayout built = layout;
  if (built.built()) {
    require(built.world_size() == config.world_size, Status::InvalidArgument,
            "plan_memory: the layout is built for " + std::to_string(built.world_size()) +
                " ranks, the plan asks for " + std::to_string(config.world_size));
    require(config.bucket_elems == 0 || built.bucket_elems() == config.bucket_elems,
            Status::InvalidArgument,
            "plan_memory: the layout is built for buckets of " +
                std::to_string(built.bucket_elems()) + " elements, the plan asks for " +
                std::to_string(config.bucket_elems));
    require(built.align_elems() == rules::layout_align(built, config.groups),
            Status::InvalidArgument,
            "plan_memory: the layout is built with another alignment than these groups' rules "
            "need (AdamW8bit: 256 elements)");
    require(!whole || built.ownership() == Ownership::Whole, Status::InvalidArgument,
            std::string("plan_memory: the layout is built with ") +
                ownership_name(built.ownership()) + " ownership, the plan asks for " +
                ownership_name(config.ownership));
  } else {
    if (whole) built.set_ownership(Ownership::Whole);
    built.build(config.world_size,
                rules::layout_bucket_elems(built, config.groups, config.bucket_elems,
                                           auto_bucket_cap(config.device)),
                auto_bucket_cap(config.device), rules::layout_align(built, config.groups));
  }
  // Whole: the very cut finalize() makes (its per-rank ranges size every local array).
  if (whole && !built.owners_applied())
    built.apply_owners(assign_owners(built, rules::owner_costs(built, config.groups,
                                                               config.param_dtype)));

  // The very plan ShardedOptimizer::finalize() allocates from.
  const BufferPlan b =
      plan_buffers(built, config.stage, config.param_dtype, config.buckets_in_flight,
                   config.units_in_flight, config.reduction, config.reduce_dtype,
                   config.groups, config.rank, config.device);
  MemoryPlan plan;
  plan.reduce_bytes = b.reduce_bytes;
  plan.reduce_bytes_accumulated = b.reduce_bytes_accumulated;
  plan.reduce_bytes_in_place = b.reduce_bytes_in_place;
  if (config.reduction == Reduction::Reproducible) {
    plan.exact_sharded = b.exact_sharded;
    if (b.exact_sharded) {
      plan.exact_state_bytes = b.exact.bytes;  // in `bytes`: from finalize
      plan.exact_wide_bytes = b.exact_wide.bytes;
      plan.exact_sharded_ranks = config.world_size;
    } else {
      plan.reduce_bytes_two_phase = built.padded_size() * (sizeof(std::uint8_t) + sizeof(std::int64_t));
      const bool whole = config.stage == Stage::DataParallel;
      for (const Bucket& bk : built.buckets())
        if (!exact::exchanges(bk, whole)) plan.exact_ragged_elems += bk.flat.size();
      plan.exact_state_bytes = b.exact.bytes;
      plan.exact_wide_bytes = b.exact_compact ? b.exact_wide.bytes : b.exact.bytes;
      plan.exact_on_demand = b.exact.on_demand;
    }
  }
  plan.unpadded_elems = built.unpadded_size();
  plan.padded_elems = built.padded_size();
  plan.owned_elems = b.local_elems;
  plan.num_buckets = built.num_buckets();
  for (const Bucket& bk : built.buckets())
    plan.bucket_elems = std::max(plan.bucket_elems, bk.flat.size());
  if (config.nodes > 1 && config.reduction == Reduction::Default) {
    const std::size_t nodes = static_cast<std::size_t>(config.nodes);
    const std::size_t wire = config.reduce_dtype == DType::BF16 ? 2 : 4;
    const std::size_t param = config.param_dtype == DType::F32 ? 4 : 2;
    for (const Bucket& bk : built.buckets()) {
      const std::size_t others = bk.flat.size() - bk.flat.size() / nodes;  // elements
      if (config.stage == Stage::DataParallel) {
        plan.internode_bytes += 2 * others * wire;
      } else {
        plan.internode_bytes += others * wire;
        if (config.stage != Stage::Zero3) plan.internode_bytes += others * param;
      }
    }
  }
  plan.staged = b.grads_scheme == GradScheme::Staged;
  plan.unit_elems = b.unit_elems;
  plan.unit_buffers = b.unit_buffers;
  for (const BufferSpec& s : b.all())
    if (!s.on_demand) plan.bytes[static_cast<int>(s.category)] += s.bytes;
  if (config.accumulate_without_sync && plan.staged)
    plan.bytes[static_cast<int>(b.accumulate.category)] += b.accumulate.bytes;
  if (config.accumulate_without_sync && b.exact.on_demand)
    plan.bytes[static_cast<int>(b.exact.category)] += b.exact.bytes;
  if (config.grad_views_across_buckets && plan.staged)
    plan.bytes[static_cast<int>(b.spill.category)] += b.spill.bytes;
  return plan;
}

OwnershipReport plan_ownership(const FlatLayout& layout, const PlanConfig& config,
                               const OwnerOptions& options) {
  check(config);
  const auto is_matrix = [&](std::size_t i) { return i < config.matrix.size() && config.matrix[i]; };
  require(config.matrix.size() <= layout.num_params(), Status::InvalidArgument,
          "plan_ownership: " + std::to_string(config.matrix.size()) + " matrix flags for " +
              std::to_string(layout.num_params()) + " parameters");
  OwnershipReport report;
  for (std::size_t i = 0; i < layout.num_params(); ++i)
    if (is_matrix(i)) {
      ++report.matrices;
      report.largest_matrix = std::max(report.largest_matrix, layout.param(i).numel);
    }
  FlatLayout built = layout;
  if (built.built()) {
    require(built.ownership() == Ownership::Whole, Status::InvalidArgument,
            "plan_ownership: the layout is built with Flat ownership");
    require(built.world_size() == config.world_size, Status::InvalidArgument,
            "plan_ownership: the layout is built for " + std::to_string(built.world_size()) +
                " ranks, the plan asks for " + std::to_string(config.world_size));
  } else {
    std::size_t bucket = config.bucket_elems;
    if (bucket == 0)
      bucket = std::max(FlatLayout::auto_bucket_elems(built.unpadded_size(),
                                                      auto_bucket_cap(config.device)),
                        report.largest_matrix);
    built.set_ownership(Ownership::Whole);
    built.build(config.world_size, bucket, auto_bucket_cap(config.device),
                rules::layout_align(built, config.groups));
  }
  std::vector<ParamCost> costs;
  costs.reserve(built.num_params());
  for (std::size_t i = 0; i < built.num_params(); ++i) {
    const ParamInfo& p = built.param(i);
    costs.push_back(param_cost(p, is_matrix(i), state_bytes_per_elem(p, is_matrix(i), config)));
    report.ns_flops += costs.back().ns_flops;
  }
  report.plan = assign_owners(built, costs, options);
  report.bucket_elems = built.bucket_elems();
  report.num_buckets = built.num_buckets();
  return report;
}

double zero_formula_bytes(Stage stage, double psi, double ranks, DType param_dtype, Rule rule) {
  const double p = static_cast<double>(dtype_size(param_dtype));
  const double g = 4.0;
  // The rule's state per element: Lion and Muon one fp32 array, AdamW two, AdamW8bit two
  // bytes and two fp32 scales per 256 elements (every parameter taken as 8-bit), Adafactor at
  // most one (every parameter taken as unfactored; a factored matrix keeps rows + cols).
  double state = 8.0;
  if (rule == Rule::Lion || rule == Rule::Muon || rule == Rule::Adafactor) state = 4.0;
  if (rule == Rule::AdamW8bit) state = 2.0 + 8.0 / 256;
  const double k = state + (param_dtype == DType::F32 ? 0.0 : 4.0);
  switch (stage) {
    case Stage::DataParallel: return (p + g + k) * psi;
    case Stage::Zero1: return (p + g) * psi + k * psi / ranks;
    case Stage::Zero2: return p * psi + (g + k) * psi / ranks;
    case Stage::Zero3: return (p + g + k) * psi / ranks;
  }
  throw Error(Status::InvalidArgument, "zero_formula_bytes: invalid stage");
}

FlatLayout uniform_layout(std::size_t psi, std::size_t tensor_elems) {
  require(psi > 0, Status::InvalidArgument, "uniform_layout: the model has no parameters");
  require(tensor_elems > 0, Status::InvalidArgument, "uniform_layout: tensor size is zero");
  const std::size_t tensors = psi / tensor_elems + (psi % tensor_elems != 0);
  require(tensors <= kMaxUniformTensors, Status::InvalidArgument,
          "uniform_layout: " + std::to_string(psi) + " elements in tensors of " +
              std::to_string(tensor_elems) + " make " + std::to_string(tensors) +
              " tensors, more than " + std::to_string(kMaxUniformTensors) +
              "; use larger tensors");
  FlatLayout layout;
  std::size_t left = psi;
  for (std::size_t t = 0; left > 0; ++t) {
    const std::size_t n = std::min(left, tensor_elems);
    std::string name = "t";  // appended, not "t" + ...: avoids a GCC 12 -Wrestrict false positive
    name += std::to_string(t);
    layout.add(name, n, 0);
    left -= n;
  }
  return layout;
}

std::size_t uniform_tensor_elems(std::size_t psi, std::size_t tensor_elems) {
  const std::size_t spread = psi / kMaxUniformTensors + (psi % kMaxUniformTensors != 0);
  return std::max(tensor_elems, spread);
}

std::size_t largest_fitting_psi(std::size_t budget_bytes, const PlanConfig& config,
                                std::size_t tensor_elems) {
  check(config);
  require(tensor_elems > 0, Status::InvalidArgument, "largest_fitting_psi: tensor size is zero");
  auto fits = [&](std::size_t psi) {
    FlatLayout l = uniform_layout(psi, uniform_tensor_elems(psi, tensor_elems));
    if (config.stage == Stage::Zero3) l = unit_per_tensor(l);
    return plan_memory(l, config).total() <= budget_bytes;
  };
  // Every rank holds at least 2 bytes per element (the replica; at stage 3 its slice of the
  // replica, gradient, master and moments: 16 / N), so budget/2 + 1 elements, or
  // N x (budget/16 + 1) + 1 at stage 3, never fit: bisect in [lo, hi) with fits(lo) (or lo == 0)
  // and !fits(hi).
  std::size_t lo = 0;
  std::size_t hi = config.stage == Stage::Zero3
                       ? (budget_bytes / 16 + 1) * static_cast<std::size_t>(config.world_size) + 1
                       : budget_bytes / 2 + 1;
  while (hi - lo > 1) {
    const std::size_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

const char* exact_path_name(ExactPath p) noexcept {
  switch (p) {
    case ExactPath::Direct: return "direct";
    case ExactPath::Packed: return "packed";
    case ExactPath::PackedInPlace: return "packed in place";
    case ExactPath::TwoPhase: return "two-phase";
    case ExactPath::RawPairInPlace: return "raw pair in place";
  }
  return "?";
}

ExactPath exact_path_needed(int micro_batches, ExactPath fastest) {
  if (micro_batches > cpu::kPackedMaxMicroBatches || fastest == ExactPath::TwoPhase) return ExactPath::TwoPhase;
  if (micro_batches > 1 || fastest != ExactPath::Direct) return ExactPath::Packed;
  return ExactPath::Direct;
}

ExactStepPlan plan_exact_step(const MemoryPlan& plan, const ExactStep& step) {
  require(plan.reduce_bytes_two_phase > 0 || plan.exact_sharded || plan.padded_elems == 0, Status::InvalidArgument,
          "plan_exact_step: the plan is not of Reduction::Reproducible");
  const int most = std::max(step.most_micro_batches, 0);
  ExactStepPlan s;
  if (plan.exact_sharded) {
    const int rounds = std::max(most, 1);
    s.wire_bytes = static_cast<std::size_t>(rounds) * plan.reduce_bytes;
    // The owned elements' words hold 63 values each; past that, their bins replace them.
    if (rounds * plan.exact_sharded_ranks > cpu::kPackedMaxMicroBatches)
      s.accumulator_bytes = plan.exact_wide_bytes - plan.exact_state_bytes;
    return s;
  }
  s.path = exact_path_needed(most, step.exchanges ? step.fastest : ExactPath::TwoPhase);
  // The in-place deposit exists where the planner counts it (the CPU's compact form).
  if (s.path == ExactPath::Packed && step.words_shared && plan.reduce_bytes_in_place != plan.reduce_bytes_accumulated)
    s.path = most <= 2 && step.fastest == ExactPath::Direct && step.last_synced ? ExactPath::RawPairInPlace : ExactPath::PackedInPlace;
  const std::size_t even = plan.padded_elems - plan.exact_ragged_elems;
  const std::size_t two_phase = plan.reduce_bytes_two_phase / std::max<std::size_t>(plan.padded_elems, 1);
  const auto per_elem = [&](std::size_t total) { return total / std::max<std::size_t>(plan.padded_elems, 1); };
  const std::size_t per = s.path == ExactPath::Direct          ? per_elem(plan.reduce_bytes)
                          : s.path == ExactPath::Packed        ? per_elem(plan.reduce_bytes_accumulated)
                          : s.path == ExactPath::PackedInPlace ? per_elem(plan.reduce_bytes_in_place)
                          : s.path == ExactPath::RawPairInPlace ? 2 * per_elem(plan.reduce_bytes)
                                                               : two_phase;
  s.wire_bytes = even * per + plan.exact_ragged_elems * two_phase;
  // The packed words (the CPU's compact form, whose bins are larger) exist where a rank
  // deposited, or in a shared window; the bins are allocated on every rank for the packed
  // exchange of the bins and for the two-phase method.
  const bool compact = plan.exact_state_bytes != plan.exact_wide_bytes;
  if (plan.exact_on_demand)
    s.accumulator_bytes = s.path == ExactPath::Direct                         ? 0
                          : s.path == ExactPath::TwoPhase                     ? plan.exact_wide_bytes
                          : compact && most < 2 && s.path == ExactPath::Packed ? 0
                                                                              : plan.exact_state_bytes;
  return s;
}

}  // namespace shardopt
