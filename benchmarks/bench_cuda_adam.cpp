// bench_cuda_adam.cpp: bandwidth of the fused AdamW update on one GPU, as a fraction of a
// device-to-device cudaMemcpy measured in the same run (goal: >= 0.90), for the Thrust
// kernel (what the backend runs) and its hand-written grid-stride twin; the norm tree too.
// Usage: bench_cuda_adam [elements = 2^26] [repetitions = 20] [--csv]. Exits 0 with a message
// when no GPU is present.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <tuple>

#include "cli.hpp"
#include "cuda_bench.hpp"
#include "sum_squares.hpp"

using namespace shardopt;

int main(int argc, char** argv) {
  CLI::App app{"Bandwidth of the fused AdamW update on one GPU against a device-to-device "
               "cudaMemcpy (Thrust and grid-stride kernels, and the norm tree). Exits 0 with a "
               "message when no GPU is present."};
  cli::init(app, "bench_cuda_adam");
  std::size_t n = std::size_t{1} << 26;
  int reps = 20;
  bool csv = false;
  app.add_option("ELEMENTS", n, "parameters")->transform(cli::size())->check(CLI::PositiveNumber)
      ->default_str("64Mi");
  app.add_option("REPETITIONS", reps, "timed calls per kernel")->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_flag("--csv", csv, "print CSV rows (row,elements,ms,gb_per_s,of_copy) instead of a table");
  if (const int rc = cli::parse(app, argc, argv); rc >= 0) return rc;
  if (!bench::gpu_present("bench_cuda_adam")) return 0;
  try {
    int sms = 0;
    SHARDOPT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    bench::FusedAdam adam(n);
    auto* norm_scratch = static_cast<double*>(bench::device_zeros(dev::norm_scratch_count(n) * 8));

    // Baseline: copy n floats device to device (reads and writes 4n bytes each).
    const double copy_ms = bench::time_ms(reps, [&] {
      SHARDOPT_CUDA_CHECK(cudaMemcpyAsync(adam.m(), adam.grad(), n * 4, cudaMemcpyDeviceToDevice, nullptr));
    });
    SHARDOPT_CUDA_CHECK(cudaMemset(adam.m(), 0, n * 4));
    const double copy_gbs = 2.0 * 4.0 * n / copy_ms / 1e6;

    auto row = [&](const char* key, const char* label, double ms, double gbs) {
      if (csv) {
        std::printf("%s,%zu,%.6f,%.3f,%.4f\n", key, n, ms, gbs, gbs / copy_gbs);
      } else {
        std::printf("%-34s %10.3f %10.1f %12.3f\n", label, ms, gbs, gbs / copy_gbs);
      }
    };
    if (csv) {
      std::printf("row,elements,ms,gb_per_s,of_copy\n");
    } else {
      std::printf("device 0: %d SMs, %zu elements, %d repetitions\n", sms, n, reps);
      std::printf("%-34s %10s %10s %12s\n", "kernel", "ms", "GB/s", "of memcpy");
    }
    row("copy", "cudaMemcpy D2D (baseline)", copy_ms, copy_gbs);
    for (auto [kernel, key, label] :
         {std::tuple{dev::AdamKernel::Thrust, "adamw_thrust", "fused AdamW, thrust::for_each"},
          std::tuple{dev::AdamKernel::GridStride, "adamw_grid_stride", "fused AdamW, grid-stride"}}) {
      const double ms = bench::time_ms(reps, [&] { adam.run(kernel); });
      row(key, label, ms, bench::kAdamBf16BytesPerElem * n / ms / 1e6);
    }
    const double norm_ms = bench::time_ms(reps, [&] {
      dev::sum_squares_partials(nullptr, adam.grad(), n, norm_scratch);
    });
    row("norm", "sum of squares (fixed tree)", norm_ms, 4.0 * n / norm_ms / 1e6);
    cudaFree(norm_scratch);
  } catch (const Error& e) {
    std::fprintf(stderr, "bench_cuda_adam: %s\n", e.what());
    return 1;
  }
  return 0;
}
