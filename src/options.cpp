// options.cpp: validation of hyperparameters and names of enums.
#include "shardopt/options.hpp"

#include <cmath>
#include <cstdlib>

#include "shardopt/error.hpp"

namespace shardopt {

const char* stage_name(Stage s) noexcept {
  switch (s) {
    case Stage::DataParallel: return "data-parallel";
    case Stage::Zero1: return "zero-1";
    case Stage::Zero2: return "zero-2";
    case Stage::Zero3: return "zero-3";
  }
  return "?";
}

const char* reduction_name(Reduction r) noexcept {
  switch (r) {
    case Reduction::Default: return "default";
    case Reduction::Reproducible: return "reproducible";
  }
  return "?";
}

const char* status_name(Status s) noexcept {
  switch (s) {
    case Status::Ok: return "ok";
    case Status::InvalidArgument: return "invalid argument";
    case Status::InvalidState: return "invalid state";
    case Status::LayoutMismatch: return "layout mismatch";
    case Status::RemoteError: return "error on another rank";
    case Status::Communication: return "communication error";
    case Status::OutOfMemory: return "out of memory";
    case Status::Io: return "I/O error";
    case Status::CorruptData: return "corrupt data";
    case Status::Unsupported: return "unsupported";
    case Status::Cuda: return "CUDA error";
    case Status::Internal: return "internal error";
  }
  return "unknown status";
}

std::string validate(const AdamConfig& c) {
  auto bad = [](const char* what, double v) {
    return std::string("invalid ") + what + " " + std::to_string(v);
  };
  if (!std::isfinite(c.lr) || c.lr < 0) return bad("learning rate (need lr >= 0):", c.lr);
  if (!std::isfinite(c.beta1) || c.beta1 < 0 || c.beta1 >= 1)
    return bad("beta1 (need 0 <= beta1 < 1):", c.beta1);
  if (!std::isfinite(c.beta2) || c.beta2 < 0 || c.beta2 >= 1)
    return bad("beta2 (need 0 <= beta2 < 1):", c.beta2);
  if (!std::isfinite(c.eps) || c.eps <= 0) return bad("eps (need eps > 0):", c.eps);
  if (!std::isfinite(c.weight_decay) || c.weight_decay < 0)
    return bad("weight_decay (need >= 0):", c.weight_decay);
  if (!std::isfinite(c.max_grad_norm) || c.max_grad_norm < 0)
    return bad("max_grad_norm (need >= 0, 0 = no clipping):", c.max_grad_norm);
  if (c.mode != AdamMode::AdamW && c.mode != AdamMode::AdamL2) return "invalid Adam mode";
  return {};
}

const char* rule_name(Rule r) noexcept {
  switch (r) {
    case Rule::AdamW: return "AdamW";
    case Rule::Lion: return "Lion";
    case Rule::AdamW8bit: return "AdamW8bit";
    case Rule::Muon: return "Muon";
    case Rule::Adafactor: return "Adafactor";
  }
  return "unknown rule";
}

const char* muon_lr_adjust_name(MuonLrAdjust a) noexcept {
  switch (a) {
    case MuonLrAdjust::Original: return "original";
    case MuonLrAdjust::MatchRmsAdamW: return "match_rms_adamw";
    case MuonLrAdjust::None: return "none";
  }
  return "unknown lr adjustment";
}

std::string validate(const GroupOptions& g) {
  if (!std::isfinite(g.lr_scale) || g.lr_scale < 0)
    return "invalid group lr_scale " + std::to_string(g.lr_scale) + " (need >= 0)";
  if (g.rule != Rule::AdamW && g.rule != Rule::Lion && g.rule != Rule::AdamW8bit &&
      g.rule != Rule::Muon && g.rule != Rule::Adafactor)
    return "invalid group rule " + std::to_string(static_cast<int>(g.rule)) +
           " (AdamW 0, Lion 1, AdamW8bit 2, Muon 3, Adafactor 4)";
  auto beta_ok = [](double b) { return std::isfinite(b) && b >= 0 && b < 1; };
  if (!beta_ok(g.lion.beta1) || !beta_ok(g.lion.beta2))
    return "invalid Lion betas " + std::to_string(g.lion.beta1) + ", " +
           std::to_string(g.lion.beta2) + " (need 0 <= beta < 1)";
  const MuonConfig& m = g.muon;
  if (!beta_ok(m.momentum))
    return "invalid Muon momentum " + std::to_string(m.momentum) + " (need 0 <= momentum < 1)";
  if (m.ns_steps < 0 || m.ns_steps > 99)
    return "invalid Muon ns_steps " + std::to_string(m.ns_steps) + " (need 0..99)";
  if (!std::isfinite(m.ns_a) || !std::isfinite(m.ns_b) || !std::isfinite(m.ns_c))
    return "invalid Muon Newton-Schulz coefficients (need finite a, b, c)";
  if (!std::isfinite(m.eps) || m.eps <= 0)
    return "invalid Muon eps " + std::to_string(m.eps) + " (need eps > 0)";
  if (m.lr_adjust != MuonLrAdjust::Original && m.lr_adjust != MuonLrAdjust::MatchRmsAdamW &&
      m.lr_adjust != MuonLrAdjust::None)
    return "invalid Muon lr_adjust " + std::to_string(static_cast<int>(m.lr_adjust)) +
           " (Original 0, MatchRmsAdamW 1, None 2)";
  // torch.optim.Adafactor's constructor checks (each also refuses NaN), and finite values.
  const AdafactorConfig& a = g.adafactor;
  if (!std::isfinite(a.beta2_decay) || a.beta2_decay > 0)
    return "invalid Adafactor beta2_decay " + std::to_string(a.beta2_decay) + " (need <= 0)";
  if (!std::isfinite(a.eps1) || a.eps1 < 0)
    return "invalid Adafactor eps1 " + std::to_string(a.eps1) + " (need eps1 >= 0)";
  if (!std::isfinite(a.eps2) || a.eps2 < 0)
    return "invalid Adafactor eps2 " + std::to_string(a.eps2) + " (need eps2 >= 0)";
  if (!std::isfinite(a.d) || a.d < 1)
    return "invalid Adafactor d " + std::to_string(a.d) + " (the clipping threshold: need d >= 1)";
  return {};
}

std::string validate(const LossScaling& s) {
  // Checked whether or not loss scaling is on: a mistake shows when it is made, not when
  // loss scaling is turned on later (and the options are saved in checkpoints).
  const std::string off = s.enabled ? "" : " (checked although loss scaling is off)";
  auto positive = [](double x) { return std::isfinite(x) && x > 0; };
  if (!positive(s.min_scale) || !positive(s.max_scale) || s.min_scale > s.max_scale)
    return "invalid loss scaling bounds min_scale " + std::to_string(s.min_scale) +
           ", max_scale " + std::to_string(s.max_scale) +
           " (need 0 < min_scale <= max_scale, finite)" + off;
  if (!positive(s.initial_scale) || s.initial_scale < s.min_scale || s.initial_scale > s.max_scale)
    return "invalid loss scaling initial_scale " + std::to_string(s.initial_scale) +
           " (need min_scale <= initial_scale <= max_scale)" + off;
  if (s.growth_interval < 1)
    return "loss scaling growth_interval must be >= 1, got " + std::to_string(s.growth_interval) + off;
  if (!std::isfinite(s.growth_factor) || s.growth_factor < 1)
    return "loss scaling growth_factor must be >= 1, got " + std::to_string(s.growth_factor) + off;
  if (!std::isfinite(s.backoff_factor) || s.backoff_factor <= 0 || s.backoff_factor >= 1)
    return "loss scaling backoff_factor must be in (0, 1), got " + std::to_string(s.backoff_factor) + off;
  return {};
}

std::string apply_environment(OptimizerOptions& o) {
  if (const char* env = std::getenv("SHARDOPT_DEBUG_COLLECTIVES")) {
    const std::string v = env;
    if (v == "1")
      o.debug_collectives = true;
    else if (!v.empty() && v != "0")
      return "SHARDOPT_DEBUG_COLLECTIVES='" + v + "': expected 1 (on) or 0 (off)";
  }
  if (o.collective_timeout_s == 0) {
    std::string problem;
    if (!collective_timeout_from_environment(o.collective_timeout_s, problem)) return problem;
  }
  if (o.collective_timeout_s == 0)
    o.collective_timeout_s = o.debug_collectives ? kDebugCollectiveTimeoutS : kDefaultCollectiveTimeoutS;
  else if (o.collective_timeout_s < 0 || o.collective_timeout_s == HUGE_VAL)
    o.collective_timeout_s = kNoCollectiveTimeout;
  return {};
}

bool collective_timeout_from_environment(double& seconds, std::string& problem) {
  const char* env = std::getenv("SHARDOPT_COLLECTIVE_TIMEOUT");
  if (env == nullptr || *env == '\0') return true;
  const std::string v = env;
  if (v == "off" || v == "none") {
    seconds = kNoCollectiveTimeout;
    return true;
  }
  char* end = nullptr;
  const double s = std::strtod(env, &end);
  if (*end != '\0' || !std::isfinite(s) || s < 0) {
    problem = "SHARDOPT_COLLECTIVE_TIMEOUT='" + v +
              "': expected seconds > 0, or 0, off or none for no timeout";
    return false;
  }
  seconds = s == 0 ? kNoCollectiveTimeout : s;
  return true;
}

}  // namespace shardopt
