// rule_step.cpp: each rule's update of a window part; the one place that knows every rule.
#include "rules/rule_step.hpp"

#include "shardopt/error.hpp"
#include "rules/adafactor.hpp"
#include "rules/muon.hpp"
#include "shardopt/lion_math.hpp"

namespace shardopt::rules {

std::vector<GroupSegment> group_segments(const FlatLayout& layout, Range flat) {
  std::vector<GroupSegment> segs;
  for (const ShardPiece& piece : layout.pieces_in(flat)) {
    const int g = layout.param(piece.param).group;
    if (!segs.empty() && segs.back().group == g) {
      segs.back().end = piece.local.end;
      continue;
    }
    if (!segs.empty()) segs.back().end = piece.local.begin;
    segs.push_back(GroupSegment{segs.empty() ? 0 : piece.local.begin, piece.local.end, g});
  }
  if (segs.empty()) segs.push_back(GroupSegment{0, 0, 0});
  segs.back().end = flat.size();
  return segs;
}

namespace {

// AdamW's per-group scalars (AdamW and AdamW8bit).
std::vector<UpdateSegment> adamw_segments(const StepInputs& in,
                                          const std::vector<GroupSegment>& groups) {
  std::vector<UpdateSegment> segs;
  segs.reserve(groups.size());
  for (const GroupSegment& g : groups) {
    const GroupOptions& o = (*in.groups)[static_cast<std::size_t>(g.group)];
    segs.push_back(UpdateSegment{g.begin, g.end,
                                 make_segment_scalars(in.hyper, o.lr_scale, o.weight_decay)});
  }
  return segs;
}

void update_adamw(Backend& be, const StepInputs& in, const std::vector<GroupSegment>& groups,
                  float* master, const float* grad, float* m, float* v, void* replica,
                  DType replica_dtype) {
  be.adam_update(make_step_scalars(in.hyper, in.grad_scale), adamw_segments(in, groups),
                 master, grad, m, v, replica, replica_dtype);
}

void update_lion(Backend& be, const StepInputs& in, const std::vector<GroupSegment>& groups,
                 float* master, const float* grad, float* m, void* replica, DType replica_dtype) {
  std::vector<LionSegment> segs;
  segs.reserve(groups.size());
  for (const GroupSegment& g : groups) {
    const GroupOptions& o = (*in.groups)[static_cast<std::size_t>(g.group)];
    segs.push_back(LionSegment{
        g.begin, g.end,
        make_lion_scalars(o.lion.beta1, o.lion.beta2, in.hyper.lr * o.lr_scale,
                          o.weight_decay ? in.hyper.weight_decay : 0.0, in.grad_scale)});
  }
  be.lion_update(segs, master, grad, m, replica, replica_dtype);
}

// Muon's hyperparameters of group `o` (lr and weight decay as Lion takes them).
muon::Config muon_config(const StepInputs& in, const GroupOptions& o) {
  muon::Config c;
  c.lr = in.hyper.lr * o.lr_scale;
  c.weight_decay = o.weight_decay ? in.hyper.weight_decay : 0.0;
  c.momentum = o.muon.momentum;
  c.nesterov = o.muon.nesterov;
  c.ns_steps = o.muon.ns_steps;
  c.a = o.muon.ns_a;
  c.b = o.muon.ns_b;
  c.c = o.muon.ns_c;
  c.eps = o.muon.eps;
  c.adjust = static_cast<muon::LrAdjust>(static_cast<int>(o.muon.lr_adjust));
  return c;
}

// Adafactor's hyperparameters of group `o` (lr and weight decay as Muon takes them).
adafactor::Config adafactor_config(const StepInputs& in, const GroupOptions& o) {
  adafactor::Config c;
  c.lr = in.hyper.lr * o.lr_scale;
  c.weight_decay = o.weight_decay ? in.hyper.weight_decay : 0.0;
  c.beta2_decay = o.adafactor.beta2_decay;
  c.eps1 = o.adafactor.eps1;
  c.eps2 = o.adafactor.eps2;
  c.d = o.adafactor.d;
  c.maximize = o.adafactor.maximize;
  return c;
}

// The parameter of `piece`, which must be whole in the window part (whole-tensor ownership
// puts it on one rank, inside one bucket: finalize() refuses anything else).
const ParamInfo& whole_param(const FlatLayout& layout, const ShardPiece& piece, Rule rule) {
  const ParamInfo& p = layout.param(piece.param);
  if (piece.in_param.begin != 0 || piece.in_param.end != p.numel || p.rows * p.cols != p.numel)
    throw Error(Status::Internal,
                std::string("update_window: ") + rule_name(rule) + " parameter '" + p.name +
                    "' is not whole in this window (elements [" +
                    std::to_string(piece.in_param.begin) + ", " +
                    std::to_string(piece.in_param.end) + ") of " + std::to_string(p.numel) + ")");
  return p;
}

// The rules' scratch for updating `p` under `rule` (StepInputs::scratch, planned for the
// largest parameter this rank updates).
float* scratch_for(const StepInputs& in, Rule rule, const ParamInfo& p) {
  require(in.scratch != nullptr || scratch_floats(rule, p) == 0, Status::Internal,
          "update_window: no rule scratch for '" + p.name + "' (" + rule_name(rule) + ")");
  return in.scratch;
}

// Adafactor on every parameter of `flat` (a part of a run's window part: pointers at its first
// element), each whole. Factored runs: each matrix's row_var and col_var at its place in the
// Factors slot; otherwise the variance, per element like the master (`variance`).
void update_adafactor(Backend& be, const FlatLayout& layout, const StateLayout& state,
                      const StepInputs& in, Range flat, bool factored, float* master,
                      const float* grad, float* variance, float* factors, void* replica,
                      DType replica_dtype) {
  const std::size_t elem = dtype_size(replica_dtype);
  for (const ShardPiece& piece : layout.pieces_in(flat)) {
    const ParamInfo& p = whole_param(layout, piece, Rule::Adafactor);
    const GroupOptions& o = (*in.groups)[static_cast<std::size_t>(p.group)];
    const std::size_t off = piece.local.begin;  // relative to `flat`
    float* st = factored ? factors + state.matrix_slot_begin(piece.param) : variance + off;
    be.adafactor_update(adafactor_config(in, o), in.hyper.step, p.rows, p.cols, factored,
                        static_cast<float>(in.grad_scale), master + off, grad + off, st,
                        replica ? static_cast<char*>(replica) + off * elem : nullptr,
                        replica_dtype, scratch_for(in, Rule::Adafactor, p));
  }
}

// Muon on every parameter of `flat` (a part of a window: pointers at its first element).
// Each must lie whole inside it: whole-tensor ownership puts every matrix on one rank, inside
// one bucket (finalize() refuses a matrix that spans buckets).
void update_muon(Backend& be, const FlatLayout& layout, const StepInputs& in, Range flat,
                 float* master, const float* grad, float* m, void* replica, DType replica_dtype) {
  const std::size_t elem = dtype_size(replica_dtype);
  for (const ShardPiece& piece : layout.pieces_in(flat)) {
    const ParamInfo& p = whole_param(layout, piece, Rule::Muon);
    const GroupOptions& o = (*in.groups)[static_cast<std::size_t>(p.group)];
    const std::size_t off = piece.local.begin;  // relative to `flat`
    be.muon_update(muon_config(in, o), p.rows, p.cols, static_cast<float>(in.grad_scale),
                   master + off, grad + off, m + off,
                   replica ? static_cast<char*>(replica) + off * elem : nullptr, replica_dtype,
                   scratch_for(in, Rule::Muon, p));
  }
}

}  // namespace

void update_window(Backend& be, const FlatLayout& layout, const StateLayout& state,
                   const std::array<void*, kNumSlots>& slots, const StepInputs& in,
                   const Window& w) {
  const Range local{w.local, w.local + w.flat.size()};
  const std::size_t elem = dtype_size(w.replica_dtype);
  state.for_each_run(local, [&](const RuleRun& run, Range part) {
    const std::size_t off = part.begin - w.local;  // in the window
    const Range flat{w.flat.begin + off, w.flat.begin + off + part.size()};
    const std::vector<GroupSegment> groups = group_segments(layout, flat);
    float* master = w.master + off;
    const float* grad = w.grad + off;
    void* replica = w.replica ? static_cast<char*>(w.replica) + off * elem : nullptr;
    // Slot s's entries from this part's first element on.
    auto slot = [&]<class T = float>(Slot s) {
      return static_cast<T*>(slots[static_cast<std::size_t>(s)]) + run.slot_index(s, part.begin);
    };
    switch (run.rule) {
      case Rule::AdamW:
        update_adamw(be, in, groups, master, grad, slot(Slot::ExpAvg), slot(Slot::ExpAvgSq),
                     replica, w.replica_dtype);
        return;
      case Rule::Lion:
        update_lion(be, in, groups, master, grad, slot(Slot::ExpAvg), replica, w.replica_dtype);
        return;
      case Rule::Muon:
        update_muon(be, layout, in, flat, master, grad, slot(Slot::ExpAvg), replica,
                    w.replica_dtype);
        return;
      case Rule::Adafactor:
        update_adafactor(be, layout, state, in, flat, run.factored, master, grad,
                         run.factored ? nullptr : slot(Slot::ExpAvgSq),
                         static_cast<float*>(slots[static_cast<std::size_t>(Slot::Factors)]),
                         replica, w.replica_dtype);
        return;
      case Rule::AdamW8bit: {
        const StepScalars s = make_step_scalars(in.hyper, in.grad_scale);
        be.adamw8bit_update(s, adamw_segments(in, groups), master, grad,
                            slot.operator()<std::uint8_t>(Slot::CodeM),
                            slot.operator()<std::uint8_t>(Slot::CodeV), slot(Slot::ScaleM),
                            slot(Slot::ScaleV), replica, w.replica_dtype);
        return;
      }
    }
    throw Error(Status::Internal, "update_window: unknown rule");
  });
}

}  // namespace shardopt::rules
