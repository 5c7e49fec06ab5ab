// bench_cuda_step.cpp: the optimizer step on one GPU (Device::Cuda, the one-process device
// communicator, fp32 master, bf16 replica), per stage, for a model of --params parameters in
// tensors of --tensor-elems (stage 3: one unit per tensor), against the fused AdamW kernel
// alone on as many elements (the floor of an update that must read and write every byte of
// the state once). When the planner says the model does not fit in 90% of the free device
// memory, the largest one that fits is run instead, and said.
//
// The step's phases come from device events on the compute stream, recorded by a wrapper
// of the communicator at the step's calls into it (no change to the optimizer):
//   reduce  step start -> the last reduce-scatter's wait()
//   norm    -> the norm's host all-reduce (after every bucket's sum of squares)
//   update  -> the step's end: every bucket's fused update, then the clearing of the
//           gradient buffers (one rank has no all-gather, and no call into the communicator
//           between the two); the clearing alone, a memset of the gradient buffer's bytes,
//           is timed apart (clear)
// A "backward" before each step writes every gradient on the compute stream (a memset) and
// calls grad_ready(), in reverse order; it is timed apart.
//
//   bench_cuda_step [--params 1Gi] [--tensor-elems 16Mi] [--stages 1,2,3] [--steps 5]
//                   [--bucket-elems 0 (automatic)] [--csv]
// Exits 0 with a message when no GPU is present.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cli.hpp"
#include "cuda_bench.hpp"
#include "shardopt/cuda_comm.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/planner.hpp"
#include "support/forwarding_comm.hpp"  // tests/support

using namespace shardopt;

namespace {

struct Args {
  std::size_t params = std::size_t{1} << 30;
  std::size_t tensor_elems = std::size_t{16} << 20;
  std::size_t bucket_elems = 0;
  int steps = 5;
  std::vector<Stage> stages{Stage::Zero1, Stage::Zero2, Stage::Zero3};
  bool csv = false;
};

/// An event on the compute stream, recorded again at every mark(): elapsed() is from the
/// previous mark's last recording.
class Mark {
 public:
  Mark() { SHARDOPT_CUDA_CHECK(cudaEventCreate(&event_)); }
  ~Mark() { cudaEventDestroy(event_); }
  Mark(const Mark&) = delete;
  Mark& operator=(const Mark&) = delete;
  void record(cudaStream_t s) {
    SHARDOPT_CUDA_CHECK(cudaEventRecord(event_, s));
    recorded_ = true;
  }
  bool recorded() const { return recorded_; }
  void reset() { recorded_ = false; }
  cudaEvent_t event() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
  bool recorded_ = false;
};

double elapsed_ms(const Mark& from, const Mark& to) {
  float ms = 0;
  SHARDOPT_CUDA_CHECK(cudaEventElapsedTime(&ms, from.event(), to.event()));
  return ms;
}

/// The step's phase boundaries, in device time.
struct Marks {
  Mark start, reduced, normed, end;
  bool in_step = false;
  bool gathering = false;  ///< an all-gather has started in this step (the norm is over)
};

class TimedRequest final : public CommRequest {
 public:
  TimedRequest(std::unique_ptr<CommRequest> inner, Marks& marks, cudaStream_t stream)
      : inner_(std::move(inner)), marks_(marks), stream_(stream) {}
  bool test() override { return inner_->test(); }
  void wait() override {
    inner_->wait();
    if (marks_.in_step) marks_.reduced.record(stream_);
  }

 private:
  std::unique_ptr<CommRequest> inner_;
  Marks& marks_;
  cudaStream_t stream_;
};

/// The device communicator, recording the phase marks on its stream during step().
class TimedComm final : public test::ForwardingComm {
 public:
  TimedComm(std::shared_ptr<Communicator> inner, Marks& marks)
      : ForwardingComm(inner), marks_(marks),
        stream_(static_cast<cudaStream_t>(inner->device_stream())) {}
  std::unique_ptr<CommRequest> start_reduce_scatter_sum(float* buf, std::size_t count,
                                                        CommType wire) override {
    return std::make_unique<TimedRequest>(ForwardingComm::start_reduce_scatter_sum(buf, count, wire),
                                          marks_, stream_);
  }
  std::unique_ptr<CommRequest> start_all_gather(void* buf, std::size_t count,
                                                CommType type) override {
    if (marks_.in_step) marks_.gathering = true;
    return ForwardingComm::start_all_gather(buf, count, type);
  }
  void all_reduce_sum_host(double* buf, std::size_t count) override {
    if (marks_.in_step && !marks_.gathering) marks_.normed.record(stream_);
    ForwardingComm::all_reduce_sum_host(buf, count);
  }

 private:
  Marks& marks_;
  cudaStream_t stream_;
};

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

struct Result {
  std::size_t buckets = 0;
  double backward_ms = 0, host_ms = 0, step_ms = 0, reduce_ms = 0, norm_ms = 0, update_ms = 0;
};

OptimizerOptions options_for(const Args& a, Stage stage) {
  OptimizerOptions o;
  o.device = Device::Cuda;
  o.stage = stage;
  o.param_dtype = DType::BF16;
  o.bucket_elems = a.bucket_elems;
  return o;
}

/// Means over a.steps timed steps, after one warm-up step.
Result run_stage(const Args& a, Stage stage, std::size_t params) {
  Marks marks;
  auto comm = std::make_shared<TimedComm>(make_cuda_single_process_communicator(), marks);
  const auto stream = static_cast<cudaStream_t>(comm->device_stream());
  ShardedOptimizer opt(comm, options_for(a, stage));
  for (std::size_t begin = 0, t = 0; begin < params; begin += a.tensor_elems, ++t) {
    if (stage == Stage::Zero3 && t > 0) opt.begin_unit();
    opt.add_param("t" + std::to_string(t), std::min(a.tensor_elems, params - begin));
  }
  opt.finalize();
  Result r;
  r.buckets = opt.layout().num_buckets();
  Mark backward_start;
  for (int step = 0; step <= a.steps; ++step) {
    backward_start.record(stream);
    for (std::size_t i = opt.layout().num_params(); i-- > 0;) {
      const std::span<float> g = opt.grad(i);
      SHARDOPT_CUDA_CHECK(cudaMemsetAsync(g.data(), 0x3c, g.size_bytes(), stream));  // ~0.0115
      opt.grad_ready(i);
    }
    for (Mark* m : {&marks.reduced, &marks.normed}) m->reset();
    marks.gathering = false;
    marks.start.record(stream);
    marks.in_step = true;
    const auto t0 = std::chrono::steady_clock::now();
    opt.step();
    const double host = seconds_since(t0);
    marks.in_step = false;
    marks.end.record(stream);
    SHARDOPT_CUDA_CHECK(cudaEventSynchronize(marks.end.event()));
    // Each phase ends at its mark; a phase without one in this step took no time.
    const double total = elapsed_ms(marks.start, marks.end);
    auto until = [&](const Mark& m, double previous) {
      return m.recorded() ? std::max(previous, elapsed_ms(marks.start, m)) : previous;
    };
    const double to_reduced = until(marks.reduced, 0.0);
    const double to_normed = until(marks.normed, to_reduced);
    SHARDOPT_CUDA_CHECK(cudaDeviceSynchronize());
    if (step == 0) continue;  // warm-up
    const double w = 1.0 / a.steps;
    r.backward_ms += w * elapsed_ms(backward_start, marks.start);
    r.host_ms += w * host * 1e3;
    r.step_ms += w * total;
    r.reduce_ms += w * to_reduced;
    r.norm_ms += w * (to_normed - to_reduced);
    r.update_ms += w * (total - to_normed);
  }
  return r;
}

/// The model that fits: a.params, or the largest whole number of tensors that fits in 90% of
/// the free device memory at every stage asked for (the planner's bytes); `why` says so.
std::size_t fitting_params(const Args& a, std::string& why) {
  std::size_t free = 0, total = 0;
  SHARDOPT_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  const auto budget = static_cast<std::size_t>(0.9 * static_cast<double>(free));
  std::size_t params = a.params;
  for (Stage stage : a.stages) {
    const PlanConfig cfg = plan_config(options_for(a, stage), 1);
    FlatLayout layout = uniform_layout(params, a.tensor_elems);
    if (stage == Stage::Zero3) layout = unit_per_tensor(layout);
    const std::size_t need = std::max(plan_memory(layout, cfg).total(),
                                      static_cast<std::size_t>(bench::kAdamBf16BytesPerElem * params));
    if (need <= budget) continue;
    const std::size_t fits = largest_fitting_psi(budget, cfg, a.tensor_elems);
    params = std::max(a.tensor_elems, fits / a.tensor_elems * a.tensor_elems);
    why = "reduced from " + std::to_string(a.params) + ": " + stage_name(stage) + " needs " +
          std::to_string(need) + " bytes, 90% of the free device memory is " + std::to_string(budget);
  }
  return params;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"The optimizer step on one GPU, per stage, with its phases from device events, "
               "against the fused AdamW kernel alone. Exits 0 with a message when no GPU is "
               "present."};
  cli::init(app, "bench_cuda_step");
  Args a;
  app.add_option("--params", a.params, "parameters")->transform(cli::size())
      ->check(CLI::PositiveNumber)->default_str("1Gi");
  app.add_option("--tensor-elems", a.tensor_elems, "elements per tensor")->transform(cli::size())
      ->check(CLI::PositiveNumber)->default_str("16Mi");
  app.add_option("--bucket-elems", a.bucket_elems, "bucket size in elements (0: automatic)")
      ->transform(cli::size())->default_str("0");
  app.add_option("--steps", a.steps, "timed steps per stage (after one warm-up step)")
      ->check(CLI::Range(1, 1 << 20))->capture_default_str();
  app.add_option("--stages", a.stages, "stages, comma separated: dp (or 0), 1, 2, 3")
      ->delimiter(',')
      ->transform(cli::choice<Stage>({{"dp", Stage::DataParallel}, {"0", Stage::DataParallel},
                                      {"1", Stage::Zero1}, {"2", Stage::Zero2}, {"3", Stage::Zero3}}))
      ->default_str("1,2,3");
  app.add_flag("--csv", a.csv, "print CSV rows instead of a table");
  if (const int rc = cli::parse(app, argc, argv); rc >= 0) return rc;
  if (!bench::gpu_present("bench_cuda_step")) return 0;
  try {
    std::string why;
    const std::size_t params = fitting_params(a, why);
    if (!why.empty()) std::printf("# model %s\n", why.c_str());
    std::vector<std::pair<Stage, Result>> results;
    for (Stage stage : a.stages) results.emplace_back(stage, run_stage(a, stage, params));
    // The floor: the fused kernel alone on as many elements, and the clearing of as many
    // gradient bytes (a memset), on buffers of their own.
    double kernel_ms = 0, clear_ms = 0;
    {
      const bench::FusedAdam alone(params);
      kernel_ms = bench::time_ms(a.steps, [&] { alone.run(dev::AdamKernel::Thrust); });
      clear_ms = bench::time_ms(a.steps, [&] {
        SHARDOPT_CUDA_CHECK(cudaMemsetAsync(alone.grad(), 0, params * sizeof(float), nullptr));
      });
    }
    if (a.csv) {
      std::printf("stage,params,tensor_elems,buckets,step_ms,reduce_ms,norm_ms,update_ms,"
                  "host_step_ms,backward_ms,kernel_ms,clear_ms,step_over_kernel\n");
    } else {
      std::printf("%zu parameters in tensors of %zu, bf16 replica, %d timed steps; alone: fused "
                  "kernel %.3f ms, clearing the gradients %.3f ms\n",
                  params, a.tensor_elems, a.steps, kernel_ms, clear_ms);
      std::printf("%-6s %8s %9s %9s %9s %9s %9s %10s %8s\n", "stage", "buckets", "step ms",
                  "reduce", "norm", "update", "host ms", "backward", "/kernel");
    }
    for (const auto& [stage, r] : results) {
      if (a.csv) {
        std::printf("%s,%zu,%zu,%zu,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f\n",
                    stage_name(stage), params, a.tensor_elems, r.buckets, r.step_ms, r.reduce_ms,
                    r.norm_ms, r.update_ms, r.host_ms, r.backward_ms, kernel_ms, clear_ms,
                    r.step_ms / kernel_ms);
      } else {
        std::printf("%-6s %8zu %9.3f %9.3f %9.3f %9.3f %9.3f %10.3f %8.3f\n", stage_name(stage),
                    r.buckets, r.step_ms, r.reduce_ms, r.norm_ms, r.update_ms, r.host_ms,
                    r.backward_ms, r.step_ms / kernel_ms);
      }
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "bench_cuda_step: %s\n", e.what());
    return 1;
  }
  return 0;
}
