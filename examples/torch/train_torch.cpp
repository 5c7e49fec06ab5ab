// train_torch.cpp: a LibTorch trainer (a deep residual MLP with LayerNorm on synthetic data)
// whose optimizer is shardopt, through the LibTorch adapter. The lines a LibTorch trainer
// changes from torch::optim::AdamW are marked "shardopt:".
//
//   mpiexec -n 2 train_torch --stage 2                  # shardopt, each rank its half-batch
//   train_torch --optimizer torch --loss-out ref.txt    # torch::optim::AdamW, full batch
//   mpiexec -n 2 train_torch --check-against ref.txt    # the two loss curves agree?
//   mpiexec -n 2 train_torch --comm gloo                # no MPI: LibTorch's c10d gloo group
//
// Options: --steps N --stage 0|1|2|3 --dtype fp32|bf16 --micro-batches K --optimizer
// shardopt|torch --comm mpi|gloo --loss-out FILE --check-against FILE --rtol X.
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cli.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/torch/optimizer.hpp"  // shardopt: the adapter
#if SHARDOPT_EXAMPLE_MPI
#include <mpi.h>

#include "shardopt/mpi_comm.hpp"
#endif
#if SHARDOPT_HAVE_C10D
#include "shardopt/torch/c10d_comm.hpp"
#endif

using namespace shardopt;

namespace {

constexpr int kGlobalBatch = 48, kIn = 32, kWidth = 64, kOut = 8, kBlocks = 6;

// A residual block: x + W2 gelu(W1 layernorm(x)).
struct BlockImpl : torch::nn::Module {
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear up{nullptr}, down{nullptr};
  BlockImpl() {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})));
    up = register_module("up", torch::nn::Linear(kWidth, 2 * kWidth));
    down = register_module("down", torch::nn::Linear(2 * kWidth, kWidth));
  }
  torch::Tensor forward(torch::Tensor x) {
    return x + down->forward(torch::gelu(up->forward(norm->forward(x))));
  }
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  torch::nn::Linear in{nullptr}, out{nullptr};
  std::vector<Block> blocks;
  NetImpl() {
    in = register_module("in", torch::nn::Linear(kIn, kWidth));
    for (int b = 0; b < kBlocks; ++b)
      blocks.push_back(register_module("block" + std::to_string(b), Block()));
    out = register_module("out", torch::nn::Linear(kWidth, kOut));
  }
  // shardopt: at stage 3 each layer is a unit whose forward runs through unit_forward (it
  // gathers the layer's parameters around it, and again in backward); `opt` null: plain calls.
  torch::Tensor forward(torch::Tensor x, libtorch::ShardedAdamW* opt = nullptr) {
    std::size_t unit = 0;
    auto run = [&](const std::function<torch::Tensor()>& f) {
      return opt ? opt->unit_forward(unit++, f) : f();
    };
    x = run([&] { return in->forward(x); });
    for (auto& b : blocks) x = run([&] { return b->forward(x); });
    return run([&] { return out->forward(x); });
  }
  // The units, in forward order.
  std::vector<std::shared_ptr<torch::nn::Module>> layers() {
    std::vector<std::shared_ptr<torch::nn::Module>> v{in.ptr()};
    for (auto& b : blocks) v.push_back(b.ptr());
    v.push_back(out.ptr());
    return v;
  }
};
TORCH_MODULE(Net);

// Synthetic regression: the global batch of step s, the same in every process.
std::pair<torch::Tensor, torch::Tensor> global_batch(int s) {
  torch::manual_seed(10'000 + s);
  torch::Tensor x = torch::randn({kGlobalBatch, kIn});
  torch::Tensor y = torch::tanh(x.narrow(1, 0, kOut) * 1.5) * x.narrow(1, kOut, kOut);
  return {x, y};
}

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& y) {
  return (out.to(torch::kFloat) - y).pow(2).mean();  // bf16 has no CPU mse_loss in 1.13
}

struct Options {
  int steps = 60;
  Stage stage = Stage::Zero1;
  bool bf16 = false;
  int micro_batches = 1;
  bool torch_optimizer = false;
  bool gloo = false;
  double rtol = 1e-5;
  std::string loss_out, check_against;
};

int parse(int argc, char** argv, bool print, Options& o) {
  CLI::App app{"A LibTorch trainer (deep residual MLP, synthetic data) with shardopt as its "
               "optimizer; run it under mpiexec. --optimizer torch trains the same model with "
               "torch::optim::AdamW in one process on the full batch."};
  cli::init(app, "train_torch");
  app.add_option("--steps", o.steps, "optimizer steps")->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--stage", o.stage, "0 (data-parallel), 1, 2 or 3 (each layer a unit)")
      ->transform(cli::choice<Stage>({{"0", Stage::DataParallel}, {"1", Stage::Zero1},
                                      {"2", Stage::Zero2}, {"3", Stage::Zero3}}))
      ->default_str("1");
  app.add_option("--dtype", o.bf16, "the model's parameters")
      ->transform(cli::choice<bool>({{"fp32", false}, {"bf16", true}}))->default_str("fp32");
  app.add_option("--micro-batches", o.micro_batches,
                 "micro-batches per step and rank (all but the last under no_sync())")
      ->check(CLI::Range(1, kGlobalBatch))->capture_default_str();
  app.add_option("--optimizer", o.torch_optimizer, "shardopt (sharded, any rank count) or torch "
                 "(torch::optim::AdamW, one process, full batch)")
      ->transform(cli::choice<bool>({{"shardopt", false}, {"torch", true}}))
      ->default_str("shardopt");
  app.add_option("--comm", o.gloo, "mpi, or gloo: LibTorch's c10d gloo group, no MPI (ranks "
                 "from RANK/WORLD_SIZE or mpiexec's PMI_RANK/PMI_SIZE, rendezvous through "
                 "SHARDOPT_GLOO_FILE or MASTER_ADDR/MASTER_PORT)")
      ->transform(cli::choice<bool>({{"mpi", false}, {"gloo", true}}))->default_str("mpi");
  app.add_option("--loss-out", o.loss_out, "write the loss curve (one value per step)");
  app.add_option("--check-against", o.check_against,
                 "compare the loss curve with this file; fail beyond --rtol")
      ->check(CLI::ExistingFile);
  app.add_option("--rtol", o.rtol, "relative tolerance of --check-against")
      ->check(CLI::Range(0.0, 1.0))->capture_default_str();
  return cli::parse(app, argc, argv, print);
}

// The loss curve against a file written by --loss-out; returns 0 when every step agrees.
int check_curve(const std::vector<double>& losses, const std::string& path, double rtol) {
  std::ifstream f(path);
  std::vector<double> ref;
  for (double v; f >> v;) ref.push_back(v);
  if (ref.size() != losses.size()) {
    std::fprintf(stderr, "train_torch: %s has %zu steps, this run %zu\n", path.c_str(),
                 ref.size(), losses.size());
    return 1;
  }
  double worst = 0.0;
  std::size_t at = 0;
  for (std::size_t s = 0; s < ref.size(); ++s) {
    const double rel = std::abs(losses[s] - ref[s]) / std::max(std::abs(ref[s]), 1e-12);
    if (rel > worst) worst = rel, at = s;
  }
  std::printf("loss curve vs %s: max relative difference %.3g at step %zu (tolerance %.3g)\n",
              path.c_str(), worst, at, rtol);
  return worst <= rtol ? 0 : 1;
}

int train(const Options& o, std::shared_ptr<Communicator> comm) {
  const int rank = comm ? comm->rank() : 0, world = comm ? comm->size() : 1;
  if (kGlobalBatch % (world * o.micro_batches) != 0)
    throw Error(Status::InvalidArgument,
                "the global batch of " + std::to_string(kGlobalBatch) +
                    " samples does not split into " + std::to_string(world) + " ranks x " +
                    std::to_string(o.micro_batches) + " micro-batches");
  torch::manual_seed(1);
  Net net;
  if (o.bf16) net->to(torch::kBFloat16);

  const auto adamw = torch::optim::AdamWOptions(2e-3).weight_decay(0.01);
  std::unique_ptr<torch::optim::Optimizer> opt;
  libtorch::ShardedAdamW* sharded = nullptr;
  if (o.torch_optimizer) {
    opt = std::make_unique<torch::optim::AdamW>(net->parameters(), adamw);
  } else {
    OptimizerOptions so;  // shardopt: stage, clipping; the rest comes from AdamWOptions
    so.stage = o.stage;
    so.adam.max_grad_norm = 1.0;
    so.bucket_elems = 16 * 1024;
    auto s = o.stage == Stage::Zero3  // shardopt: stage 3 registers the layers as units
                 ? std::make_unique<libtorch::ShardedAdamW>(
                       libtorch::ShardedAdamW::units_of(net->layers()), adamw, comm, so)
                 : std::make_unique<libtorch::ShardedAdamW>(net->named_parameters(), adamw,
                                                            comm, so);
    sharded = s.get();
    opt = std::move(s);
  }

  const int rows = kGlobalBatch / world / o.micro_batches;
  std::vector<double> losses;
  for (int step = 0; step < o.steps; ++step) {
    auto [x, y] = global_batch(step);
    if (o.bf16) x = x.to(torch::kBFloat16);
    double loss_sum = 0.0;  // sum over this rank's micro-batches of their mean loss
    if (sharded) sharded->zero_grad(); else opt->zero_grad();
    for (int m = 0; m < o.micro_batches; ++m) {
      const int first = (rank * o.micro_batches + m) * rows;
      torch::Tensor loss =
          mse(net->forward(x.narrow(0, first, rows), sharded), y.narrow(0, first, rows));
      loss_sum += loss.item<double>();
      if (sharded && m + 1 < o.micro_batches) {
        auto no_sync = sharded->no_sync();  // shardopt: accumulate without communication
        loss.backward();
      } else {
        loss.backward();
      }
    }
    if (!sharded) torch::nn::utils::clip_grad_norm_(net->parameters(), 1.0);
    opt->step();
    double mean = loss_sum / o.micro_batches;
    if (comm) {  // the full batch's mean loss (equal shares)
      comm->all_reduce_sum_host(&mean, 1);
      mean /= world;
    }
    losses.push_back(mean);
    if (rank == 0 && (step % 10 == 0 || step == o.steps - 1)) {
      std::printf("step %4d  loss %.6f", step, mean);
      if (sharded)
        std::printf("  grad_norm %.4f%s", sharded->last_result().grad_norm,
                    sharded->last_result().clipped ? " (clipped)" : "");
      std::printf("\n");
    }
  }

  std::size_t numel = 0;
  for (const auto& p : net->parameters()) numel += static_cast<std::size_t>(p.numel());
  const std::size_t elt = o.bf16 ? 2 : 4;
  // torch::optim::AdamW on one rank: parameters, gradients and two fp32 moments (its state
  // has the parameters' dtype, fp32 here; a bf16 model has no fp32 master).
  const std::size_t unsharded = numel * (elt + elt + 2 * elt);
  if (sharded) {
    const MemoryReport m = sharded->memory_report();
    for (int r = 0; r < world; ++r) {
      if (r == rank)
        std::printf("rank %d optimizer memory (%s, %s, %zu parameters): params %zu  grads %zu  "
                    "master %zu  moments %zu  scratch %zu  total %zu bytes; "
                    "torch::optim::AdamW unsharded: %zu bytes\n",
                    rank, stage_name(o.stage), o.bf16 ? "bf16" : "fp32", numel,
                    m[MemCategory::Params], m[MemCategory::Grads], m[MemCategory::Master],
                    m[MemCategory::Moments], m[MemCategory::Scratch], m.total(), unsharded);
      std::fflush(stdout);
      comm->barrier();
    }
  } else {
    std::printf("torch::optim::AdamW (one process, %zu parameters): %zu bytes of parameters, "
                "gradients and moments\n", numel, unsharded);
  }

  int rc = 0;
  if (rank == 0 && !o.loss_out.empty()) {
    std::ofstream f(o.loss_out);
    f.precision(17);
    for (double l : losses) f << l << "\n";
    if (!f) {
      std::fprintf(stderr, "train_torch: cannot write %s\n", o.loss_out.c_str());
      rc = 1;
    }
  }
  if (rank == 0 && !o.check_against.empty()) rc |= check_curve(losses, o.check_against, o.rtol);
  if (comm) {
    double any = rc;
    comm->all_reduce_sum_host(&any, 1);
    rc = any != 0 ? 1 : 0;
  }
  return rc;
}

// Which process this is before any communicator exists (to print --help once).
bool first_process() {
  for (const char* v : {"PMI_RANK", "OMPI_COMM_WORLD_RANK", "RANK"})
    if (const char* s = std::getenv(v)) return std::atoi(s) == 0;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  int rc = parse(argc, argv, first_process(), o);
  if (rc >= 0) return rc;
  bool mpi = false;
  try {
    std::shared_ptr<Communicator> comm;
    if (o.torch_optimizer) {
      // One process: torch::optim::AdamW needs no communicator.
    } else if (o.gloo) {
#if SHARDOPT_HAVE_C10D
      comm = libtorch::make_gloo_communicator_from_env();
#else
      throw Error(Status::Unsupported, "--comm gloo: this build has no c10d communicator "
                                       "(LibTorch's gloo headers were not found)");
#endif
    } else {
#if SHARDOPT_EXAMPLE_MPI
      MPI_Init(&argc, &argv);
      mpi = true;
      comm = make_mpi_communicator(MPI_COMM_WORLD);
#else
      comm = make_single_process_communicator();
#endif
    }
    rc = train(o, comm);
  } catch (const Error& e) {
    std::fprintf(stderr, "train_torch: %s: %s\n", status_name(e.status()), e.what());
    rc = 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_torch: %s\n", e.what());
    rc = 1;
  }
#if SHARDOPT_EXAMPLE_MPI
  if (mpi) MPI_Finalize();
#endif
  return rc;
}
