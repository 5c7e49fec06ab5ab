// bench_cuda_adam.cpp: bandwidth of the fused AdamW update on one GPU, as a fraction of a
// device-to-device cudaMemcpy measured in the same run (goal: >= 0.90), for the Thrust
// kernel (what the backend runs) and its hand-written grid-stride twin; the norm tree and
// AdamW8bit's block kernel (on the same master and gradients, whole blocks of them) too.
// Usage: bench_cuda_adam [elements = 2^26] [repetitions = 20] [--csv]. Exits 0 with a message
// when no GPU is present.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <tuple>

#include "cli.hpp"
#include "cuda_bench.hpp"
#include "rules/qmap.hpp"
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

    // AdamW8bit over the whole blocks of n (bf16 replica), the maps uploaded from the host's.
    const std::size_t blocks = n / rules::q8::kBlock, n8 = blocks * rules::q8::kBlock;
    if (blocks > 0) {
      auto* maps = static_cast<rules::q8::Qmap*>(bench::device_zeros(2 * sizeof(rules::q8::Qmap)));
      SHARDOPT_CUDA_CHECK(cudaMemcpy(maps, &rules::q8::signed_map(), sizeof(rules::q8::Qmap),
                                     cudaMemcpyHostToDevice));
      SHARDOPT_CUDA_CHECK(cudaMemcpy(maps + 1, &rules::q8::unsigned_map(), sizeof(rules::q8::Qmap),
                                     cudaMemcpyHostToDevice));
      auto* codes = static_cast<std::uint8_t*>(bench::device_zeros(2 * n8));
      auto* scales = static_cast<float*>(bench::device_zeros(2 * blocks * 4));
      const StepHyper h{1e-3, 0.9, 0.999, 1e-8, 0.01, AdamMode::AdamW, 10};
      dev::AdamW8bitOp op;
      op.s = make_step_scalars(h, 1.0);
      op.g = make_segment_scalars(h, 1.0, true);
      op.qs = maps;
      op.qu = maps + 1;
      op.master = adam.master();
      op.grad = adam.grad();
      op.code_m = codes;
      op.code_v = codes + n8;
      op.scale_m = scales;
      op.scale_v = scales + blocks;
      op.out_bf16 = adam.out();
      const double ms = bench::time_ms(reps, [&] { dev::adamw8bit_update(nullptr, op, blocks); });
      row("adamw8bit", "AdamW8bit, a CUDA block per block", ms,
          bench::kAdamW8bitBf16BytesPerElem * n8 / ms / 1e6);
      for (void* p : {static_cast<void*>(maps), static_cast<void*>(codes), static_cast<void*>(scales)})
        cudaFree(p);
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "bench_cuda_adam: %s\n", e.what());
    return 1;
  }
  return 0;
}
