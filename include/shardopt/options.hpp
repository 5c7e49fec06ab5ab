// options.hpp: what a trainer chooses: sharding stage, dtypes, Adam hyperparameters, groups.
#pragma once

#include <cstddef>
#include <string>

#include "shardopt/adam_math.hpp"
#include "shardopt/dtype.hpp"
#include "shardopt/ownership.hpp"

namespace shardopt {

enum class Stage : int {
  DataParallel = 0,  ///< baseline: all-reduce, every rank holds and updates everything
  Zero1 = 1,         ///< optimizer state sharded; full fp32 gradient buffer on every rank
  Zero2 = 2,         ///< state and gradients sharded; gradients reduced bucket by bucket
  Zero3 = 3,         ///< parameters sharded too: units gathered on acquire, released after use
};
const char* stage_name(Stage s) noexcept;

enum class Device : int { Cpu = 0, Cuda = 1 };

/// How the gradient sums are computed (docs/architecture.md, "Reproducible mode").
enum class Reduction : int {
  /// fp32 (or bf16-wire) sums in whatever order the collectives take: the fastest; the last
  /// bits of a step depend on the number of ranks, the bucket size and the transport.
  Default = 0,
  /// Every sum between the trainer's micro-batch gradients and the update is exact (integer
  /// bins with absolute boundaries), so a step is the same bit for bit at any number of
  /// ranks, assignment of micro-batches to ranks (counts may differ between ranks, a rank
  /// may have none: the average is over the step's micro-batches of all ranks), bucket size
  /// and communicator. One micro-batch per rank moves 4 wire bytes per element (the direct
  /// exchange of raw values) and needs no memory beyond the full fp32 gradient; several on
  /// some rank, 8 (the packed exchange; 9 past 63 per rank) and an exact accumulator of 17
  /// bytes per element. On the CPU; on Device::Cuda at stages 0-2 with Ownership::Flat (the
  /// same exchanges over ncclSend/ncclRecv and the same bytes; bit for bit the CPU's). The
  /// reduction runs inside step(), not during backward.
  Reproducible = 1,
};
const char* reduction_name(Reduction r) noexcept;

struct AdamConfig {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
  AdamMode mode = AdamMode::AdamW;
  double max_grad_norm = 0.0;  ///< clip the global L2 norm to this; 0 disables clipping
};

/// Returns an empty string when valid, otherwise what is wrong (lr >= 0, 0 <= beta < 1,
/// eps > 0, weight_decay >= 0, max_grad_norm >= 0, all finite).
std::string validate(const AdamConfig& c);

/// The update rule of a parameter group (the rule layer: src/rules/, docs/architecture.md
/// "Optimizer rules"). Every rule takes the group's lr (AdamConfig::lr * lr_scale), the
/// weight decay (AdamConfig::weight_decay where the group's weight_decay is on) and the
/// averaged, clipped gradient; each keeps its own state arrays.
enum class Rule : int {
  /// AdamConfig's Adam: torch.optim.AdamW (or torch.optim.Adam with AdamMode::AdamL2);
  /// state exp_avg and exp_avg_sq (fp32, 8 bytes per element).
  AdamW = 0,
  /// Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"; the update of
  /// lucidrains' lion-pytorch and timm): p *= 1 - lr * wd; c = beta1 m + (1 - beta1) g;
  /// p -= lr * sign(c) (sign(0) = 0); m = beta2 m + (1 - beta2) g. Decay is always decoupled
  /// (AdamConfig::mode does not apply). State exp_avg (the momentum m, fp32, 4 bytes per
  /// element); no exp_avg_sq.
  Lion = 1,
  /// AdamW with 8-bit block-quantized state (bitsandbytes / torchao semantics, issue 31): per
  /// element a u8 code of exp_avg (signed dynamic map) and of exp_avg_sq (unsigned map), per
  /// block of 256 elements of a parameter an fp32 scale of each (2 bytes + 1/32 per element
  /// against AdamW's 8). Each step dequantizes, runs AdamW's fp32 update (the weight from the
  /// fp32 m and v) and requantizes. A parameter with fewer than
  /// AdamW8bitConfig::min_8bit_numel elements (its global size, not its shard's) keeps AdamW's
  /// fp32 state, so precision never depends on ranks, stage or bucket size. With any 8-bit
  /// parameter the layout aligns to 256 elements (FlatLayout::kQuantBlockElems). On
  /// Device::Cpu and Device::Cuda, bit for bit the same (cuda/adamw8bit_op.hpp).
  AdamW8bit = 2,
  /// Muon (Jordan et al. 2024; the semantics of torch.optim.Muon, src/rules/muon.hpp) on 2-D
  /// matrices, issue 32: M = lerp(M, g, 1 - mu); U = nesterov ? lerp(g, M, mu) : M;
  /// O = Newton-Schulz(U) (fp32, once per step on the reduced gradient);
  /// p *= 1 - lr * wd; p -= adjusted_lr * O. State exp_avg (the momentum M, fp32, 4 bytes per
  /// element). Every parameter of a Muon group must be registered with a 2-D shape (rows > 1,
  /// cols > 1: add_param(name, Shape2D, group)) and the optimizer must use
  /// Ownership::Whole (a matrix is updated whole by one rank); finalize() refuses anything
  /// else. Device::Cpu at stages 0-3; on Device::Cuda (stages 0-2) the GEMMs are cuBLAS's
  /// (fp32): equal to the CPU's to rounding, not bit for bit (docs/cuda.md).
  Muon = 3,
  /// Adafactor (Shazeer & Stern 2018; the semantics of torch.optim.Adafactor, PyTorch >= 2.5,
  /// src/rules/adafactor.hpp), issue 32: with t the step count, rho = min(lr, 1/sqrt(t)),
  /// alpha = max(eps2, RMS(p)) * rho; p *= 1 - lr * wd; a 2-D parameter (rows > 1 and
  /// cols > 1, registered with add_param(name, Shape2D, group)) keeps factored statistics,
  /// row_var = lerp(row_var, mean_j g^2, t^beta2_decay) and col_var likewise over the rows
  /// (rows + cols fp32 per matrix, not per element), v = row_var_i col_var_j /
  /// max(mean(row_var), eps1); any other parameter (1-D, or 1 x n / n x 1: torch would
  /// factor a 2-D 1 x n tensor, here it is a vector) keeps the per-element variance
  /// lerp(variance, g^2, t^beta2_decay) (exp_avg_sq's slot, 4 bytes per element);
  /// u = g / sqrt(max(v, eps1^2)); p -= alpha / max(1, RMS(u) / d) * u. RMS(p) and RMS(u)
  /// are statistics of the whole tensor, 1-D ones included, so every parameter of an
  /// Adafactor group must be whole on the rank that updates it: the optimizer must use
  /// Ownership::Whole and each parameter must fit one bucket (finalize() refuses anything
  /// else, naming the parameter). The update runs once per step, on the reduced, averaged
  /// and clipped gradient. lr and weight decay as for every rule (AdamConfig::lr * lr_scale;
  /// AdamConfig::weight_decay where the group's weight_decay is on: torch's Adafactor
  /// defaults to lr 1e-2 and weight_decay 0). Stages 0-3 on the CPU, 0-2 on Device::Cuda;
  /// checkpoints store its variance, factored statistics and options (format 7).
  Adafactor = 4,
};
const char* rule_name(Rule r) noexcept;
inline constexpr int kNumRules = 5;

/// Lion's own hyperparameters (lr and weight decay come from AdamConfig and the group).
struct LionConfig {
  double beta1 = 0.9;   ///< interpolation of the update direction
  double beta2 = 0.99;  ///< decay of the momentum
};

/// AdamW8bit's own option (its hyperparameters are AdamConfig's).
struct AdamW8bitConfig {
  /// Parameters with fewer elements keep fp32 m and v (torchao's min_quant_size).
  std::size_t min_8bit_numel = 4096;
};

/// Muon's learning-rate adjustment (torch.optim.Muon's adjust_lr_fn).
enum class MuonLrAdjust : int {
  Original = 0,       ///< lr * sqrt(max(1, rows / cols)) (torch's default, "original")
  MatchRmsAdamW = 1,  ///< lr * 0.2 * sqrt(max(rows, cols)) ("match_rms_adamw", Moonshot)
  None = 2,           ///< lr unchanged
};
const char* muon_lr_adjust_name(MuonLrAdjust a) noexcept;

/// Muon's own hyperparameters (lr is AdamConfig::lr x lr_scale; the weight decay is
/// AdamConfig::weight_decay where the group's weight_decay is on, as for Lion).
struct MuonConfig {
  double momentum = 0.95;  ///< mu, 0 <= mu < 1
  bool nesterov = true;
  int ns_steps = 5;        ///< Newton-Schulz iterations, 0..99
  double ns_a = 3.4445;    ///< quintic coefficients (Keller Jordan's)
  double ns_b = -4.7750;
  double ns_c = 2.0315;
  double eps = 1e-7;       ///< the Frobenius-norm clamp of Newton-Schulz, > 0
  MuonLrAdjust lr_adjust = MuonLrAdjust::Original;
};

/// Adafactor's own hyperparameters, torch.optim.Adafactor's defaults (torch's eps = (eps1,
/// eps2); lr is AdamConfig::lr x lr_scale and the weight decay AdamConfig::weight_decay where
/// the group's weight_decay is on, as for Muon and Lion).
struct AdafactorConfig {
  double beta2_decay = -0.8;  ///< the second moments' lerp weight at step t is t^beta2_decay; <= 0
  /// Floor of mean(row_var) and, squared, of the variance estimate; >= 0. torch's default
  /// (None) is the parameter dtype's machine epsilon: fp32's 2^-23 here (the master is fp32).
  double eps1 = 1.1920928955078125e-07;
  double eps2 = 1e-3;   ///< floor of RMS(p) in the step size alpha; >= 0
  double d = 1.0;       ///< update clipping threshold on RMS(u); >= 1
  bool maximize = false;
};

/// Options of one parameter group. Group 0 always exists with the defaults.
struct GroupOptions {
  double lr_scale = 1.0;      ///< this group's lr is lr * lr_scale
  bool weight_decay = true;   ///< false for biases and norms, as is usual
  /// The group's update rule, fixed at finalize() (set_group() may not change it).
  Rule rule = Rule::AdamW;
  LionConfig lion;            ///< used when rule is Lion (validated always)
  AdamW8bitConfig adamw8bit;  ///< used when rule is AdamW8bit
  MuonConfig muon;            ///< used when rule is Muon (validated always)
  AdafactorConfig adafactor;  ///< used when rule is Adafactor (validated always)
};
std::string validate(const GroupOptions& g);

/// Dynamic loss scaling for fp16 training (the GradScaler scheme). The trainer multiplies its
/// loss by loss_scale() before backward; the step divides the gradients by the same scale
/// (folded into the update's gradient factor, no extra pass) and reports the unscaled norm.
/// A step with a NaN/Inf gradient is skipped on every rank and backs the scale off; after
/// growth_interval finite steps in a row the scale grows.
struct LossScaling {
  bool enabled = false;
  double initial_scale = 65536.0;
  int growth_interval = 2000;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  double min_scale = 1.0;          ///< backoff never goes below this
  double max_scale = 16777216.0;   ///< growth never goes above this (2^24)
};
/// What is wrong with `s`, or "". The options are checked also while loss scaling is off
/// (enabled = false): an invalid value is an error at creation either way.
std::string validate(const LossScaling& s);

struct OptimizerOptions {
  Stage stage = Stage::Zero1;
  DType param_dtype = DType::BF16;  ///< dtype of the full replica the forward pass reads
  Device device = Device::Cpu;
  AdamConfig adam;
  /// Gradients are reduced, and stage 1/2 parameters gathered, in buckets of about this many
  /// elements; a larger parameter spans several. 0 (the default): automatic, an eighth of
  /// the model between 4096 and 2^20 elements, 2^24 on Device::Cuda
  /// (FlatLayout::auto_bucket_elems: why), so that stage 2 saves memory on small models too;
  /// raised to the largest Rule::Muon matrix where that is larger (a matrix must fit one
  /// bucket). finalize() stores the size it chose here.
  std::size_t bucket_elems = 0;
  /// Start each bucket's collective as soon as it is complete (and, after the update, gather
  /// the replica bucket by bucket) instead of doing all communication inside step().
  bool overlap = true;
  /// Stage 2: staging buckets that may be in flight at once (memory: this many buckets).
  int buckets_in_flight = 2;
  /// Stage 3: gathered units that may be held at once (acquired or prefetched); memory: this
  /// many buffers of the largest unit, in the parameter dtype, accounted as Params.
  int units_in_flight = 2;
  /// Wire type of the gradient reduction: F32, or BF16 for half the bytes (each partial sum
  /// rounded to bf16: about 3 significant digits; see docs/architecture.md).
  DType reduce_dtype = DType::F32;
  LossScaling loss_scaling;
  /// Default, or Reproducible (see Reduction; needs reduce_dtype F32; on Device::Cuda, stages
  /// 0-2 with ownership Flat: the constructor refuses the rest with Error(InvalidArgument)).
  Reduction reduction = Reduction::Default;
  /// Flat (equal slices of every bucket), or Whole (every parameter on one rank:
  /// ownership.hpp). Rule::Muon and Rule::Adafactor need Whole. Whole runs stages 0-3 on the
  /// CPU with either reduction (stage 3: each rank keeps its owned ranges, units gathered by
  /// uneven all-gathers), and stages 0-2 on Device::Cuda with the default reduction
  /// (docs/cuda.md); finalize() refuses it (Error(Unsupported)) on Device::Cuda at stage 3 or
  /// with Reduction::Reproducible (Adafactor: stages 0-3 with either reduction on the CPU,
  /// stages 0-2 on Device::Cuda like the other rules). Checkpoints do not depend on it: saved
  /// in either ownership, they load in either (checkpoint.hpp).
  Ownership ownership = Ownership::Flat;

  // ---- collective diagnostics (docs/architecture.md, "Errors and collectives") ---------------
  /// Debugging: before every collective, every rank checks that all ranks are entering the
  /// same collective with the same sizes (make_checked_communicator); at the first divergence
  /// every rank throws the same Error(InvalidState) naming it. The environment variable
  /// SHARDOPT_DEBUG_COLLECTIVES=1 turns it on too; it must be on on every rank or none. Cost:
  /// one extra blocking all-gather of 32 bytes per rank before every collective.
  bool debug_collectives = false;
  /// Seconds a rank may wait in one collective (Communicator::set_collective_timeout, which
  /// the constructor calls on the communicator). MPI communicators: the rank prints the call
  /// and collective it waits in, what every other rank is in and which have not arrived, and
  /// every rank waiting in the library throws the same Error(Communication); the program
  /// should end the job with MPI_Abort (comm.hpp, set_collective_timeout). NCCL: the NCCL
  /// communicator is aborted and every rank that can still answer throws the same
  /// Error(Communication) (nccl_comm.hpp); its host-side MPI collectives time out as MPI's.
  /// 0 (the default): SHARDOPT_COLLECTIVE_TIMEOUT if set, else kDefaultCollectiveTimeoutS
  /// (kDebugCollectiveTimeoutS with debug_collectives). kNoCollectiveTimeout (any negative
  /// value): wait forever. The constructor stores the value it chose in options().
  double collective_timeout_s = 0.0;
};

/// The default collective timeout: 10 minutes, PyTorch's process-group default. A rank waits
/// in a collective for its slowest peer; legitimate gaps (rank 0 alone evaluating, writing a
/// log or a checkpoint, a straggling node) last seconds to minutes, a lost rank forever. Long
/// enough for the first, and it turns the second into a report instead of a hang.
inline constexpr double kDefaultCollectiveTimeoutS = 600.0;
/// The default with debug_collectives on: a debugging run wants the report soon.
inline constexpr double kDebugCollectiveTimeoutS = 60.0;
/// collective_timeout_s (or SHARDOPT_COLLECTIVE_TIMEOUT=off) for no timeout.
inline constexpr double kNoCollectiveTimeout = -1.0;

/// SHARDOPT_COLLECTIVE_TIMEOUT: seconds > 0, or 0 / off / none for no timeout (returned as
/// kNoCollectiveTimeout). Returns false, with `problem` set, when it is malformed; true with
/// `seconds` untouched when it is unset or empty.
bool collective_timeout_from_environment(double& seconds, std::string& problem);

/// Applies the environment variables SHARDOPT_DEBUG_COLLECTIVES (1 turns debug_collectives
/// on; 0 or empty: no change) and SHARDOPT_COLLECTIVE_TIMEOUT (used when collective_timeout_s
/// is 0) to `o`, then resolves the default: afterwards collective_timeout_s is > 0 (seconds)
/// or kNoCollectiveTimeout. Returns what is wrong with them, or an empty string.
std::string apply_environment(OptimizerOptions& o);

}  // namespace shardopt
