// bench_cuda_adam.cpp: bandwidth of the fused AdamW update on one GPU, as a fraction of a
// device-to-device cudaMemcpy measured in the same run (goal: >= 0.90), for the Thrust
// kernel (what the backend runs) and its hand-written grid-stride twin; the norm tree too.
// Usage: bench_cuda_adam [elements = 2^26] [repetitions = 20]. Exits 0 with a message when
// no GPU is present.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include "cli.hpp"
#include "cuda_check.hpp"
#include "cuda_ops.hpp"
#include "sum_squares.hpp"

using namespace shardopt;

namespace {

/// Milliseconds per call of `body`, timed with events over `reps` calls after one warm-up.
double time_ms(int reps, const std::function<void()>& body) {
  cudaEvent_t start, stop;
  SHARDOPT_CUDA_CHECK(cudaEventCreate(&start));
  SHARDOPT_CUDA_CHECK(cudaEventCreate(&stop));
  body();
  SHARDOPT_CUDA_CHECK(cudaEventRecord(start));
  for (int i = 0; i < reps; ++i) body();
  SHARDOPT_CUDA_CHECK(cudaEventRecord(stop));
  SHARDOPT_CUDA_CHECK(cudaEventSynchronize(stop));
  float ms = 0;
  SHARDOPT_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms / reps;
}

void* device_zeros(std::size_t bytes) {
  void* p = nullptr;
  SHARDOPT_CUDA_CHECK(cudaMalloc(&p, bytes));
  SHARDOPT_CUDA_CHECK(cudaMemset(p, 0, bytes));
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Bandwidth of the fused AdamW update on one GPU against a device-to-device "
               "cudaMemcpy (Thrust and grid-stride kernels, and the norm tree). Exits 0 with a "
               "message when no GPU is present."};
  cli::init(app, "bench_cuda_adam");
  std::size_t n = std::size_t{1} << 26;
  int reps = 20;
  app.add_option("ELEMENTS", n, "parameters")->transform(cli::size())->check(CLI::PositiveNumber)
      ->default_str("64Mi");
  app.add_option("REPETITIONS", reps, "timed calls per kernel")->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  if (const int rc = cli::parse(app, argc, argv); rc >= 0) return rc;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("bench_cuda_adam: no CUDA device present; nothing to measure.\n");
    return 0;
  }
  try {
    cudaDeviceProp prop{};
    SHARDOPT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));

    auto* master = static_cast<float*>(device_zeros(n * 4));
    auto* grad = static_cast<float*>(device_zeros(n * 4));
    auto* m = static_cast<float*>(device_zeros(n * 4));
    auto* v = static_cast<float*>(device_zeros(n * 4));
    auto* out = static_cast<bf16*>(device_zeros(n * 2));
    auto* norm_scratch = static_cast<double*>(device_zeros(dev::norm_scratch_count(n) * 8));

    // Realistic values (not zeros): grad ~ U(-1, 1) through the cast kernels' inverse.
    std::vector<float> host(n);
    for (std::size_t i = 0; i < n; ++i) host[i] = static_cast<float>((i * 2654435761u) % 2001) / 1000.0f - 1.0f;
    SHARDOPT_CUDA_CHECK(cudaMemcpy(grad, host.data(), n * 4, cudaMemcpyHostToDevice));
    SHARDOPT_CUDA_CHECK(cudaMemcpy(master, host.data(), n * 4, cudaMemcpyHostToDevice));

    const StepHyper h{1e-3, 0.9, 0.999, 1e-8, 0.01, AdamMode::AdamW, 10};
    struct {
      StepScalars s;
      UpdateSegment seg;
    } block{make_step_scalars(h, 1.0), UpdateSegment{0, n, make_segment_scalars(h, 1.0, true)}};
    void* dblock = device_zeros(sizeof block);
    SHARDOPT_CUDA_CHECK(cudaMemcpy(dblock, &block, sizeof block, cudaMemcpyHostToDevice));

    dev::AdamChunkOp op;
    op.step = &static_cast<decltype(block)*>(dblock)->s;
    op.segments = &static_cast<decltype(block)*>(dblock)->seg;
    op.num_segments = 1;
    op.n = n;
    op.master = master;
    op.grad = grad;
    op.m = m;
    op.v = v;
    op.out_bf16 = out;
    op.vectorized = dev::adam_vector_aligned(master, grad, m, v, out, nullptr);

    // Baseline: copy n floats device to device (reads and writes 4n bytes each).
    const double copy_ms = time_ms(reps, [&] {
      SHARDOPT_CUDA_CHECK(cudaMemcpyAsync(m, grad, n * 4, cudaMemcpyDeviceToDevice));
    });
    SHARDOPT_CUDA_CHECK(cudaMemset(m, 0, n * 4));
    const double copy_gbs = 2.0 * 4.0 * n / copy_ms / 1e6;

    std::printf("device: %s (%d SMs), %zu elements, %d repetitions\n", prop.name,
                prop.multiProcessorCount, n, reps);
    std::printf("%-34s %10s %10s %12s\n", "kernel", "ms", "GB/s", "of memcpy");
    std::printf("%-34s %10.3f %10.1f %12.3f\n", "cudaMemcpy D2D (baseline)", copy_ms, copy_gbs, 1.0);
    // AdamW with bf16 replica: reads master, grad, m, v; writes master, m, v, bf16 copy.
    const double adam_bytes = (4.0 * 4 + 3.0 * 4 + 2.0) * n;
    for (auto [kernel, label] : {std::pair{dev::AdamKernel::Thrust, "fused AdamW, thrust::for_each"},
                                 std::pair{dev::AdamKernel::GridStride, "fused AdamW, grid-stride"}}) {
      const double ms = time_ms(reps, [&] { dev::adam_update(nullptr, kernel, op); });
      const double gbs = adam_bytes / ms / 1e6;
      std::printf("%-34s %10.3f %10.1f %12.3f\n", label, ms, gbs, gbs / copy_gbs);
    }
    const double norm_ms = time_ms(reps, [&] {
      dev::sum_squares_partials(nullptr, grad, n, norm_scratch);
    });
    const double norm_gbs = 4.0 * n / norm_ms / 1e6;
    std::printf("%-34s %10.3f %10.1f %12.3f\n", "sum of squares (fixed tree)", norm_ms, norm_gbs,
                norm_gbs / copy_gbs);
    for (void* p : {static_cast<void*>(master), static_cast<void*>(grad), static_cast<void*>(m),
                    static_cast<void*>(v), static_cast<void*>(out),
                    static_cast<void*>(norm_scratch), dblock})
      cudaFree(p);
  } catch (const Error& e) {
    std::fprintf(stderr, "bench_cuda_adam: %s\n", e.what());
    return 1;
  }
  return 0;
}
