// train_mlp.cpp: a small data-parallel trainer that uses shardopt as its optimizer.
//
// A two-layer MLP (16 -> 64 -> 4, ReLU) learns a fixed "teacher" function on a synthetic data
// set generated deterministically from the global sample index, so any rank count sees the
// same global batch: each rank takes a contiguous slice of it. The forward pass reads the
// bf16 replica the optimizer keeps; backward writes fp32 gradients into the optimizer; the
// optimizer reduce-scatters, clips, updates its shard and all-gathers.
//
//   mpiexec -n 2 ./train_mlp [--steps N] [--stage 0|1|2|3] [--dtype bf16|fp32]
//                            [--micro-batches K] [--no-overlap]
//                            [--rule adamw|lion|adamw8bit] [--min-8bit-numel N]
//                            [--muon | --adafactor]
//                            [--loss-out FILE] [--check-against FILE] [--params-out FILE]
//   ./train_mlp --help
//
// Each rank's slice of the batch is split into K micro-batches (default 2): all but the last
// accumulate gradients locally with no communication; during the last one each bucket's
// reduction starts as soon as its gradients are ready (overlapped with the rest of
// backward). --micro-batches 1 --no-overlap is the plain step, for comparison: with the same
// K, overlap on and off give bit-identical weights.
//
// --stage 3 shards the parameters too: each layer is a unit, and the forward pass acquires
// layer 1 while prefetching layer 2, releases it, then acquires layer 2 (already in flight).
//
// --rule picks both groups' update rule (AdamW by default); --min-8bit-numel sets AdamW8bit's
// threshold (parameters with fewer elements keep fp32 state; 4096 by default, which keeps
// this model's matrices fp32 too: 256 makes both matrices 8-bit).
//
// --muon adds a hidden layer fch (64 -> 96, ReLU) between fc1 and fc2 whose 96 x 64 weight is
// a Rule::Muon matrix (add_param with a Shape2D), with Ownership::Whole and the automatic
// bucket size; fc1 (the input layer), fc2 (the head) and the biases keep --rule, as usual
// for Muon. Stages 0-2 (the trainer acquires no hidden unit at stage 3).
//
// --adafactor adds the same hidden layer, both of its parameters in a Rule::Adafactor group
// (torch.optim.Adafactor's defaults, weight_decay off as torch's): its 96 x 64 weight keeps
// factored statistics (row_var, col_var), its bias a per-element variance; Ownership::Whole
// and the automatic bucket size as for --muon; fc1, fc2 and their biases keep --rule.
//
// --params-out writes the final fp32 master weights of every parameter, in order, as raw
// floats; the C and Fortran trainers (examples/c, examples/fortran) write the same file.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "cli.hpp"
#include "shardopt/optimizer.hpp"
#ifdef SHARDOPT_WITH_MPI
#include <mpi.h>

#include "shardopt/mpi_comm.hpp"
#endif

using namespace shardopt;

namespace {

constexpr int kIn = 16, kHidden = 64, kMid = 96, kOut = 4;
constexpr int kGlobalBatch = 96;  // divisible by 1, 2, 3, 4, 6, 8 ranks

// Deterministic uniform value in [-1, 1) from integers (splitmix64).
float uniform(std::uint64_t a, std::uint64_t b) {
  std::uint64_t z = a * 0x9E3779B97F4A7C15ull + b * 0xD1B54A32D192ED03ull + 0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(static_cast<double>(z >> 11) * 0x1.0p-53 * 2.0 - 1.0);
}

// The data set: sample s of step t has inputs x and targets y = teacher(x).
void make_sample(int step, int s, float* x, float* y) {
  const std::uint64_t id = static_cast<std::uint64_t>(step) * kGlobalBatch + static_cast<std::uint64_t>(s);
  for (int i = 0; i < kIn; ++i) x[i] = uniform(id, static_cast<std::uint64_t>(i));
  for (int o = 0; o < kOut; ++o) {
    double acc = 0;
    for (int i = 0; i < kIn; ++i) acc += uniform(1000003 + o, static_cast<std::uint64_t>(i)) * x[i];
    y[o] = static_cast<float>(std::sin(acc));
  }
}

struct Options {
  int steps = 200;
  Stage stage = Stage::Zero1;
  DType dtype = DType::BF16;
  int micro_batches = 2;
  bool overlap = true;
  /// --reproducible: the global batch is split into micro-batches of this many samples
  /// (--micro-batch-size), dealt to the ranks blocked or round-robin (--assign); the
  /// optimizer sums them exactly, so any rank count gives the same bits.
  bool reproducible = false;
  int micro_batch_size = 8;
  bool round_robin = false;
  Rule rule = Rule::AdamW;
  std::size_t min_8bit_numel = AdamW8bitConfig{}.min_8bit_numel;
  bool muon = false;
  bool adafactor = false;
  std::string loss_out, check_against, params_out;
};

// The command line; returns the exit code after --help, --version or bad input (printed on
// rank 0 only), or -1 to train.
int parse(int argc, char** argv, bool print, Options& o) {
  CLI::App app{"A small data-parallel MLP trainer that uses shardopt as its optimizer; run it "
               "under mpiexec."};
  cli::init(app, "train_mlp");
  app.add_option("--steps", o.steps, "optimizer steps")->check(CLI::Range(1, 1 << 30))
      ->capture_default_str();
  app.add_option("--stage", o.stage, "0 (data-parallel), 1, 2 or 3")
      ->transform(cli::choice<Stage>({{"0", Stage::DataParallel}, {"dp", Stage::DataParallel},
                                      {"1", Stage::Zero1}, {"2", Stage::Zero2},
                                      {"3", Stage::Zero3}}))
      ->default_str("1");
  app.add_option("--dtype", o.dtype, "the parameter replica")
      ->transform(cli::choice<DType>({{"bf16", DType::BF16}, {"fp32", DType::F32}}))
      ->default_str("bf16");
  app.add_option("--micro-batches", o.micro_batches,
                 "micro-batches per step (all but the last accumulate without communication)")
      ->check(CLI::Range(1, kGlobalBatch))->capture_default_str();
  app.add_flag("--no-overlap{false}", o.overlap, "reduce buckets in step(), not during backward");
  app.add_flag("--reproducible", o.reproducible,
               "Reduction::Reproducible: the same loss curve and weights, bit for bit, at any "
               "rank count (micro-batches of --micro-batch-size samples; --micro-batches is "
               "then ignored)");
  app.add_option("--micro-batch-size", o.micro_batch_size,
                 "with --reproducible: samples per micro-batch (must divide the global batch "
                 "of 96 into a multiple of the rank count)")
      ->check(CLI::Range(1, kGlobalBatch))->capture_default_str();
  app.add_option("--assign", o.round_robin,
                 "with --reproducible: which micro-batches a rank computes")
      ->transform(cli::choice<bool>({{"blocked", false}, {"round-robin", true}}))
      ->default_str("blocked");
  app.add_option("--rule", o.rule, "the update rule of every parameter group")
      ->transform(cli::choice<Rule>({{"adamw", Rule::AdamW}, {"lion", Rule::Lion},
                                     {"adamw8bit", Rule::AdamW8bit}}))
      ->default_str("adamw");
  app.add_option("--min-8bit-numel", o.min_8bit_numel,
                 "with --rule adamw8bit: parameters with fewer elements keep fp32 state")
      ->capture_default_str();
  auto* muon = app.add_flag("--muon", o.muon,
                            "add a hidden 64 -> 96 layer whose weight Muon trains "
                            "(Ownership::Whole)");
  app.add_flag("--adafactor", o.adafactor,
               "add a hidden 64 -> 96 layer that Adafactor trains, its weight factored "
               "(Ownership::Whole)")
      ->excludes(muon);
  app.add_option("--loss-out", o.loss_out, "write the loss curve (one value per step)");
  app.add_option("--check-against", o.check_against,
                 "compare the loss curve with this file; fail beyond the tolerance")
      ->check(CLI::ExistingFile);
  app.add_option("--params-out", o.params_out, "write the final fp32 master weights (raw floats)");
  return cli::parse(app, argc, argv, print);
}

// Reads parameter p as float, whatever the replica dtype.
std::vector<float> read_param(ShardedOptimizer& opt, std::size_t p) {
  std::vector<float> out(opt.layout().param(p).numel);
  if (opt.options().param_dtype == DType::BF16) {
    auto v = opt.param<bf16>(p);
    for (std::size_t k = 0; k < out.size(); ++k) out[k] = to_float(v[k]);
  } else {
    auto v = opt.param<float>(p);
    std::copy(v.begin(), v.end(), out.begin());
  }
  return out;
}

double sum_over_ranks(Communicator& comm, double x) {
  comm.all_reduce_sum_host(&x, 1);
  return x;
}

int run(std::shared_ptr<Communicator> comm, const Options& cli) {
  const int rank = comm->rank(), world = comm->size();
  if (kGlobalBatch % world != 0) {
    if (rank == 0) std::fprintf(stderr, "global batch %d does not divide over %d ranks\n", kGlobalBatch, world);
    return 2;
  }
  OptimizerOptions o;
  o.stage = cli.stage;
  o.param_dtype = cli.dtype;
  o.adam.lr = 1e-2;
  o.adam.weight_decay = 0.01;
  o.adam.max_grad_norm = 1.0;
  o.bucket_elems = 1024;  // several buckets even for this small model
  o.overlap = cli.overlap;
  if (cli.reproducible) o.reduction = Reduction::Reproducible;
  // The hidden layer (--muon, --adafactor) and its whole-tensor rule.
  const bool hidden = cli.muon || cli.adafactor;
  if (hidden) {
    o.ownership = Ownership::Whole;  // each Muon/Adafactor tensor updated whole by one rank
    o.bucket_elems = 0;  // automatic: raised to the largest such tensor, which must fit a bucket
  }
  ShardedOptimizer opt(comm, o);
  GroupOptions decay{1.0, true}, no_decay_group{1.0, false};
  for (GroupOptions* g : {&decay, &no_decay_group}) {
    g->rule = cli.rule;
    g->adamw8bit.min_8bit_numel = cli.min_8bit_numel;
  }
  opt.set_group(0, decay);
  const int no_decay = opt.add_group(no_decay_group);
  // Muon's defaults (torch.optim.Muon's), with decay; Adafactor's (torch.optim.Adafactor's),
  // without decay as torch's default.
  GroupOptions hidden_group;
  hidden_group.rule = cli.adafactor ? Rule::Adafactor : Rule::Muon;
  hidden_group.weight_decay = !cli.adafactor;
  const int hidden_g = hidden ? opt.add_group(hidden_group) : 0;
  const int mid = hidden ? kMid : kHidden;  // fc2's inputs
  // Stage 3 gathers parameters a unit (here: a layer) at a time. Units are declared at every
  // stage, as the C and Fortran trainers do, so that all stages share one layout.
  const bool zero3 = cli.stage == Stage::Zero3;
  const std::size_t layer1 = static_cast<std::size_t>(opt.begin_unit());
  const std::size_t W1 = opt.add_param("fc1.weight", kHidden * kIn);
  const std::size_t B1 = opt.add_param("fc1.bias", kHidden, no_decay);
  std::size_t WH = 0, BH = 0;  // the hidden layer (--muon, --adafactor)
  if (hidden) {
    opt.begin_unit();
    WH = opt.add_param("fch.weight", Shape2D{kMid, kHidden}, hidden_g);  // row-major (out, in)
    BH = opt.add_param("fch.bias", kMid, cli.adafactor ? hidden_g : no_decay);
  }
  const std::size_t layer2 = static_cast<std::size_t>(opt.begin_unit());
  const std::size_t W2 = opt.add_param("fc2.weight", static_cast<std::size_t>(kOut * mid));
  const std::size_t B2 = opt.add_param("fc2.bias", kOut, no_decay);
  opt.finalize();

  // Same initial values on every rank (scaled uniform, like Kaiming-uniform).
  auto init = [&](std::size_t p, float scale, std::uint64_t seed) {
    std::vector<float> v(opt.layout().param(p).numel);
    for (std::size_t k = 0; k < v.size(); ++k) v[k] = scale * uniform(seed, k);
    opt.set_param(p, v);
  };
  init(W1, 1.0f / std::sqrt(static_cast<float>(kIn)), 11);
  init(B1, 0.0f, 12);
  init(W2, 1.0f / std::sqrt(static_cast<float>(mid)), 13);
  init(B2, 0.0f, 14);
  if (hidden) {
    init(WH, 1.0f / std::sqrt(static_cast<float>(kHidden)), 15);
    init(BH, 0.0f, 16);
  }

  const int local = kGlobalBatch / world, first = rank * local;
  if (cli.micro_batches < 1 || local % cli.micro_batches != 0) {
    if (rank == 0)
      std::fprintf(stderr, "%d samples per rank do not split into %d micro-batches\n", local,
                   cli.micro_batches);
    return 2;
  }
  int micro = local / cli.micro_batches;
  // This rank's micro-batches, by global index: [first sample, end).
  std::vector<int> mb_first;
  int num_mb = kGlobalBatch;  // global micro-batches (reproducible mode)
  if (cli.reproducible) {
    micro = cli.micro_batch_size;
    num_mb = kGlobalBatch / micro;
    if (kGlobalBatch % micro != 0 || num_mb % world != 0) {
      if (rank == 0)
        std::fprintf(stderr, "micro-batches of %d samples do not split the global batch of %d "
                     "evenly over %d ranks\n", micro, kGlobalBatch, world);
      return 2;
    }
    const int per_rank = num_mb / world;
    for (int q = 0; q < per_rank; ++q)
      mb_first.push_back(micro * (cli.round_robin ? q * world + rank : rank * per_rank + q));
  } else {
    for (int mb = 0; mb < cli.micro_batches; ++mb) mb_first.push_back(first + mb * micro);
  }
  std::vector<double> losses;
  std::vector<float> x(kIn), y(kOut), h(kHidden), out(kOut), dout(kOut), dh(kHidden);
  std::vector<float> h2(kMid), dh2(kMid);  // the hidden layer's (--muon, --adafactor)
  for (int step = 0; step < cli.steps; ++step) {
    // Linear warm-up then cosine decay; set on every rank alike.
    const double warm = 20, peak = 1e-2;
    const double lr = step < warm ? peak * (step + 1) / warm
                                  : peak * 0.5 * (1 + std::cos(M_PI * (step - warm) / (cli.steps - warm)));
    opt.set_lr(lr);
    // Forward reads each layer; at stage 3 the layer is acquired (gathered) first, the next
    // one prefetched so its gather overlaps this layer's use, and released after use.
    if (zero3) {
      opt.acquire(layer1);
      opt.prefetch(layer2);
    }
    const std::vector<float> w1 = read_param(opt, W1), b1 = read_param(opt, B1);
    if (zero3) {
      opt.release(layer1);
      opt.acquire(layer2);
    }
    const std::vector<float> w2 = read_param(opt, W2), b2 = read_param(opt, B2);
    if (zero3) opt.release(layer2);
    std::vector<float> wh, bh;
    if (hidden) wh = read_param(opt, WH), bh = read_param(opt, BH);
    double local_sse = 0;
    std::vector<double> mb_sse(static_cast<std::size_t>(num_mb), 0.0);  // reproducible mode
    for (std::size_t mb = 0; mb < mb_first.size(); ++mb) {
      opt.begin_backward(/*sync=*/mb + 1 == mb_first.size());
      std::vector<float> gw1(w1.size(), 0), gb1(b1.size(), 0), gw2(w2.size(), 0), gb2(b2.size(), 0);
      std::vector<float> gwh(wh.size(), 0), gbh(bh.size(), 0);
      double sse_mb = 0;  // this micro-batch's, alone
      for (int s = mb_first[mb]; s < mb_first[mb] + micro; ++s) {
        make_sample(step, s, x.data(), y.data());
        for (int j = 0; j < kHidden; ++j) {
          float a = b1[j];
          for (int i = 0; i < kIn; ++i) a += w1[j * kIn + i] * x[i];
          h[j] = a > 0 ? a : 0;
        }
        if (hidden) {
          for (int m = 0; m < kMid; ++m) {
            float a = bh[m];
            for (int j = 0; j < kHidden; ++j) a += wh[m * kHidden + j] * h[j];
            h2[m] = a > 0 ? a : 0;
          }
        }
        const std::vector<float>& last = hidden ? h2 : h;  // what fc2 reads
        std::vector<float>& dlast = hidden ? dh2 : dh;
        for (int o2 = 0; o2 < kOut; ++o2) {
          float a = b2[o2];
          for (int j = 0; j < mid; ++j) a += w2[o2 * mid + j] * last[j];
          out[o2] = a;
          const float e = a - y[o2];
          sse_mb += static_cast<double>(e) * e;
          dout[o2] = 2.0f * e / static_cast<float>(micro);  // d(mean over micro-batch)/d out
        }
        // Backward, layer 2 (the hidden layer with --muon or --adafactor) then layer 1.
        for (int j = 0; j < mid; ++j) dlast[j] = 0;
        for (int o2 = 0; o2 < kOut; ++o2) {
          gb2[o2] += dout[o2];
          for (int j = 0; j < mid; ++j) {
            gw2[o2 * mid + j] += dout[o2] * last[j];
            dlast[j] += dout[o2] * w2[o2 * mid + j];
          }
        }
        if (hidden) {
          for (int j = 0; j < kHidden; ++j) dh[j] = 0;
          for (int m = 0; m < kMid; ++m) {
            if (h2[m] <= 0) continue;
            gbh[m] += dh2[m];
            for (int j = 0; j < kHidden; ++j) {
              gwh[m * kHidden + j] += dh2[m] * h[j];
              dh[j] += dh2[m] * wh[m * kHidden + j];
            }
          }
        }
        for (int j = 0; j < kHidden; ++j) {
          if (h[j] <= 0) continue;
          gb1[j] += dh[j];
          for (int i = 0; i < kIn; ++i) gw1[j * kIn + i] += dh[j] * x[i];
        }
      }
      // Hand the gradients over in backward order (stage 2 reduces bucket by bucket).
      opt.accumulate_grad(B2, std::span<const float>(gb2));
      opt.grad_ready(B2);
      opt.accumulate_grad(W2, std::span<const float>(gw2));
      opt.grad_ready(W2);
      if (hidden) {
        opt.accumulate_grad(BH, std::span<const float>(gbh));
        opt.grad_ready(BH);
        opt.accumulate_grad(WH, std::span<const float>(gwh));
        opt.grad_ready(WH);
      }
      opt.accumulate_grad(B1, std::span<const float>(gb1));
      opt.grad_ready(B1);
      opt.accumulate_grad(W1, std::span<const float>(gw1));
      opt.grad_ready(W1);
      local_sse += sse_mb;
      mb_sse[static_cast<std::size_t>(mb_first[mb] / micro) % mb_sse.size()] = sse_mb;
    }  // micro-batches: step() averages over them and over ranks
    const StepResult r = opt.step();

    double loss = 0;
    if (cli.reproducible) {
      // Each micro-batch's loss sits in its own slot (the others add zeros, exactly), then
      // the slots are summed in micro-batch order: the same bits at any rank count.
      comm->all_reduce_sum_host(mb_sse.data(), mb_sse.size());
      for (double v : mb_sse) loss += v;
      loss /= kGlobalBatch;
    } else {
      loss = sum_over_ranks(*comm, local_sse) / kGlobalBatch;
    }
    losses.push_back(loss);
    if (rank == 0 && (step % 20 == 0 || step == cli.steps - 1))
      std::printf("step %4d  loss %.6f  grad_norm %.4f%s%s  lr %.2e\n", step, loss, r.grad_norm,
                  r.clipped ? " (clipped)" : "", r.skipped ? " (skipped)" : "", lr);
  }

  // Per-rank optimizer memory next to what unsharded (data-parallel) training holds.
  const MemoryReport m = opt.memory_report();
  const std::size_t P = opt.layout().padded_size();
  const std::size_t unsharded = P * dtype_size(cli.dtype) + P * 4 /*grads*/ +
                                (cli.dtype == DType::BF16 ? P * 4 : 0) /*master*/ + P * 8 /*m, v*/;
  for (int r = 0; r < world; ++r) {
    if (r == rank)
      std::printf("rank %d memory (%s, %s): params %zu  grads %zu  master %zu  moments %zu  "
                  "scratch %zu  total %zu bytes; unsharded data-parallel: %zu bytes (%.2fx)\n",
                  rank, stage_name(cli.stage), dtype_name(cli.dtype), m[MemCategory::Params],
                  m[MemCategory::Grads], m[MemCategory::Master], m[MemCategory::Moments],
                  m[MemCategory::Scratch], m.total(), unsharded,
                  static_cast<double>(unsharded) / static_cast<double>(m.total()));
    std::fflush(stdout);
    comm->barrier();
  }

  int rc = 0;
  if (!cli.params_out.empty()) {
    std::ofstream f;
    if (rank == 0) f.open(cli.params_out, std::ios::binary);
    for (std::size_t p = 0; p < opt.layout().num_params(); ++p) {
      std::vector<float> master(opt.layout().param(p).numel);
      opt.get_master(p, master);  // collective
      if (rank == 0)
        f.write(reinterpret_cast<const char*>(master.data()),
                static_cast<std::streamsize>(master.size() * sizeof(float)));
    }
    if (rank == 0 && !f) {
      std::fprintf(stderr, "cannot write %s\n", cli.params_out.c_str());
      rc = 1;
    }
  }
  if (rank == 0 && !cli.loss_out.empty()) {
    std::ofstream f(cli.loss_out);
    f.precision(17);
    for (double l : losses) f << l << "\n";
  }
  if (rank == 0 && !cli.check_against.empty()) {
    std::ifstream f(cli.check_against);
    std::vector<double> ref;
    for (double v; f >> v;) ref.push_back(v);
    if (ref.size() != losses.size()) {
      std::fprintf(stderr, "loss curve length %zu != reference %zu\n", losses.size(), ref.size());
      rc = 1;
    }
    double worst = 0;
    for (std::size_t i = 0; i < std::min(ref.size(), losses.size()); ++i)
      worst = std::max(worst, std::fabs(losses[i] - ref[i]) / std::max(1e-12, std::fabs(ref[i])));
    // Ranks change only the order of fp32 gradient sums (per-rank partial sums). With an
    // fp32 replica the curves agree to ~1e-7; a bf16 replica turns some of those last-bit
    // differences into bf16 rounding flips that grow slowly over steps (~2e-3 after 200).
    const double tol = cli.dtype == DType::F32 ? 1e-5 : 5e-3;
    std::printf("loss curve vs %s: max relative difference %.3e (tolerance %.0e)\n",
                cli.check_against.c_str(), worst, tol);
    if (worst > tol) rc = 1;
    if (losses.back() > 0.5 * losses.front()) {
      std::fprintf(stderr, "training did not reduce the loss (%.4f -> %.4f)\n", losses.front(), losses.back());
      rc = 1;
    }
  }
  double any = rc;
  comm->all_reduce_sum_host(&any, 1);
  return any != 0 ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  int rank = 0;
#ifdef SHARDOPT_WITH_MPI
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
#endif
  int rc = 0;
  try {
    Options options;
    rc = parse(argc, argv, rank == 0, options);
    if (rc < 0) {
#ifdef SHARDOPT_WITH_MPI
      rc = run(make_mpi_communicator(MPI_COMM_WORLD), options);
#else
      rc = run(make_single_process_communicator(), options);
#endif
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "train_mlp: %s: %s\n", status_name(e.status()), e.what());
    rc = 1;
#ifdef SHARDOPT_WITH_MPI
    // A collective timeout: the missing ranks would keep MPI_Finalize waiting.
    if (e.status() == Status::Communication) MPI_Abort(MPI_COMM_WORLD, 1);
#endif
  }
#ifdef SHARDOPT_WITH_MPI
  MPI_Finalize();
#endif
  return rc;
}
